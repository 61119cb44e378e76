"""`Sandbox.run`: one program in a fresh child process under limits, with a wall-clock deadline, a CPU budget for
its whole process tree (cputime.py), an empty temporary home and working folder (removed after),
a scrubbed environment and capped output, and optionally a result channel and pipes to another run.

What isolates the child beyond that (another user, namespaces, the guards) is chosen by `launch.probe`;
docs/sandbox.md is the threat model.
"""

from __future__ import annotations

import heapq
import math
import os
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cgroup, cputime, launch, syscalls

_CHUNK = 1 << 16
_CPU_POLL_S = 0.05
"""How often the parent reads a run's CPU time while it runs: the budget may be overrun by about this much per
core."""
_EXIT_GRACE_S = 0.5
"""After the child exits, how long its output may still take to drain (its whole group has been killed)."""
MAX_PROGRAM_BYTES = 100_000
"""A program travels as one argv string (the kernel caps one at 128 KiB); larger inputs go through stdin."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    timeout_s: float = 5.0
    """Wall-clock seconds; past them the child's whole process group is killed."""
    cpu_s: int = 5
    """CPU seconds of the run's whole process tree (counted by the parent in /proc, cputime.py; past them it is
    killed), and of each process (RLIMIT_CPU: SIGXCPU then, SIGKILL one second later)."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS), in MiB: a larger allocation raises MemoryError."""
    file_mb: int = 16
    """The largest file the child may write (RLIMIT_FSIZE), in MiB; writing past it kills it (SIGXFSZ). In the
    jail also the size of each of its private tmpfs folders (home, /tmp, /var/tmp, /dev/shm)."""
    inodes: int = 1024
    """Files, folders, links and nodes in each private tmpfs folder of the jail (its nr_inodes). tmpfs charges
    extended attributes to the same count (1 KiB an inode), so this also bounds what they hold."""
    processes: int = 64
    """Processes and threads a run may have (RLIMIT_NPROC of its slot's own uid; where the chain keeps the
    parent's user, beyond the processes that user had when the sandbox was made); pids.max of its cgroup."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_bytes: int = 1 << 20
    """stdout and stderr are each read up to this many bytes; past it the child is killed (no more is held)."""

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Limits.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class RunResult:
    returncode: int | None
    """The launch chain's exit status (negative: killed by that signal)."""
    stdout: bytes
    stderr: bytes
    timed_out: bool
    """The wall-clock deadline passed and the child was killed."""
    output_capped: bool
    """stdout, stderr or the channel passed Limits.output_bytes and the child was killed."""
    cpu_exceeded: bool = False
    """The process tree used more than Limits.cpu_s of CPU (cputime.py) and was killed."""
    channel: bytes = b""
    """What the child wrote to its result channel (`run(..., channel=True)`)."""
    seconds: float = field(default=0.0, compare=False)


class _Slots:
    """Slot numbers of the runs in flight in this process, lowest free first (every Sandbox draws from one set,
    so no two runs at once share a uid)."""

    def __init__(self):
        self._lock, self._free, self._made = threading.Lock(), [], 0

    def take(self) -> int:
        with self._lock:
            if self._free:
                return heapq.heappop(self._free)
            self._made += 1
            return self._made - 1

    def give(self, slot: int) -> None:
        with self._lock:
            heapq.heappush(self._free, slot)


_SLOTS = _Slots()


class Sandbox:
    """Runs untrusted Python programs, one child process each. Thread-safe: a pool of threads may share one.

    Making one probes once per process how children can be isolated here (`isolation`; `launch.probe`), refuses
    a chain short of the jail unless it is accepted by name (`launch.accept`), and sets up the slots' cgroups
    where the host allows (cgroup.py). Each run takes a free slot: a uid of its own where the chain drops to
    another user, and a cgroup of its own in the jail.
    """

    def __init__(self, limits: Limits | None = None, guards: bool = True, isolation: launch.Isolation | None = None):
        """`isolation`: None for the strongest that works here (refused short of the jail, unless accepted); a
        weaker one to test the fallbacks (passing one accepts it)."""
        self.limits = limits or Limits()
        if isolation is None:
            isolation = launch.probe(guards)
            launch.accept(isolation)
        self.isolation = isolation
        limits = self.limits
        self._groups = (cgroup.setup(limits.memory_mb, 4 * limits.file_mb, limits.processes)
                        if isolation.drop == "jail" else None)
        self._nproc = limits.processes + (0 if isolation.drop else launch.tasks_of(isolation.uid))
        self._count_cpu = cputime.available()

    def run(self, program: str, stdin: bytes = b"", channel: bool = False, fds: tuple[int, ...] = ()) -> RunResult:
        """Run `program` (Python source, as __main__) with `stdin` as its input, and collect what it wrote.

        channel: give the child a pipe back to the parent, whose descriptor number is prepended to `stdin` as
        ASCII digits and a newline (the child reads that line first); what it writes there comes back in
        `RunResult.channel`. fds: descriptors handed to the child under the same numbers (pipes to another
        run); this call closes them in the parent once the child holds them."""
        if len(program.encode()) > MAX_PROGRAM_BYTES:
            raise ValueError(f"sandbox: the program is {len(program.encode())} bytes, over {MAX_PROGRAM_BYTES}; "
                             "pass large inputs through stdin")
        limits = self.limits
        reader, writer = os.pipe() if channel else (None, None)
        if channel:
            stdin = b"%d\n" % writer + stdin
        passed = (*fds, writer) if channel else tuple(fds)
        slot = _SLOTS.take()
        uid = launch.slot_uid(slot) if self.isolation.drop else self.isolation.uid
        try:
            with tempfile.TemporaryDirectory(prefix="workbench-sandbox-", dir=launch.temp_root(),
                                             ignore_cleanup_errors=True) as tmp:
                run_dir = Path(tmp)
                home = launch.prepare(run_dir, self.isolation, uid)
                settings = {"home": str(home), "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                            "file_mb": limits.file_mb, "inodes": limits.inodes, "nproc": self._nproc,
                            "open_files": limits.open_files, "guards": self.isolation.guards,
                            "seccomp": syscalls.bpf() if self.isolation.seccomp else None,
                            "cgroup": self._groups.path(slot) if self._groups else None}
                argv, env = launch.command(self.isolation, run_dir, settings, program, uid)
                start = time.monotonic()
                with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      cwd=run_dir if self.isolation.drop == "jail" else home, env=env,
                                      start_new_session=True, pass_fds=passed) as proc:
                    for fd in passed:
                        os.close(fd)
                    passed = ()
                    try:
                        out, err, back, timed_out, capped, cpu = _communicate(
                            proc, stdin, reader, start + limits.timeout_s, limits.output_bytes,
                            limits.cpu_s if self._count_cpu else None)
                    finally:
                        _kill_tree(proc)
                        _kill_group(proc)  # before wait(): the group id is not reused while its leader is unreaped
                        proc.wait()
                return RunResult(proc.returncode, out, err, timed_out, capped, cpu, back, time.monotonic() - start)
        finally:
            _SLOTS.give(slot)
            for fd in (*passed, reader):
                if fd is not None:
                    os.close(fd)


def _communicate(proc: subprocess.Popen, data: bytes, channel: int | None, deadline: float, cap: int,
                 cpu_s: float | None) -> tuple[bytes, bytes, bytes, bool, bool, bool]:
    """Feed stdin and read stdout, stderr (and the channel) until they close, the deadline passes, one passes
    `cap` bytes or the process tree's CPU time passes `cpu_s` (None: not counted). Returns (stdout, stderr,
    channel, timed_out, capped, cpu_exceeded)."""
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    outputs = {out_fd: bytearray(), err_fd: bytearray()}
    if channel is not None:
        outputs[channel] = bytearray()
    pending = memoryview(data)

    def collected(timed_out: bool = False, capped: bool = False, cpu: bool = False):
        return (bytes(outputs[out_fd]), bytes(outputs[err_fd]), bytes(outputs.get(channel, b"")), timed_out, capped,
                cpu)

    with selectors.DefaultSelector() as sel:
        for fd in outputs:
            sel.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        exit_fd = _exit_fd(proc.pid)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)
        exited = False
        try:
            while any(fd in sel.get_map() for fd in outputs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return collected(timed_out=not exited)
                if cpu_s is not None and not exited and cputime.cpu_seconds(proc.pid) > cpu_s:
                    _kill_tree(proc)
                    return collected(cpu=True)
                if exit_fd is None and not exited and _has_exited(proc.pid):
                    exited, deadline = True, min(deadline, time.monotonic() + _EXIT_GRACE_S)
                    _kill_group(proc)
                wait = remaining if exit_fd is not None or exited else min(remaining, 0.02)
                for key, _ in sel.select(min(wait, _CPU_POLL_S) if cpu_s is not None else wait):
                    fd = key.fd
                    if fd == exit_fd:  # the child is gone: stray descendants holding the pipes go with its group
                        sel.unregister(fd)
                        exited, deadline = True, min(deadline, time.monotonic() + _EXIT_GRACE_S)
                        _kill_group(proc)
                    elif fd == in_fd:
                        try:
                            pending = pending[os.write(fd, pending[:_CHUNK]):]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                    else:
                        chunk = os.read(fd, _CHUNK)
                        if not chunk:
                            sel.unregister(fd)
                            continue
                        buf = outputs[fd]
                        buf += chunk
                        if len(buf) > cap:
                            del buf[cap:]
                            return collected(capped=True)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
    return collected()


def _exit_fd(pid: int) -> int | None:
    """A pidfd (Linux 5.3+), readable once `pid` exits; None where there is none (then the loop polls)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pid: int) -> bool:
    """Without reaping it (WNOWAIT), so its process group id stays reserved for _kill_group."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of the tree, leaves first (inside a PID namespace, killing its first process
    would do; without one, this reaches descendants that left the process group)."""
    for pid in reversed(cputime.tree(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty already
        pass
