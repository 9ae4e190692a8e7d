"""``tune lr|batch_size``: Lightning's Tuner on the configured model and data, a config file that the next fit stacks,
nothing written into run folders; mistakes in one line before anything is written."""

from __future__ import annotations

import csv
import math
import random
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader

from template.engine.commands.tune import judge, measured_losses
from tests.commands import user_projects as projects
from tests.conftest import CONFIGS, REPO, cli_env, pythonpath

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


class Recorded(LightningModule):
    """A regression whose training steps record the losses they return."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.losses = nn.Linear(32, 1), []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = (self.net(batch) - batch.sum(1, keepdim=True)).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):  # noqa: ANN201
        return DataLoader(RandomDataset(32, 640), batch_size=16)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(r"ignore:.*isinstance\(treespec, LeafSpec\)")  # Lightning on torch's pytree
def test_the_plotted_loss_is_the_loss_measured(tmp_path: Path) -> None:
    # Lightning's finder keeps a running mean whose first value is half the first loss; the plot shows the losses.
    model = Recorded()
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    found = Tuner(trainer).lr_find(
        model, min_lr=1e-5, max_lr=0.1, num_training=30, update_attr=False, early_stop_threshold=None
    )
    lrs, measured = measured_losses(found.results)
    assert lrs == found.results["lr"] and len(measured) == 30
    assert found.results["loss"][0] == pytest.approx(model.losses[0] / 2, rel=0.02)  # what the plot showed before
    assert measured == pytest.approx(model.losses[:30], rel=1e-6)


def _finder_curve(loss_at, noise: float, seed: int, steps: int = 100) -> tuple[list[float], list[float]]:
    """Rates from 1e-8 to 1 as Lightning's finder takes them, and noisy losses ``loss_at(lr)``."""
    draw = random.Random(seed)
    lrs = [1e-8 * 1e8 ** (i / (steps - 1)) for i in range(steps)]
    return lrs, [loss_at(lr) * (1 + noise * draw.gauss(0, 1)) for lr in lrs]


def _falls_at_1e_3(lr: float) -> float:
    """Flat at tiny rates, falling from 2.3 to 0.5 around 1e-3 (about a decade wide), diverging above 0.1."""
    return (0.5 + 1.8 / (1 + (lr / 1e-3) ** 1.1)) * (1 + 3 * math.log10(lr / 0.1) if lr > 0.1 else 1)


@pytest.mark.parametrize("noise", [0.02, 0.1, 0.2])
def test_the_suggestion_is_where_the_loss_falls_not_where_noise_is(noise: float) -> None:
    # Noise at tiny rates makes the steepest slope against the linear rate (Lightning's suggestion) a tiny rate.
    for seed in range(20):
        curve = judge(*_finder_curve(_falls_at_1e_3, noise, seed))
        assert curve.falls, curve.why
        assert 2e-4 < curve.lrs[curve.steepest] < 5e-3, (seed, curve.lrs[curve.steepest])
        assert curve.lrs[curve.start] < curve.lrs[curve.steepest] < curve.lrs[curve.low] < 0.1


@pytest.mark.parametrize(
    "loss_at",
    [lambda lr: 2.3, lambda lr: 2.3 * (1 + lr), lambda lr: 2.3 + 0.01 * (lr > 1e-3)],
    ids=["flat", "rising", "a step up"],
)
def test_a_curve_with_no_falling_region_is_refused(loss_at) -> None:  # noqa: ANN001
    for seed in range(20):
        curve = judge(*_finder_curve(loss_at, 0.05, seed))
        assert not curve.falls, (seed, curve.lrs[curve.steepest], curve.why)
        assert "its smoothed loss falls by" in curve.why and "noise" in curve.why


def test_too_few_steps_are_refused() -> None:
    curve = judge(*_finder_curve(_falls_at_1e_3, 0.0, 0, steps=6))
    assert not curve.falls and curve.why == "6 steps are too few to tell"


def _metric(run: Path, name: str) -> float:
    with open(run / "metrics.csv", newline="") as f:
        return float([row for row in csv.DictReader(f) if row.get(name)][-1][name])


# Three user projects (tests/commands/user_projects.py): their modules' YAML, and the metric fit is judged by.
USER_PROJECTS = {
    "text": ("TextClassifier", {"net": {"class_path": f"{projects.__name__}.BagOfEmbeddings"}}, "Sentences", "val_f1"),
    "two heads": ("TwoHeads", {"net": {"class_path": f"{projects.__name__}.ShapeNet"}}, "ShapesData", "val_acc"),
    "regression": ("Regressor", {}, "CurveData", "val_r2"),
}


@pytest.mark.slow  # a finder's 100 steps and two fits of 3 epochs, per project
@pytest.mark.parametrize("project", list(USER_PROJECTS))
def test_the_suggestion_trains_as_well_as_the_modules_own_rate(tmp_path: Path, run_cli, project: str) -> None:  # noqa: ANN001
    model, init_args, data, metric = USER_PROJECTS[project]
    config = {
        "model": {"class_path": f"{projects.__name__}.{model}", "init_args": init_args},
        "data": {"class_path": f"{projects.__name__}.{data}"},
        "trainer": {"accelerator": "cpu", "max_epochs": 3, "enable_progress_bar": False},
    }
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    # Lightning's range and its 100 steps, more than the config's 3 epochs hold.
    env = cli_env(PYTHONPATH=pythonpath(REPO))  # the projects' classes by their module's name, tests.commands...
    done = run_cli("tune", "lr", "--config", "user.yaml", timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ((option, lr),) = yaml.safe_load((tmp_path / "tune-lr.yaml").read_text())["model"]["init_args"].items()
    assert option == ("learning_rate" if project == "regression" else "lr")  # the argument each module names it by
    assert f"Suggested learning rate: {lr:.3g} (model.init_args.{option})" in done.stdout, done.stdout
    for config in ([], ["--config", "tune-lr.yaml"]):
        fit = run_cli("fit", "--config", "user.yaml", *config, timeout=300, env=env)
        assert fit.returncode == 0, fit.stderr[-3000:]
    default, tuned = (_metric(tmp_path / f"lightning_logs/version_{v}", metric) for v in (0, 1))
    assert tuned >= 0.9 * default, f"{metric} {tuned:.3f} at the suggested {lr:.3g}, {default:.3f} at the default"
