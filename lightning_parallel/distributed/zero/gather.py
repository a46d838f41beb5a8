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

**User code between the step and the next forward** (Lightning's ``on_train_batch_end``, ``on_train_batch_start``,
an EMA callback, logging, the start of ``training_step``, manual optimization after ``opt.step()``) may read any
parameter while its all-gather is still in flight. A stale read is made impossible, not unlikely: from the launch
until the first block's forward (or until nothing is pending) a ``TorchFunctionMode``, the *guard*, sees every torch
function and tensor method called from Python, and before one whose tensor arguments share storage with a pending
bucket (a parameter, ``param.data``, a ``state_dict()`` entry, a view of the flat buffer, the optimizer's shard
views) it waits for that bucket. Reads under ``torch.no_grad()``, in-place writes (``p.clamp_()``), ``.tolist()``,
``.numpy()``, ``copy.deepcopy`` and ``torch.save`` all go through such a function. Functions that read only metadata
(``shape``, ``dtype``, ``requires_grad``, ``grad``, ``numel()``, hashing) do not wait, so a callback that reads no
parameter (a timer, a logger) leaves the all-gather in flight. At the first block's forward the guard waits for the
rest (manual optimization may run a forward right after ``opt.step()``) and leaves: inside forward and backward it
costs nothing. What it cannot see: memory aliased *before* the step outside torch (a NumPy array made from a
parameter earlier and read afterwards), and reads from other threads (the mode is per thread).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_parallel.distributed.blocks import find_blocks
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.stage3_compat import current_function_mode

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
        self._index_of_storage = {
            bucket.flat_params.untyped_storage().data_ptr(): i for i, bucket in enumerate(buckets.buckets)
        }
        self._guard = _StaleReadGuard(self)
        self._guard_pushed = False  # on this thread's torch function mode stack (maybe below a user's mode)
        self.guarding = False
        """Whether the guard waits for the buckets user code touches (from :meth:`launch` to the first block's
        forward, or until nothing is pending)."""
        self.num_guarded_waits = 0
        """Buckets the guard had to wait for because user code touched them while their all-gather was in flight
        (0 when the code between steps reads no parameter: the all-gather stayed overlapped)."""
        self._hooks: list[RemovableHandle] = [
            block.register_forward_pre_hook(lambda _module, _args, indices=indices: self._before_block(indices))
            for block, indices in zip(blocks, self.block_buckets, strict=True)
        ]

    @property
    def is_pending(self) -> bool:
        """Whether some launched all-gather has not been waited for."""
        return bool(self._pending)

    def _before_block(self, indices: list[int]) -> None:
        """A block's forward pre-hook: the forward has begun, so the rest must be current and the guard may leave;
        then wait for this block's buckets."""
        if self.guarding or self._guard_pushed:
            self.wait(self.rest)  # already done before a training step; not after `opt.step()` in manual optimization
            self._stop_guarding()
        self.wait(indices)

    def launch(self, indices: Iterable[int]) -> None:
        """Collective (asynchronous). All-gather buckets ``indices`` (the stepped optimizer's), in :attr:`launch_order`.
        Each must be waited for (:meth:`wait`, :meth:`wait_for_rest`, :meth:`wait_all`) before the next step."""
        wanted = set(indices)
        for index in self.launch_order:
            if index in wanted:
                if index in self._pending:  # stepped twice without a forward in between: the older one first
                    self._pending.pop(index).wait()
                self._pending[index] = self.buckets.launch_parameter_gather(index)
        if self._pending:
            self._start_guarding()

    def wait(self, indices: Iterable[int]) -> None:
        """Local. Wait for the pending all-gathers of buckets ``indices`` (no-op for those already complete)."""
        works = [self._pending.pop(index) for index in indices if index in self._pending] if self._pending else []
        if works:
            with self.waiting():
                for work in works:
                    work.wait()
        if not self._pending and (self.guarding or self._guard_pushed):
            self._stop_guarding()

    @contextmanager
    def reading_metadata_only(self) -> Generator[None, None, None]:
        """Local. The guard lets everything pass inside: for our own code that reads only storages' sizes (a memory
        report between steps), which ``untyped_storage()`` would otherwise make wait."""
        guarding, self.guarding = self.guarding, False
        try:
            yield
        finally:
            self.guarding = guarding and bool(self._pending)

    def wait_for_tensors(self, tensors: Iterable[Any]) -> None:
        """Local. Wait for the pending buckets whose flat buffer any of ``tensors`` (nested in lists, tuples and
        dicts) is or views; the guard calls it before a torch function runs on them."""
        touched: set[int] = set()
        _collect_storages(tensors, touched)
        indices = [self._index_of_storage[ptr] for ptr in touched if ptr in self._index_of_storage]
        pending = [index for index in indices if index in self._pending]
        if pending:
            self.num_guarded_waits += len(pending)
            self.wait(pending)

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
        self._stop_guarding()

    def remove_hooks(self) -> None:
        """Local. Wait for what is pending and stop hooking the blocks."""
        self.wait_all()
        self._stop_guarding()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _start_guarding(self) -> None:
        self.guarding = True
        if not self._guard_pushed:
            self._guard.__enter__()
            self._guard_pushed = True

    def _stop_guarding(self) -> None:
        """Stop waiting on reads; leave the mode stack if the guard is innermost. Under a mode the user entered
        since (``with torch.device(...)`` around the forward), or while the guard itself runs (torch takes a mode off
        the stack during its ``__torch_function__``), it stays as a pass-through until a later wait or block finds it
        innermost."""
        self.guarding = False
        if self._guard_pushed and current_function_mode() is self._guard:
            self._guard.__exit__(None, None, None)
            self._guard_pushed = False


class _StaleReadGuard(TorchFunctionMode):
    """Before any torch function whose tensor arguments share storage with a bucket whose all-gather is in flight,
    waits for that bucket (see the module docstring). Only metadata reads pass without waiting."""

    def __init__(self, gather: OverlappedParameterGather) -> None:
        super().__init__()
        self.gather = gather

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Inside this method the mode is off: the storage lookups below and `func` itself are not seen again.
        if self.gather.guarding and func not in _READS_NO_VALUES:
            self.gather.wait_for_tensors((args, kwargs))
        return func(*args, **kwargs)


def _collect_storages(values: Any, found: set[int]) -> None:
    """Add the storage address of every tensor in ``values`` (nested lists, tuples, dicts) to ``found``."""
    if isinstance(values, DTensor):  # a split weight (tensor parallelism): its local tensor is a bucket view
        values = values.to_local()
    if isinstance(values, Tensor):
        try:
            found.add(values.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage (sparse, a wrapper subclass): not a bucket view
            pass
    elif isinstance(values, list | tuple):
        for value in values:
            _collect_storages(value, found)
    elif isinstance(values, dict):
        for value in values.values():
            _collect_storages(value, found)


_METADATA = ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "layout", "ndim", "grad_fn")
_READS_NO_VALUES: frozenset[Any] = frozenset(
    [getattr(Tensor, name).__get__ for name in _METADATA]
    + [
        getattr(getattr(Tensor, name), method)
        for name in ("requires_grad", "grad")
        for method in ("__set__", "__delete__")
    ]
    + [Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.element_size, Tensor.stride]
    + [Tensor.is_floating_point, Tensor.is_complex, Tensor.requires_grad_, Tensor.__hash__, Tensor.data_ptr]
)
"""Torch functions that read or set a tensor's metadata only (or its ``.grad``, a separate tensor): no wait."""


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
