"""strategy dp on real GPUs: the split, the replicas and the gather, against single-device runs on the same batches.

Marked ``gpu(2)``: skipped without 2 CUDA GPUs; written to run as is on a multi-GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from template.data import DigitsDataModule
from template.engine.commands import cli  # noqa: F401 - importing the command line is what registers "dp"
from template.engine.strategies.dp import ParallelForward
from template.model import Classifier
from template.nets import MLP
from tests.conftest import CONFIGS

pytestmark = pytest.mark.gpu(2)  # strategy dp splits each batch over 2 GPUs

TWO_GPUS = [0, 1]


class StepRecorder(Callback):
    """The loss, the gradients and where the network's replicas ran, for every training step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.replica_calls: list[tuple[str, int, torch.dtype]] = []
        self.wrapped: list[bool] = []

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        # Replicas copy the network's hooks, so this sees each device's slice of the batch.
        def record(module, inputs, output) -> None:  # noqa: ANN001
            self.replica_calls.append((str(inputs[0].device), inputs[0].shape[0], output.dtype))

        pl_module._modules["net"].register_forward_hook(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.wrapped.append(isinstance(pl_module.net, ParallelForward))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.grads.append({n: p.grad.detach().float().cpu().clone() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


def model() -> Classifier:
    seed_everything(11)
    # No dropout: the replicas' random masks would differ from the single device's. SGD, not Adam: Adam's first
    # step is +-lr for any gradient, so float noise on a near-zero gradient would flip a weight by 2 * lr.
    net = MLP(input_shape=(1, 8, 8), num_classes=10, dropout=0.0)
    return Classifier(net, num_classes=10, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def digits_loader(tmp_path: Path, batch_size: int = 64) -> DataLoader:
    """The digits training split in a fixed order, so both runs see the same batches."""
    data = DigitsDataModule(data_dir=str(tmp_path / "data"))
    data.prepare_data()
    data.setup("fit")
    return DataLoader(data.splits["train"], batch_size=batch_size)


def train(tmp_path: Path, devices, strategy: str, loader=None, precision: str = "32-true", steps: int = 1):  # noqa: ANN001, ANN201
    recorder = StepRecorder()
    net = model()
    trainer = Trainer(
        accelerator="gpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        default_root_dir=tmp_path,
    )
    trainer.fit(net, train_dataloaders=loader if loader is not None else digits_loader(tmp_path))
    return net, recorder


def assert_same_step(single: StepRecorder, parallel: StepRecorder, rtol: float, atol: float) -> None:
    assert parallel.losses == pytest.approx(single.losses, rel=rtol, abs=atol)
    for grads_single, grads_dp in zip(single.grads, parallel.grads, strict=True):
        assert grads_dp.keys() == grads_single.keys()
        for name, grad in grads_single.items():
            torch.testing.assert_close(grads_dp[name], grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize(
    ("precision", "dtype", "tol"),
    [("32-true", torch.float32, 1e-5), ("16-mixed", torch.float16, 2e-3), ("bf16-mixed", torch.bfloat16, 2e-2)],
)
def test_one_step_equals_single_device_on_the_same_global_batch(tmp_path: Path, precision: str, dtype, tol) -> None:  # noqa: ANN001
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    _, single = train(tmp_path / "single", 1, "auto", precision=precision)
    _, parallel = train(tmp_path / "dp", TWO_GPUS, "dp", precision=precision)

    assert parallel.wrapped == [True]
    # The global batch of 64 ran as 32 + 32 on the two GPUs, in the precision of the main thread.
    assert sorted(parallel.replica_calls) == [("cuda:0", 32, dtype), ("cuda:1", 32, dtype)]
    assert single.replica_calls == [("cuda:0", 64, dtype)]
    assert_same_step(single, parallel, rtol=tol, atol=tol)


@pytest.mark.gpu(3)  # to leave one out
def test_devices_list_uses_exactly_those_gpus_with_the_first_as_root(tmp_path: Path) -> None:
    _, parallel = train(tmp_path, [2, 0], "dp")
    assert sorted(parallel.replica_calls) == [("cuda:0", 32, torch.float32), ("cuda:2", 32, torch.float32)]


def test_uneven_last_batch_trains_like_single_device(tmp_path: Path) -> None:
    # 9 samples in batches of 4: 4 (2+2), 4 (2+2) and a last batch of 1, smaller than the 2 GPUs (one replica).
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(9, 1, 8, 8, generator=generator), torch.randint(0, 10, (9,), generator=generator))
    loader = DataLoader(data, batch_size=4)
    net_single, single = train(tmp_path / "single", 1, "auto", loader=loader, steps=3)
    net_dp, parallel = train(tmp_path / "dp", TWO_GPUS, "dp", loader=loader, steps=3)

    assert [calls[1] for calls in parallel.replica_calls] == [2, 2, 2, 2, 1]
    assert_same_step(single, parallel, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(net_single.state_dict().items(), net_dp.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)

    # An odd batch splits 2 + 1.
    _, odd = train(tmp_path / "odd", TWO_GPUS, "dp", loader=DataLoader(data, batch_size=3), steps=1)
    assert sorted(calls[1] for calls in odd.replica_calls) == [1, 2]


def test_validation_metrics_equal_single_device(tmp_path: Path) -> None:
    results = {}
    for name, devices, strategy in (("single", 1, "auto"), ("dp", TWO_GPUS, "dp")):
        trainer = Trainer(
            accelerator="gpu",
            devices=devices,
            strategy=strategy,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path / name,
        )
        results[name] = trainer.validate(model(), datamodule=DigitsDataModule(data_dir=str(tmp_path / "data")))[0]
    assert results["dp"].keys() == results["single"].keys() == {"val_loss", "val_acc"}
    assert results["dp"] == pytest.approx(results["single"], rel=1e-5, abs=1e-6)


def _last(run_dir: Path) -> Path:
    checkpoints = sorted(
        run_dir.glob("lightning_logs/version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime
    )
    assert checkpoints, f"no last.ckpt under {run_dir}"
    return checkpoints[-1]


@pytest.mark.parametrize(
    ("first", "then"),
    [("dp.yaml", "ddp.yaml"), ("dp.yaml", "default.yaml"), ("ddp.yaml", "dp.yaml"), ("default.yaml", "dp.yaml")],
)
def test_checkpoint_resumes_across_dp_ddp_and_single_device(run_cli, tmp_path: Path, first: str, then: str) -> None:
    short = ["--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2"]
    result = run_cli("fit", "--config", CONFIGS / first, "--trainer.max_epochs=1", *short, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = _last(tmp_path)
    saved = torch.load(checkpoint, weights_only=True)
    assert not any(key.startswith("net.module.") for key in saved["state_dict"])

    result = run_cli(
        "fit", "--config", CONFIGS / then, "--trainer.max_epochs=2", *short, "--ckpt_path", checkpoint, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = torch.load(_last(tmp_path), weights_only=True)
    assert (resumed["epoch"], resumed["global_step"]) == (1, saved["global_step"] * 2)
