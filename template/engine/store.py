"""Crash-safe file writes: a reader sees the old file or the new one, never a partial one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from template.engine.errors import disk_error

# Temporary names carry host and PID so that a later write can tell a dead writer's leftover from a live one.
_TMP_SUFFIX = ".tmp"


def atomic_torch_save(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that a kill at any moment leaves the previous file or the new one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a file beside ``path`` (same filesystem), fsync it, ``os.replace`` it onto ``path``."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        remove_stale_temporaries(path)
        mode = _target_mode(path)
        fd, tmp = _open_temporary(path)
    except OSError as err:
        err.filename = str(path)  # not the temporary's name: the file the user knows
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            recorder = _WriteErrors(f)
            try:
                write(recorder)  # type: ignore[arg-type]
            except Exception as err:
                # torch.save's zip writer turns a failed write (ENOSPC...) into a RuntimeError about positions.
                if recorder.error is not None and recorder.error is not err:
                    raise recorder.error from err
                raise
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
            if tmp is None:
                # An O_TMPFILE file has no name until now: a kill can leak it only between this link and the rename.
                tmp = _temporary_name(path)
                _link_unnamed(f.fileno(), tmp)
            os.replace(tmp, path)  # at once, before the file is closed: that window stays two system calls wide
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and (err.filename is None or err.filename == tmp):
            err.filename = str(path)  # a failed write() names no file, a temporary no file the user knows
        raise
    _fsync_directory(directory)


def prove_writable(directory: str | os.PathLike, option: str) -> None:
    """Create ``directory`` (and its parents) if missing, and prove that a file can be written in it.

    The probe is an unnamed file (O_TMPFILE) where the OS has them, else a named one removed at once, even on
    failure. Raises a one-line DiskError naming the path, the errno and ``option`` (what chose the folder).
    """
    directory = Path(directory)
    probe: str | None = None
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
        error = disk_error(err, directory, "nothing was written there", option)
        if error is None:
            raise
        raise error from None
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)


@contextlib.contextmanager
def undone_on_failure(path: str | os.PathLike, copy: bool = True) -> Iterator[None]:
    """If the block raises, ``path`` is left as it was: deleted if the block created it, cut back to its length if
    the block appended to it, or (``copy``: its bytes are kept in memory meanwhile) rewritten with its old bytes.

    For files a library writes in place (Lightning's hparams.yaml, metrics.csv, config.yaml): a full disk leaves
    no 0-byte or half-written file behind.
    """
    path = Path(path)
    try:
        size: int | None = path.stat().st_size
        old = path.read_bytes() if copy else None
    except FileNotFoundError:
        size, old = None, None
    except OSError:
        yield  # cannot be read: nothing to restore it to
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


class _WriteErrors:
    """A file's ``write`` that remembers the OSError it raised, for callers that replace it with their own error."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str) -> object:
        return getattr(self._f, name)


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete temporaries for ``path`` left by killed writers on this host; returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]+{re.escape(_TMP_SUFFIX)}$")
    removed = []
    for candidate in _siblings(path):
        match = pattern.match(candidate.name)
        if match and match["host"] == socket.gethostname() and not _pid_alive(int(match["pid"])):
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
                removed.append(candidate)
    return removed


def temporaries(path: str | os.PathLike) -> list[Path]:
    """Temporary files currently beside ``path`` that belong to writes of ``path``."""
    path = Path(path)
    return [p for p in _siblings(path) if p.name.startswith(f".{path.name}.") and p.name.endswith(_TMP_SUFFIX)]


def _siblings(path: Path) -> Iterator[Path]:
    try:
        yield from (path.parent if str(path.parent) else Path(".")).iterdir()
    except FileNotFoundError:
        return


def _temporary_name(path: Path) -> str:
    return str(path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"))


def _open_temporary(path: Path) -> tuple[int, str | None]:
    """An unnamed file in the target's directory where the OS supports it (a kill cannot leak it), else a named one."""
    directory = path.parent if str(path.parent) else Path(".")
    if hasattr(os, "O_TMPFILE") and Path("/proc/self/fd").is_dir():
        try:
            return os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600), None
        except OSError:
            pass  # filesystem without O_TMPFILE support (e.g. some network filesystems)
    tmp = _temporary_name(path)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), tmp


def _link_unnamed(fd: int, name: str) -> None:
    """Give an O_TMPFILE file a name; a ``src_dir_fd`` makes Python use linkat(), which follows the /proc link."""
    directory = os.open(os.path.dirname(name) or ".", os.O_RDONLY)
    try:
        os.link(f"/proc/self/fd/{fd}", name, src_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


def _target_mode(path: Path) -> int:
    """The mode the file has now, or for a new file what ``open()`` would give it under the current umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # Reading the umask through os.umask() briefly changes it for every thread; /proc avoids that on Linux.
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_directory(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the folder ``new`` at ``path`` in one step, so that a kill at any moment leaves the previous folder (or
    file) there or the new one; whatever ``path`` held is deleted afterwards.

    ``os.replace`` cannot put a folder onto a non-empty one. Linux's renameat2 swaps the two names atomically; where
    the filesystem lacks it, two renames leave, for an instant, nothing at ``path`` (never a partial folder).
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
    """Swap the names ``a`` and ``b`` atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    rename_exchange, at_fdcwd = 2, -100
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return False
    if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _fsync_directory(directory: Path) -> None:
    """Persist the rename itself: without this, a power loss can bring back the old directory entry."""
    with contextlib.suppress(OSError):  # some platforms/filesystems cannot open or fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
