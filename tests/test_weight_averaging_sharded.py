"""Lightning's own weight averaging under ZeRO-3 and the pipeline, against Lightning's ``DDPStrategy`` on 2 ranks.

``EMAWeightAveraging`` and ``StochasticWeightAveraging``, unchanged, on a user-like language model whose LM head
shares the embedding's weight (``model_zoo.TiedGPT``: under ZeRO-3 the tied weight sits in the root unit, which FSDP2
keeps gathered after an evaluation forward; under a 2-stage pipeline the embedding and the head live on different
ranks) with a validation loop (the callbacks swap the averages in and out around it, the sanity check included)
and AdamW. For each callback and strategy, in one pair of forked ranks:

* the weights the module holds after ``fit`` (the averages, swapped in at the end of training), the validation
  losses, and the checkpoint written before the last epoch (the averaged weights, the module's own, the averaging
  state) equal DDP's;
* each rank's copy holds its shard (every parameter a DTensor) or its stage only, never the whole model;
* resuming from that checkpoint ends where the uninterrupted run ended;
* ``checkpoint_format="sharded"`` is refused at set-up, on every rank, before the first step;
* ZeRO-3 resumes an optimizer without state (plain SGD) with EMA.

In one process: a copy held like a stage keeps the stage's layers and loads its part of a whole state (a tied
weight named once), and a copy that differs from the module is refused, naming the difference.

``tests/test_callbacks.py`` runs the same callbacks under every strategy against one device (with
``data_parallel``, ``zero1`` and ``zero2`` too).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.distributed.tensor import DTensor
from training_helpers import assert_weights_close
from typing_extensions import override

from lightning_parallel import PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel._compat import averaged_copy_of
from lightning_parallel.distributed.averaged_copy import StageCopyHolding, hold_copy
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.remote_layer import RemoteLayer

WORLD_SIZE = 2
EPOCH_STEPS = 2
STRATEGIES = ("ddp", "zero3", "pipeline")  # Lightning's DDPStrategy first: the reference
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
CALLBACKS: dict[str, tuple[Callable[[], pl.Callback], int]] = {  # the callback, and the epochs to train
    "ema": (lambda: EMAWeightAveraging(decay=0.7), 2),
    "swa": (lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1), 3),
}


class _LanguageModel(zoo.TiedGPT):
    """The tied language model with a validation loss."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, sync_dist=True)


class _ValidationLosses(pl.Callback):
    """Every validation loss the Trainer logs (each is computed with the averaged weights swapped in)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def _fit(
    strategy: Any, world_size: int, case: str, *, workdir: Path, ckpt_path: str | None = None
) -> tuple[pl.Trainer, pl.Callback, _ValidationLosses]:
    make_callback, epochs = CALLBACKS[case]
    callback, losses = make_callback(), _ValidationLosses()
    every_epoch = ModelCheckpoint(dirpath=workdir, save_top_k=-1)
    pl.seed_everything(0, verbose=False)
    trainer = zoo.trainer(
        strategy,
        world_size,
        max_steps=-1,
        max_epochs=epochs,
        callbacks=[callback, every_epoch, losses],
        enable_checkpointing=True,
        limit_val_batches=None,
        num_sanity_val_steps=1,  # the callbacks swap their (initial) copy in for the sanity check too
    )
    sampler = trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
    replica = (sampler["num_replicas"], sampler["rank"])
    train = zoo.loader(*replica, kind="tokens", steps=EPOCH_STEPS)
    val = zoo.loader(*replica, kind="tokens", steps=1)
    trainer.fit(_LanguageModel(), train, val, ckpt_path=ckpt_path)
    return trainer, callback, losses


def _weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Collective: the whole module's weights after ``fit`` (complete on rank 0)."""
    return {name: t.detach().clone() for name, t in trainer.strategy.lightning_module_state_dict().items()}


def _held(callback: pl.Callback) -> dict[str, Any]:
    """What this rank's averaged copy holds: its parameters' names (every name of a tied one), their local element
    count, and whether all are DTensors."""
    copy = averaged_copy_of(callback)
    params = list(copy.parameters())
    return {
        "names": [name for name, _ in copy.named_parameters(remove_duplicate=False)],
        "numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
    }


def _saved(path: Path) -> dict[str, Any]:
    """The parts of a checkpoint that weight averaging writes (and the module's weights)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    keys = ("state_dict", "current_model_state", "averaging_state", "callbacks")
    return {key: checkpoint[key] for key in keys if key in checkpoint}


def _case(rank: int, world_size: int, strategy: str, case: str, workdir: Path) -> dict[str, Any]:
    """Fit with the callback (a checkpoint per epoch), then resume a fresh run from the one before the last epoch."""
    trainer, callback, losses = _fit(strategy, world_size, case, workdir=workdir / "fit")
    resume_from = workdir / "fit" / f"epoch={trainer.max_epochs - 2}-step={(trainer.max_epochs - 1) * EPOCH_STEPS}.ckpt"
    last = workdir / "fit" / f"epoch={trainer.max_epochs - 1}-step={trainer.max_epochs * EPOCH_STEPS}.ckpt"
    result = {"weights": _weights(trainer), "val_losses": losses.losses, "held": _held(callback)}
    if rank == 0:
        result |= {"saved": _saved(resume_from), "last_saved": _saved(last)}
    resumed, _, _ = _fit(strategy, world_size, case, workdir=workdir / "resumed", ckpt_path=str(resume_from))
    result["resumed_weights"] = _weights(resumed)
    return result


def _refused(world_size: int, strategy: pl.strategies.Strategy, workdir: Path) -> dict[str, Any]:
    trainer = zoo.trainer(strategy, world_size, callbacks=[EMAWeightAveraging()], default_root_dir=workdir)
    try:
        trainer.fit(_LanguageModel(), zoo.loader(kind="tokens"))
    except ValueError as error:
        return {"error": str(error), "global_step": trainer.global_step}
    return {"error": None, "global_step": trainer.global_step}


def _stateless_optimizer_resume(rank: int, world_size: int, workdir: Path) -> dict[str, Any]:
    """ZeRO-3 resuming plain SGD (no optimizer state to shard; torch's loader needs one tensor state) with EMA."""
    first_epoch = str(workdir / "fit" / f"epoch=0-step={EPOCH_STEPS}.ckpt")
    weights = []
    for directory, ckpt_path in ((workdir / "fit", None), (workdir / "resumed", first_epoch)):
        pl.seed_everything(0, verbose=False)
        every_epoch = ModelCheckpoint(dirpath=directory, save_top_k=-1)
        callbacks = [EMAWeightAveraging(decay=0.7), every_epoch]
        trainer = zoo.trainer(
            "zero3", world_size, max_steps=-1, max_epochs=2, callbacks=callbacks, enable_checkpointing=True
        )
        trainer.fit(zoo.ResidualMLP(), zoo.loader(world_size, rank, steps=EPOCH_STEPS), ckpt_path=ckpt_path)
        weights.append(_weights(trainer))
    return {"weights": weights[0], "resumed_weights": weights[1]}


def _in_ranks(rank: int, world_size: int, workdir: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    results["stateless"] = _stateless_optimizer_resume(rank, world_size, Path(workdir) / "stateless")
    for strategy in STRATEGIES:
        for case in CALLBACKS:
            results[strategy, case] = _case(rank, world_size, strategy, case, Path(workdir) / strategy / case)
    sharded_zero3 = ShardedOptimizerStrategy(stage=3, checkpoint_format="sharded")
    sharded_pipeline = PipelineParallelStrategy(checkpoint_format="sharded")
    results["refused", "zero3"] = _refused(world_size, sharded_zero3, Path(workdir))
    results["refused", "pipeline"] = _refused(world_size, sharded_pipeline, Path(workdir))
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    with tempfile.TemporaryDirectory(prefix="lp-averaging-") as workdir:
        return run_distributed(_in_ranks, WORLD_SIZE, args=(workdir,), init_process_group=False, timeout=240)


def _assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)  # the same names in the same order, as DDP (one device) writes them
    assert_weights_close(actual, expected, **TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "pipeline"])
@pytest.mark.parametrize("case", list(CALLBACKS))
def test_module_after_fit_and_validation_losses_equal_ddp(ranks, strategy: str, case: str) -> None:
    reference, result = ranks[0]["ddp", case], ranks[0][strategy, case]
    _assert_states_close(result["weights"], reference["weights"])
    assert result["val_losses"] == pytest.approx(reference["val_losses"], rel=1e-5)
    assert len(reference["val_losses"]) == 1 + CALLBACKS[case][1]  # the sanity check, then every epoch
    # The module holds the averages, not its own last weights.
    if case == "ema":
        _assert_states_close(result["weights"], reference["last_saved"]["state_dict"])
        current = reference["last_saved"]["current_model_state"]
        assert max((current[name] - result["weights"][name]).abs().max().item() for name in current) > 1e-3
    else:  # SWA's checkpoints hold the module's own weights, and the average in the callback's state
        average = reference["last_saved"]["callbacks"]["StochasticWeightAveraging"]["average_model_state"]
        own = reference["last_saved"]["state_dict"]
        assert max((own[name] - result["weights"][name]).abs().max().item() for name in own) > 1e-3
        assert average.keys() == result["weights"].keys()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "pipeline"])
@pytest.mark.parametrize("case", list(CALLBACKS))
def test_checkpoint_holds_the_whole_averages_ddp_writes(ranks, strategy: str, case: str) -> None:
    reference, saved = ranks[0]["ddp", case]["saved"], ranks[0][strategy, case]["saved"]
    assert saved.keys() == reference.keys()
    _assert_states_close(saved["state_dict"], reference["state_dict"])
    if case == "ema":
        _assert_states_close(saved["current_model_state"], reference["current_model_state"])
        assert saved["averaging_state"] == reference["averaging_state"]
        assert int(saved["averaging_state"]["n_averaged"]) == EPOCH_STEPS  # the epoch's steps, averaged
    else:
        state = dict(saved["callbacks"]["StochasticWeightAveraging"])
        expected = dict(reference["callbacks"]["StochasticWeightAveraging"])
        _assert_states_close(state.pop("average_model_state"), expected.pop("average_model_state"))
        assert state == expected  # n_averaged, the epoch of the last update, the SWA scheduler's state
        assert state["n_averaged"] == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "pipeline"])
@pytest.mark.parametrize("case", list(CALLBACKS))
def test_each_rank_averages_only_what_it_holds(ranks, strategy: str, case: str) -> None:
    model = _LanguageModel()
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    whole = sum(p.numel() for p in model.parameters())
    held = [result[strategy, case]["held"] for result in ranks]
    if strategy == "zero3":  # every parameter a DTensor shard; the shards add up to the model
        assert all(entry["all_dtensor"] and entry["names"] == names for entry in held)
        assert all(entry["numel"] < whole for entry in held) and sum(entry["numel"] for entry in held) == whole
    else:  # each stage's parameters only (the tied embedding/head on both stages: its names split between them)
        assert all(set(entry["names"]) < set(names) for entry in held), held
        assert sorted(name for entry in held for name in entry["names"]) == sorted(names)
    assert [result["ddp", case]["held"]["numel"] for result in ranks] == [whole, whole]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "pipeline"])
@pytest.mark.parametrize("case", list(CALLBACKS))
def test_resume_from_the_checkpoint_continues_like_an_uninterrupted_run(ranks, strategy: str, case: str) -> None:
    result = ranks[0][strategy, case]
    _assert_states_close(result["resumed_weights"], result["weights"])


@pytest.mark.timeout(300)
def test_zero3_resumes_an_optimizer_without_state(ranks) -> None:
    _assert_states_close(ranks[0]["stateless"]["resumed_weights"], ranks[0]["stateless"]["weights"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "pipeline"])
def test_sharded_checkpoint_format_is_refused_before_training_on_every_rank(ranks, strategy: str) -> None:
    for result in ranks:
        refused = result["refused", strategy]
        assert refused["error"] is not None and refused["global_step"] == 0, refused
        assert refused["error"].startswith("`EMAWeightAveraging` needs `checkpoint_format='consolidated'`")


# ------------------------------------------------------------------ one process: holding a copy like a stage
def _stage_of_tied_model() -> tuple[nn.Module, nn.Module, StageCopyHolding]:
    """A whole copy, and the module as pipeline rank 1 of 2 holds it (the embedding and first block elsewhere)."""
    model = _LanguageModel()
    whole_copy = copy.deepcopy(model)
    model.embedding = RemoteLayer("embedding", 0)
    model.blocks[0] = RemoteLayer("blocks.0", 0)
    keys = list(whole_copy.state_dict())
    aliases = {"head.weight": "embedding.weight"}
    return model, whole_copy, StageCopyHolding(ParallelDims(2, 1, 2), keys, aliases)


def test_a_stage_copy_holds_the_stage_and_loads_its_part_of_a_whole_state() -> None:
    model, whole_copy, layout = _stage_of_tied_model()
    whole_state = {name: torch.randn_like(t) for name, t in whole_copy.state_dict().items()}
    del whole_state["head.weight"]  # a state naming the tied weight once, by its canonical name
    hold_copy(whole_copy, model, layout)
    assert [n for n, _ in whole_copy.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert isinstance(whole_copy.embedding, RemoteLayer)
    whole_copy.load_state_dict(whole_state)  # strict: this rank's entries, the tied head from the embedding's
    torch.testing.assert_close(whole_copy.head.weight, whole_state["embedding.weight"])
    torch.testing.assert_close(whole_copy.blocks[1].mlp[0].weight, whole_state["blocks.1.mlp.0.weight"])
    assert hold_copy(whole_copy, model, layout) is hold_copy(whole_copy, model, layout)  # held once


def test_a_copy_of_another_module_is_refused_naming_the_difference() -> None:
    model, whole_copy, layout = _stage_of_tied_model()
    model.extra = nn.Linear(2, 2)  # built after the callback copied the module
    with pytest.raises(ValueError, match=r"does not hold the same parameters as the module .*'extra.weight'"):
        hold_copy(whole_copy, model, layout)
