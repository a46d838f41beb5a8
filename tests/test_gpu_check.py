"""benchmarks/gpu_check.py (`make gpu-check`): fails fast without CUDA; its CPU stand-in runs every row of the GPU
flow, equal to one device bit for bit, inside its budget, and leaves nothing but its two table files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed

from benchmarks.gpu_check import Check
from benchmarks.gpu_check_fit import CheckSettings
from benchmarks.gpu_check_plan import FORK, REPEAT, STALE, TENSOR_PARALLEL, TORCHFT, Row, fit_plan, plan

_REPO_ROOT = Path(__file__).resolve().parents[1]
# The only reasons a row of the CPU stand-in may give for not running.
_CPU_SKIPS = {
    "skipped: gloo has no fp16 all-reduce (runs on CUDA)",
    "skipped: CUDA is not initialised in this process (CPU stand-in)",
    "skipped: torchft not installed",
}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # Without a `PL_GLOBAL_SEED` another test may have left here: Lightning seeds its distributed sampler with it.
    environment = {k: v for k, v in os.environ.items() if k != "PL_GLOBAL_SEED"}
    path = os.pathsep.join(p for p in (str(_REPO_ROOT), environment.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=_REPO_ROOT,
        env={**environment, "PYTHONPATH": path, **(env or {})},
    )


def test_without_cuda_it_stops_at_once_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # No visible GPU: what a CPU machine (or a CPU build of torch) sees.
    proc = _run("--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "The GPU check needs a CUDA GPU: torch.cuda.is_available() is False" in proc.stderr
    assert "--device cpu" in proc.stderr
    assert not out.exists()  # nothing written, nothing trained


def test_the_tensor_parallel_row_runs_on_pairs_of_gpus() -> None:
    """Several GPUs: ZeRO-3 x tensor parallel 2 at every precision, a pair reading one batch; an odd count skips it."""
    rows = [row for row in plan("cuda", num_gpus=4) if row.name == TENSOR_PARALLEL]
    assert [row.precision for row in rows] == ["32-true", "bf16-mixed", "bf16-true"]
    assert all(row.skip is None and row.resumes for row in rows)
    fitted = fit_plan(rows[0])
    assert fitted.replicas == 2 and getattr(fitted.strategy, "tensor_parallel_size", None) == 2
    odd = [row for row in plan("cuda", num_gpus=3) if row.name == TENSOR_PARALLEL]
    assert len(odd) == 3 and all(row.skip and "even number" in row.skip for row in odd)
    assert not [row for row in plan("cuda", num_gpus=1) if row.name == TENSOR_PARALLEL]


def test_cpu_stand_in_runs_every_row_and_deletes_every_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run("--device", "cpu", "--out", str(out), "--budget-s", "400")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.rglob("*")) == ["gpu_check.json", "gpu_check.md"]  # checkpoints deleted
    table = json.loads((out / "gpu_check.json").read_text())
    rows = {(r["name"], r["precision"]): r for r in table["rows"]}
    assert list(rows) == [(row.name, row.precision) for row in plan("cpu", num_gpus=0)]  # every row, in order
    for (name, _), row in rows.items():
        if row["result"].startswith("skipped"):
            assert row["result"] in _CPU_SKIPS, row
        elif name == STALE:
            # The forward that reads the weights of the step before is rejected: the tolerance can catch the race.
            assert row["result"] == "ok (rejected, as it must be)" and row["loss_diff"] > 2e-5, row
        elif name == TORCHFT:  # two groups average half batches: rounding only
            assert row["result"] == "ok" and row["loss_diff"] < 2e-5 and len(row["peaks"]["fit"]) == 2, row
        else:
            # One rank, the sharded backend (or DDP's hook, or the pipeline against accumulated micro-batches)
            # forced: the same arithmetic as one device, bit for bit, and resumed from mid-run as uninterrupted.
            assert (row["result"], row["loss_diff"], row["weight_diff"]) == ("ok", 0.0, 0.0), row
            assert row["resume_diff"] == (None if name == REPEAT else 0.0), row
            assert row["disk_bytes"] > 0 and all(row["peaks"][k][0] > 0 for k in ("fit", "save", "load")), row
    assert rows[FORK, "32-true"]["result"] in _CPU_SKIPS
    disk = table["disk"]
    assert 0 < disk["peak_bytes"] <= disk["written_bytes"] == sum(r["disk_bytes"] for r in table["rows"])
    markdown = (out / "gpu_check.md").read_text()
    assert markdown in proc.stdout  # printed too
    ran = sum(not r["result"].startswith("skipped") for r in table["rows"])
    assert f"{ran} of {len(rows)} rows ran, 0 failed" in markdown


def test_rows_over_budget_are_skipped_not_failed(tmp_path: Path) -> None:
    check = Check(CheckSettings.for_device("cpu"), tmp_path, budget_s=3.0, device="CPU")
    # Before any fit: 4 s a fit; a strategy row costs its fit, its resume (0.75) and its reference's fit.
    assert check.estimate_s(Row("zero2 forced")) == pytest.approx(4.0 * 2.75)
    assert check.estimate_s(Row(STALE)) == pytest.approx(4.0 * 2)
    outcome = check.run_row(Row("zero2 forced"))
    assert outcome.result.startswith("skipped: budget (estimated 11 s, "), outcome.result
    assert check.run_row(Row(TORCHFT, skip="torchft not installed")).result == "skipped: torchft not installed"
    check.fit_seconds = [9.0, 1.0, 2.0]  # the first (start-up included) is left out of the estimate
    assert check.fit_s() == 1.5
    assert not list(tmp_path.iterdir())  # nothing written for a skipped row
    # What the watchdog writes when a row is still running past the budget: the rows so far and that one, failed.
    check.running = Row("zero3 forced")
    check.write(running="FAILED: still running")
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["name"], r["result"]) for r in rows] == [("zero3 forced", "FAILED: still running")]
    assert "| zero3 forced | 1 | 32-true | FAILED: still running |" in (tmp_path / "gpu_check.md").read_text()


def test_make_gpu_check_installs_nothing() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "gpu-check"], capture_output=True, text=True, cwd=_REPO_ROOT, timeout=30
    )
    assert proc.stdout.strip() == (
        "PYTHONPATH=. python3 -m benchmarks.gpu_check --out benchmarks/out/gpu_check --budget-s 480"
    ), proc.stdout + proc.stderr


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
            buckets = getattr(backend, "buckets", None)
            seen[self.name] = (
                type(backend).__name__ if backend is not None else type(strategy.model).__name__,
                getattr(backend, "gather", None) is not None,
                type(buckets.replicas).__name__ if buckets is not None and buckets.replicas is not None else None,
                str(torch.distributed.get_backend()),
            )

    strategies = {
        "zero1": ForcedShardingStrategy(1),
        "zero2 hybrid": ForcedShardingStrategy(2, hybrid=True),
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
        "zero1": ("FlatBucketBackend", True, None, "gloo"),  # buckets, and the overlapped all-gather
        "zero2 hybrid": ("FlatBucketBackend", True, "ProcessGroupReplicas", "gloo"),  # + the all-reduce across replicas
        "zero3": ("FullyShardBackend", False, None, "gloo"),
        "compressed": ("DistributedDataParallel", False, None, "gloo"),  # DDP with the compression hook
    }
