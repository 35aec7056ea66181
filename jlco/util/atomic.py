"""Atomic writes: a reader (or a crash) sees the old file or directory or the new one,
never a half-written one. Each write goes to a temporary sibling in the same parent
directory (same filesystem, so the final `os.replace` / `os.rename` is one atomic step)
and is renamed into place only when complete.

`check_writable` runs before long work so that an unwritable output fails in a second,
not after an hour of conversion.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
from typing import Iterator


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(path: str | os.PathLike, what: str = "output") -> pathlib.Path:
    """Absolute `path` if it can be created (or replaced) by this process: its nearest
    existing ancestor must be a writable directory. Raises OSError naming `what` and the
    path otherwise (a parent that is a file, a read-only directory)."""
    path = pathlib.Path(path).absolute()
    anchor = _nearest_existing(path.parent)
    if not anchor.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} cannot be created: {str(anchor)!r} "
                                 "is not a directory")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {str(path)!r} cannot be created: directory "
                              f"{str(anchor)!r} is not writable")
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {str(path)!r} is a directory that is not writable")
    return path


def _sibling(path: pathlib.Path, make_dir: bool = False,
             suffix: str = "") -> tuple[pathlib.Path, int | None]:
    """A new hidden `.NAME.RANDOM.tmp[SUFFIX]` file (open fd) or directory beside `path`. Unlike
    tempfile.mkstemp/mkdtemp (mode 0600/0700) it is created with the process umask's
    permissions, so the renamed result reads like any other file the user writes."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp{suffix}"
        try:
            if make_dir:
                os.mkdir(tmp, 0o777)
                return tmp, None
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {str(path)!r}")


def write_bytes(path: str | os.PathLike, data: bytes) -> pathlib.Path:
    """Write `data` to `path` atomically (temp file in the same directory, fsync, rename).
    The parent directory is created if needed."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _sibling(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    """`write_bytes` for UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def temp_sibling(path: str | os.PathLike, suffix: str = "") -> Iterator[pathlib.Path]:
    """A temporary file name beside `path` (ending in `suffix`, for readers that go by
    it) for writers that want a path, not bytes (e.g. matplotlib's savefig), or for a
    check of the written file before it replaces `path`; renamed onto `path` when the
    block succeeds, removed when it raises."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _sibling(path, suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def new_directory(path: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Build a directory atomically: yields a temporary directory beside `path`; when the
    block succeeds it is renamed to `path` (which must not exist, or be an empty
    directory), when it raises it is removed. A crash leaves only a hidden
    `.NAME.*.tmp` directory, never a half-written `path`."""
    path = pathlib.Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, _ = _sibling(path, make_dir=True)
    try:
        yield tmp
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()   # rename(2) would replace an empty directory; say so explicitly
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
