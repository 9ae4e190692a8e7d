"""Exact at every moment: a run stopped by a signal or a kill at any moment, then the same command, ends bit for bit
where the uninterrupted run ends (weights, optimizer and scheduler states, random states), each step logged once.

Each cell of the matrix is a configuration, a moment and a signal. ``fault.Fault`` sends the signal from inside the
run at exactly that moment (no timing); the same command then runs again, and its final ``last.ckpt`` is compared with
that of the same configuration run without a stop. The run: 2 epochs of 8 batches, validation twice an epoch (after
batches 4 and 8), 2 sanity-check batches. The whole matrix is slow; ``FAST`` cells, one per kind of moment, run in the
fast suite.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from template.engine.resume import checkpoints
from template.engine.runs.folder import newest
from tests.conftest import CONFIGS, PACKAGE, REPO, ForkServer, cli_env, finish, made_once

WAIT = 240  # seconds for one start of a run; a healthy single-process start takes 5-10 s here, DDP 15-25 s
STEPS = 16
VALIDATIONS = 4  # two an epoch
BASE = [
    "--trainer.accelerator=cpu", "--trainer.deterministic=true", "--trainer.limit_train_batches=8",
    "--trainer.limit_val_batches=2", "--trainer.val_check_interval=0.5", "--trainer.max_epochs=2",
    "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--run.name=r",
]  # fmt: skip
SCALING = ["--scaling.global_batch_size=32", "--scaling.lr_scaling=linear", "--scaling.reference_batch_size=64"]
USER_LOGGER = ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir=mylogs"]

# Configurations: the arguments each adds to BASE (and the config file it runs).
CONFIGURATIONS: dict[str, list[str]] = {
    "single": [],
    "accumulation": ["--trainer.accumulate_grad_batches=2"],
    "loggers-off": ["--trainer.logger=false"],
    "user-logger": USER_LOGGER,
    "ema": ["--ema.decay=0.9"],
    "workers": ["--data.num_workers=2"],
    "periodic": ["--run.save_every_n_steps=3"],
    "scaling": SCALING,
    "test-after-fit": ["--test_after_fit=true"],
    "ddp": [],
    # DDP in one process: Lightning's DistributedSampler (whose order changes with the epoch) without a second one.
    "ddp-1": ["--trainer.devices=1"],
    "ddp-workers": ["--data.num_workers=2"],
    "ddp-scaling": SCALING,  # 16 a process
    "fsdp": [],
    "dp": ["--trainer.accelerator=gpu"],  # configs/dp.yaml: one process, each batch split over GPUs 0 and 1
}
CONFIG_FILES = {
    "ddp": "ddp_cpu.yaml", "ddp-1": "ddp_cpu.yaml", "ddp-workers": "ddp_cpu.yaml", "ddp-scaling": "ddp_cpu.yaml",
    "fsdp": "fsdp_cpu.yaml", "dp": "dp.yaml",
}  # fmt: skip


@dataclass(frozen=True)
class Cell:
    configuration: str
    moment: str
    signal: str = "SIGTERM"
    epoch: int = 0
    batch: int = 0
    nth: int = 0
    ranks: tuple[int, ...] = (0,)
    slurm: bool = False

    @property
    def id(self) -> str:
        where = {
            "train_batch": f"e{self.epoch}b{self.batch}",
            "val_batch": f"v{self.nth}b{self.batch}",
            "sanity_batch": f"b{self.batch}",
            "epoch_end": f"e{self.epoch}",
            "checkpoint": f"n{self.nth}",
        }.get(self.moment, "")
        ranks = "" if self.ranks == (0,) else "-ranks" + "".join(map(str, self.ranks))
        return f"{self.configuration}-{self.moment}{where}-{self.signal}{'-slurm' if self.slurm else ''}{ranks}"


def _every_moment(configuration: str, signal_name: str) -> list[Cell]:
    """Every training batch end of both epochs, every validation batch (the sanity check's too), each epoch end,
    checkpoints being written, after the last step and in teardown."""
    cells = [Cell(configuration, "train_batch", signal_name, e, b) for e in (0, 1) for b in range(8)]
    cells += [Cell(configuration, "sanity_batch", signal_name, batch=b) for b in (0, 1)]
    cells += [Cell(configuration, "val_batch", signal_name, nth=n, batch=b) for n in range(4) for b in (0, 1)]
    cells += [Cell(configuration, "epoch_end", signal_name, epoch=e) for e in (0, 1)]
    cells += [Cell(configuration, "checkpoint", signal_name, nth=n) for n in (0, 1, 2)]
    cells += [Cell(configuration, "train_end", signal_name), Cell(configuration, "teardown", signal_name)]
    return [*cells, Cell("test-after-fit", "test_after_fit", signal_name)]


def _kinds_of_moment(configuration: str, signal_name: str, **extra: Any) -> list[Cell]:
    """One cell per kind of moment: mid-epoch, before a validation, an epoch's last batch, mid-validation (during an
    epoch and at its end), the sanity check, an epoch's end, a checkpoint being written, after the last step."""
    return [
        Cell(configuration, "train_batch", signal_name, 0, 1, **extra),
        Cell(configuration, "train_batch", signal_name, 0, 3, **extra),
        Cell(configuration, "train_batch", signal_name, 1, 7, **extra),
        Cell(configuration, "val_batch", signal_name, nth=0, batch=0, **extra),
        Cell(configuration, "val_batch", signal_name, nth=1, batch=1, **extra),
        Cell(configuration, "sanity_batch", signal_name, **extra),
        Cell(configuration, "epoch_end", signal_name, **extra),
        Cell(configuration, "checkpoint", signal_name, nth=1, **extra),
        Cell(configuration, "train_end", signal_name, **extra),
    ]


def _every_epoch(configuration: str, *moments: tuple[str, int], **extra: Any) -> list[Cell]:
    """Each moment in the first epoch and the same moment in the second: a sampler whose order depends on the epoch
    (Lightning's ``DistributedSampler``) must be put back in the epoch the run stopped in, not only in the first.
    A moment is a training batch's index (``("train_batch", 5)``) or a validation's index in the epoch."""
    cells = []
    for epoch in (0, 1):
        for moment, index in moments:
            if moment == "train_batch":
                cells.append(Cell(configuration, moment, "SIGTERM", epoch, index, **extra))
            else:  # two validations an epoch: the epoch's first is nth 0, then nth 2
                cells.append(Cell(configuration, moment, "SIGTERM", nth=2 * epoch + index, batch=0, **extra))
    return cells


def _configuration_cells(configuration: str) -> list[Cell]:
    """Where a configuration touches the training state: mid-epoch, between micro-batches, an epoch's last batch,
    mid-validation, and a SIGKILL (the restart from the newest checkpoint)."""
    return [
        Cell(configuration, "train_batch", "SIGTERM", 0, 2),
        Cell(configuration, "train_batch", "SIGINT", 0, 7),
        Cell(configuration, "val_batch", "SIGUSR1", nth=1, batch=1),
        Cell(configuration, "train_batch", "SIGKILL", 1, 2),
    ]


SLOW = [
    *_every_moment("single", "SIGTERM"),
    *_kinds_of_moment("single", "SIGINT"),
    *_kinds_of_moment("single", "SIGUSR1"),
    *_kinds_of_moment("single", "SIGUSR1", slurm=True),
    *_kinds_of_moment("single", "SIGKILL"),
    *[
        cell
        for name in CONFIGURATIONS
        if name not in ("single", "test-after-fit") and not name.startswith("ddp")
        for cell in _configuration_cells(name)
    ],
    Cell("periodic", "train_batch", "SIGKILL", 0, 7),
    Cell("periodic", "checkpoint", "SIGKILL", nth=2),
    *[Cell("ddp", "train_batch", "SIGTERM", 0, 2, ranks=r) for r in ((0,), (1,), (0, 1))],
    *[Cell("ddp", "train_batch", "SIGTERM", 0, 7, ranks=r) for r in ((1,), (0, 1))],
    *[Cell("ddp", "val_batch", "SIGTERM", nth=1, batch=0, ranks=r) for r in ((0,), (1,))],
    Cell("ddp", "sanity_batch", "SIGINT", ranks=(0, 1)),
    Cell("ddp", "train_batch", "SIGKILL", 1, 2, ranks=(1,)),
    *_every_epoch("ddp", ("train_batch", 5), ("val_batch", 0), ranks=(0, 1)),
    *_every_epoch("ddp", ("train_batch", 5), ranks=(1,)),
    *_every_epoch("ddp-1", ("train_batch", 2), ("val_batch", 0)),
    *_every_epoch("ddp-workers", ("train_batch", 5), ranks=(0, 1)),
    *_every_epoch("ddp-scaling", ("train_batch", 5), ranks=(0, 1)),
    Cell("ddp", "train_batch", "SIGINT", 1, 3, ranks=(0,)),
    *_kinds_of_moment("fsdp", "SIGTERM"),
    *_every_epoch("fsdp", ("train_batch", 5), ("val_batch", 0), ranks=(0, 1)),
    *[Cell("fsdp", "train_batch", "SIGTERM", 0, 2, ranks=r) for r in ((1,), (0, 1))],
    Cell("fsdp", "val_batch", "SIGINT", nth=1, batch=1, ranks=(1,)),
    Cell("fsdp", "train_batch", "SIGKILL", 1, 2, ranks=(1,)),
    Cell("fsdp", "checkpoint", "SIGKILL", nth=1),
]
FAST = [
    Cell("single", "train_batch", "SIGTERM", 0, 5),  # mid-epoch
    Cell("single", "train_batch", "SIGINT", 0, 7),  # an epoch's last batch (validation and the epoch's end follow)
    Cell("single", "val_batch", "SIGUSR1", nth=1, batch=0),  # mid-validation
    Cell("single", "sanity_batch", "SIGTERM"),
    Cell("single", "epoch_end", "SIGTERM"),
    Cell("single", "checkpoint", "SIGKILL", nth=1),  # killed while a checkpoint is written
    Cell("single", "teardown", "SIGTERM"),  # after the last step
]
SLOW += [
    Cell("accumulation", "train_batch", "SIGTERM", 0, 2),  # between micro-batches
    Cell("ddp-1", "train_batch", "SIGTERM", 1, 2),  # mid-epoch in a later epoch, Lightning's DistributedSampler
]
FAST_IDS = {cell.id for cell in FAST}
SLOW = [cell for cell in dict.fromkeys(SLOW) if cell.id not in FAST_IDS]  # each cell once, in order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(configuration: str) -> list[str]:
    config = CONFIGS / CONFIG_FILES.get(configuration, "default.yaml")
    return [sys.executable, "-m", PACKAGE, "fit", "--config", str(config), *BASE, *CONFIGURATIONS[configuration]]


def _env(work: Path, slurm: bool = False) -> dict[str, str]:
    env = {k: v for k, v in cli_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env["MASTER_PORT"] = str(_free_port())
    env["PYTHONFAULTHANDLER"] = "1"  # a run that hangs shows where each process waited (conftest.end_hung)
    if slurm:
        # What srun gives the one task of a batch job; scontrol records the requeue request.
        bin_dir = work / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {work / "scontrol.log"}\n')
        (bin_dir / "scontrol").chmod(0o755)
        env.update(
            PATH=os.pathsep.join([str(bin_dir), env["PATH"]]), SLURM_JOB_ID="777", SLURM_JOBID="777",
            SLURM_JOB_NAME="simulated", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1",
            SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1",
            SLURM_JOB_NODELIST="127.0.0.1",
        )  # fmt: skip
    return env


def _start(command: list[str], work: Path, env: dict[str, str], server: ForkServer | None = None) -> int:
    """Run ``command`` in ``work`` (its output appended to run.log): its exit code. With ``server``, a forked child
    runs it; the uninterrupted runs each cell compares with are fresh interpreters (another hash seed, nothing
    inherited)."""
    if server is not None:
        return server.run(command[3:], work, env, work / "run.log", WAIT)
    with (work / "run.log").open("a") as log:
        proc = subprocess.Popen(
            command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        return finish(proc, WAIT, log=work / "run.log")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final checkpoint of each configuration run without a stop (made on first use)."""
    done: dict[str, dict] = {}

    def run(work: Path, configuration: str) -> None:
        code = _start(_command(configuration), work, _env(work))
        assert code == 0, (work / "run.log").read_text()[-4000:]

    def final(configuration: str) -> dict:
        if configuration not in done:
            made = made_once(tmp_path_factory, f"uninterrupted-{configuration}", lambda w: run(w, configuration))
            done[configuration] = _last(made)
        return done[configuration]

    return final


def _last(work: Path) -> dict:
    path = work / "lightning_logs" / "r" / "checkpoints" / "last.ckpt"
    if path.is_dir():  # strategy fsdp's: one shard per process, joined here
        return checkpoints.load_sharded(path)
    return torch.load(path, weights_only=True)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two checkpoint parts differ: tensors bit for bit, everything else by equality."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        same = same and a.dtype == b.dtype and torch.equal(a, b)
        if not same and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
            return [f"{where}: max abs difference {(a.double() - b.double()).abs().max().item():.3g}"]
        return [] if same else [f"{where}: {a!r} != {b!r}"[:300]]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"[:300]]


def _training_state(checkpoint: dict) -> dict:
    """What an exact continuation must reproduce: the step, the weights, optimizer and scheduler states, every
    process's random states and the weights' average.

    Not ``epoch``: a start that trains nothing more (stopped after the last step) has Lightning's ModelCheckpoint write
    ``last.ckpt`` again when training ends, with the epoch counter already past the last epoch (2, not 1).
    """
    callbacks = checkpoint.get("callbacks", {})
    return {
        "global_step": checkpoint["global_step"],
        "state_dict": checkpoint["state_dict"],
        "optimizer_states": checkpoint["optimizer_states"],
        "lr_schedulers": checkpoint.get("lr_schedulers"),
        "callbacks": {k: v for k, v in callbacks.items() if k == "ExactResume" or k.startswith("EMA")},
    }


def _metrics_csv(work: Path, configuration: str) -> Path:
    if configuration == "user-logger":
        return max((work / "mylogs" / "lightning_logs").glob("version_*"), key=lambda p: p.name) / "metrics.csv"
    return work / "lightning_logs" / "r" / "metrics.csv"


def _check_logged_once(work: Path, configuration: str, killed: bool = False) -> None:
    """Each training step once in metrics.csv (and TensorBoard), each validation's accuracy once."""
    if configuration == "loggers-off":
        return
    path = _metrics_csv(work, configuration)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    column = next(c for c in ("train_loss_step", "train_loss") if c in rows[0])
    logged = [int(r["step"]) for r in rows if r[column]]
    steps = STEPS // 2 if configuration == "accumulation" else STEPS
    if configuration == "user-logger":
        # A logger of the user's own starts a new version at each start: the steps are split between them. After a
        # SIGKILL the steps since the newest checkpoint are in both (the project drops them from its own loggers).
        versions = sorted(path.parent.parent.glob("version_*"))
        logged = []
        for version in versions:
            with (version / "metrics.csv").open(newline="") as f:
                logged += [int(r["step"]) for r in csv.DictReader(f) if r.get(column)]
        assert sorted(set(logged) if killed else logged) == list(range(steps)), logged
        return
    assert logged == list(range(steps)), f"{path}: {logged}"
    assert len([r for r in rows if r.get("val_acc")]) == VALIDATIONS, f"one val_acc per validation, {VALIDATIONS}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path.parent)).Reload()
    assert [e.step for e in events.Scalars(column)] == list(range(steps))


def _check_provenance(work: Path, cell: Cell, stopped: bool) -> None:
    run = work / "lightning_logs" / "r"
    starts = json.loads((run / "provenance.json").read_text())["starts"] if cell.configuration != "user-logger" else []
    if not starts:
        return
    # A signal in teardown comes after training finished, and the start has recorded so.
    after = cell.moment in ("teardown", "test_after_fit")
    # A peer SIGKILLed under DDP makes rank 0 fail on its next collective.
    killed = "killed" if 0 in cell.ranks else "failed"
    expected = {"SIGKILL": killed}.get(cell.signal, "finished" if after else "interrupted")
    assert [s["status"] for s in starts] == ([expected, "finished"] if stopped else ["finished"]), starts
    if stopped and expected == "interrupted":
        assert starts[0]["signal"] == cell.signal


def _check_nothing_outside_the_run(work: Path, cell: Cell) -> None:
    test_files = {"run.log", "fault.yaml", "fault.fired", "bin", "scontrol.log", "data"}
    if cell.configuration == "user-logger":
        test_files.add("mylogs")  # the user's logger writes where it was told
    left = sorted(set(os.listdir(work)) - test_files - {"lightning_logs"})
    assert not left, f"left outside the run's folder: {left}"
    assert os.listdir(work / "lightning_logs") == ["r"]
    checkpoints = work / "lightning_logs" / "r" / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if not p.name.endswith(".ckpt")], "temporary files left"
    # Stopped at the run's end, the continuation trains and writes nothing: the stop's checkpoint is then the newest.
    interrupted = checkpoints / "interrupted.ckpt"
    assert not interrupted.exists() or newest([checkpoints]) == str(interrupted), "the finished run keeps the stop's"


def _run_cell(cell: Cell, work: Path, uninterrupted: Any, server: ForkServer) -> None:
    reference = uninterrupted(cell.configuration)
    ranks = ", ".join(map(str, cell.ranks))
    (work / "fault.yaml").write_text(
        "class_path: fault.Fault\ninit_args: {"
        f"moment: {cell.moment}, signal: {cell.signal}, epoch: {cell.epoch}, batch: {cell.batch}, nth: {cell.nth}, "
        f"ranks: [{ranks}]}}\n"
    )
    # Appended: the callbacks a configuration lists (a user's own) stay.
    command = [*_command(cell.configuration), "--trainer.callbacks+=fault.yaml"]
    env = _env(work, slurm=cell.slurm)

    first = _start(command, work, env, server)
    output = (work / "run.log").read_text()
    fired = (work / "fault.fired").is_file()
    assert fired, f"the fault never fired (exit {first}):\n{output[-3000:]}"
    signum = int(getattr(signal, cell.signal))
    if cell.signal == "SIGKILL":
        # Under DDP the other ranks fail when a peer is killed; what matters is what the same command does next.
        assert first != 0, output[-3000:]
    elif cell.moment in ("teardown", "test_after_fit"):  # training has ended: the run finishes, naming the signal
        assert first == 0, f"exit code {first}, expected 0:\n{output[-3000:]}"
        assert f"{cell.signal} came after training ended and stopped nothing" in output, output[-3000:]
        assert "Traceback" not in output, output[-4000:]
    else:
        assert first == 128 + signum, f"exit code {first}, expected {128 + signum}:\n{output[-3000:]}"
        assert f"Stopping on {cell.signal}" in output, output[-3000:]
        assert "Traceback" not in output, output[-4000:]
        then = "the job is requeued" if cell.slurm else "run the same command to continue"
        assert then in output, output[-3000:]
    if cell.slurm:
        assert (work / "scontrol.log").read_text() == "requeue 777\n"

    # The same command (and environment) again: it continues where the first stopped and ends normally.
    second = _start(command, work, env, server)
    output = (work / "run.log").read_text()
    assert second == 0, output[-4000:]
    differences = _differences(_training_state(reference), _training_state(_last(work)))
    assert not differences, "the continued run differs from the uninterrupted one:\n" + "\n".join(differences[:10])
    _check_logged_once(work, cell.configuration, killed=cell.signal == "SIGKILL")
    _check_provenance(work, cell, stopped=True)
    _check_nothing_outside_the_run(work, cell)


def _params(cells: list[Cell]) -> list[Any]:
    # configs/dp.yaml splits each batch over GPUs 0 and 1.
    return [pytest.param(c, id=c.id, marks=[pytest.mark.gpu(2)] if c.configuration == "dp" else []) for c in cells]


@pytest.mark.parametrize("cell", _params(FAST))
def test_a_stop_at_each_kind_of_moment_continues_exactly(
    cell: Cell, tmp_path: Path, uninterrupted: Any, fork_server: ForkServer
) -> None:
    _run_cell(cell, tmp_path, uninterrupted, fork_server)


@pytest.mark.slow
@pytest.mark.parametrize("cell", _params(SLOW))
def test_every_moment_signal_and_configuration_continues_exactly(
    cell: Cell, tmp_path: Path, uninterrupted: Any, fork_server: ForkServer
) -> None:
    _run_cell(cell, tmp_path, uninterrupted, fork_server)


def test_the_matrix_covers_what_it_promises() -> None:
    """The figures of docs/reliability.md: the moments, signals and configurations of the matrix."""
    cells = FAST + SLOW
    assert len({cell.id for cell in cells}) == len(cells), "two cells with one id"
    assert {cell.signal for cell in cells} == {"SIGTERM", "SIGINT", "SIGUSR1", "SIGKILL"}
    assert {cell.configuration for cell in cells} == set(CONFIGURATIONS)
    assert {cell.moment for cell in cells} >= {"train_batch", "sanity_batch", "val_batch", "epoch_end", "checkpoint"}
    every_batch = {(c.epoch, c.batch) for c in cells if c.configuration == "single" and c.moment == "train_batch"}
    assert every_batch >= {(e, b) for e in (0, 1) for b in range(8)}
    assert f"{len(cells)} cells, {len(FAST)} of them" in " ".join(
        (REPO / "docs" / "reliability.md").read_text().split()
    )
