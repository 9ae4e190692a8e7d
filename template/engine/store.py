"""Crash-safe files (a reader sees a file's old content or its new, never a part of it) and exclusive locks.

A file is written to a temporary beside it, unnamed (``O_TMPFILE``) where the filesystem has it so that a kill leaks
nothing, else named and locked while written so that the next write removes one a killed writer left."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import secrets
import shutil
import socket
import stat
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from template.engine.errors import disk_error

_HOST = socket.gethostname().replace(".", "_")  # in a named temporary's name: whose lock can be checked here


class Lock:
    """An exclusive lock held by this process until ``release()`` or its end, however it ends (SIGKILL included);
    a forked child (a DataLoader worker, which outlives a killed run for seconds) closes its copy at once."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        _HELD.add(self)
        _release_in_forked_children()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    __del__ = release  # unreachable, it could never be released


_HELD: weakref.WeakSet[Lock] = weakref.WeakSet()


@functools.cache
def _release_in_forked_children() -> None:
    """One fork hook for the process, whatever the number of locks: closing the child's descriptors leaves the
    parent's locks (an unlock would release them for both)."""
    os.register_at_fork(after_in_child=lambda: [lock.release() for lock in list(_HELD)])


def try_lock(path: str | os.PathLike) -> Lock | None:
    """Lock the folder or file ``path`` for this process; None while another process has it."""
    fd = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return Lock(fd)


def atomic_torch_save(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that a kill at any moment leaves the previous file or the new one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary beside ``path``, fsync it and rename it onto ``path``, whose mode it keeps.
    An OSError names ``path``, never the temporary."""
    path, fd, tmp = Path(path), None, None
    try:
        remove_stale_temporaries(path)
        if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # a filesystem without O_TMPFILE (some network filesystems)
                fd = os.open(path.parent, os.O_TMPFILE | os.O_WRONLY, 0o666)
        if fd is None:
            tmp = _temporary_name(path)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else has it
        with os.fdopen(fd, "wb") as f:
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(fd, stat.S_IMODE(path.stat().st_mode))
            try:
                write(f)
            except RuntimeError as err:
                # torch.save's zip writer turns a failed write (ENOSPC) into a RuntimeError about positions.
                if isinstance(err.__context__, OSError):
                    raise err.__context__ from err
                raise
            f.flush()
            os.fsync(fd)
            if tmp is None:  # unnamed: only a kill between this link and the rename leaves it behind
                tmp = _temporary_name(path)
                # Any src_dir_fd makes Python call linkat(), which follows the /proc link (absolute: no fd is read).
                os.link(f"/proc/self/fd/{fd}", tmp, src_dir_fd=fd, follow_symlinks=True)
            os.replace(tmp, path)  # before the close, which releases the temporary's lock
    except BaseException as err:
        if isinstance(err, OSError) and (fd is None or err.filename in (None, tmp)):
            err.filename = str(path)
        if fd is not None and tmp is not None:  # the temporary was made and has a name
            Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def prove_writable(directory: str | os.PathLike, option: str) -> None:
    """Create ``directory`` (and its parents) if missing and write a file there, removed at once; else a one-line
    DiskError naming the path, the errno and ``option`` (what chose the folder)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory, buffering=0) as probe:
            probe.write(b"probe")
            os.fsync(probe.fileno())
    except OSError as err:
        if (error := disk_error(err, directory, "nothing was written there", option)) is None:
            raise
        raise error from None


@contextlib.contextmanager
def undone_on_failure(path: str | os.PathLike, copy: bool = True) -> Iterator[None]:
    """For a file a library writes in place (config.yaml, hparams.yaml, metrics.csv): if the block raises, ``path``
    is as it was: removed if the block created it, else rewritten with its old bytes (with ``copy``) or cut back."""
    path = Path(path)
    try:
        size: int | None = path.stat().st_size
        old = path.read_bytes() if copy else None
    except FileNotFoundError:
        size, old = None, None
    except OSError:
        yield  # unreadable: nothing to restore it to
        return
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if size is None:
                path.unlink(missing_ok=True)
            elif old is not None and path.read_bytes() != old:
                atomic_write(path, lambda f: f.write(old))
            elif path.stat().st_size > size:
                os.truncate(path, size)
        raise


def remove_stale_temporaries(path: str | os.PathLike) -> None:
    """Remove the named temporaries of ``path`` that killed writers on this host left (unlocked ones; another host's
    lock may not reach here on a network filesystem)."""
    path = Path(path)
    prefix = f".{path.name}.{_HOST}."
    with contextlib.suppress(FileNotFoundError):
        for candidate in [p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(".tmp")]:
            with contextlib.suppress(FileNotFoundError, BlockingIOError), candidate.open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: locked, its writer lives
                candidate.unlink()


def _temporary_name(path: Path) -> str:
    return str(path.with_name(f".{path.name}.{_HOST}.{secrets.token_hex(4)}.tmp"))


def replace_directory(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the folder ``new`` at ``path`` (a folder, a file or nothing) so that a kill leaves the previous one there or
    the new one: renameat2 swaps two folders in one step; without it two renames leave nothing there for an instant."""
    new, path = Path(new), Path(path)
    old = new.with_name(new.name + ".old")
    if not path.exists():
        new.rename(path)
    elif path.is_dir() and _exchange(new, path):
        old = new
    else:
        path.rename(old) if path.is_dir() else path.unlink()
        new.rename(path)
    _fsync_directory(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step (renameat2 RENAME_EXCHANGE); False where that fails."""
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None).renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0
    return False


def _fsync_directory(directory: Path) -> None:
    """Persist a rename: without this, a power loss can bring back the old directory entry."""
    with contextlib.suppress(OSError):  # some filesystems cannot open or fsync a folder
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
