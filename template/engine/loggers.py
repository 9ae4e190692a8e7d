"""The default loggers: CSV and TensorBoard in one version folder, written to disk on a timer."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import TensorBoardLogger as _TensorBoardLogger

from template.engine.errors import ConfigError


class _TimedSave:
    """Writes the logger's files at most every ``save_interval`` seconds, and always at the end of the run.

    Lightning calls ``logger.save()`` after every logging step (Lightning-AI/pytorch-lightning#4664, closed as
    won't fix): a rewrite of metrics.csv's tail and a TensorBoard flush each time, which costs more than a small
    model's training step. Values are never dropped: they wait in memory until the next save or ``finalize``,
    which Lightning calls when a run ends, fails or is interrupted. A killed process loses at most the last
    ``save_interval`` seconds of values.
    """

    _last_save: float = float("-inf")

    def __init__(self, *args: Any, save_interval: float = 5.0, **kwargs: Any) -> None:
        if not save_interval >= 0:  # also refuses NaN
            raise ConfigError(
                f"trainer.logger save_interval={save_interval} is not a number of seconds >= 0; use e.g. 5 (0 "
                "writes at every logging step, as Lightning's own loggers do)"
            )
        self.save_interval = save_interval
        super().__init__(*args, **kwargs)

    def save(self) -> None:
        now = time.monotonic()
        if now - self._last_save < self.save_interval:
            return
        self._last_save = now
        super().save()  # type: ignore[misc]  # the Lightning logger this is mixed into

    def finalize(self, status: str) -> None:
        self._last_save = float("-inf")  # the end of a run always reaches the disk
        super().finalize(status)  # type: ignore[misc]


class CSVLogger(_TimedSave, _CSVLogger):
    """Lightning's CSVLogger, writing ``metrics.csv`` at most every ``save_interval`` seconds."""


class TensorBoardLogger(_TimedSave, _TensorBoardLogger):
    """Lightning's TensorBoardLogger, flushing its event file at most every ``save_interval`` seconds."""


def default_loggers(root: str | None) -> list:
    """CSV and TensorBoard logs side by side in one version folder under ``root`` (``default_root_dir``)."""
    root = root or "."
    csv = CSVLogger(save_dir=root, name="lightning_logs")
    # CSV first: it is the logger whose folder Lightning uses for config.yaml and checkpoints.
    return [csv, TensorBoardLogger(save_dir=root, name="lightning_logs", version=csv.version)]
