"""One global batch for every strategy, the learning rate scaled to it once, and the run summary that says so."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from lightning.fabric.accelerators import cuda as fabric_cuda
from lightning.fabric.utilities.device_parser import _parse_gpu_ids
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_getattr
from torch.nn import functional as F
from torch.optim import lr_scheduler
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from template.data import DigitsDataModule
from template.engine.errors import ConfigError, explain_trainer_error, one_line
from template.engine.strategies.scaling import (
    BatchScaling,
    format_summary,
    lr_factor,
    per_process_batch_size,
    scale_learning_rates,
)
from template.nets import MLP
from tests.conftest import CONFIGS, REPO, cli_env, pythonpath

SHORT = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1")
BASE_LR = 1e-3  # the example's Adam default, and the user's model's below


# --- the arithmetic -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size,accumulate,expected",
    [(1, 1, 64), (2, 1, 32), (2, 2, 16), (8, 2, 4)],
    ids=["single-or-dp", "ddp-2", "ddp-2-accumulate-2", "2-nodes-x-4-gpus-accumulate-2"],
)
def test_per_process_batch_adds_up_to_the_global_batch(world_size, accumulate, expected):
    # DataParallel runs in one process (world size 1): the whole batch is loaded, DataParallel splits it.
    assert per_process_batch_size(64, world_size, accumulate) == expected
    assert expected * world_size * accumulate == 64


def test_a_global_batch_that_does_not_divide_is_refused_with_the_numbers():
    with pytest.raises(ConfigError) as err:
        per_process_batch_size(100, 4, 2)
    message = str(err.value)
    assert "\n" not in message
    assert "global_batch_size=100" in message and "4 process(es) x 2 accumulation" in message
    assert "multiple of 8, e.g. 96 or 104" in message


def test_lr_factor_rules():
    assert lr_factor("none", 256, 64) == 1.0
    assert lr_factor("linear", 256, 64) == 4.0
    assert lr_factor("sqrt", 256, 64) == 2.0
    assert lr_factor("linear", 32, 64) == 0.5


def test_lr_scaling_without_a_reference_batch_is_refused():
    with pytest.raises(ConfigError, match=r"lr_scaling=sqrt needs scaling.reference_batch_size"):
        BatchScaling(global_batch_size=64, lr_scaling="sqrt")


@pytest.mark.parametrize("option", ["global_batch_size", "reference_batch_size"])
def test_a_batch_size_below_one_is_one_line(run_main, option: str) -> None:
    result = run_main("fit", "--config", CONFIGS / "default.yaml", f"--scaling.{option}=0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: invalid value '0' for 'scaling.{option}'; expected a value > 0 or null"
    )


def _lrs_over_steps(make_scheduler, lr: float, factor: float | None, steps: int = 12) -> list[float]:
    """The learning rate at each step of a schedule, optionally scaled after the optimizer and scheduler exist."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)
    scheduler = make_scheduler(optimizer, lr)
    if factor is not None:
        scale_learning_rates([optimizer], [scheduler], factor)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


SCHEDULES = {
    "step": lambda opt, lr: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "lambda": lambda opt, lr: lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch)),
    "cosine": lambda opt, lr: lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "one-cycle": lambda opt, lr: lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=12),
    "cyclic": lambda opt, lr: lr_scheduler.CyclicLR(opt, base_lr=lr / 10, max_lr=lr, step_size_up=3),
    "warmup-then-decay": lambda opt, lr: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4), lr_scheduler.ExponentialLR(opt, gamma=0.8)],
        milestones=[4],
    ),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_scaling_a_built_optimizer_equals_building_it_with_the_scaled_lr(schedule):
    # Lightning builds optimizer and scheduler before the rule can apply: the schedule must follow the new LR.
    scaled_afterwards = _lrs_over_steps(SCHEDULES[schedule], lr=0.1, factor=2.0)
    built_scaled = _lrs_over_steps(SCHEDULES[schedule], lr=0.2, factor=None)
    assert scaled_afterwards == pytest.approx(built_scaled, rel=1e-9)


# --- the callback in a real (single-process) Trainer ----------------------------------------------------------------


def _trainer(root: Path, scaling: BatchScaling, epochs: int) -> Trainer:
    return Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=0,
        callbacks=[scaling],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class UsersModel(LightningModule):
    """A model of the user's own: SGD with a schedule that halves the LR every epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(num_classes=10, input_shape=(1, 8, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=BASE_LR, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)}


def test_lr_is_scaled_once_and_not_again_on_resume(tmp_path):
    data_dir = str(tmp_path / "data")

    def fit(epochs: int, rule: str = "linear", ckpt: Path | None = None) -> tuple[Trainer, BatchScaling]:
        scaling = BatchScaling(global_batch_size=32, lr_scaling=rule, reference_batch_size=16)
        trainer = _trainer(tmp_path, scaling, epochs)
        trainer.fit(UsersModel(), datamodule=DigitsDataModule(data_dir=data_dir), ckpt_path=ckpt)
        return trainer, scaling

    trainer, scaling = fit(1)
    assert scaling.summary["lr"] == pytest.approx(2 * BASE_LR) and scaling.summary["lr_factor"] == 2.0
    assert scaling.summary["effective_batch_size"] == 32 and scaling.summary["batch_per_process"] == 32
    ckpt = Path(trainer.checkpoint_callback.best_model_path)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["callbacks"]["BatchScaling"]["summary"] == scaling.summary
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(2 * BASE_LR / 2)

    # Resumed twice, the schedule continues from 2x the base LR (halved each epoch), never 4x or 8x; the Run: line
    # states the configured rate scaled, not the schedule's rate at the resume.
    for epochs in (2, 3):
        trainer, scaling = fit(epochs, ckpt=ckpt)
        assert scaling.summary["lr"] == pytest.approx(2 * BASE_LR)
        assert f"lr {2 * BASE_LR:.6g} (linear scaling x2)" in format_summary(scaling.summary)
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(2 * BASE_LR * 0.5**epochs)
        ckpt = Path(trainer.checkpoint_callback.best_model_path)

    # Resumed under another rule, the LR is rescaled from the base, not from the already-scaled value.
    trainer, scaling = fit(4, rule="sqrt", ckpt=ckpt)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(math.sqrt(2) * BASE_LR * 0.5**4)
    assert scaling.summary["lr_factor"] == pytest.approx(math.sqrt(2))
    assert scaling.summary["lr"] == pytest.approx(math.sqrt(2) * BASE_LR)


def test_data_batch_size_and_global_batch_size_in_conflict_are_refused(tmp_path):
    trainer = _trainer(tmp_path, BatchScaling(global_batch_size=64), 1)
    dm = DigitsDataModule(data_dir=str(tmp_path / "data"), batch_size=16)
    with pytest.raises(ConfigError, match=r"data.batch_size=16 and scaling.global_batch_size=64 both set"):
        trainer.callbacks[0].apply_batch_size(trainer, dm)
    # The constructor's default (64) or the value the global batch gives is no conflict.
    assert BatchScaling(global_batch_size=32).apply_batch_size(trainer, DigitsDataModule()) == 32


def test_a_datamodule_without_batch_size_is_refused_for_a_global_batch(tmp_path):
    trainer = _trainer(tmp_path, BatchScaling(global_batch_size=64), 1)

    class NoBatch(LightningDataModule):
        pass

    # Before the module is attached (the command line's early call) the module may still hold it: decided in setup.
    assert trainer.callbacks[0].apply_batch_size(trainer, NoBatch()) is None
    with pytest.raises(
        ConfigError, match=r"needs a `batch_size` that the dataloaders use.*; NoBatch or UsersModel has"
    ):
        trainer.callbacks[0].apply_batch_size(trainer, NoBatch(), UsersModel())


class HparamsOnly(LightningDataModule):
    """Keeps its batch size in hparams only (save_hyperparameters), as Lightning's batch-size finder allows."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        data = TensorDataset(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
        return DataLoader(data, batch_size=self.hparams.batch_size)


class ModuleHeld(UsersModel):
    """The batch size on the LightningModule, as Lightning's batch-size finder also allows."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size


def test_the_batch_size_is_found_where_lightnings_batch_size_finder_finds_it(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=2, logger=False)
    dm = HparamsOnly()
    assert BatchScaling(global_batch_size=32).apply_batch_size(trainer, dm) == 16 and dm.hparams.batch_size == 16
    model = ModuleHeld()
    assert BatchScaling(global_batch_size=64).apply_batch_size(trainer, None, model) == 32 and model.batch_size == 32
    # The same holders as Lightning's own lookup (module attached to a Trainer with the DataModule).
    trainer = _trainer(tmp_path, BatchScaling(), 1)
    model, dm = ModuleHeld(batch_size=4), HparamsOnly(batch_size=6)
    trainer.fit(model, datamodule=dm)
    assert lightning_getattr(model, "batch_size") == 6
    assert trainer.callbacks[0].summary["batch_per_process"] == 6


def test_without_a_holder_the_summary_reads_the_batch_from_the_loader(tmp_path, capsys):
    class LoaderOnly(LightningDataModule):
        def __init__(self, batch_sampler: bool) -> None:
            super().__init__()
            self.batch_sampler = batch_sampler

        def train_dataloader(self):
            data = TensorDataset(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
            if self.batch_sampler:
                return DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 12, drop_last=False))
            return DataLoader(data, batch_size=10, shuffle=True)

    for batch_sampler, size in ((False, 10), (True, 12)):
        scaling = BatchScaling()
        _trainer(tmp_path, scaling, 1).fit(UsersModel(), datamodule=LoaderOnly(batch_sampler))
        assert (scaling.summary["batch_per_process"], scaling.summary["effective_batch_size"]) == (size, size)
        assert format_summary(scaling.summary).count(f"batch {size}/process ({size}/device)") == 1


@pytest.mark.slow
def test_a_datamodule_with_its_batch_size_in_hparams_runs_under_ddp(run_cli, tmp_path):
    # configs/ddp_cpu.yaml states a global batch; the DataModule keeps batch_size in hparams (save_hyperparameters).
    result = run_cli(
        "fit", "--config", CONFIGS / "ddp_cpu.yaml", "--data.class_path=user_code.plain_data.HparamsDigits", *SHORT,
        env=cli_env(PYTHONPATH=pythonpath(REPO / "tests")), timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "batch 32/process (32/device) x 2 process(es) x 1 accumulation = 64 per optimizer step" in output


def test_a_users_datamodule_with_batch_size_gets_its_share(tmp_path):
    class Users(LightningDataModule):
        def __init__(self, batch_size: int = 8) -> None:
            super().__init__()
            self.batch_size = batch_size

    trainer = Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=4, logger=False)
    dm = Users()
    assert BatchScaling(global_batch_size=128).apply_batch_size(trainer, dm) == 32 and dm.batch_size == 32


# --- the command line: one process and two DDP processes, same global batch ----------------------------------------


def _run_summary(workdir: Path) -> tuple[dict, dict]:
    """The run summary from hparams.yaml and from the last checkpoint of the only run in ``workdir``."""
    (run,) = (workdir / "lightning_logs").iterdir()
    from_yaml = yaml.safe_load((run / "hparams.yaml").read_text())["run"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return from_yaml, ckpt["callbacks"]["BatchScaling"]["summary"]


@pytest.mark.slow
def test_same_global_batch_on_one_process_and_two_ddp_processes(run_cli, tmp_path):
    scaling = ("--scaling.lr_scaling=linear", "--scaling.reference_batch_size=32")
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    single_dir.mkdir(), ddp_dir.mkdir()
    single = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", "--scaling.global_batch_size=64", *scaling, *SHORT, cwd=single_dir
    )
    assert single.returncode == 0, single.stderr[-3000:]
    # configs/ddp_cpu.yaml splits the config's batch (64) over its 2 processes (scaling.split_batch).
    ddp = run_cli("fit", "--config", CONFIGS / "ddp_cpu.yaml", *scaling, *SHORT, cwd=ddp_dir, timeout=300)
    output = ddp.stdout + ddp.stderr
    assert ddp.returncode == 0, output[-3000:]

    one, one_ckpt = _run_summary(single_dir)
    two, two_ckpt = _run_summary(ddp_dir)
    assert one == one_ckpt and two == two_ckpt
    assert (one["world_size"], one["batch_per_process"]) == (1, 64)
    assert (two["world_size"], two["batch_per_process"], two["strategy"]) == (2, 32, "ddp")
    for key in ("effective_batch_size", "lr", "lr_factor"):
        assert one[key] == two[key], key
    assert one["effective_batch_size"] == 64 and one["lr"] == pytest.approx(2 * BASE_LR)
    # The model's hyper-parameters keep the base LR: a run rebuilt from them (--ckpt_path) never compounds it.
    (run,) = (ddp_dir / "lightning_logs").iterdir()
    assert yaml.safe_load((run / "hparams.yaml").read_text())["optimizer"]["init_args"]["lr"] == BASE_LR
    assert {one["seed"], two["seed"]} == {1234} and one["precision"] == two["precision"] == "32-true"
    # Printed once, by rank zero.
    assert output.count("Run: strategy ddp") == 1, output[-3000:]
    assert "batch 32/process (32/device) x 2 process(es) x 1 accumulation = 64" in output


@pytest.mark.slow
def test_non_divisible_global_batch_is_refused_before_any_process_starts(run_cli, tmp_path):
    result = run_cli("fit", "--config", CONFIGS / "ddp_cpu.yaml", "--scaling.global_batch_size=63", *SHORT)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: scaling.global_batch_size=63 does not split into 2 process(es)"), lines
    assert "Traceback" not in result.stderr and "Starting with 2 processes" not in result.stdout + result.stderr
    assert not (tmp_path / "lightning_logs").exists()


# --- GPU selection --------------------------------------------------------------------------------------------------


def test_missing_gpu_index_message_names_the_visible_gpus(monkeypatch):
    # Lightning's own check, on a pretend 2-GPU machine, turned into the project's one line.
    monkeypatch.setattr(fabric_cuda, "_get_all_visible_cuda_devices", lambda: [0, 1])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(MisconfigurationException) as err:
        _parse_gpu_ids([0, 3], include_cuda=True)
    message = explain_trainer_error(one_line(err.value))
    assert message == (
        "trainer.devices asks for GPU index(es) [0, 3] but the GPUs visible to this process are [0, 1] "
        "(CUDA_VISIBLE_DEVICES=4,6 hides the others and renumbers these from 0); list only those, "
        "or set `devices: N` for the first N"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_accelerator_without_gpus_is_one_line(run_main, monkeypatch):
    # In process, refused while the Trainer is built; no GPU whatever the machine has.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    result = run_main("fit", "--config", CONFIGS / "ddp.yaml", *SHORT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: trainer.accelerator asks for a GPU but this process sees none (CUDA_VISIBLE_DEVICES=0,2 hides "
        "the others and renumbers these from 0); use accelerator cpu or auto"
    )


@pytest.mark.gpu(1)
def test_listing_a_gpu_that_does_not_exist_names_the_visible_ones(run_cli):
    count = torch.cuda.device_count()
    devices = f"--trainer.devices=[0,{count}]"
    result = run_cli("fit", "--config", CONFIGS / "ddp.yaml", devices, *SHORT, timeout=120)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert f"[0, {count}]" in line and f"visible to this process are {list(range(count))}" in line


@pytest.mark.gpu(2)  # strategy dp over 2 GPUs
def test_dp_loads_the_global_batch_whole_and_splits_it_over_its_gpus(run_cli, tmp_path):
    result = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=gpu", "--trainer.strategy=dp",
        "--trainer.devices=2", "--scaling.global_batch_size=64", *SHORT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary, _ = _run_summary(tmp_path)
    assert (summary["strategy"], summary["world_size"], summary["devices_per_node"]) == ("dp", 1, 2)
    assert (summary["batch_per_process"], summary["batch_per_device"], summary["effective_batch_size"]) == (64, 32, 64)
