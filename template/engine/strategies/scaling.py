"""One global batch size for every strategy, the learning rate scaled to it, and the run's summary line."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterable
from typing import Any, Literal

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from template.engine.errors import ConfigError
from template.engine.internals import child_schedulers, last_lr_attributes
from template.engine.logs.console import Mechanism

LRScaling = Literal["none", "linear", "sqrt"]
OPTION = "scaling.global_batch_size"

# Every learning rate a schedule keeps in the optimizer's param groups (OneCycleLR keeps max_lr and min_lr there).
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
# ...and on the scheduler itself (CyclicLR keeps max_lrs). Floors such as ReduceLROnPlateau's min_lrs stay absolute.
_SCHEDULER_LR_ATTRIBUTES = ("base_lrs", "max_lrs")


def per_process_batch_size(
    global_batch_size: int, world_size: int, accumulate_grad_batches: int, option: str = OPTION
) -> int:
    """The DataLoader batch of one process such that one optimizer step sees ``global_batch_size`` samples (the value
    of ``option``, which a refusal names)."""
    shares = world_size * accumulate_grad_batches
    if global_batch_size % shares:
        below = global_batch_size - global_batch_size % shares
        raise ConfigError(
            f"{option}={global_batch_size} does not split into {world_size} process(es) x "
            f"{accumulate_grad_batches} accumulation step(s) = {shares} equal parts; use a multiple of {shares}, "
            f"e.g. {below or shares} or {below + shares}"
        )
    return global_batch_size // shares


def lr_factor(rule: LRScaling, effective_batch_size: int, reference_batch_size: int | None) -> float:
    """How much the base learning rate is multiplied by for ``effective_batch_size`` under ``rule``."""
    if rule == "none" or reference_batch_size is None:
        return 1.0
    ratio = effective_batch_size / reference_batch_size
    return ratio if rule == "linear" else math.sqrt(ratio)


def scale_learning_rates(optimizers: Iterable[torch.optim.Optimizer], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply every learning rate held by the optimizers and their schedulers by ``factor``, in place."""
    for group in [group for optimizer in optimizers for group in optimizer.param_groups]:
        group.update({key: _times(group[key], factor) for key in _GROUP_LR_KEYS if key in group})
    pending = list(schedulers)
    while pending:
        scheduler = pending.pop()
        pending.extend(child_schedulers(scheduler))
        for attribute in (*_SCHEDULER_LR_ATTRIBUTES, *last_lr_attributes(scheduler)):
            if isinstance(values := getattr(scheduler, attribute, None), list):
                setattr(scheduler, attribute, [_times(v, factor) for v in values])


def _times(value: Any, factor: float) -> Any:
    # A tensor learning rate (capturable/fused optimizers) must stay the same tensor object.
    return value.mul_(factor) if isinstance(value, torch.Tensor) else value * factor


class BatchScaling(Callback):
    """States the batch once for every strategy, scales the learning rate to it, and records the run summary."""

    def __init__(
        self,
        global_batch_size: PositiveInt | None = None,
        lr_scaling: LRScaling = "none",
        reference_batch_size: PositiveInt | None = None,
        split_batch: bool = False,
    ) -> None:
        """
        Args:
            global_batch_size: samples per optimizer step, summed over all processes and accumulation steps. Each
                process then loads global / (world size x accumulate_grad_batches); under DataParallel (one
                process) the whole batch is loaded and split across the devices. None keeps ``data.batch_size``
                as the batch of each process (the per-device form under DDP).
            lr_scaling: multiply the optimizer's learning rate by effective / reference batch size (``linear``),
                by its square root (``sqrt``), or leave it (``none``).
            reference_batch_size: the batch size the configured learning rate was tuned for.
            split_batch: with global_batch_size unset, ``data.batch_size`` stays the batch of one optimizer step as on
                one device: each process loads its share (batch_size / world size). What the parallelism files
                (configs/ddp*.yaml, configs/fsdp*.yaml) set, so that stacking one keeps a config's batch. Without a
                batch size to split (one written in the DataLoader), each process loads that batch.
        """
        super().__init__()
        if lr_scaling != "none" and reference_batch_size is None:
            raise ConfigError(
                f"scaling.lr_scaling={lr_scaling} needs scaling.reference_batch_size, the batch size the learning "
                "rate was tuned for; set it, e.g. --scaling.reference_batch_size=64"
            )
        # Plain numbers: hparams.yaml and a weights-only checkpoint cannot hold the parser's PositiveInt.
        self.global_batch_size = None if global_batch_size is None else int(global_batch_size)
        self.lr_scaling = lr_scaling
        self.reference_batch_size = None if reference_batch_size is None else int(reference_batch_size)
        self.split_batch = split_batch
        self.step_batch: int | None = None  # split_batch: data.batch_size as configured, before it was split
        self.summary: dict[str, Any] = {}
        # The factor already inside the optimizer's learning rates: 1 for a fresh run, the checkpoint's on resume.
        self.applied_lr_factor = 1.0

    @property
    def announcement(self) -> Mechanism | None:
        if self.global_batch_size is None and self.lr_scaling == "none" and not self.split_batch:
            return None
        return Mechanism(
            "batch scaling",
            "sets each process's data.batch_size from the batch of one optimizer step; scales the learning rate",
            "--scaling.global_batch_size=null --scaling.split_batch=false --scaling.lr_scaling=none",
        )

    def apply_batch_size(self, trainer: Trainer, datamodule: Any, module: Any = None) -> int | None:
        """Set every holder of the batch size to the per-process batch of the global one, and return it (idempotent).
        The command line calls it before the module is attached (``module`` None; ``setup`` calls it again), so the
        DataModule sees its batch from its first hook."""
        holders = batch_size_holders(module, datamodule)
        names = _names(datamodule, module)
        current = holders[-1][1].batch_size if holders else None
        if self.global_batch_size is None and not (self.split_batch and isinstance(current, int)):
            # Per process: data.batch_size, or the DataLoader's own where nothing holds a batch size to split.
            if self.lr_scaling != "none" and not isinstance(current, int) and (holders or module is not None):
                raise ConfigError(
                    f"scaling.lr_scaling={self.lr_scaling} needs the batch size, but {names} has no integer "
                    "`batch_size` (attribute or hparams); set scaling.global_batch_size"
                )
            return current
        if not isinstance(current, int):
            if module is None and trainer.lightning_module is None:
                return None  # the module may hold it: decided in setup, once it is attached
            raise ConfigError(
                f"{OPTION} needs a `batch_size` that the dataloaders use, an attribute or hparams entry of the "
                f"DataModule or the LightningModule (where Lightning's batch-size finder looks); {names} has none: "
                f"add one or set {OPTION}=null"
            )
        batch = self._per_process(trainer, holders[-1][0], current)
        for _, holder in holders:
            holder.batch_size = batch
        return batch

    def _per_process(self, trainer: Trainer, owner: Any, current: int) -> int:
        """The batch of one process: its share of ``data.batch_size`` as configured (``split_batch``), or of the
        global batch, beside which a batch size other than the constructor's default (``owner``'s) is refused."""
        if self.global_batch_size is None:
            self.step_batch = self.step_batch or current  # as configured, when called again
            return per_process_batch_size(self.step_batch, trainer.world_size, 1, "data.batch_size")
        batch = per_process_batch_size(self.global_batch_size, trainer.world_size, trainer.accumulate_grad_batches)
        # A data.batch_size other than the constructor's default was set on purpose: it would be silently replaced.
        default = getattr(inspect.signature(type(owner)).parameters.get("batch_size"), "default", None)
        if default not in (None, inspect.Parameter.empty) and current not in (batch, default):
            raise ConfigError(
                f"data.batch_size={current} and {OPTION}={self.global_batch_size} both set the batch (the global one "
                f"gives {batch} per process); keep one of them"
            )
        return batch

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.apply_batch_size(trainer, trainer.datamodule, pl_module)  # also for a Trainer built without the CLI
        # Fresh optimizers hold the base LR; a checkpoint restored later brings its own factor (load_state_dict).
        self.applied_lr_factor = 1.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The configured rates, as the run summary states them: a checkpoint restored next brings the schedule's.
        groups = [optimizer.param_groups[0] for optimizer in trainer.optimizers]
        self.configured_lrs = [float(group.get("initial_lr", group["lr"])) for group in groups]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning restored the optimizer from a checkpoint: rescaling relative to the factor it holds applies
        # the rule once, however often the run resumes.
        holders = batch_size_holders(pl_module, trainer.datamodule)
        per_process = holders[-1][1].batch_size if holders else None
        if not isinstance(per_process, int):
            per_process = loader_batch_size(trainer.train_dataloader)
        shares = trainer.world_size * trainer.accumulate_grad_batches
        effective = per_process * shares if isinstance(per_process, int) else None
        factor = lr_factor(self.lr_scaling, effective, self.reference_batch_size) if effective else 1.0
        if factor != self.applied_lr_factor:
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            scale_learning_rates(trainer.optimizers, schedulers, factor / self.applied_lr_factor)
            self.applied_lr_factor = factor
        self.summary = run_summary(trainer, per_process, effective, self)
        bar = trainer.progress_bar_callback
        if bar is not None and bar.is_enabled:
            if trainer.is_global_zero:
                bar.print(format_summary(self.summary))  # the bar clears its line first; a print would continue it
        else:
            rank_zero_info(format_summary(self.summary))
        for logger in trainer.loggers:
            logger.log_hyperparams({"run": self.summary})
            logger.save()

    def state_dict(self) -> dict[str, Any]:
        return {"lr_factor": self.applied_lr_factor, "summary": self.summary}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied_lr_factor = float(state_dict.get("lr_factor", 1.0))


def batch_size_holders(module: Any, datamodule: Any) -> list[tuple[Any, Any]]:
    """(owner, holder) pairs where Lightning's ``lightning_setattr`` looks for the batch size: the module, its hparams,
    the DataModule, its hparams (Lightning's needs the module attached). The last is read, all are set."""
    return [
        (owner, holder)
        for owner in (module, datamodule)
        for holder in (owner, getattr(owner, "hparams", None))
        if hasattr(holder, "batch_size")
    ]


def _names(*objects: Any) -> str:
    """The classes of the batch size's possible owners, for a message."""
    return " or ".join(type(o).__name__ for o in objects if o is not None) or "the run"


def loader_batch_size(loaders: Any) -> int | None:
    """The batch size of the first training DataLoader: its ``batch_size``, or its batch sampler's."""
    found: list[DataLoader] = []
    apply_to_collection(loaders, DataLoader, found.append)
    sizes = [loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) for loader in found]
    return next((size for size in sizes if isinstance(size, int)), None)


def run_summary(trainer: Trainer, per_process: int | None, effective: int | None, scaling: BatchScaling) -> dict:
    """What this run really does, in plain types so it fits in a checkpoint and in hparams.yaml."""
    devices_per_process = max(1, trainer.num_devices * trainer.num_nodes // trainer.world_size)
    per_device: int | float | None = None
    if per_process is not None:
        # DataParallel splits each process's batch across its devices; elsewhere a process has one device.
        per_device = per_process / devices_per_process
        per_device = int(per_device) if per_device.is_integer() else round(per_device, 2)
    rates = [rate * scaling.applied_lr_factor for rate in scaling.configured_lrs]
    seed = os.environ.get("PL_GLOBAL_SEED")
    strategy = trainer.strategy
    cluster = getattr(strategy, "cluster_environment", None)
    return {
        "strategy": getattr(strategy, "strategy_name", None)
        or type(strategy).__name__.removesuffix("Strategy").lower(),
        "accelerator": type(trainer.accelerator).__name__.removesuffix("Accelerator").lower(),
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "world_size": trainer.world_size,
        "cluster_environment": type(cluster).__name__ if cluster is not None else None,
        "batch_per_device": per_device,
        "batch_per_process": per_process,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "effective_batch_size": effective,
        "global_batch_size": scaling.global_batch_size,
        "lr_scaling": scaling.lr_scaling,
        "reference_batch_size": scaling.reference_batch_size,
        "lr_factor": scaling.applied_lr_factor,
        "lr": rates[0] if len(rates) == 1 else rates,
        "precision": str(trainer.precision),
        "seed": int(seed) if seed is not None else None,
    }


def format_summary(summary: dict) -> str:
    """The summary as one log line."""
    s = summary
    batch = (
        f"batch {s['batch_per_process']}/process ({s['batch_per_device']}/device) x {s['world_size']} process(es) "
        f"x {s['accumulate_grad_batches']} accumulation = {s['effective_batch_size']} per optimizer step"
    )
    rates = ", ".join(f"{rate:.6g}" for rate in (s["lr"] if isinstance(s["lr"], list) else [s["lr"]]))
    lr = f"lr {rates}" + (f" ({s['lr_scaling']} scaling x{s['lr_factor']:.4g})" if s["lr_scaling"] != "none" else "")
    return (
        f"Run: strategy {s['strategy']} on {s['accelerator']}, {s['num_nodes']} node(s) x {s['devices_per_node']} "
        f"device(s), world size {s['world_size']}{f' ({env})' if (env := s['cluster_environment']) else ''}; "
        f"{batch}; {lr}; precision {s['precision']}; seed {s['seed']}"
    )
