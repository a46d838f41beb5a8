"""Scaling of memory per rank and bytes communicated with the world size: measured at small world sizes by the ZeRO
benchmark's memory part (:mod:`benchmarks.zero`), predicted for large ones by the planner.

The measured part is deterministic (bytes of parameters, gradients and optimizer state each rank holds after the last
step; bytes each rank receives per optimizer step under bandwidth-optimal collectives), so a few steps at world size
1, 2 and 4 are enough. The prediction is a seam: :func:`save_scaling_chart` and :func:`scaling_table` take any
``predicted`` series; :func:`predicted_scaling` fills it from ``lightning_parallel.planner`` when that package exists.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.figures import pyplot
from benchmarks.results import markdown_table
from benchmarks.zero import DDP, OURS, RunConfig, ZeroResults
from lightning_parallel.demos.gpt import GPTConfig

__all__ = [
    "PREDICTED_WORLD_SIZES",
    "SCALED_CONFIGURATIONS",
    "ScalingSeries",
    "measured_scaling",
    "planner_agreement",
    "predicted_scaling",
    "save_scaling_chart",
    "scaling_table",
]

_MIB = 1024**2
PREDICTED_WORLD_SIZES: tuple[int, ...] = tuple(2**k for k in range(11))
"""World sizes the planner predicts: 1, 2, 4 (checked against the measurement), then 8, 16, ..., 1024."""
SCALED_CONFIGURATIONS: tuple[str, ...] = (*OURS, DDP)
"""Configurations the ZeRO benchmark runs at every world size of its memory part."""


@dataclass(frozen=True)
class ScalingSeries:
    """Bytes per rank of one configuration at several world sizes."""

    label: str
    """Legend text."""
    world_sizes: tuple[int, ...]
    """World sizes, increasing."""
    held_bytes: tuple[float, ...]
    """Parameters + gradients + optimizer state held by the largest rank, per world size."""
    comm_bytes: tuple[float, ...]
    """Bytes a rank receives per optimizer step (mean over ranks), per world size."""

    def __post_init__(self) -> None:
        if not len(self.world_sizes) == len(self.held_bytes) == len(self.comm_bytes):
            raise ValueError(
                f"`ScalingSeries({self.label!r})` needs one value per world size: got {len(self.world_sizes)} world"
                f" sizes, {len(self.held_bytes)} held and {len(self.comm_bytes)} communicated values."
            )


def measured_scaling(results: ZeroResults) -> dict[str, ScalingSeries]:
    """Configuration -> its measured series, from the memory part of a ZeRO benchmark run."""
    sizes = tuple(results.config.memory_world_sizes)
    series = {}
    for name in SCALED_CONFIGURATIONS:
        held, comm = [], []
        for world_size in sizes:
            probe = results.memory[(name, world_size)].probe
            fields = (probe["parameter_bytes"], probe["gradient_bytes"], probe["optimizer_state_bytes"])
            held.append(max(sum(values) for values in zip(*fields, strict=True)))
            comm.append(sum(probe["received_bytes"]) / len(probe["received_bytes"]))
        series[name] = ScalingSeries(results.contenders[name].label, sizes, tuple(held), tuple(comm))
    return series


def predicted_scaling(
    run: RunConfig, world_sizes: Sequence[int] = PREDICTED_WORLD_SIZES
) -> dict[str, ScalingSeries] | None:
    """The planner's prediction for the memory part's model at ``world_sizes``; ``None`` if there is no planner.

    ``lightning_parallel.planner.plan`` gives each configuration's bytes held per rank and the payload of each
    collective per step; the payloads become bytes received per rank with the same bandwidth-optimal factors as the
    measurement (:mod:`benchmarks.zero_probe`). Lightning's DDP is predicted by the planner's ``data_parallel`` (the
    same replicas and the same all-reduce). ZeRO needs two ranks: world size 1 is predicted for DDP only.

    Args:
        run: The memory part's configuration (model preset and overrides, batch, sequence length).
        world_sizes: World sizes to predict.
    """
    try:
        planner = importlib.import_module("lightning_parallel.planner")
    except ImportError:
        return None
    if not callable(getattr(planner, "plan", None)):  # the package is being written: no prediction yet
        return None
    overrides = {k: v for k, v in (("n_layer", run.n_layer), ("n_embd", run.n_embd)) if v is not None}
    model = GPTConfig.from_preset(run.preset, **overrides)
    seq_len = min(run.seq_len, model.block_size)
    points: dict[str, list[tuple[int, float, float]]] = {name: [] for name in SCALED_CONFIGURATIONS}
    for world_size in world_sizes:
        predicted = planner.plan(model, world_size=world_size, batch_size=run.batch_size, seq_len=seq_len)
        for name in SCALED_CONFIGURATIONS:
            planned = "data_parallel" if name == DDP else name
            if all(c.name != planned for c in predicted.configurations):
                continue  # ZeRO at world size 1
            ranks = predicted.configuration(planned).ranks
            held = max(rank.held for rank in ranks)
            received = sum(_received(rank.communication, world_size) for rank in ranks) / len(ranks)
            points[name].append((world_size, float(held), received))
    return {
        name: ScalingSeries(
            f"{name}, planner", tuple(p[0] for p in rows), tuple(p[1] for p in rows), tuple(p[2] for p in rows)
        )
        for name, rows in points.items()
        if rows
    }


def _received(payloads: Mapping[str, int], world_size: int) -> float:
    """Bytes a rank receives for these collective payloads (the probe's factors; broadcast counted on every rank)."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    factors["broadcast"] = 1.0 if n > 1 else 0.0
    unknown = set(payloads) - set(factors)
    if unknown:
        raise ValueError(f"The planner predicts collectives {sorted(unknown)} the benchmark does not measure.")
    return sum(factors[kind] * size for kind, size in payloads.items())


def planner_agreement(measured: Mapping[str, ScalingSeries], predicted: Mapping[str, ScalingSeries]) -> float | None:
    """The largest relative difference between planner and measurement at world sizes both have (``None``: none)."""
    differences = []
    for name, series in measured.items():
        guess = predicted.get(name)
        if guess is None:
            continue
        guessed = dict(zip(guess.world_sizes, zip(guess.held_bytes, guess.comm_bytes, strict=True), strict=True))
        for ws, held, comm in zip(series.world_sizes, series.held_bytes, series.comm_bytes, strict=True):
            if ws in guessed:
                for actual, expected in ((held, guessed[ws][0]), (comm, guessed[ws][1])):
                    differences.append(abs(actual - expected) / max(abs(actual), 1.0))
    return max(differences) if differences else None


def save_scaling_chart(
    measured: Mapping[str, ScalingSeries], predicted: Mapping[str, ScalingSeries] | None, path: Path
) -> None:
    """Two panels against the world size (log scale): bytes held per rank and bytes received per rank per step.

    Measured points are solid with markers; predicted ones (same colour, same configuration key) are dashed.
    """
    plt = pyplot()
    fig, (held_ax, comm_ax) = plt.subplots(1, 2, figsize=(11, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (name, series) in zip(colors, measured.items(), strict=False):
        for ax, values in ((held_ax, series.held_bytes), (comm_ax, series.comm_bytes)):
            ax.plot(series.world_sizes, [v / _MIB for v in values], "o-", color=color, label=f"{series.label}")
        guess = (predicted or {}).get(name)
        if guess is not None:
            for ax, values in ((held_ax, guess.held_bytes), (comm_ax, guess.comm_bytes)):
                ax.plot(guess.world_sizes, [v / _MIB for v in values], "x--", color=color)
    groups = (measured, predicted or {})
    sizes = sorted({ws for group in groups for series in group.values() for ws in series.world_sizes})
    for ax, what, scale in (
        (held_ax, "parameters + gradients + optimizer state, MiB per rank", "log"),
        (comm_ax, "MiB received per rank per optimizer step (0 at world size 1)", "symlog"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale(scale, **({"linthresh": 0.01} if scale == "symlog" else {}))
        ax.set_xticks(sizes, [str(ws) for ws in sizes], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("world size")
        ax.set_ylabel(what, fontsize=8)
        ax.grid(True, alpha=0.3)
    subtitle = "measured (solid)" + (", planner (dashed)" if predicted else "; planner prediction not available")
    held_ax.set_title(f"Bytes held per rank: {subtitle}", fontsize=9)
    comm_ax.set_title("Bytes communicated per rank per step", fontsize=9)
    comm_ax.set_ylim(bottom=0)
    handles, labels = held_ax.get_legend_handles_labels()
    if predicted:
        handles.append(plt.Line2D([], [], color="gray", linestyle="--", marker="x"))
        labels.append("planner (same colour)")
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_table(measured: Mapping[str, ScalingSeries], predicted: Mapping[str, ScalingSeries] | None) -> str:
    """A markdown table: one row per configuration, one column per world size, cells ``held MiB / received MiB``."""
    sizes = sorted({ws for s in measured.values() for ws in s.world_sizes})
    predicted_sizes = sorted({ws for s in (predicted or {}).values() for ws in s.world_sizes} - set(sizes))
    header = ["configuration", *(f"ws {ws}" for ws in sizes), *(f"ws {ws} (planner)" for ws in predicted_sizes)]
    rows = []
    for name, series in measured.items():
        cells = dict(zip(series.world_sizes, zip(series.held_bytes, series.comm_bytes, strict=True), strict=True))
        guess = (predicted or {}).get(name)
        if guess is not None:
            guessed = zip(guess.held_bytes, guess.comm_bytes, strict=True)
            cells.update({ws: v for ws, v in zip(guess.world_sizes, guessed, strict=True) if ws not in cells})
        rows.append([series.label, *(_cell(cells.get(ws)) for ws in (*sizes, *predicted_sizes))])
    return markdown_table(header, rows)


def _cell(values: tuple[float, float] | None) -> str:
    return "-" if values is None else f"{values[0] / _MIB:,.2f} / {values[1] / _MIB:,.2f}"
