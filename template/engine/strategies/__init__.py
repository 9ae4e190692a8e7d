"""Parallelism and devices: strategies ``dp`` and ``fsdp`` (registered by name on import), ``trainer.devices``, the
global batch and learning-rate scaling, ``compile`` and ``ema``. Uses logs, errors, the store and internals."""

from lightning.pytorch.strategies import StrategyRegistry

from template.engine.strategies.dp import DataParallelStrategy, check_dp_trainer_config
from template.engine.strategies.fsdp import FSDP2Strategy

# Lightning has no "dp"; this "fsdp" replaces Lightning's (FSDP1, CUDA only), which stays reachable by class_path.
StrategyRegistry.register("dp", DataParallelStrategy, description=DataParallelStrategy.__doc__, override=True)
StrategyRegistry.register("fsdp", FSDP2Strategy, description=FSDP2Strategy.__doc__, override=True)

__all__ = ["DataParallelStrategy", "FSDP2Strategy", "check_dp_trainer_config"]
