"""The pipeline split from a plain torch loop, without Lightning: ``split_into_stages`` -> engine + backend + a torch
optimizer -> ``PipelineRun.reassemble``, against one device trained on the same data with the same optimizer."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
from distributed_harness import run_distributed
from model_zoo import TiedLM
from torch import nn

from lightning_parallel.distributed.pipeline.parallel_dims import build_parallel_dims
from lightning_parallel.distributed.pipeline.stage_split import StageHolding, split_into_stages
from lightning_parallel.distributed.pipeline.zero import pipeline_zero_config

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_parallel"
VOCAB, WIDTH, STEPS = 16, 8, 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randint(VOCAB, (4, 5), generator=generator), torch.randint(VOCAB, (4, 5), generator=generator))
        for _ in range(STEPS)
    ]


def _one_device(model: nn.Module) -> nn.Module:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for index, batch in enumerate(_batches()):
        model.training_step(batch, index).backward()  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad()
    return model


def _plain_loop(rank: int, world_size: int, pipeline_parallel_size: int, zero_stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TiedLM(VOCAB, WIDTH)  # a plain nn.Module, no LightningModule
    reference = _one_device(copy.deepcopy(model))
    zero_config = pipeline_zero_config(zero_stage)
    dims = build_parallel_dims(
        world_size, rank, pipeline_parallel_size=pipeline_parallel_size, zero_config=zero_config
    )  # a collective: the mesh and its process groups
    device = torch.device("cpu")
    run = split_into_stages(
        model,
        dims=dims,
        device=device,
        num_stages=pipeline_parallel_size,
        schedule="1F1B",
        num_microbatches=2,
        partition=[2] if pipeline_parallel_size == 2 else "parameters",
        holding=StageHolding(zero_config=zero_config),
    )
    engine, backend = run.engine, run.backend
    assert engine is not None
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # this rank's stage only
    run.setup_optimizers([optimizer])  # ZeRO-2: the stage's flat buckets, this replica's shard stepped
    losses = []
    dp, replica = dims.data_parallel_size, dims.data_parallel_rank
    for index, (tokens, targets) in enumerate(_batches()):
        rows = slice(replica * len(tokens) // dp, (replica + 1) * len(tokens) // dp)  # this replica's part
        batch = (tokens[rows], targets[rows])
        inputs, _ = engine.capture_inputs("training_step", (batch, index), {})
        outcome = engine.train_step("training_step", (batch, index), {}, model_inputs=inputs, divisor=2)
        backend.reduce_gradients()  # the replicas' average, then the tied copies' sum over the pipeline ranks
        optimizer.step()
        backend.after_optimizer_step(optimizer)  # ZeRO-2: all-gather the stepped shards
        optimizer.zero_grad()
        assert outcome.loss is not None
        losses.append(outcome.loss.item())
    backend.wait_for_parameters()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, parameter in model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(parameter, expected[name], msg=f"{name} on rank {rank}")
    run.reassemble(model, device=device)
    backend.teardown()
    assert not run.is_split and model.head.weight is model.embedding.weight
    torch.testing.assert_close(model.state_dict(), reference.state_dict())
    return {"held": sorted(held), "losses": losses, "backend": type(backend).__name__}


def test_split_into_stages_trains_like_one_device_in_a_plain_torch_loop() -> None:
    """Two pipeline ranks, the tied weight's copies on both: each rank holds its stage and ends equal to one device."""
    results = run_distributed(_plain_loop, world_size=2, args=(2, 0), timeout=120)
    block = ["mlp.0.bias", "mlp.0.weight", "norm.bias", "norm.weight"]
    assert results[0]["held"] == [*(f"blocks.0.{name}" for name in block), "embedding.weight"]
    assert results[1]["held"] == [*(f"blocks.1.{name}" for name in block), "head.weight"]  # the tied copy
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == STEPS


def test_split_into_stages_with_zero_over_two_replicas_trains_like_one_device() -> None:
    """One stage on two data-parallel replicas with ZeRO-2 (the flat buckets' backend): each replica trains on its half
    of every batch and both end equal to one device on the whole batches."""
    results = run_distributed(_plain_loop, world_size=2, args=(1, 2), timeout=120)
    assert [r["backend"] for r in results] == ["FlatBucketBackend", "FlatBucketBackend"]
    assert results[0]["held"] == results[1]["held"] and "head.weight" in results[0]["held"]


def test_the_split_module_imports_no_lightning() -> None:
    """The split, its run record and what they import, loaded without the package's ``__init__`` (which exports the
    strategies): no Lightning, no strategy module."""
    code = f"""
        import json, sys, types
        package = types.ModuleType("lightning_parallel")  # the package without its __init__ (the strategies)
        package.__path__ = [{str(PACKAGE_DIR)!r}]
        sys.modules["lightning_parallel"] = package
        import lightning_parallel.distributed.pipeline.stage_split
        import lightning_parallel.distributed.pipeline.run
        print(json.dumps(sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.",
              "pytorch_lightning", "lightning_parallel.strategies")))))
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
