"""A cgroup (v2) per sandboxed run: the CPU time of the run's whole process tree, and a kill that reaches every
process in it, whatever it did to its process group or session.

cgroup v2's `cpu.stat` counts CPU time whether or not the cpu controller is enabled, so this needs only a
writable cgroup2 mount (root, or a delegated subtree). The child joins its cgroup itself, before it runs any of
the program (child.py, `enter_jail`), so no process of the run starts outside it.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from pathlib import Path

_NAMES = itertools.count()
_REMOVE_WAIT_S = 2.0
"""After the kill, how long removing the cgroup may wait for its processes to be gone."""


@functools.cache
def parent() -> Path | None:
    """This process's own cgroup v2 folder, when it may create cgroups in it; else None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            folder = Path(fields[1]) / own.lstrip("/")
            if os.access(folder, os.W_OK) and (folder / "cpu.stat").exists():
                return folder
    return None


class RunGroup:
    """The cgroup of one run: made by `__init__` under `parent()`, removed by `close`."""

    def __init__(self, root: Path):
        self.path = root / f"workbench-sandbox-{os.getpid()}-{next(_NAMES)}"
        self.path.mkdir()

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every process that ran in the group, ended ones included."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        return 0.0

    def kill(self) -> None:
        """SIGKILL to every process in the group (cgroup.kill, Linux 5.14+; else one by one, repeated until
        none is left, so a process forked meanwhile is caught)."""
        try:
            (self.path / "cgroup.kill").write_text("1")
            return
        except FileNotFoundError:
            pass
        for _ in range(100):
            pids = (self.path / "cgroup.procs").read_text().split()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        """Kill what is left and remove the group (it can go once its processes have exited)."""
        self.kill()
        deadline = time.monotonic() + _REMOVE_WAIT_S
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
