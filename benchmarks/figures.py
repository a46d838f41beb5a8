"""The suite's PNG figures (matplotlib, the optional ``plots`` extra) and the pipeline's Chrome trace, from plain
numbers and the monitor's per-rank records."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["chrome_trace", "peak_breakdown_chart", "ratio_chart", "scaling_chart", "timeline_chart"]

_MIB = 2**20
_CHUNK_COLORS = {"F": "#4285f4", "B": "#34a853", "W": "#fbbc05"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:  # optional for the library, required for the figures
        raise ImportError("The benchmark figures need matplotlib: `pip install -e '.[plots]'`.") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, rect: tuple[float, ...] = (0, 0, 1, 1)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_chart(bars: Mapping[str, Sequence[float]], path: Path) -> None:
    """Throughput ours / anchor: a bar per comparison at the median, a dot per repeat, a line at parity."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(bars) + 1.4))
    y = list(range(len(bars)))[::-1]
    medians = [statistics.median(values) for values in bars.values()]
    ax.barh(y, medians, color=["#34a853" if m >= 1 else "#ea4335" for m in medians], alpha=0.75)
    for yy, median, values in zip(y, medians, bars.values(), strict=True):
        ax.plot(values, [yy] * len(values), "k.", markersize=5)
        ax.text(median, yy, f" {median:.3f}", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(y, list(bars), fontsize=8)
    ax.set_xlabel("throughput ours / anchor (> 1: ours faster); bars: medians, dots: repeats")
    _save(plt, fig, path)


def scaling_chart(
    series: Mapping[str, tuple[Mapping[int, tuple[float, float]], Mapping[int, tuple[float, float]]]], path: Path
) -> None:
    """Bytes held per rank and wire bytes per rank per step against the world size (log 2): measured solid with
    markers, the planner's prediction dashed in the same colour. ``series``: label -> (measured, predicted), each
    world size -> (held, wire)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (label, (measured, predicted)) in zip(colors, series.items(), strict=False):
        for index, ax in enumerate(axes):
            for points, style, name in ((measured, "o-", label), (predicted, "x--", None)):
                sizes = sorted(points)
                ax.plot(sizes, [points[ws][index] / _MIB for ws in sizes], style, color=color, label=name)
    for ax, what, scale in (
        (axes[0], "MiB held per rank", "log"),
        (axes[1], "MiB on the wire per rank per step", "symlog"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale(scale, **({"linthresh": 0.01} if scale == "symlog" else {}))
        ax.set_xlabel("world size")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    axes[0].set_title("measured (solid), planner (dashed)", fontsize=9)
    axes[1].set_ylim(bottom=0)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    _save(plt, fig, path, rect=(0, 0.15, 1, 1))


def timeline_chart(runs: Mapping[str, Sequence[dict[str, Any]]], path: Path) -> None:
    """One panel per run, one band per rank: the chunks of the rank's first measured step (the monitor's timeline)."""
    plt = _pyplot()
    ranks_total = sum(len(ranks) for ranks in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.1 * ranks_total + 0.6 * len(runs)), squeeze=False)
    for ax, (title, ranks) in zip(axes[:, 0], runs.items(), strict=True):
        for rank in ranks:
            for kind, stage, start, end in rank["steps"][0]["timeline"]:
                ax.broken_barh(
                    [(start * 1e3, (end - start) * 1e3)], (rank["rank"] - 0.4, 0.8), color=_CHUNK_COLORS[kind]
                )
                ax.text((start + end) / 2 * 1e3, rank["rank"], f"{kind}s{stage}", ha="center", va="center", fontsize=5)
        ax.set_yticks([r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the rank's step start (forward blue, backward green, weight gradients yellow)")
    _save(plt, fig, path)


def chrome_trace(ranks: Sequence[dict[str, Any]], path: Path) -> None:
    """The first measured step of every rank as a Chrome trace (one thread per rank, one slice per chunk)."""
    events: list[dict[str, Any]] = []
    for rank in ranks:
        tid = rank["rank"]
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"rank {tid}"}})
        for kind, stage, start, end in rank["steps"][0]["timeline"]:
            events.append(
                {
                    "name": f"{kind} stage {stage}",
                    "ph": "X",
                    "ts": start * 1e6,
                    "dur": (end - start) * 1e6,
                    "pid": 0,
                    "tid": tid,
                }
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


_PEAK_PARTS = ("parameters", "gradients", "optimizer_state", "other")


def peak_breakdown_chart(rows: Mapping[str, Mapping[str, float]], path: Path) -> None:
    """Peak bytes per rank, one stacked bar per row (``label -> {parameters, gradients, optimizer_state, other}``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.6))
    labels = list(rows)[::-1]
    left = [0.0] * len(labels)
    for part, color in zip(_PEAK_PARTS, ("#4285f4", "#34a853", "#fbbc05", "#9e9e9e"), strict=True):
        widths = [rows[label].get(part, 0) / _MIB for label in labels]
        ax.barh(labels, widths, left=left, color=color, label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("peak live tensor bytes per rank (MiB), split at the moment of the peak")
    ax.legend(loc="lower right", fontsize=8)
    _save(plt, fig, path)
