"""The default loggers write to disk on a timer, yet every logged value reaches the files: at the end, or on a crash."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch import Callback, Trainer

from template.data import DigitsDataModule
from template.engine.logs.loggers import ResumableCSVLogger, ResumableTensorBoardLogger
from template.model import Classifier
from template.nets import MLP


class _FileRows(Callback):
    """Records how many data rows metrics.csv holds on disk after each training step."""

    def __init__(self, path: Path, fail_at: int | None = None) -> None:
        self.path, self.fail_at, self.rows = path, fail_at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.rows.append(len(_rows(self.path)) if self.path.exists() else 0)
        if trainer.global_step == self.fail_at:
            raise RuntimeError("planted failure")


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def _fit(
    tmp_path: Path, save_interval: float, fail_at: int | None = None
) -> tuple[Path, _FileRows, ResumableTensorBoardLogger]:
    csv_logger = ResumableCSVLogger(tmp_path, name="logs", save_interval=save_interval)
    tensorboard = ResumableTensorBoardLogger(
        tmp_path, name="logs", version=csv_logger.version, save_interval=save_interval
    )
    metrics = Path(csv_logger.log_dir) / "metrics.csv"
    watcher = _FileRows(metrics, fail_at)
    trainer = Trainer(
        max_epochs=2, limit_train_batches=15, limit_val_batches=2, log_every_n_steps=1,
        logger=[csv_logger, tensorboard], callbacks=[watcher], default_root_dir=tmp_path,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Classifier(MLP((1, 8, 8), 10), num_classes=10)
    trainer.fit(model, DigitsDataModule(data_dir=str(tmp_path / "data")))
    return metrics, watcher, tensorboard


def test_a_long_interval_keeps_files_untouched_during_training_and_complete_at_the_end(tmp_path: Path) -> None:
    metrics, watcher, tensorboard = _fit(tmp_path, save_interval=3600)
    # Lightning asks for a save after each of the 30 logging steps; none of them wrote: the file came at the end.
    assert set(watcher.rows) == {0}, watcher.rows
    rows = _rows(metrics)
    assert [int(r["step"]) for r in rows if r["train_loss"]] == list(range(30))
    assert len([r for r in rows if r["val_acc"]]) == 2
    # TensorBoard's event file holds every step value too once the run has ended.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tensorboard.log_dir)
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == list(range(30))


def test_a_zero_interval_writes_at_every_logging_step_as_lightning_does(tmp_path: Path) -> None:
    _, watcher, _ = _fit(tmp_path, save_interval=0)
    assert watcher.rows[1:] == sorted(watcher.rows[1:]) and len(set(watcher.rows)) >= 25, watcher.rows


def test_a_crashed_run_still_has_its_values_on_disk(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="planted failure"):
        _fit(tmp_path, save_interval=3600, fail_at=12)
    rows = _rows(next(tmp_path.glob("logs/version_*/metrics.csv")))
    # Every step logged before the failure; the failing step (index 11) raised before Lightning logged it.
    assert [int(r["step"]) for r in rows if r["train_loss"]] == list(range(11))


@pytest.mark.parametrize(
    "damage",
    [b"\x00\xff\xfe binary junk \x89PNG", b"epoch,step,train_loss\n0,0,0.5\n0,1", b"\xff\xfe;;\n1;2\n",
     b"epoch,step,train_loss\n0,zero,0.5\n"],
    ids=["binary", "truncated-row", "bad-header", "non-numeric-step"],
)  # fmt: skip
def test_a_damaged_metrics_csv_is_kept_aside_when_a_run_resumes(tmp_path: Path, caplog, damage: bytes) -> None:  # noqa: ANN001
    folder = tmp_path / "logs" / "run"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_bytes(damage)
    (folder / "metrics.damaged-1.csv").write_bytes(b"an earlier one")
    logger = ResumableCSVLogger(tmp_path, name="logs", version="run", resume=True, save_interval=0)
    with caplog.at_level("INFO"):
        logger.experiment  # noqa: B018 - Lightning creates the writer when fit sets up, before the first values
        logger.log_metrics({"train_loss": 0.25}, step=3)
        logger.save()
    assert (folder / "metrics.damaged-1.csv").read_bytes() == b"an earlier one", "never overwritten"
    assert (folder / "metrics.damaged-2.csv").read_bytes() == damage
    assert "metrics.damaged-2.csv" in caplog.text and "damaged" in caplog.text
    assert [(r["step"], r["train_loss"]) for r in _rows(folder / "metrics.csv")] == [("3", "0.25")]


def test_a_failed_save_leaves_metrics_csv_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import csv as csv_module
    import errno

    from template.engine.errors import DiskError

    logger = ResumableCSVLogger(tmp_path, name="logs", save_interval=0)
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()
    path = Path(logger.log_dir) / "metrics.csv"
    before = path.read_bytes()
    real = csv_module.DictWriter.writerows

    def full(self, rows):  # noqa: ANN001, ANN202 - a disk that fills up halfway through the rows
        self.writerow(rows[0])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv_module.DictWriter, "writerows", full)
    for metrics in ({"a": 2.0}, {"a": 3.0, "new_column": 1.0}):  # an append, and a rewrite with a new header
        logger.log_metrics(metrics, step=1)
        logger.log_metrics(metrics, step=2)
        with pytest.raises(DiskError, match=r"No space left on device \[Errno 28\]"):
            logger.save()
        assert path.read_bytes() == before
    monkeypatch.setattr(csv_module.DictWriter, "writerows", real)


@pytest.mark.parametrize("value", ["-3", "nan"])
def test_a_save_interval_below_zero_or_not_a_number_is_refused_by_the_parser(value: str) -> None:
    from jsonargparse import ArgumentParser

    from template.engine.errors import explain_parser_error

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ResumableCSVLogger, "logger")
    with pytest.raises(Exception) as refused:  # noqa: PT011 - jsonargparse's own ArgumentError
        parser.parse_args(["--logger.save_dir=logs", f"--logger.save_interval={value}"])
    line = explain_parser_error(str(refused.value))
    assert line == f"invalid value '{value}' for 'logger.save_interval'; expected a value >= 0"
