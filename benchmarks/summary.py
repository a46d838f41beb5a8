"""The suite's summary: every comparison of ours against its anchor as ratios, the figures, and the scaling table.

Built by :mod:`benchmarks.run_all` from the result objects of the benchmarks that ran; it is the first section of
``benchmarks/RESULTS.md``. Each row says which way is better; an anchor that could not run keeps its row with the
error that stopped it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import scaling
from benchmarks.data_parallel import ANCHOR as DP_ANCHOR
from benchmarks.data_parallel import OURS as DP_OURS
from benchmarks.data_parallel import DataParallelResults
from benchmarks.figures import MemoryBar, RatioBar, save_communication_chart, save_memory_chart, save_ratio_chart
from benchmarks.pipeline import PipelineResults
from benchmarks.results import machine_description, markdown_table, today
from benchmarks.zero import DDP, OPTIONAL_ANCHORS, ZERO_REDUNDANCY, ZeroResults

__all__ = ["NAME", "Comparison", "comparisons", "render_summary"]

NAME = "summary"
"""The summary's section name in RESULTS.md."""
_NAN = float("nan")
_ZERO_ANCHORS = {
    # ours -> anchors it is compared with (the optional ones appear with their error when they did not run)
    "zero1": (DDP, ZERO_REDUNDANCY, "deepspeed_stage1"),
    "zero2": (DDP, ZERO_REDUNDANCY, "fsdp_shard_grad_op", "deepspeed_stage2"),
    "zero3": (DDP, ZERO_REDUNDANCY),
}


@dataclass
class Comparison:
    """One row of the ratio table: ours against one anchor."""

    ours: str
    """Our configuration."""
    anchor: str
    """The anchor's configuration."""
    throughput: list[float]
    """Tokens/s ours / anchor, one value per repeat (> 1: ours faster); empty if not measured."""
    peak_rss: float = _NAN
    """Peak RSS per rank ours / anchor (< 1: ours smaller)."""
    held: float = _NAN
    """Bytes of parameters + gradients + optimizer state per rank, ours / anchor (< 1: ours smaller)."""
    comm: float = _NAN
    """Bytes received per rank per step, ours / anchor (1: the same traffic)."""
    error: str | None = None
    """Why the anchor did not run (the caught error), else ``None``."""


def _data_parallel_rows(results: DataParallelResults) -> list[Comparison]:
    ours, anchor = max(results.median_peak_mem(DP_OURS)), max(results.median_peak_mem(DP_ANCHOR))
    return [Comparison("DataParallelStrategy", "Lightning DDPStrategy", results.throughput_ratios, ours / anchor)]


def _held(results: ZeroResults, name: str, world_size: int) -> float:
    probe = results.memory[(name, world_size)].probe
    fields = zip(probe["parameter_bytes"], probe["gradient_bytes"], probe["optimizer_state_bytes"], strict=True)
    return max(sum(values) for values in fields)


def _zero_rows(results: ZeroResults) -> list[Comparison]:
    largest = max(results.config.memory_world_sizes)
    rows = []
    for name, anchors in _ZERO_ANCHORS.items():
        ours_label = f"ShardedOptimizerStrategy(stage={name[-1]})"
        for anchor in anchors:
            contender = results.contenders.get(anchor) or OPTIONAL_ANCHORS[anchor]
            anchor_label = contender.label.removeprefix("anchor: ")
            if anchor in results.unavailable:
                rows.append(Comparison(ours_label, anchor_label, [], error=results.unavailable[anchor]))
                continue
            rows.append(
                Comparison(
                    ours_label,
                    anchor_label,
                    results.ratios(name, anchor),
                    peak_rss=results.memory[(name, largest)].peak() / results.memory[(anchor, largest)].peak(),
                    held=_held(results, name, largest) / _held(results, anchor, largest),
                    comm=results.comm(name) / results.comm(anchor),
                )
            )
    return rows


def _pipeline_rows(results: PipelineResults) -> list[Comparison]:
    ratios = [raw / ours for ours, raw in zip(results.ours_step_s, results.raw_step_s, strict=True)]
    m = results.config.num_microbatches
    return [Comparison("PipelineParallelStrategy (1F1B)", f"raw torch.distributed.pipelining (1F1B, m={m})", ratios)]


def comparisons(benchmarks: Mapping[str, Any]) -> list[Comparison]:
    """Every comparison of the benchmarks that ran, keyed by benchmark name (``data_parallel``, ``zero``, ...)."""
    rows: list[Comparison] = []
    if "data_parallel" in benchmarks:
        rows += _data_parallel_rows(benchmarks["data_parallel"])
    if "zero" in benchmarks:
        rows += _zero_rows(benchmarks["zero"])
    if "pipeline" in benchmarks:
        rows += _pipeline_rows(benchmarks["pipeline"])
    return rows


def _num(value: float, digits: int = 3) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def _ratio_table(rows: list[Comparison]) -> str:
    header = ["ours", "anchor", "throughput ours/anchor (>1 better)", "per repeat", "peak RSS/rank ours/anchor (<1)"]
    header += ["bytes held/rank ours/anchor (<1)", "bytes received/rank/step ours/anchor", "ran"]
    body = []
    for row in rows:
        if row.error is not None:
            body.append([row.ours, row.anchor, "-", "-", "-", "-", "-", f"no: `` {row.error} ``"])
            continue
        median = statistics.median(row.throughput) if row.throughput else _NAN
        per_repeat = ", ".join(f"{r:.3f}" for r in row.throughput) or "-"
        cells = [_num(median), per_repeat, _num(row.peak_rss), _num(row.held), _num(row.comm, 4), "yes"]
        body.append([row.ours, row.anchor, *cells])
    return markdown_table(header, body)


def _figures(benchmarks: Mapping[str, Any], rows: list[Comparison], figures_dir: Path) -> list[tuple[str, Path]]:
    """Draw the summary's figures; return (caption, path) of each."""
    drawn = []
    bars = [
        RatioBar(f"{r.ours} / {r.anchor}", statistics.median(r.throughput), tuple(r.throughput))
        for r in rows
        if r.throughput
    ]
    if bars:
        path = figures_dir / "throughput_ratios.png"
        save_ratio_chart(bars, path, title="Throughput ours / anchor, medians over repeats")
        drawn.append(("Throughput ratios", path))
    zero = benchmarks.get("zero")
    if zero is not None:
        largest = max(zero.config.memory_world_sizes)
        memory = []
        for name, contender in zero.contenders.items():
            run = zero.memory[(name, largest)]
            growth = max(p - s for p, s in zip(run.summary["peak_mem"], run.probe["rss_at_setup"], strict=True))
            fields = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")
            memory.append(MemoryBar(contender.label, *(run.held(f) for f in fields), peak_rss_growth=growth))
        path = figures_dir / "memory_per_rank.png"
        save_memory_chart(memory, path, title=f"Memory per rank, world size {largest} (ZeRO benchmark's memory part)")
        drawn.append((f"Memory per rank at world size {largest}", path))
        comm = [(c.label, zero.comm(name)) for name, c in zero.contenders.items()]
        path = figures_dir / "communication.png"
        ws = zero.config.throughput.devices
        save_communication_chart(comm, path, title=f"Bytes received per rank per step, world size {ws}")
        drawn.append(("Bytes communicated per step", path))
    return drawn


def render_summary(
    benchmarks: Mapping[str, Any],
    *,
    command: str,
    failed: Mapping[str, str],
    figures_dir: Path,
    results_path: Path,
    predicted: Mapping[str, scaling.ScalingSeries] | None = None,
) -> str:
    """Draw the figures and return the summary section.

    Args:
        benchmarks: Benchmark name -> its result object, for those that ran.
        command: The command to record.
        failed: Benchmark name -> the error of those that raised.
        figures_dir: Where the PNGs go.
        results_path: The RESULTS.md the section goes into (figure links are relative to it).
        predicted: The planner's scaling series (see :mod:`benchmarks.scaling`); ``None``: measured only.
    """
    rows = comparisons(benchmarks)
    drawn = _figures(benchmarks, rows, figures_dir)
    links = [f"![{caption}]({_relative(path, results_path)})" for caption, path in drawn]
    parts = [
        "## Summary: ours beside the anchors",
        "",
        f"- Command: `{command}`",
        f"- Date: {today()}",
        f"- Machine: {machine_description()}",
        "- Ratios are ours / anchor, medians over repeats (each repeat runs the pair back to back, in alternating"
        " order). Throughput: > 1 means ours is faster. Peak RSS and bytes held per rank: < 1 means ours holds less"
        " (largest world size of the ZeRO memory part). Bytes received per rank per step: 1 means the same traffic"
        " (ZeRO-3 needs 1.5x by design); DataParallelStrategy and the pipeline hold and send what their anchors do by"
        " construction (same DDP reducer; same stages and schedule), so those cells are not measured (-). An anchor"
        " that cannot run here keeps its row with the error it raised. Details and absolute numbers are in the"
        " sections below.",
        "- `--preset large` (GPU sizes: `gpt-125m`, NCCL, 2 GPUs; 4 for the scaling part) has not been run by us yet:"
        " no GPU machine.",
        "",
        _ratio_table(rows) if rows else "No comparison ran.",
    ]
    if failed:
        parts += ["", "Benchmarks that failed: " + "; ".join(f"`{n}`: `{e}`" for n, e in failed.items())]
    zero = benchmarks.get("zero")
    if zero is not None:
        measured = scaling.measured_scaling(zero)
        path = figures_dir / "scaling.png"
        scaling.save_scaling_chart(measured, predicted, path)
        planner = "not available yet (no planner)"
        if predicted:
            agreement = scaling.planner_agreement(measured, predicted)
            planner = "predicted by `lightning_parallel.planner.plan` (dashed in the figure)"
            if agreement is not None:
                planner += (
                    f"; where both exist, planner and measurement differ by at most {agreement:.1e} (relative; ours"
                    " also all-reduce one 8-byte non-finite-loss flag per step, which the planner leaves out)"
                )
        parts += [
            "",
            "### Scaling with the world size",
            "",
            "Cells: MiB of parameters + gradients + optimizer state held by the largest rank / MiB received per rank"
            f" per optimizer step; measured at world sizes {', '.join(map(str, zero.config.memory_world_sizes))}"
            f" (ZeRO memory part), larger world sizes {planner}.",
            "",
            scaling.scaling_table(measured, predicted),
            "",
            f"![scaling]({_relative(path, results_path)})",
        ]
    if links:
        parts += ["", "### Figures", "", *(f"{link}\n" for link in links)]
    return "\n".join(parts)


def _relative(path: Path, results_path: Path) -> str:
    return Path(os.path.relpath(path, results_path.parent)).as_posix()
