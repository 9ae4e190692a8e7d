"""``--test_after_fit true``: the best checkpoint is tested when fit ends, its results in the same run folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import CONFIGS

SHORT = ("--trainer.max_epochs=3", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2")
SHORT += ("--trainer.limit_test_batches=3", "--trainer.enable_progress_bar=false", "--run.name=r")


def test_fit_then_test_on_the_best_checkpoint(run_main, tmp_path: Path) -> None:
    result = run_main("fit", "--config", CONFIGS / "default.yaml", *SHORT, "--test_after_fit=true")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "r"
    rows = list(csv.DictReader((folder / "metrics.csv").open()))
    val_acc = [float(r["val_acc"]) for r in rows if r["val_acc"]]
    saved = json.loads((folder / "test-results.json").read_text())
    # The best of the three epochs by val_acc, not the last weights.
    best_epoch = val_acc.index(max(val_acc))
    assert Path(saved["checkpoint"]).name == f"best-{best_epoch}-{max(val_acc):.4f}.ckpt"
    ((test_row), *_) = [r for r in rows if r["test_acc"]]
    (results,) = saved["results"]
    assert float(test_row["test_acc"]) == pytest.approx(results["test_acc"])  # in the run's own metrics.csv
    assert 0 < results["test_acc"] <= 1


def test_without_the_option_fit_does_not_test(run_main, tmp_path: Path) -> None:
    result = run_main("fit", "--config", CONFIGS / "default.yaml", *SHORT[1:], "--trainer.max_epochs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "r"
    assert not (folder / "test-results.json").exists()
    assert "test_acc" not in (folder / "metrics.csv").read_text().splitlines()[0]
