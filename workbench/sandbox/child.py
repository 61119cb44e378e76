"""The first code a sandboxed child runs, before the program it was given: it enters the jail (where the launch
chain gives it one), lowers the child's resource limits, installs the guards, then runs the program as
`__main__`.

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

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
"""The world-writable folders a program may expect; in the jail each is a private, empty, size-capped tmpfs."""
MAX_WRITES = 16
"""Files a run may open for writing (guards): with RLIMIT_FSIZE, a bound on what it leaves in its home where
there is no jail (a memory file system, shared with the trainer's /dev/shm users such as NCCL)."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def enter_jail(jail: dict, size_mb: int) -> None:
    """As root, pid 1 of fresh mount, PID, network and IPC namespaces (unshare made them): build a root of empty
    tmpfs with the interpreter, its libraries and the devices bound read-only, private scratch folders and a /proc
    of this PID namespace, chroot into it, and become `jail['uid']` for good (all capabilities go with uid 0;
    no_new_privs; SIGKILL when the launcher dies, which the uid change had cleared).

    The mounts go through libc (ctypes, loaded before the root changes): Python 3.11 has no os.mount, and one
    `mount` process per folder would cost more than the rest of the start-up. ctypes leaves sys.modules after."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target: str, fstype, flags: int, data: str | None = None) -> None:
        if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                      ctypes.c_ulong(flags), data and data.encode()) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"sandbox jail: mounting {target}: {os.strerror(error)}")

    root, uid, safe = jail["root"], jail["uid"], _MS_NOSUID | _MS_NODEV
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", safe, "size=64k,mode=755")
    for path in jail["binds"]:
        os.makedirs(root + path, exist_ok=True)
        mount(path, root + path, None, _MS_BIND | _MS_REC)
        mount(None, root + path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | safe)
    for path in jail["masks"]:  # the base interpreter's installed packages, inside a bound folder
        mount("tmpfs", root + path, "tmpfs", _MS_RDONLY | safe | _MS_NOEXEC, "size=4k,mode=555")
    for link, target in jail["links"]:
        os.symlink(target, root + link)
    for path in (*SCRATCH, jail["home"]):
        os.makedirs(root + path, exist_ok=True)
        owner = f",mode=700,uid={uid},gid={uid}" if path == jail["home"] else ",mode=1777"
        mount("tmpfs", root + path, "tmpfs", safe, f"size={size_mb}m" + owner)
    for device in DEVICES:
        open(root + device, "w").close()
        mount(device, root + device, None, _MS_BIND)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", safe | _MS_NOEXEC)
    mount(None, root, None, _MS_REMOUNT | _MS_RDONLY | safe)
    os.chroot(root)
    os.chdir(jail["home"])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "sandbox jail: prctl failed")
    for name in [m for m in sys.modules if m == "_ctypes" or m.split(".")[0] == "ctypes"]:
        del sys.modules[name]


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
    """An audit hook (PEP 578; it cannot be removed once added) refusing processes, signals, sockets, native code,
    `gc`, tracing and shared memory outright; creating, removing, renaming, truncating, linking or changing
    anything outside `home`; more than MAX_WRITES files opened for writing; and reads outside `home`, the
    standard library and a few devices.

    Everything it reads lives in this closure: frozen sets, tuples, and the C functions of `posix` (a path is
    resolved with them, not with os.path, whose helpers a program could rebind). Rebinding anything in a module
    (this one is `__main__`) changes nothing; reaching the closure's cells needs `gc`, which it refuses.
    Builtins it calls are bound here too. It is still Python-level, which is why the jail (launch.py), not this,
    is the boundary: docs/sandbox.md."""
    import posix

    denied_events = frozenset({
        # Processes: a fork bomb, or a shell with the network tools that `socket` blocking does not reach.
        "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
        # Signals: without a PID namespace, a child of the same user could kill the trainer (os.kill(-1, 9)).
        "os.kill", "os.killpg", "signal.pthread_kill",
        # The network, where no network namespace cuts it off, and name lookups (they leave through libc).
        "socket.__new__", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
        "socket.gethostbyaddr", "socket.getnameinfo",
        # Native code, with which every rule here could be undone; tracing and frames, with which a program
        # rewrites code that runs after it.
        "ctypes.dlopen", "ctypes.dlsym", "sys.settrace", "sys.setprofile",
    })
    denied_imports = frozenset({"_posixsubprocess", "_ctypes", "ctypes", "gc", "_posixshmem",
                                "multiprocessing", "_multiprocessing"})
    # Events whose first argument is a path the program changes (a second one too: rename, link, symlink).
    changes = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.truncate", "os.link",
                         "os.symlink", "os.chmod", "os.chown", "os.utime", "os.setxattr", "os.removexattr",
                         "os.chflags", "os.lchflags"})
    two_paths = frozenset({"os.rename", "os.link", "os.symlink"})
    getcwd, lstat, readlink, fspath = posix.getcwd, posix.lstat, posix.readlink, posix.fspath
    decode = bytes.decode
    starts, split, rfind = str.startswith, str.split, str.rfind
    # Builtins too: a program may rebind `builtins.isinstance`, which an unbound name here would look up.
    is_a, refused, tuple_, int_, bytes_, oserror = isinstance, PermissionError, tuple, int, bytes, OSError
    sep, kind_mask, link_kind = "/", 0o170000, 0o120000
    writes, max_writes = [0], MAX_WRITES

    def resolve(path, depth: int = 0) -> str:
        """The absolute path with every symlink followed (posix functions only)."""
        path = fspath(path)  # a PathLike's __fspath__ is the program's code: racy, like any check before use
        if is_a(path, bytes_):
            path = decode(path, "utf-8", "surrogateescape")
        if not starts(path, sep):
            path = getcwd() + sep + path
        done = ""
        for part in split(path, sep):
            if part in ("", "."):
                continue
            if part == "..":
                done = done[:rfind(done, sep)]
                continue
            here = done + sep + part
            try:
                is_link = (lstat(here).st_mode & kind_mask) == link_kind
            except oserror:
                is_link = False
            if is_link and depth < 40:
                target = readlink(here)
                here = resolve(target if starts(target, sep) else done + sep + target, depth + 1)
            done = here
        return done or sep

    home_root = resolve(home)
    readable = tuple_(resolve(p) for p in sys.path if p) + (home_root,)
    devices, write_flags, write_modes = frozenset(DEVICES), _WRITE_FLAGS, frozenset("wax+")

    def inside(path: str, roots: tuple) -> bool:
        for root in roots:
            if path == root or starts(path, root + sep):
                return True
        return False

    def guard(event: str, args: tuple) -> None:
        if event in denied_events:
            raise refused(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in denied_imports:
            raise refused(f"sandbox: importing {args[0]} is not allowed")
        if event in changes:
            for path in args[:2 if event in two_paths else 1]:
                if is_a(path, int_) or not inside(resolve(path), (home_root,)):
                    raise refused(f"sandbox: {event} outside {home_root} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or is_a(path, int_):  # a file descriptor the process already holds
                return
            where = resolve(path)
            writing = (flags or 0) & write_flags != 0
            for c in mode or "":
                writing = writing or c in write_modes
            if writing and not inside(where, (home_root,)):
                raise refused(f"sandbox: writing {where} is not allowed (only under {home_root})")
            writes[0] += writing
            if writes[0] > max_writes:
                raise refused(f"sandbox: more than {max_writes} files opened for writing")
            if not writing and not (where in devices or inside(where, readable)):
                raise refused(f"sandbox: reading {where} is not allowed")

    sys.addaudithook(guard)


def main() -> None:
    settings, program = marshal.loads(bytes.fromhex(sys.argv[1])), sys.argv[2]
    if settings["jail"]:
        enter_jail(settings["jail"], settings["file_mb"])
    set_limits(settings)
    if settings["guards"]:
        install_guards(settings["home"])
    sys.argv = ["-c"]
    exec(compile(program, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102


if __name__ == "__main__":
    main()
