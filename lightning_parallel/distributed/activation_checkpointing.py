"""Activation checkpointing: recompute chosen blocks in backward instead of keeping their activations.

One piece for every strategy (``activation_checkpointing: ActivationCheckpointing = False``):

* ``False``: nothing is recomputed.
* ``True``: every block, found as ZeRO-3 finds its FSDP2 units
  (:func:`lightning_parallel.distributed.blocks.find_blocks`): the blocks a model declares in ``_no_split_modules``
  (Hugging Face models), elsewhere the repeated blocks of a ``ModuleList``/``Sequential`` (>= 2 children of one
  class with trainable parameters, e.g. transformer blocks; in a container mixing classes, only classes whose
  modules have submodules of their own).
* a set of ``nn.Module`` subclasses: every instance of those classes (the outermost one where they nest).
* ``"selective"``: the blocks ``True`` finds, each recomputed *selectively* (below);
  ``SelectiveCheckpointing(blocks={Block})`` does the same for the blocks of a set of classes.

Selective checkpointing is torchtitan's per-op policy (``activation_checkpoint.mode = "selective"``,
``selective_ac_option = "op"``; ``_apply_op_sac`` in ``torchtitan/distributed/activation_checkpoint.py``), built
on torch's public ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: inside each block's forward the
outputs of the 1st, 3rd, 5th, ... matrix product (``aten.mm``/``aten.addmm``, what ``nn.Linear`` dispatches to; GPT:
the fused ``qkv`` and the MLP's first product, Llama: ``q``, ``v``, gate and down) and of the fused attention kernel
(flash, memory-efficient, cuDNN, torch's CPU kernel: the output and its log-sum-exp) are kept (``MUST_SAVE``),
everything else is recomputed in backward (``PREFER_RECOMPUTE``), so backward reruns the even-numbered products and
the element-wise ops only. Exactly what the planner's ``"selective"`` counts
(``lightning_parallel/planner/activations.py``): the block's input plus those outputs. One difference, for
correctness: an attention kernel called with dropout (``dropout_p > 0``) draws its mask from the RNG, and a cached
kernel would not draw it again in the recomputation, shifting the masks of every later dropout in the block; such a
call is recomputed instead (torch's CPU kernel never gets one: with dropout, ``scaled_dot_product_attention`` runs
its math path on CPU, which saves no kernel output either way).

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

Non-reentrant checkpointing (selective or not) saves and restores the CPU RNG state (and that of the inputs'
device) around the recomputation (``preserve_rng_state=True``), so dropout inside a checkpointed block draws the same
mask twice and training equals training without checkpointing. The recomputation also leaves the block's buffers as
the forward left them, so BatchNorm's running statistics are updated once per step (torch's checkpoint alone updates
them twice). With gradients disabled (evaluation, torch's pipeline shape inference) the block runs its plain forward.

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
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lightning_parallel.distributed.blocks import declared_block_names, find_blocks, outermost_modules

__all__ = [
    "ActivationCheckpointing",
    "SelectiveCheckpointing",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "is_checkpointed",
    "validate_activation_checkpointing",
]

_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")
"""The names Hugging Face blocks give their key/value cache (5.x, 4.x, GPT-2 before 4.x)."""


@dataclass(frozen=True, kw_only=True)
class SelectiveCheckpointing:
    """Selective (per-op) checkpointing of chosen blocks: ``activation_checkpointing="selective"`` is
    ``SelectiveCheckpointing()``. See the module docstring for what each block keeps."""

    blocks: set[type[nn.Module]] | frozenset[type[nn.Module]] | None = None
    """The block classes to checkpoint selectively (the outermost instance where they nest); ``None``: every block,
    as ``activation_checkpointing=True`` finds them."""

    def __post_init__(self) -> None:
        if self.blocks is not None:
            object.__setattr__(self, "blocks", _check_classes(self.blocks, "SelectiveCheckpointing(blocks=...)"))


ActivationCheckpointing: TypeAlias = bool | Literal["selective"] | set[type[nn.Module]] | SelectiveCheckpointing
"""The strategies' option type: ``False``, ``True`` (every repeated block), a set of module classes, ``"selective"``
(every repeated block, per-op selective) or :class:`SelectiveCheckpointing`."""

_VALID = (
    "True (every repeated block), False, 'selective' (every repeated block, torchtitan's per-op selective"
    " checkpointing), a set of nn.Module classes such as `{Block}`, or `SelectiveCheckpointing(blocks={Block})`"
)


def validate_activation_checkpointing(value: Any) -> bool | frozenset[type[nn.Module]] | SelectiveCheckpointing:
    """Check the option's value without a model (call it in the strategy's ``__init__``); return it normalised
    (``"selective"`` becomes ``SelectiveCheckpointing()``).

    Raises:
        TypeError: For a value that is neither a bool, ``"selective"``, a set nor a :class:`SelectiveCheckpointing`,
            or a set holding something other than ``nn.Module`` subclasses (an instance, a class name as a string,
            ...). The message names the value.
        ValueError: For an empty set (pass ``False`` to turn checkpointing off).
    """
    if isinstance(value, bool | SelectiveCheckpointing):
        return value
    if value == "selective":
        return SelectiveCheckpointing()
    if isinstance(value, str):
        planner = {"full": "True", "none": "False"}.get(value.lower())
        hint = f" (the planner's {value!r} is `{planner}`)" if planner else ""
        raise TypeError(f"`activation_checkpointing={value!r}` must be {_VALID}{hint}.")
    if not isinstance(value, set | frozenset):
        raise TypeError(f"`activation_checkpointing={value!r}` must be {_VALID}.")
    return _check_classes(value, "activation_checkpointing")


def _check_classes(value: Any, name: str) -> frozenset[type[nn.Module]]:
    """``value`` as a frozenset of ``nn.Module`` subclasses; the errors name the option ``name``."""
    if not isinstance(value, set | frozenset):
        raise TypeError(f"`{name}` is {value!r}; pass a set of nn.Module classes such as `{{Block}}`, or None.")
    if not value and name == "activation_checkpointing":
        raise ValueError(
            "`activation_checkpointing=set()` names no module class. Pass `False` to turn it off, `True` for every"
            " repeated block, or the classes to recompute, e.g. `{Block}`."
        )
    if not value:
        raise ValueError(
            "`SelectiveCheckpointing(blocks=set())` names no module class. Pass `blocks=None` for every repeated"
            " block, or the classes to recompute selectively, e.g. `{Block}`."
        )
    bad = [item for item in value if not (isinstance(item, type) and issubclass(item, nn.Module))]
    if bad:
        raise TypeError(
            f"`{name}` holds {', '.join(map(repr, bad))}, which "
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
        ValueError: If ``policy`` is ``True`` (or ``"selective"``) and ``module`` has no repeated blocks, or a class
            of the set has no instance in ``module`` (a typo or a class imported from elsewhere would otherwise do
            nothing silently). The message names the missing classes and the classes the module holds.
    """
    policy = validate_activation_checkpointing(policy)
    if isinstance(policy, SelectiveCheckpointing):
        policy, spelled = (True, "'selective'") if policy.blocks is None else (policy.blocks, "")
    else:
        spelled = "True"
    if policy is False:
        return []
    if policy is True:
        chosen = find_blocks(module)
        if not chosen:
            raise ValueError(_no_blocks_message(module, spelled))
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


def _no_blocks_message(module: nn.Module, spelled: str) -> str:
    declared = sorted(declared_block_names(module))
    declaration = (
        f"`_no_split_modules` names {', '.join(declared)}, of which it holds no instance with parameters"
        if declared
        else "no submodule declares `_no_split_modules` (Hugging Face models do)"
    )
    return (
        f"`activation_checkpointing={spelled}` found no blocks in `{type(module).__name__}`: {declaration}, and no"
        " ModuleList or Sequential holds >= 2 children of one class with trainable parameters (in a container that"
        " mixes classes, children with submodules of their own: single layers such as Linear do not count). Pass"
        " the classes to recompute instead, e.g. `activation_checkpointing={MyBlock}`."
    )


class _CheckpointedForward:
    """A module instance's ``forward``: the original one, recomputed in backward (non-reentrant checkpoint).

    Holds the module and, where the instance already had its own ``forward`` attribute, that one; otherwise the
    class's ``forward`` is looked up at call time (FSDP2 swaps the class for a subclass, which keeps it).
    """

    def __init__(self, module: nn.Module, original: Any, *, selective: bool = False) -> None:
        self.module = module
        self.original = original
        self.selective = selective
        """Keep what :class:`_SelectivePolicy` chooses instead of recomputing the whole forward."""
        self._positions: dict[str, int] | None = None

    def plain_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.plain_forward(*args, **kwargs)
        args, kwargs = self._without_cache(args, kwargs)
        run = self._selective_forward if self.selective else self.plain_forward
        return checkpoint(run, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _selective_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The plain forward with autocast's weight-copy cache off. torch's replaying mode requires the
        recomputation to run the very ops the forward ran; with the cache on, a forward that finds a weight's 16-bit
        copy cached (a second micro-batch in one autocast region, the pipeline's case) runs one ``_to_copy`` fewer
        than the recomputation, which starts with an empty cache, and backward fails. Off, both cast every weight
        they use (the copies are recomputed, not kept: the planner counts none under checkpointing)."""
        with _autocast_cache_off():
            return self.plain_forward(*args, **kwargs)

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
        """(forward, recomputation) contexts, made afresh for each call: the recomputation in backward leaves the
        block's buffers as the forward left them, so BatchNorm's running statistics (and ``num_batches_tracked``)
        are updated once per forward, as without checkpointing; torch's checkpoint alone would update them a second
        time. Selective: torch's caching mode around the forward, its replaying mode inside the recomputation, both
        sharing one cache and one :class:`_SelectivePolicy` (its matrix-product count starts at 0 for each call)."""
        if not self.selective:
            return contextlib.nullcontext(), _BuffersRestored(self.module)
        caching, replaying = create_selective_checkpoint_contexts(_SelectivePolicy())
        return caching, _Nested(_BuffersRestored(self.module), replaying)


_MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
"""The matrix products the selective policy counts: what ``nn.Linear``/``torch.matmul`` on 2- and 3-d inputs
dispatch to (torchtitan counts ``aten.mm``, its models have no biases; a biased ``nn.Linear`` runs ``aten.addmm``).
Not counted: attention's ``bmm`` where attention is written out (the planner does not count it either)."""

_ATTENTION_DROPOUT_INDEX = {
    torch.ops.aten._scaled_dot_product_flash_attention.default: 3,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
    torch.ops.aten._scaled_dot_product_efficient_attention.default: 5,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: 5,
}
"""The fused attention kernels whose outputs (output, log-sum-exp, ...) the selective policy keeps, with the position
of ``dropout_p`` in each one's schema (``tests/test_selective_activation_checkpointing.py`` checks them against
torch's schemas)."""


class _SelectivePolicy:
    """torchtitan's per-op policy for one checkpointed call (module docstring): keep the odd-numbered matrix
    products' outputs and the fused attention's, recompute everything else.

    The count is kept per pass (forward, recomputation): torch versions that ask the policy again in the
    recomputation get the same answers in the same order.
    """

    def __init__(self) -> None:
        self.matmuls = {False: 0, True: 0}

    def __call__(self, ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMUL_OPS:
            self.matmuls[ctx.is_recompute] += 1
            odd = self.matmuls[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        index = _ATTENTION_DROPOUT_INDEX.get(func)
        if index is not None:
            dropout = kwargs.get("dropout_p", args[index] if len(args) > index else 0.0)
            # With dropout the kernel draws from the RNG: recompute it, so the recomputation draws what forward drew.
            return CheckpointPolicy.PREFER_RECOMPUTE if dropout else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _autocast_cache_off() -> contextlib.AbstractContextManager[Any]:
    """Autocast as it is, its cache off (a nested ``torch.autocast``: leaving it restores the cache flag and keeps
    the outer region's cache); nothing when no autocast is on or its cache is off already."""
    if torch.is_autocast_cache_enabled():
        accelerator = torch.accelerator.current_accelerator()
        for device_type in ("cpu", *([accelerator.type] if accelerator is not None else [])):
            if torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
                return torch.autocast(device_type, dtype=dtype, cache_enabled=False)
    return contextlib.nullcontext()


class _Nested:
    """Context: enters its contexts in order, leaves them in reverse. Re-enterable, as :class:`_BuffersRestored`."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().__exit__(*exc)


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
    still returned; its wrapper takes this call's mode, whole-block or selective). Apply it before ``fully_shard``
    (ZeRO-3) and before a pipeline split (or to a stage's layers).

    Args:
        module: The model (the LightningModule, a stage's layers' parent, or any ``nn.Module``).
        policy: ``False``, ``True``, a set of ``nn.Module`` classes, ``"selective"`` or a
            :class:`SelectiveCheckpointing` (see the module docstring).

    Returns:
        The qualified names (``module.named_modules()``) of the checkpointed submodules, in module order.

    Raises:
        TypeError, ValueError: As :func:`checkpointed_modules`, before anything is wrapped.
    """
    chosen = checkpointed_modules(module, policy)
    selective = isinstance(validate_activation_checkpointing(policy), SelectiveCheckpointing)
    names = {id(m): name for name, m in module.named_modules()}
    for sub in chosen:
        if is_checkpointed(sub):
            sub.__dict__["forward"].selective = selective  # the same wrapper, the latest call's mode
        else:
            # An instance attribute: `nn.Module.__call__` looks `forward` up on the instance first.
            sub.forward = _CheckpointedForward(sub, sub.__dict__.get("forward"), selective=selective)
    return [names[id(m)] for m in chosen]
