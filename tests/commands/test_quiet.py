"""Quiet output: a fit, its resume and a sweep print no library warning a user cannot act on.

The runs are real commands with Python's default warning filters (``cli_env`` silences warnings for the other
tests), as a user starts them.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, TESTS, cli_env, pythonpath

FIT = [
    "fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]  # fmt: skip
# The lines the issue listed, each from a library and none the user's to act on.
NOISE = {
    "sweep": "LightningCLI's args parameter is intended to run from within Python",
    "periodic or interrupted checkpoint": "`weights_only` was not set",
    "resumed CSV logs": "Previous log files in this directory will be deleted",
    "resumed checkpoint folder": "exists and is not empty",
}
# A warning as Python prints it ("file.py:12: UserWarning: ...") or as Lightning does ("file.py:12: ...").
WARNING_LINE = re.compile(r"\.py:\d+: ")


def _user_env() -> dict[str, str]:
    # The runs mean the CPU: on a GPU machine Lightning rightly says "GPU available but not used" to a CPU run.
    env = cli_env(CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONWARNINGS")  # a user's shell sets none: Python's default filters apply
    return env


def _noise(output: str) -> list[str]:
    return [
        line
        for line in output.splitlines()
        if WARNING_LINE.search(line) or any(text in line for text in NOISE.values())
    ]


# Without loggers the same paths run, less the loggers' own files: in the slow suite.
@pytest.mark.parametrize("logger", ["default", pytest.param("none", marks=pytest.mark.slow)])
def test_a_fit_and_its_resume_print_no_library_warning(run_cli, tmp_path: Path, logger: str) -> None:  # noqa: ANN001
    extra = ["--run.name=quiet", "--run.save_every_n_steps=2"]
    extra += ["--trainer.logger=false"] if logger == "none" else []
    first = run_cli(*FIT, *extra, "--trainer.max_epochs=1", env=_user_env())
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(*FIT, *extra, "--trainer.max_epochs=2", env=_user_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    for done in (first, resumed):
        assert _noise(done.stdout + done.stderr) == []


@pytest.mark.slow  # a stop and its continuation: the fit and resume above are the fast suite's
def test_a_stopped_run_and_its_continuation_print_no_library_warning(run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    """A SIGTERM mid-epoch (interrupted.ckpt written), then the same command."""
    (tmp_path / "fault.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: {moment: train_batch, batch: 1}\n"
    )
    command = [*FIT, "--config", "fault.yaml", "--run.name=quiet", "--trainer.max_epochs=1"]
    env = _user_env()
    env["PYTHONPATH"] = pythonpath(TESTS)
    first = run_cli(*command, env=env)
    assert first.returncode == 143, first.stderr[-3000:]
    resumed = run_cli(*command, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "interrupted.ckpt" in resumed.stdout + resumed.stderr
    for done in (first, resumed):
        assert _noise(done.stdout + done.stderr) == []


def test_a_new_run_into_another_runs_checkpoint_folder_is_still_warned(run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    # Not a resume: this run would overwrite the other's last.ckpt, which the user can act on.
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "last.ckpt").write_bytes(b"another run's")
    done = run_cli(*FIT, "--trainer.max_epochs=1", "--checkpoint.dirpath=shared", env=_user_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in _noise(done.stderr) if "shared exists and is not empty" in line], done.stderr[-3000:]


def test_the_sweep_parses_trial_configs_without_the_args_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from template.engine.sweep.options import Configs

    # The sweep's process: its own command line in sys.argv, each trial's fit arguments given to LightningCLI.
    monkeypatch.setattr(sys, "argv", [PACKAGE, "sweep", "--config", str(CONFIGS / "sweep.yaml")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs = Configs(["--config", str(CONFIGS / "default.yaml")], {})
        config = configs.complete({"model.optimizer.init_args.lr": 0.01})
    assert config["model"]["init_args"]["optimizer"]["init_args"]["lr"] == 0.01
    assert [str(w.message) for w in caught if NOISE["sweep"] in str(w.message)] == []


@pytest.mark.slow  # a sweep process and its trial
def test_a_one_trial_sweep_prints_no_library_warning(run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    space = "    model.optimizer.init_args.lr: {type: categorical, choices: [0.01]}\n"
    (tmp_path / "s.yaml").write_text(f"sweep:\n  name: s\n  n_trials: 1\n  space:\n{space}")
    done = run_cli("sweep", *FIT[1:3], "--config", "s.yaml", *FIT[3:], "--trainer.max_epochs=1", env=_user_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1/1 finished" in done.stdout + done.stderr
    assert _noise(done.stdout + done.stderr) == []
    trial_log = (tmp_path / "lightning_logs" / "s" / "trial-0000.log").read_text()
    assert _noise(trial_log) == []
