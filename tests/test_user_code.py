"""A user's own net and DataModule from a module outside the package, by YAML alone."""

import csv
from pathlib import Path

import pytest
import yaml

from tests.conftest import cli_env

USER_CODE = Path(__file__).parent / "user_code"

USER_CONFIG = {
    "trainer": {"max_epochs": 3, "accelerator": "cpu", "enable_progress_bar": False, "log_every_n_steps": 5},
    "model": {"net": {"class_path": "my_code.TinyNet", "init_args": {"width": 32}}},
    "data": {"class_path": "my_code.Blobs", "init_args": {"batch_size": 16, "data_dir": "blobs"}},
}


def _last_val_acc(run_dir: Path) -> float:
    rows = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("val_acc")]
    return float(rows[-1]["val_acc"])


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_user_net_and_data_train_from_yaml(run_cli, tmp_path, strategy):
    devices = 2 if strategy == "ddp" else 1
    config = {**USER_CONFIG, "trainer": {**USER_CONFIG["trainer"], "strategy": strategy, "devices": devices}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("fit", "--config", "user.yaml", env=cli_env(PYTHONPATH=str(USER_CODE)))
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert _last_val_acc(run_dir) > 0.9
    # The data's own shape and class count reached the net and the metrics: nothing assumed the digits.
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["net"]["init_args"] == {"input_shape": [5], "num_classes": 3, "width": 32}
    assert hparams["num_classes"] == 3
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and "last.ckpt" in checkpoints
    # prepare_data ran on one process only, also with 2 DDP processes.
    assert len((tmp_path / "blobs" / "prepare_calls.log").read_text().split()) == 1
