"""The table of ``make gpu-check``: one outcome per row, printed, and written to ``DIR`` as Markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_fit import SPLIT_FACTOR, CheckSettings, tolerance
from benchmarks.gpu_check_plan import NUM_MICROBATCHES, REPEAT, STALE, Row
from benchmarks.report import markdown_table, mib

__all__ = ["JSON_NAME", "MARKDOWN_NAME", "DiskUse", "Outcome", "render_markdown", "write_tables"]

MARKDOWN_NAME, JSON_NAME = "gpu_check.md", "gpu_check.json"
"""The two files the check leaves in its ``--out`` folder (nothing else)."""


@dataclass
class Outcome:
    """What one row measured, or why it failed or was skipped."""

    row: Row
    result: str = "ok"
    """``ok``, ``ok (rejected, as it must be)`` (the stale control), ``FAILED: ...`` or ``skipped: ...``."""
    seconds: float = 0.0
    loss_diff: float | None = None
    """Largest absolute difference of a step's loss from the one-device reference."""
    weight_diff: float | None = None
    """Largest absolute difference of a checkpointed weight (mid-run and end) from the reference."""
    resume_diff: float | None = None
    """Largest absolute difference of a weight at the end of the fit resumed from ``mid.ckpt`` from the
    uninterrupted fit's."""
    peaks: dict[str, list[int]] = field(default_factory=dict)
    """Per rank: ``torch.cuda.max_memory_allocated`` (peak RSS on CPU) of the fit, saving ``mid.ckpt`` and the
    resumed fit's set-up with the load."""
    disk_bytes: int = 0
    """Bytes of the files the row wrote (deleted when the row ends)."""

    @property
    def failed(self) -> bool:
        return self.result.startswith("FAILED")


@dataclass
class DiskUse:
    """The checkpoints the check wrote: every row deletes its own before the next starts."""

    peak_bytes: int = 0
    """The most held at once (the largest row's files)."""
    peak_row: str = "-"
    written_bytes: int = 0
    """All rows together."""

    def add(self, row: Row, size: int) -> None:
        self.written_bytes += size
        if size > self.peak_bytes:
            self.peak_bytes, self.peak_row = size, f"{row.name} {row.precision}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _cells(o: Outcome) -> list[str]:
    per_rank = [" / ".join(mib(m, 0) for m in o.peaks.get(name, [])) or "-" for name in ("fit", "save", "load")]
    return [
        o.row.name,
        str(o.row.world_size),
        o.row.precision,
        o.result,
        _number(o.loss_diff),
        _number(o.weight_diff),
        _number(o.resume_diff),
        *per_rank,
        mib(o.disk_bytes, 0) if o.disk_bytes else "-",
        f"{o.seconds:.1f}",
    ]


def render_markdown(outcomes: Sequence[Outcome], *, settings: CheckSettings, device: str, summary: str) -> str:
    """The table with what it compared, and the summary line (time, disk)."""
    header = ["row", "ranks", "precision", "result", "max loss diff", "max weight diff", "resumed weight diff"]
    header += ["fit peak MiB/rank", "save peak MiB/rank", "load peak MiB/rank", "disk MiB", "s"]
    bounds = ", ".join(
        f"{p}: loss {tolerance(p).loss_atol:g}, weights rtol {tolerance(p).weight_rtol:.3g} atol"
        f" {tolerance(p).weight_atol:g}"
        for p in ("32-true", "bf16-mixed")
    )
    return "\n".join(
        [
            "## gpu_check: sharded code paths against one device",
            "",
            f"`python -m benchmarks.gpu_check` on {device}: preset `{settings.preset}`, {settings.steps} steps (two"
            f" epochs), global batch {settings.batch_size} x {settings.seq_len} tokens, no per-step synchronize."
            " `forced`: the sharded backend (or DDP's compression hook) at world size 1. Compared with one device at"
            f" the same precision: every step's loss and the checkpoints saved mid-run and at the end ({bounds};"
            f" {SPLIT_FACTOR}x wider where ranks or replica groups split the batch). Pipeline rows ({NUM_MICROBATCHES}"
            f" micro-batches) against one device accumulating the same micro-batches. `{REPEAT}` must pass and"
            f" `{STALE}` (forward reading one-step-stale weights) must be rejected. Every strategy also resumes from"
            " its mid-run checkpoint (saved after the first epoch) into a fresh module and must end where it ended"
            " (`resumed weight diff`). Peaks:"
            " `torch.cuda.max_memory_allocated` on CUDA, peak RSS on CPU; `load`: set-up and restore of the resumed"
            " fit. Every checkpoint is deleted when its row ends.",
            "",
            markdown_table(header, [_cells(o) for o in outcomes]),
            "",
            summary,
        ]
    )


def write_tables(out: Path, outcomes: Sequence[Outcome], *, markdown: str, meta: dict[str, Any]) -> None:
    """``out/gpu_check.md`` and ``out/gpu_check.json`` (rows and ``meta``: device, settings, budget, disk)."""
    rows = [{**asdict(o.row), **{k: v for k, v in asdict(o).items() if k != "row"}} for o in outcomes]
    (out / MARKDOWN_NAME).write_text(markdown + "\n")
    (out / JSON_NAME).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
