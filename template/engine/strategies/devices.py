"""``trainer.devices`` and ``trainer.strategy``: the one reading of their values; ``free:N`` (the N visible GPUs with
the most free memory, read through NVML: torch would put a CUDA context on every GPU it asks, busy ones too), the
devices a process trains on, and the float32 matmul precision; each process-wide setting undone when the command ends
(``settings_restored``)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info

from template.engine.errors import ConfigError

# Rank 0's choice, "<request>-><indices>", for the DDP processes Lightning starts with rank 0's environment.
HANDOFF_VARIABLE = "FREE_GPUS_CHOSEN"
_GIB = 1024**3
_SYNTAX = "free:N or free:N,min=MGiB (e.g. free:2 or free:2,min=8GiB)"
_REQUEST = re.compile(r"free:\s*(\d+)\s*(?:,\s*min\s*=\s*(\d+\.?\d*|\.\d+)\s*(?:g(?:i?b)?)?\s*)?", re.IGNORECASE)


@dataclass(frozen=True)
class FreeRequest:
    """A parsed ``free:N[,min=MGiB]`` value."""

    text: str
    count: int
    min_free_gib: float = 0.0


def selects(strategy: Any, cls: type[Strategy]) -> bool:
    """Whether a ``trainer.strategy`` value (its registry name, an instance or a ``class_path`` config) selects
    ``cls``, a strategy with a ``strategy_name``: the one reading of that option's values."""
    if isinstance(strategy, str):
        return strategy.strip().lower() == cls.strategy_name
    class_path = strategy.get("class_path") if isinstance(strategy, Mapping) else getattr(strategy, "class_path", None)
    if isinstance(class_path, str):
        return class_path.rpartition(".")[2] == cls.__name__
    return isinstance(strategy, cls)


def gpu_indices(devices: Any, visible: int) -> list[int]:
    """The GPU indices a ``trainer.devices`` value asks for, read as Lightning reads it: N (or "N") the first N, a
    list (or "0,2") those, -1 and "auto" all ``visible`` ones. A ``free:N`` request is resolved to a list first."""
    if _every_gpu(devices):
        return list(range(visible))
    try:
        if isinstance(devices, str):
            text = devices.strip()
            devices = [int(part) for part in text.split(",") if part.strip()] if "," in text else int(text)
        return list(range(devices)) if isinstance(devices, int) else [int(index) for index in devices]
    except (TypeError, ValueError):
        raise ConfigError(
            f"trainer.devices={devices!r} is not a number of devices, a list of GPU indices, -1, auto or free:N; "
            "e.g. devices: 2 or devices: [0, 1]"
        ) from None


def gpu_count(devices: Any) -> int | None:
    """How many GPUs a ``trainer.devices`` value asks for (``free:N`` included); None for all visible (-1, auto)."""
    if (request := parse_free_request(devices)) is not None:
        return request.count
    return None if _every_gpu(devices) else len(gpu_indices(devices, 0))


def _every_gpu(devices: Any) -> bool:
    return devices in (None, -1) or (isinstance(devices, str) and devices.strip().lower() in ("auto", "-1"))


def parse_free_request(devices: Any) -> FreeRequest | None:
    """The request in a ``trainer.devices`` value; None for the values Lightning reads itself (2, [0, 1], "auto")."""
    if not isinstance(devices, str) or not devices.strip().lower().startswith("free:"):
        return None
    text = devices.strip()
    match = _REQUEST.fullmatch(text)
    if match is None or int(match[1]) < 1:
        raise ConfigError(
            f"trainer.devices={text!r} is not a free-GPU request; write {_SYNTAX}: N >= 1 GPUs, each with at "
            "least M GiB free"
        )
    return FreeRequest(text, int(match[1]), float(match[2] or 0))


def resolve_free_devices(trainer: MutableMapping[str, Any]) -> None:
    """Replace ``trainer["devices"]`` = ``free:N[,min=M]`` in place by the GPU indices rank 0 picks, which it hands
    down in ``FREE_GPUS_CHOSEN`` to the ranks Lightning's DDP launcher starts: all train on the same GPUs."""
    if (request := parse_free_request(trainer.get("devices"))) is None:
        return
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    if accelerator not in ("auto", "gpu", "cuda"):
        raise ConfigError(
            f"trainer.devices={request.text!r} picks CUDA GPUs but trainer.accelerator is {accelerator!r}; set "
            "trainer.accelerator=gpu (or auto), or give CPU devices as a number of processes (devices: 2)"
        )
    _refuse_under_external_launcher(request)
    chosen = _handed_down_choice(request)
    if chosen is None:
        chosen, message = pick_free_gpus(request)
        rank_zero_info(message)
        os.environ[HANDOFF_VARIABLE] = f"{request.text}->{','.join(map(str, chosen))}"
    if accelerator == "auto":
        trainer["accelerator"] = "gpu"  # "auto" could fall back to another accelerator than the GPUs picked
    trainer["devices"] = chosen


def _handed_down_choice(request: FreeRequest) -> list[int] | None:
    """The list rank 0 picked, in a process Lightning's DDP launcher started (LOCAL_RANK >= 1); None in rank 0 (which
    overwrites a value an earlier run left in the shell)."""
    local_rank = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    if local_rank == "0":
        return None
    value = os.environ.get(HANDOFF_VARIABLE, "")
    decided_for, _, indices = value.rpartition("->")
    if decided_for != request.text or not re.fullmatch(r"\d+(,\d+)*", indices):
        raise ConfigError(
            f"trainer.devices={request.text!r}: this process is local rank {local_rank} but has no choice handed "
            f"down from rank 0 ({HANDOFF_VARIABLE}={value!r}); start one process and let Lightning launch the "
            "others, or list the GPUs explicitly (devices: [0, 1])"
        )
    return [int(index) for index in indices.split(",")]


def _refuse_under_external_launcher(request: FreeRequest) -> None:
    """Refuse when a launcher started several processes on this node; one per node (torchrun --nproc_per_node=1)
    picks among its node's GPUs. A launcher that does not state its processes per node counts as several."""
    from lightning.fabric.plugins.environments import LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment

    per_node = {
        TorchElasticEnvironment: "LOCAL_WORLD_SIZE",
        SLURMEnvironment: "SLURM_NTASKS_PER_NODE",
        LSFEnvironment: "JSM_NAMESPACE_LOCAL_SIZE",
    }
    for environment, variable in per_node.items():
        if environment.detect() and os.environ.get(variable, "").strip() not in ("0", "1"):
            raise ConfigError(
                f"trainer.devices={request.text!r} is decided by one process and handed to the DDP processes "
                f"Lightning starts, but {environment.__name__.replace('Environment', '')} started this process as "
                "one of several on this node, each of which would pick on its own; list the GPUs explicitly "
                "(devices: [0, 1], or let the scheduler set CUDA_VISIBLE_DEVICES), or start one process and let "
                "Lightning launch ddp"
            )


def pick_free_gpus(request: FreeRequest) -> tuple[list[int], str]:
    """The visible indices of the ``request.count`` GPUs with the most free memory, and a one-line report of why."""
    gpus = read_visible_gpus(request)
    qualifying = [i for i, (free, _) in enumerate(gpus) if free >= request.min_free_gib * _GIB]
    # Most free first: under dp the first device is the root that gathers outputs and holds the optimizer state.
    qualifying.sort(key=lambda i: -gpus[i][0])
    floor = f" with at least {request.min_free_gib:g} GiB free" if request.min_free_gib else ""
    listing = "; ".join(
        f"GPU {i}: {free / _GIB:.1f} of {total / _GIB:.1f} GiB free" for i, (free, total) in enumerate(gpus)
    )
    if len(qualifying) < request.count:
        raise ConfigError(
            f"trainer.devices={request.text!r} needs {request.count} GPU(s){floor} but {len(qualifying)} of the "
            f"{len(gpus)} visible qualify ({listing}); ask for fewer, lower min, wait for memory to free up, or list "
            "the devices explicitly"
        )
    chosen = qualifying[: request.count]
    return chosen, (
        f"trainer.devices={request.text!r}: training on GPU(s) {chosen}, the {request.count} with the most free "
        f"memory{floor} of {len(gpus)} visible ({listing})"
    )


def read_visible_gpus(request: FreeRequest) -> list[tuple[int, int]]:
    """Free and total bytes of every GPU this process can see, by CUDA's index here, read through NVML."""
    try:
        import pynvml
    except ImportError:
        raise ConfigError(
            f"trainer.devices={request.text!r} reads each GPU's free memory through NVML, which is not installed; "
            "pip install nvidia-ml-py (this project's gpu extra: pip install -e '.[gpu]'), or list the devices "
            "explicitly"
        ) from None
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise ConfigError(_no_gpu(request, hidden, f"NVML cannot start: {err}")) from None
    try:
        handles = _visible_handles(pynvml, hidden)
        if not handles:
            raise ConfigError(_no_gpu(request, hidden, "NVML lists no GPU" if hidden is None else "none visible"))
        _number_gpus_in_pci_order(request, [_text(pynvml.nvmlDeviceGetName(handle)) for handle in handles])
        return [(int(m.free), int(m.total)) for m in map(pynvml.nvmlDeviceGetMemoryInfo, handles)]
    except pynvml.NVMLError as err:  # e.g. a GPU NVML may not query from inside a container
        raise ConfigError(
            f"trainer.devices={request.text!r} cannot read the GPUs' free memory (NVML: {err}); list the devices "
            "explicitly (devices: [0, 1])"
        ) from None
    finally:
        pynvml.nvmlShutdown()


def _no_gpu(request: FreeRequest, hidden: str | None, reason: str) -> str:
    note = f", CUDA_VISIBLE_DEVICES={hidden!r}" if hidden is not None else ""
    return (
        f"trainer.devices={request.text!r} picks among CUDA GPUs but this process sees none ({reason}{note}); "
        "train on the CPU with devices: N processes (e.g. --config configs/ddp_cpu.yaml) or run where GPUs are"
    )


def _number_gpus_in_pci_order(request: FreeRequest, models: list[str]) -> None:
    """Make CUDA number the GPUs in PCI bus order, as they are read here, before CUDA starts (the DDP processes
    inherit it): CUDA's default puts the fastest model first, another card than the one picked on mixed machines."""
    if "CUDA_DEVICE_ORDER" not in os.environ and not torch.cuda.is_initialized():
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST (CUDA started before the pick)")
    if order.strip().upper() != "PCI_BUS_ID" and len(set(models)) > 1:
        raise ConfigError(
            f"trainer.devices={request.text!r} reads the GPUs in PCI bus order, but CUDA_DEVICE_ORDER={order} numbers "
            f"these mixed models ({', '.join(sorted(set(models)))}) in another order, so the GPUs picked would not be "
            "those trained on; unset CUDA_DEVICE_ORDER (or set it to PCI_BUS_ID), or list the devices explicitly"
        )


def _visible_handles(pynvml: Any, hidden: str | None) -> list[Any]:
    """NVML handles of the GPUs CUDA numbers 0, 1, ... here, in PCI bus order: those CUDA_VISIBLE_DEVICES lists, in
    its order, by index or UUID (prefix), up to the first entry CUDA cannot use, as CUDA reads it."""
    count = pynvml.nvmlDeviceGetCount()
    physical = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    # NVML promises no order of its own: CUDA's PCI_BUS_ID order is that of the bus ids.
    physical.sort(key=lambda handle: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId).upper())
    if hidden is None:
        return physical
    uuids = [_text(pynvml.nvmlDeviceGetUUID(handle)).upper() for handle in physical]
    visible: list[Any] = []
    for entry in (part.strip().upper() for part in hidden.split(",")):
        if entry.startswith("MIG-"):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={hidden!r} names a MIG instance, whose free memory NVML reports per "
                "instance and not by this name; list the devices explicitly instead of free:N"
            )
        if re.fullmatch(r"[+-]?\d+", entry):
            positions = [int(entry)] if 0 <= int(entry) < count else []
        else:
            positions = [i for i, uuid in enumerate(uuids) if entry.startswith("GPU-") and uuid.startswith(entry)]
        if len(positions) != 1 or physical[positions[0]] in visible:
            break  # CUDA ignores this entry and all after it (a GPU listed twice too)
        visible.append(physical[positions[0]])
    return visible


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older NVML bindings return bytes


@contextlib.contextmanager
def settings_restored() -> Iterator[None]:
    """The process-wide settings a command makes for its run, as they were once it ends: the environment variables its
    DDP processes inherit (a CPU run's ``CUDA_VISIBLE_DEVICES=""``, ``free:N``'s choice and CUDA's device order) and
    torch's float32 matmul precision. A second command in the process (a notebook, a test) sees the GPUs again."""
    environment = {
        name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", HANDOFF_VARIABLE, "CUDA_DEVICE_ORDER")
    }
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def hide_gpus_from_cpu_run(trainer: Mapping[str, Any]) -> None:
    """Hide the GPUs from a CPU run and the DDP processes it starts, before CUDA starts: Lightning reads and sets
    every visible GPU's random state around its sanity check, putting a CUDA context on each (busy ones too)."""
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, CPUAccelerator) or str(accelerator).strip().lower() == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def process_devices(strategy: Strategy) -> list[torch.device]:
    """The devices this process trains on: its root device, or all where one process drives several (dp). What
    touches a GPU (random states, provenance) asks this, not CUDA's current device, so a CPU run creates no context."""
    several = strategy.world_size == 1 and getattr(strategy, "parallel_devices", None)
    return list(several or [strategy.root_device])


def add_gpu_arguments(parser: LightningArgumentParser) -> None:
    """Add the top-level ``float32_matmul_precision`` option."""
    parser.add_argument(
        "--float32_matmul_precision",
        type=Literal["auto", "highest", "high", "medium"],
        default="auto",
        help=(
            "torch.set_float32_matmul_precision: 'high' lets float32 matmuls use TF32 tensor cores (faster, 10-bit "
            "mantissa), 'highest' keeps full float32. auto = 'high' on CUDA, torch's default elsewhere."
        ),
    )


def apply_matmul_precision(value: str | None, trainer: Trainer) -> None:
    """Set torch's float32 matmul precision for this run; ``auto`` changes it only when training on CUDA."""
    if value in (None, "auto"):
        if not isinstance(trainer.accelerator, CUDAAccelerator):
            return  # CPU results stay as they were (newer torch routes this setting to oneDNN too)
        value = "high"
    torch.set_float32_matmul_precision(value)
