"""The GPU check (``make gpu-check``): what CPU cannot find, on NCCL, against one device.

Usage::

    python -m benchmarks.gpu_check [--steps N] [--output benchmarks/RESULTS.md]   # a machine with >= 1 CUDA GPU
    python -m benchmarks.gpu_check --device cpu --tiny --output /tmp/RESULTS.md  # dry run of the same code on CPU

On one GPU it *forces* the sharded code paths at world size 1 over NCCL (``benchmarks/gpu_check_runs.py``): ZeRO
1/2/3 with flat buckets / FSDP2, reduce-scatters and the overlapped parameter all-gather (stages 1-2), fp32 masters
under ``bf16-true``, and data parallel's gradient compression hook, each against one device. With two or more GPUs
it adds data parallel, ZeRO 1/2/3, hybrid sharding (``shard_size``), a pipeline and the pipeline's ``zero_stage`` at
the world size of all GPUs (``spawn``), with the demo's callbacks (``DemoRecorder``, ``RunStats``) gathering on NCCL.

* every fit trains ``--steps`` steps (default 10) of the demo GPT on the same batches; no callback of ours waits for
  the device per step (losses stay on the device, times are CUDA events), so a race of an overlapped collective with
  the next forward is not hidden;
* per-step losses, a checkpoint saved mid-run and one at the end are compared with the one-device reference at the
  same precision: fp32 close to rounding, bf16 with a tolerance the two controls validate on the machine itself
  (the reference fitted again must pass; a run whose forward reads one-step-stale weights must be rejected);
* ``torch.cuda.max_memory_allocated`` per rank for the fit and while saving the mid-run checkpoint;
* the CUDA-before-fork refusal: with CUDA initialised here, a ``*_notebook`` (fork) strategy must refuse to start.

On CUDA, deterministic algorithms are requested (``warn_only``), so two fits with the same arithmetic agree bit for
bit and the tolerances can stay far below the signal of a stale weight. Results go to the ``gpu_check`` section of
``--output``. Without CUDA the check stops at once with exit status 2 and says why.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.gpu_check_runs import (
    ForcedDataParallelStrategy,
    ForcedShardingStrategy,
    Probe,
    RoundedGradients,
    StaleForward,
    read_probe,
)
from benchmarks.harness import one_line
from benchmarks.report import RESULTS_PATH, markdown_table, mib, update_section
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.demos.main import quiet_lightning
from lightning_parallel.demos.report import DemoRecorder, read_recording
from lightning_parallel.demos.stats import RunStats
from lightning_parallel.strategies import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

__all__ = [
    "NAME",
    "CheckSettings",
    "Configuration",
    "Outcome",
    "Tolerance",
    "compare",
    "main",
    "plan",
    "render_markdown",
    "run_check",
    "tolerance",
]

NAME = "gpu_check"
"""Section name in RESULTS.md."""

REPEAT, STALE = "control: one device again", "control: stale forward"
"""The positive control (must pass) and the negative control (must be rejected)."""

NO_CUDA_MESSAGE = (
    "The GPU check needs a CUDA GPU: torch.cuda.is_available() is False (torch {version}, CUDA build: {cuda}). Run it"
    " on a machine with a CUDA GPU and a CUDA build of torch (`make gpu-check TORCH_SPEC=torch`), or try the dry run"
    " on CPU: `python -m benchmarks.gpu_check --device cpu --tiny --output /tmp/RESULTS.md`."
)


@dataclass(frozen=True)
class Tolerance:
    """How far a run may be from the reference: per-step losses (absolute) and checkpoint weights."""

    loss_atol: float
    weight_rtol: float
    weight_atol: float


# fp32: the same arithmetic gives the same bits (measured on CPU: every forced row equals one device exactly); the
# bound leaves room for a few float32 roundings of a loss near 5.5 (ulp 4.8e-7). bf16: losses are fp32 reductions of
# bf16 products, so a reordered sum moves them by far less than one bf16 ulp of the loss (0.03); 2e-4 is 1/150 of
# that. A one-step-stale forward moved the tiny model's losses by 3e-4..2.5e-3 (CPU, 8 steps, fp32 and bf16-mixed);
# the controls measure both sides on the machine that runs the check.
_TOLERANCES = {
    "32-true": Tolerance(loss_atol=2e-5, weight_rtol=1.3e-6, weight_atol=1e-5),
    "bf16": Tolerance(loss_atol=2e-4, weight_rtol=2**-8, weight_atol=1e-5),
}
_SPLIT_FACTOR = 10
"""Several ranks split each batch, so sums are reordered (and bf16 matmuls of half batches may pick other kernels):
their tolerance is this many times wider. The stale-weight race is hunted by the forced one-rank rows, which run the
same overlapped code paths at the tight tolerance."""


def tolerance(precision: str, *, world_size: int = 1) -> Tolerance:
    """The tolerance of a run at ``precision`` against one device (wider when several ranks split the batch)."""
    base = _TOLERANCES["32-true" if precision == "32-true" else "bf16"]
    if world_size == 1:
        return base
    factor = _SPLIT_FACTOR
    return Tolerance(base.loss_atol * factor, base.weight_rtol * factor, base.weight_atol * factor)


@dataclass(frozen=True)
class Configuration:
    """One fit: a row name (see :func:`_make_strategy`) at a world size and precision."""

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
    steps: int = 10
    """Optimizer steps per fit: enough for a stale weight to show in several losses."""
    batch_size: int = 4
    """Sequences per step (the global batch; split over the replicas of a multi-rank run)."""
    seq_len: int = 512
    """Tokens per sequence."""
    precisions: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")
    """Lightning precisions checked (``bf16-true``: the ZeRO rows only, with fp32 masters)."""


@dataclass
class Outcome:
    """What one configuration measured, or why it failed."""

    config: Configuration
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    loss_diff: float | None = None
    """Largest absolute difference of a step's loss from the reference."""
    weight_diff: float | None = None
    """Largest absolute difference of a checkpointed weight (mid-run and final) from the reference."""
    fit_peak: list[int] = field(default_factory=list)
    """Per rank: ``torch.cuda.max_memory_allocated`` over the fit, the save left out (peak RSS on CPU)."""
    save_peak: list[int] = field(default_factory=list)
    """Per rank: ``torch.cuda.max_memory_allocated`` while saving the mid-run checkpoint."""
    states: dict[str, dict[str, Tensor]] = field(default_factory=dict, repr=False)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None


def plan(settings: CheckSettings, *, num_gpus: int, tiny: bool) -> list[Configuration]:
    """The configurations to run: forced one-rank rows and controls; with two GPUs or more, multi-rank rows."""
    if tiny:  # the CPU test: one row of each kind
        return [
            Configuration("zero2 forced", "32-true", 1),
            Configuration("zero3 forced", "bf16-true", 1),
            Configuration("data_parallel bf16-compressed forced", "32-true", 1),
            Configuration(STALE, "32-true", 1),
        ]
    configs = []
    for precision in settings.precisions:
        names = ["zero1 forced", "zero2 forced", "zero3 forced"]
        if precision != "bf16-true":
            names += ["data_parallel bf16-compressed forced", "pipeline", REPEAT, STALE]
            if settings.device == "cuda":
                names.insert(3, "data_parallel fp16-compressed forced")  # gloo has no fp16 all-reduce
        configs += [Configuration(name, precision, 1) for name in names]
    if num_gpus >= 2:
        names = ["data_parallel", "zero1", "zero2", "zero3", "zero2 hybrid", "zero3 hybrid", "pipeline"]
        names += ["pipeline zero_stage=1", "pipeline zero_stage=2", "pipeline zero_stage=3"]
        for precision in settings.precisions:
            chosen = [n for n in names if n.startswith("zero")] if precision == "bf16-true" else names
            configs += [Configuration(name, precision, num_gpus) for name in chosen]
    return configs


def _make_strategy(name: str, world_size: int) -> Strategy | str:
    """The strategy of a row (``"auto"``: Lightning's single device)."""
    start = "spawn" if world_size > 1 else "popen"  # spawn: CUDA is initialised here; popen with 1 rank: in-process
    if name in (REPEAT, STALE):
        return "auto"
    if name.endswith("forced"):
        if name.startswith("data_parallel"):
            return ForcedDataParallelStrategy(gradient_compression=name.split()[1].split("-")[0])  # type: ignore[arg-type]
        return ForcedShardingStrategy(int(name[4]), overlap_param_gather=True)
    if name == "data_parallel":
        return DataParallelStrategy(start_method=start)
    if name.startswith("pipeline"):
        zero_stage = int(name[-1]) if "zero_stage" in name else 0
        return PipelineParallelStrategy(
            pipeline_parallel_size=_pipeline_stages(name, world_size),
            num_microbatches=2,
            zero_stage=zero_stage,  # type: ignore[arg-type]
            start_method=start,
        )
    shard_size = max(world_size // 2, 1) if name.endswith("hybrid") else None  # 2 groups of world_size / 2 ranks
    return ShardedOptimizerStrategy(int(name[4]), shard_size=shard_size, overlap_param_gather=True, start_method=start)


def _pipeline_stages(name: str, world_size: int) -> int:
    """Stages of a pipeline row: 2 where the GPUs allow (ZeRO in a pipeline also needs replicas of each stage)."""
    stages = 1 if "zero_stage" in name and world_size < 4 else 2
    return min(stages, world_size)


def _reference_key(config: Configuration) -> str:
    """Which one-device run a configuration is compared with."""
    if "compressed" in config.strategy:
        return f"{config.precision} rounded {config.strategy.split()[1].split('-')[0]}"
    if config.precision == "bf16-true":
        return "bf16-true masters"  # our fp32 masters at world size 1 (plain Lightning steps the bf16 weights)
    return config.precision


def _reference(key: str) -> tuple[Strategy | str, list[Callback], str]:
    """The strategy, extra callbacks and precision of the one-device run called ``key``."""
    precision, *kind = key.split()
    if kind == ["masters"]:
        return ShardedOptimizerStrategy(2), [], precision
    if kind[:1] == ["rounded"]:
        return "auto", [RoundedGradients(torch.bfloat16 if kind[1] == "bf16" else torch.float16)], precision
    return "auto", [], precision


def _fit(
    settings: CheckSettings, config: Configuration, strategy: Strategy | str, extra: Sequence[Callback]
) -> Outcome:
    """Fit once with the demo's callbacks and the probe; read losses, peaks and checkpoints back."""
    outcome = Outcome(config)
    world_size = config.world_size
    replicas = world_size // (_pipeline_stages(config.strategy, world_size) if "pipeline" in config.strategy else 1)
    torch.manual_seed(0)
    module = GPTLightningModule(settings.preset, block_size=settings.seq_len)
    data = RandomTokenDataset(settings.batch_size * settings.steps, settings.seq_len, seed=1)
    directory = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    callbacks: list[Callback] = [
        RunStats(warmup_steps=1),
        DemoRecorder(),
        Probe(directory, save_at=settings.steps // 2),
    ]
    trainer = pl.Trainer(
        accelerator="gpu" if settings.device == "cuda" else "cpu",
        devices=world_size,
        strategy=strategy,
        precision=config.precision,  # type: ignore[arg-type]
        max_steps=settings.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, *extra],
        default_root_dir=directory,
        use_distributed_sampler=strategy != "auto",
    )
    start = time.perf_counter()
    loader = DataLoader(data, batch_size=settings.batch_size // replicas)
    if strategy == "auto":  # one device: the order Lightning's DistributedSampler (shuffle, seed 0) gives the others
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=settings.batch_size, sampler=sampler)
    trainer.fit(module, loader)
    outcome.seconds = time.perf_counter() - start
    outcome.losses = read_recording(trainer).losses
    outcome.fit_peak, outcome.save_peak, outcome.states = read_probe(trainer, directory)
    return outcome


def compare(outcome: Outcome, reference: Outcome, tol: Tolerance) -> None:
    """Raise ``AssertionError`` where ``outcome`` leaves ``tol`` of ``reference``; record the largest differences."""
    ours, theirs = torch.tensor(outcome.losses), torch.tensor(reference.losses)
    outcome.loss_diff = float((ours - theirs).abs().max())
    outcome.weight_diff = max(
        float((state[k] - reference.states[name][k]).abs().max())
        for name, state in outcome.states.items()
        for k in reference.states[name]
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tol.loss_atol, msg=lambda m: f"per-step losses: {m}")
    for name, expected in reference.states.items():
        for key, value in expected.items():
            torch.testing.assert_close(
                outcome.states[name][key],
                value,
                rtol=tol.weight_rtol,
                atol=tol.weight_atol,
                msg=lambda m, k=key, n=name: f"{n} checkpoint, {k}: {m}",
            )


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


def _run_one(settings: CheckSettings, config: Configuration, references: dict[str, Outcome]) -> Outcome:
    """Fit ``config`` (and its reference, once) and compare; the stale control passes when the comparison fails."""
    key = _reference_key(config)
    if key not in references:
        strategy, extra, precision = _reference(key)
        references[key] = _fit(settings, Configuration(f"reference {key}", precision, 1), strategy, extra)
    extra = [StaleForward()] if config.strategy == STALE else []
    outcome = _fit(settings, config, _make_strategy(config.strategy, config.world_size), extra)
    try:
        compare(outcome, references[key], tolerance(config.precision, world_size=config.world_size))
    except AssertionError:
        if config.strategy != STALE:
            raise
        outcome.states = {}
        return outcome  # rejected, as it must be
    if config.strategy == STALE:
        outcome.error = "the comparison did not catch a one-step-stale weight: the tolerance is too wide"
    outcome.states = {}  # the weights are not kept past the comparison
    return outcome


def run_check(settings: CheckSettings, configs: Sequence[Configuration]) -> tuple[list[Outcome], str]:
    """Fit every configuration, compare it with one device, then check the fork refusal."""
    references: dict[str, Outcome] = {}
    outcomes = []
    for config in configs:
        print(f"{config.strategy} x{config.world_size} {config.precision} ...", end=" ", flush=True)
        try:
            outcome = _run_one(settings, config, references)
        except Exception as error:  # one failing configuration must not hide the others
            outcome = Outcome(config, error=one_line(error))
        print("ok" if outcome.passed else outcome.error, flush=True)
        outcomes.append(outcome)
    return outcomes, check_fork_refusal(settings)


def _cells(o: Outcome) -> list[str]:
    result = "ok" if o.passed else f"FAILED: {o.error}"
    if o.passed and o.config.strategy == STALE:
        result = "ok (rejected, as it must be)"
    return [
        o.config.strategy,
        str(o.config.world_size),
        o.config.precision,
        result,
        "-" if o.loss_diff is None else f"{o.loss_diff:.2e}",
        "-" if o.weight_diff is None else f"{o.weight_diff:.2e}",
        " / ".join(mib(m, 0) for m in o.fit_peak) or "-",
        " / ".join(mib(m, 0) for m in o.save_peak) or "-",
        f"{o.seconds:.1f}",
    ]


def render_markdown(outcomes: Sequence[Outcome], fork_refusal: str, *, settings: CheckSettings, device: str) -> str:
    """The RESULTS.md section: one row per configuration, then the fork refusal."""
    header = ["configuration", "ranks", "precision", "result", "max loss diff", "max weight diff"]
    header += ["fit max_memory_allocated MiB per rank", "checkpoint save MiB per rank", "s"]
    bounds = ", ".join(
        f"{p}: loss {tolerance(p).loss_atol:g}, weights rtol {tolerance(p).weight_rtol:.3g} atol"
        f" {tolerance(p).weight_atol:g}"
        for p in settings.precisions
    )
    return "\n".join(
        [
            "## gpu_check: sharded code paths on NCCL against one device",
            "",
            f"`make gpu-check` on {device}: preset `{settings.preset}`, {settings.steps} steps, global batch"
            f" {settings.batch_size} x {settings.seq_len} tokens, no per-step synchronize. `forced`: the sharded"
            " backend (or DDP's compression hook) at world size 1. Compared with one device at the same precision:"
            f" every step's loss and the checkpoints saved mid-run and at the end ({bounds}; {_SPLIT_FACTOR}x"
            f" wider with several ranks). `{REPEAT}` must pass and `{STALE}` (forward reads one-step-stale"
            " weights) must be rejected: together they show the tolerance is tight enough and not too tight.",
            "",
            markdown_table(header, [_cells(o) for o in outcomes]),
            "",
            f"CUDA-before-fork refusal of the `*_notebook` strategies: {fork_refusal}.",
        ]
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run with gloo")
    parser.add_argument("--tiny", action="store_true", help="one configuration of each kind, tiny model (seconds)")
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
    if args.device == "cuda":
        # Same arithmetic, same bits: cuBLAS needs a fixed workspace for that (set before CUDA starts; spawned ranks
        # inherit it), and embedding backward's atomics give way to a deterministic kernel.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    settings = CheckSettings(device=args.device, steps=args.steps)
    if args.tiny:
        settings = replace(settings, preset="tiny", seq_len=32)
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
