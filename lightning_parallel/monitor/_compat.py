"""Every torch-internal name the monitor relies on, in one place for version bumps (checked with torch 2.13).

* The ``c10d`` dispatcher ops that eager ``torch.distributed`` calls go through (``ProcessGroup`` methods call them,
  so a ``TorchDispatchMode`` sees them, as torch's own ``CommDebugMode`` does): ``_allgather_base_``
  (``all_gather_single`` / ``all_gather_into_tensor``), ``_reduce_scatter_base_`` (``reduce_scatter_single`` /
  ``reduce_scatter_tensor``), ``allreduce_``.
* The module whose calls the monitor counts, by ``__name__``: FSDP2 issues its all-gathers, reduce-scatters and
  (HSDP) all-reduces from ``torch.distributed.fsdp._fully_shard``, and on gloo its gradient reductions through
  ``lightning_parallel.distributed.zero.stage3_gloo`` (``set_custom_reduce_scatter``). The issuer of an op is the
  innermost Python frame outside ``torch.distributed``'s front end (``distributed_c10d``, ``c10d_logger``, the
  ``torch._dynamo`` wrappers that disable compilation of its functions) and outside dispatch machinery
  (``torch._ops``, dispatch modes).
* Tensor parallelism's collectives: ``DTensor`` redistributes through the functional collectives
  (``torch.distributed._functional_collectives``, ops ``_c10d_functional.all_reduce`` /
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor``), not through the ``c10d`` ops above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "COUNTED_OPS",
    "FSDP_ISSUERS",
    "TENSOR_PARALLEL_ISSUERS",
    "TENSOR_PARALLEL_OPS",
    "TRANSPARENT_MODULES",
    "TRANSPARENT_PREFIX",
]


def _first(args: tuple[Any, ...]) -> list[Tensor]:
    return [args[0]]


def _second(args: tuple[Any, ...]) -> list[Tensor]:
    return [args[1]]


def _listed(args: tuple[Any, ...]) -> list[Tensor]:
    return list(args[0])


_c10d = torch.ops.c10d
COUNTED_OPS: dict[Any, tuple[str, Callable[[tuple[Any, ...]], list[Tensor]]]] = {
    # op: (our collective name, the tensors whose bytes count, per the ledger's definition)
    _c10d._allgather_base_.default: ("all_gather", _first),  # (output, input, ...): the gathered output
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", _second),  # (output, input, ...): the unsharded input
    _c10d.allreduce_.default: ("all_reduce", _listed),  # (tensors, ...)
}


def _gathered(args: tuple[Any, ...]) -> int:
    return int(args[0].numel() * args[0].element_size() * args[1])  # (input, group_size, group_name): the output


def _bytes_of_first(args: tuple[Any, ...]) -> int:
    return int(args[0].numel() * args[0].element_size())


_functional = torch.ops._c10d_functional
TENSOR_PARALLEL_OPS: dict[Any, tuple[str, Callable[[tuple[Any, ...]], int]]] = {
    # op: (our collective name, its bytes per the ledger's definition)
    _functional.all_reduce.default: ("all_reduce", _bytes_of_first),  # (input, op, group_name)
    _functional.all_gather_into_tensor.default: ("all_gather", _gathered),
    _functional.reduce_scatter_tensor.default: ("reduce_scatter", _bytes_of_first),  # (input, op, size, name)
}
TENSOR_PARALLEL_ISSUERS: tuple[str, ...] = ("torch.distributed._functional_collectives",)
"""Where ``DTensor``'s redistributions (tensor parallelism inside and around the split layers) issue their ops."""

FSDP_ISSUERS: tuple[str, ...] = (
    "torch.distributed.fsdp._fully_shard.",
    "torch.distributed._composable.fsdp.",
    "lightning_parallel.distributed.zero.stage3_gloo",
)
"""FSDP2's package (torch >= 2.6), where it lived before, and ZeRO-3's reductions that FSDP2 calls on gloo."""
TRANSPARENT_MODULES = frozenset(
    {"torch.distributed.distributed_c10d", "torch.distributed.c10d_logger", "torch.utils._python_dispatch"}
)
TRANSPARENT_PREFIX = "torch._"  # torch._ops (OpOverload.__call__), torch._dynamo (the front end's disable wrappers)
