"""Using a ZeRO-3 (FSDP2) module outside the training loop: the whole module on demand, and a clear error otherwise.

Outside ``trainer.fit/validate/test/predict`` a sharded module still all-gathers its parameters in every forward,
a collective that the other ranks do not join when code runs on one rank only (sampling, an evaluation on rank 0):
gloo then aborts with a collective mismatch or waits until the timeout. :class:`ShardedModuleAccess` turns that
into a ``RuntimeError`` raised before any collective, and :meth:`ShardedModuleAccess.full_parameters` gathers the
whole parameters once on every rank so that any rank may then call the module on its own.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_parallel.distributed.zero.stage3_compat import (
    is_initialised_root,
    propagate_requires_grad,
    reset_iteration,
    reshard_after_forward_disabled,
)

__all__ = ["ShardedModuleAccess", "reset_after_failure"]

_ATTRIBUTE = "_lightning_parallel_sharded_access"


class ShardedModuleAccess:
    """Guards the FSDP units of one sharded module: a forward is allowed while a Trainer runs the module
    (``running``) or inside :meth:`full_parameters`; anywhere else it raises before FSDP's all-gather.

    While the Trainer runs, the same hook carries a ``requires_grad`` change (unfreezing a backbone between steps) over
    to FSDP2's sharded parameters before the unit gathers them (see
    :func:`~lightning_parallel.distributed.zero.stage3_compat.propagate_requires_grad`). Attaching to a module replaces
    the guard a previous strategy left on it (a new Trainer, a second ``fit``).
    """

    def __init__(self, module: nn.Module, units: Sequence[nn.Module], *, world_size: int) -> None:
        self.module = module
        self.units = [unit for unit in units if isinstance(unit, FSDPModule)]
        self.world_size = world_size
        self.running = False
        self._full = False
        self._handles: list[RemovableHandle] = []
        previous = module.__dict__.get(_ATTRIBUTE)
        if previous is not None:
            previous.detach()
        module.__dict__[_ATTRIBUTE] = self
        for unit in self.units:  # prepend: before FSDP's own pre-forward hook, which all-gathers
            self._handles.append(unit.register_forward_pre_hook(self._check, prepend=True))

    def detach(self) -> None:
        """Remove the guard hooks (the module is handed to another strategy)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.module.__dict__.get(_ATTRIBUTE) is self:
            del self.module.__dict__[_ATTRIBUTE]

    def _check(self, unit: nn.Module, args: Any) -> None:
        assert isinstance(unit, FSDPModule)  # the hook is registered on FSDP units only
        if self.running:
            propagate_requires_grad(unit)  # a freeze/unfreeze since the last step trains as on one device
            return
        # FSDP2 swaps a sharded module's class for a subclass named `FSDP<Class>`: name the user's class.
        name = next(c for c in type(self.module).__mro__ if not c.__name__.startswith("FSDP")).__name__
        if not self._full:
            raise RuntimeError(
                f"`{name}` is sharded across {self.world_size} ranks by ZeRO-3 (`ShardedOptimizerStrategy(stage=3)`)"
                " and is called outside `trainer.fit/validate/test/predict`: its forward would all-gather parameters"
                " with ranks that are not calling it (a hang or a gloo collective mismatch). Enter"
                " `with trainer.strategy.full_module():` on every rank first (it gathers the whole parameters once;"
                " inside it any rank may call the module on its own), or use `trainer.predict`/`trainer.validate`."
            )
        if any(isinstance(param, DTensor) for param in unit.parameters()):
            raise RuntimeError(
                f"`{name}` was resharded inside `trainer.strategy.full_module()` (`state_dict()`, `load_state_dict()`"
                " and `.to()` reshard an FSDP2 module), so calling it would need the other ranks again. Call the"
                " module only; take weights with `trainer.strategy.consolidated_state_dict()` outside the block."
            )

    @contextmanager
    def full_parameters(self) -> Generator[nn.Module, None, None]:
        """Collective on entry (every rank, same order): all-gather every unit's parameters and keep them whole
        until exit, so any rank may call the module alone in between. Exit is local: it frees the whole
        parameters (changes made to them inside are dropped)."""
        for unit in self.units:
            unit.unshard()
        self._full = True
        try:
            with reshard_after_forward_disabled(self.units):
                yield self.module
        finally:
            self._full = False
            for unit in self.units:
                unit.reshard()


def reset_after_failure(units: Sequence[nn.Module]) -> None:
    """Local (no collective): after an exception mid forward/backward, put FSDP back in its idle, sharded state so
    that tearing down (``module.cpu()``) does not fail on the half-finished step and hide the real error."""
    for unit in units:
        # A non-root unit is reset by its root; one that never ran a forward holds nothing unsharded.
        if isinstance(unit, FSDPModule) and is_initialised_root(unit):
            reset_iteration(unit)
