"""The GPU paths on one real GPU, each a real command in its own process group with a timeout: one device, strategy
dp over [0], ddp over NCCL, bf16-mixed, ``devices: free:1``, fsdp (resuming a ddp checkpoint, then its own sharded
one), and the one-line refusal of a free-memory floor no GPU meets.

Marked ``gpu(1)``: ``python -m pytest -m gpu`` runs them on a machine with a GPU (scripts/gpu_check.sh does);
skipped, with the count named, elsewhere. Marked slow too: the fast suite on a GPU machine leaves them out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, cli_env, finish

pytestmark = [pytest.mark.gpu(1), pytest.mark.slow]

WAIT = 300  # one run: start-up (10-15 s to import on a GPU node), NCCL's rendezvous, 2 short epochs
SHORT = ("--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false")


def _fit(work: Path, name: str, *args: str, epochs: int = 2, expect: int = 0) -> str:
    """``python -m <package> fit *args`` in ``work``, its own process group (a timeout ends it and every child);
    the output, after asserting the exit code."""
    log = work / f"{name}.log"
    command = [sys.executable, "-m", PACKAGE, "fit", *args, f"--trainer.max_epochs={epochs}", *SHORT]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=work, env=cli_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        code = finish(proc, WAIT, f"the {name} run")
    output = log.read_text()
    assert code == expect, output[-3000:]
    if expect == 0:
        assert "Best checkpoint" in output, output[-3000:]
        # The command line sets float32 matmuls' precision on CUDA: Lightning's hint about it never shows.
        assert "Tensor Cores" not in output, output[-3000:]
    return output


def _summary(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("Run: strategy")]
    return line


def test_one_device(tmp_path: Path) -> None:
    output = _fit(tmp_path, "single", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=gpu")
    assert _summary(output).startswith("Run: strategy single_device on cuda, 1 node(s) x 1 device(s)")


def test_dp_over_one_gpu_resumes_a_single_device_checkpoint(tmp_path: Path) -> None:
    _fit(tmp_path, "single", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=gpu", "--run.name=r")
    output = _fit(
        tmp_path, "dp", "--config", str(CONFIGS / "dp.yaml"), "--trainer.devices=[0]", "--run.name=r", epochs=4
    )
    assert "resuming from" in output and _summary(output).startswith("Run: strategy dp on cuda"), output[-3000:]


def test_ddp_over_nccl(tmp_path: Path) -> None:
    output = _fit(tmp_path, "ddp", "--config", str(CONFIGS / "ddp.yaml"), "--trainer.devices=[0]")
    assert "distributed_backend=nccl" in output, output[-3000:]
    assert _summary(output).startswith("Run: strategy ddp on cuda"), output[-3000:]


def test_bf16_mixed(tmp_path: Path) -> None:
    output = _fit(tmp_path, "bf16", "--config", str(CONFIGS / "bf16.yaml"), "--trainer.accelerator=gpu")
    assert "precision bf16-mixed" in _summary(output) and " on cuda," in _summary(output)


def test_free_1_picks_the_gpu_and_says_so(tmp_path: Path) -> None:
    pytest.importorskip("pynvml", reason="free:N reads free memory through NVML: pip install -e '.[gpu]'")
    output = _fit(tmp_path, "free", "--config", str(CONFIGS / "ddp.yaml"), "--trainer.devices=free:1")
    assert "training on GPU(s) [0]" in output, output[-3000:]


def test_fsdp_resumes_a_ddp_checkpoint_and_then_its_own_shards(tmp_path: Path) -> None:
    fsdp = ("--config", str(CONFIGS / "fsdp.yaml"), "--trainer.devices=[0]", "--run.name=r")
    _fit(tmp_path, "ddp", "--config", str(CONFIGS / "ddp.yaml"), "--trainer.devices=[0]", "--run.name=r")
    output = _fit(tmp_path, "fsdp", *fsdp, epochs=4)  # the whole ddp checkpoint loads into the shards
    assert "resuming from" in output and "distributed_backend=nccl" in output, output[-3000:]
    assert "fsdp: sharded" in output and "precision bf16-mixed" in _summary(output), output[-3000:]
    output = _fit(tmp_path, "fsdp_resumed", *fsdp, epochs=6)  # from fsdp's sharded checkpoint folder
    assert "resuming from" in output, output[-3000:]
    assert (tmp_path / "lightning_logs" / "r" / "checkpoints" / "last.ckpt").exists()


def test_an_impossible_free_memory_floor_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("pynvml", reason="free:N reads free memory through NVML: pip install -e '.[gpu]'")
    floor = ("--config", str(CONFIGS / "ddp.yaml"), "--trainer.devices=free:1,min=100000GiB")
    output = _fit(tmp_path, "refused", *floor, expect=2)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "min=100000GiB" in errors[0] and "qualify" in errors[0], output[-3000:]
    assert "Traceback" not in output
    assert not (tmp_path / "lightning_logs").exists()
