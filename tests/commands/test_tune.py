"""``tune lr|batch_size``: Lightning's Tuner on the configured model and data, a config file that the next fit stacks,
nothing written into run folders; mistakes in one line before anything is written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import CONFIGS

FIT_LIMITS = [
    "--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
]  # fmt: skip


def _one_line(done) -> str:  # noqa: ANN001
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


def _refused(done) -> str:  # noqa: ANN001
    """The one error line of a finder that ran (Lightning's own lines before it), without a traceback."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["tune", "momentum"], "unknown finder 'momentum'; name one first: python -m template tune lr|batch_size"),
        (["tune"], "unknown finder '--config'; name one first"),
        (["tune", "batch_size", "--tune.mode=fast"], "argument --tune.mode: invalid choice: 'fast'"),
        (["tune", "lr", "--tune.num_training=many"], "argument --tune.num_training: invalid int value"),
    ],
    ids=["unknown-finder", "no-finder", "unknown-mode", "not-a-number"],
)
def test_tune_mistakes_are_one_line_before_anything_is_written(tmp_path: Path, run_main, args, fragment) -> None:  # noqa: ANN001
    line = _one_line(run_main(*args, "--config", CONFIGS / "default.yaml"))
    assert fragment in line, line
    assert list(tmp_path.iterdir()) == []


def test_lr_without_matplotlib_names_the_extra(tmp_path: Path, run_main, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    line = _one_line(run_main("tune", "lr", "--config", CONFIGS / "default.yaml"))
    assert "matplotlib" in line and "pip install -e '.[sweep]'" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_tune_lr_writes_the_plot_and_a_config_that_fit_uses(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    # From 1e-4, 30 steps reach the rates where the loss falls (from 1e-8 the curve is nearly flat).
    done = run_cli(
        "tune", "lr", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--tune.num_training=30",
        "--tune.min_lr=1e-4", "--tune.output=tuned/lr.yaml",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    written = yaml.safe_load((tmp_path / "tuned/lr.yaml").read_text())
    lr = written["model"]["init_args"]["optimizer"]["init_args"]["lr"]  # the example's optimizer argument
    assert 1e-8 < lr < 1
    assert f"Suggested learning rate: {lr:.3g} (model.init_args.optimizer.init_args.lr)" in done.stdout, done.stdout
    assert (tmp_path / "tuned/lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # No run folder, no finder checkpoint: only the data the example prepares and the two files asked for.
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "data", "data/digits.pt", "tuned", "tuned/lr.png", "tuned/lr.yaml",
    ]  # fmt: skip

    fit = run_cli("fit", "--config", CONFIGS / "default.yaml", "--config", "tuned/lr.yaml", *FIT_LIMITS)
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == lr  # Adam trained with the found rate


@pytest.mark.slow
def test_tune_lr_sets_lightning_cli_optimizer_when_the_config_names_one(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    optimizer = ["--optimizer=SGD", "--optimizer.lr=0.5", "--optimizer.momentum=0.9"]
    # From 1e-3, 20 steps reach the rates where the loss falls (from 1e-8 the curve is flat).
    done = run_cli(
        "tune", "lr", "--config", CONFIGS / "default.yaml", *optimizer, "--trainer.accelerator=cpu",
        "--tune.num_training=20", "--tune.min_lr=1e-3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lr = yaml.safe_load((tmp_path / "tune-lr.yaml").read_text())["optimizer"]["init_args"]["lr"]
    fit = run_cli("fit", "--config", CONFIGS / "default.yaml", *optimizer, "--config", "tune-lr.yaml", *FIT_LIMITS)
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == lr and group["momentum"] == 0.9  # SGD as configured, at the found rate


@pytest.mark.slow
def test_tune_batch_size_under_ddp_searches_one_device_and_writes_its_config(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    done = run_cli(
        "tune", "batch_size", "--config", CONFIGS / "ddp_cpu.yaml", "--tune.max_trials=3",
        "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the finder runs on one" in done.stdout + done.stderr
    # Power scaling from 2: three trials that all fit on the CPU end at 2 * 2 * 2.
    assert yaml.safe_load((tmp_path / "tune-batch_size.yaml").read_text()) == {"data": {"init_args": {"batch_size": 8}}}
    assert "Batch size 8 per process (data.init_args.batch_size): the largest that ran\n" in done.stdout, done.stdout
    assert not (tmp_path / "lightning_logs").exists()
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.slow  # a finder's 30 steps
def test_a_flat_curve_is_reported_not_written_and_the_finder_stays_quiet(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    # Up to 1e-6, Adam barely moves the weights: the loss is flat, and its "steepest descent" means nothing.
    done = run_cli(
        "tune", "lr", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--tune.max_lr=1e-6",
        "--tune.num_training=30", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    line = _refused(done)
    assert "tune lr: the loss does not fall at the learning rate the finder suggests" in line, line
    assert "see tune-lr.png" in line and "--tune.max_lr" in line, line
    assert (tmp_path / "tune-lr.png").is_file() and not (tmp_path / "tune-lr.yaml").exists()
    # No bar with the bar off; none of Lightning's lines about the finder's own fit and checkpoint.
    for noise in ("Finding best initial lr", "weights_only", "`Trainer.fit` stopped", "Restoring states"):
        assert noise not in done.stdout + done.stderr, noise


@pytest.mark.slow  # the finder's trials up to the whole data set
def test_a_batch_larger_than_the_data_is_reported_not_written(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    done = run_cli("tune", "batch_size", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu")
    line = _refused(done)
    assert "every batch size tried ran, up to 2048, which takes all 1439 training samples" in line, line
    assert "choose data.init_args.batch_size by speed or accuracy" in line, line
    assert not (tmp_path / "tune-batch_size.yaml").exists()
    output = done.stdout + done.stderr
    assert "Batch size 1024 succeeded, trying batch size 2048" in output  # Lightning's line per trial stays
    assert "will continue with full run" not in output and "`Trainer.fit` stopped" not in output
