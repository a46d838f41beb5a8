"""Overlap ZeRO-1/2's parameter all-gather after the optimizer step with the next forward pass.

After the sharded step every rank must receive the other ranks' updated shards before it reads those parameters
again. Waiting for all of them at the end of the step leaves the whole all-gather exposed (DDP has no such cost: its
all-reduce hides behind backward). Megatron's distributed optimizer (``overlap_param_gather``) launches every bucket's
all-gather after the step and waits for each in a forward pre-hook of the modules that use it. We do the same with a
granularity that stays correct for real models:

* A **block** (a transformer layer, found as ZeRO-3 finds its units, ``blocks.find_blocks``) waits, in its forward
  pre-hook, for the buckets holding any parameter of the whole block. A block may read its submodules' parameters
  without calling them (``nn.MultiheadAttention`` reads ``out_proj.weight`` functionally; a mixture of experts stacks
  its experts' weights), so waiting for the block's own direct parameters only, as Megatron does per module, would
  let such a model read stale values silently.
* Every **other bucket** (embeddings, the final norm, the head, and any bucket shared with them) is waited for before
  the training step starts (:meth:`wait_for_rest`), so code outside the blocks reads whole, current parameters.
* The buckets are launched in the order they are first needed (the rest, then block by block in forward order), so
  the all-gathers for block ``k`` run while blocks ``< k`` compute; a process group completes its collectives in
  launch order.

What is left exposed is waited for before anything else reads parameters (:meth:`wait_all`: the next backward's
gradient sync, checkpoints, evaluation, the end of fit). A model without repeated blocks gains nothing and loses
nothing: all its buckets are "the rest", and so are a compiled model's (a hook inside a compiled region would
break its graph).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_parallel.distributed.blocks import find_blocks
from lightning_parallel.distributed.zero import ShardedParameterBuckets

__all__ = ["OverlappedParameterGather"]


class OverlappedParameterGather:
    """Launches ZeRO-1/2 parameter all-gathers after a step and waits for each bucket where it is first needed.

    Args:
        buckets: the flat buckets of ``module``.
        module: the model; forward pre-hooks are registered on its repeated blocks (removed by :meth:`remove_hooks`).
        waiting: a context entered around every wait that blocks (a strategy times exposed communication with it).
    """

    def __init__(
        self,
        buckets: ShardedParameterBuckets,
        module: nn.Module,
        *,
        waiting: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.buckets = buckets
        self.waiting = waiting
        bucket_of = {id(segment.param): index for index, b in enumerate(buckets.buckets) for segment in b.segments}
        blocks = [block for block in find_blocks(module) if not _shares_parameters(module, block)]
        if any(_is_compiled(m) for m in module.modules()):
            blocks = []  # a hook inside a compiled region would break its graph: wait for everything up front
        in_blocks: set[int] = set()
        self.block_buckets: list[list[int]] = []
        """For each block, in forward (registration) order: the buckets holding its parameters."""
        for block in blocks:
            ids = {id(p) for p in block.parameters()} & bucket_of.keys()
            in_blocks |= ids
            self.block_buckets.append(sorted({bucket_of[i] for i in ids}))
        self.rest: list[int] = sorted({index for i, index in bucket_of.items() if i not in in_blocks})
        """Buckets with a parameter outside every block: waited for before the training step."""
        first_needed: dict[int, int] = {index: -1 for index in self.rest}
        for position, indices in enumerate(self.block_buckets):
            for index in indices:
                first_needed.setdefault(index, position)
        # Bucket indices run in reverse registration order: a higher index is used earlier in forward.
        self.launch_order: list[int] = sorted(first_needed, key=lambda index: (first_needed[index], -index))
        """Every bucket, in the order it is first needed."""
        self._pending: dict[int, dist.Work] = {}
        self._hooks: list[RemovableHandle] = [
            block.register_forward_pre_hook(lambda _module, _args, indices=indices: self.wait(indices))
            for block, indices in zip(blocks, self.block_buckets, strict=True)
        ]

    @property
    def is_pending(self) -> bool:
        """Whether some launched all-gather has not been waited for."""
        return bool(self._pending)

    def launch(self, indices: Iterable[int]) -> None:
        """Collective (asynchronous). All-gather buckets ``indices`` (the stepped optimizer's), in :attr:`launch_order`.
        Each must be waited for (:meth:`wait`, :meth:`wait_for_rest`, :meth:`wait_all`) before the next step."""
        wanted = set(indices)
        for index in self.launch_order:
            if index in wanted:
                if index in self._pending:  # stepped twice without a forward in between: the older one first
                    self._pending.pop(index).wait()
                self._pending[index] = self.buckets.launch_parameter_gather(index)

    def wait(self, indices: Iterable[int]) -> None:
        """Local. Wait for the pending all-gathers of buckets ``indices`` (no-op for those already complete)."""
        works = [self._pending.pop(index) for index in indices if index in self._pending] if self._pending else []
        if works:
            with self.waiting():
                for work in works:
                    work.wait()

    def wait_for_rest(self) -> None:
        """Local. Wait for every bucket holding a parameter outside the repeated blocks (before the training step)."""
        self.wait(self.rest)

    def wait_all(self) -> None:
        """Local. Wait for every pending all-gather: all parameters are current afterwards."""
        self.wait(list(self._pending))

    def discard(self) -> None:
        """Local. Forget the pending all-gathers without waiting (training failed: a dead peer never completes them;
        the parameters outside this rank's shards may be stale)."""
        self._pending.clear()

    def remove_hooks(self) -> None:
        """Local. Wait for what is pending and stop hooking the blocks."""
        self.wait_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs through ``torch.compile`` (``nn.Module.compile()`` or a ``torch.compile`` wrapper)."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def _shares_parameters(root: nn.Module, block: nn.Module) -> bool:
    """Whether a parameter of ``block`` is also registered outside it (a tie): then it is read outside the block."""
    inside = {id(p) for p in block.parameters()}
    prefix = next(name for name, m in root.named_modules() if m is block) + "."
    return any(
        id(param) in inside and not name.startswith(prefix)
        for name, param in root.named_parameters(remove_duplicate=False)
    )
