"""Experiment (issue 23, item 2): FSDP2's gradient reduction as an async all-reduce-and-slice on gloo, against plain
FSDP2, on the same GPT in the same forked ranks, interleaved. What ZeRO-3 now does on gloo, with the cases below routed
to a synchronous completion, lives in ``lightning_parallel/distributed/zero/stage3_gloo.py``; this script keeps the bare
comparison (its own copy, no safety checks: fp32, 1-D mesh, ``zero_grad`` every step).

FSDP2 (torch 2.13) calls its reduce-scatter synchronously (``foreach_reduce`` calls the comm without ``async_op``
and ignores what it returns): on gloo every unit's reduction blocks backward, and gloo's reduce-scatter is slower
than its all-reduce (``distributed/zero/buckets.py``, ``default_gradient_reduction``).
``FSDPModule.set_custom_reduce_scatter(comm: ReduceScatter)`` lets a ``ReduceScatter`` (``allocate(size, *, dtype,
device)``, ``__call__(output_tensor, input_tensor, group, op, async_op=False)``) replace it.
:class:`AsyncAllReduceSlice` launches an async all-reduce of the unit's input (the whole gradients) and returns at
once; the rank's slice is copied into FSDP2's output (and divided for ``AVG``) when more than ``max_in_flight`` are in
flight, and at the end of backward (here: explicitly before the step).

That is only correct while FSDP2 does not read the output between the call and the end of backward: on CPU its
"streams" are no-ops, so it must not accumulate into an existing sharded ``.grad`` (no ``zero_grad`` between
syncs), post-divide (``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``, fp16 reduce), cast
(``reduce_dtype`` other than the sharded parameters'), all-reduce across replicas (HSDP), offload, or run a
post-accumulate-grad hook on a sharded parameter. This script trains fp32, 1-D mesh, ``zero_grad`` every step.

    python benchmarks/zero3_async_reduce.py --repeats 8   # 13.8M-parameter GPT, world size 2, 3 steps a repeat
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # torch 2.13: not exported publicly
from torch.nn import functional as F

from lightning_parallel.accounting import LiveTensorPeak
from lightning_parallel.demos.gpt import GPT, GPTConfig
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.stage3_compat import initialise_root

VARIANTS = ("fsdp2", "async_all_reduce")


class AsyncAllReduceSlice(ReduceScatter):
    """FSDP2's reduce-scatter as an async all-reduce of the input; the slice is taken later (:meth:`finish`)."""

    def __init__(self, *, max_in_flight: int = 2) -> None:
        self.max_in_flight = max_in_flight
        self._pending: deque[tuple[dist.Work, torch.Tensor, torch.Tensor, int, int, bool]] = deque()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(  # type: ignore[override]
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"AsyncAllReduceSlice supports SUM and AVG, not {op!r}")
        work = dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self._pending.append((work, input_tensor, output_tensor, rank, size, op == dist.ReduceOp.AVG))
        while len(self._pending) > self.max_in_flight:
            self._complete()
        return None

    def _complete(self) -> None:
        work, full, output, rank, size, average = self._pending.popleft()
        work.wait()
        output.copy_(full[rank * output.numel() : (rank + 1) * output.numel()])  # (numel / N,)
        if average:
            output.div_(size)

    def finish(self) -> None:
        """Wait for every reduction and fill FSDP2's outputs: call at the end of backward, before any read."""
        while self._pending:
            self._complete()


def _rank(
    rank: int, world_size: int, repeats: int, steps: int, config: GPTConfig, max_in_flight: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    base = GPT(config)
    zero3.broadcast_from_rank0(base, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (world_size,))
    runs = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        units = zero3.apply_fully_shard(model, mesh)
        initialise_root(units[-1])
        comm = AsyncAllReduceSlice(max_in_flight=max_in_flight) if name == "async_all_reduce" else None
        for unit in units if comm is not None else ():
            unit.set_custom_reduce_scatter(comm)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), comm)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        tuple(torch.randint(config.vocab_size, (4, config.block_size), generator=generator) for _ in "xy")
        for _ in range(steps)
    ]

    def step(name: str, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        model, optimizer, comm = runs[name]
        logits = model(inputs)  # (B, T, V)
        F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
        if comm is not None:
            comm.finish()
        optimizer.step()
        optimizer.zero_grad()

    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(repeats):
        for name in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for inputs, targets in batches:
                step(name, inputs, targets)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    peaks = {}
    for name in VARIANTS:
        with LiveTensorPeak() as tracker:
            step(name, *batches[0])
        peaks[name] = tracker.result().peak_bytes
    local = {name: [p.to_local() for p in runs[name][0].parameters()] for name in VARIANTS}
    identical = all(torch.equal(a, b) for a, b in zip(*local.values(), strict=True))
    return {"seconds": seconds, "identical": identical, "peak_bytes": peaks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per repeat")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--max-in-flight", type=int, default=2, help="unit reductions in flight at once")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks` is a folder
    from benchmarks.peak_memory import run_forked

    config = GPTConfig(vocab_size=4096, block_size=64, n_layer=args.n_layer, n_head=6, n_embd=args.n_embd)
    ranks = run_forked(
        _rank, (args.repeats, args.steps, config, args.max_in_flight), world_size=2, timeout=1800, what="zero3 async"
    )
    seconds = ranks[0]["seconds"]
    ratios = [a / f for a, f in zip(seconds["async_all_reduce"], seconds["fsdp2"], strict=True)]
    print(f"async all-reduce-and-slice / FSDP2, per repeat: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(
        f"median {statistics.median(ratios):.3f}; FSDP2 {statistics.median(seconds['fsdp2']) / args.steps:.3f} s/step"
    )
    print(f"weights identical on every rank: {all(r['identical'] for r in ranks)}")
    for name in VARIANTS:
        print(f"peak tensor MiB over one step, {name}: {max(r['peak_bytes'][name] for r in ranks) / 2**20:.1f}")


if __name__ == "__main__":
    main()
