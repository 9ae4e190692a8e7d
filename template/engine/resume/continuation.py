"""Which checkpoint a ``fit`` continues from: the run's newest, checked; and the periodic saves for restarts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from template.engine.errors import ConfigError
from template.engine.logs.console import Mechanism
from template.engine.resume import checkpoints
from template.engine.resume.states import exact_resume_point
from template.engine.runs.folder import checkpoint_dir, newest, run_dir, run_name


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

    def describe(self) -> str | None:
        """The line saying which run this is and where it starts; None for an unnamed run."""
        if self.name is None:
            return None
        if self.ckpt_path is None:
            return f"Run {self.name} ({self.directory}): no checkpoint yet, starting from the beginning"
        where = checkpoints.describe(self.ckpt_path)
        return f"Run {self.name} ({self.directory}): resuming from {self.ckpt_path} ({where})"


def continue_run(config: Any) -> Run:
    """The run of a ``fit`` config and, when no ``ckpt_path`` is given, its newest checkpoint (validated)."""
    name = run_name(config.get("run.name"))
    ckpt_path = config.get("ckpt_path")
    every = config.get("run.save_every_n_steps")
    preemption = config.get("run.preemption") is not False
    if every is not None and every < 1:
        raise ConfigError(f"run.save_every_n_steps={every} must be a number of steps >= 1, or null for none")
    interval = config.get("run.preemption_check_interval", 1.0)
    if interval < 0:
        raise ConfigError(f"run.preemption_check_interval={interval} must be seconds >= 0 (e.g. 1.0; 0: every step)")
    preemption = {"preemption": preemption, "preemption_check_interval": interval}
    if name is None:
        return Run(None, None, ckpt_path, resume=False, save_every_n_steps=every, **preemption)
    directory = run_dir(config.get("trainer.default_root_dir"), name)
    if ckpt_path is None:
        dirpath = config.get("checkpoint.dirpath")
        ckpt_path = newest([directory / "checkpoints", *([Path(dirpath)] if dirpath else [])])
    step = None
    if ckpt_path is not None and ckpt_path not in checkpoints.SPECIAL_PATHS:
        option = f"the run's folder {directory}"
        step = checkpoints.check(ckpt_path, option, strategy=config.get("trainer.strategy")).get("global_step")
    return Run(
        name, directory, ckpt_path, resume=directory.is_dir(), save_every_n_steps=every, **preemption,
        resume_step=step if isinstance(step, int) else None,
    )  # fmt: skip


class PeriodicCheckpoint(Callback):
    """Rewrites ``checkpoints/last-step.ckpt`` every ``every`` training steps, for restarts after a SIGKILL.

    It is written at the first batch end from which a resume is exact (``resume.exact_resume_point``), at most a
    validation later than the step it is due: never between micro-batches, at an epoch's last batch or right before
    a validation. ``ModelCheckpoint(every_n_train_steps=...)`` would write at those too.
    """

    announcement = Mechanism(
        "periodic checkpoint", "last-step.ckpt every run.save_every_n_steps steps", "--run.save_every_n_steps=null"
    )

    FILENAME = "last-step.ckpt"

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
            trainer.save_checkpoint(Path(checkpoint_dir(trainer)) / self.FILENAME, weights_only=False)
            self._due = (trainer.global_step // self.every + 1) * self.every


def periodic_checkpoint(run: Run | None) -> list[PeriodicCheckpoint]:
    """The periodic save of ``run.save_every_n_steps``; none when unset."""
    every = run.save_every_n_steps if run is not None else None
    return [] if every is None else [PeriodicCheckpoint(every)]
