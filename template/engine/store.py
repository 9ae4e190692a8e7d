"""Crash-safe files (a reader sees a file's old content or its new, never a part of it) and exclusive locks.

A file is written beside its target, fsynced and renamed onto it. The temporary is unnamed (``O_TMPFILE``) where the
filesystem has it, so that a kill leaks nothing; else it is named ``.<target>.<host>.<hex>.tmp`` and locked while
written, so that the next write of the target removes one a killed writer left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import socket
import stat
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from template.engine.errors import disk_error


class Lock:
    """An exclusive lock on a file or folder, held by this process until ``release()`` or its end.

    The kernel releases it when the process ends however it ends (SIGKILL, the OOM killer), so a killed holder never
    leaves it behind. A forked child (a DataLoader worker) closes its copy at once: a killed run's workers, which live
    on for seconds, do not hold it.
    """

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        held = weakref.ref(self)
        # Closing the child's descriptor leaves the parent's lock (an unlock would release it for both).
        os.register_at_fork(after_in_child=lambda: (lock := held()) is not None and lock.release())

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    __del__ = release  # unreachable, it could never be released


def try_lock(path: str | os.PathLike) -> Lock | None:
    """Lock ``path`` (a folder, or a file, created if missing) for this process; None while another process has it."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_RDONLY | os.O_CREAT, 0o644)
    if _locked(fd):
        return Lock(fd)
    os.close(fd)
    return None


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def atomic_torch_save(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that a kill at any moment leaves the previous file or the new one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary beside ``path``, fsync it and rename it onto ``path``, whose mode it keeps.

    An OSError names ``path``, the file the user knows, never the temporary.
    """
    path = Path(path)
    try:
        remove_stale_temporaries(path)
        fd, tmp = _open_temporary(path)
    except OSError as err:
        err.filename = str(path)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(fd, stat.S_IMODE(path.stat().st_mode))  # an existing file keeps its mode
            try:
                write(f)
            except RuntimeError as err:
                # torch.save's zip writer turns a failed write (ENOSPC) into a RuntimeError about positions.
                if isinstance(err.__context__, OSError):
                    raise err.__context__ from err
                raise
            f.flush()
            os.fsync(fd)
            if tmp is None:
                # Unnamed until now: only a kill between this link and the rename leaves it behind.
                tmp = _temporary_name(path)
                directory = os.open(path.parent, os.O_RDONLY)
                try:  # a src_dir_fd makes Python call linkat(), which follows the /proc link
                    os.link(f"/proc/self/fd/{fd}", tmp, src_dir_fd=directory, follow_symlinks=True)
                finally:
                    os.close(directory)
            os.replace(tmp, path)  # before the close, which releases the temporary's lock
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename in (None, tmp):
            err.filename = str(path)
        raise
    _fsync_directory(path.parent)


def prove_writable(directory: str | os.PathLike, option: str) -> None:
    """Create ``directory`` (and its parents) if missing and write a file there, removed at once; else a one-line
    DiskError naming the path, the errno and ``option`` (what chose the folder)."""
    directory = Path(directory)
    probe = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = _open_temporary(directory / ".write-probe")
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno == errno.EEXIST and not directory.is_dir():
            err = OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory))
        if (error := disk_error(err, directory, "nothing was written there", option)) is None:
            raise
        raise error from None
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)


@contextlib.contextmanager
def undone_on_failure(path: str | os.PathLike, copy: bool = True) -> Iterator[None]:
    """For a file a library writes in place (Lightning's config.yaml, hparams.yaml, metrics.csv): if the block
    raises, ``path`` is as it was: removed if the block created it, else rewritten with its old bytes (kept in memory
    with ``copy``) or cut back to its old length."""
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


def temporaries(path: str | os.PathLike) -> list[Path]:
    """The temporaries of writes of ``path`` beside it now."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        return [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.") and p.name.endswith(".tmp")]
    return []


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of ``path`` that killed writers of this host left (unlocked); what was removed.

    Another host's are left: its locks may not reach this one on a network filesystem.
    """
    removed = []
    for candidate in temporaries(path):
        if candidate.name.split(".")[-3] != socket.gethostname().replace(".", "_"):
            continue
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(candidate, os.O_RDONLY)
            try:
                if _locked(fd):
                    candidate.unlink()
                    removed.append(candidate)
            finally:
                os.close(fd)
    return removed


def _temporary_name(path: Path) -> str:
    host = socket.gethostname().replace(".", "_")
    return str(path.with_name(f".{path.name}.{host}.{secrets.token_hex(4)}.tmp"))


def _open_temporary(path: Path) -> tuple[int, str | None]:
    """A locked temporary in ``path``'s folder, with the mode ``open()`` gives a new file: unnamed where the
    filesystem can (its name None), else named."""
    fd, name = None, None
    if hasattr(os, "O_TMPFILE") and Path("/proc/self/fd").is_dir():
        with contextlib.suppress(OSError):  # a filesystem without O_TMPFILE (some network filesystems)
            fd = os.open(path.parent, os.O_TMPFILE | os.O_WRONLY, 0o666)
    if fd is None:
        name = _temporary_name(path)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    _locked(fd)  # a new file: nobody else has it
    return fd, name


def replace_directory(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the folder ``new`` at ``path`` (a folder, a file or nothing), so that a kill at any moment leaves the
    previous one there or the new one; the previous one is removed afterwards.

    ``os.replace`` cannot put a folder onto a non-empty one: Linux's renameat2 swaps the two names in one step; where
    the filesystem lacks it, two renames leave nothing at ``path`` for an instant (never a partial folder).
    """
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
    """Swap the names ``a`` and ``b`` in one step (renameat2 RENAME_EXCHANGE); False where unsupported."""
    rename_exchange, at_fdcwd = 2, -100
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _fsync_directory(directory: Path) -> None:
    """Persist a rename: without this, a power loss can bring back the old directory entry."""
    with contextlib.suppress(OSError):  # some filesystems cannot open or fsync a folder
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
