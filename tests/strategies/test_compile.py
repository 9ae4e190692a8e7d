"""``torch.compile`` from YAML: the network compiled in place under single, DDP and dp, checkpoint keys unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from template.data import DigitsDataModule
from template.engine.errors import ConfigError
from template.engine.strategies.compile import CompileNetwork
from template.engine.strategies.dp import share_compiled_call
from template.model import Classifier
from template.nets import MLP
from tests.conftest import CONFIGS

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on CPU needs a C compiler (cc)")


@pytest.mark.slow
def test_compiled_network_trains_and_keeps_plain_checkpoint_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Classifier(MLP((1, 8, 8), 10, dropout=0.0), num_classes=10)
    plain_keys = set(model.state_dict())
    trainer = Trainer(
        max_epochs=1, limit_train_batches=5, limit_val_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[CompileNetwork(enabled=True)],
    )  # fmt: skip
    trainer.fit(model, DigitsDataModule(data_dir=str(tmp_path / "data")))
    assert model.net._compiled_call_impl is not None  # the network really ran compiled
    assert trainer.global_step == 5
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)
    assert set(checkpoint["state_dict"]) == plain_keys  # no `_orig_mod.`: loads into an uncompiled model
    Classifier(MLP((1, 8, 8), 10), num_classes=10).load_state_dict(checkpoint["state_dict"])


def _replica(module: torch.nn.Module) -> torch.nn.Module:
    """What DataParallel's replicate builds, minus the copy to another GPU: weights as plain tensor attributes."""
    replica = module._replicate_for_data_parallel()
    for name, child in module._modules.items():
        replica._modules[name] = _replica(child)
    for name, parameter in module._parameters.items():
        setattr(replica, name, parameter.detach().clone())
    return replica


@pytest.mark.slow  # compiles the network on the CPU (about 10 s)
def test_dp_replicas_run_compiled_code_on_their_own_weights() -> None:
    net = MLP((1, 8, 8), 10, dropout=0.0)
    net.compile()
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        expected = net(x)
        for _ in range(3):  # DataParallel builds new replicas on every step
            replicas = share_compiled_call(net, [_replica(net) for _ in range(2)])
            replicas[1].layers[-1].bias = replicas[1].layers[-1].bias + 1  # this replica's own weights
            outputs = [replica(x) for replica in replicas]
            torch.testing.assert_close(outputs[0], expected)
            torch.testing.assert_close(outputs[1], expected + 1)  # not the original's weights
    without = [_replica(net) for _ in range(2)]  # the bug share_compiled_call fixes: every replica runs net's weights
    without[1].layers[-1].bias = without[1].layers[-1].bias + 1
    with torch.no_grad():
        torch.testing.assert_close(without[1](x), expected)


def test_compile_names_the_missing_network_attribute() -> None:
    model = Classifier(MLP((1, 8, 8), 10), num_classes=10)
    with pytest.raises(ConfigError, match=r"compile.module_name='backbone' is not a network of Classifier .*'net'"):
        CompileNetwork(enabled=True, module_name="backbone").setup(None, model, "fit")  # type: ignore[arg-type]


@pytest.mark.slow
def test_compile_under_ddp_from_the_command_line(run_cli, tmp_path: Path) -> None:
    result = run_cli(
        "fit", "--config", CONFIGS / "ddp_cpu.yaml", "--compile.enabled=true", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4
    assert all(key.startswith("net.layers.") for key in checkpoint["state_dict"])
