"""Refuse to fork the training ranks from a process that already holds a CUDA context.

A process forked after CUDA was initialised cannot use CUDA at all: torch raises "Cannot re-initialize CUDA in
forked subprocess" in the child, deep inside ``trainer.fit``. That happens with CUDA ranks, and also with CPU ranks on
a machine with visible GPUs: every ``fit`` starts with Lightning's ``isolate_rng()``, which reads each GPU's RNG
state. In a notebook the only cure is a
kernel restart, so the launcher checks before it forks and says so.

Lightning's own ``_check_bad_cuda_fork`` (its launcher still runs it, after ours) does not catch this case: on every
torch that has ``torch.cuda._is_in_bad_fork`` (all we support) it asks only that, which is true in a child that was
*already* forked after CUDA was initialised, not in the parent about to fork. We check ``torch.cuda.is_initialized()``
in the parent instead.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_parallel._compat import MultiProcessingLauncher

__all__ = ["CUDA_BEFORE_FORK_MESSAGE", "ForkSafeLauncher", "check_cuda_before_fork"]

CUDA_BEFORE_FORK_MESSAGE = (
    "CUDA was initialised in this process before `trainer.fit` forked the training processes"
    " (`start_method='fork'`, the `*_notebook` strategies). A forked process cannot use CUDA: the ranks would fail"
    " with 'Cannot re-initialize CUDA in forked subprocess' (CPU ranks too when GPUs are visible: Lightning reads"
    " their random state when `fit` starts). Something in this process created the CUDA context: a tensor or model"
    " moved to a GPU, `torch.cuda.synchronize()`, `torch.cuda.memory_allocated()`, an earlier run on the GPU, ..."
    " To fix it: restart the Python (Jupyter) kernel and do not touch CUDA before `trainer.fit` (let the strategy move"
    " the model), or use `start_method='spawn'` (e.g. `strategy='data_parallel_spawn'`; the module must be"
    " picklable), or run a script with the default `start_method='popen'`."
)
"""The error raised when CUDA is initialised in the process about to fork."""


def _cuda_is_initialized() -> bool:
    """Whether this process holds a CUDA context (the one place the check reads torch's state)."""
    return torch.cuda.is_initialized()


def check_cuda_before_fork(start_method: str, *, cuda_initialized: bool | None = None) -> None:
    """Raise ``RuntimeError`` if ``start_method`` forks and this process has already initialised CUDA.

    Args:
        start_method: The launcher's start method; only ``"fork"`` and ``"forkserver"`` are checked (``"spawn"``
            and ``"popen"`` start fresh interpreters, which may use CUDA whatever the parent did).
        cuda_initialized: The fact to judge; ``None`` (the default) reads ``torch.cuda.is_initialized()``.

    Raises:
        RuntimeError: :data:`CUDA_BEFORE_FORK_MESSAGE`, naming the cause and the fixes.
    """
    if start_method not in ("fork", "forkserver"):
        return
    if cuda_initialized is None:
        cuda_initialized = _cuda_is_initialized()
    if cuda_initialized:
        raise RuntimeError(CUDA_BEFORE_FORK_MESSAGE)


class ForkSafeLauncher(MultiProcessingLauncher):
    """Lightning's fork/spawn launcher that first runs :func:`check_cuda_before_fork`.

    Every strategy of this package uses it (or :class:`~lightning_parallel.strategies.launch.ConsolidatingLauncher`,
    a subclass) for ``start_method="fork"`` and ``"spawn"``.
    """

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        check_cuda_before_fork(self._start_method)
        return super().launch(function, *args, trainer=trainer, **kwargs)
