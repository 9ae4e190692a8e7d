"""``ema.decay``: an exponential moving average of the weights (Lightning's EMAWeightAveraging), off by default."""

from __future__ import annotations

from lightning.pytorch.callbacks import EMAWeightAveraging

from template.engine.errors import ConfigError


class EMAOptions:
    """The ``ema`` options: validation, checkpoints' ``state_dict`` and ``export`` use the averaged weights."""

    def __init__(
        self, decay: float | None = None, update_every_n_steps: int = 1, update_starting_at_step: int | None = None
    ) -> None:
        """``decay``: the weight of the average at each update, e.g. 0.999; null (the default) keeps no average.

        ``update_every_n_steps``: update the average every N optimizer steps. ``update_starting_at_step``: start
        averaging at this step (before it the average follows the weights).
        """
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step


def ema_callbacks(
    decay: float | None, update_every_n_steps: int = 1, update_starting_at_step: int | None = None
) -> list:
    """``[EMAWeightAveraging(...)]`` for a ``decay``, ``[]`` for None; a decay outside (0, 1) is a one-line error."""
    if decay is None:
        return []
    if not 0 < decay < 1:
        raise ConfigError(f"ema.decay={decay} must be between 0 and 1 (e.g. 0.999), or null for no average")
    if update_every_n_steps < 1:
        raise ConfigError(f"ema.update_every_n_steps={update_every_n_steps} must be >= 1")
    return [
        EMAWeightAveraging(
            decay=decay, update_every_n_steps=update_every_n_steps, update_starting_at_step=update_starting_at_step
        )
    ]
