"""Trainer strategies the project adds to Lightning; importing this package registers them by name."""

from lightning.pytorch.strategies import StrategyRegistry

from template.engine.strategies.dp import DataParallelStrategy, check_dp_trainer_config
from template.engine.strategies.fsdp import FSDP2Strategy

DataParallelStrategy.register_strategies(StrategyRegistry)
FSDP2Strategy.register_strategies(StrategyRegistry)

__all__ = ["DataParallelStrategy", "FSDP2Strategy", "check_dp_trainer_config"]
