"""Counting a pipeline layer's forward FLOPs without running it: its parameters, and what they touch, are fake.

Torch-only. ``partition="compute"`` needs each layer's FLOPs for an example batch, on every rank, at no memory cost.
Moving a copy of the layer to ``meta`` (``copy.deepcopy(layer).to("meta")``) moves only parameters and buffers: a
module that caches a plain tensor attribute (Lightning's demo ``PositionalEncoding.pe``, created at its first
forward) then mixes a CPU tensor with ``meta`` activations and torch refuses the op. Running the whole forward under
torch's ``FakeTensorMode`` accepts such tensors, but it also fakes the small tensors a forward builds to decide what
to do (``nn.TransformerDecoder`` compares its mask with a causal one, ``bool((mask == causal).all())``; Hugging Face
checks whether a padding mask masks anything), and a fake tensor has no values to read.

So here only what derives from the parameters is fake: the layer is called through ``torch.func.functional_call``
with fake stand-ins for its parameters and buffers (no copy of the layer), made by one ``FakeTensorMode`` with
``allow_non_fake_inputs=True`` and *not* entered. An op that touches a fake tensor runs in that mode (shapes only,
real tensors it meets are taken in); every other op runs for real. So the example inputs, side inputs (masks),
cached attributes and tensors the forward builds from them (``torch.arange(T, device=x.device)``: a fake tensor
reports its real device) stay real, and control flow on them works as in a real forward. An op that reads a value
computed from the parameters (``.item()`` of an activation) fails, and the caller falls back to parameter counts.
Attributes the forward assigns (a cache built from fake activations) are put back afterwards, so the real module
never holds a fake tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from lightning_parallel.distributed.pipeline._compat import FakeTensorMode

__all__ = ["count_forward_flops", "new_fake_mode"]


def new_fake_mode() -> FakeTensorMode:
    """The mode that makes the fake stand-ins: one per chain of layers, whose fake outputs feed the next layer."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def count_forward_flops(
    layer: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None, *, fake_mode: FakeTensorMode
) -> tuple[Any, int]:
    """Call ``layer(*args, **kwargs)`` with fake parameters and buffers; return its output and its forward FLOPs.

    No gradients are recorded, the layer's parameters, buffers and attributes are left as they were, and nothing
    the size of a parameter or an activation is allocated. Tensors of the output are fake (or real, for a layer
    without parameters that only reshapes its real input); pass them on to the next layer with the same
    ``fake_mode``.

    Raises:
        Exception: Whatever the forward raises when an op reads a value computed from the parameters (a fake tensor
            has none), or when an op has no fake implementation.
    """
    tensors = [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]
    state: dict[str, Tensor] = {name: fake_mode.from_tensor(tensor) for name, tensor in tensors}
    # from_tensor remembers each tensor: tied parameters get one stand-in, so functional_call keeps them tied.
    device = next((tensor.device for _, tensor in tensors), torch.device("cpu"))
    call_args, call_kwargs = _fake_for_meta((tuple(args), dict(kwargs or {})), fake_mode, device)
    counting = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)
    with _attributes_restored(layer), torch.no_grad(), counting as counter:
        output = torch.func.functional_call(layer, state, call_args, call_kwargs)
    return output, int(counter.get_total_flops())


def _fake_for_meta(inputs: Any, fake_mode: FakeTensorMode, device: torch.device) -> Any:
    """``inputs`` with each ``meta`` tensor (a shape-only example, as the planner passes) replaced by a fake one on
    the layer's ``device``: torch 2.11's fake mode refuses to mix a ``meta`` input with fake parameters that report a
    real device (``found two different devices cpu, meta``); later torch accepts it. A meta tensor has no values, so
    nothing real is lost."""

    def fake(tensor: Tensor) -> Tensor:
        if tensor.device.type != "meta":
            return tensor
        with fake_mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)

    return tree_map_only(Tensor, fake, inputs)


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


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# torch's counter knows the CUDA attention kernels but not the CPU one that `scaled_dot_product_attention` dispatches
# to on CPU (it counts 0 there, measured with torch 2.13): a layer with attention would weigh only its projections,
# and `partition="compute"` would put too many attention blocks on one CPU stage. Count it as the CUDA kernels are.
_CPU_ATTENTION = (
    {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    else {}
)
