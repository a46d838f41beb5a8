"""The planner: memory per rank and bytes per step of every strategy for a model, checked against the monitor."""

from lightning_parallel.planner.cli import main, parse_memory
from lightning_parallel.planner.estimate import ConfigEstimate, RankEstimate, pipeline_bubble
from lightning_parallel.planner.fit import LargestFit, largest_fitting
from lightning_parallel.planner.plan import Plan, format_bytes, plan
from lightning_parallel.planner.recommend import recommend, trainer_line
from lightning_parallel.planner.shape import (
    ProvidesTransformerShape,
    TransformerShape,
    register_config_type,
    register_preset,
)
from lightning_parallel.planner.spec import ModelSpec, model_spec

__all__ = [
    "ConfigEstimate",
    "LargestFit",
    "ModelSpec",
    "Plan",
    "ProvidesTransformerShape",
    "RankEstimate",
    "TransformerShape",
    "format_bytes",
    "largest_fitting",
    "main",
    "model_spec",
    "parse_memory",
    "pipeline_bubble",
    "plan",
    "recommend",
    "register_config_type",
    "register_preset",
    "trainer_line",
]
