"""Splitting a model given as ``pipeline_layers()`` into contiguous pipeline stages.

Torch-only: usable without a Trainer. The model stays one ``nn.Module`` tree; a rank keeps the layers of its own
stages and replaces the others by :class:`RemoteLayer` placeholders, so ``state_dict()`` keeps the model's original
parameter names and ``parameters()`` (hence the optimizer) holds only the local stage's parameters.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.balance import UnevenStages, balance_ranks, balanced_boundaries
from lightning_parallel.distributed.pipeline.flops import count_forward_flops, new_fake_mode
from lightning_parallel.distributed.pipeline.side_inputs import (
    accepted_side_inputs,
    call_layer,
    decoded_side_input,
    encoded_side_input,
    split_side_inputs,
    with_zero_gradients,
)

__all__ = [
    "PLACEMENTS",
    "PartitionMethod",
    "Placement",
    "Registration",
    "RemoteLayer",
    "StageModule",
    "StagePlan",
    "UnevenStages",
    "balanced_boundaries",
    "check_layer_output",
    "check_parameter_ownership",
    "layer_compute_costs",
    "layer_parameter_costs",
    "layer_registrations",
    "local_module_ids",
    "measure_layer_times",
    "plan_for_example",
    "plan_stages",
    "remove_remote_layers",
    "resolve_pipeline_layers",
    "validate_partition",
]

PartitionMethod = Literal["flops", "compute", "measured", "parameters"]
"""How the automatic split weighs a layer: ``"flops"`` (its forward FLOPs for an example batch; ``"compute"`` is the
same, its older name), ``"measured"`` (its forward and backward timed), ``"parameters"`` (its parameter count)."""
_FLOPS = ("flops", "compute")

Placement = Literal["loop", "v"]
"""How a :class:`StagePlan` lays stages on pipeline ranks (see :attr:`StagePlan.placement`)."""
PLACEMENTS: tuple[Placement, ...] = ("loop", "v")

_CONTRACT = (
    "The pipeline contract: a step calls `self(...)` exactly once and computes its loss from the result; the"
    " layers of `pipeline_layers()` run only inside the pipeline."
)


def validate_partition(partition: Any) -> None:
    """``partition`` must be a :data:`PartitionMethod` or a list of layer indices.

    Raises:
        ValueError: Quoting the bad value and the valid options.
    """
    is_int_list = isinstance(partition, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in partition
    )
    if not (partition in ("flops", "compute", "measured", "parameters") or is_int_list):
        raise ValueError(
            f"`partition={partition!r}` is invalid. Valid options: 'flops' (or its older name 'compute'), 'measured',"
            " 'parameters', or a list of the first layer index of every stage but the first."
        )


def resolve_pipeline_layers(module: nn.Module) -> list[nn.Module]:
    """Call ``module.pipeline_layers()`` and check what it returns.

    Raises:
        TypeError: If the module has no ``pipeline_layers`` method or it returns something other than modules.
        ValueError: If it returns no layers or the same layer twice.
    """
    method = getattr(module, "pipeline_layers", None)
    if not callable(method):
        raise TypeError(
            f"`{type(module).__name__}` has no `pipeline_layers()` method and holds no model that declares a pipeline"
            " plan (a Hugging Face model with `base_model_pp_plan`), so PipelineParallelStrategy does not know how to"
            " split it. Add `def pipeline_layers(self) -> Sequence[nn.Module]` returning the model's layers in order,"
            " each layer's output the next one's input, their composition equal to `forward`."
        )
    layers = list(method())
    if not layers:
        raise ValueError(f"`{type(module).__name__}.pipeline_layers()` returned no layers; return at least one.")
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"`pipeline_layers()` item {index} is a `{type(layer).__name__}`, not an `nn.Module`; return modules."
            )
    if len({id(layer) for layer in layers}) != len(layers):
        raise ValueError("`pipeline_layers()` returned the same module twice; every layer must appear once.")
    return layers


@dataclass(frozen=True)
class Registration:
    """Where a layer's module, or a tensor it holds itself, is registered in the model: what a split replaces on a
    rank that does not run the layer, and teardown puts back."""

    name: str
    """The qualified name in the model: a module's (``"model.transformer.wte"``) or a tensor's (``"model.cls_token"``,
    a parameter of the model itself that an adapter holds)."""
    holder: nn.Module
    """A module: the module itself. A tensor: the module of the layer that holds it (the adapter)."""
    attribute: str | None = None
    """A tensor: its attribute in ``holder`` (``"cls_token"``); ``None`` for a module."""

    @property
    def is_tensor(self) -> bool:
        return self.attribute is not None

    def value(self, holder: nn.Module | None = None) -> nn.Module | Tensor:
        """What is registered under :attr:`name`: the module, or the tensor ``holder`` holds now (default:
        :attr:`holder`; a copy of it, or the holder after teardown gave it the received tensor)."""
        holder = holder if holder is not None else self.holder
        return holder if self.attribute is None else getattr(holder, self.attribute)

    def place(self, module: nn.Module, holder: nn.Module | None = None) -> None:
        """Register :meth:`value` under :attr:`name` in ``module`` (in place of a placeholder or the original)."""
        value = self.value(holder)
        if isinstance(value, nn.Module):
            module.set_submodule(self.name, value)
            return
        prefix, _, leaf = self.name.rpartition(".")
        _register_slot(module.get_submodule(prefix), leaf, value)

    def remove(self, module: nn.Module, stage: int) -> None:
        """Take it out of ``module`` on a rank that does not run its layer: a module becomes a :class:`RemoteLayer`,
        a tensor an empty slot (``None``: absent from ``parameters()`` and ``state_dict()``, as a module's
        parameters are behind a placeholder)."""
        if self.attribute is None:
            module.set_submodule(self.name, RemoteLayer(self.name, stage))
            return
        prefix, _, leaf = self.name.rpartition(".")
        _register_slot(module.get_submodule(prefix), leaf, None)


def _register_slot(owner: nn.Module, leaf: str, value: Tensor | None) -> None:
    """Register ``value`` under ``owner``'s existing parameter or buffer slot ``leaf`` through torch's own API
    (``None``: the slot stays, empty; a buffer keeps whether it is persistent)."""
    if leaf in owner._parameters:
        assert value is None or isinstance(value, nn.Parameter), f"`{leaf}` is a parameter slot"
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value, persistent=leaf not in owner._non_persistent_buffers_set)


def layer_registrations(module: nn.Module, layers: Sequence[nn.Module]) -> list[list[Registration]]:
    """Where each layer's modules (and the tensors it holds itself) are registered in ``module``: what a split
    replaces and teardown puts back.

    A layer registered in the tree contributes its own names, *and* the other names of its submodules registered
    elsewhere too: an adapter such as ``Embeddings(self.model.transformer.wte, self.model.transformer.wpe)`` holds a
    model's own modules, reachable under two names, and both must leave a rank that does not run the layer (else the
    module keeps a second path to tensors moved to ``meta``). A layer that is not registered itself (built inside
    ``pipeline_layers()``, or an adapter made from a model's declared plan) is found through its submodules, so the
    model's own names stay the checkpoint's names. A parameter or buffer that such a layer holds itself
    (``self.cls_token = vit.cls_token``: timm's ViT keeps ``cls_token`` and ``pos_embed`` on the model itself, next
    to its blocks) is registered by the model's own name for it, so only the tensor leaves a rank that does not run
    the layer. A stateless layer (no parameters, no buffers: a reshape) outside the tree has nothing to move.

    Raises:
        ValueError: If a layer holds a parameter or buffer that is not one of ``module``'s, or is ``module``.
    """
    names: dict[int, list[str]] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        if name:
            names.setdefault(id(submodule), []).append(name)
    tensor_names = _tensor_names(module)
    result: list[list[Registration]] = []
    for index, layer in enumerate(layers):
        if layer is module:
            raise ValueError(
                f"`pipeline_layers()` item {index} is the module `{type(module).__name__}` itself; return its layers."
            )
        found = sorted(
            ((name, sub) for sub in layer.modules() for name in names.get(id(sub), [])), key=lambda r: r[0].count(".")
        )
        registrations: list[Registration] = []
        for name, sub in found:  # outermost first: a name under one already kept moves with it
            if not _under(name, registrations):
                registrations.append(Registration(name, sub))
        covered = {id(m) for r in registrations for m in r.holder.modules()}
        for prefix, sub in layer.named_modules():
            if id(sub) not in covered:
                registrations += _tensor_registrations(module, index, layer, prefix, sub, tensor_names, registrations)
        result.append(registrations)
    return result


def _under(name: str, registrations: Sequence[Registration]) -> bool:
    return any(name == r.name or name.startswith(r.name + ".") for r in registrations)


def _tensor_names(module: nn.Module) -> dict[int, list[str]]:
    """``id`` of every parameter and buffer of ``module`` -> its qualified names."""
    found: dict[int, list[str]] = {}
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        found.setdefault(id(tensor), []).append(name)
    return found


def _tensor_registrations(
    module: nn.Module,
    index: int,
    layer: nn.Module,
    prefix: str,
    holder: nn.Module,
    tensor_names: dict[int, list[str]],
    registrations: Sequence[Registration],
) -> list[Registration]:
    """The registrations of the tensors ``holder`` (a module of ``layer`` registered nowhere in ``module``) holds
    itself: each of ``module``'s names for it not under a registration already kept.

    Raises:
        ValueError: Naming the tensor, if it is not one of ``module``'s (a copy).
    """
    own = [(k, t) for k, t in [*holder._parameters.items(), *holder._buffers.items()] if t is not None]
    result: list[Registration] = []
    for attribute, tensor in own:
        model_names = tensor_names.get(id(tensor))
        if not model_names:
            kind = "parameter" if attribute in holder._parameters else "buffer"
            where = f"{prefix}.{attribute}" if prefix else attribute
            raise ValueError(
                f"`pipeline_layers()` item {index} (`{type(layer).__name__}`) holds the {kind} `{where}` (shape"
                f" {tuple(tensor.shape)}), which is no {kind} of `{type(module).__name__}`: a layer may hold only the"
                " model's own modules and tensors, so that every rank trains, and checkpoints save, the model's own."
                " Return the model's own layers (not copies), or an adapter made of the model's own modules and"
                " tensors (`self.cls_token = vit.cls_token`)."
            )
        result += [
            Registration(name, holder, attribute)
            for name in model_names
            if not _under(name, registrations) and not _under(name, result)
        ]
    return result


def check_parameter_ownership(module: nn.Module, layers: Sequence[nn.Module]) -> list[int]:
    """Check that every parameter of ``module`` belongs to a layer; return each layer's parameter count.

    A parameter may belong to several layers (tied weights, e.g. an embedding reused as the LM head): the stages
    that use it each keep a copy (see :mod:`.tied`).

    Raises:
        ValueError: If a parameter belongs to no layer.
    """
    owned = {id(parameter) for layer in layers for parameter in layer.parameters()}
    for name, parameter in module.named_parameters():
        if id(parameter) not in owned:
            raise ValueError(
                f"Parameter `{name}` belongs to none of the modules returned by `pipeline_layers()`. Every"
                " parameter used by `forward` must live in a pipeline layer."
            )
    return layer_parameter_costs(layers)


def layer_parameter_costs(layers: Sequence[nn.Module]) -> list[int]:
    """Number of parameters per layer."""
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def check_layer_output(index: int, layer: nn.Module, output: Any) -> tuple[Tensor, ...]:
    """``output`` as a tuple of tensors; a ``TypeError`` naming the layer if it is anything else."""
    if isinstance(output, Tensor):
        return (output,)
    if isinstance(output, tuple) and output and all(isinstance(o, Tensor) for o in output):
        return output
    kind = type(output).__name__
    if isinstance(output, tuple):
        kind = f"tuple of ({', '.join(type(o).__name__ for o in output)})"
    raise TypeError(
        f"Pipeline layer {index} (`{type(layer).__name__}`) returned a {kind}; pipeline layers must return a tensor"
        " or a non-empty tuple of tensors (they are sent between ranks). Wrap the layer so that it does."
    )


def layer_compute_costs(
    layers: Sequence[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Estimate each layer's compute by counting its forward FLOPs with fake parameters (no memory, deterministic).

    Also checks that every layer returns a tensor or a tuple of tensors. The estimate adds each layer's output
    size, so layers without matrix products (embeddings, norms) still count as the memory-bound work they are.
    Every rank computes the same numbers, so no communication is needed to agree on a split. The layers are not
    copied: each runs once through ``torch.func.functional_call`` with fake stand-ins (shapes, no memory) for its
    parameters and buffers; only what derives from them is fake, so the inputs, masks and plain tensor attributes (a
    cached positional encoding) stay real (see :mod:`.flops`), and attributes the forward sets are put back.

    Args:
        layers: The pipeline layers, in order.
        args, kwargs: Example inputs of the first layer (one micro-batch or a whole batch; only shapes matter).

    Raises:
        TypeError: If a layer returns something other than a tensor or a tuple of tensors.
        RuntimeError: Naming the layer, if it cannot run with fake parameters (its forward reads a value computed
            from them, e.g. ``.item()`` of an activation, or uses an op without a fake implementation).
    """
    costs = []
    side, extra = split_side_inputs(kwargs or {})
    current_args: tuple[Any, ...] = tuple(args)
    fake_mode = new_fake_mode()
    for index, layer in enumerate(layers):
        layer_kwargs = {**accepted_side_inputs(layer, side), **(extra if index == 0 else {})}
        try:
            output, flops = count_forward_flops(layer, current_args, layer_kwargs, fake_mode=fake_mode)
        except Exception as error:
            raise _UncountableLayerError(
                f"Could not count the FLOPs of pipeline layer {index} (`{type(layer).__name__}`) with fake (shape-only)"
                f" parameters: {type(error).__name__}: {error}"
            ) from error
        outputs = check_layer_output(index, layer, output)
        costs.append(flops + sum(o.numel() for o in outputs))
        current_args = outputs
    return costs


class _UncountableLayerError(RuntimeError):
    """A layer whose forward cannot run with fake parameters; planning falls back to parameter counts."""


def _on(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor detached on ``device``, floating ones requiring grad (namedtuples kept)."""

    def move(tensor: Tensor) -> Tensor:
        tensor = tensor.detach().to(device)
        return tensor.requires_grad_() if tensor.is_floating_point() else tensor

    return apply_to_collection(value, Tensor, move)


def measure_layer_times(
    layers: Sequence[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    device: torch.device,
    repeats: int = 3,
) -> list[float]:
    """Wall time of each layer's forward and backward on ``device`` for the example inputs, in seconds.

    Each layer is timed on a copy (one at a time), so the real layers' gradients, buffers (batch-norm statistics)
    and the RNG streams stay untouched; the next layer gets the previous one's output. Ranks measure different
    times, so measure on one rank and share the result.
    """
    times = []
    side, extra = split_side_inputs(kwargs or {})
    current_args: tuple[Any, ...] = tuple(args)
    # Saved and restored by hand: `torch.random.fork_rng` asks for the current accelerator, which initialises CUDA
    # even for a CPU measurement (and a process that did so can no longer fork CUDA-using children).
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        for index, layer in enumerate(layers):
            probe = copy.deepcopy(layer).to(device)
            kw = {**accepted_side_inputs(probe, side), **(extra if index == 0 else {})}
            inputs, kw = _on(current_args, device), _on(kw, device)
            _forward_backward(index, probe, inputs, kw)  # warm-up: allocator, kernels, lazy initialisation
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                outputs = _forward_backward(index, probe, inputs, kw)
            _synchronize(device)
            times.append((time.perf_counter() - start) / repeats)
            current_args = tuple(o.detach() for o in outputs)
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    return times


def _forward_backward(
    index: int, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Tensor, ...]:
    outputs = check_layer_output(index, layer, layer(*args, **kwargs))
    loss = sum(o.float().sum() for o in outputs if o.requires_grad)
    if isinstance(loss, Tensor):
        loss.backward()
    return outputs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class StagePlan:
    """Which layers form which stage, and which pipeline rank runs each stage.

    Every question "which rank holds stage ``s`` / layer ``i``" goes through :meth:`rank_of_stage` (and
    :meth:`stages_of`, its inverse), which follow :attr:`placement`; nothing else writes the placement out.
    """

    starts: tuple[int, ...]
    """Index of the first layer of each stage."""
    num_layers: int
    """Total number of layers."""
    pipeline_parallel_size: int
    """Number of pipeline ranks; :attr:`placement` says which of them runs each stage."""
    placement: Placement = "loop"
    """How stages are laid on ranks, as the schedule expects them (``ScheduleSpec.placement``): ``"loop"`` puts stage
    ``s`` on rank ``s % pipeline_parallel_size`` (every schedule with one stage per rank, and the interleaved/looped
    ones); ``"v"`` (two stages per rank) puts stage ``s`` on rank ``s`` for ``s < p`` and on ``2p - 1 - s`` after, so
    rank ``r`` holds stages ``r`` and ``2p - 1 - r`` and the first and last stage share rank 0 (torch's V-shaped
    schedules, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"`placement={self.placement!r}` is invalid. Valid placements: {', '.join(PLACEMENTS)}.")
        if self.placement == "v" and self.num_stages != 2 * self.pipeline_parallel_size:
            raise ValueError(
                f"`placement='v'` lays two stages on each rank, but the plan has {self.num_stages} stages for"
                f" `pipeline_parallel_size={self.pipeline_parallel_size}`. Use `stages_per_rank=2`."
            )

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def layers_of(self, stage: int) -> range:
        """Layer indices of ``stage``."""
        stop = self.starts[stage + 1] if stage + 1 < self.num_stages else self.num_layers
        return range(self.starts[stage], stop)

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs ``stage`` under :attr:`placement`."""
        if not 0 <= stage < self.num_stages:
            raise IndexError(f"Stage {stage} is not in this plan of {self.num_stages} stages.")
        p = self.pipeline_parallel_size
        if self.placement == "v" and stage >= p:
            return 2 * p - 1 - stage  # the way back up the V
        return stage % p

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """Stages run by ``pipeline_rank``, ascending (the inverse of :meth:`rank_of_stage`)."""
        return [stage for stage in range(self.num_stages) if self.rank_of_stage(stage) == pipeline_rank]

    def stage_of_layer(self, layer: int) -> int:
        return max(s for s, start in enumerate(self.starts) if start <= layer)

    def rank_of_layer(self, layer: int) -> int:
        """The pipeline rank that runs ``layer`` (the rank of its stage)."""
        return self.rank_of_stage(self.stage_of_layer(layer))


def plan_stages(
    costs: Sequence[float],
    *,
    num_stages: int,
    pipeline_parallel_size: int,
    boundaries: Sequence[int] | None = None,
    placement: Placement = "loop",
    uneven: UnevenStages | None = None,
) -> StagePlan:
    """Plan stages from per-layer costs, or from explicit ``boundaries`` (start layer of every stage but the first),
    laid on ranks by ``placement`` (the schedule's: ``schedule_spec(name).placement``).

    From costs (:mod:`.balance`): the split minimising the heaviest stage, the first and last stage lightened by
    ``uneven``; where a rank holds several stages (``num_stages > pipeline_parallel_size``), refined so that the
    heaviest *rank* (the sum of its stages) is as light as a one-layer move of a boundary can make it.

    Raises:
        ValueError: If there are more stages than layers, the boundaries are not increasing in ``(0, num_layers)``,
            or ``uneven`` lightens a stage by more layers than there are.
    """
    n = len(costs)
    if boundaries is None:
        starts = _balanced_starts(costs, num_stages, pipeline_parallel_size, placement, uneven or UnevenStages())
    else:
        starts = [0, *boundaries]
        valid = all(a < b for a, b in zip(starts, [*starts[1:], n], strict=True))
        if len(starts) != num_stages or not valid:
            raise ValueError(
                f"`partition={list(boundaries)!r}` must list the first layer of stages 1..{num_stages - 1}"
                f" ({num_stages - 1} strictly increasing indices in 1..{n - 1}) for {num_stages} stages of {n} layers."
            )
    return StagePlan(
        starts=tuple(starts), num_layers=n, pipeline_parallel_size=pipeline_parallel_size, placement=placement
    )


def _balanced_starts(
    costs: Sequence[float], num_stages: int, pipeline_parallel_size: int, placement: Placement, uneven: UnevenStages
) -> list[int]:
    uneven.check_layer_count(len(costs))
    extra_first, extra_last = uneven.extra_costs(costs)
    starts = balanced_boundaries(costs, num_stages, extra_first=extra_first, extra_last=extra_last)
    if num_stages <= pipeline_parallel_size:
        return starts  # one stage per rank: the heaviest stage is the heaviest rank
    plan = StagePlan(
        starts=tuple(starts), num_layers=len(costs), pipeline_parallel_size=pipeline_parallel_size, placement=placement
    )
    return balance_ranks(
        costs,
        starts,
        rank_of_stage=plan.rank_of_stage,
        num_ranks=pipeline_parallel_size,
        extra_first=extra_first,
        extra_last=extra_last,
    )


def plan_for_example(
    layers: Sequence[nn.Module],
    example: tuple[tuple[Any, ...], dict[str, Any]] | None,
    *,
    partition: PartitionMethod | Sequence[int],
    num_stages: int,
    pipeline_parallel_size: int,
    measured: Sequence[float] | None = None,
    warn: Callable[[str], Any] = warnings.warn,
    placement: Placement = "loop",
    uneven: UnevenStages | None = None,
) -> StagePlan:
    """Plan stages for ``layers`` given example inputs of the first layer (``(args, kwargs)``, or ``None``), laid on
    ranks by ``placement`` (:attr:`StagePlan.placement`), the first and last stage lightened by ``uneven``
    (:class:`~.balance.UnevenStages`; not with an explicit list).

    Only ``"flops"`` (``"compute"``) runs the layers, to count their FLOPs (:func:`layer_compute_costs`, with fake
    parameters); ``"parameters"`` and an explicit list run nothing (the layers' outputs are checked by the layer check
    and at run time), ``"measured"`` uses ``measured`` (per-layer times from :func:`measure_layer_times`, the same on
    every rank). Without an example, or when a layer's FLOPs cannot be counted (``warn`` says which and why), the
    split follows parameter counts. Every rank sees the same layers and example shapes, so every rank takes the same
    decision and warns the same; pass a ``warn`` that is silent off rank 0.

    What each method weighs: ``"parameters"`` counts every parameter of a layer (a weight tied between the embedding
    and the head counts in both: each stage holding one keeps a copy), so it balances weights, gradients and
    optimizer state, not activations; ``"flops"`` counts the forward FLOPs (the head's projection to the vocabulary
    included), not the loss nor the optimizer step.
    """
    costs: Sequence[float] | None = None
    if partition in _FLOPS and example is not None:
        try:
            costs = layer_compute_costs(layers, *example)
        except _UncountableLayerError as error:
            warn(
                f"{error}. `partition={partition!r}` splits by parameter counts instead. Pass `partition='measured'`"
                " to time the layers, or the first layer of every stage but the first (`partition=[...]`)."
            )
    elif partition == "measured":
        costs = measured
    if costs is None:
        costs = layer_parameter_costs(layers)
    boundaries = None if isinstance(partition, str) else list(partition)
    return plan_stages(
        costs,
        num_stages=num_stages,
        pipeline_parallel_size=pipeline_parallel_size,
        boundaries=boundaries,
        placement=placement,
        uneven=uneven,
    )


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline rank; calling it explains the contract."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.name = name
        self.stage = stage
        self.orphaned = False
        """Set when the run failed before the whole model could be put back: any access then raises."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.orphaned:
            raise self._orphaned_error()
        raise RuntimeError(
            f"`{self.name}` lives on pipeline stage {self.stage}, not on this rank, so it cannot be called here."
            f" {_CONTRACT} Call `self(...)` in the step instead of reaching into submodules."
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.orphaned:
            raise self._orphaned_error()
        return super().state_dict(*args, **kwargs)

    def _orphaned_error(self) -> RuntimeError:
        return RuntimeError(
            f"`{self.name}` lived on pipeline stage {self.stage} of a pipeline run that failed, so this module holds"
            " only this rank's stages and cannot give its whole state. Load the last checkpoint into a fresh module"
            " (`LitModel.load_from_checkpoint(path)`)."
        )

    def extra_repr(self) -> str:
        return f"name={self.name!r}, stage={self.stage}"


def local_module_ids(layers: Sequence[nn.Module], plan: StagePlan, local_stages: Sequence[int]) -> set[int]:
    """``id`` of every module, parameter and buffer inside a layer of ``local_stages`` (what two layers share stays
    where one runs)."""
    local = [layers[index] for stage in local_stages for index in plan.layers_of(stage)]
    return {id(item) for layer in local for item in (*layer.modules(), *layer.parameters(), *layer.buffers())}


def remove_remote_layers(
    module: nn.Module,
    registrations: Sequence[Sequence[Registration]],
    plan: StagePlan,
    local_stages: Sequence[int],
    *,
    keep: set[int],
) -> None:
    """Take every registration of a layer outside ``local_stages`` out of ``module`` (:meth:`Registration.remove`: a
    module becomes a :class:`RemoteLayer`, a tensor the layer holds itself an empty slot), freeing it here.

    ``keep``: ids of modules and tensors a local layer also holds (:func:`local_module_ids`); they stay.
    """
    local_layers = {layer for stage in local_stages for layer in plan.layers_of(stage)}
    for index, layer_registrations in enumerate(registrations):
        if index in local_layers:
            continue
        for registration in layer_registrations:
            if id(registration.value()) not in keep:
                registration.remove(module, plan.stage_of_layer(index))


class StageModule(nn.Module):
    """The layers of one stage applied in order; the module a ``PipelineStage`` runs.

    With side inputs (:mod:`.side_inputs`, ``side_dtypes``: name to dtype): the first stage takes them by keyword
    from the model call, a later stage as the last ``len(side_dtypes)`` positional inputs (what the previous stage
    sent after its outputs, in the order of the names); every layer gets those it takes by name, and every stage but
    the last sends them on after its outputs. Where torch makes every received tensor require grad (< 2.12), they
    travel encoded as floating tensors and each received one gets a gradient of zeros (:mod:`.side_inputs`).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        side_dtypes: Mapping[str, torch.dtype] | None = None,
        is_first: bool = True,
        is_last: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.side_dtypes = dict(sorted((side_dtypes or {}).items()))
        self.side_names = tuple(self.side_dtypes)
        self.encodes_side_inputs = bool(self.side_names) and _compat.every_received_tensor_requires_grad()
        self.is_first, self.is_last = is_first, is_last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        received: tuple[Tensor, ...] = ()
        if self.is_first:
            side, kwargs = split_side_inputs(kwargs)
        else:  # torch's multi-stage schedules hand the model call's kwargs to every stage of the first rank: unused
            count = len(self.side_names)
            received = args[len(args) - count :] if count else ()
            args, kwargs = args[: len(args) - count], {}
            side = self._received_side_inputs(received)
            if torch.is_grad_enabled():
                args = tuple(
                    _ContiguousGradient.apply(a) if isinstance(a, Tensor) and a.requires_grad else a for a in args
                )
        output = call_layer(self.layers[0], args, side, kwargs)
        for layer in self.layers[1:]:
            output = call_layer(layer, output if isinstance(output, tuple) else (output,), side)
        single = not isinstance(output, tuple)
        outputs: tuple[Tensor, ...] = (output,) if single else tuple(output)
        if not self.is_last:
            # Sent to the next stage: gloo's send/recv refuse a non-contiguous tensor, and torch sizes the next
            # stage's receive buffer with this output's strides (an encoder's output after a transpose, ...).
            outputs = tuple(o.contiguous() for o in outputs)
        if torch.is_grad_enabled():
            outputs = tuple(_requiring_grad(o) for o in outputs)
            if self.encodes_side_inputs:  # torch < 2.12 sends a gradient back for every received side input
                outputs = with_zero_gradients(outputs, received)
        if self.is_last or not self.side_names:
            return outputs[0] if single else outputs
        return (*outputs, *self._sent_side_inputs(side))

    def _received_side_inputs(self, received: Sequence[Tensor]) -> dict[str, Tensor]:
        if not self.encodes_side_inputs:
            return dict(zip(self.side_names, received, strict=True))
        return {
            name: decoded_side_input(value, self.side_dtypes[name])
            for name, value in zip(self.side_names, received, strict=True)
        }

    def _sent_side_inputs(self, side: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        if not self.encodes_side_inputs:  # detached: they never require grad; contiguous: P2P sends need it
            return tuple(side[name].detach().contiguous() for name in self.side_names)
        # torch < 2.12's backward of a stage that uses `autograd.grad` (zero-bubble and V schedules) refuses an
        # output that does not require grad; the gradient it receives for one of these is discarded.
        return tuple(encoded_side_input(side[name]).requires_grad_() for name in self.side_names)


def _requiring_grad(tensor: Tensor) -> Tensor:
    # torch fixes at the first step whether each activation sent between stages requires grad. A stage whose
    # parameters are all frozen sends one that does not, the next stage then never computes the gradient for it, and
    # unfreezing later fails with "Failed to run stage backward ... Output gradient: ('None',)". Every floating
    # activation leaves a stage requiring grad, so the stages' metadata does not depend on what is trainable (a
    # frozen prefix only receives a gradient it does not use).
    if tensor.is_floating_point() and not tensor.requires_grad:
        return tensor.detach().requires_grad_()
    return tensor


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous.

    The gradient of a stage's input is sent back to the previous stage, and torch sizes that stage's receive buffer
    with its strides; gloo's send/recv refuse a non-contiguous tensor. Attention over a batch-first input transposes
    it, so the gradient of ``nn.Transformer``'s encoder output (the decoder's ``memory``) is laid out
    ``(B, T, E)`` with strides of ``(T, B, E)``: ``RuntimeError: input tensor has to be contiguous`` at the first step.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> Tensor:
        return gradient.contiguous()
