"""``FaultTolerantReplicas``: the Lightning side of ``FaultTolerance`` for ``DataParallelStrategy``.

The strategy keeps one and calls it at four points of a training step; everything torchft does sits behind
:class:`~lightning_parallel.fault_tolerance.replica_sync.ReplicaGroupSync` (imported when fitting starts, so
torchft stays optional):

* ``setup`` (fitting): refuse what the mode does not support, start the group's torchft manager on the group's own
  store, and (``start_together``) wait for the other groups;
* ``training_step``: start the step's quorum in the background;
* ``post_backward``: average the gradients over the groups alive, then ask whether the step commits; if it does not
  (a group died during the step), drop the gradients so the optimizer leaves weights and state alone, and do not
  count the step in ``trainer.global_step``;
* ``teardown``: stop the manager.

What a healing group receives from a live one: the module's ``state_dict``, every optimizer's and LR scheduler's,
and the number of optimizer steps taken (``trainer.global_step``), so it stops at ``max_steps`` with the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_parallel.fault_tolerance.config import FaultTolerance

__all__ = ["FaultTolerantReplicas"]


class FaultTolerantReplicas:
    """One replica group's fault-tolerant gradient averaging, driven by ``DataParallelStrategy``."""

    def __init__(self, config: FaultTolerance) -> None:
        if not isinstance(config, FaultTolerance):
            raise TypeError(
                f"`fault_tolerance={config!r}` must be a `FaultTolerance(replica_group=..., num_replica_groups=...)`"
                " from `lightning_parallel.fault_tolerance`, or None."
            )
        self.config = config
        self._sync: Any = None
        self._trainer: Any = None
        self._parameters: tuple[nn.Parameter, ...] = ()
        self._in_step = False

    # ------------------------------------------------------------------ data
    def sampler_kwargs(self, *, group_rank: int, group_world_size: int) -> dict[str, int]:
        """``DistributedSampler`` arguments: every rank of every group reads its own slice of the data."""
        return {
            "num_replicas": self.config.num_replica_groups * group_world_size,
            "rank": self.config.replica_group * group_world_size + group_rank,
        }

    # ------------------------------------------------------------------ lifecycle
    def setup(
        self, trainer: Any, module: nn.Module, *, group_rank: int, group_world_size: int, store: tuple[str, int]
    ) -> None:
        """Local checks, then (cross-group) start the manager and, with ``start_together``, wait for the groups."""
        _check_supported(trainer, module)
        from lightning_parallel.fault_tolerance.replica_sync import ReplicaGroupSync  # torchft: only now

        self._trainer = trainer
        self._parameters = tuple(p for p in module.parameters() if p.requires_grad)
        self._sync = ReplicaGroupSync(
            self.config,
            group_rank=group_rank,
            group_world_size=group_world_size,
            store_host=store[0],
            store_port=store[1],
            state_dict=self._state_dict,
            load_state_dict=self._load_state_dict,
        )
        if self.config.start_together:
            self._sync.wait_for_groups(self._parameters)

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
        committed = bool(self._sync.should_commit())
        self._in_step = False
        if not committed:
            for parameter in self._parameters:
                parameter.grad = None  # the optimizer skips parameters without a gradient: weights and state stay
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
        return {
            "module": trainer.lightning_module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in trainer.strategy.unwrapped_optimizers()],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "global_step": _step_progress(trainer).completed,
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
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


def _check_supported(trainer: Any, module: nn.Module) -> None:
    """Refuse, on every rank before any collective, what the mode does not handle."""
    if not getattr(module, "automatic_optimization", True):
        raise ValueError(
            "`DataParallelStrategy(fault_tolerance=...)` supports automatic optimization only: the LightningModule"
            " sets `automatic_optimization = False`. Use automatic optimization, or drop `fault_tolerance`."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"`DataParallelStrategy(fault_tolerance=...)` averages over replica groups every step; it does not support"
            f" `Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` yet. Use a larger batch, or drop"
            " `fault_tolerance`."
        )
    if len(trainer.optimizers) != 1:
        raise ValueError(
            f"`DataParallelStrategy(fault_tolerance=...)` supports one optimizer; configure_optimizers returned"
            f" {len(trainer.optimizers)}."
        )


def _step_progress(trainer: Any) -> Any:
    """Lightning's count of optimizer steps (``trainer.global_step`` is its ``completed``)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total


def _uncount_step(trainer: Any) -> None:
    """The step did not commit: take it back out of ``global_step`` (Lightning adds it once the step returns)."""
    progress = _step_progress(trainer)
    progress.ready -= 1
    progress.completed -= 1
