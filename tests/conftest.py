"""Shared fixtures: run the real command line in a subprocess, in a scratch folder."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import template

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
PACKAGE = template.__name__


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a child run: quiet, single-threaded per process, nothing from the outer session leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _restore_matmul_precision():  # noqa: ANN202
    """The command line sets torch's global float32 matmul precision on (faked) CUDA runs: undo it after each test."""
    import torch

    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(autouse=True)
def _restore_rank_zero():  # noqa: ANN202
    """A Trainer built in process under a faked rank (torchrun, SLURM variables) sets the process-wide rank that
    Lightning's rank-zero-only writes check: loggers of every later test here would stop writing."""
    from lightning.pytorch.utilities import rank_zero_only

    before = getattr(rank_zero_only, "rank", 0)
    yield
    leaked = getattr(rank_zero_only, "rank", 0)
    rank_zero_only.rank = before
    assert leaked == before, f"the test left Lightning's process-wide rank at {leaked}"


@pytest.fixture
def run_cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run ``python -m <package> *args`` in ``tmp_path`` with a hard timeout; returns the completed process."""

    def run(*args: str, timeout: float = 180, cwd: Path | None = None, env: dict[str, str] | None = None):
        return subprocess.run(
            [sys.executable, "-m", PACKAGE, *map(str, args)],
            cwd=cwd or tmp_path,
            env=env or cli_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    return run


@pytest.fixture
def run_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """Run the command line inside this process, in ``tmp_path``: no interpreter start-up, for runs that stop early."""
    from template.engine.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [PACKAGE])
        code = 0
        try:
            main(list(map(str, args)))
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run
