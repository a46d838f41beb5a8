"""The pipeline walks batches and model inputs with Lightning's ``apply_to_collection``: namedtuples, mappings and
dataclasses are looked into, as Lightning's own batch transfer does (the former hand-written walkers saw only
tuples, lists and dicts, so a dataclass of tensors had no batch size and no shape in a runtime's key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_parallel.distributed.pipeline.engine import _signature
from lightning_parallel.distributed.pipeline.microbatch import batch_size_of, slice_batch


class Pair(NamedTuple):
    scalar: torch.Tensor
    rows: torch.Tensor


@dataclass
class Inputs:
    tokens: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class FrozenInputs:
    tokens: torch.Tensor


def test_batch_size_of_any_collection() -> None:
    assert batch_size_of(Pair(torch.tensor(1.0), torch.zeros(5, 2))) == 5
    assert batch_size_of({"a": [torch.tensor(2), (torch.zeros(3),)]}) == 3
    assert batch_size_of(Inputs(torch.zeros(4, 2))) == 4
    assert batch_size_of(FrozenInputs(torch.zeros(6))) == 6
    assert batch_size_of(("text", 3)) is None


def test_slicing_keeps_namedtuples_and_dataclasses() -> None:
    sliced = slice_batch(Pair(torch.tensor(1.0), torch.arange(6)), 2, 4)
    assert isinstance(sliced, Pair)
    torch.testing.assert_close(sliced.rows, torch.tensor([2, 3]))
    inputs = slice_batch(Inputs(torch.arange(6).view(3, 2), torch.ones(3)), 1, 3)
    assert isinstance(inputs, Inputs) and inputs.tokens.shape == (2, 2) and inputs.mask.shape == (2,)


def test_a_runtime_key_sees_shapes_inside_any_collection() -> None:
    assert _signature(Inputs(torch.zeros(4, 2))) != _signature(Inputs(torch.zeros(3, 2)))
    assert _signature(Inputs(torch.zeros(4, 2))) == _signature(Inputs(torch.ones(4, 2)))
    assert _signature(Pair(torch.tensor(1.0), torch.zeros(4))) != _signature(Pair(torch.tensor(1), torch.zeros(4)))
    assert _signature((torch.zeros(2), {"m": torch.zeros(2, 3)})) == (((2,), torch.float32), ((2, 3), torch.float32))
