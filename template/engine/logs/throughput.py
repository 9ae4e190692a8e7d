"""Training throughput in the logs: samples/s per epoch, FLOP/s and utilisation where known, peak GPU memory."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

PREFIX = "throughput/"
# The dtype the matmuls run in, for the device's peak FLOP/s.
_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64, "transformer-engine": torch.int8}


class ThroughputLog(Callback):
    """Logs, for every training epoch, ``throughput/samples_per_sec`` (all processes together) and, on CUDA,
    ``throughput/peak_memory_gib`` (the first device's peak allocated memory in the epoch). A LightningModule with a
    ``flops_per_batch`` attribute (FLOPs of one batch on one device, as for Lightning's ThroughputMonitor; see
    ``lightning.fabric.utilities.throughput.measure_flops``) also gets ``throughput/flops_per_sec`` and, on GPUs
    whose peak Lightning knows, ``throughput/mfu`` (model FLOPs utilisation, 0 to 1). The end of ``fit`` prints the
    figures in one line.

    The batch size is the first tensor's length in each batch, as ``self.log`` infers it; time spent validating is
    left out. The GPU is synchronised only at the edges of an epoch and of its validation, never per step.

    Args:
        enabled: log and print the figures; ``false`` adds no work at all.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._available_flops: int | None = None
        self._epochs: list[dict[str, float]] = []  # the figures as logged: reduced over processes, float32
        self._logged: list[str] = []  # the names logged at the last epoch's end, not yet read back
        self._reset()

    def _reset(self) -> None:
        self._start = self._validation_start = None
        self._paused = 0.0
        self._samples = self._batches = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        precision = str(trainer.precision)
        dtype = next((d for p, d in _COMPUTE_DTYPE.items() if precision.startswith(p)), torch.float32)
        self._available_flops = get_available_flops(trainer.strategy.root_device, dtype)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self._read_back(trainer)
        self._reset()
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._start = self._now(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.enabled:
            # (inputs, targets): the first tensor's length without Lightning's walk of the batch (~1.5 us a step).
            first = batch[0] if isinstance(batch, (tuple, list)) and batch else None
            fast = isinstance(first, torch.Tensor) and first.dim() > 0
            self._samples += len(first) if fast else extract_batch_size(batch)
            self._batches += 1

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.enabled and self._start is not None and not trainer.sanity_checking:
            self._validation_start = self._now(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is not None:
            self._paused += self._now(trainer) - self._validation_start
            self._validation_start = None

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled or self._start is None or self._batches == 0:
            return
        elapsed = self._now(trainer) - self._start - self._paused
        if elapsed <= 0:
            return
        flops = getattr(pl_module, "flops_per_batch", None)
        # Lightning's Throughput over a window of two points: the epoch's start and its end.
        throughput = Throughput(available_flops=self._available_flops, world_size=trainer.world_size, window_size=2)
        throughput.update(time=0.0, batches=0, samples=0, flops=None if flops is None else 0)
        throughput.update(
            time=elapsed,
            batches=self._batches,
            samples=self._samples,
            flops=None if flops is None else int(flops * self._batches),
        )
        computed = throughput.compute()
        # One process: Throughput gives only the device's figures, which are then the whole run's.
        metrics = {"samples_per_sec": computed.get("samples_per_sec", computed["device/samples_per_sec"])}
        if flops is not None:
            metrics["flops_per_sec"] = computed.get("flops_per_sec", computed["device/flops_per_sec"])
            if "device/mfu" in computed:
                metrics["mfu"] = computed["device/mfu"]
        device = trainer.strategy.root_device
        if device.type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        self._logged = list(metrics)
        for name, value in metrics.items():
            # Each process estimates the whole run's rate from its own time: the log holds the mean over processes
            # (one all-reduce per epoch), and the largest peak memory.
            reduce = "max" if name == "peak_memory_gib" else "mean"
            pl_module.log(PREFIX + name, float(value), on_epoch=True, on_step=False, sync_dist=True, reduce_fx=reduce)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_back(trainer)

    def _read_back(self, trainer: Trainer) -> None:
        """The last epoch's figures as Lightning reduced and logged them after ``on_train_epoch_end``: the printed
        line then says what the logs hold."""
        logged = {name: trainer.callback_metrics.get(PREFIX + name) for name in self._logged}
        if self._logged and all(value is not None for value in logged.values()):
            self._epochs.append({name: float(value) for name, value in logged.items()})
        self._logged = []

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._epochs:
            rank_zero_info(summary(self._epochs))

    @staticmethod
    def _now(trainer: Trainer) -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU's queued work belongs to the time measured
        return time.perf_counter()


def summary(epochs: list[dict[str, float]]) -> str:
    """One line: the last epoch's samples/s (and the mean over epochs), FLOP/s and utilisation, peak GPU memory."""
    last = epochs[-1]
    mean = sum(e["samples_per_sec"] for e in epochs) / len(epochs)
    parts = [f"{last['samples_per_sec']:,.0f} samples/s in the last epoch ({mean:,.0f} mean over {len(epochs)})"]
    if "flops_per_sec" in last:
        utilisation = f", {last['mfu']:.1%} of the devices' peak" if "mfu" in last else ""
        parts.append(f"{last['flops_per_sec'] / 1e12:.3g} TFLOP/s{utilisation}")
    if "peak_memory_gib" in last:
        parts.append(f"peak GPU memory {max(e['peak_memory_gib'] for e in epochs):.2f} GiB")
    return "Throughput: " + "; ".join(parts)
