"""A user's callback for tests that counts, on rank 0, the collectives and host reads of tensors in each training step.

Collectives: the calls of ``torch.distributed``'s functions (wrapped in both ``torch.distributed`` and its
``distributed_c10d`` module, so that a helper such as ``broadcast_object_list`` counts the collectives it runs).
DDP's gradient buckets (C++) are not seen; they are the same in any Trainer. Host reads: the operators that wait for
a device's result on the host (``.item()``, ``float(tensor)``, ``bool(tensor)``, and the operators of data-dependent
size that synchronise a GPU, such as ``torch.unique``), seen on any device through a dispatch mode (``.tolist()`` and
copies to the CPU are not seen there). On a CUDA device
the synchronisations themselves are counted too (``cuda sync``), from ``torch.cuda.set_sync_debug_mode("warn")``:
operators that synchronise inside (``torch.bincount``), copies from pageable host memory, the reads above.

Counts go into buckets: ``step <n>`` from a training batch's start to the next bucket's start (its backward, its
optimizer step, every callback's ``on_train_batch_end``), ``validation`` for a validation (with what follows it up to
the next bucket), ``epoch end`` from ``on_train_epoch_end``. Written as JSON to ``path`` at the end of training.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
    "all_to_all", "all_to_all_single", "monitored_barrier", "gather_object", "scatter_object_list",
)  # fmt: skip
# Operators that read a device's result on the host: on a GPU each waits for the work queued before it.
_SYNC = "called a synchronizing CUDA operation"
HOST_READS = ("_local_scalar_dense", "_unique2", "unique_dim", "unique_consecutive", "nonzero", "masked_select")


class HostReads(TorchDispatchMode):
    def __init__(self, count: Any) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.count(name)
        return func(*args, **(kwargs or {}))


class CollectiveCounter(Callback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self._bucket = "setup"
        self._steps = 0
        self._wrapped: list[tuple[Any, str, Any]] = []
        self._mode: HostReads | None = None

    def _count(self, name: str) -> None:
        self.counts[self._bucket][name] += 1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for name in COLLECTIVES:
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self._count(_name)
                return _original(*args, **kwargs)

            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    self._wrapped.append((module, name, original))
                    setattr(module, name, counted)
        self._mode = HostReads(lambda name: self._count("host:" + name))
        self._mode.__enter__()
        if trainer.strategy.root_device.type == "cuda":
            self._shown = warnings.showwarning
            warnings.showwarning = self._show
            warnings.filterwarnings("always", message=_SYNC)
            torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if _SYNC in str(message):
            self._count("cuda sync")
        else:
            self._shown(message, *args, **kwargs)

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._bucket = f"step {self._steps}"
        self._steps += 1

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._bucket = "validation"

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._bucket = "epoch end"

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._mode.__exit__(None, None, None)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._shown
        for module, name, original in self._wrapped:
            setattr(module, name, original)
        Path(self.path).write_text(json.dumps({bucket: dict(c) for bucket, c in self.counts.items()}, indent=1))
