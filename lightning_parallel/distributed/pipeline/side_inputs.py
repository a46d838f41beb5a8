"""Side inputs: tensors every pipeline layer may need besides the previous layer's output (attention masks, ids).

Torch-only. A layer of ``pipeline_layers()`` gets the previous layer's output as positional arguments. Models also
pass tensors that many layers need to their blocks by keyword (``block(h, attention_mask=mask)``): the rule is

* every **tensor keyword argument** of the model call in the step (``self(tokens, attention_mask=mask)``) is a side
  input: split into micro-batches along dim 0 like the positional inputs, handed to every stage, and passed **by
  name** to each layer whose ``forward`` has a parameter of that name (or ``**kwargs``). Nothing else changes: the
  user's ``forward`` already calls the blocks that way, and the layer check compares exactly these calls.
* the stages carry the side inputs along: a stage sends them to the next one after its own outputs (detached: they
  never require grad) and the last stage drops them.
* a non-tensor keyword argument (``return_dict=False``) goes to the first layer only, as before.

Torch < 2.12 makes every tensor a stage receives require grad, which a non-floating one (a bool mask, int64 position
ids) cannot, and wants a gradient back for each (:mod:`._compat`). There the stages send every side input as a
floating tensor that requires grad (:func:`encoded_side_input`: the same bytes viewed as a float of the same size, or
exact float16 values for one-byte dtypes), the receiving stage reads it back in its own dtype
(:func:`decoded_side_input`, knowing the dtypes: every rank of a pipeline holds the same batch) and gives every
received side input a gradient of zeros (:func:`with_zero_gradients`), which the sending stage discards. Torch >=
2.12 sends them as they are.

In DeepSpeed's pipeline a mask travels inside every layer's output tuple, threaded by hand; torch's
``PipelineStage`` sends only the previous stage's outputs. This rule keeps the LightningModule unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "accepted_side_inputs",
    "call_layer",
    "decoded_side_input",
    "encoded_side_input",
    "side_input_dtypes",
    "side_input_names",
    "split_side_inputs",
    "with_zero_gradients",
]


def side_input_names(kwargs: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the tensor keyword arguments of a model call, sorted (the order stages send them in)."""
    return tuple(sorted(name for name, value in kwargs.items() if isinstance(value, Tensor)))


def side_input_dtypes(kwargs: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """``name: dtype`` of the tensor keyword arguments of a model call, in the order stages send them."""
    return {name: kwargs[name].dtype for name in side_input_names(kwargs)}


def split_side_inputs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(side inputs, the other keyword arguments)`` of a model call."""
    side = {name: kwargs[name] for name in side_input_names(kwargs)}
    return side, {name: value for name, value in kwargs.items() if name not in side}


def accepted_side_inputs(layer: nn.Module, side: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The side inputs ``layer.forward`` takes by name (all of them if it has ``**kwargs``)."""
    if not side:
        return {}
    try:
        parameters = inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):  # a builtin or C++ forward without a signature: give it nothing
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(side)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {name for name, p in parameters.items() if p.kind in keyword}
    return {name: value for name, value in side.items() if name in names}


def call_layer(
    layer: nn.Module, inputs: Sequence[Any], side: Mapping[str, Tensor], extra: Mapping[str, Any] | None = None
) -> Any:
    """``layer(*inputs, **side inputs it takes, **extra)``: how every pipeline layer is called (stages, checks)."""
    return layer(*inputs, **accepted_side_inputs(layer, side), **(extra or {}))


_SAME_SIZE_FLOATS = {2: torch.float16, 4: torch.float32, 8: torch.float64}


def encoded_side_input(value: Tensor) -> Tensor:
    """``value`` detached and contiguous, as a tensor that can require grad: a floating or complex one as it is, an
    integer one of 2, 4 or 8 bytes viewed as the float of its size (the same bytes), a one-byte one (bool, int8,
    uint8) converted to float16 (exact). :func:`decoded_side_input` reads it back."""
    value = value.detach().contiguous()
    if value.is_floating_point() or value.is_complex():
        return value
    same_size = _SAME_SIZE_FLOATS.get(value.element_size())
    return value.view(same_size) if same_size is not None else value.to(torch.float16)


def decoded_side_input(value: Tensor, dtype: torch.dtype) -> Tensor:
    """The side input of ``dtype`` that :func:`encoded_side_input` turned into ``value`` (detached unless
    ``value`` is already of ``dtype``)."""
    if value.dtype == dtype:
        return value
    value = value.detach()
    return value.view(dtype) if value.element_size() == dtype.itemsize else value.to(dtype)


def with_zero_gradients(outputs: tuple[Tensor, ...], received: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``outputs`` unchanged, those that require grad tied to ``received`` so that the backward from any of them
    gives each tensor of ``received`` that requires grad a gradient of zeros (what torch < 2.12 sends back for a
    side input whether or not the stage's layers used it)."""
    if not any(r.requires_grad for r in received):
        return outputs
    return tuple(_ZeroGradients.apply(o, *received) if o.requires_grad else o for o in outputs)


class _ZeroGradients(torch.autograd.Function):
    """``output`` unchanged; in backward its gradient passes through and each further input gets zeros."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, *received: Tensor) -> Tensor:
        ctx.received = [(r.shape, r.dtype, r.device) for r in received]
        return output.detach()  # the same storage, not a view: torch's split backward detaches outputs in place

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor, ...]:
        zeros = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.received)
        return (gradient, *zeros)
