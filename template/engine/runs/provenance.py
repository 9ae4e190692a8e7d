"""How a run was made: ``provenance.json`` in its folder, one entry per start, with how that start ended."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from template.engine.errors import exit_signal, one_line
from template.engine.runs import PROVENANCE, Status, read_starts, settled
from template.engine.store import atomic_write
from template.engine.strategies.devices import process_devices

# The distributions whose versions decide what a run computes; others installed are not listed.
PACKAGES = ("torch", "lightning", "torchmetrics", "torchdata", "jsonargparse", "numpy", "mlflow-skinny", "wandb")
# Whole-repository pathspecs (":/"): run in the engine's folder, git would list only what lies below it.
_GIT_COMMANDS = [
    ("rev-parse", "HEAD"),
    ("diff", "HEAD", "--no-color", "--no-ext-diff", ":/"),
    ("diff", "HEAD", "--name-only", ":/"),
    ("ls-files", "--others", "--exclude-standard", "--full-name", ":/"),
]


def git_state(directory: str | os.PathLike) -> dict[str, Any]:
    """The commit checked out in ``directory``'s repository, the diff from it, and the whole repository's modified and
    untracked files; outside a repository, or without git, ``commit`` is None and ``reason`` says why. Never raises."""

    def git(args: tuple[str, ...]) -> subprocess.CompletedProcess:
        # Milliseconds, unless the repository is on a hung network filesystem.
        command = ["git", "-C", str(directory), "-c", "diff.relative=false", *args]
        return subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=10)

    try:
        with ThreadPoolExecutor(len(_GIT_COMMANDS)) as pool:  # all at once: a start waits for the slowest, not the sum
            done = list(pool.map(git, _GIT_COMMANDS))
    except FileNotFoundError:
        return {"commit": None, "reason": "git is not installed"}
    except (OSError, subprocess.SubprocessError) as err:
        return {"commit": None, "reason": one_line(str(err))[:300]}
    for args, result in zip(_GIT_COMMANDS, done, strict=True):
        if result.returncode != 0:
            reason = result.stderr.strip() or f"git {args[0]} exited with {result.returncode}"
            return {"commit": None, "reason": one_line(reason)[:300]}
    commit, diff, modified, untracked = (result.stdout for result in done)
    files = {"modified": modified.splitlines(), "untracked": untracked.splitlines()}
    return {"commit": commit.strip(), "dirty": bool(diff), "diff": diff, **files}


def package_versions() -> dict[str, str]:
    """Versions of the installed distributions in ``PACKAGES`` and of this project's own."""
    versions = {}
    for name in (__name__.split(".")[0], *PACKAGES):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def exit_status(exception: BaseException | None) -> dict[str, Any]:
    """``finished``; ``interrupted`` with the signal's name; or ``failed`` with the error in one line."""
    if exception is None:
        return {"status": Status.FINISHED}
    if isinstance(exception, KeyboardInterrupt):
        return {"status": Status.INTERRUPTED, "signal": "SIGINT"}
    if isinstance(exception, SIGTERMException):  # Preemption's code names the signal it stopped on; Lightning's, none
        return {"status": Status.INTERRUPTED, "signal": exit_signal(exception.code) or "SIGTERM"}
    return {"status": Status.FAILED, "error": f"{type(exception).__name__}: {one_line(str(exception))}"[:500]}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _this_process(trainer: Trainer) -> dict[str, Any]:
    devices = process_devices(trainer.strategy)
    names = [f"{d} ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else str(d) for d in devices]
    return {"host": socket.gethostname(), "devices": names}


class Provenance(Callback):
    """Appends this start of the run to ``<run folder>/provenance.json`` (rank 0), and how it ended: the command line,
    the git commit (a diff from it saved beside as ``git-<n>.diff``), Python, package, torch and CUDA versions, the
    devices, world size, nodes and hosts, start and end times, and the exit status. Rewritten atomically."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._entry: dict[str, Any] | None = None
        self._started = 0.0
        self._set_up = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._set_up:
            return  # test after fit: the same start goes on
        self._set_up = True
        processes = [_this_process(trainer)]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank takes part, so that rank 0 can name every host and GPU of the job.
            processes = [None] * dist.get_world_size()
            dist.all_gather_object(processes, _this_process(trainer))
        log_dir = trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
        if not trainer.is_global_zero or log_dir is None:
            return
        self._path = Path(log_dir) / PROVENANCE
        self._path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_starts(log_dir, writing=True)
        git = git_state(Path(__file__).resolve().parent)
        if git.get("commit") and (diff := git.pop("diff")):
            git["diff_file"] = f"git-{len(entries) + 1}.diff"
            atomic_write(self._path.parent / git["diff_file"], lambda f: f.write(diff.encode()))
        self._started = time.monotonic()
        self._entry = {
            "start": _now(),
            "end": None,
            "status": Status.RUNNING,
            "stage": stage,
            "command": shlex.join(sys.orig_argv),
            "cwd": os.getcwd(),
            "pid": os.getpid(),
            "git": git,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "packages": package_versions(),
            "torch": {
                "version": torch.__version__,
                "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            },
            "strategy": type(trainer.strategy).__name__,
            "accelerator": type(trainer.accelerator).__name__,
            "precision": str(trainer.precision),
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "hosts": sorted({p["host"] for p in processes}),
            "devices": [device for p in processes for device in p["devices"]],
        }
        write_starts(log_dir, settled([*entries, self._entry]))  # an earlier start that wrote no end was killed

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, None)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish(trainer, exception)

    def _finish(self, trainer: Trainer, exception: BaseException | None) -> None:
        if self._entry is None or self._entry["end"] is not None:
            return  # not rank 0, or ended already (a test after fit does not reopen it)
        self._entry.update(end=_now(), seconds=round(time.monotonic() - self._started, 3), **exit_status(exception))
        self._entry.update(epochs=trainer.current_epoch, steps=trainer.global_step)
        try:
            write_starts(self._path.parent, [*read_starts(self._path.parent, writing=True)[:-1], self._entry])
        except OSError:
            if exception is None:
                raise
            # The run failed already (often on this disk): its own error is what the user sees, not this one.


def write_starts(folder: str | os.PathLike, starts: list[dict[str, Any]]) -> None:
    """Rewrite ``folder``'s ``provenance.json`` with ``starts``, atomically (the sweep driver records a pruned trial's
    last start as ``pruned``)."""
    text = json.dumps({"starts": starts}, indent=1)
    atomic_write(Path(folder) / PROVENANCE, lambda f: f.write(text.encode()))


def record_failed_start(folder: str | os.PathLike, exception: BaseException) -> None:
    """Append a start to ``folder``'s ``provenance.json`` that failed with ``exception`` before ``Provenance`` was set
    up: the runs table lists it with its error line."""
    entry = {"start": _now(), "end": _now(), "command": shlex.join(sys.orig_argv), "cwd": os.getcwd()}
    entry.update(pid=os.getpid(), hosts=[socket.gethostname()], **exit_status(exception))
    write_starts(folder, [*read_starts(folder, writing=True), entry])
