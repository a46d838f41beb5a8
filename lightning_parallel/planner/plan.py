"""``plan(...)``: every strategy configuration's predicted bytes for a model and cluster, and a recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.distributed.pipeline.schedule import ScheduleSpec, schedule_spec
from lightning_parallel.planner.activations import check_attention, check_checkpointing, recompute_fraction
from lightning_parallel.planner.dry_plan import dry_run_workload, measure_rows
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
from lightning_parallel.planner.hf import DEFAULT_SEQ_LEN_CAP
from lightning_parallel.planner.recommend import recommend, trainer_line
from lightning_parallel.planner.search import cost_key, search
from lightning_parallel.planner.spec import ModelSpec, model_spec

__all__ = ["Plan", "default_microbatches", "format_bytes", "pipeline_schedule", "plan"]

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
    checkpointing: str = "none"
    """The activation checkpointing the table's rows assume: ``"none"``, ``"selective"`` or ``"full"``."""
    attention: str = "flash"
    """The attention kernel the activations assume: ``"flash"`` or ``"math"``."""
    table_fits: bool | None = None
    """Whether a row of the table (the requested options) fits; ``None`` without ``device_memory``."""
    closest: ConfigEstimate | None = None
    """When no row fits: the row with the smallest per-rank total."""
    num_searched: int = 0
    """Layouts the search tried when no row fit (:mod:`lightning_parallel.planner.search`); 0: no search."""
    dry_run: bool = False
    """Whether the rows' peaks were measured by a dry run (:mod:`lightning_parallel.planner.dry_run`)."""

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the table's rows assume any activation checkpointing."""
        return self.checkpointing != "none"

    def configuration(self, name: str) -> ConfigEstimate:
        """The configuration called ``name`` (``"zero2"``, ``"pipeline pp=2, dp=2"``, ...)."""
        for config in self.configurations:
            if config.name == name:
                return config
        raise KeyError(f"No configuration {name!r}; planned: {[c.name for c in self.configurations]}.")

    def table(self) -> str:
        """A markdown table, one row per configuration, each value the worst rank's."""
        peak = " peak (dry run) |" if self.dry_run else ""
        lines = [
            "| configuration | params | grads | optimizer state | activations (est.) | total | wire bytes/step |"
            f" bubble |{peak} fits |",
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if self.dry_run else ""),
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
                *([] if not self.dry_run else ["formula" if c.peak is None else format_bytes(c.peak)]),
                "?" if c.fits is None else ("yes" if c.fits else "NO"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        memory = "unlimited" if self.device_memory is None else f"{self.device_memory / _GIB:.1f} GiB"
        checkpointing = "" if self.checkpointing == "none" else f", {self.checkpointing} activation checkpointing"
        lines = [
            f"Model {self.model}: {self.num_parameters:,} parameters; world size {self.world_size} on"
            f" {self.num_nodes} node(s), {memory} per device, {self.optimizer}, precision {self.precision},"
            f" batch {self.batch_size} x {self.seq_len} tokens per replica, {self.attention} attention"
            f"{checkpointing}. Per rank, worst rank shown:",
            "",
            self.table(),
            "",
            *[f"* {a}" for a in self.assumptions],
            *[f"* {c.name}: {note}" for c in self.configurations for note in c.notes],
        ]
        return "\n".join(lines + self._recommendation_lines())

    def _recommendation_lines(self) -> list[str]:
        chosen = self.recommended
        if chosen is None:
            return []
        lines = [""]
        if self.table_fits is False and self.closest is not None:
            lines.append(
                f"Nothing in the table fits {self.device_memory / _GIB:.1f} GiB per device"  # type: ignore[operator]
                f" ({_mode_words(self.checkpointing)}, {self.attention} attention): the closest is"
                f" {self.closest.name} at {format_bytes(self.closest.max_total)} per rank."
            )
        fitting_rows = [c.name for c in self.configurations if c.fits]
        if self.table_fits and chosen not in self.configurations:
            lines.append(
                f"In the table ({_mode_words(self.checkpointing)}) these fit: {', '.join(fitting_rows)}; the search"
                " found a cheaper layout."
            )
        if chosen.fits and self.num_searched:
            lines.append(
                f"Searched {self.num_searched} layouts (activation checkpointing none / selective / full, ZeRO stages,"
                " shard group sizes, pipeline sizes); the cheapest that fits (planner/search.py's order: estimated"
                f" step time with recomputation and bubble, then wire bytes) is {chosen.name} with"
                f" {_mode_words(chosen.checkpointing)}: {_breakdown(chosen)}."
            )
        verdict = ""
        if chosen.fits is False:
            verdict = " (NOTHING FITS: closest shown)"
        elif chosen.fits:
            verdict = f" (fits: {format_bytes(chosen.max_total)} of {format_bytes(self.device_memory or 0)} per rank)"
        mode = "" if chosen.checkpointing == "none" else f", {chosen.checkpointing} activation checkpointing"
        lines += [f"Recommended: {chosen.name}{mode}{verdict}", f"    {self.trainer_line}"]
        return lines


def _mode_words(mode: str) -> str:
    return "no activation checkpointing" if mode == "none" else f"{mode} activation checkpointing"


def _breakdown(config: ConfigEstimate) -> str:
    worst = max(config.ranks, key=lambda r: r.total)
    activations = "?" if worst.activations is None else format_bytes(worst.activations)
    return (
        f"{format_bytes(worst.total)} per rank (parameters {format_bytes(worst.parameters)}, gradients"
        f" {format_bytes(worst.gradients)}, optimizer state {format_bytes(worst.optimizer_state)}, activations"
        f" {activations})"
    )


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
    activation_checkpointing: bool | str = False,
    attention: str | None = None,
    process_group_backend: str = "nccl",
    search_layouts: bool = True,
    dry_run: bool = False,
    reads_gradients: bool = False,
    tensor_parallel_size: int = 1,
) -> Plan:
    """Predict bytes held per rank and bytes communicated per step for every strategy configuration, and pick one.

    Configurations: data parallel, ZeRO 1/2/3 (on several nodes also hybrid, ``zero2 shard=<devices per node>``:
    sharded within a node, replicated across nodes), and a pipeline ``p x dp`` for every divisor ``p >= 2`` of the world
    size (models with ``pipeline_layers()`` and at least ``p`` layers). When ``device_memory`` is given and none of
    them fits, the planner searches the other options (checkpointing modes, ZeRO stages, shard group sizes, pipelines:
    :mod:`lightning_parallel.planner.search`) and recommends the cheapest that fits, saying first that the table's
    rows do not. Formulas and assumptions: :mod:`lightning_parallel.planner.estimate` and
    :mod:`lightning_parallel.planner.activations`; recommendation rule: :mod:`lightning_parallel.planner.recommend`.

    Args:
        model: a preset (``"gpt-1.3b"``), a parameter count (``350_000_000``, ``"1.3B"``), a ``GPTConfig``, a
            Hugging Face transformers config (``LlamaConfig(...)``, a local ``config.json`` or a directory holding
            one; :mod:`lightning_parallel.planner.hf`), a ``"package.module:Class"`` LightningModule path, or a module
            instance.
        world_size: total number of processes (devices).
        num_nodes: machines they are spread over (the recommendation, and node-aligned shard groups in the search).
        device_memory: bytes per device; ``None`` skips the "fits" check (and the search).
        optimizer: a key of :data:`~lightning_parallel.planner.estimate.OPTIMIZER_STATES`.
        precision: a Lightning precision string (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).
        batch_size: samples per batch of one data-parallel replica (what its dataloader yields).
        seq_len: tokens per sample; ``None``: the model's ``TransformerShape`` (its ``default_seq_len``, else
            ``max_seq_len``; 1 without one; a transformers config: ``min(max_position_embeddings, 4096)``).
        num_microbatches: pipeline micro-batches; ``None``: :func:`default_microbatches` (the planner passes the
            count it chose in the ``Trainer`` line).
        schedule: pipeline schedule (a key of :data:`~lightning_parallel.distributed.pipeline.schedule.SCHEDULE_SPECS`:
            ``"1F1B"``, ``"GPipe"``, ``"Interleaved1F1B"``, ``"ZBVZeroBubble"``, ...); 1F1B needs at least as many
            micro-batches as ranks (DualPipeV as stages), so a batch smaller than that is planned as GPipe
            (:func:`pipeline_schedule`; ZBVZeroBubble takes any count).
        bucket_cap_mb: the ZeRO-1/2 bucket size (``ShardedOptimizerStrategy(bucket_cap_mb=...)``).
        activation_checkpointing: ``"none"`` (``False``), ``"full"`` (``True``: every transformer block recomputed in
            backward, the strategies' ``activation_checkpointing=True``) or ``"selective"`` (torchtitan's per-op
            policy, the strategies' ``activation_checkpointing="selective"``;
            :mod:`~lightning_parallel.planner.activations`). The recommended ``Trainer`` line passes the strategy's
            argument.
        attention: the attention kernel: ``"flash"`` (flash / memory-efficient SDPA: no ``s^2`` scores stored) or
            ``"math"`` (the probabilities stored); ``None``: ``"flash"`` for ``process_group_backend="nccl"`` (GPU
            plans), ``"math"`` for ``"gloo"`` (CPU plans; an upper bound there: torch's CPU SDPA kernel is fused too).
        process_group_backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs): on gloo ZeRO-1/2 all-reduce their gradient
            buckets (each rank keeps its slice) instead of reduce-scattering them, which is faster there
            (:func:`~lightning_parallel.distributed.zero.buckets.default_gradient_reduction`); ZeRO-3 reduce-scatters
            on both (on gloo by point-to-point sends, ``distributed/zero/stage3_gloo.py``); bytes held do not change.
        search_layouts: with ``device_memory``, search every option for the cheapest layout that fits and recommend
            it; ``False`` keeps to the table's rows (:func:`~lightning_parallel.planner.largest_fitting` does, to
            stay fast).
        dry_run: measure each data-parallel / ZeRO / hybrid row's peak by running one training step of the model on
            fake tensors as rank 0 of ``world_size`` (:mod:`lightning_parallel.planner.dry_run`: activations,
            temporaries and communication buffers as the code allocates them; seconds per row at any world size);
            the "peak (dry run)" column, and "fits" and the recommendation use it. A pipeline row runs torch's
            schedule on each pipeline rank's stages (:mod:`lightning_parallel.planner.dry_run_pipeline`) and shows the
            largest rank. ZeRO rows in ``"bf16-true"`` / ``"16-true"`` hold the strategy's fp32 master weights.
            Pipeline rows with ZeRO-3 inside, uneven stages or a 16-bit precision, mixed precisions, bare parameter
            counts and models that cannot run on fake tensors keep the formula (marked "formula").
            The search's extra layouts stay on the formula.
        reads_gradients: code reads a parameter's ``.grad`` between backward and the step on every step (a
            gradient-norm logger every step): ZeRO rows then count the loan of whole gradients (one more all-gather
            of the gradient bytes a step; stages 2-3 hold those bytes from backward until the step). Code that reads on
            a few steps only pays this on those steps (docs/zero.md).
        tensor_parallel_size: above 1, one more row, ``zero3 tp=T``: ``ShardedOptimizerStrategy(stage=3,
            tensor_parallel_size=T)``, the layers of the model's tensor-parallel plan split over ``T`` ranks and ZeRO-3
            over the rest (:mod:`lightning_parallel.planner.tensor_parallel`; the dry run plays it). Needs a module
            with a plan (``tensor_parallel_plan()`` or a Hugging Face model inside), not a config or a count.

    Raises:
        ValueError: for an unknown optimizer, precision, attention kernel or checkpointing mode, or a world size /
            node count that does not divide.
        TypeError: for an ``activation_checkpointing`` that is neither a bool nor a mode name.
    """
    _validate(world_size, num_nodes, optimizer, precision, batch_size, device_memory)
    checkpointing = _checkpointing_mode(activation_checkpointing)
    attention = attention if attention is not None else ("math" if process_group_backend == "gloo" else "flash")
    check_attention(attention)
    spec = model_spec(model)
    defaulted = seq_len is None
    if seq_len is None:
        seq_len = (spec.shape.default_seq_len or spec.shape.max_seq_len) if spec.shape is not None else 1
    element, activation = PRECISION_BYTES[precision]

    def context(mode: str) -> EstimateContext:
        return EstimateContext(
            spec,
            world_size,
            OPTIMIZER_STATES[optimizer.lower()],
            element,
            activation,
            batch_size,
            seq_len,
            checkpointing=mode,
            attention=attention,
            gradient_reduction="all_reduce" if process_group_backend == "gloo" else "reduce_scatter",
            reads_gradients=reads_gradients,
        )

    def pipelines(ctx: EstimateContext, zero_stage: int) -> list[ConfigEstimate]:
        return _pipelines(ctx, spec, num_microbatches=num_microbatches, schedule=schedule, zero_stage=zero_stage)

    ctx = context(checkpointing)
    configs = _table(ctx, num_nodes=num_nodes, bucket_cap_mb=bucket_cap_mb, pipelines=pipelines)
    if tensor_parallel_size > 1:
        configs.insert(
            4 if world_size > 1 else len(configs), estimate_zero3(ctx, tensor_parallel_size=tensor_parallel_size)
        )
    for config in configs:
        config.checkpointing = checkpointing
    dry_notes: list[str] = []
    if dry_run:
        workload = dry_run_workload(model, spec, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer,
                                    activation_checkpointing=checkpointing)  # fmt: skip
        dry_notes = measure_rows(configs, workload, world_size=world_size, precision=precision,
                                 bucket_cap_mb=bucket_cap_mb, backend=process_group_backend)  # fmt: skip
    _mark_fits(configs, device_memory)
    chosen = recommend(configs, num_nodes=num_nodes)
    table_fits = None if device_memory is None else any(c.fits for c in configs)
    closest = min(configs, key=lambda c: c.max_total) if table_fits is False else None
    num_searched = 0
    if device_memory is not None and search_layouts:  # the cheapest layout that fits, over every option
        modes = ["none", "selective", "full"] if spec.shape is not None else ["none"]
        found = search(context, modes=modes, num_nodes=num_nodes, bucket_cap_mb=bucket_cap_mb, pipelines=pipelines)
        _mark_fits(found, device_memory)
        num_searched = len(found)
        recompute = {mode: recompute_fraction(spec.shape, mode, seq_len=seq_len) for mode in modes}
        fitting = sorted((c for c in found if c.fits), key=lambda c: cost_key(c, world_size, recompute))
        chosen = fitting[0] if fitting else min(configs, key=lambda c: c.max_total)
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
        assumptions=_assumptions(spec, checkpointing=checkpointing, attention=attention, seq_len_defaulted=defaulted)
        + dry_notes,
        checkpointing=checkpointing,
        attention=attention,
        table_fits=table_fits,
        closest=closest,
        num_searched=num_searched,
        dry_run=dry_run,
    )


def _checkpointing_mode(value: object) -> str:
    """``True``/``False`` or a mode name -> the mode name."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if not isinstance(value, str):
        raise TypeError(
            f'`activation_checkpointing={value!r}` must be True ("full"), False ("none") or one of "none",'
            ' "selective", "full".'
        )
    check_checkpointing(value)
    return value


def _table(
    ctx: EstimateContext,
    *,
    num_nodes: int,
    bucket_cap_mb: float,
    pipelines: Any,
) -> list[ConfigEstimate]:
    """The rows of the table: the configurations of the requested options."""
    world_size = ctx.world_size
    configs = [estimate_data_parallel(ctx)]
    if world_size == 1 and ctx.element_bytes < 4:  # 16-bit parameters: ZeRO keeps fp32 masters of everything
        configs += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb) for s in (1, 2)]
    if world_size > 1:
        configs += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb) for s in (1, 2)]
        configs.append(estimate_zero3(ctx))
        per_node = world_size // num_nodes
        if num_nodes > 1 and per_node > 1:  # hybrid: shard within a node, replicate across the nodes
            configs += [estimate_zero12(ctx, stage=s, bucket_cap_mb=bucket_cap_mb, shard_size=per_node) for s in (1, 2)]
            configs.append(estimate_zero3(ctx, shard_size=per_node))
        configs += pipelines(ctx, 0)
    return configs


def _mark_fits(configs: list[ConfigEstimate], device_memory: int | None) -> None:
    for config in configs:
        config.fits = None if device_memory is None else config.max_total <= device_memory


def _pipelines(
    ctx: EstimateContext, spec: ModelSpec, *, num_microbatches: int | None, schedule: str, zero_stage: int = 0
) -> list[ConfigEstimate]:
    if not spec.has_pipeline_layers:
        return []
    if zero_stage == 3 and schedule_spec(schedule).splits_backward:
        return []  # the strategy refuses it: FSDP2's gradient hooks miss the weight gradients computed outside backward
    num_layers = len(spec.layer_numels())
    configs = []
    for p in range(2, ctx.world_size + 1):
        if ctx.world_size % p or (zero_stage and ctx.world_size == p):
            continue  # zero_stage needs replicas to shard over
        chosen = pipeline_schedule(schedule, batch_size=ctx.batch_size, pipeline_parallel_size=p,
                                   num_microbatches=num_microbatches)  # fmt: skip
        if chosen is None:
            continue  # the strategy refuses batches not divisible by the micro-batch count
        m, row_schedule, stages_per_rank = chosen
        if p * stages_per_rank > num_layers:
            continue
        config = estimate_pipeline(
            ctx,
            pipeline_parallel_size=p,
            num_microbatches=m,
            schedule=row_schedule,
            stages_per_rank=stages_per_rank,
            zero_stage=zero_stage,
        )
        if row_schedule != schedule:
            config.notes.append(
                f"batch {ctx.batch_size} < {p} stages: {schedule} needs at least one micro-batch per stage, so this"
                f" row is GPipe with {m} micro-batch(es); the stages run one after the other (bubble"
                f" {config.bubble:.2f}): the pipeline splits the memory, not the time."
            )
        configs.append(config)
    return configs


def pipeline_schedule(
    schedule: str, *, batch_size: int, pipeline_parallel_size: int, num_microbatches: int | None
) -> tuple[int, str, int] | None:
    """``(micro-batches, schedule, stages per rank)`` of a ``pipeline_parallel_size`` pipeline for this batch, or
    ``None`` when the given ``num_microbatches`` does not divide it.

    :func:`default_microbatches` when it finds a count; else one micro-batch per sample, with ``schedule`` where
    torch runs it with that count (:class:`~lightning_parallel.distributed.pipeline.schedule.ScheduleSpec`'s rules:
    ``ZBVZeroBubble`` takes any count, ``GPipe`` and ``LoopedBFS`` too), else with GPipe (a batch smaller than the
    pipeline: 1F1B and the interleaved schedules need a micro-batch per rank, DualPipeV one per stage): at batch 1 a
    single micro-batch goes through the stages one after the other.
    """
    spec = schedule_spec(schedule)
    stages_per_rank = spec.default_stages_per_rank
    if num_microbatches is not None:
        return (num_microbatches, schedule, stages_per_rank) if batch_size % num_microbatches == 0 else None
    m = default_microbatches(batch_size, pipeline_parallel_size, schedule)
    if m is not None:
        return m, schedule, stages_per_rank
    if _runs(spec, pipeline_parallel_size, batch_size):
        return batch_size, schedule, stages_per_rank
    return batch_size, "GPipe", 1


def default_microbatches(batch_size: int, pipeline_parallel_size: int, schedule: str) -> int | None:
    """The most micro-batches up to ``4 x stages`` that divide the batch (a smaller bubble; more, smaller
    micro-batches use an accelerator less well), at least the number of stages, and a count torch's ``schedule``
    runs (its :class:`~lightning_parallel.distributed.pipeline.schedule.ScheduleSpec`'s rules: a multiple of the
    pipeline size for the interleaved schedules, any count for ``ZBVZeroBubble``); ``None`` when no count
    qualifies."""
    spec = schedule_spec(schedule)
    stages = pipeline_parallel_size * spec.default_stages_per_rank
    for m in range(min(batch_size, 4 * stages), stages - 1, -1):
        if batch_size % m == 0 and _runs(spec, pipeline_parallel_size, m):
            return m
    return None


def _runs(spec: ScheduleSpec, pipeline_parallel_size: int, num_microbatches: int) -> bool:
    """Whether torch's schedule of ``spec`` runs ``num_microbatches`` on a ``pipeline_parallel_size`` pipeline."""
    error = spec.config_error(
        pipeline_parallel_size=pipeline_parallel_size,
        stages_per_rank=spec.default_stages_per_rank,
        num_microbatches=num_microbatches,
    )
    return error is None


def _assumptions(spec: ModelSpec, *, checkpointing: str, attention: str, seq_len_defaulted: bool) -> list[str]:
    kernel = (
        "flash (fused SDPA: no s^2 attention scores stored)"
        if attention == "flash"
        else "math (the s^2 attention probabilities stored, in fp32)"
    )
    notes = [
        "Bytes held and bytes per step are exact for our strategies (checked against ParallelismMonitor);"
        " activations count what autograd saves, tensor by tensor (equal to CPU measurements), plus the largest"
        " transient of backward (planner/activations.py).",
        f"Attention kernel: {kernel}; pass attention / --attention to change it.",
        "Pipelines: the most micro-batches up to 4 x stages that divide the batch and the schedule runs (unless"
        " num_microbatches is given).",
        "wire bytes = the most bytes one rank puts on the wire per step under ring collectives (2(N-1)/N of an"
        " all-reduce, (N-1)/N of a reduce-scatter or all-gather; P2P as sent).",
    ]
    if checkpointing == "full":
        notes.append(
            "Full activation checkpointing: each block keeps its input; backward recomputes one block at a time"
            " (~1/3 more compute: each block's forward runs twice)."
        )
    elif checkpointing == "selective":
        notes.append(
            "Selective activation checkpointing (torchtitan's per-op policy): each block keeps its input, every other"
            " matmul output and the attention output; the rest is recomputed in backward."
        )
    if spec.shape is None:
        notes.append("No transformer shape (no `transformer_shape()` hook): activations are not estimated ('?').")
    elif (
        seq_len_defaulted
        and spec.shape.default_seq_len is not None
        and spec.shape.default_seq_len < spec.shape.max_seq_len
    ):
        notes.append(
            f"seq_len defaults to {spec.shape.default_seq_len} tokens (min(max_position_embeddings,"
            f" {DEFAULT_SEQ_LEN_CAP}); the model takes up to {spec.shape.max_seq_len}); pass seq_len / --seq-len to"
            " plan another."
        )
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
