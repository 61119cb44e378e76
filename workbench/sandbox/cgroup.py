"""A cgroup v2 for each sandbox slot, where the host allows one: `memory.max` counts what no rlimit does (tmpfs
pages, memfd, pipe buffers and the kernel memory the run makes the kernel allocate), so a run that fills it is
killed by the OOM killer inside its own group, not the trainer; `pids.max` bounds its processes and threads.

Made beside the trainer's own cgroup (read from /proc/self/cgroup, on the cgroup2 mount of /proc/self/mountinfo):
`workbench-sandbox-<pid>-<limits>/slot-<n>`. The child joins its slot's group itself, first thing, while it is still root
(child.py), so everything it starts is inside. Where that cannot be done (no cgroup2 with the memory and pids
controllers, not root, the trainer's group holding processes so it cannot hand controllers down), `setup`
says why in one line and the runs go without one.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import warnings
from pathlib import Path

_WANTED = {"memory", "pids"}
_SLACK_MB = 64
"""Memory a run's group may hold beyond its address space and tmpfs folders: page tables, pipe buffers, slab."""


def _mount() -> Path | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if "cgroup2" in fields[fields.index("-") + 1:fields.index("-") + 2]:
                return Path(fields[4])
    return None


def _own(mount: Path) -> Path:
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return mount / line[3:].strip().lstrip("/")
    raise OSError("no cgroup v2 entry in /proc/self/cgroup")


class SlotGroups:
    """The per-slot groups under one parent group of this process (made on first use of a slot)."""

    def __init__(self, root: Path, memory_bytes: int, pids: int):
        self.root, self.memory_bytes, self.pids = root, memory_bytes, pids
        self._made: set[int] = set()
        self._lock = threading.Lock()

    def path(self, slot: int) -> str:
        group = self.root / f"slot-{slot}"
        with self._lock:
            if slot not in self._made:
                group.mkdir(exist_ok=True)
                (group / "memory.max").write_text(str(self.memory_bytes))
                (group / "memory.swap.max").exists() and (group / "memory.swap.max").write_text("0")
                (group / "pids.max").write_text(str(self.pids))
                self._made.add(slot)
        return str(group)


@functools.cache
def _parent() -> Path | None:
    """Where the slot groups go: beside the trainer's own cgroup (its parent already hands memory and pids down,
    and a group holding processes cannot), or under it where it is the root of the mount (then it must hold no
    process, or be the machine's root); None with one line saying why not (once per process)."""
    try:
        if os.geteuid() != 0:
            raise OSError("the trainer is not root")
        mount = _mount()
        if mount is None:
            raise OSError("no cgroup2 file system is mounted")
        own = _own(mount)
        missing = _WANTED - set((own / "cgroup.controllers").read_text().split())
        if missing:
            raise OSError(f"the controllers {', '.join(sorted(missing))} are not delegated to {own}")
        if own != mount:  # a sibling: the parent hands memory and pids down already, as own lists them
            return own.parent
        if _WANTED - set((own / "cgroup.subtree_control").read_text().split()):
            (own / "cgroup.subtree_control").write_text("+memory +pids")  # EBUSY where own holds processes
    except OSError as e:
        warnings.warn(f"sandbox: no memory cgroup ({e.strerror or e}): a run's tmpfs pages, pipes and kernel memory "
                      "are bounded only by the tmpfs size and inode caps, RLIMIT_AS and the seccomp filter (no "
                      "memfd); run the trainer where cgroup v2 delegates memory and pids (docs/sandbox.md)",
                      stacklevel=3)
        return None
    return own


@functools.cache
def setup(memory_mb: int, tmpfs_mb: int, processes: int) -> SlotGroups | None:
    """The slot groups for these limits, or None where the host allows none (`_parent` says why, once)."""
    parent = _parent()
    if parent is None:
        return None
    root = parent / f"workbench-sandbox-{os.getpid()}-{memory_mb}-{tmpfs_mb}-{processes}"
    try:
        root.mkdir(exist_ok=True)
        (root / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError as e:
        warnings.warn(f"sandbox: no memory cgroup ({e}); see docs/sandbox.md", stacklevel=2)
        return None
    atexit.register(_remove, root)
    return SlotGroups(root, (memory_mb + tmpfs_mb + _SLACK_MB) << 20, processes)


def _remove(root: Path) -> None:
    """The slot groups and their parent, once empty (a group with a process left in it stays)."""
    for group in [*root.glob("slot-*"), root]:
        try:
            group.rmdir()
        except OSError:
            pass
