"""``ema.decay``: an exponential moving average of the weights (Lightning's EMAWeightAveraging), off by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonargparse.typing import OpenUnitInterval, PositiveInt
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from typing_extensions import override

from template.engine.logs.console import Mechanism


class EMA(EMAWeightAveraging):
    """Lightning's EMAWeightAveraging, leaving the module's callables out of its copy: the optimizer and scheduler
    factories of the command line reach objects that cannot be copied (under DDP the launcher's process handles)."""

    announcement = Mechanism(
        "ema",
        "an exponential moving average of the weights, used by validation, checkpoints and export",
        "--ema.decay=null",
    )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        held: dict[str, Any] = {
            name: value
            for name, value in vars(pl_module).items()
            if callable(value) and not isinstance(value, nn.Module) and not name.startswith("_")
        }
        for name in held:
            delattr(pl_module, name)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            for name, value in held.items():
                setattr(pl_module, name, value)


@dataclass
class EMAOptions:
    """The ``ema`` options: validation, checkpoints' ``state_dict`` and ``export`` use the averaged weights.

    Args:
        decay: the weight of the average at each update, e.g. 0.999; null (the default) keeps no average.
        update_every_n_steps: update the average every N optimizer steps.
        update_starting_at_step: start averaging at this step (before it the average follows the weights).
    """

    decay: OpenUnitInterval | None = None
    update_every_n_steps: PositiveInt = 1
    update_starting_at_step: int | None = None


def ema_callbacks(decay: float | None, **options: Any) -> list[EMA]:
    """``[EMA(...)]`` for a ``decay`` (its range checked by the command line), ``[]`` for None."""
    return [] if decay is None else [EMA(decay=decay, **options)]
