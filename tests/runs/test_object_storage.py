"""Runs on object storage: ``trainer.default_root_dir: s3://bucket/prefix`` against a real S3 server (moto's, on
loopback), with every promise of a run on a disk: its files there, the same command continuing bit for bit after a
SIGTERM, a SIGKILL or a kill in the middle of an upload, one start at a time, DDP, sweeps, the commands that read a
checkpoint, the runs table, and each mistake as one line before anything is written.

What a server on one host cannot prove: races between the conditional writes of several hosts (moto checks them
without a lock per key); docs/reliability.md says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env, finish
from tests.resume.test_exact_resume import _differences, _training_state
from tests.servers import S3, S3_SECRET, Relay, postgres, postgres_binaries

WAIT = 240
FIT = [
    "fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.deterministic=true",
    "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--trainer.max_epochs=2",
    "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--run.name=r",
]  # fmt: skip
STEPS = 16


@pytest.fixture(scope="module")
def s3() -> S3:
    server = S3()
    yield server
    server.stop()


def _env(s3: S3, tmp_path: Path, endpoint: str | None = None, **extra: str) -> dict[str, str]:
    """A child's environment: the server, helpers on PYTHONPATH, temporary files (the local copies) under tmp_path."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in cli_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(s3.env(endpoint), TMPDIR=str(tmp_path / "tmp"), **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = WAIT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", PACKAGE, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    log = (cwd / "run.log").open("a")
    return subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *map(str, args)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _paced(tmp_path: Path, delay: float = 0.3, hold: Path | None = None) -> list[str]:
    (tmp_path / "paced.yaml").write_text(
        f"trainer:\n  callbacks:\n    - class_path: step_marker.StepMarker\n"
        f"      init_args: {{path: {tmp_path / 'steps.txt'}, delay: {delay}{f', hold: {hold}' if hold else ''}}}\n"
    )
    return ["--config", str(tmp_path / "paced.yaml")]


def _wait_for(condition, what: str, timeout: float = WAIT) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def _steps(tmp_path: Path) -> int:
    marks = tmp_path / "steps.txt"
    return int(marks.read_text().split()[-2]) if marks.is_file() and marks.read_text().strip() else 0


def _one_error(done: subprocess.CompletedProcess, code: int) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == code and len(errors) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return errors[0]


def _checkpoint(s3: S3, url: str) -> dict:
    with s3.fs().open(url.removeprefix("s3://"), "rb") as f:
        return torch.load(f, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The final training state of FIT without a stop, on a local disk: what each continuation on S3 must end at."""
    work = tmp_path_factory.mktemp("uninterrupted")
    done = subprocess.run(
        [sys.executable, "-m", PACKAGE, *FIT], cwd=work, env=cli_env(), capture_output=True, text=True, timeout=WAIT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _training_state(torch.load(work / "lightning_logs/r/checkpoints/last.ckpt", weights_only=True))


def _assert_exact(s3: S3, root: str, uninterrupted: dict) -> None:
    run = f"{root}/lightning_logs/r"
    assert s3.fs().cat(f"{run.removeprefix('s3://')}/checkpoints/newest") == b"last.ckpt"
    final = _training_state(_checkpoint(s3, f"{run}/checkpoints/last.ckpt"))
    differences = _differences(final, uninterrupted)
    assert not differences, differences[:5]
    rows = list(csv_rows(s3, f"{run}/metrics.csv"))
    logged = [row["step"] for row in rows if row.get("train_loss")]
    assert len(logged) == len(set(logged)) == STEPS, logged  # every step logged once, none twice


def csv_rows(s3: S3, url: str):  # noqa: ANN201
    import csv
    import io

    return csv.DictReader(io.StringIO(s3.fs().cat(url.removeprefix("s3://")).decode()))


def test_a_run_on_s3_keeps_its_folder_there_and_the_commands_read_it(s3: S3, tmp_path: Path) -> None:
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path)
    done = _run([*FIT, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=1"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    fs, run = s3.fs(), f"{root.removeprefix('s3://')}/lightning_logs/r"
    names = {key.rsplit("/", 1)[-1] for key in fs.find(run)}
    assert {"config.yaml", "hparams.yaml", "metrics.csv", "provenance.json", "last.ckpt", "newest"} <= names, names
    assert any(name.startswith("events.out.tfevents") for name in names), names
    assert fs.cat(f"{run}/checkpoints/newest") == b"last.ckpt"
    assert yaml.safe_load(fs.cat(f"{run}/config.yaml"))["trainer"]["default_root_dir"] == root
    (start,) = json.loads(fs.cat(f"{run}/provenance.json"))["starts"]
    assert start["status"] == "finished" and start["steps"] == 8
    assert f"Best checkpoint: {root}/lightning_logs/r/checkpoints/best-0-" in done.stderr + done.stdout
    # No key, secret or local copy left behind: not in the objects, not in the output, not on the disk.
    assert all(S3_SECRET.encode() not in fs.cat(key) for key in fs.find(root.removeprefix("s3://")))
    assert S3_SECRET not in done.stdout + done.stderr
    assert not list((tmp_path / "tmp").iterdir()) and not (tmp_path / "lightning_logs").exists()
    # The commands that read a checkpoint read it there, and the runs table lists the runs there.
    last = f"{root}/lightning_logs/r/checkpoints/last.ckpt"
    validated = _run(["validate", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--ckpt_path",
                      last, "--trainer.limit_val_batches=2", "--trainer.default_root_dir", tmp_path / "eval"],
                     tmp_path, env)  # fmt: skip
    assert validated.returncode == 0 and "val_acc" in validated.stdout, validated.stderr[-3000:]
    table = _run(["runs", root], tmp_path, env)
    row = table.stdout.splitlines()[2].split() if table.returncode == 0 else []
    assert row[:2] == ["r", "finished"] and row[2].startswith("val_acc="), table.stdout + table.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopped_at_any_moment_the_same_command_continues_bit_for_bit(
    s3: S3, tmp_path: Path, uninterrupted: dict, how: str
) -> None:
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path)
    # A SIGKILL leaves no time for a checkpoint: the run writes one every 3 steps.
    periodic = ["--run.save_every_n_steps=3"] if how == "SIGKILL" else []
    command = [*FIT, f"--trainer.default_root_dir={root}", *periodic]
    proc = _start([*command, *_paced(tmp_path)], tmp_path, env)
    _wait_for(lambda: _steps(tmp_path) >= 5, "step 5")  # mid-epoch 0
    if how == "SIGKILL":  # once last-step.ckpt (step 3) is uploaded and named the newest
        _wait_for(lambda: s3.fs().exists(f"{root[5:]}/lightning_logs/r/checkpoints/newest"), "the first upload")
    os.killpg(proc.pid, getattr(signal, how))
    assert finish(proc, WAIT) == (143 if how == "SIGTERM" else -9), (tmp_path / "run.log").read_text()[-3000:]
    done = _run(command, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {root}/lightning_logs/r/checkpoints/" in done.stderr + done.stdout
    _assert_exact(s3, root, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
def test_a_kill_during_an_upload_leaves_the_previous_checkpoint_named_and_whole(
    s3: S3, tmp_path: Path, uninterrupted: dict
) -> None:
    # Uploads of last.ckpt take 30 s (tests/slow_uploads/sitecustomize.py): the run is killed during the first one.
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path, SLOW_UPLOADS="last.ckpt", SLOW_UPLOADS_LOG=str(tmp_path / "uploads.txt"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "slow_uploads"), env["PYTHONPATH"]])
    command = [*FIT, f"--trainer.default_root_dir={root}", "--run.save_every_n_steps=3"]
    proc = _start([*command, *_paced(tmp_path)], tmp_path, env)  # paced: the uploads keep up with the steps
    uploads = tmp_path / "uploads.txt"
    _wait_for(lambda: uploads.is_file() and "last.ckpt" in uploads.read_text(), "the upload of last.ckpt")
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc, WAIT)
    run = f"{root}/lightning_logs/r"
    fs = s3.fs()
    assert not fs.exists(f"{run[5:]}/checkpoints/last.ckpt")  # never half there
    newest = fs.cat(f"{run[5:]}/checkpoints/newest").decode()  # the checkpoint uploaded before it, whole
    step = _checkpoint(s3, f"{run}/checkpoints/{newest}")["global_step"]
    # last-step.ckpt of step 6 or the epoch's best of step 8; on a loaded machine the uploads may fall behind until
    # the second epoch's end, when last.ckpt, pushed again, goes after that epoch's best (step 16).
    assert newest != "last.ckpt" and step in (6, 8, STEPS), (newest, step)
    done = _run(command, tmp_path, _env(s3, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"resuming from {re.escape(run)}/checkpoints/{re.escape(newest)} \(epoch \d+, step {step}\)",
                     done.stderr + done.stdout), done.stderr[-3000:]  # fmt: skip
    _assert_exact(s3, root, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
def test_one_start_at_a_time_and_a_stale_lease_is_taken_over(s3: S3, tmp_path: Path) -> None:
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path)
    command = [*FIT, f"--trainer.default_root_dir={root}"]
    proc = _start([*command, *_paced(tmp_path, delay=1.0), "--trainer.max_epochs=20"], tmp_path, env)
    lease = f"{root[5:]}/lightning_logs/r/lease.json"
    _wait_for(lambda: s3.fs().exists(lease), "the lease")
    expires = json.loads(s3.fs().cat(lease))["expires"]
    _wait_for(lambda: json.loads(s3.fs().cat(lease))["expires"] > expires, "a renewal of the lease", timeout=60)
    second = _run(command, tmp_path, env)
    line = _one_error(second, 2)
    assert "run 'r' is already running on " in line and f"PID {proc.pid}" in line, line
    _wait_for(lambda: any("best-" in k for k in s3.fs().find(f"{root[5:]}/lightning_logs/r/checkpoints")), "a best")
    os.killpg(proc.pid, signal.SIGTERM)
    assert finish(proc, WAIT) == 143
    assert not s3.fs().exists(lease)  # released when the run stopped
    first = {k for k in s3.fs().find(f"{root[5:]}/lightning_logs/r/checkpoints") if "best-" in k}
    # Each later start trains one epoch more: the first may have gone several epochs past its best on a loaded machine.
    with s3.fs().open(f"{root[5:]}/lightning_logs/r/checkpoints/interrupted.ckpt") as f:
        epochs = torch.load(f, weights_only=True)["epoch"] + 1
    # A lease whose holder died without releasing it: expired (another host), or on this host with its PID gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    for holder in ({"host": "elsewhere", "pid": 1, "expires": time.time() - 1},
                   {"host": socket.gethostname(), "pid": dead.pid, "expires": time.time() + 3600}):  # fmt: skip
        s3.fs().pipe(lease, json.dumps(holder).encode())
        started, epochs = time.monotonic(), epochs + 1
        done = _run([*command, f"--trainer.max_epochs={epochs}"], tmp_path, env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert time.monotonic() - started < 120  # taken over at once, not after an hour
    # Later starts' best checkpoints replaced each other, never the first start's (Lightning #21813 on object stores).
    assert first <= set(s3.fs().find(f"{root[5:]}/lightning_logs/r/checkpoints")), first


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
def test_ddp_on_s3_rank_zero_writes_and_a_stop_in_a_later_epoch_continues_bit_for_bit(s3: S3, tmp_path: Path) -> None:
    root = f"{s3.bucket()}/runs"
    ddp = [*FIT[:3], "--config", CONFIGS / "ddp_cpu.yaml", *FIT[3:]]  # FIT's steps, epochs and logging
    local = tmp_path / "local"
    local.mkdir()
    done = _run(ddp, local, cli_env() | {"MASTER_PORT": str(_free_port())})  # uninterrupted, on the disk
    assert done.returncode == 0, done.stderr[-3000:]
    uninterrupted = _training_state(torch.load(local / "lightning_logs/r/checkpoints/last.ckpt", weights_only=True))
    env = _env(s3, tmp_path, MASTER_PORT=str(_free_port()))
    command = [*ddp, f"--trainer.default_root_dir={root}"]
    proc = _start([*command, *_paced(tmp_path)], tmp_path, env)
    _wait_for(lambda: _steps(tmp_path) >= STEPS // 2 + 3, "a step in the second epoch")
    os.killpg(proc.pid, signal.SIGTERM)
    assert finish(proc, WAIT) == 143, (tmp_path / "run.log").read_text()[-3000:]
    done = _run(command, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {root}/lightning_logs/r/checkpoints/interrupted.ckpt (epoch 1," in done.stderr + done.stdout
    _assert_exact(s3, root, uninterrupted)
    starts = json.loads(s3.fs().cat(f"{root[5:]}/lightning_logs/r/provenance.json"))["starts"]
    assert [(s["world_size"], s["status"]) for s in starts] == [(2, "interrupted"), (2, "finished")], starts


@pytest.mark.slow
@pytest.mark.timeout(4 * WAIT)
@pytest.mark.skipif(postgres_binaries() is None, reason="PostgreSQL is not installed (apt-get install postgresql)")
def test_a_sweep_keeps_its_trial_folders_on_s3_and_its_study_in_postgresql(s3: S3, tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")

    root = f"{s3.bucket()}/runs"
    with postgres() as url:
        (tmp_path / "s.yaml").write_text(
            f"sweep:\n  name: s\n  n_trials: 2\n  pruner: none\n  storage: {url}\n  space:\n"
            "    model.optimizer.init_args.lr: {type: categorical, choices: [0.01, 0.003]}\n"
        )
        tiny = [a for a in FIT if a not in ("fit", "--run.name=r")]
        done = _run(["sweep", *tiny, "--config", tmp_path / "s.yaml", f"--trainer.default_root_dir={root}"], tmp_path,
                    _env(s3, tmp_path))  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        study = optuna.load_study(study_name="s", storage=url)
        assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    fs, sweep = s3.fs(), f"{root[5:]}/lightning_logs/s"
    for trial in ("trial-0000", "trial-0001"):
        assert fs.cat(f"{sweep}/{trial}/checkpoints/newest") == b"last.ckpt"
        assert fs.exists(f"{sweep}/{trial}/metrics.csv") and fs.exists(f"{sweep}/{trial}.yaml")
    assert fs.exists(f"{sweep}/trials.csv") and fs.exists(f"{sweep}/best.yaml")


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
def test_the_commands_that_read_a_checkpoint_read_it_on_s3(s3: S3, tmp_path: Path) -> None:
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path)
    assert _run([*FIT, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=1"], tmp_path, env).returncode == 0
    last = f"{root}/lightning_logs/r/checkpoints/last.ckpt"
    evaluate = ["--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--trainer.limit_test_batches=2",
                "--trainer.limit_predict_batches=2", "--ckpt_path", last]  # fmt: skip
    tested = _run(["test", *evaluate], tmp_path, env)
    assert tested.returncode == 0 and "test_acc" in tested.stdout, tested.stderr[-3000:]
    predicted = _run(["predict", *evaluate], tmp_path, env)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert list(tmp_path.glob("lightning_logs/predict/version_*/predictions.csv"))  # a checkpoint outside a run here
    exported = _run(["export", last], tmp_path, env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.startswith(f"Wrote {root}/lightning_logs/r/checkpoints/last.pt")
    with s3.fs().open(f"{root[5:]}/lightning_logs/r/checkpoints/last.pt", "rb") as f:
        assert all(isinstance(v, torch.Tensor) for v in torch.load(f, weights_only=True).values())


MISTAKES = {
    "no such bucket": (["--trainer.default_root_dir=s3://no-such-bucket/runs"], 2, "bucket 'no-such-bucket' does"),
    "unknown protocol": (["--trainer.default_root_dir=nope://b/runs"], 2, "Protocol not known: nope"),
    "no run name": (["--trainer.default_root_dir={root}", "--run.name=null"], 2, "needs a name (--run.name"),
    "save_last link": (["--trainer.default_root_dir={root}", "--checkpoint.save_last=link"], 2, "symbolic link"),
    "fsdp": (["--config", str(CONFIGS / "fsdp_cpu.yaml"), "--trainer.default_root_dir={root}"], 2, "folder of shards"),
    "checkpoint dirpath": (["--checkpoint.dirpath={root}/ckpts"], 2, "set trainer.default_root_dir there instead"),
    "secret in options": (
        ["--trainer.default_root_dir={root}", '--run.storage_options={"secret": "x"}'],
        2,
        "holds secret: credentials",
    ),
    "no credentials": (["--trainer.default_root_dir={root}"], 2, "credentials for s3://"),
    "unreachable": (["--trainer.default_root_dir={root}"], 3, "check that the store is reachable"),
}


@pytest.fixture
def in_process(s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The command line run in this process (``run_main``) against the server, temporary files under tmp_path."""
    import multiprocessing.util
    import tempfile

    import fsspec.config

    # multiprocessing makes its folder once per process, in tempfile's: made under tmp_path, its sockets' paths would
    # pass AF_UNIX's limit and every later DataLoader worker of this pytest process would hang unable to send a batch.
    multiprocessing.util.get_temp_dir()
    (tmp_path / "tmp").mkdir()
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3.endpoint})
    return s3


def test_the_pointer_moves_only_after_the_logs_written_before_its_checkpoint(
    in_process: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The uploader held on its first file, so that the rest queues up as it does behind a slow store: metrics.csv
    # queued, then a checkpoint, then metrics.csv written again (the checkpoint's own step, which Lightning logs
    # after the batch-end hooks that save it). A kill once the pointer names the checkpoint must find on the store
    # every row written before it.
    from template.engine.runs.remote import RemoteRoot

    remote = RemoteRoot(f"{in_process.bucket()}/runs")
    run = remote.local / "lightning_logs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    held, uploads = threading.Event(), []
    put_file, pipe_file = remote.fs._put_file, remote.fs._pipe_file

    async def put(local: str, key: str, **kwargs: object) -> None:
        await asyncio.to_thread(held.wait, 60)
        uploads.append((Path(local).name, Path(local).read_text()))
        await put_file(local, key, **kwargs)

    async def pipe(key: str, value: bytes, **kwargs: object) -> None:
        uploads.append((key.rsplit("/", 1)[-1], value.decode()))
        await pipe_file(key, value, **kwargs)

    monkeypatch.setattr(remote.fs, "_put_file", put)  # the uploads' requests, on fsspec's event loop
    monkeypatch.setattr(remote.fs, "_pipe_file", pipe)
    try:
        (run / "hparams.yaml").write_text("{}\n")
        remote.sync(run)  # the upload held
        (run / "metrics.csv").write_text("step\n0\n1\n2\n")
        remote.sync(run)
        (run / "checkpoints" / "last.ckpt").write_text("step 3")
        remote.push(run / "checkpoints" / "last.ckpt", newest=True)
        (run / "metrics.csv").write_text("step\n0\n1\n2\n3\n")
        remote.sync(run)
        held.set()
        remote.flush()
    finally:
        held.set()
        remote.close()
    names = [name for name, _ in uploads]
    pointer = names.index("newest")
    assert "metrics.csv" in names[:pointer], uploads
    assert uploads[names.index("metrics.csv")][1].startswith("step\n0\n1\n2\n"), uploads
    assert names[names.index("last.ckpt") + 1] == "newest" and uploads[pointer][1] == "last.ckpt", uploads


def test_a_fenced_run_cancels_its_own_requests_and_nobody_elses(
    in_process: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its lease lost, the run cancels its upload under way at once; fsspec's event loop is the whole process's, and
    # what else runs on it (the user's own s3fs work, a later command's requests) goes on as if nothing happened.
    from template.engine.errors import DiskError
    from template.engine.runs.remote import RemoteRoot

    bucket = in_process.bucket()
    remote = RemoteRoot(f"{bucket}/runs")
    started, cancelled = threading.Event(), threading.Event()

    async def stuck(*args: object, **kwargs: object) -> None:
        started.set()
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def theirs() -> str:
        await asyncio.sleep(3)
        return "still running"

    monkeypatch.setattr(remote.fs, "_put_file", stuck)
    (remote.local / "r").mkdir()
    (remote.local / "r" / "metrics.csv").write_text("step\n0\n")
    try:
        remote.sync(remote.local / "r")
        assert started.wait(timeout=60)
        other = asyncio.run_coroutine_threadsafe(theirs(), remote.fs.loop)
        remote.fence(DiskError("lease lost"))
        assert cancelled.wait(timeout=10)
        with pytest.raises(DiskError, match="lease lost"):
            remote.flush()
        assert other.result(timeout=30) == "still running"
    finally:
        remote.close()
    assert in_process.fs().find(bucket.removeprefix("s3://")) == []  # nothing written


@pytest.mark.parametrize("case", MISTAKES, ids=list(MISTAKES))
def test_each_mistake_is_one_line_before_anything_is_written(
    in_process: S3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_main,
    case: str,  # noqa: ANN001
) -> None:
    import fsspec.config

    args, code, expected = MISTAKES[case]
    bucket = in_process.bucket()
    if case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("HOME", str(tmp_path / "tmp"))  # no ~/.aws there
    if case == "unreachable":
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{_free_port()}"})
    started = time.monotonic()
    done = run_main(*FIT, *(a.replace("{root}", f"{bucket}/runs") for a in args))
    line = _one_error(done, code)
    assert expected in line, line
    assert time.monotonic() - started < 60  # a store that does not answer is given up on in bounded time
    assert in_process.fs().find(bucket.removeprefix("s3://")) == []  # nothing written there
    assert {p.name for p in tmp_path.iterdir()} == {"tmp"} and not list((tmp_path / "tmp").iterdir())


def test_a_store_that_ignores_conditional_writes_is_refused(
    in_process: S3,
    monkeypatch: pytest.MonkeyPatch,
    run_main,  # noqa: ANN001
) -> None:
    import s3fs

    pipe = s3fs.S3FileSystem._pipe_file

    async def ignoring(self, path, data, *args, mode="overwrite", **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return await pipe(self, path, data, *args, **kwargs)  # If-None-Match dropped, as some stores do

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", ignoring)
    bucket = in_process.bucket()
    line = _one_error(run_main(*FIT, f"--trainer.default_root_dir={bucket}/runs"), 2)
    assert "ignores conditional writes (If-None-Match)" in line and bucket in line, line


@pytest.mark.slow
def test_refused_credentials_are_one_line(s3: S3, tmp_path: Path) -> None:
    # A server of its own that checks keys (moto's INITIAL_NO_AUTH_ACTION_COUNT): the test's key is unknown there.
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", f"from moto.server import ThreadedMotoServer as S; import time; s = S(ip_address="
         f"'127.0.0.1', port={port}, verbose=False); s.start(); time.sleep(600)"],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, start_new_session=True,
    )  # fmt: skip
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, "the server", timeout=60)
        done = _run([*FIT, "--trainer.default_root_dir=s3://any/runs"], tmp_path, _env(s3, tmp_path, endpoint))
        line = _one_error(done, 2)
        assert "credentials for s3://any/runs are missing or refused" in line and S3_SECRET not in done.stderr, line
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def test_without_s3fs_the_line_names_the_extra(s3: S3, tmp_path: Path) -> None:
    (tmp_path / "nos3fs").mkdir()
    (tmp_path / "nos3fs" / "s3fs.py").write_text("raise ImportError('No module named s3fs')\n")
    env = _env(s3, tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "nos3fs"), env["PYTHONPATH"]])
    line = _one_error(_run([*FIT, f"--trainer.default_root_dir={s3.bucket()}/runs"], tmp_path, env), 2)
    assert "needs s3fs: pip install -e '.[s3]'" in line, line


@pytest.mark.parametrize("storage", ["null", "s3"])
def test_a_sweep_refuses_a_journal_on_object_storage(in_process: S3, tmp_path: Path, run_main, storage: str) -> None:  # noqa: ANN001
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    bucket = in_process.bucket()
    journal = f"{bucket}/study.journal" if storage == "s3" else "null"
    (tmp_path / "s.yaml").write_text(
        f"sweep:\n  name: s\n  storage: {journal}\n  space:\n"
        "    model.optimizer.init_args.lr: {type: categorical, choices: [0.01, 0.003]}\n"
    )
    root = f"{bucket}/runs" if storage == "null" else "."
    done = run_main(
        "sweep", "--config", CONFIGS / "default.yaml", "--config", "s.yaml", f"--trainer.default_root_dir={root}"
    )
    line = _one_error(done, 2)
    assert "does not have; keep the study in a database" in line and "postgresql://" in line, line
    assert in_process.fs().find(bucket.removeprefix("s3://")) == []


@pytest.mark.slow
@pytest.mark.timeout(4 * WAIT)
def test_the_store_gone_mid_run_is_one_line_and_the_next_start_continues(
    s3: S3, tmp_path: Path, uninterrupted: dict
) -> None:
    host, port = s3.endpoint.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path, endpoint=relay.endpoint)
    command = [*FIT, f"--trainer.default_root_dir={root}", "--run.save_every_n_steps=3"]
    proc = _start([*command, *_paced(tmp_path)], tmp_path, env)
    _wait_for(lambda: s3.fs().exists(f"{root[5:]}/lightning_logs/r/checkpoints/newest"), "the first upload")
    relay.cut()
    code = finish(proc, WAIT)
    log = (tmp_path / "run.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 3 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert "check that the store is reachable" in errors[0] and "run the same command again" in errors[0], errors[0]
    relay.restore()
    done = _run(command, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_exact(s3, root, uninterrupted)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_of(log: str, code: int, expected: str, exit_code: int) -> str:
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert exit_code == code and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert expected in errors[0], errors[0]
    return errors[0]


@pytest.mark.slow
@pytest.mark.timeout(4 * WAIT)
def test_a_start_cut_off_from_the_store_stops_writing_before_another_takes_the_run_over(
    s3: S3, tmp_path: Path, uninterrupted: dict
) -> None:
    # The first start runs on another host (tests/other_host) through a relay. Cut off from the store while its
    # training is held, it cannot renew its lease: it says so once, and 45 s after its last renewal it fences itself
    # off the store, before a second start may take the lease over (when it expires, 60 s after that renewal). The
    # relay restored and its training let go, the first writes nothing more; the second continued the run bit for bit.
    host, port = s3.endpoint.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))
    root, hold = f"{s3.bucket()}/runs", tmp_path / "hold"
    run = f"{root[5:]}/lightning_logs/r"
    command = [*FIT, f"--trainer.default_root_dir={root}", "--run.save_every_n_steps=3"]
    env = _env(s3, tmp_path, endpoint=relay.endpoint, OTHER_HOST="elsewhere")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "other_host"), env["PYTHONPATH"]])
    first = _start([*command, *_paced(tmp_path, hold=hold)], tmp_path, env)
    _wait_for(lambda: s3.fs().exists(f"{run}/checkpoints/newest"), "the first upload")
    hold.touch()  # the first's training waits at its next step's end
    time.sleep(3)
    relay.cut()
    assert json.loads(s3.fs().cat(f"{run}/lease.json"))["host"] == "elsewhere"
    second = _run(command, tmp_path, _env(s3, tmp_path))  # waits for the lease to expire, then continues the run
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_exact(s3, root, uninterrupted)
    relay.restore()
    seen = len(relay.requests)
    hold.unlink()
    code = finish(first, WAIT)
    log = (tmp_path / "run.log").read_text()
    _one_line_of(log, code, f"its lease {root}/lightning_logs/r/lease.json was not renewed for 45 s", 75)
    assert len([line for line in log.splitlines() if line.startswith("warning: cannot renew the lease")]) == 1, log
    assert relay.requests[seen:] == [], relay.requests[seen:]  # nothing written, nothing even read
    _assert_exact(s3, root, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(4 * WAIT)
def test_a_store_that_stops_answering_ends_the_run_within_its_bound_and_the_next_start_continues(
    s3: S3, tmp_path: Path, uninterrupted: dict
) -> None:
    # The relay holds every connection open and answers nothing: the run's lease is not renewed, and 45 s after its
    # last renewal the run stops with one line; its newest uploaded checkpoint is whole. A start meanwhile gives up on
    # the store after one request's bounded retries (3 attempts, each answered within 15 s); once the store answers
    # again the same command continues bit for bit.
    host, port = s3.endpoint.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))
    root = f"{s3.bucket()}/runs"
    pointer = f"{root[5:]}/lightning_logs/r/checkpoints/newest"
    env = _env(s3, tmp_path, endpoint=relay.endpoint)
    command = [*FIT, f"--trainer.default_root_dir={root}", "--run.save_every_n_steps=3"]
    proc = _start([*command, *_paced(tmp_path)], tmp_path, env)
    _wait_for(lambda: s3.fs().exists(pointer), "the first upload")
    relay.stall()
    stalled = time.monotonic()
    code = finish(proc, WAIT)
    seconds = time.monotonic() - stalled
    log = (tmp_path / "run.log").read_text()
    _one_line_of(log, code, "was not renewed for 45 s", 75)
    assert seconds < 45 + 15, seconds
    newest = s3.fs().cat(pointer).decode()
    step = _checkpoint(s3, f"{root}/lightning_logs/r/checkpoints/{newest}")["global_step"]  # whole: it loads
    started = time.monotonic()
    stuck = _run(command, tmp_path, env)
    waited = time.monotonic() - started
    assert "check that the store is reachable" in _one_error(stuck, 3)
    assert waited < 90, waited
    relay.restore()
    done = _run(command, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"/checkpoints/{newest} (epoch 0, step {step})" in done.stderr + done.stdout, done.stderr[-3000:]
    _assert_exact(s3, root, uninterrupted)
    print(f"\nstore stalled: the run ended {seconds:.1f} s later (exit 75); a start gave up after {waited:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(4 * WAIT)
def test_a_signal_while_the_last_uploads_run_stops_nothing_and_a_second_ends_the_run_at_once(
    s3: S3, tmp_path: Path, uninterrupted: dict
) -> None:
    # Uploads of last.ckpt take 30 s (tests/slow_uploads): training has ended and the command waits for them when a
    # SIGTERM comes to the whole group. It stops nothing (the uploads go on); a second one ends the run at once, in one
    # line, and the same command continues from the newest checkpoint whose upload completed.
    root = f"{s3.bucket()}/runs"
    env = _env(s3, tmp_path, SLOW_UPLOADS="last.ckpt", SLOW_UPLOADS_LOG=str(tmp_path / "uploads.txt"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "slow_uploads"), env["PYTHONPATH"]])
    command = [*FIT, f"--trainer.default_root_dir={root}"]
    proc = _start(command, tmp_path, env)
    _wait_for(lambda: "Best checkpoint:" in (tmp_path / "run.log").read_text(), "the end of training")
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(3)
    assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]  # the first stopped nothing
    os.killpg(proc.pid, signal.SIGTERM)
    code = finish(proc, 60)
    log = (tmp_path / "run.log").read_text()
    assert code == 143 and "Traceback" not in log, log[-3000:]
    assert "Stopping at once on a second SIGTERM" in log and "uploads may not be" in log, log[-3000:]
    done = _run(command, tmp_path, _env(s3, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_exact(s3, root, uninterrupted)
