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

In DeepSpeed's pipeline a mask travels inside every layer's output tuple, threaded by hand; torch's
``PipelineStage`` sends only the previous stage's outputs. This rule keeps the LightningModule unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["accepted_side_inputs", "call_layer", "side_input_names", "split_side_inputs"]


def side_input_names(kwargs: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the tensor keyword arguments of a model call, sorted (the order stages send them in)."""
    return tuple(sorted(name for name, value in kwargs.items() if isinstance(value, Tensor)))


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
