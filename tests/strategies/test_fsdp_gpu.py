"""Strategy fsdp on real GPUs: configs/fsdp.yaml as shipped (2 GPUs, NCCL, bf16-mixed, one unit per Linear), a
stop and the same command again, bit-identical to the run that was not stopped.

Marked ``gpu(2)``: skipped without 2 CUDA GPUs; written to run as is on a multi-GPU machine."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from template.engine.resume import checkpoints
from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env, finish, pythonpath

pytestmark = pytest.mark.gpu(2)  # configs/fsdp.yaml shards over 2 GPUs

RUN = [
    sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "fsdp.yaml"), "--trainer.max_epochs=2",
    "--trainer.deterministic=true", "--trainer.enable_progress_bar=false", "--run.name=r",
]  # fmt: skip
WAIT = 600


# tests/fault.py stops the run from inside, at the end of epoch 1's third training batch, on both ranks.
FAULT = (
    "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: "
    "{moment: train_batch, signal: SIGTERM, epoch: 1, batch: 2, ranks: [0, 1]}\n"
)


def _run(work: Path, *extra: str) -> tuple[int, str]:
    env = cli_env(PYTHONPATH=pythonpath(REPO / "tests"))
    with (work / "run.log").open("a") as out:
        proc = subprocess.Popen(
            [*RUN, *extra], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own process group: a timeout ends both ranks
        return finish(proc, WAIT), (work / "run.log").read_text()


def test_fsdp_config_trains_in_bf16_over_nccl_and_resumes_exactly(tmp_path: Path) -> None:
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir()
    stopped.mkdir()
    code, output = _run(whole)
    assert code == 0, output[-3000:]
    assert "distributed_backend=nccl" in output and "precision bf16-mixed" in output
    assert "fsdp: sharded net.layers" in output

    (stopped / "fault.yaml").write_text(FAULT)
    code, output = _run(stopped, "--config", "fault.yaml")
    assert code == 128 + signal.SIGTERM, output[-3000:]
    code, output = _run(stopped, "--config", "fault.yaml")
    assert code == 0, output[-3000:]

    last = "lightning_logs/r/checkpoints/last.ckpt"
    reference, resumed = (checkpoints.load_sharded(work / last) for work in (whole, stopped))
    assert reference["global_step"] == resumed["global_step"]
    for name, tensor in reference["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), name
    # Adam's moments and step counts, per parameter, bit for bit too.
    (expected,), (got,) = reference["optimizer_states"], resumed["optimizer_states"]
    assert expected["state"].keys() == got["state"].keys()
    for name, state in expected["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][name][key])), (name, key)
