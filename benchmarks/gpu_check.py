"""One GPU check (``make gpu-check``): every strategy on NCCL with mixed precision, against one device.

Usage::

    python -m benchmarks.gpu_check [--steps N] [--output benchmarks/RESULTS.md]   # a machine with >= 1 CUDA GPU
    python -m benchmarks.gpu_check --device cpu --tiny --output /tmp/RESULTS.md  # dry run of the same code on CPU

On CUDA (about 5 minutes on one H200 for the ``gpt-350m`` demo model):

* every strategy at world size 1 (``data_parallel``, ``zero1``, ``zero2``, ``zero3``, ``pipeline``), and with two or
  more GPUs every ZeRO stage, data parallel and a 2-stage pipeline at world size 2 (``spawn``), each under
  ``bf16-mixed`` and ``16-mixed``, fits a few steps of the same model on the same batches;
* each run's per-step losses (and, at world size 1, its final weights) are compared with Lightning's single-device
  training at the same precision, within bf16 tolerance;
* ``torch.cuda.max_memory_allocated`` per configuration (:class:`~lightning_parallel.demos.stats.RunStats`) and the
  peak and bytes held that :class:`~lightning_parallel.monitor.ParallelismMonitor` measured through its CUDA path;
* the CUDA-before-fork refusal: with CUDA initialised here, a ``*_notebook`` (fork) strategy must refuse to start.

Results go to the ``gpu_check`` section of ``--output``. Without CUDA the check stops at once with exit status 2 and
says why; ``--device cpu --tiny`` runs one configuration end to end on CPU (what the tests run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from benchmarks.harness import one_line
from benchmarks.report import RESULTS_PATH, markdown_table, mib, update_section
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.demos.main import quiet_lightning
from lightning_parallel.demos.report import DemoRecorder, read_recording
from lightning_parallel.demos.stats import RunStats, summarize
from lightning_parallel.monitor import ParallelismMonitor
from lightning_parallel.strategies import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

__all__ = ["NAME", "CheckSettings", "Configuration", "Outcome", "main", "plan", "render_markdown", "run_check"]

NAME = "gpu_check"
"""Section name in RESULTS.md."""

STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3", "pipeline")
"""Strategies checked at every world size."""

NO_CUDA_MESSAGE = (
    "The GPU check needs a CUDA GPU: torch.cuda.is_available() is False (torch {version}, CUDA build: {cuda}). Run it"
    " on a machine with a CUDA GPU and a CUDA build of torch (`make gpu-check TORCH_SPEC=torch`), or try the dry run"
    " on CPU: `python -m benchmarks.gpu_check --device cpu --tiny --output /tmp/RESULTS.md`."
)

_RTOL, _ATOL = 1.6e-2, 2e-3  # bf16 (torch.testing's bf16 rtol); atol: a few AdamW steps of lr 3e-4 may round apart


@dataclass(frozen=True)
class Configuration:
    """One fit: a strategy at a world size and precision."""

    strategy: str
    precision: str
    world_size: int


@dataclass(kw_only=True)
class CheckSettings:
    """Model, data and length of every fit."""

    device: str = "cuda"
    """``"cuda"`` (NCCL) or ``"cpu"`` (gloo, the dry run)."""
    preset: str = "gpt-350m"
    """Demo GPT preset (``gpt-350m``: 24 layers, 1024 wide, about 350M parameters)."""
    steps: int = 4
    """Optimizer steps per fit."""
    batch_size: int = 4
    """Sequences per step (the global batch; split over the replicas of a world-size-2 run)."""
    seq_len: int = 512
    """Tokens per sequence."""
    precisions: tuple[str, ...] = ("bf16-mixed", "16-mixed")
    """Lightning precisions checked."""


@dataclass
class Outcome:
    """What one configuration measured, or why it failed."""

    config: Configuration
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    loss_diff: float | None = None
    """Largest absolute difference of a step's loss from the single-device run."""
    weight_diff: float | None = None
    """Largest absolute difference of a final weight from the single-device run (world size 1 only)."""
    max_memory_allocated: list[int] = field(default_factory=list)
    """Per rank: ``torch.cuda.max_memory_allocated`` on CUDA (peak RSS on CPU)."""
    monitor_peak: int | None = None
    """Rank 0's peak memory as ParallelismMonitor measured it (its CUDA path on GPUs)."""
    monitor_held: int | None = None
    """Rank 0's parameters + gradients + optimizer state bytes, from ParallelismMonitor."""
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None


def plan(settings: CheckSettings, *, num_gpus: int, tiny: bool) -> list[Configuration]:
    """The configurations to run: every strategy and precision at world size 1, and at 2 with two GPUs."""
    if tiny:
        return [Configuration("zero2", settings.precisions[0], 1)]
    sizes = [1, 2] if num_gpus >= 2 else [1]
    return [Configuration(s, p, n) for n in sizes for s in STRATEGIES for p in settings.precisions]


def _make_strategy(name: str, world_size: int) -> Strategy:
    start = "spawn" if world_size > 1 else "popen"  # spawn: CUDA is initialised here; popen with 1 rank: in-process
    if name == "data_parallel":
        return DataParallelStrategy(start_method=start)
    if name == "pipeline":
        return PipelineParallelStrategy(pipeline_parallel_size=world_size, num_microbatches=2, start_method=start)
    return ShardedOptimizerStrategy(int(name[-1]), start_method=start)


class _FinalWeights(Callback):
    """Keeps the whole model's weights at the end of fit (rank 0 of an in-process run)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # collective for ZeRO-3 and pipelines
        self.state = {k: v.detach().float().cpu().clone() for k, v in state.items()}


def _fit(settings: CheckSettings, config: Configuration | None) -> tuple[Outcome, dict[str, torch.Tensor] | None]:
    """Fit once; ``config=None`` is the single-device reference (Lightning's default strategy)."""
    precision = config.precision if config else settings.precisions[0]
    outcome = Outcome(config or Configuration("one device", precision, 1))
    world_size = outcome.config.world_size
    replicas = world_size // (world_size if outcome.config.strategy == "pipeline" else 1)
    torch.manual_seed(0)
    module = GPTLightningModule(settings.preset, block_size=settings.seq_len)
    data = RandomTokenDataset(settings.batch_size * settings.steps, settings.seq_len, seed=1)
    weights, monitor = _FinalWeights(), ParallelismMonitor(figure_path=False, summary_path=None)
    callbacks: list[Callback] = [RunStats(warmup_steps=0), DemoRecorder()]
    if world_size == 1:
        callbacks += [weights, monitor]  # their results stay in the ranks of a spawned run
    trainer = pl.Trainer(
        accelerator="gpu" if settings.device == "cuda" else "cpu",
        devices=world_size,
        strategy=_make_strategy(outcome.config.strategy, world_size) if config else "auto",
        precision=precision,
        max_steps=settings.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tempfile.mkdtemp(prefix="gpu-check-"),  # the monitor's JSON; nothing in the repository
        use_distributed_sampler=config is not None,
    )
    start = time.perf_counter()
    loader = DataLoader(data, batch_size=settings.batch_size // replicas)
    if config is None:  # one device: the order Lightning's DistributedSampler (shuffle, seed 0) gives our strategies
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=settings.batch_size, sampler=sampler)
    trainer.fit(module, loader)
    outcome.seconds = time.perf_counter() - start
    outcome.losses = read_recording(trainer).losses
    outcome.max_memory_allocated = [int(m) for m in summarize(trainer)["peak_mem"]]
    if monitor.summary:
        rank0 = monitor.summary["ranks"][0]
        outcome.monitor_peak, outcome.monitor_held = rank0["peak_memory_bytes"], sum(rank0["memory"].values())
    return outcome, weights.state


def _compare(outcome: Outcome, state: dict[str, torch.Tensor] | None, reference: tuple[Outcome, Any]) -> None:
    ref_outcome, ref_state = reference
    ours, theirs = torch.tensor(outcome.losses), torch.tensor(ref_outcome.losses)
    outcome.loss_diff = float((ours - theirs).abs().max())
    torch.testing.assert_close(ours, theirs, rtol=_RTOL, atol=_ATOL, msg=lambda m: f"per-step losses: {m}")
    if state is not None and ref_state is not None:
        outcome.weight_diff = max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=_RTOL, atol=_ATOL, msg=lambda m, k=key: f"{k}: {m}")


def check_fork_refusal(settings: CheckSettings) -> str:
    """With CUDA initialised in this process, a fork (``*_notebook``) strategy must refuse to start ``fit``."""
    if not torch.cuda.is_initialized():
        return "skipped: CUDA is not initialised in this process (CPU dry run)"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="data_parallel_notebook", max_steps=1, logger=False)
    try:
        trainer.fit(GPTLightningModule("tiny"), DataLoader(RandomTokenDataset(4, 16), batch_size=2))
    except RuntimeError as error:
        if "CUDA was initialised in this process" in str(error):
            return "passed: RuntimeError before forking (restart the kernel / use a *_spawn name)"
        return f"FAILED: another RuntimeError: {error}"
    return "FAILED: the fork strategy started although CUDA was initialised"


def run_check(settings: CheckSettings, configs: Sequence[Configuration]) -> tuple[list[Outcome], str]:
    """Fit every configuration, compare it with one device, then check the fork refusal."""
    references: dict[str, tuple[Outcome, Any]] = {}
    outcomes = []
    for config in configs:
        print(f"{config.strategy} x{config.world_size} {config.precision} ...", end=" ", flush=True)
        try:
            if config.precision not in references:
                references[config.precision] = _fit(
                    CheckSettings(**{**vars(settings), "precisions": (config.precision,)}), None
                )
            outcome, state = _fit(settings, config)
            _compare(outcome, state, references[config.precision])
        except Exception as error:  # one failing configuration must not hide the others
            outcome = Outcome(config, error=one_line(error))
        print("ok" if outcome.passed else outcome.error, flush=True)
        outcomes.append(outcome)
    return outcomes, check_fork_refusal(settings)


def render_markdown(outcomes: Sequence[Outcome], fork_refusal: str, *, settings: CheckSettings, device: str) -> str:
    """The RESULTS.md section: one row per configuration, then the fork refusal."""
    header = ["strategy", "ranks", "precision", "result", "max loss diff", "max weight diff"]
    header += ["max_memory_allocated MiB per rank", "monitor peak MiB", "monitor held MiB", "s"]
    rows = [
        [
            o.config.strategy,
            str(o.config.world_size),
            o.config.precision,
            "ok" if o.passed else f"FAILED: {o.error}",
            "-" if o.loss_diff is None else f"{o.loss_diff:.2e}",
            "-" if o.weight_diff is None else f"{o.weight_diff:.2e}",
            " / ".join(mib(m, 0) for m in o.max_memory_allocated) or "-",
            mib(o.monitor_peak, 0),
            mib(o.monitor_held, 0),
            f"{o.seconds:.1f}",
        ]
        for o in outcomes
    ]
    return "\n".join(
        [
            "## gpu_check: every strategy on NCCL with mixed precision, against one device",
            "",
            f"`make gpu-check` on {device}: preset `{settings.preset}`, {settings.steps} steps, global batch"
            f" {settings.batch_size} x {settings.seq_len} tokens. Equivalence: per-step losses (and final weights at"
            f" world size 1) against Lightning's single-device run at the same precision, rtol {_RTOL}, atol {_ATOL}.",
            "",
            markdown_table(header, rows),
            "",
            f"CUDA-before-fork refusal of the `*_notebook` strategies: {fork_refusal}.",
        ]
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run with gloo")
    parser.add_argument("--tiny", action="store_true", help="one configuration of the tiny model (seconds)")
    parser.add_argument("--steps", type=int, default=CheckSettings.steps, help="optimizer steps per fit")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="the markdown file to update")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 0 if every configuration passed, 1 if one failed, 2 without CUDA (``--device cuda``)."""
    args = _parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE.format(version=torch.__version__, cuda=torch.version.cuda), file=sys.stderr)
        return 2
    settings = CheckSettings(device=args.device, steps=args.steps)
    if args.tiny:
        settings = CheckSettings(device=args.device, preset="tiny", steps=args.steps, seq_len=32)
    if args.device == "cpu":
        settings.precisions = ("bf16-mixed",)  # Lightning has no 16-mixed on CPU
    quiet_lightning()
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    started = time.perf_counter()
    outcomes, refusal = run_check(settings, plan(settings, num_gpus=num_gpus, tiny=args.tiny))
    update_section(NAME, render_markdown(outcomes, refusal, settings=settings, device=device), path=args.output)
    print(
        f"{sum(o.passed for o in outcomes)}/{len(outcomes)} passed in {time.perf_counter() - started:.0f} s;"
        f" fork refusal {refusal}; written to {args.output}"
    )
    return 0 if all(o.passed for o in outcomes) and not refusal.startswith("FAILED") else 1


if __name__ == "__main__":
    sys.exit(main())
