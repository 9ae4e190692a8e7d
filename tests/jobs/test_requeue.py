"""A SLURM requeue asked where it cannot be (inside a container image without SLURM's tools) is one line saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from template.engine.jobs import processes


def test_without_scontrol_a_requeue_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert processes.requeue_slurm_job() == (
        "cannot ask SLURM to requeue job 777: scontrol is not on PATH here (SLURM's tools are outside this image?)"
    )
    monkeypatch.delenv("SLURM_JOB_ID")
    assert processes.requeue_slurm_job() == "cannot ask SLURM to requeue job (unknown): no SLURM_JOB_ID"
