"""What the planner needs to know about a model: parameter shapes, pipeline layers, FSDP2 units, transformer shape.

Built on the ``meta`` device (no memory, any size) from a registered preset name, a parameter count, a registered config
object (the demo's ``GPTConfig``), a Hugging Face config (:mod:`.hf`), a ``"package.module:Class"`` path or a module
instance, using the same functions the strategies use to split the model
(:func:`lightning_parallel.distributed.zero.stage3.fsdp_units`, the pipeline partitioner). The transformer shape comes
from the model's own hook (:mod:`.shape`).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.balance import UnevenStages
from lightning_parallel.distributed.pipeline.layer_costs import layer_compute_costs, layer_parameter_costs
from lightning_parallel.distributed.pipeline.layer_registration import resolve_pipeline_layers
from lightning_parallel.distributed.pipeline.schedule import Placement
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan, plan_for_example
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.planner.hf import decoder_config, hf_notes, read_hf_config
from lightning_parallel.planner.hf_modules import build_causal_lm
from lightning_parallel.planner.shape import (
    TransformerShape,
    build_from_config,
    preset_builder,
    preset_names,
    transformer_shape_of,
)

__all__ = ["ModelSpec", "ParamSpec", "UnitSpec", "model_spec"]


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter."""

    name: str
    shape: tuple[int, ...]
    element_size: int | None = None
    """Bytes per element in the dtype the model was built with; ``None``: unknown (the precision's)."""

    @property
    def numel(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP2 unit: the parameters it shards itself (not those of units nested in it)."""

    params: tuple[int, ...]
    """Indices into :attr:`ModelSpec.params`."""
    stays_gathered: bool
    """Kept gathered between forward and backward (gathered once a step): the LightningModule itself (FSDP2's
    root), and the model it wraps when that holds every other unit (``zero3.gathered_through_backward``); every
    other unit reshards after forward and is gathered again for backward."""


@dataclass
class ModelSpec:
    """The facts about a model the planner's arithmetic uses."""

    name: str
    params: list[ParamSpec]
    """Trainable parameters in ``named_parameters()`` order."""
    units: list[UnitSpec] | None = None
    """FSDP2 units as ``ShardedOptimizerStrategy(stage=3)`` would apply them; ``None``: unknown (one flat unit)."""
    module: nn.Module | None = None
    """The (meta) module, for the pipeline partitioner; ``None`` for a bare parameter count."""
    shape: TransformerShape | None = None
    """The transformer shape the model reports (``transformer_shape()``), for the activation estimate; ``None``:
    the model has no such hook."""
    notes: list[str] = field(default_factory=list)
    _cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False, compare=False)
    """Per-layer FLOPs and output sizes per batch shape: the same for every configuration the planner tries."""

    @property
    def num_parameters(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def has_pipeline_layers(self) -> bool:
        return self.module is not None and callable(getattr(self.module, "pipeline_layers", None))

    def example_inputs(self, batch_size: int, seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Example ``self(...)`` arguments (meta tensors): token ids ``(B, T)`` of a transformer that reports its
        shape, else ``example_input_array``."""
        if self.shape is not None:
            return self.shape.example_inputs(batch_size, seq_len), {}
        example = getattr(self.module, "example_input_array", None)
        if isinstance(example, Tensor):
            return (example.to("meta"),), {}
        if isinstance(example, tuple):
            return tuple(e.to("meta") if isinstance(e, Tensor) else e for e in example), {}
        return None

    def stage_plan(
        self,
        *,
        num_stages: int,
        pipeline_parallel_size: int,
        batch_size: int,
        seq_len: int,
        placement: Placement = "loop",
        uneven: UnevenStages | None = None,
    ) -> StagePlan:
        """The split ``PipelineParallelStrategy(partition="flops")`` makes for this batch (the same function), its
        stages laid on ranks by ``placement`` (the schedule's, ``schedule_spec(name).placement``), the first and last
        stage lightened by ``uneven``."""
        assert self.module is not None
        layers = resolve_pipeline_layers(self.module)
        example = self.example_inputs(batch_size, seq_len)
        costs = self._layer_costs(layers, example, batch_size, seq_len)
        return plan_for_example(
            layers,
            example,
            partition="flops" if costs is None else "measured",  # the FLOPs "flops" counts, counted once
            measured=costs,
            num_stages=num_stages,
            pipeline_parallel_size=pipeline_parallel_size,
            placement=placement,
            uneven=uneven,
        )

    def _layer_costs(self, layers: list[nn.Module], example: Any, batch_size: int, seq_len: int) -> list[int] | None:
        """``layer_compute_costs`` of the layers for this batch, cached; ``None`` when they cannot be counted (the
        partitioner then says why and splits by parameters)."""
        key = ("costs", batch_size, seq_len)
        if key not in self._cache:
            try:
                self._cache[key] = None if example is None else layer_compute_costs(layers, *example)
            except Exception:  # the partitioner's own call reports it
                self._cache[key] = None
        return self._cache[key]

    def layer_numels(self) -> list[int]:
        assert self.module is not None
        return layer_parameter_costs(resolve_pipeline_layers(self.module))

    def layer_output_numels(self, batch_size: int, seq_len: int) -> list[int] | None:
        """Elements of each pipeline layer's output for a batch (what a stage boundary sends), on ``meta``."""
        key = ("outputs", batch_size, seq_len)
        if key not in self._cache:
            self._cache[key] = self._layer_output_numels(batch_size, seq_len)
        return self._cache[key]

    def _layer_output_numels(self, batch_size: int, seq_len: int) -> list[int] | None:
        example = self.example_inputs(batch_size, seq_len)
        if example is None or self.module is None:
            return None
        args, kwargs = example
        sizes = []
        for layer in resolve_pipeline_layers(self.module):
            with torch.no_grad():
                output = copy.deepcopy(layer).to("meta")(*args, **kwargs)
            outputs = output if isinstance(output, tuple) else (output,)
            sizes.append(sum(o.numel() for o in outputs))
            args, kwargs = outputs, {}
        return sizes


def model_spec(model: Any) -> ModelSpec:
    """Describe ``model``: a preset name (``"tiny"``, ``"gpt-125m"``, ... registered by the demo), a parameter count
    (``int`` or a string like ``"1.3e9"``/``"350M"``), a registered config object (``GPTConfig``), a Hugging Face
    transformers config (``LlamaConfig(...)``, a local ``config.json`` or a directory holding one; see
    :mod:`.hf`), a ``"package.module:Class"`` LightningModule path (constructed without arguments on the meta device)
    or an ``nn.Module`` instance.

    Raises:
        ValueError: for a string that is neither a preset, a count, a local config nor an importable class path, and
            for a transformers config of an architecture the planner does not know (:class:`.hf.HFConfigError`).
    """
    if isinstance(model, nn.Module):
        return _from_module(type(model).__name__, model)
    if isinstance(model, int) and not isinstance(model, bool):
        return _from_count(model)
    built = build_from_config(model)
    if built is not None:
        return _from_module(type(built).__name__, built)
    if isinstance(model, str):
        count = _parse_count(model)
        if count is not None:
            return _from_count(count)
        build = preset_builder(model)
        if build is not None:
            with torch.device("meta"):
                return _from_module(model, build())
    config = read_hf_config(model)  # a transformers config, its config.json or a directory holding one
    if config is not None:
        return _from_hf_config(*config)
    if not isinstance(model, str):
        raise ValueError(
            f"`model={model!r}` is invalid: pass a preset name, a parameter count, a transformers config (or its"
            " local config.json) or a class path."
        )
    return _from_module(model, _construct(model))


def _from_module(name: str, module: nn.Module) -> ModelSpec:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    index = {id(p): i for i, (_, p) in enumerate(named)}
    units = []
    # The strategy shards the LightningModule, whose child the network is; a bare network (a GPTConfig, a plain
    # nn.Module) gets the same parent here, so its units (and which one is FSDP2's root) are the strategy's.
    holder = module
    if not isinstance(module, pl.LightningModule):
        holder = nn.Module()
        holder.add_module("model", module)
    found = zero3.fsdp_units(holder)
    gathered = zero3.gathered_through_backward(holder, found)  # as `apply_fully_shard` keeps them
    for unit in found:
        nested = {
            id(p) for other in found if other is not unit and zero3.contains(unit, other) for p in other.parameters()
        }
        own = tuple(index[id(p)] for p in unit.parameters() if id(p) not in nested and id(p) in index)
        units.append(UnitSpec(params=own, stays_gathered=any(unit is kept for kept in gathered)))
    return ModelSpec(
        name=name,
        params=[ParamSpec(n, tuple(p.shape), p.element_size()) for n, p in named],
        units=units,
        module=module,
        shape=transformer_shape_of(module),
    )


def _from_hf_config(values: dict[str, Any], origin: str) -> ModelSpec:
    layout = decoder_config(values, origin)
    with torch.device("meta"):
        spec = _from_module(f"{layout.causal_lm} ({origin})", build_causal_lm(layout))
    spec.notes += hf_notes(layout)
    return spec


def _from_count(count: int) -> ModelSpec:
    if count < 1:
        raise ValueError(f"A parameter count must be positive, got {count}.")
    return ModelSpec(
        name=f"{count:,} parameters",
        params=[ParamSpec("flat", (count,))],
        notes=[
            "A bare parameter count: one flat parameter is assumed (padding to the world size is then at most N-1"
            " elements); pipeline stages, activations and FSDP2 units are unknown. Pass a preset or a class path"
            " for exact numbers."
        ],
    )


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _parse_count(text: str) -> int | None:
    value = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1
    if value and value[-1] in _SUFFIXES:
        value, scale = value[:-1], _SUFFIXES[value[-1]]
    try:
        return int(float(value) * scale)
    except ValueError:
        return None


def _construct(path: str) -> nn.Module:
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"`model={path!r}` is not a preset ({', '.join(preset_names())}), a parameter count (e.g. '350M'), a local"
            f" config.json (or its directory) or an importable class path like 'my_package.models:MyModule' ({error})."
        ) from error
    with torch.device("meta"):
        return cls()
