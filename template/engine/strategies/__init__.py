"""Parallelism and devices: strategies ``dp`` and ``fsdp``, ``trainer.devices``, the global batch and learning-rate
scaling, ``compile`` and ``ema``. Uses logs, errors, the store and internals.

Importing this package registers ``dp`` in Lightning's StrategyRegistry, once for the process: Lightning has no
strategy of that name, so no meaning changes, and a ``Trainer(strategy="dp")`` of your own works too. ``fsdp`` is
left Lightning's (FSDP1, CUDA only): the command line builds its ``trainer.strategy: fsdp`` as FSDP2 itself
(``commands.trainer_arguments.strategy``); elsewhere use ``FSDP2Strategy()``."""

from lightning.pytorch.strategies import StrategyRegistry

from template.engine.strategies.dp import DataParallelStrategy, check_dp_trainer_config
from template.engine.strategies.fsdp import FSDP2Strategy

StrategyRegistry.register("dp", DataParallelStrategy, description=DataParallelStrategy.__doc__, override=True)

__all__ = ["DataParallelStrategy", "FSDP2Strategy", "check_dp_trainer_config"]
