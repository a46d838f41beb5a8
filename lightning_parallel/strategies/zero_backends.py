"""The three ways ``ShardedOptimizerStrategy`` holds a model, behind one protocol chosen once in ``setup``.

* :class:`FlatBucketBackend` (stages 1-2): parameters live in flat buckets that are reduce-scattered as backward
  produces gradients; the user's optimizer steps this rank's shard, then the buckets are all-gathered.
* :class:`FullyShardBackend` (stage 3): torch's FSDP2 ``fully_shard`` per repeated block.
* :class:`ReplicatedBackend` (world size 1): plain single-device training, nothing sharded; with 16-bit parameters
  and fp32 master weights, ``strategies.zero_master_backend.MasterWeightBackend`` (stage-1/2 buckets over one rank).

With 16-bit parameters (``Trainer(precision="bf16-true")``) and ``master_weights="fp32"`` (the strategy's default)
both sharded backends keep fp32 master weights in the shard: stages 1-2 an fp32 copy of each bucket's shard beside
the bf16 buckets (``distributed/zero.py``), stage 3 fp32 sharded parameters that FSDP2 casts to bf16 for compute
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). Gradients are reduced in fp32 in both. Consolidated
checkpoints hold the bf16 model (as single-device ``bf16-true`` saves it) and the fp32 masters under the optimizer
state's ``"master_weights"`` entry.

The strategy calls the :class:`ZeroBackend` protocol and never asks which backend it holds (DeepSpeed likewise
picks its ZeRO optimizer once). It builds whichever :func:`backend_type` chose from two frozen records, passed whole:
the user's settings (:class:`~lightning_parallel.distributed.zero_config.ZeroConfig`, validated in the strategy's
``__init__``) and this run's :class:`ZeroContext` (ranks, mesh, listeners); each backend reads what it needs.
Gradient clipping over shards goes through ``strategies.clipping.with_clipping``, a subclass of whichever precision
plugin the Trainer chose (Lightning's ``FSDPPrecision`` pattern). The waits of the stage 1-2 sync run inside
``events.timed("exposed_communication")`` for whoever listens (the monitor).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, cast

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_parallel._compat import sync_module_states
from lightning_parallel.accounting import MemoryReport, module_memory_report
from lightning_parallel.distributed import zero3
from lightning_parallel.distributed.averaged_copy import HeldCopy, ShardedCopyLayout
from lightning_parallel.distributed.checkpoint import (
    ShardedCheckpointReader,
    ShardedPieces,
    add_aliases,
    load_module_state,
    replicated_pieces,
    scalar_states,
)
from lightning_parallel.distributed.compression import CommunicationStats
from lightning_parallel.distributed.gradient_sync import GradientSync
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.zero import ShardedParameterBuckets
from lightning_parallel.distributed.zero3_access import ShardedModuleAccess, reset_after_failure
from lightning_parallel.distributed.zero3_compat import initialise_root
from lightning_parallel.distributed.zero_config import ZeroConfig
from lightning_parallel.distributed.zero_gather import OverlappedParameterGather
from lightning_parallel.distributed.zero_optimizer import ShardedOptimizer, check_shardable, load_from_reader
from lightning_parallel.instrumentation import StrategyEvents
from lightning_parallel.strategies.base import unwrap_optimizer
from lightning_parallel.strategies.clipping import with_clipping, with_scaler
from lightning_parallel.strategies.parameter_callbacks import check_parameter_callbacks, hold_averaged_copies

__all__ = [
    "FlatBucketBackend",
    "FullyShardBackend",
    "ReplicatedBackend",
    "ZeroBackend",
    "ZeroContext",
    "backend_type",
    "with_sharded_grad_scaler",
]


@dataclass(frozen=True, kw_only=True)
class ZeroContext:
    """What the strategy's ``setup`` hands a backend beside the user's :class:`ZeroConfig`: this run's ranks, its
    mesh and who listens. The defaults are one rank and no listener (a backend used without a strategy)."""

    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None
    """The strategy's mesh (axes ``replicate``, ``shard``, ``pp``): the sharded backends shard over its ``shard``
    axis and average across its ``replicate`` axis; ``None`` at world size 1."""
    events: StrategyEvents = field(default_factory=StrategyEvents)
    """Where the stage 1-2 sync waits are timed (``events.timed("exposed_communication")``)."""
    stats: CommunicationStats | None = None
    """Where to count the bytes of our own collectives (the monitor's ledger), or ``None``."""
    callbacks: Sequence[Any] = ()
    """The Trainer's callbacks (stage 3 holds the weight-averaging ones' copies as shards)."""


class ZeroBackend(GradientSync, Protocol):
    """How the model, its gradients and the optimizers' state are held and synchronised; built once per ``setup``.

    The gradient sync is :class:`~lightning_parallel.distributed.gradient_sync.GradientSync` (``no_sync``,
    ``reduce_gradients``, ``clip_grad_norm_``, ``after_optimizer_step``, ``wait_for_parameters``,
    ``gradient_buffers``, ``memory_report``, ``optimizer_state``, ``load_optimizer_state``, ``abandon_in_flight``,
    ``teardown``); a ZeRO backend also holds the module: the methods below.
    """

    empty_init_on_meta: ClassVar[bool]
    """Whether ``init_module(empty_init=True)`` creates the model on the meta device (materialised in setup)."""
    collective_tap: ClassVar[Literal["fsdp"] | None]
    """Collectives issued by code we do not own that a monitor must tap to count (FSDP2's), else ``None``."""

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None: ...

    @property
    def times_exposed_communication(self) -> bool:
        """Whether the gradient sync waits run in our code, inside ``events.timed("exposed_communication")``."""

    def convert_module(self, plugin: Precision, module: nn.Module) -> None:
        """Local. The precision plugin's ``convert_module`` (``bf16-true`` casts it), before ``setup_module``."""

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        """Collective. Start from rank 0's weights, shard if this backend does, and move to ``device``."""

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Collective. Point the (unwrapped) optimizers at what this rank holds, before their first step."""

    def wrap_precision(self, plugin: Precision, device: torch.device) -> Precision:
        """The precision plugin to train with: ``plugin``, or one that clips over all shards and agrees on inf/nan."""

    def after_evaluation_step(self) -> None:
        """Local. After a validation step: leave the parameters as training holds them between steps (the callbacks
        that run next may read or swap them)."""

    def model_state(self) -> dict[str, Any]:
        """Collective. The whole model's plain state dict (complete on rank 0)."""

    def load_model_state(self, state: Any, *, strict: bool) -> None:
        """Collective. Load a plain state dict or a :class:`ShardedCheckpointReader`."""

    def sharded_pieces(self, optimizer: Optimizer | None) -> ShardedPieces:
        """What this rank writes into a sharded checkpoint (one optimizer at most)."""

    def full_module(self) -> AbstractContextManager[nn.Module]:
        """Collective on entry: the whole module on every rank until exit (also after ``teardown``)."""


def backend_type(stage: int, *, is_sharding: bool, keeps_masters: bool = False) -> type[ZeroBackend]:
    """The backend for ``stage`` (1, 2 or 3). World size 1 (``is_sharding=False``) shards nothing at any stage: it
    trains plainly, or steps fp32 master weights of 16-bit parameters when ``keeps_masters``."""
    if not is_sharding:
        if keeps_masters:
            # Imported here: it subclasses `FlatBucketBackend` of this module.
            from lightning_parallel.strategies.zero_master_backend import MasterWeightBackend

            return MasterWeightBackend
        return ReplicatedBackend
    return FullyShardBackend if stage == 3 else FlatBucketBackend


class ReplicatedBackend:
    """World size 1 (fp32 parameters, ``master_weights=None``, or not fitting): the module and optimizers as they
    are. The two sharded backends reuse its plain-module methods.

    Every backend is built from the whole :class:`ZeroConfig` and :class:`ZeroContext` (so the strategy builds
    whichever :func:`backend_type` chose with one call) and reads from them what it needs: this one only the ranks,
    the mesh and the events.
    """

    empty_init_on_meta: ClassVar[bool] = False
    collective_tap: ClassVar[Literal["fsdp"] | None] = None

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        self.config = config
        self.rank, self.world_size = context.rank, context.world_size
        self.mesh = context.mesh
        """The strategy's mesh (see :attr:`ZeroContext.mesh`); ``None`` at world size 1."""
        self.events = context.events
        self.module: nn.Module | None = None

    def _groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """``(shard group, replicate group)`` from :attr:`mesh` (``None`` for an axis of one rank or without a mesh:
        the world shards alone)."""
        if self.mesh is None:
            return None, None
        shard = self.mesh.get_group("shard")
        replicate = self.mesh.get_group("replicate") if self.mesh["replicate"].size() > 1 else None
        return shard, replicate

    @property
    def times_exposed_communication(self) -> bool:
        return False

    @property
    def held(self) -> nn.Module:
        """The module given to :meth:`setup_module`."""
        if self.module is None:
            raise RuntimeError("The ZeRO backend holds no module: `setup_module` has not run.")
        return self.module

    def convert_module(self, plugin: Precision, module: nn.Module) -> None:
        plugin.convert_module(module)

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        zero3.materialize_meta_module(module, device)  # `empty_init` of a stage-3 model at world size 1
        module.to(device)
        sync_module_states(module)

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        pass

    def wrap_precision(self, plugin: Precision, device: torch.device) -> Precision:
        return plugin

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        yield

    def reduce_gradients(self) -> Iterable[Tensor]:
        return ()

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Collective where the gradients are ``DTensor`` shards. torch's own clip over ``optimizer``'s parameters (as
        Lightning's precision plugin clips them: this backend's gradients are the parameters' ``.grad``)."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, float(max_norm))

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        pass

    def after_evaluation_step(self) -> None:
        pass

    def wait_for_parameters(self, *, everywhere: bool = True) -> None:
        pass

    def abandon_in_flight(self) -> None:
        pass

    def gradient_buffers(self) -> list[Tensor]:
        return []

    def memory_report(self, optimizers: Sequence[Optimizer]) -> MemoryReport:
        return module_memory_report(self.held, optimizers)

    def model_state(self) -> dict[str, Any]:
        return _cloned_state(self.held)

    def load_model_state(self, state: Any, *, strict: bool) -> None:
        if isinstance(state, ShardedCheckpointReader):
            state = full_state_from_reader(state)
        load_module_state(self.held, state, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: Optimizer, state: Any) -> None:
        if isinstance(state, ShardedCheckpointReader):
            zero3.load_from_reader(self.held, optimizer, state, strict=False)
        else:
            optimizer.load_state_dict(state)

    def sharded_pieces(self, optimizer: Optimizer | None) -> ShardedPieces:
        pieces = replicated_pieces(self.held, optimizer, rank=self.rank, world_size=self.world_size)
        scalars = scalar_states(self.held.named_parameters(), optimizer)  # every rank holds every parameter's
        return ShardedPieces(pieces=pieces, group_params=_group_params(optimizer), scalars=scalars)

    @contextmanager
    def full_module(self) -> Generator[nn.Module, None, None]:
        yield self.held

    def teardown(self) -> None:
        pass


class FlatBucketBackend(ReplicatedBackend):
    """Stages 1-2: flat buckets reduce-scattered during backward, each optimizer stepping this rank's shard."""

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        super().__init__(config, context)
        self.stats = context.stats
        self.buckets: ShardedParameterBuckets | None = None
        self.gather: OverlappedParameterGather | None = None  # fitting with `overlap_param_gather`
        self.sharded_optimizers: list[ShardedOptimizer] = []  # one per optimizer, in order

    @property
    def times_exposed_communication(self) -> bool:
        return self.buckets is not None  # fitting: the waits for reduce-scatter and all-gather are ours

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        for optimizer in optimizers:
            check_shardable(optimizer, warn=rank_zero_warn)
        # Frozen parameters the optimizers hold are bucketed too: unfreezing them later needs no new layout.
        held = [param for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]]
        shard_group, replicate_group = self._groups()
        self.buckets = ShardedParameterBuckets(
            self.held,
            stage=self.config.stage,
            group=shard_group,
            replicate_group=replicate_group,
            bucket_cap_mb=self.config.bucket_cap_mb,
            frozen=held,
            master_dtype=torch.float32 if self.config.master_weights == "fp32" else None,
        )
        if self.stats is not None:
            self.buckets.stats = self.stats
        if self.config.overlaps_param_gather(world_size=self.world_size):
            self.gather = OverlappedParameterGather(
                self.buckets, self.held, waiting=lambda: self.events.timed("exposed_communication")
            )
        self.sharded_optimizers = [ShardedOptimizer(optimizer, self.buckets) for optimizer in optimizers]

    def sharded_for(self, optimizer: Optimizer) -> ShardedOptimizer:
        """The :class:`ShardedOptimizer` of ``optimizer`` (manual optimization clips with its wrapper)."""
        optimizer = unwrap_optimizer(optimizer)
        return next(sharded for sharded in self.sharded_optimizers if sharded.optimizer is optimizer)

    def wrap_precision(self, plugin: Precision, device: torch.device) -> Precision:
        if self.buckets is not None:  # fitting: Lightning clips through the precision plugin
            plugin = with_clipping(plugin, self._clip_over_shards)
        return with_sharded_grad_scaler(plugin, device)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Collective. As torch's clip over ``optimizer``'s parameters only, with the norm over every shard."""
        assert self.buckets is not None
        return self.buckets.clip_grad_norm_(float(max_norm), views=self.sharded_for(optimizer).views)

    def _clip_over_shards(self, optimizer: Optimizer, max_norm: float) -> None:
        self.clip_grad_norm_(optimizer, max_norm)

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
        if buckets.sync_gradients:
            with self.events.timed("exposed_communication"):
                buckets.finish_gradient_sync()
        else:
            for bucket in buckets.buckets:
                bucket.ready = 0
        return (view.tensor for view in buckets.views())

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        # The stepped optimizer's buckets: the same ones on every rank.
        indices = self.sharded_for(optimizer).bucket_indices
        if self.gather is not None:  # waited for where each bucket is first needed (distributed/zero_gather.py)
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


class FullyShardBackend(ReplicatedBackend):
    """Stage 3: FSDP2 ``fully_shard`` per repeated block; parameters are DTensor shards between forward passes."""

    empty_init_on_meta: ClassVar[bool] = True
    collective_tap: ClassVar[Literal["fsdp"] | None] = "fsdp"  # FSDP2's all-gathers and reduce-scatters

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        super().__init__(config, context)
        self.callbacks = context.callbacks
        self.stats = context.stats
        """Where to count HSDP's all-reduce across replica groups (FSDP2's other collectives: the monitor's tap)."""
        self.compute_dtype: torch.dtype | None = None
        """The 16-bit dtype FSDP2 computes in while the sharded parameters are the fp32 masters, else ``None``."""
        self.units: list[nn.Module] = []  # each also an `FSDPModule` (fully_shard changes their class)
        self.access: ShardedModuleAccess | None = None
        self.averaged_copies: list[HeldCopy] = []
        """The weight-averaging callbacks' copies of the module, held as shards like it."""
        self._hooks: list[RemovableHandle] = []

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        check_parameter_callbacks(self.callbacks, strategy_name="zero3", layout="each parameter as a DTensor shard")
        self.module = module
        # FSDP2 on the `shard` axis; with several replica groups HSDP on `replicate` x `shard` (placements
        # (Replicate(), Shard(0)): reduce-scatter in the group, then all-reduce of the shard across the groups).
        _, replicate = self._groups()
        mesh = self._mesh_or_world(device)
        mesh = mesh["replicate", "shard"] if replicate is not None else mesh["shard"]
        zero3.broadcast_from_rank0(module, device)  # start from rank 0's weights, as stages 1-2 and DDP do
        if self.config.master_weights == "fp32":
            self.compute_dtype = zero3.upcast_16bit_parameters(module) or self.compute_dtype
        policy = (
            MixedPrecisionPolicy() if self.compute_dtype is None else zero3.master_weight_policy(self.compute_dtype)
        )
        self.units = zero3.apply_fully_shard(module, mesh, mp_policy=policy)
        if zero3.materialize_meta_module(module, device) and self.compute_dtype is not None:
            zero3.round_parameters(module, self.compute_dtype)  # initialised in fp32: as a 16-bit init would be
        module.to(device)
        initialise_root(self.units[-1])  # `module`: the root whichever unit's forward runs first
        # Weight-averaging callbacks copied the whole module in their `setup`: each copy now holds this rank's shard of
        # every parameter, starting from the module's (rank 0's) rows, as DDP's rank 0 copy starts from its module.
        self.averaged_copies = hold_averaged_copies(self.callbacks, module, ShardedCopyLayout(device))
        self.access = ShardedModuleAccess(module, self.units, world_size=self.world_size)
        self.access.running = True
        if self.compute_dtype is not None:  # after the access guard's hook, which carries `requires_grad` changes
            self._hooks = [
                unit.register_forward_pre_hook(lambda unit, _: zero3.refresh_gradient_dtypes(unit))
                for unit in self.units
            ]

    def _mesh_or_world(self, device: torch.device) -> DeviceMesh:
        if self.mesh is not None:
            return self.mesh
        return MeshLayout.for_sharding(self.world_size, None).build(device.type)  # used without a strategy

    def convert_module(self, plugin: Precision, module: nn.Module) -> None:
        """A module sharded with fp32 masters by an earlier ``fit`` is left as it is: ``bf16-true``'s cast would round
        the masters and re-point FSDP2's shards at bf16 copies (its buffers were converted then); the 16-bit dtype
        the plugin converts to (seen on a probe module) is the compute dtype again."""
        if self.config.master_weights == "fp32" and any(isinstance(param, DTensor) for param in module.parameters()):
            probe = nn.Linear(1, 1)
            plugin.convert_module(probe)
            if probe.weight.dtype in (torch.bfloat16, torch.float16):
                self.compute_dtype = probe.weight.dtype
                return
        plugin.convert_module(module)

    @property
    def _fsdp_units(self) -> list[FSDPModule]:
        return cast(list[FSDPModule], self.units)

    def wrap_precision(self, plugin: Precision, device: torch.device) -> Precision:
        return with_sharded_grad_scaler(plugin, device)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        for unit in self._fsdp_units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in self._fsdp_units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def reduce_gradients(self) -> Iterable[Tensor]:
        for unit in self._fsdp_units:
            # A unit whose parameters got no gradient stays unsharded after backward, and FSDP2 copies each
            # parameter's `requires_grad` (`toggle_optimizer`) only when it unshards: reshard (a no-op otherwise).
            unit.reshard()
        return ()

    def after_evaluation_step(self) -> None:
        # FSDP2 keeps the root unit's parameters gathered after a forward without backward: a weight-averaging
        # callback swapping its averages in and out at `on_validation_epoch_end` (next) would meet whole tensors in
        # place of the shards it holds. Reshard (local; the root gathers again at its next forward).
        if self.averaged_copies:
            for unit in self._fsdp_units:
                unit.reshard()

    def model_state(self) -> dict[str, Any]:
        state = zero3.consolidated_model_state(self.held)
        if self.compute_dtype is not None:  # the 16-bit weights single-device training would hold, not the masters
            state = zero3.cast_parameters(self.held, state, self.compute_dtype)
        return state

    def load_model_state(self, state: Any, *, strict: bool) -> None:
        if isinstance(state, ShardedCheckpointReader):
            zero3.load_from_reader(self.held, None, state, strict=strict)
        else:
            zero3.load_consolidated_model_state(self.held, dict(state), strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        with_master = self.compute_dtype is not None
        return zero3.consolidated_optimizer_state(self.held, optimizer, with_master_weights=with_master)

    def load_optimizer_state(self, optimizer: Optimizer, state: Any) -> None:
        if isinstance(state, ShardedCheckpointReader):
            zero3.load_from_reader(self.held, optimizer, state, strict=False)
        else:
            zero3.load_consolidated_optimizer_state(self.held, optimizer, state)

    def sharded_pieces(self, optimizer: Optimizer | None) -> ShardedPieces:
        pieces = zero3.sharded_pieces(self.held, optimizer)
        # Every rank steps its shard of every parameter (or an empty one) when that parameter has a gradient, so
        # each rank's optimizer holds every parameter's own 0-dim state.
        scalars = scalar_states(self.held.named_parameters(), optimizer)
        return ShardedPieces(pieces=pieces, group_params=_group_params(optimizer), scalars=scalars)

    @contextmanager
    def full_module(self) -> Generator[nn.Module, None, None]:
        """Stage 3 all-gathers every parameter once on entry and frees the whole copies on exit."""
        if self.access is None:
            yield self.held
            return
        with self.access.full_parameters() as module:
            yield module

    def teardown(self) -> None:
        # Local, no collective: an exception mid-step leaves FSDP2 half unsharded, and `module.cpu()` afterwards
        # would fail with an unrelated AttributeError that hides the user's error.
        reset_after_failure(self.units)
        if self.access is not None:
            self.access.running = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


# ---------------------------------------------------------------------- mixed precision over shards
def with_sharded_grad_scaler(plugin: Precision, device: torch.device) -> Precision:
    """`16-mixed`: each rank sees only its shard's gradients, so the inf/nan check that decides whether to skip the
    step must be all-reduced, or ranks would diverge. Torch's ``ShardedGradScaler`` does exactly that."""
    if getattr(plugin, "scaler", None) is None:  # only MixedPrecision("16-mixed") has one
        return plugin
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return with_scaler(plugin, ShardedGradScaler(device=device.type))


# ---------------------------------------------------------------------- helpers
def full_state_from_reader(reader: ShardedCheckpointReader) -> dict[str, Tensor]:
    """Collective. Whole parameters and buffers (stages 1-2 hold every parameter whole anyway)."""
    shapes = reader.meta["shapes"]
    values = reader.read([("param", name, 0, math.prod(shape)) for name, shape in shapes.items()], with_buffers=True)
    state = {name: values[("param", name, 0, math.prod(shape))].view(shape) for name, shape in shapes.items()}
    state.update({entry.removeprefix("buffer/"): t for entry, t in values.items() if isinstance(entry, str)})
    return add_aliases(state, reader.meta)


def _cloned_state(module: nn.Module) -> dict[str, Any]:
    # Parameters may be views into flat buckets: clone so the checkpoint holds plain, independent tensors.
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def _group_params(optimizer: Optimizer | None) -> list[list[nn.Parameter]] | None:
    return [list(group["params"]) for group in optimizer.param_groups] if optimizer is not None else None
