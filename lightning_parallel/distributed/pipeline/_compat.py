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
* ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): :mod:`.flops` counts a layer's FLOPs with fake stand-ins
  for its parameters (shapes without memory that report their real device), as torch's own ``FlopCounterMode`` tests
  and ``torch.export`` do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FakeTensorMode", "schedule_backward_initialized", "stage_inference_method"]

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
