"""The planner's rows measured by a dry run (:mod:`.dry_run`) instead of the activation formula.

:func:`dry_run_workload` turns what ``plan(model=...)`` accepts into one training step: a transformers config builds
transformers' own model (``AutoModelForCausalLM.from_config``: the real attention, masks and loss path), a preset, a
``GPTConfig`` or any module reporting a transformer shape runs on ``(batch, seq_len)`` token ids with a cross-entropy
loss, another module on its ``example_input_array`` with the mean of its output as the loss. A bare parameter count
has no module: the formula stays.

:func:`measure_rows` runs rank 0 (the largest shard: padding falls on the last ranks) of each data-parallel / ZeRO /
hybrid row, and every pipeline rank of the first replica of each pipeline row (:mod:`.dry_run_pipeline`: torch's
schedule on the rank's stages; the row's peak is its largest), and sets :attr:`~.estimate.ConfigEstimate.peak`.
Data-parallel and ZeRO rows are dry-run in fp32 and in the 16-bit ``-true`` precisions (ZeRO then holds the fp32
master weights the strategy keeps); pipeline rows with ZeRO-3 inside, uneven stages or a 16-bit precision, mixed
precisions and models the dry run cannot execute keep the formula, with a note saying why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.planner.dry_run import (
    PRECISIONS,
    DryRunError,
    DryRunLayout,
    DryRunWorkload,
    dry_run,
    language_model_workload,
    materialise,
    module_workload,
)
from lightning_parallel.planner.dry_run_pipeline import PIPELINE_ZERO_STAGES, PipelineLayout, dry_run_pipeline
from lightning_parallel.planner.estimate import ConfigEstimate
from lightning_parallel.planner.hf import read_hf_config
from lightning_parallel.planner.spec import ModelSpec

__all__ = ["OPTIMIZERS", "dry_run_workload", "measure_rows"]

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-4),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-4),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-4),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "sgd_no_momentum": lambda p: torch.optim.SGD(p, lr=1e-2),
}
"""The torch optimizer behind each of the planner's optimizer names (their state is what the step allocates)."""


def dry_run_workload(
    model: Any,
    spec: ModelSpec,
    *,
    batch_size: int,
    seq_len: int,
    optimizer: str,
    activation_checkpointing: str,
) -> DryRunWorkload | str:
    """One training step of ``model`` for the dry run, or the reason there is none (a sentence)."""
    make_optimizer = OPTIMIZERS[optimizer.lower()]
    checkpointing: bool | str = False if activation_checkpointing == "none" else activation_checkpointing
    if checkpointing == "full":
        checkpointing = True
    config = read_hf_config(model) if not isinstance(model, nn.Module) else None
    if config is not None:
        try:
            import transformers
        except ImportError:
            return "transformers is not installed (the dry run builds its model from the config)"
        values = dict(config[0])
        model_type = values.pop("model_type")
        hf_config = transformers.AutoConfig.for_model(model_type, **values)
        vocab = int(hf_config.vocab_size)
        return language_model_workload(
            lambda: transformers.AutoModelForCausalLM.from_config(hf_config),
            batch_size=batch_size,
            seq_len=seq_len,
            vocab_size=vocab,
            optimizer=make_optimizer,
            activation_checkpointing=checkpointing,
            description=spec.name,
        )
    if spec.module is None:
        return "a parameter count has no module to run"
    build = materialise(spec.module)
    if spec.shape is not None:
        return language_model_workload(
            build,
            batch_size=batch_size,
            seq_len=seq_len,
            vocab_size=spec.shape.vocab_size,
            optimizer=make_optimizer,
            activation_checkpointing=checkpointing,
            description=spec.name,
        )
    example = getattr(spec.module, "example_input_array", None)
    examples = (example,) if isinstance(example, Tensor) else example
    if not isinstance(examples, tuple) or not examples:
        return "the module has neither a transformer shape nor an example_input_array to run on"

    def make_inputs() -> tuple[Any, ...]:
        return tuple(torch.empty(e.shape, dtype=e.dtype) if isinstance(e, Tensor) else e for e in examples)

    return module_workload(
        build, make_inputs, optimizer=make_optimizer, activation_checkpointing=checkpointing, description=spec.name
    )


def _layout(
    config: ConfigEstimate, *, world_size: int, bucket_cap_mb: float, backend: str, precision: str
) -> DryRunLayout | None:
    """The dry-run layout of a data-parallel / ZeRO table row, or ``None`` for another row."""
    strategy, *options = config.name.split(" ")  # "zero3", "zero2 shard=4", "zero3 tp=2"
    if strategy not in ("data_parallel", "zero1", "zero2", "zero3"):
        return None
    values = dict(option.split("=", 1) for option in options)
    return DryRunLayout(
        strategy=strategy,
        world_size=world_size,
        shard_size=int(values["shard"]) if "shard" in values else None,
        bucket_cap_mb=bucket_cap_mb,
        backend=backend,
        precision=precision,
        tensor_parallel_size=int(values.get("tp", 1)),
    )


def _pipeline_layouts(config: ConfigEstimate, *, world_size: int, backend: str) -> list[PipelineLayout] | None:
    """The dry-run layouts of a pipeline row's pipeline ranks (first replica), or ``None`` when the dry run does not
    cover the row (ZeRO-3 inside the pipeline, uneven stages)."""
    arguments = dict(re.findall(r"(\w+)=('[^']*'|\w+)", config.strategy))
    if "first_stage_fewer_layers" in arguments or "last_stage_fewer_layers" in arguments:
        return None
    zero_stage = int(arguments.get("zero_stage", 0))
    if zero_stage not in PIPELINE_ZERO_STAGES:
        return None
    p = int(arguments["pipeline_parallel_size"])
    return [
        PipelineLayout(
            world_size=world_size,
            pipeline_parallel_size=p,
            rank=rank,
            schedule=arguments.get("schedule", "'1F1B'").strip("'"),
            num_microbatches=int(arguments["num_microbatches"]),
            zero_stage=zero_stage,
            backend=backend,
        )
        for rank in range(p)
    ]


def _measure_pipeline_row(
    config: ConfigEstimate, workload: DryRunWorkload, *, world_size: int, backend: str
) -> list[str]:
    """Set a pipeline row's peak to the largest of its pipeline ranks' dry runs; a note if the dry run failed."""
    pipeline = _pipeline_layouts(config, world_size=world_size, backend=backend)
    if pipeline is None:
        return []
    try:
        config.peak = max(dry_run_pipeline(workload, layout).peak_bytes for layout in pipeline)
    except DryRunError as error:
        return [f"Dry run of {config.name} failed, the row keeps the formula: {error}"]
    return []


def measure_rows(
    configs: list[ConfigEstimate],
    workload: DryRunWorkload | str,
    *,
    world_size: int,
    precision: str,
    bucket_cap_mb: float,
    backend: str,
) -> list[str]:
    """Set each dry-runnable row's :attr:`~.estimate.ConfigEstimate.peak`; return notes for the plan."""
    precision = "32-true" if precision == "32" else precision
    if precision not in PRECISIONS:
        valid = ", ".join(PRECISIONS)
        return [f"Dry run: precision {precision} is not dry-run yet ({valid} only); every row keeps the formula."]
    if isinstance(workload, str):
        return [f"Dry run: not possible ({workload}); every row keeps the formula."]
    notes = []
    for config in configs:
        if config.name.startswith("pipeline"):
            if precision == "32-true":  # the pipeline's dry run plays fp32 only
                notes += _measure_pipeline_row(config, workload, world_size=world_size, backend=backend)
            continue
        layout = _layout(
            config, world_size=world_size, bucket_cap_mb=bucket_cap_mb, backend=backend, precision=precision
        )
        if layout is None:
            continue
        try:
            config.peak = dry_run(workload, layout).peak_bytes
        except DryRunError as error:
            for row in configs:
                row.peak = None
            return [f"Dry run failed, every row keeps the formula: {error}"]
    if any(c.peak is None for c in configs):
        notes.append(
            "Dry run: pipeline rows with ZeRO-3 inside, uneven stages or a 16-bit precision keep the formula (marked"
            " 'formula' in the peak column)."
        )
    return notes
