"""The module torch's ``PipelineStage`` runs: the layers of one stage applied in order, side inputs passed along."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.side_inputs import (
    call_layer,
    decoded_side_input,
    encoded_side_input,
    split_side_inputs,
    with_zero_gradients,
)

__all__ = ["StageModule"]


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
