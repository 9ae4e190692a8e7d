"""``python -m template runs``: a finished, an interrupted and a failed run, each with its status, in one table."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env, finish

WAIT = 180  # seconds for any one child; a short run here takes 10-30 s on a busy machine
SHORT = [
    "--trainer.accelerator=cpu", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--trainer.enable_model_summary=false",
]  # fmt: skip


def _fit(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    env = cli_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "default.yaml"), *SHORT]
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen(
        [*command, f"--run.name={name}", *extra], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _wait(proc: subprocess.Popen) -> int:
    return finish(proc, WAIT, "a run")


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run, a run stopped by SIGTERM, and a run whose module raised, side by side (run concurrently)."""
    tmp_path = tmp_path_factory.mktemp("runs")
    finished = _fit(tmp_path, "finished", "--trainer.max_epochs=2", "--model.optimizer.init_args.lr=0.01")
    marker = "--trainer.callbacks+=step_marker.StepMarker"
    interrupted = _fit(tmp_path, "interrupted", "--trainer.max_epochs=50", marker, "--trainer.callbacks.path=steps.txt")
    failed = _fit(
        tmp_path, "failed", "--trainer.max_epochs=2", "--trainer.callbacks+=failure_plant.PlantedFailure",
        "--trainer.callbacks.mode=raise", "--trainer.callbacks.rank=0", f"--trainer.callbacks.record_dir={tmp_path}",
    )  # fmt: skip
    deadline = time.monotonic() + WAIT
    while not (tmp_path / "steps.txt").is_file() or len((tmp_path / "steps.txt").read_text().splitlines()) < 3:
        assert interrupted.poll() is None and time.monotonic() < deadline, (tmp_path / "interrupted.log").read_text()
        time.sleep(0.1)
    interrupted.send_signal(signal.SIGTERM)
    assert _wait(finished) == 0, (tmp_path / "finished.log").read_text()[-3000:]
    assert _wait(interrupted) == 128 + signal.SIGTERM, (tmp_path / "interrupted.log").read_text()[-3000:]
    assert _wait(failed) == 1, (tmp_path / "failed.log").read_text()[-3000:]
    return tmp_path


@pytest.mark.slow  # three training subprocesses
def test_runs_table_shows_each_status(three_runs: Path, run_cli) -> None:
    result = run_cli("runs", "--csv", "runs.csv", cwd=three_runs)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["run"]: row for row in csv.DictReader((three_runs / "runs.csv").open())}
    assert set(rows) == {"finished", "interrupted", "failed"}
    assert rows["finished"]["status"] == "finished"
    assert rows["interrupted"]["status"] == "interrupted (SIGTERM)"
    assert rows["failed"]["status"] == "failed (RuntimeError: planted failure on rank 0)"
    # Epochs and steps as the trainer counted them; the best value as metrics.csv has it.
    assert (rows["finished"]["epochs"], rows["finished"]["steps"]) == ("2", "12")
    assert (rows["failed"]["epochs"], rows["failed"]["steps"]) == ("0", "2")
    val_acc = [float(r["val_acc"]) for r in csv.DictReader((three_runs / "lightning_logs/finished/metrics.csv").open())
               if r["val_acc"]]  # fmt: skip
    assert rows["finished"]["best"] == f"val_acc={max(val_acc):.4g}"
    assert rows["failed"]["best"] == "-"  # it failed before its first validation
    # The config keys that differ between the runs, and only those.
    assert rows["finished"]["model.init_args.optimizer.init_args.lr"] == "0.01"
    assert rows["interrupted"]["model.init_args.optimizer.init_args.lr"] == "0.001"
    assert rows["interrupted"]["trainer.max_epochs"] == "50"
    assert "trainer.limit_train_batches" not in rows["finished"]
    assert all(row["duration"] != "-" for row in rows.values())
    (start,) = json.loads((three_runs / "lightning_logs/interrupted/provenance.json").read_text())["starts"]
    assert start["command"].startswith(f"{sys.executable} -m {PACKAGE} fit --config")
    # The printed table holds the same.
    lines = result.stdout.splitlines()
    assert lines[0].split()[:7] == ["run", "status", "best", "epochs", "steps", "duration", "samples/s"]
    assert any(line.startswith("interrupted") and "interrupted (SIGTERM)" in line for line in lines)


@pytest.mark.slow  # shares the three training subprocesses above
def test_runs_reads_files_without_importing_torch(three_runs: Path) -> None:
    code = (
        "import sys; from template.engine.runs.table import main; main([sys.argv[1]]); "
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'heavy import'"
    ).replace("template", PACKAGE)
    done = subprocess.run(
        [sys.executable, "-c", code, str(three_runs)], capture_output=True, text=True, timeout=60, env=cli_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed (RuntimeError: planted failure on rank 0)" in done.stdout


@pytest.mark.slow  # a training subprocess killed mid-run
def test_a_killed_run_shows_killed(tmp_path: Path, run_cli) -> None:
    run = tmp_path / "lightning_logs" / "gone"
    run.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    import socket

    start = {"start": "2026-01-01T00:00:00+00:00", "end": None, "status": "running", "pid": dead.pid}
    (run / "provenance.json").write_text(json.dumps({"starts": [{**start, "hosts": [socket.gethostname()]}]}))
    result = run_cli("runs", tmp_path / "lightning_logs")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].split()[:2] == ["gone", "killed"]


def test_runs_on_a_missing_folder_is_one_line(run_cli, tmp_path: Path) -> None:
    result = run_cli("runs", tmp_path / "nowhere")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: '{tmp_path / 'nowhere'}' is not a folder; pass the folder "
                                                  "that holds lightning_logs/"]  # fmt: skip


@pytest.mark.parametrize(
    "damage",
    [b"\x00\xff\xfe binary junk \x89PNG\r\n\x1a\n", b"epoch,step,val_acc\n0,3,0.5\n0,4,0.", b"\xff\xfe,,,\n1,2\n",
     b"epoch,step,val_acc\n0,three,0.5\n0,4,0.75\n"],
    ids=["binary", "truncated-row", "bad-header", "non-numeric-step"],
)  # fmt: skip
def test_runs_shows_a_run_whose_metrics_csv_is_damaged(tmp_path: Path, capsys, damage: bytes) -> None:  # noqa: ANN001
    from template.engine.runs.table import main

    run = tmp_path / "lightning_logs" / "damaged"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_bytes(damage)
    (run / "config.yaml").write_text("checkpoint:\n  monitor: val_acc\n  mode: max\n")
    main([str(tmp_path), "--csv", str(tmp_path / "runs.csv")])
    (row,) = csv.DictReader((tmp_path / "runs.csv").open())
    assert row["run"] == "damaged"
    best = {b"0,three": "val_acc=0.75", b"0,4,0.": "val_acc=0.5"}  # what can be read of the damaged ones
    assert row["best"] == next((v for k, v in best.items() if k in damage), "-")


@pytest.mark.parametrize("target", ["afile/runs.csv", "afolder"], ids=["a-file-in-the-way", "a-folder"])
def test_an_unwritable_csv_is_one_line_and_leaves_files_as_they_were(tmp_path: Path, run_main, target: str) -> None:  # noqa: ANN001
    run = tmp_path / "lightning_logs" / "finished"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("epoch,step,val_acc\n0,3,0.5\n")
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "afolder").mkdir()
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    done = run_main("runs", str(tmp_path), "--csv", str(tmp_path / target))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 3 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(tmp_path / target) in errors[0] and "--csv" in errors[0], errors[0]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "afile").read_text() == "keep me"


def _run_folder(folder: Path, config: str, status: str | None = "finished") -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config)
    (folder / "metrics.csv").write_text("epoch,step,val_acc\n0,3,0.5\n1,7,0.75\n")
    if status:
        (folder / "provenance.json").write_text(json.dumps({"starts": [{"status": status, "epochs": 2, "steps": 8}]}))


@pytest.fixture
def runs_of_two_models(tmp_path: Path) -> Path:
    """Three runs of two models whose configs differ in long keys, and a validate of one's checkpoint."""
    optimizer = (
        "model:\n  class_path: {}\n  init_args:\n    optimizer:\n      init_args: {{lr: {}, betas: [0.9, 0.999]}}\n"
    )
    logs = tmp_path / "lightning_logs"
    for version, model, lr in [(2, "my_code.Regressor", 0.01), (10, "my_code.Regressor", 0.1), (1, "a.b.Other", 0.01)]:
        config = optimizer.format(model, lr) + "checkpoint: {monitor: val_acc, mode: max}\ntrainer: {max_epochs: 30}\n"
        _run_folder(logs / f"version_{version}", config, "interrupted" if version == 10 else "finished")
    _run_folder(logs / "version_2/validate/version_0", "checkpoint: {monitor: val_acc, mode: max}\n", status=None)
    return tmp_path


def test_runs_fit_the_terminal_and_list_evaluations_by_stage(runs_of_two_models: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    from template.engine.runs.table import main

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)  # a terminal 80 wide (a pipe gets every column)
    main([str(runs_of_two_models)])
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[-1].startswith("(") and "more columns: --wide shows them" in lines[-1]
    # In numeric order, each evaluation under the run of its checkpoint, by its stage; it trained no epochs.
    assert [line.split()[:2] for line in lines[2:-1]] == [
        ["version_1", "finished"], ["version_2", "finished"], ["version_2/validate/version_0", "validate"],
        ["version_10", "interrupted"],
    ]  # fmt: skip
    assert lines[4].split()[2:5] == ["val_acc=0.75", "-", "-"]
    main([str(runs_of_two_models), "--wide"])
    header = capsys.readouterr().out.splitlines()[0].split()
    assert "model.init_args.optimizer.init_args.lr" in header and "model.class_path" in header
    main([str(runs_of_two_models), "--columns", "run,lr,class_path", "--where", "status=fin*"])
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [
        ["run", "lr", "class_path"], ["---------", "----", "-----------------"],
        ["version_1", "0.01", "a.b.Other"], ["version_2", "0.01", "my_code.Regressor"],
    ]  # fmt: skip


def test_runs_csv_on_stdout_holds_whole_names_for_scripts(runs_of_two_models: Path, capsys) -> None:  # noqa: ANN001
    from template.engine.runs.table import main

    main([str(runs_of_two_models), "--csv", "-", "--where", "lr=0.01", "--where", "run=version_?"])
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert [row["run"] for row in rows] == ["version_1", "version_2"]
    assert {row["model.class_path"] for row in rows} == {"a.b.Other", "my_code.Regressor"}
    assert "model.init_args.optimizer.init_args.lr" not in rows[0]  # the same in both: not a difference


@pytest.mark.parametrize(
    ("option", "fragment"),
    [
        (["--columns", "run,lrr"], "--columns: no column 'lrr'"),
        (["--where", "lr"], "--where 'lr': give COLUMN=PATTERN"),
    ],
)
def test_a_column_that_does_not_exist_is_one_line(runs_of_two_models: Path, run_main, option, fragment) -> None:  # noqa: ANN001
    done = run_main("runs", str(runs_of_two_models), *option)
    assert done.returncode == 2 and done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr
    assert fragment in done.stderr and "Traceback" not in done.stderr


def test_test_metrics_are_columns(runs_of_two_models: Path, capsys) -> None:  # noqa: ANN001
    from template.engine.runs.table import main

    logs = runs_of_two_models / "lightning_logs"
    with (logs / "version_1" / "metrics.csv").open("a") as f:  # test_after_fit: in the run's own metrics.csv
        f.write("1,8,,0.875,0.25\n")
    (logs / "version_1" / "metrics.csv").write_text(
        (logs / "version_1" / "metrics.csv").read_text().replace("val_acc\n", "val_acc,test_f1,test_loss\n", 1)
    )
    _run_folder(logs / "version_2/test/version_0", "checkpoint: {monitor: val_acc, mode: max}\n", status=None)
    (logs / "version_2/test/version_0/metrics.csv").write_text("epoch,step,test_f1\n0,0,0.5\n")
    main([str(runs_of_two_models), "--csv", "-", "--where", "status=*"])
    rows = {row["run"]: row for row in csv.DictReader(capsys.readouterr().out.splitlines())}
    assert list(rows["version_1"])[7:9] == ["test_f1", "test_loss"]  # after the header's, before the config keys
    assert (rows["version_1"]["test_f1"], rows["version_1"]["test_loss"]) == ("0.875", "0.25")
    assert (rows["version_2/test/version_0"]["test_f1"], rows["version_2"]["test_f1"]) == ("0.5", "-")
    main([str(runs_of_two_models), "--columns", "run,test_f1", "--where", "test_f1=0.*"])
    assert [line.split() for line in capsys.readouterr().out.splitlines()[2:]] == [
        ["version_1", "0.875"], ["version_2/test/version_0", "0.5"],
    ]  # fmt: skip


def test_a_start_that_failed_before_training_is_listed_with_its_error(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from template.engine.runs.folder import RunFolders
    from template.engine.runs.table import main

    logs = tmp_path / "lightning_logs"
    _run_folder(logs / "again", "checkpoint: {monitor: val_acc, mode: max}\n")  # it trained 2 epochs, then failed
    for name in ("new", "again"):  # claimed, then the DataModule's setup failed: Provenance never started
        folders = RunFolders()
        folders.claim(logs / name, name, "--run.name")
        try:
            folders.failed(FileNotFoundError(2, "No such file or directory", "/data/train.csv"))
        finally:
            folders.release()
    main([str(tmp_path), "--csv", "-"])
    rows = {row["run"]: row for row in csv.DictReader(capsys.readouterr().out.splitlines())}
    error = "failed (FileNotFoundError: [Errno 2] No such file or directory: '/data/train.csv')"
    assert (rows["new"]["status"], rows["new"]["epochs"], rows["new"]["steps"]) == (error, "-", "-")
    assert (rows["again"]["status"], rows["again"]["epochs"], rows["again"]["steps"]) == (error, "2", "8")
    folders = RunFolders()
    folders.claim(logs / "new", "new", "--run.name")
    (logs / "new" / "provenance.json").write_text('{"starts": [{"status": "running"}, {"status": "running"}]}')
    folders.failed(RuntimeError("after its Provenance"))  # the start recorded itself: not recorded twice
    folders.release()
    assert len(json.loads((logs / "new" / "provenance.json").read_text())["starts"]) == 2
