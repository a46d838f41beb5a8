"""ZeRO-1/2 overlap the parameter all-gather after the step with the next forward (``overlap_param_gather``).

* Equivalence: a transformer of ``nn.TransformerEncoderLayer`` blocks (whose attention reads ``out_proj.weight``
  without calling ``out_proj``) trains under zero1/zero2 with the overlap exactly as on one device, with the
  all-gathers really still pending between steps.
* Manual optimization with a forward right after ``opt.step()`` (two steps per batch) trains as on one device.
* Callbacks need no declaration: a timing callback that overrides ``on_train_batch_end`` and reads nothing leaves the
  all-gathers pending (the stale-read guard never waited), and a callback that averages every parameter (EMA) and
  clips them in place there gets exactly the one-device values (the guard waited for what it read).
* The guard itself (no Trainer): metadata reads pass, any value read of a parameter (``.sum()``, ``.data``,
  ``.tolist()``, an in-place op under ``no_grad``) or of a view of a bucket waits for that bucket only, and the guard
  leaves the torch function mode stack at the first block's forward, having waited for the buckets outside the
  blocks; ``state_dict()`` waits for every bucket.
* Layout: each block waits for every bucket holding a parameter of the whole block (``out_proj`` included), the
  other buckets are waited for before the training step, and buckets are launched in the order they are needed.
"""

from __future__ import annotations

import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.overrides import _get_current_function_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from training_helpers import cpu_trainer

from lightning_parallel import ParallelismMonitor, ShardedOptimizerStrategy
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.gather import OverlappedParameterGather

STEPS = 4
GLOBAL_BATCH = 8


class EncoderModel(pl.LightningModule):
    """Embedding -> 3 ``nn.TransformerEncoderLayer`` -> norm -> head, AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(
            # No biases: attention's key bias has an exactly-zero gradient that Adam turns into rounding-sized steps.
            nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True, bias=False)
            for _ in range(3)
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)).mean(dim=(1, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class _TwoStepsPerBatch(EncoderModel):
    """Manual optimization, two optimizer steps per batch (even samples, then odd ones): the second forward starts
    right after ``opt.step()``, reading the embedding before the first block and the head after the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        for half in (slice(0, None, 2), slice(1, None, 2)):  # the same samples on one device as on two ranks
            loss = nn.functional.mse_loss(self(x[half]), y[half])
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()


class _TimingCallback(Callback):
    """A user's timing callback: overrides ``on_train_batch_end`` and reads no parameter (no declaration). It records
    whether all-gathers are still pending there and how often the guard had to wait so far."""

    def __init__(self) -> None:
        self.pending: list[bool] = []
        self.guarded_waits: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds = time.perf_counter() - self.started
        gather = getattr(trainer.strategy, "backend", None) and trainer.strategy.backend.gather
        self.pending.append(gather is not None and gather.is_pending)
        self.guarded_waits.append(gather.num_guarded_waits if gather is not None else -1)


class _EmaAndClip(_TimingCallback):
    """Reads every parameter between steps (an exponential moving average of them, under ``no_grad``) and writes
    them in place (clips them), as a user's EMA or weight-clipping callback would, without any declaration."""

    def __init__(self) -> None:
        super().__init__()
        self.average: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name in self.average:
                    self.average[name].mul_(0.5).add_(param.data, alpha=0.5)
                else:
                    self.average[name] = param.detach().clone()
                param.clamp_(-0.2, 0.2)
        super().on_train_batch_end(trainer, module, *args)


def _data(world_size: int, rank: int) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * GLOBAL_BATCH, 5, 8, generator=generator)
    y = torch.randn(STEPS * GLOBAL_BATCH, generator=generator)
    per_rank = GLOBAL_BATCH // world_size
    # Step k of rank r takes samples [k*B + r*b, k*B + (r+1)*b): the one-device batch k is their union.
    index = torch.cat(
        [
            torch.arange(k * GLOBAL_BATCH + rank * per_rank, k * GLOBAL_BATCH + (rank + 1) * per_rank)
            for k in range(STEPS)
        ]
    )
    return DataLoader(TensorDataset(x[index], y[index]), batch_size=per_rank, shuffle=False)


def _fit(
    strategy: Any, world_size: int, rank: int, callbacks: list[Callback], make: type[EncoderModel] = EncoderModel
) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    module = make()
    trainer = cpu_trainer(
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        use_distributed_sampler=False,  # `_data` gives each rank its own slice of every global batch
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=_data(world_size, rank))
    state = module.state_dict() if world_size == 1 else trainer.strategy.lightning_module_state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def _overlapped_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for stage in (1, 2):
        timing, reader = _TimingCallback(), _EmaAndClip()
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.004)  # ~1 KiB-parameter buckets: many
        # With our monitor too: it reports the bytes every rank holds after each step (storages' sizes only).
        with tempfile.TemporaryDirectory(prefix="lp-overlap-") as folder:
            monitor = ParallelismMonitor(figure_path=False, summary_path=Path(folder, "monitor.json"))
            results[f"zero{stage}"] = _fit(strategy, world_size, rank, [timing, monitor])
        results[f"zero{stage}_pending"] = timing.pending
        results[f"zero{stage}_guarded"] = timing.guarded_waits
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.004)
        results[f"zero{stage}_reader"] = _fit(strategy, world_size, rank, [reader])
        results[f"zero{stage}_average"] = reader.average
        results[f"zero{stage}_reader_guarded"] = reader.guarded_waits
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.004)
        results[f"zero{stage}_manual"] = _fit(strategy, world_size, rank, [], make=_TwoStepsPerBatch)
    return results


def _single_device(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    reader = _EmaAndClip()
    return {
        "plain": _fit("auto", 1, 0, []),
        "reader": _fit("auto", 1, 0, [reader]),
        "average": reader.average,
        "manual": _fit("auto", 1, 0, [], make=_TwoStepsPerBatch),
    }


def test_overlap_trains_like_one_device_with_parameter_reading_callbacks_and_manual_optimization() -> None:
    (reference,) = run_distributed(_single_device, 1, init_process_group=False, timeout=120)
    for result in run_distributed(_overlapped_ranks, 2, init_process_group=False, timeout=240):
        for stage in ("zero1", "zero2"):
            # A callback that reads nothing: the all-gathers are still in flight after every step, never waited for.
            assert result[f"{stage}_pending"] == [True] * STEPS, result[f"{stage}_pending"]
            assert result[f"{stage}_guarded"] == [0] * STEPS, result[f"{stage}_guarded"]
            # One that reads and writes every parameter: the guard waited for every bucket, every step.
            guarded = result[f"{stage}_reader_guarded"]
            assert guarded[0] > 0 and all(b - a == guarded[0] for a, b in pairwise(guarded)), guarded
            cases = (("", "plain"), ("_reader", "reader"), ("_average", "average"), ("_manual", "manual"))
            for key, expected_of in cases:
                for name, expected in reference[expected_of].items():
                    actual = result[f"{stage}{key}"][name]
                    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=f"{stage}{key} {name}")


def _gathered_encoder() -> tuple[EncoderModel, ShardedParameterBuckets, OverlappedParameterGather, dict[int, int]]:
    """The seeded encoder in small stage-1 buckets under the overlapped gather, and each parameter's bucket (by id)."""
    torch.manual_seed(0)
    module = EncoderModel()
    buckets = ShardedParameterBuckets(module, stage=1, bucket_cap_mb=0.004)
    gather = OverlappedParameterGather(buckets, module)
    bucket_of = {id(s.param): i for i, b in enumerate(buckets.buckets) for s in b.segments}
    return module, buckets, gather, bucket_of


def _guarded_reads(rank: int, world_size: int) -> dict[str, Any]:
    module, buckets, gather, bucket_of = _gathered_encoder()
    everything = range(len(buckets.buckets))
    head, embed = module.head.weight, module.embed.weight
    out: dict[str, Any] = {}

    def still_pending() -> set[int]:
        return set(gather._pending)

    gather.launch(everything)
    out["innermost_after_launch"] = _get_current_function_mode() is gather._guard
    _ = (head.shape, head.dtype, head.requires_grad, head.grad, head.numel(), head.size(), hash(head))
    head.requires_grad_(True)
    out["metadata"] = still_pending() == set(everything)
    reads = {
        "sum": lambda: head.sum(),
        "data": lambda: head.data.mul(1),
        "no_grad_in_place": lambda: torch.no_grad()(lambda: head.mul_(1))(),
        "tolist": lambda: head.tolist(),
        "flat_view": lambda: buckets.buckets[bucket_of[id(head)]].flat_params[:3].clone(),
    }
    for name, read in reads.items():
        gather.wait_all()
        gather.launch(everything)
        read()
        out[name] = still_pending() == set(everything) - {bucket_of[id(head)]}
    gather.wait_all()
    gather.launch(everything)
    module.state_dict()  # detaches every parameter: waits for every bucket
    out["state_dict"] = not still_pending()
    gather.launch(everything)
    module.layers[0](torch.randn(2, 5, 16))  # a block first (manual optimization after `opt.step()`): the rest too
    out["rest_at_first_block"] = not set(gather.rest) & still_pending() and not gather.guarding
    gather.wait_all()
    gather.launch(everything)
    module(torch.randn(2, 5, 8))  # the embedding's read waits for its bucket; the first block ends the guard
    out["embed_waited"] = bucket_of[id(embed)] not in still_pending()
    out["guard_left_at_forward"] = not gather.guarding and _get_current_function_mode() is None
    gather.remove_hooks()
    return out


def test_the_guard_waits_for_exactly_the_buckets_that_user_code_reads_between_steps() -> None:
    for out in run_distributed(_guarded_reads, 2, timeout=60):
        assert out == dict.fromkeys(out, True), out


def _layout(rank: int, world_size: int) -> dict[str, Any]:
    module, buckets, gather, bucket_of = _gathered_encoder()
    gather.launch(range(len(buckets.buckets)))
    pending = gather.is_pending
    gather.wait_all()
    return {
        "num_buckets": len(buckets.buckets),
        "block_buckets": gather.block_buckets,
        "rest": gather.rest,
        "launch_order": gather.launch_order,
        "out_proj": [bucket_of[id(layer.self_attn.out_proj.weight)] for layer in module.layers],
        "block_params": [sorted({bucket_of[id(p)] for p in layer.parameters()}) for layer in module.layers],
        "outside": sorted({bucket_of[id(p)] for m in (module.embed, module.norm, module.head) for p in m.parameters()}),
        "pending_after_launch": pending,
        "pending_after_wait": gather.is_pending,
    }


def test_each_block_waits_for_the_buckets_of_all_its_parameters_and_the_rest_before_the_step() -> None:
    for layout in run_distributed(_layout, 2, timeout=60):
        assert layout["num_buckets"] > 6  # small buckets: the blocks need different ones
        assert layout["block_buckets"] == layout["block_params"]
        for out_proj, needed in zip(layout["out_proj"], layout["block_buckets"], strict=True):
            assert out_proj in needed  # read by attention without calling `out_proj`
        assert layout["rest"] == layout["outside"]
        order = layout["launch_order"]
        assert sorted(order) == list(range(layout["num_buckets"]))
        assert order[: len(layout["rest"])] == sorted(layout["rest"], reverse=True)  # needed first
        first_use = [
            min(i for i, needed in enumerate(layout["block_buckets"]) if b in needed)
            for b in order[len(layout["rest"]) :]
        ]
        assert first_use == sorted(first_use)  # then block by block, in forward order
        assert layout["pending_after_launch"] and not layout["pending_after_wait"]


def test_bad_overlap_value_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`overlap_param_gather='yes'` is invalid\. Valid options: 'auto'"):
        ShardedOptimizerStrategy(overlap_param_gather="yes")  # type: ignore[arg-type]


class _CollectiveOrder(Callback):
    """Records, from the start of fit to its end, every collective this rank issues (the c10d op, and which process
    group: the ``ProcessGroup`` script object among its arguments) and the first block's forward, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.mode = _RecordCollectives(self.events)
        self.mode.__enter__()
        module.layers[0].register_forward_pre_hook(lambda *_: self.events.append(("first block forward", "")))

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.mode.__exit__(None, None, None)


class _RecordCollectives(TorchDispatchMode):
    def __init__(self, events: list[tuple[str, str]]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            groups = [
                dist.ProcessGroup.unbox(arg).group_name
                for arg in args
                if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type())
            ]
            self.events.append((func.__name__, groups[0] if groups else ""))
        return func(*args, **(kwargs or {}))


def _collective_order(rank: int, world_size: int) -> list[tuple[str, str]]:
    torch.set_num_threads(1)
    order = _CollectiveOrder()
    _fit(ShardedOptimizerStrategy(stage=2, bucket_cap_mb=0.004), world_size, rank, [order])
    return order.events


def test_nothing_waits_on_the_parameter_all_gathers_between_their_launch_and_the_first_block() -> None:
    """Issue 36, item 2: a collective issued on the all-gathers' process group after they were launched queues behind
    them (NCCL and gloo complete a group's collectives in order), and reading its result on the host (the
    trainable-parameter check's ``.tolist()``) then waits for every all-gather before the first forward kernel,
    cancelling the overlap. Recorded order, not timing: between the last all-gather launched after a step (gloo: one
    broadcast per rank and bucket) and the next forward of the first block, nothing is issued on their group."""
    for events in run_distributed(_collective_order, 2, init_process_group=False, timeout=120):
        forwards = [index for index, (name, _) in enumerate(events) if name == "first block forward"]
        assert len(forwards) == STEPS
        for previous, forward in pairwise(forwards):
            launches = [i for i in range(previous, forward) if events[i][0] == "broadcast_.default"]
            assert launches, "no all-gather launched after the step"
            last, group = launches[-1], events[launches[-1]][1]
            queued = [event for event in events[last + 1 : forward] if event[1] == group]
            assert queued == [], f"issued on the all-gathers' group before the first block's forward: {queued}"
