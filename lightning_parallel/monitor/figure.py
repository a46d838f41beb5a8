"""The monitor's PNG: per-rank memory bars, throughput over steps, pipeline timeline (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_figure"]

_COLORS = {"F": "tab:blue", "B": "tab:green", "W": "tab:olive"}


def write_figure(summary: dict[str, Any], path: str | Path) -> bool:
    """Draw the summary of :class:`ParallelismMonitor` to ``path``; ``False`` if matplotlib is not installed.

    Panels: bytes held per rank (parameters, gradients, optimizer state stacked, MiB), samples/s over steps per rank,
    and, for pipelines, each rank's forward (blue) / backward (green) chunks of the last step (white is idle).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = summary["ranks"]
    has_timeline = any(r["steps"] and r["steps"][-1].get("timeline") for r in ranks)
    figure, axes = plt.subplots(1, 3 if has_timeline else 2, figsize=(15 if has_timeline else 10, 4))
    _memory_bars(axes[0], ranks)
    _throughput(axes[1], ranks)
    if has_timeline:
        _timeline(axes[2], ranks)
    figure.suptitle(f"{summary['strategy']} on {summary['world_size']} rank(s)")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _memory_bars(ax: Any, ranks: list[dict[str, Any]]) -> None:
    bottom = [0.0] * len(ranks)
    for kind in ("parameters", "gradients", "optimizer_state"):
        values = [r["memory"].get(kind, 0) / 2**20 for r in ranks]
        ax.bar([str(r["rank"]) for r in ranks], values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("rank")
    ax.set_ylabel("MiB held")
    ax.set_title("Bytes held per rank")
    ax.legend()


def _throughput(ax: Any, ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        steps = [s for s in rank["steps"] if s["step_time_s"] > 0]
        ax.plot(
            [s["step"] for s in steps], [s["samples"] / s["step_time_s"] for s in steps], label=f"rank {rank['rank']}"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_title("Throughput")
    ax.legend()


def _timeline(ax: Any, ranks: list[dict[str, Any]]) -> None:
    for row, rank in enumerate(ranks):
        events = rank["steps"][-1].get("timeline") or [] if rank["steps"] else []
        for kind, _stage, start, end in events:
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8), color=_COLORS.get(kind, "grey"))
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.set_xlabel("ms into the last step")
    ax.set_title("Pipeline timeline (F blue, B green)")
