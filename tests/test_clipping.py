"""The one clipper by a global norm (``distributed/clipping.py``): every norm type, over gradients split between
pipeline stages (with tied copies), sharded by ZeRO, or both, equals ``torch.nn.utils.clip_grad_norm_`` on one
device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed

from lightning_parallel.distributed.clipping import clip_grad_norm_over_ranks_, grad_norm_over_ranks
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer

NORM_TYPES = (1.0, 2.0, 3.0, math.inf)
MAX_NORM = 0.5


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _batch(rank: int) -> torch.Tensor:
    return torch.arange(10, dtype=torch.float32).reshape(2, 5) * (0.3 + rank)


def _reference(norm_type: float) -> tuple[float, list[torch.Tensor]]:
    """One device: the mean over both ranks' batches, clipped by torch."""
    model = _model()
    loss = sum(model(_batch(rank)).square().sum() for rank in range(2)) / 2
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)
    return float(norm), [p.grad.clone() for p in model.parameters()]


def _over_ranks(rank: int, world_size: int) -> dict[str, dict[float, tuple[float, list[torch.Tensor]]]]:
    results: dict[str, dict[float, tuple[float, list[torch.Tensor]]]] = {"pipeline": {}, "zero": {}}
    for norm_type in NORM_TYPES:
        # Pipeline: each rank holds the full (already averaged) gradients of its stage only; the last layer's bias
        # is "tied": both ranks hold it, rank 0 counts it and rank 1 only scales its copy.
        model = _model()
        loss = sum(model(_batch(r)).square().sum() for r in range(2)) / 2
        loss.backward()
        params = list(model.parameters())
        stage = params[:2] if rank == 0 else params[2:3]
        copies = [params[3]] if rank == 1 else []
        counted = stage + ([params[3]] if rank == 0 else [])
        norm = clip_grad_norm_over_ranks_(
            counted, MAX_NORM, norm_type=norm_type, groups=[dist.group.WORLD], device=torch.device("cpu"), copies=copies
        )
        results["pipeline"][norm_type] = (float(norm), [p.grad.clone() for p in [*stage, *copies]])
        # ZeRO-2: every bucket cut into two shards, one per rank (parameters split across the shard boundary).
        model = _model()
        buckets = ShardedParameterBuckets(model, stage=2, bucket_cap_mb=64 / 2**20)
        ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), buckets)  # the views the optimizer steps
        model(_batch(rank)).square().sum().backward()
        buckets.finish_gradient_sync()
        norm = buckets.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
        full = []
        for param in model.parameters():  # each rank's clipped pieces, gathered into the full gradient
            flat = torch.zeros(param.numel())
            for view in buckets.views():
                if view.param is param:
                    flat[view.start : view.stop] = view.grad
            dist.all_reduce(flat)
            full.append(flat.view_as(param))
        results["zero"][norm_type] = (float(norm), full)
    return results


@pytest.fixture(scope="module")
def over_ranks() -> list[dict[str, dict[float, tuple[float, list[torch.Tensor]]]]]:
    return run_distributed(_over_ranks, 2, timeout=120)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_pipeline_clipping_equals_one_device(over_ranks: list, norm_type: float) -> None:
    norm, grads = _reference(norm_type)
    stages = ([0, 1], [2, 3])  # rank 1 also scaled its copy of the tied bias
    for rank, result in enumerate(over_ranks):
        measured_norm, measured = result["pipeline"][norm_type]
        assert measured_norm == pytest.approx(norm, rel=1e-6)
        for got, index in zip(measured, stages[rank], strict=True):
            torch.testing.assert_close(got, grads[index])


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_zero_clipping_equals_one_device(over_ranks: list, norm_type: float) -> None:
    norm, grads = _reference(norm_type)
    for result in over_ranks:
        measured_norm, measured = result["zero"][norm_type]
        assert measured_norm == pytest.approx(norm, rel=1e-6)
        for got, expected in zip(measured, grads, strict=True):
            torch.testing.assert_close(got, expected)


def test_one_rank_and_16_bit_gradients() -> None:
    """No groups: torch's own norm, with 16-bit gradients normed in fp32."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16)]
    for param in params:
        param.grad = torch.randn_like(param) * 3
    for norm_type in NORM_TYPES:
        expected = torch.linalg.vector_norm(torch.cat([p.grad.float() for p in params]), norm_type)
        norm = grad_norm_over_ranks(params, norm_type=norm_type, groups=(), device=torch.device("cpu"))
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm, expected)


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -math.inf])
def test_a_norm_that_cannot_be_combined_is_refused(norm_type: float) -> None:
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    with pytest.raises(ValueError, match=f"norm_type={norm_type!r}"):
        grad_norm_over_ranks([param], norm_type=norm_type, device=torch.device("cpu"))
