"""Gradient compression for ``DistributedDataParallel`` that works on every backend, gloo included.

Torch ships DDP communication hooks for fp16, bf16 and PowerSGD, but two of them fail on CPU/gloo:

* ``bf16_compress_hook`` is refused by DDP by name unless the backend is NCCL/XCCL, although gloo
  reduces bfloat16 fine since torch 2.x. :func:`low_precision_allreduce_hook` is the same algorithm
  under our own name, so it runs wherever the backend can reduce the dtype (checked up front by
  :func:`check_backend_supports_dtype`).
* ``powerSGD_hook`` issues its all-reduces from future callbacks. With several DDP buckets on gloo the
  callbacks of different buckets interleave differently on each rank, so ranks all-reduce tensors of
  different sizes and gloo aborts the process in C++. :class:`SerializedPowerSGD` waits for each
  bucket's PowerSGD exchange to finish before handing the bucket back, which makes the collective
  order identical on every rank (measured: multi-bucket PowerSGD on gloo runs instead of SIGABRT).

Every hook here counts the bytes it hands to collectives in a
:class:`~lightning_parallel.accounting.CommunicationStats`, so the benchmark and the monitor report measured
traffic, not arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_parallel.accounting import CommunicationStats  # re-exported: the hooks' counter
from lightning_parallel.choices import check_choice, choices_of

__all__ = [
    "COMPRESSION_CHOICES",
    "CommunicationStats",
    "GradientCompression",
    "SerializedPowerSGD",
    "check_backend_supports_dtype",
    "low_precision_allreduce_hook",
    "validate_compression",
]

GradientCompression = Literal["fp16", "bf16", "powersgd"]
COMPRESSION_CHOICES: tuple[str, ...] = choices_of(GradientCompression)

_COMPRESSION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

DDPCommHook = Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def validate_compression(compression: str | None, *, powersgd_rank: int, powersgd_start_iter: int) -> None:
    """Raise ``ValueError`` for an unknown compression name or bad PowerSGD options (no collective involved)."""
    check_choice(
        "gradient_compression",
        compression,
        None | GradientCompression,  # None listed first
        unknown=True,
    )
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        raise ValueError(
            f"`powersgd_rank={powersgd_rank!r}` is invalid: the PowerSGD approximation rank must be an integer >= 1"
            " (1-4 is typical; higher ranks compress less)."
        )
    if isinstance(powersgd_start_iter, bool) or not isinstance(powersgd_start_iter, int) or powersgd_start_iter < 2:
        raise ValueError(
            f"`powersgd_start_iter={powersgd_start_iter!r}` is invalid: it must be an integer >= 2 because PowerSGD"
            " with error feedback needs at least one uncompressed all-reduce first (torch's PowerSGDState rule)."
        )


def compression_dtype(compression: str) -> torch.dtype | None:
    """The dtype a compression name casts gradients to, or ``None`` for PowerSGD."""
    return _COMPRESSION_DTYPES.get(compression)


def check_backend_supports_dtype(dtype: torch.dtype, *, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce a one-element tensor of ``dtype`` and turn a backend refusal into a clear ``ValueError``.

    Every rank runs the same probe on the same backend, so either every rank passes or every rank raises
    (a backend rejects a dtype locally, before any byte is exchanged).
    """
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    probe = torch.ones(1, dtype=dtype, device=device)
    try:
        dist.all_reduce(probe, group=group)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"Gradient compression to {dtype} is not supported by the {dist.get_backend(group)!r} backend"
            f" ({error}). Use `gradient_compression='fp16'` or 'powersgd', or None."
        ) from error


def low_precision_allreduce_hook(
    dtype: torch.dtype | None, stats: CommunicationStats
) -> Callable[[dist.ProcessGroup | None, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """A DDP hook that all-reduces each bucket in ``dtype`` (``None``: the gradients' own dtype) and counts bytes.

    Gradients are pre-divided by the world size before the cast (as torch's fp16 hook does) so the sum stays in
    the low-precision range, then copied back into the fp32 bucket in place, so no second full-size fp32 buffer
    exists at any moment.
    """

    # No annotations on the hook itself: DDP compares them with the real `dist.GradBucket` object, and
    # `from __future__ import annotations` turns them into strings it rejects.
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # DDP runs only inside an initialised process group
        buffer = bucket.buffer()
        compressed = buffer.to(dtype) if dtype is not None else buffer
        compressed.div_(group.size())
        stats.record("all_reduce", compressed.numel() * compressed.element_size())
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    hook.__name__ = f"low_precision_allreduce_hook_{dtype}"
    return hook


class SerializedPowerSGD:
    """Torch's PowerSGD hook, made safe on gloo by finishing each bucket's exchange before returning.

    On NCCL the stock hook is used unchanged (``serialize=False``): its callbacks run in stream order there.

    Args:
        process_group: group to reduce over (``None``: the default group).
        rank: the PowerSGD matrix approximation rank.
        start_iter: DDP iterations of plain all-reduce before compression starts (error feedback needs >= 2).
        stats: where to count bytes.
        serialize: wait for each bucket's exchange inside the hook (needed on gloo).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        *,
        rank: int,
        start_iter: int,
        stats: CommunicationStats,
        serialize: bool,
    ) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
        )
        self.stats = stats
        self.serialize = serialize
        self.__name__ = self.__qualname__ = "serialized_powersgd_hook"  # DDP logs the hook by name

    def __call__(self, state, bucket):  # unannotated: see low_precision_allreduce_hook
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        numel_before = self.state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(self.state, bucket)
        if not self.serialize:
            self._count(bucket, compressing, numel_before)
            return future
        value = future.wait()
        self._count(bucket, compressing, numel_before)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(value)
        return done

    def _count(self, bucket: dist.GradBucket, compressing: bool, numel_before: int) -> None:
        buffer = bucket.buffer()
        if compressing:
            # PowerSGD counts the elements it exchanges (P, Q and the uncompressed 1-D tensors) in its state.
            numel = self.state.total_numel_after_compression - numel_before
            self.stats.record("all_reduce", numel * buffer.element_size())
        else:
            self.stats.record("all_reduce", buffer.numel() * buffer.element_size())
