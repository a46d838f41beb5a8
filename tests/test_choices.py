"""One choice validator (``lightning_parallel.choices``) and the frozen ``ZeroConfig`` the ZeRO backends are built from.

Unit tier: one process, no process group.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Literal

import pytest

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.choices import check_choice, choices_of
from lightning_parallel.distributed.compression import COMPRESSION_CHOICES, validate_compression
from lightning_parallel.distributed.zero.backends import (
    FlatBucketBackend,
    FullyShardBackend,
    MasterWeightBackend,
    ReplicatedBackend,
    ZeroContext,
)
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.strategies.launch import validate_start_method
from lightning_parallel.strategies.nonfinite import validate_nonfinite


def test_choices_of_reads_literals_bools_and_none_in_order() -> None:
    assert choices_of(Literal["a", "b"] | None) == ("a", "b", None)
    assert choices_of(None | Literal["a"]) == (None, "a")
    assert choices_of(Literal["auto"] | bool) == ("auto", True, False)
    assert choices_of(Literal[1, 2, 3]) == (1, 2, 3)
    assert COMPRESSION_CHOICES == ("fp16", "bf16", "powersgd")


@pytest.mark.parametrize(
    ("value", "valid"),
    [(1, True), (3, True), (True, False), (1.0, False), ("1", False), (None, False), ([1], False)],
)
def test_a_choice_matches_by_value_and_type(value, valid) -> None:
    if valid:
        check_choice("stage", value, Literal[1, 2, 3])
    else:
        with pytest.raises(ValueError, match=r"is invalid\. Valid options: 1, 2, 3\.$"):
            check_choice("stage", value, Literal[1, 2, 3])


def test_the_notes_must_list_the_same_values() -> None:
    with pytest.raises(AssertionError, match="do not list its choices"):
        check_choice("x", "a", Literal["a", "b"], notes={"a": ""})


# The messages as they were before the one validator, word for word (tests and users match them).
@pytest.mark.parametrize(
    ("check", "message"),
    [
        (
            lambda: ShardedOptimizerStrategy(stage=4),  # type: ignore[arg-type]
            "`stage=4` is invalid. Valid options: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).",
        ),
        (
            lambda: ShardedOptimizerStrategy(stage=True),  # type: ignore[arg-type]
            "`stage=True` is invalid. Valid options: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).",
        ),
        (
            lambda: ShardedOptimizerStrategy(checkpoint_format="zip"),  # type: ignore[arg-type]
            "`checkpoint_format='zip'` is invalid. Valid options: 'consolidated', 'sharded'.",
        ),
        (
            lambda: ShardedOptimizerStrategy(master_weights="bf16"),  # type: ignore[arg-type]
            "`master_weights='bf16'` is invalid. Valid options: 'fp32' (step fp32 master weights of 16-bit parameters,"
            " the default), None (step the 16-bit parameters directly).",
        ),
        (
            lambda: ShardedOptimizerStrategy(overlap_param_gather="yes"),  # type: ignore[arg-type]
            "`overlap_param_gather='yes'` is invalid. Valid options: 'auto' (the default), True, False.",
        ),
        (
            lambda: ShardedOptimizerStrategy(bucket_cap_mb=0),
            "`bucket_cap_mb=0` must be a positive number of MiB.",
        ),
        (
            lambda: validate_start_method("thread"),
            "Unknown `start_method='thread'`. Valid options: 'popen' (re-launch the script, the default for scripts"
            " and the CLI), 'spawn' (fresh interpreters, picklable code), 'fork' (Jupyter notebooks).",
        ),
        (
            lambda: validate_nonfinite("retry"),
            "`nonfinite_loss='retry'` is invalid. Valid options: 'skip' (every rank drops the step), 'stop' (every"
            " rank raises), 'ignore' (no check).",
        ),
        (
            lambda: validate_compression("int8", powersgd_rank=1, powersgd_start_iter=2),
            "Unknown `gradient_compression='int8'`. Valid options: None, 'fp16', 'bf16', 'powersgd'.",
        ),
        (
            lambda: DataParallelStrategy(uneven_inputs="sometimes"),  # type: ignore[arg-type]
            "`uneven_inputs='sometimes'` is invalid. Valid options: 'auto', True, False.",
        ),
        (
            lambda: DataParallelStrategy(uneven_inputs=1),  # type: ignore[arg-type]
            "`uneven_inputs=1` is invalid. Valid options: 'auto', True, False.",
        ),
    ],
)
def test_messages_are_unchanged(check, message) -> None:
    with pytest.raises(ValueError) as error:
        check()
    assert str(error.value) == message


def test_zero_config_is_frozen_and_read_by_the_strategy() -> None:
    strategy = ShardedOptimizerStrategy(1, shard_size=2, bucket_cap_mb=4.0, master_weights=None)
    config = strategy.zero_config
    assert config == ZeroConfig(stage=1, shard_size=2, bucket_cap_mb=4.0, master_weights=None)
    assert (strategy.stage, strategy.shard_size, strategy.bucket_cap_mb) == (1, 2, 4.0)
    assert (strategy.master_weights, strategy.overlap_param_gather) == (None, "auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"`stage=3\.0` is invalid"):
        dataclasses.replace(config, stage=3.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overlap", "world_size", "expected"),
    [("auto", 2, True), (True, 2, True), (False, 2, False), ("auto", 1, False), (True, 1, False)],
)
def test_overlap_param_gather_resolved_for_a_fit(overlap, world_size, expected) -> None:
    assert ZeroConfig(overlap_param_gather=overlap).overlaps_param_gather(world_size=world_size) is expected


@pytest.mark.parametrize("backend", [ReplicatedBackend, FlatBucketBackend, FullyShardBackend, MasterWeightBackend])
def test_every_backend_takes_the_config_and_context_whole(backend: type[ReplicatedBackend]) -> None:
    """No keyword arguments swallowed: the protocol's constructor is every backend's."""
    parameters = list(inspect.signature(backend).parameters.values())
    assert [(p.name, p.kind) for p in parameters] == [
        ("config", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("context", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ]
    assert isinstance(backend(ZeroConfig(), ZeroContext()), ReplicatedBackend)


def test_the_world_size_1_master_backend_steps_stage_2_buckets_and_counts_nothing() -> None:
    from lightning_parallel.accounting import CommunicationStats

    backend = MasterWeightBackend(ZeroConfig(stage=3), ZeroContext(stats=CommunicationStats()))
    assert backend.config.stage == 2 and backend.stats is None
