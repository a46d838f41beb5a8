"""What a ZeRO-1/2 shard view holds as ``.grad`` across gradient syncs: torch's ``.grad`` on one device, kept exactly.

On one device a parameter's ``.grad`` is ``None`` until its first gradient, accumulates over backwards until
``zero_grad()`` (manual optimization may sync several backwards before one step), and is left alone for a parameter that
got no gradient or whose ``requires_grad`` is off. The optimizer of
:class:`~lightning_parallel.distributed.zero.buckets.ShardedParameterBuckets` steps 1-D views of this rank's shard of
each bucket (:class:`~lightning_parallel.distributed.zero.flat_bucket.ShardView`), whose ``.grad`` is a slice of the
bucket's reduced gradient shard. The functions here decide, for one bucket at a time, where a sync's collective writes
its result and what each view's ``.grad`` then is, so that the optimizer sees what it would see on one device:

* :func:`reduce_output`: at launch, the reduced shard itself when no view keeps a gradient, else a fresh tensor
  (``pending_shard``) added to the kept ones after the sync;
* :func:`take_reduced`: after the sync, each view's ``.grad`` (kept plus reduced, reduced only, kept, or ``None``);
* stage 1 without fp32 masters reduces *in place* (``reduces_in_place``: the reduced shard is this rank's slice of
  the persistent full bucket, so no second copy of the gradients exists). That slice then holds the averages until
  the next accumulation starts: :func:`clear_unowned` after a sync (zero the rest of the bucket, take ``.grad`` from
  the parameters overlapping the slice so autograd gives them a fresh one), :func:`start_accumulation` before the
  bucket's next gradient (carry what the views keep aside, in ``carried``, and zero the slice).

Local: no collective. Called only by ``ShardedParameterBuckets``, which owns the buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_parallel.distributed.zero.flat_bucket import FlatBucket

__all__ = ["clear_unowned", "reduce_output", "start_accumulation", "take_reduced"]


def start_accumulation(bucket: FlatBucket) -> None:
    """In place (stage 1): before this bucket's first gradient after a sync, empty the owned slice, which holds the
    last sync's averages (no-op otherwise). What views still hold as ``.grad`` (no ``zero_grad`` since) is carried
    aside, so the next sync adds to it as torch accumulates; a view without ``.grad`` contributes nothing. Parameters
    overlapping the slice have no ``.grad`` since that sync (:func:`clear_unowned`), so nothing was added into it
    yet."""
    if not bucket.holds_reduced:
        return
    kept = [view for view in bucket.views if view.tensor.grad is not None]
    if kept:
        carried = torch.zeros_like(bucket.shard_grads)
        for view in kept:
            carried[view.grad_offset : view.grad_offset + view.grad.numel()].copy_(view.grad)
        bucket.carried = carried
    bucket.shard_grads.zero_()
    bucket.holds_reduced = False


def reduce_output(bucket: FlatBucket) -> Tensor:
    """Where this sync's collective writes ``bucket``'s reduced shard (and :attr:`pending_shard` if elsewhere).

    torch's ``.grad`` semantics: a sync after the optimizer's ``zero_grad()`` starts from zero, a sync without it
    (manual optimization accumulating over several synchronised backwards) adds to the previous gradients. A view
    without ``.grad`` (cleared, or never used) holds no gradient: its slot restarts from zero. In place, kept
    gradients were carried aside by :func:`start_accumulation`.
    """
    cleared = [view for view in bucket.views if view.tensor.grad is None]
    if bucket.reduces_in_place or len(cleared) == len(bucket.views):
        output = bucket.shard_grads
    else:
        output = torch.empty_like(bucket.shard_grads)
        for view in cleared:
            view.grad.zero_()
    bucket.pending_shard = None if output is bucket.shard_grads else output
    return output


def clear_unowned(bucket: FlatBucket, *, rank: int) -> None:
    """In place (stage 1), after a sync: zero the full buffer outside the owned slice (the next accumulation adds
    there) and take ``.grad`` from the parameters overlapping the slice, so that autograd gives them a fresh one
    instead of adding into the averages the optimizer is about to read."""
    assert bucket.full_grads is not None
    start = rank * bucket.shard_numel
    bucket.full_grads[:start].zero_()
    bucket.full_grads[start + bucket.shard_numel :].zero_()
    for segment in bucket.owned_segments:
        segment.param.grad = None
    bucket.holds_reduced = True


def take_reduced(bucket: FlatBucket, *, got_gradient: Callable[[nn.Parameter], bool]) -> None:
    """Set each view's ``.grad`` after a sync, as torch would for its parameter.

    A view keeps ``.grad`` it already had (no ``zero_grad`` since: torch accumulates) and gets one when its
    parameter got a gradient on some rank (``got_gradient``); otherwise it stays ``None``, so the optimizer leaves it
    alone. A view switched off by ``toggle_optimizer`` (``requires_grad=False``) keeps its previous gradient
    unchanged.
    """
    pending = bucket.pending_shard if bucket.carried is None else bucket.carried
    bucket.pending_shard = bucket.carried = None
    if bucket.reduces_in_place and pending is not None:  # the shard holds this sync's averages; `pending` the kept
        for view in bucket.views:
            had_grad = view.tensor.grad is not None
            takes = view.tensor.requires_grad and got_gradient(view.param)
            kept = pending[view.grad_offset : view.grad_offset + view.grad.numel()]
            view.grad.add_(kept) if takes else view.grad.copy_(kept)
            view.tensor.grad = view.grad if (had_grad or takes) else None
        return
    for view in bucket.views:
        had_grad = view.tensor.grad is not None
        takes = view.tensor.requires_grad and got_gradient(view.param)
        if pending is not None and takes:
            view.grad.add_(pending[view.grad_offset : view.grad_offset + view.grad.numel()])
        elif pending is None and not takes:
            view.grad.zero_()  # the reduced values are not this view's: it had no gradient and gets none
        view.tensor.grad = view.grad if (had_grad or takes) else None
