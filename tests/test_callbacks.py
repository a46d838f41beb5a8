"""Lightning's own callbacks under every strategy, on 2 forked ranks, against the same callbacks on one device.

One ``run_distributed`` per strategy runs every case inside the same two ranks (results cached per module), and
each test below reads one case:

* ``EarlyStopping`` with ranks logging *different* values: Lightning reduces ``should_stop`` over the ranks (any
  rank may stop), so every rank stops after the same step, the step of the earliest rank, and none hangs.
* ``ModelCheckpoint(save_top_k=2, monitor="val_loss")``: the same two files and best path on every rank,
  ``trainer.validate(ckpt_path="best")`` reproduces the best score, and resuming from the other top-k checkpoint
  ends with the uninterrupted run's weights and learning rates.
* ``LearningRateMonitor`` (per-step schedule): the learning rates one device logs.
* ``EMAWeightAveraging``, ``StochasticWeightAveraging``, ``ModelPruning`` (they touch parameters): the weights one
  device ends with, or, where a strategy cannot hold whole parameters, a ``ValueError``/``TypeError`` naming the
  callback before the first step. ``data_parallel``, ``zero1`` and ``zero2`` must run all three, and every strategy
  the two weight-averaging callbacks (``tests/test_weight_averaging_sharded.py`` compares ZeRO-3 and the pipeline
  with Lightning's DDP, checkpoints included).
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import (
    EarlyStopping,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import Logger
from torch import nn
from training_helpers import assert_weights_close
from typing_extensions import override

STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3", "pipeline")
MUST_WORK = ("data_parallel", "zero1", "zero2")  # every parameter callback; the others refuse pruning only
WORLD_SIZE = 2
EPOCH_STEPS = 2  # optimizer steps per epoch (global batch zoo.GLOBAL_BATCH)
TIMEOUT_S = 180  # generous: the 2 cores are shared with other tests
KNOWN_FAILURE_TIMEOUT_S = 60  # a crash on one rank ends both within seconds
# EarlyStopping(patience=1, mode="min") stops rank 1 after epoch 2 and rank 0 after epoch 4 on its own.
SCORES = ([1.0, 0.9, 0.8, 0.7, 0.75, 0.8, 0.9], [1.0, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99])
MAX_EPOCHS_EARLY_STOPPING = 7
CHECKPOINT_EPOCHS = 3


class _CallbackModel(zoo.ResidualMLP):
    """A residual MLP with a validation loss, a per-step LR schedule and, optionally, a per-rank epoch score."""

    def __init__(self, scores: tuple[list[float], ...] | None = None) -> None:
        super().__init__()
        self.scores = scores

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        if self.scores is not None:  # not synchronised: each rank logs its own value
            self.log("score", self.scores[self.global_rank][self.current_epoch])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _MemoryLogger(Logger):
    """Keeps what Lightning logs (on every rank), so a test can read the learning rates."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    @override
    def name(self) -> str:
        return "memory"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def learning_rates(self) -> list[float]:
        return [metrics["lr-SGD"] for _, metrics in self.records if "lr-SGD" in metrics]


# ------------------------------------------------------------------ one fit, on a rank or on one device
def _fit(
    strategy: str,
    devices: int,
    rank: int,
    *,
    callbacks: list[pl.Callback],
    max_epochs: int,
    scores: tuple[list[float], ...] | None = None,
    validate: bool = False,
    logger: Logger | None = None,
    ckpt_path: str | None = None,
    trainer: pl.Trainer | None = None,
) -> tuple[pl.Trainer, _CallbackModel]:
    pl.seed_everything(0, verbose=False)
    if trainer is None:
        trainer = _trainer(
            strategy, devices, callbacks=callbacks, max_epochs=max_epochs, validate=validate, logger=logger
        )
    model = _CallbackModel(scores)
    train = zoo.loader(*_replica(trainer), steps=EPOCH_STEPS)
    val = zoo.loader(*_replica(trainer), steps=1) if validate else None
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return trainer, model


def _trainer(
    strategy: str,
    devices: int,
    *,
    callbacks: list[pl.Callback],
    max_epochs: int,
    validate: bool = False,
    logger: Logger | None = None,
) -> pl.Trainer:
    return zoo.trainer(
        strategy,
        devices,
        max_steps=-1,
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=logger if logger is not None else False,
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        limit_val_batches=None if validate else 0,
        log_every_n_steps=1,
    )


def _weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights (complete on rank 0)."""
    return {name: tensor.detach().clone() for name, tensor in trainer.strategy.lightning_module_state_dict().items()}


def _early_stopping(strategy: str, devices: int, rank: int, scores: tuple[list[float], ...]) -> dict[str, Any]:
    stopper = EarlyStopping(monitor="score", mode="min", patience=1, check_on_train_epoch_end=True)
    trainer, _ = _fit(strategy, devices, rank, callbacks=[stopper], max_epochs=MAX_EPOCHS_EARLY_STOPPING, scores=scores)
    return {"global_step": trainer.global_step, "stopped_epoch": stopper.stopped_epoch}


def _checkpoint_and_learning_rates(strategy: str, devices: int, rank: int, workdir: str) -> dict[str, Any]:
    logger = _MemoryLogger()
    checkpoint = ModelCheckpoint(dirpath=workdir, monitor="val_loss", mode="min", save_top_k=2)
    callbacks = [checkpoint, LearningRateMonitor(logging_interval="step")]
    trainer, model = _fit(
        strategy, devices, rank, callbacks=callbacks, max_epochs=CHECKPOINT_EPOCHS, validate=True, logger=logger
    )
    result: dict[str, Any] = {
        "weights": _weights(trainer),
        "learning_rates": logger.learning_rates(),
        "files": sorted(path.name for path in Path(workdir).iterdir()),
        "best_model_path": Path(checkpoint.best_model_path).name,
        "best_model_score": float(checkpoint.best_model_score),
        "top_k": {Path(path).name: float(score) for path, score in checkpoint.best_k_models.items()},
    }
    resume_from = checkpoint.kth_best_model_path  # read first: `validate` restores the callback's saved state
    val = zoo.loader(*_replica(trainer), steps=1)
    (metrics,) = trainer.validate(model, val, ckpt_path="best", verbose=False)
    result["validated_best"] = float(metrics["val_loss"])
    result["resume_step"] = torch.load(resume_from, weights_only=False, map_location="cpu")["global_step"]
    resume_logger = _MemoryLogger()
    resumed, _ = _fit(
        strategy,
        devices,
        rank,
        callbacks=[LearningRateMonitor(logging_interval="step")],
        max_epochs=CHECKPOINT_EPOCHS,
        logger=resume_logger,
        ckpt_path=resume_from,
    )
    result["resumed_weights"] = _weights(resumed)
    result["resumed_learning_rates"] = resume_logger.learning_rates()
    result["resumed_global_step"] = resumed.global_step
    return result


def _replica(trainer: pl.Trainer) -> tuple[int, int]:
    """This rank's data replica: (number of replicas, index), as the strategy's sampler would shard."""
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    return sampler["num_replicas"], sampler["rank"]


PARAMETER_CALLBACKS: dict[str, tuple[Callable[[], pl.Callback], int]] = {
    "ema": (lambda: EMAWeightAveraging(decay=0.7), 2),
    "swa": (lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1), 3),
    "pruning": (lambda: ModelPruning("l1_unstructured", amount=0.3, use_lottery_ticket_hypothesis=False), 2),
}


def _parameter_callback(strategy: str, devices: int, rank: int, case: str, workdir: str) -> dict[str, Any]:
    """Fit with the callback (checkpointing every epoch), then resume a fresh run from the first epoch's file."""
    make_callback, epochs = PARAMETER_CALLBACKS[case]
    every_epoch = ModelCheckpoint(dirpath=Path(workdir) / case, save_top_k=-1)
    trainer = _trainer(strategy, devices, callbacks=[make_callback(), every_epoch], max_epochs=epochs)
    try:
        _fit(strategy, devices, rank, callbacks=[], max_epochs=epochs, trainer=trainer)
    except (ValueError, TypeError) as error:
        return {"refused": f"{type(error).__name__}: {error}", "global_step": trainer.global_step}
    first_epoch = str(Path(workdir) / case / f"epoch=0-step={EPOCH_STEPS}.ckpt")
    resumed, _ = _fit(strategy, devices, rank, callbacks=[make_callback()], max_epochs=epochs, ckpt_path=first_epoch)
    return {"weights": _weights(trainer), "resumed_weights": _weights(resumed)}


CASES = ("early_stopping", "checkpoint", *PARAMETER_CALLBACKS)

# Cases that crash mid-training under a strategy: each runs alone, with its errors raised (a crash on one rank
# would leave the other waiting in a collective and break the cases after it). Empty: every strategy now either runs
# these callbacks like one device or refuses them at setup.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _run_case(strategy: str, world_size: int, rank: int, case: str, workdir: str) -> dict[str, Any]:
    if case == "early_stopping":
        return _early_stopping(strategy, world_size, rank, SCORES)
    if case == "checkpoint":
        return _checkpoint_and_learning_rates(strategy, world_size, rank, str(Path(workdir) / "checkpoints"))
    return _parameter_callback(strategy, world_size, rank, case, workdir)


def _cases_in_rank(rank: int, world_size: int, strategy: str, cases: tuple[str, ...], workdir: str) -> dict:
    results: dict[str, Any] = {}
    for case in cases:
        if len(cases) == 1:  # alone: let a failure end the rank, so its peer stops too
            results[case] = _run_case(strategy, world_size, rank, case, workdir)
            continue
        try:
            results[case] = _run_case(strategy, world_size, rank, case, workdir)
        except Exception as error:  # one case's failure is reported by its own test, the others still run
            results[case] = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
    return results


@cache
def _distributed(strategy: str, cases: tuple[str, ...]) -> tuple[dict[str, Any], ...] | Exception:
    """Every rank's results of ``cases`` under ``strategy``, run in one pair of ranks (or the error, cached too)."""
    timeout = TIMEOUT_S if len(cases) > 1 else KNOWN_FAILURE_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="lp-callbacks-") as workdir:
        try:
            return tuple(
                run_distributed(
                    _cases_in_rank,
                    WORLD_SIZE,
                    args=(strategy, cases, workdir),
                    init_process_group=False,
                    timeout=timeout,
                )
            )
        except Exception as error:
            return error


@cache
def _one_device(case: str) -> dict[str, Any]:
    if case == "early_stopping":  # one device sees only the scores of the rank that stops first
        return _early_stopping("auto", 1, 0, (SCORES[1],))
    if case == "checkpoint":
        with tempfile.TemporaryDirectory(prefix="lp-callbacks-") as workdir:
            return _checkpoint_and_learning_rates("auto", 1, 0, workdir)
    if case.startswith("plain-"):  # no callback, for as many epochs
        trainer, _ = _fit("auto", 1, 0, callbacks=[], max_epochs=int(case.removeprefix("plain-")))
        return {"weights": _weights(trainer)}
    with tempfile.TemporaryDirectory(prefix="lp-callbacks-") as workdir:
        return _parameter_callback("auto", 1, 0, case, workdir)


def _case(strategy: str, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if (strategy, case) in KNOWN_FAILURES:
        outcome = _distributed(strategy, (case,))
    else:
        outcome = _distributed(strategy, tuple(c for c in CASES if (strategy, c) not in KNOWN_FAILURES))
    if isinstance(outcome, Exception):
        raise outcome
    rank0, rank1 = (results[case] for results in outcome)
    for result in (rank0, rank1):
        assert "error" not in result, f"{strategy}/{case}: {result['error']}"
    return rank0, rank1


# ------------------------------------------------------------------ tests
@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_early_stopping_stops_every_rank_after_the_same_step(strategy: str) -> None:
    rank0, rank1 = _case(strategy, "early_stopping")
    reference = _one_device("early_stopping")
    assert rank0 == rank1 == reference, (rank0, rank1, reference)
    assert reference["global_step"] < MAX_EPOCHS_EARLY_STOPPING * EPOCH_STEPS  # it did stop early


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_checkpoint_top_k_best_and_resume(strategy: str) -> None:
    rank0, rank1 = _case(strategy, "checkpoint")
    reference = _one_device("checkpoint")
    for key in ("files", "best_model_path"):
        assert rank0[key] == rank1[key] == reference[key], key
    assert len(rank0["top_k"]) == 2
    for result in (rank0, rank1):
        for key in ("best_model_score", "validated_best"):
            assert result[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
        assert result["validated_best"] == pytest.approx(result["best_model_score"], rel=1e-6)
    assert_weights_close(rank0["weights"], reference["weights"], rtol=1e-5, atol=1e-6)
    # Resuming from the other top-k checkpoint really trains, and ends where the uninterrupted run ended.
    assert rank0["resume_step"] < rank0["resumed_global_step"] == CHECKPOINT_EPOCHS * EPOCH_STEPS
    assert_weights_close(rank0["resumed_weights"], rank0["weights"], rtol=1e-5, atol=1e-6)
    assert rank0["resumed_learning_rates"] == pytest.approx(rank0["learning_rates"][rank0["resume_step"] :])


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_learning_rate_monitor_logs_what_one_device_logs(strategy: str) -> None:
    rank0, _ = _case(strategy, "checkpoint")
    reference = _one_device("checkpoint")["learning_rates"]
    assert len(reference) == CHECKPOINT_EPOCHS * EPOCH_STEPS and reference[0] > reference[-1]
    assert rank0["learning_rates"] == pytest.approx(reference, rel=1e-6)


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize(
    ("strategy", "case"),
    [
        pytest.param(
            strategy,
            case,
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[strategy, case])]
            if (strategy, case) in KNOWN_FAILURES
            else [],
        )
        for strategy in STRATEGIES
        for case in PARAMETER_CALLBACKS
    ],
)
def test_parameter_callbacks_work_like_one_device_or_are_refused_at_setup(strategy: str, case: str) -> None:
    rank0, rank1 = _case(strategy, case)
    callback_name = type(PARAMETER_CALLBACKS[case][0]()).__name__
    if "refused" in rank0 or "refused" in rank1:
        assert strategy not in MUST_WORK and case == "pruning", (
            f"{strategy} refused {callback_name}: {rank0.get('refused')}"
        )
        for result in (rank0, rank1):
            assert "refused" in result and callback_name in result["refused"], result
            assert result["global_step"] == 0, result  # before the first step, not after hours of training
        return
    reference = _one_device(case)
    assert_weights_close(rank0["weights"], reference["weights"], rtol=1e-5, atol=1e-6)
    # Resumed from the first epoch's checkpoint: the callback's state comes back as on one device.
    assert_weights_close(rank0["resumed_weights"], reference["resumed_weights"], rtol=1e-5, atol=1e-6)
    reference = reference["weights"]
    plain = _one_device(f"plain-{PARAMETER_CALLBACKS[case][1]}")["weights"]
    assert max((reference[name] - plain[name]).abs().max().item() for name in plain) > 1e-3  # the callback acted
