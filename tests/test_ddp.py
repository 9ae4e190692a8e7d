"""DDP on CPU: 2 processes over gloo, launched by Lightning from the real command."""

import csv

import pytest

from tests.conftest import CONFIGS

pytestmark = pytest.mark.slow  # two DDP processes

OUR_LINES = ("Best checkpoint:", "Prepared the digits data set")


def test_ddp_cpu_config_trains_two_processes(run_cli, tmp_path):
    result = run_cli("fit", "--config", CONFIGS / "ddp_cpu.yaml", timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Starting with 2 processes" in output and "distributed_backend=gloo" in output

    # One run folder, one set of checkpoints: only rank 0 writes them.
    runs = list((tmp_path / "lightning_logs").iterdir())
    assert [p.name for p in runs] == ["version_0"]
    names = sorted(p.name for p in (runs[0] / "checkpoints").iterdir())
    assert len(names) == 2 and names[-1] == "last.ckpt"
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["digits.pt"]

    # Metrics are logged and reduced over both ranks, and the example reaches the quality of one device.
    val_acc = [float(r["val_acc"]) for r in csv.DictReader((runs[0] / "metrics.csv").open()) if r["val_acc"]]
    assert len(val_acc) == 15 and max(val_acc) >= 0.95

    # prepare_data ran once, and none of our own lines is printed twice.
    for line in OUR_LINES:
        assert output.count(line) == 1, line
