"""The optimizer step on local shards (``distributed/zero/local_step.py``) against torch's step of the ``DTensor``
parameters.

Two forked gloo ranks shard the same model twice with FSDP2; one optimizer steps through :class:`LocalShardStep`,
the other as torch does. After every step the weights, the gradients and every state entry must be equal bit for bit,
the state entries ``DTensor`` of the parameter's placements exactly where torch's are (the scalar ``step`` plain), the
parameter groups hold the ``DTensor`` parameters again, and ``state_dict()`` has the same keys. Covered: each
optimizer of the list with and without state (the first step creates it), a closure (Lightning's way) and none (a
grad scaler's), an uneven shard (a rank with fewer rows), a frozen parameter (no gradient), a user's post hook that
reads the parameters, a step that raises (everything put back), and optimizers the step leaves alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from test_zero3_gloo import WIDTH, _Block
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.local_step import ELEMENTWISE_OPTIMIZERS, LocalShardStep, local_shard_steps
from lightning_parallel.distributed.zero.stage3_compat import initialise_root


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(WIDTH, 3)  # 3 rows over 2 ranks: an uneven shard
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x) + self.frozen(x))


_OPTIONS: dict[type, dict[str, Any]] = {
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    torch.optim.Adam: {"lr": 0.05, "weight_decay": 0.01},
    torch.optim.AdamW: {"lr": 0.05},
    torch.optim.RAdam: {"lr": 0.05, "decoupled_weight_decay": True, "weight_decay": 0.1},
}


class _CountingStep(LocalShardStep):
    """Counts the steps whose update ran on the aliases."""

    swapped_steps = 0

    def swap_in(self) -> None:
        super().swap_in()
        self.swapped_steps += self._params is not None


def _sharded(base: nn.Module, mesh: Any) -> nn.Module:
    model = _Model()
    model.load_state_dict(base.state_dict())
    units = zero3.apply_fully_shard(model, mesh)
    initialise_root(units[-1])
    return model


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local().clone() if isinstance(tensor, DTensor) else tensor.clone()


def _state_facts(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every state entry: key, whether a DTensor (and its placements), and its local values."""
    facts = []
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            placed = isinstance(value, DTensor)
            facts.append((key, placed, value.placements if placed else None, _local(value)))
    return facts


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, (tuple, list)):
            if not _same(list(x), list(y)):
                return False
        elif x != y:
            return False
    return True


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], closure: bool) -> list[Any]:
    record = []
    for inputs in batches:
        optimizer.zero_grad()
        if closure:

            def step_closure(inputs: torch.Tensor = inputs) -> torch.Tensor:
                loss = model(inputs).square().mean()
                loss.backward()
                return loss

            optimizer.step(step_closure)
        else:
            model(inputs).square().mean().backward()
            optimizer.step()
        params = [_local(p) for p in model.parameters()]
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        record.append((params, grads, _state_facts(optimizer)))
    return record


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = _Model()
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, WIDTH, generator=generator) for _ in range(3)]
    results: dict[str, Any] = {}
    for optimizer_class, options in _OPTIONS.items():
        for closure in (True, False):
            ours_model, torch_model = _sharded(base, mesh), _sharded(base, mesh)
            ours = optimizer_class(ours_model.parameters(), **options)
            theirs = optimizer_class(torch_model.parameters(), **options)
            post_hook_saw: list[bool] = []
            # A user's post hook registered before ours (an EMA): it must see the DTensor parameters.
            ours.register_step_post_hook(
                lambda opt, *_, seen=post_hook_saw: seen.append(
                    all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
                )
            )
            assert LocalShardStep.applies_to(ours)
            step = _CountingStep(ours)
            mine, reference = _train(ours_model, ours, batches, closure), _train(torch_model, theirs, batches, closure)
            name = f"{optimizer_class.__name__}, closure={closure}"
            results[name] = {
                "equal": all(_same(list(a), list(b)) for a, b in zip(mine, reference, strict=True)),
                "post_hook_saw_dtensors": post_hook_saw == [True] * len(batches),
                "groups_restored": [p for g in ours.param_groups for p in g["params"]] == list(ours_model.parameters()),
                "state_keys": list(ours.state_dict()["state"]) == list(theirs.state_dict()["state"]),
                "aliases_gone": not step._swapped and step._params is None,
                "swapped_steps": step.swapped_steps,
            }
            step.remove()
    # A step that raises after the swap (in the update): everything put back, the next step as torch's.
    model = _sharded(base, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    (step,) = local_shard_steps([optimizer])
    model(batches[0]).square().mean().backward()

    optimizer.param_groups[0]["lr"] = "not a number"  # the update raises, after the swap
    with pytest.raises(TypeError):
        optimizer.step()
    swapped_when_it_failed = step._params is not None
    optimizer.param_groups[0]["lr"] = 0.05
    optimizer.step()  # the next step puts them back first
    results["restored_after_failure"] = (
        swapped_when_it_failed
        and all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
        and not any(isinstance(k, torch.Tensor) and not isinstance(k, DTensor) for k in optimizer.state)
    )
    # Left alone: an optimizer not in the list (a subclass of one in it, LBFGS), fused kernels, plain parameters.

    class _MyAdamW(torch.optim.AdamW):
        pass

    left_alone = [
        _MyAdamW(model.parameters(), lr=0.1),
        torch.optim.LBFGS(model.parameters()),
        torch.optim.AdamW(nn.Linear(2, 2).parameters()),
    ]
    results["left_alone"] = [LocalShardStep.applies_to(o) for o in left_alone]
    return results


def test_local_shard_step_equals_torchs_dtensor_step_bit_for_bit() -> None:
    for result in run_distributed(_rank, 2, timeout=120):
        for name in (f"{c.__name__}, closure={b}" for c in _OPTIONS for b in (True, False)):
            assert result[name] == {
                "equal": True,
                "post_hook_saw_dtensors": True,
                "groups_restored": True,
                "state_keys": True,
                "aliases_gone": True,
                "swapped_steps": 3,
            }, name
        assert result["restored_after_failure"]
        assert result["left_alone"] == [False, False, False]


def test_the_list_is_torchs_elementwise_optimizers() -> None:
    assert all(issubclass(c, torch.optim.Optimizer) for c in ELEMENTWISE_OPTIMIZERS)
    assert torch.optim.LBFGS not in ELEMENTWISE_OPTIMIZERS
