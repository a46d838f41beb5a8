"""Pipeline parallelism building blocks on ``torch.distributed.pipelining``, importable without a Trainer.

* :mod:`.partition`: ``pipeline_layers()`` -> balanced contiguous stages; keep only the local stages' layers.
* :mod:`.schedule`: schedule names and constraints, the ``data x pipeline`` rank layout, torch stages/schedules.
* :mod:`.microbatch`: splitting batches into micro-batches, padding evaluation batches.
* :mod:`.contract`: running a LightningModule's own step with ``self(...)`` answered by the pipeline.
* :mod:`.consolidate`: stage state <-> the single-device (consolidated) checkpoint layout.
"""

from lightning_parallel.distributed.pipeline.consolidate import (
    consolidate_optimizer_state,
    consolidate_state_dict,
    optimizer_layout,
    optimizer_state_bytes,
    slice_optimizer_state,
    state_dict_bytes,
)
from lightning_parallel.distributed.pipeline.contract import ContractError
from lightning_parallel.distributed.pipeline.partition import (
    RemoteLayer,
    StagePlan,
    balanced_boundaries,
    layer_compute_costs,
    layer_parameter_costs,
    plan_for_example,
    plan_stages,
    resolve_pipeline_layers,
)
from lightning_parallel.distributed.pipeline.schedule import (
    SCHEDULES,
    ParallelDims,
    PipelineRuntime,
    build_runtime,
    resolve_schedule,
    validate_schedule_config,
)

__all__ = [
    "SCHEDULES",
    "ContractError",
    "ParallelDims",
    "PipelineRuntime",
    "RemoteLayer",
    "StagePlan",
    "balanced_boundaries",
    "build_runtime",
    "consolidate_optimizer_state",
    "consolidate_state_dict",
    "layer_compute_costs",
    "layer_parameter_costs",
    "optimizer_layout",
    "optimizer_state_bytes",
    "plan_for_example",
    "plan_stages",
    "resolve_pipeline_layers",
    "resolve_schedule",
    "slice_optimizer_state",
    "state_dict_bytes",
    "validate_schedule_config",
]
