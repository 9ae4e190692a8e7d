"""How a run was made: provenance.json in the run folder, one entry per start, and git state without failing."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from template.engine.runs import read_starts
from template.engine.runs.provenance import _this_process, exit_status, git_state
from tests.conftest import CONFIGS, REPO

SHORT = ("--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false")
SHORT += ("--trainer.enable_model_summary=false", "--trainer.accelerator=cpu", "--run.name=r")

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, timeout=30,
                   capture_output=True)  # fmt: skip


@needs_git
def test_git_state_names_the_commit_and_the_uncommitted_diff(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "first")
    clean = git_state(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False and clean["diff"] == ""
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")
    dirty = git_state(tmp_path)
    assert dirty["commit"] == clean["commit"] and dirty["dirty"] is True
    assert "-x = 1\n+x = 2" in dirty["diff"] and dirty["modified"] == ["a.py"] and dirty["untracked"] == ["new.py"]


@needs_git
def test_git_state_lists_the_whole_repositorys_files_from_the_engines_folder(tmp_path: Path) -> None:
    """The engine asks git from its own folder; a user's new model and edited config elsewhere are listed as well."""
    engine = tmp_path / "lab" / "engine" / "runs"
    engine.mkdir(parents=True)
    (engine / "provenance.py").write_text("")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default.yaml").write_text("model: {}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "first")
    (tmp_path / "configs" / "default.yaml").write_text("model: {lr: 0.1}\n")
    (tmp_path / "lab" / "my_model.py").write_text("class MyModel: ...\n")
    (tmp_path / "configs" / "mine.yaml").write_text("")
    state = git_state(engine)
    assert state["untracked"] == ["configs/mine.yaml", "lab/my_model.py"]
    assert state["dirty"] is True and "+model: {lr: 0.1}" in state["diff"]
    assert state["modified"] == ["configs/default.yaml"]


@needs_git
def test_git_state_outside_a_repository_does_not_fail(tmp_path: Path) -> None:
    state = git_state(tmp_path)
    assert state["commit"] is None and "not a git repository" in state["reason"]


def test_git_state_without_git_does_not_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    assert git_state(tmp_path) == {"commit": None, "reason": "git is not installed"}


def test_exit_status_says_which_signal_and_which_error() -> None:
    assert exit_status(None) == {"status": "finished"}
    stopped = SIGTERMException()
    stopped.code = 128 + signal.SIGUSR1  # what the Preemption callback sets for SLURM's requeue signal
    assert exit_status(stopped) == {"status": "interrupted", "signal": "SIGUSR1"}
    assert exit_status(SIGTERMException()) == {"status": "interrupted", "signal": "SIGTERM"}
    assert exit_status(KeyboardInterrupt()) == {"status": "interrupted", "signal": "SIGINT"}
    assert exit_status(ValueError("bad\n  value")) == {"status": "failed", "error": "ValueError: bad value"}


@pytest.mark.parametrize(
    ("world_size", "root", "parallel", "expected"),
    [
        (1, "cpu", None, ["cpu"]),  # a CPU run asks CUDA nothing, GPUs or not
        (2, "cpu", ["cpu", "cpu"], ["cpu"]),  # each ddp_cpu rank names its own
        (4, "cuda:3", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ["cuda:3 (GPU 3)"]),  # a ddp rank: its root device
        (1, "cuda:2", ["cuda:2", "cuda:0"], ["cuda:2 (GPU 2)", "cuda:0 (GPU 0)"]),  # dp: every device it drives
    ],
)
def test_each_process_names_the_devices_it_trains_on(monkeypatch, world_size, root, parallel, expected) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA's current device was asked"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU {torch.device(device).index}")
    devices = [torch.device(d) for d in parallel] if parallel else None
    strategy = SimpleNamespace(world_size=world_size, root_device=torch.device(root), parallel_devices=devices)
    assert _this_process(SimpleNamespace(strategy=strategy))["devices"] == expected


def test_a_record_that_cannot_be_read_is_shown_as_none_and_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "provenance.json").mkdir()  # unreadable as a file, whoever runs the test
    assert read_starts(tmp_path) == []  # the runs table shows "-"
    with pytest.raises(IsADirectoryError):
        read_starts(tmp_path, writing=True)  # a new start fails rather than write a record over it
    (tmp_path / "provenance.json").rmdir()
    assert read_starts(tmp_path, writing=True) == []  # none yet: a new record


def test_each_start_of_a_run_is_appended(run_main, tmp_path: Path) -> None:
    for epochs in (1, 2):
        result = run_main("fit", "--config", CONFIGS / "default.yaml", *SHORT, f"--trainer.max_epochs={epochs}")
        assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "r"
    first, second = json.loads((folder / "provenance.json").read_text())["starts"]
    assert [first["status"], second["status"]] == ["finished", "finished"]
    assert [(first["epochs"], first["steps"]), (second["epochs"], second["steps"])] == [(1, 3), (2, 6)]
    # In process the command line is the one that started the interpreter (here pytest's).
    assert second["command"] == shlex.join(sys.orig_argv) and first["start"] <= second["start"] <= second["end"]
    assert second["python"] == ".".join(map(str, sys.version_info[:3]))
    assert second["packages"]["lightning"].startswith("2.") and second["torch"]["version"]
    assert (second["world_size"], second["num_nodes"], second["devices"]) == (1, 1, ["cpu"])
    assert second["hosts"] and second["seconds"] > 0
    git = second["git"]
    if git["commit"] is None:  # a new project before its first commit, or no git
        assert git["reason"]
        return
    assert len(git["commit"]) == 40
    # The diff beside it is what `git diff HEAD` shows for the code that ran.
    repo = REPO
    diff = subprocess.run(["git", "diff", "HEAD", "--no-color", "--no-ext-diff"], cwd=repo, capture_output=True,
                          text=True, timeout=30).stdout  # fmt: skip
    assert git["dirty"] is bool(diff)
    if diff:
        assert (folder / git["diff_file"]).read_text() == diff
        assert git["diff_file"] == "git-2.diff"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_run_records_every_process_and_tests_after_fit_with_ema(run_cli, tmp_path: Path) -> None:
    # Rank 0 writes; every rank takes part in the collectives behind the run folder's name and the host list.
    result = run_cli(
        "fit", "--config", CONFIGS / "ddp_cpu.yaml", *SHORT, "--trainer.max_epochs=2", "--test_after_fit=true",
        "--ema.decay=0.9", "--trainer.limit_test_batches=2", timeout=540,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "r"
    (start,) = json.loads((folder / "provenance.json").read_text())["starts"]
    assert (start["status"], start["world_size"], start["devices"], start["steps"]) == ("finished", 2, ["cpu"] * 2, 6)
    assert start["strategy"] == "DDPStrategy" and len(start["hosts"]) == 1
    results = json.loads((folder / "test-results.json").read_text())
    assert Path(results["checkpoint"]).name.startswith("best-") and "test_acc" in results["results"][0]
    # EMA under DDP: one update per optimizer step. (Lightning 2.6 rewrites last.ckpt only when a top-k checkpoint
    # is saved in the same step, so it may be an earlier step's.)
    for path in (folder / "checkpoints").glob("*.ckpt"):
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint["averaging_state"]["n_averaged"] == checkpoint["global_step"] > 0, path.name
