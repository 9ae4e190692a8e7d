"""One run folder across restarts: the run's name, its newest checkpoint, and its config kept once."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_only

from template.engine.errors import ConfigError, disk_errors
from template.engine.runs import LOGS
from template.engine.store import atomic_write, prove_writable, undone_on_failure

# Lightning treats a SLURM "job" named like this as an interactive allocation, not a batch job it may requeue.
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A sweep's trials are runs one level down (<sweep name>/<trial>), their folds under --cv.folds two.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*){0,2}")


class RunOptions:
    """The ``run`` options: which run folder a ``fit`` belongs to, so that the same command continues it."""

    def __init__(
        self,
        name: str | None = None,
        save_every_n_steps: int | None = None,
        preemption: bool = True,
        preemption_check_interval: float = 1.0,
    ) -> None:
        """``name``: the run's folder under ``<default_root_dir>/lightning_logs/`` (default: the scheduler's job id).

        ``save_every_n_steps``: also write ``checkpoints/last-step.ckpt`` every N training steps, for restarts after a
        SIGKILL (torchrun elastic restarts, the OOM killer), which leave no time for a checkpoint on the way out.

        ``preemption``: on SIGTERM, SIGUSR1 or Ctrl-C write ``checkpoints/interrupted.ckpt`` (and requeue a SLURM job).

        ``preemption_check_interval``: with several processes, about how many seconds apart they compare signals
        (a collective and a GPU sync each time; the stop waits for the next comparison); 0: at every step.
        """
        self.name = name
        self.save_every_n_steps = save_every_n_steps
        self.preemption = preemption
        self.preemption_check_interval = preemption_check_interval


def run_name(configured: str | None, environ: os._Environ | dict[str, str] = os.environ) -> str | None:
    """The run's name: the configured one, else the SLURM batch job's or torchrun's run id; None for neither."""
    if configured is not None:
        if not _RUN_NAME.fullmatch(configured) or configured in (".", ".."):
            raise ConfigError(
                f"run.name={configured!r} is not a folder name; use letters, digits, '.', '_' and '-', e.g. "
                "--run.name=digits-lr3e-4"
            )
        return configured
    job = environ.get("SLURM_JOB_ID")
    if job and environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_JOB_NAMES:
        # An array task is its own job for requeueing; its folder follows the array id and task.
        array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{array}_{task}" if array and task else f"slurm-{job}"
    # torchrun's default rendezvous id is the literal "none": the same for every job, so it names no run.
    elastic = environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none" and _NAME.fullmatch(elastic):
        return f"torchrun-{elastic}"
    return None


def run_dir(root: str | os.PathLike | None, name: str) -> Path:
    """The run's folder: logs, ``config.yaml`` and ``checkpoints/``."""
    return Path(root or ".") / LOGS / name


def run_folder_arguments(directory: Path | None, trainer_config: dict[str, Any], checkpoint: Any) -> dict[str, Any]:
    """Keep a named run's checkpoints in its own folder whatever the loggers, so that the same command finds them.

    Lightning puts checkpoints in the first logger's version folder, or in ``default_root_dir`` without a logger. With
    ``logger: false`` the run's folder becomes the Trainer's ``default_root_dir`` (config.yaml and provenance.json go
    there too); with a logger of the user's own the checkpoint folder is set. ``checkpoint.dirpath`` stays the user's.
    """
    if directory is None:
        return {}
    if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None:
        checkpoint.dirpath = str(directory / "checkpoints")
    return {"default_root_dir": str(directory)} if trainer_config.get("logger") is False else {}


class RunConfigCallback(SaveConfigCallback):
    """Writes ``config.yaml`` on the first start; a restart keeps it, saving a changed config beside it."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        log_dir = trainer.log_dir
        if self.already_saved or not self.save_to_log_dir or log_dir is None:
            super().setup(trainer, pl_module, stage)
            return
        first = Path(log_dir) / self.config_filename
        exists = trainer.strategy.broadcast(first.is_file() if trainer.is_global_zero else False)
        if not exists:
            # jsonargparse writes config.yaml in place: a full disk must not leave a 0-byte or partial one.
            with disk_errors(first, "nothing was written"), undone_on_failure(first, copy=False):
                super().setup(trainer, pl_module, stage)
            return
        if trainer.is_global_zero:
            text = self.parser.dump(self.config, skip_none=False)
            if _without_ckpt_path(first.read_text()) != _without_ckpt_path(text):
                # The first config stays as it was; each differing restart adds config.restart-<n>.yaml.
                n = 1
                while (Path(log_dir) / f"config.restart-{n}.yaml").exists():
                    n += 1
                restart = Path(log_dir) / f"config.restart-{n}.yaml"
                with disk_errors(restart, "nothing was written"):
                    atomic_write(restart, lambda f: f.write(text.encode()))
        self.already_saved = trainer.strategy.broadcast(True)


def _without_ckpt_path(text: str) -> str:
    # The checkpoint a restart resumes from is chosen by the run, not configured: it does not make the config differ.
    return "\n".join(line for line in text.splitlines() if not line.startswith("ckpt_path:"))


class RunFolder:
    """The folder a command writes into, claimed before anything is written.

    One process per folder: a lock on the folder itself, which the kernel releases when the process ends however it
    ends, so a killed run never leaves it stuck. A folder the command created is removed again when the command stops
    on a mistake before its first training step (``discard_unstarted``): a mistake leaves the disk as it was.
    """

    claimed: RunFolder | None = None

    def __init__(self, directory: Path, created: Path | None, handle: int, parent_times: tuple | None) -> None:
        self.directory = directory
        self.created = created
        # The times of the folder the new one was made in, given back when it is removed again.
        self.parent_times = parent_times
        self.handle = handle  # kept open: closing it would release the lock
        self.trainer: Trainer | None = None


_forks_drop_the_lock = False


def claim(directory: str | os.PathLike, name: str | None, option: str) -> RunFolder | None:
    """Create ``directory`` if needed and lock it for this process; a ConfigError when another process has it.

    Only the process of global rank zero claims (the others write nothing there); None in the others.
    """
    _unlock()  # a command run earlier in this process (a test, a notebook) has ended
    if not _global_zero():
        return None
    directory = Path(directory).absolute()
    created = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
    times = _times(created.parent) if created is not None else None
    prove_writable(directory, option)
    handle = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        which = f"run {name!r}" if name else f"the run in {directory}"
        raise ConfigError(
            f"{which} is already running in another process (its folder {directory} is locked); wait for it to end "
            "or stop it, or start this one under another --run.name"
        ) from None
    RunFolder.claimed = RunFolder(directory, created, handle, times)
    global _forks_drop_the_lock
    if not _forks_drop_the_lock:
        # A forked child (a DataLoader worker) shares the lock; a SIGKILLed run's workers live on for seconds and
        # would refuse the same command started again at once (torchrun's restart): the lock is this process's alone.
        os.register_at_fork(after_in_child=_unlock)
        _forks_drop_the_lock = True
    return RunFolder.claimed


# Folders a command created for the run besides its own (a ``checkpoint.dirpath`` of the user's), with the times of
# the folder each was made in: removed with the run's when the command stops before training (``discard_unstarted``).
_created: list[tuple[Path, tuple | None]] = []


def prepare_folder(directory: str | os.PathLike, option: str) -> None:
    """Create ``directory`` if needed and prove it writable before training; a DiskError naming ``option`` if not.

    What this creates is removed again, leaving the disk as it was, when it cannot be written or the command stops
    on a mistake before its first training step.
    """
    if not _global_zero():
        return
    directory = Path(directory).absolute()
    created = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
    times = _times(created.parent) if created is not None else None
    try:
        prove_writable(directory, option)
    except BaseException:
        if created is not None:
            _remove(created, times)
        raise
    if created is not None:
        _created.append((created, times))


def release() -> None:
    """Unlock the claimed folder: the command has ended (the process ending does the same)."""
    _created.clear()
    _unlock()


def _unlock() -> None:
    folder, RunFolder.claimed = RunFolder.claimed, None
    if folder is not None:
        with contextlib.suppress(OSError):
            os.close(folder.handle)


def discard_unstarted() -> Path | None:
    """Remove the folder the claimed run created, when it stopped before its first training step; what was removed.

    The other folders the command created for it (``prepare_folder``) go too, unless they hold a checkpoint.
    """
    others, _created[:] = list(_created), []
    for created, times in reversed(others):
        if not any(created.rglob("*.ckpt")):
            _remove(created, times)
    folder = RunFolder.claimed
    if folder is None or folder.created is None:
        return None
    trainer = folder.trainer
    if trainer is not None and trainer.global_step > 0:
        return None
    if any(folder.created.rglob("*.ckpt")):
        return None
    _remove(folder.created, folder.parent_times)
    return folder.created


def _remove(created: Path, parent_times: tuple | None) -> None:
    """Remove a folder this command created, and give the folder it was made in its times back."""
    shutil.rmtree(created, ignore_errors=True)
    if parent_times is not None:
        with contextlib.suppress(OSError):
            os.utime(created.parent, ns=parent_times)


def _times(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_atime_ns, stat.st_mtime_ns


def _global_zero() -> bool:
    # Before Lightning sets up its processes the Trainer does not know its rank yet; the launchers' variables do.
    return (
        rank_zero_only.rank == 0
        and os.environ.get("NODE_RANK", "0") == "0"
        and os.environ.get("GROUP_RANK", "0") == "0"
    )


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint: a folder of torch distributed checkpoint shards (strategy fsdp)."""
    return (Path(path) / ".metadata").is_file()


def checkpoint_dir(trainer: Any) -> str:
    """Where the run's checkpoints go: the ModelCheckpoint's folder, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "dirpath", None):
        return str(callback.dirpath)
    return os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")


def newest(directories: list[Path]) -> str | None:
    """The most recently written ``.ckpt`` in ``directories``, or None."""
    candidates = [p for d in directories if d.is_dir() for p in d.glob("*.ckpt") if p.is_file() or is_sharded(p)]
    if not candidates:
        return None
    # On equal times prefer last.ckpt: ModelCheckpoint writes it right after the best-* file of the same step.
    return str(max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name.startswith("last"))))


def newest_under(root: str | os.PathLike, dirpath: str | os.PathLike | None = None) -> str:
    """What ``--ckpt_path last`` means: the newest ``.ckpt`` of the runs under ``root``; a ConfigError for none."""
    root = Path(root)
    directories = [*root.glob("*/*/checkpoints"), root / "checkpoints", *([Path(dirpath)] if dirpath else [])]
    found = newest(directories)
    if found is None:
        raise ConfigError(
            f"--ckpt_path last: no checkpoint found under '{root}' (looked in {root}/<logger>/<version>/checkpoints); "
            "train first, set --trainer.default_root_dir to the run's root, or pass a checkpoint file"
        )
    return found
