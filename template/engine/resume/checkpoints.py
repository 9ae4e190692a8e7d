"""Checkpoint files: check and load one a user names (a missing, truncated or foreign file is one ``error:`` line
before anything reads it), write them crash-safe and load them weights-only, and ``last.ckpt`` at every validation."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from template.engine.errors import ConfigError, disk_errors, one_line
from template.engine.internals import SHARDED_METADATA, save_last_where_skipped
from template.engine.logs.console import Mechanism
from template.engine.resume.states import ExactResume
from template.engine.runs import INTERRUPTED, is_sharded
from template.engine.runs.folder import checkpoint_dir, newest
from template.engine.runs.remote import RemoteRoot
from template.engine.store import atomic_torch_save
from template.engine.strategies.fsdp import is_fsdp

# Lightning resolves these names itself instead of reading a file.
SPECIAL_PATHS = ("best", "last", "hpc", "registry")
# Lightning writes this key into every checkpoint it saves.
_LIGHTNING_KEY = "pytorch-lightning_version"


def check(
    path: str | os.PathLike, option: str = "--ckpt_path", lightning: bool = True, strategy: Any = None
) -> dict[str, Any]:
    """The checkpoint at ``path``, its tensors memory-mapped (a sharded one without its shards); a ConfigError when
    it cannot be used. ``lightning``: it is resumed or evaluated from, so a bare ``state_dict`` is refused.
    ``strategy``: the ``trainer.strategy`` that will load it (a sharded checkpoint loads only under fsdp)."""
    if is_sharded(path):
        return _check_sharded(Path(path), option, strategy)
    if not Path(path).is_file():
        raise ConfigError(f"checkpoint '{path}' does not exist; pass an existing file to {option}")
    try:
        # mmap reads the archive's index, not the tensors: a cheap check that the file is whole.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # junk bytes make the unpickler fail in arbitrary ways
        reason = one_line(err).split(". ")[0][:200]
        if "mmap can only be used" in reason:
            reason = "not a PyTorch checkpoint archive"
        raise ConfigError(
            f"checkpoint '{path}' cannot be loaded ({reason}); it is truncated, corrupt "
            f"or not a weights-only PyTorch checkpoint: pass a complete .ckpt file written by this project to {option}"
        ) from None
    mapping = checkpoint if isinstance(checkpoint, Mapping) else {}
    if lightning and not (_LIGHTNING_KEY in mapping and "state_dict" in mapping):
        if mapping and all(isinstance(v, torch.Tensor) for v in mapping.values()):  # what `export` writes
            raise ConfigError(
                f"checkpoint '{path}' holds a network's weights only (as `export` writes them), not a training "
                f"state: load it with net.load_state_dict(torch.load('{path}', weights_only=True)), or pass the "
                f"Lightning .ckpt it was exported from to {option}"
            )
        raise ConfigError(
            f"checkpoint '{path}' is not a Lightning checkpoint (it has no '{_LIGHTNING_KEY}'); pass a .ckpt "
            f"file written by a run of this project to {option}"
        )
    return checkpoint


def _check_sharded(path: Path, option: str, strategy: Any) -> dict[str, Any]:
    if strategy is not None and not is_fsdp(strategy):
        raise ConfigError(
            f"checkpoint '{path}' is sharded (a folder written by strategy fsdp) but trainer.strategy is "
            f"{strategy if isinstance(strategy, str) else type(strategy).__name__}: run with --trainer.strategy=fsdp, "
            f"or export it to one file (python -m {__package__.split('.')[0]} export {path})"
        )
    from torch.distributed.checkpoint import FileSystemReader  # here: only sharded checkpoints need it at start-up

    try:
        FileSystemReader(path).read_metadata()
        return torch.load(path / SHARDED_METADATA, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a missing or truncated part: see check()
        raise ConfigError(
            f"sharded checkpoint '{path}' cannot be loaded ({one_line(err)[:200]}); it is incomplete or corrupt: "
            f"pass a complete checkpoint written by this project to {option}"
        ) from None


def load_sharded(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning checkpoint, in this process (no process group): the shards joined into
    full tensors, optimizer states keyed by parameter name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = check(path, option="the command")
    buffer = io.BytesIO()
    dcp_to_torch_save(path, buffer)
    buffer.seek(0)
    shards = torch.load(buffer, map_location="cpu", weights_only=True)
    optimizers = sorted((k for k in shards if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return {**checkpoint, "state_dict": shards["state_dict"], "optimizer_states": [shards[k] for k in optimizers]}


def load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """The whole checkpoint at ``path`` (any weights-only file: Lightning, exported or plain PyTorch)."""
    if is_sharded(path):
        return load_sharded(path)
    check(path, option="the command", lightning=False)
    return torch.load(path, map_location=map_location, weights_only=True)


def resuming_in_place(trainer: Any, ckpt_path: str | os.PathLike | None) -> None:
    """Leave out Lightning's warning that the checkpoint folder "exists and is not empty" (in this fit) when the fit
    continues from a checkpoint in it (the run's own); elsewhere a new run would overwrite another's ``last.ckpt``."""
    if ckpt_path is None or str(ckpt_path) in SPECIAL_PATHS:
        return
    folder = checkpoint_dir(trainer)
    if Path(ckpt_path).resolve().parent != Path(folder).resolve():
        return
    # No argument of ModelCheckpoint avoids the warning: its setup warns before every fit in a non-empty folder.
    for callback in (c for c in trainer.callbacks if isinstance(c, ExactResume)):
        callback.ignore(rf"Checkpoint directory {re.escape(str(folder))} exists and is not empty\.$")


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (the ``checkpoint:`` section) whose ``save_last=True`` writes ``last.ckpt`` at
    every validation, and which removes a stop's ``interrupted.ckpt`` once the run finished.

    Lightning 2.6 writes it only where a top-k checkpoint is: a run whose score stopped improving ended with an old
    ``last.ckpt``. A second ModelCheckpoint cannot write it: Lightning refuses two of the same state key (the class
    name keeps it), and MLflow uploads only the checkpoints of the last one to save.
    """

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        save_last_where_skipped(self, trainer, at_epoch_end=False)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        save_last_where_skipped(self, trainer, at_epoch_end=True)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # The finished run's checkpoints are written: a stop's, older, would only make the run look interrupted.
        interrupted = Path(checkpoint_dir(trainer)) / INTERRUPTED
        if interrupted.exists() and newest([interrupted.parent]) != str(interrupted):
            trainer.strategy.remove_checkpoint(interrupted)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves survive SIGKILL at any moment and whose loads are ``weights_only``. With a
    ``remote`` run folder (object storage) each checkpoint is then uploaded whole, in the background, and named the
    run's newest once its upload completed."""

    announcement = Mechanism(
        "atomic checkpoints", "written beside the target, fsynced, renamed; loaded weights-only", "--trainer.plugins=[]"
    )

    def __init__(self, remote: RemoteRoot | None = None) -> None:
        super().__init__()
        self.remote = remote

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None or get_protocol(str(path)) != "file":
            super().save_checkpoint(checkpoint, path, storage_options)  # a store of the user's, through Lightning
            return
        with disk_errors(path, kept="any previous checkpoint there is intact"):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_torch_save(checkpoint, path)
        if self.remote is not None:
            # The logs up to this checkpoint first: the pointer, moved after its upload, never names one without them.
            self.remote.sync(Path(path).parent.parent)
            self.remote.push(Path(path), newest=True)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        super().remove_checkpoint(path)
        if self.remote is not None:
            self.remote.remove(Path(path))

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load with ``weights_only=True`` whatever the caller asks: a checkpoint is data, never code to run."""
        return super().load_checkpoint(*args, **{**kwargs, "weights_only": True})
