"""Standalone tier: real process trees started the way users start them (script re-launch, torchrun)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_harness import find_free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "data_parallel.py")


def _run(command: list[str], timeout: float = 240) -> str:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "WORLD_SIZE", "RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    return output


def _final_metrics(output: str) -> str:
    match = re.search(r"world_size=(\d+).*final metrics: (.*)", output)
    assert match, output[-2000:]
    return match.group(0)


@pytest.mark.slow
def test_script_relaunch_popen_trains_on_two_processes_with_fp16_compression():
    output = _run([sys.executable, EXAMPLE, "--devices", "2", "--max-steps", "4", "--compression", "fp16"])
    assert "world_size=2" in _final_metrics(output)


@pytest.mark.slow
def test_torchrun_launch_uses_the_external_environment():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}", EXAMPLE, "--devices", "2", "--max-steps", "4",
    ]  # fmt: skip
    assert "world_size=2" in _final_metrics(_run(command))


@pytest.mark.slow
def test_zero_example_trains_saves_sharded_and_resumes_on_one_device(tmp_path):
    example = str(ROOT / "examples" / "sharded_optimizer.py")
    checkpoint = str(tmp_path / "zero3")
    common = ["--max-steps", "4", "--checkpoint-format", "sharded", "--save", checkpoint]
    output = _run([sys.executable, example, "--stage", "3", "--devices", "2", *common])
    assert "world_size=2 stage=3" in _final_metrics(output)
    assert "rank 0: bytes held" in output and "rank 1: bytes held" in output
    resumed = _run([sys.executable, example, "--stage", "2", "--devices", "1", "--max-steps", "6",
                    "--resume", checkpoint, "--save", str(tmp_path / "resumed.ckpt")])  # fmt: skip
    assert "world_size=1 stage=2" in _final_metrics(resumed)
