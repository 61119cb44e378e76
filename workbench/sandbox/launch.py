"""How a sandboxed child is started, and what isolates it. The launch chain is chosen once per process, strongest
first, by starting a probe child with each candidate (`CANDIDATES`) until one works:

- 'jail' (a root parent with CAP_SYS_ADMIN): `unshare` makes mount, PID, network and IPC namespaces, and the
  child (child.py, `enter_jail`) builds its own root from empty tmpfs: the interpreter's installation and the
  system's shared libraries bound read-only (the base interpreter's site-packages hidden), private empty
  /tmp, /var/tmp, /dev/shm and home (each with a size and an inode cap), four devices, and a /proc of its own
  PID namespace; then it chroots there and becomes its slot's uid for good (`slot_uid`). Nothing of the trainer (its files, the installed packages and their data, its
  processes, /proc entries, path-named sockets) exists in that view, nor another run's; the mounts vanish with
  the namespace;
- namespaces without the jail (`unshare`): net (no network: only a loopback that is down, not this machine's)
  and pid (the parent is invisible, `kill -1` reaches only the sandbox, everything in it dies with the child).
  A root parent creates them directly; any other needs a user namespace around them (`--user`);
- as root, drop to the slot's unprivileged uid (`setpriv`): root ignores RLIMIT_NPROC and may read every file;
- the child itself: `python -I -S` (isolated: no site, no PYTHON* variables, no user or current folder on
  sys.path) running `child.py`, which loads the seccomp filter (syscalls.py) and sets the rlimits and the guards.

Whatever does not work on a machine (no `unshare`, namespaces refused, not root) is left out, and `Isolation`
says what was active; anything short of the jail refuses untrusted code unless accepted by name (`accept`). Python
3.12's `os.unshare` would spare the binary; this is 3.11.
"""

from __future__ import annotations

import functools
import json
import marshal
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import cputime, syscalls

SLOT_UID_BASE = 1_000_000
SLOTS_PER_PROCESS = 512
"""A root parent's child runs as uid and gid `slot_uid(slot)`: one per slot of this process (Sandbox.run: no two
runs at once share a slot) and per process (the pid picks a block of SLOTS_PER_PROCESS), so RLIMIT_NPROC,
keyrings and file ownership are per run, not shared by all runs as with nobody. No user of the machine has
these ids; a container that maps only 65,536 ids has no jail (the probe falls back)."""
ACCEPT_ENV = "WORKBENCH_SANDBOX_ACCEPT"
"""Naming a launch chain that cannot isolate (`Isolation.name`) here lets it run untrusted code anyway."""
PATH = "/usr/bin:/bin"
JAIL_HOME = "/home"
"""The child's home and working folder inside the jail."""
SPACES = ("user", "mnt", "net", "pid", "ipc")
_FLAGS = {"user": ["--user"], "mnt": ["--mount"], "net": ["--net"], "ipc": ["--ipc"],
          "pid": ["--pid", "--fork", "--kill-child"]}
_PROBE = ("import json, os\n"
          "print(json.dumps({n: os.readlink(f'/proc/self/ns/{n}') for n in ('user', 'mnt', 'net', 'pid', 'ipc')}))\n")


@dataclass(frozen=True)
class Isolation:
    """What isolates a sandboxed child on this machine (`probe` measures it)."""

    drop: str
    """How a root parent's child becomes its slot's uid: 'jail' (in its own root file system, child.py `enter_jail`),
    'direct' (setpriv), or '' (it keeps the parent's user: not root, or dropping did not work)."""
    namespaces: tuple[str, ...]
    """The namespaces the child runs in, of user, mnt, net and pid. With 'user', an unprivileged user creates
    them (a parent that is not root, or the slot's uid after the drop); without, root does, before the drop."""
    uid: int
    """The real uid the child runs as outside any namespace; where `drop` is set, that of the probe (each run has
    its own: `slot_uid`, so RLIMIT_NPROC counts its own processes only)."""
    guards: bool
    """Whether child.py's audit hook is installed (sockets, processes, signals, ctypes, file access)."""
    seccomp: bool = False
    """Whether the child loads the seccomp filter (syscalls.py) before running anything untrusted."""

    def __post_init__(self):
        if self.drop == "jail" and ({"mnt", "pid"} - set(self.namespaces) or "user" in self.namespaces):
            raise ValueError("Isolation: 'jail' mounts in mount and PID namespaces that root creates: its "
                             "namespaces must hold 'mnt' and 'pid' and not 'user'")

    @property
    def network(self) -> str:
        """What stops network access: the kernel (a network namespace), else the Python guard only."""
        return "net namespace" if "net" in self.namespaces else ("python guard" if self.guards else "nothing")

    @property
    def name(self) -> str:
        """The chain in a word or two, as ACCEPT_ENV takes it: 'jail', 'setpriv+net+pid', 'userns+net+pid', 'plain'."""
        if self.drop == "jail":
            return "jail"
        spaces = [n for n in self.namespaces if n != "user"]
        head = "setpriv" if self.drop else ("userns" if "user" in self.namespaces else "plain")
        return "+".join([head if head != "plain" or not spaces else "ns", *spaces])

    def describe(self) -> str:
        who = {"jail": "one per run (slot_uid), chrooted into a private root of the interpreter only",
               "direct": "one per run (slot_uid, setpriv)"}
        cpu = ("the whole process tree" if "pid" in self.namespaces and cputime.available()
               else "each process" if not cputime.available() else "the process tree, less what leaves it")
        return (f"uid {who.get(self.drop, f'{self.uid} (the parent user)')}; "
                f"namespaces: {', '.join(self.namespaces) or 'none'}; network blocked by: {self.network}; "
                f"CPU limited for: {cpu}; guards: {'on' if self.guards else 'off'}; "
                f"seccomp: {'on' if self.seccomp else 'off'}; "
                "always: rlimits, own session, scrubbed env, temp home")


def slot_uid(slot: int) -> int:
    """The uid (and gid) of a run in `slot` of this process: at most 2**22 pids x 512 slots above 1,000,000, under
    uid_t's 2**32 - 1."""
    if not 0 <= slot < SLOTS_PER_PROCESS:
        raise RuntimeError(f"sandbox: more than {SLOTS_PER_PROCESS} runs at once in one process; use fewer workers")
    return SLOT_UID_BASE + (os.getpid() % (1 << 22)) * SLOTS_PER_PROCESS + slot


CANDIDATES = (("jail", ("mnt", "net", "pid", "ipc")), ("direct", ("net", "pid")),
              ("direct", ("user", "net", "pid")), ("direct", ()), ("", ("net", "pid")), ("", ("user", "net", "pid")),
              ("", ()))
"""(drop, namespaces) launch chains, strongest first; `probe` skips those this parent cannot use."""


def interpreter() -> tuple[Path, Path]:
    """(the real interpreter binary, its installation prefix): a venv's python is a link to the base one, and
    the child needs only the standard library."""
    binary = Path(os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable))
    return binary, Path(os.path.realpath(sys.base_prefix))


def command(isolation: Isolation, run_dir: Path, settings: dict, program: str,
            uid: int) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) starting `child.py` with `settings` on `program` under `isolation`, as `uid` where the
    chain drops to another user (the jail's settings are added here: `prepare` made its folders)."""
    binary, _ = interpreter()
    settings = dict(settings, jail=None)
    spaces = isolation.namespaces
    by_root = () if "user" in spaces else spaces  # created before the drop, by root
    argv: list[str] = []
    if by_root:
        argv += [_tool("unshare"), *(f for n in by_root for f in _FLAGS[n]), "--"]
    if isolation.drop == "jail":
        settings["jail"] = dict(jail_view(), root=str(run_dir / "root"), uid=uid, home=JAIL_HOME)
    elif isolation.drop:
        argv += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
        # Changing uid clears unshare's --kill-child; restored, the child dies with unshare even if it left the
        # process group (os.setsid), and with it the PID namespace.
        argv += ["--pdeathsig", "KILL", "--"] if "pid" in by_root else ["--"]
    if "user" in spaces:
        argv += [_tool("unshare"), *(f for n in spaces for f in _FLAGS[n]), "--"]
    env = {"PATH": PATH, "HOME": settings["home"], "LANG": "C.UTF-8"}
    argv += [str(binary), "-I", "-S", "-c", _child_source(), marshal.dumps(settings).hex(), program]
    return argv, env


@functools.cache
def jail_view() -> dict:
    """What the jail shows of this machine: the interpreter's installation and the folders of the shared
    libraries it loads (bound read-only at the same paths, so the interpreter's own paths stay valid), with
    its site-packages hidden; and the links (/lib -> usr/lib) through which the loader finds them."""
    _, prefix = interpreter()
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    libs = [os.path.realpath(p) for p in (f"/lib/{arch}", f"/usr/lib/{arch}", "/lib64", "/usr/lib64")
            if arch or "64" in p]
    binds = list(dict.fromkeys([str(prefix), *(p for p in libs if os.path.isdir(p))]))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    installed = {*site.getsitepackages(), site.getusersitepackages(), *(f"{root}/lib/{version}/{kind}-packages"
                 for root in (prefix, "/usr", "/usr/local") for kind in ("site", "dist")), "/usr/lib/python3"}
    masks = sorted(p for p in map(os.path.realpath, installed)
                   if os.path.isdir(p) and any(Path(p).is_relative_to(b) for b in binds))
    links = [(p, os.readlink(p)) for p in ("/lib", "/lib64", "/bin", "/sbin") if os.path.islink(p)]
    return {"binds": binds, "masks": masks, "links": links}


def prepare(run_dir: Path, isolation: Isolation, uid: int) -> Path:
    """The child's home (also its working folder) in `run_dir`, reachable by the child's user only; in the jail,
    the empty folder its root is mounted on (its home is then JAIL_HOME, a tmpfs inside)."""
    if isolation.drop == "jail":
        (run_dir / "root").mkdir()
        return Path(JAIL_HOME)
    home = run_dir / "home"
    home.mkdir(mode=0o700)
    if isolation.drop:
        os.chmod(run_dir, 0o711)  # the child's user passes through to home/ and lists nothing
        os.chown(home, uid, uid)
    return home


SHM_FREE_BYTES = 1 << 30
"""/dev/shm holds the run folders only with this much free (Docker's default of 64 MiB is NCCL's to use)."""


def temp_root() -> str | None:
    """Where run folders go: /dev/shm (a memory file system: making and removing a folder there costs far less than
    on a disk's /tmp, a share of every run's start; BENCHMARKS.md, "Numbers behind the code") where it has room,
    else the system's temporary folder."""
    try:
        room = os.statvfs("/dev/shm")
    except OSError:
        return None
    roomy = room.f_bavail * room.f_frsize >= SHM_FREE_BYTES
    return "/dev/shm" if roomy and os.access("/dev/shm", os.W_OK | os.X_OK) else None


@functools.cache
def probe(guards: bool) -> Isolation:
    """The strongest launch chain that starts a child here (a few ms a try, once per process)."""
    own = {n: os.readlink(f"/proc/self/ns/{n}") for n in SPACES}
    root = os.geteuid() == 0
    binary, prefix = interpreter()
    for drop, spaces in CANDIDATES:
        usable = ((not drop or (root and (drop == "jail" or _has("setpriv"))))
                  and (drop != "jail" or binary.is_relative_to(prefix))
                  and (not spaces or (_has("unshare") and (root or "user" in spaces))))
        if not usable:
            continue
        trial = Isolation(drop, spaces, slot_uid(0) if drop else os.getuid(), guards, syscalls.bpf() is not None)
        seen = _run_probe(trial)
        if seen is not None and all(seen[n] != own[n] for n in spaces):
            return trial
    raise RuntimeError(f"sandbox: not even a plain `{binary} -I -S` child started; check that the interpreter runs")


def weaker_than_jail(isolation: Isolation) -> str:
    """What a launch chain without the jail leaves open (one line), and how to get the jail."""
    return (f"no private file-system view ({isolation.describe()}): sandboxed code can read every file its user "
            "can read (the trainer's files, the installed problem data, so a wrong solution can copy the "
            "canonical answer), change what its user may change, reach path-named unix sockets and the shared "
            "scratch folders, and see every process in /proc; the Python guards are then the only wall, and "
            "they are not one. The jail needs a root parent with CAP_SYS_ADMIN (in a container: "
            "docs/sandbox.md)")


def accept(isolation: Isolation) -> None:
    """Refuse a chain that cannot isolate (anything but the jail) unless ACCEPT_ENV names it; where it does, say in
    one line what is then unprotected."""
    if isolation.drop == "jail":
        return
    if isolation.name not in os.environ.get(ACCEPT_ENV, "").split(","):
        raise RuntimeError(f"sandbox: refusing to run untrusted code on the launch chain '{isolation.name}', the "
                           f"strongest here: {weaker_than_jail(isolation)}. To run it anyway, set "
                           f"{ACCEPT_ENV}={isolation.name}")
    warnings.warn(f"sandbox: running untrusted code on '{isolation.name}' as {ACCEPT_ENV} asks: "
                  f"{weaker_than_jail(isolation)}", stacklevel=3)


def tasks_of(uid: int) -> int:
    """Processes and threads of real user `uid` now (what RLIMIT_NPROC counts), read from /proc."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _run_probe(trial: Isolation) -> dict | None:
    with tempfile.TemporaryDirectory(prefix="workbench-sandbox-probe-", dir=temp_root()) as tmp:
        run_dir = Path(tmp)
        home = prepare(run_dir, trial, trial.uid)
        settings = {"home": str(home), "cpu_s": 5, "memory_mb": 1024, "file_mb": 1, "inodes": 64, "nproc": 1 << 20,
                    "open_files": 64, "guards": trial.guards, "seccomp": syscalls.bpf() if trial.seccomp else None,
                    "cgroup": None}
        argv, env = command(trial, run_dir, settings, _PROBE, trial.uid)
        try:
            done = subprocess.run(argv, check=False, cwd=run_dir, env=env, capture_output=True, timeout=10)
            return json.loads(done.stdout) if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None


def _has(tool: str) -> bool:
    return shutil.which(tool, path=PATH) is not None


def _tool(tool: str) -> str:
    return shutil.which(tool, path=PATH) or tool


@functools.cache
def _child_source() -> str:
    return Path(__file__).with_name("child.py").read_text()
