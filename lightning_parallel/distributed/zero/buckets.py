"""ZeRO stages 1 and 2 on plain torch collectives: flat buckets, reduce-scatter during backward, sharded step.

Layout (Megatron's distributed optimizer / DeepSpeed ZeRO):

* Trainable parameters are grouped, in reverse registration order (roughly the order backward produces their
  gradients, as DDP does), into buckets of at most ``bucket_cap_mb``. Each bucket owns one flat parameter buffer;
  the module's parameters become views into it (``param.data = flat[a:b].view(shape)``), so the module, its
  ``state_dict`` and the user's references keep working unchanged.
* Each bucket is padded to a multiple of the world size and cut into equal contiguous shards; rank r owns shard r.
* Backward: a post-accumulate-grad hook adds each parameter's gradient into its bucket's flat gradient buffer and
  drops ``param.grad``. When a bucket is complete (and this micro-step synchronises) its average is
  reduce-scattered asynchronously while backward goes on (on gloo all-reduced in place, each rank keeping its slice:
  faster there, see :func:`default_gradient_reduction`). Buckets are launched in one fixed order (bucket order, from
  the first sync on the order rank 0's first backward completed them), so every rank issues the same collectives
  in the same order even when parameters are unused on some ranks.
* Step: the user's optimizer sees, per parameter group, 1-D views of the owned pieces of its parameters, with the
  reduced gradient shard as ``.grad``. It updates the flat parameter buffer in place; then each bucket's shard is
  all-gathered (``distributed/zero/gather.py`` overlaps that with the next forward). Reduce-scatter + all-gather
  moves the same bytes as DDP's all-reduce.
* Unused parameters: ``torch.optim`` skips a ``None`` gradient (no momentum, no weight decay), but a flat shard
  cannot tell it from a zero one. Each sync also all-reduces one "got a gradient since the last sync" flag per
  parameter; a view gets ``.grad`` only if its parameter got one on some rank (average ``sum / N``, as DDP) or
  still holds one (no ``zero_grad`` since). Frozen parameters the optimizer holds are bucketed too, so unfreezing
  needs no new layout. The flags are one byte per bucketed parameter per sync, counted in ``stats`` as an
  all-reduce (as the planner counts them). They are host facts (set by the backward hooks): given a CPU group
  (``flags_group``) they are all-reduced there, so a sync reads nothing back from the device. ``toggle_optimizer``
  switches ``requires_grad`` of the views (the optimizer's tensors): a view switched off keeps its ``.grad`` through
  a sync, as a frozen parameter does on one device.

Stage 1 keeps the full flat gradient buffers (``Psi`` bytes) between steps and reduce-scatters each one *in place*:
the reduced shard is rank r's own slice of its full buffer (NCCL and gloo both allow an output that is the input's
``rank``-th slice), so stage 1 holds ``Psi`` bytes of gradients, as DDP + ``ZeroRedundancyOptimizer`` does, not
``Psi + Psi / N``. Between a sync and the optimizer step that slice holds the averaged gradient; parameters that
overlap it get a fresh ``.grad`` from autograd in the next backward (the others accumulate in place into their slot of
the bucket), and the slice is zeroed at the first gradient of the next accumulation. Stage 2 frees each bucket's full
buffer as soon as its reduce-scatter completes and keeps only the ``Psi / N`` shard. Optimizer state exists only for
the owned views: ``K * Psi / N``. Neither stage ever holds a second full copy of gradients or optimizer state. What
each view's ``.grad`` is across syncs (kept, carried aside, cleared: torch's semantics on one device, also in place)
is decided in ``distributed/zero/accumulation.py``.

Peak memory, not only the steady state: at stage 2 a bucket's full buffer is freed as soon as its collective has
completed and this rank's slice is taken (checked at every gradient, not only at the next launch), and a new full
buffer is allocated only once fewer than ``max_buckets_in_flight`` collectives are in flight (waiting for the oldest
if need be). The whole buckets alive at once, in flight or being filled, are thus at most ``max_buckets_in_flight``
(plus autograd's gradient of the parameter at hand, and any bucket whose gradients backward interleaves with
another's) instead of growing to ``Psi`` when the collectives finish late; the sync frees each one as it completes.
The all-gather after the step is in place (each rank's shard is already its slice of the flat buffer): no copy.

16-bit parameters with fp32 master weights (``master_dtype=torch.float32``; ``Trainer(precision="bf16-true")``, ZeRO
paper section 3.1): the module's parameters stay bf16 views of the bf16 flat buckets (``2 Psi``). Each rank also
keeps an fp32 copy of its shard of every bucket, the master (``4 Psi / N``), and the optimizer steps 1-D views of
*that* (so its state is fp32 too). Gradients are accumulated in the bf16 bucket as autograd produces them, upcast to
fp32 when the bucket is launched and reduce-scattered in fp32 into an fp32 shard (``4 Psi / N``; the fp32 copy of
the bucket lives only while its collective is in flight). After the step the updated master shard is rounded to
bf16 into the flat buffer, which is then all-gathered (in bf16, ``2 Psi`` bytes as before).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.accounting import (
    CommunicationStats,
    MemoryReport,
    module_memory_report,
    optimizer_state_tensors,
    storage_bytes,
)
from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_, grad_norm_over_ranks
from lightning_parallel.distributed.gloo_collectives import (
    ParameterGather,
    all_gather_by_broadcasts,
    default_parameter_gather,
)
from lightning_parallel.distributed.zero.accumulation import (
    clear_unowned,
    reduce_output,
    start_accumulation,
    take_reduced,
)
from lightning_parallel.distributed.zero.flat_bucket import FlatBucket, Segment, ShardView
from lightning_parallel.distributed.zero.layout import BucketMember, bucket_layout, min_buckets, padded_numel
from lightning_parallel.distributed.zero.local_shards import as_placed, local_gradient_of, local_tensor
from lightning_parallel.distributed.zero.replica_reduction import ProcessGroupReplicas, ReplicaReduction

__all__ = [
    "DEFAULT_BUCKETS_IN_FLIGHT",
    "GradientReduction",
    "MemoryReport",
    "ShardView",
    "ShardedParameterBuckets",
    "default_gradient_reduction",
    "module_memory_report",
]

DEFAULT_BUCKETS_IN_FLIGHT = 2
"""Collectives of stage-1/2 buckets that may be in flight at once (each holds a full bucket, or a shard copy); at
stage 2 also the whole gradient buckets alive at once, the one being filled included."""


# torch 2.12 renamed the flat collectives and deprecates the old names with a FutureWarning on every call. Looked up
# at each call, not bound at import, so that counting shims installed on `torch.distributed` (the benchmarks') see us.
def _reduce_scatter(output: Tensor, full: Tensor, *, group: dist.ProcessGroup | None) -> dist.Work:
    """Async sum of ``full`` over ranks, this rank's ``1/N`` slice into ``output``."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)


GradientReduction = Literal["reduce_scatter", "all_reduce"]


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same element of the same storage (``data_ptr`` equality, also for the
    planner's fake tensors, whose data pointers are all 0)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()


def default_gradient_reduction(group: dist.ProcessGroup | None) -> GradientReduction:
    """The fastest way to average a gradient bucket into this rank's shard on ``group``'s backend.

    A reduce-scatter moves half an all-reduce's bytes and is what NCCL does best. Gloo's is not: its
    ``reduce_scatter_tensor`` copies the input in the calling thread before it starts (about 10 ms for 20 MB, which
    stalls backward) and then runs slower than its ring all-reduce (measured on 2 ranks, 20 MB: 23-34 ms in total
    against 15.5 ms, of which 0.1 ms in the caller). On gloo every rank therefore all-reduces the bucket in place
    and keeps its own slice: the same result, more bytes on the wire, less time.
    """
    return "all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter"


def _all_gather(output: Tensor, shard: Tensor, *, group: dist.ProcessGroup | None) -> dist.Work:
    """Async concatenation of every rank's ``shard`` into ``output``."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, shard, group=group, async_op=True)


class ShardedParameterBuckets:
    """Flat bucketed parameters and gradients of ``module``, sharded across ``group``.

    Args:
        module: the model; its trainable parameters are moved into flat buffers in place.
        stage: 1 (optimizer state sharded) or 2 (optimizer state and gradients sharded).
        group: the process group that shards the buckets (``None``: the default group).
        replicate_group: hybrid sharding (``ShardedOptimizerStrategy(shard_size=...)``): the ranks holding the same
            shard in the other shard groups (the mesh's ``replicate`` axis); each reduced gradient shard is then
            all-reduced across it (``1/K`` of the bucket's bytes), so gradients are averaged over every rank.
            ``None``: ``group`` is every rank there is.
        replicas: instead of ``replicate_group``, any
            :class:`~.replica_reduction.ReplicaReduction` of the reduced shards across the
            replicas (``FaultTolerance``: torchft's manager across replica groups, each its own job).
        bucket_cap_mb: bucket size in MiB; at stage 2 at most a thirty-second of the model
            (:data:`~lightning_parallel.distributed.zero.layout.STAGE2_MIN_BUCKETS`).
        frozen: parameters to bucket although ``requires_grad`` is off (those the optimizers hold, so unfreezing
            them later needs no new layout). Other frozen parameters stay outside the buckets, never communicated.
        max_buckets_in_flight: reduce-scatters (stage 2, or of fp32 copies beside 16-bit buckets) in flight at once;
            one more waits for the oldest first. At stage 2 it bounds the whole gradient buckets alive during a
            backward, the one being filled included: a new one waits for the oldest in flight.
        master_dtype: ``torch.float32`` keeps an fp32 master copy of this rank's shard of every bucket of 16-bit
            parameters, which the optimizer steps, and reduces their gradients in fp32 (module docstring). No effect
            on buckets whose parameters already have at least that precision. ``None``: step the parameters
            themselves and reduce in their dtype.
        reduce_dtype: the dtype gradients are reduced in on the wire (``torch.bfloat16``, ``torch.float16``:
            ``ShardedOptimizerStrategy(gradient_compression=...)``): each bucket is cast to it when launched, divided,
            reduced (also across the replicas under hybrid sharding) and the result copied into the shard, which keeps
            its own dtype (fp32 beside a master or under fp32 parameters). ``None``: the master's dtype beside a
            master, else the parameters'.
        gradient_reduction: ``"reduce_scatter"`` or ``"all_reduce"`` (each rank keeps its slice of the result);
            ``None``: the faster on ``group``'s backend (:func:`default_gradient_reduction`: all-reduce on gloo).
        parameter_gather: ``"all_gather"`` or ``"broadcasts"`` (one per rank, the same result); ``None``: the faster
            on ``group``'s backend (:func:`~lightning_parallel.distributed.gloo_collectives.default_parameter_gather`:
            broadcasts on gloo).
        gradient_hooks: take each gradient into its bucket as backward produces it (a post-accumulate-grad hook per
            parameter); ``False`` for a caller whose backward bypasses autograd's accumulation (a pipeline schedule's
            split weight gradients): it lets backward fill ``.grad``, then calls :meth:`add_gradients`.
        flags_group: a CPU (gloo) group of the ranks of ``group`` and of ``replicate_group``
            (``HostGroups.data_parallel``): the "got a gradient" flags are all-reduced there, on the host, with no
            device sync. ``None``: over ``group`` (and ``replicate_group``) on the buckets' device, and read back
            (one wait of the host for the device per sync).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        replicas: ReplicaReduction | None = None,
        bucket_cap_mb: float = 25.0,
        frozen: Iterable[nn.Parameter] = (),
        max_buckets_in_flight: int = DEFAULT_BUCKETS_IN_FLIGHT,
        master_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        gradient_reduction: GradientReduction | None = None,
        parameter_gather: ParameterGather | None = None,
        gradient_hooks: bool = True,
        flags_group: dist.ProcessGroup | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"`stage={stage!r}` is invalid for ShardedParameterBuckets: use 1 or 2.")
        if replicate_group is not None and replicas is not None:
            raise ValueError("Pass `replicate_group` or `replicas` to ShardedParameterBuckets, not both.")
        if max_buckets_in_flight < 1:
            raise ValueError(f"`max_buckets_in_flight={max_buckets_in_flight!r}` is invalid: use 1 or more.")
        self.stage = stage
        self.master_dtype = master_dtype
        self.reduce_dtype = reduce_dtype
        self.max_buckets_in_flight = max_buckets_in_flight
        self._in_flight: deque[FlatBucket] = deque()  # stage 2: launched reduce-scatters whose full buffer is alive
        self.group = group
        self.gradient_reduction: GradientReduction = gradient_reduction or default_gradient_reduction(group)
        self.parameter_gather: ParameterGather = parameter_gather or default_parameter_gather(group)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.replicate_group = replicate_group
        self.replicas: ReplicaReduction | None = (
            ProcessGroupReplicas(replicate_group) if replicate_group is not None else replicas
        )
        """Who averages the reduced shards across the replicas (hybrid sharding), or ``None``."""
        self.replicate_size = self.replicas.divisor if self.replicas is not None else 1
        self.flags_group = flags_group
        self._flags_cross_jobs = replicas is not None
        """The flags must also cross replica groups that are other jobs (torchft), which no host group reaches."""
        self.sync_gradients = True
        self.stats: CommunicationStats | None = None
        """Where to count collective bytes (``None``: not counted); see :class:`CommunicationStats`."""
        self._next_launch = 0
        self._completed: list[int] = []  # bucket indices in the order the first backward completed them
        self._hooks: list = []
        kept = set(frozen)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad or p in kept]
        self.buckets = self._build_buckets(list(reversed(named)), bucket_cap_mb)
        self.launch_order: list[int] = list(range(len(self.buckets)))
        """Order in which complete buckets are reduce-scattered: their index (reverse registration) until the first
        sync, then the order in which rank 0's first backward completed them (:meth:`_settle_launch_order`)."""
        self._launch_order_settled = False
        self.agree_on_launch_order = True
        """Broadcast rank 0's launch order at the first sync; ``False`` keeps this rank's own (the planner's dry run,
        which plays one rank on fake tensors whose broadcast carries no values)."""
        self._bucket_of: dict[nn.Parameter, tuple[FlatBucket, Segment]] = {
            segment.param: (bucket, segment) for bucket in self.buckets for segment in bucket.segments
        }
        for index, (_, segment) in enumerate(self._bucket_of.values()):
            segment.index = index
        # Parameters that got a gradient on this rank since the last sync (any micro-step counts).
        self._used = bytearray(len(self._bucket_of))
        for param in self._bucket_of if gradient_hooks else ():
            # torch refuses a hook on a frozen tensor, but keeps one across `requires_grad` changes.
            frozen_now = not param.requires_grad
            param.requires_grad_(True)
            self._hooks.append(param.register_post_accumulate_grad_hook(self._on_gradient))
            param.requires_grad_(not frozen_now)

    # ------------------------------------------------------------------ layout
    def _build_buckets(self, named: list[tuple[str, nn.Parameter]], bucket_cap_mb: float) -> list[FlatBucket]:
        # A tensor-parallel weight is bucketed as its local shard (`distributed/zero/local_shards.py`).
        tensors = [local_tensor(p) for _, p in named]
        members = [BucketMember(t.numel(), t.element_size(), (t.dtype, t.device)) for t in tensors]
        layout = bucket_layout(members, bucket_cap_mb=bucket_cap_mb, min_buckets=min_buckets(self.stage))
        return [self._make_bucket([named[i] for i in indices]) for indices in layout]

    def _make_bucket(self, members: list[tuple[str, nn.Parameter]]) -> FlatBucket:
        padded = padded_numel(sum(local_tensor(param).numel() for _, param in members), self.world_size)
        reference = local_tensor(members[0][1])
        flat = torch.zeros(padded, dtype=reference.dtype, device=reference.device)
        segments, offset = [], 0
        for name, param in members:
            local = local_tensor(param)  # the parameter itself, or a split weight's local shard
            numel = local.numel()
            flat[offset : offset + numel].copy_(local.detach().reshape(-1))
            local.data = flat[offset : offset + numel].view_as(local)
            segments.append(Segment(param=param, name=name, offset=offset, numel=numel))
            offset += numel
        shard_numel = padded // self.world_size
        master = None
        if self._keeps_master(flat.dtype):
            assert self.master_dtype is not None
            master = torch.empty(shard_numel, dtype=self.master_dtype, device=flat.device)
        start = self.rank * shard_numel
        full_grads = torch.zeros_like(flat) if self.stage == 1 else None
        in_place = full_grads is not None and master is None
        bucket = FlatBucket(
            segments=segments,
            numel=padded,
            shard_numel=shard_numel,
            flat_params=flat,
            # The reduced gradient shard has the dtype of what the optimizer steps: fp32 beside an fp32 master. Stage 1
            # without a master reduces in place: the shard is this rank's slice of the persistent full buffer.
            shard_grads=(
                full_grads[start : start + shard_numel]
                if in_place and full_grads is not None
                else torch.zeros(shard_numel, dtype=flat.dtype if master is None else master.dtype, device=flat.device)
            ),
            full_grads=full_grads,
            master=master,
            reduces_in_place=in_place,
            owned_segments=[s for s in segments if s.offset < start + shard_numel and s.offset + s.numel > start],
        )
        self._copy_to_master(bucket)
        bucket.views = self._owned_views(bucket)
        return bucket

    def _keeps_master(self, dtype: torch.dtype) -> bool:
        master = self.master_dtype
        return master is not None and dtype.is_floating_point and torch.finfo(dtype).bits < torch.finfo(master).bits

    def _copy_to_master(self, bucket: FlatBucket) -> None:
        if bucket.master is not None:
            start = self.rank * bucket.shard_numel
            bucket.master.copy_(bucket.flat_params[start : start + bucket.shard_numel])

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """Local. Set every master shard to this rank's shard of the (16-bit) parameters, e.g. after loading
        weights into the module; the upcast is exact."""
        for bucket in self.buckets:
            self._copy_to_master(bucket)

    def _owned_views(self, bucket: FlatBucket) -> list[ShardView]:
        shard_start = self.rank * bucket.shard_numel
        shard_stop = shard_start + bucket.shard_numel
        views = []
        for segment in bucket.segments:
            lo = max(segment.offset, shard_start)
            hi = min(segment.offset + segment.numel, shard_stop)
            if lo >= hi:
                continue
            views.append(
                ShardView(
                    name=segment.name,
                    param=segment.param,
                    start=lo - segment.offset,
                    stop=hi - segment.offset,
                    tensor=(
                        bucket.flat_params[lo:hi]
                        if bucket.master is None
                        else bucket.master[lo - shard_start : hi - shard_start]
                    ),
                    grad=bucket.shard_grads[lo - shard_start : hi - shard_start],
                    grad_offset=lo - shard_start,
                )
            )
        return views

    def views(self) -> list[ShardView]:
        """Every piece of every parameter this rank owns, bucket by bucket."""
        return [view for bucket in self.buckets for view in bucket.views]

    @property
    def parameters(self) -> list[nn.Parameter]:
        return list(self._bucket_of)

    # ------------------------------------------------------------------ backward
    def _on_gradient(self, param: nn.Parameter) -> None:
        bucket, segment = self._bucket_of[param]
        if bucket.launched:
            raise RuntimeError(
                f"Parameter `{segment.name}` got a gradient after its bucket was already reduced in this backward"
                " (a second gradient in one backward, or `requires_grad` switched on during backward). Set"
                " `requires_grad` before the forward pass."
            )
        if bucket.ready == 0:  # first gradient of this bucket in this backward: `requires_grad` may have changed
            bucket.expected = sum(1 for s in bucket.segments if s.param.requires_grad)
        if bucket.full_grads is None:
            self._make_room_for_a_bucket()
            bucket.full_grads = torch.zeros(bucket.numel, dtype=bucket.flat_params.dtype, device=param.device)
        elif self._in_flight:  # free what finished since the last gradient before autograd allocates the next one
            self._release_reduced_buckets()
        start_accumulation(bucket)
        grad = local_gradient_of(param)
        assert grad is not None
        target = bucket.full_grads[segment.offset : segment.offset + segment.numel]
        if self.stage == 1 and _same_memory(grad, target):
            pass  # stage 1: `.grad` is a view into the persistent bucket and autograd accumulated in place
        else:
            target.add_(grad.reshape(-1))
            # Stage 1 points `.grad` at its slot in the persistent bucket (no allocation or copy from the next
            # step on, like DDP's gradient_as_bucket_view); stage 2 frees it, keeping only the bucket until sync.
            param.grad = as_placed(param, target) if self.stage == 1 else None
        self._used[segment.index] = 1
        bucket.ready += 1
        if bucket.ready >= bucket.expected:
            if not self._launch_order_settled:
                self._completed.append(next(i for i, b in enumerate(self.buckets) if b is bucket))
            if self.sync_gradients:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self, *, flush: bool = False) -> None:
        """Launch buckets in :attr:`launch_order` while they are complete (all of them when ``flush``)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self.launch_order[self._next_launch]]
            if not flush and (bucket.ready == 0 or bucket.ready < bucket.expected):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _settle_launch_order(self, device: torch.device) -> None:
        """Collective, once (the first sync): launch buckets from now on in the order backward completes them.

        Buckets follow reverse registration order, which is roughly the order backward produces gradients; where a
        model registers its modules in another order than it uses them, a bucket launched early in that order waits
        for its last gradient and holds back every complete bucket behind it (launches must keep one order on every
        rank). The order the first backward actually completed them (DDP likewise rebuilds its buckets after the
        first iteration) removes that wait. Rank 0's order is broadcast so that every rank issues the same
        collectives in the same order, whatever its own backward did (unused parameters, different control flow).
        """
        seen = dict.fromkeys(self._completed)  # first completion of each bucket, in order
        order = [*seen, *(i for i in range(len(self.buckets)) if i not in seen)]
        if self.agree_on_launch_order:
            agreed = torch.tensor(order, dtype=torch.int64, device=device)
            dist.broadcast(agreed, group=self.group, group_src=0)
            order = agreed.tolist()
        self.launch_order = order
        self._launch_order_settled = True
        self._completed.clear()

    def _launch(self, bucket: FlatBucket) -> None:
        if bucket.full_grads is None:  # no parameter of this bucket got a gradient on this rank
            self._make_room_for_a_bucket()
            bucket.full_grads = torch.zeros(
                bucket.numel, dtype=bucket.flat_params.dtype, device=bucket.flat_params.device
            )
        start_accumulation(bucket)
        full = bucket.full_grads
        wire = self._wire_dtype(bucket)
        send = full
        # Stage 1 keeps its 16-bit bucket beside a master (the views' `.grad`); otherwise the bucket is reduced in place
        # when it already has the wire dtype.
        if wire != full.dtype or (bucket.master is not None and self.stage == 1):
            send = bucket.send = full.to(wire, copy=True)  # a copy in the wire dtype while the collective runs
            if self.stage == 2:  # the copy is what is reduced: free the whole bucket now
                bucket.full_grads = None
        send.div_(self.world_size * self.replicate_size)  # the average over every rank (hybrid: every group too)
        output = reduce_output(bucket)  # the shard, or beside it when views keep gradients (torch's `.grad`)
        if self.stats is not None:  # bytes of the full (unsharded) buffer, for either collective
            self.stats.record(self.gradient_reduction, send.numel() * send.element_size())
        if self.gradient_reduction == "all_reduce":
            bucket.work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            start = self.rank * bucket.shard_numel
            owned = send[start : start + bucket.shard_numel]
            bucket.copy_after = None if output.data_ptr() == owned.data_ptr() else (output, owned)
        elif output.dtype != send.dtype:  # into a shard of the wire dtype, copied into the output once complete
            received = torch.empty(bucket.shard_numel, dtype=send.dtype, device=send.device)
            bucket.work = _reduce_scatter(received, send, group=self.group)
            bucket.copy_after = (output, received)
        else:
            bucket.work = _reduce_scatter(output, send, group=self.group)
        bucket.launched = True
        if self.stage == 2 or bucket.send is not None:  # stage 1 too when it reduces an fp32 copy of the bucket
            self._in_flight.append(bucket)
            self._release_reduced_buckets()

    def _wire_dtype(self, bucket: FlatBucket) -> torch.dtype:
        """The dtype ``bucket``'s gradients are reduced in: :attr:`reduce_dtype` if set, else the master's beside one,
        else the parameters'."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return bucket.master.dtype if bucket.master is not None else bucket.flat_params.dtype

    def _complete(self, bucket: FlatBucket) -> None:
        """Wait for ``bucket``'s gradient collective; after an all-reduce, take this rank's slice of the result."""
        assert bucket.work is not None
        bucket.work.wait()
        bucket.work = None
        if bucket.copy_after is not None:
            output, owned = bucket.copy_after
            output.copy_(owned)
            bucket.copy_after = None

    def _make_room_for_a_bucket(self) -> None:
        """Stage 2, before a full gradient buffer is allocated: wait until fewer than ``max_buckets_in_flight``
        collectives are in flight, so that the new bucket and those in flight are at most ``max_buckets_in_flight``
        whole buckets (in a backward that fills buckets one after another, as reverse registration order does)."""
        if self.stage == 2:
            self._release_reduced_buckets(limit=self.max_buckets_in_flight - 1)

    def _release_reduced_buckets(self, *, limit: int | None = None) -> None:
        """Free what a finished collective no longer needs, oldest first, as soon as this rank's slice is taken: the
        full gradient buffer (stage 2) and the fp32 copy that was reduced (16-bit parameters with masters, both
        stages); while more than ``limit`` (default ``max_buckets_in_flight``) are in flight, wait for the oldest.
        The reduced values are in the shard (or in ``pending_shard``). Stage 1 keeps its full 16-bit buffer: it
        persists between steps."""
        limit = self.max_buckets_in_flight if limit is None else limit
        while self._in_flight:
            oldest = self._in_flight[0]
            assert oldest.work is not None
            if len(self._in_flight) <= limit and not oldest.work.is_completed():
                return
            self._complete(oldest)
            self._free_reduced(oldest)
            self._in_flight.popleft()

    def _free_reduced(self, bucket: FlatBucket) -> None:
        """After ``bucket``'s collective completed and its slice was taken: drop the buffers it no longer needs."""
        bucket.send = None
        if self.stage == 2:
            bucket.full_grads = None

    def finish_gradient_sync(self) -> None:
        """Collective. Launch what backward left (unused parameters), wait for every reduce-scatter, agree on which
        parameters got a gradient, and give the optimizer's views their ``.grad`` (``None``: not stepped)."""
        self._launch_ready_buckets(flush=True)
        self._in_flight.clear()  # waited for below
        device = self.buckets[0].flat_params.device if self.buckets else torch.device("cpu")
        used, used_work = self._launch_used_flags(device)
        for bucket in self.buckets:
            if bucket.work is not None:
                self._complete(bucket)
            self._free_reduced(bucket)  # one whole bucket at a time, not all of them until the loop below
            bucket.ready = 0
            bucket.launched = False
        if used_work is not None:
            used_work.wait()
        got_gradient = self._got_gradient_anywhere(self._used_across_replicas(used))
        for bucket in self.buckets:
            take_reduced(bucket, got_gradient=got_gradient)
            if bucket.reduces_in_place:
                clear_unowned(bucket, rank=self.rank)
            elif bucket.full_grads is not None:
                bucket.full_grads.zero_()
        self._next_launch = 0
        self._used[:] = bytes(len(self._used))
        if not self._launch_order_settled and self.buckets:
            self._settle_launch_order(device)

    def _launch_used_flags(self, device: torch.device) -> tuple[Tensor | None, dist.Work | None]:
        """Collective (asynchronous). Launch the MAX over the ranks of the "got a gradient" flags: on the host over
        :attr:`flags_group` (a copy of the hooks' bytes), else on ``device`` over :attr:`group`."""
        if not self._used:
            return None, None
        if self.stats is not None:  # one byte per bucketed parameter (the planner counts it)
            self.stats.record("all_reduce", len(self._used))
        if self.flags_group is not None:
            used = torch.frombuffer(bytearray(self._used), dtype=torch.uint8)
            return used, dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.flags_group, async_op=True)
        # A copy to the device from pageable memory is staged before it returns: `non_blocking` spares the wait for
        # the stream, and the hooks' bytes may be reset at once.
        used = torch.frombuffer(self._used, dtype=torch.uint8).to(device, copy=True, non_blocking=True)
        return used, dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def _used_across_replicas(self, used: Tensor | None) -> list[int]:
        """Collective across the replicas (hybrid sharding; their shards are reduced here too): the flags of every
        rank averaging these gradients, on the host."""
        if self.flags_group is None:
            self._all_reduce_across_replicas(used)
            return used.tolist() if used is not None else []  # a device read: no host group was given
        if not self._flags_cross_jobs or used is None:
            self._all_reduce_across_replicas(None)  # `flags_group` spans the replicas of this job's mesh already
            return used.tolist() if used is not None else []  # a host tensor: no device sync
        # Replica groups that are other jobs (torchft) combine the flags with the shards, on the shards' device: the
        # one sync left (the cross-job reduction takes device tensors, and no host group spans the jobs).
        on_device = used.to(self.device, non_blocking=True)
        self._all_reduce_across_replicas(on_device)
        return on_device.tolist()

    def _got_gradient_anywhere(self, used_anywhere: list[int]) -> Callable[[nn.Parameter], bool]:
        """Whether a bucketed parameter got a gradient on some rank, from the all-reduced flags."""
        return lambda param: bool(used_anywhere[self._bucket_of[param][1].index])

    def _all_reduce_across_replicas(self, used: Tensor | None) -> None:
        """Collective across :attr:`replicas` (hybrid sharding only): combine each bucket's freshly reduced shard
        (already divided by :attr:`replicate_size` times this group's ranks) and the "got a gradient" flags, in bucket
        order on every rank. Each shard is ``1/K`` of its bucket: cheaper than an all-reduce of whole buckets."""
        if self.replicas is None:
            return
        fresh = [b.shard_grads if b.pending_shard is None else b.pending_shard for b in self.buckets]
        if self.reduce_dtype is None:
            self.replicas.reduce(fresh, used, self.stats)
            return
        # Compressed: each shard holds what was reduced in the wire dtype, so casting it back is exact (an fp32 shard).
        sent = [shard.to(self.reduce_dtype) for shard in fresh]
        self.replicas.reduce(sent, used, self.stats)
        for shard, summed in zip(fresh, sent, strict=True):
            shard.copy_(summed)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def all_gather_parameters(self, buckets: Iterable[int] | None = None) -> None:
        """Collective. Give every rank the updated full parameters after the sharded optimizer step.

        Args:
            buckets: indices of the buckets to gather (those holding the stepped optimizer's parameters); every
                rank must pass the same ones. ``None``: all of them.
        """
        chosen = range(len(self.buckets)) if buckets is None else buckets
        for work in [self.launch_parameter_gather(index) for index in chosen]:
            work.wait()

    @torch.no_grad()
    def launch_parameter_gather(self, index: int) -> dist.Work:
        """Collective (asynchronous). All-gather bucket ``index``'s flat parameters *in place*: this rank's input is its
        own slice of the output (NCCL and gloo allow it), so no copy of the shard is made. Until the returned work
        completes, the bucket's parameters outside this rank's shard are stale. Every rank launches the same buckets
        in the same order."""
        bucket = self.buckets[index]
        start = self.rank * bucket.shard_numel
        owned = bucket.flat_params[start : start + bucket.shard_numel]
        if bucket.master is not None:  # the optimizer stepped the fp32 master: round it into the 16-bit buffer
            owned.copy_(bucket.master)
        if self.stats is not None:  # bytes of the full (gathered) buffer
            self.stats.record("all_gather", bucket.flat_params.numel() * bucket.flat_params.element_size())
        return self.gather_in_place(bucket.flat_params)

    def gather_in_place(self, flat: Tensor) -> dist.Work:
        """Collective (asynchronous, not counted). All-gather the shards of ``flat`` in place: this rank's slice
        (the ``rank``-th of ``world_size``) already holds its shard, the others are written."""
        if self.parameter_gather == "broadcasts":
            return all_gather_by_broadcasts(flat, self.group)
        start = self.rank * (flat.numel() // self.world_size)
        return _all_gather(flat, flat[start : start + flat.numel() // self.world_size], group=self.group)

    def bucket_indices(self, params: Iterable[nn.Parameter]) -> list[int]:
        """Indices of the buckets holding any of ``params`` (the same on every rank: the layout is)."""
        wanted = {id(param) for param in params}
        return [i for i, bucket in enumerate(self.buckets) if any(id(s.param) in wanted for s in bucket.segments)]

    def global_grad_norm(self, norm_type: float = 2.0, views: Iterable[ShardView] | None = None) -> Tensor:
        """Collective. Norm of the full averaged gradient of ``views`` (default: all), from the reduced shards (each
        element is owned by one rank); views without ``.grad`` count as no gradient, as torch skips them."""
        chosen = [view.tensor for view in (self.views() if views is None else views)]
        return grad_norm_over_ranks(chosen, norm_type=norm_type, groups=[self.group], device=self.device)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, views: Iterable[ShardView] | None = None
    ) -> Tensor:
        """Collective. ``torch.nn.utils.clip_grad_norm_`` semantics over the sharded gradients of ``views``."""
        chosen = [view.tensor for view in (self.views() if views is None else views)]
        return clip_grad_norm_over_ranks_(
            chosen, max_norm, norm_type=norm_type, groups=[self.group], device=self.device
        )

    @property
    def device(self) -> torch.device:
        """The device of the buckets (the CPU when there is none)."""
        return self.buckets[0].flat_params.device if self.buckets else torch.device("cpu")

    def got_gradient_here(self, param: nn.Parameter) -> bool:
        """Local. Whether ``param`` got a gradient on this rank since the last sync."""
        return bool(self._used[self._bucket_of[param][1].index])

    # ------------------------------------------------------------------ accounting
    def memory_report(
        self, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None
    ) -> MemoryReport:
        """Bytes of the buckets' parameters and gradients and of ``optimizers``' per-element state on this rank.

        The fp32 master shards count as optimizer state, as in the ZeRO paper (``K = 12`` bytes per parameter for
        mixed-precision Adam: fp32 master, momentum and variance), since only the optimizer step reads them.
        """
        params = (p for p in self.parameters)
        masters = [bucket.master for bucket in self.buckets if bucket.master is not None]
        return MemoryReport(
            parameters=storage_bytes(params),
            gradients=storage_bytes(self.gradient_buffers()),
            optimizer_state=storage_bytes([*optimizer_state_tensors(optimizers), *masters]),
        )

    def gradient_buffers(self) -> list[Tensor]:
        """The gradient tensors this rank holds now: each bucket's reduced shard, and its full buffer while alive
        (stage 1: always; stage 2: from its first gradient until its reduce-scatter completed)."""
        held = (t for bucket in self.buckets for t in (bucket.shard_grads, bucket.full_grads, bucket.send))
        return [t for t in held if t is not None]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def add_gradients(self) -> None:
        """Local (launches reduce-scatters when ``sync_gradients``). Take the ``.grad`` every bucketed parameter holds
        now into its bucket, as the backward hook does for each gradient.

        For a caller whose backward bypasses autograd's gradient accumulation (a pipeline schedule's split weight
        gradients): built with ``gradient_hooks=False``, it lets backward fill ``.grad``, then calls this and
        :meth:`finish_gradient_sync` (``PipelineParallelStrategy(zero_stage=...)``).
        """
        for param in self._bucket_of:
            if param.grad is not None:
                self._on_gradient(param)
