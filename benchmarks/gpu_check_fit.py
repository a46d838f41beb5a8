"""One fit of ``make gpu-check`` and its comparison with one device: settings, tolerances, the fit, the resume.

A fit trains ``steps`` optimizer steps of the demo GPT over two epochs of ``steps / 2`` batches (the same batches for
every row: a ``DistributedSampler`` with seed 0, shuffled per epoch), saving ``mid.ckpt`` after the first epoch's
last step and ``end.ckpt`` at the end (:class:`~benchmarks.gpu_check_runs.Probe`). :func:`resume` starts a fresh
module (other initial weights) from ``mid.ckpt`` with the same strategy and trains the second epoch again: it must
end where the uninterrupted fit ended. (Saved there, Lightning resumes at the next epoch's first batch; saved inside
an epoch, it would restart that epoch's batches, since a plain ``DataLoader`` cannot be skipped into.) Every file goes
to the directory the caller gives, which the caller deletes (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.gpu_check_runs import Probe, read_peaks, read_states
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.demos.main import _restored_environ  # Lightning's launchers write MASTER_PORT, WORLD_SIZE here
from lightning_parallel.demos.report import DemoRecorder, read_recording

__all__ = [
    "CheckSettings",
    "FitPlan",
    "Fitted",
    "Tolerance",
    "compare",
    "configure_device",
    "fit",
    "largest_differences",
    "resume",
    "tolerance",
]


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
# the controls measure both sides on the machine that runs the check. These bounds hold only against a reference
# with the same micro-batches: a pipeline's two micro-batches of a bf16-mixed step against one whole-batch step moved
# a weight by 23% of its value (tiny preset, CPU), so a pipeline row is compared with a one-device run that
# accumulates the same two micro-batches (``reference_key``), which it equals bit for bit on CPU.
_TOLERANCES = {
    "32-true": Tolerance(loss_atol=2e-5, weight_rtol=1.3e-6, weight_atol=1e-5),
    "bf16": Tolerance(loss_atol=2e-4, weight_rtol=2**-8, weight_atol=1e-5),
}
SPLIT_FACTOR = 10
"""Several ranks (or replica groups) split each batch, so sums are reordered (and bf16 matmuls of half batches may
pick other kernels): their tolerance is this many times wider. The stale-weight race is hunted by the forced one-rank
rows, which run the same overlapped code paths at the tight tolerance."""


def tolerance(precision: str, *, world_size: int = 1) -> Tolerance:
    """The tolerance of a run at ``precision`` against one device (wider when several ranks split the batch)."""
    base = _TOLERANCES["32-true" if precision == "32-true" else "bf16"]
    if world_size == 1:
        return base
    factor = SPLIT_FACTOR
    return Tolerance(base.loss_atol * factor, base.weight_rtol * factor, base.weight_atol * factor)


@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    """Model, data and length of every fit."""

    device: str = "cuda"
    """``"cuda"`` (NCCL) or ``"cpu"`` (gloo: the stand-in that runs the same flow in CI)."""
    preset: str = "gpt-125m"
    """Demo GPT preset. ``gpt-125m`` (86 M parameters with the byte vocabulary): a checkpoint with AdamW's state is
    about 1 GB, a row holds three at once (mid-run, end, resumed end) and deletes them; about 30 fits fit 8 minutes
    on one H100 (estimate, not measured yet). The CPU stand-in uses ``tiny``."""
    steps: int = 8
    """Optimizer steps per fit, two epochs of ``steps / 2``: enough for a stale weight to show in several losses."""
    batch_size: int = 8
    """Sequences per step (the global batch; split over the replicas of a multi-rank run)."""
    seq_len: int = 256
    """Tokens per sequence."""

    @classmethod
    def for_device(cls, device: str, *, preset: str | None = None, steps: int = 8) -> CheckSettings:
        """The defaults of ``device``: ``gpt-125m`` x 256 tokens on CUDA, ``tiny`` x 32 tokens x 4 on CPU."""
        if device == "cpu":
            return cls(device=device, preset=preset or "tiny", steps=steps, batch_size=4, seq_len=32)
        return cls(device=device, preset=preset or cls.preset, steps=steps)

    @property
    def save_at(self) -> int:
        """The step after which ``mid.ckpt`` is saved (the first epoch's last) and from which :func:`resume` starts."""
        return self.steps // 2


def configure_device(device: str) -> None:
    """On CUDA, request deterministic algorithms: two fits with the same arithmetic then agree bit for bit, so the
    tolerances can stay far below the signal of a stale weight. Call before CUDA starts (child processes inherit
    the cuBLAS setting). On CPU, one intra-op thread."""
    if device != "cuda":
        # Tiny fits: threads only contend with the other processes on a shared CPU. Through the environment too, or
        # Lightning's launcher sets the count of the first strategy that is not a single device (and sums reorder).
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        return
    # cuBLAS needs a fixed workspace for that; embedding backward's atomics give way to a deterministic kernel.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


@dataclass
class Fitted:
    """What one fit measured."""

    seconds: float
    losses: list[float]
    """Loss of every optimizer step (the mean over its micro-batches when it accumulates)."""
    peaks: dict[str, list[int]]
    """Per-rank peak bytes by window (``fit``, ``save``, ``load``; see :class:`~benchmarks.gpu_check_runs.Probe`)."""
    states: dict[str, dict[str, Tensor]] = field(default_factory=dict, repr=False)
    """The weights of the checkpoints it saved, by name (``mid``, ``end``)."""


@dataclass(frozen=True, kw_only=True)
class FitPlan:
    """How one fit is run: the strategy, its precision and devices, and how each rank reads the batches."""

    strategy: Strategy | str
    precision: str
    devices: int = 1
    replicas: int = 1
    """Processes (or replica groups) that split each batch: each reads ``batch_size / replicas`` sequences."""
    accumulate: int = 1
    """One device only: micro-batches per step (Lightning's ``accumulate_grad_batches``)."""
    extra: Sequence[Callback] = ()


def _loader(settings: CheckSettings, plan: FitPlan) -> DataLoader:
    data = RandomTokenDataset(settings.batch_size * settings.save_at, settings.seq_len, seed=1)
    if plan.strategy == "auto":  # one device: the order Lightning's DistributedSampler (shuffle, seed 0) gives others
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=settings.batch_size // plan.accumulate, sampler=sampler)
    return DataLoader(data, batch_size=settings.batch_size // plan.replicas)


def _trainer(settings: CheckSettings, plan: FitPlan, directory: Path, probe: Probe) -> pl.Trainer:
    return pl.Trainer(
        accelerator="gpu" if settings.device == "cuda" else "cpu",
        devices=plan.devices,
        strategy=plan.strategy,
        precision=plan.precision,  # type: ignore[arg-type]
        max_steps=settings.steps,
        accumulate_grad_batches=plan.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DemoRecorder(), probe, *plan.extra],
        default_root_dir=directory,
        use_distributed_sampler=plan.strategy != "auto",
    )


def _module(settings: CheckSettings, seed: int) -> GPTLightningModule:
    torch.manual_seed(seed)
    return GPTLightningModule(settings.preset, block_size=settings.seq_len)


def _step_losses(losses: list[float], accumulate: int) -> list[float]:
    """Per optimizer step: Lightning records each micro-batch's loss divided by ``accumulate``; their sum is the
    step's mean loss."""
    return [sum(losses[i : i + accumulate]) for i in range(0, len(losses), accumulate)]


def fit(settings: CheckSettings, plan: FitPlan, directory: Path) -> Fitted:
    """Fit from fresh weights (seed 0); save ``directory/mid.ckpt`` and ``directory/end.ckpt``; read them back."""
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    trainer = _trainer(settings, plan, directory, Probe(directory, save_at=settings.save_at))
    with _restored_environ():  # an in-process fit at world size 1 leaves WORLD_SIZE etc.: the next spawn would refuse
        trainer.fit(_module(settings, seed=0), _loader(settings, plan))
    losses = _step_losses(read_recording(trainer).losses, plan.accumulate)
    states = read_states(directory)
    seconds = time.perf_counter() - start  # all of it, reading the checkpoints back too: the budget's unit
    return Fitted(seconds, losses, read_peaks(trainer.callback_metrics), states)


def resume(settings: CheckSettings, plan: FitPlan, checkpoint: Path, directory: Path) -> Fitted:
    """A fresh module (other initial weights: seed 1) resumed from ``checkpoint`` with the same strategy; trains the
    remaining steps and saves ``directory/end.ckpt``. Its ``load`` peak covers the set-up and the restore."""
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    trainer = _trainer(settings, plan, directory, Probe(directory, save_at=None))
    with _restored_environ():
        trainer.fit(_module(settings, seed=1), _loader(settings, plan), ckpt_path=checkpoint)
    losses = _step_losses(read_recording(trainer).losses, plan.accumulate)
    states = read_states(directory, ("end",))
    return Fitted(time.perf_counter() - start, losses, read_peaks(trainer.callback_metrics), states)


def largest_differences(ours: Fitted, reference: Fitted) -> tuple[float, float]:
    """The largest absolute difference of a step's loss, and of a weight of a checkpoint both saved."""
    steps = min(len(ours.losses), len(reference.losses))
    loss = float((torch.tensor(ours.losses[-steps:]) - torch.tensor(reference.losses[-steps:])).abs().max())
    weight = max(
        float((state[k] - reference.states[name][k]).abs().max())
        for name, state in ours.states.items()
        for k in reference.states[name]
    )
    return loss, weight


def compare(ours: Fitted, reference: Fitted, tol: Tolerance) -> tuple[float, float]:
    """Raise ``AssertionError`` where ``ours`` leaves ``tol`` of ``reference`` (the last ``len(ours.losses)`` steps'
    losses and every checkpoint both saved); return the largest differences (loss, weight)."""
    steps = len(ours.losses)
    if steps != len(reference.losses[-steps:]) or not ours.states.keys() <= reference.states.keys():
        raise AssertionError(
            f"{steps} steps and checkpoints {sorted(ours.states)} against {len(reference.losses)} steps and"
            f" {sorted(reference.states)}"
        )
    differences = largest_differences(ours, reference)
    torch.testing.assert_close(
        torch.tensor(ours.losses),
        torch.tensor(reference.losses[-steps:]),
        rtol=0,
        atol=tol.loss_atol,
        msg=lambda m: f"per-step losses: {m}",
    )
    for name, state in ours.states.items():
        for key, value in reference.states[name].items():
            torch.testing.assert_close(
                state[key],
                value,
                rtol=tol.weight_rtol,
                atol=tol.weight_atol,
                msg=lambda m, k=key, n=name: f"{n} checkpoint, {k}: {m}",
            )
    return differences
