"""How a run was made: ``provenance.json`` in its folder, one entry per start, with how that start ended."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from template.engine.errors import one_line
from template.engine.runs import PROVENANCE, settled
from template.engine.store import atomic_write
from template.engine.strategies.devices import process_devices

# The distributions whose versions decide what a run computes; others installed are not listed.
PACKAGES = ("torch", "lightning", "torchmetrics", "torchdata", "jsonargparse", "numpy", "mlflow-skinny", "wandb")
_GIT_TIMEOUT = 10  # seconds


def git_state(directory: str | os.PathLike) -> dict[str, Any]:
    """The commit checked out in ``directory``'s repository, whether tracked files differ from it, the diff and the
    untracked files; outside a repository, or without git, ``commit`` is None and ``reason`` says why. Never raises.
    """
    commands = [
        ("rev-parse", "HEAD"),
        ("diff", "HEAD", "--no-color", "--no-ext-diff"),
        ("ls-files", "--others", "--exclude-standard", "--full-name"),
    ]
    processes: list[subprocess.Popen] = []
    try:
        # All at once: a start waits for the slowest, not for the sum.
        for args in commands:
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL}
            processes.append(subprocess.Popen(["git", "-C", str(directory), *args], text=True, **pipes))
        # Milliseconds, unless the repository is on a hung network filesystem.
        outputs = [process.communicate(timeout=_GIT_TIMEOUT) for process in processes]
    except FileNotFoundError:
        return {"commit": None, "reason": "git is not installed"}
    except (OSError, subprocess.SubprocessError) as err:
        return {"commit": None, "reason": one_line(str(err))[:300]}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for args, process, (_, stderr) in zip(commands, processes, outputs, strict=True):
        if process.returncode != 0:
            reason = stderr.strip() or f"git {args[0]} exited with {process.returncode}"
            return {"commit": None, "reason": one_line(reason)[:300]}
    (commit, _), (diff, _), (untracked, _) = outputs
    return {"commit": commit.strip(), "dirty": bool(diff), "diff": diff, "untracked": untracked.splitlines()}


def package_versions() -> dict[str, str]:
    """Versions of the installed distributions in ``PACKAGES`` and of this project's own."""
    versions = {}
    own = __name__.split(".")[0]
    for name in (own, *PACKAGES):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def exit_status(exception: BaseException | None) -> dict[str, Any]:
    """``finished``; ``interrupted`` with the signal's name; or ``failed`` with the error in one line."""
    if exception is None:
        return {"status": "finished"}
    if isinstance(exception, KeyboardInterrupt):
        return {"status": "interrupted", "signal": "SIGINT"}
    if isinstance(exception, SIGTERMException):
        # The project's Preemption callback sets the code to 128 + the signal it stopped on (SIGTERM, SIGUSR1).
        code = exception.code if isinstance(exception.code, int) and exception.code > 128 else 128 + signal.SIGTERM
        with contextlib.suppress(ValueError):
            return {"status": "interrupted", "signal": signal.Signals(code - 128).name}
        return {"status": "interrupted", "signal": f"signal {code - 128}"}
    return {"status": "failed", "error": f"{type(exception).__name__}: {one_line(str(exception))}"[:500]}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _this_process(trainer: Trainer) -> dict[str, Any]:
    names = [
        f"{d} ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else str(d)
        for d in process_devices(trainer.strategy)
    ]
    return {"host": socket.gethostname(), "devices": names}


class Provenance(Callback):
    """Appends this start of the run to ``<run folder>/provenance.json`` (rank 0), and how it ended.

    Each entry: the command line, the git commit, whether tracked files differed from it (their diff saved beside,
    as ``git-<n>.diff``), Python, package, torch and CUDA versions, the devices trained on, world size, nodes and host
    names, start and end times, and the exit status. The file is rewritten atomically: a kill leaves the previous
    version or the new one.
    """

    def __init__(self) -> None:
        self._path: Path | None = None
        self._entry: dict[str, Any] | None = None
        self._started: float | None = None
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
        entries = self._read()
        git = git_state(Path(__file__).resolve().parent)
        diff = git.pop("diff", "")
        if git.get("commit") and diff:
            git["diff_file"] = f"git-{len(entries) + 1}.diff"
            self._path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self._path.parent / git["diff_file"], lambda f: f.write(diff.encode()))
        self._started = time.monotonic()
        self._entry = {
            "start": _now(),
            "end": None,
            "status": "running",
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
        self._write(settled([*entries, self._entry]))  # an earlier start that wrote no end was killed

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.finish(trainer, None)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.finish(trainer, exception)

    def finish(self, trainer: Trainer, exception: BaseException | None) -> None:
        """Record how this start ended; the first call counts (a test after fit does not reopen it)."""
        if self._entry is None or self._entry["end"] is not None:
            return
        self._entry.update(end=_now(), seconds=round(time.monotonic() - (self._started or 0.0), 3))
        self._entry.update(exit_status(exception), epochs=trainer.current_epoch, steps=trainer.global_step)
        entries = self._read()
        try:
            self._write(entries[:-1] + [self._entry] if entries else [self._entry])
        except OSError:
            if exception is None:
                raise
            # The run failed already (often on this disk): its own error is what the user sees, not this one.

    def _read(self) -> list[dict[str, Any]]:
        if self._path is None or not self._path.is_file():
            return []
        try:
            return json.loads(self._path.read_text())["starts"]
        except (ValueError, KeyError, TypeError):
            return []  # a file written by hand or another tool: start a new record rather than fail the run

    def _write(self, entries: list[dict[str, Any]]) -> None:
        assert self._path is not None
        text = json.dumps({"starts": entries}, indent=1)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self._path, lambda f: f.write(text.encode()))
