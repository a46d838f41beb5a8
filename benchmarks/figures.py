"""PNG figures of the benchmark suite, drawn with matplotlib (the optional ``plots`` extra), saved under
``benchmarks/figures/`` and linked from ``benchmarks/RESULTS.md``.

Every function takes plain numbers (no benchmark result objects), so the figures can be redrawn from a table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MemoryBar",
    "RatioBar",
    "pyplot",
    "save_communication_chart",
    "save_memory_chart",
    "save_ratio_chart",
    "save_timeline",
]

_MIB = 1024**2
TIMELINE_COLORS = {"F": "#4285f4", "B": "#34a853", "W": "#fbbc05"}
"""Forward blue, backward (or input-gradient half) green, weight-gradient half yellow."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the file-only ``Agg`` backend (no display needed).

    Raises:
        ImportError: If matplotlib is not installed, naming the extra that installs it.
    """
    try:
        import matplotlib
    except ImportError as error:  # matplotlib is optional for the library, required for the figures
        raise ImportError("The benchmark figures need matplotlib: `pip install -e '.[plots]'`.") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class RatioBar:
    """One comparison of the ratio chart."""

    label: str
    """Text beside the bar, e.g. ``"zero2 / Lightning DDP"``."""
    median: float
    """Median over repeats of ours / anchor."""
    per_repeat: tuple[float, ...] = ()
    """The ratio of each repeat (drawn as dots)."""


@dataclass(frozen=True)
class MemoryBar:
    """One configuration of the memory chart, in bytes on the largest rank."""

    label: str
    """Configuration name."""
    parameter_bytes: float
    """Bytes of parameters the rank holds."""
    gradient_bytes: float
    """Bytes of gradients the rank holds."""
    optimizer_state_bytes: float
    """Bytes of optimizer state the rank holds."""
    peak_rss_growth: float = float("nan")
    """Peak RSS during ``fit`` minus the RSS at setup (NaN: not drawn)."""


def save_ratio_chart(bars: Sequence[RatioBar], path: Path, *, title: str) -> None:
    """Horizontal bars of throughput ratios ours / anchor, a line at 1.0 (parity) and each repeat as a dot."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(bars) + 1.4))
    y = list(range(len(bars)))[::-1]
    colors = ["#34a853" if bar.median >= 1.0 else "#ea4335" for bar in bars]
    ax.barh(y, [bar.median for bar in bars], color=colors, alpha=0.75)
    for yy, bar in zip(y, bars, strict=True):
        ax.plot(bar.per_repeat, [yy] * len(bar.per_repeat), "k.", markersize=5)
        ax.text(bar.median, yy, f" {bar.median:.3f}", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlim(0, 1.15 * max([1.0, *(bar.median for bar in bars), *(r for bar in bars for r in bar.per_repeat)]))
    ax.set_yticks(y, [bar.label for bar in bars], fontsize=8)
    ax.set_xlabel("throughput ours / anchor (> 1: ours faster); bars: medians, dots: repeats")
    ax.set_title(title, fontsize=10)
    _save(fig, path)


def save_memory_chart(bars: Sequence[MemoryBar], path: Path, *, title: str) -> None:
    """Stacked bars of parameter, gradient and optimizer-state MiB per rank, with the peak RSS growth as a marker."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 2.0))
    y = list(range(len(bars)))[::-1]
    left = [0.0] * len(bars)
    for name, color in (("parameter", "#4285f4"), ("gradient", "#34a853"), ("optimizer_state", "#fbbc05")):
        widths = [getattr(bar, f"{name}_bytes") / _MIB for bar in bars]
        ax.barh(y, widths, left=left, color=color, label=name.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    growth = [(yy, bar.peak_rss_growth / _MIB) for yy, bar in zip(y, bars, strict=True) if bar.peak_rss_growth >= 0]
    if growth:
        ax.plot([g for _, g in growth], [yy for yy, _ in growth], "kD", markersize=5, label="peak RSS growth in fit")
    ax.set_yticks(y, [bar.label for bar in bars], fontsize=8)
    ax.set_xlabel("MiB held by the largest rank (less is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    _save(fig, path)


def save_communication_chart(bars: Sequence[tuple[str, float]], path: Path, *, title: str) -> None:
    """Horizontal bars of bytes communicated per rank per optimizer step (MiB), one per configuration."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 1.4))
    y = list(range(len(bars)))[::-1]
    values = [value / _MIB for _, value in bars]
    ax.barh(y, values, color="#4285f4", alpha=0.8)
    ax.set_xlim(0, 1.15 * max([*values, 1e-3]))
    for yy, value in zip(y, values, strict=True):
        ax.text(value, yy, f" {value:.2f}", va="center", fontsize=8)
    ax.set_yticks(y, [label for label, _ in bars], fontsize=8)
    ax.set_xlabel("MiB received per rank per optimizer step (bandwidth-optimal algorithms)")
    ax.set_title(title, fontsize=10)
    _save(fig, path)


def save_timeline(rows: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: Path) -> None:
    """One panel per run (schedule), one band per rank: the forward/backward blocks of one training step.

    Args:
        rows: ``(title, ranks)`` per run; each rank is a record with ``"rank"`` and ``"events"``
            ``(kind, stage, micro-batch, start, end, step)`` as written by :mod:`benchmarks.pipeline`. Each run is
            drawn on its own time axis (milliseconds from its first block).
        path: Where to save the PNG.
    """
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.1 * sum(len(r) for _, r in rows) + 0.6 * len(rows)))
    axes = axes if len(rows) > 1 else [axes]
    for ax, (title, ranks) in zip(axes, rows, strict=True):
        origin = min(e[3] for r in ranks for e in r["events"])
        for r in ranks:
            for kind in TIMELINE_COLORS:
                blocks = [((e[3] - origin) * 1e3, (e[4] - e[3]) * 1e3) for e in r["events"] if e[0] == kind]
                ax.broken_barh(blocks, (r["rank"] - 0.4, 0.8), facecolors=TIMELINE_COLORS[kind], edgecolor="black")
            for kind, stage, chunk, start, end, _step in r["events"]:
                if (end - start) * 1e3 > 0:
                    mid = (start + end) / 2 - origin
                    ax.text(
                        mid * 1e3,
                        r["rank"],
                        f"{kind}{chunk}" + ("" if stage == r["rank"] else f"s{stage}"),
                        ha="center",
                        va="center",
                        fontsize=5,
                    )
        ax.set_yticks([r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("ms from the step's first block (forward blue, backward green, weight gradients yellow)")
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
