"""ZeRO inside the pipeline: each stage's optimizer state (stage 1) and gradients (stage 2) sharded across its replicas.

Torch-only. The building blocks are ZeRO-1/2's own, over the mesh's ``"replicate"`` axis instead of the world:
:class:`~lightning_parallel.distributed.zero.ShardedParameterBuckets` holds the rank's stage parameters in flat
buckets padded to a multiple of the data-parallel size, and
:class:`~lightning_parallel.distributed.zero_optimizer.ShardedOptimizer` points the user's optimizer at the
``1/dp`` shard this replica owns. What differs from ``ShardedOptimizerStrategy``:

* No backward hooks. torch's schedules accumulate each micro-batch's gradient into ``.grad`` (the zero-bubble
  schedules outside autograd's accumulation, where a hook would not fire), so the gradients are taken into the
  buckets once the schedule finished, then reduce-scattered (:meth:`PipelineZero.reduce_gradients`): the same bytes
  as the replicas' all-reduce of the plain pipeline. Stage 2 frees the full buffers once reduced.
* Tied parameters (``tied.py``): the sum over the pipeline ranks holding a copy comes after the replica reduction,
  on the shards. The copies sit in different buckets on different stages, so a replica owns different slices of
  each; every owner writes its slice into a zero tensor of the parameter's size, and one all-reduce over all
  replicas of the ranks sharing the copy sums the copies' averaged gradients (each element has one non-zero term
  per copy, so the sum is exact and every member gets the same bits: the copies stay bitwise equal).
* Clipping: a shard's squares are summed over the ``"replicate"`` group, then over the ``"pp"`` group.

Per rank: optimizer state ``K * stage_params / dp`` (exactly, when each bucket's size is a multiple of ``dp``: the
padding holds no state), gradients ``stage_params + stage_params / dp`` (stage 1) or ``stage_params / dp``
(stage 2) after the step, parameters whole (the flat buckets, with their padding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.accounting import CommunicationStats, MemoryReport
from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_
from lightning_parallel.distributed.pipeline.consolidate import WholeOptimizerState, local_optimizer_state
from lightning_parallel.distributed.pipeline.partition import StagePlan
from lightning_parallel.distributed.pipeline.schedule import ParallelDims
from lightning_parallel.distributed.pipeline.sync import ReplicatedSync, SyncContext
from lightning_parallel.distributed.pipeline.tied import TiedLayout, TiedParameter
from lightning_parallel.distributed.zero import ShardedParameterBuckets, ShardView
from lightning_parallel.distributed.zero_optimizer import ShardedOptimizer, check_shardable

__all__ = ["ZERO_STAGES", "FlatBucketSync", "PipelineZero", "check_no_tie_within_a_rank", "check_zero_stage"]

ZERO_STAGES = (0, 1, 2, 3)
"""``zero_stage`` values of ``PipelineParallelStrategy``: 0 (off), 1 (optimizer state), 2 (+ gradients), 3 (+
parameters, with FSDP2: :mod:`.fully_shard`)."""


def check_zero_stage(zero_stage: Any, *, checkpoint_format: str, schedule: str | None = None) -> None:
    """Raise ``ValueError`` for a ``zero_stage`` that is not 0-3, or a combination we do not support.

    The sharded checkpoint format writes each replica's slice of whole parameters and optimizer state; with ZeRO-1/2
    the optimizer state is sharded by bucket instead, which that writer does not know, so it is refused up front
    (stage 3 writes FSDP2's rows of each tensor, which the format holds). Stage 3 refuses the zero-bubble schedule:
    it computes weight gradients outside autograd's backward, where FSDP2's hooks reduce them.
    """
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"`zero_stage={zero_stage!r}` is invalid. Valid options: 0 (no sharding), 1 (optimizer state sharded"
            " across each stage's data-parallel replicas), 2 (+ gradients), 3 (+ parameters)."
        )
    if zero_stage in (1, 2) and checkpoint_format == "sharded":
        raise ValueError(
            f"`zero_stage={zero_stage}` with `checkpoint_format='sharded'` is not supported: the sharded writer"
            " does not know ZeRO-1/2's bucketed optimizer shards. Use `checkpoint_format='consolidated'` (the"
            " default; loadable under any layout), `zero_stage=0` or `zero_stage=3`."
        )
    if zero_stage == 3 and schedule == "InterleavedZeroBubble":
        raise ValueError(
            "`zero_stage=3` with `schedule='InterleavedZeroBubble'` is not supported: that schedule computes the"
            " weight gradients outside autograd's backward, where FSDP2 reduce-scatters them. Use another schedule"
            " ('1F1B', 'GPipe', 'Interleaved1F1B', 'LoopedBFS') or `zero_stage=2`."
        )


def check_no_tie_within_a_rank(tied: Sequence[TiedParameter], plan: StagePlan, pipeline_parallel_size: int) -> None:
    """Local, the same verdict on every rank. ZeRO-3 shards a rank's layers as separate FSDP2 units: a parameter
    two layers of one pipeline rank share (both users of a tied weight on one rank, as the looped placement of the
    interleaved schedules can put them) would be gathered by neither unit's forward, so it is refused.

    Raises:
        ValueError: naming the parameter and the fix.
    """
    for parameter in tied:
        ranks = [plan.stage_of_layer(index) % pipeline_parallel_size for index in parameter.layers]
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


class PipelineZero:
    """A stage's parameters in flat buckets over the replicas, and the optimizers stepping this replica's shard.

    Building it is a collective (one process group per set of pipeline ranks sharing tied copies, across all
    replicas). Call it on every rank with the optimizers before their first step.

    Args:
        module: this rank's (split) module; its trainable parameters move into flat buffers in place.
        optimizers: the unwrapped optimizers of this rank's parameters.
        stage: 1 or 2.
        dims: the strategy's ranks and groups; buckets are sharded over ``dims.data_parallel_group``.
        tied: which pipeline ranks hold a copy of each tied parameter.
        aliases: other name -> canonical name of parameters with several names.
        bucket_cap_mb: bucket size in MiB.
        stats: where to count collective bytes (``None``: not counted).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        *,
        stage: int,
        dims: ParallelDims,
        tied: TiedLayout,
        aliases: Mapping[str, str],
        bucket_cap_mb: float = 25.0,
        stats: CommunicationStats | None = None,
    ) -> None:
        held = [param for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]]
        self.dims = dims
        self.stats = stats
        self.buckets = ShardedParameterBuckets(
            module, stage=stage, group=dims.data_parallel_group, bucket_cap_mb=bucket_cap_mb, frozen=held
        )
        self.buckets.remove_hooks()  # gradients are taken after the schedule: see `reduce_gradients`
        self.buckets.stats = stats
        self.sharded = [ShardedOptimizer(optimizer, self.buckets) for optimizer in optimizers]
        self._canonical = {view.name: aliases.get(view.name, view.name) for view in self.buckets.views()}
        self._numel = {aliases.get(n, n): p.numel() for n, p in module.named_parameters()}
        self._tied_groups = _tied_groups(tied, dims)

    def sharded_for(self, optimizer: Optimizer) -> ShardedOptimizer:
        """The :class:`ShardedOptimizer` wrapping the (unwrapped) ``optimizer``."""
        return next(sharded for sharded in self.sharded if sharded.optimizer is optimizer)

    def canonical_name(self, view: ShardView) -> str:
        return self._canonical[view.name]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Collective. Reduce-scatter the schedule's gradients (``.grad`` of the stage's parameters) into the shards
        this replica owns (their mean over the replicas), then sum the shards of tied copies over the stages."""
        self.buckets.add_gradients()
        self.buckets.finish_gradient_sync()
        for group, names in self._tied_groups:
            self._sum_tied_shards(group, names)

    def _sum_tied_shards(self, group: Any, names: list[str]) -> None:
        """Every copy's shard becomes the sum of all copies' averaged gradients (see the module docstring).

        One "has a gradient" flag per parameter travels along: a copy no rank used counts as zeros; if no copy was
        used, its views keep ``.grad = None`` (not stepped, as on one device).
        """
        offsets, total = {}, 0
        for name in names:
            offsets[name], total = total, total + self._numel[name]
        views = [view for view in self.buckets.views() if self.canonical_name(view) in offsets]
        device = self.buckets.buckets[0].flat_params.device
        dtype = views[0].grad.dtype if views else torch.float32
        flat = torch.zeros(total + len(names), dtype=dtype, device=device)
        for view in views:
            name = self.canonical_name(view)
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
            name = self.canonical_name(view)
            start = offsets[name] + view.start
            view.grad.copy_(flat[start : start + view.grad.numel()])
            has_grad = view.tensor.grad is not None or (used is not None and used[names.index(name)] > 0)
            view.tensor.grad = view.grad if has_grad else None

    def clip_grad_norm(
        self, optimizer: Optimizer, max_norm: float, *, uncounted: set[str], device: torch.device
    ) -> Tensor:
        """Collective. torch's clip over ``optimizer``'s parameters, the norm over every shard of every stage; the
        copies of tied parameters in ``uncounted`` (canonical names another rank counts) are scaled, not counted."""
        views = [view for view in self.sharded_for(optimizer).views if view.tensor.grad is not None]
        counted = [view.tensor for view in views if self.canonical_name(view) not in uncounted]
        copies = [view.tensor for view in views if self.canonical_name(view) in uncounted]
        # The replicas of a stage hold disjoint shards of its gradients, the pipeline ranks the stages.
        groups = [self.dims.data_parallel_group, self.dims.pipeline_group]
        return clip_grad_norm_over_ranks_(counted, max_norm, groups=groups, device=device, copies=copies)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Collective over the replicas: all-gather the buckets ``optimizer`` stepped."""
        self.buckets.all_gather_parameters(self.sharded_for(optimizer).bucket_indices)

    # ------------------------------------------------------------------ state
    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        """Bytes of the stage's buckets (parameters, gradients) and ``optimizers``' state shards on this rank."""
        return self.buckets.memory_report(optimizers)

    def plain_state(self, optimizer: Optimizer) -> tuple[dict[str, Any], list[list[nn.Parameter]]]:
        """Collective over the replicas. ``optimizer``'s unsharded state dict of this stage on replica 0 (``{}`` on
        the others), and the parameters it numbers per group."""
        sharded = self.sharded_for(optimizer)
        return sharded.consolidated_state_dict(destination=0), sharded.group_params

    def group_params(self, optimizer: Optimizer) -> list[list[nn.Parameter]]:
        """The parameters ``optimizer`` was given, per group (it steps their shard views)."""
        return self.sharded_for(optimizer).group_params

    def load_plain_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Local. Take this replica's slices of a plain state dict numbered as :meth:`group_params`."""
        self.sharded_for(optimizer).load_consolidated_state_dict(state)


class FlatBucketSync(ReplicatedSync):
    """``zero_stage`` 1-2 with data parallelism: a :class:`PipelineZero` built with the optimizers (when fitting).

    Until then (and in a run that does not fit) the stage is held whole, as :class:`~.sync.ReplicatedSync` holds it.
    """

    def __init__(self, context: SyncContext) -> None:
        super().__init__(context)
        self.zero: PipelineZero | None = None
        """The stage's buckets and sharded optimizers; built by :meth:`setup_optimizers`."""

    def setup_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Collective (groups of the tied copies). Move the stage's parameters into flat buckets sharded over the
        replicas; the optimizers step this replica's shard."""
        super().setup_optimizers(optimizers)
        for optimizer in self.optimizers:
            check_shardable(optimizer, warn=self.context.warn)
        self.zero = PipelineZero(
            self.module,
            self.optimizers,
            stage=self.context.zero_stage,
            dims=self.dims,
            tied=self.context.tied.layout,
            aliases=self.context.aliases,
            stats=self.stats,
        )

    def _built(self) -> PipelineZero:
        assert self.zero is not None, "the optimizers were not set up"
        return self.zero

    # ------------------------------------------------------------------ step
    def reduce_gradients(self) -> list[Tensor]:
        """Collective. Reduce-scatter into the replicas' shards, then the tied sum on them."""
        self._built().reduce_gradients()
        return []

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        uncounted = self.context.tied.layout.uncounted(self.dims.pipeline_rank)
        return self._built().clip_grad_norm(optimizer, max_norm, uncounted=uncounted, device=self.context.device)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self._built().after_optimizer_step(optimizer)

    # ------------------------------------------------------------------ state
    def gradient_buffers(self) -> list[Tensor]:
        return self.zero.buckets.gradient_buffers() if self.zero is not None else []

    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        """The stage's flat buckets and the optimizer state of this replica's shard, summed over ``optimizers``."""
        if self.zero is None:
            return super().memory_report(optimizers)
        return self.zero.memory_report(optimizers)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective over the replicas: first the stage's shards onto replica 0, which then joins its pipeline's
        gather (the other replicas' parts are dropped: global rank 0 keeps one)."""
        if self.zero is None:
            return super().optimizer_state(optimizer)
        plain, group_params = self.zero.plain_state(optimizer)
        if not plain:
            plain = {"state": {}, "param_groups": [_settings(group) for group in optimizer.param_groups]}
        return local_optimizer_state(optimizer, self.parameter_names(), state_dict=plain, group_params=group_params)

    def load_optimizer_state(self, optimizer: Optimizer, state: Any) -> None:
        if self.zero is None:
            return super().load_optimizer_state(optimizer, state)
        assert isinstance(state, WholeOptimizerState)
        group_params = self.zero.group_params(optimizer)
        self.zero.load_plain_state(
            optimizer, state.slice_for(optimizer, self.parameter_names(), group_params=group_params)
        )
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
