"""The trial's side of a sweep: the objective's value at each validation, appended to a file the driver reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from template.engine.errors import ConfigError
from template.engine.strategies.devices import process_devices

REPORTER = f"{__name__}.ObjectiveReporter"  # the class path a trial's config names
REPORTS = "objective.jsonl"
NOT_LOGGED = "the sweep's objective"
MEMORY_FRACTION = "SWEEP_GPU_MEMORY_FRACTION"  # sweep.gpu_memory_fraction, for the trial and its DDP ranks


class ObjectiveReporter(Callback):
    """Appends ``{"step", "epoch", "value"}`` of ``monitor`` to ``<run folder>/objective.jsonl`` after each validation
    (rank zero; under DDP the value is reduced), where the driver reads it to prune; caps the trial's share of each of
    its CUDA devices' memory (``sweep.gpu_memory_fraction``) before the model reaches them."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if fraction := os.environ.get(MEMORY_FRACTION):
            for device in process_devices(trainer.strategy):
                if device.type == "cuda":
                    torch.cuda.set_per_process_memory_fraction(float(fraction), device)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:  # said at the sanity check, not after training for no score
            logged = ", ".join(sorted(metrics)) or "nothing during validation"
            raise ConfigError(
                f"{NOT_LOGGED} '{self.monitor}' is never logged by the module (it logs: {logged}); set "
                "sweep.objective or checkpoint.monitor to one of those"
            )
        if trainer.sanity_checking:
            return
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank asks
        if not trainer.is_global_zero or log_dir is None:
            return
        value = float(metrics[self.monitor])  # NaN stays NaN (Python's json reads it back): the trial failed
        line = json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch, "value": value})
        with (Path(log_dir) / REPORTS).open("a") as f:
            f.write(line + "\n")
