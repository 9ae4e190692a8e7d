"""Step-level ``self.log`` calls cost nothing on the training steps whose values no logger will write."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator


class LogCadence(Callback):
    """Skips a LightningModule's step-only ``self.log`` calls between the Trainer's logging steps.

    Lightning writes step values to the loggers every ``trainer.log_every_n_steps`` steps, but a ``self.log`` in
    ``training_step`` still costs ~1 ms on every step (the value is moved into Lightning's result collection and
    overwritten by the next step's). With this callback those calls return at once on the steps in between, so a
    textbook ``training_step`` that logs its loss costs what logging costs only on the steps that write. Values
    that accumulate over the epoch (``on_epoch=True``) and everything outside training are logged as usual. The
    progress bar and ``trainer.callback_metrics`` then show a step value as of the latest logging step.

    Args:
        enabled: false logs every call on every step, as Lightning does.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.enabled and stage == "fit" and "log" not in pl_module.__dict__:
            pl_module.log = _gated(pl_module.log, trainer, pl_module)  # an instance attribute: the class is untouched

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("log", None)


def _gated(log: Any, trainer: Trainer, pl_module: LightningModule) -> Any:
    def gated_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        # Only keyword calls are judged; a call passing on_step/on_epoch by position is always logged.
        if not args and trainer.training and not trainer.fast_dev_run:
            hook = pl_module._current_fx_name
            if _FxValidator.functions.get(hook) is not None and not trainer._logger_connector.should_update_logs:
                on_step, on_epoch = _FxValidator.get_default_logging_levels(
                    hook, kwargs.get("on_step"), kwargs.get("on_epoch")
                )
                if on_step and not on_epoch:
                    return
        log(name, value, *args, **kwargs)

    return gated_log
