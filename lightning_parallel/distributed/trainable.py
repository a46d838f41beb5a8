"""The same trainable parameters on every rank, checked with one small collective that every rank reaches.

Data parallel training of any kind (DDP, ZeRO's buckets, FSDP2) averages the gradients of the parameters that
require grad, so every rank must agree on which those are. Code that sets ``requires_grad`` on one rank only
(``if self.global_rank == 0: layer.requires_grad_(False)``) breaks that silently or at a distance: DDP's re-wrap
fails inside torch's cross-rank check, ZeRO-1/2 trains the "frozen" layer on the other ranks' gradients, FSDP2
reduce-scatters gradients of different layouts, and a rank may wait for a collective its peer never starts.

:func:`check_same_trainable_parameters` compares a fingerprint of the ``requires_grad`` flags across ranks (one
all-reduce of two integers); only when they differ does it gather the names, so the error can say which parameters
are trainable on which ranks. Every rank raises the same error at the same point, before any collective that
depends on the flags.

The flags are host facts, so the check runs on the host: over a CPU (gloo) group of CPU tensors
(``distributed/host_groups.py``), it never waits for the device (over NCCL it would copy the fingerprint to the GPU
and read the result back, waiting twice for everything queued before it). It still runs every step: a rank that
alone changed its flags cannot know whether the others did without asking them, and skipping the exchange when the
local flags are unchanged would leave the ranks that changed them waiting in a collective the others never start.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_same_trainable_parameters", "check_same_trainable_parameters_within", "disagreement_message"]

_SHOWN = 8  # parameter names listed per group in the error


def check_same_trainable_parameters(
    module: nn.Module,
    *,
    owner: str,
    group: dist.ProcessGroup,
    flags: Sequence[bool] | None = None,
) -> None:
    """Collective over ``group``. Raise ``RuntimeError`` on every rank when the ranks disagree on which of
    ``module``'s parameters require grad, naming them and the ranks.

    Args:
        module: the module every rank trains (its parameter names must be the same on every rank).
        owner: how the error names the caller (``"DataParallelStrategy"``).
        group: a CPU (gloo) group of the ranks that average gradients together (``HostGroups``); the fingerprint
            travels as a CPU tensor, so no device is waited for.
        flags: ``requires_grad`` of ``module.parameters()`` in order, if the caller already read them (a caller that
            checks every step keeps the parameters in a tuple instead of walking the module each time).
    """
    if flags is None:
        flags = [param.requires_grad for param in module.parameters()]
    fingerprint = _fingerprint(flags)
    # The maximum of the fingerprint and of its negation (= minus the minimum): equal on every rank only if the
    # fingerprints all are (two integers; the names travel only when they differ).
    extremes = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, negated_lowest = extremes.tolist()  # a host tensor: no device sync
    if highest == -negated_lowest:
        return
    layouts: list[list[tuple[str, bool]] | None] = [None] * dist.get_world_size(group)
    layout = [(name, param.requires_grad) for name, param in module.named_parameters()]
    dist.all_gather_object(layouts, layout, group=group)
    raise RuntimeError(disagreement_message([layout or [] for layout in layouts], owner=owner))


def check_same_trainable_parameters_within(
    module: nn.Module,
    *,
    cohorts: Sequence[int],
    owner: str,
    group: dist.ProcessGroup,
    flags: Sequence[bool] | None = None,
) -> None:
    """Collective over ``group``, a CPU (gloo) group of every rank. Raise ``RuntimeError`` on every rank when the
    ranks of one cohort (those with the same ``cohorts[rank]``: the data-parallel replicas of one pipeline stage,
    which hold the same parameters and average their gradients) disagree on which of ``module``'s parameters require
    grad.

    The check spans every rank, not only each cohort, so that the ranks of the other stages raise too instead of
    waiting in the pipeline's schedule for a stage that left. One all-gather of one integer per rank, on the host;
    the names travel only when a cohort disagrees.
    """
    if flags is None:
        flags = [param.requires_grad for param in module.parameters()]
    world_size = dist.get_world_size(group)
    if len(cohorts) != world_size:
        raise ValueError(f"`cohorts` names {len(cohorts)} ranks; the world has {world_size}.")
    mine = torch.tensor([_fingerprint(flags)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    fingerprints = torch.cat(gathered).tolist()  # host tensors: no device sync
    members: dict[int, list[int]] = {}
    for rank, cohort in enumerate(cohorts):
        members.setdefault(cohort, []).append(rank)
    disagreeing = [ranks for ranks in members.values() if len({fingerprints[rank] for rank in ranks}) > 1]
    if not disagreeing:
        return
    layouts: list[list[tuple[str, bool]] | None] = [None] * world_size
    named = [(name, param.requires_grad) for name, param in module.named_parameters()]
    dist.all_gather_object(layouts, named, group=group)
    messages = [
        disagreement_message([layouts[rank] or [] for rank in ranks], owner=owner, ranks=ranks) for ranks in disagreeing
    ]
    raise RuntimeError(" ".join(messages))


def disagreement_message(
    layouts: list[list[tuple[str, bool]]], *, owner: str, ranks: Sequence[int] | None = None
) -> str:
    """The error for per-rank ``(name, requires_grad)`` layouts that differ: each set of parameters with the same
    pattern, with the ranks where they are trainable and those where they are frozen (or absent). ``ranks``: the
    global rank of each layout (default: its position)."""
    world_size = len(layouts)
    label = list(ranks) if ranks is not None else list(range(world_size))
    by_rank = [dict(layout) for layout in layouts]
    names = list(dict.fromkeys(name for layout in layouts for name, _ in layout))
    patterns: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for name in names:
        flags = [flags_of.get(name) for flags_of in by_rank]
        if len(set(flags)) == 1:
            continue
        trainable = tuple(label[rank] for rank in range(world_size) if flags[rank] is True)
        frozen = tuple(label[rank] for rank in range(world_size) if flags[rank] is False)
        absent = tuple(label[rank] for rank in range(world_size) if flags[rank] is None)
        patterns.setdefault((trainable, frozen, absent), []).append(name)
    parts = []
    for (trainable, frozen, absent), group_names in patterns.items():
        states = (("trainable", trainable), ("frozen", frozen), ("missing", absent))
        where = [f"{state} on {_ranks(ranks)}" for state, ranks in states if ranks]
        parts.append(f"{_names(group_names)}: {', '.join(where)}")
    if not parts:  # the same flags under the same names, in another order
        parts.append("the same parameters are registered in a different order on different ranks")
    return (
        f"{owner}: the ranks disagree on which parameters require grad: {'; '.join(parts)}. Data parallel training"
        " averages the gradients of the same parameters on every rank; with different ones the ranks would average"
        " mismatched gradients or wait for each other. Set `requires_grad` the same way on every rank: not under"
        " `if self.global_rank == 0:` or other code that depends on the rank (freeze and unfreeze in `setup`,"
        " `on_train_batch_start`, `on_train_epoch_start` or a callback such as `BackboneFinetuning`, which run on"
        " every rank)."
    )


def _fingerprint(flags: Sequence[bool]) -> int:
    """A 56-bit digest of the flags in parameter order (the same on every rank for the same flags): cheap enough
    for every step (one byte per parameter hashed)."""
    return int.from_bytes(hashlib.blake2b(bytes(flags), digest_size=7).digest(), "little")


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _names(names: list[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"
