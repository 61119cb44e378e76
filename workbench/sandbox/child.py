"""The first code a sandboxed child runs, before the program it was given: it lowers the child's resource limits,
installs the guards, then runs the program as `__main__`.

The parent sends this file's text with `python -I -S -c`, so it runs in a bare interpreter (no site, no
workbench) and imports only the standard library. argv[1] is its settings (a dict, `marshal`led and in hex:
marshal is built in, json would cost a third of the start-up), argv[2] the program.

The limits are set here rather than in `subprocess`'s `preexec_fn`, which CPython documents as unsafe in a
process with threads (the reward pool drives its children from threads). rlimits are inherited by everything
this process starts, and their hard limits equal the soft ones (CPU: one second more), so none can be raised.
"""

import marshal
import os
import resource
import sys

DENIED_EVENTS = frozenset({
    # Processes: a fork bomb, or a shell with the network tools that `socket` blocking does not reach.
    "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
    # Signals: without a PID namespace, a child of the same user could kill the trainer (os.kill(-1, 9)).
    "os.kill", "os.killpg", "signal.pthread_kill",
    # The network, where no network namespace cuts it off, and name lookups (they leave through libc).
    "socket.__new__", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
    "socket.gethostbyaddr", "socket.getnameinfo",
    # Native code, with which every rule here could be undone.
    "ctypes.dlopen", "ctypes.dlsym",
})
"""Audit events refused outright (they are raised before the action, so refusing one prevents it)."""

DENIED_IMPORTS = frozenset({"_posixsubprocess", "_ctypes", "ctypes"})
"""Modules whose functions reach the actions above without raising the events."""

DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"})
MAX_WRITES = 16
"""Files a run may open for writing: with RLIMIT_FSIZE, a bound on what it leaves in its home (a memory file
system, shared with the trainer's /dev/shm users such as NCCL)."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def set_limits(settings: dict) -> None:
    """CPU seconds (SIGXCPU at the soft limit, SIGKILL a second later), address space, file size, processes
    (and threads) of this real user, open files, and no core files."""
    mb = 1 << 20
    wanted = {
        resource.RLIMIT_CPU: (settings["cpu_s"], settings["cpu_s"] + 1),
        resource.RLIMIT_AS: (settings["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (settings["file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (settings["nproc"],) * 2,
        resource.RLIMIT_NOFILE: (settings["open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for kind, (soft, hard) in wanted.items():
        _, current = resource.getrlimit(kind)
        if current != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(kind, (soft, hard))


def install_guards(home: str) -> None:
    """An audit hook (PEP 578; it cannot be removed once added) refusing DENIED_EVENTS and DENIED_IMPORTS,
    writes outside `home` (and past MAX_WRITES files), and reads outside `home`, the interpreter's standard
    library and a few devices.

    It binds the functions it uses now, so rebinding `os.path.realpath` later changes nothing; it is still
    Python-level, so code written to defeat it (patching what realpath calls, say) can: docs/sandbox.md."""
    realpath, fsdecode = os.path.realpath, os.fsdecode
    home = realpath(home)
    readable = tuple(realpath(p) for p in sys.path if p) + (home,)
    writes = [0]

    def inside(path: str, roots: tuple) -> bool:
        return any(path == root or path.startswith(root + os.sep) for root in roots)

    def guard(event: str, args: tuple) -> None:
        if event in DENIED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in DENIED_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):  # a file descriptor the process already holds
                return
            where = realpath(fsdecode(path))
            writing = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            if writing and not inside(where, (home,)):
                raise PermissionError(f"sandbox: writing {where} is not allowed (only under {home})")
            writes[0] += writing
            if writes[0] > MAX_WRITES:
                raise PermissionError(f"sandbox: more than {MAX_WRITES} files opened for writing")
            if not writing and not (where in DEVICES or inside(where, readable)):
                raise PermissionError(f"sandbox: reading {where} is not allowed")

    sys.addaudithook(guard)


def main() -> None:
    settings, program = marshal.loads(bytes.fromhex(sys.argv[1])), sys.argv[2]
    set_limits(settings)
    if settings["guards"]:
        install_guards(settings["home"])
    sys.argv = ["-c"]
    exec(compile(program, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102


if __name__ == "__main__":
    main()
