"""The :class:`ZeroBackend` protocol: the gradient sync plus holding the module, one implementation chosen per run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.distributed.checkpoint import ShardedPieces
from lightning_parallel.distributed.gradient_sync import GradientSync
from lightning_parallel.distributed.zero.backends.context import ZeroContext
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.gradient_loan import GradientLoan

__all__ = ["ZeroBackend"]


class ZeroBackend(GradientSync, Protocol):
    """How the model, its gradients and the optimizers' state are held and synchronised; built once per ``setup``.

    The gradient sync is :class:`~lightning_parallel.distributed.gradient_sync.GradientSync` (``no_sync``,
    ``reduce_gradients``, ``clip_grad_norm_``, ``after_optimizer_step``, ``wait_for_parameters``,
    ``gradient_buffers``, ``memory_report``, ``abandon_in_flight``, ``teardown``); a ZeRO backend also holds the
    module and the optimizers' state: the methods below. A pipeline stage is held by the same backends
    (``ZeroContext.stage``); its stage-keyed checkpoint state is read over them by ``distributed/pipeline/run.py``
    (``stage_optimizer_state``: the same name always means the same thing). Torch-only: the strategy reaches
    Lightning's precision plugin through ``strategies/zero_precision.py``, which reads :attr:`clips_over_ranks` and
    :attr:`shards_gradients`.
    """

    empty_init_on_meta: ClassVar[bool]
    """Whether ``init_module(empty_init=True)`` creates the model on the meta device (materialised in setup)."""
    collective_tap: ClassVar[Literal["fsdp"] | None]
    """Collectives issued by code we do not own that a monitor must tap to count (FSDP2's), else ``None``."""
    shards_gradients: ClassVar[bool]
    """Whether each rank checks only a shard of the gradients for inf/nan, so that a grad scaler's check must agree
    across ranks (torch's ``ShardedGradScaler``)."""
    shards_parameters: ClassVar[bool]
    """Whether the held module's parameters become ``DTensor`` shards (stage 3: FSDP2 changes the module's class and
    hooks for good, so a pipeline shards copies of its stage's layers)."""

    compute_dtype: torch.dtype | None
    """The 16-bit dtype the held parameters compute in while they are stored as fp32 master weights (stage 3), else
    ``None`` (the parameters are what the model computes with)."""

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None: ...

    @property
    def times_exposed_communication(self) -> bool:
        """Whether the gradient sync waits run in our code, inside ``events.timed("exposed_communication")``."""

    @property
    def clips_over_ranks(self) -> bool:
        """Whether clipping must go through :meth:`clip_grad_norm_` (the gradients are in our buckets, which a clip
        over the parameters' ``.grad`` would not see); otherwise torch's clip over the parameters does the same."""

    def convert_module(self, module: nn.Module, *, convert: Callable[[nn.Module], object]) -> None:
        """Local. ``convert(module)``, the precision plugin's ``convert_module`` (``bf16-true`` casts it), before
        ``setup_module``."""

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        """Collective. Start from rank 0's weights, shard if this backend does, and move to ``device``."""

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Collective. Point the (unwrapped) optimizers at what this rank holds, before their first step."""

    def after_evaluation_step(self) -> None:
        """Local. After a validation step: leave the parameters as training holds them between steps (the callbacks
        that run next may read or swap them)."""

    def model_state(self) -> dict[str, Any]:
        """Collective. The whole model's plain state dict (complete on rank 0)."""

    def load_model_state(self, state: Any, *, strict: bool) -> None:
        """Collective. Load a plain state dict or a :class:`ShardedCheckpointReader`."""

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective. ``optimizer``'s plain (unsharded) state dict of what this backend's ranks hold together,
        complete on the first of them (``{}`` or partial elsewhere)."""

    def load_optimizer_state(self, optimizer: Optimizer, state: Any) -> None:
        """Local or collective (per implementation). Load a plain state dict as :meth:`optimizer_state` returns it,
        or a :class:`ShardedCheckpointReader`: each rank keeps what it holds of it."""

    def sharded_pieces(self, optimizer: Optimizer | None) -> ShardedPieces:
        """What this rank writes into a sharded checkpoint (one optimizer at most)."""

    def lend_gradients(self, *, synced: bool) -> GradientLoan | None:
        """After :meth:`reduce_gradients` (``synced``: the gradients were averaged over ranks; else a micro-step of
        gradient accumulation): give every parameter that has a gradient the ``.grad`` DDP would hold, for hooks to
        read, until the loan's ``hand_back()`` (``distributed/zero/gradient_loan.py``). Collective when ``synced``
        and sharding. ``None`` where ``.grad`` already is that."""

    def parameters_stepped_by(self, optimizer: Optimizer) -> list[nn.Parameter]:
        """Local. The module's parameters ``optimizer`` steps (the ones whose ``.grad`` a loan lends its gradients
        through), in its order."""

    def full_module(self) -> AbstractContextManager[nn.Module]:
        """Collective on entry: the whole module on every rank until exit (also after ``teardown``)."""
