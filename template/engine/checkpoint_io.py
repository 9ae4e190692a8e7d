"""Checkpoint IO plugin: crash-safe writes beside the target, and loading that never unpickles code."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from template.engine.atomic import atomic_torch_save
from template.engine.errors import disk_errors
from template.engine.mechanism import Mechanism


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves survive SIGKILL at any moment and whose loads are ``weights_only``."""

    announcement = Mechanism(
        "atomic checkpoints", "written beside the target, fsynced, renamed; loaded weights-only", "--trainer.plugins=[]"
    )

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        """Write ``checkpoint`` to a temporary file beside ``path``, fsync it, and rename it onto ``path``."""
        if storage_options is not None or get_protocol(str(path)) != "file":
            # Remote stores (s3://, gs://...) have their own atomic uploads; Lightning's path handles them.
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        # The temporary is gone and the previous file untouched (atomic_write): say so in one line.
        with disk_errors(path, kept="any previous checkpoint there is intact"):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load with ``weights_only=True`` whatever the caller asks: a checkpoint is data, never code to run."""
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)
