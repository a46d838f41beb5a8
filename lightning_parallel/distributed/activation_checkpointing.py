"""Activation checkpointing: recompute chosen blocks in backward instead of keeping their activations.

One piece for every strategy (``activation_checkpointing: bool | set[type[nn.Module]] = False``):

* ``False``: nothing is recomputed.
* ``True``: every block, found as ZeRO-3 finds its FSDP2 units
  (:func:`lightning_parallel.distributed.blocks.find_blocks`): the blocks a model declares in ``_no_split_modules``
  (Hugging Face models), elsewhere the repeated blocks of a ``ModuleList``/``Sequential`` (>= 2 children of one
  class with trainable parameters, e.g. transformer blocks; in a container mixing classes, only classes whose
  modules have submodules of their own).
* a set of ``nn.Module`` subclasses: every instance of those classes (the outermost one where they nest).

How a block is wrapped, and why. torch's ``checkpoint_wrapper`` puts the block inside a ``CheckpointWrapper``, which
renames every parameter (``blocks.0._checkpoint_wrapped_module.attn...``); its state-dict hooks hide that from
``state_dict()`` but not from ``named_parameters()``, which our sharded checkpoints, optimizer-state consolidation and
monitor use. Instead, the block's *instance* gets a ``forward`` that runs the class's ``forward`` through the public
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the module tree, every name and every state-dict key
stay exactly as they were, so checkpoints move between strategies with or without it. The wrapper lives inside the
module's ``__call__``, so hooks registered on the block (FSDP2's all-gather before forward, its reshard after) run
once around the checkpointed forward, and the recomputation in backward calls the plain ``forward`` after FSDP2's
pre-backward hook has gathered the parameters again: the same composition as torchtitan's
``fully_shard(checkpoint_wrapper(block))``. Apply it before ``fully_shard``.

Non-reentrant checkpointing saves and restores the CPU RNG state (and that of the inputs' device) around the
recomputation (``preserve_rng_state=True``), so dropout inside a checkpointed block draws the same mask twice and
training equals training without checkpointing. The recomputation also leaves the block's buffers as the forward
left them, so BatchNorm's running statistics are updated once per step (torch's checkpoint alone updates them twice).
With gradients disabled (evaluation, torch's pipeline shape
inference) the block runs its plain forward.

A block called with a key/value cache to fill (Hugging Face's ``past_key_values``/``layer_past`` with
``use_cache=True``, the configs' default even in training) would write it a second time in the recomputation and
attend to both writes (a shape error with a padding mask, silently other values without). As Hugging Face's own
gradient checkpointing (``GradientCheckpointingLayer``) does, a checkpointed block runs without the cache while
gradients are enabled, unless its class declares ``_can_checkpoint_with_cache = True`` (it only reads the cache).
In training the cache starts empty, so this changes nothing but the cache the model returns (empty).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel.distributed.blocks import declared_block_names, find_blocks, outermost_modules

__all__ = [
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "is_checkpointed",
    "validate_activation_checkpointing",
]

_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")
"""The names Hugging Face blocks give their key/value cache (5.x, 4.x, GPT-2 before 4.x)."""

ActivationCheckpointing: TypeAlias = bool | set[type[nn.Module]]
"""The strategies' option type: ``False``, ``True`` (every repeated block) or a set of module classes."""


def validate_activation_checkpointing(value: Any) -> bool | frozenset[type[nn.Module]]:
    """Check the option's value without a model (call it in the strategy's ``__init__``); return it normalised.

    Raises:
        TypeError: For a value that is neither a bool nor a set, or a set holding something other than
            ``nn.Module`` subclasses (an instance, a class name as a string, ...). The message names the value.
        ValueError: For an empty set (pass ``False`` to turn checkpointing off).
    """
    if isinstance(value, bool):
        return value
    if not isinstance(value, set | frozenset):
        raise TypeError(
            f"`activation_checkpointing={value!r}` must be True (every repeated block), False, or a set of"
            " nn.Module classes such as `{Block}`."
        )
    if not value:
        raise ValueError(
            "`activation_checkpointing=set()` names no module class. Pass `False` to turn it off, `True` for every"
            " repeated block, or the classes to recompute, e.g. `{Block}`."
        )
    bad = [item for item in value if not (isinstance(item, type) and issubclass(item, nn.Module))]
    if bad:
        raise TypeError(
            f"`activation_checkpointing` holds {', '.join(map(repr, bad))}, which "
            f"{'is' if len(bad) == 1 else 'are'} not nn.Module subclasses. Pass the classes themselves, e.g."
            " `{Block}` (not instances or names)."
        )
    return frozenset(value)


def checkpointed_modules(module: nn.Module, policy: Any) -> list[nn.Module]:
    """The submodules of ``module`` that ``policy`` checkpoints, outermost first in ``modules()`` order.

    A module nested inside another chosen one is left out (the outer recomputation already covers it); ``module``
    itself is never chosen (the LightningModule's ``forward`` is what the strategy calls).

    Raises:
        TypeError, ValueError: As :func:`validate_activation_checkpointing`.
        ValueError: If ``policy`` is ``True`` and ``module`` has no repeated blocks, or a class of the set has no
            instance in ``module`` (a typo or a class imported from elsewhere would otherwise do nothing silently).
            The message names the missing classes and the classes the module holds.
    """
    policy = validate_activation_checkpointing(policy)
    if policy is False:
        return []
    if policy is True:
        chosen = find_blocks(module)
        if not chosen:
            raise ValueError(_no_blocks_message(module))
        return outermost_modules(module, chosen)
    present = {type(m) for m in module.modules() if m is not module}
    missing = [cls for cls in policy if not any(issubclass(p, cls) for p in present)]
    if missing:
        names = ", ".join(sorted(cls.__qualname__ for cls in missing))
        held = ", ".join(sorted({p.__qualname__ for p in present if p.__module__.split(".")[0] != "torch"})[:8])
        raise ValueError(
            f"`activation_checkpointing` names {names}, of which `{type(module).__name__}` holds no instance (its own"
            f" module classes: {held or 'only torch.nn layers'}). Pass classes the model uses, e.g. the class of its"
            " transformer blocks, or `True` for every block."
        )
    classes = tuple(policy)
    return outermost_modules(module, [m for m in module.modules() if m is not module and isinstance(m, classes)])


def _no_blocks_message(module: nn.Module) -> str:
    declared = sorted(declared_block_names(module))
    declaration = (
        f"`_no_split_modules` names {', '.join(declared)}, of which it holds no instance with parameters"
        if declared
        else "no submodule declares `_no_split_modules` (Hugging Face models do)"
    )
    return (
        f"`activation_checkpointing=True` found no blocks in `{type(module).__name__}`: {declaration}, and no"
        " ModuleList or Sequential holds >= 2 children of one class with trainable parameters (in a container that"
        " mixes classes, children with submodules of their own: single layers such as Linear do not count). Pass"
        " the classes to recompute instead, e.g. `activation_checkpointing={MyBlock}`."
    )


class _CheckpointedForward:
    """A module instance's ``forward``: the original one, recomputed in backward (non-reentrant checkpoint).

    Holds the module and, where the instance already had its own ``forward`` attribute, that one; otherwise the
    class's ``forward`` is looked up at call time (FSDP2 swaps the class for a subclass, which keeps it).
    """

    def __init__(self, module: nn.Module, original: Any) -> None:
        self.module = module
        self.original = original
        self._positions: dict[str, int] | None = None

    def plain_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.plain_forward(*args, **kwargs)
        args, kwargs = self._without_cache(args, kwargs)
        return checkpoint(self.plain_forward, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _without_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with ``use_cache=False`` and no key/value cache (module docstring), whether they
        were passed by keyword (Llama) or by position (GPT-2 passes ``past_key_values`` second)."""
        keeps_cache = getattr(self.module, "_can_checkpoint_with_cache", False) is True
        replacements = {"use_cache": False} | ({} if keeps_cache else dict.fromkeys(_CACHE_ARGUMENTS))
        positions = self._argument_positions()
        new_args, new_kwargs, dropped = list(args), dict(kwargs), []
        for name, value in replacements.items():
            if name in new_kwargs:
                old, new_kwargs[name] = new_kwargs[name], value
            elif positions.get(name, len(args)) < len(args):
                old, new_args[positions[name]] = new_args[positions[name]], value
            else:
                continue
            if name != "use_cache" and old is not None:
                dropped.append(name)
        if dropped:
            warnings.warn(
                f"`{type(self.module).__name__}` is recomputed in backward (activation checkpointing), so it runs"
                f" without its key/value cache ({', '.join(dropped)}=None, use_cache=False), as Hugging Face's"
                " gradient checkpointing does. Pass `use_cache=False` to the model while training to silence this.",
                stacklevel=3,
            )
        return tuple(new_args), new_kwargs

    def _argument_positions(self) -> dict[str, int]:
        """Positions in ``*args`` of the forward's positional parameters, by name (empty for ``*args`` only)."""
        if self._positions is None:
            forward = self.original if self.original is not None else type(self.module).forward
            try:
                parameters = list(inspect.signature(forward).parameters.values())
            except (TypeError, ValueError):  # a builtin or an object without a signature: keywords only
                parameters = []
            if self.original is None:
                parameters = parameters[1:]  # the class's function: `self` comes first
            positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            names = [p.name for p in itertools.takewhile(lambda p: p.kind in positional, parameters)]
            self._positions = {name: index for index, name in enumerate(names)}
        return self._positions

    def _contexts(self) -> tuple[Any, Any]:
        """(forward, recomputation) contexts: the recomputation in backward leaves the block's buffers as the
        forward left them, so BatchNorm's running statistics (and ``num_batches_tracked``) are updated once per
        forward, as without checkpointing; torch's checkpoint alone would update them a second time."""
        return contextlib.nullcontext(), _BuffersRestored(self.module)


class _BuffersRestored:
    """Context: the module's buffers are put back as they were on entry. Re-enterable (torch may enter the
    recomputation context more than once, e.g. for a nested checkpoint)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._saved: list[list[tuple[Tensor, Tensor]]] = []

    def __enter__(self) -> None:
        self._saved.append([(buffer, buffer.detach().clone()) for buffer in self.module.buffers()])

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for buffer, value in self._saved.pop():
                buffer.copy_(value)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped this module's ``forward``."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def apply_activation_checkpointing(module: nn.Module, policy: Any) -> list[str]:
    """Recompute the submodules ``policy`` chooses (:func:`checkpointed_modules`) in backward; return their names.

    Local (no collective). Wraps in place without changing the module tree: parameter names, buffer names and
    ``state_dict()`` keys stay as they were. Idempotent: a module wrapped before is not wrapped again (its name is
    still returned). Apply it before ``fully_shard`` (ZeRO-3) and before a pipeline split (or to a stage's layers).

    Args:
        module: The model (the LightningModule, a stage's layers' parent, or any ``nn.Module``).
        policy: ``False``, ``True`` or a set of ``nn.Module`` classes (see the module docstring).

    Returns:
        The qualified names (``module.named_modules()``) of the checkpointed submodules, in module order.

    Raises:
        TypeError, ValueError: As :func:`checkpointed_modules`, before anything is wrapped.
    """
    chosen = checkpointed_modules(module, policy)
    names = {id(m): name for name, m in module.named_modules()}
    for sub in chosen:
        if not is_checkpointed(sub):
            # An instance attribute: `nn.Module.__call__` looks `forward` up on the instance first.
            sub.forward = _CheckpointedForward(sub, sub.__dict__.get("forward"))
    return [names[id(m)] for m in chosen]
