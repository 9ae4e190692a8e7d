"""Portable weights: the exported state_dict loads weights-only into the bare net; DP/DDP/compiled files load too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from template.engine.commands.cli import main
from template.engine.commands.export import clean_key, extract_state_dict, load_weights
from template.engine.resume.checkpoints import load
from template.model import Classifier
from template.nets import MLP
from tests.conftest import CONFIGS, PACKAGE


def _net() -> MLP:
    torch.manual_seed(0)
    return MLP(input_shape=(1, 8, 8), num_classes=10)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    # Compared on the CPU: nn.DataParallel moves the module it wraps to cuda:0 where a GPU is visible.
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@pytest.mark.slow
def test_export_from_a_real_run_loads_into_the_bare_net(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    fit = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt"
    done = run_cli("export", checkpoint, "--output", "exported/net.pt")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported/net.pt" in done.stdout

    # Plain PyTorch, no project code: the bare network and torch.load(weights_only=True).
    net = MLP(input_shape=(1, 8, 8), num_classes=10)
    net.load_state_dict(torch.load(tmp_path / "exported/net.pt", weights_only=True))
    model = Classifier.load_from_checkpoint(checkpoint, weights_only=True)
    assert _same_weights(net, model.net)
    x = torch.rand(5, 1, 8, 8)
    net.eval(), model.eval()
    assert torch.equal(net(x), model(x))


def test_dataparallel_checkpoint_loads(tmp_path: Path) -> None:
    source = _net()
    torch.save(nn.DataParallel(source).state_dict(), tmp_path / "dp.pt")
    assert all(k.startswith("module.") for k in torch.load(tmp_path / "dp.pt", weights_only=True))
    assert _same_weights(load_weights(MLP((1, 8, 8), 10), tmp_path / "dp.pt"), source)


def test_ddp_checkpoint_loads(tmp_path: Path) -> None:
    source = _net()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = nn.parallel.DistributedDataParallel(source).state_dict()
    finally:
        dist.destroy_process_group()
    torch.save({"epoch": 3, "model_state_dict": state}, tmp_path / "ddp.pt")  # the common hand-written layout
    assert _same_weights(load_weights(MLP((1, 8, 8), 10), tmp_path / "ddp.pt"), source)


def test_compiled_checkpoints_load(tmp_path: Path) -> None:
    source = _net()
    compiled = torch.compile(source)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    torch.save(compiled.state_dict(), tmp_path / "compiled.pt")
    assert _same_weights(load_weights(MLP((1, 8, 8), 10), tmp_path / "compiled.pt"), source)
    # DataParallel around a compiled model, and a compiled submodule inside a plain one.
    torch.save(nn.DataParallel(compiled).state_dict(), tmp_path / "dp_compiled.pt")
    assert _same_weights(load_weights(MLP((1, 8, 8), 10), tmp_path / "dp_compiled.pt"), source)
    assert clean_key("layers._orig_mod.0.weight") == "layers.0.weight"


def test_map_location(tmp_path: Path) -> None:
    torch.save(_net().state_dict(), tmp_path / "net.pt")
    meta = extract_state_dict(load(tmp_path / "net.pt", map_location="meta"))
    assert {t.device.type for t in meta.values()} == {"meta"}


@pytest.mark.gpu(1)
def test_map_location_onto_a_gpu(tmp_path: Path) -> None:
    torch.save(_net().state_dict(), tmp_path / "net.pt")
    net = load_weights(MLP((1, 8, 8), 10).cuda(), tmp_path / "net.pt", map_location="cuda:0")
    assert next(net.parameters()).is_cuda


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (None, "does not exist"),
        (lambda p: p.write_bytes(b"junk"), "cannot be loaded"),
        (lambda p: torch.save({"step": 3, "name": "x"}, p), "does not hold a state_dict"),
    ],
    ids=["missing", "corrupt", "not-a-state-dict"],
)
def test_export_bad_input_is_one_line(tmp_path: Path, capsys, monkeypatch, make, fragment: str) -> None:  # noqa: ANN001
    source = tmp_path / "in.ckpt"
    if make is not None:
        make(source)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(source), "--output", str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("error:"), err
    assert fragment in err and "in.ckpt" in err, err
    assert not (tmp_path / "out.pt").exists()
