"""Durable writes: what a save that must survive a kill at any instant needs from the file system."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a rename is durable only once its folder is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folder(path: str | os.PathLike) -> Path:
    """`path` as a writable folder (made with its parents), or a one-line ValueError the command line prints as is:
    a read-only place or a file in the way otherwise ends in an OSError traceback."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"cannot create output folder {path}: a file of that name is in the way") from None
    except OSError as e:
        raise ValueError(f"cannot create output folder {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create output folder {path}: it is not writable")
    return path
