"""Throughput in the logs: samples/s per epoch for any module, FLOP/s where declared, validation time left out."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from template.engine.logs.console import ThroughputLog, summary
from tests.conftest import CONFIGS

BATCH, BATCHES = 8, 4


class DictBatches(LightningModule):
    """A user's module whose batches are dicts (no batch_size anywhere), validating slowly on purpose."""

    def __init__(self, flops_per_batch: int | None = None, validation_sleep: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        if flops_per_batch is not None:
            self.flops_per_batch = flops_per_batch
        self.validation_sleep = validation_sleep

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.layer(batch["x"]).pow(2).mean()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        time.sleep(self.validation_sleep)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader([{"x": torch.randn(4), "id": i} for i in range(BATCH * BATCHES)], batch_size=BATCH)

    val_dataloader = train_dataloader


def _fit(
    tmp_path: Path,
    module: LightningModule,
    epochs: int = 2,
    log: ThroughputLog | None = None,
    extra: list = (),
    ckpt_path: Path | None = None,
    version: int = 0,
) -> list[dict]:
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=epochs, accelerator="cpu", logger=CSVLogger(tmp_path, version=version),
        callbacks=[log or ThroughputLog(), *extra], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    with (tmp_path / "lightning_logs" / f"version_{version}" / "metrics.csv").open() as f:
        return [row for row in csv.DictReader(f) if row.get("throughput/samples_per_sec")]


def test_samples_per_sec_per_epoch_for_any_module_and_flops_where_declared(tmp_path: Path) -> None:
    log = ThroughputLog()
    rows = _fit(tmp_path, DictBatches(flops_per_batch=1000), log=log)
    assert [int(r["epoch"]) for r in rows] == [0, 1]  # one value per epoch
    # The figures printed at the end are the logged ones (float32, reduced over processes), each epoch's.
    names = ("samples_per_sec", "flops_per_sec")
    assert log._epochs == [{name: float(row[f"throughput/{name}"]) for name in names} for row in rows]
    for row in rows:
        samples, flops = float(row["throughput/samples_per_sec"]), float(row["throughput/flops_per_sec"])
        assert samples > 0
        # Both over the same time: FLOP/s per sample/s is the FLOPs of one batch per sample of it.
        assert flops / samples == pytest.approx(1000 / BATCH)
        assert "throughput/mfu" not in row  # no known peak on the CPU
        assert "throughput/peak_memory_gib" not in row  # CUDA only


class StopAt(Callback):
    """Saves a checkpoint and ends the fit at a training step's end, or at the end of an epoch's validation."""

    def __init__(self, path: Path, step: int | None = None, epoch: int | None = None) -> None:
        self.path, self.step, self.epoch = path, step, epoch

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise SystemExit

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            raise SystemExit


@pytest.mark.parametrize("where", [{"step": 6}, {"epoch": 1}], ids=["mid-epoch", "at-validation"])
def test_a_resumed_run_has_a_figure_for_every_epoch(tmp_path: Path, where: dict) -> None:
    """Lightning continues the checkpoint's epoch without starting it again: that epoch is measured too, and the
    line's mean covers the epochs before the restart."""
    path = tmp_path / "stop.ckpt"
    with pytest.raises(SystemExit):
        _fit(tmp_path, DictBatches(), epochs=3, extra=[StopAt(path, **where)])
    log = ThroughputLog()
    rows = _fit(tmp_path, DictBatches(), epochs=3, log=log, ckpt_path=path, version=1)
    assert len(log._epochs) == 3 and [int(r["epoch"]) for r in rows] == [1, 2]  # the first in the stopped run's log
    assert all(float(r["throughput/samples_per_sec"]) > 0 for r in rows)
    assert "mean over 3)" in summary(log._epochs)  # the line printed at the end


def test_validation_time_is_left_out(tmp_path: Path) -> None:
    rows = _fit(tmp_path, DictBatches(validation_sleep=0.25), epochs=1)
    (row,) = rows
    # With the 4 x 0.25 s of validation counted, the epoch could not exceed 32 samples / 1 s.
    assert float(row["throughput/samples_per_sec"]) > 3 * BATCH * BATCHES
    assert "throughput/flops_per_sec" not in row  # the module declares no FLOPs


@pytest.mark.gpu(1)  # peak GPU memory needs CUDA
def test_peak_gpu_memory_on_cuda(tmp_path: Path) -> None:
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=1, accelerator="cuda", devices=1, logger=CSVLogger(tmp_path),
        callbacks=[ThroughputLog()], enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(DictBatches())
    with (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open() as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("throughput/peak_memory_gib")]
    assert 0 < float(row["throughput/peak_memory_gib"]) < torch.cuda.get_device_properties(0).total_memory / 2**30


def test_summary_line() -> None:
    epochs = [{"samples_per_sec": 1000.0}, {"samples_per_sec": 3000.0, "flops_per_sec": 2e12, "mfu": 0.25}]
    epochs[-1]["peak_memory_gib"] = epochs[0]["peak_memory_gib"] = 1.5
    assert summary(epochs) == (
        "Throughput: 3,000 samples/s in the last epoch (2,000 mean over 2); 2 TFLOP/s, 25.0% of the devices' peak; "
        "peak GPU memory 1.50 GiB"
    )


@pytest.mark.slow  # a training subprocess; the unit tests above cover the callback
def test_the_command_line_logs_and_prints_throughput(run_cli, tmp_path: Path) -> None:
    result = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", "--trainer.max_epochs=2", "--trainer.limit_train_batches=5",
        "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--run.name=t",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "lightning_logs" / "t" / "metrics.csv").open() as f:
        values = [float(r["throughput/samples_per_sec"]) for r in csv.DictReader(f) if r["throughput/samples_per_sec"]]
    assert len(values) == 2
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Throughput: ")]
    # The line says what the log holds (float32, reduced over processes), not the process's own estimate.
    mean = sum(values) / len(values)
    assert line.startswith(f"Throughput: {values[-1]:,.0f} samples/s in the last epoch ({mean:,.0f} mean over 2)")
    table = run_cli("runs").stdout.splitlines()
    assert table[2].split()[6] == f"{values[-1]:.0f}"  # the runs table's samples/s column


@pytest.mark.slow  # a training subprocess
def test_switched_off(run_cli, tmp_path: Path) -> None:
    result = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--throughput.enabled=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Throughput:" not in result.stdout + result.stderr
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "throughput/" not in header
