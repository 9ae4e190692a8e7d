"""What a run shows: its first lines (each object the engine adds carries its ``announcement``), the progress bar, the
check that the monitored metrics are logged, the throughput figures."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from template.engine.errors import ConfigError

PREFIX = "throughput/"
_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64, "transformer-engine": torch.int8}


@dataclass(frozen=True)
class Mechanism:
    """One thing the command line adds to a run: what it changes, and the option that switches it off."""

    name: str
    does: str
    off: str


def first_lines(trainer: Any, fit: bool) -> str:
    """The mechanisms of the Trainer's objects, in the order they act, each once with how to switch it off (an object
    whose ``announcement`` is None is idle in this run)."""
    objects = [trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None), *trainer.loggers, *trainer.callbacks]
    mechanisms: dict[str, Mechanism] = {}
    for obj in objects:
        if isinstance(mechanism := getattr(obj, "announcement", None), Mechanism):
            mechanisms.setdefault(mechanism.name, mechanism)
    width = max([len(name) for name in mechanisms] + [len("checkpoints")])
    lines = [f"  {m.name:<{width}}  {m.does}  [off: {m.off}]" for m in mechanisms.values()]
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    if fit and checkpoint is not None and getattr(checkpoint, "monitor", None) is None:
        lines.append(
            f"  {'checkpoints':<{width}}  no checkpoint.monitor set: only last.ckpt is kept  "
            "[best too: --checkpoint.monitor=<a logged metric> --checkpoint.mode=min|max]"
        )
    return "\n".join(["Added by the command line [and how to switch each off]:", *lines])


@dataclass
class Throttle:
    """``ready()`` is True at most once every ``seconds``, the first time included; after ``reset()`` it is True."""

    seconds: float
    last: float = float("-inf")

    def reset(self) -> None:
        self.last = float("-inf")

    def ready(self) -> bool:
        if (now := time.monotonic()) - self.last < self.seconds:
            return False
        self.last = now
        return True


class TimedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, redrawn every ``refresh_rate`` training steps but at most every ``min_interval`` seconds
    (a redraw can cost a small model's step), and at an epoch's last step; the clock is read only to redraw. Off where
    the output is not a terminal: a log file (a sweep trial's, a cluster job's) gets no carriage-return redraws."""

    announcement = Mechanism(
        "progress bar",
        "redrawn every 10 steps, at most 4 times a second",
        "--trainer.enable_progress_bar=false, or your own bar",
    )

    def __init__(self, refresh_rate: int = 10, min_interval: float = 0.25) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._redraw = Throttle(min_interval)
        if not sys.stdout.isatty():
            self.disable()
            self.announcement = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = batch_idx + 1
        if n % self.refresh_rate == 0 and n != self.total_train_batches and not self._redraw.ready():
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class MonitorCheck(Callback):
    """Stops a run whose ``checkpoint.monitor`` (or a configured callback's ``monitor``, e.g. EarlyStopping's) the
    module does not log, in one line naming the metrics it logs: a validation metric after the sanity check (after the
    first validation with several validation loaders, whose sanity check Lightning keeps no metric of), a training one
    (``train*``) after the first validation, where Lightning finds out later and with a traceback."""

    def __init__(self, monitors: dict[str, str]) -> None:
        self.unchecked = dict(monitors)  # option (as the user sets it) -> metric name

    @override
    def on_sanity_check_end(self, trainer: Trainer, pl_module: Any) -> None:
        if len(trainer.num_sanity_val_batches) == 1:
            self._check(trainer, training=False)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._check(trainer, training=True)

    def _check(self, trainer: Trainer, training: bool) -> None:
        logged = sorted(trainer.callback_metrics)
        for option, metric in list(self.unchecked.items()):
            if metric.startswith("train") and not training:
                continue
            del self.unchecked[option]
            if metric in logged:
                continue
            example = next((m for m in logged if m.startswith("val")), logged[0] if logged else "val_loss")
            mode = "max" if any(w in example for w in ("acc", "f1", "auc", "precision", "recall")) else "min"
            fix = (
                f"--checkpoint.monitor={example} --checkpoint.mode={mode}"
                if option == "checkpoint.monitor"
                else f"monitor: {example} (mode: {mode})"
            )
            raise ConfigError(
                f"{option}={metric!r} is not logged by the module (it logs: {', '.join(logged) or 'nothing'}); "
                f"name one of those, e.g. {fix}"
            )


class ThroughputLog(Callback):
    """Logs per training epoch ``throughput/samples_per_sec`` (all processes together) and, on CUDA,
    ``throughput/peak_memory_gib`` (the first device's peak allocated memory); for a LightningModule with a
    ``flops_per_batch`` attribute (one batch's FLOPs on one device, as ``lightning.fabric.utilities.throughput.
    measure_flops`` counts them) also ``throughput/flops_per_sec`` and, on GPUs whose peak Lightning knows,
    ``throughput/mfu`` (0 to 1). The end of ``fit`` prints them in one line. The batch size is each batch's first
    tensor's length; validation time is left out; the GPU is synchronised only at an epoch's and a validation's edges
    (Lightning's ThroughputMonitor synchronises it at every step). A resumed run's figures and line cover every epoch.

    Args:
        enabled: log and print the figures; ``false`` adds no work at all.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._available_flops: int | None = None
        self._epochs: list[dict[str, float]] = []  # each epoch's figures as logged: reduced over processes, float32
        self._pending: dict[str, float] = {}  # the last epoch's, this process's, logged but not yet read back
        self._start: float | None = None  # this epoch's, and its samples, batches and seconds of validation
        self._samples = self._batches = 0
        self._paused = 0.0
        self._validating: float | None = None  # since when
        self._carried: float | None = None  # seconds of the epoch a checkpoint was written in, which a resume continues

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.enabled and stage == "fit":
            precision = str(trainer.precision)  # the dtype the matmuls run in sets the device's peak FLOP/s
            dtype = next((d for p, d in _COMPUTE_DTYPE.items() if precision.startswith(p)), torch.float32)
            self._available_flops = get_available_flops(trainer.strategy.root_device, dtype)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Resumed: Lightning continues the checkpoint's epoch without its on_train_epoch_start.
        if self.enabled and self._carried is not None:
            self._start, self._paused, self._carried = _now(trainer), -self._carried, None

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self._read_back(trainer)
        if (device := trainer.strategy.root_device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._samples = self._batches = 0
        self._paused = 0.0
        self._start = _now(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.enabled:
            # (inputs, targets): the first tensor's length, without Lightning's walk of the whole batch at every step.
            first = batch[0] if isinstance(batch, (tuple, list)) and batch else None
            fast = isinstance(first, torch.Tensor) and first.dim() > 0
            self._samples += len(first) if fast else extract_batch_size(batch)
            self._batches += 1

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.enabled and self._start is not None and not trainer.sanity_checking:
            self._validating = _now(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validating is not None:
            self._paused += _now(trainer) - self._validating
            self._validating = None

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled or self._start is None or self._batches == 0:
            return
        elapsed = _now(trainer) - self._start - self._paused
        if elapsed <= 0:
            return
        # Each process estimates the whole run's rate from its own: the log holds the mean over processes.
        metrics = {"samples_per_sec": self._samples / elapsed * trainer.world_size}
        if (flops := getattr(pl_module, "flops_per_batch", None)) is not None:
            per_device = flops * self._batches / elapsed
            metrics["flops_per_sec"] = per_device * trainer.world_size
            if self._available_flops:
                metrics["mfu"] = per_device / self._available_flops
        if (device := trainer.strategy.root_device).type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        self._pending = metrics
        for name, value in metrics.items():
            reduce = "max" if name == "peak_memory_gib" else "mean"  # one all-reduce per epoch
            pl_module.log(PREFIX + name, float(value), on_epoch=True, on_step=False, sync_dist=True, reduce_fx=reduce)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_back(trainer)
        if self._epochs:
            rank_zero_info(summary(self._epochs))

    def _read_back(self, trainer: Trainer) -> None:
        """The last epoch's figures as Lightning reduced and logged them after ``on_train_epoch_end``: the printed
        line then says what the logs hold."""
        logged = {name: trainer.callback_metrics.get(PREFIX + name) for name in self._pending}
        if self._pending and all(value is not None for value in logged.values()):
            self._epochs.append({name: float(value) for name, value in logged.items()})
        self._pending = {}

    @override
    def state_dict(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self._start - self._paused if self._start is not None else 0.0
        epochs = [*self._epochs, self._pending] if self._pending else self._epochs
        return {"epochs": epochs, "samples": self._samples, "batches": self._batches, "seconds": seconds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epochs = list(state_dict.get("epochs", []))  # none in a checkpoint of an earlier version
        self._samples, self._batches = state_dict.get("samples", 0), state_dict.get("batches", 0)
        self._carried = state_dict.get("seconds")


def _now(trainer: Trainer) -> float:
    if (device := trainer.strategy.root_device).type == "cuda":
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
