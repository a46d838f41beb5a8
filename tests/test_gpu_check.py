"""benchmarks/gpu_check.py (`make gpu-check`): fails fast without CUDA; its CPU dry run forces the sharded paths at
world size 1, equals one device bit for bit, and rejects the stale-weight control."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import model_zoo as zoo
import torch
from distributed_harness import run_distributed

_REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=_REPO_ROOT,
        # Without a `PL_GLOBAL_SEED` another test may have left here: Lightning seeds its distributed sampler with it.
        env={**{k: v for k, v in os.environ.items() if k != "PL_GLOBAL_SEED"}, **(env or {})},
    )


def test_without_cuda_it_stops_at_once_and_says_why(tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    # No visible GPU: what a CPU machine (or a CPU build of torch) sees.
    proc = _run("--output", str(output), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "The GPU check needs a CUDA GPU: torch.cuda.is_available() is False" in proc.stderr
    assert "--device cpu --tiny" in proc.stderr
    assert not output.exists()  # nothing written, nothing trained


def test_cpu_dry_run_forces_the_sharded_paths_and_rejects_a_stale_weight(tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    output.write_text("# Benchmark results\n\n<!-- begin zero -->\nkept\n<!-- end zero -->\n")
    proc = _run("--device", "cpu", "--tiny", "--steps", "8", "--output", str(output))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = output.read_text()
    assert "kept" in text  # other sections stay
    assert "<!-- begin gpu_check -->" in text and "<!-- end gpu_check -->" in text
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[1] == "1":
            rows[cells[0], cells[2]] = cells
    assert set(rows) == {
        ("zero2 forced", "32-true"),
        ("zero3 forced", "bf16-true"),
        ("data_parallel bf16-compressed forced", "32-true"),
        ("control: stale forward", "32-true"),
    }, text
    for (name, _), (_, _, _, result, loss_diff, weight_diff, fit_peak, save_peak, _) in rows.items():
        if name.startswith("control"):
            # The forward that reads the weights of the step before is rejected: the tolerance can catch the race.
            assert result == "ok (rejected, as it must be)" and float(loss_diff) > 2e-5, text
            continue
        # One rank, the sharded backend (or DDP's hook) forced: the same arithmetic as one device, bit for bit.
        assert (result, float(loss_diff), float(weight_diff)) == ("ok", 0.0, 0.0), text
        assert int(fit_peak.replace(",", "")) > 0 and int(save_peak.replace(",", "")) > 0
    assert "refusal of the `*_notebook` strategies: skipped: CUDA is not initialised" in text


def _forced_paths(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from benchmarks.gpu_check_runs import ForcedDataParallelStrategy, ForcedShardingStrategy
    from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

    seen: dict[str, Any] = {}

    class _Look(pl.Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            strategy: Any = trainer.strategy
            backend = getattr(strategy, "_backend", None)
            seen[self.name] = (
                type(backend).__name__ if backend is not None else type(strategy.model).__name__,
                getattr(backend, "gather", None) is not None,
                str(torch.distributed.get_backend()),
            )

    strategies = {
        "zero1": ForcedShardingStrategy(1, overlap_param_gather=True),
        "zero3": ForcedShardingStrategy(3),
        "compressed": ForcedDataParallelStrategy(gradient_compression="bf16"),
    }
    for name, strategy in strategies.items():
        trainer = zoo.trainer(strategy, 1, max_steps=1, callbacks=[_Look(name)])
        trainer.fit(GPTLightningModule("tiny", block_size=16), DataLoader(RandomTokenDataset(2, 16), batch_size=2))
    return seen


def test_forced_strategies_run_the_sharded_backends_at_world_size_one() -> None:
    # One process joined by Lightning (gloo here, NCCL on a GPU): the backends a world size of 1 would not choose.
    (seen,) = run_distributed(_forced_paths, world_size=1, init_process_group=False)
    assert seen == {
        "zero1": ("FlatBucketBackend", True, "gloo"),  # buckets, and the overlapped all-gather
        "zero3": ("FullyShardBackend", False, "gloo"),
        "compressed": ("DistributedDataParallel", False, "gloo"),  # DDP with the compression hook
    }
