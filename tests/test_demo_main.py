"""Integration: the main demo and the data-parallel benchmark, each forking 2 CPU ranks from this process."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported before forking so the ranks inherit it)
import pytest
import torch

from lightning_parallel.demos import main as demo

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:  # `benchmarks` is a folder at the repository root, not an installed package
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import data_parallel as bench  # noqa: E402


def _table_rows(output: str) -> dict[str, list[str]]:
    """The demo table's rows by label, from the header line on, as stripped cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strategy "))
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")] for line in lines[start + 2 :])}


@pytest.fixture
def restore_log_levels() -> Iterator[None]:
    """The demo quietens two Lightning loggers in this process; put their levels back."""
    loggers = [
        logging.getLogger(name)
        for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.distributed")
    ]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


@pytest.mark.usefixtures("restore_log_levels")
def test_demo_main_prints_one_row_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    status = demo.main(["--preset", "tiny", "--steps", "3"])
    output = capsys.readouterr().out
    assert status == 0, output
    rows = _table_rows(output)
    assert list(rows) == [row.label for row in demo.STRATEGY_ROWS]
    for label, cells in rows.items():
        # "-": the strategy counts no all-reduce bytes (pipeline, ZeRO rows).
        loss, _tokens_per_s, _comm, peak_rank0, peak_rank1 = (
            math.nan if c == "-" else float(c.replace(",", "")) for c in cells
        )
        assert math.isfinite(loss), label
        assert peak_rank0 > 0 and peak_rank1 > 0, label


def test_benchmark_measures_ratios_and_fp16_halves_bytes() -> None:
    torch.set_num_threads(1)
    config = bench.BenchmarkConfig(preset="tiny", steps=4, warmup_steps=2, repeats=1, batch_size=4, seq_len=32)
    results = bench.measure(config)
    assert set(results.runs) == set(bench.CONFIGS)
    assert all(len(runs) == 1 for runs in results.runs.values())
    for ratio in (results.throughput_ratio, results.median_step_ratio):
        assert math.isfinite(ratio) and ratio > 0
    assert results.fp32_bytes_per_step > 0
    assert results.fp16_bytes_per_step * 2 == results.fp32_bytes_per_step
    assert results.bytes_ratio == 0.5
    for name in bench.CONFIGS:
        peaks = results.median_peak_mem(name)
        assert len(peaks) == 2 and min(peaks) > 0, name
    # The anchor has no communication counters; ours counts nothing unless asked to.
    assert results.runs[bench.ANCHOR][0]["comm_bytes_per_step"] is None
    assert "| throughput ours / Lightning DDP" in bench.render_markdown(results, command="pytest")
