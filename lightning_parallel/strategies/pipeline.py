"""PipelineParallelStrategy: pipeline model parallelism (x data parallelism) on ``torch.distributed.pipelining``.

A thin adapter: the split (``distributed/pipeline/stage_split.py``), the steps' engine, the ZeRO backend holding each
stage (the one ``ShardedOptimizerStrategy`` would pick) and the reassembly are torch-only; this class reads the
Trainer (:mod:`.pipeline_setup`) and connects the precision plugin, the hooks and the checkpoints.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.accounting import CommunicationStats, MemoryReport
from lightning_parallel.distributed.activation_checkpointing import ActivationCheckpointing
from lightning_parallel.distributed.data_shards import tell_data_parallel_rank
from lightning_parallel.distributed.mesh import MeshLayout, validate_tensor_parallel_size
from lightning_parallel.distributed.pipeline.balance import UnevenStages
from lightning_parallel.distributed.pipeline.checkpoint_format import (
    CHECKPOINT_FORMATS,
    CheckpointFormat,
    CheckpointWrite,
    whole_model_state,
)
from lightning_parallel.distributed.pipeline.config import PipelineConfig
from lightning_parallel.distributed.pipeline.contract import replay_logs
from lightning_parallel.distributed.pipeline.engine import PipelineEngine, StepOutcome
from lightning_parallel.distributed.pipeline.microbatch import check_divisible_batch, divisible_batches
from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call
from lightning_parallel.distributed.pipeline.parallel_dims import (
    ParallelDims,
    build_parallel_dims,
    pipeline_mesh_layout,
)
from lightning_parallel.distributed.pipeline.reassemble import mark_orphaned
from lightning_parallel.distributed.pipeline.replica_batches import BatchBroadcast, broadcast_batch, replica_batches
from lightning_parallel.distributed.pipeline.run import PipelineRun
from lightning_parallel.distributed.pipeline.schedule import resolve_schedule
from lightning_parallel.distributed.pipeline.stage_copy import StageCopyHolding
from lightning_parallel.distributed.pipeline.stage_plan import PartitionMethod, StagePlan
from lightning_parallel.distributed.pipeline.stage_split import (
    StageHolding,
    check_not_split,
    check_splittable,
    split_into_stages,
)
from lightning_parallel.distributed.pipeline.tied import TiedLayout
from lightning_parallel.distributed.pipeline.verify import closure_evaluated_twice
from lightning_parallel.distributed.pipeline.zero import PipelineZeroStage, pipeline_zero_config
from lightning_parallel.distributed.zero.config import (
    MasterWeights,
    OverlapParamGather,
    ZeroConfig,
    ZeroGradientCompression,
    zero_options,
)
from lightning_parallel.instrumentation import Instrumentation
from lightning_parallel.lightning_optimizer import unwrap_optimizer
from lightning_parallel.strategies import pipeline_setup
from lightning_parallel.strategies.base import LightningParallelStrategy
from lightning_parallel.strategies.batchnorm import check_layer_sync
from lightning_parallel.strategies.clipping import with_clipping
from lightning_parallel.strategies.launch import ConsolidatingLauncher, StartMethod
from lightning_parallel.strategies.options import FieldOf, base_options
from lightning_parallel.strategies.parameter_callbacks import hold_averaged_copies
from lightning_parallel.strategies.pipeline_hooks import HookWindows
from lightning_parallel.strategies.pipeline_setup import CheckpointFormatName
from lightning_parallel.strategies.tensor_parallel import check_plan_early, tensor_parallel_plan

__all__ = ["PipelineParallelStrategy"]


class PipelineParallelStrategy(LightningParallelStrategy):
    """Pipeline model parallelism for an unchanged LightningModule that adds ``pipeline_layers()``.

    The module's layers (``pipeline_layers()``: in order, each layer's output the next one's input, their composition
    equal to ``forward``) are cut into contiguous stages; each rank keeps only its stages' parameters and optimizer
    state. torch's ``PipelineStage`` and schedules move micro-batches through the stages. The user's
    ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` run unchanged on the rank with the last
    stage, once per micro-batch, with ``self(...)`` answered by the pipeline's output for that micro-batch.

    Ranks form ``world_size / pipeline_parallel_size`` data-parallel replicas of the pipeline
    (``global_rank = replica * pipeline_parallel_size + pipeline_rank``); the sampler shards data by replica, and every
    rank of a replica trains on the batch of the rank holding the first stage, whatever its loader does (each rank
    iterates its own loader; the first rank's batch is broadcast over the pipeline: ``docs/pipeline.md``, "Data").
    Gradients are averaged across the replicas of each stage.

    Semantics (``docs/pipeline.md`` has the details):

    * Gradients: each micro-batch's loss is divided by ``num_microbatches * accumulate_grad_batches`` before its
      backward, so the gradient is that of the mean loss over the batch (and the accumulation window), as on one
      device. Logged values are the mean over micro-batches (weighted by their sizes; ``reduce_fx="sum"/"max"/"min"``
      honoured); every rank logs them, so loggers on rank 0 and callbacks on all ranks see the same numbers.
    * ``gradient_clip_val`` with ``"norm"`` clips by the global norm over all stages.
    * Training batches must be divisible by ``num_microbatches``; a smaller last batch that is not is left out of the
      epoch (a warning), as ``drop_last=True`` would. Evaluation/predict batches are padded by repeating the last
      row; padded rows never reach the step.
    * Checkpoints are consolidated by default: one ``.ckpt`` with the whole model's ``state_dict`` (original names)
      and the optimizer state in the single-device layout, loadable by single-device Lightning, DataParallelStrategy,
      ShardedOptimizerStrategy, or a pipeline of another size. Saving is a collective (call it on every rank).
    * A pipeline of one rank is a single stage holding the whole model, whatever the schedule.
    * After the run the module is plain and whole again on every rank.

    Each argument at length: ``docs/pipeline.md``, "The arguments at length".

    Args:
        pipeline_parallel_size: Ranks per pipeline; ``"auto"`` uses all ranks (no data parallelism; with
            ``tensor_parallel_size=T``, the world size over ``T``).
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, or the
            V-shaped ``"ZBVZeroBubble"`` / ``"DualPipeV"`` (two stages per rank, rank ``r`` holding ``r`` and
            ``2p - 1 - r``).
        num_microbatches: Micro-batches per batch; ``"auto"`` is the number of stages (the minimum for 1F1B).
        stages_per_rank: Virtual stages per rank; ``"auto"`` is 2 for the multi-stage schedules (exactly 2 for the
            V-shaped ones), else 1.
        partition: ``"flops"`` (forward FLOPs of an example batch; ``"compute"`` is its older name), ``"measured"``
            (timed on rank 0), ``"parameters"``, or a list with the first layer index of every stage but the first.
            Where a rank holds several stages, the automatic split balances the ranks (the sums of their stages).
        first_stage_fewer_layers: Lighten the first stage of an automatic partition by this many layers' worth
            (balanced as if it also held that many more layers of the median layer's cost; with uniform blocks it
            holds that many fewer), e.g. for the 1F1B warm-up's activations on the first rank. ``0``: even.
        last_stage_fewer_layers: The same for the last stage (the head, its loss and its optimizer state).
        verify_layers: Check on the first batch that ``pipeline_layers()`` applied in order gives ``forward``'s
            result (two forward passes of the whole model); ``False`` skips it.
        activation_checkpointing: Recompute blocks in backward on every stage: ``False``, ``True`` (every block), a
            set of module classes such as ``{Block}``, or ``"selective"`` (every block with torchtitan's per-op
            policy: each keeps every other matrix product's output and the attention output).
        checkpoint_format: ``"consolidated"`` (one ``.ckpt`` as on one device, gathered to rank 0) or ``"sharded"``
            (a ``torch.distributed.checkpoint`` directory written by all ranks; refused with ``zero_stage`` 1-2).
        zero_stage: ZeRO over the data-parallel replicas of each stage, held by ``ShardedOptimizerStrategy``'s own
            backends: ``0`` off, ``1`` optimizer state sharded, ``2`` gradients too, ``3`` parameters too (FSDP2);
            weights and checkpoints are those of ``0``.
        shard_size: With ``zero_stage`` 1-3, the replicas of a stage that shard it (hybrid sharding); ``None``: all.
        bucket_cap_mb: ``zero_stage`` 1-2: size of the flat gradient buckets, in MiB.
        master_weights: ``zero_stage`` 1-3 under ``precision="bf16-true"``: ``"fp32"`` steps fp32 masters of the
            shard (kept without data parallelism too); ``None`` steps the 16-bit parameters.
        gradient_compression: ``zero_stage`` 1-3: ``"bf16"`` or ``"fp16"`` reduces each stage's gradients over its
            replicas in that dtype (half the bytes of fp32), written into the shard in its own dtype, as
            ``ShardedOptimizerStrategy(gradient_compression=...)`` does; ``None`` (default): the shard's dtype.
            Refused at ``zero_stage=0``.
        overlap_param_gather: ``zero_stage`` 1-2: overlap the all-gather of the stepped parameters with the next
            forward (``True``/``"auto"``) or wait at the end of the step (``False``).
        tensor_parallel_size: Ranks splitting each stage's layers (the mesh's innermost ``tensor`` axis), from the
            module's ``tensor_parallel_plan()`` or a Hugging Face model's own plan, with the stage's ZeRO over its
            data-parallel replicas (``zero_stage`` 0: they average their gradients' local shards; 1-2: the flat
            buckets hold each split weight's local slice; 3: FSDP2 shards the split weights; docs/tensor_parallel.md).
        start_method: ``"popen"`` (scripts, CLI, torchrun, SLURM), ``"spawn"``, or ``"fork"`` (notebooks).
        timeout: Seconds (or a ``timedelta``) a collective may wait before the job fails.
        process_group_backend: ``None`` picks NCCL on CUDA, gloo on CPU.
        accelerator: Set by the Trainer from its ``accelerator`` argument.
        parallel_devices: Set by the Trainer from ``devices``.
        cluster_environment: Set by the Trainer from the launcher it detects (torchrun, SLURM, MPI, ...).
        checkpoint_io: Set by the Trainer (its ``plugins``); the default saves with ``torch.save``.
        precision_plugin: Set by the Trainer from ``precision``.
    """

    strategy_name = "pipeline"
    launcher_type = ConsolidatingLauncher  # fork/spawn: the parent process gets the whole model, not rank 0's stage

    def __init__(
        self,
        *,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        schedule: str = "1F1B",
        num_microbatches: int | Literal["auto"] = "auto",
        stages_per_rank: int | Literal["auto"] = "auto",
        partition: PartitionMethod | list[int] = "flops",
        first_stage_fewer_layers: int = 0,
        last_stage_fewer_layers: int = 0,
        verify_layers: bool = True,
        activation_checkpointing: ActivationCheckpointing = False,
        checkpoint_format: CheckpointFormatName = "consolidated",
        zero_stage: PipelineZeroStage = 0,
        shard_size: int | None = None,
        bucket_cap_mb: float = 25.0,
        master_weights: MasterWeights = "fp32",
        gradient_compression: ZeroGradientCompression = None,
        overlap_param_gather: OverlapParamGather = "auto",
        tensor_parallel_size: int = 1,
        start_method: StartMethod = "popen",
        timeout: timedelta | float = default_pg_timeout,
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.schedule = resolve_schedule(schedule)
        validate_tensor_parallel_size(tensor_parallel_size)
        pipeline_setup.check_arguments(
            pipeline_parallel_size=pipeline_parallel_size,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            partition=partition,
            first_stage_fewer_layers=first_stage_fewer_layers,
            last_stage_fewer_layers=last_stage_fewer_layers,
            verify_layers=verify_layers,
            checkpoint_format=checkpoint_format,
        )
        zero_config = pipeline_zero_config(  # ShardedOptimizerStrategy's ZeroConfig and messages
            zero_stage,
            partial(ZeroConfig, **zero_options(locals())),
            checkpoint_format=checkpoint_format,
            schedule=self.schedule,
        )
        super().__init__(
            options=base_options(locals()),
            nonfinite_loss="ignore",  # not checked: the loss of a step exists on the last stage only
            activation_checkpointing=activation_checkpointing,
        )
        self._pipeline_parallel_size_arg = pipeline_parallel_size
        self._num_microbatches_arg = num_microbatches
        self._stages_per_rank_arg = stages_per_rank
        self.partition = partition
        self.uneven_stages = UnevenStages(
            first_stage_fewer_layers=first_stage_fewer_layers, last_stage_fewer_layers=last_stage_fewer_layers
        )
        """How many layers' worth the first and last stage are lightened by (``first_stage_fewer_layers``,
        ``last_stage_fewer_layers``)."""
        self.verify_layers = verify_layers
        self._checkpoints: CheckpointFormat = CHECKPOINT_FORMATS[checkpoint_format]
        self.zero_stage = zero_stage
        self.zero_config = zero_config
        """The ZeRO settings (``None`` at ``zero_stage=0``): each stage's ZeRO backend is built from them."""
        self._config: PipelineConfig | None = None
        self._run: PipelineRun | None = None  # the last split's record (`distributed/pipeline/run.py`)
        self._skip_warned = False
        self._hook_windows = HookWindows()  # the whole model in the module's own hooks (`pipeline_hooks.py`)
        self._batch_bytes: deque[int] = deque()  # each fetched training batch's broadcast, until its step starts
        self.tensor_parallel_size = tensor_parallel_size
        """Ranks splitting each stage's layers (the mesh's ``tensor`` axis; 1: no tensor parallelism)."""

    # ------------------------------------------------------------------ configuration
    @property
    def pipeline_config(self) -> PipelineConfig:
        """Ranks, stages and micro-batches with every ``"auto"`` resolved (fixed once the Trainer connects the model;
        before that, resolved from the devices known so far)."""
        if self._config is not None:
            return self._config
        return PipelineConfig.resolve(
            # The layout the Trainer was given, or the environment's where it alone says it (Ray Train).
            world_size=self.world_size if self.layout_from_environment else self.num_processes * self.num_nodes,
            pipeline_parallel_size=self._pipeline_parallel_size_arg,
            schedule=self.schedule,
            stages_per_rank=self._stages_per_rank_arg,
            num_microbatches=self._num_microbatches_arg,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def checkpoint_format(self) -> str:
        """``"consolidated"`` or ``"sharded"`` (see the class docstring); assigning it chooses the format anew."""
        return self._checkpoints.name

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        self._checkpoints = CHECKPOINT_FORMATS[value]

    # Read from `pipeline_config`:
    pipeline_parallel_size = FieldOf[int](
        "pipeline_config", 'Ranks per pipeline (``"auto"``: the world size over the tensor size).'
    )
    stages_per_rank = FieldOf[int](
        "pipeline_config",
        "Virtual stages per rank; 1 when a pipeline has one rank (the whole model is then one stage).",
    )
    effective_schedule = FieldOf[str](
        "pipeline_config", 'The schedule that runs: ``schedule``, or ``"1F1B"`` on a one-rank pipeline.'
    )
    num_stages = FieldOf[int]("pipeline_config")
    num_microbatches = FieldOf[int]("pipeline_config")

    @property
    def parallel_dims(self) -> ParallelDims:
        """Ranks and process groups; raises ``RuntimeError`` before the strategy's ``setup``."""
        return self._run_for("parallel_dims").dims

    @property
    def tied_layout(self) -> TiedLayout:
        """Tied parameters and the pipeline ranks holding a copy of each; raises ``RuntimeError`` before ``setup``."""
        return self._run_for("tied_layout").tied.layout

    @property
    def stage_plan(self) -> StagePlan:
        """Which layers form which stage; raises ``RuntimeError`` before the strategy's ``setup``."""
        return self._run_for("stage_plan").plan

    def _run_for(self, name: str) -> PipelineRun:
        if self._run is None:
            raise RuntimeError(f"`PipelineParallelStrategy.{name}` is available after the Trainer set it up.")
        return self._run

    @property
    def _current_run(self) -> PipelineRun:
        """The last split's record (internal: the steps and checkpoint hooks read it; raises before ``setup``)."""
        if self._run is None:
            raise RuntimeError("The pipeline is available after the Trainer set the strategy up.")
        return self._run

    def _resolve_config(self) -> None:
        """Fix the pipeline's counts for this run and check them (local: every rank reaches the same verdict)."""
        self._config = None
        config = self.pipeline_config
        config.validate()
        self._config = config

    @override
    def connect(self, model: Any) -> None:
        # Everything that can be checked without a process group is checked here, on every rank, so a bad
        # configuration raises everywhere instead of hanging a collective.
        super().connect(model)
        self._resolve_config()
        # BatchNorm normalises each micro-batch on the rank of its stage; nothing here would synchronise it.
        check_layer_sync(_compat.layer_sync_of(self), self.strategy_name, self.root_device, supported=False)
        counts = f" (`pipeline_parallel_size={self.pipeline_parallel_size}` x `stages_per_rank={self.stages_per_rank}`)"
        check_splittable(model, num_stages=self.num_stages, counts=counts)
        if self.tensor_parallel_size > 1:
            check_plan_early(model, self.tensor_parallel_size, owner="PipelineParallelStrategy")

    @override
    def setup_environment(self) -> None:
        assert self.cluster_environment is not None
        self._resolve_config()
        super().setup_environment()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._hook_windows.close()
        if self._run is not None:  # teardown then leaves the split module alone (no collective with failed peers)
            self._run.failed = True
            self._run.backend.abandon_in_flight()
        super().on_exception(exception)

    @property
    @override
    def mesh_layout(self) -> MeshLayout:
        """``replicate x shard x P``: the data-parallel replicas of each stage on the ``replicate`` axis, or with ZeRO
        on the ``shard`` axis (``shard_size`` of them; the rest on ``replicate``: hybrid sharding)."""
        p, t = self.pipeline_parallel_size, self.tensor_parallel_size
        return pipeline_mesh_layout(
            self.world_size, pipeline_parallel_size=p, zero_config=self.zero_config, tensor_parallel_size=t
        )

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ValueError(
                "PipelineParallelStrategy supports automatic optimization only: the schedule runs forward and"
                " backward together. Remove `self.automatic_optimization = False`."
            )
        pipeline_setup.check_precision(self.precision_plugin.precision)
        if fitting:
            pipeline_setup.check_callbacks(
                trainer.callbacks,
                zero_stage=self.zero_stage,
                pipeline_parallel_size=self.pipeline_parallel_size,
                checkpoint_format=self.checkpoint_format,
            )
        if not self.is_split:
            self._apply_activation_checkpointing(module)  # before the split: each stage keeps its wrapped blocks
            self._split(trainer, module, fitting=fitting)
        else:  # after a failed run of the same Trainer the module was left split: reuse that split
            self._current_run.failed = False
            mark_orphaned(module, orphaned=False)
            self.model_to_device()
        run = self._current_run
        make_view = partial(run.whole_model_view, module, device=self.root_device, stats=self._tracked_stats)
        self._hook_windows.attach(trainer, module, make_view, shards=run.backend.shards_gradients)
        if fitting:
            # Weight-averaging callbacks copied the whole module in their `setup`: each copy keeps this rank's stage.
            layout = StageCopyHolding(run.dims, tuple(run.full_state_keys), dict(run.aliases))
            hold_averaged_copies(trainer.callbacks, module, layout)
            self.setup_optimizers(trainer)
            run.setup_optimizers(self.unwrapped_optimizers())  # ZeRO-1/2: a collective (the stage's buckets)
        # Clipping by norm uses the norm over all stages.
        self.precision_plugin = with_clipping(self.precision_plugin, self._clip_grad_by_global_norm)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _split(self, trainer: Any, module: Any, *, fitting: bool) -> None:
        """What the Trainer knows (the first batch, the optimizers' layout, the precision), then the torch split."""
        check_not_split(module)
        layers, call = pipeline_layers_and_call(module)
        previous = self._run  # an earlier split's ranks and groups are reused (groups are created once)
        if previous is not None:
            dims = previous.dims
        else:  # on the mesh built in `setup_environment` (its groups: a collective done there)
            p, zero_config = self.pipeline_parallel_size, self.zero_config
            dims = build_parallel_dims(
                self.world_size,
                self.global_rank,
                pipeline_parallel_size=p,
                zero_config=zero_config,
                tensor_parallel_size=self.tensor_parallel_size,
                mesh=self.device_mesh,
                host_data_parallel_group=self.host_groups.data_parallel if self.world_size > 1 else None,
            )
        example = pipeline_setup.example_model_inputs(trainer, module, call, num_microbatches=self.num_microbatches)
        if dims.pipeline_parallel_size > 1:  # planned from the first stage's batch on every rank, as it trains
            first = dims.replica_source(0)
            example, _ = broadcast_batch(example, BatchBroadcast(dims.replica_group, first, self.root_device))
        # Recorded whatever runs first, so that a later `fit` of this Trainer can still write consolidated checkpoints.
        layouts = pipeline_setup.whole_model_optimizer_layouts(module, fitting=fitting)
        precision = self.precision_plugin.precision
        self._run = split_into_stages(
            module,
            dims=dims,
            device=self.root_device,
            num_stages=self.num_stages,
            schedule=self.effective_schedule,
            num_microbatches=self.num_microbatches,
            example=example,
            layers=layers,
            call=call,
            partition=self.partition,
            uneven=self.uneven_stages,
            verify_layers=self.verify_layers,
            holding=StageHolding(
                zero_config=self.zero_config,
                keeps_masters=pipeline_setup.keeps_fp32_masters(self.zero_config, precision=precision, fitting=fitting),
                fitting=fitting,
                mesh=self.device_mesh,
                convert=self.precision_plugin.convert_module,
                warn=rank_zero_warn,
                stats=self._tracked_stats,
                tensor_parallel=tensor_parallel_plan(module, self.tensor_parallel_size, owner=self.strategy_name),
            ),
            optimizer_layouts=layouts,
            on_chunk=self.events.chunk,
            on_p2p=self.communication_stats.record if self.track_communication else None,
            previous=previous,
        )

    def _tracked_stats(self) -> CommunicationStats | None:
        """Where collective bytes are counted now (``None`` unless a monitor switched counting on)."""
        return self.communication_stats if self.track_communication else None

    @override
    def configure_ddp(self) -> None:
        return None  # no DDP wrapper: replicas' gradients are averaged per stage in `optimizer_step`

    # ------------------------------------------------------------------ steps
    @property
    def engine(self) -> PipelineEngine:
        if self._run is None or self._run.engine is None:
            raise RuntimeError("The pipeline is available after the Trainer set the strategy up.")
        return self._run.engine

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._hook_windows.close()
        module = self.lightning_module
        assert module is not None
        engine, run = self.engine, self._current_run
        run.backend.wait_for_parameters(everywhere=False)  # ZeRO-1/2 overlapped: what no forward pre-hook waits for
        if self.world_size > 1:  # on the host group: no device sync
            run.check_same_trainable_parameters(module, group=self.host_groups.world, owner="PipelineParallelStrategy")
        with self.precision_plugin.train_step_context():
            model_inputs, size = engine.capture_inputs("training_step", args, kwargs)
            check_divisible_batch(size, engine.num_microbatches)
            divisor = engine.num_microbatches * module.trainer.accumulate_grad_batches
            # This batch's gradients are handed over in `backward`, after Lightning's `zero_grad`.
            with run.gradients_set_aside(module), self.events.timed("pipeline_step"):
                outcome = engine.train_step("training_step", args, kwargs, model_inputs=model_inputs, divisor=divisor)
        self._replay(outcome)
        assert outcome.loss is not None  # a training step always has one
        loss = outcome.loss.to(self.root_device).requires_grad_()
        return {"loss": loss, **outcome.extra} if outcome.extra else loss

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._hook_windows.close()  # Lightning calls this right after the module's `on_train_batch_start`
        # The batch came from the first pipeline rank during the fetch, before the step's window of the monitor (which
        # opens in the callbacks' `on_train_batch_start`, just before this): its bytes are counted now.
        payload = self._batch_bytes.popleft() if self._batch_bytes else None
        if payload is not None and self.track_communication:
            self.communication_stats.record("broadcast", payload)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every loader: the first pipeline rank's batches on every rank of its pipeline (each rank still iterates
        its own loader; a LitData ``StreamingDataset`` reads the replica's share). Training: batches not divisible by
        ``num_microbatches`` left out."""
        trainer = self.module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return dataloader
        training = trainer.state.stage == RunningStage.TRAINING
        if self._run is not None and self.pipeline_parallel_size > 1:
            dims = self._run.dims
            tell_data_parallel_rank(dataloader, rank=dims.data_parallel_rank, size=dims.data_parallel_size)
            first = dims.replica_source(self._run.plan.rank_of_stage(0))  # with TP: its tensor rank 0
            exchange = BatchBroadcast(group=dims.replica_group, src=first, device=self.root_device)
            dataloader = replica_batches(dataloader, exchange, self._batch_bytes.append if training else None)
        if not training:
            return dataloader
        self._batch_bytes.clear()  # a new training loader: a batch prefetched by an earlier fit never trains
        batches = divisible_batches(dataloader, self.num_microbatches, self._skip_batch)
        if batches.known_partial_batch is not None:
            self._warn_skipped_batch(batches.known_partial_batch)
        return batches

    def _skip_batch(self, size: int) -> None:
        """A fetched training batch left out: its broadcast (the last one recorded) trains no step."""
        if self._batch_bytes:
            self._batch_bytes.pop()
        self._warn_skipped_batch(size)

    def _warn_skipped_batch(self, size: int) -> None:
        if not self._skip_warned:
            rank_zero_warn(
                f"PipelineParallelStrategy skips a last training batch of {size} samples (not divisible by"
                f" `num_microbatches={self.num_microbatches}`). Use `drop_last=True` in the training DataLoader to"
                " silence this."
            )
            self._skip_warned = True

    def _evaluation_step(self, step: str, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._hook_windows.close()
        engine = self.engine
        self._current_run.backend.wait_for_parameters()
        with context:
            model_inputs, _ = engine.capture_inputs(step, args, kwargs)
            outcome = engine.eval_step(step, args, kwargs, model_inputs=model_inputs, collect=step == "predict_step")
        self._replay(outcome)
        return outcome.result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context(), args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context(), args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The step's outputs of the whole batch on every rank of the pipeline (rank 0 returns replica 0's)."""
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context(), args, kwargs)

    def _replay(self, outcome: StepOutcome) -> None:
        replay_logs(self.module, outcome.logs, device=self.root_device, is_source=self.engine.has_last_stage)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward inside ``training_step``; hand its gradients over here."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._current_run.hand_over_gradients(module)
        with self._hook_windows.window("on_after_backward"):  # post_backward calls it; the whole model if overridden
            return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        backend = self._current_run.backend
        calls = 0

        def closure_then_reduce() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:  # an optimizer we do not know to refuse at setup, re-evaluating like LBFGS
                raise closure_evaluated_twice(unwrap_optimizer(optimizer))
            result = closure()
            with self.events.timed("exposed_communication"):
                backend.reduce_gradients()  # over the replicas of each stage, then the tied copies' sum
            # The precision plugin calls `on_before_optimizer_step` next: the whole model if overridden.
            self._hook_windows.open("on_before_optimizer_step")
            return result

        try:
            output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        finally:
            self._hook_windows.close()
        with self.events.timed("exposed_communication"):
            backend.after_optimizer_step(unwrap_optimizer(optimizer))  # ZeRO-1/2: all-gather the stepped buckets
        return output

    @override
    def instrumentation(self) -> Instrumentation:
        dp = self.mesh_layout.data_parallel_size
        return Instrumentation(data_parallel_size=dp, times_exposed_communication=True, is_pipeline=True)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` by the norm over all stages (a tied parameter counted once)."""
        self._current_run.backend.clip_grad_norm_(unwrap_optimizer(optimizer), clip_val)

    @override
    def gradient_tensors(self) -> list[Tensor]:
        """The parameters' ``.grad`` (at ``zero_stage=3`` their shards) and, with ``zero_stage`` 1-2, the stage's
        gradient buckets."""
        buffers = self._run.backend.gradient_buffers() if self._run is not None else []
        return [*super().gradient_tensors(), *buffers]

    @override
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds (measured from its tensors: at ``zero_stage=3`` the local shards); with ``zero_stage``
        1-2 the stage's flat buckets and the optimizer state of this replica's shard, summed over the optimizers."""
        if self._run is None:
            return super().memory_report()
        return self._run.backend.memory_report(self.unwrapped_optimizers())

    # ------------------------------------------------------------------ checkpoints
    @property
    def is_split(self) -> bool:
        """Whether the module holds only this rank's stages now (during a run; teardown puts the whole model back)."""
        return self._run is not None and self._run.is_split

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's ``state_dict`` on rank 0 (a collective; other ranks get ``{}``).

        With ``checkpoint_format="sharded"`` nothing is gathered: ``save_checkpoint`` writes every rank's part.
        """
        self._hook_windows.close()  # a checkpoint saved by a callback right after a hook: the split module
        if self._run is None:
            return super().lightning_module_state_dict()
        return self._on_global_zero(self._checkpoints.model_state(self.module, self._run))

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The whole model's ``state_dict`` under its own names on rank 0, ``{}`` elsewhere (a collective while
        the model is split; after teardown every rank holds the whole model and nothing is exchanged)."""
        return self._on_global_zero(whole_model_state(self.module, self._run))

    def _on_global_zero(self, state: dict[str, Any] | None) -> dict[str, Any]:
        return state if state is not None and self.is_global_zero else {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The single-device ``optimizer.state_dict()`` of the whole model on rank 0 (a collective)."""
        self._hook_windows.close()
        optimizer = unwrap_optimizer(optimizer)
        state = self._checkpoints.optimizer_state(self._current_run, optimizer, self.unwrapped_optimizers())
        return self._on_global_zero(state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._hook_windows.close()
        write = partial(super().save_checkpoint, checkpoint, filepath, storage_options=storage_options)
        if self._run is None:
            return write()
        optimizer = unwrap_optimizer(self.optimizers[0]) if self.optimizers else None
        request = CheckpointWrite(self.module, checkpoint, filepath, optimizer, write=write, broadcast=self.broadcast)
        self._checkpoints.save(self._run, request)
        return None

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.is_split:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._refuse_loading_into_tensor_parallel()
        self._current_run.load_model_state(self.module, checkpoint["state_dict"], strict=strict)
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._current_run.load_optimizer_states(self.unwrapped_optimizers(), checkpoint["optimizer_states"])
        _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _refuse_loading_into_tensor_parallel(self) -> None:
        """Every rank, at the same point (no collective pending): weights are not cut into the split layers' slices
        once split (a ``fit(ckpt_path=...)`` loads them before the split, which cuts them)."""
        if self.tensor_parallel_size > 1:
            size = self.tensor_parallel_size
            raise ValueError(
                f"Loading weights into the split stages of `PipelineParallelStrategy(tensor_parallel_size={size})` is"
                " not built yet: pass the checkpoint to `trainer.fit(ckpt_path=...)` (loaded before the split), or"
                " load it into the module before `fit`."
            )

    @override
    def teardown(self) -> None:
        self._hook_windows.detach()
        run, module = self._run, self.lightning_module
        if run is not None and run.is_split and module is not None:
            # The user's module whole on every rank (a collective), unless the run failed (its placeholders then raise
            # on access). A later run of this Trainer splits the module afresh.
            if not run.failed:
                self._wait_for_peers("the teardown's gather of the stages")  # a peer that failed after training
            run.reassemble(module, device=self.root_device)
        if run is not None:
            run.backend.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        schedules = {"": "1F1B", "_gpipe": "GPipe", "_interleaved": "Interleaved1F1B"}
        methods = {"": "popen", "_spawn": "spawn", "_notebook": "fork"}
        entries = [
            (f"pipeline{suffix}{variant}", {"schedule": schedule, "start_method": method})
            for suffix, schedule in schedules.items()
            for variant, method in methods.items()
        ]
        cls._register(strategy_registry, entries)
