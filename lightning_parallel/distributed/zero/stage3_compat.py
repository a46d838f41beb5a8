"""The private FSDP2 state that ZeRO-3 reads or restores, in one place.

``FSDPModule.set_reshard_after_forward`` is public but has no getter and also clears the "auto" flag that lets FSDP2
keep the root unit unsharded after forward; :func:`reshard_after_forward_disabled` restores both exactly.
``FSDPModule.reset_iter_state`` is public, but in torch 2.13 fails on a root unit that never ran a forward (its
communication context is created lazily); :func:`is_initialised_root` tells which units to reset. torch 2.11 has no
``reset_iter_state``: :func:`reset_iteration` does the part teardown needs with FSDP2's ``TrainingState``.
FSDP2 keeps one ``_fsdp_param_group`` per unit up to torch 2.11, a list ``_fsdp_param_groups`` since 2.12
(:func:`param_groups_of`).
:func:`propagate_requires_grad` reads FSDP2's per-parameter records (``FSDPParam``), which have no public API.
:func:`initialise_root` runs FSDP2's lazy initialisation of the root unit (``FSDPState._lazy_init``), which FSDP2 runs
only at the first forward of whichever unit comes first and which has no public entry point. Checked against torch
2.11 to 2.14: a version that renames these fields fails here with a named error, not silently.

Also the one torch private of the stage 1-2 overlap (``distributed/zero/gather.py``): :func:`current_function_mode`
(``torch.overrides._get_current_function_mode``), the innermost active ``TorchFunctionMode``. The overlap's
stale-read guard is entered after the optimizer step and left at the next forward, not in one ``with`` block, so it
pops itself only when it is the innermost mode (``TorchFunctionMode.__exit__`` pops whichever mode is innermost).

And what ZeRO-3's gloo gradient reduction (``distributed/zero/stage3_gloo.py``) must know to defer a reduction safely:
each unit's ``FSDPParam`` records (:func:`sharded_gradient_params`), whether it has an all-reduce hook
(:func:`has_all_reduce_hook`) or a sharded parameter a post-accumulate-grad hook (:func:`post_accumulate_grad_hooks`),
and the autograd engine's end-of-backward callback (:func:`queue_at_end_of_backward`).

And the one private of the stage 1-2 buckets under tensor parallelism (``distributed/zero/local_shards.py``):
:func:`wrapped_local_tensor` (``DTensor._local_tensor``), the plain tensor a split weight wraps, whose ``.data`` the
buckets point into their flat buffer. ``to_local()`` returns that very tensor under ``no_grad`` up to torch 2.12, but a
fresh view of it for a parameter since 2.13 (so setting its ``.data`` would leave the weight where it was); setting
the ``DTensor`` parameter's own ``.data`` moves only the wrapper. Checked on torch 2.11 and 2.13.

And one of the optimizer's: :func:`run_step_post_hook_first` moves a step post hook ahead of those registered before it
(``Optimizer._optimizer_step_post_hooks``, an ordered dict; ``register_step_post_hook`` has no ``prepend``), so that
the local-shard step puts the ``DTensor`` parameters back before a user's post hook (an EMA) reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.overrides import TorchFunctionMode, _get_current_function_mode

__all__ = [
    "current_function_mode",
    "has_all_reduce_hook",
    "initialise_root",
    "is_initialised_root",
    "param_groups_of",
    "post_accumulate_grad_hooks",
    "propagate_requires_grad",
    "queue_at_end_of_backward",
    "reset_iteration",
    "reshard_after_forward_disabled",
    "run_step_post_hook_first",
    "sharded_gradient_params",
    "wrapped_local_tensor",
]


def _moved(error: AttributeError, consequence: str) -> RuntimeError:
    """The error for a torch version whose FSDP2 moved a field this module reads (``consequence``: what fails)."""
    return RuntimeError(
        f"This torch version's FSDP2 has no `{error.name}` where lightning_parallel expects it (written for torch"
        f" 2.13); {consequence}"
    )


def param_groups_of(unit: FSDPModule) -> list[Any]:
    """FSDP2's ``FSDPParamGroup`` records of ``unit``: a list ``_fsdp_param_groups`` since torch 2.12 (several groups
    per unit), a single optional ``_fsdp_param_group`` in torch 2.11 and earlier."""
    return _state_param_groups(unit._get_fsdp_state())


def reset_iteration(root: FSDPModule) -> None:
    """Local. FSDP2's ``reset_iter_state()`` on an initialised root (torch >= 2.12); on torch 2.11, which has none,
    the part of it teardown needs: every unit below ``root`` idle and resharded, the iteration's trackers cleared."""
    reset = getattr(root, "reset_iter_state", None)
    if reset is not None:
        reset()
        return
    state = root._get_fsdp_state()
    for unit_state in state._state_ctx.all_states:
        unit_state._training_state = TrainingState.IDLE
        for group in _state_param_groups(unit_state):
            group._training_state = TrainingState.IDLE
            group.reshard()
    state._comm_ctx.post_forward_order.clear()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _state_param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch <= 2.11; AttributeError (named by the callers) if this moved too
    return [] if group is None else [group]


def current_function_mode() -> TorchFunctionMode | None:
    """The innermost active ``TorchFunctionMode`` of this thread, or ``None``."""
    return _get_current_function_mode()


def _saved_reshard_settings(unit: FSDPModule) -> tuple[Any, bool | None, list[tuple[Any, Any]]]:
    try:
        state = unit._get_fsdp_state()
        groups = [(group, group.post_forward_mesh_info) for group in param_groups_of(unit)]
        return state, state._auto_reshard_after_forward, groups
    except AttributeError as error:  # pragma: no cover - only on a torch version that moved these fields
        raise _moved(error, "`ShardedOptimizerStrategy.full_module()` cannot keep parameters unsharded.") from error


@contextmanager
def reshard_after_forward_disabled(units: Sequence[nn.Module]) -> Generator[None, None, None]:
    """Keep every unit's unsharded parameters after its forward; restore each unit's own setting on exit."""
    saved = [_saved_reshard_settings(unit) for unit in units if isinstance(unit, FSDPModule)]
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info


def initialise_root(root: nn.Module) -> None:
    """Make ``root`` FSDP2's root of every unit below it now, not at the first forward. Local; call once every
    parameter is materialised on its device (FSDP2 refuses meta parameters here).

    FSDP2 picks as root the first unit whose forward runs, and only a root builds the communication context that it
    shares with the units below it (one reduce-scatter input kept alive at a time, backward prefetching in forward
    order). When ``training_step`` calls a child (``self.model(x)``, ``self.generator(z)``) instead of ``self(x)``,
    each unit reached first would become a root of its own, keep its last reduce-scatter input (its whole gradients)
    until backward ends, and a later ``self(x)`` would fail with "requires running forward through the root module
    first". A unit below an initialised root runs its own forward normally (FSDP2 lets any unit start an iteration).
    Idempotent: an initialised root is left as it is.
    """
    assert isinstance(root, FSDPModule)  # the root `apply_fully_shard` returns last
    try:
        root._get_fsdp_state()._lazy_init()
    except AttributeError as error:  # pragma: no cover - only on a torch version that moved these fields
        raise _moved(error, "ZeRO-3 cannot choose the root FSDP unit.") from error


def is_initialised_root(unit: FSDPModule) -> bool:
    """Whether ``unit`` is an initialised FSDP2 root (by :func:`initialise_root` or its first forward as a root), so
    that ``reset_iter_state()`` may be called on it.

    A root marked root while its communication context was never set up (possible without :func:`initialise_root`
    when its forward never ran) would fail to reset.
    """
    state = unit._get_fsdp_state()
    return getattr(state, "_is_root", None) is True and hasattr(state._comm_ctx, "all_gather_state")


def propagate_requires_grad(unit: FSDPModule) -> None:
    """Carry a ``requires_grad`` change made on the module's registered parameters over to FSDP2's sharded ones.

    Between steps FSDP2 may leave the *unsharded* parameters registered (a root unit keeps them after forward, and
    a frozen unit has no backward to reshard it), so ``module.requires_grad_(True)`` (unfreezing a backbone) lands
    on those, while FSDP2 copies ``requires_grad`` from the sharded parameter at every all-gather: the change would
    last one step. FSDP2 itself sets both equal when it registers the unsharded parameter, so a difference here is
    the user's change. Local; call before the unit's forward.
    """
    for group in param_groups_of(unit):
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            registered = getattr(info.module, info.param_name)
            sharded = fsdp_param.sharded_param
            if registered is not sharded and registered.requires_grad != sharded.requires_grad:
                sharded.requires_grad_(registered.requires_grad)


def sharded_gradient_params(unit: FSDPModule) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of ``unit``: what its reduction writes ``.grad`` of. Each has
    ``sharded_param`` (the DTensor the optimizer steps) and ``offload_to_cpu``."""
    try:
        return [fsdp_param for group in param_groups_of(unit) for fsdp_param in group.fsdp_params]
    except AttributeError as error:  # pragma: no cover - only on a torch version that moved these fields
        raise _moved(error, "ZeRO-3 cannot reduce gradients on gloo.") from error


def local_gradient(fsdp_param: Any) -> Tensor | None:
    """This rank's gradient sum that FSDP2 keeps unsharded while ``set_requires_gradient_sync(False)`` (gradient
    accumulation): in the reduce dtype once upcast, else on the unsharded parameter; ``None`` if it got none."""
    accumulated = fsdp_param.unsharded_accumulated_grad
    if accumulated is not None:
        return accumulated
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def has_all_reduce_hook(unit: FSDPModule) -> bool:
    """Whether ``FSDPModule.set_all_reduce_hook`` gave ``unit`` a hook (it runs on the reduced shard at once)."""
    groups = param_groups_of(unit)
    return any(getattr(group, "_all_reduce_hook", None) is not None for group in groups)


def post_accumulate_grad_hooks(tensor: Tensor) -> bool:
    """Whether ``tensor`` has hooks from ``register_post_accumulate_grad_hook`` (FSDP2 runs them on each sharded
    parameter as soon as it assigns the reduced gradient; torch keeps them in a private field)."""
    return bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def queue_at_end_of_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the autograd backward now running finishes (before ``backward()`` returns), as FSDP2
    does for its own end-of-backward work (``Variable._execution_engine.queue_callback``, no public API). ``False``
    when no backward is running (the caller then does the work itself)."""
    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


def wrapped_local_tensor(tensor: Tensor) -> Tensor:
    """The plain tensor a ``DTensor`` wraps, itself (not a view): its storage is the ``DTensor``'s."""
    try:
        return tensor._local_tensor  # type: ignore[attr-defined]
    except AttributeError as error:
        raise RuntimeError(
            "This torch version's DTensor keeps no `_local_tensor` where lightning_parallel expects it (written for"
            " torch 2.11-2.13); ZeRO-1/2 cannot hold tensor-parallel weights in its buckets. Use"
            " `ShardedOptimizerStrategy(stage=3, tensor_parallel_size=...)`."
        ) from error


def run_step_post_hook_first(optimizer: Any, handle: Any) -> None:
    """Make the step post hook of ``handle`` (from ``optimizer.register_step_post_hook``) run before the others; where
    a torch release keeps them elsewhere it stays last (only a post hook reading the parameters would see aliases)."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if hooks is not None and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)
