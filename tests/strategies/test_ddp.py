"""DDP on CPU: 2 processes over gloo, launched by Lightning from the real command."""

import csv
import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, PACKAGE, cli_env

pytestmark = pytest.mark.slow  # two DDP processes

OUR_LINES = ("Best checkpoint:", "Prepared the digits data set")


def test_ddp_cpu_config_trains_two_processes(run_cli, tmp_path):
    # The example's config (15 epochs) with the parallelism preset stacked after it.
    result = run_cli("fit", "--config", CONFIGS / "default.yaml", "--config", CONFIGS / "ddp_cpu.yaml", timeout=300)
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
    # The sampler gives each process 90 of the 179 validation samples: the repeated one is said, once.
    assert output.count("Validation under DDP repeats 1 of its 179 samples") == 1, output[-3000:]

    # Predictions under DDP: one file, written by rank 0, every test sample once and in the data's order.
    ckpt = runs[0] / "checkpoints" / "last.ckpt"
    result = run_cli("predict", "--config", CONFIGS / "ddp_cpu.yaml", "--ckpt_path", ckpt, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (written,) = tmp_path.rglob("predictions*.csv")
    assert written == runs[0] / "predict" / "version_0" / "predictions.csv"
    assert [int(row["index"]) for row in csv.DictReader(written.open())] == list(range(179))


def test_every_rank_ends_its_process_group_before_it_exits(tmp_path):
    # A gloo group left to the interpreter's teardown aborts the process about one exit in ten (SIGABRT after a
    # finished run). Two ranks under torchrun, which waits for both; the script runs the command line as -m does.
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, os\n"
        "import torch.distributed as dist\n"
        f"from {PACKAGE}.engine.commands.cli import main\n\n"
        "rank = os.environ['RANK']\n"
        "end = lambda: open(f'rank{rank}.end', 'w').write(f'process group open: {dist.is_initialized()}')\n"
        "atexit.register(end)\n"
        "main()\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    tiny = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    command = [*torchrun, str(script), "fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), *tiny]
    done = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Each rank reports to a file of its own: two ranks printing at exit interleave on torchrun's shared stdout.
    ends = [(tmp_path / f"rank{rank}.end").read_text() for rank in (0, 1)]
    assert ends == ["process group open: False"] * 2, ends
