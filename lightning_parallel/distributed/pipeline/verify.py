"""Checks that run before the first step, on every rank and without communication.

* :func:`check_layers_compose_to_forward`: ``pipeline_layers()`` applied in order must be ``forward``; a layer list
  that forgets a residual connection would otherwise train a different model without a word.
* :func:`check_single_evaluation_optimizers`: an optimizer that re-evaluates the loss inside ``step(closure)``
  (LBFGS' line search) cannot run under a pipeline, whose schedule runs forward and backward once per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.layer_costs import check_layer_output
from lightning_parallel.distributed.pipeline.side_effects import preserved_state
from lightning_parallel.distributed.pipeline.side_inputs import accepted_side_inputs, split_side_inputs

__all__ = ["check_layers_compose_to_forward", "check_single_evaluation_optimizers", "closure_evaluated_twice"]

_REEVALUATING_OPTIMIZERS: tuple[type, ...] = (torch.optim.LBFGS,)

_FIX = (
    " `forward` must be exactly the layers applied in order, each to the previous one's output (a residual"
    " connection, reshape or extra argument between layers belongs inside a layer; a tensor passed to the model by"
    " keyword, such as `attention_mask=`, is given by that name to every layer whose forward takes it); otherwise"
    " the pipeline trains a different model. Fix `pipeline_layers()`, or pass `verify_layers=False` to"
    " PipelineParallelStrategy to skip this check."
)


def check_layers_compose_to_forward(
    module: nn.Module,
    layers: Sequence[nn.Module],
    example: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    reference: Callable[..., Any] | None = None,
) -> None:
    """Run ``module(*example)`` and the chain of ``layers`` on the same inputs and compare them, layer by layer.

    Forward pre-hooks record the input each layer receives in ``forward``; the chain feeds each layer the previous
    layer's output. The first layer whose two inputs differ is where ``forward`` does something the layers do not.
    Runs under ``torch.no_grad()`` with the module's buffers (BatchNorm statistics) and the RNG streams restored
    afterwards, and both runs start from the same buffers and RNG state (dropout draws the same numbers). A layer
    that ``forward`` never calls (a reshape written inline in ``forward``) is not compared; its effect shows in the
    next compared input or in the output. Cost: two forward passes of the whole model on one batch, holding the
    input of every layer once. ``reference`` computes ``forward``'s result from the example (default: ``module``
    itself; a model that declares its split: its own call, whose blocks the layers wrap, so only outputs compare).

    Raises:
        ValueError: Naming the first pipeline layer whose input differs, or the output if only it differs.
    """
    args, kwargs = example
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    args, kwargs = _to(args, device), _to(kwargs, device)
    names = {id(m): name for name, m in module.named_modules() if name}
    with torch.no_grad(), preserved_state(module, devices=[device]):
        with preserved_state(module, devices=[device]):
            recorded, expected = _run_forward(reference or module, layers, args, kwargs)
        side, extra = split_side_inputs(kwargs)
        current: tuple[tuple[Any, ...], dict[str, Any]] = (
            tuple(args),
            {**accepted_side_inputs(layers[0], side), **extra},
        )
        for index, layer in enumerate(layers):
            label = f"pipeline layer {index} (`{type(layer).__name__}`{_named(names, layer)})"
            if index in recorded:
                difference = _difference(current, recorded[index], rtol, atol, signature=_signature_of(layer))
                if difference is not None:
                    source = "the batch" if index == 0 else f"the output of layer {index - 1}"
                    raise ValueError(
                        f"`pipeline_layers()` of `{type(module).__name__}` does not compose to `forward`: on the"
                        f" first batch, {label} receives a different input in `forward` than {source} in the chain"
                        f" of layers ({difference}).{_FIX}"
                    )
            try:
                output = layer(*current[0], **current[1])
            except Exception as error:
                raise ValueError(
                    f"`pipeline_layers()` of `{type(module).__name__}` does not compose to `forward`: calling {label}"
                    f" on the output of the previous layer failed with {type(error).__name__}: {error}.{_FIX}"
                ) from error
            following = layers[index + 1] if index + 1 < len(layers) else None
            current = (
                check_layer_output(index, layer, output),
                accepted_side_inputs(following, side) if following else {},
            )
    current = (current[0], {})
    difference = _difference(current, ((expected if isinstance(expected, tuple) else (expected,)), {}), rtol, atol)
    if difference is not None:
        raise ValueError(
            f"`pipeline_layers()` of `{type(module).__name__}` does not compose to `forward`: on the first batch,"
            f" the output of the last pipeline layer ({len(layers) - 1}) differs from `forward`'s output"
            f" ({difference}); `forward` does something after the last layer.{_FIX}"
        )


def _run_forward(
    forward: Callable[..., Any], layers: Sequence[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[int, tuple[tuple[Any, ...], dict[str, Any]]], Any]:
    """``forward(*args, **kwargs)``, and a copy of the first input every layer received during it."""
    recorded: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def recorder(index: int) -> Any:
        def hook(_: nn.Module, hook_args: tuple[Any, ...], hook_kwargs: dict[str, Any]) -> None:
            if index not in recorded:  # copies: a layer may change its input in place (ReLU(inplace=True))
                recorded[index] = (_clone(hook_args), _clone(hook_kwargs))

        return hook

    handles = [layer.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        expected = forward(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return recorded, expected


def _difference(
    actual: tuple[tuple[Any, ...], dict[str, Any]],
    expected: tuple[tuple[Any, ...], dict[str, Any]],
    rtol: float,
    atol: float,
    *,
    signature: inspect.Signature | None = None,
) -> str | None:
    """``None`` if both calls pass the same arguments, else a short description of the first difference.

    With the layer's ``signature`` both calls are bound to it first, defaults filled in, so a tensor passed by
    keyword in ``forward`` (``self.embeddings(input_ids=ids)``, as Hugging Face models call their modules) matches
    the same tensor passed positionally by the chain, and an argument ``forward`` spells out at its default value
    (``token_type_ids=None``) matches one the chain leaves out. Calls the signature cannot bind are compared as
    written: positional arguments by position, keyword arguments by name.
    """
    pairs = _bound_pairs(actual, expected, signature) if signature is not None else None
    if pairs is None:
        (args, kwargs), (expected_args, expected_kwargs) = actual, expected
        if len(args) != len(expected_args):
            return f"{len(args)} positional arguments against {len(expected_args)} in `forward`"
        if set(kwargs) != set(expected_kwargs):
            return f"keyword arguments {sorted(kwargs)} against {sorted(expected_kwargs)} in `forward`"
        pairs = [
            *((f"positional argument {i}", v, r) for i, (v, r) in enumerate(zip(args, expected_args, strict=True))),
            *((f"argument `{k}`", kwargs[k], expected_kwargs[k]) for k in kwargs),
        ]
    elif isinstance(pairs, str):
        return pairs
    for label, value, reference in pairs:
        if isinstance(value, Tensor) and isinstance(reference, Tensor):
            if value.shape != reference.shape:
                return f"{label}: shape {tuple(value.shape)} against {tuple(reference.shape)} in `forward`"
            if not _close(value, reference, rtol, atol):
                return f"{label}: largest absolute difference {_largest_gap(value, reference):.3g}"
        elif isinstance(value, Tensor) or isinstance(reference, Tensor):
            return f"{label}: a {type(value).__name__} against a {type(reference).__name__} in `forward`"
    return None


def _signature_of(layer: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(layer.forward)
    except (TypeError, ValueError):  # a forward without an inspectable signature (a builtin): compared as written
        return None


def _bound_pairs(
    actual: tuple[tuple[Any, ...], dict[str, Any]],
    expected: tuple[tuple[Any, ...], dict[str, Any]],
    signature: inspect.Signature,
) -> list[tuple[str, Any, Any]] | str | None:
    """``(label, chain's value, forward's value)`` for every parameter of ``signature``, both calls bound to it; a
    description of the difference if only one call binds or they fill different ``**kwargs`` names; ``None`` if
    neither binds."""
    bound, reference = _bind(signature, *actual), _bind(signature, *expected)
    if bound is None and reference is None:
        return None
    if bound is None or reference is None:
        failed = "the chain's call" if bound is None else "the call in `forward`"
        return f"{failed} does not match the signature of its `forward`"
    if bound.keys() != reference.keys():
        return f"arguments {sorted(bound)} against {sorted(reference)} in `forward`"
    return [(f"argument `{name}`", bound[name], reference[name]) for name in bound]


def _bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of the call by parameter name, defaults included (``*args`` as ``name[i]``, ``**kwargs``
    flattened without its ``None`` values: Hugging Face blocks get ``position_ids=None`` there); ``None`` if the call
    does not fit the signature."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            arguments.update((f"{name}[{i}]", item) for i, item in enumerate(value))
        elif kind is inspect.Parameter.VAR_KEYWORD:  # `None` there as absent: the default of a named parameter
            arguments.update((key, item) for key, item in value.items() if item is not None)
        else:
            arguments[name] = value
    return arguments


_CHUNK = 1 << 20
"""Elements compared at a time: the comparison runs in float64, and a whole model output in float64 (a language
model's logits: batch x sequence x vocabulary) would cost several times the output's size at the peak of set-up."""


def _chunks(value: Tensor, reference: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    return zip(value.detach().reshape(-1).split(_CHUNK), reference.detach().reshape(-1).split(_CHUNK), strict=True)


def _close(value: Tensor, reference: Tensor, rtol: float, atol: float) -> bool:
    if not (value.is_floating_point() or value.is_complex()):
        return bool(torch.equal(value, reference))
    if not reference.numel():
        return True
    scale = max(1.0, max(float(r.abs().max()) for _, r in _chunks(value, reference)))
    return all(
        torch.allclose(v.double(), r.double(), rtol=rtol, atol=atol * scale, equal_nan=True)
        for v, r in _chunks(value, reference)
    )


def _largest_gap(value: Tensor, reference: Tensor) -> float:
    return max(float((v.double() - r.double()).abs().max()) for v, r in _chunks(value, reference))


def _named(names: dict[int, str], layer: nn.Module) -> str:
    return f", `{names[id(layer)]}`" if id(layer) in names else ""


def _clone(value: Any) -> Any:
    """``value`` with every tensor detached and copied; tuples, namedtuples, lists and mappings keep their type."""
    return apply_to_collection(value, Tensor, lambda t: t.detach().clone())


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor on ``device``; tuples, namedtuples, lists and mappings keep their type."""
    return apply_to_collection(value, Tensor, lambda t: t.to(device))


def check_single_evaluation_optimizers(optimizers: Sequence[Any]) -> None:
    """Refuse optimizers known to call the closure more than once per ``step`` (LBFGS).

    Raises:
        ValueError: Naming the optimizer and the alternatives.
    """
    for optimizer in optimizers:
        if isinstance(optimizer, _REEVALUATING_OPTIMIZERS):
            raise ValueError(_reevaluation_message(type(optimizer).__name__))


def closure_evaluated_twice(optimizer: Any) -> RuntimeError:
    """The error for an optimizer that called the closure a second time within one ``step`` (found at run time)."""
    return RuntimeError(_reevaluation_message(type(optimizer).__name__))


def _reevaluation_message(name: str) -> str:
    return (
        f"`{name}` re-evaluates the loss by calling the closure more than once inside `step()` (a line search),"
        " which PipelineParallelStrategy cannot do: the pipeline schedule runs forward and backward of every"
        " micro-batch once per step, inside `training_step`, so a second evaluation would silently reuse the first"
        " one's gradients. Use an optimizer that steps once per gradient (SGD, Adam, AdamW, ...), or train with"
        f" `{name}` on one device or with data parallelism."
    )
