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

**A loan costs only what is read.** The strategy does not lend at every step: :class:`LendOnRead` watches, between
a sync and the step, every read or assignment of a parameter's ``.grad`` from Python (a ``TorchFunctionMode``: torch
calls it for ``Tensor.grad``'s getter and setter) and lends at the first one, before the read returns. A step whose
hooks read no gradient gathers nothing and allocates nothing. Whether to lend is agreed over the ranks (one byte
all-reduced once a step, at the first read or at the hand-back, whichever comes first), so a read on some ranks only
(``if trainer.is_global_zero: ...``) lends on every rank and does not hang. Lending FSDP2's ``DTensor`` shards
instead, as Lightning's FSDP strategy does, would cost nothing either, but is not what one device reads: Lightning's
``grad_norm`` cannot stack their norms, shapes and indexing differ, and every op on one is a collective of its own.

Why our own: DeepSpeed answers ``None`` for ``param.grad`` outside its ``safe_get_full_grad`` helper, FSDP2 hands the
shard as a ``DTensor`` (whose norms Lightning's ``grad_norm`` cannot stack); neither lets a hook written for DDP run
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from lightning_parallel.distributed.zero.accumulation import clear_unowned
from lightning_parallel.distributed.zero.local_shards import as_placed, local_piece, whole_tensor
from lightning_parallel.distributed.zero.stage3_compat import (
    current_function_mode,
    local_gradient,
    sharded_gradient_params,
)

if TYPE_CHECKING:
    from lightning_parallel.accounting import CommunicationStats
    from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
    from lightning_parallel.distributed.zero.flat_bucket import FlatBucket, ShardView

__all__ = [
    "BucketGradientLoan",
    "GradientLoan",
    "LendOnRead",
    "LocalBucketGradientLoan",
    "LocalShardedTensorGradientLoan",
    "ShardedTensorGradientLoan",
]


class GradientLoan(Protocol):
    """Whole averaged gradients lent to the module's parameters' ``.grad``; :meth:`hand_back` ends the loan."""

    gathered_bytes: int
    """The bytes this rank all-gathered to lend (0: a local loan)."""
    allocated_bytes: int
    """The bytes of the buffers this rank allocated for the loan, held until :meth:`hand_back`."""

    def hand_back(self) -> None:
        """Local. Take this rank's slice of each ``.grad`` into what the optimizer steps; free the whole copies."""

    def buffers(self) -> list[Tensor]:
        """Local. The gradient tensors the loan holds beside the lent ``.grad`` (what a memory count adds)."""


class BucketGradientLoan:
    """Stages 1-2 after a sync: each bucket's reduced shards all-gathered into whole gradients (collective)."""

    def __init__(self, buckets: ShardedParameterBuckets) -> None:
        self.buckets = buckets
        # The views this rank steps that hold a gradient now: one still holding it at hand-back was not zeroed since.
        self._had_grad = {id(view) for view in buckets.views() if view.tensor.grad is not None}
        has_grad = self._has_gradient_anywhere()
        self._whole: list[Tensor] = []
        self._lent: dict[int, tuple[Tensor, int]] = {}  # what each parameter's `.grad` was lent, and its version
        self.gathered_bytes = self.allocated_bytes = 0
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
                # A split weight's local gradient gathered over the tensor ranks (collective): a plain whole `.grad`.
                grad = whole_tensor(param, whole[segment.offset : segment.offset + segment.numel])
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
                self.allocated_bytes += whole.numel() * whole.element_size()
            start = buckets.rank * bucket.shard_numel
            whole[start : start + bucket.shard_numel].copy_(bucket.shard_grads)
        self._whole.append(whole)
        if buckets.world_size == 1:  # the shard is the whole bucket
            return None
        self.gathered_bytes += whole.numel() * whole.element_size()
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

    def buffers(self) -> list[Tensor]:
        return list(self._whole)

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
    if not unchanged:  # a split weight's whole `.grad`: this rank's slice of it first
        piece = local_piece(view.param, grad.detach()).reshape(-1)[view.start : view.stop]
        if piece.data_ptr() != view.grad.data_ptr():
            view.grad.copy_(piece)
    view.tensor.grad = view.grad


def _restore_between_syncs(bucket: FlatBucket, whole: Tensor, *, rank: int, stage: int) -> None:
    """Put the parameters' ``.grad`` back as the buckets keep them between a sync and the next backward."""
    if bucket.reduces_in_place:  # `whole` is the full bucket: zero the other ranks' slices again
        clear_unowned(bucket, rank=rank)  # also drops `.grad` of the parameters overlapping this rank's slice
        owned = {id(segment.param) for segment in bucket.owned_segments}
        for segment in bucket.segments:
            if id(segment.param) not in owned:  # autograd accumulates into the bucket slot in place again
                segment.param.grad = as_placed(segment.param, whole[segment.offset : segment.offset + segment.numel])
        return
    full = bucket.full_grads if stage == 1 else None  # stage 1 with masters: (zeroed) views of its 16-bit bucket
    if full is not None and full is whole:  # it held the lent gradients: zero again for the next accumulation
        full.zero_()
    for segment in bucket.segments:
        slot = None if full is None else full[segment.offset : segment.offset + segment.numel]
        segment.param.grad = None if slot is None else as_placed(segment.param, slot)


class LocalBucketGradientLoan:
    """Stage 2 in a micro-step without a sync (gradient accumulation): ``.grad`` views of this rank's accumulating
    whole buckets, the local sum DDP's ``no_sync`` holds too. Local; a change to ``.grad`` changes the bucket."""

    gathered_bytes = allocated_bytes = 0

    def __init__(self, buckets: ShardedParameterBuckets) -> None:
        self.params: list[nn.Parameter] = []
        for bucket in buckets.buckets:
            if bucket.full_grads is None:
                continue
            for segment in bucket.segments:
                if buckets.got_gradient_here(segment.param):
                    view = bucket.full_grads[segment.offset : segment.offset + segment.numel]
                    segment.param.grad = as_placed(segment.param, view)
                    self.params.append(segment.param)

    def hand_back(self) -> None:
        for param in self.params:  # autograd must give the next micro-step's gradient fresh, for the hook to add it
            param.grad = None
        self.params.clear()

    def buffers(self) -> list[Tensor]:
        return []  # views of the buckets, which the backend counts


class ShardedTensorGradientLoan:
    """Stage 3: each ``DTensor`` gradient all-gathered into a plain whole ``.grad`` (collective), re-sharded on hand
    back."""

    def __init__(self, module: nn.Module, *, stats: CommunicationStats | None = None) -> None:
        self.lent: list[tuple[nn.Parameter, DTensor, Tensor, int]] = []  # the shard, the whole lent and its version
        self.gathered_bytes = self.allocated_bytes = 0
        for param in module.parameters():  # the same order on every rank
            grad = param.grad
            if isinstance(param, DTensor) and isinstance(grad, DTensor):
                param.grad = whole = grad.full_tensor()
                self.lent.append((param, grad, whole, whole._version))
                self.gathered_bytes += whole.numel() * whole.element_size()
                self.allocated_bytes += whole.numel() * whole.element_size()
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

    def buffers(self) -> list[Tensor]:
        return [shard for _, shard, _, _ in self.lent]  # off `.grad` while the whole gradients are lent


class LocalShardedTensorGradientLoan:
    """Stage 3 in a micro-step without a sync: FSDP2's unsharded local sums (DDP's ``no_sync`` gradients) as the
    parameters' ``.grad``. Local; a change to ``.grad`` changes FSDP2's sum; hand-back restores the shards."""

    gathered_bytes = allocated_bytes = 0

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

    def buffers(self) -> list[Tensor]:
        return [shard for _, shard in self.lent if shard is not None]


class LendOnRead:
    """A loan made only when code reads a gradient: from :meth:`open` (after a sync) until :meth:`hand_back`, the first
    read or assignment of a watched parameter's ``.grad`` from Python makes the loan ``lend()`` returns, before the
    read returns (collective: every rank lends then). A step without such a read lends nothing.

    Collective at the first read or at :meth:`hand_back`, whichever comes first: one ``uint8`` all-reduced (max) over
    ``group``, the same group on every rank, so that every rank lends when any rank reads (a read on rank 0 only,
    ``if trainer.is_global_zero``, does not hang: the other ranks lend with it at their hand-back). Its limit: a rank
    that reads must not wait, between its read and the step, for a collective of a rank that does not read (that rank
    waits for the reader in :meth:`hand_back`). ``group=None``: one rank, nothing agreed.

    Our own code reads ``.grad`` inside :meth:`unwatched` (the strategy's clipping over shards, the monitor's tensor
    count): what the shards hold, no loan. One object serves a whole fit: :meth:`open` it at each synchronised
    backward.

    Args:
        lend: makes the loan (collective on every rank; ``None``: nothing to lend).
        parameters: the parameters whose ``.grad`` is watched (the module's).
        group: the group the ranks agree over (a CPU group: the flag is read on the host).
        on_lend: called after each loan made here, with it and whether this rank read (``False``: another rank did).
    """

    def __init__(
        self,
        lend: Callable[[], GradientLoan | None],
        *,
        parameters: Iterable[Tensor],
        group: dist.ProcessGroup | None,
        on_lend: Callable[[GradientLoan, bool], None] | None = None,
    ) -> None:
        self._lend = lend
        self._watched = frozenset(id(param) for param in parameters)
        self._group = group
        self._on_lend = on_lend
        self.loan: GradientLoan | None = None
        """The loan made in the open window, if any: whole gradients on ``.grad`` now."""
        self.watching = False
        """Whether a read lends now (inside an open window, before the loan, outside :meth:`unwatched`)."""
        self.is_open = False
        self._agreed = False  # this window's one agreement ran
        self._mode = _GradientReadWatch(self)
        self._mode_pushed = False
        self.gathered_bytes = self.allocated_bytes = 0  # the last loan's (:attr:`loan`)

    def open(self) -> None:
        """Local. Watch reads of ``.grad`` until :meth:`hand_back`."""
        if self.is_open:  # a window left open (a backward without a step): it ends first
            self.hand_back()
        self.is_open, self.watching, self._agreed = True, True, False
        if not self._mode_pushed:
            self._mode.__enter__()
            self._mode_pushed = True

    def watches(self, tensor: Any) -> bool:
        return self.watching and id(tensor) in self._watched

    def lend_now(self) -> None:
        """Collective (the agreement and the loan's gather). Lend, on a read in the open window."""
        self.watching = False
        if not self._agreed:
            self._agree(wants_loan=True)
            self._make(read_here=True)

    def hand_back(self) -> None:
        """Collective unless this window lent already (one byte all-reduced: whether another rank read, then the
        loan's gather if one did). End the window: the loan, if any, goes back to the shards."""
        if not self.is_open:
            return
        self.watching = False
        if not self._agreed and self._agree(wants_loan=False):  # another rank read: lend with it
            self._make(read_here=False)
        self.is_open = False
        self._leave_mode()
        loan, self.loan = self.loan, None
        if loan is not None:
            loan.hand_back()

    def buffers(self) -> list[Tensor]:
        return [] if self.loan is None else self.loan.buffers()

    def discard(self) -> None:
        """Local. Stop watching, without agreeing (the fit ended or failed); the loan, if any, is dropped."""
        self.is_open = self.watching = False
        self.loan = None
        self._leave_mode()

    @contextmanager
    def unwatched(self) -> Generator[None, None, None]:
        """Local. Reads of ``.grad`` inside see what the shards hold and lend nothing (our own code's reads)."""
        watching, self.watching = self.watching, False
        try:
            yield
        finally:
            self.watching = watching and self.is_open and self.loan is None

    def _agree(self, *, wants_loan: bool) -> bool:
        self._agreed = True
        if self._group is None or dist.get_world_size(self._group) == 1:
            return wants_loan
        flag = torch.tensor([int(wants_loan)], dtype=torch.uint8)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def _make(self, *, read_here: bool) -> None:
        self.loan = self._lend()
        if self.loan is not None:
            self.gathered_bytes, self.allocated_bytes = self.loan.gathered_bytes, self.loan.allocated_bytes
            if self._on_lend is not None:
                self._on_lend(self.loan, read_here)

    def _leave_mode(self) -> None:
        """Leave the mode stack if the watch is innermost; under a mode entered since, it stays as a pass-through
        (not watching) until a later hand-back finds it innermost."""
        if self._mode_pushed and current_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode_pushed = False


_GRADIENT_ACCESS: frozenset[Any] = frozenset(
    getattr(getattr(Tensor, name), method)
    for name in ("grad", "_grad")
    for method in ("__get__", "__set__", "__delete__")
)
"""What torch calls a ``TorchFunctionMode`` with for ``tensor.grad`` read, assigned or deleted from Python."""


class _GradientReadWatch(TorchFunctionMode):
    """Lends before the first access to a watched parameter's ``.grad`` (:class:`LendOnRead`); passes all else."""

    def __init__(self, owner: LendOnRead) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Inside this method the mode is off: the loan's own torch calls are not seen.
        if self.owner.watching and func in _GRADIENT_ACCESS and args and self.owner.watches(args[0]):
            self.owner.lend_now()
        return func(*args, **(kwargs or {}))
