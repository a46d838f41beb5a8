"""One decision on every rank when a loss is NaN or infinite.

Left alone, a non-finite loss on one rank is averaged into every rank's gradients and silently ruins the model on
all of them. Here each rank contributes "my loss is finite" to one all-reduce (MIN) per training step, launched
asynchronously before backward and awaited after it (so it overlaps backward), and every rank then takes the same
decision:

* ``"skip"`` (default): every rank drops this step's update: backward still runs (Lightning forbids skipping it in
  distributed training, and every rank's collectives must match), then every gradient is dropped, so the optimizer
  changes neither parameters nor state (torch optimizers skip parameters without ``.grad``). A warning names the
  step; training goes on with the next batch.
* ``"stop"``: every rank raises ``FloatingPointError`` naming the step.
* ``"ignore"``: no check, no collective (the behaviour of plain DDP).

Applies to automatic optimization; under manual optimization check ``torch.isfinite(loss)`` yourself.

Cost: ``"skip"`` and ``"stop"`` read one value on the host per step, as torch's ``GradScaler`` does under fp16
(``_maybe_opt_step``'s ``found_inf.item()``): dropping the gradients, so that any torch optimizer leaves the parameters
and its state alone, is a decision of the host, and the device cannot take it (zeroing the gradients with
``torch.where`` would still decay momentum, apply weight decay and count the step). On CUDA the read does not drain
the device's queue: the verdict is copied to pinned host memory on a side stream right after the forward (the copy
waits only for the loss and its all-reduce), and the host, after backward, waits for that copy's event, which the GPU
passed long before (backward keeps running, and the host goes on queueing the optimizer step). Elsewhere (CPU) the
read is of a tensor already on the host. ``"ignore"`` reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_parallel.choices import check_choice

__all__ = [
    "FiniteCheck",
    "HostCopy",
    "NonFiniteLoss",
    "drop_gradients",
    "start_finite_check",
    "validate_nonfinite",
]

NonFiniteLoss = Literal["skip", "stop", "ignore"]


def validate_nonfinite(policy: object) -> None:
    check_choice(
        "nonfinite_loss",
        policy,
        NonFiniteLoss,
        notes={"skip": "every rank drops the step", "stop": "every rank raises", "ignore": "no check"},
    )


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


@dataclass
class FiniteCheck:
    """One step's "is every rank's loss finite?" all-reduce, launched before backward and read after it.

    The flag is computed on the loss's device and all-reduced asynchronously, so neither the check nor the collective
    stalls the step: on CUDA no host sync between forward and backward (the CPU keeps queuing backward kernels), on
    gloo the all-reduce runs in gloo's thread while backward computes. It is awaited in ``post_backward``.
    """

    policy: str
    step: int
    finite_here: Tensor
    """This rank's verdict (int32, 1 = finite), on the loss's device."""
    all_finite: Tensor
    """The MIN over ranks once :attr:`work` completed (the same tensor as ``finite_here`` at world size 1)."""
    work: Any = None
    on_host: HostCopy | None = None
    """CUDA: ``[all_finite, finite_here]`` being copied to pinned host memory (see the module docstring)."""

    def should_skip(self) -> bool:
        """Wait for the all-reduce; whether every rank drops this step. Raises ``FloatingPointError`` for ``"stop"``.

        The one host read of the step (module docstring: the decision is the host's); on CUDA of a host copy made
        right after the forward, so it does not wait for backward."""
        if self.on_host is not None:
            all_finite, finite_here = self.on_host.read()
        else:
            if self.work is not None:
                self.work.wait()
            all_finite, finite_here = torch.cat([self.all_finite, self.finite_here]).tolist()
        if all_finite:
            return False
        where = "this rank" if not finite_here else "another rank"
        if self.policy == "stop":
            raise FloatingPointError(
                f"The training loss at step {self.step} is NaN or infinite on {where}; every rank stops here"
                " (`nonfinite_loss='stop'`). Lower the learning rate, clip gradients, or use `nonfinite_loss='skip'`."
            )
        rank_zero_warn(
            f"The training loss at step {self.step} is NaN or infinite on some rank: every rank skips this step."
        )
        return True


class HostCopy:
    """CUDA: ``values`` (int32, on the device) copied to pinned host memory on a side stream once ``work`` (an
    asynchronous NCCL collective that wrote them, or ``None``) completed, without making the current stream wait for
    anything; :meth:`read` waits for that copy only, not for what the current stream queued after it."""

    def __init__(self, values: list[Tensor], *, work: Any) -> None:
        device = values[0].device
        stream = torch.cuda.Stream(device)  # one of torch's pooled side streams: nothing is created per step
        stream.wait_stream(torch.cuda.current_stream(device))  # the loss and its flag are computed first
        self.host = torch.empty(len(values), dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(stream):
            if work is not None:
                work.wait()  # NCCL: the side stream (the current one here) waits for the all-reduce, the host does not
            self.host.copy_(torch.cat(values), non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(stream)
        # `values` stay referenced by the check until `read`, which follows the event: their memory is not reused first.

    def read(self) -> list[int]:
        self.done.synchronize()
        return self.host.tolist()


def start_finite_check(
    output: Any, *, policy: str, device: torch.device, step: int, world_size: int
) -> FiniteCheck | None:
    """Collective (asynchronous) unless ``policy == "ignore"`` (then ``None``): launch the check of this step's loss.
    Every rank must call it once per training step and later call :meth:`FiniteCheck.should_skip`."""
    if policy == "ignore":
        return None
    loss = _loss_of(output)
    if loss is None:
        finite = torch.ones(1, dtype=torch.int32, device=device)
    else:
        finite = torch.isfinite(loss.detach()).all().to(device=device, dtype=torch.int32).reshape(1)
    all_finite, work = finite, None
    if world_size > 1:
        all_finite = finite.clone()
        work = dist.all_reduce(all_finite, op=dist.ReduceOp.MIN, async_op=True)
    on_host = HostCopy([all_finite, finite], work=work) if finite.device.type == "cuda" else None
    return FiniteCheck(policy=policy, step=step, finite_here=finite, all_finite=all_finite, work=work, on_host=on_host)


def drop_gradients(tensors: Any) -> None:
    """Set ``.grad = None`` on every tensor, so the optimizer step leaves them and their state untouched."""
    for tensor in tensors:
        tensor.grad = None
