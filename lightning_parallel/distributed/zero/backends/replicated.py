"""World size 1 without 16-bit masters: the module and optimizers as they are; the plain-module methods the
sharded backends reuse."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.accounting import MemoryReport, module_memory_report
from lightning_parallel.distributed.checkpoint import (
    ShardedCheckpointReader,
    ShardedPieces,
    add_aliases,
    host_copies,
    host_copy,
    load_module_state,
    replicated_pieces,
    scalar_states,
)
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.backends.context import ZeroContext
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.gradient_loan import GradientLoan

__all__ = ["ReplicatedBackend", "cloned_state", "full_state_from_reader", "group_params_of"]


class ReplicatedBackend:
    """World size 1 (fp32 parameters, ``master_weights=None``, or not fitting): the module and optimizers as they
    are. The two sharded backends reuse its plain-module methods.

    Every backend is built from the whole :class:`ZeroConfig` and :class:`ZeroContext` (so the strategy builds
    whichever ``backend_type`` chose with one call) and reads from them what it needs: this one only the ranks, the
    mesh, the events and how to broadcast rank 0's weights.
    """

    empty_init_on_meta: ClassVar[bool] = False
    collective_tap: ClassVar[Literal["fsdp"] | None] = None
    shards_gradients: ClassVar[bool] = False

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        self.config = config
        self.rank, self.world_size = context.rank, context.world_size
        self.mesh = context.mesh
        """The strategy's mesh (see :attr:`ZeroContext.mesh`); ``None`` at world size 1."""
        self.events = context.events
        self.sync_module_states = context.sync_module_states
        self.stage_extensions = context.stage
        """Set when this backend holds a pipeline stage (``ZeroContext.stage``)."""
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
    def clips_over_ranks(self) -> bool:
        return False

    @property
    def held(self) -> nn.Module:
        """The module given to :meth:`setup_module`."""
        if self.module is None:
            raise RuntimeError("The ZeRO backend holds no module: `setup_module` has not run.")
        return self.module

    def convert_module(self, module: nn.Module, *, convert: Callable[[nn.Module], object]) -> None:
        convert(module)

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        zero3.materialize_meta_module(module, device)  # `empty_init` of a stage-3 model at world size 1
        module.to(device)
        self.sync_module_states(module)

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        pass

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

    def lend_gradients(self, *, synced: bool) -> GradientLoan | None:
        return None  # the parameters' own `.grad`, as on one device

    def parameters_stepped_by(self, optimizer: Optimizer) -> list[nn.Parameter]:
        return [param for group in optimizer.param_groups for param in group["params"]]

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
        return cloned_state(self.held)

    def load_model_state(self, state: Any, *, strict: bool) -> None:
        if isinstance(state, ShardedCheckpointReader):
            state = full_state_from_reader(state)
        load_module_state(self.held, state, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every tensor copied to the CPU (as the sharded backends assemble it)."""
        return host_copies(optimizer.state_dict())

    def load_optimizer_state(self, optimizer: Optimizer, state: Any) -> None:
        if isinstance(state, ShardedCheckpointReader):
            zero3.load_from_reader(self.held, optimizer, state, strict=False)
        else:
            optimizer.load_state_dict(state)

    def sharded_pieces(self, optimizer: Optimizer | None) -> ShardedPieces:
        pieces = replicated_pieces(self.held, optimizer, rank=self.rank, world_size=self.world_size)
        scalars = scalar_states(self.held.named_parameters(), optimizer)  # every rank holds every parameter's
        return ShardedPieces(pieces=pieces, group_params=group_params_of(optimizer), scalars=scalars)

    @contextmanager
    def full_module(self) -> Generator[nn.Module, None, None]:
        yield self.held

    def teardown(self) -> None:
        pass


def full_state_from_reader(reader: ShardedCheckpointReader) -> dict[str, Tensor]:
    """Collective. Whole parameters and buffers (stages 1-2 hold every parameter whole anyway)."""
    shapes = reader.meta["shapes"]
    values = reader.read([("param", name, 0, math.prod(shape)) for name, shape in shapes.items()], with_buffers=True)
    state = {name: values[("param", name, 0, math.prod(shape))].view(shape) for name, shape in shapes.items()}
    state.update({entry.removeprefix("buffer/"): t for entry, t in values.items() if isinstance(entry, str)})
    return add_aliases(state, reader.meta)


def cloned_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict with every tensor copied to the CPU, one at a time.

    Plain, independent tensors (parameters may be views into flat buckets), and never a second copy of the model on
    the device: a model that fits only because ZeRO shards its optimizer state must still be able to save.
    """
    return {name: host_copy(tensor) for name, tensor in module.state_dict().items()}


def group_params_of(optimizer: Optimizer | None) -> list[list[nn.Parameter]] | None:
    """``optimizer``'s parameter lists, one per group (``ShardedPieces.group_params``)."""
    return [list(group["params"]) for group in optimizer.param_groups] if optimizer is not None else None
