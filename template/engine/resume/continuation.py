"""Which checkpoint a ``fit`` continues from: the run's newest, checked once; and the periodic saves for restarts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from template.engine.logs.console import Mechanism
from template.engine.resume import checkpoints
from template.engine.resume.states import exact_resume_point
from template.engine.runs import CHECKPOINTS, LAST_STEP, run_dir
from template.engine.runs.folder import RunFolders, checkpoint_dir, newest, run_name


@dataclass
class Run:
    """What ``fit`` continues: the run's name and folder, the checkpoint it resumes from, whether it has logs."""

    name: str | None
    directory: Path | None
    ckpt_path: str | None
    resume: bool
    save_every_n_steps: int | None = None
    preemption: bool = True
    preemption_check_interval: float = 1.0
    resume_step: int | None = None  # the global step of the checkpoint the run continues from
    resume_epoch: int | None = None

    def describe(self) -> str | None:
        """The line saying which run this is and where it starts; None for an unnamed run."""
        if self.name is None:
            return None
        if self.ckpt_path is None:
            return f"Run {self.name} ({self.directory}): no checkpoint yet, starting from the beginning"
        epoch, step = ("?" if value is None else value for value in (self.resume_epoch, self.resume_step))
        return f"Run {self.name} ({self.directory}): resuming from {self.ckpt_path} (epoch {epoch}, step {step})"


def continue_run(config: Any, folders: RunFolders | None = None) -> Run:
    """The run of a ``fit`` config and, when no ``ckpt_path`` is given, its newest checkpoint; the checkpoint is
    checked (``checkpoints.check``), once: the Run keeps what the rest of the start needs of it. ``folders``: the
    command's, which copies a run folder on object storage locally."""
    name = run_name(config.get("run.name"))
    ckpt_path = config.get("ckpt_path")
    options = {
        "save_every_n_steps": config.get("run.save_every_n_steps"),
        "preemption": config.get("run.preemption") is not False,
        "preemption_check_interval": config.get("run.preemption_check_interval", 1.0),
    }
    if name is None:
        return Run(None, None, ckpt_path, resume=False, **options)
    folders = folders or RunFolders()
    root = folders.root(config.get("trainer.default_root_dir"), config.get("run.storage_options"))
    directory = run_dir(root, name)
    remote = folders.remote
    if ckpt_path is None and remote is not None:
        ckpt_path = remote.newest(directory / CHECKPOINTS)
    elif ckpt_path is None:
        dirpath = config.get("checkpoint.dirpath")
        ckpt_path = newest([directory / CHECKPOINTS, *([Path(dirpath)] if dirpath else [])])
    step = epoch = None
    if ckpt_path is not None and ckpt_path not in checkpoints.SPECIAL_PATHS:
        option = f"the run's folder {remote.url_of(directory) if remote else directory}"
        checked = checkpoints.check(ckpt_path, option, strategy=config.get("trainer.strategy"))
        step, epoch = checked.get("global_step"), checked.get("epoch")
    resume = remote.exists(directory) if remote is not None else directory.is_dir()
    return Run(name, directory, ckpt_path, resume=resume, **options, resume_step=step, resume_epoch=epoch)


class PeriodicCheckpoint(Callback):
    """Rewrites ``checkpoints/last-step.ckpt`` every ``every`` training steps, for restarts after a SIGKILL: at the
    first batch end from which a resume is exact, where ``ModelCheckpoint(every_n_train_steps=...)`` would also write
    between micro-batches, at an epoch's last batch and right before a validation."""

    announcement = Mechanism(
        "periodic checkpoint", "last-step.ckpt every run.save_every_n_steps steps", "--run.save_every_n_steps=null"
    )

    def __init__(self, every: int) -> None:
        self.every = every
        self._due = every

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._due = (trainer.global_step // self.every + 1) * self.every

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step >= self._due and exact_resume_point(trainer):
            # A full training state, as ModelCheckpoint writes; Lightning logs a line when weights_only is left unset.
            trainer.save_checkpoint(Path(checkpoint_dir(trainer)) / LAST_STEP, weights_only=False)
            self._due = (trainer.global_step // self.every + 1) * self.every


def periodic_checkpoint(run: Run) -> list[PeriodicCheckpoint]:
    return [] if run.save_every_n_steps is None else [PeriodicCheckpoint(run.save_every_n_steps)]
