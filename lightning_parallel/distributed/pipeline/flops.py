"""Counting a pipeline layer's forward FLOPs without running it: its parameters and activations on ``meta``.

Torch-only. ``partition="compute"`` needs each layer's FLOPs for an example batch, on every rank, at no memory cost.
Moving a copy of the layer to ``meta`` (``copy.deepcopy(layer).to("meta")``) moves only parameters and buffers: a
module that caches a plain tensor attribute (Lightning's demo ``PositionalEncoding.pe``, created at its first
forward) then mixes a CPU tensor with meta activations and torch refuses the op. torch's ``FakeTensorMode`` accepts
such tensors, but it also fakes the small tensors a forward builds to decide what to do (``nn.TransformerDecoder``
compares its mask with a causal one, ``bool((mask == causal).all())``), and refuses to read them.

So here only what derives from the parameters is on ``meta``: the layer is called through
``torch.func.functional_call`` with ``meta`` stand-ins for its parameters and buffers (no copy of the layer), and a
dispatch mode runs every op that mixes ``meta`` and real tensors on ``meta``. The example inputs, side inputs
(masks) and tensors the forward builds from them stay real, so control flow on them works as in a real forward;
an op that reads a value derived from the parameters (``.item()`` of an activation) fails, and the caller falls
back to parameter counts. Attributes the forward assigns (a cache built from ``meta`` activations) are put back
afterwards, so the real module never holds a ``meta`` tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.distributed.pipeline._compat import TorchDispatchMode, tree_flatten, tree_unflatten

__all__ = ["count_forward_flops"]


def count_forward_flops(
    layer: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None
) -> tuple[Any, int]:
    """Call ``layer(*args, **kwargs)`` with its parameters and buffers on ``meta``; return its output and FLOPs.

    No gradients are recorded, the layer's parameters, buffers and attributes are left as they were, and nothing
    the size of a parameter or an activation is allocated. The output's tensors are on ``meta`` (or real, for a
    layer without parameters that only reshapes its real input).

    Raises:
        Exception: Whatever the forward raises when an op reads a value computed from the parameters (there is none
            on ``meta``), or when an op has no ``meta`` implementation.
    """
    stand_ins: dict[int, Tensor] = {}

    def on_meta(tensor: Tensor) -> Tensor:
        if id(tensor) not in stand_ins:  # tied tensors keep one stand-in: functional_call keeps them tied
            stand_ins[id(tensor)] = torch.empty_like(tensor, device="meta")
        return stand_ins[id(tensor)]

    state = {name: on_meta(p) for name, p in layer.named_parameters(remove_duplicate=False)}
    state.update({name: on_meta(b) for name, b in layer.named_buffers(remove_duplicate=False)})
    with _attributes_restored(layer), torch.no_grad(), FlopCounterMode(display=False) as counter, _MetaWins():
        output = torch.func.functional_call(layer, state, tuple(args), dict(kwargs or {}))
    return output, int(counter.get_total_flops())


class _MetaWins(TorchDispatchMode):
    """Run every op that has a ``meta`` tensor argument on ``meta``: real tensor arguments follow it there.

    Entered inside ``FlopCounterMode``, so the counter sees the op with every argument on ``meta`` (and counts it).
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        flat, spec = tree_flatten((args, kwargs or {}))
        tensors = [value for value in flat if isinstance(value, Tensor)]
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            flat = [v.to("meta") if isinstance(v, Tensor) and not v.is_meta else v for v in flat]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **(kwargs or {}))


@contextmanager
def _attributes_restored(layer: nn.Module) -> Iterator[None]:
    """Put every submodule's attributes back as they were (a cache the forward created or replaced, a counter).

    Written into ``__dict__`` directly: ``nn.Module.__setattr__`` would file a tensor under buffers or parameters.
    """
    saved = [(module, dict(module.__dict__)) for module in layer.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for name in [name for name in module.__dict__ if name not in attributes]:
                del module.__dict__[name]
            for name, value in attributes.items():
                if module.__dict__.get(name, _MISSING) is not value:
                    module.__dict__[name] = value


_MISSING = object()
