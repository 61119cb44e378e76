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
    a read-only place or a file in the way otherwise ends in an OSError traceback. An empty name is refused: it
    would be the current folder, and a run's files would land among the user's."""
    if not os.fspath(path).strip():
        raise ValueError("the output folder is empty (\"\"), which would write into the current folder: give a folder "
                         "name")
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


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """The text of `path`, or a one-line error naming it: FileNotFoundError when there is none, ValueError when it
    is a folder or not UTF-8 text (a binary file otherwise raises a decode error that names no file)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not text: byte {e.start} is not UTF-8") from None
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read: {e.strerror or e}") from None
