"""Nothing sharded: the module and optimizers as they are (world size 1 without 16-bit masters, or a pipeline stage at
``zero_stage=0``, whose replicas' gradients are averaged as DDP averages them); the plain-module methods the sharded
backends reuse."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel.accounting import CommunicationStats, MemoryReport, module_memory_report
from lightning_parallel.distributed.averaged_copy import shard_whole_state
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
from lightning_parallel.distributed.tensor_parallel import is_tensor_parallel
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.backends.context import ZeroContext
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.gradient_loan import GradientLoan

__all__ = [
    "ReplicatedBackend",
    "average_across_replicas",
    "cloned_state",
    "full_state_from_reader",
    "group_params_of",
    "local_gradient_view",
]


class ReplicatedBackend:
    """World size 1 (fp32 parameters, ``master_weights=None``, or not fitting), or every replica holding the whole
    module (a pipeline stage at ``zero_stage=0``: ``reduce_gradients`` averages the gradients over
    ``ZeroContext.data_parallel_group``): the module and optimizers as they are. The two sharded backends reuse its
    plain-module methods.

    Every backend is built from the whole :class:`ZeroConfig` and :class:`ZeroContext` (so the strategy builds
    whichever ``backend_type`` chose with one call) and reads from them what it needs: this one only the ranks, the
    mesh, the events and how to broadcast rank 0's weights.
    """

    empty_init_on_meta: ClassVar[bool] = False
    collective_tap: ClassVar[Literal["fsdp"] | None] = None
    shards_gradients: ClassVar[bool] = False
    shards_parameters: ClassVar[bool] = False

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        self.config = config
        self.rank, self.world_size = context.rank, context.world_size
        self.mesh = context.mesh
        """The strategy's mesh (see :attr:`ZeroContext.mesh`); ``None`` at world size 1."""
        self.events = context.events
        self.sync_module_states = context.sync_module_states
        self.stage_extensions = context.stage
        """Set when this backend holds a pipeline stage (``ZeroContext.stage``)."""
        self.data_parallel_group = context.data_parallel_group
        self.stats = context.stats
        self.compute_dtype: torch.dtype | None = None
        self.module: nn.Module | None = None
        self.optimizers: list[Optimizer] = []

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
        if not is_tensor_parallel(module):  # a split module was cut from rank 0's broadcast weights already
            self.sync_module_states(module)

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        yield

    def reduce_gradients(self) -> Iterable[Tensor]:
        """Collective over the replicas (``ZeroContext.data_parallel_group``), then the pipeline's tied sum, if any."""
        if self.data_parallel_group is not None:
            grads = [p.grad for o in self.optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
            # A tensor-parallel stage's split gradients: their local shards (the same storage), averaged in place.
            local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
            average_across_replicas(local, group=self.data_parallel_group, stats=self.stats)
        self._after_reduction(None)
        return ()

    def _after_reduction(self, views: Sequence[Any] | None) -> None:
        """The pipeline's step once the gradients are averaged (``StageExtensions.after_reduction``), if any."""
        extensions = self.stage_extensions
        if extensions is not None and extensions.after_reduction is not None:
            extensions.after_reduction(views)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Collective where the gradients are ``DTensor`` shards or the module is a pipeline stage. torch's own clip
        over ``optimizer``'s parameters (as Lightning's precision plugin clips them: this backend's gradients are the
        parameters' ``.grad``); a pipeline stage's norm also over the other stages (``StageExtensions``), with the
        local shards' norm over the ``shard`` group where the parameters are sharded."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        extensions = self.stage_extensions
        if extensions is None:
            return torch.nn.utils.clip_grad_norm_(params, float(max_norm))
        name_of = {id(param): name for name, param in self.held.named_parameters(remove_duplicate=False)}
        named = [(name_of[id(p)], local_gradient_view(p)) for p in params if p.grad is not None]
        groups = [self._groups()[0]] if self.shards_parameters else []  # each replica holds disjoint rows
        return extensions.clip_grad_norm_(named, max_norm, groups=groups)

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
        # A split weight (tensor parallelism) takes this rank's slice of the whole tensor.
        load_module_state(self.held, shard_whole_state(self.held, state), strict=strict)

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


def average_across_replicas(grads: Sequence[Tensor], *, group: Any, stats: CommunicationStats | None = None) -> None:
    """Collective over ``group``. Average ``grads`` in place over its ranks (one flat all-reduce, counted in ``stats``
    when given)."""
    size = dist.get_world_size(group)
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if stats is not None:
        stats.record("all_reduce", flat.numel() * flat.element_size())
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def local_gradient_view(param: Tensor) -> Tensor:
    """``param`` itself, or for a ``DTensor`` a plain tensor of its local shard whose ``.grad`` is the local shard of
    its gradient (the same storage: scaling it scales the gradient)."""
    if not isinstance(param, DTensor):
        return param
    view = cast(DTensor, param.detach()).to_local()
    view.grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
    return view


def full_state_from_reader(reader: ShardedCheckpointReader) -> dict[str, Tensor]:
    """Collective. Whole parameters and buffers (stages 1-2 hold every parameter whole anyway)."""
    shapes = reader.meta["shapes"]
    values = reader.read([("param", name, 0, math.prod(shape)) for name, shape in shapes.items()], with_buffers=True)
    state = {name: values[("param", name, 0, math.prod(shape))].view(shape) for name, shape in shapes.items()}
    state.update({entry.removeprefix("buffer/"): t for entry, t in values.items() if isinstance(entry, str)})
    return add_aliases(state, reader.meta)


def cloned_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict with every tensor copied to the CPU, one at a time. Collective over the tensor ranks
    when layers are split (each ``DTensor`` gathered whole: the single-device numbering and shapes), else local.

    Plain, independent tensors (parameters may be views into flat buckets), and never a second copy of the model on
    the device: a model that fits only because ZeRO shards its optimizer state must still be able to save.
    """
    return {
        name: host_copy(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
        for name, tensor in module.state_dict().items()
    }


def group_params_of(optimizer: Optimizer | None) -> list[list[nn.Parameter]] | None:
    """``optimizer``'s parameter lists, one per group (``ShardedPieces.group_params``)."""
    return [list(group["params"]) for group in optimizer.param_groups] if optimizer is not None else None
