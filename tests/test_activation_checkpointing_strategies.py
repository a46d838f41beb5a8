"""``activation_checkpointing`` as an option of every strategy: the same weights as one device without it.

The building block (names kept, RNG, saved bytes) is tested in ``test_activation_checkpointing.py``; here the
option goes through real Trainers: before DDP wraps the model, before FSDP2 shards its units (ZeRO-3), before the
pipeline splits its layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from training_helpers import _loader_for, assert_weights_close, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos.gpt import Block
from lightning_parallel.distributed.activation_checkpointing import is_checkpointed

STEPS = 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _strategy(name: str, policy: Any) -> Any:
    if name == "data_parallel":
        return DataParallelStrategy(activation_checkpointing=policy)
    if name == "pipeline":
        return PipelineParallelStrategy(schedule="1F1B", activation_checkpointing=policy)
    return ShardedOptimizerStrategy(int(name[-1]), activation_checkpointing=policy)  # type: ignore[arg-type]


def _fit(rank: int, world_size: int, name: str | None, policy: Any, per_device_batch: int) -> tuple[dict, int]:
    torch.set_num_threads(1)
    module = make_module("sgd")
    strategy = "auto" if name is None else _strategy(name, policy)
    trainer = make_trainer(strategy, devices=world_size, max_steps=STEPS)
    trainer.fit(module, train_dataloaders=_loader_for(world_size, per_device_batch))
    checkpointed = sum(is_checkpointed(m) for m in module.modules())
    state = trainer.strategy.lightning_module_state_dict() if world_size > 1 else module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}, checkpointed


@pytest.fixture(scope="module")
def reference() -> dict[int, dict]:
    """Single-device weights without checkpointing, per global batch (data parallel: 8; a 2-stage pipeline: 4)."""
    return {
        batch: run_distributed(_fit, 1, args=(None, False, batch), init_process_group=False, timeout=180)[0][0]
        for batch in (8, 4)
    }


@pytest.mark.parametrize(
    ("name", "policy"), [("data_parallel", {Block}), ("zero2", True), ("zero3", True), ("pipeline", True)]
)
def test_activation_checkpointing_trains_like_one_device_without_it(name, policy, reference) -> None:
    batch = 4  # per rank: data parallel and ZeRO split a global batch of 8, the 2-stage pipeline runs 4 whole
    weights, checkpointed = run_distributed(_fit, 2, args=(name, policy, batch), init_process_group=False)[0]
    assert checkpointed == 2  # the tiny GPT's two blocks (the pipeline: after fit, on the module made whole again)
    assert_weights_close(weights, reference[4 if name == "pipeline" else 8], **TOLERANCE)


def test_a_bad_value_is_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module subclasses"):
        ShardedOptimizerStrategy(2, activation_checkpointing={"Block"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be True"):
        DataParallelStrategy(activation_checkpointing="yes")  # type: ignore[arg-type]
