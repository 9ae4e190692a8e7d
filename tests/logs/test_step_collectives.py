"""Nothing per training step that waits for the device or adds a collective: under DDP the project adds to a bare
Lightning Trainer around the same module only the preemption agreement, at its stride (engine/jobs/preemption.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env

COUNTER = """trainer:
  callbacks:
    - class_path: collective_counter.CollectiveCounter
      init_args: {path: counts.json}
"""
# The options of tests/bare_trainer_counts.py: 2 epochs of 15 steps, a validation and a checkpoint at each epoch's end.
OPTIONS = [
    "--trainer.max_epochs=2", "--trainer.limit_train_batches=15", "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=5",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counts(command: list[str], work: Path, gpu: bool = False) -> dict[str, dict[str, int]]:
    env = cli_env(PYTHONPATH=str(REPO / "tests"), MASTER_PORT=str(_free_port()))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((work / "counts.json").read_text())


@pytest.mark.slow  # 2 runs of 2 DDP processes
def test_the_project_adds_no_collective_or_host_read_per_step_outside_the_preemption_stride(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "bare").mkdir()
    (tmp_path / "project" / "counter.yaml").write_text(COUNTER)
    # An interval far longer than the run: the stride only doubles, 1, 2, 4, ... batches, so the agreements come
    # after batches 1, 3 and 7 (steps 0, 2, 6); the next, after batch 15, is the epoch's last (not a safe point) and
    # waits for the epoch's end, after which the stride is 16, past the run's end.
    project = _counts(
        [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), "--config", "counter.yaml",
         *OPTIONS, "--run.preemption_check_interval=3600"],
        tmp_path / "project",
    )  # fmt: skip
    bare_script = str(REPO / "tests" / "bare_trainer_counts.py")
    bare = _counts([sys.executable, bare_script, str(tmp_path / "bare")], tmp_path / "bare")
    steps = [f"step {n}" for n in range(30)]
    assert set(steps) <= set(bare) and set(steps) <= set(project), (sorted(bare), sorted(project))
    added = {}
    for step in steps:
        difference = {k: project[step].get(k, 0) - bare[step].get(k, 0) for k in {*project[step], *bare[step]}}
        if any(difference.values()):
            added[step] = {k: v for k, v in difference.items() if v}
    total = lambda c: sum(v for b in steps for k, v in c[b].items() if not k.startswith("host:"))  # noqa: E731
    print(
        f"\ncollectives per step over 30 steps: bare Lightning {total(bare) / 30:.2f}, the project "
        f"{total(project) / 30:.2f}; at the epochs' ends bare {bare['epoch end']}, the project {project['epoch end']}"
    )
    # The agreement's all_reduce (its result is read with .tolist(), the one sync on a GPU), at those steps only.
    agreement = {"all_reduce": 1}
    assert added == {"step 0": agreement, "step 2": agreement, "step 6": agreement}


@pytest.mark.gpu(1)
def test_on_a_gpu_the_engine_adds_no_synchronisation_to_a_step(tmp_path: Path) -> None:
    """The example on one GPU: the synchronisations of each step (torch.cuda.set_sync_debug_mode) in the project
    and in a bare Lightning Trainer around the same module are the same. Lightning's own (its logging steps read the
    logged values; copying a batch from pageable memory) are in both."""
    (tmp_path / "project").mkdir()
    (tmp_path / "bare").mkdir()
    (tmp_path / "project" / "counter.yaml").write_text(COUNTER)
    project = _counts(
        [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "default.yaml"), "--config", "counter.yaml",
         *OPTIONS, "--trainer.accelerator=gpu", "--trainer.log_every_n_steps=5"],
        tmp_path / "project", gpu=True,
    )  # fmt: skip
    bare_script = str(REPO / "tests" / "bare_trainer_counts.py")
    bare = _counts([sys.executable, bare_script, str(tmp_path / "bare"), "gpu"], tmp_path / "bare", gpu=True)
    syncs = lambda c: [c[f"step {n}"].get("cuda sync", 0) for n in range(30)]  # noqa: E731
    print(f"\nCUDA synchronisations per step: bare Lightning {syncs(bare)}, the project {syncs(project)}")
    # Not at logging steps (every 5th): the project's loggers are its own (CSV and TensorBoard).
    quiet = [f"step {n}" for n in range(30) if (n + 1) % 5]
    assert {s: project[s] for s in quiet} == {s: bare[s] for s in quiet}
