"""Test-only callback for trials that share a GPU: it records what the trial sees and can ask for too much memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class SharedGpuProbe(Callback):
    """At the start of training, writes ``<record_dir>/<pid>.json`` (the trial's ``CUDA_VISIBLE_DEVICES``, memory
    fraction variable, device and the allocator's fraction there); the trial whose run folder is named ``hog_run``
    then allocates ``hog_fraction`` of its GPU's memory. On the CPU it raises the error such a GPU would, so that the
    sweep's handling of an out-of-memory trial is tested without one."""

    def __init__(self, record_dir: str, hog_run: str, hog_fraction: float = 0.5) -> None:
        self.record_dir = Path(record_dir)
        self.hog_run = hog_run
        self.hog_fraction = hog_fraction

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        fraction = None
        if device.type == "cuda" and hasattr(torch.cuda, "get_per_process_memory_fraction"):
            fraction = torch.cuda.get_per_process_memory_fraction(device)
        seen = {
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "SWEEP_GPU_MEMORY_FRACTION": os.environ.get("SWEEP_GPU_MEMORY_FRACTION"),
            "device": str(device),
            "allocator_fraction": fraction,
            "run": Path(trainer.log_dir).name,
        }
        self.record_dir.mkdir(parents=True, exist_ok=True)
        (self.record_dir / f"{os.getpid()}.json").write_text(json.dumps(seen))
        if seen["run"] != self.hog_run:
            return
        if device.type != "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory (raised on the CPU by the test's SharedGpuProbe)")
        total = torch.cuda.get_device_properties(device).total_memory
        self.held = torch.empty(int(self.hog_fraction * total), dtype=torch.uint8, device=device)
