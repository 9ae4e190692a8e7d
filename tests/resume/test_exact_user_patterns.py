"""Exact for the user's own training patterns: a user's modules (``tests/user_code/patterns.py``), stopped by a signal
anywhere in an epoch (the second one, and the first for a schedule the second epoch trains by), then the same command,
end bit for bit where the uninterrupted run ends: weights, optimizer and scheduler states, random states, and every
value of ``metrics.csv`` (the epoch means of an epoch resumed in its middle among them).

The augmentation cells are a matrix: random augmentation in the Dataset's ``__getitem__`` drawn from each global
generator (torch, Python, NumPy), read in the main process or in 2 workers (persistent too), in one process and under
2-process DDP, stopped in the first epoch and in a later one. Lightning's epoch-start callbacks (``BackboneFinetuning``,
``GradientAccumulationScheduler``, ``StochasticWeightAveraging``), a module's own ``on_train_epoch_start`` and two
training loaders in a dict are stopped in an epoch where their state matters.

The cells are the every-moment matrix's (``test_exact_resume.py``: ``Cell``, ``_run_cell``) with the configuration's
command replaced.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CONFIGS, PACKAGE, REPO, TESTS, ForkServer, made_once
from tests.resume import test_exact_resume as matrix
from tests.resume.test_exact_resume import Cell

MODEL = "--model.class_path=user_code.patterns."
DATA = "--data.class_path=user_code."
PLAIN = f"{DATA}plain_data.PlainDigits"
# Three epochs: the final checkpoint is written at the last validation, before Lightning steps a plateau scheduler at
# the epoch's end, so a second epoch's step shows only in a third's.
PLATEAU = [
    "--trainer.max_epochs=3", "--model.scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau",
    "--model.scheduler.init_args.factor=0.5", "--model.scheduler.init_args.patience=0",
    "--model.scheduler.init_args.threshold=10",
]  # fmt: skip
ONE_CYCLE = [f"{MODEL}OneCycle", PLAIN, "--trainer.gradient_clip_val=0.5", "--trainer.accumulate_grad_batches=2"]
NET = f"{MODEL}Net"


def USER(name: str) -> str:  # noqa: N802 - reads as the constant it names
    return str(TESTS / "user_code" / f"{name}.yaml")


# Each configuration: its config file, the arguments it adds to the matrix's, its optimizer steps and validations.
PATTERNS: dict[str, tuple[str, list[str], int, int]] = {
    # The example's own model: no validation counts as an improvement, so the rate halves at each epoch's end.
    "plateau-per-epoch": ("default.yaml", [*PLATEAU, "--trainer.val_check_interval=1.0"], 24, 3),
    "plateau-val-check-interval": ("default.yaml", PLATEAU, 24, 6),  # validations after batches 4 and 8
    "plateau-every-validation": ("default.yaml", [f"{MODEL}PlateauEveryValidation", PLAIN], 16, 4),
    "two-optimizers": ("default.yaml", [f"{MODEL}TwoOptimizers", PLAIN], 16, 4),
    "one-cycle": ("default.yaml", ONE_CYCLE, 8, 4),
    "one-cycle-ddp": ("ddp_cpu.yaml", ONE_CYCLE, 8, 4),
    "own-checkpoint": ("default.yaml", [NET, PLAIN, "--config", str(TESTS / "user_code" / "own.yaml")], 16, 4),
    "weighted-sampler": ("default.yaml", [NET, f"{DATA}patterns.Weighted"], 16, 4),
    "augmentation": ("default.yaml", [NET, f"{DATA}patterns.Augmented"], 16, 4),
    **{
        f"augmentation-{draw}{'-workers' * bool(workers)}": (
            "default.yaml", [NET, f"{DATA}patterns.Augmented", f"--data.draw={draw}", f"--data.num_workers={workers}"],
            16, 4,
        )
        for draw in ("torch", "python", "numpy") for workers in (0, 2)
    },
    "augmentation-persistent-workers": (
        "default.yaml", [NET, f"{DATA}patterns.Augmented", "--data.num_workers=2", "--data.persistent=true"], 16, 4
    ),
    "augmentation-ddp-workers": ("ddp_cpu.yaml", [NET, f"{DATA}patterns.Augmented", "--data.num_workers=2"], 16, 4),
    "backbone-finetuning": (
        "default.yaml", [f"{MODEL}Backbone", PLAIN, "--trainer.max_epochs=3", "--config", USER("finetuning")], 24, 6
    ),
    "accumulation-schedule": ("default.yaml", [NET, PLAIN, "--config", USER("accumulation")], 12, 4),
    "swa": ("default.yaml", [NET, PLAIN, "--config", USER("swa")], 16, 4),
    "epoch-start-hooks": ("default.yaml", [f"{MODEL}EpochStart", PLAIN, "--trainer.max_epochs=3"], 24, 6),
    "two-loaders": ("default.yaml", [f"{MODEL}TwoLoaderNet", f"{DATA}patterns.TwoLoaders"], 16, 4),
    "two-loaders-ddp": ("ddp_cpu.yaml", [f"{MODEL}TwoLoaderNet", f"{DATA}patterns.TwoLoaders"], 16, 4),
    # A module's own per-rank value in on_save_checkpoint: each rank gets its own back.
    "rank-mean-ddp": ("ddp_cpu.yaml", [f"{MODEL}RankMean", PLAIN], 16, 4),
}  # fmt: skip
# Stopped in the first epoch too; those of three epochs in the third as well.
HOOKS = ["backbone-finetuning", "accumulation-schedule", "swa", "epoch-start-hooks"]
IN_EVERY_EPOCH = [name for name in PATTERNS if name.startswith("augmentation-")] + HOOKS
THREE_EPOCHS = ["backbone-finetuning", "epoch-start-hooks"]


def _command(configuration: str) -> list[str]:
    config, extra, _, _ = PATTERNS[configuration]
    return [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / config), *matrix.BASE, *extra]


def _anywhere(configuration: str, last_validation: int = 3) -> list[Cell]:
    """Mid-epoch in both of the first two epochs, right before a validation, an epoch's last batch, in the second
    epoch's last validation (its ``last_validation``-th, from 0)."""
    return [
        Cell(configuration, "train_batch", "SIGTERM", 0, 2),
        Cell(configuration, "train_batch", "SIGTERM", 1, 3),
        Cell(configuration, "train_batch", "SIGTERM", 1, 5),
        Cell(configuration, "train_batch", "SIGTERM", 1, 7),
        Cell(configuration, "val_batch", "SIGTERM", nth=last_validation, batch=1),
    ]


FAST = [Cell("augmentation-torch-workers", "train_batch", "SIGTERM", 1, 5)]
SLOW = [
    *_anywhere("plateau-per-epoch", last_validation=1),
    *_anywhere("plateau-val-check-interval"),
    *_anywhere("plateau-every-validation"),
    Cell("plateau-per-epoch", "epoch_end", "SIGTERM", epoch=0),
    *[Cell(name, "train_batch", "SIGTERM", 1, 5) for name in PATTERNS if not name.startswith("plateau")],
    Cell("one-cycle", "train_batch", "SIGTERM", 1, 2),  # between micro-batches: the stop waits for the step
    Cell("one-cycle-ddp", "train_batch", "SIGTERM", 1, 5, ranks=(1,)),
    *[Cell(name, "train_batch", "SIGTERM", 0, 3) for name in [*IN_EVERY_EPOCH, "two-loaders", "two-loaders-ddp"]],
    *[Cell(name, "train_batch", "SIGTERM", 2, 5) for name in THREE_EPOCHS],
    Cell("two-loaders", "train_batch", "SIGTERM", 1, 3),  # the shorter loader exactly at its end
]
SLOW = [cell for cell in dict.fromkeys(SLOW) if cell.id not in {c.id for c in FAST}]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final checkpoint of each pattern run without a stop (made on first use)."""
    done: dict[str, dict] = {}

    def run(work: Path, configuration: str) -> None:
        code = matrix._start(_command(configuration), work, matrix._env(work))
        assert code == 0, (work / "run.log").read_text()[-4000:]

    def final(configuration: str) -> dict:
        if configuration not in done:
            made = made_once(tmp_path_factory, f"pattern-{configuration}", lambda w: run(w, configuration))
            done[configuration] = matrix._last(made)
            FOLDERS[configuration] = made
        return done[configuration]

    return final


FOLDERS: dict[str, Path] = {}  # each uninterrupted run's folder


def logged(work: Path) -> dict[tuple[str, str], str]:
    """Every value of the run's ``metrics.csv`` by (step, column), the times aside."""
    with (work / "lightning_logs" / "r" / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    timed = ("throughput", "time", "samples_per_sec", "batches_per_sec")
    return {(r["step"], c): v for r in rows for c, v in r.items() if v and c != "step" and not c.startswith(timed)}


def _run(cell: Cell, work: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, server: ForkServer) -> None:
    monkeypatch.setattr(matrix, "_command", _command)
    monkeypatch.setattr(matrix, "STEPS", PATTERNS[cell.configuration][2])
    monkeypatch.setattr(matrix, "VALIDATIONS", PATTERNS[cell.configuration][3])
    matrix._run_cell(cell, work, uninterrupted, server)
    expected, continued = logged(FOLDERS[cell.configuration]), logged(work)
    differing = sorted(key for key in expected.keys() | continued.keys() if expected.get(key) != continued.get(key))
    assert not differing, "metrics.csv differs from the uninterrupted run's: " + ", ".join(
        f"{column} at step {step}: {continued.get((step, column))} != {expected.get((step, column))}"
        for step, column in differing[:8]
    )
    output = (work / "run.log").read_text()
    assert "Not exact" not in output and "not an exact continuation" not in output, output[-3000:]
    if cell.configuration == "own-checkpoint":  # the user's own checkpoints, beside the run's
        assert len(list((work / "lightning_logs" / "r" / "checkpoints").glob("loss-*.ckpt"))) == 2


@pytest.mark.parametrize("cell", FAST, ids=[cell.id for cell in FAST])
def test_a_users_training_pattern_continues_exactly(
    cell: Cell, tmp_path: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, fork_server: ForkServer
) -> None:
    _run(cell, tmp_path, uninterrupted, monkeypatch, fork_server)


@pytest.mark.slow
@pytest.mark.parametrize("cell", SLOW, ids=[cell.id for cell in SLOW])
def test_each_users_training_pattern_continues_exactly_anywhere_in_an_epoch(
    cell: Cell, tmp_path: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, fork_server: ForkServer
) -> None:
    _run(cell, tmp_path, uninterrupted, monkeypatch, fork_server)


def test_the_pattern_cells_cover_every_pattern() -> None:
    cells = FAST + SLOW
    assert len({cell.id for cell in cells}) == len(cells) and len(FAST) == 1
    assert {cell.configuration for cell in cells} == set(PATTERNS)
    mid_second_epoch = {c.configuration for c in cells if (c.moment, c.epoch) == ("train_batch", 1) and c.batch < 7}
    assert mid_second_epoch == set(PATTERNS)
    docs = " ".join((REPO / "docs" / "reliability.md").read_text().split())
    assert f"({len(FAST)} cell fast, {len(SLOW)} slow)" in docs, "docs/reliability.md gives the patterns' cells"


@pytest.mark.slow
@pytest.mark.parametrize("draw", ["torch", "python", "numpy"])
def test_the_weights_do_not_depend_on_num_workers(draw: str, uninterrupted: Any) -> None:
    """Augmentation read in the main process and in 2 workers: the same weights, optimizer state and random states
    (each batch's draws are a function of the seed, the epoch and its place, not of the process reading it)."""
    in_main, in_workers = uninterrupted(f"augmentation-{draw}"), uninterrupted(f"augmentation-{draw}-workers")
    differences = matrix._differences(matrix._training_state(in_main), matrix._training_state(in_workers))
    assert not differences, "num_workers=2 trained other weights than num_workers=0:\n" + "\n".join(differences[:10])
