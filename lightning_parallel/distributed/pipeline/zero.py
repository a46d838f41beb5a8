"""ZeRO inside the pipeline: each stage held by the ZeRO backends ``ShardedOptimizerStrategy`` runs.

Torch-only. A stage's replicas sit on the mesh's data axes: ``shard`` (the ranks ZeRO shards the stage over) and
``replicate`` (hybrid sharding: shard groups holding the same shards). Stages 1-2 are
:class:`~lightning_parallel.distributed.zero.backends.FlatBucketBackend`, built from the same
:class:`~lightning_parallel.distributed.zero.config.ZeroConfig` (bucket cap, fp32 master weights of 16-bit
parameters, overlapped parameter gather, hybrid sharding) with the pipeline's extension points
(:class:`~lightning_parallel.distributed.zero.backends.StageExtensions`):

* No backward hooks: torch's schedules accumulate each micro-batch's gradient into ``.grad`` (the zero-bubble
  schedules outside autograd's accumulation, where a hook would not fire), so the backend takes the gradients into
  its buckets once the schedule finished, then reduce-scatters them: the same bytes as the replicas' all-reduce.
* Tied parameters (``tied.py``): after the reduction, the copies' shards are summed over the pipeline ranks holding a
  copy. The copies sit in different buckets on different stages, so a replica owns different slices of each; every
  owner in the first replica group writes its slice into a zero tensor of the parameter's size, and one all-reduce
  over every replica of the ranks sharing the copy sums the copies' averaged gradients (each element has one
  non-zero term per copy, so the sum is exact and every member gets the same bits: the copies stay bitwise equal).
* Clipping: the shards' squares summed over the ``shard`` group, then over the ``pp`` group; the copies of a tied
  weight counted once.

Per rank (``N`` shard ranks, a stage of ``P`` parameters, AdamW in fp32): optimizer state ``8P/N`` (exactly, when
each bucket's size is a multiple of ``N``), gradients ``P`` (stage 1) or ``P/N`` (stage 2) after the step,
parameters whole (the flat buckets, with their padding); docs/zero.md's formulas with the stage's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.accounting import MemoryReport
from lightning_parallel.choices import check_choice, choices_of
from lightning_parallel.distributed.pipeline.consolidate import WholeOptimizerState, local_optimizer_state
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.schedule import SCHEDULE_SPECS, schedule_spec
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.sync import ReplicatedSync, SyncContext
from lightning_parallel.distributed.pipeline.tied import TiedLayout, TiedParameter
from lightning_parallel.distributed.zero.backends import (
    FlatBucketBackend,
    MasterWeightBackend,
    StageExtensions,
    ZeroContext,
)
from lightning_parallel.distributed.zero.config import MasterWeights, OverlapParamGather, ZeroConfig
from lightning_parallel.distributed.zero.flat_bucket import ShardView

__all__ = [
    "ZERO_STAGES",
    "FlatBucketSync",
    "PipelineZeroStage",
    "TiedShardSum",
    "check_no_tie_within_a_rank",
    "pipeline_zero_config",
]

PipelineZeroStage = Literal[0, 1, 2, 3]
"""``PipelineParallelStrategy(zero_stage=...)``: 0 (off), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters,
with FSDP2: :mod:`.fully_shard`)."""

ZERO_STAGES: tuple[int, ...] = choices_of(PipelineZeroStage)

_ZERO_ONLY_DEFAULTS = {"shard_size": None, "bucket_cap_mb": 25.0, "overlap_param_gather": "auto"}
"""The ZeRO options that mean nothing without ZeRO, at their defaults (``master_weights`` has effect only under ZeRO
too, but its default is kept whatever the stage)."""


def pipeline_zero_config(
    zero_stage: Any,
    *,
    shard_size: int | None = None,
    bucket_cap_mb: float = 25.0,
    master_weights: MasterWeights = "fp32",
    overlap_param_gather: OverlapParamGather = "auto",
    checkpoint_format: str = "consolidated",
    schedule: str | None = None,
) -> ZeroConfig | None:
    """Local, the same verdict on every rank. The ZeRO settings of ``PipelineParallelStrategy``, validated as
    ``ShardedOptimizerStrategy`` validates them (the same :class:`ZeroConfig`, the same messages); ``None`` for
    ``zero_stage=0``.

    The sharded checkpoint format writes each replica's slice of whole parameters and optimizer state; with ZeRO-1/2
    the optimizer state is sharded by bucket instead, which that writer does not know, so it is refused up front
    (stage 3 writes FSDP2's rows of each tensor, which the format holds). Stage 3 refuses the zero-bubble schedule:
    it computes weight gradients outside autograd's backward, where FSDP2's hooks reduce them.

    Raises:
        ValueError: naming the bad value and the fix.
    """
    check_choice(
        "zero_stage",
        zero_stage,
        PipelineZeroStage,
        notes={
            0: "no sharding",
            1: "optimizer state sharded across each stage's data-parallel replicas",
            2: "+ gradients",
            3: "+ parameters",
        },
    )
    config = ZeroConfig(  # validates the options whatever the stage
        stage=zero_stage or 1,
        shard_size=shard_size,
        bucket_cap_mb=bucket_cap_mb,
        master_weights=master_weights,
        overlap_param_gather=overlap_param_gather,
    )
    if zero_stage == 0:
        given = {"shard_size": shard_size, "bucket_cap_mb": bucket_cap_mb, "overlap_param_gather": overlap_param_gather}
        changed = [f"`{name}={value!r}`" for name, value in given.items() if value != _ZERO_ONLY_DEFAULTS[name]]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} shards or buckets ZeRO's state, but `zero_stage=0` shards nothing. Pass"
                " `zero_stage=1`, 2 or 3, or leave the option at its default."
            )
        return None
    if zero_stage in (1, 2) and checkpoint_format == "sharded":
        raise ValueError(
            f"`zero_stage={zero_stage}` with `checkpoint_format='sharded'` is not supported: the sharded writer"
            " does not know ZeRO-1/2's bucketed optimizer shards. Use `checkpoint_format='consolidated'` (the"
            " default; loadable under any layout), `zero_stage=0` or `zero_stage=3`."
        )
    if zero_stage == 3 and schedule is not None and schedule_spec(schedule).splits_backward:
        others = ", ".join(repr(name) for name, spec in SCHEDULE_SPECS.items() if not spec.splits_backward)
        raise ValueError(
            f"`zero_stage=3` with `schedule={schedule!r}` is not supported: that schedule computes the weight"
            f" gradients outside autograd's backward, where FSDP2 reduce-scatters them. Use another schedule"
            f" ({others}) or `zero_stage=2`."
        )
    return config


def check_no_tie_within_a_rank(tied: Sequence[TiedParameter], plan: StagePlan, pipeline_parallel_size: int) -> None:
    """Local, the same verdict on every rank. ZeRO-3 shards a rank's layers as separate FSDP2 units: a parameter
    two layers of one pipeline rank share (both users of a tied weight on one rank, as the plan's placement,
    ``StagePlan.rank_of_stage``, can put them) would be gathered by neither unit's forward, so it is refused.

    Raises:
        ValueError: naming the parameter and the fix.
    """
    for parameter in tied:
        ranks = [plan.rank_of_layer(index) for index in parameter.layers]
        if len(set(ranks)) < len(ranks):
            fix = (
                "use `ShardedOptimizerStrategy(stage=3)` (a pipeline of one rank is data parallelism; it shards a tied"
                " model) or `zero_stage=2`"
                if pipeline_parallel_size == 1
                else "place those layers on different ranks (`partition=[...]`, `stages_per_rank=1`) or use"
                " `zero_stage=2`"
            )
            raise ValueError(
                f"`zero_stage=3` cannot shard `{parameter.name}`: it is used by pipeline layers {parameter.layers}"
                f" that run on one pipeline rank, and ZeRO-3 shards each layer on its own. To train it, {fix}."
            )


class TiedShardSum:
    """Collective over each set of pipeline ranks sharing tied copies (all their replicas): every copy's reduced
    shard becomes the sum of all copies' averaged gradients (see the module docstring).

    Building it is a collective: one process group per set of pipeline ranks sharing copies, across all replicas.
    """

    def __init__(
        self, module: nn.Module, tied: TiedLayout, dims: ParallelDims, aliases: Mapping[str, str], *, stats: Any
    ) -> None:
        self.aliases = aliases
        self.stats = stats
        self.numel = {aliases.get(n, n): p.numel() for n, p in module.named_parameters()}
        self.groups = _tied_groups(tied, dims)
        self.writes = dims.layout.replicate_rank(dims.global_rank) == 0
        """Whether this rank writes its shards: the replica groups hold the same shards, the first one counts."""

    def __call__(self, views: Sequence[ShardView]) -> None:
        for group, names in self.groups:
            self._sum(group, names, views)

    @torch.no_grad()
    def _sum(self, group: Any, names: list[str], all_views: Sequence[ShardView]) -> None:
        """One "has a gradient" flag per parameter travels along: a copy no rank used counts as zeros; if no copy was
        used, its views keep ``.grad = None`` (not stepped, as on one device)."""
        offsets, total = {}, 0
        for name in names:
            offsets[name], total = total, total + self.numel[name]
        views = [view for view in all_views if self.aliases.get(view.name, view.name) in offsets]
        device = views[0].grad.device if views else torch.device("cpu")
        dtype = views[0].grad.dtype if views else torch.float32
        flat = torch.zeros(total + len(names), dtype=dtype, device=device)
        for view in views if self.writes else ():
            name = self.aliases.get(view.name, view.name)
            if view.tensor.grad is not None:
                start = offsets[name] + view.start
                flat[start : start + view.grad.numel()] = view.grad
                flat[total + names.index(name)] = 1
        if self.stats is not None:
            self.stats.record("all_reduce", flat.numel() * flat.element_size())
        dist.all_reduce(flat, group=group)
        # Whether a copy was used anywhere is needed on the host (`.grad` set or None). A view with a local gradient
        # knows (its own flag is 1); only views without one read the flags, all in one transfer (a read per view was
        # a device sync per view, issue 36 item 5).
        used = flat[total:].tolist() if any(view.tensor.grad is None for view in views) else None
        for view in views:
            name = self.aliases.get(view.name, view.name)
            start = offsets[name] + view.start
            view.grad.copy_(flat[start : start + view.grad.numel()])
            has_grad = view.tensor.grad is not None or (used is not None and used[names.index(name)] > 0)
            view.tensor.grad = view.grad if has_grad else None


class FlatBucketSync(ReplicatedSync):
    """``zero_stage`` 1-2: the stage held by :class:`~lightning_parallel.distributed.zero.backends.FlatBucketBackend`
    over the stage's replicas, built with the optimizers (when fitting).

    Until then (and in a run that does not fit) the stage is held whole, as :class:`~.sync.ReplicatedSync` holds it.
    """

    def __init__(self, context: SyncContext) -> None:
        super().__init__(context)
        previous = context.previous
        self.backend: FlatBucketBackend | None = previous.backend if isinstance(previous, FlatBucketSync) else None
        """The ZeRO-1/2 backend holding the stage; built by :meth:`setup_optimizers`. A split that does not fit
        (``validate`` after ``fit``) keeps the fit's: its optimizers step its shard views, and a checkpoint saved
        now must consolidate their state through it (the stage's parameters are the same objects, still views into
        its buckets)."""

    def setup_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Collective (the stage's buckets; groups of the tied copies). Move the stage's parameters into flat buckets
        sharded over the replicas; the optimizers step this replica's shard."""
        super().setup_optimizers(optimizers)
        context, dims = self.context, self.dims
        uncounted = context.tied.layout.uncounted(dims.pipeline_rank)
        extensions = StageExtensions(
            after_reduction=TiedShardSum(self.module, context.tied.layout, dims, context.aliases, stats=self.stats),
            norm_groups=(dims.pipeline_group,),
            uncounted=frozenset(
                name for name, _ in self.module.named_parameters() if context.aliases.get(name, name) in uncounted
            ),
        )
        assert context.zero_config is not None, "zero_stage 1-3 has ZeRO settings"
        # Without data parallelism this sync exists only to keep fp32 masters: `ShardedOptimizerStrategy`'s world-size-1
        # backend (stage-1/2 buckets of one shard, at any `zero_stage`).
        backend_type = FlatBucketBackend if dims.data_parallel_size > 1 else MasterWeightBackend
        backend = backend_type(
            context.zero_config,
            ZeroContext(
                rank=dims.global_rank,
                world_size=dims.world_size,
                mesh=context.mesh,
                stats=self.stats,
                warn=context.warn,
                sync_module_states=lambda module: None,  # the split started every stage from rank 0's weights
                stage=extensions,
                host_group=dims.host_data_parallel_group,
            ),
        )
        backend.setup_module(self.module, context.device)
        backend.setup_optimizers(list(self.optimizers))
        self.backend = backend

    def _built(self) -> FlatBucketBackend:
        assert self.backend is not None, "the optimizers were not set up"
        return self.backend

    # ------------------------------------------------------------------ step
    def reduce_gradients(self) -> list[Tensor]:
        """Collective. Reduce-scatter into the replicas' shards, then the tied sum on them."""
        self._built().reduce_gradients()
        return []

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        return self._built().clip_grad_norm_(optimizer, max_norm)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self._built().after_optimizer_step(optimizer)

    def wait_for_parameters(self, *, everywhere: bool = True) -> None:
        if self.backend is not None:
            self.backend.wait_for_parameters(everywhere=everywhere)

    def abandon_in_flight(self) -> None:
        if self.backend is not None:
            self.backend.abandon_in_flight()

    def teardown(self) -> None:
        if self.backend is not None:
            self.backend.teardown()

    # ------------------------------------------------------------------ state
    def gradient_buffers(self) -> list[Tensor]:
        return self.backend.gradient_buffers() if self.backend is not None else []

    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        """The stage's flat buckets and the optimizer state of this replica's shard, summed over ``optimizers``."""
        if self.backend is None:
            return super().memory_report(optimizers)
        return self.backend.memory_report(optimizers)

    def model_state(self) -> dict[str, Any]:
        self.wait_for_parameters()
        return super().model_state()

    def load_model_entries(self, module: nn.Module, entries: dict[str, Any]) -> None:
        if self.backend is None:
            return super().load_model_entries(module, entries)
        self.backend.load_model_state(entries, strict=False)  # the fp32 masters start from the loaded weights
        return None

    def stage_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective over the shard group: first the stage's shards onto its first rank, which then joins its
        pipeline's gather (the other replicas' parts are dropped: global rank 0 keeps one)."""
        if self.backend is None:
            return super().stage_optimizer_state(optimizer)
        plain = self.backend.optimizer_state(optimizer)
        group_params = self.backend.sharded_for(optimizer).group_params
        if not plain:
            plain = {"state": {}, "param_groups": [_settings(group) for group in optimizer.param_groups]}
        return local_optimizer_state(optimizer, self.parameter_names(), state_dict=plain, group_params=group_params)

    def load_stage_optimizer_state(self, optimizer: Optimizer, state: WholeOptimizerState) -> None:
        if self.backend is None:
            return super().load_stage_optimizer_state(optimizer, state)
        group_params = self.backend.sharded_for(optimizer).group_params
        plain = state.slice_for(optimizer, self.parameter_names(), group_params=group_params)
        self.backend.load_optimizer_state(optimizer, plain)
        return None


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _tied_groups(tied: TiedLayout, dims: ParallelDims) -> list[tuple[Any, list[str]]]:
    """Collective: for each set of pipeline ranks sharing tied copies, one group of those ranks in every replica
    (the whole world when the set is the whole pipeline); the ``(group, canonical names)`` this rank belongs to."""
    p, dp = dims.pipeline_parallel_size, dims.data_parallel_size
    groups = []
    for ranks, names in tied.rank_sets().items():
        members = [replica * p + r for replica in range(dp) for r in ranks]
        group = dist.group.WORLD if len(members) == dims.world_size else dist.new_group(members)
        if dims.pipeline_rank in ranks:
            groups.append((group, names))
    return groups
