"""Split a module into pipeline stages on every rank: the whole split, usable from a plain torch loop.

Torch-only. :func:`split_into_stages` takes a module with ``pipeline_layers()`` (or its layers), the process groups
(:class:`~.parallel_dims.ParallelDims`) and the pipeline's counts, and returns the :class:`~.run.PipelineRun` record:
this rank's stages kept in the module (the other layers replaced by :class:`~.remote_layer.RemoteLayer` placeholders and
moved to ``meta``), the ZeRO backend holding the stage over its replicas (``stage_holder.py``: the one chooser's,
as for a whole model) and the engine running steps.
:meth:`~.run.PipelineRun.reassemble` gives the whole module back. ``PipelineParallelStrategy`` calls these and adds
only what the Trainer knows (the example batch, the precision plugin, the optimizers' layout, hooks).

A plain loop, on every rank of a joined process group (``tests/test_pipeline_torch_split.py`` runs it)::

    dims = build_parallel_dims(world_size, rank, pipeline_parallel_size=2)  # the mesh and its groups
    run = split_into_stages(model, dims=dims, device=device, num_stages=2, schedule="1F1B", num_microbatches=2)
    optimizer = torch.optim.AdamW(model.parameters())  # this rank's parameters only
    run.setup_optimizers([optimizer])
    for index, batch in enumerate(loader):
        inputs, _ = run.engine.capture_inputs("training_step", (batch, index), {})
        run.engine.train_step("training_step", (batch, index), {}, model_inputs=inputs, divisor=2)
        run.backend.reduce_gradients()  # over the replicas of each stage, then the tied copies' sum
        optimizer.step()
        run.backend.after_optimizer_step(optimizer)  # ZeRO-1/2: all-gather the stepped shards
        optimizer.zero_grad()
    run.reassemble(model, device=device)  # the whole model again on every rank, on the CPU
    run.backend.teardown()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_parallel.distributed.broadcast import broadcast_from_rank0
from lightning_parallel.distributed.pipeline.balance import UnevenStages
from lightning_parallel.distributed.pipeline.consolidate import OptimizerLayout
from lightning_parallel.distributed.pipeline.contract import ModelCall
from lightning_parallel.distributed.pipeline.engine import PipelineEngine
from lightning_parallel.distributed.pipeline.layer_registration import (
    check_parameter_ownership,
    layer_registrations,
    local_module_ids,
    remove_remote_layers,
)
from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.plan_agreement import check_same_plan, plan_on_every_rank
from lightning_parallel.distributed.pipeline.reassemble import offload_layers
from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer
from lightning_parallel.distributed.pipeline.run import PipelineRun
from lightning_parallel.distributed.pipeline.schedule import schedule_spec
from lightning_parallel.distributed.pipeline.split_layers import SplitLayers
from lightning_parallel.distributed.pipeline.stage_holder import (
    StageHolding,
    check_holdable,
    hold_stage,
    stage_backend_type,
)
from lightning_parallel.distributed.pipeline.stage_plan import PartitionMethod
from lightning_parallel.distributed.pipeline.tensor_parallel_stage import split_stage
from lightning_parallel.distributed.pipeline.tied import (
    TiedGradientSync,
    TiedLayout,
    canonical_names,
    find_tied_parameters,
    parameter_aliases,
)
from lightning_parallel.distributed.pipeline.torch_stage import ChunkObserver, P2PObserver
from lightning_parallel.distributed.pipeline.verify import check_layers_compose_to_forward

__all__ = [
    "StageHolding",
    "check_not_split",
    "check_splittable",
    "split_into_stages",
    "tied_gradient_sync",
]

Example = tuple[tuple[Any, ...], dict[str, Any]]
"""The model call's ``(args, kwargs)`` for one batch."""


def check_not_split(module: nn.Module) -> None:
    """Local. Raise ``ValueError`` if ``module`` holds placeholders of an earlier split (its layers live elsewhere)."""
    if any(isinstance(submodule, RemoteLayer) for submodule in module.modules()):
        raise ValueError(
            "This module was already split by another PipelineParallelStrategy (some layers live on other"
            " ranks). Create a fresh module, or load the consolidated checkpoint into one."
        )


def check_splittable(module: nn.Module, *, num_stages: int, counts: str = "") -> None:
    """Local, the same verdict on every rank. ``module.pipeline_layers()`` must own its parameters, sit in the module
    where it can be replaced, and give each of ``num_stages`` stages a layer (``counts``: where that number comes
    from, for the message)."""
    layers, _ = pipeline_layers_and_call(module)
    check_parameter_ownership(module, layers)
    layer_registrations(module, layers)
    if len(layers) < num_stages:
        raise ValueError(
            f"Cannot split {len(layers)} pipeline layers into {num_stages} stages{counts}: every stage needs at least"
            " one layer. Use fewer stages or return finer layers."
        )


def tied_gradient_sync(layout: TiedLayout, dims: ParallelDims, previous: PipelineRun | None) -> TiedGradientSync:
    """The previous split's when the layout is the same (its process groups exist), else a new one (a collective
    when ranks hold copies: new groups)."""
    if previous is not None and previous.tied.layout == layout:
        return previous.tied
    return TiedGradientSync(layout, dims)


def split_into_stages(
    module: nn.Module,
    *,
    dims: ParallelDims,
    device: torch.device,
    num_stages: int,
    schedule: str,
    num_microbatches: int,
    example: Example | None = None,
    layers: Sequence[nn.Module] | None = None,
    call: ModelCall | None = None,
    partition: PartitionMethod | Sequence[int] = "flops",
    uneven: UnevenStages | None = None,
    verify_layers: bool = True,
    holding: StageHolding | None = None,
    optimizer_layouts: Sequence[OptimizerLayout] = (),
    on_chunk: ChunkObserver | None = None,
    on_p2p: P2PObserver | None = None,
    previous: PipelineRun | None = None,
) -> PipelineRun:
    """Collective (every rank, the same arguments but ``device``). Keep this rank's stages of ``module`` in place.

    Local checks first, on every rank, so a bad model raises everywhere before the first collective: the module is
    not split already, the layers' registrations, ``verify_layers`` (the layers applied in order on ``example`` give
    ``forward``'s result), the plan, and whether the chosen backend can hold it. Then: one plan on every rank, every
    replica from rank 0's weights, the other ranks' layers replaced by placeholders (moved to ``meta``), the module
    converted and moved to ``device``, the backend holding the stage and the engine built.

    Args:
        module: The model; keeps its own names (its other ranks' layers become :class:`~.remote_layer.RemoteLayer`).
        dims: Ranks and process groups (:func:`~.parallel_dims.build_parallel_dims`).
        device: This rank's device.
        num_stages: Stages in all (``pipeline_parallel_size x stages_per_rank``).
        schedule: Canonical schedule name (:func:`~.schedule.resolve_schedule`); evaluation runs forward-only.
        num_microbatches: Micro-batches per batch.
        example: The model call's ``(args, kwargs)`` for a batch: plans ``"flops"``/``"measured"`` and verifies.
        layers: The pipeline layers in order; default ``module.pipeline_layers()`` (or a declared Hugging Face plan).
        call: The model call the pipeline answers; default the one that comes with the layers, else ``module(...)``.
        partition: ``"flops"`` (or ``"compute"``), ``"measured"``, ``"parameters"`` or the first layer of every stage
            but the first.
        uneven: How many layers' worth the first and last stage are lightened by (automatic partitions only).
        verify_layers: Check the layers against ``forward`` on ``example`` (two forward passes, no side effects).
        holding: How the stage is held over its replicas (:class:`~.stage_holder.StageHolding`: the ZeRO settings,
            the mesh, the precision's conversion, how to warn and count); default replicated, nothing counted.
        optimizer_layouts: Each optimizer's parameter names per group on the whole model (consolidated checkpoints).
        on_chunk: Told of every forward/backward chunk this rank's stages run.
        on_p2p: Told of every P2P op this rank's stages send or receive.
        previous: The last split of this module's strategy: its tied groups and sharded names are reused.

    Returns:
        The run's record; ``run.engine`` runs steps, ``run.setup_optimizers`` sets the optimizers up, ``run.backend``
        (a :class:`~lightning_parallel.distributed.zero.backends.ZeroBackend`) reduces gradients and steps with them.
    """
    check_not_split(module)
    holding = holding if holding is not None else StageHolding()
    mesh = holding.mesh if holding.mesh is not None else dims.mesh
    if mesh is None:
        raise ValueError(
            "`dims` has no process groups yet: make it with `build_parallel_dims(...)` (a collective) or pass `mesh=`."
        )
    if layers is None:
        layers, declared_call = pipeline_layers_and_call(module)
        call = call or declared_call
    layers = list(layers)
    call = call or ModelCall(module)
    registrations = layer_registrations(module, layers)  # raises before any collective
    if verify_layers and example is not None:
        check_layers_compose_to_forward(module, layers, example, reference=call.reference)
    plan = plan_on_every_rank(
        layers,
        example,
        partition=partition,
        num_stages=num_stages,
        pipeline_parallel_size=dims.pipeline_parallel_size,
        global_rank=dims.global_rank,
        device=device,
        placement=schedule_spec(schedule).placement,  # which rank holds each stage: the schedule's
        uneven=uneven,
    )
    chosen = stage_backend_type(holding, dims)
    full_state_keys = list(module.state_dict().keys())
    full_shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    tied, aliases = find_tied_parameters(module, layers), parameter_aliases(module)
    check_holdable(chosen, tied, plan, dims.pipeline_parallel_size)
    # First collectives: every check above ran on every rank.
    check_same_plan(plan, dims.world_size)
    broadcast_from_rank0(module, device)  # every stage and replica starts from rank 0's weights
    layout = TiedLayout(tuple(tied), plan)
    tied_sync = tied_gradient_sync(layout, dims, previous)
    split = SplitLayers(layers=list(layers), registrations=registrations, plan=plan, dims=dims)
    local = keep_local_layers(module, split)
    canonical_held = set(canonical_names(module, aliases).values())
    if holding.convert is not None:
        holding.convert(module)
    module.to(device)
    tensor_parallel = (
        split_stage(module, holding.tensor_parallel, mesh["tensor"]) if holding.tensor_parallel is not None else None
    )
    # ZeRO-3: the local layers' sharded copies run the stages (the optimizers are built after this).
    held = hold_stage(
        chosen,
        module,
        {i: layers[i] for i in local},
        holding=holding,
        registrations=registrations,
        dims=dims,
        mesh=mesh,
        tied=tied_sync,
        aliases=aliases,
        device=device,
        previous=previous.held if previous is not None else None,
        tensor_parallel=tensor_parallel,
    )
    running = held.layers
    engine = PipelineEngine(
        module,
        layers=[running.get(i) for i in range(len(layers))],
        plan=plan,
        dims=dims,
        schedule=schedule,
        num_microbatches=num_microbatches,
        device=device,
        call=call,
        on_chunk=on_chunk,
        on_p2p=on_p2p,
    )
    return PipelineRun(
        module=module,
        split=split,
        tied=tied_sync,
        aliases=aliases,
        full_state_keys=full_state_keys,
        full_shapes=full_shapes,
        optimizer_layouts=list(optimizer_layouts),
        local_parameter_names=canonical_held - layout.uncounted(dims.pipeline_rank),
        held=held,
        engine=engine,
        tensor_parallel=tensor_parallel,
    )


def keep_local_layers(module: nn.Module, split: SplitLayers) -> set[int]:
    """Local. Replace the layers of other pipeline ranks by placeholders in ``module`` and move them to ``meta`` (a
    module a local layer shares stays); returns the indices of this rank's layers."""
    local_stages, local, layers = split.local_stages, split.local, split.layers
    shared = local_module_ids(layers, split.plan, local_stages)
    remove_remote_layers(module, split.registrations, split.plan, local_stages, keep=shared)
    offload_layers(layers, [i for i in range(len(layers)) if i not in local], keep=shared)
    return local
