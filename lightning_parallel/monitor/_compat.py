"""Every private torch name the monitor wraps, in one place for version bumps (checked with torch 2.13).

* ``torch.distributed.pipelining.schedules._batch_p2p``: every schedule sends and receives activations and
  gradients through it (a list of ``P2POp``); ``_wait_batch_p2p`` waits for them. The monitor counts the bytes of
  the ops and times the waits.
* ``torch.distributed.pipelining.stage._PipelineStageBase``: ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk`` run one micro-batch of a stage; their time is the stage's busy time.
* FSDP2 issues its collectives through the public ``torch.distributed.all_gather_single`` /
  ``reduce_scatter_single`` (torch >= 2.12) or ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (older).
"""

from __future__ import annotations

from types import ModuleType

import torch.distributed as dist
from torch.distributed.pipelining import schedules as pipeline_schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["FSDP_COLLECTIVES", "PIPELINE_STAGE_CLASS", "PIPELINE_STAGE_METHODS", "fsdp_collective_names", "schedules"]

schedules: ModuleType = pipeline_schedules
PIPELINE_STAGE_CLASS = _PipelineStageBase
PIPELINE_STAGE_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

FSDP_COLLECTIVES = {
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


def fsdp_collective_names() -> dict[str, str]:
    """The ``torch.distributed`` functions FSDP2 calls in this torch version, mapped to our collective names."""
    preferred = [name for name in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, name)]
    if len(preferred) == 2:
        return {name: FSDP_COLLECTIVES[name] for name in preferred}
    return {name: FSDP_COLLECTIVES[name] for name in ("all_gather_into_tensor", "reduce_scatter_tensor")}
