"""Cutting per-layer costs into balanced contiguous stages, with the first and last stage optionally lighter.

Torch-free arithmetic, used by :func:`~.stage_plan.plan_stages`. Three steps, each deterministic (every rank computes
the same split from the same costs):

1. :func:`balanced_boundaries`: the contiguous split minimising the heaviest *stage* (dynamic programming). The
   embedding and the head are pipeline layers of their own (a model's ``pipeline_layers()``, a declared Hugging Face
   plan's prologue and epilogue), so their own cost already counts: with a large vocabulary the stages holding them
   get fewer blocks by themselves.
2. :class:`UnevenStages`: the user's ``first_stage_fewer_layers`` / ``last_stage_fewer_layers`` (torchtitan's
   ``pipeline_parallel_first_stage_less_layers``): the first (last) stage is balanced as if it also held that many
   more layers of the median layer's cost, so with uniform blocks it holds exactly that many fewer than the others.
   For what a cost does not see: the 1F1B warm-up keeps ``p`` micro-batches of activations in flight on the first
   rank and one on the last; the loss and the optimizer step of a large head; an embedding whose FLOPs are tiny
   but whose weights and optimizer state are not.
3. :func:`balance_ranks`: where a rank holds several stages (interleaved schedules, the V ones: rank 0 holds the
   first *and* the last stage), what a rank holds and runs is the sum of its stages, so the split is refined by
   moving one boundary by one layer at a time while the heaviest rank gets lighter (then the heaviest stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["UnevenStages", "balance_ranks", "balanced_boundaries", "stage_costs"]


@dataclass(frozen=True, kw_only=True)
class UnevenStages:
    """How many layers' worth the first and the last stage are lightened by (``PipelineParallelStrategy``'s
    ``first_stage_fewer_layers`` / ``last_stage_fewer_layers``)."""

    first_stage_fewer_layers: int = 0
    """The first stage is balanced as if it also held this many more layers of the median layer's cost (with uniform
    blocks: it holds this many fewer than the other stages)."""
    last_stage_fewer_layers: int = 0
    """The same for the last stage."""

    def __post_init__(self) -> None:
        for name in ("first_stage_fewer_layers", "last_stage_fewer_layers"):
            check_fewer_layers(name, getattr(self, name))

    def check_layer_count(self, num_layers: int) -> None:
        """Local. Refuse a count larger than the model's number of pipeline layers (it would lighten a stage by more
        than the whole model, which the user surely did not mean).

        Raises:
            ValueError: Naming the argument, its value and the number of layers.
        """
        for name in ("first_stage_fewer_layers", "last_stage_fewer_layers"):
            value = getattr(self, name)
            if value > num_layers:
                raise ValueError(
                    f"`{name}={value}` is larger than the model's {num_layers} pipeline layers: it counts layers by"
                    f" which that stage is lightened. Use a value from 0 to {num_layers} (typically 1 or 2)."
                )

    @property
    def is_even(self) -> bool:
        """Nothing is lightened: the plain balanced split."""
        return not (self.first_stage_fewer_layers or self.last_stage_fewer_layers)

    def extra_costs(self, costs: Sequence[float]) -> tuple[float, float]:
        """The cost added to the first and to the last stage: the counts times the median layer's cost (the lower
        median: a block's, in a model that is mostly blocks; the embedding and the head do not move it)."""
        if self.is_even or not costs:
            return 0.0, 0.0
        median = sorted(float(c) for c in costs)[(len(costs) - 1) // 2]
        return self.first_stage_fewer_layers * median, self.last_stage_fewer_layers * median


def check_fewer_layers(name: str, value: object) -> None:
    """``value`` must be a non-negative ``int``.

    Raises:
        TypeError, ValueError: Naming the argument and the value.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"`{name}={value!r}` must be an int (0 keeps the stages even).")
    if value < 0:
        raise ValueError(
            f"`{name}={value}` must be 0 or more: the number of layers' worth by which that stage is lightened."
        )


def stage_costs(
    costs: Sequence[float], starts: Sequence[int], *, extra_first: float = 0.0, extra_last: float = 0.0
) -> list[float]:
    """Each stage's summed cost (``starts``: the first layer of each stage), the extras on the first and last stage."""
    bounds = [*starts, len(costs)]
    result = [float(sum(costs[bounds[s] : bounds[s + 1]])) for s in range(len(starts))]
    result[0] += extra_first
    result[-1] += extra_last
    return result


def balanced_boundaries(
    costs: Sequence[float], num_stages: int, *, extra_first: float = 0.0, extra_last: float = 0.0
) -> list[int]:
    """Cut ``costs`` into ``num_stages`` contiguous non-empty groups minimising the largest group's sum, the first
    group counting ``extra_first`` more and the last ``extra_last`` more.

    Returns the start index of each stage (``[0, ...]``). Ties go to the earliest cut, so every rank gets the same
    answer from the same costs.

    Raises:
        ValueError: If there are fewer layers than stages.
    """
    n = len(costs)
    if num_stages > n:
        raise ValueError(
            f"Cannot split {n} pipeline layers into {num_stages} stages: every stage needs at least one layer."
            " Lower `pipeline_parallel_size` / `stages_per_rank`, or return finer layers from `pipeline_layers()`."
        )
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    inf = float("inf")
    # best[k][i]: the smallest possible maximum stage cost when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        extra = (extra_first if k == 1 else 0.0) + (extra_last if k == num_stages else 0.0)
        for i in range(k, n + 1):
            if k == num_stages and i != n:
                continue  # the last stage ends at the last layer
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts = []
    i = n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def balance_ranks(
    costs: Sequence[float],
    starts: Sequence[int],
    *,
    rank_of_stage: Callable[[int], int],
    num_ranks: int,
    extra_first: float = 0.0,
    extra_last: float = 0.0,
) -> list[int]:
    """Refine ``starts`` for ranks that hold several stages: move one boundary by one layer while that makes the
    sorted rank sums smaller (heaviest first), then the sorted stage sums; return the new starts.

    Deterministic (boundaries tried in order, a move kept only if it is strictly better), and never worse than
    ``starts`` for the heaviest rank. A local search: it stops at the first split no single move improves.
    """
    extras = {"extra_first": extra_first, "extra_last": extra_last}

    def key(candidate: Sequence[int]) -> tuple[list[float], list[float]]:
        stages = stage_costs(costs, candidate, **extras)
        ranks = [0.0] * num_ranks
        for stage, cost in enumerate(stages):
            ranks[rank_of_stage(stage)] += cost
        return sorted(ranks, reverse=True), sorted(stages, reverse=True)

    current, best = list(starts), key(starts)
    bounds = len(costs)
    improved = True
    while improved:
        improved = False
        for b in range(1, len(current)):
            for step in (-1, 1):
                candidate = list(current)
                candidate[b] += step
                upper = candidate[b + 1] if b + 1 < len(candidate) else bounds
                if not candidate[b - 1] < candidate[b] < upper:
                    continue
                score = key(candidate)
                if score < best:
                    current, best, improved = candidate, score, True
    return current
