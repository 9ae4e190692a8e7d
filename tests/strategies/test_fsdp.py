"""Strategy fsdp (FSDP2 through Lightning's ModelParallelStrategy) on 2 CPU processes over gloo: it trains, writes
folders of shards, and every command (validate, test, predict, export, runs, a resume) reads them; mistakes are
one line before anything is written."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from template.engine.resume import checkpoints
from template.engine.strategies import fsdp
from template.nets import MLP
from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env, made_once

FSDP = ["--config", str(CONFIGS / "fsdp_cpu.yaml")]
TINY = [
    "--trainer.max_epochs=2", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.deterministic=true",
    "--trainer.log_every_n_steps=1",
]  # fmt: skip
WAIT = 300
SHARDED_LINE = "fsdp: sharded net.layers.1, net.layers.4, net.layers.7, then the whole module, over 2 processes"


def _errors(done) -> list[str]:  # noqa: ANN001 - CompletedProcess
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]


def _val_accs(run: Path) -> list[float]:
    with (run / "metrics.csv").open(newline="") as f:
        return [float(r["val_acc"]) for r in csv.DictReader(f) if r.get("val_acc")]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A named fsdp run of 2 epochs: its working folder."""

    def make(work: Path) -> None:
        command = [sys.executable, "-m", PACKAGE, "fit", *FSDP, *TINY, "--run.name=f"]
        done = subprocess.run(command, cwd=work, env=cli_env(), capture_output=True, text=True, timeout=WAIT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (work / "fit.out").write_text(done.stdout + done.stderr)

    return made_once(tmp_path_factory, "fsdp-run", make)


@pytest.mark.slow  # 2 processes, like every test here but the mistakes (found before any process starts)
def test_fsdp_trains_and_writes_whole_folders_of_shards(fsdp_run: Path) -> None:
    output = (fsdp_run / "fit.out").read_text()
    assert "Starting with 2 processes" in output and output.count(SHARDED_LINE) == 1, output[-3000:]
    assert "strategy fsdp on cpu" in output and "Traceback" not in output
    run = fsdp_run / "lightning_logs" / "f"
    folder = run / "checkpoints"
    # Only whole checkpoints under their names: no temporary or replaced folder left beside them.
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".ckpt")) == []
    last = folder / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    joined = checkpoints.load_sharded(last)
    assert joined["global_step"] == 8 and joined["epoch"] == 1
    net = MLP((1, 8, 8), 10)
    weights = {k.removeprefix("net."): v for k, v in joined["state_dict"].items()}
    net.load_state_dict(weights)  # whole tensors of the plain network's shapes and names
    assert len(_val_accs(run)) == 2


@pytest.mark.slow
def test_validate_test_predict_and_export_read_the_shards(fsdp_run: Path, run_cli, tmp_path: Path) -> None:
    last = fsdp_run / "lightning_logs" / "f" / "checkpoints" / "last.ckpt"
    fitted = _val_accs(fsdp_run / "lightning_logs" / "f")[-1]
    done = run_cli("validate", *FSDP, *TINY, "--ckpt_path", last, timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (version,) = (fsdp_run / "lightning_logs" / "f" / "validate").iterdir()  # beside the run of the checkpoint
    assert _val_accs(version) == pytest.approx([fitted], abs=1e-6)

    done = run_cli("test", *FSDP, *TINY, "--ckpt_path", last, timeout=WAIT)
    assert done.returncode == 0 and "test_acc" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    done = run_cli("predict", *FSDP, *TINY, "--ckpt_path", last, "--trainer.limit_predict_batches=2", timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (predictions,) = (fsdp_run / "lightning_logs" / "f" / "predict").rglob("predictions*.csv")
    # One file from both processes, each with two batches of 32: every index once, in the data's order.
    assert [int(row["index"]) for row in csv.DictReader(predictions.open())] == list(range(128))

    # export joins the shards into one plain state_dict that the bare network loads.
    done = run_cli("export", last, "--output", "net.pt", timeout=WAIT)
    assert done.returncode == 0, done.stderr[-3000:]
    net = MLP((1, 8, 8), 10)
    net.load_state_dict(torch.load(tmp_path / "net.pt", weights_only=True))
    expected = checkpoints.load_sharded(last)["state_dict"]
    assert all(torch.equal(v, expected[f"net.{k}"]) for k, v in net.state_dict().items())

    # The runs table reads the run.
    done = run_cli("runs", fsdp_run / "lightning_logs", timeout=WAIT)
    assert done.returncode == 0 and "finished" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_sharded_checkpoint_under_another_strategy_is_one_line(fsdp_run: Path, run_cli, tmp_path: Path) -> None:
    last = fsdp_run / "lightning_logs" / "f" / "checkpoints" / "last.ckpt"
    done = run_cli("validate", "--ckpt_path", last, *TINY, timeout=WAIT)
    (line,) = _errors(done)
    assert done.returncode != 0 and "is sharded" in line and "--trainer.strategy=fsdp" in line and "export" in line
    assert "Traceback" not in done.stderr and not (tmp_path / "lightning_logs").exists()


@pytest.mark.slow
def test_a_whole_checkpoint_loads_into_the_shards(run_cli, tmp_path: Path) -> None:
    """A checkpoint of one process, evaluated under fsdp: the metric DDP measures on the same split of the data."""
    done = run_cli("fit", *TINY, "--run.name=one", timeout=WAIT)
    assert done.returncode == 0, done.stderr[-3000:]
    last = tmp_path / "lightning_logs" / "one" / "checkpoints" / "last.ckpt"
    measured = {}
    for n, (strategy, config) in enumerate((("ddp", "ddp_cpu.yaml"), ("fsdp", "fsdp_cpu.yaml"))):
        done = run_cli("validate", "--config", CONFIGS / config, *TINY, "--ckpt_path", last, timeout=WAIT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        measured[strategy] = _val_accs(last.parent.parent / "validate" / f"version_{n}")  # beside the checkpoint's run
    assert measured["fsdp"] == pytest.approx(measured["ddp"], abs=1e-6) and len(measured["fsdp"]) == 1


@pytest.mark.slow
def test_a_run_continues_on_another_number_of_processes(fsdp_run: Path, run_cli, tmp_path: Path) -> None:
    """The shards are re-split for one process; the random states cannot be, and a line says so. Folders a kill left
    mid-write (a half-written checkpoint, a replaced one) are never resumed from, and the next save removes them."""
    shutil.copytree(fsdp_run / "lightning_logs", tmp_path / "lightning_logs")
    folder = tmp_path / "lightning_logs" / "f" / "checkpoints"
    (folder / ".last.ckpt.partial").mkdir()
    (folder / ".last.ckpt.partial" / "__0_0.distcp").write_bytes(b"half")
    shutil.copytree(folder / "last.ckpt", folder / ".last.ckpt.partial.old")
    more = [a.replace("max_epochs=2", "max_epochs=3") for a in TINY]
    warnings_shown = cli_env(PYTHONWARNINGS="default")
    done = run_cli("fit", *FSDP, *more, "--run.name=f", "--trainer.devices=1", env=warnings_shown, timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "random states of 2 processes but this run has 1" in done.stdout + done.stderr, done.stderr[-3000:]
    assert "resuming from lightning_logs/f/checkpoints/last.ckpt (epoch 1, step 8)" in done.stdout + done.stderr
    assert checkpoints.load_sharded(folder / "last.ckpt")["global_step"] == 12
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".ckpt")) == []


@pytest.mark.slow
def test_a_module_that_shards_itself_keeps_its_sharding(run_cli, tmp_path: Path) -> None:
    env_path = os.pathsep.join([str(REPO / "tests" / "user_code"), os.environ.get("PYTHONPATH", "")])
    model = ["--model.class_path=sharded_model.SelfShardedClassifier", "--model.init_args.net=template.nets.MLP"]
    done = run_cli("fit", *FSDP, *TINY, *model, env=cli_env(PYTHONPATH=env_path), timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "fsdp: sharded" not in done.stdout + done.stderr
    (version,) = (tmp_path / "lightning_logs").iterdir()
    assert len(_val_accs(version)) == 2


def test_checkpointed_layers_are_sharded_inside_their_wrappers(tmp_path: Path) -> None:
    """In one process (gloo, world size 1): the default units keep their names when they are also checkpointed, and
    each is sharded with its activation-checkpointing wrapper around it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    module = nn.Module()
    module.net = MLP((1, 8, 8), 10)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        units = fsdp.shard(module, init_device_mesh("cpu", (1,)), None, ["Linear"], True, bf16=False)
        assert units == ["net.layers.1", "net.layers.4", "net.layers.7"]
        for name in units:
            unit = module.get_submodule(name)
            assert isinstance(unit, FSDPModule) and type(unit).__name__.endswith("CheckpointWrapper"), type(unit)
        module.net(torch.randn(3, 1, 8, 8)).sum().backward()
        assert fsdp.is_sharded(module) and all(p.grad is not None for p in module.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--trainer.precision=16-mixed"], ["trainer.precision=16-mixed", "bf16-mixed"]),
        (["--ema.decay=0.9"], ["ema.decay=0.9", "--ema.decay=null"]),
        (
            ["--trainer.strategy=template.engine.strategies.FSDP2Strategy", "--trainer.strategy.shard_layers=[Nope]"],
            ["shard_layers=['Nope']", "Linear"],
        ),
        (["--model.net=torch.nn.LazyLinear", "--model.net.out_features=10"], ["lazy layer", "nn.Linear"]),
        (["--trainer.strategy.shard_layers=[Linear]"], ["given by name", "FSDP2Strategy", "shard_layers"]),
    ],
    ids=["fp16-mixed", "ema", "shard-layers-naming-nothing", "lazy-layer", "option-of-the-name"],
)
def test_fsdp_mistakes_are_one_line_before_anything_is_written(
    extra: list[str], words: list[str], run_cli, tmp_path: Path
) -> None:
    done = run_cli("fit", *FSDP, *TINY, *extra, timeout=WAIT)
    errors = _errors(done)
    assert done.returncode != 0 and len(errors) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(w in errors[0] for w in words), errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "lightning_logs").exists() or not any((tmp_path / "lightning_logs").iterdir())
