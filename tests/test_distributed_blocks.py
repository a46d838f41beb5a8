"""Distributed tier: torch-only building blocks on a real gloo group of forked ranks (no Trainer)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed_harness import DistributedTestError, run_distributed
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.distributed.compression import (
    CommunicationStats,
    SerializedPowerSGD,
    low_precision_allreduce_hook,
    validate_compression,
)
from lightning_parallel.distributed.uneven import LockstepBatches, needs_lockstep

CPU = torch.device("cpu")


# ---------------------------------------------------------------- harness
def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()


def test_harness_reports_the_failing_rank_traceback():
    with pytest.raises(DistributedTestError, match="boom on rank one"):
        run_distributed(_raise_on_rank_one, timeout=20)


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_harness_kills_a_hung_rank_and_names_it():
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish"):
        run_distributed(_hang_on_rank_zero, timeout=3, init_process_group=False)


# ---------------------------------------------------------------- compression hooks
def _ddp_gradients(rank: int, world_size: int, compression: str | None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    # Tiny buckets so several buckets are in flight: the case that aborts torch's PowerSGD hook on gloo.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    stats = CommunicationStats()
    if compression in ("fp16", "bf16", "fp32"):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[compression]
        ddp.register_comm_hook(None, low_precision_allreduce_hook(dtype, stats))
    elif compression == "powersgd":
        ddp.register_comm_hook(None, SerializedPowerSGD(None, rank=2, start_iter=2, stats=stats, serialize=True))
    torch.manual_seed(100 + rank)
    for _ in range(4):
        ddp.zero_grad()
        ddp(torch.randn(8, 64)).square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"grads": grads, "bytes": dict(stats.bytes_by_collective), "calls": stats.calls}


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_low_precision_hook_matches_fp32_within_dtype_tolerance_and_halves_bytes(compression):
    exact = run_distributed(_ddp_gradients, args=("fp32",))
    compressed = run_distributed(_ddp_gradients, args=(compression,))
    tolerance = {"fp16": 2e-3, "bf16": 2e-2}[compression]
    torch.testing.assert_close(compressed[0]["grads"], exact[0]["grads"], rtol=tolerance, atol=tolerance)
    # Both ranks hold the same (averaged) gradient.
    torch.testing.assert_close(compressed[0]["grads"], compressed[1]["grads"], rtol=0, atol=0)
    assert compressed[0]["bytes"]["all_reduce"] * 2 == exact[0]["bytes"]["all_reduce"]
    assert exact[0]["calls"] > 4  # several buckets per step were exercised


def test_powersgd_with_many_buckets_runs_on_gloo_and_sends_fewer_bytes():
    exact = run_distributed(_ddp_gradients, args=("fp32",))
    result = run_distributed(_ddp_gradients, args=("powersgd",))
    torch.testing.assert_close(result[0]["grads"], result[1]["grads"], rtol=0, atol=0)
    assert result[0]["bytes"]["all_reduce"] < exact[0]["bytes"]["all_reduce"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression": "int8"}, "Unknown `gradient_compression='int8'`"),
        ({"compression": "powersgd", "powersgd_rank": 0}, "powersgd_rank=0"),
        ({"compression": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter=1"),
    ],
)
def test_bad_compression_options_name_the_value(kwargs, message):
    options = {"powersgd_rank": 1, "powersgd_start_iter": 2, **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        validate_compression(options.pop("compression"), **options)


# ---------------------------------------------------------------- uneven inputs
class _NoLength(torch.utils.data.IterableDataset):
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        return iter(range(self.count))


def _lockstep(rank: int, world_size: int, counts: list[int], sized: bool) -> dict:
    count = counts[rank]
    loader = list(range(count)) if sized else _NoLength(count)
    wrapped = LockstepBatches(loader, device=CPU)
    seen, padding = [], []
    for batch in wrapped:
        seen.append(batch)
        padding.append(wrapped.pop_is_padding())
    return {"seen": seen, "padding": padding, "needs": needs_lockstep(loader, device=CPU)}


@pytest.mark.parametrize("sized", [True, False])
def test_lockstep_yields_the_same_number_of_batches_on_every_rank(sized):
    rank0, rank1 = run_distributed(_lockstep, args=([5, 3], sized))
    assert rank0["seen"] == [0, 1, 2, 3, 4] and rank0["padding"] == [False] * 5
    assert rank1["seen"] == [0, 1, 2, 2, 2] and rank1["padding"] == [False, False, False, True, True]
    assert rank0["needs"] and rank1["needs"]


def test_equal_lengths_need_no_lockstep():
    rank0, _ = run_distributed(_lockstep, args=([4, 4], True))
    assert rank0["needs"] is False


def test_a_rank_without_any_batch_raises_on_every_rank():
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_lockstep, args=([3, 0], True), timeout=30)
    text = str(error.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert text.count("received no training batch") == 2
    assert "did not finish" not in text
