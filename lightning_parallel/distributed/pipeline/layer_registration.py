"""A model's pipeline layers and where each is registered in it: what a split takes out of a rank and puts back.

Torch-only. :func:`resolve_pipeline_layers` checks what ``pipeline_layers()`` returns; :func:`layer_registrations`
finds every name under which a layer's modules (and the tensors it holds itself) sit in the model;
:func:`remove_remote_layers` replaces those of other ranks' layers by :class:`~.remote_layer.RemoteLayer`
placeholders (:meth:`Registration.place` puts them back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.layer_costs import layer_parameter_costs
from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer

if TYPE_CHECKING:
    from lightning_parallel.distributed.pipeline.stage_plan import StagePlan

__all__ = [
    "Registration",
    "check_parameter_ownership",
    "layer_registrations",
    "local_module_ids",
    "remove_remote_layers",
    "resolve_pipeline_layers",
]


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
