"""``plan(...)``: every strategy configuration's predicted bytes for a model and cluster, and a recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.planner.estimate import (
    OPTIMIZER_STATES,
    PRECISION_BYTES,
    ConfigEstimate,
    EstimateContext,
    estimate_data_parallel,
    estimate_pipeline,
    estimate_zero3,
    estimate_zero12,
)
from lightning_parallel.planner.recommend import recommend, trainer_line
from lightning_parallel.planner.spec import ModelSpec, model_spec

__all__ = ["Plan", "default_microbatches", "format_bytes", "plan"]

_GIB = 2**30


@dataclass
class Plan:
    """The planner's answer. :meth:`table` renders it; ``str(plan)`` is the table plus the recommendation."""

    model: str
    num_parameters: int
    world_size: int
    num_nodes: int
    device_memory: int | None
    optimizer: str
    precision: str
    batch_size: int
    seq_len: int
    configurations: list[ConfigEstimate]
    recommended: ConfigEstimate | None
    trainer_line: str | None
    assumptions: list[str] = field(default_factory=list)
    activation_checkpointing: bool = False
    """Whether the activation estimates assume every transformer block recomputed in backward."""

    def configuration(self, name: str) -> ConfigEstimate:
        """The configuration called ``name`` (``"zero2"``, ``"pipeline pp=2, dp=2"``, ...)."""
        for config in self.configurations:
            if config.name == name:
                return config
        raise KeyError(f"No configuration {name!r}; planned: {[c.name for c in self.configurations]}.")

    def table(self) -> str:
        """A markdown table, one row per configuration, each value the worst rank's."""
        lines = [
            "| configuration | params | grads | optimizer state | activations (est.) | total | wire bytes/step |"
            " bubble | fits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in self.configurations:
            worst = max(c.ranks, key=lambda r: r.total)
            cells = [
                c.name,
                format_bytes(worst.parameters),
                format_bytes(worst.gradients),
                format_bytes(worst.optimizer_state),
                "?" if worst.activations is None else format_bytes(worst.activations),
                format_bytes(worst.total),
                _wire_cell(c, self.world_size),
                "-" if c.bubble is None else f"{c.bubble:.2f}",
                "?" if c.fits is None else ("yes" if c.fits else "NO"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        memory = "unlimited" if self.device_memory is None else f"{self.device_memory / _GIB:.1f} GiB"
        lines = [
            f"Model {self.model}: {self.num_parameters:,} parameters; world size {self.world_size} on"
            f" {self.num_nodes} node(s), {memory} per device, {self.optimizer}, precision {self.precision},"
            f" batch {self.batch_size} x {self.seq_len} tokens per replica"
            f"{', activation checkpointing' if self.activation_checkpointing else ''}. Per rank, worst rank shown:",
            "",
            self.table(),
            "",
            *[f"* {a}" for a in self.assumptions],
            *[f"* {c.name}: {note}" for c in self.configurations for note in c.notes],
        ]
        if self.recommended is not None:
            fits = "" if self.recommended.fits is not False else " (NOTHING FITS: closest shown)"
            lines += ["", f"Recommended: {self.recommended.name}{fits}", f"    {self.trainer_line}"]
        return "\n".join(lines)


def _wire_cell(config: ConfigEstimate, world_size: int) -> str:
    wire = format_bytes(config.wire_bytes(world_size))
    return wire if config.communication_complete else f"{wire} + P2P (?)"


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def plan(
    model: Any,
    *,
    world_size: int,
    num_nodes: int = 1,
    device_memory: int | None = None,
    optimizer: str = "adamw",
    precision: str = "32-true",
    batch_size: int = 8,
    seq_len: int | None = None,
    num_microbatches: int | None = None,
    schedule: str = "1F1B",
    bucket_cap_mb: float = 25.0,
    activation_checkpointing: bool = False,
    process_group_backend: str = "nccl",
) -> Plan:
    """Predict bytes held per rank and bytes communicated per step for every strategy configuration, and pick one.

    Configurations: data parallel, ZeRO 1/2/3 (on several nodes also hybrid, ``zero2 shard=<devices per node>``:
    sharded within a node, replicated across nodes), and a pipeline ``p x dp`` for every divisor ``p >= 2`` of the world
    size (models with ``pipeline_layers()`` and at least ``p`` layers). Formulas and assumptions:
    :mod:`lightning_parallel.planner.estimate`; recommendation rule: :mod:`lightning_parallel.planner.recommend`.

    Args:
        model: a preset (``"gpt-1.3b"``), a parameter count (``350_000_000``, ``"1.3B"``), a ``GPTConfig``, a
            Hugging Face transformers config (``LlamaConfig(...)``, a local ``config.json`` or a directory holding
            one; :mod:`lightning_parallel.planner.hf`), a ``"package.module:Class"`` LightningModule path, or a module
            instance.
        world_size: total number of processes (devices).
        num_nodes: machines they are spread over (changes the recommendation only).
        device_memory: bytes per device; ``None`` skips the "fits" check.
        optimizer: a key of :data:`~lightning_parallel.planner.estimate.OPTIMIZER_STATES`.
        precision: a Lightning precision string (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).
        batch_size: samples per batch of one data-parallel replica (what its dataloader yields).
        seq_len: tokens per sample; ``None``: the model's ``TransformerShape`` (its ``default_seq_len``, else
            ``max_seq_len``; 1 without one; a transformers config: ``min(max_position_embeddings, 4096)``).
        num_microbatches: pipeline micro-batches; ``None``: :func:`default_microbatches` (the planner passes the
            count it chose in the ``Trainer`` line; bytes held and sent do not depend on it).
        schedule: pipeline schedule (``"1F1B"``, ``"GPipe"``, ``"Interleaved1F1B"``).
        bucket_cap_mb: the ZeRO-1/2 bucket size (``ShardedOptimizerStrategy(bucket_cap_mb=...)``).
        activation_checkpointing: every transformer block recomputed in backward, as the strategies'
            ``activation_checkpointing=True`` does: each block keeps only its input, plus one block's activations
            while it is recomputed (:func:`~lightning_parallel.planner.estimate.activation_estimate`). The
            recommended ``Trainer`` line then turns it on.
        process_group_backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs): on gloo ZeRO-1/2 all-reduce their gradient
            buckets and ZeRO-3 its units' gradients (each rank keeps its slice) instead of reduce-scattering them,
            which is faster there (:func:`~lightning_parallel.distributed.zero.default_gradient_reduction`,
            ``distributed/zero/stage3_gloo.py``); bytes held do not change.

    Raises:
        ValueError: for an unknown optimizer or precision, or a world size / node count that does not divide.
        TypeError: for an ``activation_checkpointing`` that is not a bool.
    """
    _validate(world_size, num_nodes, optimizer, precision, batch_size, device_memory)
    if not isinstance(activation_checkpointing, bool):
        raise TypeError(
            f"`activation_checkpointing={activation_checkpointing!r}` must be True or False: the planner models"
            " checkpointing of every transformer block (`True`), which is what a set naming the block class does."
        )
    spec = model_spec(model)
    if seq_len is None:
        seq_len = (spec.shape.default_seq_len or spec.shape.max_seq_len) if spec.shape is not None else 1
    element, activation = PRECISION_BYTES[precision]
    ctx = EstimateContext(
        spec,
        world_size,
        OPTIMIZER_STATES[optimizer.lower()],
        element,
        activation,
        batch_size,
        seq_len,
        activation_checkpointing=activation_checkpointing,
        gradient_reduction="all_reduce" if process_group_backend == "gloo" else "reduce_scatter",
    )
    configs = [estimate_data_parallel(ctx)]
    if world_size == 1 and element < 4:  # 16-bit parameters: ZeRO keeps fp32 masters of everything (nothing to shard)
        configs += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb) for s in (1, 2)]
    if world_size > 1:
        configs += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb) for s in (1, 2)]
        configs.append(estimate_zero3(ctx))
        per_node = world_size // num_nodes
        if num_nodes > 1 and per_node > 1:  # hybrid: shard within a node, replicate across the nodes
            configs += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb, shard_size=per_node) for s in (1, 2)]
            configs.append(estimate_zero3(ctx, shard_size=per_node))
        configs += _pipelines(ctx, spec, num_microbatches=num_microbatches, schedule=schedule)
    for config in configs:
        config.fits = None if device_memory is None else config.max_total <= device_memory
    chosen = recommend(configs, num_nodes=num_nodes)
    line = trainer_line(chosen, world_size=world_size, num_nodes=num_nodes, precision=precision) if chosen else None
    return Plan(
        model=spec.name,
        num_parameters=spec.num_parameters,
        world_size=world_size,
        num_nodes=num_nodes,
        device_memory=device_memory,
        optimizer=optimizer,
        precision=precision,
        batch_size=batch_size,
        seq_len=seq_len,
        configurations=configs,
        recommended=chosen,
        trainer_line=line,
        assumptions=_assumptions(spec, activation_checkpointing=activation_checkpointing),
        activation_checkpointing=activation_checkpointing,
    )


def _pipelines(
    ctx: EstimateContext, spec: ModelSpec, *, num_microbatches: int | None, schedule: str
) -> list[ConfigEstimate]:
    if not spec.has_pipeline_layers:
        return []
    num_layers = len(spec.layer_numels())
    stages_per_rank = 2 if schedule.lower().startswith("interleaved") else 1
    configs = []
    for p in range(2, ctx.world_size + 1):
        if ctx.world_size % p or p * stages_per_rank > num_layers:
            continue
        m = num_microbatches or default_microbatches(ctx.batch_size, p, stages_per_rank)
        if m is None or ctx.batch_size % m:
            continue  # the strategy refuses batches not divisible by the micro-batch count
        configs.append(
            estimate_pipeline(
                ctx, pipeline_parallel_size=p, num_microbatches=m, schedule=schedule, stages_per_rank=stages_per_rank
            )
        )
    return configs


def default_microbatches(batch_size: int, pipeline_parallel_size: int, stages_per_rank: int) -> int | None:
    """The most micro-batches up to ``4 x stages`` that divide the batch (a smaller bubble; more, smaller
    micro-batches use an accelerator less well), at least the number of stages, a multiple of the pipeline size for
    interleaved schedules; ``None`` when no count qualifies."""
    stages = pipeline_parallel_size * stages_per_rank
    for m in range(min(batch_size, 4 * stages), stages - 1, -1):
        if batch_size % m == 0 and (stages_per_rank == 1 or m % pipeline_parallel_size == 0):
            return m
    return None


def _assumptions(spec: ModelSpec, *, activation_checkpointing: bool) -> list[str]:
    notes = [
        "Bytes held and bytes per step are exact for our strategies (checked against ParallelismMonitor);"
        " activations are an estimate (34h + 5as bytes per token and block in 16-bit, Korthikanti et al. 2022).",
        "The activation estimate keeps attention scores (the 5as term); fused attention kernels (flash /"
        " memory-efficient SDPA, the default on GPUs) do not store them, so read it as an upper bound.",
        "Pipelines: the most micro-batches up to 4 x stages that divide the batch (unless num_microbatches is given).",
        "wire bytes = the most bytes one rank puts on the wire per step under ring collectives (2(N-1)/N of an"
        " all-reduce, (N-1)/N of a reduce-scatter or all-gather; P2P as sent).",
    ]
    if activation_checkpointing:
        notes.append(
            "Activation checkpointing: each block keeps its input (h elements per token in the parameters' dtype);"
            " backward adds one block's activations for one (micro-)batch while recomputing it, and ~1/3 more"
            " compute (each block's forward runs twice)."
        )
    if spec.shape is None:
        notes.append("No transformer shape (no `transformer_shape()` hook): activations are not estimated ('?').")
    return notes + spec.notes


def _validate(
    world_size: int, num_nodes: int, optimizer: str, precision: str, batch_size: int, device_memory: int | None
) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size={world_size!r}` must be a positive integer.")
    if not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"`num_nodes={num_nodes!r}` must be a positive divisor of `world_size={world_size}`.")
    if optimizer.lower() not in OPTIMIZER_STATES:
        raise ValueError(f"Unknown `optimizer={optimizer!r}`. Valid options: {', '.join(OPTIMIZER_STATES)}.")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"Unknown `precision={precision!r}`. Valid options: {', '.join(PRECISION_BYTES)}.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size={batch_size!r}` must be a positive integer (samples per replica).")
    if device_memory is not None and device_memory <= 0:
        raise ValueError(f"`device_memory={device_memory!r}` must be a positive number of bytes (or None).")
