"""What a hook reads as ``.grad`` under ZeRO: the averaged gradient DDP would hold, lent to the hooks and taken back.

Between a gradient sync and the optimizer step, ZeRO holds each rank's shard of the averaged gradient only (stages
1-2: a slice of a flat bucket, which the user's optimizer steps through 1-D views; stage 3: FSDP2's ``DTensor``
shard). Code written for one device or DDP reads the module's parameters' ``.grad`` there: Lightning's
``grad_norm(self, 2)`` in ``on_before_optimizer_step``, a clip by hand, manual optimization after
``manual_backward``. It would see zeros, ``None`` or a shard.

A :class:`GradientLoan` gives every parameter that has a gradient a plain ``.grad`` holding the whole averaged
gradient (collective: one all-gather of the gradient shards, the bytes of the gradients), for the hooks; ``hand_back``
(local) then takes this rank's slice of whatever ``.grad`` holds by then (changed in place, replaced, or set to
``None``) into the shard the optimizer steps, and frees the whole gradients. So a hook that changes ``.grad`` changes
the step, as on one device. Costs, while lent: stages 1-2 all-gather each bucket's reduced shard (the gradient bytes,
like the second half of DDP's all-reduce); stage 1 gathers into its full gradient bucket, which it holds anyway (no
memory; with fp32 masters, its 16-bit one); stage 2 into a whole-gradient buffer in the parameters' dtype (``Psi``
bytes, the parameters' bytes, until handed back: 2 bytes a parameter under ``bf16-true``, whose fp32 shards are
rounded before the gather); stage 3 all-gathers each ``DTensor`` gradient (``Psi`` bytes until handed back).

Why our own: DeepSpeed answers ``None`` for ``param.grad`` outside its ``safe_get_full_grad`` helper, FSDP2 hands the
shard as a ``DTensor`` (whose norms Lightning's ``grad_norm`` cannot stack); neither lets a hook written for DDP run
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_parallel.distributed.zero.accumulation import clear_unowned
from lightning_parallel.distributed.zero.stage3_compat import local_gradient, sharded_gradient_params

if TYPE_CHECKING:
    from lightning_parallel.accounting import CommunicationStats
    from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
    from lightning_parallel.distributed.zero.flat_bucket import FlatBucket, ShardView

__all__ = [
    "BucketGradientLoan",
    "GradientLoan",
    "LocalBucketGradientLoan",
    "LocalShardedTensorGradientLoan",
    "ShardedTensorGradientLoan",
]


class GradientLoan(Protocol):
    """Whole averaged gradients lent to the module's parameters' ``.grad``; :meth:`hand_back` ends the loan."""

    def hand_back(self) -> None:
        """Local. Take this rank's slice of each ``.grad`` into what the optimizer steps; free the whole copies."""


class BucketGradientLoan:
    """Stages 1-2 after a sync: each bucket's reduced shards all-gathered into whole gradients (collective)."""

    def __init__(self, buckets: ShardedParameterBuckets) -> None:
        self.buckets = buckets
        # The views this rank steps that hold a gradient now: one still holding it at hand-back was not zeroed since.
        self._had_grad = {id(view) for view in buckets.views() if view.tensor.grad is not None}
        has_grad = self._has_gradient_anywhere()
        self._whole: list[Tensor] = []
        self._lent: dict[int, tuple[Tensor, int]] = {}  # what each parameter's `.grad` was lent, and its version
        works = [self._gather(bucket) for bucket in buckets.buckets]
        for work in works:
            if work is not None:
                work.wait()
        for bucket, whole in zip(buckets.buckets, self._whole, strict=True):
            for segment in bucket.segments:
                param = segment.param
                if not has_grad[segment.index]:
                    param.grad = None
                    continue
                grad = whole[segment.offset : segment.offset + segment.numel].view_as(param)
                param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
                self._lent[id(param)] = (param.grad, param.grad._version)

    def _has_gradient_anywhere(self) -> list[bool]:
        """Collective. Whether each bucketed parameter has a gradient: the optimizer's views of its pieces do (every
        element is some rank's; the pieces of one parameter agree)."""
        buckets = self.buckets
        flags = torch.zeros(len(buckets.parameters), dtype=torch.uint8, device=buckets.device)
        for bucket in buckets.buckets:
            segment_of = {id(segment.param): segment for segment in bucket.segments}
            for view in bucket.views:
                if id(view) in self._had_grad:
                    flags[segment_of[id(view.param)].index] = 1
        if buckets.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=buckets.group)
            if buckets.stats is not None:
                buckets.stats.record("all_reduce", flags.numel())
        return [bool(flag) for flag in flags.tolist()]

    def _gather(self, bucket: FlatBucket) -> dist.Work | None:
        """Collective (asynchronous): ``bucket``'s reduced shards into one whole buffer in the parameters' dtype, the
        ``.grad`` the hooks get (views of it): in place where the shard is a slice of the full gradient bucket (stage
        1 without masters), into the full 16-bit bucket stage 1 holds beside fp32 masters (zero since the sync), else
        into a new buffer of the parameters' bytes (stage 2). Each rank rounds its fp32 shard to the parameters'
        dtype before the gather: the values a gather in fp32 then a cast give, without the fp32 buffer and the
        16-bit copies of it (6 bytes a parameter where the doc says 2)."""
        buckets = self.buckets
        if bucket.reduces_in_place:
            assert bucket.full_grads is not None
            whole = bucket.full_grads
        else:
            dtype, full = bucket.flat_params.dtype, bucket.full_grads
            if full is not None and full.dtype == dtype:
                whole = full
            else:
                whole = torch.empty(bucket.numel, dtype=dtype, device=bucket.shard_grads.device)
            start = buckets.rank * bucket.shard_numel
            whole[start : start + bucket.shard_numel].copy_(bucket.shard_grads)
        self._whole.append(whole)
        if buckets.world_size == 1:  # the shard is the whole bucket
            return None
        if buckets.stats is not None:
            buckets.stats.record("all_gather", whole.numel() * whole.element_size())
        return buckets.gather_in_place(whole)

    @torch.no_grad()
    def hand_back(self) -> None:
        buckets = self.buckets
        for bucket, whole in zip(buckets.buckets, self._whole, strict=True):
            for view in bucket.views:
                zeroed = id(view) in self._had_grad and view.tensor.grad is None
                _take_back(view, zeroed=zeroed, unchanged=self._unchanged(view.param))
            _restore_between_syncs(bucket, whole, rank=buckets.rank, stage=buckets.stage)
        self._whole.clear()
        self._lent.clear()

    def _unchanged(self, param: nn.Parameter) -> bool:
        """Whether ``param.grad`` is still what was lent, untouched: the shard holds it already (in the master's
        precision, which a 16-bit ``.grad`` would round)."""
        lent = self._lent.get(id(param))
        return lent is not None and param.grad is lent[0] and lent[0]._version == lent[1]


def _take_back(view: ShardView, *, zeroed: bool, unchanged: bool) -> None:
    """This rank's piece of ``view.param.grad`` into the shard the optimizer steps (``None``: no gradient)."""
    grad = view.param.grad
    if zeroed or grad is None:  # the optimizer's `zero_grad()` ran since the loan, or the hook dropped the gradient
        view.tensor.grad = None
        return
    piece = grad.detach().reshape(-1)[view.start : view.stop]
    if not unchanged and piece.data_ptr() != view.grad.data_ptr():
        view.grad.copy_(piece)
    view.tensor.grad = view.grad


def _restore_between_syncs(bucket: FlatBucket, whole: Tensor, *, rank: int, stage: int) -> None:
    """Put the parameters' ``.grad`` back as the buckets keep them between a sync and the next backward."""
    if bucket.reduces_in_place:  # `whole` is the full bucket: zero the other ranks' slices again
        clear_unowned(bucket, rank=rank)  # also drops `.grad` of the parameters overlapping this rank's slice
        owned = {id(segment.param) for segment in bucket.owned_segments}
        for segment in bucket.segments:
            if id(segment.param) not in owned:  # autograd accumulates into the bucket slot in place again
                segment.param.grad = whole[segment.offset : segment.offset + segment.numel].view_as(segment.param)
        return
    full = bucket.full_grads if stage == 1 else None  # stage 1 with masters: (zeroed) views of its 16-bit bucket
    if full is not None and full is whole:  # it held the lent gradients: zero again for the next accumulation
        full.zero_()
    for segment in bucket.segments:
        slot = None if full is None else full[segment.offset : segment.offset + segment.numel]
        segment.param.grad = None if slot is None else slot.view_as(segment.param)


class LocalBucketGradientLoan:
    """Stage 2 in a micro-step without a sync (gradient accumulation): ``.grad`` views of this rank's accumulating
    whole buckets, the local sum DDP's ``no_sync`` holds too. Local; a change to ``.grad`` changes the bucket."""

    def __init__(self, buckets: ShardedParameterBuckets) -> None:
        self.params: list[nn.Parameter] = []
        for bucket in buckets.buckets:
            if bucket.full_grads is None:
                continue
            for segment in bucket.segments:
                if buckets.got_gradient_here(segment.param):
                    view = bucket.full_grads[segment.offset : segment.offset + segment.numel]
                    segment.param.grad = view.view_as(segment.param)
                    self.params.append(segment.param)

    def hand_back(self) -> None:
        for param in self.params:  # autograd must give the next micro-step's gradient fresh, for the hook to add it
            param.grad = None
        self.params.clear()


class ShardedTensorGradientLoan:
    """Stage 3: each ``DTensor`` gradient all-gathered into a plain whole ``.grad`` (collective), re-sharded on hand
    back."""

    def __init__(self, module: nn.Module, *, stats: CommunicationStats | None = None) -> None:
        self.lent: list[tuple[nn.Parameter, DTensor, Tensor, int]] = []  # the shard, the whole lent and its version
        for param in module.parameters():  # the same order on every rank
            grad = param.grad
            if isinstance(param, DTensor) and isinstance(grad, DTensor):
                param.grad = whole = grad.full_tensor()
                self.lent.append((param, grad, whole, whole._version))
                if stats is not None:  # DTensor's all-gather is not one of FSDP2's, which the monitor's tap counts
                    stats.record("all_gather", whole.numel() * whole.element_size())

    @torch.no_grad()
    def hand_back(self) -> None:
        for param, shard, whole, version in self.lent:
            grad = param.grad
            if grad is None or isinstance(grad, DTensor):  # dropped, or a shard set by the hook itself
                continue
            if grad is whole and whole._version == version:  # untouched: the shard holds it already
                param.grad = shard
                continue
            # Local: this rank's chunk of the whole gradient, cut as the shard's placements cut it (no scatter).
            piece = distribute_tensor(grad.detach(), shard.device_mesh, shard.placements, src_data_rank=None)
            shard.to_local().copy_(piece.to_local())
            param.grad = shard
        self.lent.clear()


class LocalShardedTensorGradientLoan:
    """Stage 3 in a micro-step without a sync: FSDP2's unsharded local sums (DDP's ``no_sync`` gradients) as the
    parameters' ``.grad``. Local; a change to ``.grad`` changes FSDP2's sum; hand-back restores the shards."""

    def __init__(self, units: list[nn.Module]) -> None:
        self.lent: list[tuple[nn.Parameter, Tensor | None]] = []
        for unit in units:
            for fsdp_param in sharded_gradient_params(cast(FSDPModule, unit)):
                local = local_gradient(fsdp_param)
                if local is not None:
                    param = fsdp_param.sharded_param
                    self.lent.append((param, param.grad))
                    param.grad = local

    def hand_back(self) -> None:
        for param, shard in self.lent:
            param.grad = shard
        self.lent.clear()
