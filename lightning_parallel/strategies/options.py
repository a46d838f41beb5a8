"""Options that travel together through the strategies, written once.

* :class:`BaseOptions`: the launch settings and the Trainer-set plugins that each strategy's typed ``__init__`` takes
  (its public signature, the contract LightningCLI reads) and hands unchanged to ``LightningParallelStrategy``;
  :func:`base_options` picks them from the ``__init__``'s arguments.
* :class:`FieldOf`: a read-only strategy attribute that reads the field of the same name of a record the strategy
  holds (``ShardedOptimizerStrategy.shard_size`` is ``zero_config.shard_size``), so a record's fields are not written
  again as one property each.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Generic, NoReturn, TypedDict, TypeVar, cast, overload

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from lightning_parallel.strategies.launch import StartMethod

__all__ = ["BaseOptions", "FieldOf", "base_options"]

T = TypeVar("T")


class BaseOptions(TypedDict):
    """What every strategy of this package passes through to ``LightningParallelStrategy`` as it got it: how the
    processes start and wait (validated there, on every rank) and the plugins the Trainer sets."""

    start_method: StartMethod
    timeout: timedelta | float
    process_group_backend: str | None
    accelerator: Accelerator | None
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    checkpoint_io: CheckpointIO | None
    precision_plugin: Precision | None


def base_options(arguments: Mapping[str, Any]) -> BaseOptions:
    """The :class:`BaseOptions` among a strategy ``__init__``'s arguments (its ``locals()``, read before it assigns
    any other name of these)."""
    return cast(BaseOptions, {name: arguments[name] for name in BaseOptions.__required_keys__})


class FieldOf(Generic[T]):
    """A read-only attribute: the field of the same name of the record held in the attribute ``record``.

    ``shard_size = FieldOf[int | None]("zero_config")`` reads ``self.zero_config.shard_size``, as a ``property``
    would; assigning it raises ``AttributeError`` as assigning a property without a setter does.
    """

    def __init__(self, record: str, doc: str | None = None) -> None:
        self.record = record
        self.name = ""
        self.__doc__ = doc or f"``{record}``'s field of this name."

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> FieldOf[T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> FieldOf[T] | T:
        if instance is None:
            return self
        return cast(T, getattr(getattr(instance, self.record), self.name))

    def __set__(self, instance: object, value: object) -> NoReturn:
        raise AttributeError(
            f"`{type(instance).__name__}.{self.name}` is read from `{self.record}` and cannot be assigned."
        )
