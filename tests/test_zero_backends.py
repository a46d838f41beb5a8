"""ZeRO backends: the torch-only ``GradientSync`` protocol they implement, and clipping over shards through a
subclass of the Trainer's precision plugin."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from training_helpers import assert_weights_close, fit_tiny

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.distributed.gradient_sync import GradientSync
from lightning_parallel.distributed.zero.backends import (
    FlatBucketBackend,
    FullyShardBackend,
    MasterWeightBackend,
    ReplicatedBackend,
    ZeroBackend,
    ZeroContext,
    backend_type,
)
from lightning_parallel.distributed.zero.config import ZeroConfig

GLOBAL_BATCH = 8
CLIP = 0.05  # far below the tiny GPT's gradient norm, so clipping changes every step


@pytest.mark.parametrize("backend", [ReplicatedBackend, FlatBucketBackend, FullyShardBackend, MasterWeightBackend])
def test_every_backend_has_every_method_of_the_protocols(backend: type[ReplicatedBackend]) -> None:
    """The strategy calls only `ZeroBackend` (`GradientSync` plus holding the module); a name missing or misspelt in
    a backend would fail only on the path that calls it."""
    declared = {name for protocol in (GradientSync, ZeroBackend) for name in vars(protocol) if not name.startswith("_")}
    assert {"reduce_gradients", "clip_grad_norm_", "full_module"} <= declared
    assert sorted(name for name in declared if not hasattr(backend, name)) == []


@pytest.mark.parametrize(
    ("stage", "is_sharding", "keeps_masters", "expected"),
    [
        (0, True, False, ReplicatedBackend),  # a pipeline stage's replicas at zero_stage=0: averaged as DDP does
        (0, False, False, ReplicatedBackend),
        (0, True, True, ReplicatedBackend),  # no ZeRO, no masters
        (1, True, False, FlatBucketBackend),
        (2, True, True, FlatBucketBackend),  # the buckets keep the masters in the shard
        (3, True, False, FullyShardBackend),
        (2, False, False, ReplicatedBackend),  # nothing to shard over
        (3, False, True, MasterWeightBackend),
    ],
)
def test_one_chooser_for_a_whole_model_and_a_pipeline_stage(
    stage: int, is_sharding: bool, keeps_masters: bool, expected: type
) -> None:
    assert backend_type(stage, is_sharding=is_sharding, keeps_masters=keeps_masters) is expected


def test_the_plain_backend_clips_as_torch_and_returns_the_total_norm() -> None:
    torch.manual_seed(0)
    model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    batch = torch.randn(5, 4)
    for module in (model, reference):
        module(batch).square().sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = ReplicatedBackend(ZeroConfig(), ZeroContext()).clip_grad_norm_(optimizer, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.testing.assert_close(norm, expected)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref.grad)


class _PrecisionProbe(Callback):
    """What the Trainer trains with, read inside the rank after fit."""

    def __init__(self) -> None:
        self.facts: dict = {}

    def on_train_end(self, trainer, pl_module) -> None:
        plugin = trainer.precision_plugin
        self.facts = {
            "mixed": isinstance(plugin, MixedPrecision),
            "precision": plugin.precision,
            "patched_on_instance": "clip_grad_by_norm" in vars(plugin),
        }


def _fit(rank: int, world_size: int, stage: int, clip: float | None) -> dict:
    probe = _PrecisionProbe()
    strategy = ShardedOptimizerStrategy(stage=stage) if stage else "auto"
    weights = fit_tiny(
        strategy,
        devices=world_size,
        per_device_batch=GLOBAL_BATCH // world_size,
        optimizer="sgd",
        precision="bf16-mixed",
        gradient_clip_val=clip,
        callbacks=[probe],
    )
    return {"weights": weights, **probe.facts}


@pytest.mark.parametrize("stage", [2, 3])
def test_clipping_keeps_the_trainers_precision_plugin_and_matches_one_device(stage):
    (reference,) = run_distributed(_fit, 1, args=(0, CLIP), init_process_group=False, timeout=180)
    (unclipped,) = run_distributed(_fit, 1, args=(0, None), init_process_group=False, timeout=180)
    results = run_distributed(_fit, 2, args=(stage, CLIP), init_process_group=False, timeout=180)
    for result in results:
        # bf16-mixed autocast kept, and clipping chosen by subclassing, not by replacing a method on the instance.
        assert result["mixed"] and result["precision"] == "bf16-mixed"
        assert not result["patched_on_instance"]
    # bf16 autocast: the reduction order of the averaged gradient is the only difference.
    assert_weights_close(results[0]["weights"], reference["weights"], rtol=1e-2, atol=1e-3)
    moved = max(
        (results[0]["weights"][name] - tensor).abs().max().item() for name, tensor in unclipped["weights"].items()
    )
    assert moved > 1e-2, "clipping had no effect: the test would not see a wrong norm"
    assert all(torch.isfinite(tensor).all() for tensor in results[0]["weights"].values())
