"""The planner's arithmetic: bytes held per rank and bytes communicated per step, per strategy and configuration.

Every formula mirrors what our strategies allocate and send, so ``tests/test_planner.py`` can require the numbers to
*equal* what :class:`~lightning_parallel.monitor.ParallelismMonitor` measures. Definitions and assumptions:

* Bytes held are tensor storages (each counted once) after an optimizer step: parameters, gradients, and the
  optimizer's per-element state (``exp_avg``/``exp_avg_sq`` for Adam(W), ``momentum_buffer`` for SGD with momentum;
  the 0-dim ``step`` counters are not counted). Optimizer state has the parameters' dtype.
* Precision: ``"32-true"`` and the ``*-mixed`` precisions keep the parameters' dtypes as the model built them (fp32,
  4 bytes, unless a layer was built in 16 bits; autocast only changes activations); ``"16-true"``/``"bf16-true"``
  store 2 bytes per element. The data-parallel, ZeRO-3 and pipeline (without ZeRO) estimates assume one dtype.
* Communication per step is the monitor's definition (:mod:`lightning_parallel.accounting`): the full buffer of
  each collective on this rank; ring wire bytes are ``2(N-1)/N`` of an all-reduce and ``(N-1)/N`` of a
  reduce-scatter or all-gather.
* Data parallel: everything replicated; one all-reduce of all gradients (DDP's buckets hold exactly the gradients).
* ZeRO-1/2 (ours): trainable parameters, in reverse registration order, fill flat buckets of ``bucket_cap_mb``, a
  new bucket at each change of dtype (the buckets' own :func:`.zero_layout.bucket_layout`);
  each bucket is padded to a multiple of N. Parameters: the padded buckets. Gradients: stage 1 keeps the padded
  full bucket (its reduced shard is rank r's slice of it: reduced in place), stage 2 the shard only. Optimizer
  state: only the elements of rank r's shard that are real parameters (the padding is never stepped). Per step: one
  reduce-scatter (an all-reduce on gloo, where it is faster) and one all-gather of every padded bucket, and one
  all-reduce of the "got a gradient" flags, one byte per parameter tensor (:data:`GRADIENT_FLAG_BYTES`).
* ZeRO with 16-bit parameters (``"bf16-true"``/``"16-true"``) keeps fp32 master weights by default
  (``ShardedOptimizerStrategy(master_weights="fp32")``; ``master_weights=False`` here models ``None``). Stages 1-2:
  parameters are the 2-byte padded buckets; gradients stage 1 the 2-byte full bucket plus a 4-byte reduced shard,
  stage 2 the 4-byte shard; optimizer state the 4-byte master shard (padding included) plus 4-byte state of the owned
  real elements (``12 Psi / N`` bytes for AdamW, ZeRO paper section 3.1); per step a 4-byte reduce-scatter and a
  2-byte all-gather of every padded bucket. Stage 3: the sharded parameters and gradients are the 4-byte masters and
  their 4-byte gradients, optimizer state 4 bytes; FSDP2 all-gathers 2-byte parameters and reduce-scatters 4-byte
  gradients.
* ZeRO-3 (FSDP2): every parameter is sharded on dim 0 into ``ceil(d0/N)``-row shards; each rank stores a padded
  shard (parameters) and a padded gradient shard per unit, while optimizer state follows the unpadded local rows
  (``torch.chunk``). Per step every unit is all-gathered in forward and reduce-scattered once; units are
  all-gathered again in backward (``reshard_after_forward=True``) except the root and the model it wraps
  (``UnitSpec.stays_gathered``).
* Pipeline p x dp: the split of ``PipelineParallelStrategy(partition="flops")`` (the partitioner itself is called,
  uneven stages and the per-rank refinement of several stages per rank included);
  each rank holds its stages' parameters, gradients and optimizer state. Per step every stage boundary sends the
  activations of the batch forward and their gradients backward (same shape, in the parameters' dtype: under
  autocast the residual stream between blocks stays fp32); replicas all-reduce their stage's gradients. Bubble:
  ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v*m+p-1)`` for interleaved 1F1B with v stages per rank
  (Narayanan et al., 2021). With ``zero_stage`` 1 or 2 (dp > 1) each stage's parameters are bucketed as ZeRO-1/2
  buckets them (:func:`planned_buckets` of the stage's parameters, each bucket padded to a multiple of dp) and the
  replicas reduce-scatter and all-gather them instead of the all-reduce: ZeRO-1/2's arithmetic per stage, over dp
  ranks (the all-reduce of tied-weight copies is not modelled there). With ``zero_stage=3`` (dp > 1) each stage's
  parameters are FSDP2-sharded over its dp replicas as ZeRO-3 shards them (padded shards of parameters and
  gradients, optimizer state of the unpadded local rows); every micro-batch all-gathers each parameter in forward
  and again in backward and reduce-scatters its gradient (FSDP2's traffic, which the monitor does not count under
  the pipeline), and tied copies all-reduce their local rows. Without it, a weight tied across stages (an
  embedding shared with the LM head) is held by every rank that runs a user of it, and those ranks all-reduce its
  gradient (plus one flag element per parameter) once a step (``distributed/pipeline/tied.py``).
* Activations (:mod:`.activations`): what autograd saves for backward, counted tensor by tensor for the model's
  transformer shape (grouped-query attention, gated or GELU MLP, RMSNorm or LayerNorm), the attention kernel
  (``"flash"``: no ``s^2`` scores stored; ``"math"``: the probabilities stored) and activation checkpointing
  (``"none"``, ``"selective"``: torchtitan's per-op policy, ``"full"``: every block recomputed), plus the largest
  transient of backward. Equal to the bytes measured on CPU (``tests/test_planner_activations.py``). A pipeline stage
  holds the activations of ``m`` micro-batches (GPipe) or ``min(m, p - pipeline_rank)`` (1F1B) of its own blocks,
  and recomputes one micro-batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_parallel.accounting import ring_wire_bytes
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.pipeline.balance import UnevenStages
from lightning_parallel.distributed.pipeline.layer_registration import resolve_pipeline_layers
from lightning_parallel.distributed.pipeline.schedule import schedule_spec
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tied import TiedLayout, find_tied_parameters
from lightning_parallel.distributed.zero.layout import BucketMember, bucket_layout, min_buckets, padded_numel
from lightning_parallel.planner.activations import activation_bytes
from lightning_parallel.planner.bubble import simulated_bubble
from lightning_parallel.planner.spec import ModelSpec, ParamSpec
from lightning_parallel.planner.tensor_parallel import split_parameters, split_shape, tensor_parallel_communication

__all__ = [
    "OPTIMIZER_STATES",
    "PRECISION_BYTES",
    "ConfigEstimate",
    "EstimateContext",
    "RankEstimate",
    "estimate_data_parallel",
    "estimate_pipeline",
    "estimate_zero3",
    "estimate_zero12",
    "pipeline_bubble",
    "planned_buckets",
    "zero_buckets",
]

OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2,
    "adam": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,
    "sgd_momentum": 1,
    "sgd": 1,
    "rmsprop": 1,
    "adagrad": 1,
    "sgd_no_momentum": 0,
}
"""Per-element state tensors per optimizer (``"sgd"`` means SGD with momentum, as the demo module uses)."""

PRECISION_BYTES: dict[str, tuple[int, int]] = {
    "32-true": (4, 4),
    "32": (4, 4),
    "bf16-mixed": (4, 2),
    "16-mixed": (4, 2),
    "bf16-true": (2, 2),
    "16-true": (2, 2),
}
"""Bytes per element of (parameters/gradients/optimizer state, activations) per Lightning precision."""


@dataclass
class RankEstimate:
    """Predicted bytes of one rank."""

    parameters: int
    gradients: int
    optimizer_state: int
    communication: dict[str, int]
    """Bytes per collective per training step (the monitor's definition)."""
    activations: int | None = None
    """Estimate (see the module docstring); ``None``: unknown for this model."""
    lent: int = 0
    """ZeRO with code that reads ``.grad`` every step (:attr:`EstimateContext.reads_gradients`): the bytes the loan of
    whole gradients holds between backward and the step (stage 1: none, it gathers into its full bucket; stages 2-3:
    the gradients' bytes). Not in :attr:`held` (gone after the step); after backward, so it peaks instead of the
    activations, not on top of them."""
    other_groups: list[tuple[str, int, int]] = field(default_factory=list)
    """Collectives counted in :attr:`communication` that run over another group than the configuration's
    data-parallel one, as ``(collective, bytes, group size)``: a pipeline's tied-weight all-reduce."""

    @property
    def held(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.held + max(self.activations or 0, self.lent)


@dataclass
class ConfigEstimate:
    """One strategy configuration: its predicted ranks and the line that selects it."""

    name: str
    strategy: str
    """What goes into ``Trainer(strategy=...)``: a registry name or a constructor call."""
    ranks: list[RankEstimate]
    bubble: float | None = None
    fits: bool | None = None
    notes: list[str] = field(default_factory=list)
    communication_complete: bool = True
    """False where some traffic could not be predicted (pipeline P2P of a model without an example input)."""
    checkpointing: str = "none"
    """The activation-checkpointing mode its activations assume (``"none"``, ``"selective"``, ``"full"``)."""
    peak: int | None = None
    """The peak bytes of live tensors one training step reached in the planner's dry run (``plan(dry_run=True)``,
    :mod:`lightning_parallel.planner.dry_run`); ``None``: not dry-run, :attr:`max_total` is the formula's total."""

    @property
    def max_total(self) -> int:
        """The bytes a rank needs: the dry run's peak where there is one, else the formula's worst rank total."""
        if self.peak is not None:
            return self.peak
        return max(r.total for r in self.ranks)

    def wire_bytes(self, world_size: int) -> float:
        """The most bytes one rank puts on the wire per step under ring algorithms."""
        group = world_size
        if self.name.startswith("pipeline"):
            group = world_size // int(self.name.split("pp=")[1].split(",")[0])
        elif " shard=" in self.name:  # hybrid ZeRO: the shard group; the replica all-reduce is in `other_groups`
            group = int(self.name.split("shard=")[1])
        return max(_rank_wire_bytes(r, group) for r in self.ranks)


def _rank_wire_bytes(rank: RankEstimate, group: int) -> float:
    other = {kind: 0 for kind in rank.communication}
    for kind, num_bytes, _ in rank.other_groups:
        other[kind] += num_bytes
    wire = sum(ring_wire_bytes(kind, v - other[kind], group) for kind, v in rank.communication.items())
    return wire + sum(ring_wire_bytes(kind, num_bytes, size) for kind, num_bytes, size in rank.other_groups)


@dataclass(frozen=True)
class EstimateContext:
    """The inputs every estimate shares."""

    spec: ModelSpec
    world_size: int
    state_count: int
    """Per-element optimizer state tensors (:data:`OPTIMIZER_STATES`)."""
    element_bytes: int
    """Bytes per parameter / gradient / optimizer-state element."""
    activation_bytes: int
    """Bytes per activation element."""
    batch_size: int
    """Samples per batch of one data-parallel replica (what its dataloader yields)."""
    seq_len: int
    checkpointing: str = "none"
    """Activation checkpointing: ``"none"``, ``"selective"`` (torchtitan's per-op policy: the strategies'
    ``activation_checkpointing="selective"``) or ``"full"`` (every transformer block recomputed in backward: the
    strategies' ``activation_checkpointing=True``)."""
    attention: str = "flash"
    """The attention kernel: ``"flash"`` (fused; no scores stored) or ``"math"`` (the ``s^2`` probabilities stored)."""
    gradient_reduction: str = "reduce_scatter"
    """How ZeRO-1/2 average their gradient buckets: ``"reduce_scatter"`` (NCCL) or ``"all_reduce"`` (gloo: each rank
    keeps its slice). ZeRO-3 reduce-scatters on both."""
    reads_gradients: bool = False
    """Code reads a parameter's ``.grad`` between backward and the step on every step (a gradient-norm logger): ZeRO
    then lends the whole gradients each step (:func:`_zero_loan`). A hook that reads on a few steps costs this on those
    steps only."""


def _activations(
    ctx: EstimateContext,
    *,
    blocks: float,
    samples: float,
    with_head: bool,
    with_embedding: bool = True,
    recompute_samples: float | None = None,
    batches: int = 1,
    tensor_parallel_size: int = 1,
) -> int | None:
    """Peak activation bytes (:func:`.activations.activation_bytes`); ``None`` without a transformer shape. Under
    tensor parallelism, of the shape one tensor rank computes (:func:`.tensor_parallel.split_shape`)."""
    shape = ctx.spec.shape
    if shape is None:
        return None
    if tensor_parallel_size > 1:
        shape = split_shape(shape, tensor_parallel_size)
    return activation_bytes(
        shape,
        seq_len=ctx.seq_len,
        samples=samples,
        blocks=blocks,
        stream_bytes=ctx.element_bytes,
        compute_bytes=ctx.activation_bytes,
        attention=ctx.attention,
        checkpointing=ctx.checkpointing,
        with_embedding=with_embedding,
        with_head=with_head,
        recompute_samples=recompute_samples,
        batches=batches,
    ).peak


_CHECKPOINTING_ARGUMENTS = {"none": "", "full": "activation_checkpointing=True",
                            "selective": 'activation_checkpointing="selective"'}  # fmt: skip
"""The strategies' ``activation_checkpointing`` argument for each planner mode ("" for none)."""


def _strategy_line(ctx: EstimateContext, registry_name: str, constructor: str, args: str = "") -> str:
    """The ``Trainer(strategy=...)`` value: the registry name, or the constructor call with checkpointing on."""
    checkpointing = _CHECKPOINTING_ARGUMENTS[ctx.checkpointing]
    if not checkpointing:
        return f'"{registry_name}"'
    return f"{constructor}({args}{', ' if args else ''}{checkpointing})"


def estimate_data_parallel(ctx: EstimateContext) -> ConfigEstimate:
    numel = ctx.spec.num_parameters
    e = ctx.element_bytes
    comm = {"all_reduce": numel * e} if ctx.world_size > 1 else {}
    layers = ctx.spec.shape.num_layers if ctx.spec.shape else 0
    act = _activations(ctx, blocks=layers, samples=ctx.batch_size, with_head=True)
    rank = RankEstimate(numel * e, numel * e, ctx.state_count * numel * e, comm, act)
    strategy = _strategy_line(ctx, "data_parallel", "DataParallelStrategy")
    return ConfigEstimate("data_parallel", strategy, [rank] * ctx.world_size)


@dataclass(frozen=True)
class PlannedBucket:
    """One ZeRO-1/2 flat bucket as ``ShardedParameterBuckets`` builds it."""

    numel: int
    """Elements before padding."""
    element_size: int
    """Bytes per element of its parameters (one dtype per bucket)."""


def trained_element_size(param: ParamSpec, element_bytes: int) -> int:
    """Bytes per element of ``param`` in training: a 16-bit ``"*-true"`` precision (``element_bytes`` 2) converts every
    parameter (Lightning's ``HalfPrecision.convert_module``); 32-bit and mixed precisions keep the dtype the model was
    built with (a bf16 layer stays bf16 beside fp32 ones)."""
    if element_bytes < MASTER_BYTES or param.element_size is None:
        return element_bytes
    return param.element_size


def planned_buckets(spec: ModelSpec, *, element_bytes: int, bucket_cap_mb: float, stage: int) -> list[PlannedBucket]:
    """The flat buckets ``ShardedParameterBuckets`` builds at ZeRO ``stage``, in bucket order: the same
    :func:`bucket_layout` over the parameters in reverse registration order, a bucket per dtype run."""
    sizes = [trained_element_size(param, element_bytes) for param in reversed(spec.params)]
    numels = [param.numel for param in reversed(spec.params)]
    members = [BucketMember(numel, size, size) for numel, size in zip(numels, sizes, strict=True)]
    return [
        PlannedBucket(sum(numels[i] for i in indices), sizes[indices[0]])
        for indices in bucket_layout(members, bucket_cap_mb=bucket_cap_mb, min_buckets=min_buckets(stage))
    ]


def zero_buckets(spec: ModelSpec, *, element_bytes: int, bucket_cap_mb: float, stage: int) -> list[int]:
    """Element counts of the flat buckets ``ShardedParameterBuckets`` builds at ZeRO ``stage`` (before padding), in
    bucket order."""
    planned = planned_buckets(spec, element_bytes=element_bytes, bucket_cap_mb=bucket_cap_mb, stage=stage)
    return [bucket.numel for bucket in planned]


GRADIENT_FLAG_BYTES = 1
"""ZeRO-1/2's "got a gradient" flag: one ``uint8`` per bucketed parameter, all-reduced at every gradient sync
(``ShardedParameterBuckets.finish_gradient_sync``), so unused parameters are not stepped."""


def _zero_communication(
    ctx: EstimateContext, num_params: int, *, ranks: int, reduced: int, gathered: int
) -> dict[str, int]:
    """Bytes per step of ZeRO-1/2 sharded over ``ranks``: the gradient buckets (``reduced`` bytes, reduce-scattered,
    or all-reduced as ``ctx.gradient_reduction`` says), the parameter buckets (``gathered`` bytes, all-gathered) and
    the flags of ``num_params`` parameters (all-reduced, :data:`GRADIENT_FLAG_BYTES` each). One rank communicates
    nothing: its "collectives" are copies, and none is counted."""
    if ranks <= 1:
        return {}
    comm = {ctx.gradient_reduction: reduced, "all_gather": gathered}
    comm["all_reduce"] = comm.get("all_reduce", 0) + num_params * GRADIENT_FLAG_BYTES
    return comm


MASTER_BYTES = 4
"""Bytes per element of ZeRO's master weights, their gradients (reduced in fp32) and optimizer state."""


def _zero_loan(ctx: EstimateContext, comm: dict[str, int], *, gathered: int, flags: int, ranks: int) -> None:
    """A step whose code reads ``.grad`` (``distributed/zero/gradient_loan.py``), when ``ctx.reads_gradients``: add to
    ``comm`` the loan's all-gather of ``gathered`` bytes (the whole gradients: stages 1-2 the padded buckets in the
    parameters' dtype, stage 3 each gradient in its shards' dtype) and its all-reduce of ``flags`` bytes (stages
    1-2: which parameters have a gradient). One rank lends nothing it does not hold."""
    if not ctx.reads_gradients or ranks <= 1:
        return
    comm["all_gather"] = comm.get("all_gather", 0) + gathered
    if flags:
        comm["all_reduce"] = comm.get("all_reduce", 0) + flags


def _keeps_master(ctx: EstimateContext, master_weights: bool | None) -> bool:
    """Whether ZeRO keeps fp32 master weights: only of 16-bit parameters, and unless ``master_weights=False``."""
    return master_weights is not False and ctx.element_bytes < MASTER_BYTES


def estimate_zero12(
    ctx: EstimateContext,
    *,
    stage: int,
    bucket_cap_mb: float,
    master_weights: bool | None = None,
    shard_size: int | None = None,
) -> ConfigEstimate:
    """ZeRO-1/2 (ours). ``master_weights``: fp32 masters of 16-bit parameters; ``None``: when they are 16-bit.
    ``shard_size``: hybrid sharding over groups of that many ranks (``None``: every rank); each rank then also
    all-reduces its reduced gradient shards across the replica groups (the flags travel once, over every
    data-parallel rank: the host group, ``distributed/host_groups.py``)."""
    layout = MeshLayout.for_sharding(ctx.world_size, shard_size)
    n = layout.shard_size
    ranks = []
    buckets = planned_buckets(ctx.spec, element_bytes=ctx.element_bytes, bucket_cap_mb=bucket_cap_mb, stage=stage)
    layers = ctx.spec.shape.num_layers if ctx.spec.shape else 0
    act = _activations(ctx, blocks=layers, samples=ctx.batch_size, with_head=True)
    num_params = len(ctx.spec.params)
    for rank in range(ctx.world_size):
        params, grads, optimizer, comm = _zero_sharded(
            ctx, buckets, num_params, stage=stage, rank=layout.shard_rank(rank), ranks=n, master_weights=master_weights
        )
        shard_bytes = _reduced_shard_bytes(buckets, n, master_weights)
        across = _across_replicas(comm, layout, shard_bytes)
        whole = sum(padded_numel(bucket.numel, n) * bucket.element_size for bucket in buckets)
        _zero_loan(ctx, comm, gathered=whole, flags=num_params * GRADIENT_FLAG_BYTES, ranks=n)
        lent = whole if ctx.reads_gradients and n > 1 and stage == 2 else 0  # stage 1 gathers into its full bucket
        ranks.append(RankEstimate(params, grads, optimizer, comm, act, lent=lent, other_groups=across))
    return ConfigEstimate(*_zero_name(ctx, stage, shard_size, layout), ranks)


def _zero_name(ctx: EstimateContext, stage: int, shard_size: int | None, layout: MeshLayout) -> tuple[str, str]:
    """The configuration's name and strategy line: ``zero2``, or ``zero2 shard=4`` under hybrid sharding."""
    if shard_size is None or shard_size == ctx.world_size:
        return f"zero{stage}", _strategy_line(ctx, f"zero{stage}", "ShardedOptimizerStrategy", f"stage={stage}")
    checkpointing = f", {_CHECKPOINTING_ARGUMENTS[ctx.checkpointing]}" if ctx.checkpointing != "none" else ""
    strategy = f"ShardedOptimizerStrategy(stage={stage}, shard_size={shard_size}{checkpointing})"
    return f"zero{stage} shard={layout.shard_size}", strategy


def _across_replicas(comm: dict[str, int], layout: MeshLayout, num_bytes: int) -> list[tuple[str, int, int]]:
    """Hybrid sharding: add the all-reduce of ``num_bytes`` across the replica groups to ``comm`` and return it as
    the one collective over another group than the shard group (for :meth:`ConfigEstimate.wire_bytes`)."""
    if layout.replicate_size == 1:
        return []
    comm["all_reduce"] = comm.get("all_reduce", 0) + num_bytes
    return [("all_reduce", num_bytes, layout.replicate_size)]


def estimate_zero3(
    ctx: EstimateContext,
    *,
    master_weights: bool | None = None,
    shard_size: int | None = None,
    tensor_parallel_size: int = 1,
) -> ConfigEstimate:
    """ZeRO-3 (FSDP2). ``master_weights``: fp32 sharded masters of 16-bit parameters; ``None``: when 16-bit.
    ``shard_size``: HSDP over groups of that many ranks (``None``: every rank); each unit's reduced gradient shard
    is then all-reduced across the replica groups. ``tensor_parallel_size``: the layers of the model's
    tensor-parallel plan split over that many ranks first (:mod:`.tensor_parallel`: local shapes, their
    collectives over the tensor group, the split layers' activations), ZeRO-3 over the remaining data axes."""
    t = tensor_parallel_size
    layout = MeshLayout.for_sharding(ctx.world_size, shard_size, tensor_parallel_size=t)
    n, e = layout.shard_size, ctx.element_bytes
    compute = e  # bytes per element all-gathered for compute
    if _keeps_master(ctx, master_weights):
        e = MASTER_BYTES  # the shards, their gradients (reduced in fp32) and the optimizer state
    params = ctx.spec.params if t == 1 else split_parameters(ctx.spec, t)
    rows = [p.shape[0] if p.shape else 1 for p in params]
    row_numel = [p.numel // d0 if d0 else 0 for p, d0 in zip(params, rows, strict=True)]
    padded_shard = [-(-d0 // n) * rn for d0, rn in zip(rows, row_numel, strict=True)]
    units = ctx.spec.units
    notes = []
    if units is None:
        from lightning_parallel.planner.spec import UnitSpec

        units = [UnitSpec(params=tuple(range(len(params))), stays_gathered=False)]
        notes.append("FSDP2 units unknown: one unit gathered in forward and backward assumed.")
    gather = sum((1 if u.stays_gathered else 2) * n * sum(padded_shard[i] for i in u.params) for u in units)
    scatter = sum(n * sum(padded_shard[i] for i in u.params) for u in units)
    # A reduce-scatter on every backend (on gloo built from point-to-point sends: `distributed/zero/stage3_gloo.py`).
    comm = {"all_gather": gather * compute, "reduce_scatter": scatter * e}
    across = _across_replicas(comm, layout, scatter // n * e)  # each unit's reduced shard
    whole = sum(p.numel for p in params) * e  # each `DTensor` gradient gathered whole
    _zero_loan(ctx, comm, gathered=whole, flags=0, ranks=n)
    lent = whole if ctx.reads_gradients and n > 1 else 0
    layers = ctx.spec.shape.num_layers if ctx.spec.shape else 0
    act = _activations(ctx, blocks=layers, samples=ctx.batch_size, with_head=True, tensor_parallel_size=t)
    if t > 1:
        tokens = ctx.batch_size * ctx.seq_len
        split = tensor_parallel_communication(ctx.spec, tokens=tokens, element_bytes=ctx.activation_bytes)
        for kind, num_bytes in split.items():
            comm[kind] = comm.get(kind, 0) + num_bytes
            across.append((kind, num_bytes, t))
    ranks = []
    for rank in range(ctx.world_size):
        r = layout.shard_rank(rank)
        chunk = [-(-d0 // n) for d0 in rows]
        local = sum(max(0, min(c, d0 - r * c)) * rn for c, d0, rn in zip(chunk, rows, row_numel, strict=True))
        held = sum(padded_shard) * e
        ranks.append(
            RankEstimate(held, held, ctx.state_count * local * e, dict(comm), act, lent=lent, other_groups=across)
        )
    name, strategy = _zero_name(ctx, 3, shard_size, layout)
    if t > 1:
        sharding = f", shard_size={layout.shard_size}" if layout.replicate_size > 1 else ""
        checkpointing = f", {_CHECKPOINTING_ARGUMENTS[ctx.checkpointing]}" if ctx.checkpointing != "none" else ""
        name = f"{name} tp={t}"
        strategy = f"ShardedOptimizerStrategy(stage=3{sharding}, tensor_parallel_size={t}{checkpointing})"
    return ConfigEstimate(name, strategy, ranks, notes=notes)


def pipeline_bubble(
    schedule: str, *, pipeline_parallel_size: int, num_microbatches: int, stages_per_rank: int
) -> float:
    """Idle fraction of a pipeline step, from torch's own order of the schedule's actions played with unit costs
    (:func:`~lightning_parallel.planner.bubble.simulated_bubble`): ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
    ``(p-1)/(v*m+p-1)`` for the interleaved and looped ones, ``(p-1)/(3*v*m+p-1)`` for the zero-bubble and V-shaped
    ones (their weight gradients fill the bubble) in torch 2.13's orders."""
    return simulated_bubble(
        schedule,
        pipeline_parallel_size=pipeline_parallel_size,
        num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
    )


def estimate_pipeline(
    ctx: EstimateContext,
    *,
    pipeline_parallel_size: int,
    num_microbatches: int | None,
    schedule: str,
    stages_per_rank: int,
    zero_stage: int = 0,
    bucket_cap_mb: float = 25.0,
    uneven: UnevenStages | None = None,
) -> ConfigEstimate:
    """``PipelineParallelStrategy``; ``zero_stage`` 1 or 2 shards each stage's optimizer state (and gradients) over
    its dp replicas as ZeRO-1/2 does, 3 its parameters, gradients and optimizer state as ZeRO-3 (FSDP2) does
    (nothing is sharded at dp = 1). ``uneven``: the strategy's ``first_stage_fewer_layers`` /
    ``last_stage_fewer_layers`` (every per-rank number follows the resulting stage plan)."""
    p, v, n, e = pipeline_parallel_size, stages_per_rank, ctx.world_size, ctx.element_bytes
    layout = MeshLayout(n, pipeline_parallel_size=p)  # the strategy's mesh: replicas x pipeline ranks
    dp = layout.data_parallel_size
    num_stages = p * v
    m = num_microbatches or num_stages
    plan = ctx.spec.stage_plan(
        num_stages=num_stages,
        pipeline_parallel_size=p,
        batch_size=ctx.batch_size,
        seq_len=ctx.seq_len,
        placement=schedule_spec(schedule).placement,  # which rank holds each stage: the schedule's, as in the strategy
        uneven=uneven,
    )
    numels = ctx.spec.layer_numels()
    outputs = ctx.spec.layer_output_numels(ctx.batch_size, ctx.seq_len)
    boundary = None
    if outputs is not None:  # bytes leaving stage s forward (= its output gradient coming back), whole batch
        boundary = [outputs[plan.layers_of(s)[-1]] * e for s in range(num_stages)]
    in_flight = m if schedule.lower() == "gpipe" else None
    tied_sync = _tied_sync(ctx, plan)
    ranks = []
    for r in range(n):
        pr = layout.pipeline_rank(r)
        stages = plan.stages_of(pr)
        local = sum(numels[i] for s in stages for i in plan.layers_of(s))
        comm: dict[str, int] = {}
        if boundary is not None:
            # A boundary between two stages of one rank (the tip of a V) passes its tensors locally: no P2P.
            sends = sum(boundary[s] for s in stages if s < num_stages - 1 and plan.rank_of_stage(s + 1) != pr)
            sends += sum(boundary[s - 1] for s in stages if s > 0 and plan.rank_of_stage(s - 1) != pr)
            comm = {"send": sends, "recv": sends} if sends else {}
        held, sharded, others = _stage_sharding(
            ctx, plan, stages, zero_stage=zero_stage, rank=r, layout=layout, bucket_cap_mb=bucket_cap_mb, m=m
        )
        if held is None:  # nothing sharded: the whole stage; replicas all-reduce its gradients
            held = (local * e, local * e, ctx.state_count * local * e)
            sharded = {"all_reduce": local * e} if dp > 1 else {}
            others = tied_sync.get(pr, [])
        comm.update(sharded)
        for kind, num_bytes, _ in others:
            comm[kind] = comm.get(kind, 0) + num_bytes
        blocks = _blocks_in(ctx, plan, stages)
        flight = in_flight if in_flight is not None else min(m, p - pr)
        has_head = (num_stages - 1) in stages
        act = _activations(
            ctx,
            blocks=blocks,
            samples=ctx.batch_size / m * flight,
            with_head=has_head,
            with_embedding=0 in stages,
            recompute_samples=ctx.batch_size / m,
            batches=flight,
        )
        ranks.append(RankEstimate(held[0], held[1], held[2], comm, act, other_groups=others))
    name = (
        f"pipeline pp={p}, dp={dp}"
        + (f", v={v}" if v > 1 else "")
        + (f", zero{zero_stage}" if zero_stage and dp > 1 else "")
    )
    args = f"pipeline_parallel_size={p}, num_microbatches={m}, schedule={schedule!r}"
    if zero_stage:
        args += f", zero_stage={zero_stage}"
    if uneven is not None and not uneven.is_even:
        args += f", first_stage_fewer_layers={uneven.first_stage_fewer_layers}"
        args += f", last_stage_fewer_layers={uneven.last_stage_fewer_layers}"
    if ctx.checkpointing != "none":
        args += f", {_CHECKPOINTING_ARGUMENTS[ctx.checkpointing]}"
    bubble = pipeline_bubble(schedule, pipeline_parallel_size=p, num_microbatches=m, stages_per_rank=v)
    notes = [] if boundary is not None else [
        "stage boundary sizes unknown (no example input): P2P bytes not predicted; set the module's"
        " `example_input_array` to predict them."
    ]  # fmt: skip
    return ConfigEstimate(
        name,
        f"PipelineParallelStrategy({args})",
        ranks,
        bubble=bubble,
        notes=notes,
        communication_complete=boundary is not None,
    )


def _stage_sharding(
    ctx: EstimateContext,
    plan: StagePlan,
    stages: list[int],
    *,
    zero_stage: int,
    rank: int,
    layout: MeshLayout,
    bucket_cap_mb: float,
    m: int,
) -> tuple[tuple[int, int, int] | None, dict[str, int], list[tuple[str, int, int]]]:
    """The pipeline's ZeRO on ``rank`` (stages ``stages``): bytes of parameters, gradients and optimizer state, the
    sharding's communication per step, and the collectives over other groups (tied copies); ``None`` bytes when
    nothing is sharded (``zero_stage=0`` or one replica)."""
    dp = layout.data_parallel_size
    if dp == 1 or not zero_stage:
        return None, {}, []
    stage_spec = _stage_spec(ctx, plan, stages)
    if zero_stage == 3:
        shard = (layout.replicate_rank(rank), dp)
        *held, comm = _fully_sharded(ctx, stage_spec, shard=shard, num_microbatches=m)
        others = _tied_sync(ctx, plan, shard=shard).get(layout.pipeline_rank(rank), [])
        return (held[0], held[1], held[2]), comm, others
    buckets = planned_buckets(
        stage_spec, element_bytes=ctx.element_bytes, bucket_cap_mb=bucket_cap_mb, stage=zero_stage
    )
    # Not modelled yet: the fp32 masters `PipelineParallelStrategy(master_weights="fp32")` keeps under bf16-true.
    params, grads, state, comm = _zero_sharded(
        ctx,
        buckets,
        len(stage_spec.params),
        stage=zero_stage,
        rank=layout.data_parallel_rank(rank),
        ranks=dp,
        master_weights=False,
    )
    return (params, grads, state), comm, []  # the tied copies' all-reduce is not modelled under ZeRO-1/2


def _tied_sync(
    ctx: EstimateContext, plan: StagePlan, *, shard: tuple[int, int] | None = None
) -> dict[int, list[tuple[str, int, int]]]:
    """Per pipeline rank, the all-reduces that sum the gradients of its tied-parameter copies, as ``("all_reduce",
    bytes, group size)``: one flat buffer per set of ranks sharing copies, holding the gradients and one flag element
    per parameter (``TiedGradientSync``). ``shard=(replica, dp)``: ZeRO-3's copies, of which a replica sums its rows."""
    module = ctx.spec.module
    assert module is not None
    key = ("tied",)
    if key not in ctx.spec._cache:  # the same for every configuration: found once per model
        ctx.spec._cache[key] = tuple(find_tied_parameters(module, resolve_pipeline_layers(module)))
    layout = TiedLayout(ctx.spec._cache[key], plan)
    numel = {p.name: p.numel if shard is None else _local_rows(p, *shard) for p in ctx.spec.params}
    sync: dict[int, list[tuple[str, int, int]]] = {}
    for ranks, names in layout.rank_sets().items():
        num_bytes = (sum(numel[n] for n in names) + len(names)) * ctx.element_bytes
        for rank in ranks:
            sync.setdefault(rank, []).append(("all_reduce", num_bytes, len(ranks)))
    return sync


def _local_rows(param: ParamSpec, rank: int, ranks: int) -> int:
    """Elements of ``param`` that FSDP2's rank ``rank`` of ``ranks`` holds, unpadded: its ``torch.chunk`` of dim 0."""
    rows = param.shape[0] if param.shape else 1
    chunk = -(-rows // ranks)
    return max(0, min(chunk, rows - rank * chunk)) * (param.numel // rows if rows else 0)


def _fully_sharded(
    ctx: EstimateContext, stage: ModelSpec, *, shard: tuple[int, int], num_microbatches: int
) -> tuple[int, int, int, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state, and FSDP2's communication per step, of replica
    ``shard[0]`` of ``shard[1]`` when ``stage``'s parameters are sharded as the pipeline's ZeRO-3 shards them (no
    fp32 masters: those the strategy keeps under bf16-true are not modelled yet)."""
    rank, ranks = shard
    e = ctx.element_bytes
    padded = sum(-(-(p.shape[0] if p.shape else 1) // ranks) * _row_numel(p) for p in stage.params)
    local = sum(_local_rows(p, rank, ranks) for p in stage.params)
    # Per micro-batch: every unit gathered for forward and again for backward (resharded after forward), its
    # gradients reduce-scattered once (the stage module is no FSDPModule: no gradient sync is deferred).
    comm = {
        "all_gather": 2 * num_microbatches * ranks * padded * e,
        "reduce_scatter": num_microbatches * ranks * padded * e,
    }
    return padded * e, padded * e, ctx.state_count * local * e, comm


def _row_numel(param: ParamSpec) -> int:
    rows = param.shape[0] if param.shape else 1
    return param.numel // rows if rows else 0


def _stage_spec(ctx: EstimateContext, plan: object, stages: list[int]) -> ModelSpec:
    """The trainable parameters these stages hold, in the module's ``named_parameters()`` order (the split module's
    order, which its ZeRO buckets follow)."""
    key = ("stage", tuple(tuple(plan.layers_of(s)) for s in stages))  # type: ignore[attr-defined]
    if key not in ctx.spec._cache:  # the same for every configuration with these layers
        ctx.spec._cache[key] = _build_stage_spec(ctx, plan, stages)
    return ctx.spec._cache[key]


def _build_stage_spec(ctx: EstimateContext, plan: object, stages: list[int]) -> ModelSpec:
    module = ctx.spec.module
    assert module is not None
    layers = resolve_pipeline_layers(module)
    local = {id(q) for s in stages for i in plan.layers_of(s) for q in layers[i].parameters()}  # type: ignore[attr-defined]
    named = module.named_parameters()
    return ModelSpec(
        ctx.spec.name,
        [ParamSpec(n, tuple(q.shape), q.element_size()) for n, q in named if id(q) in local and q.requires_grad],
    )


def _zero_sharded(
    ctx: EstimateContext,
    buckets: list[PlannedBucket],
    num_params: int,
    *,
    stage: int,
    rank: int,
    ranks: int,
    master_weights: bool | None,
) -> tuple[int, int, int, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state, and communication per step, of ``rank`` when ``buckets``
    (of ``num_params`` parameters) are sharded over ``ranks`` by ZeRO-1/2. Each bucket of 16-bit parameters keeps an
    fp32 master shard unless ``master_weights`` is ``False``; its gradients are then reduced in fp32 into an fp32
    shard and its optimizer state is fp32."""
    params = grads = optimizer = reduced = gathered = 0
    for bucket in buckets:
        e = bucket.element_size
        master = master_weights is not False and e < MASTER_BYTES
        g = MASTER_BYTES if master else e  # the reduced gradient shard and the optimizer state
        padded = padded_numel(bucket.numel, ranks)
        shard = padded // ranks
        owned = max(0, min(bucket.numel, (rank + 1) * shard) - rank * shard)  # the padding is never stepped
        params += padded * e
        # Stage 1 reduces in place into its full bucket unless the shard is an fp32 copy beside a 16-bit bucket.
        grads += padded * e + (shard * g if master else 0) if stage == 1 else shard * g
        optimizer += ctx.state_count * owned * g + (shard * MASTER_BYTES if master else 0)
        reduced += padded * g
        gathered += padded * e
    comm = _zero_communication(ctx, num_params, ranks=ranks, reduced=reduced, gathered=gathered)
    return params, grads, optimizer, comm


def _reduced_shard_bytes(buckets: list[PlannedBucket], ranks: int, master_weights: bool | None) -> int:
    """Bytes of one rank's reduced gradient shards of ``buckets`` sharded over ``ranks`` (fp32 for a 16-bit bucket
    with master weights), as :func:`_zero_sharded` counts them."""
    total = 0
    for bucket in buckets:
        master = master_weights is not False and bucket.element_size < MASTER_BYTES
        total += padded_numel(bucket.numel, ranks) // ranks * (MASTER_BYTES if master else bucket.element_size)
    return total


def _blocks_in(ctx: EstimateContext, plan: object, stages: list[int]) -> float:
    """Transformer blocks held by these stages (:meth:`TransformerShape.is_block` of their pipeline layers)."""
    shape = ctx.spec.shape
    if shape is None:
        return 0.0
    layers = [i for s in stages for i in plan.layers_of(s)]  # type: ignore[attr-defined]
    return float(sum(1 for i in layers if shape.is_block(i)))
