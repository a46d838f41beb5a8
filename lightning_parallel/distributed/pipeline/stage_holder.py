"""How a pipeline holds its stage over the data-parallel replicas: by the ZeRO backend a whole model gets.

Torch-only. As torchtitan applies the same ``parallelize`` to a whole model and to each pipeline stage, a split asks
the one chooser (:func:`~lightning_parallel.distributed.zero.backends.backend_type`) for the backend of its
``zero_stage`` (0: replicated, the replicas' gradients averaged as DDP does; 1-2: flat buckets; 3: fully-shard;
without data parallelism, replicated or fp32 masters) and builds it from the same
:class:`~lightning_parallel.distributed.zero.config.ZeroConfig` that ``ShardedOptimizerStrategy`` builds its backend
from. What a stage adds are extensions, not another family of holders:

* :class:`~lightning_parallel.distributed.zero.backends.StageExtensions`: the tied copies' gradient sum over the
  pipeline ranks (:class:`~.zero.TiedCopiesSum`), the clipping norm over the ``pp`` group, the tied copies left out of
  this rank's norm;
* ZeRO-3's preparation step (:class:`~.fully_shard.PipelineFullyShard`): the stage's layers replaced by copies the
  backend shards, put back whole after the run.

The stage-keyed checkpoint state (by canonical name, over the pipeline) is read over the backend by
:class:`~.run.PipelineRun`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.distributed.pipeline.fully_shard import PipelineFullyShard
from lightning_parallel.distributed.pipeline.layer_registration import Registration
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tensor_parallel_stage import StageTensorParallel
from lightning_parallel.distributed.pipeline.tied import TiedGradientSync, TiedParameter, canonical_names
from lightning_parallel.distributed.pipeline.zero import TiedCopiesSum, check_no_tie_within_a_rank
from lightning_parallel.distributed.tensor_parallel import TensorParallelPlan
from lightning_parallel.distributed.zero.backends import StageExtensions, ZeroBackend, ZeroContext, backend_type
from lightning_parallel.distributed.zero.config import ZeroConfig

__all__ = ["HeldStage", "StageHolding", "check_holdable", "hold_stage", "stage_backend_type"]


def _not_counted() -> CommunicationStats | None:
    return None


@dataclass(frozen=True, kw_only=True)
class StageHolding:
    """How a split holds its stage over the replicas: the options that travel together from the strategy (or a plain
    torch loop) to the stage's ZeRO backend."""

    zero_config: ZeroConfig | None = None
    """ZeRO inside the pipeline over each stage's replicas (``None``: ``zero_stage=0``, replicated)."""
    keeps_masters: bool = False
    """16-bit parameters stepped through fp32 master weights (also without data parallelism, as
    ``ShardedOptimizerStrategy`` keeps them at world size 1)."""
    fitting: bool = True
    """Whether the optimizers are set up after this split; a split that does not fit (``validate`` after ``fit``)
    keeps the fit's ZeRO-1/2 backend, whose shards the fit's optimizers still step (a checkpoint reads them there)."""
    mesh: DeviceMesh | None = None
    """The device mesh the backend shards over; default the split's ``dims.mesh``."""
    convert: Callable[[nn.Module], Any] | None = None
    """Called with the split module before it moves to its device (a precision plugin's ``convert_module``)."""
    warn: Callable[[str], Any] = warnings.warn
    """How the backend warns (an optimizer not known to update element-wise)."""
    stats: Callable[[], CommunicationStats | None] = field(default=_not_counted)
    """Where collective bytes are counted now (``None``: not counted; a monitor switches counting on per run)."""
    tensor_parallel: TensorParallelPlan | None = None
    """The whole module's tensor-parallel plan: this rank's layers are split over the mesh's ``tensor`` axis after
    the pipeline split (``tensor_parallel_stage.py``); ``None``: no tensor parallelism."""


@dataclass(frozen=True)
class HeldStage:
    """What :func:`hold_stage` made: the backend and, at ZeRO-3, the preparation step's copies."""

    backend: ZeroBackend
    copies: PipelineFullyShard | None
    layers: dict[int, nn.Module]
    """The layers the stages run, by index (ZeRO-3: the sharded copies)."""
    sharded_names: dict[int, str]
    """``id`` -> canonical name of the sharded parameters of this and earlier splits (ZeRO-3: the optimizers of a
    ``fit`` keep its shards after a later ``validate`` splits afresh); empty when nothing is sharded."""


def stage_backend_type(holding: StageHolding, dims: ParallelDims) -> type[ZeroBackend]:
    """Local. The backend holding each stage: the one chooser's answer for ``zero_stage`` over the stage's replicas."""
    zero_stage = holding.zero_config.stage if holding.zero_config is not None else 0
    return backend_type(zero_stage, is_sharding=dims.data_parallel_size > 1, keeps_masters=holding.keeps_masters)


def check_holdable(
    chosen: type[ZeroBackend], tied: Sequence[TiedParameter], plan: StagePlan, pipeline_parallel_size: int
) -> None:
    """Local, the same verdict on every rank, before any collective: raise ``ValueError`` for a split ``chosen``
    cannot hold (sharded parameters: a weight two layers of one rank share)."""
    if chosen.shards_parameters:
        check_no_tie_within_a_rank(tied, plan, pipeline_parallel_size)


def hold_stage(
    chosen: type[ZeroBackend],
    module: nn.Module,
    layers: Mapping[int, nn.Module],
    *,
    holding: StageHolding,
    registrations: Sequence[Sequence[Registration]],
    dims: ParallelDims,
    mesh: DeviceMesh,
    tied: TiedGradientSync,
    aliases: Mapping[str, str],
    device: torch.device,
    previous: HeldStage | None = None,
    tensor_parallel: StageTensorParallel | None = None,
) -> HeldStage:
    """Collective over the stage's replicas (ZeRO-3: FSDP2's set-up) or local. Build ``chosen`` holding this rank's
    ``layers`` of the split ``module`` (every replica from rank 0's weights already), with the pipeline's extensions.
    The optimizers come later: ``backend.setup_optimizers`` (fitting only). ``tensor_parallel``: the stage's layers
    are split over the tensor group, whose ranks the clipping norm also sums over (each element counted once)."""
    sharded_names = dict(previous.sharded_names) if previous is not None else {}
    reusable = chosen.shards_gradients and not chosen.shards_parameters  # the fit's shard views stay the state
    if previous is not None and not holding.fitting and reusable and type(previous.backend) is chosen:
        return HeldStage(previous.backend, None, dict(layers), sharded_names)
    copies = (
        PipelineFullyShard(module, layers, registrations=registrations, warn=holding.warn)
        if chosen.shards_parameters
        else None
    )
    held = copies.container if copies is not None else module
    uncounted = tied.layout.uncounted(dims.pipeline_rank)
    names = canonical_names(module, aliases)
    replicated = tensor_parallel.replicated_names(held, dims.tensor_rank) if tensor_parallel is not None else set()
    extensions = StageExtensions(
        after_reduction=TiedCopiesSum(module, tied, dims, aliases, stats=holding.stats),
        norm_groups=(dims.pipeline_group,) if dims.tensor_group is None else (dims.pipeline_group, dims.tensor_group),
        uncounted=frozenset(
            name
            for name, param in held.named_parameters(remove_duplicate=False)
            if names.get(id(param)) in uncounted or name in replicated
        ),
        device=device,
    )
    context = ZeroContext(
        rank=dims.global_rank,
        world_size=dims.world_size,
        mesh=mesh,
        # Collectives a tap counts (FSDP2's) are not counted in the pipeline, which installs no tap.
        stats=holding.stats() if chosen.collective_tap is None else None,
        warn=holding.warn,
        sync_module_states=_started_at_the_split,
        stage=extensions,
        host_group=dims.host_data_parallel_group,
        data_parallel_group=dims.data_parallel_group if dims.data_parallel_size > 1 else None,
    )
    # `zero_stage=0` has no ZeRO settings: the replicated backend reads none of them.
    backend = chosen(holding.zero_config or ZeroConfig(), context)
    backend.setup_module(held, device)  # ZeRO-3: FSDP2 shards the copies (the units of a stage share one root)
    if copies is None:
        return HeldStage(backend, None, dict(layers), sharded_names)
    copies.finish(aliases)
    sharded_names.update(copies.names)
    return HeldStage(backend, copies, dict(copies.layers), sharded_names)


def _started_at_the_split(module: nn.Module) -> None:
    del module  # the split broadcast rank 0's weights to every stage and replica
