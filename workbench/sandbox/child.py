"""The first code a sandboxed child runs, before the program it was given: it joins its slot's cgroup (where
there is one), enters the jail (where the launch chain gives it one), loads the seccomp filter, lowers the
child's resource limits, installs the guards, then runs the program as `__main__`. ctypes (for mount and prctl)
leaves sys.modules before the program runs; its classes stay reachable, and every ctypes event is refused by
the guards.

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
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 38, 22, 2
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
"""The world-writable folders a program may expect; in the jail each is a private, empty, size-capped tmpfs."""
MAX_WRITES = 16
"""Files a run may open for writing (guards): with RLIMIT_FSIZE, a bound on what it leaves in its home where
there is no jail (a memory file system, shared with the trainer's /dev/shm users such as NCCL)."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def enter_jail(jail: dict, size_mb: int, inodes: int, libc) -> None:
    """As root, pid 1 of fresh mount, PID, network and IPC namespaces (unshare made them): build a root of empty
    tmpfs with the interpreter, its libraries and the devices bound read-only, private scratch folders and a /proc
    of this PID namespace, chroot into it, and become `jail['uid']` for good (all capabilities go with uid 0;
    no_new_privs; SIGKILL when the launcher dies, which the uid change had cleared).

    Every tmpfs has a size and an inode count (nr_inodes): tmpfs charges extended attributes to the inode count,
    so without one a run could pin kernel memory far past its size. The mounts go through libc (ctypes, loaded
    before the root changes): Python 3.11 has no os.mount, and one `mount` process per folder would cost more
    than the rest of the start-up."""
    import ctypes

    def mount(source, target: str, fstype, flags: int, data: str | None = None) -> None:
        if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                      ctypes.c_ulong(flags), data and data.encode()) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"sandbox jail: mounting {target}: {os.strerror(error)}")

    root, uid, safe = jail["root"], jail["uid"], _MS_NOSUID | _MS_NODEV
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", safe, "size=64k,nr_inodes=256,mode=755")
    for path in jail["binds"]:
        os.makedirs(root + path, exist_ok=True)
        mount(path, root + path, None, _MS_BIND | _MS_REC)
        mount(None, root + path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | safe)
    for path in jail["masks"]:  # the base interpreter's installed packages, inside a bound folder
        mount("tmpfs", root + path, "tmpfs", _MS_RDONLY | safe | _MS_NOEXEC, "size=4k,nr_inodes=1,mode=555")
    for link, target in jail["links"]:
        os.symlink(target, root + link)
    for path in (*SCRATCH, jail["home"]):
        os.makedirs(root + path, exist_ok=True)
        owner = f",mode=700,uid={uid},gid={uid}" if path == jail["home"] else ",mode=1777"
        mount("tmpfs", root + path, "tmpfs", safe, f"size={size_mb}m,nr_inodes={inodes}" + owner)
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
    if libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "sandbox jail: prctl failed")


def load_filter(bpf: bytes, libc) -> None:
    """no_new_privs, then the seccomp filter the parent built (syscalls.py: BPF, 8 bytes an instruction)."""
    import ctypes

    class Program(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(bpf, len(bpf))
    if (libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                          ctypes.byref(Program(len(bpf) // 8, ctypes.addressof(code))), 0, 0)):
        raise OSError(ctypes.get_errno(), "sandbox: loading the seccomp filter failed")


def join_cgroup(path: str) -> None:
    """Move this process (root still, before anything else starts) into its slot's cgroup (cgroup.py)."""
    with open(path + "/cgroup.procs", "w") as f:
        f.write("0")


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
    """An audit hook (PEP 578; it cannot be removed once added) refusing processes, signals, sockets, every ctypes
    event, `gc`, tracing and shared memory outright; creating, removing, renaming, truncating, linking or changing
    anything outside `home`; more than MAX_WRITES files opened for writing; and reads outside `home`, the
    standard library and a few devices.

    The hook's frame can be reached (a refused call's traceback holds it), and through it everything the hook
    reads. So it reads only what cannot be changed: frozen sets, tuples, strings, numbers, builtin functions and
    types (bound here, so rebinding a builtin or a module's name changes nothing), and a counter that only
    counts up. No Python function is in its closure (a function's code and its cells can be swapped): paths are
    resolved inline with the C functions of `posix`. It is still Python-level, which is why the jail and the
    seccomp filter, not this, are the boundary: docs/sandbox.md."""
    import itertools
    import posix

    denied_events = frozenset({
        # Processes: a fork bomb, or a shell with the network tools that `socket` blocking does not reach.
        "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
        # Signals: without a PID namespace, a child of the same user could kill the trainer (os.kill(-1, 9)).
        "os.kill", "os.killpg", "signal.pthread_kill",
        # The network, where no network namespace cuts it off, and name lookups (they leave through libc).
        "socket.__new__", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
        "socket.gethostbyaddr", "socket.getnameinfo",
        # Tracing and frames, with which a program rewrites code that runs after it. (Every "ctypes." event,
        # native code with which every rule here could be undone, is refused by its prefix.)
        "sys.settrace", "sys.setprofile",
    })
    # Matched on every dotted component: `pkg._posixshmem` is refused like `_posixshmem`.
    denied_imports = frozenset({"_posixsubprocess", "_ctypes", "ctypes", "gc", "_posixshmem",
                                "multiprocessing", "_multiprocessing"})
    # Events whose first argument is a path the program changes (a second one too: rename, link, symlink).
    changes = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.truncate", "os.link",
                         "os.symlink", "os.chmod", "os.chown", "os.utime", "os.setxattr", "os.removexattr",
                         "os.chflags", "os.lchflags"})
    two_paths = frozenset({"os.rename", "os.link", "os.symlink"})
    getcwd, lstat, readlink, fspath = posix.getcwd, posix.lstat, posix.readlink, posix.fspath
    decode, starts, split, rfind = bytes.decode, str.startswith, str.split, str.rfind
    is_a, refused, int_, bytes_, oserror, backwards, advance = (isinstance, PermissionError, int, bytes, OSError,
                                                               reversed, next)
    sep, dot, kind_mask, link_kind = "/", ".", 0o170000, 0o120000
    writes, max_writes = itertools.count(1), MAX_WRITES
    home_root = os.path.realpath(home)  # the fixed roots: resolved before any untrusted code runs
    readable = tuple(os.path.realpath(p) for p in sys.path if p) + (home_root,)
    devices, write_flags, write_modes = frozenset(DEVICES), _WRITE_FLAGS, frozenset("wax+")

    def guard(event: str, args: tuple) -> None:
        if event in denied_events or starts(event, "ctypes."):
            raise refused(f"sandbox: {event} is not allowed")
        if event == "import":
            for part in split(args[0], dot):
                if part in denied_imports:
                    raise refused(f"sandbox: importing {args[0]} is not allowed")
            return
        writing = False
        if event in changes:
            paths = args[:2] if event in two_paths else args[:1]
        elif event == "open":
            path, mode, flags = args
            if path is None or is_a(path, int_):  # a file descriptor the process already holds
                return
            paths, writing = (path,), (flags or 0) & write_flags != 0
            for c in mode or "":
                writing = writing or c in write_modes
        else:
            return
        for path in paths:
            if is_a(path, int_):
                raise refused(f"sandbox: {event} on a descriptor is not allowed")
            path = fspath(path)  # a PathLike's __fspath__ is the program's code: racy, like any check before use
            if is_a(path, bytes_):
                path = decode(path, "utf-8", "surrogateescape")
            if not starts(path, sep):
                path = getcwd() + sep + path
            # Every symlink followed, with posix functions only (at most 40, as the kernel).
            todo, done, hops = split(path, sep), "", 0
            todo.reverse()
            while todo:
                part = todo.pop()
                if part == "" or part == dot:
                    continue
                if part == "..":
                    done = done[:rfind(done, sep)]
                    continue
                here = done + sep + part
                try:
                    is_link = (lstat(here).st_mode & kind_mask) == link_kind
                except oserror:
                    is_link = False
                if is_link and hops < 40:
                    hops += 1
                    target = readlink(here)
                    if starts(target, sep):
                        done = ""
                    todo += backwards(split(target, sep))
                    continue
                done = here
            where = done or sep
            at_home = where == home_root or starts(where, home_root + sep)
            if event != "open" or writing:
                if not at_home:
                    raise refused(f"sandbox: {event} of {where} is not allowed (only under {home_root})")
                if writing and advance(writes) > max_writes:
                    raise refused(f"sandbox: more than {max_writes} files opened for writing")
                continue
            if at_home or where in devices:
                continue
            for root in readable:
                if where == root or starts(where, root + sep):
                    break
            else:
                raise refused(f"sandbox: reading {where} is not allowed")

    sys.addaudithook(guard)


def main() -> None:
    settings, program = marshal.loads(bytes.fromhex(sys.argv[1])), sys.argv[2]
    if settings["cgroup"]:
        join_cgroup(settings["cgroup"])
    if settings["jail"] or settings["seccomp"]:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if settings["jail"]:
            enter_jail(settings["jail"], settings["file_mb"], settings["inodes"], libc)
        if settings["seccomp"]:
            load_filter(settings["seccomp"], libc)
        elif libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "sandbox: prctl(no_new_privs) failed")
        del ctypes, libc  # nothing of them left in this frame, under the program's
        for name in [m for m in sys.modules if m == "_ctypes" or m.split(".")[0] == "ctypes"]:
            del sys.modules[name]
    set_limits(settings)
    if settings["guards"]:
        install_guards(settings["home"])
    sys.argv = ["-c"]
    exec(compile(program, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102


if __name__ == "__main__":
    main()
