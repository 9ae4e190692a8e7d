"""Resuming at an epoch boundary repeats the uninterrupted run bit for bit; mid-epoch resume warns what repeats."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from template.engine.resume.checkpoints import AtomicCheckpointIO
from template.engine.resume.states import ExactResume
from template.engine.runs.folder import newest_under
from tests.conftest import CONFIGS, PACKAGE, cli_env, pythonpath

# Shuffled batches and dropout (the MLP's default 0.1) both draw random numbers: exactly what resume must restore.
FAST = [
    "fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.deterministic=true",
    "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
]  # fmt: skip


def _last(run_dir: Path) -> dict:
    versions = sorted((run_dir / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return torch.load(versions[-1] / "checkpoints" / "last.ckpt", weights_only=True)


def _max_difference(a: dict, b: dict) -> float:
    """Largest absolute difference over all weights and all optimizer state tensors; inf if the structure differs."""
    pairs = [(a["state_dict"], b["state_dict"])]
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        assert opt_a["state"].keys() == opt_b["state"].keys()
        pairs += [(opt_a["state"][k], opt_b["state"][k]) for k in opt_a["state"]]
    worst = 0.0
    for x, y in pairs:
        assert x.keys() == y.keys()
        for k in x:
            tx, ty = torch.as_tensor(x[k]).double(), torch.as_tensor(y[k]).double()
            worst = max(worst, (tx - ty).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs without interruption, also keeping a mid-epoch checkpoint (after step 3 of 8)."""
    run_dir = tmp_path_factory.mktemp("straight")
    extra = {
        "trainer": {
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": "mid", "every_n_train_steps": 3, "save_top_k": -1, "filename": "{step}"},
                }
            ]
        }
    }
    (run_dir / "mid.yaml").write_text(yaml.safe_dump(extra))
    command = [sys.executable, "-m", PACKAGE, *FAST, "--config", "mid.yaml", "--trainer.max_epochs=2"]
    done = subprocess.run(command, cwd=run_dir, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_resume_at_epoch_boundary_is_bit_exact(straight: Path, tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    first = run_cli(*FAST, "--trainer.max_epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(*FAST, "--trainer.max_epochs=2", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "lightning_logs/version_0/checkpoints/last.ckpt" in resumed.stdout + resumed.stderr
    reference, result = _last(straight), _last(tmp_path)
    assert result["global_step"] == reference["global_step"] == 16
    difference = _max_difference(reference, result)
    print(f"\nmax parameter/optimizer-state difference after resuming at the epoch boundary: {difference}")
    assert difference == 0.0

    # The same resume without the saved random states drifts away: the states are what makes it exact.
    control = tmp_path / "control"
    control.mkdir()
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    del checkpoint["callbacks"]["ExactResume"]
    torch.save(checkpoint, control / "no_rng.ckpt")
    drifted = run_cli(*FAST, "--trainer.max_epochs=2", "--ckpt_path", "no_rng.ckpt", cwd=control)
    assert drifted.returncode == 0, drifted.stderr[-3000:]
    assert _max_difference(reference, _last(control)) > 0


@pytest.mark.slow  # the fast suite's exact-resume cells stop runs mid-epoch
def test_mid_epoch_resume_is_bit_exact(straight: Path, tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    # The example data's StatefulDataLoader saves its place in the epoch: the rest of epoch 0 reads exactly the
    # batches the uninterrupted run read after step 3.
    shutil.copy(straight / "mid" / "step=3.ckpt", tmp_path / "mid.ckpt")
    resumed = run_cli(*FAST, "--trainer.max_epochs=2", "--ckpt_path", "mid.ckpt", env=cli_env(PYTHONWARNINGS="default"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming in the middle of epoch" not in resumed.stderr
    difference = _max_difference(_last(straight), _last(tmp_path))
    print(f"\nmax parameter/optimizer-state difference after resuming mid-epoch (step 3 of 8): {difference}")
    assert difference == 0.0


# A user's DataModule with a plain DataLoader, which cannot be put back at its place in an epoch.
PLAIN_DATA = f"""
from torch.utils.data import DataLoader

from {PACKAGE}.data import DigitsDataModule, collate_batch


class PlainDigits(DigitsDataModule):
    def train_dataloader(self):
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, collate_fn=collate_batch)
"""


@pytest.mark.slow
def test_mid_epoch_resume_of_a_plain_dataloader_warns_what_repeats(straight: Path, tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    (tmp_path / "plain_data.py").write_text(PLAIN_DATA)
    # The same step-3 checkpoint as an older version wrote it: without the states its epoch's order was drawn from.
    checkpoint = torch.load(straight / "mid" / "step=3.ckpt", weights_only=True)
    for rank in checkpoint["callbacks"]["ExactResume"]["ranks"]:
        rank["loaders"] = [None]
    torch.save(checkpoint, tmp_path / "mid.ckpt")
    # cli_env() silences Python warnings: Lightning's own, that this line replaces, would show.
    env = cli_env(PYTHONWARNINGS="default", PYTHONPATH=pythonpath(tmp_path))
    resumed = run_cli(
        *FAST, "--data.class_path=plain_data.PlainDigits", "--trainer.max_epochs=1", "--ckpt_path", "mid.ckpt", env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    text = " ".join((resumed.stdout + resumed.stderr).split())
    assert "Resuming in the middle of epoch 0 after 3 batches: training loader 0 cannot be put back" in text
    assert "for its remaining 5 batches: about 3 batches are trained on twice, as many not at all" in text
    assert "not resumable" not in text, "Lightning's own warning does not repeat the line"


def test_ckpt_path_last_picks_the_newest_checkpoint(tmp_path: Path) -> None:
    old = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    new = tmp_path / "lightning_logs" / "version_1" / "checkpoints"
    for directory in (old, new):
        directory.mkdir(parents=True)
    (old / "last.ckpt").write_bytes(b"0")
    (new / "best-0.ckpt").write_bytes(b"1")
    (new / "last.ckpt").write_bytes(b"1")
    for age, path in enumerate([new / "last.ckpt", new / "best-0.ckpt", old / "last.ckpt"]):
        stamp = 1_700_000_000 - 10 * age
        os.utime(path, (stamp, stamp))
    assert Path(newest_under(tmp_path)) == new / "last.ckpt"


class _Tiny(LightningModule):
    """Dropout and a shuffled loader whose sampler draws from its own generator, not the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.arange(64.0).reshape(16, 4) / 64)
        return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))


def _fit(tmp_path: Path, epochs: int, ckpt_path: Path | None = None, module: type[_Tiny] = _Tiny) -> _Tiny:
    seed_everything(0)
    model = module()
    trainer = Trainer(
        max_epochs=epochs, callbacks=[ExactResume()], plugins=[AtomicCheckpointIO()], deterministic=True,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp_path / f"epoch{epochs}.ckpt")
    return model


def test_sampler_generator_state_is_restored(tmp_path: Path) -> None:
    straight = _fit(tmp_path / "a", epochs=2)
    _fit(tmp_path / "b", epochs=1)
    resumed = _fit(tmp_path / "b", epochs=2, ckpt_path=tmp_path / "b" / "epoch1.ckpt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved = torch.load(tmp_path / "b" / "epoch1.ckpt", weights_only=True)["callbacks"]["ExactResume"]
    assert saved["ranks"][0]["samplers"][0] is not None  # the loader's own generator was saved, not only global RNG


class _Chunks(torch.utils.data.Sampler):
    """A user's batch sampler with no ``sampler`` inside: chunks of a permutation drawn with Python's random."""

    def __len__(self) -> int:
        return 4

    def __iter__(self):  # noqa: ANN204
        order = list(range(16))
        random.shuffle(order)
        for start in range(0, 16, 4):
            yield order[start : start + 4]


class _TinyChunks(_Tiny):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(64.0).reshape(16, 4) / 64), batch_sampler=_Chunks())


def test_a_users_batch_sampler_without_a_sampler_resumes_exactly(tmp_path: Path) -> None:
    straight = _fit(tmp_path / "a", epochs=2, module=_TinyChunks)
    _fit(tmp_path / "b", epochs=1, module=_TinyChunks)
    resumed = _fit(tmp_path / "b", epochs=2, ckpt_path=tmp_path / "b" / "epoch1.ckpt", module=_TinyChunks)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_last_ckpt_holds_the_last_step_when_the_score_stops_improving(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    """A learning rate of 0: every validation scores the same, so no best-* checkpoint follows the first. Lightning
    2.6 then stops writing last.ckpt; the finished run's last.ckpt must still be its end, which the same command
    continues from (here: nothing more to train)."""
    zero = ["--model.optimizer=torch.optim.SGD", "--model.optimizer.lr=0", "--trainer.max_epochs=3", "--run.name=flat"]
    done = run_cli(*FAST, *zero)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "flat" / "checkpoints"
    assert [p.name.split("-")[1] for p in folder.glob("best-*.ckpt")] == ["0"], "a later validation scored higher"
    last = torch.load(folder / "last.ckpt", weights_only=True)
    assert (last["global_step"], last["epoch"]) == (24, 2), "last.ckpt is not the run's end"


class _Stream(torch.utils.data.IterableDataset):
    def __len__(self) -> int:  # Lightning warns only where it knows an epoch's length
        return 16

    def __iter__(self):  # noqa: ANN204
        yield from TensorDataset(torch.arange(64.0).reshape(16, 4) / 64)


class _TinyStream(_Tiny):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(), batch_size=4)


@pytest.mark.parametrize(("module", "inexact"), [(_Tiny, False), (_TinyStream, True)], ids=["map-style", "iterable"])
def test_lightnings_not_resumable_warning_is_left_out_and_the_project_says_what_repeats(
    tmp_path: Path, module: type[_Tiny], inexact: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning warns at every mid-epoch resume of a plain DataLoader that it is "not resumable": false where the
    project puts the loader back at its place, and where it cannot (an iterable dataset) the project's own line says
    what is trained on twice; Lightning's is left out (for that fit only) either way."""

    class SaveMidEpoch(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
            if trainer.global_step == 2:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    def fit(callbacks: list[Callback], ckpt_path: Path | None = None) -> None:
        options = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
        trainer = Trainer(max_epochs=1, callbacks=[ExactResume(), *callbacks], **options, default_root_dir=tmp_path)
        trainer.fit(module(), ckpt_path=ckpt_path)

    fit([SaveMidEpoch()])
    caplog.set_level("INFO")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        fit([], ckpt_path=tmp_path / "mid.ckpt")
        assert warnings.filters == filters, "a filter of this fit is left installed"
    said = [str(w.message) for w in caught if "your dataloader is not resumable" in str(w.message)]
    assert said == []
    lines = [r.getMessage() for r in caplog.records if "cannot be put back at its place" in r.getMessage()]
    assert len(lines) == inexact, lines
    assert not inexact or "about 2 batches are trained on twice, as many not at all" in lines[0]


@pytest.mark.slow  # a fit, then validate and predict on 2 DDP processes
def test_evaluating_a_checkpoint_on_another_number_of_processes_says_nothing_of_a_resume(run_cli) -> None:  # noqa: ANN001
    fit = run_cli(*FAST, "--trainer.max_epochs=1", "--run.name=one")
    assert fit.returncode == 0, fit.stderr[-3000:]
    ddp = ["--config", str(CONFIGS / "ddp_cpu.yaml"), "--trainer.limit_predict_batches=2"]
    for command in ("validate", "predict"):
        done = run_cli(
            command, *FAST[1:], *ddp, "--ckpt_path=lightning_logs/one/checkpoints/last.ckpt",
            env=cli_env(PYTHONWARNINGS="default"), timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "random states of 1 processes" not in done.stdout + done.stderr, command
