"""The CPU time of a sandboxed run's whole process tree, read by the parent from /proc: the launcher and every
descendant (`/proc/<pid>/task/<tid>/children`), each counted with the time of the children it has reaped
(utime + stime + cutime + cstime).

Inside a PID namespace nothing can leave the tree: an orphan is re-parented to the namespace's first process,
which is in it, and a zombie is counted until it is reaped into its reaper's cutime. (Without one, a process
whose parent exits goes to the machine's init and out of the count: docs/sandbox.md.)

A per-run cgroup would count the same, but moving a process into one waits for an RCU grace period in the
kernel, which costs a run more than the whole jail does.
"""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree(pid: int) -> list[int]:
    """`pid` and its descendants now (parents before children); [] when `pid` is gone."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:  # gone meanwhile
            continue
        found.append(current)
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(child) for child in f.read().split()]
            except OSError:
                continue
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds used by `pid`'s tree: the live processes and what they reaped."""
    ticks = 0
    for member in tree(pid):
        try:
            with open(f"/proc/{member}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime (fields 14-17 of proc(5))
    return ticks / _TICK


def available() -> bool:
    """Whether this kernel lists children in /proc (CONFIG_PROC_CHILDREN), which `tree` needs."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
