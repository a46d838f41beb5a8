"""benchmarks/gpu_check.py (`make gpu-check`): fails fast without CUDA; its CPU dry run runs one configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=_REPO_ROOT,
        # Without a `PL_GLOBAL_SEED` another test may have left here: Lightning seeds its distributed sampler with it.
        env={**{k: v for k, v in os.environ.items() if k != "PL_GLOBAL_SEED"}, **(env or {})},
    )


def test_without_cuda_it_stops_at_once_and_says_why(tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    # No visible GPU: what a CPU machine (or a CPU build of torch) sees.
    proc = _run("--output", str(output), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "The GPU check needs a CUDA GPU: torch.cuda.is_available() is False" in proc.stderr
    assert "--device cpu --tiny" in proc.stderr
    assert not output.exists()  # nothing written, nothing trained


def test_cpu_dry_run_fits_one_configuration_and_writes_its_section(tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    output.write_text("# Benchmark results\n\n<!-- begin zero -->\nkept\n<!-- end zero -->\n")
    proc = _run("--device", "cpu", "--tiny", "--steps", "3", "--output", str(output))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = output.read_text()
    assert "kept" in text  # other sections stay
    assert "<!-- begin gpu_check -->" in text and "<!-- end gpu_check -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| zero2 ")]
    assert len(rows) == 1, text
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    strategy, ranks, precision, result, loss_diff, weight_diff, peaks, monitor_peak, monitor_held, _ = cells
    assert (strategy, ranks, precision, result) == ("zero2", "1", "bf16-mixed", "ok")
    # One device, one rank: ZeRO-2 trains exactly like Lightning's single-device run.
    assert float(loss_diff) == 0.0 and float(weight_diff) == 0.0
    assert int(peaks.replace(",", "")) > 0 and int(monitor_peak.replace(",", "")) > 0
    assert float(monitor_held.replace(",", "")) > 0
    assert "refusal of the `*_notebook` strategies: skipped: CUDA is not initialised" in text
