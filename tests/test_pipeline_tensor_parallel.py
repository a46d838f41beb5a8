"""Tensor parallelism inside each pipeline stage: ``PipelineParallelStrategy(pipeline_parallel_size=2,
tensor_parallel_size=2)`` on 4 forked gloo ranks (pipeline 2 x tensor 2, ``zero_stage=0``, no data parallelism).

* unit: the ranks of the pipeline on the mesh with the tensor axis innermost (each tensor rank's pipeline group, the
  replica's source of batches); every ``zero_stage`` taken; refused on every rank before any process group: a
  module without a plan, a head count the tensor size does not divide.
* integration, against one device on the same batches: a Hugging Face Llama with nothing written for it (the
  pipeline's split from its ``base_model_pp_plan``, the tensor split from its own ``tp_plan``) and a module of our
  own through its ``pipeline_layers()`` and ``tensor_parallel_plan()`` train with AdamW and clipping on the global
  norm to one device's weights, AdamW moments and logged losses; the consolidated checkpoint written during the run
  (``DTensor``s gathered whole) loads into a plain module on one device; after the run the module is whole and
  plain on every rank. With 2 data-parallel replicas (8 ranks) at ``zero_stage`` 0-3: one device's weights and AdamW
  moments, and the ZeRO-3 run's checkpoint resumed at ZeRO-2 to the weights one device reaches resuming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import trainer
from test_tensor_parallel import SEQ, VOCAB
from test_tensor_parallel import Llama as PlannedLlama
from test_tensor_parallel import OwnModel as PlannedModel
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from training_helpers import refusal_before_the_process_group

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims

STEPS, BATCH, CLIP = 3, 4, 0.5
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class OwnModel(PlannedModel):
    """``test_tensor_parallel``'s module of our own (its ``tensor_parallel_plan()`` splits the blocks' attention and
    MLP; embedding, norms and head whole), with its pipeline layers."""

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1].contiguous())  # torch 2.11's stage checks the strides of its example's inputs
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss


class Llama(PlannedLlama):
    """A Hugging Face Llama with nothing written for the pipeline or tensor parallelism."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss


MODELS = {"own": OwnModel, "llama": Llama}


# ---------------------------------------------------------------------- unit: the ranks
def test_pipeline_ranks_with_the_tensor_axis_innermost() -> None:
    # 8 ranks: 2 replicas x 2 stages x 2 tensor ranks; rank 5 is replica 1, stage 0, tensor rank 1.
    dims = ParallelDims(8, 5, 2, tensor_parallel_size=2)
    assert (dims.data_parallel_rank, dims.pipeline_rank, dims.tensor_rank) == (1, 0, 1)
    assert [dims.pipeline_global_rank(r) for r in (0, 1)] == [5, 7]  # its tensor rank on every stage
    assert dims.replica_source(0) == 4  # the replica's first stage at tensor rank 0
    assert dims.layout.group_ranks("pp", 5) == [5, 7] and dims.layout.group_ranks("tensor", 5) == [4, 5]


def test_takes_every_zero_stage() -> None:
    for zero_stage in (0, 1, 2, 3):
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=zero_stage)
        assert strategy.tensor_parallel_size == 2


@pytest.mark.parametrize(("devices", "expected"), [(4, 2), (8, 4), (2, 1)])
def test_automatic_pipeline_size_leaves_room_for_the_tensor_axis(devices: int, expected: int) -> None:
    """``pipeline_parallel_size="auto"`` is every rank of one tensor rank (it was the world size, which the mesh then
    refused as ``P x T`` > world)."""
    strategy = PipelineParallelStrategy(tensor_parallel_size=2)
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False)
    assert strategy.pipeline_parallel_size == expected
    assert strategy.mesh_layout.data_parallel_size == 1


class Unplanned(OwnModel):
    """Pipeline layers, but no ``tensor_parallel_plan()`` and no Hugging Face model."""

    tensor_parallel_plan = None  # type: ignore[assignment]


REFUSED = {
    "no plan": (Unplanned, "define `tensor_parallel_plan(self)`"),
    "heads": (
        lambda: Llama(num_attention_heads=2, num_key_value_heads=1),
        "does not divide `model.config.num_key_value_heads` = 1",
    ),
}


def _fit_refused(rank: int, world_size: int, case: str) -> str:
    make, _ = REFUSED[case]
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)
    return refusal_before_the_process_group(lambda: trainer(strategy, world_size, max_steps=1).fit(make(), _loader()))


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_on_every_rank_before_the_process_group(case: str) -> None:
    messages = run_distributed(_fit_refused, 4, args=(case,), init_process_group=False, timeout=60)
    assert all(REFUSED[case][1] in message for message in messages), messages


# ---------------------------------------------------------------------- integration: equal to one device
def _loader() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return DataLoader(list(tokens), batch_size=BATCH, shuffle=False)  # type: ignore[arg-type]


class Record(pl.Callback):
    """Each step's logged loss; at the end of training (the module still split) the consolidated state and
    checkpoint."""

    def __init__(self, path: str) -> None:
        self.path, self.losses, self.state = path, [], {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (optimizer,) = trainer.optimizers
        self.state = {
            "weights": {k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()},
            "optimizer": trainer.strategy.optimizer_state(optimizer),
            "split": sorted(n for n, p in pl_module.named_parameters() if isinstance(p, DTensor)),
        }
        if self.path:
            trainer.save_checkpoint(self.path)  # rank 0 writes, every rank calls


def _fit(name: str, world_size: int, directory: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = MODELS[name]()
    strategy: Any = "auto"
    if world_size > 1:
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)
    record = Record(f"{directory}/{name}.ckpt" if world_size > 1 else "")  # one device resumes the 2 x 2 one
    fit = trainer(strategy, world_size, max_steps=STEPS, gradient_clip_val=CLIP, callbacks=[record])
    fit.fit(module, _loader())
    after = module.state_dict()
    return {
        **record.state,
        "losses": record.losses,
        "after": {k: v.detach().clone() for k, v in after.items()},
        "plain": all(type(v) is Tensor for v in after.values()),
        "checkpoint": record.path,
    }


def _in_ranks(rank: int, world_size: int, directory: str = "") -> dict[str, Any]:
    results: dict[str, Any] = {name: _fit(name, world_size, directory) for name in MODELS}
    results["resumed"] = _resume(world_size, directory)
    return results


def _resume(world_size: int, directory: str) -> dict[str, Tensor]:
    """One step more from the own module's checkpoint written by the 2 x 2 run: its weights (whole, consolidated)."""
    pl.seed_everything(0, verbose=False)
    strategy: Any = "auto"
    if world_size > 1:
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)
    record, module = Record(""), OwnModel()
    fit = trainer(strategy, world_size, max_steps=STEPS + 1, gradient_clip_val=CLIP, callbacks=[record])
    fit.fit(module, _loader(), ckpt_path=f"{directory}/own.ckpt")
    return record.state["weights"]


def test_two_stages_by_two_tensor_ranks_train_like_one_device(tmp_path: Path) -> None:
    ranks = run_distributed(_in_ranks, 4, args=(str(tmp_path),), init_process_group=False, timeout=400)
    (reference,) = run_distributed(
        _in_ranks, 1, args=(str(tmp_path),), init_process_group=False, launcher_env=False, timeout=180
    )
    # Resumed from the 2 x 2 run's checkpoint (its optimizer state cut into the split slices): the weights one device
    # reaches resuming the same checkpoint.
    torch.testing.assert_close(ranks[0]["resumed"], reference["resumed"], **TOLERANCE)
    for name in MODELS:
        expected, result = reference[name], ranks[0][name]
        assert list(result["weights"]) == list(expected["weights"])  # the single-device numbering
        torch.testing.assert_close(result["weights"], expected["weights"], **TOLERANCE)
        assert result["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
        torch.testing.assert_close(result["optimizer"]["state"], expected["optimizer"]["state"], **TOLERANCE)
        for rank in ranks:  # every rank logs the last stage's losses; the module whole and plain after the run
            torch.testing.assert_close(rank[name]["losses"], expected["losses"], rtol=1e-6, atol=1e-6)
            assert rank[name]["plain"]
            torch.testing.assert_close(rank[name]["after"], expected["after"], **TOLERANCE)
        # The consolidated checkpoint loads into the plain module on one device.
        checkpoint = torch.load(result["checkpoint"], weights_only=False)
        plain = MODELS[name]()
        plain.load_state_dict(checkpoint["state_dict"])
        torch.testing.assert_close(plain.state_dict(), expected["weights"], **TOLERANCE)
    # Each rank split its own stage's layers only: stage 0 (ranks 0, 1) some, stage 1 (ranks 2, 3) the others.
    own = [rank["own"]["split"] for rank in ranks]
    assert own[0] == own[1] and own[2] == own[3] and set(own[0]).isdisjoint(own[2])
    assert len(own[0]) + len(own[2]) == 2 * (6 * 2 - 1)  # weights and biases of the six split layers, no key bias


# ---------------------------------------------------------------------- integration: with data-parallel replicas
ZERO_STAGES = (0, 1, 2, 3)


def _replicas_fit(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    """2 replicas x 2 stages x 2 tensor ranks on 8 ranks at each ``zero_stage`` in turn (the stage's ZeRO over its 2
    replicas: 0 averages the gradients' local shards, 1-2 hold the split weights' local slices in flat buckets, 3
    shards them with FSDP2), replica ``r`` reading the half ``r`` of every global batch (one device: the whole batch).
    Then one step more from the ``zero_stage=3`` run's checkpoint, at ``zero_stage=2`` (one device: the same
    checkpoint)."""
    tokens = list(_loader().dataset)
    batch_size = BATCH
    if world_size > 1:
        replica, batch_size = rank // 4, BATCH // 2
        tokens = [tokens[k * BATCH + replica * batch_size + i] for k in range(STEPS) for i in range(batch_size)]

    def fit(zero_stage: int, *, steps: int = STEPS, path: str = "", resume: str | None = None) -> dict[str, Any]:
        pl.seed_everything(0, verbose=False)
        strategy: Any = "auto"
        if world_size > 1:
            strategy = PipelineParallelStrategy(
                pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2, zero_stage=zero_stage
            )
        record, module = Record(path), OwnModel()
        fitted = trainer(strategy, world_size, max_steps=steps, gradient_clip_val=CLIP, callbacks=[record])
        fitted.fit(module, DataLoader(tokens, batch_size=batch_size), ckpt_path=resume)
        after = module.state_dict()
        plain = all(type(v) is Tensor for v in after.values())
        return {**record.state, "after": {k: v.detach().clone() for k, v in after.items()}, "plain": plain}

    path = f"{directory}/zero3.ckpt"
    results: dict[Any, Any] = {}
    if world_size > 1:
        results = {stage: fit(stage, path=path if stage == 3 else "") for stage in ZERO_STAGES}
    else:
        results = {stage: fit(0) for stage in (0,)}
    results["resumed"] = fit(2 if world_size > 1 else 0, steps=STEPS + 1, resume=path)["weights"]
    return results


def test_data_parallel_replicas_of_tensor_parallel_stages_train_like_one_device(tmp_path: Path) -> None:
    ranks = run_distributed(_replicas_fit, 8, args=(str(tmp_path),), init_process_group=False, timeout=500)
    (reference,) = run_distributed(
        _replicas_fit, 1, args=(str(tmp_path),), init_process_group=False, launcher_env=False, timeout=180
    )
    expected = reference[0]
    for stage in ZERO_STAGES:  # the replicas' gradients averaged over the stage's replicas, each ZeRO stage's way
        result = ranks[0][stage]
        assert list(result["weights"]) == list(expected["weights"])  # the single-device numbering
        torch.testing.assert_close(result["weights"], expected["weights"], **TOLERANCE)
        torch.testing.assert_close(result["optimizer"]["state"], expected["optimizer"]["state"], **TOLERANCE)
        for rank in ranks:  # the module whole and plain after the run
            assert rank[stage]["plain"]
            torch.testing.assert_close(rank[stage]["after"], expected["after"], **TOLERANCE)
    # The ZeRO-3 run's consolidated checkpoint loads into the plain module on one device, and resumes at ZeRO-2 to
    # the weights one device reaches resuming it.
    plain = OwnModel()
    plain.load_state_dict(torch.load(tmp_path / "zero3.ckpt", weights_only=False)["state_dict"])
    torch.testing.assert_close(plain.state_dict(), expected["weights"], **TOLERANCE)
    torch.testing.assert_close(ranks[0]["resumed"], reference["resumed"], **TOLERANCE)
