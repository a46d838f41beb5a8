"""One check for an argument that takes one of a fixed set of values, read from the argument's own ``Literal``.

The ``Literal`` annotation a constructor argument already has (which mypy and LightningCLI read) is the only list
of its valid values: :func:`check_choice` compares against the values it holds, so no tuple of the same values is
kept beside it to drift. Pure Python: the torch-only ``distributed/`` layer uses it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

__all__ = ["check_choice", "choices_of"]


def choices_of(annotation: Any) -> tuple[Any, ...]:
    """The values an annotation built from ``Literal``, ``bool`` and ``None`` admits, in the order written:
    ``choices_of(Literal["a", "b"] | None) == ("a", "b", None)``, ``choices_of(bool) == (True, False)``."""
    if annotation is None or annotation is type(None):
        return (None,)
    if annotation is bool:
        return (True, False)
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    members = get_args(annotation)  # a union
    assert members, f"{annotation!r} is not built from Literal, bool and None"
    return tuple(value for member in members for value in choices_of(member))


def check_choice(
    name: str,
    value: object,
    annotation: Any,
    *,
    notes: Mapping[Any, str] | None = None,
    unknown: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``value`` is one of the values of ``annotation`` (see :func:`choices_of`), of the
    same type: ``True`` is not the ``1`` of ``Literal[1, 2]``, nor ``0`` the ``False`` of ``bool``.

    The message names the argument and lists the valid values: ``"`name=value` is invalid. Valid options: ..."``, or
    with ``unknown`` (a name of something, such as a start method) ``"Unknown `name=value`. Valid options: ..."``.

    Args:
        name: the argument's name, as the user spells it.
        value: what the user passed.
        annotation: the argument's ``Literal`` (or a union of ``Literal``, ``bool`` and ``None``).
        notes: a short note per valid value, shown in brackets after it; its order is the order listed (every valid
            value must have an entry, ``""`` for none). Without it, the annotation's order and no notes.
        unknown: word the message for a name the user may have misspelt.
    """
    choices = choices_of(annotation)
    if notes is not None:
        assert _same_values(tuple(notes), choices), f"the notes of `{name}` do not list its choices {choices!r}"
        choices = tuple(notes)
    if any(_equal(value, choice) for choice in choices):
        return
    listed = ", ".join(repr(choice) + (f" ({notes[choice]})" if notes and notes[choice] else "") for choice in choices)
    start = f"Unknown `{name}={value!r}`." if unknown else f"`{name}={value!r}` is invalid."
    raise ValueError(f"{start} Valid options: {listed}.")


def _equal(value: object, choice: object) -> bool:
    return type(value) is type(choice) and value == choice


def _same_values(left: tuple[Any, ...], right: tuple[Any, ...]) -> bool:
    return len(left) == len(right) and all(any(_equal(a, b) for b in right) for a in left)
