"""The cheap per-step path: batched data reads, logging at the Trainer's cadence, no patch of the user's objects, and
DDP still splitting the data."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric
from typing_extensions import override

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
    from template.engine.commands.cli import build_cli

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


class Untouched(Callback):
    """A user's callback that checks, at every training step, that the engine has patched none of the user's objects.

    Not ``self.log`` (an instance attribute would shadow the class's), not a metric's methods (torchmetrics keeps
    ``update`` and ``compute`` as instance attributes of its own: they must stay the same objects), and not this
    callback's own idle hooks (the engine makes Lightning skip only its own callbacks' idle hooks).
    """

    def __init__(self) -> None:
        self.steps = 0
        self.before: dict[str, tuple] = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.before = {name: (m.update, m.compute) for name, m in pl_module.named_modules() if isinstance(m, Metric)}

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        self.steps += 1
        assert "log" not in pl_module.__dict__ and type(pl_module).log is LightningModule.log
        metrics = {name: m for name, m in pl_module.named_modules() if isinstance(m, Metric)}
        assert metrics.keys() == self.before.keys() and metrics, metrics
        for name, metric in metrics.items():
            assert (metric.update, metric.compute) == self.before[name], name
            assert not {"forward", "reset", "state_dict"} & metric.__dict__.keys(), name
        assert "on_train_batch_start" not in self.__dict__ and callable(self.on_before_backward)


def test_fit_patches_nothing_of_the_users_objects(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from template.engine.commands.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        ["fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.max_epochs=1", "--trainer.limit_train_batches=12",
         "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
         '--trainer.callbacks+={"class_path": "tests.logs.test_step_cost.Untouched"}'],
    )  # fmt: skip
    # By name: jsonargparse imports this module again under its dotted path.
    untouched = next(c for c in cli.trainer.callbacks if type(c).__name__ == "Untouched")
    assert untouched.steps == 12
    # The engine's own callbacks: Lightning passes over their idle per-batch hooks.
    engine = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("template.engine.")]
    assert engine and all(c.on_before_backward is None for c in engine)
