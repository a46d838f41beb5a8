"""Peak memory per rank of DDP, DDP + ZeroRedundancyOptimizer and our ZeRO stages 1-3 (issue 12).

Runs each strategy on the same GPT (default: d=768, 12 layers, vocabulary 8192, sequence 128, ~97.7M parameters,
AdamW, fp32) in freshly forked ranks joined by gloo, with a plain torch training loop over the same building blocks
the strategies call (``ShardedParameterBuckets`` + ``ShardedOptimizer`` at stages 1-2, ``zero3.apply_fully_shard``
at stage 3, ``DistributedDataParallel`` as Lightning's ``DDPStrategy`` builds it). After one warm-up step (the
optimizer state exists from then on) it measures two steps per rank with:

* **peak tensor bytes**: :class:`lightning_parallel.accounting.LiveTensorPeak`, exact and independent of the C
  allocator, broken down at the moment of the peak into parameters / gradients / optimizer state / other
  (activations, autograd's saved tensors, temporaries, communication buffers; DDP's C++ gradient buckets and ZeRO-3's
  gathered parameters are "other" too, as no Python object names them);
* **peak RSS**: ``VmHWM`` reset at the window's start. glibc keeps freed memory unless ``MALLOC_MMAP_THRESHOLD_`` is
  set, so the script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=131072`` (every allocation over 128 KiB is its
  own mapping, returned on free) unless ``--keep-malloc`` is given.

Prints a Markdown table (MiB per rank, the worst rank) and checks the issue's goals: peak(zero2) <= peak(zero1) -
0.9 (1 - 1/N) G (G: gradient bytes) and peak(zero1) <= peak(DDP + ZeroRedundancyOptimizer).

    python benchmarks/peak_memory.py --world-sizes 2 4
    python benchmarks/peak_memory.py --n-layer 2 --n-embd 64 --n-head 4 --vocab 256   # a quick check
    python benchmarks/peak_memory.py --strategies zero1 zero2 --n-layer 6 --n-embd 384 --n-head 6 --vocab 4096 \
        --bucket-cap-mb 3   # ~12M parameters, ~16 buckets like the default model's: a loaded 2-core machine
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.accounting import (
    LiveTensorPeak,
    optimizer_state_tensors,
    peak_memory_bytes,
    reset_peak_memory,
)
from lightning_parallel.demos.gpt import GPT, GPTConfig
from lightning_parallel.distributed.activation_checkpointing import apply_activation_checkpointing
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer
from lightning_parallel.distributed.zero.stage3_compat import initialise_root

STRATEGIES = ("single", "ddp", "ddp_zero_redundancy", "zero1", "zero2", "zero3", "deepspeed_zero1", "deepspeed_zero2")
"""``single`` is one process without any wrapper (measured once, at world size 1). ``deepspeed_*``: DeepSpeed's own
engine (optional; benchmarks/deepspeed_anchor.py says how to install it and what it bypasses on CPU)."""
ANCHOR_AT_STAGE = {"zero1": ("ddp_zero_redundancy", "deepspeed_zero1"), "zero2": ("deepspeed_zero2",)}
"""Our stage -> the anchors that shard the same states (the goal: ours <= each)."""
MMAP_THRESHOLD = "131072"
MIB = 2**20


@dataclass(kw_only=True)
class Settings:
    """One measurement: the model's shape, the batch and the steps."""

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab: int = 8192
    seq_len: int = 128
    batch_size: int = 4
    """Sequences per rank per step."""
    measured_steps: int = 2
    """Steps inside the measured window, after one warm-up step."""
    bf16: bool = False
    """bf16 parameters (``precision="bf16-true"``): fp32 master weights in the shard at ZeRO 1-3 (as our strategies'
    default ``master_weights="fp32"``), plain bf16 for the single process, DDP and DDP + ZeroRedundancyOptimizer."""
    activation_checkpointing: bool = False
    """Every transformer block recomputed in backward (the strategies' ``activation_checkpointing=True``)."""
    bucket_cap_mb: float = 25.0
    """ZeRO-1/2 bucket size (the strategies' default); scale it with a small preset to keep the number of buckets
    (about 15 at the default model)."""


@dataclass
class RankPeak:
    """What one rank measured over the window."""

    peak_bytes: int
    breakdown: dict[str, int]
    peak_rss: int
    parameter_bytes: int  # of the whole model (Psi)
    phase: str = "-"
    """The phase in which the peak happened (forward, backward, gradient_sync, optimizer_step, ...)."""


class _Runner:
    """One strategy on one rank: the model, its optimizer, a step and what counts as what."""

    def __init__(self, strategy: str, model: nn.Module, rank: int, world_size: int, settings: Settings) -> None:
        self.strategy = strategy
        self.module = model
        if settings.activation_checkpointing:
            apply_activation_checkpointing(model, True)
        if settings.bf16 and strategy != "zero3":  # ZeRO-3 shards fp32 masters and computes in bf16 (below)
            model.to(torch.bfloat16)
        master = torch.float32 if settings.bf16 else None
        self.buckets: ShardedParameterBuckets | None = None
        self.sharded: ShardedOptimizer | None = None
        device = torch.device("cpu")
        if strategy == "single":
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        elif strategy in ("ddp", "ddp_zero_redundancy"):
            self.model: nn.Module = DistributedDataParallel(model)  # Lightning's DDPStrategy defaults
            if strategy == "ddp":
                self.optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
            else:
                self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        elif strategy in ("zero1", "zero2"):
            zero3.broadcast_from_rank0(model, device)
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self.buckets = ShardedParameterBuckets(
                model, stage=int(strategy[-1]), master_dtype=master, bucket_cap_mb=settings.bucket_cap_mb
            )
            self.sharded = ShardedOptimizer(self.optimizer, self.buckets)
        elif strategy == "zero3":
            zero3.broadcast_from_rank0(model, device)
            from torch.distributed.device_mesh import init_device_mesh

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if master else None
            units = zero3.apply_fully_shard(model, init_device_mesh("cpu", (world_size,)), mp_policy=policy)
            initialise_root(units[-1])  # as `ShardedOptimizerStrategy(stage=3)` does once the model is materialised
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            raise ValueError(f"Unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], tracker: LiveTensorPeak | None = None) -> None:
        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        inputs, targets = batch
        phase("forward")
        logits = self.model(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        del logits
        phase("backward")
        loss.backward()
        if self.buckets is not None:
            phase("gradient_sync")
            self.buckets.finish_gradient_sync()
        phase("optimizer_step")
        self.optimizer.step()
        if self.buckets is not None and self.sharded is not None:
            phase("parameter_all_gather")
            self.buckets.all_gather_parameters(self.sharded.bucket_indices)
        self.optimizer.zero_grad()

    def categories(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        if self.buckets is not None:
            grads += self.buckets.gradient_buffers()
        optimizer = self.optimizer.optim if isinstance(self.optimizer, ZeroRedundancyOptimizer) else self.optimizer
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": list(optimizer_state_tensors(optimizer)),
        }


def _measure_rank(rank: int, world_size: int, strategy: str, settings: Settings) -> RankPeak:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=settings.vocab,
        block_size=settings.seq_len,
        n_layer=settings.n_layer,
        n_head=settings.n_head,
        n_embd=settings.n_embd,
    )
    model = GPT(config)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner: Any
    if strategy.startswith("deepspeed_"):  # optional anchor: DeepSpeed's own engine
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks` is a folder
        from benchmarks.deepspeed_anchor import DeepSpeedRunner

        runner = DeepSpeedRunner(strategy, model, rank, world_size, settings)
    else:
        runner = _Runner(strategy, model, rank, world_size, settings)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        tuple(torch.randint(settings.vocab, (settings.batch_size, settings.seq_len), generator=generator) for _ in "xy")
        for _ in range(1 + settings.measured_steps)
    ]
    runner.step(batches[0])  # warm-up: optimizer state exists from here on
    dist.barrier()
    reset_peak_memory(torch.device("cpu"))
    with LiveTensorPeak(categories=runner.categories) as tracker:
        for batch in batches[1:]:
            runner.step(batch, tracker)
    peak = tracker.result()
    return RankPeak(peak.peak_bytes, peak.breakdown, peak_memory_bytes(), parameter_bytes, peak.phase or "-")


def run_forked(
    rank_fn: Callable[..., Any], args: tuple[Any, ...], *, world_size: int, timeout: float, what: str
) -> list[Any]:
    """``rank_fn(rank, world_size, *args)`` in ``world_size`` forked ranks joined by gloo on loopback; each rank's
    return value (pickled back). Raises ``RuntimeError`` with the first rank's traceback if any rank failed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="forked-ranks-") as tmp:
        out = Path(tmp)
        ranks = [
            context.Process(target=_forked_rank, args=(rank_fn, args, r, world_size, port, out, timeout))
            for r in range(world_size)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout)
            if process.is_alive():
                process.kill()
        errors = sorted(out.glob("*.err"))
        if errors or any(process.exitcode != 0 for process in ranks):
            detail = errors[0].read_text() if errors else f"exit codes {[p.exitcode for p in ranks]}"
            raise RuntimeError(f"{what} at world size {world_size} failed:\n{detail}")
        return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(world_size)]


def _forked_rank(
    rank_fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world_size: int, port: int, out: Path, timeout: float
) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(rank_fn(rank, world_size, *args)))
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


def measure(strategy: str, world_size: int, settings: Settings, *, timeout: float = 1800.0) -> list[RankPeak]:
    """Run ``strategy`` at ``world_size`` in forked ranks; each rank's :class:`RankPeak`."""
    return run_forked(_measure_rank, (strategy, settings), world_size=world_size, timeout=timeout, what=strategy)


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:.1f}"


def format_table(results: dict[tuple[str, int], list[RankPeak]]) -> str:
    """Markdown: per strategy and world size, the worst rank's peak tensor bytes (with the breakdown) and RSS."""
    lines = [
        "| strategy | ws | peak tensors MiB | at | parameters | gradients | optimizer state | other | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (strategy, world_size), ranks in results.items():
        worst = max(ranks, key=lambda r: r.peak_bytes)
        parts = [_mib(worst.breakdown.get(k, 0)) for k in ("parameters", "gradients", "optimizer_state", "other")]
        rss = max(r.peak_rss for r in ranks)
        cells = [strategy, str(world_size), _mib(worst.peak_bytes), worst.phase, *parts, _mib(rss)]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def check_goals(results: dict[tuple[str, int], list[RankPeak]], settings: Settings) -> list[str]:
    """The issue's goals, one line each, stated as met or not with the numbers (worst rank, tensor bytes and RSS)."""
    lines = []
    single = results.get(("single", 1))
    for world_size in sorted({ws for s, ws in results if s == "zero3"}):
        if single is not None:
            zero3_peak, single_peak = (
                max(r.peak_bytes for r in results[k]) for k in (("zero3", world_size), ("single", 1))
            )
            ratio = zero3_peak / single_peak
            lines.append(
                f"ws {world_size}, tensor bytes: zero3 {_mib(zero3_peak)} = {ratio:.2f} x single process"
                f" {_mib(single_peak)} MiB (goal at ws 4: <= 0.45)"
                + (f": {'met' if ratio <= 0.45 else 'NOT met'}" if world_size == 4 else "")
            )
    for world_size in sorted({ws for _, ws in results}):
        got = {s: results[(s, world_size)] for s in STRATEGIES if (s, world_size) in results}
        if "zero1" in got and "zero2" in got:
            # Every parameter trainable; `parameter_bytes` is counted in fp32, the gradients are bf16 under --bf16.
            gradient_bytes = got["zero1"][0].parameter_bytes // (2 if settings.bf16 else 1)
            saving = 0.9 * (1 - 1 / world_size) * gradient_bytes
            for what, key in (("tensor bytes", "peak_bytes"), ("RSS", "peak_rss")):
                one, two = (max(getattr(r, key) for r in got[s]) for s in ("zero1", "zero2"))
                met = two <= one - saving
                lines.append(
                    f"ws {world_size}, {what}: zero2 {_mib(two)} <= zero1 {_mib(one)} - {_mib(saving)}"
                    f" = {_mib(one - saving)} MiB: {'met' if met else 'NOT met'}"
                )
        for ours, anchors in ANCHOR_AT_STAGE.items():
            for anchor_name in (a for a in anchors if ours in got and a in got):
                for what, key in (("tensor bytes", "peak_bytes"), ("RSS", "peak_rss")):
                    mine, anchor = (max(getattr(r, key) for r in got[s]) for s in (ours, anchor_name))
                    lines.append(
                        f"ws {world_size}, {what}: {ours} {_mib(mine)} <= {anchor_name} {_mib(anchor)} MiB:"
                        f" {'met' if mine <= anchor else 'NOT met'}"
                    )
        if all(s in got for s in ("zero1", "zero2", "zero3")):
            one, two, three = (max(r.peak_bytes for r in got[s]) for s in ("zero1", "zero2", "zero3"))
            lines.append(
                f"ws {world_size}, tensor bytes: zero3 {_mib(three)} < zero2 {_mib(two)} < zero1 {_mib(one)} MiB:"
                f" {'met' if three < two < one else 'NOT met'}"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument(  # DeepSpeed only when asked for: it is an optional install
        "--strategies", nargs="+", default=[s for s in STRATEGIES if not s.startswith("deepspeed_")], choices=STRATEGIES
    )
    parser.add_argument("--keep-malloc", action="store_true", help="do not set MALLOC_MMAP_THRESHOLD_")
    parser.add_argument("--json", type=Path, help="also write every rank's figures here")
    parser.add_argument("--figure", type=Path, help="also draw the worst rank's breakdown per row as a PNG here")
    for name, default in asdict(Settings()).items():
        if isinstance(default, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    if not args.keep_malloc and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        # glibc reads it once, at process start: re-execute with it set (the forked ranks inherit it).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    settings = Settings(**{name: getattr(args, name) for name in asdict(Settings())})
    results: dict[tuple[str, int], list[RankPeak]] = {}
    if "single" in args.strategies:
        results[("single", 1)] = measure("single", 1, settings)
    for world_size in args.world_sizes:
        for strategy in (s for s in args.strategies if s != "single"):
            results[(strategy, world_size)] = measure(strategy, world_size, settings)
            print(f"{strategy} ws {world_size}: done", file=sys.stderr, flush=True)
    psi = next(iter(results.values()))[0].parameter_bytes
    print(f"{psi / 4 / 1e6:.1f}M parameters ({_mib(psi)} MiB fp32), {settings}")
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}\n")
    print(format_table(results))
    print()
    print("\n".join(check_goals(results, settings)))
    if args.figure is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks` is a folder
        from benchmarks.figures import peak_breakdown_chart

        worst = {f"{s} ws {ws}": max(ranks, key=lambda r: r.peak_bytes) for (s, ws), ranks in results.items()}
        peak_breakdown_chart({label: rank.breakdown for label, rank in worst.items()}, args.figure)
    if args.json is not None:
        payload = {f"{s}@{ws}": [asdict(r) for r in ranks] for (s, ws), ranks in results.items()}
        args.json.write_text(__import__("json").dumps(payload, indent=1))


if __name__ == "__main__":
    main()
