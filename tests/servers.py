"""Real servers for tests, on loopback only, each started in a temporary folder and stopped by the test: an S3 server
(moto's, the S3 protocol over HTTP, as s3fs's own tests use it), a TCP relay in front of it that a test can cut (the
store going away mid-run, its objects kept) or stall (connections held open, never answered), and PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

# Fake credentials the S3 server accepts; a test checks the secret is written nowhere. Made per session, so that
# no file of a run (its git diff included) holds it by chance.
S3_KEY, S3_SECRET = "AKIATESTKEY", f"secret-{uuid.uuid4().hex}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3:
    """moto's S3 server on 127.0.0.1; ``env()``: what a ``python -m <package>`` process needs to reach it."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def bucket(self) -> str:
        """A new empty bucket: its ``s3://`` URL."""
        name = f"b{uuid.uuid4().hex[:16]}"
        self.fs().mkdir(name)
        return f"s3://{name}"

    def fs(self, endpoint: str | None = None):  # noqa: ANN201 - s3fs.S3FileSystem
        import s3fs

        return s3fs.S3FileSystem(
            endpoint_url=endpoint or self.endpoint, key=S3_KEY, secret=S3_SECRET, use_listings_cache=False,
            skip_instance_cache=True,
        )  # fmt: skip

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {
            "FSSPEC_S3_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        }  # fmt: skip

    def stop(self) -> None:
        self.server.stop()


class Relay:
    """A TCP relay on 127.0.0.1 to ``target`` (host, port): ``cut()`` closes it and every connection through it (the
    store is gone), ``stall()`` holds every connection open and answers nothing (a store that hangs), ``restore()``
    relays again on the same port. ``requests``: the first line of each HTTP request it relayed."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, free_port()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.stalled = False
        self.requests: list[str] = []
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        self.stalled = False
        if getattr(self, "_listener", None) is None or self._listener.fileno() < 0:
            self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=True)
            threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def stall(self) -> None:
        self.stalled = True

    def cut(self) -> None:
        with self._lock:
            for s in [self._listener, *self._open]:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for a, b, log in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, log), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, log: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if self.stalled:
                    continue  # read, never passed on: no answer comes
                if log and data.split(b" ", 1)[0] in (b"GET", b"HEAD", b"PUT", b"POST", b"DELETE"):
                    self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def postgres_binaries() -> tuple[Path, Path] | None:
    """Debian's initdb and pg_ctl (kept off PATH), or those on PATH; None without PostgreSQL."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for bin_dir in (*debian, *(Path(p).parent for p in [shutil.which("initdb")] if p)):
        if (bin_dir / "initdb").is_file() and (bin_dir / "pg_ctl").is_file():
            return bin_dir / "initdb", bin_dir / "pg_ctl"
    return None


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A PostgreSQL server in a temporary folder on 127.0.0.1: its URL, until the block ends."""
    initdb, pg_ctl = postgres_binaries()
    # PostgreSQL refuses to run as root: as root it runs as an unprivileged user, in a folder of its own.
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    data, port = Path(tempfile.mkdtemp(prefix="test-pg-")), free_port()
    if as_user:
        shutil.chown(data, "nobody")
    subprocess.run([*as_user, initdb, "-D", data, "-U", "sweep", "--auth=trust"], check=True, capture_output=True,
                   timeout=120, cwd=data)  # fmt: skip
    options = f"-k {data} -h 127.0.0.1 -p {port}"
    start = [*as_user, pg_ctl, "-D", data, "-o", options, "-w", "-t", "60", "-l", data / "log", "start"]
    subprocess.run(start, check=True, capture_output=True, timeout=90, cwd=data)
    try:
        yield f"postgresql://sweep@127.0.0.1:{port}/postgres"
    finally:
        stop = [*as_user, pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"]
        subprocess.run(stop, capture_output=True, timeout=60, cwd=data)
        shutil.rmtree(data, ignore_errors=True)
