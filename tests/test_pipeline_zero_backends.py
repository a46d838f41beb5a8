"""The pipeline composes the ZeRO backends (issue 31, item 1): each stage is held by ``ShardedOptimizerStrategy``'s
own backend, built from the same ``ZeroConfig``.

* Every ZeRO option reaches both strategies: the same ``ZeroConfig`` from the same arguments, the same refusal (the
  same message) for every bad value, and at run time the stage's backend built from it (bucket cap, overlapped
  parameter gather, master weights).
* What the backend brings to the pipeline, against one device:

  - hybrid sharding inside the pipeline (``pp x replicate x shard`` = 2 x 2 x 2 ranks): ZeRO-1, 2 and 3 train
    ``model_zoo.TiedGPT`` (embedding and head tied across the two stages) to one device's weights, the tied copies
    bitwise equal, each rank holding exactly ``1/shard_size`` of its stage's optimizer state;
  - fp32 master weights under ``precision="bf16-true"`` (2 x 2 ranks): ZeRO-1 and 2 equal
    ``ShardedOptimizerStrategy`` on one device with its masters, bit for bit in the masters' checkpoint entry; the
    consolidated checkpoint holds the bf16 ``state_dict`` and the masters in the single-device layout and resumes
    on one device exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from training_helpers import assert_weights_close

from lightning_parallel import PipelineParallelStrategy, ShardedOptimizerStrategy

ADAM_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # as tests/test_pipeline_zero.py
TIED = ("embedding.weight", "head.weight")

ZERO_OPTIONS: dict[str, Any] = {"shard_size": 2, "bucket_cap_mb": 0.001, "master_weights": None}
"""Non-default values of the options both strategies take (``overlap_param_gather`` is checked on its own)."""


# ---------------------------------------------------------------------- the options (no process)
@pytest.mark.parametrize("overlap_param_gather", [True, False, "auto"])
def test_every_zero_option_reaches_both_strategies_as_one_config(overlap_param_gather: Any) -> None:
    options = {**ZERO_OPTIONS, "overlap_param_gather": overlap_param_gather}
    for stage in (1, 2, 3):
        pipeline = PipelineParallelStrategy(zero_stage=stage, **options)
        sharded = ShardedOptimizerStrategy(stage, **options)
        assert pipeline.zero_config == sharded.zero_config


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("shard_size", 0),
        ("shard_size", "2"),
        ("bucket_cap_mb", 0),
        ("bucket_cap_mb", -1.0),
        ("master_weights", "fp16"),
        ("overlap_param_gather", "yes"),
    ],
)
def test_a_bad_zero_option_is_refused_with_the_same_message_by_both(option: str, value: Any) -> None:
    with pytest.raises(ValueError) as sharded:
        ShardedOptimizerStrategy(2, **{option: value})
    with pytest.raises(ValueError) as pipeline:
        PipelineParallelStrategy(zero_stage=2, **{option: value})
    assert str(pipeline.value) == str(sharded.value)
    assert repr(value) in str(pipeline.value)


@pytest.mark.parametrize("option", ["shard_size", "bucket_cap_mb"])
def test_zero_only_options_without_zero_are_refused(option: str) -> None:
    with pytest.raises(ValueError, match=rf"`{option}=.*` shards or buckets ZeRO's state, but `zero_stage=0`"):
        PipelineParallelStrategy(zero_stage=0, **{option: ZERO_OPTIONS[option]})


# ---------------------------------------------------------------------- runs
class _AtTrainEnd(pl.Callback):
    """While the module is still split: this rank's tied copies, its bytes held, its stage's size, and what the
    stage's ZeRO backend was built with."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(trainer.strategy, PipelineParallelStrategy):
            return
        named = dict(pl_module.named_parameters(remove_duplicate=False))
        backend = trainer.strategy._current_run.backend
        self.facts = {
            "copies": {n: _whole(named[n].detach()).clone() for n in TIED if n in named},
            "stage_numel": sum(p.numel() for p in pl_module.parameters()),
            "parameters": len(list(pl_module.parameters())),
            "memory": trainer.strategy.memory_report().as_dict(),
            "backend": type(backend).__name__,
            "buckets": len(backend.buckets.buckets) if hasattr(backend, "buckets") else None,
            "overlaps_gather": backend.gather is not None if hasattr(backend, "gather") else None,
        }


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _fit(strategy: Any, devices: int, *, checkpoint: str | None = None, resume: str | None = None, **kwargs: Any):
    pl.seed_everything(0, verbose=False)
    at_end = _AtTrainEnd()
    trainer = zoo.trainer(strategy, devices, callbacks=[at_end], **kwargs)
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = zoo.TiedGPT()
    trainer.fit(module, zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens"), ckpt_path=resume)
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)  # a collective: every rank calls it
    return {"weights": zoo.state_of(module), "global_step": trainer.global_step, **at_end.facts}


def _pipeline(zero_stage: int, **kwargs: Any) -> PipelineParallelStrategy:
    return PipelineParallelStrategy(pipeline_parallel_size=2, zero_stage=zero_stage, timeout=120, **kwargs)


def _check_copies_and_state(results: list[dict], *, shard_size: int, state_bytes_per_element: int) -> None:
    copies = [value for result in results for value in result["copies"].values()]
    assert copies and all(torch.equal(copy, copies[0]) for copy in copies[1:])  # stepped identically, bit for bit
    for result in results:
        numel = result["stage_numel"]
        assert numel % shard_size == 0  # no bucket padding: the shares are exact
        assert result["memory"]["optimizer_state"] == state_bytes_per_element * numel // shard_size


def _hybrid_ranks(rank: int, world_size: int) -> dict[str, dict]:
    """pp=2 x replicate=2 x shard=2: each stage sharded over 2 replicas, the 2 shard groups holding the same shards."""
    return {
        "zero1": _fit(_pipeline(1, shard_size=2), world_size),
        "zero2": _fit(_pipeline(2, shard_size=2, bucket_cap_mb=0.001, overlap_param_gather=False), world_size),
        "zero3": _fit(_pipeline(3, shard_size=2), world_size),
    }


def _one_device(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    return {
        "adam": _fit("auto", 1),
        # One device with ZeRO's fp32 masters of bf16 parameters (nothing to shard at world size 1).
        "bf16_masters": _fit(ShardedOptimizerStrategy(2), 1, precision="bf16-true"),
        "bf16_masters_two_epochs": _fit(
            ShardedOptimizerStrategy(2), 1, precision="bf16-true", max_steps=-1, max_epochs=2
        ),
    }


def test_hybrid_sharding_inside_the_pipeline_trains_like_one_device() -> None:
    (single,) = run_distributed(_one_device, 1, args=("",), init_process_group=False, timeout=180)
    results = run_distributed(_hybrid_ranks, 8, init_process_group=False, timeout=420)
    runs = {name: [result[name] for result in results] for name in results[0]}
    for name, state_elements in (("zero1", 2), ("zero2", 2), ("zero3", 2)):
        for result in runs[name]:
            assert_weights_close(result["weights"], single["adam"]["weights"], **ADAM_TOLERANCE)
        # fp32 AdamW: two states of 4 bytes per element, this rank's half of its stage (shard_size=2, not dp=4).
        _check_copies_and_state(runs[name], shard_size=2, state_bytes_per_element=4 * state_elements)
    assert {result["backend"] for result in runs["zero2"]} == {"FlatBucketBackend"}
    assert {result["backend"] for result in runs["zero3"]} == {"FullyShardBackend"}
    # The options reached the backend: a bucket cap of ~1 KiB cuts a stage of several parameters into several buckets
    # (the default holds any stage of this model in one), and no overlap.
    assert all(result["buckets"] >= min(result["parameters"], 3) for result in runs["zero2"])
    assert max(result["buckets"] for result in runs["zero2"]) >= 3
    assert not any(result["overlaps_gather"] for result in runs["zero2"])
    assert all(result["buckets"] == 1 and result["overlaps_gather"] for result in runs["zero1"])  # the defaults


def _bf16_ranks(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    checkpoint = f"{directory}/pipeline_bf16.ckpt"
    return {
        "zero1": _fit(_pipeline(1), world_size, precision="bf16-true"),
        "zero2": _fit(_pipeline(2), world_size, precision="bf16-true", checkpoint=checkpoint),
        "zero3": _fit(_pipeline(3), world_size, precision="bf16-true", checkpoint=f"{directory}/zero3_bf16.ckpt"),
    }


def _no_replicas(rank: int, world_size: int) -> dict:
    """A pipeline of 2 ranks, no data parallelism: nothing to shard, the fp32 masters kept (as at world size 1)."""
    return _fit(_pipeline(3), world_size, precision="bf16-true")


def _resume_on_one_device(rank: int, world_size: int, checkpoint: str) -> dict:
    strategy = ShardedOptimizerStrategy(2)
    return _fit(strategy, 1, precision="bf16-true", resume=checkpoint, max_steps=-1, max_epochs=2)


def test_fp32_master_weights_inside_the_pipeline_equal_one_device(tmp_path: Path) -> None:
    (single,) = run_distributed(_one_device, 1, args=(str(tmp_path),), init_process_group=False, timeout=180)
    results = run_distributed(_bf16_ranks, 4, args=(str(tmp_path),), init_process_group=False, timeout=300)
    runs = {name: [result[name] for result in results] for name in results[0]}
    reference = single["bf16_masters"]["weights"]
    assert all(value.dtype == torch.bfloat16 for value in reference.values() if value.is_floating_point())
    for name in ("zero1", "zero2", "zero3"):
        for result in runs[name]:
            assert_weights_close(result["weights"], reference, **BF16_CLOSE)
        # AdamW's two fp32 states and (stages 1-2) the fp32 master: this replica's half of its stage. At stage 3 the
        # sharded parameters are the fp32 masters (4 bytes per element, counted as parameters).
        _check_copies_and_state(runs[name], shard_size=2, state_bytes_per_element=8 if name == "zero3" else 12)
    for result in runs["zero3"]:
        assert result["memory"]["parameters"] == 4 * result["stage_numel"] // 2
    # Without replicas (2 x 1) zero_stage=3 keeps every parameter's fp32 master, as one device does.
    for result in run_distributed(_no_replicas, 2, init_process_group=False, timeout=180):
        assert_weights_close(result["weights"], reference, **BF16_CLOSE)
        assert result["memory"]["optimizer_state"] == 12 * result["stage_numel"]
    # The consolidated checkpoints: the bf16 state_dict and the fp32 masters in the single-device layout.
    for checkpoint in ("pipeline_bf16.ckpt", "zero3_bf16.ckpt"):
        _check_master_weights_checkpoint(torch.load(tmp_path / checkpoint, weights_only=True))
    # Resumed on one device (ShardedOptimizerStrategy keeps masters at world size 1): where two epochs end.
    (resumed,) = run_distributed(
        _resume_on_one_device, 1, args=(str(tmp_path / "pipeline_bf16.ckpt"),), init_process_group=False, timeout=180
    )
    assert_weights_close(resumed["weights"], single["bf16_masters_two_epochs"]["weights"], **BF16_CLOSE)


def _check_master_weights_checkpoint(saved: dict) -> None:
    (optimizer_state,) = saved["optimizer_states"]
    masters = optimizer_state["master_weights"]
    names = [name for name, _ in zoo.TiedGPT().named_parameters()]
    assert sorted(masters) == list(range(len(names)))  # every parameter's, numbered as one device numbers them
    for index, name in enumerate(names):
        master, weight = masters[index], saved["state_dict"][name]
        assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
        assert torch.equal(master.to(torch.bfloat16), weight)  # the bf16 weights are the masters rounded
    assert any(not torch.equal(masters[i], saved["state_dict"][n].float()) for i, n in enumerate(names))


BF16_CLOSE = {"rtol": 1.6e-2, "atol": 4e-3}
"""bf16 weights from micro-batched gradients (the pipeline sums 2 micro-batches' bf16 gradients, and the tied copies'
gradients in fp32) against one device's whole-batch gradient: equal up to the rounding of a bf16 gradient, about one
bf16 ulp of a weight of magnitude 0.5 (3.9e-3); fp32 master weights keep the differences from growing."""


class _ValidatedTiedGPT(zoo.TiedGPT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))


def _saved_around_validate(rank: int, world_size: int, directory: str) -> None:
    """ZeRO-2 at 2 x 2: ``fit``, save, ``validate`` (which splits the module afresh), save again."""
    pl.seed_everything(0, verbose=False)
    trainer = zoo.trainer(_pipeline(2), world_size)
    sampler = trainer.strategy.distributed_sampler_kwargs
    loader = zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens")
    module = _ValidatedTiedGPT()
    trainer.fit(module, loader)
    trainer.save_checkpoint(f"{directory}/after_fit.ckpt")
    trainer.validate(module, loader, verbose=False)
    trainer.save_checkpoint(f"{directory}/after_validate.ckpt")


def test_a_checkpoint_saved_after_validate_holds_the_fits_zero_state(tmp_path: Path) -> None:
    run_distributed(_saved_around_validate, 4, args=(str(tmp_path),), init_process_group=False, timeout=180)
    before = torch.load(tmp_path / "after_fit.ckpt", weights_only=True)
    after = torch.load(tmp_path / "after_validate.ckpt", weights_only=True)
    assert_weights_close(after["state_dict"], before["state_dict"], rtol=0.0, atol=0.0)
    (saved_before,), (saved_after,) = before["optimizer_states"], after["optimizer_states"]
    assert saved_after["param_groups"] == saved_before["param_groups"]
    assert saved_after["state"].keys() == saved_before["state"].keys() and saved_before["state"]
    for index, state in saved_before["state"].items():
        for key, value in state.items():
            assert torch.equal(saved_after["state"][index][key], value), (index, key)
