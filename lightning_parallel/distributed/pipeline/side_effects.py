"""Running a module without leaving a trace: buffers and random number streams come back as they were.

Two runs happen outside training and must not change what training computes: the check that ``pipeline_layers()``
composes to ``forward`` (:mod:`.verify`), and torch's metadata inference, which runs each stage's forward once on
micro-batch 0 (the first stage) or on uninitialised tensors (the others) before the first real micro-batch. In
training mode a BatchNorm layer would fold those runs into its running statistics (``num_batches_tracked`` one too
high, and statistics of garbage on the later stages), and dropout would draw from the RNG stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["preserved_state"]


@contextmanager
def preserved_state(module: nn.Module, *, devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Restore ``module``'s buffers and the CPU (and given CUDA devices') RNG states when the block exits.

    A buffer that changed is replaced by its saved copy (the same name, a new tensor), never written in place, so
    a graph the block built (torch's inference runs backward next) still finds the tensors it saved. The RNG states
    are saved and restored by hand: ``torch.random.fork_rng`` asks for the current accelerator, which would initialise
    CUDA in a CPU process (and a process that did so can no longer fork CUDA-using children).
    """
    saved = {name: (buffer, buffer.detach().clone()) for name, buffer in module.named_buffers()}
    cpu_state = torch.get_rng_state()
    cuda_states = [(d, torch.cuda.get_rng_state(d)) for d in set(devices) if d.type == "cuda"]
    try:
        yield
    finally:
        _restore_buffers(module, saved)
        torch.set_rng_state(cpu_state)
        for device, state in cuda_states:
            torch.cuda.set_rng_state(state, device)


def _restore_buffers(module: nn.Module, saved: dict[str, tuple[Tensor, Tensor]]) -> None:
    for name, (original, copy) in saved.items():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix)
        current = getattr(owner, leaf, None)
        if current is original and _same(current, copy):
            continue
        # The saved copy takes the buffer's place (no in-place write): autograd may still hold the changed tensor
        # (BatchNorm saves its running statistics for backward, and torch's inference runs backward next).
        setattr(owner, leaf, copy)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
