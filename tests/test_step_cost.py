"""The cheap per-step path: batched data reads, logging at the Trainer's cadence, and DDP still splitting the data."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from template.data import BatchedTensorDataset, DigitsDataModule, collate_batch
from tests.conftest import CONFIGS


def _tensors(n: int = 103) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def test_batched_reads_give_the_batches_of_per_sample_reads() -> None:
    images, labels = _tensors()
    batched = DataLoader(BatchedTensorDataset(images, labels), batch_size=16, collate_fn=collate_batch)
    per_sample = DataLoader(TensorDataset(images, labels), batch_size=16)
    pairs = list(zip(batched, per_sample, strict=True))
    assert len(pairs) == 7  # 6 full batches and a last one of 7
    for (x, y), (x_ref, y_ref) in pairs:
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_collate_still_accepts_a_list_of_samples() -> None:
    images, labels = _tensors(4)
    x, y = collate_batch([(images[i], labels[i]) for i in range(4)])
    assert torch.equal(x, images) and torch.equal(y, labels)


def test_workers_pinning_and_persistent_workers_still_work(tmp_path: Path) -> None:
    digits = DigitsDataModule(
        data_dir=str(tmp_path), batch_size=100, num_workers=2, pin_memory=True, persistent_workers=True
    )
    digits.prepare_data()
    digits.setup("fit")
    loader = digits.train_dataloader()
    assert loader.num_workers == 2 and loader.persistent_workers and loader.pin_memory
    for _ in range(2):  # the second epoch reuses the persistent workers
        labels = torch.cat([y for _, y in loader])
        assert len(labels) == 1439
        assert torch.equal(labels.sort().values, digits.splits["train"].tensors[1].sort().values)


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


def test_training_metrics_are_logged_at_the_trainer_cadence_and_per_epoch(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from template.model import Classifier
    from template.nets import MLP

    trainer = Trainer(
        max_epochs=2, limit_train_batches=7, limit_val_batches=2, log_every_n_steps=3, logger=CSVLogger(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Classifier(MLP((1, 8, 8), 10), num_classes=10), DigitsDataModule(data_dir=str(tmp_path)))
    rows = _metrics(Path(trainer.logger.log_dir))

    # The step loss: only on the steps the Trainer writes logs (every 3rd optimizer step), never in between.
    step_rows = [r for r in rows if r["train_loss"]]
    assert [int(r["step"]) for r in step_rows] == [2, 5, 8, 11]
    assert all(0 < float(r["train_loss"]) < 5 for r in step_rows)

    # Epoch values: one per epoch for training (accuracy and mean loss, over every step) and validation.
    for column in ("train_acc", "train_loss_epoch", "val_acc", "val_loss"):
        values = [(int(r["epoch"]), float(r[column])) for r in rows if r[column]]
        assert [epoch for epoch, _ in values] == [0, 1], column
    for column in ("train_acc", "val_acc"):
        assert all(0 <= float(r[column]) <= 1 for r in rows if r[column])


@pytest.mark.slow
def test_ddp_still_splits_the_data_between_processes(run_cli, tmp_path: Path) -> None:
    result = run_cli(
        "fit",
        *("--config", CONFIGS / "ddp_cpu.yaml", "--trainer.max_epochs=1", "--trainer.limit_val_batches=0"),
        "--trainer.enable_progress_bar=false",
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    checkpoint = torch.load(
        tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    # 1439 training samples, 2 processes of 32 per batch: each process reads its half (720 with padding) in 23
    # steps. Without Lightning's DistributedSampler each would read all 1439 in 45.
    assert checkpoint["global_step"] == 23


def _trainer(tmp_path: Path, monkeypatch, *args: str):  # noqa: ANN001, ANN202
    from template.engine.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(CONFIGS / "default.yaml"), "--trainer.logger=false", *args], run=False)
    return cli.trainer


def test_progress_bar_redraws_every_tenth_step_unless_configured(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    bar = _trainer(tmp_path, monkeypatch).progress_bar_callback
    assert isinstance(bar, TQDMProgressBar) and bar.refresh_rate == 10
    assert _trainer(tmp_path, monkeypatch, "--trainer.enable_progress_bar=false").progress_bar_callback is None
    chosen = _trainer(tmp_path, monkeypatch, "--trainer.callbacks+=RichProgressBar").progress_bar_callback
    assert isinstance(chosen, RichProgressBar)


def _fit_counting_logs(tmp_path: Path, monkeypatch, callbacks: list) -> tuple[list[dict[str, str]], int, list[int]]:  # noqa: ANN001
    """metrics.csv, the number of `self.log("train_loss")` calls, and the batch size of each accuracy update run."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.loggers import CSVLogger
    from torchmetrics.classification import MulticlassAccuracy

    from template.model import Classifier
    from template.nets import MLP

    calls, updates = [], []
    log, update = LightningModule.log, MulticlassAccuracy.update

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(args[0])
        return log(self, *args, **kwargs)

    def counted_update(self, preds, target):  # noqa: ANN001, ANN202
        if self.training_metric:
            updates.append(len(target))
        return update(self, preds, target)

    monkeypatch.setattr(LightningModule, "log", counted)
    monkeypatch.setattr(MulticlassAccuracy, "update", counted_update)  # before the metrics wrap it
    torch.manual_seed(0)
    trainer = Trainer(
        max_epochs=2, limit_train_batches=7, limit_val_batches=2, log_every_n_steps=3, logger=CSVLogger(tmp_path),
        enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path,
    )  # fmt: skip
    model = Classifier(MLP((1, 8, 8), 10), num_classes=10)
    for name, metric in model.named_children():
        metric.training_metric = name == "train_acc"
    trainer.fit(model, DigitsDataModule(data_dir=str(tmp_path), batch_size=32))
    monkeypatch.undo()  # the next run counts afresh
    return _metrics(Path(trainer.logger.log_dir)), calls.count("train_loss"), updates


def _same_rows(rows: list[dict[str, str]], expected: list[dict[str, str]]) -> None:
    """Equal rows; float values equal up to float32 summation order (a mean over the epoch's losses)."""
    assert [r.keys() for r in rows] == [r.keys() for r in expected]
    for row, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            if value and "." in value:
                assert abs(float(row[key]) - float(value)) <= 1e-6 * abs(float(value)), (key, row, want)
            else:
                assert row[key] == value, (key, row, want)


def test_log_cadence_writes_the_same_metrics_with_fewer_step_logs_and_metric_updates(
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
) -> None:
    from template.engine.cadence import LogCadence

    every_step, every_calls, every_updates = _fit_counting_logs(tmp_path / "every", monkeypatch, [])
    gated, gated_calls, gated_updates = _fit_counting_logs(tmp_path / "gated", monkeypatch, [LogCadence()])
    _same_rows(gated, every_step)  # every row and value of metrics.csv, step and epoch columns alike
    assert [int(r["step"]) for r in gated if r["train_loss"]] == [2, 5, 8, 11]
    # 14 training steps: Lightning's log runs on each without the gate, on the 4 that write with it.
    assert (every_calls, gated_calls) == (14, 4)
    # The training accuracy: 7 updates of 32 samples per epoch without the queue, one of 224 at each epoch end with.
    assert (every_updates, gated_updates) == ([32] * 14, [224, 224])
    off, off_calls, off_updates = _fit_counting_logs(tmp_path / "off", monkeypatch, [LogCadence(enabled=False)])
    assert off == every_step and off_calls == 14 and off_updates == every_updates
