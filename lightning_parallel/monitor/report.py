"""The end-of-fit table of :class:`ParallelismMonitor`, from its summary (plain dicts, JSON-compatible)."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["format_table", "median_step", "steady_communication"]

_MIB = 2**20


def median_step(rank: dict[str, Any], key: str) -> float | None:
    """Median of ``key`` over a rank's steps after the first (warm-up), or over all if there is only one."""
    steps = rank["steps"][1:] or rank["steps"]
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else None


def steady_communication(rank: dict[str, Any]) -> dict[str, int] | None:
    """Bytes per collective of the rank's last step (the first steps may hold one-off set-up messages)."""
    if not rank["communication_measured"] or not rank["steps"]:
        return None
    return dict(rank["steps"][-1]["communication"] or {})


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / _MIB:.2f}"


def format_table(summary: dict[str, Any]) -> str:
    """One row per rank: bytes held, peak memory, median step time and throughput, bytes per step, bubble."""
    header = (
        "rank | params MiB | grads MiB | optim MiB | peak MiB | step ms | samples/s | tokens/s |"
        " exposed comm ms | bubble | bytes/step by collective"
    )
    lines = [f"ParallelismMonitor: {summary['strategy']} on {summary['world_size']} rank(s)", header]
    for rank in summary["ranks"]:
        memory = rank["memory"]
        step = median_step(rank, "step_time_s")
        samples = median_step(rank, "samples")
        tokens = median_step(rank, "tokens")
        exposed = median_step(rank, "exposed_communication_s")
        bubble = median_step(rank, "bubble_fraction")
        communication = steady_communication(rank)
        comm = (
            "not measured"
            if communication is None
            else ", ".join(f"{k} {v}" for k, v in sorted(communication.items())) or "none"
        )
        lines.append(
            " | ".join(
                [
                    str(rank["rank"]),
                    _mib(memory.get("parameters")),
                    _mib(memory.get("gradients")),
                    _mib(memory.get("optimizer_state")),
                    _mib(rank["peak_memory_bytes"]),
                    "-" if step is None else f"{step * 1e3:.1f}",
                    "-" if not step or samples is None else f"{samples / step:.1f}",
                    "-" if not step or not tokens else f"{tokens / step:.0f}",
                    "not measured" if exposed is None else f"{exposed * 1e3:.1f}",
                    "-" if bubble is None else f"{bubble:.2f}",
                    comm,
                ]
            )
        )
    return "\n".join(lines)
