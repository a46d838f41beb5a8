"""Peak memory (issue 12, items 1-2): exact peak bytes of live tensors, and ZeRO-2's peak below ZeRO-1's.

* :class:`~lightning_parallel.accounting.LiveTensorPeak` on allocations whose sizes are known: exact bytes, phase and
  breakdown, independent of the C allocator.
* ``ShardedParameterBuckets(stage=2, max_buckets_in_flight=k)``: the gradient bytes alive at any moment of a backward
  are at most the shards plus ``k + 1`` full buckets (``k`` reduce-scatters in flight and the bucket being filled);
  stage 1 holds every full bucket throughout (each reduced shard is a slice of its bucket).
* Real Trainers under ``ShardedOptimizerStrategy`` stage 1 and 2 with ``ParallelismMonitor(peak_tensors_step=...)``:
  on every rank, peak(zero2) <= peak(zero1) - 0.9 (1 - 1/N) G, the parameters and optimizer state at the peak are
  the bytes the strategy reports holding, and the breakdown adds up to the peak.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from training_helpers import _loader_for, make_module, make_trainer

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.accounting import LiveTensorPeak, dataset_tensors, storage_bytes
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.monitor import ParallelismMonitor

FLOAT = 4  # bytes of one fp32 element


def test_live_tensor_peak_counts_known_allocations_exactly() -> None:
    before = torch.ones(1000)
    with LiveTensorPeak(categories=lambda: {"before": [before]}) as tracker:
        doubled = before * 2  # +4,000
        view = doubled[10:20]  # a view: no new storage
        del doubled, view  # -4,000
        tracker.phase = "second"
        large = torch.empty(2000)  # +8,000
        small = torch.empty(500)  # +2,000: the peak, 10,000 above the start
        del large, small
        kept = torch.zeros(250)  # +1,000, alive at the end
    peak = tracker.result()
    assert peak.peak_bytes - peak.start_bytes == (2000 + 500) * FLOAT
    assert peak.end_bytes - peak.start_bytes == 250 * FLOAT
    assert peak.phase == "second"
    assert peak.breakdown["before"] == 1000 * FLOAT
    assert sum(peak.breakdown.values()) == peak.peak_bytes
    assert kept.numel() == 250


def test_live_tensor_peak_follows_storages_resized_in_place() -> None:
    # FSDP2 frees a unit's gathered parameters with `untyped_storage().resize_(0)`, which is no dispatched op.
    gathered = torch.ones(1000)
    original = torch.UntypedStorage.resize_
    with LiveTensorPeak() as tracker:
        gathered.untyped_storage().resize_(0)  # -4,000
        other = torch.empty(500)  # +2,000: below the start
        gathered.untyped_storage().resize_(1000 * FLOAT)  # +4,000: the peak, 2,000 above the start
        gathered.untyped_storage().resize_(0)
    peak = tracker.result()
    assert peak.peak_bytes - peak.start_bytes == 500 * FLOAT
    assert peak.end_bytes - peak.start_bytes == (500 - 1000) * FLOAT
    assert torch.UntypedStorage.resize_ is original  # the wrapper is gone once the region ends
    assert other.numel() == 500


def test_live_tensor_peak_leaves_out_the_training_data() -> None:
    """A data set held in memory (a GPU run keeps it on the host) is not what a step costs: ``exclude`` with
    ``dataset_tensors`` leaves its tensors out, however deeply the loader wraps them, and counts everything else."""
    from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset

    inputs, targets, other = torch.zeros(1000), torch.zeros(1000, dtype=torch.long), torch.zeros(300)
    data = ConcatDataset([Subset(TensorDataset(inputs, targets), [0, 1]), TensorDataset(other)])
    loader = DataLoader(data, batch_size=2)
    found = dataset_tensors(loader)
    assert {id(t) for t in found} == {id(inputs), id(targets), id(other)}
    assert dataset_tensors({"train": [loader]}, max_depth=1) == []  # deeper than allowed: nothing
    with LiveTensorPeak(exclude=lambda: dataset_tensors(loader)) as tracker:
        batch = inputs[:10] * 2  # +40 bytes: a new storage counts; the data set's views do not
        view = targets[5:]  # a view of the data: nothing
    peak = tracker.result()
    assert peak.peak_bytes == peak.start_bytes + 10 * FLOAT
    with LiveTensorPeak() as unfiltered:
        pass
    assert unfiltered.result().start_bytes - peak.start_bytes >= 1000 * FLOAT + 1000 * 8 + 300 * FLOAT
    assert batch.numel() == 10 and view.numel() == 995


def test_live_tensor_peak_result_needs_the_block_to_end() -> None:
    tracker = LiveTensorPeak()
    with pytest.raises(RuntimeError, match="after the `with` block"):
        tracker.result()


def _bucket_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    widths = [64] * 9
    results: dict[str, Any] = {}
    for stage, in_flight in ((1, 2), (2, 1), (2, 2)):
        model = nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(widths)))
        layer_bytes = 64 * 64 * FLOAT
        # One layer per bucket: 8 buckets of 16 KiB.
        buckets = ShardedParameterBuckets(
            model, stage=stage, bucket_cap_mb=layer_bytes / 2**20, max_buckets_in_flight=in_flight
        )
        alive: list[int] = []

        def record(_: torch.Tensor, buckets: ShardedParameterBuckets = buckets, alive: list[int] = alive) -> None:
            alive.append(storage_bytes(buckets.gradient_buffers()))  # distinct storages: a shard may be a slice

        for p in model.parameters():  # after the buckets' own hook: the bucket has taken this gradient
            p.register_post_accumulate_grad_hook(record)
        for _ in range(2):
            model(torch.randn(4, 64)).square().sum().backward()
            buckets.finish_gradient_sync()
            model.zero_grad()
        results[f"stage{stage}_k{in_flight}"] = {
            "max_alive": max(alive),
            "bucket_bytes": layer_bytes,
            "num_buckets": len(buckets.buckets),
            "shard_bytes": sum(b.shard_numel for b in buckets.buckets) * FLOAT,
        }
        buckets.remove_hooks()
    return results


def test_zero2_bounds_the_full_gradient_buckets_alive_during_backward() -> None:
    for result in run_distributed(_bucket_rank, 2, timeout=120):
        one = result["stage1_k2"]
        assert one["num_buckets"] == 8
        # Stage 1 keeps every full bucket throughout; its reduced shards are slices of them (reduced in place).
        assert one["max_alive"] == 8 * one["bucket_bytes"]
        for k in (1, 2):
            two = result[f"stage2_k{k}"]
            assert two["max_alive"] <= two["shard_bytes"] + (k + 1) * two["bucket_bytes"], (k, two)


def _trainer_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results = {}
    for stage in (1, 2):
        monitor = ParallelismMonitor(peak_tensors_step=1, figure_path=False, summary_path=None)
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.05)  # ~10 buckets
        trainer = make_trainer(strategy, devices=world_size, max_steps=2, callbacks=[monitor])
        module = make_module()
        trainer.fit(module, train_dataloaders=_loader_for(world_size, 4))
        report = strategy.memory_report()
        assert monitor.summary is not None
        own = next(r for r in monitor.summary["ranks"] if r["rank"] == rank)
        results[stage] = {
            "peak": own["peak_tensors"],
            "parameters": report.parameters,
            "optimizer_state": report.optimizer_state,
            "gradients": report.gradients,
            "gradient_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        }
    return results


def test_zero2_peaks_below_zero1_by_the_gradients_it_shards(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)  # the monitor's JSON goes to the default root dir
    n = 2
    for result in run_distributed(_trainer_rank, n, timeout=240, init_process_group=False):
        for stage in (1, 2):
            peak, held = result[stage]["peak"], result[stage]
            assert sum(peak["breakdown"].values()) == peak["peak_bytes"]
            assert peak["breakdown"]["parameters"] == held["parameters"]
            assert peak["breakdown"]["optimizer_state"] == held["optimizer_state"]
            assert peak["phase"] in ("forward", "backward", "optimizer_step")
            if stage == 1:  # the persistent full buckets (the shards are slices): what memory_report() counts
                assert peak["breakdown"]["gradients"] == held["gradients"]
        gradients = result[1]["gradient_bytes"]
        one, two = result[1]["peak"]["peak_bytes"], result[2]["peak"]["peak_bytes"]
        assert two <= one - 0.9 * (1 - 1 / n) * gradients, (one, two, gradients)
