"""One folder, one run: what every command that writes a run (train, on-off, sweep, train-policy, warm-start,
nightly) does with its folder before the first byte, and how it stops.

- `claim`: the folder is made (one line if it cannot be), locked for as long as the command writes into it, and
  refused in one line when another process holds it, when it already holds a run (unless the run is resumed), or
  when its config.yaml is not one a run wrote (the user's own file, which the run's resolved settings would
  overwrite).
- `deferred_interrupt`: a first Ctrl-C lets the current step finish, so the loop can checkpoint at the step
  boundary before it stops; a second one stops at once.

The lock is `fcntl.flock` on a file in the folder, so a crash releases it with the process; the file holds the
holder's pid, host and start time, for the message a second process gets. A lock file left with a holder's record
(the holder was killed) is taken over with a one-line notice. On a file system without flock the record alone
decides: a holder on this host whose pid is alive keeps the folder.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .files import make_folder

LOCK = ".workbench.lock"
"""The lock file in a folder in use; removed when the holder ends normally."""
RUN_FILES = ("config.yaml", "metrics.csv", "checkpoints", "checkpoint", ".checkpoint-old", "policy", "tensorboard")
"""What a training run writes into its folder: any of them means the folder holds a run."""
_RUN_FOLDERS = {"checkpoints", "checkpoint", ".checkpoint-old", "policy", "tensorboard"}
"""Those of RUN_FILES a run writes as folders: a file of such a name is not a run's (and its save will say so)."""
POLICY_FILES = ("config.json", "model.safetensors")
"""What a saved policy (train-policy, warm-start) is."""
_RESOLVED = re.compile(r"# \w+: the resolved settings of this run")
"""The first line `workbench.config.write_config` gives a run's config.yaml."""

_held: dict[Path, int] = {}
"""The folders this process holds, with how many claims are open on each (a command may claim a folder that a
function it calls claims again: on-off's run and then its report)."""


@dataclass(frozen=True)
class Claim:
    folder: Path
    """The folder, made and locked."""
    created: bool
    """Whether this claim made it (a run that fails before writing anything may remove it again)."""


def _holder(text: str) -> dict:
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict) -> str:
    if not record:
        return "another process"
    return (f"{record.get('command', 'a process')} (pid {record.get('pid')} on {record.get('host')}, "
            f"since {record.get('started')})")


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return isinstance(pid, int)   # another user's live process, or a record without a pid
    return True


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace")


def _lock(folder: Path, command: str, option: str) -> int:
    """The locked lock file's descriptor, its record ours; a one-line ValueError when another process holds it."""
    path = folder / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"cannot lock {folder}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock = True
        except BlockingIOError:
            record = _holder(_read(fd))
            os.close(fd)
            raise ValueError(f"{folder} is in use by {_describe(record)}: wait for it to end, or give another "
                             f"{option}") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            flock = False   # no flock here: the record decides (below)
        # A holder that released the file between our open and our lock removed it: lock the new one instead.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    record = _holder(_read(fd))
    if record:
        here = record.get("host") == socket.gethostname()
        if not flock and here and _alive(record.get("pid")) and record.get("pid") != os.getpid():
            os.close(fd)
            raise ValueError(f"{folder} is in use by {_describe(record)}: wait for it to end, or give another "
                             f"{option}")
        print(f"note: {folder}: taking over the lock left by {_describe(record)}, which ended without releasing it",
              file=sys.stderr, flush=True)
    mine = {"command": command, "pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(mine).encode())
    return fd


def _unlock(folder: Path, fd: int) -> None:
    # Removed while still locked: a process that opened it meanwhile sees another file once it gets the lock, and
    # retries on the next one (`_lock`).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / LOCK)
    os.close(fd)


def _check(folder: Path, holds: tuple[str, ...], resume: bool, resumable: Callable[[], bool] | None,
           config: bool, what: str, option: str) -> None:
    if config and (folder / "config.yaml").is_file():
        with open(folder / "config.yaml", "rb") as f:
            first = f.readline().decode("utf-8", "replace").strip()
        if not _RESOLVED.fullmatch(first):
            raise ValueError(f"{folder / 'config.yaml'} is not a config a run wrote, and the run writes its resolved "
                             f"settings there: keep your file outside {folder} (e.g. {folder}.yaml, then --config "
                             f"{folder}.yaml), or give another {option}")
    found = [name for name in holds if ((folder / name).is_dir() if name in _RUN_FOLDERS else (folder / name).exists())]
    if not resume:
        if found:
            resumed = " continue it with resume=True (--resume), or" if resumable is not None else ""
            raise ValueError(f"{folder} already holds {what} ({found[0]}):{resumed} give another {option} "
                             "(or delete that folder)")
        return
    if resumable is not None and not resumable():
        if found:
            raise ValueError(f"resume: {folder} holds {what} that wrote no checkpoint yet ({found[0]}), so there is "
                             f"nothing to resume from: delete that folder to start over, or give another {option}")
        raise FileNotFoundError(f"resume: no checkpoint in {folder}, which holds no run to resume; run without "
                                "resume first")


@contextlib.contextmanager
def claim(out_dir: str | os.PathLike, command: str, *, option: str = "--out-dir", holds: tuple[str, ...] = (),
          what: str = "a run", resume: bool = False, resumable: Callable[[], bool] | None = None,
          config: bool = True) -> Iterator[Claim]:
    """`out_dir` made, locked for the block, and checked: refused (a one-line ValueError) when another process holds
    it; when any of `holds` is in it and not `resume`; when `resume` and `resumable()` is false (nothing to resume;
    FileNotFoundError where the folder holds no run at all); with `config`, when its config.yaml was not written by
    a run. `option` names the setting in messages. A block that fails leaves no folder the claim made and nothing
    wrote into."""
    raw = os.fspath(out_dir)
    created = not Path(raw).exists() if raw.strip() else False
    folder = make_folder(raw)
    key = folder.resolve()
    owner = key not in _held   # a claim nested in one of this process's on the same folder shares its lock
    fd = _lock(folder, command, option) if owner else None
    _held[key] = _held.get(key, 0) + 1
    failed = False
    try:
        _check(folder, holds, resume, resumable, config, what, option)
        yield Claim(folder, created)
    except BaseException:
        failed = True
        raise
    finally:
        _held[key] -= 1
        if not _held[key]:
            del _held[key]
        if owner:
            _unlock(folder, fd)
            if failed and created:
                with contextlib.suppress(OSError):
                    folder.rmdir()   # only if empty: nothing was written


def start_over(folder: str | os.PathLike) -> None:
    """Remove what a run that never wrote a checkpoint left in `folder` (its config, metrics, starting policy): for
    an experiment that owns the folder and reruns such a run from its start (on-off's runs, a sweep's points)."""
    for name in RUN_FILES:
        path = Path(folder) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class _Stop:
    requested = False
    """A Ctrl-C came during the block: finish the step, checkpoint, then stop."""


@contextlib.contextmanager
def deferred_interrupt(enabled: bool = True) -> Iterator[_Stop]:
    """Within the block a first Ctrl-C (SIGINT) only sets `.requested` and says so on stderr; a second one raises
    KeyboardInterrupt at once. Off (`enabled` False, or outside the main thread, where no handler can be set) a
    Ctrl-C raises as usual."""
    stop = _Stop()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True
        print("\ninterrupt: finishing this step and checkpointing it (Ctrl-C again stops at once, without one)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
