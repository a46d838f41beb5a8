"""Pick a benchmark's preset and override its repeats and steps: one rule for every benchmark of the suite."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

__all__ = ["configure_preset"]

ConfigT = TypeVar("ConfigT")


def configure_preset(presets: dict[str, ConfigT], preset: str, *, repeats: int | None, steps: int | None) -> ConfigT:
    """A copy of ``presets[preset]`` with ``repeats`` and ``steps`` replaced where given (warm-up kept shorter).

    The configuration is a dataclass with ``repeats``, ``steps`` and ``warmup_steps`` fields.
    """
    if preset not in presets:
        raise ValueError(f"`preset={preset!r}` is not one of {', '.join(presets)}.")
    config: Any = replace(presets[preset])  # type: ignore[type-var]
    config.repeats = config.repeats if repeats is None else repeats
    config.steps = config.steps if steps is None else steps
    config.warmup_steps = min(config.warmup_steps, config.steps - 1)
    return config
