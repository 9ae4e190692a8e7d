"""strategy dp on CPU: selection by name, YAML, command line and class_path; the one-line errors; the wrap/unwrap
routing and checkpoint keys. Without CUDA ``nn.DataParallel`` is a pass-through, so the split itself is only
exercised by tests/strategies/test_dp_gpu.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from template.data import DigitsDataModule
from template.engine.commands import cli  # importing the command line is what registers "dp"
from template.engine.errors import ConfigError
from template.engine.strategies import dp
from template.engine.strategies.dp import (
    DataParallelStrategy,
    ParallelForward,
    check_dp_settings,
    under_callers_autocast,
)
from template.model import Classifier
from template.nets import MLP
from tests.conftest import CONFIGS, PACKAGE, cli_env


def _report_instead_of_training(self: cli.CLI) -> None:
    strategy = self.trainer.strategy
    built = {
        "strategy": type(strategy).__name__,
        "devices": [str(d) for d in strategy.parallel_devices],
        "root": str(strategy.root_device),
        "precision": type(strategy.precision_plugin).__name__,
        "module_name": strategy.module_name,
        "world_size": self.trainer.world_size,
    }
    print("BUILT " + json.dumps(built))
    sys.exit(0)


@pytest.fixture
def run_with_fake_gpus(run_main, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """The real command line, in process, with ``torch.cuda.device_count`` faked; it prints the Trainer it built
    instead of training (the CUDA calls of training cannot be faked): parsing, selection and checks only."""

    def run(gpus: int, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(cli.CLI, "before_fit", _report_instead_of_training)
        return run_main(*args)

    return run


def built(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("BUILT "))
    return json.loads(line[len("BUILT ") :])


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a failed run; fails if there is a traceback or more than one."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0]


# --- selection ---------------------------------------------------------------------------------------------------


def test_registry_name_builds_the_strategy_and_the_trainer_checks_it() -> None:
    assert isinstance(StrategyRegistry.get("dp"), DataParallelStrategy)
    # A real Trainer resolves "dp" through the registry (else: Lightning's "invalid strategy name").
    with pytest.raises(ConfigError, match=r"trainer.accelerator is 'cpu'.*configs/ddp_cpu.yaml"):
        Trainer(strategy="dp", accelerator="cpu", devices=1, logger=False)


def test_yaml_selects_dp_over_a_device_list_with_mixed_precision(run_with_fake_gpus) -> None:  # noqa: ANN001
    result = run_with_fake_gpus(
        4, "fit", "--config", CONFIGS / "dp.yaml", "--trainer.devices=[2,0]", "--trainer.precision=16-mixed"
    )
    assert built(result) == {
        "strategy": "DataParallelStrategy",
        "devices": ["cuda:2", "cuda:0"],
        "root": "cuda:2",  # the first listed device, not the lowest index
        "precision": "MixedPrecision",  # the accelerator connector's plugin, handed to the strategy
        "module_name": "net",
        "world_size": 1,
    }


def test_command_line_selects_dp_with_a_device_count(run_with_fake_gpus) -> None:  # noqa: ANN001
    args = ["--trainer.strategy=dp", "--trainer.accelerator=gpu", "--trainer.devices=3"]
    info = built(run_with_fake_gpus(4, "fit", "--config", CONFIGS / "default.yaml", *args))
    assert (info["strategy"], info["devices"], info["root"]) == (
        "DataParallelStrategy",
        ["cuda:0", "cuda:1", "cuda:2"],
        "cuda:0",
    )


def test_class_path_form_with_init_args(run_with_fake_gpus, tmp_path: Path) -> None:  # noqa: ANN001
    config = tmp_path / "dp_class.yaml"
    config.write_text(
        "trainer:\n  accelerator: gpu\n  devices: 2\n  strategy:\n"
        f"    class_path: {PACKAGE}.engine.strategies.DataParallelStrategy\n    init_args:\n      module_name: net\n"
    )
    info = built(run_with_fake_gpus(2, "fit", "--config", config))
    assert (info["strategy"], info["devices"], info["module_name"]) == (
        "DataParallelStrategy",
        ["cuda:0", "cuda:1"],
        "net",
    )


def test_print_config_shows_dp(run_main) -> None:
    result = run_main("fit", "--config", CONFIGS / "dp.yaml", "--print_config")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "  strategy: dp\n" in result.stdout


# --- one-line errors through the real command ----------------------------------------------------------------------


@pytest.mark.slow
def test_dp_without_a_gpu_points_to_the_cpu_config(run_cli, tmp_path: Path) -> None:
    # GPUs hidden, so that the test means the same on a machine that has some.
    line = one_line_error(run_cli("fit", "--config", CONFIGS / "dp.yaml", env=cli_env(CUDA_VISIBLE_DEVICES="")))
    assert (
        "needs CUDA GPUs but this process sees none (torch.cuda.device_count() is 0, CUDA_VISIBLE_DEVICES='')" in line
    )
    assert "to train data-parallel on CPU use --config configs/ddp_cpu.yaml" in line
    assert not (tmp_path / "lightning_logs").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "--trainer.accelerator=cpu",
            r"trainer.accelerator is 'cpu'; set trainer.accelerator=gpu.*configs/ddp_cpu.yaml",
        ),
        ("--trainer.num_nodes=2", r"trainer.num_nodes is 2; set trainer.num_nodes=1, or use strategy ddp"),
        ("--trainer.sync_batchnorm=true", r"sync_batchnorm=true needs one process per GPU \(strategy ddp\)"),
    ],
)
def test_settings_dp_cannot_run(run_main, override: str, expected: str) -> None:
    line = one_line_error(run_main("fit", "--config", CONFIGS / "dp.yaml", override))
    assert re.search(expected, line), line


def test_missing_device_index_names_the_visible_gpus(run_with_fake_gpus) -> None:  # noqa: ANN001
    line = one_line_error(run_with_fake_gpus(2, "fit", "--config", CONFIGS / "dp.yaml", "--trainer.devices=[0,2]"))
    assert "trainer.devices=[0, 2] asks for GPU index 2 but this process sees 2 GPU(s), indices [0, 1]" in line


@pytest.mark.parametrize(
    ("devices", "bad"),
    [(3, "2"), ("3", "2"), ("0,4", "4"), ([1, -2], "-2")],
)
def test_device_values_are_read_like_lightning(monkeypatch: pytest.MonkeyPatch, devices, bad: str) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    for fine in (-1, "-1", "auto", 2, "0,1", [1]):
        check_dp_settings("gpu", fine, 1)
    with pytest.raises(ConfigError, match=rf"asks for GPU index {bad} .*CUDA_VISIBLE_DEVICES=3,5 renumbers"):
        check_dp_settings("gpu", devices, 1)


# --- the strategy object on CPU --------------------------------------------------------------------------------------


class CpuDataParallel(DataParallelStrategy):
    """The real strategy minus its CUDA checks, so that a CPU Trainer runs its wrap/unwrap and checkpoint paths."""

    def set_world_ranks(self) -> None:
        pass


@pytest.fixture
def pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """nn.DataParallel as on a machine without CUDA (a pass-through), also when the test box has GPUs."""
    # The module, not the function of the same name that torch.nn.parallel exports.
    monkeypatch.setattr(sys.modules["torch.nn.parallel.data_parallel"], "_get_available_device_type", lambda: None)


class Recorder(Callback):
    """What the LightningModule's ``net`` attribute is while training, and whether its forward went through DP."""

    def __init__(self) -> None:
        self.seen: list[tuple[type, bool, list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        child = pl_module._modules["net"]
        # The wrapper holds the registered child itself, and attribute lookups still reach into it.
        same = pl_module.net.module is child and pl_module.net.layers is child.layers
        self.seen.append((type(pl_module.net), same, list(pl_module.state_dict())))


def digits(tmp_path: Path, batch_size: int = 32) -> DigitsDataModule:
    return DigitsDataModule(data_dir=str(tmp_path / "data"), batch_size=batch_size)


def classifier() -> Classifier:
    return Classifier(MLP(input_shape=(1, 8, 8), num_classes=10, dropout=0.0), num_classes=10)


def fit(tmp_path: Path, name: str, strategy, callbacks=(), **kwargs) -> tuple[Classifier, Trainer]:  # noqa: ANN001
    seed_everything(7)
    model = classifier()
    trainer = Trainer(
        accelerator="cpu",
        devices=kwargs.pop("devices", 1),
        strategy=strategy,
        max_steps=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / name,
        callbacks=list(callbacks),
        **kwargs,
    )
    trainer.fit(model, datamodule=digits(tmp_path))
    return model, trainer


def test_training_routes_net_through_dataparallel_and_unwraps_after(
    tmp_path: Path, pass_through: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    original = ParallelForward.forward
    monkeypatch.setattr(
        ParallelForward, "forward", lambda self, *a, **k: calls.append(a[0].shape[0]) or original(self, *a, **k)
    )
    recorder = Recorder()
    model, trainer = fit(tmp_path, "dp", CpuDataParallel(), [recorder], devices=2)

    plain_keys = list(classifier().state_dict())
    assert recorder.seen and all(seen == (ParallelForward, True, plain_keys) for seen in recorder.seen)
    # Every forward of the network went through the wrapper: 3 training batches and the validation batches.
    assert calls[:3] == [32, 32, 32] and len(calls) >= 3 + 2
    assert type(model.net) is MLP and "net" not in model.__dict__  # unwrapped: the plain child again
    assert trainer.num_devices == 2 and trainer.world_size == 1


def test_checkpoint_keys_match_single_device_and_load_anywhere(tmp_path: Path, pass_through: None) -> None:
    single, single_trainer = fit(tmp_path, "single", "auto")
    parallel, parallel_trainer = fit(tmp_path, "dp", CpuDataParallel(), devices=2)
    single_trainer.save_checkpoint(tmp_path / "single.ckpt")
    parallel_trainer.save_checkpoint(tmp_path / "dp.ckpt")

    # Hand-built models keep the optimizer class in their hyper-parameters: a trusted file, not weights only.
    single_state = torch.load(tmp_path / "single.ckpt", weights_only=False)["state_dict"]
    dp_state = torch.load(tmp_path / "dp.ckpt", weights_only=False)["state_dict"]
    assert list(dp_state) == list(single_state) and not any("module." in key for key in dp_state)
    # Same seed, same batches, pass-through replicas: the same training.
    assert all(torch.equal(dp_state[k], single_state[k]) for k in single_state)

    plain = Classifier.load_from_checkpoint(
        tmp_path / "dp.ckpt", net=MLP((1, 8, 8), 10, dropout=0.0), weights_only=False
    )
    assert all(torch.equal(v, dp_state[k]) for k, v in plain.state_dict().items())
    # The dp checkpoint resumes under one device, and the single-device one under dp.
    resumed = Trainer(
        accelerator="cpu", devices=1, max_steps=5, limit_val_batches=0, logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path / "single-resumed",
    )  # fmt: skip
    resumed.fit(classifier(), datamodule=digits(tmp_path), ckpt_path=tmp_path / "dp.ckpt", weights_only=False)
    assert resumed.global_step == 5
    resumed = Trainer(
        accelerator="cpu", devices=2, strategy=CpuDataParallel(), max_steps=5, limit_val_batches=0, logger=False,
        enable_progress_bar=False, default_root_dir=tmp_path / "dp-resumed",
    )  # fmt: skip
    resumed.fit(classifier(), datamodule=digits(tmp_path), ckpt_path=tmp_path / "single.ckpt", weights_only=False)
    assert resumed.global_step == 5


def test_batch_smaller_than_the_device_count_is_refused(tmp_path: Path, pass_through: None) -> None:
    model = classifier()
    trainer = Trainer(
        accelerator="cpu", devices=3, strategy=CpuDataParallel(), max_steps=1, logger=False, default_root_dir=tmp_path
    )
    loader = DataLoader(TensorDataset(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))), batch_size=2)
    with pytest.raises(ConfigError, match=r"the batch size is 2 but strategy dp splits every batch over 3 GPUs"):
        trainer.fit(model, train_dataloaders=loader)


def test_module_without_the_named_network_is_refused(tmp_path: Path, pass_through: None) -> None:
    class NoNet(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=CpuDataParallel(), max_steps=1, logger=False, default_root_dir=tmp_path
    )
    with pytest.raises(ConfigError, match=r"network `net`, but NoNet has no nn.Module child of that name"):
        trainer.fit(NoNet(), train_dataloaders=DataLoader(TensorDataset(torch.rand(4, 4)), batch_size=2))
    # Named through init_args, the same module trains with its `layer` wrapped.
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=CpuDataParallel(module_name="layer"), max_steps=1, logger=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(NoNet(), train_dataloaders=DataLoader(TensorDataset(torch.rand(4, 4)), batch_size=2))
    assert trainer.global_step == 1


def test_single_process_collectives_are_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = DataParallelStrategy(parallel_devices=[torch.device("cuda", 1), torch.device("cuda", 0)])
    environment = LightningEnvironment()
    # set_global_rank also sets the process-wide rank_zero_only.rank: restore it, or later Trainers here stop logging.
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    environment.set_global_rank(3)  # whatever a detected cluster says, dp is one process
    strategy.cluster_environment = environment
    value = torch.tensor([1.0, 3.0])
    assert strategy.reduce(value, reduce_op="mean") is value and strategy.all_gather(value) is value
    assert strategy.broadcast(obj := {"a": 1}) is obj and strategy.barrier("x") is None
    assert strategy.reduce_boolean_decision(False) is False
    assert (strategy.global_rank, strategy.world_size, strategy.is_global_zero) == (0, 1, True)
    assert strategy.root_device == torch.device("cuda", 1) and strategy.distributed_sampler_kwargs is None


def test_replica_threads_keep_the_callers_autocast_dtype() -> None:
    # torch's replica threads get only "autocast on"; the wrapper carries the dtype (bf16 here) across threads.
    layer = nn.Linear(4, 4)
    x = torch.rand(2, 4)
    results = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped = under_callers_autocast(layer, "cpu")
    for name, fn in (("wrapped", wrapped), ("plain", layer)):
        thread = threading.Thread(target=lambda n=name, f=fn: results.__setitem__(n, f(x).dtype))
        thread.start()
        thread.join(timeout=30)
    assert results == {"wrapped": torch.bfloat16, "plain": torch.float32}
    assert dp.CPU_ALTERNATIVE == "configs/ddp_cpu.yaml" and (CONFIGS.parent / dp.CPU_ALTERNATIVE).is_file()
