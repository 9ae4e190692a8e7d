"""The run's name and folder, its newest checkpoint, and logs that continue without repeating a step."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from template.engine.errors import ConfigError
from template.engine.logs.loggers import ResumableCSVLogger
from template.engine.resume.continuation import continue_run
from template.engine.runs.folder import RunFolders, newest, run_name


@pytest.mark.parametrize(
    "configured,environ,expected",
    [
        ("exp-1", {"SLURM_JOB_ID": "5"}, "exp-1"),  # the configured name wins over the scheduler's
        ("s/trial-0003/fold-1", {}, "s/trial-0003/fold-1"),  # a fold of a sweep's trial (sweep --cv.folds)
        (None, {"SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "train"}, "slurm-5"),
        (None, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "2"}, "slurm-6_2"),
        (None, {"SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "bash"}, None),  # an interactive allocation is no run
        (None, {"TORCHELASTIC_RUN_ID": "abc"}, "torchrun-abc"),
        (None, {"TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun's default id names no run
        (None, {}, None),
    ],
)
def test_run_name(configured: str | None, environ: dict[str, str], expected: str | None) -> None:
    assert run_name(configured, environ) == expected


@pytest.mark.parametrize("bad", ["../x", "a/b/c/d", "a/", "a/..", "..", "", "-x"])
def test_a_run_name_that_is_not_a_folder_name_is_one_line(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"run.name=.* is not a folder name; use letters, digits"):
        run_name(bad, {})


def test_a_sweep_trial_is_a_run_one_level_down() -> None:
    assert run_name("digits-lr/trial-0003", {}) == "digits-lr/trial-0003"


def test_newest_checkpoint_prefers_the_latest_then_last(tmp_path: Path) -> None:
    assert newest([tmp_path / "missing"]) is None
    for age, name in enumerate(["interrupted.ckpt", "last.ckpt", "best-0.ckpt", "last-step.ckpt"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1_700_000_000 - age, 1_700_000_000 - age))
    assert newest([tmp_path]) == str(tmp_path / "interrupted.ckpt")
    os.utime(tmp_path / "last.ckpt", (1_700_000_000, 1_700_000_000))
    assert newest([tmp_path]) == str(tmp_path / "last.ckpt")


def test_resumed_csv_log_keeps_rows_before_the_first_new_step(tmp_path: Path) -> None:
    first = ResumableCSVLogger(save_dir=tmp_path, name="logs", version="run")
    for step in range(6):
        first.log_metrics({"loss": float(step)}, step)
    first.finalize("success")
    resumed = ResumableCSVLogger(save_dir=tmp_path, name="logs", version="run", resume=True)
    resumed.log_hyperparams({"lr": 0.1})
    # Nothing logged yet: the interrupted run's rows are still all on disk.
    with (tmp_path / "logs" / "run" / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(6))
    for step in (4, 5, 6):
        resumed.log_metrics({"loss": 10.0 + step, "acc": 0.5}, step)
    resumed.finalize("success")
    with (tmp_path / "logs" / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert [float(r["loss"]) for r in rows] == [0, 1, 2, 3, 14, 15, 16]


def test_a_killed_runs_forked_workers_do_not_keep_its_folder_locked(tmp_path: Path) -> None:
    """A run SIGKILLed while its DataLoader workers (forked children) live on: the same command at once claims the
    folder (before: "already running in another process" until the workers noticed, up to 5 s later)."""
    script = (
        "import multiprocessing, os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from template.engine.runs.folder import RunFolders\n"
        "folders = RunFolders()\n"
        "folders.claim(sys.argv[1], 'r', '--run.name')\n"
        "worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,))\n"
        "worker.start()\n"
        "Path(sys.argv[2]).write_text(str(worker.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    folder, pid_file = tmp_path / "r", tmp_path / "worker.pid"
    # No pipes: the worker would hold them open, and waiting for their end would wait for the worker.
    killed = subprocess.Popen(
        [sys.executable, "-c", script, str(folder), str(pid_file)], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    assert killed.wait(timeout=120) == -signal.SIGKILL
    worker = int(pid_file.read_text())
    folders = RunFolders()
    try:
        os.kill(worker, 0)  # the worker still runs
        folders.claim(folder, "r", "--run.name")  # a ConfigError if the folder were still locked
        assert folders.lock is not None
    finally:
        folders.release()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_a_negative_preemption_check_interval_is_one_line(run_main) -> None:  # noqa: ANN001
    from jsonargparse import Namespace

    done = run_main("fit", "--run.preemption_check_interval=-1")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert (
        "'run.preemption_check_interval'" in errors[0] and "-1" in errors[0] and "expected a value >= 0" in errors[0]
    ), errors[0]
    assert continue_run(Namespace(run=Namespace(preemption_check_interval=0.0))).preemption_check_interval == 0.0
