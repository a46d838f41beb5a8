"""ShardedOptimizerStrategy: ZeRO stages 1, 2 and 3 as a Lightning strategy."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel._compat import optimizers_to_device, sync_module_states
from lightning_parallel.accounting import MemoryReport
from lightning_parallel.choices import check_choice
from lightning_parallel.distributed.activation_checkpointing import ActivationCheckpointing
from lightning_parallel.distributed.averaged_copy import shard_whole_state
from lightning_parallel.distributed.checkpoint import ShardedCheckpointReader, is_sharded_checkpoint
from lightning_parallel.distributed.mesh import MeshLayout, validate_tensor_parallel_size
from lightning_parallel.distributed.tensor_parallel import whole_layers
from lightning_parallel.distributed.trainable import check_same_trainable_parameters
from lightning_parallel.distributed.zero.backends import ZeroBackend, ZeroContext, backend_type
from lightning_parallel.distributed.zero.config import (
    MasterWeights,
    OverlapParamGather,
    Stage,
    ZeroConfig,
    ZeroGradientCompression,
    zero_options,
)
from lightning_parallel.distributed.zero.gradient_loan import GradientLoan, LendOnRead
from lightning_parallel.fault_tolerance.config import FaultTolerance
from lightning_parallel.fault_tolerance.replicas import FaultTolerantReplicas
from lightning_parallel.fault_tolerance.shard_state import OwnedShardState
from lightning_parallel.instrumentation import Instrumentation
from lightning_parallel.lightning_optimizer import unwrap_optimizer
from lightning_parallel.strategies.base import LightningParallelStrategy
from lightning_parallel.strategies.batchnorm import check_layer_sync
from lightning_parallel.strategies.checkpointing import save_sharded
from lightning_parallel.strategies.clipping import LentGradients
from lightning_parallel.strategies.gradient_readers import gradient_readers, lends_every_step, reader_of_this_read
from lightning_parallel.strategies.launch import ConsolidatingLauncher, StartMethod
from lightning_parallel.strategies.nonfinite import NonFiniteLoss
from lightning_parallel.strategies.options import FieldOf, base_options
from lightning_parallel.strategies.parameter_callbacks import (
    TrainerParameterCallbacks,
    check_averaging_checkpoint_format,
)
from lightning_parallel.strategies.tensor_parallel import check_plan_early, split_module
from lightning_parallel.strategies.zero_precision import zero_precision

__all__ = ["ShardedOptimizerStrategy"]

CheckpointFormat = Literal["consolidated", "sharded"]


class ShardedOptimizerStrategy(LightningParallelStrategy):
    """ZeRO data parallelism: shard optimizer state (stage 1), gradients (stage 2) or parameters too (stage 3).

    Every rank trains on its own slice of the global batch as in data parallel, with the same communication volume
    (reduce-scatter + all-gather = all-reduce), but holds only ``1/N`` of the sharded states. Memory per rank with
    ``Psi`` parameter bytes, ``K`` optimizer bytes per parameter byte and ``N`` ranks (ZeRO paper, fp32):
    stage 1 ``2*Psi + K*Psi/N``, stage 2 ``Psi + (1 + K)*Psi/N``, stage 3 ``(2 + K)*Psi/N``.

    Stages 1-2 are our own implementation (flat buckets reduce-scattered as backward produces them, the user's
    optimizer stepping only its shard, parameters all-gathered after the step). Stage 3 applies torch's FSDP2
    ``fully_shard`` per repeated block of the model automatically; create the model under
    ``trainer.init_module(empty_init=True)`` (or in ``configure_model``) so no rank ever materialises all of it.

    Works with any ``torch.optim`` optimizer whose update is element-wise (AdamW, Adam, SGD, RMSprop, Adagrad, ...);
    one that needs a parameter's whole shape (LBFGS, Adafactor, SparseAdam, Muon) is refused at stages 1-2. Several
    optimizers (a GAN in manual optimization) work at every stage, also when they share parameters: each steps them
    with its own state, as on one device.

    ``Trainer(precision="bf16-true")`` trains as the ZeRO paper does (section 3.1): bf16 parameters and gradients for
    compute, gradients reduced in fp32, and fp32 master weights in each rank's shard that the optimizer steps (so its
    state is fp32 too). With ``Psi`` parameters and AdamW a rank holds ``2*Psi`` bytes of bf16 parameters, ``2*Psi``
    of bf16 gradients (stage 1) and ``12*Psi/N`` of fp32 masters and moments; docs/zero.md gives each stage's exact
    bytes. ``memory_report()`` counts the masters as optimizer state.

    Hybrid sharding (FSDP's ``HYBRID_SHARD``, torchtitan's ``dp_replicate x dp_shard``): ``shard_size=K`` shards over
    groups of ``K`` consecutive ranks (e.g. the devices of one node) and replicates across the ``world_size / K``
    groups: ``N`` above becomes ``K``, and each step adds one all-reduce of the reduced gradient shard (``Psi / K``
    bytes) across the groups, so gradients are averaged over every rank and training equals one device on the
    global batch. The layout is :attr:`device_mesh`'s ``("replicate", "shard")`` axes (``distributed/mesh.py``).

    Fault-tolerant hybrid sharding (``fault_tolerance=FaultTolerance(...)``, stages 1-2, torchft): each replica group
    is its own job of ``K`` processes sharding among themselves, and the replicate axis goes through torchft across
    the groups alive at each step: rank ``i`` of every group averages its reduced gradient shard with rank ``i`` of
    the others, the optimizer steps only if the step committed, a group that dies leaves the others training, and a
    restarted group's rank ``i`` fetches its shard of parameters and optimizer state from rank ``i`` of a live group
    (docs/reliability.md).

    Args:
        stage: 1, 2 or 3.
        tensor_parallel_size: ranks that split each layer's matrices (tensor parallelism, the mesh's innermost
            ``tensor`` axis; default 1: off). The layers to split come from the LightningModule's
            ``tensor_parallel_plan()`` or the Hugging Face model's ``tp_plan`` (docs/tensor_parallel.md); the ZeRO
            stage then shards over the ``world_size / tensor_parallel_size`` data-parallel ranks (stages 1-2: the
            flat buckets hold each split weight's local slice), each tensor-parallel group reading the same slice of
            the batch. Clipping is on the global norm, hooks read whole gradients, checkpoints stay consolidated in
            the single-device layout.
        shard_size: ranks per shard group (a divisor of the world size); ``None`` (default) shards over every rank.
            Stages 1-2 reduce-scatter (gloo: all-reduce) each gradient bucket within the group, all-reduce the
            ``1/K`` shard across the groups and all-gather the stepped parameters within the group; stage 3 is
            FSDP2's HSDP (``fully_shard`` on the 2-D mesh). Checkpoints do not depend on it: either format resumes
            under another ``shard_size``, another world size or another strategy.
        start_method: ``"popen"`` (scripts, CLI, torchrun, SLURM), ``"spawn"`` or ``"fork"`` (notebooks).
        timeout: seconds (or ``timedelta``) a collective may wait before the job fails.
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        bucket_cap_mb: size of the flat gradient buckets of stages 1-2, in MiB (stage 2: at most a thirty-second of the
            model, so that its peak stays at or below stage 1's).
        checkpoint_format: ``"consolidated"`` writes one Lightning ``.ckpt`` whose model and optimizer state have the
            plain single-device layout (rank 0 gathers); ``"sharded"`` writes a directory in parallel from all ranks
            with ``torch.distributed.checkpoint``. Both load at any world size and under the other strategies.
        activation_checkpointing: recompute blocks in backward instead of keeping their activations: ``False``,
            ``True`` (every repeated block, the units stage 3 shards) or a set of module classes such as ``{Block}``;
            ``"selective"``: every repeated block keeps every other matrix product's output and the attention's
            (torchtitan's per-op policy; ``SelectiveCheckpointing(blocks={Block})`` for chosen classes). Applied
            before FSDP2 wraps the units; parameter names and checkpoints are unchanged; see docs/memory.md.
        nonfinite_loss: what every rank does when the loss is NaN/inf on any rank: ``"skip"`` the step (default),
            ``"stop"`` (raise ``FloatingPointError``) or ``"ignore"`` (no check).
        overlap_param_gather: stages 1-2: ``True`` or ``"auto"`` (default) start the all-gather of the stepped
            parameters after the step and wait for each bucket where it is first needed (each repeated block's at its
            forward, the others' before the training step), so it overlaps the next forward as in Megatron. Code that
            runs in between (callbacks' and the module's ``on_train_batch_end``, an EMA, manual optimization after
            ``opt.step()``) cannot read a stale value: any torch operation on a parameter there first waits for its
            bucket (``distributed/zero/gather.py``), so a callback that reads no parameter keeps the overlap and one
            that does reads what it would without it. ``False`` waits at the end of the step. Checkpoints,
            evaluation and backward always see current parameters.
        fault_tolerance: stages 1-2: ``FaultTolerance(replica_group=..., num_replica_groups=..., lighthouse=...)``
            makes this job one replica group of a fault-tolerant run (torchft, an optional extra), sharding over all
            of its processes (``shard_size`` ``None`` or the job's world size, at least 2) and averaging the gradient
            shards over the groups alive at each step (the class docstring, docs/reliability.md). ``None``: off.
        master_weights: with 16-bit parameters (``precision="bf16-true"`` or ``"16-true"``), ``"fp32"`` (default)
            keeps an fp32 master copy of this rank's shard that the optimizer steps, rounded to the 16-bit weights
            after each step, and reduces gradients in fp32; ``None`` steps the 16-bit parameters directly, as plain
            Lightning does. No effect under ``32-true`` and the ``*-mixed`` precisions (the parameters are fp32
            already). World size 1 keeps the masters too (of every parameter: nothing to shard), so a run moved
            between 1 and N devices keeps its arithmetic. Consolidated checkpoints hold the 16-bit ``state_dict``
            and the masters under each optimizer state's ``"master_weights"`` entry, at every world size.
        gradient_compression: ``"bf16"`` or ``"fp16"`` reduces the gradients in that dtype (half the bytes of fp32 on
            the wire), as FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)`` and DeepSpeed's
            ``communication_data_type`` do, and as ``DataParallelStrategy(gradient_compression=...)`` names it: each
            rank's gradients are cast, divided by the world size, reduced (also across the replica groups under
            ``shard_size``), and the result is written into the shard in its own dtype (fp32 under ``32-true`` or
            beside fp32 masters), which the optimizer steps. Stages 1-2 cast each bucket as it is launched (the
            unreduced sum of accumulated micro-batches stays in the bucket's dtype); stage 3 is FSDP2's
            ``reduce_dtype`` (FSDP2 keeps a unit's unreduced sum over accumulated micro-batches in it). ``None``
            (default): reduce in the shard's dtype. No effect at world size 1 (nothing is reduced). docs/zero.md.
        accelerator: set by the Trainer from its ``accelerator`` argument; pass it only to override Lightning's choice.
        parallel_devices: set by the Trainer from ``devices``.
        cluster_environment: set by the Trainer from the launcher it detects (torchrun, SLURM, MPI, ...).
        checkpoint_io: set by the Trainer (its ``plugins``); the default saves with ``torch.save``.
        precision_plugin: set by the Trainer from ``precision``.
    """

    strategy_name = "sharded_optimizer"
    launcher_type = ConsolidatingLauncher  # fork/spawn: the parent process gets the whole model, not rank 0's shard

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        *,
        tensor_parallel_size: int = 1,
        shard_size: int | None = None,
        start_method: StartMethod = "popen",
        timeout: timedelta | float = default_pg_timeout,
        process_group_backend: str | None = None,
        bucket_cap_mb: float = 25.0,
        checkpoint_format: CheckpointFormat = "consolidated",
        nonfinite_loss: NonFiniteLoss = "skip",
        activation_checkpointing: ActivationCheckpointing = False,
        master_weights: MasterWeights = "fp32",
        gradient_compression: ZeroGradientCompression = None,
        overlap_param_gather: bool | Literal["auto"] = "auto",
        fault_tolerance: FaultTolerance | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        config = ZeroConfig(stage=stage, **zero_options(locals()))  # validates (before any collective)
        check_choice("checkpoint_format", checkpoint_format, CheckpointFormat)
        _check_tensor_parallel_options(tensor_parallel_size, config, checkpoint_format, fault_tolerance)
        if fault_tolerance is not None and stage == 3:
            raise ValueError(
                "`ShardedOptimizerStrategy(stage=3, fault_tolerance=...)` is not supported: fault tolerance across"
                " replica groups works with ZeRO stages 1-2 (`stage=1` or `stage=2`), or with"
                " `DataParallelStrategy(fault_tolerance=...)`."
            )
        replicas = None
        if fault_tolerance is not None:
            replicas = FaultTolerantReplicas(fault_tolerance, owner=f"ShardedOptimizerStrategy(stage={stage})")
        super().__init__(
            options=base_options(locals()),
            nonfinite_loss=nonfinite_loss,
            activation_checkpointing=activation_checkpointing,
        )
        self.zero_config = config
        """The ZeRO settings of the arguments above, validated; the backend chosen in ``setup`` is built from it."""
        self.tensor_parallel_size = tensor_parallel_size
        self.checkpoint_format = checkpoint_format
        self._backend: ZeroBackend | None = None
        self._keeps_masters_alone = False
        """World size 1 fitting 16-bit parameters with fp32 masters (set in ``setup``)."""
        self._memory_logged = False
        self._loan: GradientLoan | None = None
        """Whole averaged gradients lent to the parameters' ``.grad`` from backward until the step (hooks read them):
        after a sync, :attr:`_lend_on_read` (lends at the first read)."""
        self._lend_on_read: LendOnRead | None = None  # made at the first synchronised backward of each fit
        self._gradient_readers: list[str] | None = None  # decided at the first backward of each fit
        self._lends_every_step = False  # `reads_gradients = True` somewhere: the loan made before the hooks
        self._loan_reported = False
        self._syncs_gradients = True  # False inside `block_backward_sync` (accumulation)
        self.fault_tolerance = fault_tolerance
        self._replicas = replicas

    # ------------------------------------------------------------------ settings (read from `zero_config`)
    stage = FieldOf[Stage]("zero_config")
    shard_size = FieldOf[int | None]("zero_config")
    bucket_cap_mb = FieldOf[float]("zero_config")
    master_weights = FieldOf[MasterWeights]("zero_config")
    gradient_compression = FieldOf[ZeroGradientCompression]("zero_config")
    overlap_param_gather = FieldOf[OverlapParamGather]("zero_config")

    # ------------------------------------------------------------------ set-up
    @property
    @override
    def mesh_layout(self) -> MeshLayout:
        """``(world_size / shard_size) x shard_size x 1``; ``shard_size=None``: ``1 x world_size x 1``. Raises
        ``ValueError`` (on every rank, before the group is joined) for a ``shard_size`` that does not divide the
        world size."""
        if self._replicas is not None:
            self._check_fault_tolerant_layout()
        return MeshLayout.for_sharding(self.world_size, self.shard_size, tensor_parallel_size=self.tensor_parallel_size)

    @override
    def setup_environment(self) -> None:
        # Local, on every rank before the group is joined: a module built already has a plan that fits the size.
        check_plan_early(self.lightning_module, self.tensor_parallel_size, owner=self._owner)
        super().setup_environment()

    @property
    def _owner(self) -> str:
        t = f", tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return f"ShardedOptimizerStrategy(stage={self.stage}{t})"

    def _check_fault_tolerant_layout(self) -> None:
        """Local: with ``fault_tolerance`` the job is one replica group, whose processes form one shard group."""
        owner = f"ShardedOptimizerStrategy(stage={self.stage}, fault_tolerance=...)"
        if self.world_size < 2:
            raise ValueError(
                f"`{owner}` runs each replica group as one shard group of its processes, and this job has one process:"
                " it would shard nothing. Start each group with 2 or more processes (devices), or use"
                " `DataParallelStrategy(fault_tolerance=...)` for groups of one process."
            )
        if self.shard_size not in (None, self.world_size):
            raise ValueError(
                f"`{owner}`: `shard_size={self.shard_size}` must equal the replica group's process count"
                f" ({self.world_size}): each replica group is its own job and one shard group; the replicate axis is"
                f" the groups themselves (torchft). Pass `shard_size={self.world_size}` or `shard_size=None`, and run"
                " more replica groups instead of several shard groups per job."
            )

    @property
    def is_sharding(self) -> bool:
        """Whether states are sharded (world size > 1); at world size 1 training is plain single-device, except that
        16-bit parameters are stepped through fp32 masters while fitting (``master_weights="fp32"``)."""
        return self.world_size > 1

    @property
    def backend(self) -> ZeroBackend:
        """How this run holds the model and optimizer state (chosen in ``setup``; see ``distributed.zero_backends``)."""
        if self._backend is None:
            raise RuntimeError("`ShardedOptimizerStrategy.backend` is chosen in `setup`; it was read before that.")
        return self._backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Stage 3 models may live on the meta device until setup shards them; load into the sharded model.
        return True

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        on_meta = empty_init and backend_type(self.stage, is_sharding=self.is_sharding).empty_init_on_meta
        on_meta = on_meta and self.tensor_parallel_size == 1  # tensor parallelism splits weights that exist
        context = torch.device("meta") if on_meta else nullcontext()
        with context, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # local, before any collective
            check_averaging_checkpoint_format(
                trainer.callbacks, strategy_name=f"zero{self.stage}", checkpoint_format=self.checkpoint_format
            )
        if fitting and self._layer_sync:
            check_layer_sync(self._layer_sync, f"zero{self.stage}", self.root_device, supported=True)
            self.model = self._layer_sync.apply(self.model)
        if fitting:
            self._check_same_trainable_parameters()  # before the buckets or FSDP2 units lay out the gradients
        context = ZeroContext(
            rank=self.global_rank,
            world_size=self.world_size,
            mesh=self.device_mesh if self.is_sharding else None,
            events=self.events,
            stats=self.communication_stats if self.track_communication else None,
            parameter_callbacks=TrainerParameterCallbacks(trainer.callbacks),
            warn=rank_zero_warn,
            sync_module_states=sync_module_states,
            replicas=self._replicas if fitting else None,
            host_group=self.host_groups.data_parallel if self.is_sharding else None,
        )
        self._backend = backend_type(self.stage, is_sharding=self.is_sharding)(self.zero_config, context)
        self._backend.convert_module(self.model, convert=self.precision_plugin.convert_module)
        self._keeps_masters_alone = (
            fitting and not self.is_sharding and self.master_weights == "fp32" and _has_16bit_parameters(self.model)
        )
        if self._keeps_masters_alone:
            # World size 1 converts the module as plain Lightning does (`bf16-true` casts it); only now is it known
            # that 16-bit parameters are to be stepped through fp32 masters, by the backend that keeps them.
            self._backend = backend_type(self.stage, is_sharding=False, keeps_masters=True)(self.zero_config, context)
        if self.tensor_parallel_size > 1:  # torchtitan's order: tensor parallel, activation checkpointing, FSDP2
            split_module(self.module, self.device_mesh, self.root_device, owner=self._owner)
        self._apply_activation_checkpointing(self.module)  # before FSDP2 (stage 3) wraps its units
        self._backend.setup_module(self.module, self.root_device)
        if fitting:
            self.setup_optimizers(trainer)
            self._validate_optimizers()
            if self._replicas is not None:
                self._replicas.check_supported(trainer, self.module)  # local; the groups are joined at train start
            self._backend.setup_optimizers(self.unwrapped_optimizers())
        self._loan, self._lend_on_read, self._gradient_readers, self._loan_reported = None, None, None, False
        lent = LentGradients(
            hand_back=self._hand_back_gradients,
            parameters=self._lent_parameters,
            taken_back=self._gradients_taken_back,
            unwatched=self._reading_own_gradients,
        )
        self.precision_plugin = zero_precision(self._backend, self.precision_plugin, self.root_device, lent=lent)
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._replicas is not None:
            self._join_replica_groups(self.module.trainer)

    def _join_replica_groups(self, trainer: Any) -> None:
        """Fitting with ``fault_tolerance``, at train start (after Lightning restored a checkpoint, which this strategy
        loads after ``setup``: a live group's state must win over this group's own older checkpoint): start this
        rank's torchft manager (its peers are the same rank of the other groups), wait for the groups
        (``start_together``), then make the group's parameters whole again if a live group's shards were loaded
        while joining."""
        assert self._replicas is not None and self.cluster_environment is not None
        buckets = getattr(self._backend, "buckets", None)  # stages 1-2 at world size >= 2: the flat buckets' backend
        assert buckets is not None
        optimizers = self.unwrapped_optimizers()
        state = OwnedShardState(buckets, self.module, optimizers[0]) if len(optimizers) == 1 else None
        environment = self.cluster_environment
        self._replicas.setup(
            trainer,
            self.module,
            group_rank=self.global_rank,
            group_world_size=self.world_size,
            store=(environment.main_address, environment.main_port),
            model_state=state,
            zero_gradients=state.zero_gradients if state is not None else None,
            bucket_shards=[bucket.shard_numel for bucket in buckets.buckets],
        )
        if state is not None:
            state.settle()

    @contextmanager
    def full_module(self) -> Generator[nn.Module, None, None]:
        """Collective on entry: the whole module on every rank until exit, so code that runs on one rank only
        (sampling, an evaluation on rank 0) may call it. Enter on every rank::

            trainer.fit(model)
            with trainer.strategy.full_module():
                if trainer.is_global_zero:
                    sample = model.generate(prompt)

        Stage 3 all-gathers every parameter once on entry and frees the whole copies on exit (each rank holds the
        full parameters in between; changes to them are dropped); stages 1-2 hold whole parameters anyway. With
        ``tensor_parallel_size``, the weights split over the tensor axis are gathered whole too and torch's parallel
        styles' hooks lifted until exit, so the layers compute without their tensor-parallel group
        (``distributed/tensor_parallel/whole.py``). Outside this block a stage-3 module called outside a Trainer
        raises a ``RuntimeError`` instead of hanging.
        """
        if self._backend is None:  # never set up: the module as it is
            yield self.module
            return
        with self._backend.full_module() as module, whole_layers(module) as whole:
            yield whole

    def _validate_optimizers(self) -> None:
        optimizers = self.unwrapped_optimizers()  # several may hold the same parameter, as on one device
        if len(optimizers) > 1 and self._writes_sharded:
            raise ValueError(
                f"`checkpoint_format='sharded'` holds one optimizer, `configure_optimizers` returned"
                f" {len(optimizers)}. Use `checkpoint_format='consolidated'` (the default) with several optimizers."
            )

    @override
    def configure_ddp(self) -> None:
        pass  # no DDP wrapper: gradients are synchronised by the backend (our buckets or FSDP2)

    # ------------------------------------------------------------------ training
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the non-final micro-batches of gradient accumulation."""
        self._syncs_gradients = False
        try:
            with self.backend.no_sync():
                yield None
        finally:
            self._syncs_gradients = True

    def _check_same_trainable_parameters(self) -> None:
        """Collective while sharding: the ranks agree on which parameters require grad, or every rank raises naming
        them (one all-reduce of two integers; names travel only on a mismatch). Otherwise stages 1-2 would train a
        parameter frozen on one rank with the others' gradients, and stage 3 reduce-scatter different layouts."""
        if self.is_sharding:
            assert self.model is not None
            owner = f"ShardedOptimizerStrategy(stage={self.stage})"
            # On the host group: no device sync, no wait behind the parameter all-gathers of the shard group.
            check_same_trainable_parameters(self.model, owner=owner, group=self.host_groups.world)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_same_trainable_parameters()  # every step: `requires_grad` may change between steps
        self.backend.wait_for_parameters(everywhere=False)  # the rest waits in the blocks' forward pre-hooks
        if self._replicas is not None:
            self._replicas.start_step()  # the quorum of replica groups, in the background during forward/backward
        output = super().training_step(*args, **kwargs)
        self._decide_skip_step(output)
        return output

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self._hand_back_gradients()  # manual optimization: a second backward before the step adds to the shards
        super().pre_backward(closure_loss)
        self.backend.wait_for_parameters()  # a block this forward did not use: current before any backward hook

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's order, except that the gradients are averaged *before* ``on_after_backward`` (Lightning calls
        it from the precision plugin's ``post_backward``, ahead of the strategy's), as DDP averages them inside
        backward: a hook then reads them whole and averaged, not while the collectives write them."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self._replicas is not None and self._syncs_gradients:
            self._reduce_over_replica_groups()
        else:
            held = self.backend.reduce_gradients()
            self._drop_gradients_if_skipped(held)  # every rank decided the same: no step on non-finite gradients
        if self._gradients_are_read():
            self._start_loan()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # `on_after_backward`
        if not self._syncs_gradients:  # accumulating: the next backward adds to the buckets, not to the loan
            self._hand_back_gradients()
        return closure_loss

    def _reduce_over_replica_groups(self) -> None:
        """``fault_tolerance``: the buckets' sync averages the gradient shards inside the group, then across the
        groups (torchft); the optimizer steps only if the step committed. A group whose loss was non-finite sends
        zeros and steps with the others' average, as a data-parallel group does, so the groups' weights stay equal."""
        assert self._replicas is not None
        check, self._finite_check = self._finite_check, None
        self._replicas.send_zeros = check is not None and check.should_skip()
        held = list(self.backend.reduce_gradients())
        self._replicas.commit(held)

    def _gradients_are_read(self) -> bool:
        """Whether code may read ``.grad`` between backward and the step: manual optimization, or a module or user
        callback overriding ``on_after_backward`` / ``on_before_optimizer_step`` without ``reads_gradients = False``
        (decided once per fit)."""
        if self._gradient_readers is None:
            trainer: Any = self.module.trainer
            self._gradient_readers = gradient_readers(self.module, trainer.callbacks)
            self._lends_every_step = lends_every_step(self.module, trainer.callbacks)
        return bool(self._gradient_readers)

    def _start_loan(self) -> None:
        """Local. After a sync: lend at the first read of a ``.grad`` (``LendOnRead``: collective then, on every rank),
        so a step whose hooks read none costs nothing; in a micro-step without a sync: views of this rank's sums.
        Collective (the loan, now) under ``reads_gradients = True``."""
        if not self._syncs_gradients or self._lends_every_step:
            self._loan = self.backend.lend_gradients(synced=self._syncs_gradients)
            return
        if self._lend_on_read is None:
            self._lend_on_read = LendOnRead(
                lambda: self.backend.lend_gradients(synced=True),
                parameters=list(self.module.parameters()),
                group=self.host_groups.world if self.world_size > 1 else None,
                on_lend=self._report_first_loan,
            )
        self._lend_on_read.open()
        self._loan = self._lend_on_read

    def _report_first_loan(self, loan: GradientLoan, read_here: bool) -> None:
        """Once a fit, on rank 0: what read a gradient and what lending costs on each step with such a read."""
        if self._loan_reported:
            return
        self._loan_reported = True
        where = f"in `{reader_of_this_read()}`" if read_here else "on another rank"
        rank_zero_info(
            f"ShardedOptimizerStrategy(stage={self.stage}): a parameter's `.grad` was read {where}, so every rank lends"
            f" the whole averaged gradients to `.grad` for this step: {loan.gathered_bytes / 2**20:.2f} MiB"
            f" all-gathered and {loan.allocated_bytes / 2**20:.2f} MiB more held until the step, per rank, on every"
            f" step whose code reads a `.grad`. Code that may read: {', '.join(self._gradient_readers or [])}; one that"
            " overrides a gradient hook without reading `.grad` can say so with the class attribute"
            " `reads_gradients = False` (docs/zero.md)."
        )

    @contextmanager
    def _reading_own_gradients(self) -> Generator[None, None, None]:
        """Local. Our own reads of ``.grad`` (clipping over shards, the monitor's count) lend nothing."""
        watch = self._lend_on_read
        with nullcontext() if watch is None else watch.unwatched():
            yield

    def _hand_back_gradients(self) -> None:
        """Local. End the loan of whole gradients to ``.grad``: this rank's slices of them go to the optimizer."""
        loan, self._loan = self._loan, None
        if loan is not None:
            loan.hand_back()

    def _lent_parameters(self, optimizer: Optimizer) -> list[Tensor] | None:
        """Local. While gradients are lent: the module's parameters ``optimizer`` steps, whose ``.grad`` a clip by the
        user (``self.clip_gradients``) must clip so that the ``.grad`` read next and the step both see it."""
        if self._loan is None or (isinstance(self._loan, LendOnRead) and self._loan.loan is None):
            return None  # nothing lent (yet): the shards hold the gradients
        return list(self.backend.parameters_stepped_by(unwrap_optimizer(optimizer)))

    @contextmanager
    def _gradients_taken_back(self) -> Generator[None, None, None]:
        """Collective while gradients are lent or watched (the loan's end agreed on entry; watched again on exit, so
        a later read lends again). The loan ended for the length of the block, so that the optimizer's own tensors
        hold every change made to ``.grad``: the grad scaler unscales them in it (``16-mixed``)."""
        lent = self._loan is not None
        self._hand_back_gradients()
        yield
        if lent:
            self._start_loan()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self._memory_logged:  # before the all-gather starts: its stale-read guard would wait for the sizes
            self._memory_logged = True
            self._log_memory_reports()
        self.backend.after_optimizer_step(unwrap_optimizer(optimizer))
        return output

    def _log_memory_reports(self) -> None:
        """Once, after the first step (optimizer state exists from then on): the bytes every rank holds."""
        report = self.memory_report().as_dict()
        reports: list[Any] = [report]
        if self.is_sharding:
            reports = [None] * self.world_size
            dist.all_gather_object(reports, report)
        lines = [f"ShardedOptimizerStrategy(stage={self.stage}) bytes held per rank (MiB):"]
        lines += [
            f"  rank {rank}: " + ", ".join(f"{key} {value / 2**20:.2f}" for key, value in entry.items())
            for rank, entry in enumerate(reports)
        ]
        rank_zero_info("\n".join(lines))

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank really holds (measured from its tensors);
        optimizer state summed over every optimizer."""
        return self.backend.memory_report(self.unwrapped_optimizers())

    @override
    def gradient_tensors(self) -> list[Tensor]:
        lent = [] if self._loan is None else self._loan.buffers()
        with self._reading_own_gradients():
            return [*super().gradient_tensors(), *self.backend.gradient_buffers(), *lent]

    @override
    def instrumentation(self) -> Instrumentation:
        return Instrumentation(
            data_parallel_size=self.mesh_layout.data_parallel_size,
            tap=self.backend.collective_tap,
            times_exposed_communication=self.backend.times_exposed_communication,
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self.backend.after_evaluation_step()
        return output

    @override
    def on_validation_start(self) -> None:
        self.backend.wait_for_parameters()
        self._broadcast_buffers()

    @override
    def on_test_start(self) -> None:
        self.backend.wait_for_parameters()
        self._broadcast_buffers()

    @override
    def on_predict_start(self) -> None:
        self.backend.wait_for_parameters()
        self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        """Evaluate with rank 0's buffers (e.g. BatchNorm running statistics) on every rank, as DDP does: each rank
        updates its own copy while training, and rank 0's is the one a checkpoint keeps."""
        if self.is_sharding and self.lightning_module is not None:
            for buffer in self.module.buffers():
                if not buffer.is_meta:
                    dist.broadcast(buffer, src=0)

    # ------------------------------------------------------------------ checkpoints
    @property
    def _writes_sharded(self) -> bool:
        return self.checkpoint_format == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._writes_sharded:
            return {}  # written piece by piece in `save_checkpoint`, without a gather
        return self.consolidated_state_dict()

    def consolidated_state_dict(self) -> dict[str, Any]:
        """Collective. The whole model's plain state dict under its own names (complete on rank 0)."""
        return self.backend.model_state()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.backend.load_model_state(checkpoint["state_dict"], strict=strict)
        current = checkpoint.get("current_model_state")
        if isinstance(checkpoint, dict) and isinstance(current, Mapping):
            # A `WeightAveraging` checkpoint: its `on_load_checkpoint`, next, loads the module's own weights from here
            # with the module's `load_state_dict`, past the strategy. Give it this rank's shards of the whole tensors
            # (a DTensor parameter takes only a DTensor); where parameters are whole this changes nothing.
            checkpoint["current_model_state"] = shard_whole_state(self.module, current)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._writes_sharded:
            return {}
        return self.backend.optimizer_state(unwrap_optimizer(optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer state(s), this run has {len(self.optimizers)}."
            )
        for optimizer, state in zip(self.unwrapped_optimizers(), states, strict=True):
            self.backend.load_optimizer_state(optimizer, state)
        optimizers_to_device(self.optimizers, self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self._writes_sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        optimizer = unwrap_optimizer(self.optimizers[0]) if self.optimizers else None
        parts = self.backend.sharded_pieces(optimizer)
        if self.mesh_layout.replicate_rank(self.global_rank) != 0:
            parts.pieces = []  # another replica group writes the same values (hybrid sharding)
        save_sharded(self, checkpoint, filepath, parts=parts, optimizer=optimizer)
        return None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory is read lazily: each rank later loads only the ranges it holds. At world size 1 with
        fp32 masters too: its ``param`` pieces are masters, which a plain state dict would round to 16 bits."""
        # Under tensor parallelism the parameters' local pieces are not the row ranges the reader serves: read it whole.
        lazy = (self.is_sharding or self._keeps_masters_alone) and self.tensor_parallel_size == 1
        if lazy and is_sharded_checkpoint(checkpoint_path):
            reader = ShardedCheckpointReader(checkpoint_path)
            checkpoint = dict(reader.meta["lightning"])
            checkpoint["state_dict"] = reader
            if reader.meta.get("param_groups") is not None:
                checkpoint["optimizer_states"] = [reader]
            return checkpoint
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._backend is not None:
            self._backend.abandon_in_flight()  # teardown follows: it must not wait for a failed peer
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._loan = None  # dropped, not handed back: training is over (or failed)
        if self._lend_on_read is not None:
            self._lend_on_read.discard()
        if self._replicas is not None:
            self._replicas.teardown()
        if self._backend is not None:  # setup may have failed before choosing it
            self._backend.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = [(f"zero{stage}", stage, "popen") for stage in (1, 2, 3)] + [("sharded_optimizer", 2, "popen")]
        entries += [(f"zero{stage}_notebook", stage, "fork") for stage in (1, 2, 3)]
        cls._register(
            strategy_registry,
            ((name, {"stage": stage, "start_method": method}) for name, stage, method in entries),
        )


def _check_tensor_parallel_options(
    tensor_parallel_size: object, config: ZeroConfig, checkpoint_format: str, fault_tolerance: FaultTolerance | None
) -> None:
    """Local, in ``__init__``: ``tensor_parallel_size`` is a positive integer, and above 1 only with what composes
    with it (consolidated checkpoints, no fault tolerance)."""
    validate_tensor_parallel_size(tensor_parallel_size)
    if tensor_parallel_size == 1:
        return
    given = f"ShardedOptimizerStrategy(stage={config.stage}, tensor_parallel_size={tensor_parallel_size}"
    if checkpoint_format != "consolidated":
        raise ValueError(
            f"`{given}, checkpoint_format={checkpoint_format!r})` is not supported: with tensor parallelism"
            " checkpoints are written consolidated (the single-device layout). Use `checkpoint_format='consolidated'`."
        )
    if fault_tolerance is not None:
        raise ValueError(
            f"`{given}, fault_tolerance=...)` is not supported: fault tolerance across replica groups runs without"
            " tensor parallelism. Drop `fault_tolerance` or `tensor_parallel_size`."
        )


def _has_16bit_parameters(module: nn.Module) -> bool:
    return any(param.dtype in (torch.bfloat16, torch.float16) for param in module.parameters())
