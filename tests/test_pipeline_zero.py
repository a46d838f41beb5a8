"""ZeRO inside the pipeline (issue 13, item 2): ``PipelineParallelStrategy(zero_stage=1|2)`` on 2 x 2 ranks.

Each stage's optimizer state (stage 1) and gradients (stage 2) are sharded over its 2 data-parallel replicas. One
forked run of 4 gloo ranks trains ``model_zoo.TiedGPT`` (its embedding and LM head tied across the two stages, so
the tied sum over stages runs on shards) three ways, checked against single-device Lightning on the same global
batches:

* ``zero1_adam``: AdamW, zero_stage=1;
* ``zero2_sgd_clipped``: SGD with momentum and ``gradient_clip_val`` (norm over shards and stages, the tied copy
  counted once), zero_stage=2;
* ``zero2_adam``: AdamW, zero_stage=2, one epoch, then a consolidated checkpoint (the single-device one) that one
  device and the plain 2 x 2 pipeline resume for a second epoch; a single-device checkpoint resumed under
  zero_stage=1 likewise. Each ends where an uninterrupted two-epoch single-device run ends.
* ``zero2_accumulated``: AdamW, zero_stage=2, ``accumulate_grad_batches=2`` (gradients of two batches summed before
  one reduce-scatter);
* ``no_replicas``: zero_stage=2 on a 4-stage pipeline (no data parallelism): nothing to shard, a plain run.

Every sharded run: weights equal one device, the tied copies are bitwise equal, and ``memory_report()`` shows each
rank holding exactly half its stage's optimizer state (and, at stage 2, half its gradients).

zero_stage=3 (issue 22, item 3) has a run of its own: FSDP2 shards each stage's parameters too, the tied copies
included (every rank holds half of everything), on the same cases and schedules; its consolidated checkpoint is the
single-device one and resumes on one device and under zero_stage=0, and the single-device one resumes under it;
its sharded directory reassembles into the single-device checkpoint and resumes under it.
Another run compares it with zero_stage=0 (32-true and bf16-mixed) through validation during fit, a checkpoint
written mid-run, ``validate`` and ``predict``; weight averaging, the zero-bubble schedule and a tie within one rank
are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from training_helpers import assert_checkpoint_is_single_devices, assert_weights_close

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.accounting import storage_bytes
from lightning_parallel.distributed.checkpoint import sharded_to_consolidated
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tied import TiedParameter
from lightning_parallel.distributed.pipeline.zero import check_no_tie_within_a_rank

SGD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
ADAM_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # as tests/test_pipeline.py
CLIP = 0.05  # well below the gradient norm of every step: clipping is active throughout
TIED = ("embedding.weight", "head.weight")
DP = 2  # replicas of each stage at 2 x 2


class SGDTiedGPT(zoo.TiedGPT):
    """TiedGPT with SGD (momentum), so the clipping coefficient shows in the weights (Adam would normalise it away)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _AtTrainEnd(pl.Callback):
    """While the module is still split: this rank's tied copies, its bytes held, and its stage's size."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        named = pl_module.named_parameters(remove_duplicate=False)
        self.facts = {
            # zero_stage=3: each copy whole (a collective over the stage's replicas, in the same order on each).
            "copies": {n: _whole(p.detach()).clone() for n, p in named if n in TIED},
            "stage_numel": sum(p.numel() for p in pl_module.parameters()),
            "memory": trainer.strategy.memory_report().as_dict() if pl_module.trainer.world_size > 1 else None,
            # What the monitor's peak breakdown counts as gradients: the same storages memory_report() counts.
            "gradient_tensor_bytes": storage_bytes(trainer.strategy.gradient_tensors())
            if pl_module.trainer.world_size > 1
            else None,
        }


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _fit(
    make_model: Any,
    strategy: Any,
    devices: int,
    *,
    checkpoint: str | None = None,
    resume: str | None = None,
    **kwargs: Any,
) -> dict:
    pl.seed_everything(0, verbose=False)
    at_end = _AtTrainEnd()
    trainer = zoo.trainer(strategy, devices, callbacks=[at_end], **kwargs)
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = make_model()
    trainer.fit(module, zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens"), ckpt_path=resume)
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)  # a collective: every rank calls it
    return {
        "weights": zoo.state_of(module),
        "is_tied": module.head.weight is module.embedding.weight,
        "global_step": trainer.global_step,
        **at_end.facts,
    }


def _pipeline(zero_stage: int, schedule: str = "1F1B", **kwargs: Any) -> PipelineParallelStrategy:
    return PipelineParallelStrategy(
        pipeline_parallel_size=2, zero_stage=zero_stage, schedule=schedule, timeout=120, **kwargs
    )


def _epochs(count: int) -> dict[str, int]:
    return {"max_steps": -1, "max_epochs": count}


def _four_ranks(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    """The 2 x 2 runs; the last two resume a checkpoint for a second epoch: the 2 x 2 zero_stage=2 one under the
    plain pipeline, the single-device one under zero_stage=1."""
    zero2 = f"{directory}/zero2.ckpt"
    return {
        "zero1_adam": _fit(zoo.TiedGPT, _pipeline(1), world_size),
        "zero2_sgd_clipped": _fit(SGDTiedGPT, _pipeline(2), world_size, gradient_clip_val=CLIP),
        "zero2_adam": _fit(zoo.TiedGPT, _pipeline(2), world_size, checkpoint=zero2, **_epochs(1)),
        "plain_resumed": _fit(zoo.TiedGPT, _pipeline(0), world_size, resume=zero2, **_epochs(2)),
        "zero2_accumulated": _fit(zoo.TiedGPT, _pipeline(2), world_size, accumulate_grad_batches=2),
        "no_replicas": _fit(zoo.TiedGPT, PipelineParallelStrategy(zero_stage=2, timeout=120), world_size),
        "zero1_resumed": _fit(zoo.TiedGPT, _pipeline(1), world_size, resume=f"{directory}/single.ckpt", **_epochs(2)),
        # The other schedules; the zero-bubble one writes its split weight gradients outside autograd's hooks.
        **{
            f"zero2_{schedule}": _fit(zoo.TiedGPT, _pipeline(2, schedule), world_size, **_epochs(1))
            for schedule in ("GPipe", "Interleaved1F1B", "InterleavedZeroBubble")
        },
    }


def _references(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    """Single-device runs, and a single-device checkpoint after one epoch."""
    return {
        "adam": _fit(zoo.TiedGPT, "auto", 1, checkpoint=f"{directory}/single.ckpt", **_epochs(1)),
        "sgd_clipped": _fit(SGDTiedGPT, "auto", 1, gradient_clip_val=CLIP),
        "sgd": _fit(SGDTiedGPT, "auto", 1),
        "accumulated": _fit(zoo.TiedGPT, "auto", 1, accumulate_grad_batches=2),
        "two_epochs": _fit(zoo.TiedGPT, "auto", 1, **_epochs(2)),
    }


def _resumed_on_one_device(rank: int, world_size: int, checkpoint: str) -> dict:
    return _fit(zoo.TiedGPT, "auto", 1, resume=checkpoint, **_epochs(2))


def _check_run(results: list[dict], reference: dict, tolerance: dict, *, state_elements: int, zero_stage: int) -> None:
    for result in results:
        assert_weights_close(result["weights"], reference["weights"], **tolerance)
        assert result["is_tied"]  # the module is whole after fit, the tie intact
    copies = [value for result in results for value in result["copies"].values()]
    assert len(copies) == 4  # the embedding on the first stage's 2 ranks, the head on the last stage's 2
    for copy in copies[1:]:
        assert torch.equal(copy, copies[0])  # the copies stepped identically, bit for bit
    for result in results:
        numel = result["stage_numel"]
        assert numel % DP == 0  # no bucket padding: the halves are exact
        memory = result["memory"]
        assert memory["optimizer_state"] == state_elements * 4 * numel // DP  # fp32, half the stage's state
        shard = 4 * numel // DP
        # Stage 1 keeps the full buckets, its reduced shard a slice of them (reduced in place); stage 2 the shard.
        assert memory["gradients"] == (shard if zero_stage == 2 else 4 * numel)
        assert result["gradient_tensor_bytes"] == memory["gradients"]
        assert memory["parameters"] == 4 * numel  # whole on every replica


def _against_one_device(
    references: Callable[..., dict[str, dict]],
    four_ranks: Callable[..., dict[str, dict]],
    tmp_path: Path,
    *,
    checkpoint: str,
) -> tuple[dict[str, dict], dict[str, list[dict]], dict]:
    """The one-device references, the 4-rank runs (each run's per-rank results by name), and ``checkpoint`` (written
    by the 4-rank runs) resumed on one device."""
    directory = str(tmp_path)
    (single,) = run_distributed(references, 1, args=(directory,), init_process_group=False, timeout=180)
    results = run_distributed(four_ranks, 4, args=(directory,), init_process_group=False, timeout=300)
    runs = {name: [result[name] for result in results] for name in results[0]}
    (resumed,) = run_distributed(
        _resumed_on_one_device, 1, args=(str(tmp_path / checkpoint),), init_process_group=False, timeout=120
    )
    return single, runs, resumed


def test_zero_inside_the_pipeline_trains_like_one_device_and_resumes_on_one_device(tmp_path: Path) -> None:
    single, runs, resumed = _against_one_device(_references, _four_ranks, tmp_path, checkpoint="zero2.ckpt")
    # Clipping is active: without it the weights differ.
    assert not torch.allclose(single["sgd_clipped"]["weights"]["head.weight"], single["sgd"]["weights"]["head.weight"])

    _check_run(runs["zero1_adam"], single["adam"], ADAM_TOLERANCE, state_elements=2, zero_stage=1)
    _check_run(runs["zero2_sgd_clipped"], single["sgd_clipped"], SGD_TOLERANCE, state_elements=1, zero_stage=2)
    _check_run(runs["zero2_adam"], single["adam"], ADAM_TOLERANCE, state_elements=2, zero_stage=2)
    _check_run(runs["zero2_accumulated"], single["accumulated"], ADAM_TOLERANCE, state_elements=2, zero_stage=2)
    for schedule in ("GPipe", "Interleaved1F1B", "InterleavedZeroBubble"):
        _check_run(runs[f"zero2_{schedule}"], single["adam"], ADAM_TOLERANCE, state_elements=2, zero_stage=2)

    # Without replicas zero_stage=2 is the plain pipeline: whole gradients and optimizer state, one device's weights.
    for result in runs["no_replicas"]:
        assert_weights_close(result["weights"], single["adam"]["weights"], **ADAM_TOLERANCE)
        numel = result["stage_numel"]
        assert result["memory"] == {
            "parameters": 4 * numel,
            "gradients": 4 * numel,
            "optimizer_state": 2 * 4 * numel,
            "total": 16 * numel,
        }
    # The consolidated checkpoint is the single-device one: same keys, optimizer state in the single-device layout.
    saved = torch.load(tmp_path / "zero2.ckpt", weights_only=True)
    expected = torch.load(tmp_path / "single.ckpt", weights_only=True)
    assert_checkpoint_is_single_devices(saved, expected, **ADAM_TOLERANCE)
    # Resumed for a second epoch: on one device, under the plain pipeline, and (from the single-device checkpoint)
    # under zero_stage=1: each ends where two uninterrupted epochs on one device end.
    two_epochs = single["two_epochs"]["weights"]
    for run in (resumed, *runs["plain_resumed"], *runs["zero1_resumed"]):
        assert run["global_step"] == 2 * zoo.STEPS
        assert_weights_close(run["weights"], two_epochs, **ADAM_TOLERANCE)


@pytest.mark.parametrize("zero_stage", [4, -1, True, "1", 1.0, None])
def test_invalid_zero_stage_is_refused_naming_the_value_and_the_options(zero_stage: Any) -> None:
    with pytest.raises(ValueError, match=r"`zero_stage=.*` is invalid\. Valid options: 0 .*1 .*2"):
        PipelineParallelStrategy(zero_stage=zero_stage)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_with_the_sharded_checkpoint_format_is_refused_with_the_fix(zero_stage: int) -> None:
    with pytest.raises(
        ValueError, match=rf"`zero_stage={zero_stage}` with `checkpoint_format='sharded'`.*'consolidated'"
    ):
        PipelineParallelStrategy(zero_stage=zero_stage, checkpoint_format="sharded")


# ---------------------------------------------------------------------------------------------------- zero_stage=3
def _four_ranks_zero3(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    """zero_stage=3 at 2 x 2; ``zero3_adam`` saves the checkpoint that the last run (and one device) resume."""
    zero3 = f"{directory}/zero3.ckpt"
    return {
        "zero3_adam": _fit(zoo.TiedGPT, _pipeline(3), world_size, checkpoint=zero3, **_epochs(1)),
        "zero3_sgd_clipped": _fit(SGDTiedGPT, _pipeline(3), world_size, gradient_clip_val=CLIP),
        "zero3_accumulated": _fit(zoo.TiedGPT, _pipeline(3), world_size, accumulate_grad_batches=2),
        "zero3_resumed": _fit(zoo.TiedGPT, _pipeline(3), world_size, resume=f"{directory}/single.ckpt", **_epochs(2)),
        "plain_resumed": _fit(zoo.TiedGPT, _pipeline(0), world_size, resume=zero3, **_epochs(2)),
        # The sharded format: each replica writes its rows of its stage (after fit: from the optimizer's shards).
        "zero3_sharded": _fit(zoo.TiedGPT, _sharded3(), world_size, checkpoint=f"{directory}/zero3_dir", **_epochs(1)),
        "sharded_resumed": _fit(zoo.TiedGPT, _sharded3(), world_size, resume=f"{directory}/zero3_dir", **_epochs(2)),
        **{
            f"zero3_{schedule}": _fit(zoo.TiedGPT, _pipeline(3, schedule), world_size, **_epochs(1))
            for schedule in ("GPipe", "Interleaved1F1B")
        },
    }


def _sharded3() -> PipelineParallelStrategy:
    return _pipeline(3, checkpoint_format="sharded")


def _references_zero3(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    return {
        "adam": _fit(zoo.TiedGPT, "auto", 1, checkpoint=f"{directory}/single.ckpt", **_epochs(1)),
        "sgd_clipped": _fit(SGDTiedGPT, "auto", 1, gradient_clip_val=CLIP),
        "accumulated": _fit(zoo.TiedGPT, "auto", 1, accumulate_grad_batches=2),
        "two_epochs": _fit(zoo.TiedGPT, "auto", 1, **_epochs(2)),
    }


def _check_zero3_run(results: list[dict], reference: dict, tolerance: dict, *, state_elements: int) -> None:
    for result in results:
        assert_weights_close(result["weights"], reference["weights"], **tolerance)
        assert result["is_tied"]  # the module is plain and whole after fit, the tie intact
        assert not any(isinstance(t, DTensor) for t in result["weights"].values())
    copies = [value for result in results for value in result["copies"].values()]
    assert len(copies) == 4  # the embedding on the first stage's 2 ranks, the head on the last stage's 2
    for copy in copies[1:]:
        assert torch.equal(copy, copies[0])  # the copies stepped identically, bit for bit
    for result in results:
        numel = result["stage_numel"]
        shard = 4 * numel // DP  # fp32; every parameter's rows split evenly over the 2 replicas (no padding)
        assert result["memory"] == {
            "parameters": shard,
            "gradients": shard,
            "optimizer_state": state_elements * shard,
            "total": (2 + state_elements) * shard,
        }
        assert result["gradient_tensor_bytes"] == shard


def test_zero3_inside_the_pipeline_shards_everything_trains_like_one_device_and_resumes(tmp_path: Path) -> None:
    single, runs, resumed = _against_one_device(_references_zero3, _four_ranks_zero3, tmp_path, checkpoint="zero3.ckpt")

    _check_zero3_run(runs["zero3_adam"], single["adam"], ADAM_TOLERANCE, state_elements=2)
    _check_zero3_run(runs["zero3_sgd_clipped"], single["sgd_clipped"], SGD_TOLERANCE, state_elements=1)
    _check_zero3_run(runs["zero3_accumulated"], single["accumulated"], ADAM_TOLERANCE, state_elements=2)
    for schedule in ("GPipe", "Interleaved1F1B"):
        _check_zero3_run(runs[f"zero3_{schedule}"], single["adam"], ADAM_TOLERANCE, state_elements=2)
    # Half of zero_stage=0's bytes per rank and more: parameters, gradients and state all halved.
    saved = torch.load(tmp_path / "zero3.ckpt", weights_only=True)
    expected = torch.load(tmp_path / "single.ckpt", weights_only=True)
    assert_checkpoint_is_single_devices(saved, expected, **ADAM_TOLERANCE)
    two_epochs = single["two_epochs"]["weights"]
    _check_zero3_run(runs["zero3_sharded"], single["adam"], ADAM_TOLERANCE, state_elements=2)
    assert_checkpoint_is_single_devices(
        sharded_to_consolidated(tmp_path / "zero3_dir"), expected, **ADAM_TOLERANCE
    )  # the sharded directory reassembles into the single-device checkpoint
    for run in (resumed, *runs["plain_resumed"], *runs["zero3_resumed"], *runs["sharded_resumed"]):
        assert run["global_step"] == 2 * zoo.STEPS
        assert_weights_close(run["weights"], two_epochs, **ADAM_TOLERANCE)


def test_zero3_refuses_the_zero_bubble_schedule_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"`zero_stage=3` with `schedule='InterleavedZeroBubble'`.*`zero_stage=2`"):
        PipelineParallelStrategy(zero_stage=3, schedule="InterleavedZeroBubble")


def test_zero3_refuses_a_tied_weight_whose_users_share_a_pipeline_rank() -> None:
    tied = [TiedParameter("embedding.weight", ((0, "weight"), (3, "weight")))]
    # Looped placement: 4 stages on 2 ranks, stages 0 and 2 on rank 0, 1 and 3 on rank 1.
    check_no_tie_within_a_rank(tied, StagePlan((0, 1, 2, 3), 4, 2), 2)  # layer 0 on rank 0, layer 3 on rank 1
    with pytest.raises(ValueError, match=r"`zero_stage=3` cannot shard `embedding.weight`.*ShardedOptimizerStrategy"):
        check_no_tie_within_a_rank(tied, StagePlan((0, 2), 4, 1), 1)
    with pytest.raises(ValueError, match=r"pipeline layers \(0, 3\) that run on one pipeline rank"):
        check_no_tie_within_a_rank([TiedParameter("w", ((0, "w"), (3, "w")))], StagePlan((0, 1, 2, 3), 4, 3), 3)
    with pytest.raises(ValueError, match=r"place those layers on different ranks .* or use `zero_stage=2`"):
        check_no_tie_within_a_rank([TiedParameter("w", ((0, "w"), (3, "w")))], StagePlan((0, 1, 2, 3), 4, 3), 3)


def _fit_with_averaging(rank: int, world_size: int) -> str:
    trainer = zoo.trainer(_pipeline(3), world_size, callbacks=[EMAWeightAveraging()])
    sampler = trainer.strategy.distributed_sampler_kwargs
    try:
        trainer.fit(zoo.TiedGPT(), zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens"))
    except ValueError as error:
        return str(error)
    return "trained"


def test_zero3_refuses_weight_averaging_on_every_rank_with_the_fix() -> None:
    messages = run_distributed(_fit_with_averaging, 2, init_process_group=False, timeout=60)
    for message in messages:
        assert "`EMAWeightAveraging` is not supported with `PipelineParallelStrategy(zero_stage=3)`" in message
        assert "Use `zero_stage=2`" in message


class _EvaluatedTiedGPT(zoo.TiedGPT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten()))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


_EVALUATED = [
    (precision, zero_stage, "consolidated") for precision in ("32-true", "bf16-mixed") for zero_stage in (0, 3)
] + [("32-true", 3, "sharded")]


def _fit_evaluate_predict(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    """zero_stage 0 and 3, 32-true and bf16-mixed (and zero_stage=3 in the sharded format): fit with validation every
    2 steps and a checkpoint written while the module is split (``last.ckpt`` at step 4), then ``validate`` and
    ``predict`` (each splits and shards anew)."""
    runs = {}
    for precision, zero_stage, checkpoint_format in _EVALUATED:
        pl.seed_everything(0, verbose=False)
        path = f"{directory}/{precision}-{zero_stage}-{checkpoint_format}"
        trainer = zoo.trainer(
            _pipeline(zero_stage, checkpoint_format=checkpoint_format),
            world_size,
            callbacks=[ModelCheckpoint(dirpath=path, save_last=True, every_n_train_steps=2)],
            enable_checkpointing=True,
            precision=precision,
            val_check_interval=2,
            limit_val_batches=2,
        )
        sampler = trainer.strategy.distributed_sampler_kwargs
        module = _EvaluatedTiedGPT()
        loader = zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens")
        trainer.fit(module, loader, loader)
        validated = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
        predicted = torch.cat(trainer.predict(module, loader))
        trainer.save_checkpoint(f"{path}/after_evaluation.ckpt")  # the optimizers are still fit's
        runs[f"{precision}-{zero_stage}-{checkpoint_format}"] = {
            "weights": zoo.state_of(module),
            "checkpoint": _read(f"{path}/last.ckpt"),  # a directory in the sharded format
            "after_evaluation": _read(f"{path}/after_evaluation.ckpt"),
            "validated": validated,
            "predicted": predicted,
        }
    return runs


def _read(path: str) -> dict[str, Any]:
    saved = sharded_to_consolidated(path) if Path(path).is_dir() else torch.load(path, weights_only=True)
    return {"state_dict": saved["state_dict"], "optimizer": saved["optimizer_states"][0]}


def test_zero3_evaluates_predicts_and_checkpoints_mid_run_like_zero_stage_0(tmp_path: Path) -> None:
    results = run_distributed(_fit_evaluate_predict, 4, args=(str(tmp_path),), init_process_group=False, timeout=300)
    for runs in results:
        for precision, zero_stage, checkpoint_format in _EVALUATED:
            plain, sharded = runs[f"{precision}-0-consolidated"], runs[f"{precision}-{zero_stage}-{checkpoint_format}"]
            assert_weights_close(sharded["weights"], plain["weights"], **ADAM_TOLERANCE)
            assert_weights_close(
                sharded["checkpoint"]["state_dict"], plain["checkpoint"]["state_dict"], **ADAM_TOLERANCE
            )
            # Saved after `validate` and `predict` (which split and shard anew): what the end of `fit` wrote.
            after, last = sharded["after_evaluation"], sharded["checkpoint"]
            assert_weights_close(after["state_dict"], last["state_dict"], rtol=0, atol=0)
            assert after["optimizer"]["param_groups"] == last["optimizer"]["param_groups"]
            for index, state in last["optimizer"]["state"].items():
                assert_weights_close(after["optimizer"]["state"][index], state, rtol=0, atol=0)
            assert sharded["validated"] == pytest.approx(plain["validated"], rel=1e-5)
            torch.testing.assert_close(sharded["predicted"], plain["predicted"], rtol=1e-4, atol=1e-4)
