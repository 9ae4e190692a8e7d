"""Run folders on object storage (``trainer.default_root_dir: s3://bucket/prefix``, through fsspec): the run writes
a local copy, whose files are uploaded whole, in order and in the background; the newest checkpoint is named by a
pointer written after it; one start at a time holds the run's lease, an object created only if absent, fenced."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from enum import Enum
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs
from fsspec.utils import get_protocol

from template.engine.errors import ROOT_OPTION, ConfigError, DiskError, one_line
from template.engine.runs import CHECKPOINTS, may_be_running
from template.engine.runs import is_remote as is_remote  # where the commands ask

POINTER = "newest"  # in checkpoints/: the name of the newest checkpoint whose upload completed
LEASE = "lease.json"
LEASE_SECONDS = 60.0  # renewed every sixth of it; not renewed for three quarters of it, the holder writes no more
FENCE = 0.75 * LEASE_SECONDS
COPIES = "RUN_FOLDER_COPIES"  # JSON {url: local folder}: a sweep hands its trials the copy it reads them in
# One retry layer, botocore's (s3fs's is off): 3 attempts, each connected within 5 s, answered within 15 s of sending.
_S3_OPTIONS = {
    "use_listings_cache": False,
    "skip_instance_cache": True,
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 15, "retries": {"total_max_attempts": 3}},
}
_SECRETS = ("key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_LIGHTNING_LINES = "lightning.pytorch.utilities.rank_zero"


class Upload(Enum):
    """What the upload thread does with a file of the local copy, in the order queued."""

    PUT = "put"  # upload it whole
    NEWEST = "newest"  # upload it, then point the run at it (a checkpoint)
    REMOVE = "rm"  # remove it from the store, once the pointer names another


class RemoteRoot:
    """``trainer.default_root_dir`` on object storage, written through a local copy (``local``) of its run folders."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, option: str = ROOT_OPTION) -> None:
        self.url, self.option = url.rstrip("/"), option
        if secret := sorted(set(storage_options or {}) & set(_SECRETS)):
            raise ConfigError(
                f"run.storage_options holds {', '.join(secret)}: credentials are not written into a run's config; "
                "give them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or ~/.aws/credentials"
            )
        s3 = get_protocol(self.url) in ("s3", "s3a")
        try:
            self.fs, self.root = url_to_fs(self.url, **{**(_S3_OPTIONS if s3 else {}), **(storage_options or {})})
        except ImportError as err:
            package = next((n for n in ("s3fs", "gcsfs", "adlfs") if n in str(err)), err.name or str(err))
            raise ConfigError(f"{option}={self.url} needs {package}: pip install -e '.[s3]'") from None
        except ValueError as err:
            raise ConfigError(
                f"{option}={self.url}: {one_line(err)}; use a local folder or object storage fsspec knows "
                "(s3:// with the s3 extra, tested; gs:// with gcsfs, az:// with adlfs)"
            ) from None
        if s3:
            self.fs.retries = 1
        self._call(lambda: self.fs.ls(self.root.split("/")[0], detail=False), "reach the bucket")
        copies = json.loads(os.environ.get(COPIES, "{}"))
        self.local = Path(copies.get(self.url) or tempfile.mkdtemp(prefix="run-folder-copy-"))
        self._owned = self.url not in copies
        # Checkpoints read from the store: apart from the copy, whose checkpoints are this start's own.
        self.fetched = Path(tempfile.mkdtemp(prefix="run-folder-read-"))
        self._queue: dict[Path, Upload] = {}  # in order
        self._requests: set[concurrent.futures.Future] = set()  # the run's own, on fsspec's (shared) event loop
        self._fenced = False
        self._busy = False
        self._synced: dict[Path, tuple[int, int]] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.lease: Lease | None = None
        logging.getLogger(_LIGHTNING_LINES).addFilter(self._name_the_store)

    def _name_the_store(self, record: logging.LogRecord) -> bool:
        """The run's lines (which checkpoint it resumes from, where it stopped) name the store, not the copy."""
        if isinstance(record.msg, str):
            record.msg = record.msg.replace(str(self.fetched), self.url).replace(str(self.local), self.url)
        return True

    def url_of(self, local: str | os.PathLike) -> str:
        """The URL of a path in the local copy (what the run's lines name)."""
        return f"{self.url}/{Path(local).relative_to(self.local).as_posix()}"

    def key(self, local: str | os.PathLike) -> str:
        return f"{self.root}/{Path(local).relative_to(self.local).as_posix()}"

    # -- reading ---------------------------------------------------------------------------------------------------
    def pull(self, folder: Path, recursive: bool = True) -> None:
        """Download a run folder's files but its checkpoints into the local copy (a restart reads its logs there)."""
        depth = None if recursive else 1
        for key in self._call(lambda: self.fs.find(self.key(folder), maxdepth=depth), f"read {self.url_of(folder)}"):
            relative = key.removeprefix(f"{self.root}/")
            if relative.split("/")[-1] == LEASE or f"/{CHECKPOINTS}/" in f"/{relative}":
                continue
            target = self.local / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            self._call(lambda k=key, t=target: self.fs.get_file(k, str(t)), f"read {self.url}/{relative}")
            self._synced[target] = _stamp(target)

    def newest(self, checkpoints: Path) -> str | None:
        """The run's newest checkpoint (``checkpoints``: the folder in the copy), downloaded; None before the first."""
        try:
            name = self._call(lambda: self.fs.cat_file(self.key(checkpoints / POINTER)), "read").decode().strip()
        except FileNotFoundError:
            return None
        return self._fetch(self.key(checkpoints / name), f"the run's folder {self.url_of(checkpoints.parent)}")

    def exists(self, local: Path) -> bool:
        return bool(self._call(lambda: self.fs.exists(self.key(local)), f"read {self.url_of(local)}"))

    def download(self, url: str, option: str) -> str:
        """A file at ``url`` on this store, downloaded (``--ckpt_path s3://...``)."""
        return self._fetch(url_to_fs(url)[1], option)

    def fetch_all(self, wanted: Any) -> Path:
        """The files under the root whose name ``wanted`` accepts (the runs table's), downloaded; their folder."""
        for key in self._call(lambda: self.fs.find(self.root), f"read {self.url}"):
            if wanted(key.rsplit("/", 1)[-1]):
                self._fetch(key, self.url)
        return self.fetched

    def _fetch(self, key: str, option: str) -> str:
        target = self.fetched / key.removeprefix(f"{self.root}/")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._call(lambda: self.fs.get_file(key, str(target)), f"read {key}")
        except FileNotFoundError:
            raise ConfigError(
                f"checkpoint '{self.fs.unstrip_protocol(key)}' does not exist; pass an existing file to {option}"
            ) from None
        return str(target)

    # -- writing ---------------------------------------------------------------------------------------------------
    def upload(self, local: Path, url: str) -> None:
        """``local`` written at ``url`` now, whole (``export --output s3://...``)."""
        self._call(lambda: self.fs.put_file(str(local), url_to_fs(url)[1]), f"write {url}")

    def push(self, local: Path, newest: bool = False) -> None:
        """Upload ``local`` (a file of the copy) after what is queued; ``newest``: then point the run at it. A
        checkpoint pushed again before its upload started moves to the end, so the pointer follows the newest push."""
        self._enqueue(Path(local), Upload.NEWEST if newest else Upload.PUT)

    def remove(self, local: Path) -> None:
        self._enqueue(Path(local), Upload.REMOVE)

    def sync(self, folder: Path, recursive: bool = True) -> None:
        """Upload the files of a run folder changed since its last sync, checkpoints aside (each is pushed whole)."""
        files = Path(folder).rglob("*") if recursive else Path(folder).iterdir()
        for path in sorted(p for p in files if p.is_file() and CHECKPOINTS not in p.relative_to(folder).parts):
            if self._synced.get(path) != (stamp := _stamp(path)):
                self._synced[path] = stamp
                self._enqueue(path, Upload.PUT)

    def flush(self) -> None:
        """Wait for every upload queued; the first failure, as one line."""
        with self._changed:
            while (self._queue or self._busy) and self.failure is None:
                self._changed.wait()
            self._raise()

    def close(self) -> None:
        """Release the lease and drop the local copy, uploads done or not (``flush`` first to wait for them)."""
        with self._changed:
            self._queue.clear()
            self._changed.notify_all()
        if self.lease is not None:
            self.lease.release()
        logging.getLogger(_LIGHTNING_LINES).removeFilter(self._name_the_store)
        shutil.rmtree(self.fetched, ignore_errors=True)
        if self._owned:
            shutil.rmtree(self.local, ignore_errors=True)

    def _enqueue(self, path: Path, action: Upload) -> None:
        with self._changed:
            self._raise()
            # A checkpoint moves to the end: the pointer follows the newest push. A log file (put) queued already keeps
            # its place, before the checkpoints queued after it whose steps it holds: its upload reads it as it is then.
            if action != Upload.PUT or path not in self._queue:
                self._queue.pop(path, None)
                self._queue[path] = action
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._upload, name="run-folder-upload", daemon=True)
                self._thread.start()

    def _upload(self) -> None:
        pointed: str | None = None
        deferred: set[Path] = set()  # removals; the pointed checkpoint's waits until the pointer names another
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                path, action = next(iter(self._queue.items()))
                del self._queue[path]
                self._busy = True
            try:
                if action == Upload.REMOVE:
                    deferred.add(path)
                elif path.exists():  # else removed before its turn
                    self._write("put_file", str(path), self.key(path))
                    if action == Upload.NEWEST:
                        self._write("pipe_file", self.key(path.parent / POINTER), path.name.encode())
                        pointed = path.name
                for old in [old for old in deferred if old.name != pointed]:
                    deferred.discard(old)
                    with contextlib.suppress(FileNotFoundError):
                        self._write("rm_file", self.key(old))
            except Exception as err:  # the training thread raises it at its next push or flush
                with self._changed:
                    self.failure = self.failure or self._error(err, f"write {self.url_of(path)}")
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _write(self, method: str, *args: Any) -> None:
        """One write to the store, unless the run's lease has fenced it off."""
        self._raise()
        self.request(method, *args)

    def request(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``fs.<method>(...)`` as one of the run's requests, which ``fence`` cancels, on fsspec's event loop (shared
        with every other fsspec user of the process, whose requests go on); a TimeoutError after ``timeout`` s."""
        future = asyncio.run_coroutine_threadsafe(getattr(self.fs, f"_{method}")(*args, **kwargs), self.fs.loop)
        self._requests.add(future)
        if self._fenced:  # fenced while it was being sent: fence's cancelling may have missed it
            future.cancel()
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()  # not left to land later
            raise
        except concurrent.futures.CancelledError:
            self._raise()  # fenced
            raise
        finally:
            self._requests.discard(future)

    def fence(self, lost: DiskError) -> None:
        """Write nothing more to the store (the lease was not renewed, or taken over): the run's requests under way
        are cancelled, and the training thread raises ``lost`` at its next push or flush."""
        with self._changed:
            self.failure, self._fenced = lost, True
            self._changed.notify_all()
        for future in list(self._requests):
            future.cancel()

    def _raise(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _call(self, call: Any, what: str) -> Any:
        try:
            return call()
        except FileNotFoundError as err:
            if "bucket" in str(err).lower():
                raise ConfigError(
                    f"{self.option}={self.url}: the bucket {self.root.split('/')[0]!r} does not exist; create it or "
                    "name another"
                ) from None
            raise
        except Exception as err:
            raise self._error(err, what) from None

    def _error(self, err: BaseException, what: str) -> Exception:
        reason = one_line(err)[:300] or type(err).__name__
        if "credentials" in reason.lower() or isinstance(err, PermissionError) or "AccessDenied" in reason:
            return ConfigError(
                f"cannot {what} ({reason}): the credentials for {self.url} are missing or refused; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials) to a key that may write there"
            )
        return DiskError(
            f"cannot {what} ({reason}); check that the store is reachable (endpoint, network), then run the same "
            "command again: it continues from the newest checkpoint uploaded"
        )


class Lease:
    """``<run folder>/lease.json``: created only if absent, renewed while the run lives, taken over once it expired
    (or at once when its holder on this host is dead). A holder whose renewals fail is warned once; unrenewed for
    ``FENCE`` seconds it fences its run off the store, a quarter of the term before a taker may take over."""

    def __init__(self, remote: RemoteRoot, folder: Path, name: str) -> None:
        self.remote, self.key, self.name = remote, remote.key(folder / LEASE), name
        self.url = remote.url_of(folder / LEASE)
        self.etag: str | None = None
        self.renewed = 0.0  # when the newest write of the lease the store accepted was sent (time.monotonic)
        self._stop = threading.Event()

    def acquire(self) -> None:
        fs = self.remote.fs
        self._refuse_a_store_without_conditional_writes()
        while True:
            sent = time.monotonic()
            with contextlib.suppress(FileExistsError):
                fs.pipe_file(self.key, self._body(), mode="create")
                break
            try:
                etag, held = fs.info(self.key)["ETag"], json.loads(fs.cat_file(self.key))
            except FileNotFoundError:
                continue  # released meanwhile
            left = float(held.get("expires", 0)) - time.time()
            if left > 0 and may_be_running([held.get("host")], held.get("pid")):
                if held.get("host") == socket.gethostname():
                    raise self._taken(held, left)
                time.sleep(min(left, LEASE_SECONDS) + 1)  # another host's: renewed if its holder lives
                if fs.info(self.key)["ETag"] != etag:
                    raise self._taken(held, LEASE_SECONDS)
            sent = time.monotonic()
            with contextlib.suppress(OSError):
                fs.pipe_file(self.key, self._body(), IfMatch=etag)  # one taker wins; the others see another ETag
                break
        self.etag, self.renewed = fs.info(self.key)["ETag"], sent
        threading.Thread(target=self._renew, name="run-lease", daemon=True).start()

    def release(self) -> None:
        if self._stop.is_set():
            return  # fenced: not one write more
        self._stop.set()
        with contextlib.suppress(Exception):
            if self.remote.fs.info(self.key)["ETag"] == self.etag:
                self.remote.fs.rm_file(self.key)

    def _renew(self) -> None:
        reason = ""  # why the renewals fail, reported at the first
        while not self._stop.wait(min(LEASE_SECONDS / 6, max(0.0, self.renewed + FENCE - time.monotonic()))):
            sent, left = time.monotonic(), self.renewed + FENCE - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError(reason)
                # Cancelled when it times out: a renewal landing later could follow a taker's.
                done = self.remote.request("pipe_file", self.key, self._body(), IfMatch=self.etag, timeout=left)
                self.etag, self.renewed, reason = done["ETag"], sent, ""
            except Exception as err:
                why = one_line(err)[:200] or type(err).__name__
                if left <= 0 or isinstance(err, OSError) and err.errno == errno.EINVAL:  # S3's 412: another's ETag
                    what = f"was not renewed for {FENCE:g} s" if left <= 0 else "was taken by another start"
                    lost = DiskError(
                        f"stopped writing to run {self.name!r}: its lease {self.url} {what} ({why}); another "
                        f"start may continue the run when the lease expires, {LEASE_SECONDS - FENCE:g} s later, or "
                        "run the same command then"
                    )
                    lost.exit_code = 75  # sysexits' EX_TEMPFAIL: the same command may continue the run later
                    self._stop.set()
                    return self.remote.fence(lost)
                if not reason:
                    sys.stderr.write(f"warning: cannot renew the lease {self.url} ({why}); retrying for {left:.0f} s\n")
                reason = why

    def _body(self) -> bytes:
        body = {"host": socket.gethostname(), "pid": os.getpid(), "expires": time.time() + LEASE_SECONDS}
        return json.dumps(body).encode()

    def _taken(self, held: dict[str, Any], left: float) -> ConfigError:
        return ConfigError(
            f"run {self.name!r} is already running on {held.get('host')} (PID {held.get('pid')}; its lease "
            f"{self.url} expires {left:.0f} s after that process stops renewing it); wait for it "
            "to end or stop it, or start this one under another --run.name"
        )

    def _refuse_a_store_without_conditional_writes(self) -> None:
        probe = f"{self.key}.probe-{uuid.uuid4().hex}"
        fs = self.remote.fs
        try:
            fs.pipe_file(probe, b"", mode="create")  # a new name: the second create of it is refused, if honoured
            fs.pipe_file(probe, b"", mode="create")
        except FileExistsError:
            return
        finally:
            with contextlib.suppress(Exception):
                fs.rm_file(probe)
        raise ConfigError(
            f"{self.remote.url} ignores conditional writes (If-None-Match), so two starts of a run could not be told "
            "apart there; use a store that honours them (AWS S3 does) or a shared disk"
        )


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size
