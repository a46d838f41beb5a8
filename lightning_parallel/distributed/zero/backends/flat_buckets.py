"""ZeRO stages 1-2: parameters in flat buckets reduce-scattered as backward produces gradients, the user's optimizer
stepping this rank's shard, then the buckets all-gathered (``distributed/zero/buckets.py``, ``optimizer.py``,
``gather.py``). The waits of the sync run inside ``events.timed("exposed_communication")`` for whoever listens
(the monitor)."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.accounting import MemoryReport
from lightning_parallel.distributed.checkpoint import ShardedCheckpointReader, ShardedPieces
from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_
from lightning_parallel.distributed.tensor_parallel.norm import counted_once, tensor_axis_of
from lightning_parallel.distributed.zero.backends.context import ZeroContext
from lightning_parallel.distributed.zero.backends.replicated import ReplicatedBackend
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.gather import OverlappedParameterGather
from lightning_parallel.distributed.zero.gradient_loan import (
    BucketGradientLoan,
    GradientLoan,
    LocalBucketGradientLoan,
)
from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer, check_shardable, load_from_reader

__all__ = ["FlatBucketBackend"]


class FlatBucketBackend(ReplicatedBackend):
    """Stages 1-2: flat buckets reduce-scattered during backward, each optimizer stepping this rank's shard."""

    shards_gradients: ClassVar[bool] = True

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        super().__init__(config, context)
        self.warn = context.warn
        self.replicas = context.replicas
        self.host_group = context.host_group
        self.buckets: ShardedParameterBuckets | None = None
        self.gather: OverlappedParameterGather | None = None  # fitting with `overlap_param_gather`
        self.sharded_optimizers: list[ShardedOptimizer] = []  # one per optimizer, in order

    @property
    def times_exposed_communication(self) -> bool:
        return self.buckets is not None  # fitting: the waits for reduce-scatter and all-gather are ours

    @property
    def clips_over_ranks(self) -> bool:
        return self.buckets is not None  # fitting: Lightning clips through the precision plugin

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        for optimizer in optimizers:
            check_shardable(optimizer, warn=self.warn)
        # Frozen parameters the optimizers hold are bucketed too: unfreezing them later needs no new layout.
        held = [param for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]]
        shard_group, replicate_group = self._groups()
        self.buckets = ShardedParameterBuckets(
            self.held,
            stage=self.config.stage,
            group=shard_group,
            replicate_group=replicate_group,
            replicas=self.replicas,
            bucket_cap_mb=self.config.bucket_cap_mb,
            frozen=held,
            master_dtype=torch.float32 if self.config.master_weights == "fp32" else None,
            reduce_dtype=self.config.reduce_dtype,
            # A pipeline stage: the schedule leaves the gradients in `.grad`, taken in `reduce_gradients`.
            gradient_hooks=self.stage_extensions is None or not self.stage_extensions.reduce_after_backward,
            flags_group=self.host_group,
        )
        if self.stats is not None:
            self.buckets.stats = self.stats
        if self.config.overlaps_param_gather(world_size=self.world_size):
            self.gather = OverlappedParameterGather(
                self.buckets, self.held, waiting=lambda: self.events.timed("exposed_communication")
            )
        self.sharded_optimizers = [ShardedOptimizer(optimizer, self.buckets) for optimizer in optimizers]

    def sharded_for(self, optimizer: Optimizer) -> ShardedOptimizer:
        """The :class:`ShardedOptimizer` of ``optimizer`` (the torch optimizer, not Lightning's wrapper)."""
        return next(sharded for sharded in self.sharded_optimizers if sharded.optimizer is optimizer)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Collective. As torch's clip over ``optimizer``'s parameters only, with the norm over every shard (and, for a
        pipeline stage, over the other stages: ``StageExtensions.norm_groups``)."""
        assert self.buckets is not None
        views = self.sharded_for(optimizer).views
        extensions = self.stage_extensions
        tensor_axis = tensor_axis_of(self.mesh, self.held)
        if extensions is None and tensor_axis is not None:
            # Split weights' shards summed over the tensor ranks too; a weight they all hold whole, counted once.
            counted, copies = counted_once(((view.param, view.tensor) for view in views), tensor_rank=tensor_axis.rank)
            groups = [self.buckets.group, tensor_axis.group]
            device = self.buckets.device
            return clip_grad_norm_over_ranks_(counted, float(max_norm), groups=groups, device=device, copies=copies)
        if extensions is None:
            return self.buckets.clip_grad_norm_(float(max_norm), views=views)
        named = [(view.name, view.tensor) for view in views]
        return extensions.clip_grad_norm_(named, max_norm, groups=[self.buckets.group])

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        buckets = self._set_up_buckets()
        buckets.sync_gradients = False
        try:
            yield
        finally:
            buckets.sync_gradients = True

    def reduce_gradients(self) -> Iterable[Tensor]:
        buckets = self._set_up_buckets()
        self.wait_for_parameters()  # a block unused in this forward: its parameters are stepped next
        extensions = self.stage_extensions
        if extensions is not None and extensions.reduce_after_backward:
            buckets.add_gradients()  # a pipeline schedule left them in `.grad`
        if buckets.sync_gradients:
            with self.events.timed("exposed_communication"):
                buckets.finish_gradient_sync()
                self._after_reduction(buckets.views())
        else:
            for bucket in buckets.buckets:
                bucket.ready = 0
        return (view.tensor for view in buckets.views())

    def lend_gradients(self, *, synced: bool) -> GradientLoan | None:
        if self.buckets is None:  # not fitting: the module's own `.grad`
            return None
        if synced:
            return BucketGradientLoan(self.buckets)
        # Accumulating: stage 1's `.grad` are views of its whole bucket already (this rank's sum, as under DDP's
        # `no_sync`); stage 2 keeps none, so lend views of its buckets.
        return LocalBucketGradientLoan(self.buckets) if self.buckets.stage == 2 else None

    def parameters_stepped_by(self, optimizer: Optimizer) -> list[nn.Parameter]:
        if self.buckets is None:  # not fitting: the optimizer steps the module's parameters themselves
            return super().parameters_stepped_by(optimizer)
        return [param for params in self.sharded_for(optimizer).group_params for param in params]

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        # The stepped optimizer's buckets: the same ones on every rank.
        indices = self.sharded_for(optimizer).bucket_indices
        if self.gather is not None:  # waited for where each bucket is first needed (distributed/zero/gather.py)
            self.gather.launch(indices)
            return
        with self.events.timed("exposed_communication"):
            self._set_up_buckets().all_gather_parameters(indices)

    def abandon_in_flight(self) -> None:
        if self.gather is not None:
            self.gather.discard()

    def wait_for_parameters(self, *, everywhere: bool = True) -> None:
        if self.gather is not None:
            self.gather.wait_all() if everywhere else self.gather.wait_for_rest()

    def gradient_buffers(self) -> list[Tensor]:
        return self.buckets.gradient_buffers() if self.buckets is not None else []

    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        if self.buckets is None:  # not fitted (validate/test/predict): the module as it is
            return super().memory_report(optimizers)
        if self.gather is not None:  # sizes only: a monitor's report between steps keeps the all-gather in flight
            with self.gather.reading_metadata_only():
                return self.buckets.memory_report(optimizers)
        return self.buckets.memory_report(optimizers)

    def model_state(self) -> dict[str, Any]:
        self.wait_for_parameters()
        return super().model_state()

    @contextmanager
    def full_module(self) -> Generator[nn.Module, None, None]:
        self.wait_for_parameters()
        yield self.held

    def load_model_state(self, state: Any, *, strict: bool) -> None:
        self.wait_for_parameters()  # the collective would write into what is being loaded
        super().load_model_state(state, strict=strict)
        if self.buckets is not None:  # the masters start from the loaded weights; a ZeRO optimizer state overrides
            self.buckets.reset_master_weights()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self.wait_for_parameters()
        return self.sharded_for(optimizer).consolidated_state_dict()

    def load_optimizer_state(self, optimizer: Optimizer, state: Any) -> None:
        self.wait_for_parameters()  # masters are loaded into the shard the collective reads
        if isinstance(state, ShardedCheckpointReader):
            load_from_reader(self.sharded_for(optimizer), state, self.held)
        else:
            self.sharded_for(optimizer).load_consolidated_state_dict(state)

    def sharded_pieces(self, optimizer: Optimizer | None) -> ShardedPieces:
        self.wait_for_parameters()
        sharded = self.sharded_optimizers[0]  # one optimizer: the strategy refuses several with this format
        return ShardedPieces(
            pieces=sharded.sharded_pieces(),
            group_params=sharded.group_params,
            scalars=sharded.scalar_states_by_name(),
        )

    def teardown(self) -> None:
        # Keep the buckets (for `memory_report()` after fit) but stop hooking the module's gradients.
        if self.gather is not None:
            self.gather.remove_hooks()  # waits for what is pending
            self.gather = None
        if self.buckets is not None:
            self.buckets.remove_hooks()

    def _set_up_buckets(self) -> ShardedParameterBuckets:
        if self.buckets is None:  # Lightning builds the optimizers before any of these hooks run
            raise RuntimeError("ZeRO-1/2 buckets are built with the optimizers in `setup`; this ran before that.")
        return self.buckets
