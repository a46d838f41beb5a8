"""Every private torch name the pipeline building blocks use, in one place for version bumps.

Torch only: the Lightning privates the pipeline strategy needs (optimizer parsing, the loop's data source, the
layer-sync flag) are in :mod:`lightning_parallel._compat`, so this package imports no Lightning.

* ``schedule._stage_backward_initialized`` / ``_stages_backward_initialized`` (torch): whether a schedule finished
  its metadata inference, which calls the loss function once on an uninitialised dummy output; the only way to tell
  that call from the real per-micro-batch ones (checked with torch 2.11 and 2.13).
* ``PipelineStage._compute_outputs`` (torch >= 2.12) / ``_shape_inference`` (earlier): the methods that run a stage's
  forward for metadata inference only; wrapped so that run leaves no trace in buffers (BatchNorm statistics) or RNG.
  If neither exists we refuse to build stages rather than silently update BatchNorm statistics twice.
* ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` and
  ``get_{fwd,bwd}_{send,recv}_ops``: public names of ``PipelineStage`` defined on its private base
  ``_PipelineStageBase``, through which every schedule runs a micro-batch and builds its P2P ops;
  ``SideEffectFreePipelineStage`` overrides them (calling torch's) to time chunks and count P2P bytes. Likewise
  ``get_local_bwd_output`` / ``set_local_bwd_input`` (how torch's runtime hands an input gradient between two stages
  of one rank, the tip of a V): overridden to pass nothing when the schedule runs without backward (evaluation under
  a V schedule), where torch's would raise.
* ``_get_init_p2p_neighbors_ops`` (torch <= 2.11's P2P warm-up, overridden by ``SideEffectFreePipelineStage`` to
  drop a same-rank neighbour) and :func:`p2p_peer`, the group rank a ``P2POp`` talks to (``group_peer`` since torch
  2.6, ``peer`` a global rank before).
* Receive buffers: torch <= 2.11 makes every tensor a stage receives require grad, which an integer tensor cannot
  (``RuntimeError: only Tensors of floating point dtype can require gradients`` at the first step), and expects a
  gradient back for each (``get_bwd_send_ops`` raises on a ``None`` one); torch >= 2.12 does both for floating
  tensors only. Where :func:`every_received_tensor_requires_grad`, the stages send the model call's side inputs
  encoded as floating tensors that require grad and give each received one a gradient of zeros
  (:mod:`.side_inputs`); a layer's own non-floating output sent to the next stage still fails there.
* Metadata inference answered locally (the planner's dry run, :func:`local_metadata_inference`): torch >= 2.12 sends
  ``_StageForwardMeta`` / ``_StageBackwardMeta`` (``torch.distributed.pipelining._utils``) through
  ``PipelineStage._recv_meta`` / ``_send_meta`` and votes on static metadata (``_warmup_forward_vote`` /
  ``_warmup_backward_result``); torch 2.11 sends each stage's outputs as meta tensors with
  ``dist.send_object_list`` / ``recv_object_list`` inside ``PipelineStage._shape_inference``.
* ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): :mod:`.flops` counts a layer's FLOPs with fake stand-ins
  for its parameters (shapes without memory that report their real device), as torch's own ``FlopCounterMode`` tests
  and ``torch.export`` do.
* ``pipeline_order_with_comms``, ``_comp_type_to_function_map`` and ``_ComputationType`` / ``_Action`` (torch's
  runtime of multi-stage schedules, ``schedules._PipelineScheduleRuntime``): :func:`send_between_overlapped_actions`
  rewrites a rank's action list so that an overlapped forward/backward pair (DualPipeV's ``OVERLAP_F_B``, which the
  runtime runs as its two actions one after the other) sends its forward's output before its backward runs, not
  after both (checked with torch 2.11 and 2.13).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import _utils as pipelining_utils
from torch.utils._pytree import tree_map_only

__all__ = [
    "FakeTensorMode",
    "every_received_tensor_requires_grad",
    "local_metadata_inference",
    "p2p_peer",
    "schedule_backward_initialized",
    "send_between_overlapped_actions",
    "stage_inference_method",
]

_STAGE_INFERENCE_METHODS = ("_compute_outputs", "_shape_inference")


def schedule_backward_initialized(schedule: Any) -> bool:
    """Whether torch's ``schedule`` has finished its backward metadata inference."""
    flag = getattr(schedule, "_stage_backward_initialized", None)  # PipelineScheduleSingle
    if flag is None:
        flag = getattr(schedule, "_stages_backward_initialized", False)  # PipelineScheduleMulti
    return bool(flag)


def stage_inference_method(stage_class: type) -> str:
    """The name of the method of torch's ``PipelineStage`` that runs the stage's forward for metadata inference.

    Raises:
        RuntimeError: If this torch has none of the known ones.
    """
    for name in _STAGE_INFERENCE_METHODS:
        if callable(getattr(stage_class, name, None)):
            return name
    raise RuntimeError(
        f"This torch ({torch.__version__}) has none of `PipelineStage.{'` / `'.join(_STAGE_INFERENCE_METHODS)}`, which"
        " lightning_parallel wraps so that torch's shape inference leaves BatchNorm statistics alone. Use a torch"
        " version this package supports, or report it."
    )


def every_received_tensor_requires_grad() -> bool:
    """Whether this torch (< 2.12) makes every tensor a stage receives require grad and wants a gradient back for
    each, rather than only for the floating ones (torch's ``_prepare_forward_infra`` and ``get_bwd_send_ops``)."""
    return torch.__version__ < "2.12"


def p2p_peer(op: dist.P2POp) -> int | None:
    """The rank in ``op.group`` that ``op`` sends to or receives from."""
    return getattr(op, "group_peer", None)


Replacement = tuple[Any, str, Any]
"""``(owner, attribute name, value)``: set for the length of a dry run, then restored."""


def local_metadata_inference(stage_outputs: Callable[[int], tuple[Any, ...]]) -> list[Replacement]:
    """What answers torch's metadata inference without messages, for this torch version.

    ``stage_outputs(i)`` returns stage ``i``'s outputs (fake tensors, ``requires_grad`` as in training): what stage
    ``i + 1`` receives, and the shapes of the gradients stage ``i`` receives back. Every rank can compute them, so
    nothing is sent: the fake process group of the planner's dry run carries no objects.
    """
    if hasattr(PipelineStage, "_recv_meta"):  # torch >= 2.12
        return _meta_message_answers(stage_outputs)
    return _object_list_answers(stage_outputs)  # torch 2.11


def _meta_message_answers(stage_outputs: Callable[[int], tuple[Any, ...]]) -> list[Replacement]:
    def recv_meta(stage: PipelineStage, src_stage: int) -> Any:
        metas: Any
        if src_stage < stage.stage_index:
            metas = pipelining_utils.extract_tensor_metas(stage_outputs(src_stage))
            return pipelining_utils._StageForwardMeta(forward_metas=metas)
        metas = pipelining_utils.extract_tensor_metas(stage_outputs(stage.stage_index))  # its outputs' gradients
        return pipelining_utils._StageBackwardMeta(backward_metas=metas)

    def send_meta(stage: PipelineStage, meta: Any, dst_stage: int) -> None:
        """Nothing to send: the receiving stage's answer is computed locally."""

    def dynamic_vote(stage: PipelineStage, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([0], dtype=torch.int32)  # every stage is built without metadata: dynamic

    replacements: list[Replacement] = [
        (PipelineStage, "_recv_meta", recv_meta),
        (PipelineStage, "_send_meta", send_meta),
    ]
    for name in ("_warmup_forward_vote", "_warmup_backward_result"):  # torch's static-vs-dynamic vote (>= 2.13)
        if hasattr(PipelineStage, name):
            replacements.append((PipelineStage, name, dynamic_vote))
    return replacements


def _object_list_answers(stage_outputs: Callable[[int], tuple[Any, ...]]) -> list[Replacement]:
    inferring: list[PipelineStage] = []  # the stage whose `_shape_inference` runs (the receive does not name it)
    shape_inference = getattr(PipelineStage, "_shape_inference")  # noqa: B009  (absent from newer torch's stubs)

    def traced_shape_inference(stage: PipelineStage, *args: Any, **kwargs: Any) -> Any:
        inferring.append(stage)
        try:
            return shape_inference(stage, *args, **kwargs)
        finally:
            inferring.pop()

    def recv_object_list(objects: list[Any], *args: Any, **kwargs: Any) -> None:
        received = stage_outputs(inferring[-1].stage_index - 1)
        objects[0] = tuple(tree_map_only(torch.Tensor, lambda t: t.to("meta"), received))

    def send_object_list(objects: list[Any], *args: Any, **kwargs: Any) -> None:
        """Nothing to send: the receiving stage's answer is computed locally."""

    return [
        (PipelineStage, "_shape_inference", traced_shape_inference),
        (dist, "recv_object_list", recv_object_list),
        (dist, "send_object_list", send_object_list),
    ]


def send_between_overlapped_actions(schedule: Any) -> None:
    """Run each overlapped forward/backward pair of ``schedule``'s action lists (DualPipeV's ``OVERLAP_F_B``) as its
    forward, the forward's send, its backward, the backward's send.

    torch's runtime runs such a pair as its two actions one after the other (no overlap unless a function is
    registered for the pair: then nothing is changed) and issues the pair's sends after both, so the next rank, whose
    next forward needs the pair's forward output, waited for the pair's backward too (on 2 CPU ranks DualPipeV's
    measured bubble was 1.5-1.9x the plan played with the run's own chunk times). Same compute in the same order; each
    send issued as soon as its chunk is done, as for every action outside a pair. A schedule without a runtime action
    list is left alone.
    """
    from torch.distributed.pipelining import schedules

    kinds = schedules._ComputationType
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order or kinds.OVERLAP_F_B in getattr(schedule, "_comp_type_to_function_map", {}):
        return
    send_of = {kinds.FORWARD: kinds.SEND_F, kinds.FULL_BACKWARD: kinds.SEND_B, kinds.BACKWARD_INPUT: kinds.SEND_B}

    def key(action: Any) -> tuple[Any, int, int | None]:
        return action.computation_type, action.stage_index, action.microbatch_index

    for rank, actions in order.items():
        sends = {key(a): a for a in actions if a is not None and a.computation_type in (kinds.SEND_F, kinds.SEND_B)}
        moved: set[tuple[Any, int, int | None]] = set()
        rewritten: list[Any] = []
        for action in actions:
            if action is None or action.computation_type != kinds.OVERLAP_F_B or action.sub_actions is None:
                if action is None or key(action) not in moved:
                    rewritten.append(action)
                continue
            for sub in action.sub_actions:
                rewritten.append(sub)
                wanted = (send_of.get(sub.computation_type), sub.stage_index, sub.microbatch_index)
                if wanted in sends:
                    rewritten.append(sends[wanted])
                    moved.add(wanted)
        order[rank] = rewritten
