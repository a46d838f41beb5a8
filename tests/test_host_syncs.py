"""No host-device syncs in the pipeline's hot loops (issue 36, item 5).

A host read of a tensor (``.item()``, ``bool()``, ``int()``, ``float()``) dispatches ``aten._local_scalar_dense``; on
a GPU each one waits for the device to finish everything queued before it. A dispatch mode records every such read
during the training batches of a pipeline fit, with the innermost frame of ours that issued it: none may come from
the pipeline's loss function (once per micro-batch), the ZeRO tied-shard sum (once per view) or the tied-copy sum
(once per parameter), and the number of reads of a step must not grow with the number of micro-batches.

(On CPU ``.tolist()`` and ``.cpu()`` do not dispatch a read, so the one batched read a step may need is not seen
here; ``.item()`` and friends are, on every device.)
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import torch
from collective_devices import package_frame
from distributed_harness import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.tied import TiedGradientSync, TiedLayout, find_tied_parameters

HOT_FILES = ("distributed/pipeline/engine.py", "distributed/pipeline/zero.py", "distributed/pipeline/tied.py")


class _ScalarReads(TorchDispatchMode):
    """Counts ``_local_scalar_dense`` calls by the innermost ``lightning_parallel`` frame that issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.by_caller: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.by_caller[_issuer()] += 1
        return func(*args, **(kwargs or {}))


def _issuer() -> str:
    return package_frame(sys._getframe(2))


class _CountReads(pl.Callback):
    """The reads of each training batch (batch start to batch end: the schedule, the gradient sums, the step)."""

    def __init__(self) -> None:
        self.per_step: list[dict[str, int]] = []
        self._mode: _ScalarReads | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._mode = _ScalarReads().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self.per_step.append(dict(self._mode.by_caller))
        self._mode = None


def _fit_counting(strategy: PipelineParallelStrategy, devices: int) -> list[dict[str, int]]:
    pl.seed_everything(0, verbose=False)
    reads = _CountReads()
    trainer = zoo.trainer(strategy, devices, callbacks=[reads], max_steps=2)
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    trainer.fit(zoo.TiedGPT(), zoo.loader(sampler["num_replicas"], sampler["rank"], kind="tokens", steps=2))
    return reads.per_step


def _micro_batch_counts(rank: int, world_size: int) -> dict[int, list[dict[str, int]]]:
    return {m: _fit_counting(PipelineParallelStrategy(num_microbatches=m, timeout=60), world_size) for m in (2, 4)}


def _zero_stages(rank: int, world_size: int) -> list[dict[str, int]]:
    return _fit_counting(PipelineParallelStrategy(pipeline_parallel_size=2, zero_stage=2, timeout=60), world_size)


PER_STEP = "distributed/pipeline/engine.py:_broadcast"
"""torch's ``broadcast_object_list`` of the step's outcome (loss, logs) to the pipeline's other ranks reads the
pickled sizes: once per step, the one host value a step needs there."""


def _from_hot_files(reads: dict[str, int]) -> dict[str, int]:
    return {caller: count for caller, count in reads.items() if caller.startswith(HOT_FILES) and caller != PER_STEP}


def test_a_pipeline_step_reads_no_scalar_per_micro_batch() -> None:
    """Step 1 (step 0 builds the schedule, where torch itself reads shapes) on both ranks, 2 and 4 micro-batches:
    no reads from our hot files, and as many reads with 4 micro-batches as with 2 (Lightning's, torch's per step).

    With ``.item()`` back in the loss function (``index = int(target.reshape(-1)[0].item())``) rank 1, which runs the
    last stage, fails with ``{'distributed/pipeline/engine.py:_loss_fn': 2}`` (then 4) instead of ``{}``."""
    for counts in run_distributed(_micro_batch_counts, 2, init_process_group=False, timeout=120):
        steady = {m: per_step[1] for m, per_step in counts.items()}
        assert {m: _from_hot_files(reads) for m, reads in steady.items()} == {2: {}, 4: {}}
        assert sum(steady[4].values()) == sum(steady[2].values()), steady


def test_zero_inside_the_pipeline_reads_no_scalar_per_view() -> None:
    """2 x 2 ranks with ``zero_stage=2`` and a weight tied across the stages: the sum of the tied copies' shards reads
    nothing on any rank. With ``flat[total + names.index(name)] > 0`` back, each rank holding a copy fails with
    ``{'distributed/pipeline/zero.py:_sum_tied_shards': 1}`` per step (one per view of a tied parameter)."""
    for per_step in run_distributed(_zero_stages, 4, init_process_group=False, timeout=120):
        assert _from_hot_files(per_step[1]) == {}  # step 1: step 0 builds the schedule


class _ThreeTies(nn.Module):
    """Two layers sharing three weights: three tied parameters, whose copies sit on pipeline ranks 0 and 1."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))
        self.second = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))
        for a, b in zip(self.first, self.second, strict=True):
            b.weight = a.weight


def _tied_sum(rank: int, world_size: int) -> tuple[dict[str, int], list[torch.Tensor | None]]:
    torch.manual_seed(0)
    module = _ThreeTies()
    tied = find_tied_parameters(module, [module.first, module.second])
    dims = ParallelDims(world_size, rank, world_size).with_groups("cpu")
    layout = TiedLayout(tuple(tied), StagePlan(starts=(0, 1), num_layers=2, pipeline_parallel_size=world_size))
    sync = TiedGradientSync(layout, dims)
    for index, layer in enumerate(module.first):  # rank 0's copies were used, rank 1's were not
        layer.weight.grad = torch.full((4, 4), float(index + 1)) if rank == 0 else None
    with _ScalarReads() as reads:
        sync.all_reduce(module, {})
    return dict(reads.by_caller), [
        layer.weight.grad for layer in module.first.children() if isinstance(layer, nn.Linear)
    ]


def test_the_tied_copies_sum_reads_no_scalar_per_parameter() -> None:
    """Rank 1's three copies have no gradient and take rank 0's: without one read per parameter. With
    ``elif bool(has_grad[index]):`` back, rank 1 fails with ``{'distributed/pipeline/tied.py:all_reduce': 3}``."""
    results = run_distributed(_tied_sum, 2, timeout=60)
    for reads, grads in results:
        assert _from_hot_files(reads) == {}
        assert grads is not None
        for index, grad in enumerate(grads):
            torch.testing.assert_close(grad, torch.full((4, 4), float(index + 1)))
