"""Splitting a batch into micro-batches along dim 0, and padding evaluation batches to a divisible size.

Batches are walked with ``apply_to_collection`` from ``lightning_utilities`` (Lightning's own tree walker; a small
torch-free package, not ``lightning.pytorch``): tuples, lists, namedtuples, mappings and dataclasses keep their type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = [
    "DivisibleBatches",
    "ForwardsLoaderState",
    "StatefulDivisibleBatches",
    "batch_size_of",
    "check_batch_rows",
    "check_divisible_batch",
    "detached_cpu",
    "divisible_batches",
    "pad_batch",
    "saves_state",
    "slice_batch",
]


def _tensors(value: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(value, Tensor, found.append, allow_frozen=True)
    return found


def batch_size_of(value: Any) -> int | None:
    """Size of dim 0 of the first tensor in ``value`` (a tensor or a collection of them); ``None`` if none."""
    for tensor in _tensors(value):
        if tensor.dim() > 0:
            return tensor.size(0)
    return None


def check_divisible_batch(size: int, num_microbatches: int) -> None:
    """Raise ``ValueError`` for a training batch of ``size`` rows that does not split into equal micro-batches."""
    if size % num_microbatches:
        raise ValueError(
            f"The training batch size {size} is not divisible by `num_microbatches={num_microbatches}`; the pipeline"
            f" splits every batch into equal micro-batches. Use a batch size that is a multiple of {num_microbatches}"
            " or another `num_microbatches`."
        )


def check_batch_rows(batch: Any, size: int, *, step: str) -> None:
    """Raise ``ValueError`` naming the first tensor of ``batch`` (the step's batch) whose dim 0 is not ``size`` (the
    rows of the model's input).

    The pipeline cuts the model's input and the step's batch into micro-batches alike, rows ``i * size / m`` on: the
    last stage's run of the step on micro-batch ``i`` must see the rows that made the input of micro-batch ``i``. A
    tensor with other rows would be cut at the wrong rows, silently (a step that concatenates the batches of several
    training loaders: the first micro-batch would be the first loader's whole batch against both loaders' targets).
    """
    for path, tensor in _named_tensors(batch, "batch"):
        if tensor.dim() > 0 and tensor.size(0) != size:
            raise ValueError(
                f"`{step}`'s `{path}` has {tensor.size(0)} rows along dim 0, the input it passes to `self(...)` has"
                f" {size}. The pipeline cuts the batch and the model's input into micro-batches row by row, so the"
                " rows of every batch tensor must be the input's rows. A step that concatenates the batches of"
                " several loaders (`torch.cat([batch['a'], batch['b']])`) cannot be cut that way: train from one"
                " loader whose batches hold every sample the step feeds to the model (e.g. one dataset over both),"
                " or take the tensor out of the batch (a module attribute) if it is not per-sample."
            )


def _named_tensors(value: Any, path: str) -> Iterator[tuple[str, Tensor]]:
    """Every tensor in ``value`` with its path from ``path`` (``batch['a'][0]``), in ``apply_to_collection``'s
    order."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _named_tensors(item, f"{path}[{key!r}]")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        for field in value._fields:
            yield from _named_tensors(getattr(value, field), f"{path}.{field}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _named_tensors(item, f"{path}[{index}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _named_tensors(getattr(value, field.name), f"{path}.{field.name}")


def pad_batch(value: Any, size: int) -> Any:
    """Pad every tensor of ``value`` along dim 0 to ``size`` rows by repeating its last row."""

    def pad(tensor: Tensor) -> Tensor:
        missing = size - tensor.size(0) if tensor.dim() > 0 else 0
        if missing <= 0:
            return tensor
        return torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])])

    return apply_to_collection(value, Tensor, pad)


def slice_batch(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (dim 0) of every tensor of ``value``; other values unchanged."""
    return apply_to_collection(value, Tensor, lambda t: t[start:stop] if t.dim() > 0 else t)


def detached_cpu(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (results and states sent between ranks or saved)."""
    return apply_to_collection(value, Tensor, lambda t: t.detach().cpu())


class DivisibleBatches:
    """A training loader that leaves out batches whose size is not a multiple of ``num_microbatches``.

    Only a loader's last batch can be smaller; a pipeline cannot split it into equal micro-batches, and torch's
    stages need equal ones. ``__len__`` subtracts it when the loader's sampler and batch size tell in advance, so
    Lightning's epoch length and ``global_step`` count only the batches that train. Attributes (``sampler``,
    ``batch_size``, ...) are the wrapped loader's, so Lightning still sets the sampler's epoch.

    Args:
        loader: The training loader (after Lightning inserted its distributed sampler).
        num_microbatches: Micro-batches per batch.
        on_skip: Called with the size of every left-out batch (a warning).
    """

    def __init__(self, loader: Any, num_microbatches: int, on_skip: Callable[[int], None]) -> None:
        self.loader = loader
        self.num_microbatches = num_microbatches
        self.on_skip = on_skip

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            size = batch_size_of(batch)
            if size is not None and size % self.num_microbatches:
                self.on_skip(size)
                continue
            yield batch

    @property
    def known_partial_batch(self) -> int | None:
        """Size of the last batch if the loader's sampler and batch size show it will be left out, else ``None``."""
        batch_size = getattr(self.loader, "batch_size", None)
        sampler = getattr(self.loader, "sampler", None)
        if not batch_size or getattr(self.loader, "drop_last", False) or not isinstance(sampler, Sized):
            return None
        tail = len(sampler) % batch_size
        return tail if tail % self.num_microbatches else None

    def __len__(self) -> int:
        return len(self.loader) - (1 if self.known_partial_batch is not None else 0)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class ForwardsLoaderState:
    """``state_dict`` / ``load_state_dict`` of the wrapped ``self.loader``, for wrappers of a loader that saves its
    position (LitData's ``StreamingDataLoader``, torchdata's ``StatefulDataLoader``): Lightning saves and restores a
    loader's position where it has both methods, and from Python 3.12 ``isinstance`` looks them up on the class,
    not through a wrapper's ``__getattr__``."""

    loader: Any

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


def saves_state(loader: Any) -> bool:
    """Whether ``loader`` has ``state_dict`` and ``load_state_dict`` (Lightning's ``_Stateful`` protocol)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class StatefulDivisibleBatches(ForwardsLoaderState, DivisibleBatches):
    """:class:`DivisibleBatches` of a loader that saves its position."""


def divisible_batches(loader: Any, num_microbatches: int, on_skip: Callable[[int], None]) -> DivisibleBatches:
    """``loader`` wrapped in :class:`DivisibleBatches`, or :class:`StatefulDivisibleBatches` where it saves its
    state."""
    return (StatefulDivisibleBatches if saves_state(loader) else DivisibleBatches)(loader, num_microbatches, on_skip)
