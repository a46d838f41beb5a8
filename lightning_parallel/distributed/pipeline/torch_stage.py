"""torch's ``PipelineStage``, made to leave no trace of its metadata inference and to report what it runs.

Torch-only. :class:`SideEffectFreePipelineStage` is the stage class :func:`.torch_schedule.build_torch_schedule`
builds; :data:`ChunkObserver` and :data:`P2PObserver` are the callbacks it reports each chunk and P2P op to.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.accounting import tensor_bytes
from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.side_effects import preserved_state

__all__ = ["ChunkObserver", "P2PObserver", "SideEffectFreePipelineStage"]


ChunkObserver = Callable[[str, int], AbstractContextManager[Any]]
"""``fn(kind, stage_index)``: a context the stage runs one ``"F"``/``"B"``/``"W"`` chunk in (the observer marks its
start and end with its own clock: CUDA events on a GPU, where the host's clock would time kernel launches)."""

P2PObserver = Callable[[str, int], None]
"""``fn("send" | "recv", num_bytes)``: a stage handed the schedule one P2P op of ``num_bytes`` to send or receive."""


class SideEffectFreePipelineStage(PipelineStage):
    """``PipelineStage`` whose metadata inference leaves the stage's buffers and the RNG streams as they were, and
    which reports the time of every chunk it runs to :attr:`on_chunk` and every P2P op it sends or receives to
    :attr:`on_p2p`.

    torch infers shapes by running each stage's forward once more before the first micro-batch: the first stage on
    micro-batch 0, the others on uninitialised tensors. In training mode that updated BatchNorm's running statistics
    with garbage on the later stages and ``num_batches_tracked`` one too high (issue 10, item 7). torch has no public
    hook around that run, so this fixed class overrides the private method that runs it, whose name depends on the
    torch version (:func:`._compat.stage_inference_method`); the other name passes through unchanged. (Recent torch's
    static mode, every stage's ``input_args``/``output_args`` given up front, would skip the run: it needs each
    stage's shapes for every batch shape before its first step.)

    Chunk times (a monitor's busy time and timeline) come from overriding the schedule-facing methods that run one
    micro-batch (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``): every torch schedule
    drives a stage through them. P2P bytes come from the methods that build the activations' and gradients' send and
    receive ops (``get_{fwd,bwd}_{send,recv}_ops``), which the schedules hand to ``batch_isend_irecv`` as they are:
    each op's tensor is what is sent or received (torch's one-off neighbour warm-up at the first step is not counted).
    """

    on_chunk: ChunkObserver | None = None
    """Runs each chunk inside ``on_chunk(kind, stage_index)``; ``None``: nothing is timed."""
    on_p2p: P2PObserver | None = None
    """Told the kind and bytes of each P2P op; ``None``: nothing is counted."""

    def get_fwd_send_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("send", super().get_fwd_send_ops(*args, **kwargs))

    def get_bwd_send_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("send", super().get_bwd_send_ops(*args, **kwargs))

    def get_fwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("recv", super().get_fwd_recv_ops(*args, **kwargs))

    def get_bwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
        return self._counted("recv", super().get_bwd_recv_ops(*args, **kwargs))

    def _counted(self, kind: str, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if self.on_p2p is not None:
            for op in ops:
                self.on_p2p(kind, tensor_bytes(op.tensor))
        return ops

    # A V schedule built without a loss (evaluation) still runs its backward actions: torch skips each one's compute
    # and P2P ops (``has_backward`` is false), but hands the input gradient of the stage that follows on the same rank
    # (stages p-1 and p share the V's tip) to its neighbour unconditionally, which raises without a backward. With
    # nothing to hand over, these two pass nothing.
    def get_local_bwd_output(self, mb_index: int) -> Any:
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if not self.has_backward:
            return
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    # torch <= 2.11 warms up the P2P channels to both neighbouring stages at the first step, also to a neighbour on
    # this same rank (a V placement's tip: stages p-1 and p), which gloo refuses ("Pair is not connected"; the
    # ZBVZeroBubble and DualPipeV schedules failed at their first step). Same-rank stages hand tensors over locally,
    # so their warm-up is dropped; later torch replaced this warm-up by a vote that skips them.
    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if _compat.p2p_peer(op) != self.group_rank]

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("F", super().forward_one_chunk, args, kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("B", super().backward_one_chunk, args, kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("W", super().backward_weight_one_chunk, args, kwargs)

    def _observed(self, kind: str, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        observer = self.on_chunk
        if observer is None:
            return run(*args, **kwargs)
        with observer(kind, self.stage_index):
            return run(*args, **kwargs)

    def _compute_outputs(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference("_compute_outputs", args, kwargs)

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference("_shape_inference", args, kwargs)

    def _run_inference(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inference = getattr(super(), name)
        if name != _compat.stage_inference_method(PipelineStage):
            return inference(*args, **kwargs)
        with preserved_state(self.submod, devices=[self.device]):
            return inference(*args, **kwargs)
