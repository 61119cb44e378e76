"""How a sandboxed child is started, and what isolates it. The launch chain is chosen once per process, strongest
first, by starting a probe child with each candidate (`CANDIDATES`) until one works:

- namespaces (`unshare`): net (no network: only a loopback that is down, not this machine's) and pid (the
  parent is invisible, `kill -1` reaches only the sandbox, and everything in it dies with the child). A root
  parent creates them directly; any other needs a user namespace around them (`--user`);
- as root, drop to the unprivileged user nobody (`setpriv`): root ignores RLIMIT_NPROC and may read every file.
  Where the interpreter lies under a folder nobody cannot enter (a pyenv build under /root), a mount namespace
  binds the interpreter's prefix read-only at a folder of the run first ('bind');
- the child itself: `python -I -S` (isolated: no site, no PYTHON* variables, no user or current folder on
  sys.path) running `child.py`, which sets the rlimits and the guards.

Whatever does not work on a machine (no `unshare`, namespaces refused, not root) is left out, and `Isolation`
says what was active. Python 3.12's `os.unshare` would spare the binary; this is 3.11.
"""

from __future__ import annotations

import functools
import json
import marshal
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
"""The uid and gid a root parent's children run as (Debian's nobody/nogroup)."""
PATH = "/usr/bin:/bin"
SPACES = ("user", "mnt", "net", "pid")
_FLAGS = {"user": ["--user"], "mnt": ["--mount"], "net": ["--net"], "pid": ["--pid", "--fork", "--kill-child"]}
_BIND_SCRIPT = 'mount --bind -o ro -- "$1" "$2" && shift 2 && unset PWD && exec "$@"'  # sh exports PWD
_PROBE = ("import json, os\n"
          "print(json.dumps({n: os.readlink(f'/proc/self/ns/{n}') for n in ('user', 'mnt', 'net', 'pid')}))\n")


@dataclass(frozen=True)
class Isolation:
    """What isolates a sandboxed child on this machine (`probe` measures it)."""

    drop: str
    """How a root parent's child becomes nobody: 'bind' (in a mount namespace, with the interpreter bound where
    nobody can reach it), 'direct', or '' (it keeps the parent's user: not root, or dropping did not work)."""
    namespaces: tuple[str, ...]
    """The namespaces the child runs in, of user, mnt, net and pid. With 'user', an unprivileged user creates
    them (a parent that is not root, or nobody after the drop); without, root does, before the drop."""
    uid: int
    """The real uid the child runs as outside any namespace (RLIMIT_NPROC counts this user's processes)."""
    guards: bool
    """Whether child.py's audit hook is installed (sockets, processes, signals, ctypes, file access)."""

    def __post_init__(self):
        if self.drop == "bind" and ("mnt" not in self.namespaces or "user" in self.namespaces):
            raise ValueError("Isolation: 'bind' mounts in a mount namespace that root creates: its namespaces "
                             "must hold 'mnt' and not 'user' (else the mount would land in this machine's own)")

    @property
    def network(self) -> str:
        """What stops network access: the kernel (a network namespace), else the Python guard only."""
        return "net namespace" if "net" in self.namespaces else ("python guard" if self.guards else "nothing")

    def describe(self) -> str:
        who = {"bind": "nobody (setpriv; interpreter bound in a mount namespace)", "direct": "nobody (setpriv)"}
        return (f"uid {self.uid} = {who.get(self.drop, 'the parent user')}; "
                f"namespaces: {', '.join(self.namespaces) or 'none'}; network blocked by: {self.network}; "
                f"guards: {'on' if self.guards else 'off'}; always: rlimits, own session, scrubbed env, temp home")


CANDIDATES = (("bind", ("mnt", "net", "pid")), ("direct", ("net", "pid")), ("direct", ("user", "net", "pid")),
              ("direct", ()), ("", ("net", "pid")), ("", ("user", "net", "pid")), ("", ()))
"""(drop, namespaces) launch chains, strongest first; `probe` skips those this parent cannot use."""


def interpreter() -> tuple[Path, Path]:
    """(the real interpreter binary, its installation prefix): a venv's python is a link to the base one, and
    the child needs only the standard library."""
    binary = Path(os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable))
    return binary, Path(os.path.realpath(sys.base_prefix))


def command(isolation: Isolation, run_dir: Path, settings: dict, program: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) starting `child.py` with `settings` on `program` under `isolation`."""
    binary, prefix = interpreter()
    env = {"PATH": PATH, "HOME": settings["home"], "LANG": "C.UTF-8"}
    spaces = isolation.namespaces
    by_root = () if "user" in spaces else spaces  # created before the drop, by root
    argv: list[str] = []
    if by_root:
        argv += [_tool("unshare"), *(f for n in by_root for f in _FLAGS[n]), "--"]
    if isolation.drop == "bind":
        mount_point = run_dir / "python"
        mount_point.mkdir(exist_ok=True)
        argv += ["/bin/sh", "-c", _BIND_SCRIPT, "sandbox", str(prefix), str(mount_point)]
        binary = mount_point / binary.relative_to(prefix)
        env["LD_LIBRARY_PATH"] = str(mount_point / "lib")  # its RUNPATH names the unreachable original
    if isolation.drop:
        argv += [_tool("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs"]
        # Changing uid clears unshare's --kill-child; restored, the child dies with unshare even if it left the
        # process group (os.setsid), and with it the PID namespace.
        argv += ["--pdeathsig", "KILL", "--"] if "pid" in by_root else ["--"]
    if "user" in spaces:
        argv += [_tool("unshare"), *(f for n in spaces for f in _FLAGS[n]), "--"]
    argv += [str(binary), "-I", "-S", "-c", _child_source(), marshal.dumps(settings).hex(), program]
    return argv, env


def prepare(run_dir: Path, isolation: Isolation) -> Path:
    """The child's home (also its working folder) in `run_dir`, reachable by the child's user only."""
    home = run_dir / "home"
    home.mkdir(mode=0o700)
    if isolation.drop:
        os.chmod(run_dir, 0o711)  # nobody passes through to home/ and python/, and lists nothing
        os.chown(home, NOBODY, NOBODY)
    return home


SHM_FREE_BYTES = 1 << 30
"""/dev/shm holds the run folders only with this much free (Docker's default of 64 MiB is NCCL's to use)."""


def temp_root() -> str | None:
    """Where run folders go: /dev/shm (a memory file system: making and removing a folder on this project's
    ext4 /tmp took ~5 ms a run) where it has room, else the system's temporary folder."""
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
        usable = ((not drop or (root and _has("setpriv"))) and (drop != "bind" or binary.is_relative_to(prefix))
                  and (not spaces or (_has("unshare") and (root or "user" in spaces))))
        if not usable:
            continue
        trial = Isolation(drop, spaces, NOBODY if drop else os.getuid(), guards)
        seen = _run_probe(trial)
        if seen is not None and all(seen[n] != own[n] for n in spaces):
            return trial
    raise RuntimeError(f"sandbox: not even a plain `{binary} -I -S` child started; check that the interpreter runs")


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
        home = prepare(run_dir, trial)
        settings = {"home": str(home), "cpu_s": 5, "memory_mb": 1024, "file_mb": 1, "nproc": 1 << 20,
                    "open_files": 64, "guards": trial.guards}
        argv, env = command(trial, run_dir, settings, _PROBE)
        try:
            done = subprocess.run(argv, check=False, cwd=home, env=env, capture_output=True, timeout=10)
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
