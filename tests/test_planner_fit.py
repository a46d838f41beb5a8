"""``largest_fitting``: the largest model of a family per strategy for a device memory (issue 12, item 5)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_parallel.demos.gpt import GPTConfig
from lightning_parallel.planner import plan
from lightning_parallel.planner.fit import largest_fitting

WORLD_SIZE = 2
OPTIONS = {"batch_size": 2, "seq_len": 16}


def _total(config: GPTConfig, name: str, n_layer: int) -> int:
    result = plan(dataclasses.replace(config, n_layer=n_layer), world_size=WORLD_SIZE, **OPTIONS)
    return result.configuration(name).max_total


def test_each_answer_fits_and_one_more_layer_does_not() -> None:
    config = GPTConfig.from_preset("tiny")
    memory = _total(config, "zero2", 6)  # zero2 fits 6 layers exactly
    answers = {a.configuration: a for a in largest_fitting(config, device_memory=memory, world_size=WORLD_SIZE,
                                                            max_value=64, **OPTIONS)}  # fmt: skip
    assert answers["zero2"].value == 6
    for name, answer in answers.items():
        assert answer.value is not None, name
        assert answer.total_bytes == _total(config, name, answer.value) <= memory, name
        if answer.value < 64:
            assert _total(config, name, answer.value + 1) > memory, name
    # More sharding, a larger model: data parallel <= zero1 <= zero2 <= zero3.
    values = [answers[name].value for name in ("data_parallel", "zero1", "zero2", "zero3")]
    assert values == sorted(values) and values[0] < values[-1], values
    assert answers["zero3"].strategy == '"zero3"'


def test_nothing_fits_a_tiny_device_and_bad_arguments_are_named() -> None:
    config = GPTConfig.from_preset("tiny")
    answers = largest_fitting(config, device_memory=1024, world_size=WORLD_SIZE, max_value=8, **OPTIONS)
    assert all(a.value is None and a.num_parameters is None for a in answers)
    with pytest.raises(TypeError, match="scale_field='dropout'"):
        largest_fitting(config, device_memory=2**30, world_size=WORLD_SIZE, scale_field="dropout")
    with pytest.raises(TypeError, match="model config dataclass"):
        largest_fitting("tiny", device_memory=2**30, world_size=WORLD_SIZE)
    with pytest.raises(ValueError, match="device_memory=0"):
        largest_fitting(config, device_memory=0, world_size=WORLD_SIZE)
