"""ShardedOptimizerStrategy (ZeRO stages 1-3) against Lightning's DDP, DDP + ZeroRedundancyOptimizer, FSDP, DeepSpeed.

Every configuration trains the demo GPT with AdamW in fp32 on the same data, started with ``fork``. Two parts:

* **Throughput** (``devices`` ranks, default 2): each repeat runs every configuration once, in alternating order
  (forwards, then backwards); the ratios ours / anchor are taken per repeat (the two ran close together) and the
  table reports medians. The same runs give the bytes communicated per optimizer step and the bytes of parameters,
  gradients and optimizer state each rank holds (measured in the ranks by :mod:`benchmarks.zero_probe`).
* **Memory** (a model sized so that optimizer state dominates): peak RSS per rank of every configuration at the
  largest world size (default 4), and of ours and DDP at each world size (1, 2, 4), which should fall for ours.

Stage 3 creates the model under ``trainer.init_module(empty_init=True)`` (meta device, sharded before it is
materialised): that is how a user gets stage 3's memory benefit. Anchors that cannot run here (Lightning's
``FSDPStrategy`` and ``DeepSpeedStrategy`` on CPU) are attempted once and their exact error is recorded.

Run it with ``python -m benchmarks.zero [--preset small|large|tiny] [--repeats N]`` or through
``python -m benchmarks.run_all``. It updates its section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, Strategy
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from torch.distributed.optim import ZeroRedundancyOptimizer
from typing_extensions import override

from benchmarks.results import update_section
from benchmarks.trainers import benchmark_trainer
from benchmarks.zero_probe import ZeroProbe, read_probe
from lightning_parallel._compat import MultiProcessingLauncher
from lightning_parallel.demos.data import TextDataModule
from lightning_parallel.demos.gpt import PRESETS as GPT_PRESETS
from lightning_parallel.demos.main import quiet_lightning
from lightning_parallel.demos.module import GPTLightningModule
from lightning_parallel.demos.stats import RunStats, RunSummary, summarize
from lightning_parallel.strategies import ShardedOptimizerStrategy

__all__ = [
    "CONTENDERS",
    "OPTIONAL_ANCHORS",
    "PRESETS",
    "BenchmarkConfig",
    "Contender",
    "Run",
    "RunConfig",
    "ZeroResults",
    "configure",
    "main",
    "measure",
    "render_markdown",
    "return_freed_memory_to_os",
    "train_contender",
]

NAME = "zero"
"""This benchmark's section name in RESULTS.md."""

DDP, ZERO_REDUNDANCY = "lightning_ddp", "ddp_zero_redundancy"
OURS = ("zero1", "zero2", "zero3")


class ZeroRedundancyGPT(GPTLightningModule):
    """The demo module with its AdamW wrapped in torch's ``ZeroRedundancyOptimizer`` (optimizer state sharded)."""

    @override
    def configure_optimizers(self) -> ZeroRedundancyOptimizer:
        adamw = super().configure_optimizers()
        groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in adamw.param_groups]
        defaults = {key: adamw.defaults[key] for key in ("lr", "betas", "eps")}
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **defaults)


@dataclass(frozen=True)
class Contender:
    """One configuration of the benchmark."""

    label: str
    """Text of the table's first column."""
    stage: int
    """ZeRO stage it shards up to (0: nothing sharded); ours are compared with the anchors of their stage."""
    make_strategy: Callable[[], Strategy]
    """Builds a fresh strategy that starts its ranks with ``fork``."""
    module_class: type[GPTLightningModule] = GPTLightningModule
    """The LightningModule (it chooses the optimizer)."""
    empty_init: bool = False
    """Create the model under ``trainer.init_module(empty_init=True)``."""


def _ddp() -> DDPStrategy:
    return DDPStrategy(start_method="fork")  # ZeroProbe gives it torch's stock allreduce_hook (counted)


def _forked(strategy: Strategy) -> Strategy:
    # These strategies take no `start_method`; their default (popen) would re-run this script in every rank.
    strategy._start_method = "fork"  # type: ignore[attr-defined]
    return strategy


CONTENDERS: dict[str, Contender] = {
    "zero1": Contender(
        "ours: ShardedOptimizerStrategy(stage=1)", 1, lambda: ShardedOptimizerStrategy(1, start_method="fork")
    ),
    "zero2": Contender(
        "ours: ShardedOptimizerStrategy(stage=2)", 2, lambda: ShardedOptimizerStrategy(2, start_method="fork")
    ),
    "zero3": Contender(
        "ours: ShardedOptimizerStrategy(stage=3), empty_init",
        3,
        lambda: ShardedOptimizerStrategy(3, start_method="fork"),
        empty_init=True,
    ),
    DDP: Contender("anchor: Lightning DDPStrategy", 0, _ddp),
    ZERO_REDUNDANCY: Contender("anchor: Lightning DDP + ZeroRedundancyOptimizer", 1, _ddp, ZeroRedundancyGPT),
}
"""Configurations that run on CPU, in the order of the first repeat."""

OPTIONAL_ANCHORS: dict[str, Contender] = {
    "fsdp_shard_grad_op": Contender(
        "anchor: Lightning FSDPStrategy(SHARD_GRAD_OP)",
        2,
        lambda: FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"),
    ),
    "deepspeed_stage1": Contender(
        "anchor: Lightning DeepSpeedStrategy(stage=1)", 1, lambda: _forked(DeepSpeedStrategy(stage=1))
    ),
    "deepspeed_stage2": Contender(
        "anchor: Lightning DeepSpeedStrategy(stage=2)", 2, lambda: _forked(DeepSpeedStrategy(stage=2))
    ),
}
"""Anchors that join :data:`CONTENDERS` if a one-step attempt succeeds; otherwise their error is recorded."""


@dataclass(kw_only=True)
class RunConfig:
    """What one training run does."""

    preset: str = "small"
    """Model size, a key of :data:`~lightning_parallel.demos.gpt.PRESETS`."""
    n_layer: int | None = None
    """Override of the preset's number of blocks."""
    n_embd: int | None = None
    """Override of the preset's width."""
    steps: int = 15
    """Optimizer steps per run."""
    warmup_steps: int = 3
    """Steps before throughput and communication are measured."""
    devices: int = 2
    """CPU processes (world size)."""
    batch_size: int = 8
    """Sequences per batch per process."""
    seq_len: int = 128
    """Tokens per sequence (at most the preset's ``block_size``)."""
    accelerator: str = "cpu"
    """Lightning accelerator: ``"cpu"`` (gloo) or ``"gpu"`` (NCCL, one process per GPU)."""


@dataclass(kw_only=True)
class BenchmarkConfig:
    """The throughput part, the memory part and the number of repeats."""

    throughput: RunConfig = field(default_factory=RunConfig)
    """Runs of the throughput part (world size ``throughput.devices``)."""
    memory: RunConfig = field(default_factory=RunConfig)
    """Runs of the memory part; ``memory.devices`` is replaced by each of :attr:`memory_world_sizes`."""
    memory_world_sizes: tuple[int, ...] = (1, 2, 4)
    """World sizes of the memory part; every configuration runs at the largest, ours and DDP at each."""
    repeats: int = 3
    """Repeats of the throughput part (medians reported); the memory part runs once."""


PRESETS: dict[str, BenchmarkConfig] = {
    # Unit tests: seconds.
    "tiny": BenchmarkConfig(
        throughput=RunConfig(preset="tiny", steps=4, warmup_steps=2, batch_size=4, seq_len=32),
        memory=RunConfig(preset="tiny", steps=2, warmup_steps=1, batch_size=2, seq_len=32),
        memory_world_sizes=(1, 2),
        repeats=1,
    ),
    # A few minutes on a 2-core machine; the memory model (12.7 M parameters, 51 MB) makes AdamW's state (101 MB)
    # the largest block of state per rank.
    "small": BenchmarkConfig(
        throughput=RunConfig(preset="small", steps=15, warmup_steps=3),
        memory=RunConfig(preset="small", n_layer=4, n_embd=512, steps=3, warmup_steps=1, batch_size=2),
    ),
    # The size (~86 M parameters with the byte vocabulary) on GPUs (NCCL): 2 for the throughput part, 1, 2
    # and 4 for the memory part. Not run by us yet (no GPU machine).
    "large": BenchmarkConfig(
        throughput=RunConfig(
            preset="gpt-125m", steps=30, warmup_steps=5, batch_size=8, seq_len=1024, accelerator="gpu"
        ),
        memory=RunConfig(preset="gpt-125m", steps=4, warmup_steps=2, batch_size=4, seq_len=1024, accelerator="gpu"),
    ),
}
"""Named benchmark sizes for ``--preset``."""


@dataclass
class Run:
    """The numbers of one finished run."""

    summary: RunSummary
    """Throughput, loss and peak memory from :class:`~lightning_parallel.demos.stats.RunStats`."""
    probe: dict[str, list[float]]
    """Per-rank communication and held bytes from :class:`~benchmarks.zero_probe.ZeroProbe`."""

    def peak(self) -> float:
        """The largest rank's peak RSS in bytes."""
        return max(self.summary["peak_mem"])

    def held(self, field_name: str) -> float:
        """The largest rank's value of a probe field."""
        return max(self.probe[field_name])


@dataclass
class ZeroResults:
    """Every run's numbers."""

    config: BenchmarkConfig
    """What was run."""
    contenders: dict[str, Contender]
    """What ran: :data:`CONTENDERS` plus the optional anchors that worked."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Optional anchor -> the error that stopped it."""
    throughput: dict[str, list[Run]] = field(default_factory=dict)
    """Configuration -> one run per repeat (world size ``config.throughput.devices``)."""
    memory: dict[tuple[str, int], Run] = field(default_factory=dict)
    """(configuration, world size) -> its memory run."""

    def median(self, name: str, key: str) -> float:
        """Median over repeats of a ``RunSummary`` field of configuration ``name``."""
        return statistics.median(float(run.summary[key]) for run in self.throughput[name])  # type: ignore[literal-required]

    def ratios(self, name: str, anchor: str, key: str = "tokens_per_s") -> list[float]:
        """``name`` / ``anchor`` of ``key`` per repeat."""
        pairs = zip(self.throughput[name], self.throughput[anchor], strict=True)
        return [float(a.summary[key]) / float(b.summary[key]) for a, b in pairs]  # type: ignore[literal-required]

    def comm(self, name: str, field_name: str = "received_bytes") -> float:
        """Per-rank mean of a communication field per step, median over repeats."""
        return statistics.median(statistics.fmean(run.probe[field_name]) for run in self.throughput[name])


@contextmanager
def _restored_environ() -> Iterator[None]:
    """Lightning's fork launcher writes MASTER_PORT into this process; undo it so every run picks a fresh port."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _MetricsOnlyLauncher(MultiProcessingLauncher):
    """Lightning's fork launcher, except that the parent does not load rank 0's trained weights (the benchmark only
    needs the metrics), for Lightning's own strategies (DDP, and FSDP made to fork). Ours keep their own launchers,
    which bring the whole model back. It acts after training, outside the figures."""

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        if worker_output.weights_path is not None:
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)


def train_contender(contender: Contender, run: RunConfig) -> Run:
    """Train the demo model once with ``contender`` and return what ``RunStats`` and ``ZeroProbe`` measured."""
    gc.collect()  # the previous run's model (held in reference cycles) would otherwise be inherited by the ranks
    seq_len = min(run.seq_len, GPT_PRESETS[run.preset]["block_size"])
    torch.manual_seed(0)
    datamodule = TextDataModule(seq_len=seq_len, batch_size=run.batch_size, max_bytes=400_000, seed=0)
    datamodule.setup("fit")  # once here: the forked ranks inherit the corpus
    trainer = benchmark_trainer(
        accelerator=run.accelerator,
        devices=run.devices,
        strategy=contender.make_strategy(),
        max_steps=run.steps,
        callbacks=[RunStats(warmup_steps=run.warmup_steps), ZeroProbe(warmup_steps=run.warmup_steps)],
    )
    # FSDPStrategy always re-runs the script in every rank (here: the whole benchmark); on GPUs start it with fork
    # instead (on CPU Lightning refuses FSDP in the Trainer's constructor, above).
    if type(trainer.strategy.launcher) is MultiProcessingLauncher or isinstance(trainer.strategy, FSDPStrategy):
        trainer.strategy._launcher = _MetricsOnlyLauncher(trainer.strategy, start_method="fork")  # type: ignore[attr-defined]
    overrides = {"n_layer": run.n_layer, "n_embd": run.n_embd}
    # At world size 1 stage 3 trains unsharded, and the strategy then cannot take a meta-device model (it calls
    # `module.to(device)`): create it normally there.
    empty_init = contender.empty_init and run.devices > 1
    context = trainer.init_module(empty_init=True) if empty_init else nullcontext()
    with context:
        model = contender.module_class(run.preset, **{k: v for k, v in overrides.items() if v is not None})
    with _restored_environ():
        trainer.fit(model, datamodule=datamodule)
    return Run(summary=summarize(trainer), probe=read_probe(trainer))


def _one_line(error: BaseException) -> str:
    """The last non-empty line of an error's message (a forked rank's traceback ends with its real error)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def _try_optional_anchors(run: RunConfig) -> tuple[dict[str, Contender], dict[str, str]]:
    """Attempt each optional anchor for one step; return those that worked and the errors of the others."""
    attempt = replace(run, steps=1, warmup_steps=0)
    working, errors = {}, {}
    for name, contender in OPTIONAL_ANCHORS.items():
        print(f"\n=== attempting {contender.label} ===", flush=True)
        try:
            train_contender(contender, attempt)
        except Exception as error:  # recorded in RESULTS.md: the anchor does not run here
            errors[name] = _one_line(error)
            continue
        working[name] = contender
    return working, errors


def measure(config: BenchmarkConfig) -> ZeroResults:
    """Run the throughput part (``config.repeats`` times, alternating order) and the memory part.

    Call it with one intra-op thread in this process (``torch.set_num_threads(1)``): it forks the ranks.

    Raises:
        ValueError: If ``config.repeats < 1``.
        RuntimeError: If a run of :data:`CONTENDERS` failed (the rank's error is chained).
    """
    if config.repeats < 1:
        raise ValueError(f"`repeats={config.repeats}` must be at least 1.")
    working, unavailable = _try_optional_anchors(replace(config.throughput, preset="tiny", seq_len=32, batch_size=2))
    contenders = {**CONTENDERS, **working}
    results = ZeroResults(config=config, contenders=contenders, unavailable=unavailable)
    results.throughput = {name: [] for name in contenders}
    for repeat in range(config.repeats):
        order = list(contenders) if repeat % 2 == 0 else list(reversed(contenders))
        for name in order:
            print(f"\n=== throughput, repeat {repeat + 1}/{config.repeats}: {contenders[name].label} ===", flush=True)
            results.throughput[name].append(train_contender(contenders[name], config.throughput))
    largest = max(config.memory_world_sizes)
    for world_size in config.memory_world_sizes:
        for name, contender in contenders.items():
            if world_size == largest or name in (*OURS, DDP):
                print(f"\n=== memory, world size {world_size}: {contender.label} ===", flush=True)
                run = replace(config.memory, devices=world_size)
                results.memory[(name, world_size)] = train_contender(contender, run)
    return results


def render_markdown(results: ZeroResults, *, command: str) -> str:
    """The RESULTS.md section (:func:`benchmarks.zero_report.render_markdown`)."""
    from benchmarks.zero_report import render_markdown as render  # zero_report imports this module

    return render(results, command=command)


def configure(preset: str, *, repeats: int | None = None, steps: int | None = None) -> BenchmarkConfig:
    """The configuration of ``preset`` with ``repeats`` and the throughput part's ``steps`` replaced where given.

    The memory part keeps its few steps: its figures (bytes held, bytes per step, peak RSS) do not need more.
    """
    if preset not in PRESETS:
        raise ValueError(f"`preset={preset!r}` is not one of {', '.join(PRESETS)}.")
    config = PRESETS[preset]
    if steps is not None:
        warmup = min(config.throughput.warmup_steps, steps - 1)
        config = replace(config, throughput=replace(config.throughput, steps=steps, warmup_steps=warmup))
    return config if repeats is None else replace(config, repeats=repeats)


def return_freed_memory_to_os() -> bool:
    """Make glibc return freed tensors of 1 MiB and more to the OS at once; return whether it could be set.

    glibc raises its mmap threshold dynamically (up to 32 MiB) after large frees, so the 25 MiB gradient buckets and
    optimizer tensors freed and allocated again each step stay in the heap and RSS shows the allocator's history
    rather than live memory. A fixed threshold (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``) disables that. Set it in the
    parent before forking: the ranks inherit it, every configuration alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): RSS figures then include the allocator's retention
        return False
    m_mmap_threshold = -3  # from <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 2**20))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="benchmark size (default: small)")
    parser.add_argument("--repeats", type=int, default=None, help="throughput repeats (default: the preset's)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1.")
    return args


def main(argv: Sequence[str] | None = None, *, command: str | None = None) -> int:
    """Run the benchmark, print its section and write it into ``benchmarks/RESULTS.md``.

    Args:
        argv: Command-line arguments; ``None`` reads ``sys.argv``.
        command: The command to record in RESULTS.md; defaults to this module's command with ``argv``.

    Returns:
        0 once the results are written (whether or not they meet their goals: the tables say so); a failed run
        raises instead.
    """
    args = _parse_args(argv)
    config = configure(args.preset, repeats=args.repeats)
    if command is None:
        command = f"python -m benchmarks.zero --preset {args.preset}"
        command += "" if args.repeats is None else f" --repeats {args.repeats}"
    torch.set_num_threads(1)  # before forking: a forked child of a process whose OpenMP pool ran can hang
    quiet_lightning()
    return_freed_memory_to_os()
    results = measure(config)
    section = render_markdown(results, command=command)
    print("\n" + section)
    update_section(NAME, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
