"""One run folder across restarts: its name, its claim (lock) by one command, its config kept once, and its newest
checkpoint, which the same command continues from."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse.typing import NonNegativeFloat, PositiveInt
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_only

from template.engine.errors import ConfigError, DiskError, disk_errors
from template.engine.runs import CHECKPOINTS, LAST, is_sharded, read_starts, restart_config
from template.engine.runs.provenance import record_failed_start
from template.engine.runs.remote import Lease, RemoteRoot, is_remote
from template.engine.store import Lock, atomic_write, prove_writable, try_lock, undone_on_failure
from template.engine.strategies.fsdp import is_fsdp

_PART = "[A-Za-z0-9][A-Za-z0-9._-]*"
# A sweep's trials are runs one level down (<sweep name>/<trial>), their folds under --cv.folds two.
_RUN_NAME = re.compile(rf"{_PART}(/{_PART}){{0,2}}")


@dataclass
class RunOptions:
    """The ``run`` options: which run folder a ``fit`` belongs to, so that the same command continues it.

    Args:
        name: the run's folder under ``<default_root_dir>/lightning_logs/`` (default: the scheduler's job id).
        save_every_n_steps: also write ``checkpoints/last-step.ckpt`` every N training steps, for restarts after a
            SIGKILL (torchrun elastic restarts, the OOM killer), which leave no time for a checkpoint on the way out.
        preemption: on SIGTERM, SIGUSR1 or Ctrl-C write ``checkpoints/interrupted.ckpt`` (and requeue a SLURM job).
        preemption_check_interval: with several processes, about how many seconds apart they compare signals (a
            collective and a GPU sync each time; the stop waits for the next comparison); 0: at every step.
        storage_options: fsspec's options for a ``trainer.default_root_dir`` on object storage, e.g.
            ``{endpoint_url: http://...}``; credentials come from the environment or ~/.aws, never from here.
    """

    name: str | None = None
    save_every_n_steps: PositiveInt | None = None
    preemption: bool = True
    preemption_check_interval: NonNegativeFloat = 1.0
    storage_options: dict[str, Any] | None = None


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
    # Lightning takes a SLURM "job" named bash or interactive for an interactive allocation, not a batch job.
    if job and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        # An array task is its own job for requeueing; its folder follows the array id and task.
        array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{array}_{task}" if array and task else f"slurm-{job}"
    # torchrun's default rendezvous id is the literal "none": the same for every job, so it names no run.
    elastic = environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none" and re.fullmatch(_PART, elastic):
        return f"torchrun-{elastic}"
    return None


def run_folder_arguments(directory: Path | None, trainer_config: dict[str, Any], checkpoint: Any) -> dict[str, Any]:
    """Keep a named run's checkpoints in its own folder whatever the loggers (Lightning puts them in the first logger's
    folder): ``logger: false`` makes the run's folder the ``default_root_dir``, else the checkpoint folder is set
    unless ``checkpoint.dirpath`` is the user's."""
    if directory is None:
        return {}
    if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None:
        checkpoint.dirpath = str(directory / CHECKPOINTS)
    return {"default_root_dir": str(directory)} if trainer_config.get("logger") is False else {}


class RunConfigCallback(SaveConfigCallback):
    """Writes ``config.yaml`` on the first start; a restart keeps it, saving a changed config beside it."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        log_dir = trainer.log_dir
        if self.already_saved or not self.save_to_log_dir or log_dir is None:
            super().setup(trainer, pl_module, stage)
            return
        first = Path(log_dir) / self.config_filename
        if not trainer.strategy.broadcast(first.is_file() if trainer.is_global_zero else False):
            # jsonargparse writes config.yaml in place: a full disk must not leave a 0-byte or partial one.
            with disk_errors(first, "nothing was written"), undone_on_failure(first):
                super().setup(trainer, pl_module, stage)
            return
        if trainer.is_global_zero:
            text = self.parser.dump(self.config, skip_none=False)
            if _without_ckpt_path(first.read_text()) != _without_ckpt_path(text):
                restart = restart_config(log_dir)
                with disk_errors(restart, "nothing was written"):
                    atomic_write(restart, lambda f: f.write(text.encode()))
        self.already_saved = trainer.strategy.broadcast(True)


def _without_ckpt_path(text: str) -> str:
    # The checkpoint a restart resumes from is chosen by the run, not configured: it does not make the config differ.
    return "\n".join(line for line in text.splitlines() if not line.startswith("ckpt_path:"))


class RunFolders:
    """The folders one command writes into: the run's, claimed (locked: one process per run) before anything is
    written there, and the others it creates (a ``checkpoint.dirpath`` of the user's). What it created is removed
    again when the command stops on a mistake before its first training step: a mistake leaves the disk as it was.
    Only the process of global rank zero claims and creates. The command owns this object and releases it."""

    def __init__(self) -> None:
        self.lock: Lock | None = None
        self.run_created: Path | None = None  # the topmost folder the claim created for the run
        self.trainer: Trainer | None = None  # the command's: its global step tells whether training started
        # Each folder created, with the times of the folder it was made in, given back when it is removed again.
        self.created: dict[Path, tuple[int, int]] = {}
        self.remote: RemoteRoot | None = None  # trainer.default_root_dir on object storage, written through a copy
        self.claimed: Path | None = None  # the run's folder, once locked (on object storage: leased)
        self.starts = 0  # the starts its provenance.json held then
        self.read: list[RemoteRoot] = []  # stores a checkpoint was read from

    def root(self, configured: str | None, storage_options: dict[str, Any] | None = None) -> str | None:
        """Where the run's files are written: ``configured``, or the local copy of one on object storage."""
        if not is_remote(configured):
            return configured
        if self.remote is None or self.remote.url != configured.rstrip("/"):
            self.remote = RemoteRoot(configured, storage_options)
        return str(self.remote.local)

    def download(self, url: str, option: str, storage_options: dict[str, Any] | None = None) -> str:
        """A file on object storage (``--ckpt_path s3://...``), downloaded until the command ends; its local path."""
        self.read.append(RemoteRoot(url.rsplit("/", 1)[0], storage_options, option))
        return self.read[-1].download(url, option)

    def claim(self, directory: str | os.PathLike, name: str | None, option: str) -> None:
        """Create ``directory`` if needed, prove it writable and lock it; a ConfigError when another process has it."""
        if not _global_zero():
            return
        directory = Path(directory).absolute()
        self.run_created = self._create(directory, option)
        if self.remote is not None and directory.is_relative_to(self.remote.local):
            # On object storage: a lease object instead of the lock, and the files of earlier starts copied here.
            self.remote.lease = Lease(self.remote, directory, name or directory.name)
            self.remote.lease.acquire()
            self.remote.pull(directory)
        else:
            self.lock = try_lock(directory)
            if self.lock is None:
                which = f"run {name!r}" if name else f"the run in {directory}"
                raise ConfigError(
                    f"{which} is already running in another process (its folder {directory} is locked); wait for it "
                    "to end or stop it, or start this one under another --run.name"
                )
        self.claimed, self.starts = directory, len(read_starts(directory))

    def failed(self, exception: BaseException) -> None:
        """Record this start as failed with ``exception`` if it failed after the claim but before its ``Provenance``
        recorded it (in the DataModule's ``setup``, a check before training), so that ``runs`` lists it."""
        if self.claimed is not None and len(read_starts(self.claimed)) == self.starts:
            with contextlib.suppress(OSError):  # often the disk the run failed on: its own error is what it says
                record_failed_start(self.claimed, exception)

    def prepare(self, directory: str | os.PathLike, option: str) -> None:
        """Create ``directory`` if needed and prove it writable before training; a DiskError naming ``option`` if not
        (what was created for it is removed again)."""
        if _global_zero():
            self._create(Path(directory).absolute(), option)

    def _create(self, directory: Path, option: str) -> Path | None:
        created = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
        if created is not None:
            self.created[created] = (parent := created.parent.stat()).st_atime_ns, parent.st_mtime_ns
        try:
            prove_writable(directory, option)
        except BaseException:
            if created is not None:
                self._remove(created)
            raise
        return created

    def discard_unstarted(self) -> None:
        """Remove what this command created, when it stopped before its first training step, except folders that hold
        a checkpoint (a ``checkpoint.dirpath`` it created goes whenever it holds none)."""
        started = self.trainer is not None and self.trainer.global_step > 0
        for created in reversed(list(self.created)):
            if not (created == self.run_created and started) and not any(created.rglob("*.ckpt")):
                self._remove(created)

    def _remove(self, created: Path) -> None:
        shutil.rmtree(created, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.utime(created.parent, ns=self.created.pop(created))  # the parent's times, as before

    def release(self) -> ConfigError | DiskError | None:
        """Unlock the run's folder: the command has ended (the process ending does the same). On object storage, its
        files are uploaded first: the error saying why they could not be, or None."""
        if self.lock is not None:
            self.lock.release()
        try:
            if self.remote is not None and self.claimed is not None and self.remote.lease is not None:  # global rank 0
                self.remote.sync(self.claimed)
                self.remote.flush()
        except (ConfigError, DiskError) as err:
            return err
        finally:
            for store in filter(None, [*self.read, self.remote]):
                store.close()
        return None


def _global_zero() -> bool:
    # Before Lightning sets up its processes the Trainer does not know its rank yet; the launchers' variables do.
    ranks = (os.environ.get("NODE_RANK", "0"), os.environ.get("GROUP_RANK", "0"))
    return rank_zero_only.rank == 0 and ranks == ("0", "0")


def checkpoint_dir(trainer: Any) -> str:
    """Where the run's checkpoints go: the ModelCheckpoint's folder, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return str(callback.dirpath)
    return os.path.join(trainer.log_dir or trainer.default_root_dir, CHECKPOINTS)


def newest(directories: list[Path]) -> str | None:
    """The most recently written ``.ckpt`` in ``directories``, or None."""
    candidates = [p for d in directories if d.is_dir() for p in d.glob("*.ckpt") if p.is_file() or is_sharded(p)]
    # On equal times prefer last.ckpt: ModelCheckpoint writes it right after the best-* file of the same step.
    found = max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name.startswith(Path(LAST).stem)), default=None)
    return None if found is None else str(found)


def newest_under(root: str | os.PathLike, dirpath: str | os.PathLike | None = None) -> str:
    """What ``--ckpt_path last`` means: the newest ``.ckpt`` of the runs under ``root``; a ConfigError for none."""
    root = Path(root)
    found = newest([*root.glob(f"*/*/{CHECKPOINTS}"), root / CHECKPOINTS, *([Path(dirpath)] if dirpath else [])])
    if found is None:
        raise ConfigError(
            f"--ckpt_path last: no checkpoint found under '{root}' (looked in {root}/<logger>/<version>/checkpoints); "
            "train first, set --trainer.default_root_dir to the run's root, or pass a checkpoint file"
        )
    return found


def refuse_what_object_storage_cannot_hold(config: Any, subcommand: str | None) -> None:
    """One line for a run on object storage that could not keep its guarantees there."""
    if is_remote(dirpath := config.get("checkpoint.dirpath")):
        raise ConfigError(
            f"checkpoint.dirpath={dirpath} is on object storage: set trainer.default_root_dir there instead, and the "
            "run's checkpoints go to its folder with the run's guarantees (uploads in order, the newest named last)"
        )
    root = config.get("trainer.default_root_dir")
    if not is_remote(root) or subcommand is None:  # None: a config parsed for a sweep's trials, not run
        return
    if subcommand != "fit":
        raise ConfigError(
            f"trainer.default_root_dir={root}: {subcommand} writes its logs into a new local folder; keep "
            "default_root_dir local (--ckpt_path may name a checkpoint on object storage)"
        )
    if run_name(config.get("run.name")) is None:
        raise ConfigError(
            f"trainer.default_root_dir={root} is on object storage: a run there needs a name (--run.name, or the "
            "scheduler's job id), by which the same command finds it again"
        )
    if config.get("checkpoint.save_last") == "link":
        raise ConfigError(
            "checkpoint.save_last=link makes last.ckpt a symbolic link, which object storage does not have; use "
            "checkpoint.save_last: true"
        )
    if is_fsdp(config.get("trainer.strategy")):
        raise ConfigError(
            f"strategy fsdp writes each checkpoint as a folder of shards, which trainer.default_root_dir={root} "
            "(object storage) cannot replace whole; train with strategy ddp there, or keep fsdp runs on a shared disk"
        )
