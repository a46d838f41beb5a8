"""Pipeline parallelism building blocks on ``torch.distributed.pipelining``, importable without a Trainer.

* :mod:`.stage_plan`: ``pipeline_layers()`` -> balanced contiguous stages and the rank of each (``StagePlan``'s
  placement), from each layer's cost (:mod:`.layer_costs`). :mod:`.layer_registration`: where each layer sits in
  the model, and keeping only the local stages' layers (:mod:`.remote_layer`: the placeholders of the others).
  :mod:`.stage_module`: the module torch's stage runs. :mod:`.balance`: the balancing arithmetic (the first and last
  stage lightened by ``UnevenStages``, per-rank refinement where a rank holds several stages).
* :mod:`.schedule`: one descriptor per schedule (``ScheduleSpec``: torch class, stages per rank, placement, micro-batch
  rules). :mod:`.torch_schedule`: torch's stages and schedule built from one (:mod:`.torch_stage`: the stage class).
* :mod:`.parallel_dims`: a pipeline rank's view of the mesh (``ParallelDims``: its coordinates and process groups).
* :mod:`.microbatch`: splitting batches into micro-batches, padding evaluation batches.
* :mod:`.replica_batches`: every rank of a pipeline trains on its first rank's batch, whatever the loader does.
* :mod:`.contract`: running a LightningModule's own step with ``self(...)`` answered by the pipeline.
* :mod:`.consolidate`: stage state <-> the single-device (consolidated) checkpoint layout.
* :mod:`.verify`: checks before the first step (``pipeline_layers()`` against ``forward``, closure-re-evaluating
  optimizers).
* :mod:`.stage_split`: the whole split, usable from a plain torch loop; :mod:`.plan_agreement`: its collective
  planning step (one stage plan on every rank).
* :mod:`.reassemble`: the whole model back on every rank after a run.
* :mod:`.side_effects`: running a module without leaving a trace in its buffers or the RNG streams.
* :mod:`.stage_holder`: how a stage is held over its replicas: the ZeRO backend the one chooser
  (``zero/backends/choice.py``) picks for a whole model, with the pipeline's extensions.
* :mod:`.zero`: ZeRO's settings inside the pipeline and its tied copies' sum (an extension of the backend).
* :mod:`.fully_shard`: ZeRO-3's preparation step: the stage's layers as copies the backend shards (FSDP2).
* :mod:`.run`: one record of a split's state; :mod:`.checkpoint_format`: consolidated or sharded checkpoints.
* Also: :mod:`.config` (``PipelineConfig``), :mod:`.engine` (one step of the user's ``*_step``), :mod:`.random_draws`,
  :mod:`.side_inputs`, :mod:`.tied`, :mod:`.transfer`, :mod:`.whole_model_view` (the whole model in a user's hook),
  :mod:`.stage_copy`, :mod:`.flops`, :mod:`.model_plan` (a Hugging Face model's declared plan); docs/architecture.md
  lists each with its job.
"""

from lightning_parallel.distributed.pipeline.balance import UnevenStages, balanced_boundaries
from lightning_parallel.distributed.pipeline.checkpoint_format import CHECKPOINT_FORMATS, CheckpointFormat
from lightning_parallel.distributed.pipeline.consolidate import (
    consolidate_optimizer_state,
    consolidate_state_dict,
    optimizer_layout,
    slice_optimizer_state,
)
from lightning_parallel.distributed.pipeline.contract import ContractError
from lightning_parallel.distributed.pipeline.fully_shard import PipelineFullyShard
from lightning_parallel.distributed.pipeline.layer_costs import layer_compute_costs, layer_parameter_costs
from lightning_parallel.distributed.pipeline.layer_registration import resolve_pipeline_layers
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.random_draws import InconsistentDrawError
from lightning_parallel.distributed.pipeline.reassemble import reassemble
from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer
from lightning_parallel.distributed.pipeline.run import PipelineRun
from lightning_parallel.distributed.pipeline.schedule import (
    PLACEMENTS,
    SCHEDULE_SPECS,
    SCHEDULES,
    Placement,
    ScheduleSpec,
    resolve_schedule,
    schedule_spec,
    validate_schedule_config,
)
from lightning_parallel.distributed.pipeline.stage_holder import StageHolding, hold_stage
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan, plan_for_example, plan_stages
from lightning_parallel.distributed.pipeline.torch_schedule import TorchSchedule, build_torch_schedule
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
    "Placement",
    "RemoteLayer",
    "ScheduleSpec",
    "StageHolding",
    "StagePlan",
    "TiedCopiesSum",
    "TiedShardSum",
    "TorchSchedule",
    "UnevenStages",
    "balanced_boundaries",
    "build_torch_schedule",
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
