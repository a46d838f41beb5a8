"""``FaultTolerantReplicas``: the Lightning side of ``FaultTolerance`` for ``DataParallelStrategy`` and for
``ShardedOptimizerStrategy(stage=1 or 2)`` (hybrid sharding: shard inside a replica group, torchft across groups).

The strategy keeps one and calls it at four points of a training step; everything torchft does sits behind
:class:`~lightning_parallel.fault_tolerance.replica_sync.ReplicaGroupSync` (imported when fitting starts, so
torchft stays optional):

* ``setup`` (fitting): refuse what the mode does not support, start the group's torchft manager on the group's own
  store, and (``start_together``) wait for the other groups;
* ``training_step``: start the step's quorum in the background;
* ``post_backward``: average the gradients over the groups alive, then ask whether the step commits; if it does not
  (a group died during the step), drop the gradients so the optimizer leaves weights and state alone, and do not
  count the step in ``trainer.global_step``. Hybrid sharding averages inside the buckets' sync instead (this object
  is their :class:`~lightning_parallel.distributed.zero.replica_reduction.ReplicaReduction`: each rank's reduced
  gradient shards with the same rank's of the other groups), then calls :meth:`FaultTolerantReplicas.commit`;
* ``teardown``: stop the manager.

What a healing group receives from a live one: the model (data parallel: the module's ``state_dict`` and every
optimizer's; hybrid sharding: each rank its own shard of parameters and optimizer state from the same rank of the
live group, :class:`~lightning_parallel.fault_tolerance.shard_state.OwnedShardState`), every LR scheduler's state, and
the number of optimizer steps taken (``trainer.global_step``), so it stops at ``max_steps`` with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.fault_tolerance.agreement import GroupDescription
from lightning_parallel.fault_tolerance.config import FaultTolerance
from lightning_parallel.strategies.nonfinite import drop_gradients

__all__ = ["FaultTolerantReplicas"]


class ModelState(Protocol):
    """What a healing group loads besides the LR schedulers and the step: the model and its optimizer state."""

    def state_dict(self) -> dict[str, Any]:
        """Local; may run on a torchft thread while the training thread runs forward and backward (never beside the
        optimizer step); may hold references to live tensors (copied to the host before the step may change them)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Local, on the training thread (inside ``should_commit``)."""


class FaultTolerantReplicas:
    """One replica group's fault-tolerant gradient averaging, driven by ``DataParallelStrategy`` or (hybrid sharding)
    by ``ShardedOptimizerStrategy``, named in errors as ``owner``."""

    divisor = 1
    """As a :class:`~lightning_parallel.distributed.zero.replica_reduction.ReplicaReduction`: it averages by itself
    (over the groups in the quorum, a number known only during the step)."""

    def __init__(self, config: FaultTolerance, *, owner: str = "DataParallelStrategy") -> None:
        if not isinstance(config, FaultTolerance):
            raise TypeError(
                f"`fault_tolerance={config!r}` must be a `FaultTolerance(replica_group=..., num_replica_groups=...)`"
                " from `lightning_parallel.fault_tolerance`, or None."
            )
        self.config = config
        self.owner = owner
        self.send_zeros = False
        """Set by the strategy before a step's sync: this group skips the step (a non-finite loss), so its shards
        count as zeros in the average (as a data-parallel group sends zero gradients)."""
        self._sync: Any = None
        self._trainer: Any = None
        self._parameters: tuple[nn.Parameter, ...] = ()
        self._model_state: ModelState | None = None
        self._in_step = False

    # ------------------------------------------------------------------ data
    def sampler_kwargs(self, *, group_rank: int, group_world_size: int) -> dict[str, int]:
        """``DistributedSampler`` arguments: every rank of every group reads its own slice of the data."""
        return {
            "num_replicas": self.config.num_replica_groups * group_world_size,
            "rank": self.config.replica_group * group_world_size + group_rank,
        }

    # ------------------------------------------------------------------ lifecycle
    def check_supported(self, trainer: Any, module: nn.Module) -> None:
        """Local: refuse what the mode does not handle (``setup`` checks it too), on every rank before any
        collective."""
        _check_supported(trainer, module, self.owner)

    def setup(
        self,
        trainer: Any,
        module: nn.Module,
        *,
        group_rank: int,
        group_world_size: int,
        store: tuple[str, int],
        model_state: ModelState | None = None,
        zero_gradients: Callable[[], tuple[list[Tensor], Tensor | None]] | None = None,
        bucket_shards: Sequence[int] = (),
    ) -> None:
        """Local checks, then (cross-group) start the manager and, with ``start_together``, wait for the groups.
        Before a new quorum's first cross-group collective the groups compare their descriptions (trainable parameters'
        names, shapes and dtypes, strategy, processes per group, shard layout, precision, ``num_replica_groups``) and
        raise :class:`~lightning_parallel.fault_tolerance.agreement.ReplicaGroupMismatchError` naming what differs.
        ``model_state``: what a healing group receives of the model; ``None``: the module's ``state_dict`` and every
        optimizer's (whole parameters and state on every rank, as in data parallel). ``zero_gradients``: hybrid
        sharding, zeros shaped as what :meth:`reduce` receives in a step (a group healing while it waits for the
        others must issue the step's collective). ``bucket_shards``: hybrid sharding, the elements of each bucket's
        shard per rank."""
        _check_supported(trainer, module, self.owner)
        from lightning_parallel.fault_tolerance.replica_sync import ReplicaGroupSync  # torchft: only now

        self._trainer = trainer
        self._model_state = model_state
        self._parameters = tuple(p for p in module.parameters() if p.requires_grad)
        self._sync = ReplicaGroupSync(
            self.config,
            group_rank=group_rank,
            group_world_size=group_world_size,
            store_host=store[0],
            store_port=store[1],
            state_dict=self._state_dict,
            load_state_dict=self._load_state_dict,
            device=trainer.strategy.root_device,
            description=GroupDescription.of(
                module,
                replica_group=self.config.replica_group,
                strategy=self.owner,
                processes_per_group=group_world_size,
                precision=str(trainer.precision),
                num_replica_groups=self.config.num_replica_groups,
                min_replica_groups=self.config.min_replica_groups,
                start_together=self.config.start_together,
                gradient_clipping=_clipping(trainer),
                shard_size=group_world_size if bucket_shards else None,
                bucket_shards=bucket_shards,
            ),
        )
        if self.config.start_together:
            sync = self._sync

            def exchange_zeros() -> None:
                assert zero_gradients is not None
                sync.average_shards(*zero_gradients())

            step_collective = exchange_zeros if zero_gradients is not None else None
            sync.wait_for_groups(self._parameters, step_collective=step_collective)

    @property
    def sync(self) -> Any:
        """The running :class:`ReplicaGroupSync`; ``RuntimeError`` before ``setup``."""
        if self._sync is None:
            raise RuntimeError("FaultTolerantReplicas.sync exists from the strategy's `setup` (fitting) on.")
        return self._sync

    def start_step(self) -> None:
        """At the start of each training step (before forward): the step's quorum, in the background."""
        if self._sync is not None and not self._in_step:
            self._in_step = True
            self._sync.start_step()

    def finish_step(self) -> bool:
        """After backward (the group's own DDP all-reduce done): average over the groups, then commit or give up.
        Returns whether the optimizer may step."""
        if self._sync is None or not self._in_step:
            return True
        gradients = []
        for parameter in self._parameters:
            if parameter.grad is None:  # every group must send the same elements: an unused parameter sends zeros
                parameter.grad = torch.zeros_like(parameter)
            gradients.append(parameter.grad)
        self._sync.average_gradients(gradients)
        return self.commit(self._parameters)

    def reduce(self, shards: Sequence[Tensor], used: Tensor | None, stats: CommunicationStats | None) -> None:
        """Hybrid sharding, called by the buckets' sync (a cross-group collective): average this rank's reduced
        gradient shards, and the "got a gradient" flags, with the same rank of every group in the step's quorum."""
        if self._sync is None or not self._in_step:
            raise RuntimeError(f"{self.owner}(fault_tolerance=...): a gradient sync outside a training step.")
        if self.send_zeros:
            for shard in shards:
                shard.zero_()
            if used is not None:
                used.zero_()
        if stats is not None:
            for tensor in [*shards, *([used] if used is not None else [])]:
                stats.record("all_reduce", tensor.numel() * tensor.element_size())
        self._sync.average_shards(shards, used)

    def commit(self, holders: Iterable[Tensor]) -> bool:
        """After the step's gradients were averaged over the groups: whether the optimizer may step (collective in
        the group; a healing group loads its peer's state first). If not, drop the gradients of ``holders`` (what the
        optimizer steps) so weights and state stay, and take the step back out of ``trainer.global_step``."""
        if self._sync is None or not self._in_step:
            return True
        committed = bool(self._sync.should_commit())
        self._in_step = False
        self.send_zeros = False
        if not committed:
            drop_gradients(holders)  # the optimizer skips tensors without a gradient: weights and state stay
            _uncount_step(self._trainer)
        return committed

    def teardown(self) -> None:
        """Stop the manager (its servers and threads); idempotent."""
        if self._sync is not None:
            self._sync.shutdown()
        self._sync = None
        self._trainer = None
        self._in_step = False

    # ------------------------------------------------------------------ what a healing group receives
    def _state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        model = self._model_state.state_dict() if self._model_state is not None else None
        return {
            "module": trainer.lightning_module.state_dict() if model is None else None,
            "optimizers": [o.state_dict() for o in trainer.strategy.unwrapped_optimizers()] if model is None else None,
            "model": model,
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "global_step": _step_progress(trainer).completed,
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        if self._model_state is not None:
            self._model_state.load_state_dict(state["model"])
        else:
            trainer.lightning_module.load_state_dict(state["module"])
            for optimizer, optimizer_state in zip(
                trainer.strategy.unwrapped_optimizers(), state["optimizers"], strict=True
            ):
                optimizer.load_state_dict(optimizer_state)
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(scheduler_state)
        progress = _step_progress(trainer)
        progress.completed = int(state["global_step"])
        progress.ready = progress.completed + (1 if self._in_step else 0)  # Lightning counts the step it is in
        trainer.fit_loop.epoch_loop._batches_that_stepped = progress.completed


def _check_supported(trainer: Any, module: nn.Module, owner: str) -> None:
    """Refuse, on every rank before any collective, what the mode does not handle."""
    if not getattr(module, "automatic_optimization", True):
        raise ValueError(
            f"`{owner}(fault_tolerance=...)` supports automatic optimization only: the LightningModule"
            " sets `automatic_optimization = False`. Use automatic optimization, or drop `fault_tolerance`."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"`{owner}(fault_tolerance=...)` averages over replica groups every step; it does not support"
            f" `Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` yet. Use a larger batch, or drop"
            " `fault_tolerance`."
        )
    if len(trainer.optimizers) != 1:
        raise ValueError(
            f"`{owner}(fault_tolerance=...)` supports one optimizer; configure_optimizers returned"
            f" {len(trainer.optimizers)}."
        )


def _clipping(trainer: Any) -> str | None:
    """The Trainer's gradient clipping, as the groups compare it (``None``: off)."""
    value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    return None if value is None else f"{value} by {getattr(algorithm, 'value', algorithm) or 'norm'}"


def _step_progress(trainer: Any) -> Any:
    """Lightning's count of optimizer steps (``trainer.global_step`` is its ``completed``)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total


def _uncount_step(trainer: Any) -> None:
    """The step did not commit: take it back out of ``global_step`` (Lightning adds it once the step returns)."""
    progress = _step_progress(trainer)
    progress.ready -= 1
    progress.completed -= 1
