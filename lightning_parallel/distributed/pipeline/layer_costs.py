"""What each pipeline layer costs, the weights a split balances: parameters, forward FLOPs or measured time.

Torch-only. :func:`layer_parameter_costs` counts parameters; :func:`layer_compute_costs` counts each layer's forward
FLOPs on an example batch with fake parameters (:mod:`.flops`); :func:`measure_layer_times` times each layer's
forward and backward on the device.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.flops import count_forward_flops, new_fake_mode
from lightning_parallel.distributed.pipeline.side_inputs import accepted_side_inputs, split_side_inputs

__all__ = [
    "UncountableLayerError",
    "check_layer_output",
    "layer_compute_costs",
    "layer_parameter_costs",
    "measure_layer_times",
]


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
            raise UncountableLayerError(
                f"Could not count the FLOPs of pipeline layer {index} (`{type(layer).__name__}`) with fake (shape-only)"
                f" parameters: {type(error).__name__}: {error}"
            ) from error
        outputs = check_layer_output(index, layer, output)
        costs.append(flops + sum(o.numel() for o in outputs))
        current_args = outputs
    return costs


class UncountableLayerError(RuntimeError):
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
