"""What ``PipelineParallelStrategy`` reads from the Trainer before it splits the module (Lightning glue only).

The split itself is torch-only (:func:`~lightning_parallel.distributed.pipeline.stage_split.split_into_stages`); here:
the example batch it plans from (the first batch of the loop about to run), the whole model's optimizer layout (the
consolidated checkpoint's numbering), and the checks of the Trainer's precision and callbacks. Every function is
local and reaches the same verdict on every rank, before any collective.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from lightning_parallel import _compat
from lightning_parallel.choices import check_choice
from lightning_parallel.distributed.pipeline.balance import UnevenStages
from lightning_parallel.distributed.pipeline.config import check_count
from lightning_parallel.distributed.pipeline.consolidate import OptimizerLayout, optimizer_layout
from lightning_parallel.distributed.pipeline.contract import ModelCall, model_inputs_of_batch
from lightning_parallel.distributed.pipeline.microbatch import batch_size_of, check_batch_rows, check_divisible_batch
from lightning_parallel.distributed.pipeline.stage_plan import validate_partition
from lightning_parallel.distributed.pipeline.verify import check_single_evaluation_optimizers
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.strategies.parameter_callbacks import (
    AVERAGING_CALLBACKS,
    check_averaging_checkpoint_format,
    check_parameter_callbacks,
)

__all__ = [
    "SUPPORTED_PRECISION",
    "check_arguments",
    "check_callbacks",
    "check_precision",
    "example_model_inputs",
    "keeps_fp32_masters",
    "whole_model_optimizer_layouts",
]

CheckpointFormatName = Literal["consolidated", "sharded"]
"""``PipelineParallelStrategy(checkpoint_format=...)``."""

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")
_SIXTEEN_BIT_TRUE = ("bf16-true",)
_STEP_NAMES = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


def check_arguments(
    *,
    pipeline_parallel_size: object,
    num_microbatches: object,
    stages_per_rank: object,
    partition: object,
    first_stage_fewer_layers: object,
    last_stage_fewer_layers: object,
    verify_layers: object,
    checkpoint_format: object,
) -> None:
    """The constructor's arguments that no config object validates (``ValueError``/``TypeError`` naming the value)."""
    for name, count in [
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("num_microbatches", num_microbatches),
        ("stages_per_rank", stages_per_rank),
    ]:
        check_count(name, count)
    if not isinstance(verify_layers, bool):
        raise TypeError(f"`verify_layers={verify_layers!r}` must be True or False.")
    validate_partition(partition)
    uneven = UnevenStages(
        first_stage_fewer_layers=first_stage_fewer_layers,  # type: ignore[arg-type]  # checked by UnevenStages
        last_stage_fewer_layers=last_stage_fewer_layers,  # type: ignore[arg-type]
    )
    if not isinstance(partition, str) and not uneven.is_even:
        first, last = uneven.first_stage_fewer_layers, uneven.last_stage_fewer_layers
        raise ValueError(
            f"`first_stage_fewer_layers={first}` / `last_stage_fewer_layers={last}` lighten the stages of an"
            f" automatic partition, but `partition={partition!r}` (an explicit list) already fixes every stage."
            " Move the boundaries in the list yourself, or pass `partition='flops'` or `'parameters'`."
        )
    check_choice("checkpoint_format", checkpoint_format, CheckpointFormatName)


def example_model_inputs(
    trainer: Any, module: Any, call: ModelCall, *, num_microbatches: int
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The ``self(...)`` arguments of the first batch of the loop about to run, if any.

    Raises:
        ValueError: A training batch not divisible by ``num_microbatches``.
    """
    source = _compat.data_source_for(trainer)
    step = _STEP_NAMES.get(trainer.state.fn)
    if source is None or step is None or not source.is_defined():
        return None
    batch = _first_batch(source.dataloader(), training=step == "training_step")
    if batch is None:
        return None
    inputs = model_inputs_of_batch(module, step, (batch, 0), {}, call=call)
    size = batch_size_of(inputs)
    if size is not None:
        check_batch_rows(batch, size, step=step)
    if step == "training_step" and size is not None:
        check_divisible_batch(size, num_microbatches)
    return inputs


def _first_batch(loaders: Any, *, training: bool) -> Any | None:
    """The first batch the step will receive from ``loaders`` (what ``train_dataloader()`` & co. returned), or
    ``None`` if there is none.

    Training combines several loaders (a dict, list or tuple of them, or a ``CombinedLoader``) into one batch of the
    same structure, as Lightning's fit loop does (``max_size_cycle`` unless the ``CombinedLoader`` says otherwise):
    the step receives ``{"a": batch_a, "b": batch_b}``. Evaluation runs several loaders one after the other: the
    step's first batch is the first loader's.
    """
    if training and isinstance(loaders, dict | list | tuple | CombinedLoader):
        combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
        try:
            batch, _, _ = next(iter(combined))
        except (StopIteration, TypeError):
            return None
        return batch
    if isinstance(loaders, CombinedLoader):
        loaders = loaders.flattened
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, list | tuple):
        loaders = loaders[0] if loaders else None
    try:
        return next(iter(loaders))
    except (StopIteration, TypeError):
        return None


def whole_model_optimizer_layouts(module: Any, *, fitting: bool) -> list[OptimizerLayout]:
    """Each optimizer's parameter names per group on the whole (not yet split) model.

    ``configure_optimizers`` runs once more on the whole model only to learn its param groups by name: the
    consolidated checkpoint numbers parameters the way the single-device optimizer does. Its optimizers also show,
    before any collective, one that re-evaluates the loss in ``step(closure)`` (LBFGS), refused when fitting.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    optimizers, _ = _compat.init_optimizers_and_lr_schedulers(module)
    if fitting:
        check_single_evaluation_optimizers(optimizers)
    return [optimizer_layout(opt, names) for opt in optimizers]


def check_precision(precision: str) -> None:
    """Refuse a precision the pipeline does not run."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"`precision={precision!r}` is not supported by PipelineParallelStrategy."
            f" Valid options: {', '.join(map(repr, SUPPORTED_PRECISION))}."
        )


def keeps_fp32_masters(zero_config: ZeroConfig | None, *, precision: str, fitting: bool) -> bool:
    """Whether ZeRO steps fp32 master weights of 16-bit parameters (``precision="bf16-true"``) in this run."""
    return (
        fitting and zero_config is not None and zero_config.master_weights == "fp32" and precision in _SIXTEEN_BIT_TRUE
    )


def check_callbacks(callbacks: Any, *, zero_stage: int, pipeline_parallel_size: int, checkpoint_format: str) -> None:
    """Refuse callbacks that change parameters where a rank holds only its stage (or, at ``zero_stage=3``, its
    shards), and averaging with a checkpoint format it cannot write."""
    if pipeline_parallel_size > 1 or zero_stage == 3:
        check_parameter_callbacks(callbacks, strategy_name="pipeline", layout="only its stage's layers on each rank")
    if zero_stage == 3:
        _refuse_averaging_under_zero3(callbacks)
    check_averaging_checkpoint_format(callbacks, strategy_name="pipeline", checkpoint_format=checkpoint_format)


def _refuse_averaging_under_zero3(callbacks: Any) -> None:
    """Weight averaging's copy of the module is held as this rank's stage (``StageCopyHolding``), not as its shards:
    refused rather than averaging whole copies of sharded parameters."""
    for callback in callbacks:
        if isinstance(callback, AVERAGING_CALLBACKS):
            raise ValueError(
                f"`{type(callback).__name__}` is not supported with `PipelineParallelStrategy(zero_stage=3)`: its"
                " averaged copy would hold the stage's whole parameters, not their shards. Use `zero_stage=2` (or"
                " 0-1) with weight averaging."
            )
