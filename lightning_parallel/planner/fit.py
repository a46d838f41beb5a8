"""``largest_fitting(...)``: the largest model of a family that fits a device, per strategy configuration.

A *family* is a model config dataclass registered with :func:`~lightning_parallel.planner.register_config_type`
(the demo's ``GPTConfig`` is one) or a Hugging Face transformers config (:mod:`.hf`), and one integer field to scale
(the number of layers by default: depth, the usual knob; ``n_embd`` works too where the config's own checks allow the
values). For every configuration the planner knows (data parallel, ZeRO 1/2/3, each pipeline size) the answer is the
largest value of that field whose predicted total bytes on the worst rank fit ``device_memory``, found by doubling
and then bisecting over :func:`plan` (bytes per rank grow with the field, so the search is exact for the planner's
estimates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_parallel.planner.hf import read_hf_config
from lightning_parallel.planner.plan import Plan, plan

__all__ = ["LargestFit", "largest_fitting"]


@dataclass(frozen=True)
class LargestFit:
    """The largest model of the family that one configuration fits in the device memory."""

    configuration: str
    """The planner's configuration name (``"zero2"``, ``"pipeline pp=2, dp=2"``, ...)."""
    value: int | None
    """The largest value of the scaled field that fits; ``None``: not even the smallest tried (1, or for a pipeline
    that needs more layers, the given config's value)."""
    num_parameters: int | None
    """Parameters of that model."""
    total_bytes: int | None
    """Predicted bytes on its worst rank (parameters, gradients, optimizer state, activations)."""
    strategy: str | None
    """What goes into ``Trainer(strategy=...)`` for it."""


def largest_fitting(
    config: Any,
    *,
    device_memory: int,
    world_size: int,
    scale_field: str | None = None,
    max_value: int = 1024,
    **plan_options: Any,
) -> list[LargestFit]:
    """For every configuration, the largest ``config`` (scaled in ``scale_field``) that fits ``device_memory``.

    Args:
        config: a model config dataclass of a registered family (e.g. ``GPTConfig.from_preset("gpt-350m")``), or a
            Hugging Face transformers config (an object, a local ``config.json`` or its directory; see :mod:`.hf`).
        device_memory: bytes per device.
        world_size: total number of processes (devices).
        scale_field: the integer field of ``config`` to scale; ``None``: its number of layers (``n_layer``,
            a transformers config's ``num_hidden_layers``).
        max_value: the largest value tried; a configuration that still fits there reports ``max_value``.
        plan_options: any other argument of :func:`~lightning_parallel.planner.plan` (``precision``,
            ``batch_size``, ``seq_len``, ``activation_checkpointing``, ``optimizer``, ...).

    Raises:
        TypeError: if ``config`` is not a dataclass instance or a transformers config, or ``scale_field`` is not one
            of its integer fields.
        ValueError: for a ``device_memory`` or ``max_value`` below 1, or whatever :func:`plan` refuses.
    """
    scaled, current = _family(config, scale_field)
    for name, value in (("device_memory", device_memory), ("max_value", max_value)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer.")
    plans: dict[int, Plan] = {}

    def planned(value: int) -> Plan:
        if value not in plans:
            plans[value] = plan(
                scaled(value), world_size=world_size, device_memory=device_memory, search_layouts=False, **plan_options
            )
        return plans[value]

    # A pipeline of p stages needs at least p layers: one absent at 1 is searched from the given config's value up.
    names = list(dict.fromkeys(c.name for value in (1, current) for c in planned(value).configurations))
    return [_search(name, planned, start=_first_present(name, planned, current), max_value=max_value) for name in names]


def _family(config: Any, scale_field: str | None) -> tuple[Callable[[int], Any], int]:
    """A function giving ``config`` with ``scale_field`` set to a value, and the field's current value.

    A transformers config is scaled as its ``config.json`` keys (what the planner reads), so nothing its class
    derives from the layer count (Qwen2's ``layer_types``) has to agree.
    """
    hf_config = read_hf_config(config)
    if hf_config is not None:
        values = hf_config[0]
        field = scale_field or ("n_layer" if "n_layer" in values else "num_hidden_layers")
        integers = {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
        current = _current(field, integers, hf_config[1])
        return (lambda value: {**values, field: value}), current
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(
            f"`config={config!r}` must be a model config dataclass instance (e.g. a GPTConfig) or a transformers"
            " config."
        )
    field = scale_field or "n_layer"
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    integers = {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool)}
    current = _current(field, integers, type(config).__name__)
    return (lambda value: dataclasses.replace(config, **{field: value})), current


def _current(field: str, integers: dict[str, int], kind: str) -> int:
    if field not in integers:
        raise TypeError(f"`scale_field={field!r}` is not an integer field of {kind}: {sorted(integers)}.")
    return integers[field]


def _first_present(name: str, planned: Any, current: int) -> int:
    return 1 if any(c.name == name for c in planned(1).configurations) else current


def _fits(name: str, result: Plan, device_memory: int) -> bool:
    config = next((c for c in result.configurations if c.name == name), None)
    return config is not None and config.max_total <= device_memory


def _search(name: str, planned: Any, *, start: int, max_value: int) -> LargestFit:
    memory = planned(start).device_memory
    if not _fits(name, planned(start), memory):
        return LargestFit(name, None, None, None, None)
    good, bad = start, None
    while bad is None:  # doubling: the first value that does not fit
        trial = min(good * 2, max_value)
        if trial == good:
            break
        if _fits(name, planned(trial), memory):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:  # bisect between the last fit and the first miss
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _fits(name, planned(middle), memory) else (good, middle)
    best = planned(good)
    config = best.configuration(name)
    return LargestFit(name, good, best.num_parameters, config.max_total, config.strategy)
