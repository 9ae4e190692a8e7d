"""Queued metric updates: what any LightningModule logs is the same as with an update per call, at fewer calls."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, Metric, MetricCollection
from torchmetrics.audio import SignalNoiseRatio
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision

from template.engine.cadence import LogCadence, _MetricQueue
from template.engine.errors import ConfigError
from tests.conftest import CONFIGS

STEPS_PER_EPOCH = 6


class CountingAccuracy(MulticlassAccuracy):
    """An accuracy that records the batch size of each update it really runs."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.runs: list[int] = []

    def update(self, preds: Tensor, target: Tensor) -> None:
        self.runs.append(len(target))
        super().update(preds, target)


class MeanBatchMax(Metric):
    """A metric of the user's own whose value depends on how the samples are split into updates."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("batches", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, values: Tensor) -> None:
        self.total += values.max()
        self.batches += 1

    def compute(self) -> Tensor:
        return self.total / self.batches


class Probe(LightningModule):
    """Every way a training step commonly feeds torchmetrics, each logged at the epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 4)
        self.acc = CountingAccuracy(4)  # update(): queued, one run per epoch
        self.called = MulticlassAccuracy(4)  # metric(x, y), logged as an object per step and epoch
        self.loss_mean = MeanMetric()  # a scalar loss with its batch size: stacked
        self.ragged = MeanMetric()  # inputs whose width changes each step: run one by one
        self.weighted = MeanMetric()  # a tensor with a constant weight: concatenated, weight kept
        self.reset_midway = CountingAccuracy(4)  # reset in the middle of each epoch: the earlier updates vanish
        self.mixed = MulticlassAccuracy(4)  # update() and metric(x, y) by turns
        self.shared = MulticlassAccuracy(4)  # updated in training and validation alike
        self.group = MetricCollection({"a": MulticlassAccuracy(4), "p": MulticlassPrecision(4)})  # compute groups
        self.batch_max = MeanBatchMax()  # not a per-sample family: updated on every call
        self.snr = SignalNoiseRatio()  # one 1-D signal per call: joining them would make one longer signal

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.acc.update(logits, y)
        self.called(logits, y)
        self.log("called", self.called, on_step=True, on_epoch=True)
        self.loss_mean.update(loss, len(y))
        self.ragged.update(x[:, : 1 + batch_idx % 3])
        self.weighted.update(x[:, 0], 2.0)
        if batch_idx == STEPS_PER_EPOCH // 2:
            self.reset_midway.reset()
        self.reset_midway.update(logits, y)
        if batch_idx % 2:
            self.mixed(logits, y)
        else:
            self.mixed.update(logits, y)
        self.shared.update(logits, y)
        self.group.update(logits, y)
        self.batch_max.update(x[:, 0])
        self.snr.update(logits.flatten(), F.one_hot(y, 4).float().flatten())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.shared.update(self.net(x), y)

    def on_train_epoch_end(self) -> None:
        for name in ("acc", "loss_mean", "ragged", "weighted", "reset_midway", "mixed", "batch_max", "snr"):
            self.log(name, getattr(self, name).compute())
            getattr(self, name).reset()
        self.log_dict(self.group.compute())
        self.group.reset()

    def on_validation_epoch_end(self) -> None:
        self.log("shared", self.shared.compute())
        self.shared.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(8 * STEPS_PER_EPOCH, 6, generator=generator), torch.randint(0, 4, (48,)))
    return DataLoader(data, batch_size=8)


def _fit(root: Path, cadence: LogCadence, *callbacks: ModelCheckpoint) -> tuple[list[dict[str, str]], Probe]:
    torch.manual_seed(0)
    model = Probe()
    model.acc.persistent(True)  # its states go into checkpoints
    trainer = Trainer(
        max_epochs=2, log_every_n_steps=2, logger=CSVLogger(root), callbacks=[cadence, *callbacks],
        accelerator="cpu", enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, _loader(1), _loader(2))
    return list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open())), model


def _values(rows: list[dict[str, str]]) -> dict[str, list[float]]:
    return {key: [float(r[key]) for r in rows if r[key]] for key in rows[0] if key not in ("epoch", "step")}


def test_queued_updates_log_what_updates_on_every_call_log(tmp_path: Path) -> None:
    every, reference = _fit(tmp_path / "every", LogCadence(enabled=False))
    queued, model = _fit(tmp_path / "queued", LogCadence())
    expected, got = _values(every), _values(queued)
    assert got.keys() == expected.keys() and len(got["acc"]) == 2 and len(got["called_step"]) == 6
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, rel=1e-6), key
    # Each epoch's accuracy ran as one update of all 48 samples instead of 6 of 8, and the midway reset dropped
    # what was queued before it: the rest (steps 3-5) ran at the epoch end.
    assert (reference.acc.runs, model.acc.runs) == ([8] * 12, [48, 48])
    assert model.reset_midway.runs == [24, 24]
    # After the run every metric has its own methods back.
    for metric in model.modules():
        if isinstance(metric, Metric):
            assert "forward" not in metric.__dict__ and "reset" not in metric.__dict__
            assert not isinstance(getattr(metric.update, "__self__", None), _MetricQueue)


def test_a_checkpoint_holds_the_queued_updates(tmp_path: Path) -> None:
    """A mid-epoch checkpoint has the metric states of every step so far, as with an update per call."""
    states = {}
    for name, cadence in (("every", LogCadence(enabled=False)), ("queued", LogCadence())):
        every_4 = ModelCheckpoint(tmp_path / name / "ckpt", "{step}", every_n_train_steps=4, save_top_k=-1)
        _fit(tmp_path / name, cadence, every_4)
        states[name] = {
            path.name: {k: v for k, v in torch.load(path)["state_dict"].items() if k.startswith("acc.")}
            for path in (tmp_path / name / "ckpt").glob("step=*.ckpt")
        }
    assert sorted(states["queued"]) == ["step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert states["queued"]["step=4.ckpt"]["acc.tp"].sum() > 0  # four steps' updates, not an empty state
    for file, expected in states["every"].items():
        assert states["queued"][file].keys() == expected.keys() and expected, file
        for key, value in expected.items():
            assert torch.equal(states["queued"][file][key], value), (file, key)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_bad_queue_size_is_refused_with_the_fix(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"log_cadence\.metric_queue_mib .* got (-1\.0|inf|nan); e\.g\. 16"):
        LogCadence(metric_queue_mib=bad)


def test_the_queue_is_bounded_by_its_size(tmp_path: Path) -> None:
    # One update's inputs are 8 x 4 logits and 8 labels: 8 * 4 * 4 + 8 * 8 = 192 bytes.
    _, model = _fit(tmp_path / "bounded", LogCadence(metric_queue_mib=3 * 192 / 2**20))
    assert model.acc.runs == [24, 24] * 2  # three batches at a time
    _, model = _fit(tmp_path / "smaller", LogCadence(metric_queue_mib=100 / 2**20))
    assert model.acc.runs == [8] * 12  # one batch is over the limit: it runs at once
    _, model = _fit(tmp_path / "off", LogCadence(metric_queue_mib=0))
    assert model.acc.runs == [8] * 12


@pytest.mark.slow
def test_ddp_metrics_are_the_same_with_and_without_the_queue(run_cli, tmp_path: Path) -> None:
    """Queued updates run before torchmetrics syncs the ranks: the epoch's accuracy over both processes is equal."""
    rows = {}
    for enabled in ("true", "false"):
        result = run_cli(
            "fit",
            *("--config", CONFIGS / "ddp_cpu.yaml", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false"),
            *(f"--log_cadence.enabled={enabled}", f"--trainer.default_root_dir=runs_{enabled}"),
            timeout=300,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        (metrics,) = (tmp_path / f"runs_{enabled}").rglob("metrics.csv")
        rows[enabled] = _values(list(csv.DictReader(metrics.open())))
    assert len(rows["true"]["train_acc"]) == 2
    for key in ("train_acc", "val_acc", "val_loss"):
        assert rows["true"][key] == rows["false"][key], key
    assert rows["true"]["train_loss_epoch"] == pytest.approx(rows["false"]["train_loss_epoch"], rel=1e-6)
