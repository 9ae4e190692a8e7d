"""``strategy: dp``: one process, the LightningModule's network forward split over the listed GPUs."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor, nn
from typing_extensions import override

from template.engine.errors import ConfigError
from template.engine.internals import eager_call, is_compiled_in_place, layer_sync_enabled, set_compiled_call
from template.engine.logs.console import Mechanism
from template.engine.strategies.devices import gpu_indices, selects

# Shipped with the project: the data-parallel run that needs no GPU.
CPU_ALTERNATIVE = "configs/ddp_cpu.yaml"


class ParallelForward(nn.DataParallel):
    """``nn.DataParallel`` whose replica threads run under the caller's autocast dtype, not only its on/off switch."""

    def parallel_apply(self, replicas, inputs, kwargs):  # noqa: ANN001, ANN201 - same signature as torch's
        # torch passes its replica threads only "autocast enabled": bf16-mixed would run as fp16 there.
        device_type = self.src_device_obj.type
        return super().parallel_apply([under_callers_autocast(r, device_type) for r in replicas], inputs, kwargs)

    def replicate(self, module, device_ids):  # noqa: ANN001, ANN201 - same signature as torch's
        return share_compiled_call(module, super().replicate(module, device_ids))

    def __getattr__(self, name: str) -> Any:
        # User code reaching into the network (`self.net.encoder`) keeps working while it is wrapped.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not set yet (a half-built copy): looking inside it would recurse
                raise
            return getattr(self.module, name)


@functools.cache
def _compiled_replica_call() -> Callable[..., Any]:
    # One compiled function for all replicas: dynamo takes a replica's weights as inputs, so the new replicas of
    # every step reuse the compiled code (one graph per device) instead of recompiling.
    return torch.compile(eager_call)


def share_compiled_call(module: nn.Module, replicas: Sequence[nn.Module]) -> Sequence[nn.Module]:
    """Replicas of a network compiled in place that run compiled code on their own weights, not on the original's (the
    compiled call a replica copies is bound to the original)."""
    if not is_compiled_in_place(module):
        return replicas
    for replica in replicas:
        set_compiled_call(replica, functools.partial(_compiled_replica_call(), replica))
    return replicas


def under_callers_autocast(module: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """``module`` as a callable that, in any thread, runs under the autocast state of the thread that wrapped it."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type)

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return module(*args, **kwargs)

    return run


class DataParallelStrategy(ParallelStrategy):
    """DataParallel in the Trainer: batch on the first listed GPU, ``module_name``'s forward replicated over all."""

    announcement = Mechanism(
        "dp", "swaps your module's network attribute for DataParallel during the run", "another trainer.strategy"
    )

    strategy_name = "dp"

    def __init__(self, module_name: str = "net", parallel_devices: list[torch.device] | None = None) -> None:
        # The accelerator, precision and checkpoint IO come from the Trainer's own arguments, as fsdp's do.
        super().__init__(parallel_devices=parallel_devices)
        self.module_name = module_name
        self.num_nodes = 1  # the Trainer sets its own before it calls set_world_ranks

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "the Trainer assigns the devices"
        return self.parallel_devices[0]

    # One process whatever a detected cluster environment (SLURM, torchrun) says about ranks.
    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def distributed_sampler_kwargs(self) -> None:
        return None  # every batch goes whole to this one process, which DataParallel splits

    def set_world_ranks(self) -> None:
        # Called once the Trainer has set the accelerator, devices, num_nodes and layer sync.
        devices = [device.index for device in self.parallel_devices or []]
        check_dp_settings(self.accelerator, devices, self.num_nodes, sync_batchnorm=layer_sync_enabled(self))

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        model = self.model
        assert model is not None
        net = dict(model.named_children()).get(self.module_name)
        if net is None:
            raise ConfigError(
                f"strategy dp parallelises the LightningModule's network `{self.module_name}`, but "
                f"{type(model).__name__} has no nn.Module child of that name; assign the network as "
                f"`self.{self.module_name}` or name it with the strategy's init_args.module_name"
            )
        wrapped = ParallelForward(
            net, device_ids=[d.index for d in self.parallel_devices], output_device=self.root_device
        )
        # Shadow the attribute, keep the registered child: `self.net(x)` runs the replicas while parameters(),
        # state_dict() keys, .to() and train()/eval() see the plain network (no `module.` prefix).
        object.__setattr__(model, self.module_name, wrapped)

    def process_dataloader(self, dataloader: object) -> object:
        batch_size = getattr(dataloader, "batch_size", None)
        devices = len(self.parallel_devices or [])
        if batch_size is not None and batch_size < devices:
            raise ConfigError(
                f"the batch size is {batch_size} but strategy dp splits every batch over {devices} GPUs; raise "
                f"data.batch_size to at least {devices} (a multiple of {devices} splits evenly) or list fewer devices"
            )
        return dataloader

    def reduce(self, tensor: Tensor | Any, *args: Any, **kwargs: Any) -> Tensor | Any:
        return tensor  # outputs are gathered before the loss: one value, nothing to reduce

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        return decision

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and isinstance(module.__dict__.get(self.module_name), ParallelForward):
            del module.__dict__[self.module_name]
        super().teardown()


def check_dp_trainer_config(trainer: Mapping[str, Any]) -> None:
    """Before the Trainer is built: if ``trainer`` selects dp (by name or instance), refuse what it cannot run."""
    if selects(trainer.get("strategy"), DataParallelStrategy):
        settings = (trainer.get("accelerator", "auto"), trainer.get("devices", "auto"), trainer.get("num_nodes", 1))
        check_dp_settings(*settings, sync_batchnorm=bool(trainer.get("sync_batchnorm")))


def check_dp_settings(
    accelerator: str | Accelerator | None, devices: Any, num_nodes: int, sync_batchnorm: bool = False
) -> None:
    """Raise ConfigError, naming the bad value and the fix, when dp cannot run with these Trainer settings."""
    if sync_batchnorm:
        raise ConfigError(
            "trainer.sync_batchnorm=true needs one process per GPU (strategy ddp); under strategy dp each GPU's "
            "BatchNorm sees its slice of the batch: set trainer.sync_batchnorm=false or use strategy ddp"
        )
    if num_nodes != 1:
        raise ConfigError(
            f"strategy dp runs in one process on one machine but trainer.num_nodes is {num_nodes}; "
            "set trainer.num_nodes=1, or use strategy ddp to train over several nodes"
        )
    if isinstance(accelerator, Accelerator):
        accelerator = "cuda" if isinstance(accelerator, CUDAAccelerator) else accelerator.name()
    if str(accelerator).lower() not in ("gpu", "cuda", "auto"):
        raise ConfigError(
            f"strategy dp splits batches over CUDA GPUs but trainer.accelerator is {accelerator!r}; set "
            f"trainer.accelerator=gpu, or train data-parallel on CPU processes with --config {CPU_ALTERNATIVE}"
        )
    visible = torch.cuda.device_count()
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible == 0:
        note = f", CUDA_VISIBLE_DEVICES={hidden!r}" if hidden is not None else ""
        raise ConfigError(
            f"strategy dp needs CUDA GPUs but this process sees none (torch.cuda.device_count() is 0{note}); "
            f"to train data-parallel on CPU use --config {CPU_ALTERNATIVE} (strategy ddp over CPU processes)"
        )
    missing = [index for index in gpu_indices(devices, visible) if not 0 <= index < visible]
    if missing:
        note = f" (CUDA_VISIBLE_DEVICES={hidden} renumbers them from 0)" if hidden else ""
        raise ConfigError(
            f"trainer.devices={devices} asks for GPU index {', '.join(map(str, missing))} but this process sees "
            f"{visible} GPU(s), indices {list(range(visible))}{note}; list only those"
        )
