"""Exact for the user's own data: a DataModule returning a plain ``DataLoader(shuffle=True)`` (or any map-style loader)
resumes at every moment as exactly as the example's StatefulDataLoader.

The subprocess cells reuse the every-moment matrix of ``test_exact_resume.py`` (its ``Cell`` and ``_run_cell``) with
a user's DataModule from ``tests/user_code/plain_data.py`` selected by ``class_path``. The in-process tests check the
skipping itself for each kind of sampler: the resumed epoch yields exactly the uninterrupted epoch's tail, and the
dataset is not read for the skipped batches.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from template.engine.resume.loader import make_resumable, wrapped
from tests.conftest import CONFIGS, PACKAGE, REPO, TESTS, ForkServer, made_once
from tests.resume import test_exact_resume as matrix
from tests.resume.test_exact_resume import Cell

# --- the skipping, in process --------------------------------------------------------------------------------------


class Recorded(Dataset):
    """Returns its index (and, in a worker, the worker's seed); remembers which indices were read in this process."""

    def __init__(self, size: int = 100) -> None:
        self.size = size
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        self.reads.append(index)
        info = get_worker_info()
        return index, info.seed if info is not None else -1


class ShuffledChunks(Sampler):
    """A user's own batch sampler: chunks of a permutation drawn with Python's global random module."""

    def __init__(self, size: int, batch: int) -> None:
        self.size, self.batch = size, batch

    def __len__(self) -> int:
        return -(-self.size // self.batch)

    def __iter__(self):
        import random

        order = list(range(self.size))
        random.shuffle(order)
        for start in range(0, self.size, self.batch):
            yield order[start : start + self.batch]


def _plain_shuffle(d: Dataset) -> DataLoader:
    return DataLoader(d, batch_size=8, shuffle=True)


def _distributed(d: Dataset) -> DataLoader:
    sampler = DistributedSampler(d, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(4)
    return DataLoader(d, batch_size=8, sampler=sampler)


LOADERS: dict[str, Callable[[Dataset], DataLoader]] = {
    "shuffle": _plain_shuffle,
    "shuffle-generator": lambda d: DataLoader(
        d, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5)
    ),
    "random-sampler-generator": lambda d: DataLoader(
        d, batch_size=8, sampler=RandomSampler(d, generator=torch.Generator().manual_seed(6))
    ),
    "random-sampler-replacement": lambda d: DataLoader(
        d, batch_size=8, sampler=RandomSampler(d, replacement=True, num_samples=300)
    ),
    "subset-random": lambda d: DataLoader(d, batch_size=8, sampler=SubsetRandomSampler(list(range(10, 90)))),
    "weighted-random": lambda d: DataLoader(
        d, batch_size=8, sampler=WeightedRandomSampler(torch.linspace(0.1, 1, len(d)), num_samples=120)
    ),
    "batch-sampler": lambda d: DataLoader(d, batch_sampler=BatchSampler(RandomSampler(d), 7, drop_last=False)),
    "custom-batch-sampler": lambda d: DataLoader(d, batch_sampler=ShuffledChunks(len(d), 9)),
    "drop-last": lambda d: DataLoader(d, batch_size=16, shuffle=True, drop_last=True),
    "unbatched": lambda d: DataLoader(d, batch_size=None, shuffle=True),
    "distributed": _distributed,
    "workers": lambda d: DataLoader(d, batch_size=8, shuffle=True, num_workers=2),
    "persistent-workers": lambda d: DataLoader(d, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True),
}


def _indices(batch: Any) -> list[int]:
    index = batch[0]
    return index.tolist() if isinstance(index, torch.Tensor) and index.dim() else [int(index)]


def _epoch(loader: DataLoader) -> list[list[int]]:
    """One epoch as a training loop sees it, drawing from the global generator between batches (dropout)."""
    batches = []
    for batch in loader:
        batches.append(_indices(batch))
        torch.rand(3)
    return batches


@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_resumed_epoch_is_the_uninterrupted_tail_and_skipped_batches_are_not_read(kind: str) -> None:
    torch.manual_seed(0)
    data = Recorded()
    users = LOADERS[kind](data)
    loader = make_resumable(users)
    assert users.batch_sampler is not wrapped(loader) and wrapped(loader) is not None  # the user's is unchanged
    _epoch(loader)  # an earlier epoch: the one to resume is not the first
    sampler = wrapped(loader)
    full = _epoch(loader)
    at_iterator, at_order = sampler.at_iterator, sampler.at_order
    after = [g.get_state() for g in sampler.generators]
    done = len(full) // 2 + 1

    # Another process: other random states, the user's code building its loader again.
    torch.manual_seed(123)
    data_again = Recorded()
    again = make_resumable(LOADERS[kind](data_again))
    wrapped(again).resume(at_iterator, at_order, done)
    tail = _epoch(again)
    assert tail == full[done:], kind
    if again.num_workers == 0:
        assert sorted(data_again.reads) == sorted(i for batch in full[done:] for i in batch)
    # The sampler's own generators are where the uninterrupted epoch left them: the next epoch draws the same.
    for generator, state in zip(wrapped(again).generators, after, strict=True):
        assert torch.equal(generator.get_state(), state)


def test_worker_seeds_are_those_of_the_uninterrupted_epoch() -> None:
    torch.manual_seed(0)
    loader = make_resumable(DataLoader(Recorded(), batch_size=8, shuffle=True, num_workers=2))
    seeds = {int(s) for batch in loader for s in batch[1]}
    sampler = wrapped(loader)
    torch.manual_seed(9)
    again = make_resumable(DataLoader(Recorded(), batch_size=8, shuffle=True, num_workers=2))
    wrapped(again).resume(sampler.at_iterator, sampler.at_order, 3)
    assert {int(s) for batch in again for s in batch[1]} == seeds and len(seeds) == 2


def test_resuming_in_the_middle_of_a_million_samples_costs_well_under_a_second() -> None:
    size, batch = 1_000_000, 64

    class Big(Dataset):
        def __len__(self) -> int:
            return size

        def __getitem__(self, index: int) -> int:
            return index

    def first_batch(loader: DataLoader) -> float:
        start = time.perf_counter()
        next(iter(loader))
        return time.perf_counter() - start

    loader = make_resumable(DataLoader(Big(), batch_size=batch, shuffle=True))
    fresh = min(first_batch(loader) for _ in range(3))
    sampler = wrapped(loader)
    resumed = []
    for _ in range(3):
        again = make_resumable(DataLoader(Big(), batch_size=batch, shuffle=True))
        wrapped(again).resume(sampler.at_iterator, sampler.at_order, size // batch // 2)
        resumed.append(first_batch(again))
    print(f"\nfirst batch of a 1,000,000-sample epoch: fresh {fresh:.3f} s, resumed at its middle {min(resumed):.3f} s")
    assert min(resumed) - fresh < 0.5


# --- the every-moment matrix with the user's DataModule ------------------------------------------------------------

DATA = ["--data.class_path=user_code.plain_data.PlainDigits"]
USER_CONFIGURATIONS: dict[str, tuple[str, list[str]]] = {
    "user-plain": ("default.yaml", DATA),
    "user-workers": ("default.yaml", [*DATA, "--data.init_args.num_workers=2"]),
    "user-persistent": (
        "default.yaml",
        [*DATA, "--data.init_args.num_workers=2", "--data.init_args.persistent_workers=true"],
    ),
    "user-periodic": ("default.yaml", [*DATA, "--run.save_every_n_steps=3"]),
    "user-ddp": ("ddp_cpu.yaml", DATA),
    "user-ddp-workers": ("ddp_cpu.yaml", [*DATA, "--data.init_args.num_workers=2"]),
}


def _user_command(configuration: str) -> list[str]:
    config, extra = USER_CONFIGURATIONS[configuration]
    return [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / config), *matrix.BASE, *extra]


def _moments(configuration: str, **extra: Any) -> list[Cell]:
    """Mid-epoch, an epoch's last batch, an epoch's start (the stop lands after its first batch), mid-validation."""
    return [
        Cell(configuration, "train_batch", "SIGTERM", 0, 2, **extra),
        Cell(configuration, "train_batch", "SIGINT", 0, 7, **extra),
        Cell(configuration, "train_batch", "SIGTERM", 1, 0, **extra),
        Cell(configuration, "val_batch", "SIGUSR1", nth=1, batch=0, **extra),
    ]


FAST = [
    Cell("user-workers", "train_batch", "SIGTERM", 1, 0),  # an epoch's start, with workers
]
SLOW = [
    *_moments("user-plain"),
    *_moments("user-workers"),
    *_moments("user-persistent"),
    Cell("user-periodic", "train_batch", "SIGKILL", 0, 4),
    Cell("user-periodic", "train_batch", "SIGKILL", 1, 2),
    *_moments("user-ddp"),
    Cell("user-ddp", "train_batch", "SIGTERM", 0, 2, ranks=(1,)),
    *_moments("user-ddp-workers"),
]
SLOW = [cell for cell in SLOW if cell.id not in {c.id for c in FAST}]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final checkpoint of each user configuration run without a stop (made on first use)."""
    done: dict[str, dict] = {}

    def run(work: Path, configuration: str) -> None:
        code = matrix._start(_user_command(configuration), work, matrix._env(work))
        assert code == 0, (work / "run.log").read_text()[-4000:]

    def final(configuration: str) -> dict:
        if configuration not in done:
            made = made_once(tmp_path_factory, f"user-{configuration}", lambda w: run(w, configuration))
            done[configuration] = matrix._last(made)
        return done[configuration]

    return final


def _run(cell: Cell, work: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, server: ForkServer) -> None:
    # The matrix's own cell, run with the user's DataModule: its command is the only thing that changes.
    monkeypatch.setattr(matrix, "_command", _user_command)
    matrix._run_cell(cell, work, uninterrupted, server)
    output = (work / "run.log").read_text()
    assert "not resumable" not in output and "Resuming in the middle" not in output and "Not exact" not in output


@pytest.mark.parametrize("cell", FAST, ids=[cell.id for cell in FAST])
def test_a_plain_dataloader_continues_exactly(
    cell: Cell, tmp_path: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, fork_server: ForkServer
) -> None:
    _run(cell, tmp_path, uninterrupted, monkeypatch, fork_server)


@pytest.mark.slow
@pytest.mark.parametrize("cell", SLOW, ids=[cell.id for cell in SLOW])
def test_a_plain_dataloader_continues_exactly_at_every_moment(
    cell: Cell, tmp_path: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, fork_server: ForkServer
) -> None:
    _run(cell, tmp_path, uninterrupted, monkeypatch, fork_server)


def test_a_loader_that_cannot_be_exact_is_named_at_stop_time(tmp_path: Path) -> None:
    (tmp_path / "fault.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: {moment: train_batch, batch: 2}\n"
    )
    command = [
        sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "default.yaml"), *matrix.BASE,
        "--data.class_path=user_code.plain_data.StreamDigits", "--config", "fault.yaml",
    ]  # fmt: skip
    code = matrix._start(command, tmp_path, matrix._env(tmp_path))
    output = (tmp_path / "run.log").read_text()
    assert code == 128 + 15, output[-3000:]
    lines = [line for line in output.splitlines() if "Not exact" in line]
    assert len(lines) == 1, output[-3000:]
    assert "training loader 0 (DataLoader over _Stream)" in lines[0] and "batch 3 of epoch 0" in lines[0]
    assert "IterableDataset" in lines[0] and "about 3 batches are trained on twice, as many not at all" in lines[0]
    # Said before the stop's own line, which says how to continue.
    assert output.index("Not exact") < output.index("Stopping on SIGTERM"), output[-3000:]


@pytest.mark.slow
def test_a_stream_without_length_says_the_epoch_is_read_again_and_so_it_is(tmp_path: Path) -> None:
    """An IterableDataset without ``__len__``: its epoch ends where the data does, so the restart reads it whole again
    and trains as many steps more as the stop had done; the stop and the restart each say so in one line."""
    (tmp_path / "fault.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: {moment: train_batch, batch: 2}\n"
    )
    base = [arg for arg in matrix.BASE if not arg.startswith(("--trainer.limit_train", "--trainer.val_check"))]
    command = [
        sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "default.yaml"), *base,
        "--trainer.max_epochs=1", "--data.class_path=user_code.plain_data.EndlessDigits",
    ]  # fmt: skip
    env = matrix._env(tmp_path)
    assert matrix._start([*command, "--config", "fault.yaml"], tmp_path, env) == 128 + 15
    assert matrix._start(command, tmp_path, env) == 0, (tmp_path / "run.log").read_text()[-3000:]
    output = (tmp_path / "run.log").read_text()
    said = "the first 3 batches are trained on twice (3 steps more)"
    assert sum(said in line for line in output.splitlines()) == 2, output[-3000:]
    assert "inf" not in " ".join(line for line in output.splitlines() if said in line)
    assert "not resumable" not in output, "Lightning's own warning is left out: the line says it"
    assert matrix._last(tmp_path)["global_step"] == 3 + 1400 // 64 + 1  # 22 batches of 64 and one of 56


def test_the_user_matrix_covers_what_it_promises() -> None:
    cells = FAST + SLOW
    assert len({cell.id for cell in cells}) == len(cells) and len(FAST) <= 3
    assert {cell.configuration for cell in cells} == set(USER_CONFIGURATIONS)
    assert {cell.signal for cell in cells} == {"SIGTERM", "SIGINT", "SIGUSR1", "SIGKILL"}
    assert os.path.isfile(TESTS / "user_code" / "plain_data.py")
    docs = " ".join((REPO / "docs" / "reliability.md").read_text().split())
    assert f"({len(FAST)} cell fast, {len(SLOW)} slow)" in docs, "docs/reliability.md gives the matrix's size"
