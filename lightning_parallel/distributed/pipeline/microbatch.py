"""Splitting a batch into micro-batches along dim 0, and padding evaluation batches to a divisible size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["batch_size_of", "pad_batch", "split_batch"]


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def batch_size_of(value: Any) -> int | None:
    """Size of dim 0 of the first tensor in ``value`` (a tensor or nested tuples/lists/dicts); ``None`` if none."""
    for tensor in _tensors(value):
        if tensor.dim() > 0:
            return tensor.size(0)
    return None


def split_batch(value: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of ``value`` into ``num_microbatches`` equal chunks along dim 0; other values repeat.

    The caller checks divisibility; chunks are views (``torch.tensor_split``, as torch's pipelining splits inputs).
    """
    if isinstance(value, Tensor) and value.dim() > 0:
        return list(torch.tensor_split(value, num_microbatches))
    if isinstance(value, tuple | list):
        parts = [split_batch(v, num_microbatches) for v in value]
        chunks = [[p[i] for p in parts] for i in range(num_microbatches)]
        if hasattr(value, "_fields"):  # namedtuple
            return [type(value)(*chunk) for chunk in chunks]
        return [type(value)(chunk) for chunk in chunks]
    if isinstance(value, Mapping):
        parts_by_key = {k: split_batch(v, num_microbatches) for k, v in value.items()}
        return [{k: parts[i] for k, parts in parts_by_key.items()} for i in range(num_microbatches)]
    return [value] * num_microbatches


def pad_batch(value: Any, size: int) -> Any:
    """Pad every tensor of ``value`` along dim 0 to ``size`` rows by repeating its last row."""
    if isinstance(value, Tensor) and value.dim() > 0:
        missing = size - value.size(0)
        if missing <= 0:
            return value
        return torch.cat([value, value[-1:].expand(missing, *value.shape[1:])])
    if isinstance(value, tuple | list):
        padded = [pad_batch(v, size) for v in value]
        return type(value)(*padded) if hasattr(value, "_fields") else type(value)(padded)
    if isinstance(value, Mapping):
        return {k: pad_batch(v, size) for k, v in value.items()}
    return value
