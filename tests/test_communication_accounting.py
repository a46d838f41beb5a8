"""What the strategies count as communication (``CommunicationStats``, which ``ParallelismMonitor`` reads) equals
the planner's prediction, byte for byte, including ZeRO-1/2's "got a gradient" flags (one byte per parameter
tensor, all-reduced at every gradient sync), on real 2-rank fits of a user-like model with several buckets.

The per-step ``requires_grad`` fingerprint of ``distributed/trainable.py`` (one all-reduce of two int64, 16 bytes,
run by data parallel and ZeRO every training step) is a control message of fixed size, like the non-finite-loss
flag: neither side counts it (``monitor/ledger.py``), and the equality below holds with it running every step.
``tests/test_planner.py`` checks the same equality through the monitor on the demo GPT (``-m slow``).
"""

from __future__ import annotations

from functools import cache

import pytest
from distributed_harness import run_distributed
from model_zoo import ResidualMLP, fit_in_rank

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.planner import plan

STEPS = 3
BUCKET_CAP_MB = 0.002  # 2 KiB: the model's 1,612 elements fill 5 buckets (124, 576, 24, 576, 312 elements)
CASES = {
    "zero1": lambda: ShardedOptimizerStrategy(stage=1, bucket_cap_mb=BUCKET_CAP_MB),
    "zero2": lambda: ShardedOptimizerStrategy(stage=2, bucket_cap_mb=BUCKET_CAP_MB),
    "data_parallel": lambda: DataParallelStrategy(track_communication=True),
}


def _fits(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    counted = {}
    for case, make_strategy in CASES.items():
        strategy = make_strategy()
        strategy.track_communication = True  # what ParallelismMonitor switches on before set-up
        fit_in_rank(ResidualMLP, strategy, world_size, steps=STEPS)
        counted[case] = dict(strategy.communication_stats.bytes_by_collective)
    return counted


@cache
def _counted() -> list[dict[str, dict[str, int]]]:
    return run_distributed(_fits, 2, init_process_group=False, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_counted_bytes_equal_the_planner(case: str) -> None:
    predicted = plan(
        ResidualMLP(), world_size=2, batch_size=4, bucket_cap_mb=BUCKET_CAP_MB, process_group_backend="gloo"
    ).configuration(case)
    for rank, counted in enumerate(_counted()):
        per_step = predicted.ranks[rank].communication
        assert counted[case] == {kind: STEPS * num_bytes for kind, num_bytes in per_step.items()}, f"rank {rank}"


def test_zero_flags_are_one_byte_per_parameter_in_both() -> None:
    """The flags are in both numbers: 8 parameter tensors, 8 bytes per step beside the 1,612 gradient elements."""
    predicted = plan(
        ResidualMLP(), world_size=2, batch_size=4, bucket_cap_mb=BUCKET_CAP_MB, process_group_backend="gloo"
    )
    for stage in (1, 2):
        # gloo: the gradient buckets are all-reduced in place (fp32), and beside them the flags, one byte each
        assert predicted.configuration(f"zero{stage}").ranks[0].communication == {
            "all_reduce": 1612 * 4 + 8,
            "all_gather": 1612 * 4,
        }
        assert _counted()[0][f"zero{stage}"] == {"all_reduce": STEPS * (1612 * 4 + 8), "all_gather": STEPS * 1612 * 4}
