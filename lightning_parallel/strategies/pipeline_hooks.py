"""The whole model in the LightningModule's own hooks under ``PipelineParallelStrategy``.

While a pipeline runs, each rank's module holds only its stages, so a hook that reads the model (Lightning's
``grad_norm(self)`` in ``on_before_optimizer_step``, a weight norm in ``on_train_batch_end``) would log one stage.
:class:`HookWindows` opens :class:`~lightning_parallel.distributed.pipeline.whole_model_view.WholeModelView` around the
module's hooks that the user overrides (``is_overridden``; nobody else pays), on every rank, and closes it after:

* ``on_after_backward``: inside the strategy's ``backward``, around the precision plugin's ``post_backward`` (which
  calls the callbacks' and the module's hook); gradients as one device holds them (the replicas' average, the tied
  copies' sum), computed by the view: the stage's own ``.grad`` is only reduced later, in ``optimizer_step``.
* ``on_before_optimizer_step``: opened by the strategy's closure once the gradients are reduced, closed when the
  optimizer step returns (the precision plugin calls the hooks, then clipping, then the step, in between); the
  stage's own ``.grad`` is what the hook sees and writes.
* The weight-only hooks (``on_train_batch_start/end``, ``on_train_epoch_start/end``,
  ``on_validation_batch_start/end``, ``on_validation_epoch_start/end`` and their ``test`` twins): Lightning calls the
  callbacks' hook, then the module's. A callback we add last opens the view; one we add first closes it at the next
  callback event, and the strategy closes it where it acts next (its own ``on_train_batch_start``, the steps,
  checkpoints, teardown, an exception), so the view never outlives the next thing that needs the split.

Callbacks' hooks see the split module (they run before the view opens), except in ``on_after_backward`` and
``on_before_optimizer_step`` when the module overrides that hook (they run inside the window then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_parallel.distributed.pipeline.whole_model_view import GradientMode, HookCost, OpenView, WholeModelView

__all__ = ["GRADIENT_HOOKS", "WEIGHT_HOOKS", "HookWindows"]

GRADIENT_HOOKS: dict[str, GradientMode] = {"on_after_backward": "local", "on_before_optimizer_step": "reduced"}
"""Hooks whose view holds gradients, and how the stage's ``.grad`` stands when they run."""

WEIGHT_HOOKS = tuple(
    f"on_{stage}_{scope}_{edge}"
    for stage in ("train", "validation", "test")
    for scope in ("batch", "epoch")
    for edge in ("start", "end")
)
"""Hooks that see the whole model's weights and buffers (opened by the last callback)."""


class HookWindows:
    """Opens and closes the whole-model view around the module's overridden hooks (one per strategy)."""

    def __init__(self) -> None:
        self._view: WholeModelView | None = None
        self._hooks: frozenset[str] = frozenset()
        self._open: OpenView | None = None
        self._callbacks: list[_HookWindowCallback] = []
        self._trainer: Any = None
        self.last_cost: HookCost | None = None
        """What the last open exchanged on this rank (bytes, collectives, bytes held)."""

    def attach(self, trainer: Any, module: Any, make_view: Callable[[], WholeModelView], *, shards: bool) -> None:
        """Local. Watch the hooks ``module`` overrides. The view is exact where every replica holds its stage's
        parameters and gradients whole (``zero_stage=0``, or no data parallelism); where the stage's backend
        ``shards`` its gradients (``ZeroBackend.shards_gradients``) a warning on rank 0 names the hooks, which then see
        this rank's stage only."""
        self.detach()
        hooks = frozenset(h for h in (*GRADIENT_HOOKS, *WEIGHT_HOOKS) if is_overridden(h, module))
        if not hooks:
            return
        if shards:
            rank_zero_warn(
                f"`{type(module).__name__}` overrides {', '.join(sorted(hooks))}: with `zero_stage` > 0 and data"
                " parallelism, PipelineParallelStrategy does not gather the whole model for these hooks, so they see"
                " only this rank's stage (and its shards), not the model one device holds. Use `zero_stage=0` to read"
                " the whole model's weights and gradients there."
            )
            return
        self._view, self._hooks, self._trainer = make_view(), hooks, trainer
        if hooks - set(GRADIENT_HOOKS):
            self._callbacks = [_HookWindowCallback(self, opens=False), _HookWindowCallback(self, opens=True)]
            trainer.callbacks.insert(0, self._callbacks[0])
            trainer.callbacks.append(self._callbacks[1])

    def detach(self) -> None:
        """Local. Close the view and remove the callbacks (teardown)."""
        self.close()
        for callback in self._callbacks:
            if callback in self._trainer.callbacks:
                self._trainer.callbacks.remove(callback)
        self._callbacks, self._view, self._hooks, self._trainer = [], None, frozenset(), None

    def open(self, hook: str) -> None:
        """Collective when ``hook`` is watched (every rank reaches the same hooks in the same order)."""
        self.close()
        if self._view is not None and hook in self._hooks:
            self._open = self._view.open(GRADIENT_HOOKS.get(hook, "none"))
            self.last_cost = self._open.cost

    def close(self) -> None:
        """Local; idempotent."""
        view, self._open = self._open, None
        if view is not None:
            view.close()

    @contextmanager
    def window(self, hook: str) -> Iterator[None]:
        self.open(hook)
        try:
            yield
        finally:
            self.close()


class _HookWindowCallback(Callback):
    """Added first (``opens=False``: closes the view at every event) and last (``opens=True``: opens it right
    before the module's hook, if overridden)."""

    def __init__(self, windows: HookWindows, *, opens: bool) -> None:
        self.windows, self.opens = windows, opens

    @property
    def state_key(self) -> str:
        return f"PipelineHookWindow[opens={self.opens}]"

    def _at(self, hook: str) -> None:
        if self.opens and hook in WEIGHT_HOOKS:
            self.windows.open(hook)
        else:
            self.windows.close()

    # Lightning calls each as ``hook(trainer, pl_module, *args)``; the arguments do not matter here.
    def on_train_batch_start(self, *args: Any) -> None:
        self._at("on_train_batch_start")

    def on_train_batch_end(self, *args: Any) -> None:
        self._at("on_train_batch_end")

    def on_train_epoch_start(self, *args: Any) -> None:
        self._at("on_train_epoch_start")

    def on_train_epoch_end(self, *args: Any) -> None:
        self._at("on_train_epoch_end")

    def on_validation_start(self, *args: Any) -> None:
        self._at("on_validation_start")

    def on_validation_end(self, *args: Any) -> None:
        self._at("on_validation_end")

    def on_validation_batch_start(self, *args: Any) -> None:
        self._at("on_validation_batch_start")

    def on_validation_batch_end(self, *args: Any) -> None:
        self._at("on_validation_batch_end")

    def on_validation_epoch_start(self, *args: Any) -> None:
        self._at("on_validation_epoch_start")

    def on_validation_epoch_end(self, *args: Any) -> None:
        self._at("on_validation_epoch_end")

    def on_test_start(self, *args: Any) -> None:
        self._at("on_test_start")

    def on_test_end(self, *args: Any) -> None:
        self._at("on_test_end")

    def on_test_batch_start(self, *args: Any) -> None:
        self._at("on_test_batch_start")

    def on_test_batch_end(self, *args: Any) -> None:
        self._at("on_test_batch_end")

    def on_test_epoch_start(self, *args: Any) -> None:
        self._at("on_test_epoch_start")

    def on_test_epoch_end(self, *args: Any) -> None:
        self._at("on_test_epoch_end")

    def on_train_end(self, *args: Any) -> None:
        self._at("on_train_end")
