"""What a command changes for its whole process (the GPUs a CPU run hides, the matmul precision, the strategy names)
lasts only while it runs: a second command, or the user's own code, in the same process sees the world as it was."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

from template.engine.strategies import DataParallelStrategy, FSDP2Strategy
from template.engine.strategies import devices as gpus
from tests.conftest import CONFIGS

SHORT = ("--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false")
SEEN: dict[str, object] = {}


class Probe(Callback):
    """What the run saw of the process, at the start of training."""

    def on_train_start(self, trainer: Trainer, pl_module: object) -> None:
        SEEN.update(gpus=os.environ.get("CUDA_VISIBLE_DEVICES"), precision=torch.get_float32_matmul_precision())


def test_a_second_command_in_the_process_sees_the_world_as_it_was(run_main, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    torch.set_float32_matmul_precision("highest")
    fit = ("fit", "--config", CONFIGS / "default.yaml", *SHORT, f"--trainer.callbacks+={__name__}.Probe")
    for precision in ("medium", "high"):  # two commands, one after the other
        SEEN.clear()
        result = run_main(*fit, "--trainer.accelerator=cpu", f"--float32_matmul_precision={precision}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert {"gpus": "", "precision": precision} == SEEN  # the run's own: its DDP processes inherit them
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and "CUDA_DEVICE_ORDER" not in os.environ
        assert torch.get_float32_matmul_precision() == "highest"
    # The command line's fsdp is FSDP2; a Trainer of the user's own, by the same name, is still Lightning's.
    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy
    assert StrategyRegistry["dp"]["strategy"] is DataParallelStrategy  # a name Lightning has not: registered once


def test_the_free_gpus_choice_is_handed_down_for_one_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (gpus.HANDOFF_VARIABLE, "CUDA_DEVICE_ORDER", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpus, "pick_free_gpus", lambda request: ([3], "picked"))
    with gpus.settings_restored():
        trainer = {"accelerator": "gpu", "devices": "free:1"}
        gpus.resolve_free_devices(trainer)
        assert trainer["devices"] == [3] and os.environ[gpus.HANDOFF_VARIABLE] == "free:1->3"
    assert gpus.HANDOFF_VARIABLE not in os.environ


def test_the_command_lines_fsdp_is_fsdp2(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from template.engine.commands.cli import build_cli

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    options = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=fsdp", "--trainer.logger=false"]
    assert isinstance(build_cli(options, run=False).trainer.strategy, FSDP2Strategy)
    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy
