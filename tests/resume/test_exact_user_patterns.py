"""Exact for the user's own training patterns: a user's modules (``tests/user_code/patterns.py``), stopped by a signal
anywhere in an epoch (the second one, and the first for a schedule the second epoch trains by), then the same command,
end bit for bit where the uninterrupted run ends: weights, optimizer and scheduler states, random states.

The cells are the every-moment matrix's (``test_exact_resume.py``: ``Cell``, ``_run_cell``) with the configuration's
command replaced.
"""

from __future__ import annotations

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
}


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


FAST = [Cell("plateau-val-check-interval", "train_batch", "SIGTERM", 1, 5)]
SLOW = [
    *_anywhere("plateau-per-epoch", last_validation=1),
    *_anywhere("plateau-val-check-interval"),
    *_anywhere("plateau-every-validation"),
    Cell("plateau-per-epoch", "epoch_end", "SIGTERM", epoch=0),
    *[Cell(name, "train_batch", "SIGTERM", 1, 5) for name in PATTERNS if not name.startswith("plateau")],
    Cell("one-cycle", "train_batch", "SIGTERM", 1, 2),  # between micro-batches: the stop waits for the step
    Cell("one-cycle-ddp", "train_batch", "SIGTERM", 1, 5, ranks=(1,)),
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
        return done[configuration]

    return final


def _run(cell: Cell, work: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, server: ForkServer) -> None:
    monkeypatch.setattr(matrix, "_command", _command)
    monkeypatch.setattr(matrix, "STEPS", PATTERNS[cell.configuration][2])
    monkeypatch.setattr(matrix, "VALIDATIONS", PATTERNS[cell.configuration][3])
    matrix._run_cell(cell, work, uninterrupted, server)
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
    assert f"(1 cell fast, {len(SLOW)} slow)" in docs, "docs/reliability.md gives the patterns' cells"
