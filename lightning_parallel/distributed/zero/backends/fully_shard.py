"""ZeRO stage 3: torch's FSDP2 ``fully_shard`` per repeated block (``distributed/zero/stage3*.py``).

With 16-bit parameters and ``master_weights="fp32"`` the sharded parameters are the fp32 masters, which FSDP2 casts
to the 16-bit dtype for compute (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); consolidated
checkpoints hold the 16-bit model and the masters under the optimizer state's ``"master_weights"`` entry.
``gradient_compression`` is FSDP2's ``reduce_dtype`` (``zero3.master_weight_policy``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, cast

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_parallel.distributed.averaged_copy import HeldCopy, ShardedCopyHolding
from lightning_parallel.distributed.checkpoint import ShardedCheckpointReader, ShardedPieces, scalar_states
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.tensor_parallel import clip_grad_norm_of_placed_, is_tensor_parallel
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.backends.context import ZeroContext
from lightning_parallel.distributed.zero.backends.replicated import ReplicatedBackend, group_params_of
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.gradient_loan import (
    GradientLoan,
    LocalShardedTensorGradientLoan,
    ShardedTensorGradientLoan,
)
from lightning_parallel.distributed.zero.local_step import LocalShardStep, local_shard_steps
from lightning_parallel.distributed.zero.stage3_access import ShardedModuleAccess, reset_after_failure
from lightning_parallel.distributed.zero.stage3_compat import initialise_root
from lightning_parallel.distributed.zero.stage3_gloo import GlooGradientReduction, install_gloo_collectives

__all__ = ["FullyShardBackend"]


class FullyShardBackend(ReplicatedBackend):
    """Stage 3: FSDP2 ``fully_shard`` per repeated block; parameters are DTensor shards between forward passes."""

    empty_init_on_meta: ClassVar[bool] = True
    collective_tap: ClassVar[Literal["fsdp"] | None] = "fsdp"  # FSDP2's all-gathers and reduce-scatters
    shards_gradients: ClassVar[bool] = True
    shards_parameters: ClassVar[bool] = True

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        super().__init__(config, context)
        self.parameter_callbacks = context.parameter_callbacks
        self.stats = context.stats
        """Where to count the gloo all-gathers (broadcasts the monitor's tap cannot see as one); FSDP2's other
        collectives and ours issued for it are counted by the tap."""
        self.compute_dtype: torch.dtype | None = None
        """The 16-bit dtype FSDP2 computes in while the sharded parameters are the fp32 masters, else ``None``."""
        self.units: list[nn.Module] = []  # each also an `FSDPModule` (fully_shard changes their class)
        self.access: ShardedModuleAccess | None = None
        self.averaged_copies: list[HeldCopy] = []
        """The weight-averaging callbacks' copies of the module, held as shards like it."""
        self._hooks: list[RemovableHandle] = []
        self.gloo_reduction: GlooGradientReduction | None = None
        """On gloo, each unit's reduce-scatter as a point-to-point exchange in flight through backward
        (``stage3_gloo.py``)."""
        self.local_steps: list[LocalShardStep] = []
        """The optimizers stepping the local shards of ``DTensor`` parameters (``distributed/zero/local_step.py``)."""
        self.tensor_parallel = False
        """Whether layers were split over the mesh's ``tensor`` axis before sharding (``distributed/tensor_parallel``):
        the gradients are then ``DTensor``s on two meshes, which torch's clip cannot stack."""

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        self.parameter_callbacks.check(strategy_name="zero3", layout="each parameter as a DTensor shard")
        self.module = module
        # FSDP2 on the `shard` axis; with several replica groups HSDP on `replicate` x `shard` (placements
        # (Replicate(), Shard(0)): reduce-scatter in the group, then all-reduce of the shard across the groups).
        shard, replicate = self._groups()
        mesh = self._mesh_or_world(device)
        mesh = mesh["replicate", "shard"] if replicate is not None else mesh["shard"]
        if self.stage_extensions is None:  # a pipeline stage started from rank 0's weights at the split
            zero3.broadcast_from_rank0(module, device)  # start from rank 0's weights, as stages 1-2 and DDP do
        if self.config.master_weights == "fp32":
            self.compute_dtype = zero3.upcast_16bit_parameters(module) or self.compute_dtype
        policy = zero3.master_weight_policy(self.compute_dtype, reduce_dtype=self.config.reduce_dtype)
        # A pipeline stage's micro-batches interleave forwards and backwards: every unit but the root reshards there.
        self.units = zero3.apply_fully_shard(
            module, mesh, mp_policy=policy, keep_wrapped_model_gathered=self.stage_extensions is None
        )
        self.tensor_parallel = is_tensor_parallel(module)
        if zero3.materialize_meta_module(module, device) and self.compute_dtype is not None:
            zero3.round_parameters(module, self.compute_dtype)  # initialised in fp32: as a 16-bit init would be
        module.to(device)
        initialise_root(self.units[-1])  # `module`: the root whichever unit's forward runs first
        self.gloo_reduction = install_gloo_collectives(
            self._fsdp_units, shard, replicated=replicate is not None, stats=self.stats
        )
        # Weight-averaging callbacks copied the whole module in their `setup`: each copy now holds this rank's shard of
        # every parameter, starting from the module's (rank 0's) rows, as DDP's rank 0 copy starts from its module.
        self.averaged_copies = self.parameter_callbacks.hold_averaged_copies(module, ShardedCopyHolding(device))
        self.access = ShardedModuleAccess(module, self.units, world_size=self.world_size)
        self.access.running = True
        # After the access guard's hook, which carries `requires_grad` changes: FSDP2 fixes a unit's reduce dtype at its
        # first forward, from the parameters training then (`zero3.refresh_gradient_dtypes`).
        if self.compute_dtype is not None or self.config.reduce_dtype is not None:
            self._hooks = [
                unit.register_forward_pre_hook(lambda unit, _: zero3.refresh_gradient_dtypes(unit))
                for unit in self.units
            ]

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        super().setup_optimizers(optimizers)
        for step in self.local_steps:  # a later fit's optimizers
            step.remove()
        self.local_steps = local_shard_steps(self.optimizers)

    @property
    def clips_over_ranks(self) -> bool:
        return self.tensor_parallel

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Collective. torch's clip over ``optimizer``'s parameters; under tensor parallelism the norm counts each
        local piece once over every rank (``clip_grad_norm_of_placed_``); a pipeline stage's norm is the stage
        extensions' (its whole weights left out on tensor ranks other than 0, the sum also over ``pp`` and
        ``tensor``)."""
        if not self.tensor_parallel or self.stage_extensions is not None:
            return super().clip_grad_norm_(optimizer, max_norm)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        device = next(iter(self.held.parameters())).device
        assert self.mesh is not None  # tensor parallelism runs on the strategy's mesh
        return clip_grad_norm_of_placed_(params, float(max_norm), mesh=self.mesh, device=device)

    def _mesh_or_world(self, device: torch.device) -> DeviceMesh:
        if self.mesh is not None:
            return self.mesh
        return MeshLayout.for_sharding(self.world_size, None).build(device.type)  # used without a strategy

    def convert_module(self, module: nn.Module, *, convert: Callable[[nn.Module], object]) -> None:
        """A module sharded with fp32 masters by an earlier ``fit`` is left as it is: ``bf16-true``'s cast would round
        the masters and re-point FSDP2's shards at bf16 copies (its buffers were converted then); the 16-bit dtype
        ``convert`` converts to (seen on a probe module) is the compute dtype again."""
        if self.config.master_weights == "fp32" and any(isinstance(param, DTensor) for param in module.parameters()):
            probe = nn.Linear(1, 1)
            convert(probe)
            if probe.weight.dtype in (torch.bfloat16, torch.float16):
                self.compute_dtype = probe.weight.dtype
                return
        convert(module)

    @property
    def _fsdp_units(self) -> list[FSDPModule]:
        return cast(list[FSDPModule], self.units)

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
        if self.gloo_reduction is not None:
            self.gloo_reduction.finish()  # a no-op: the end-of-backward callback completed every reduction
        for unit in self._fsdp_units:
            # A unit whose parameters got no gradient stays unsharded after backward, and FSDP2 copies each
            # parameter's `requires_grad` (`toggle_optimizer`) only when it unshards: reshard (a no-op otherwise).
            unit.reshard()
        self._after_reduction(None)  # a pipeline stage: the tied copies' local shards summed over the stages
        return ()

    def lend_gradients(self, *, synced: bool) -> GradientLoan | None:
        if not self.units:
            return None
        if synced:
            return ShardedTensorGradientLoan(self.held, stats=self.stats)
        return LocalShardedTensorGradientLoan(self.units)  # FSDP2 keeps this rank's sums unsharded, not on `.grad`

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
        for step in self.local_steps:
            step.restore()  # a step that raised left the aliases in place
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
        return ShardedPieces(pieces=pieces, group_params=group_params_of(optimizer), scalars=scalars)

    @contextmanager
    def full_module(self) -> Generator[nn.Module, None, None]:
        """Stage 3 all-gathers every parameter once on entry and frees the whole copies on exit."""
        if self.access is None:
            yield self.held
            return
        with self.access.full_parameters() as module:
            yield module

    def abandon_in_flight(self) -> None:
        super().abandon_in_flight()
        if self.gloo_reduction is not None:
            self.gloo_reduction.abandon()

    def teardown(self) -> None:
        # Local, no collective: an exception mid-step leaves FSDP2 half unsharded, and `module.cpu()` afterwards
        # would fail with an unrelated AttributeError that hides the user's error.
        reset_after_failure(self.units)
        if self.access is not None:
            self.access.running = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for step in self.local_steps:
            step.remove()
        self.local_steps = []
