"""``torch.compile`` under every strategy: a compiled model trains exactly as the uncompiled one on one device.

Users compile in place (``nn.Module.compile()``, which keeps parameter names and checkpoints unchanged): the
model inside the LightningModule for data parallel and ZeRO (the ZeRO-1/2 gradient hooks and FSDP2's units sit on
the compiled module's parameters), each ``pipeline_layers()`` entry for the pipeline, which runs its layers one by
one. ``aot_eager`` runs dynamo and AOTAutograd (what changes how gradients are produced) without inductor's C++
compile, which would cost ~20 s per graph on this machine and change float rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from torch._dynamo.utils import counters  # test-only: proves the compiled code ran
from training_helpers import _loader_for, assert_weights_close, make_module, make_trainer

STEPS = 3
GLOBAL_BATCH = 8
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _fit(rank: int, world_size: int, strategy: Any, compile_what: str | None, per_device_batch: int) -> tuple:
    torch.set_num_threads(1)
    module = make_module("sgd")
    if compile_what == "model":
        module.model.compile(backend="aot_eager")
    elif compile_what == "layers":
        for layer in module.pipeline_layers():
            layer.compile(backend="aot_eager")
    trainer = make_trainer(strategy, devices=world_size, max_steps=STEPS)
    trainer.fit(module, train_dataloaders=_loader_for(world_size, per_device_batch))
    state = trainer.strategy.lightning_module_state_dict() if world_size > 1 else module.state_dict()
    weights = {name: tensor.detach().clone() for name, tensor in state.items()}
    return weights, counters["stats"]["unique_graphs"]  # graphs dynamo compiled in this rank


@pytest.fixture(scope="module")
def reference() -> dict[int, dict]:
    """Uncompiled single-device weights per global batch (data parallel splits 8; a 2-stage pipeline keeps 4)."""
    return {
        batch: run_distributed(_fit, 1, args=("auto", None, batch), init_process_group=False, timeout=180)[0][0]
        for batch in (GLOBAL_BATCH, GLOBAL_BATCH // 2)
    }


ZERO3_COMPILED_TEARDOWN = pytest.mark.skipif(
    torch.__version__ < "2.12",
    reason="torch 2.11: Lightning's teardown (`module.cpu()`) cannot swap FSDP2's parameters of a compiled module"
    " ('Cannot swap t1 because it has weakref associated with it'); known limit, docs/zero.md",
)


@pytest.mark.parametrize("strategy", ["data_parallel", "zero2", pytest.param("zero3", marks=ZERO3_COMPILED_TEARDOWN)])
def test_compiled_model_trains_like_one_uncompiled_device(strategy: str, reference: dict[int, dict]) -> None:
    args = (strategy, "model", GLOBAL_BATCH // 2)
    weights, graphs = run_distributed(_fit, 2, args=args, init_process_group=False, timeout=300)[0]
    assert graphs > 0
    assert_weights_close(weights, reference[GLOBAL_BATCH], **TOLERANCE)


def test_compiled_pipeline_layers_train_like_one_uncompiled_device(reference: dict[int, dict]) -> None:
    args = ("pipeline", "layers", GLOBAL_BATCH // 2)  # 2 stages, 1 replica: the global batch is the rank's
    weights, graphs = run_distributed(_fit, 2, args=args, init_process_group=False, timeout=300)[0]
    assert graphs > 0
    assert_weights_close(weights, reference[GLOBAL_BATCH // 2], **TOLERANCE)
