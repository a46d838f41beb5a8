"""One decision on every rank when a loss is NaN or infinite.

Left alone, a non-finite loss on one rank is averaged into every rank's gradients and silently ruins the model on
all of them. Here each rank contributes "my loss is finite" to one all-reduce (MIN) per training step, and every
rank then takes the same decision:

* ``"skip"`` (default): every rank drops this step's update: backward still runs (Lightning forbids skipping it in
  distributed training, and every rank's collectives must match), then every gradient is dropped, so the optimizer
  changes neither parameters nor state (torch optimizers skip parameters without ``.grad``). A warning names the
  step; training goes on with the next batch.
* ``"stop"``: every rank raises ``FloatingPointError`` naming the step.
* ``"ignore"``: no check, no collective (the behaviour of plain DDP).

Applies to automatic optimization; under manual optimization check ``torch.isfinite(loss)`` yourself.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["NONFINITE_CHOICES", "NonFiniteLoss", "drop_gradients", "should_skip_step", "validate_nonfinite"]

NonFiniteLoss = Literal["skip", "stop", "ignore"]
NONFINITE_CHOICES: tuple[str, ...] = ("skip", "stop", "ignore")


def validate_nonfinite(policy: str) -> None:
    if policy not in NONFINITE_CHOICES:
        raise ValueError(
            f"`nonfinite_loss={policy!r}` is invalid. Valid options: 'skip' (every rank drops the step),"
            " 'stop' (every rank raises), 'ignore' (no check)."
        )


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


def should_skip_step(output: Any, *, policy: str, device: torch.device, step: int, world_size: int) -> bool:
    """Collective unless ``policy == "ignore"``. Whether every rank drops this step; raises for ``"stop"``."""
    if policy == "ignore":
        return False
    loss = _loss_of(output)
    finite = loss is None or bool(torch.isfinite(loss.detach()).all())
    if world_size > 1:
        flag = torch.tensor([int(finite)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        all_finite = bool(flag.item())
    else:
        all_finite = finite
    if all_finite:
        return False
    where = "this rank" if not finite else "another rank"
    if policy == "stop":
        raise FloatingPointError(
            f"The training loss at step {step} is NaN or infinite on {where}; every rank stops here"
            " (`nonfinite_loss='stop'`). Lower the learning rate, clip gradients, or use `nonfinite_loss='skip'`."
        )
    rank_zero_warn(f"The training loss at step {step} is NaN or infinite on some rank: every rank skips this step.")
    return True


def drop_gradients(tensors: Any) -> None:
    """Set ``.grad = None`` on every tensor, so the optimizer step leaves them and their state untouched."""
    for tensor in tensors:
        tensor.grad = None
