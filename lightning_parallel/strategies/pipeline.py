"""PipelineParallelStrategy: pipeline model parallelism (x data parallelism) on ``torch.distributed.pipelining``."""

from __future__ import annotations

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
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.pipeline.checkpoint_format import (
    CHECKPOINT_FORMATS,
    CheckpointFormat,
    whole_model_state,
)
from lightning_parallel.distributed.pipeline.config import PipelineConfig
from lightning_parallel.distributed.pipeline.consolidate import WholeOptimizerState, load_local_state, optimizer_layout
from lightning_parallel.distributed.pipeline.contract import ModelCall, model_inputs_of_batch, replay_logs
from lightning_parallel.distributed.pipeline.engine import PipelineEngine, StepOutcome
from lightning_parallel.distributed.pipeline.hook_view import WholeModelView
from lightning_parallel.distributed.pipeline.microbatch import DivisibleBatches, batch_size_of
from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call
from lightning_parallel.distributed.pipeline.partition import (
    PartitionMethod,
    RemoteLayer,
    StagePlan,
    check_parameter_ownership,
    layer_registrations,
    local_module_ids,
    remove_remote_layers,
    validate_partition,
)
from lightning_parallel.distributed.pipeline.reassemble import mark_orphaned, offload_layers, reassemble
from lightning_parallel.distributed.pipeline.run import PipelineRun
from lightning_parallel.distributed.pipeline.schedule import (
    ParallelDims,
    check_count,
    resolve_schedule,
)
from lightning_parallel.distributed.pipeline.split import (
    broadcast_from_rank0,
    check_same_plan,
    plan_on_every_rank,
)
from lightning_parallel.distributed.pipeline.stage_copy import StageCopyLayout
from lightning_parallel.distributed.pipeline.sync import SyncContext
from lightning_parallel.distributed.pipeline.sync_type import pipeline_sync_type
from lightning_parallel.distributed.pipeline.tied import (
    TiedGradientSync,
    TiedLayout,
    canonical_names,
    find_tied_parameters,
    parameter_aliases,
)
from lightning_parallel.distributed.pipeline.verify import (
    check_layers_compose_to_forward,
    check_single_evaluation_optimizers,
    closure_evaluated_twice,
)
from lightning_parallel.distributed.pipeline.zero import PipelineZeroStage, pipeline_zero_config
from lightning_parallel.distributed.trainable import check_same_trainable_parameters_within
from lightning_parallel.distributed.zero.config import MasterWeights, OverlapParamGather
from lightning_parallel.instrumentation import Instrumentation
from lightning_parallel.strategies.base import LightningParallelStrategy, unwrap_optimizer
from lightning_parallel.strategies.batchnorm import check_layer_sync
from lightning_parallel.strategies.clipping import with_clipping
from lightning_parallel.strategies.launch import ConsolidatingLauncher, StartMethod
from lightning_parallel.strategies.parameter_callbacks import (
    AVERAGING_CALLBACKS,
    check_averaging_checkpoint_format,
    check_parameter_callbacks,
    hold_averaged_copies,
)
from lightning_parallel.strategies.pipeline_hooks import HookWindows

__all__ = ["PipelineParallelStrategy"]

_SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")
_SIXTEEN_BIT_TRUE = ("bf16-true",)
_STEP_NAMES = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


class PipelineParallelStrategy(LightningParallelStrategy):
    """Pipeline model parallelism for an unchanged LightningModule that adds ``pipeline_layers()``.

    The module's layers (``pipeline_layers()``: in order, each layer's output the next one's input, their composition
    equal to ``forward``) are cut into contiguous stages; each rank keeps only its stages' parameters and optimizer
    state. torch's ``PipelineStage`` and schedules move micro-batches through the stages. The user's
    ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` run unchanged on the rank with the last
    stage, once per micro-batch, with ``self(...)`` answered by the pipeline's output for that micro-batch.

    Ranks form ``world_size / pipeline_parallel_size`` data-parallel replicas of the pipeline
    (``global_rank = replica * pipeline_parallel_size + pipeline_rank``); the sampler shards data by replica, so
    every rank of a replica loads the same batch, and gradients are averaged across the replicas of each stage.

    Semantics:

    * Gradients: each micro-batch's loss is divided by ``num_microbatches * accumulate_grad_batches`` before its
      backward, so the gradient is that of the mean loss over the batch (and the accumulation window), as on one
      device. Logged values are the mean over micro-batches (weighted by their sizes; ``reduce_fx="sum"/"max"/"min"``
      honoured); every rank logs them, so loggers on rank 0 and callbacks on all ranks see the same numbers.
    * ``gradient_clip_val`` with ``"norm"`` clips by the global norm over all stages.
    * Training batches must be divisible by ``num_microbatches``. A smaller last batch that is not is left out of
      the epoch (a warning; Lightning's epoch length does not count it), as ``drop_last=True`` would.
      Evaluation/predict batches are padded to a multiple by repeating the last row; padded rows never reach the step.
    * Checkpoints are consolidated by default: one ``.ckpt`` with the whole model's ``state_dict`` (original names)
      and the optimizer state in the single-device layout, loadable by single-device Lightning, DataParallelStrategy,
      ShardedOptimizerStrategy, or a pipeline of another size. Saving is a collective (call it on every rank).
    * A pipeline of one rank is a single stage holding the whole model, whatever the schedule.

    Args:
        pipeline_parallel_size: Ranks per pipeline; ``"auto"`` uses all ranks (no data parallelism).
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"`` or ``"InterleavedZeroBubble"``
            (case-insensitive).
        num_microbatches: Micro-batches per batch; ``"auto"`` is the number of stages (the minimum for 1F1B; more
            shrinks the bubble ``(p - 1) / (m + p - 1)``).
        stages_per_rank: Virtual stages per rank for the multi-stage schedules; ``"auto"`` is 2 for those, else 1
            (always 1 on a one-rank pipeline).
        partition: ``"compute"`` balances stages by forward FLOPs counted with shape-only (fake) parameters for an
            example batch (no memory; deterministic, the same on every rank), ``"measured"`` by each layer's forward
            + backward time on rank 0's device for that batch (shared with the other ranks), ``"parameters"`` by
            parameter count, or a list with the first layer index of every stage but the first.
        activation_checkpointing: recompute blocks in backward instead of keeping their activations, on every
            stage: ``False``, ``True`` (every block: the classes a Hugging Face model declares in
            ``_no_split_modules``, else repeated blocks such as the transformer blocks) or a set of module classes such
            as ``{Block}``. With 1F1B a stage then holds each in-flight
            micro-batch's block inputs instead of all its activations; names and checkpoints are unchanged.
        verify_layers: Before the split, on the first batch of every run, check on every rank that
            ``pipeline_layers()`` applied in order gives ``forward``'s result (a ``ValueError`` naming the first layer
            whose input differs). Costs two forward passes of the whole model on one batch, on the device the model
            sits on before the split, without gradients or side effects; ``False`` skips it (models too large to run
            whole).
        checkpoint_format: ``"consolidated"`` writes one Lightning ``.ckpt`` exactly as single-device training would
            (whole ``state_dict``, single-device optimizer layout), gathered to rank 0; ``"sharded"`` writes a
            ``torch.distributed.checkpoint`` directory from all ranks in parallel (the package's shared sharded
            layout). Both load under any layout and strategy of this package. ``"sharded"`` is refused with
            ``zero_stage`` 1 or 2 (``zero_stage=3`` writes each replica's rows of its stage).
        zero_stage: ZeRO inside the pipeline, across the data-parallel replicas of each stage (the mesh's
            ``"shard"`` axis), held by the same ZeRO backends as ``ShardedOptimizerStrategy(stage=...)``: ``0``
            (off: every replica holds its stage's whole gradients and optimizer state),
            ``1`` (each replica keeps the optimizer state of ``1/dp`` of its stage's parameters:
            ``8 * stage_params / dp`` bytes for Adam(W) in fp32), ``2`` (the gradients too:
            ``4 * stage_params / dp`` bytes kept after the reduce-scatter), ``3`` (the parameters too, with FSDP2's
            ``fully_shard`` on copies of the rank's layers: ``4 * stage_params / dp`` bytes each of parameters and
            gradients; every micro-batch all-gathers each block's parameters for forward and backward and
            reduce-scatters its gradients; not with ``"InterleavedZeroBubble"``, nor with a tied weight whose users
            run on one pipeline rank). At stages 1-2 the replicas' all-reduce becomes a reduce-scatter after the
            schedule and an all-gather of the stepped parameters (the same bytes); the optimizer must update
            elementwise (AdamW, SGD, ...). Without data parallelism nothing is sharded. Weights and consolidated
            checkpoints are those of ``zero_stage=0``; after the run the module is plain and whole again.
        shard_size: with ``zero_stage`` 1-3, the replicas of a stage that shard it (a divisor of the data-parallel
            size, e.g. the devices of one node); the ``world_size / (pipeline_parallel_size * shard_size)`` groups
            hold the same shards (hybrid sharding, ``pp x replicate x shard``). ``None``: every replica shards.
            As ``ShardedOptimizerStrategy(shard_size=...)``.
        bucket_cap_mb: ``zero_stage`` 1-2: size of the flat gradient buckets, in MiB.
        master_weights: ``zero_stage`` 1-2 with 16-bit parameters (``precision="bf16-true"``): ``"fp32"`` (default)
            steps fp32 master weights of this replica's shard and reduces gradients in fp32, as
            ``ShardedOptimizerStrategy``; ``None`` steps the 16-bit parameters. Without data parallelism the masters
            are kept too (every parameter's). ``zero_stage`` 0 and 3 step the parameters as they are.
        overlap_param_gather: ``zero_stage`` 1-2: ``True``/``"auto"`` (default) overlap the all-gather of the stepped
            parameters with the next step's forward (each block waits for its buckets in a forward pre-hook), as
            ``ShardedOptimizerStrategy``; ``False`` waits at the end of the step.
        start_method: ``"popen"`` (scripts, CLI, torchrun, SLURM), ``"spawn"``, or ``"fork"`` (notebooks).
        timeout: Seconds (or a ``timedelta``) a collective may wait before the job fails.
        process_group_backend: ``None`` picks NCCL on CUDA, gloo on CPU.
        accelerator: set by the Trainer from its ``accelerator`` argument; pass it only to override Lightning's choice.
        parallel_devices: set by the Trainer from ``devices``.
        cluster_environment: set by the Trainer from the launcher it detects (torchrun, SLURM, MPI, ...).
        checkpoint_io: set by the Trainer (its ``plugins``); the default saves with ``torch.save``.
        precision_plugin: set by the Trainer from ``precision``.
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
        partition: PartitionMethod | list[int] = "compute",
        verify_layers: bool = True,
        activation_checkpointing: ActivationCheckpointing = False,
        checkpoint_format: Literal["consolidated", "sharded"] = "consolidated",
        zero_stage: PipelineZeroStage = 0,
        shard_size: int | None = None,
        bucket_cap_mb: float = 25.0,
        master_weights: MasterWeights = "fp32",
        overlap_param_gather: OverlapParamGather = "auto",
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
        for name, count in [
            ("pipeline_parallel_size", pipeline_parallel_size),
            ("num_microbatches", num_microbatches),
            ("stages_per_rank", stages_per_rank),
        ]:
            check_count(name, count)
        if not isinstance(verify_layers, bool):
            raise TypeError(f"`verify_layers={verify_layers!r}` must be True or False.")
        validate_partition(partition)
        if checkpoint_format not in ("consolidated", "sharded"):
            raise ValueError(
                f"`checkpoint_format={checkpoint_format!r}` is invalid. Valid options: 'consolidated', 'sharded'."
            )
        zero_config = pipeline_zero_config(  # ShardedOptimizerStrategy's ZeroConfig and messages
            zero_stage,
            shard_size=shard_size,
            bucket_cap_mb=bucket_cap_mb,
            master_weights=master_weights,
            overlap_param_gather=overlap_param_gather,
            checkpoint_format=checkpoint_format,
            schedule=self.schedule,
        )
        super().__init__(
            start_method=start_method,
            timeout=timeout,
            process_group_backend=process_group_backend,
            nonfinite_loss="ignore",  # not checked: the loss of a step exists on the last stage only
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            activation_checkpointing=activation_checkpointing,
        )
        self._pipeline_parallel_size_arg = pipeline_parallel_size
        self._num_microbatches_arg = num_microbatches
        self._stages_per_rank_arg = stages_per_rank
        self.partition = partition
        self.verify_layers = verify_layers
        self._checkpoints: CheckpointFormat = CHECKPOINT_FORMATS[checkpoint_format]
        self.zero_stage = zero_stage
        self.zero_config = zero_config
        """The ZeRO settings (``None`` at ``zero_stage=0``): each stage's ZeRO backend is built from them."""
        self._config: PipelineConfig | None = None
        self._run: PipelineRun | None = None  # the last split's record (`distributed/pipeline/run.py`)
        self._skip_warned = False
        self._hook_windows = HookWindows()  # the whole model in the module's own hooks (`pipeline_hooks.py`)

    # ------------------------------------------------------------------ configuration
    @property
    def pipeline_config(self) -> PipelineConfig:
        """Ranks, stages and micro-batches with every ``"auto"`` resolved (fixed once the Trainer connects the model;
        before that, resolved from the devices known so far)."""
        if self._config is not None:
            return self._config
        return PipelineConfig.resolve(
            world_size=self._world_size_before_init(),
            pipeline_parallel_size=self._pipeline_parallel_size_arg,
            schedule=self.schedule,
            stages_per_rank=self._stages_per_rank_arg,
            num_microbatches=self._num_microbatches_arg,
        )

    @property
    def checkpoint_format(self) -> str:
        """``"consolidated"`` or ``"sharded"`` (see the class docstring); assigning it chooses the format anew."""
        return self._checkpoints.name

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        self._checkpoints = CHECKPOINT_FORMATS[value]

    @property
    def pipeline_parallel_size(self) -> int:
        """Ranks per pipeline (``"auto"``: the world size)."""
        return self.pipeline_config.pipeline_parallel_size

    @property
    def stages_per_rank(self) -> int:
        """Virtual stages per rank; 1 when a pipeline has one rank (the whole model is then one stage)."""
        return self.pipeline_config.stages_per_rank

    @property
    def effective_schedule(self) -> str:
        """The schedule that runs: ``schedule``, or ``"1F1B"`` on a one-rank pipeline."""
        return self.pipeline_config.effective_schedule

    @property
    def num_stages(self) -> int:
        return self.pipeline_config.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.pipeline_config.num_microbatches

    @property
    def parallel_dims(self) -> ParallelDims:
        """Ranks and process groups; raises ``RuntimeError`` before the strategy's ``setup``."""
        if self._run is None:
            raise RuntimeError("`PipelineParallelStrategy.parallel_dims` is available after the Trainer set it up.")
        return self._run.dims

    @property
    def tied_layout(self) -> TiedLayout:
        """Tied parameters and the pipeline ranks holding a copy of each; raises ``RuntimeError`` before ``setup``."""
        if self._run is None:
            raise RuntimeError("`PipelineParallelStrategy.tied_layout` is available after the Trainer set it up.")
        return self._run.tied.layout

    @property
    def stage_plan(self) -> StagePlan:
        """Which layers form which stage; raises ``RuntimeError`` before the strategy's ``setup``."""
        if self._run is None:
            raise RuntimeError("`PipelineParallelStrategy.stage_plan` is available after the Trainer set it up.")
        return self._run.plan

    @property
    def _current_run(self) -> PipelineRun:
        """The last split's record (internal: the steps and checkpoint hooks read it; raises before ``setup``)."""
        if self._run is None:
            raise RuntimeError("The pipeline is available after the Trainer set the strategy up.")
        return self._run

    def _world_size_before_init(self) -> int:
        return self.num_processes * self.num_nodes

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
        layers, _ = pipeline_layers_and_call(model)
        check_parameter_ownership(model, layers)
        layer_registrations(model, layers)
        if len(layers) < self.num_stages:
            raise ValueError(
                f"Cannot split {len(layers)} pipeline layers into {self.num_stages} stages"
                f" (`pipeline_parallel_size={self.pipeline_parallel_size}` x `stages_per_rank={self.stages_per_rank}`)"
                ": every stage needs at least one layer. Use fewer stages or return finer layers."
            )

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
            self._run.sync.abandon_in_flight()
        super().on_exception(exception)

    @property
    @override
    def mesh_layout(self) -> MeshLayout:
        """``replicate x shard x P``: the data-parallel replicas of each stage on the ``replicate`` axis, or with ZeRO
        on the ``shard`` axis (``shard_size`` of them; the rest on ``replicate``: hybrid sharding)."""
        p = self.pipeline_parallel_size
        if self.zero_config is None or self.world_size % p:
            return MeshLayout(self.world_size, pipeline_parallel_size=p)
        shard_size = self.zero_config.shard_size or self.world_size // p
        return MeshLayout(self.world_size, shard_size=shard_size, pipeline_parallel_size=p)

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
        if self.precision_plugin.precision not in _SUPPORTED_PRECISION:
            raise ValueError(
                f"`precision={self.precision_plugin.precision!r}` is not supported by PipelineParallelStrategy."
                f" Valid options: {', '.join(map(repr, _SUPPORTED_PRECISION))}."
            )
        if fitting:
            _check_callbacks(
                trainer.callbacks,
                zero_stage=self.zero_stage,
                pipeline_parallel_size=self.pipeline_parallel_size,
                checkpoint_format=self.checkpoint_format,
            )
        if not self.is_split:
            self._apply_activation_checkpointing(module)  # before the split: each stage keeps its wrapped blocks
            self._split(trainer, module)
        else:  # after a failed run of the same Trainer the module was left split: reuse that split
            self._current_run.failed = False
            mark_orphaned(module, orphaned=False)
            self.model_to_device()
        run = self._current_run
        self._hook_windows.attach(trainer, module, partial(self._whole_model_view, run), sync=run.sync)
        if fitting:
            # Weight-averaging callbacks copied the whole module in their `setup`: each copy keeps this rank's stage.
            layout = StageCopyLayout(run.dims, tuple(run.full_state_keys), dict(run.aliases))
            hold_averaged_copies(trainer.callbacks, module, layout)
            self.setup_optimizers(trainer)
            run.sync.setup_optimizers(self.unwrapped_optimizers())  # ZeRO-1/2: a collective (the stage's buckets)
        # Clipping by norm uses the norm over all stages.
        self.precision_plugin = with_clipping(self.precision_plugin, self._clip_grad_by_global_norm)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _split(self, trainer: Any, module: Any) -> None:
        """Check the layers, plan the stages, keep this rank's layers, choose the sync, create the engine."""
        if any(isinstance(submodule, RemoteLayer) for submodule in module.modules()):
            raise ValueError(
                "This module was already split by another PipelineParallelStrategy (some layers live on other"
                " ranks). Create a fresh module, or load the consolidated checkpoint into one."
            )
        layers, call = pipeline_layers_and_call(module)
        registrations = layer_registrations(module, layers)  # raises before any collective
        example = self._example_model_inputs(trainer, module, call)
        if self.verify_layers and example is not None:
            check_layers_compose_to_forward(module, layers, example, reference=call.reference)
        plan = plan_on_every_rank(
            layers,
            example,
            partition=self.partition,
            num_stages=self.num_stages,
            pipeline_parallel_size=self.pipeline_parallel_size,
            global_rank=self.global_rank,
            device=self.root_device,
        )
        previous = self._run  # an earlier split's ranks and groups are reused (groups are created once)
        dims = previous.dims if previous is not None else self._new_parallel_dims()
        fitting = trainer.state.fn == TrainerFn.FITTING
        keeps_masters = (
            fitting
            and self.zero_config is not None
            and self.zero_config.master_weights == "fp32"
            and self.precision_plugin.precision in _SIXTEEN_BIT_TRUE
        )
        sync_type = pipeline_sync_type(
            self.zero_stage, data_parallel_size=dims.data_parallel_size, keeps_masters=keeps_masters
        )
        local_stages = plan.stages_of(dims.pipeline_rank)
        full_state_keys = list(module.state_dict().keys())
        full_shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        tied, aliases = find_tied_parameters(module, layers), parameter_aliases(module)
        sync_type.check_split(tied, plan, self.pipeline_parallel_size)
        # Recorded whatever runs first, so that a later `fit` of this Trainer can still write consolidated checkpoints.
        optimizer_layouts = self._whole_model_optimizer_layouts(module, fitting=fitting)
        # First collectives: every check above ran on every rank.
        check_same_plan(plan, self.world_size)
        broadcast_from_rank0(module, self.root_device)  # every stage and replica starts from rank 0's weights
        layout = TiedLayout(tuple(tied), plan)
        tied_sync = _tied_gradient_sync(layout, dims, previous)
        local = {i for s in local_stages for i in plan.layers_of(s)}
        shared = local_module_ids(layers, plan, local_stages)
        remove_remote_layers(module, registrations, plan, local_stages, keep=shared)
        offload_layers(layers, [i for i in range(len(layers)) if i not in local], keep=shared)
        held = set(canonical_names(module, aliases).values())
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        # ZeRO-3: the local layers' sharded copies run the stages (the optimizers are built after this).
        sync = sync_type(
            SyncContext(
                module=module,
                layers={i: layers[i] for i in local},
                registrations=registrations,
                dims=dims,
                mesh=self.device_mesh,
                tied=tied_sync,
                aliases=aliases,
                zero_config=self.zero_config,
                device=self.root_device,
                stats=self._tracked_stats,
                warn=rank_zero_warn,
                sharded_names=previous.sync.sharded_names if previous is not None else {},
            )
        )
        running = sync.layers
        engine = PipelineEngine(
            module,
            layers=[running.get(i) for i in range(len(layers))],
            plan=plan,
            dims=dims,
            schedule=self.effective_schedule,
            num_microbatches=self.num_microbatches,
            device=self.root_device,
            call=call,
            on_chunk=self.events.chunk,
            on_p2p=self.communication_stats.record if self.track_communication else None,
        )
        self._run = PipelineRun(
            dims=dims,
            plan=plan,
            tied=tied_sync,
            aliases=aliases,
            full_state_keys=full_state_keys,
            full_shapes=full_shapes,
            optimizer_layouts=optimizer_layouts,
            local_parameter_names=held - layout.uncounted(dims.pipeline_rank),
            sync=sync,
            engine=engine,
            layers=layers,
            registrations=registrations,
        )

    def _whole_model_view(self, run: PipelineRun) -> WholeModelView:
        module = self.lightning_module
        assert module is not None
        return WholeModelView(
            module,
            layers=run.layers,
            registrations=run.registrations,
            plan=run.plan,
            dims=run.dims,
            aliases=run.aliases,
            device=self.root_device,
            stats=self._tracked_stats,
        )

    def _new_parallel_dims(self) -> ParallelDims:
        layout = self.mesh_layout
        dims = ParallelDims(
            self.world_size,
            self.global_rank,
            self.pipeline_parallel_size,
            shard_size=layout.shard_size,
            mesh=self.device_mesh,  # built in `setup_environment` (its groups: a collective done there)
        )
        dims.flatten_data_axes()  # hybrid sharding: one group of every replica of the stage (a collective)
        return dims

    def _tracked_stats(self) -> CommunicationStats | None:
        """Where collective bytes are counted now (``None`` unless a monitor switched counting on)."""
        return self.communication_stats if self.track_communication else None

    def _example_model_inputs(
        self, trainer: Any, module: Any, call: ModelCall
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The ``self(...)`` arguments of the first batch of the loop about to run (local: no collective), if any."""
        source = _compat.data_source_for(trainer)
        step = _STEP_NAMES.get(trainer.state.fn)
        if source is None or step is None or not source.is_defined():
            return None
        loader = source.dataloader()
        if isinstance(loader, dict):
            loader = list(loader.values())
        if isinstance(loader, list | tuple):
            loader = loader[0] if loader else None
        try:
            batch = next(iter(loader))
        except (StopIteration, TypeError):
            return None
        inputs = model_inputs_of_batch(module, step, (batch, 0), {}, call=call)
        size = batch_size_of(inputs)
        if step == "training_step" and size is not None and size % self.num_microbatches:
            raise ValueError(
                f"The training batch size {size} is not divisible by `num_microbatches={self.num_microbatches}`;"
                " the pipeline splits every batch into equal micro-batches. Choose a batch size that is a multiple"
                f" of {self.num_microbatches} or another `num_microbatches`."
            )
        return inputs

    def _whole_model_optimizer_layouts(self, module: Any, *, fitting: bool) -> list[list[list[str]]]:
        # `configure_optimizers` runs once more on the whole model only to learn its param groups by name: the
        # consolidated checkpoint numbers parameters the way the single-device optimizer does. Its optimizers also
        # show, before any collective, one that re-evaluates the loss in `step(closure)` (LBFGS).
        names = {id(p): name for name, p in module.named_parameters()}
        optimizers, _ = _compat.init_optimizers_and_lr_schedulers(module)
        if fitting:
            check_single_evaluation_optimizers(optimizers)
        return [optimizer_layout(opt, names) for opt in optimizers]

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
        engine = self.engine
        # ZeRO-1/2 with an overlapped all-gather: what no block's forward pre-hook waits for, now.
        self._current_run.sync.wait_for_parameters(everywhere=False)
        self._check_same_trainable_parameters(module)
        with self.precision_plugin.train_step_context():
            model_inputs, size = engine.capture_inputs("training_step", args, kwargs)
            if size % engine.num_microbatches:
                raise ValueError(
                    f"The training batch size {size} is not divisible by `num_microbatches={engine.num_microbatches}`;"
                    " the pipeline splits every batch into equal micro-batches. Use a batch size that is a multiple"
                    f" of {engine.num_microbatches}."
                )
            accumulate = module.trainer.accumulate_grad_batches
            params = list(module.parameters())
            previous = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                with self.events.timed("pipeline_step"):
                    outcome = engine.train_step(
                        "training_step",
                        args,
                        kwargs,
                        model_inputs=model_inputs,
                        divisor=engine.num_microbatches * accumulate,
                    )
            finally:
                # This batch's gradients are handed over in `backward`, after Lightning's `zero_grad`.
                self._current_run.pending_grads = [p.grad for p in params]
                for p, grad in zip(params, previous, strict=True):
                    p.grad = grad
        self._replay(outcome)
        assert outcome.loss is not None  # a training step always has one
        loss = outcome.loss.to(self.root_device).requires_grad_()
        return {"loss": loss, **outcome.extra} if outcome.extra else loss

    def _check_same_trainable_parameters(self, module: Any) -> None:
        """Collective (every rank, every step, with data parallelism). The replicas of a stage average its gradients,
        so they must agree on which parameters require grad (user code may change ``requires_grad`` between steps);
        a disagreement raises on every rank, naming the parameters and ranks, before the schedule's first send."""
        dims = self.parallel_dims
        if dims.data_parallel_size == 1:
            return
        p = dims.pipeline_parallel_size
        check_same_trainable_parameters_within(
            module,
            cohorts=[rank % p for rank in range(dims.world_size)],
            owner="PipelineParallelStrategy",
            device=self.root_device,
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._hook_windows.close()  # Lightning calls this right after the module's `on_train_batch_start`
        super().on_train_batch_start(batch, batch_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        batches = DivisibleBatches(dataloader, self.num_microbatches, self._warn_skipped_batch)
        if batches.known_partial_batch is not None:
            self._warn_skipped_batch(batches.known_partial_batch)
        return batches

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
        self._current_run.sync.wait_for_parameters()
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
        run = self._current_run
        pending, run.pending_grads = run.pending_grads, None
        if pending is not None:
            for p, grad in zip(module.parameters(), pending, strict=True):
                if grad is not None:
                    p.grad = grad if p.grad is None else p.grad + grad
        with self._hook_windows.window("on_after_backward"):  # post_backward calls it; the whole model if overridden
            return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        sync = self._current_run.sync
        calls = 0

        def closure_then_reduce() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:  # an optimizer we do not know to refuse at setup, re-evaluating like LBFGS
                raise closure_evaluated_twice(unwrap_optimizer(optimizer))
            result = closure()
            with self.events.timed("exposed_communication"):
                sync.reduce_gradients()  # over the replicas of each stage, then the tied copies' sum
            # The precision plugin calls `on_before_optimizer_step` next: the whole model if overridden.
            self._hook_windows.open("on_before_optimizer_step")
            return result

        try:
            output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        finally:
            self._hook_windows.close()
        with self.events.timed("exposed_communication"):
            sync.after_optimizer_step(unwrap_optimizer(optimizer))  # ZeRO-1/2: all-gather the stepped buckets
        return output

    @override
    def instrumentation(self) -> Instrumentation:
        return Instrumentation(
            data_parallel_size=self.mesh_layout.data_parallel_size,
            times_exposed_communication=True,
            is_pipeline=True,
        )

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` with the norm over the parameters of all stages (a tied parameter
        counted once, on the lowest pipeline rank holding a copy)."""
        self._current_run.sync.clip_grad_norm_(unwrap_optimizer(optimizer), clip_val)

    @override
    def gradient_tensors(self) -> list[Tensor]:
        """The parameters' ``.grad`` (at ``zero_stage=3`` their shards) and, with ``zero_stage`` 1-2, the stage's
        gradient buckets."""
        buffers = self._run.sync.gradient_buffers() if self._run is not None else []
        return [*super().gradient_tensors(), *buffers]

    @override
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds (measured from its tensors: at ``zero_stage=3`` the local shards); with ``zero_stage``
        1-2 the stage's flat buckets and
        the optimizer state of this replica's shard, summed over the optimizers."""
        if self._run is None:
            return super().memory_report()
        return self._run.sync.memory_report(self.unwrapped_optimizers())

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
        self._checkpoints.save(
            self._run, self.module, checkpoint, filepath, optimizer=optimizer, write=write, broadcast=self.broadcast
        )
        return None

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.is_split:
            return super().load_model_state_dict(checkpoint, strict=strict)
        run = self._current_run
        load_local_state(
            self.module,
            checkpoint["state_dict"],
            run.full_state_keys,
            strict=strict,
            aliases=run.aliases,
            load=run.sync.load_model_entries,
        )
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        run = self._current_run
        for optimizer, state, layout in zip(
            self.unwrapped_optimizers(), checkpoint["optimizer_states"], run.optimizer_layouts, strict=True
        ):
            run.sync.load_optimizer_state(optimizer, WholeOptimizerState(state, layout))
        _compat.optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        self._hook_windows.detach()
        run = self._run
        if run is not None:
            if run.engine is not None:
                run.engine.clear()  # the stages' receive buffers
                self._reassemble(run)
            run.sync.teardown()
        super().teardown()

    def _reassemble(self, run: PipelineRun) -> None:
        """Give the user's module back whole on every rank (a collective), unless the run failed (then its
        placeholders raise on access). A later run of this Trainer splits the module afresh."""
        module = self.lightning_module
        if run.failed or module is None:
            if module is not None:
                mark_orphaned(module)
            return
        self._wait_for_peers("the teardown's gather of the stages")  # a peer that failed after training skips it
        run.sync.wait_for_parameters()
        run.sync.restore_layers()  # ZeRO-3: the shards gathered into the user's layers, back in the module
        reassemble(
            module,
            layers=run.layers,
            registrations=run.registrations,
            plan=run.plan,
            dims=run.dims,
            device=self.root_device,
            tied=run.tied.layout.parameters,
        )
        run.drop_split()

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


def _check_callbacks(callbacks: Any, *, zero_stage: int, pipeline_parallel_size: int, checkpoint_format: str) -> None:
    """Refuse (on every rank, before a collective) callbacks that change parameters where a rank holds only its
    stage (or, at ``zero_stage=3``, its shards), and averaging with a checkpoint format it cannot write."""
    if pipeline_parallel_size > 1 or zero_stage == 3:
        check_parameter_callbacks(callbacks, strategy_name="pipeline", layout="only its stage's layers on each rank")
    if zero_stage == 3:
        _refuse_averaging_under_zero3(callbacks)
    check_averaging_checkpoint_format(callbacks, strategy_name="pipeline", checkpoint_format=checkpoint_format)


def _refuse_averaging_under_zero3(callbacks: Any) -> None:
    """Weight averaging's copy of the module is held as this rank's stage (``StageCopyLayout``), not as its shards:
    refused (on every rank, before a collective) rather than averaging whole copies of sharded parameters."""
    for callback in callbacks:
        if isinstance(callback, AVERAGING_CALLBACKS):
            raise ValueError(
                f"`{type(callback).__name__}` is not supported with `PipelineParallelStrategy(zero_stage=3)`: its"
                " averaged copy would hold the stage's whole parameters, not their shards. Use `zero_stage=2` (or"
                " 0-1) with weight averaging."
            )


def _tied_gradient_sync(layout: TiedLayout, dims: ParallelDims, previous: PipelineRun | None) -> TiedGradientSync:
    """The previous split's when the layout is the same (its process groups exist), else a new one (a collective
    when ranks hold copies: new groups)."""
    if previous is not None and previous.tied.layout == layout:
        return previous.tied
    return TiedGradientSync(layout, dims)
