"""Portable weights: export the bare network's ``state_dict`` and load weights saved by any common wrapper.

``python -m template export CKPT [--output FILE]`` writes the plain ``state_dict`` of the network inside a
Lightning checkpoint; ``load_weights`` loads that, a Lightning checkpoint, or a plain-PyTorch checkpoint saved from
``DataParallel``/``DistributedDataParallel`` (``module.``) or ``torch.compile`` (``_orig_mod.``) into a bare module.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from template.engine import checkpoints
from template.engine.atomic import atomic_torch_save
from template.engine.errors import ConfigError, disk_errors

# Where the Classifier keeps its network: Lightning saves its weights as "net.<name>".
DEFAULT_PREFIX = "net."
_WRAPPER_PREFIX = "module."  # DataParallel and DistributedDataParallel
_COMPILED_SEGMENT = "_orig_mod."  # torch.compile, at the top or around a compiled submodule
_NESTED_KEYS = ("state_dict", "model_state_dict", "model")


def extract_state_dict(checkpoint: Any, prefix: str = DEFAULT_PREFIX, source: str = "the file") -> dict[str, Tensor]:
    """The bare network's weights inside ``checkpoint``, whichever way it was saved."""
    if isinstance(checkpoint, Mapping) and "pytorch-lightning_version" in checkpoint:
        # A Lightning checkpoint holds the whole LightningModule; keep the network's part.
        state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
        if not state:
            found = sorted({k.split(".")[0] for k in checkpoint["state_dict"]})
            raise ConfigError(f"no weights under prefix '{prefix}' in {source} (it has {found}); pass --prefix")
    else:
        state = checkpoint
        for key in _NESTED_KEYS:
            if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
                state = state[key]
                break
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(f"{source} does not hold a state_dict (a mapping of names to tensors); pass a checkpoint")
    return {clean_key(k): v for k, v in state.items()}


def clean_key(key: str) -> str:
    """Drop the names that DataParallel, DistributedDataParallel and torch.compile add around a module's weights."""
    while key.startswith(_WRAPPER_PREFIX) or key.startswith(_COMPILED_SEGMENT):
        key = key.removeprefix(_WRAPPER_PREFIX).removeprefix(_COMPILED_SEGMENT)
    return key.replace(f".{_COMPILED_SEGMENT}", ".")


def load_weights(
    module: nn.Module,
    path: str | os.PathLike,
    map_location: Any = "cpu",
    prefix: str = DEFAULT_PREFIX,
    strict: bool = True,
) -> nn.Module:
    """Load weights from ``path`` (exported, Lightning, DP/DDP or compiled checkpoint) into the bare ``module``."""
    state = extract_state_dict(checkpoints.load(path, map_location), prefix, source=f"'{path}'")
    module.load_state_dict(state, strict=strict)
    return module


def export(checkpoint_path: str | os.PathLike, output: str | os.PathLike, prefix: str = DEFAULT_PREFIX) -> Path:
    """Write the plain network ``state_dict`` of ``checkpoint_path`` to ``output`` (atomically); returns ``output``."""
    output = Path(output)
    state = extract_state_dict(checkpoints.load(checkpoint_path), prefix, source=f"'{checkpoint_path}'")
    if output.resolve() == Path(checkpoint_path).resolve():
        raise ConfigError(f"--output '{output}' is the checkpoint itself; choose another file name")
    # atomic: nothing is left at --output (the temporary is removed, a previous file untouched).
    with disk_errors(output, kept="nothing was written at --output", option="--output"):
        output.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, output)
    return output


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m template export CKPT [--output FILE] [--prefix net.]``."""
    parser = argparse.ArgumentParser(
        prog="python -m template export",
        description="Write the bare network's state_dict from a checkpoint (it loads with weights_only=True).",
    )
    parser.add_argument("ckpt_path", help="a Lightning checkpoint (or a DP/DDP/compiled plain-PyTorch one)")
    parser.add_argument("--output", help="where to write the state_dict (default: CKPT with suffix .pt)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="attribute of the LightningModule holding the net")
    args = parser.parse_args(argv)
    output = Path(args.output) if args.output else Path(args.ckpt_path).with_suffix(".pt")
    written = export(args.ckpt_path, output, args.prefix)
    print(f"Wrote {written}: net.load_state_dict(torch.load('{written}', weights_only=True))")
