"""What all three strategies of this package do the same way, written once.

``LightningParallelStrategy`` sits between Lightning's ``DDPStrategy`` (process groups, launchers, collectives,
samplers: all three strategies use those as they are) and our strategies, each of which then shows only what makes
it different:

* launch: ``start_method`` and ``timeout`` validated on every rank; ``setup_environment`` checks the launch
  against torchrun/SLURM/MPI, joins the group and records where the peers run (``strategies/launch.py``);
  ``_configure_launcher`` refuses fork/spawn under an external launcher and uses our fork-safe launcher
  (:attr:`launcher_type`: the ZeRO and pipeline strategies send the whole model back to the parent);
* failures: ``on_exception`` names a dead peer (``strategies/failures.py``) and publishes this rank's failure;
  barriers, broadcasts, boolean reductions and the end of training wait for the other ranks on the store, watching
  for a published failure, so a failed rank whose process lives on never leaves the others waiting
  (``strategies/failure_board.py``);
* a non-finite loss: one decision on every rank (``strategies/nonfinite.py``), gradients dropped after backward;
* instrumentation: :attr:`communication_stats`, :attr:`track_communication` and :attr:`events`, the protocol
  ``ParallelismMonitor`` reads (``lightning_parallel.instrumentation``);
* the rank layout: :attr:`mesh_layout` (degrees of the ``replicate`` x ``shard`` x ``pp`` axes, checked on every rank
  before the group is joined) and :attr:`device_mesh`, torch's ``DeviceMesh`` of it, built once in
  ``setup_environment`` (``distributed/mesh.py``); the samplers, ZeRO's groups and the pipeline's take their ranks
  from it;
* bytes held (:meth:`memory_report`), and checkpoints of either format loaded by every strategy.

Three levels below Lightning's ``ParallelStrategy`` (``DDPStrategy`` -> this -> ours) instead of the two the house
style suggests: ``DDPStrategy`` already gives the process-group set-up, launchers and collectives all three need,
and re-implementing them (as Lightning's ``ModelParallelStrategy`` does) would copy ~300 lines of Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.accounting import CommunicationStats, MemoryReport, module_memory_report
from lightning_parallel.distributed.activation_checkpointing import (
    ActivationCheckpointing,
    SelectiveCheckpointing,
    apply_activation_checkpointing,
    validate_activation_checkpointing,
)
from lightning_parallel.distributed.data_shards import tell_data_parallel_rank
from lightning_parallel.distributed.host_groups import HostGroups
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.instrumentation import Instrumentation, StrategyEvents
from lightning_parallel.lightning_optimizer import unwrap_optimizer
from lightning_parallel.strategies.checkpointing import load_checkpoint_any_format
from lightning_parallel.strategies.failure_board import FailureBoard
from lightning_parallel.strategies.failures import PeerTable, explain_peer_failure
from lightning_parallel.strategies.fork_safety import ForkSafeLauncher
from lightning_parallel.strategies.launch import (
    StartMethod,
    configure_launcher,
    set_up_distributed_environment,
    to_timeout,
    validate_start_method,
)
from lightning_parallel.strategies.nonfinite import (
    FiniteCheck,
    NonFiniteLoss,
    drop_gradients,
    start_finite_check,
    validate_nonfinite,
)
from lightning_parallel.strategies.options import BaseOptions
from lightning_parallel.strategies.shutdown import note_failed_run

if TYPE_CHECKING:
    from lightning_parallel.fault_tolerance.replicas import FaultTolerantReplicas

__all__ = ["LightningParallelStrategy"]


class LightningParallelStrategy(DDPStrategy):
    """The shared base of ``DataParallelStrategy``, ``ShardedOptimizerStrategy`` and ``PipelineParallelStrategy``.

    Not registered and not meant to be used directly. Subclasses pass their own settings and the Trainer-injected
    plugins through; ``ddp_options`` reach Lightning's ``DDPStrategy`` (and from there torch's
    ``DistributedDataParallel``) only for the strategy that wraps the model in DDP.

    Args:
        options: the subclass's ``start_method`` (``"popen"``, ``"spawn"`` or ``"fork"``, validated here, on every
            rank), ``timeout`` (seconds or a ``timedelta`` a collective may wait), ``process_group_backend``
            (``None`` picks NCCL on CUDA and gloo on CPU) and the plugins the Trainer sets (``accelerator``,
            ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``), as it got them
            (:func:`~lightning_parallel.strategies.options.base_options`).
        nonfinite_loss: ``"skip"``, ``"stop"`` or ``"ignore"`` (see ``strategies/nonfinite.py``).
        activation_checkpointing: ``False``, ``True`` (every repeated block) or a set of module classes to recompute
            in backward; ``"selective"`` (or ``SelectiveCheckpointing(blocks=...)``) keeps torchtitan's per-op
            choice of each block's outputs and recomputes the rest (``distributed/activation_checkpointing.py``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the Trainer.
        ddp_options: keyword arguments for ``DDPStrategy`` (bucket size, static graph, ...).
    """

    launcher_type: ClassVar[type[ForkSafeLauncher]] = ForkSafeLauncher
    """The launcher for ``start_method="fork"``/``"spawn"``."""

    _replicas: FaultTolerantReplicas | None = None
    """This job as one replica group of a fault-tolerant run (``fault_tolerance=``, where a subclass takes it)."""

    layout_from_environment: ClassVar[bool] = False
    """``True`` where the cluster environment alone says the world size and local ranks, so ``devices``/``num_nodes``
    are not checked against it (Ray Train places its workers on nodes itself: ``lightning_parallel.integrations.ray``).
    """

    def __init__(
        self,
        *,
        options: BaseOptions,
        nonfinite_loss: NonFiniteLoss,
        activation_checkpointing: ActivationCheckpointing = False,
        **ddp_options: Any,
    ) -> None:
        validate_start_method(options["start_method"])
        validate_nonfinite(nonfinite_loss)
        validate_activation_checkpointing(activation_checkpointing)
        forwarded: dict[str, Any] = {**options, "timeout": to_timeout(options["timeout"])}
        super().__init__(**forwarded, **ddp_options)
        self.nonfinite_loss = nonfinite_loss
        self.activation_checkpointing = activation_checkpointing
        self.track_communication = False
        """Count collective bytes into :attr:`communication_stats` (``ParallelismMonitor`` switches it on before
        ``setup``; ``DataParallelStrategy`` also takes it as an argument)."""
        self.communication_stats = CommunicationStats()
        self.events = StrategyEvents()
        """Timed phases of the sync paths (``lightning_parallel.instrumentation``); the monitor subscribes."""
        self._peers: PeerTable | None = None
        self._failure_board: FailureBoard | None = None
        self._finite_check: FiniteCheck | None = None
        self._device_mesh: DeviceMesh | None = None
        self._device_mesh_key: MeshLayout | None = None
        self._device_mesh_world: Any = None
        self._host_groups: HostGroups | None = None

    # ------------------------------------------------------------------ launch
    @property
    def start_method(self) -> StartMethod:
        """How extra processes start: ``"popen"``, ``"spawn"`` or ``"fork"``."""
        return self._start_method  # type: ignore[return-value]

    @property
    def timeout(self) -> timedelta:
        """How long a collective may wait before the job fails."""
        assert self._timeout is not None  # `to_timeout` in `__init__` always sets one
        return self._timeout

    @property
    def module(self) -> LightningModule:
        """The attached ``LightningModule`` (``lightning_module`` without the ``None`` of a strategy not yet
        connected); raises ``RuntimeError`` before the Trainer connected one."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__} has no LightningModule yet: the Trainer connects it in `fit`.")
        return module

    # ------------------------------------------------------------------ rank layout
    @property
    def mesh_layout(self) -> MeshLayout:
        """The degrees of the mesh's ``replicate`` x ``shard`` x ``pp`` axes for this world size (plain arithmetic,
        no process group needed; raises ``ValueError`` for degrees that do not fit the world size). Data parallel:
        every rank a replica; subclasses say their own."""
        return MeshLayout(self.world_size)

    @property
    def device_mesh(self) -> DeviceMesh:
        """torch's ``DeviceMesh`` of :attr:`mesh_layout`, axes ``("replicate", "shard", "pp")``, built once in
        ``setup_environment``, as Lightning's ``ModelParallelStrategy`` exposes it (``configure_model`` may use it).
        Raises ``RuntimeError`` when read before that."""
        if self._device_mesh is None:
            raise RuntimeError(
                f"`{type(self).__name__}.device_mesh` is built in `setup_environment`, when the Trainer joins the"
                " processes; it was read before that. Read it in `configure_model` or later."
            )
        return self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._replicas is not None:  # one of several fault-tolerant replica groups: the group's share, then ours
            return self._replicas.sampler_kwargs(group_rank=self.global_rank, group_world_size=self.world_size)
        # Every rank of `replicate` x `shard` reads its own slice of the batch; a pipeline's ranks read the same one.
        layout = self.mesh_layout
        return {"num_replicas": layout.data_parallel_size, "rank": layout.data_parallel_rank(self.global_rank)}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every loader: a LitData ``StreamingDataset`` reads this rank's data-parallel share, the one
        :attr:`distributed_sampler_kwargs` names (under fault-tolerant replica groups it would otherwise read its
        group's rank of the group's size: every group the same samples; ``distributed/data_shards.py``)."""
        shard = self.distributed_sampler_kwargs
        tell_data_parallel_rank(dataloader, rank=shard["rank"], size=shard["num_replicas"])
        return dataloader

    def _build_device_mesh(self, layout: MeshLayout) -> None:
        """Collective (every rank, after joining): the mesh of ``layout`` and its :attr:`host_groups`; kept for a later
        ``fit`` of the same layout in the same process group (new process groups on every fit would pile up)."""
        # A process group re-created after a restart needs new subgroups: compared by identity (the reference kept
        # here means a new group can never reuse the old one's `id`).
        world = dist.group.WORLD
        if self._device_mesh is not None and self._device_mesh_key == layout and self._device_mesh_world is world:
            return
        self._device_mesh = layout.build(self.root_device.type)
        # At world size 1 only where a process group runs (code paths forced to shard over it, `benchmarks/gpu_check`).
        joined = layout.world_size > 1 or (dist.is_available() and dist.is_initialized())
        self._host_groups = HostGroups.build(layout, timeout=self.timeout) if joined else None
        self._device_mesh_key, self._device_mesh_world = layout, world

    @property
    def host_groups(self) -> HostGroups:
        """Gloo groups of this run's ranks for the per-step checks of host facts (``distributed/host_groups.py``:
        no device sync, no wait behind the device group's collectives), built with :attr:`device_mesh` (rebuilt with
        it for a new process group). Raises ``RuntimeError`` before ``setup_environment``, or at world size 1 without a
        process group."""
        if self._host_groups is None:
            raise RuntimeError(
                f"`{type(self).__name__}.host_groups` exist once `setup_environment` joined the processes (at world"
                " size 1 only with a process group); they were read before that or without one."
            )
        return self._host_groups

    @override
    def setup_environment(self) -> None:
        layout = self.mesh_layout  # local: a layout that does not fit the world raises on every rank before joining
        self._peers = set_up_distributed_environment(self, super().setup_environment)
        if dist.is_available() and dist.is_initialized():
            self._build_device_mesh(layout)
        if self._failure_board is not None:  # a previous run of this strategy object
            self._failure_board.close()
        self._failure_board = None
        if self._peers is not None and dist.group.WORLD is not None:
            self._failure_board = FailureBoard(
                dist.group.WORLD.get_group_store(),
                peers=self._peers,
                global_rank=self.global_rank,
                world_size=self.world_size,
                timeout=self.timeout,
            )

    @override
    def _configure_launcher(self) -> None:
        configure_launcher(self, super()._configure_launcher, self.launcher_type)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Not DDPStrategy's: its advice names `ddp_find_unused_parameters_true`, a strategy of Lightning's.
        note_failed_run()  # at exit, do not wait for this run's collectives in flight (strategies/shutdown.py)
        board = self._failure_board
        explain_peer_failure(exception, self._peers, self.global_rank, board.failure() if board else None)
        if board is not None:
            board.publish(exception)  # the other ranks stop waiting for this one (the first failure wins)

    # ------------------------------------------------------------------ waiting for the other ranks
    def _wait_for_peers(self, what: str) -> None:
        """Collective (on the store): return once every rank got here; raise ``PeerFailedError`` naming the rank as
        soon as one published a failure or its process is gone. Call before any collective that a rank may reach
        while a peer has already left the run (between steps, at the end); not per step."""
        if self._failure_board is not None and dist.is_available() and dist.is_initialized():
            self._failure_board.rendezvous(what)

    @override
    def barrier(self, name: str | None = None) -> None:
        """Every rank waits here for the others, on the process group's store: a rank whose peer failed (and
        published it) leaves at once naming that rank, where a gloo or NCCL barrier would wait for the timeout."""
        if self._failure_board is None:
            super().barrier(name)
        else:
            self._wait_for_peers(f"the barrier {name!r}" if name else "a barrier")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._wait_for_peers(f"a broadcast from rank {src}")
        return super().broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self._wait_for_peers("a decision reduced over the ranks")
        return super().reduce_boolean_decision(decision, all=all)

    @override
    def on_train_end(self) -> None:
        # A rank whose callbacks failed in `on_train_end` (or at the last step) never gets here: the others learn it
        # here instead of in the teardown's gathers or the user's next collective.
        self._wait_for_peers("the end of training")
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._failure_board is not None:
            self._failure_board.close()  # stops the heartbeat; later rendezvous (a save after fit) still work
        super().teardown()

    # ------------------------------------------------------------------ activation checkpointing
    def _apply_activation_checkpointing(self, module: nn.Module) -> None:
        """Local, idempotent: recompute the chosen blocks of ``module`` in backward (names and keys unchanged).
        Called in ``setup`` before the model is wrapped, sharded or split, so FSDP2's hooks and the pipeline's
        stages run around the checkpointed forward."""
        if self.activation_checkpointing is False:
            return
        names = apply_activation_checkpointing(module, self.activation_checkpointing)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        selective = isinstance(validate_activation_checkpointing(self.activation_checkpointing), SelectiveCheckpointing)
        how = "selectively " if selective else ""
        rank_zero_debug(f"{type(self).__name__}: activation checkpointing {how}recomputes {len(names)} blocks: {shown}")

    # ------------------------------------------------------------------ non-finite loss
    def _decide_skip_step(self, output: Any) -> None:
        """Collective (asynchronous) unless ``nonfinite_loss="ignore"``: launch the check whether any rank's loss
        is non-finite; :meth:`_drop_gradients_if_skipped` reads the answer after backward."""
        if self._finite_check is not None and self._finite_check.work is not None:
            self._finite_check.work.wait()  # a step without backward (manual optimization) left one unread
        step = self.module.trainer.global_step
        self._finite_check = start_finite_check(
            output, policy=self.nonfinite_loss, device=self.root_device, step=step, world_size=self.world_size
        )

    def _drop_gradients_if_skipped(self, *holders: Iterable[Tensor]) -> None:
        """After backward: if any rank's loss was non-finite, drop every gradient (the module's and ``holders``) on
        every rank (they all read the same all-reduced flag), so the optimizer leaves parameters and state alone."""
        check, self._finite_check = self._finite_check, None
        if check is None or not check.should_skip():
            return
        drop_gradients(self.module.parameters())
        for tensors in holders:
            drop_gradients(tensors)

    # ------------------------------------------------------------------ reports
    def instrumentation(self) -> Instrumentation:
        """What a monitor can measure in this run (after ``setup``); subclasses say more."""
        return Instrumentation(data_parallel_size=self.world_size)

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank really holds (measured from its tensors'
        storages; the first optimizer's state)."""
        optimizers = self.unwrapped_optimizers()
        return module_memory_report(self.module, optimizers[0] if optimizers else None)

    def gradient_tensors(self) -> list[Tensor]:
        """Every gradient tensor this rank holds now: the parameters' ``.grad``; a strategy with gradient buffers of
        its own (ZeRO-1/2 buckets) adds them. What the monitor's peak breakdown counts as ``gradients``."""
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def unwrapped_optimizers(self) -> list[Optimizer]:
        """The torch optimizers, without Lightning's ``LightningOptimizer`` wrapper, in order."""
        return [unwrap_optimizer(optimizer) for optimizer in self.optimizers]

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A consolidated ``.ckpt`` or a sharded directory written by any strategy of this package."""
        return load_checkpoint_any_format(self, checkpoint_path, weights_only)

    @classmethod
    def _register(cls, strategy_registry: Any, entries: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Register ``(name, init_params)`` entries for this class (``override=True``: registering twice is fine)."""
        for name, init_params in entries:
            settings = ", ".join(f"{key}={value!r}" for key, value in init_params.items())
            description = f"lightning_parallel {cls.__name__} with {settings}"
            strategy_registry.register(name, cls, description=description, override=True, **init_params)
