"""Pipeline parallelism building blocks on ``torch.distributed.pipelining``, importable without a Trainer.

* :mod:`.partition`: ``pipeline_layers()`` -> balanced contiguous stages and the rank of each (``StagePlan``'s
  placement); keep only the local stages' layers. :mod:`.balance`: the balancing arithmetic (the first and last
  stage lightened by ``UnevenStages``, per-rank refinement where a rank holds several stages).
* :mod:`.schedule`: one descriptor per schedule (``ScheduleSpec``: torch class, stages per rank, placement, micro-batch
  rules), the ``data x pipeline`` rank layout, torch stages/schedules.
* :mod:`.microbatch`: splitting batches into micro-batches, padding evaluation batches.
* :mod:`.replica_batches`: every rank of a pipeline trains on its first rank's batch, whatever the loader does.
* :mod:`.contract`: running a LightningModule's own step with ``self(...)`` answered by the pipeline.
* :mod:`.consolidate`: stage state <-> the single-device (consolidated) checkpoint layout.
* :mod:`.verify`: checks before the first step (``pipeline_layers()`` against ``forward``, closure-re-evaluating
  optimizers).
* :mod:`.split`: the collective steps of a split (one plan on every rank, replicas from the same weights).
* :mod:`.reassemble`: the whole model back on every rank after a run.
* :mod:`.side_effects`: running a module without leaving a trace in its buffers or the RNG streams.
* :mod:`.stage_holder`: how a stage is held over its replicas: the ZeRO backend the one chooser
  (``zero/backends/choice.py``) picks for a whole model, with the pipeline's extensions.
* :mod:`.zero`: ZeRO's settings inside the pipeline and its tied copies' sum (an extension of the backend).
* :mod:`.fully_shard`: ZeRO-3's preparation step: the stage's layers as copies the backend shards (FSDP2).
* :mod:`.run`: one record of a split's state; :mod:`.checkpoint_format`: consolidated or sharded checkpoints.
"""

from lightning_parallel.distributed.pipeline.checkpoint_format import CHECKPOINT_FORMATS, CheckpointFormat
from lightning_parallel.distributed.pipeline.consolidate import (
    consolidate_optimizer_state,
    consolidate_state_dict,
    optimizer_layout,
    slice_optimizer_state,
)
from lightning_parallel.distributed.pipeline.contract import ContractError
from lightning_parallel.distributed.pipeline.fully_shard import PipelineFullyShard
from lightning_parallel.distributed.pipeline.partition import (
    PLACEMENTS,
    Placement,
    RemoteLayer,
    StagePlan,
    UnevenStages,
    balanced_boundaries,
    layer_compute_costs,
    layer_parameter_costs,
    plan_for_example,
    plan_stages,
    resolve_pipeline_layers,
)
from lightning_parallel.distributed.pipeline.random_draws import InconsistentDrawError
from lightning_parallel.distributed.pipeline.reassemble import reassemble
from lightning_parallel.distributed.pipeline.run import PipelineRun
from lightning_parallel.distributed.pipeline.schedule import (
    SCHEDULE_SPECS,
    SCHEDULES,
    ParallelDims,
    PipelineRuntime,
    ScheduleSpec,
    build_runtime,
    resolve_schedule,
    schedule_spec,
    validate_schedule_config,
)
from lightning_parallel.distributed.pipeline.stage_holder import StageHolding, hold_stage
from lightning_parallel.distributed.pipeline.verify import check_layers_compose_to_forward
from lightning_parallel.distributed.pipeline.zero import TiedCopiesSum, TiedShardSum

__all__ = [
    "CHECKPOINT_FORMATS",
    "PLACEMENTS",
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "CheckpointFormat",
    "ContractError",
    "InconsistentDrawError",
    "ParallelDims",
    "PipelineFullyShard",
    "PipelineRun",
    "PipelineRuntime",
    "Placement",
    "RemoteLayer",
    "ScheduleSpec",
    "StageHolding",
    "StagePlan",
    "TiedCopiesSum",
    "TiedShardSum",
    "UnevenStages",
    "balanced_boundaries",
    "build_runtime",
    "check_layers_compose_to_forward",
    "consolidate_optimizer_state",
    "consolidate_state_dict",
    "hold_stage",
    "layer_compute_costs",
    "layer_parameter_costs",
    "optimizer_layout",
    "plan_for_example",
    "plan_stages",
    "reassemble",
    "resolve_pipeline_layers",
    "resolve_schedule",
    "schedule_spec",
    "slice_optimizer_state",
    "validate_schedule_config",
]
