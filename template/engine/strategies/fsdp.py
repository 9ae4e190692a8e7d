"""``strategy: fsdp``: FSDP2 (torch's ``fully_shard``) through Lightning's ``ModelParallelStrategy``, on CPUs as on
GPUs; it shards parameters in place, so names, ``state_dict`` keys and exports stay those of the plain network."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from template.engine.errors import ConfigError, disk_errors
from template.engine.internals import (
    SHARDED_METADATA,
    checkpoint_wrapper,
    materialize_meta_module,
    optimizers_to_device,
    set_data_parallel_size,
)
from template.engine.logs.console import Mechanism
from template.engine.store import atomic_torch_save, replace_directory
from template.engine.strategies.devices import selects

# The precisions ModelParallelStrategy takes; bf16-mixed here also gathers bf16 parameters and reduces in float32.
_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) over all processes: each holds 1/N of the parameters, gradients and
    optimizer states. A module that does not shard itself in ``configure_model`` (``fully_shard`` on
    ``self.device_mesh["data_parallel"]``) gets each unit of ``shard_layers`` sharded, then the whole module.
    Checkpoints are folders of one shard per process, put in place whole.

    Args:
        shard_layers: class names (``TransformerBlock``) or import paths of the modules that become one unit each;
            default: each child module with parameters of the first module, from the LightningModule down, that has
            more than one (the example's ``net.layers.1``, ``net.layers.4``, ...).
        checkpoint_layers: class names or import paths of modules whose activations are recomputed in the backward
            pass (activation checkpointing): less memory, one more forward.
        reshard_after_forward: free a unit's gathered parameters after its forward (less memory, one more gather in
            the backward pass); false keeps them until the backward pass (ZeRO-2).
    """

    announcement = Mechanism(
        "fsdp",
        "FSDP2: a module that does not shard itself in configure_model gets its layers (or strategy.shard_layers) "
        "sharded, then the whole module; checkpoints are folders of shards",
        "shard in your LightningModule.configure_model, or another trainer.strategy",
    )

    strategy_name = "fsdp"

    def __init__(
        self,
        shard_layers: list[str] | None = None,
        checkpoint_layers: list[str] | None = None,
        reshard_after_forward: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.shard_layers = list(shard_layers) if shard_layers else None
        self.checkpoint_layers = list(checkpoint_layers) if checkpoint_layers else []
        self.reshard_after_forward = reshard_after_forward

    @override
    def setup_environment(self) -> None:
        # Every process is one data-parallel shard (ModelParallelStrategy's "auto" would make it one per node).
        set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        # ModelParallelStrategy.setup, less its demand that the module shard itself in configure_model.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not is_sharded(self.model):
            bf16 = self.precision_plugin.precision == "bf16-mixed"
            mesh = self.device_mesh["data_parallel"]
            units = shard(self.model, mesh, self.shard_layers, self.checkpoint_layers, self.reshard_after_forward, bf16)
            rank_zero_info(
                f"fsdp: sharded {', '.join(units)}, then the whole module, over {self.world_size} processes "
                "(other units: trainer.strategy's shard_layers)"
            )
        materialize_meta_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def check_module(self, module: nn.Module) -> None:
        """Before processes start, refuse layer names that name nothing in ``module`` and parameters not yet created
        (lazy layers), which cannot be sharded."""
        lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise ConfigError(
                f"{type(module).__name__}'s parameter {lazy[0]} is not created yet (a lazy layer), and strategy fsdp "
                "shards parameters before the first forward; give the layer its input size (nn.Linear instead of "
                "nn.LazyLinear), or use strategy ddp"
            )
        if self.shard_layers is not None:
            _matching(module, self.shard_layers, "shard_layers")
        _matching(module, self.checkpoint_layers, "checkpoint_layers")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Each process writes its shard into a folder beside ``filepath``, which rank zero renames into place once all
        have written: a checkpoint under its name is always whole."""
        if storage_options is not None:
            raise TypeError("strategy fsdp writes sharded checkpoints itself: storage_options is not supported")
        from torch.distributed.checkpoint import FileSystemWriter, save

        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(f".{path.name}.partial")
        with disk_errors(path, kept="any previous checkpoint there is intact"):
            if self.is_global_zero:
                for leftover in (partial, partial.with_name(partial.name + ".old")):  # a killed writer's
                    shutil.rmtree(leftover, ignore_errors=True)
                partial.mkdir(parents=True)
            self.barrier()
            shards = {"state_dict": checkpoint.pop("state_dict")}
            shards |= {f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))}
            save(shards, storage_writer=FileSystemWriter(partial, sync_files=True))
            if self.is_global_zero:
                atomic_torch_save(checkpoint, partial / SHARDED_METADATA)
            self.barrier()
            if self.is_global_zero:
                replace_directory(partial, path)
            self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # A checkpoint is data, never code to run (as AtomicCheckpointIO loads single files).
        return super().load_checkpoint(checkpoint_path, weights_only=True)


def is_fsdp(strategy: Any) -> bool:
    """Whether a ``trainer.strategy`` value (name, instance or ``class_path`` config) selects this strategy."""
    return selects(strategy, FSDP2Strategy)


def check_fsdp_trainer_config(trainer: Mapping[str, Any]) -> None:
    """Before the Trainer is built: if ``trainer`` selects fsdp, raise ConfigError for a precision it refuses."""
    precision = str(trainer.get("precision") or "32-true")
    if not is_fsdp(trainer.get("strategy")) or precision in _PRECISIONS:
        return
    why = (
        "fp16 mixed precision needs a gradient scaler that agrees across shards, which FSDP2 does not have"
        if precision.startswith("16")
        else "Lightning's ModelParallelStrategy does not run it"
    )
    raise ConfigError(
        f"trainer.precision={precision} is not supported with strategy fsdp ({why}); set --trainer.precision to one "
        f"of {', '.join(_PRECISIONS)} (bf16-mixed on GPUs)"
    )


def check_ema(ema_decay: float | None, strategy: Any) -> None:
    """Refuse ``ema`` under fsdp: the average would be whole in every process (the memory sharding saves)."""
    if ema_decay is not None and is_fsdp(strategy):
        raise ConfigError(
            f"ema.decay={ema_decay} is not supported with strategy fsdp (the average would be a whole copy of the "
            "weights in every process); set --ema.decay=null, or use strategy ddp"
        )


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds sharded (DTensor) parameters, e.g. sharded by its own ``configure_model``."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def shard(
    module: nn.Module,
    mesh: Any,
    shard_layers: list[str] | None,
    checkpoint_layers: list[str],
    reshard_after_forward: bool,
    bf16: bool,
) -> list[str]:
    """Shard ``module`` in place: each unit, then the root; returns the units' names (for the run's first lines)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = [name for name, _ in _units(module, shard_layers)]
    for name, child in _matching(module, checkpoint_layers, "checkpoint_layers"):
        parent_name, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent_name), attribute, checkpoint_wrapper(child))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy}
    for name in units:  # looked up after the wrapping: a checkpointed unit is sharded with its wrapper
        fully_shard(module.get_submodule(name), **options)
    fully_shard(module, **options)
    return units or ["no sub-module"]


def _units(module: nn.Module, shard_layers: list[str] | None) -> list[tuple[str, nn.Module]]:
    """The modules sharded one by one: those of ``shard_layers``, else each child module with parameters of the first
    module down from the root that has several (``net`` alone would be one unit, gathered whole in every forward)."""
    if shard_layers is not None:
        return _matching(module, shard_layers, "shard_layers")
    prefix, parent = "", module
    while True:
        children = [(f"{prefix}{n}", c) for n, c in parent.named_children() if _has_parameters(c)]
        if len(children) != 1 or next(children[0][1].children(), None) is None:
            return children
        prefix, parent = f"{children[0][0]}.", children[0][1]


def _matching(module: nn.Module, names: list[str], option: str) -> list[tuple[str, nn.Module]]:
    """The outermost sub-modules whose class is named (``Linear``) or imported (``torch.nn.Linear``) in ``names``."""
    if not names:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        cls = type(child)
        if cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names:
            found.append((name, child))
    if not found:
        classes = sorted({type(m).__name__ for n, m in module.named_modules() if n and _has_parameters(m)})
        raise ConfigError(
            f"trainer.strategy.{option}={names} names no sub-module of {type(module).__name__}; name classes it "
            f"has, e.g. {classes[:6]}"
        )
    return found


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
