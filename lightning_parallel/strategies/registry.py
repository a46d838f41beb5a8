"""Registers our strategy names in Lightning's registry, so ``Trainer(strategy="data_parallel")`` works."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.strategies.data_parallel import DataParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.sharded_optimizer import ShardedOptimizerStrategy

__all__ = ["STRATEGY_CLASSES", "register_all", "registered_names"]

STRATEGY_CLASSES = (DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy)


def register_all() -> None:
    """Add every strategy name of this package to Lightning's ``StrategyRegistry`` (idempotent)."""
    for strategy_class in STRATEGY_CLASSES:
        strategy_class.register_strategies(StrategyRegistry)


def registered_names() -> list[str]:
    """The registry names this package provides, e.g. ``"data_parallel_notebook"``."""
    return sorted(name for name, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGY_CLASSES)
