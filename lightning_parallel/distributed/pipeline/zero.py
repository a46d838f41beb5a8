"""ZeRO inside the pipeline: its settings, and what a pipeline adds to the ZeRO backend holding a stage.

Torch-only. Each stage is held by the backend ``ShardedOptimizerStrategy`` runs, picked by the same chooser
(:func:`~lightning_parallel.distributed.zero.backends.backend_type`, in ``stage_holder.py``) and built from the same
:class:`~lightning_parallel.distributed.zero.config.ZeroConfig`. A stage's replicas sit on the mesh's data axes:
``shard`` (the ranks ZeRO shards the stage over) and ``replicate`` (hybrid sharding: shard groups holding the same
shards). With stages 1-2 (flat buckets: bucket cap, fp32 master weights of 16-bit parameters, overlapped parameter
gather, hybrid sharding) the pipeline's extension points
(:class:`~lightning_parallel.distributed.zero.backends.StageExtensions`) do this:

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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.choices import check_choice, choices_of
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.schedule import SCHEDULE_SPECS, schedule_spec
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tied import TiedGradientSync, TiedLayout, TiedParameter
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.flat_bucket import ShardView

__all__ = [
    "ZERO_STAGES",
    "PipelineZeroStage",
    "TiedCopiesSum",
    "TiedShardSum",
    "check_no_tie_within_a_rank",
    "pipeline_zero_config",
]

PipelineZeroStage = Literal[0, 1, 2, 3]
"""``PipelineParallelStrategy(zero_stage=...)``: 0 (off), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters,
with FSDP2: :mod:`.fully_shard`)."""

ZERO_STAGES: tuple[int, ...] = choices_of(PipelineZeroStage)

_ZERO_ONLY = ("shard_size", "bucket_cap_mb", "overlap_param_gather")
"""The ZeRO options that mean nothing without ZeRO (``master_weights`` has effect only under ZeRO too, but its default
is kept whatever the stage)."""


def pipeline_zero_config(
    zero_stage: Any,
    settings: Callable[..., ZeroConfig] = ZeroConfig,
    *,
    checkpoint_format: str = "consolidated",
    schedule: str | None = None,
) -> ZeroConfig | None:
    """Local, the same verdict on every rank. The ZeRO settings of ``PipelineParallelStrategy``, validated as
    ``ShardedOptimizerStrategy`` validates them (the same :class:`ZeroConfig`, the same messages); ``None`` for
    ``zero_stage=0``.

    ``settings``: the user's ZeRO options as :class:`ZeroConfig` without its stage (``partial(ZeroConfig,
    shard_size=..., ...)``; default all at their defaults), called once ``zero_stage`` is known to be valid.

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
    config = settings(stage=zero_stage or 1)  # validates the options whatever the stage
    if zero_stage == 0:
        if config.gradient_compression is not None:
            raise ValueError(
                f"`gradient_compression={config.gradient_compression!r}` reduces ZeRO's gradients in that dtype, but"
                " `zero_stage=0` holds each stage without ZeRO (its replicas average the gradients in their own"
                " dtype). Pass `zero_stage=1`, 2 or 3 (the same weights and checkpoints as 0), or leave"
                " `gradient_compression=None`."
            )
        defaults = ZeroConfig()
        given = {name: getattr(config, name) for name in _ZERO_ONLY}
        changed = [f"`{name}={value!r}`" for name, value in given.items() if value != getattr(defaults, name)]
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


class TiedCopiesSum:
    """The pipeline's ``StageExtensions.after_reduction``: once the stage's gradients are averaged over its replicas,
    every tied copy's gradient becomes the sum of all copies' over the pipeline ranks holding one (the copies then
    stay bitwise equal). Collective over those ranks.

    Whichever backend holds the stage says what it reduced: the shard views of ZeRO-1/2's buckets
    (:class:`TiedShardSum`, whose groups span every replica: built at the first call, a collective on every rank) or
    ``None``, the parameters' own ``.grad`` (replicated; ZeRO-3's local rows), summed per replica by
    :class:`~.tied.TiedGradientSync`.
    """

    def __init__(
        self,
        module: nn.Module,
        tied: TiedGradientSync,
        dims: ParallelDims,
        aliases: Mapping[str, str],
        *,
        stats: Callable[[], CommunicationStats | None],
    ) -> None:
        self.module, self.tied, self.dims, self.aliases, self.stats = module, tied, dims, aliases, stats
        self._shard_sum: TiedShardSum | None = None

    def __call__(self, views: Sequence[ShardView] | None) -> None:
        if views is None:
            self.tied.all_reduce(self.module, self.aliases, stats=self.stats())
            return
        if self._shard_sum is None:
            self._shard_sum = TiedShardSum(self.module, self.tied.layout, self.dims, self.aliases)
        self._shard_sum(views, stats=self.stats())


class TiedShardSum:
    """Collective over each set of pipeline ranks sharing tied copies (all their replicas): every copy's reduced
    shard becomes the sum of all copies' averaged gradients (see the module docstring).

    Building it is a collective: one process group per set of pipeline ranks sharing copies, across all replicas.
    """

    def __init__(self, module: nn.Module, tied: TiedLayout, dims: ParallelDims, aliases: Mapping[str, str]) -> None:
        self.aliases = aliases
        self.numel = {aliases.get(n, n): p.numel() for n, p in module.named_parameters()}
        self.groups = _tied_groups(tied, dims)
        self.writes = dims.layout.replicate_rank(dims.global_rank) == 0
        """Whether this rank writes its shards: the replica groups hold the same shards, the first one counts."""

    def __call__(self, views: Sequence[ShardView], *, stats: CommunicationStats | None = None) -> None:
        for group, names in self.groups:
            self._sum(group, names, views, stats)

    @torch.no_grad()
    def _sum(
        self, group: Any, names: list[str], all_views: Sequence[ShardView], stats: CommunicationStats | None
    ) -> None:
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
        if stats is not None:
            stats.record("all_reduce", flat.numel() * flat.element_size())
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
