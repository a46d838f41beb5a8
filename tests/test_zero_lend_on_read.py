"""A gradient loan costs only what is read (issue 46, first item).

Under ZeRO-2/3 the whole averaged gradients are lent to ``.grad`` only at a step whose code reads one
(``LendOnRead``, ``distributed/zero/gradient_loan.py``). A user's callback overriding ``on_before_optimizer_step``
that reads gradients on one step of four, on 2 real gloo ranks with ``ParallelismMonitor``:

* on a step without a read, the bytes of every live tensor storage held in ``on_before_optimizer_step`` (after the
  user's callback ran) and the bytes of every collective equal those of the same run without the callback, exactly;
* on the step with a read, the loan adds exactly its buffers (the gradient bytes: ``Psi``) to what is held, the
  monitor counts its all-gather, and rank 0 logs once which hook read and what the loan costs;
* a read on rank 0 only lends on every rank (no hang), and what rank 0 reads, a clip by hand on the ranks, and the
  weights after training equal one device;
* ``reads_gradients = False`` on a callback or module leaves it out.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.utilities import grad_norm
from torch import nn
from training_helpers import assert_weights_close

from lightning_parallel import ParallelismMonitor, ShardedOptimizerStrategy
from lightning_parallel.accounting import optimizer_state_tensors, tensor_storages
from lightning_parallel.planner import plan
from lightning_parallel.strategies.gradient_readers import gradient_readers, lends_every_step

STEPS, READ_STEP, QUIET_STEP = 4, 2, 1
FLOAT = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(zoo.FEATURES, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, zoo.CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class ReadsOnSomeSteps(pl.Callback):
    """A user's callback: on ``steps`` only, the ranks in ``ranks`` (``None``: every rank) read Lightning's gradient
    norm, and every rank clips by hand to ``clip`` if given (which changes the step)."""

    def __init__(self, steps: set[int], *, ranks: set[int] | None = None, clip: float | None = None) -> None:
        self.steps, self.ranks, self.clip = steps, ranks, clip
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if step not in self.steps:
            return
        if self.ranks is None or trainer.global_rank in self.ranks:
            self.norms[step] = float(grad_norm(pl_module, 2)["grad_2.0_norm_total"])
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(pl_module.parameters(), self.clip)


class ReadsOnRankZeroThenSyncs(ReadsOnSomeSteps):
    """Reads on rank 0 only, then every rank logs with ``sync_dist=True`` (a collective): lending on read would hang
    (rank 0 waits in the agreement, rank 1 in the log's all-reduce), so it asks for a loan at every step."""

    reads_gradients = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        pl_module.log("synced", torch.tensor(float(trainer.global_step)), sync_dist=True)


class DeclaresNoReads(pl.Callback):
    """Overrides a gradient hook, reads no gradient, and says so."""

    reads_gradients = False

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass


class HeldBytes(pl.Callback):
    """The bytes of the tensors a step holds, in ``on_before_optimizer_step`` after the callbacks before this one ran:
    the parameters, every gradient tensor (``strategy.gradient_tensors()``: the parameters' ``.grad``, whole ones
    while lent, and the strategy's gradient buffers) and the optimizer state; each storage once (a view counts its
    base, a ``DTensor`` its local shard). The monitor's peak breakdown counts these categories; the garbage
    collector's view would also count buffers gloo's worker thread has not let go of yet (timing)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ShardedOptimizerStrategy)
        state = optimizer_state_tensors(strategy.unwrapped_optimizers())
        storages = {
            storage._cdata: storage.nbytes()
            for tensor in [*pl_module.parameters(), *strategy.gradient_tensors(), *state]
            for storage in tensor_storages(tensor)
        }
        self.held[trainer.global_step] = sum(storages.values())


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fit_monitored(stage: int, world_size: int, rank: int, reads_on: int | None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    monitor = ParallelismMonitor(figure_path=False, summary_path=None)
    probe = HeldBytes()
    callbacks: list[pl.Callback] = [monitor, probe]
    if reads_on is not None:
        callbacks.insert(0, ReadsOnSomeSteps({reads_on}))
    strategy = ShardedOptimizerStrategy(stage=stage)
    trainer = zoo.trainer(strategy, world_size, max_steps=STEPS, callbacks=callbacks)
    messages = _Messages()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    # INFO whatever ran before in this process (the demo quiets Lightning's loggers to WARNING)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(messages)
    try:
        trainer.fit(Mlp(), zoo.loader(world_size, rank))
    finally:
        logger.removeHandler(messages)
        logger.setLevel(level)
    parameters = list(trainer.lightning_module.parameters())
    if stage == 3:  # each `DTensor` gradient gathered whole
        lent, flags = sum(param.numel() for param in parameters) * FLOAT, 0
    else:  # each bucket's reduced shards gathered into one whole (padded) buffer; a byte a parameter: has a gradient
        lent = sum(bucket.numel for bucket in strategy.backend.buckets.buckets) * FLOAT  # type: ignore[attr-defined]
        flags = len(parameters)
    return {
        "held": probe.held,
        "communication": [record.communication for record in monitor.steps],
        "lent_bytes": lent,
        "flag_bytes": flags,
        "messages": [message for message in messages.messages if "`.grad` was read" in message],
    }


def _monitored_in_ranks(rank: int, world_size: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    return {
        (stage, reads_on): _fit_monitored(stage, world_size, rank, reads_on)
        for stage in (2, 3)
        for reads_on in (None, READ_STEP, QUIET_STEP)
    }


@pytest.fixture(scope="module")
def monitored() -> list[dict[Any, Any]]:
    return run_distributed(_monitored_in_ranks, 2, init_process_group=False, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_without_a_read_costs_what_a_run_without_the_callback_costs(monitored, stage: int) -> None:
    for rank, results in enumerate(monitored):
        without, reader = results[stage, None], results[stage, READ_STEP]
        # Every other step holds and communicates exactly what it does without the callback; the reading step adds
        # the loan's buffers and its gather.
        for step in range(STEPS):
            if step != READ_STEP:
                assert reader["held"][step] == without["held"][step], (rank, step, reader["held"], without["held"])
                assert reader["communication"][step] == without["communication"][step], (rank, step)
        assert reader["held"][READ_STEP] == without["held"][READ_STEP] + reader["lent_bytes"], rank
        added = dict(reader["communication"][READ_STEP])
        added["all_gather"] -= reader["lent_bytes"]
        if reader["flag_bytes"]:  # stages 1-2: the "got a gradient" flags of the loan
            added["all_reduce"] -= reader["flag_bytes"]
        assert added == without["communication"][READ_STEP], (rank, added)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_read_lends_the_gradients_and_says_so_once(monitored, stage: int) -> None:
    reads_early = monitored[0][stage, QUIET_STEP]
    without = monitored[0][stage, None]
    lent = reads_early["lent_bytes"]
    assert reads_early["held"][QUIET_STEP] == without["held"][QUIET_STEP] + lent
    assert reads_early["held"][READ_STEP] == without["held"][READ_STEP]
    [message] = reads_early["messages"]  # rank 0 only, once a fit
    assert "in `ReadsOnSomeSteps.on_before_optimizer_step`" in message
    assert f"{lent / 2**20:.2f} MiB all-gathered and {lent / 2**20:.2f} MiB more held" in message
    assert monitored[1][stage, QUIET_STEP]["messages"] == []
    assert without["messages"] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_the_planner_counts_the_loan_the_monitor_measures(monitored, stage: int) -> None:
    reader, without = monitored[0][stage, READ_STEP], monitored[0][stage, None]
    options: dict[str, Any] = {"world_size": 2, "optimizer": "sgd", "process_group_backend": "gloo"}
    reading = plan(Mlp(), reads_gradients=True, **options).configuration(f"zero{stage}").ranks[0]
    quiet = plan(Mlp(), **options).configuration(f"zero{stage}").ranks[0]
    measured = reader["communication"][READ_STEP]
    added = {kind: measured[kind] - without["communication"][READ_STEP].get(kind, 0) for kind in measured}
    assert {kind: reading.communication[kind] - quiet.communication.get(kind, 0) for kind in added} == added
    assert reading.lent == reader["lent_bytes"] and quiet.lent == 0
    assert reading.held == quiet.held  # after the step the loan is gone


def _fit_reading(strategy: Any, world_size: int, rank: int, *, then_syncs: bool = False) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    # Step 1: rank 0 alone reads (the other ranks lend with it at their hand-back, or at every step under
    # `reads_gradients = True`); step 2: every rank reads and clips by hand, which changes the step.
    reader = ReadsOnRankZeroThenSyncs({1}, ranks={0}) if then_syncs else ReadsOnSomeSteps({1}, ranks={0})
    clipper = ReadsOnSomeSteps({2}, clip=0.05)
    trainer = zoo.trainer(strategy, world_size, max_steps=STEPS, callbacks=[reader, clipper, DeclaresNoReads()])
    module = Mlp()
    trainer.fit(module, zoo.loader(world_size, rank))
    state = trainer.strategy.lightning_module_state_dict() if world_size > 1 else module.state_dict()
    return {"norms": {**reader.norms, **clipper.norms}, "weights": {k: v.detach().clone() for k, v in state.items()}}


def _reading_in_ranks(rank: int, world_size: int) -> dict[Any, dict[str, Any]]:
    torch.set_num_threads(1)
    results: dict[Any, dict[str, Any]] = {
        stage: _fit_reading(ShardedOptimizerStrategy(stage=stage), world_size, rank) for stage in (1, 2, 3)
    }
    for stage in (2, 3):
        strategy = ShardedOptimizerStrategy(stage=stage)
        results[stage, "every step"] = _fit_reading(strategy, world_size, rank, then_syncs=True)
    return results


@pytest.mark.compat  # torch calls the watch for `Tensor.grad`: checked on every supported torch release
@pytest.mark.timeout(300)
def test_reads_on_some_steps_and_ranks_equal_one_device() -> None:
    one_device = _fit_reading("auto", 1, 0)
    assert sorted(one_device["norms"]) == [1, 2]
    results = run_distributed(_reading_in_ranks, 2, init_process_group=False, timeout=280)
    for stage in (1, 2, 3, (2, "every step"), (3, "every step")):
        norms = results[0][stage]["norms"]
        assert sorted(norms) == [1, 2], stage
        for step, value in one_device["norms"].items():
            assert norms[step] == pytest.approx(value, rel=1e-5), (stage, step)
        assert sorted(results[1][stage]["norms"]) == [2]  # rank 1 read on step 2 only
        assert_weights_close(results[0][stage]["weights"], one_device["weights"], **TOLERANCE)  # rank 0's whole


class HookNoRead(Mlp):
    reads_gradients = False

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass


class HookReads(Mlp):
    def on_after_backward(self) -> None:
        pass


def test_gradient_readers_name_the_hooks_and_leave_out_declared_non_readers() -> None:
    assert gradient_readers(Mlp(), []) == []
    assert gradient_readers(HookReads(), []) == ["HookReads.on_after_backward"]
    assert gradient_readers(HookNoRead(), [DeclaresNoReads(), ParallelismMonitor()]) == []
    assert gradient_readers(Mlp(), [ReadsOnSomeSteps(set())]) == ["ReadsOnSomeSteps.on_before_optimizer_step"]
    assert not lends_every_step(HookReads(), [ReadsOnSomeSteps(set()), DeclaresNoReads()])
    assert lends_every_step(Mlp(), [ReadsOnRankZeroThenSyncs(set())])
    unclear = DeclaresNoReads()
    unclear.reads_gradients = "no"  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"`DeclaresNoReads.reads_gradients = 'no'`: set it to `False`"):
        gradient_readers(Mlp(), [unclear])
    manual = Mlp()
    manual.automatic_optimization = False
    assert gradient_readers(manual, []) == ["Mlp.training_step"]
