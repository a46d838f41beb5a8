"""ZeRO-3's collectives on gloo (``distributed/zero/stage3_gloo.py``, issue 23 item 2) against plain FSDP2.

Two forked gloo ranks hold the same model twice, sharded by ``zero3.apply_fully_shard``: once gathering through
:class:`GlooAllGather` (broadcasts) and reducing through :class:`GlooGradientReduction` (async all-reduce and
slice), once through FSDP2's own all-gather and reduce-scatter. After each
step both must hold the same weights and gradients, bit for bit (two ranks: a sum of two values, halved), in every
case where FSDP2 reads its output before backward ends (then the reduction must complete at once) and where it does
not (then it stays in flight, which the test observes: otherwise the overlap is gone and nothing would fail).
"""

from __future__ import annotations

from typing import Any

import torch
from distributed_harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.stage3_compat import initialise_root
from lightning_parallel.distributed.zero.stage3_gloo import (
    GlooAllGather,
    GlooGradientReduction,
    install_gloo_collectives,
)

WIDTH = 24
NUM_BLOCKS = 6


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Block() for _ in range(NUM_BLOCKS)))
        self.head = nn.Linear(WIDTH, 1)
        self.skip: int | None = None
        """A block the forward leaves out (a forward taking another path than the first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = x if index == self.skip else block(x)
        return self.head(x)


def _sharded(base: nn.Module, mesh: Any, reduction: GlooGradientReduction | None) -> nn.Module:
    model = _Model()
    model.load_state_dict(base.state_dict())
    units = zero3.apply_fully_shard(model, mesh)
    initialise_root(units[-1])
    if reduction is not None:
        GlooAllGather().install(units)
        reduction.install(units, replicated=False)
    return model


def _local(tensors: Any) -> list[torch.Tensor]:
    return [t.to_local().clone() for t in tensors]


def _start(rank: int, world_size: int) -> tuple[nn.Module, Any, list[torch.Tensor]]:
    """The model every rank starts from, the mesh, and this rank's batches."""
    torch.manual_seed(0)
    base = _Model()
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(rank)
    return base, mesh, [torch.randn(4, WIDTH, generator=generator) for _ in range(4)]


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    base, mesh, batches = _start(rank, world_size)
    results: dict[str, Any] = {}
    for case in ("deferred", "accumulating", "zeros_not_none", "post_accumulate_hook"):
        reduction = GlooGradientReduction(max_in_flight=2)
        ours, plain = _sharded(base, mesh, reduction), _sharded(base, mesh, None)
        seen_in_flight: list[int] = []
        # The first block's backward runs last: by then the later units' reductions were started.
        ours.blocks[0].register_full_backward_hook(
            lambda *_, seen=seen_in_flight, reduction=reduction: seen.append(reduction.in_flight)
        )
        hook_grads: dict[str, list[torch.Tensor]] = {"ours": [], "plain": []}
        steps = []
        for name, model in (("ours", ours), ("plain", plain)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
            if case == "post_accumulate_hook":  # reads the gradient as soon as FSDP2 assigns it
                head_weight = model.head.weight
                head_weight.register_post_accumulate_grad_hook(
                    lambda p, into=hook_grads[name]: into.append(p.grad.to_local().clone())
                )
            after_backward = []
            for step, inputs in enumerate(batches):
                backwards = 2 if case == "accumulating" else 1  # no zero_grad between: FSDP2 adds to `.grad`
                for _ in range(backwards):
                    model(inputs).square().mean().backward()
                    after_backward.append(reduction.in_flight if name == "ours" else 0)
                grads = _local(p.grad for p in model.parameters())
                optimizer.step()
                # zeros_not_none: `.grad` is None in steps 0-1, zeros from step 2 on
                optimizer.zero_grad(set_to_none=case != "zeros_not_none" or step == 0)
                steps.append((name, step, grads, _local(model.parameters())))
            if name == "ours":
                results.setdefault("after_backward", []).extend(after_backward)
        ours_steps = [s for s in steps if s[0] == "ours"]
        plain_steps = [s for s in steps if s[0] == "plain"]
        results[case] = {
            "equal": all(
                all(torch.equal(a, b) for a, b in zip(o[2] + o[3], p[2] + p[3], strict=True))
                for o, p in zip(ours_steps, plain_steps, strict=True)
            ),
            "in_flight_seen": seen_in_flight,  # at the first block's backward, one entry per backward
            "hooks_equal": all(torch.equal(a, b) for a, b in zip(hook_grads["ours"], hook_grads["plain"], strict=True))
            and len(hook_grads["ours"]) == len(hook_grads["plain"]),
            "hook_calls": len(hook_grads["ours"]),
        }
    return results


def test_zero3_gloo_reduction_equals_fsdp2_and_stays_in_flight_only_where_fsdp2_reads_nothing() -> None:
    for result in run_distributed(_rank, 2, timeout=120):
        for case in ("deferred", "accumulating", "zeros_not_none", "post_accumulate_hook"):
            assert result[case]["equal"], case
        # Overlap where FSDP2 reads nothing (`.grad` is None): reductions still in flight when the first block's
        # backward runs (at most 2); where FSDP2 adds to an existing `.grad` (the second backward without
        # `zero_grad`, zeros left by `zero_grad(set_to_none=False)`) each completed inside its call: none in flight.
        assert all(1 <= n <= 2 for n in result["deferred"]["in_flight_seen"]), result["deferred"]
        first, second = result["accumulating"]["in_flight_seen"][::2], result["accumulating"]["in_flight_seen"][1::2]
        assert all(n >= 1 for n in first) and set(second) == {0}, result["accumulating"]
        seen = result["zeros_not_none"]["in_flight_seen"]
        assert all(n >= 1 for n in seen[:2]) and seen[2:] == [0, 0], result["zeros_not_none"]
        assert result["post_accumulate_hook"]["hooks_equal"] and result["post_accumulate_hook"]["hook_calls"] == 4
        # Every backward returns with every reduction done: a hook or optimizer step after it reads final gradients.
        assert result["after_backward"] and set(result["after_backward"]) == {0}


def _prefetch_rank(rank: int, world_size: int) -> dict[str, Any]:
    base, mesh, batches = _start(rank, world_size)
    stats = CommunicationStats()
    ours = _Model()
    ours.load_state_dict(base.state_dict())
    units = zero3.apply_fully_shard(ours, mesh)
    initialise_root(units[-1])
    install_gloo_collectives(units, mesh.get_group(), replicated=False, stats=stats)
    plain = _sharded(base, mesh, None)
    # All-gathers issued when each block computes (inside its forward, after FSDP2's pre-forward), per forward.
    gathers: list[list[int]] = []
    for block in ours.blocks:
        block.linear.register_forward_hook(lambda *_: gathers[-1].append(stats.calls))
    steps = []
    for model in (ours, plain):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step, inputs in enumerate(batches):
            model.skip = 3 if step == 2 else None  # step 2: block 2 prefetches block 3, which does not run
            stats.reset()
            gathers.append([])
            model(inputs).square().mean().backward()
            grads = [torch.empty(0) if p.grad is None else p.grad.to_local().clone() for p in model.parameters()]
            steps.append((grads, _local(model.parameters())))
            optimizer.step()
            optimizer.zero_grad()
    ours_steps, plain_steps = steps[: len(batches)], steps[len(batches) :]
    equal = all(
        all(torch.equal(a, b) for a, b in zip(o[0] + o[1], p[0] + p[1], strict=True))
        for o, p in zip(ours_steps, plain_steps, strict=True)
    )
    return {"equal": equal, "gathers": gathers[: len(batches)]}


def test_zero3_gloo_prefetches_the_next_unit_in_forward_and_equals_fsdp2() -> None:
    """From the second forward on, each unit starts the next unit's all-gather before it computes (the order learned
    in the first forward), so the broadcasts overlap this unit's compute; a prefetched unit that the forward leaves
    out is harmless; weights and gradients equal plain FSDP2's bit for bit."""
    # Units: the blocks, the head, the root (no parameters of its own). Block i computes after gather i + 1.
    own = list(range(1, NUM_BLOCKS + 1))
    for result in run_distributed(_prefetch_rank, 2, timeout=120):
        assert result["equal"]
        first, second, skipping, fourth = result["gathers"]
        assert first == own  # the order is not known yet: each unit gathers at its own forward
        # The next unit's gather started before this one computes (the root started block 0's; the last block the
        # head's).
        assert second == fourth == [n + 1 for n in own]
        # Block 3 is left out: block 2 prefetched it (gather 4, unused), block 4 gathers at its own forward (5) and
        # prefetches block 5 (6).
        assert skipping == [2, 3, 4, 6, 7]
