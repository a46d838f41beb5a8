"""Standalone tier: real process trees started the way users start them (one device, script re-launch, torchrun).

Multi-node torchrun, network namespaces, SLURM and mpirun runs of the same examples: tests/test_multinode.py,
tests/test_slurm.py, tests/test_mpi.py.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from distributed_harness import find_free_port
from launch_helpers import EXAMPLES, ROOT, assert_equals_single_device, clean_environment, example_command

EXAMPLE = str(EXAMPLES / "data_parallel.py")


def _run(command: list[str], timeout: float = 240) -> str:
    env = clean_environment()
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
    output = _run([sys.executable, example, "--stage", "3", "--meta-init", "--devices", "2", *common])
    assert "world_size=2 stage=3" in _final_metrics(output)
    assert "rank 0: bytes held" in output and "rank 1: bytes held" in output
    resumed = _run([sys.executable, example, "--stage", "2", "--devices", "1", "--max-steps", "6",
                    "--resume", checkpoint, "--save", str(tmp_path / "resumed.ckpt")])  # fmt: skip
    assert "world_size=1 stage=2" in _final_metrics(resumed)


@pytest.mark.slow
def test_single_device_run_of_the_data_parallel_example_equals_a_plain_trainer(tmp_path):
    output = _run([sys.executable, *example_command("data_parallel", tmp_path / "one.ckpt", "--devices", "1")])
    assert "world_size=1" in _final_metrics(output)
    assert_equals_single_device(tmp_path / "one.ckpt")


def _cluster_module():
    spec = importlib.util.spec_from_file_location("examples_cluster", EXAMPLES / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, (2, 1)),  # no launcher: the example's default, one node
        ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, (2, 2)),  # torchrun --nnodes=2 --nproc-per-node=2
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_SIZE": "3"}, (3, 1)),  # mpirun -np 3
        ({"MPI_LOCALNRANKS": "2", "PMI_SIZE": "8"}, (2, 4)),  # MPICH / Intel MPI
        ({"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}, (4, 2)),  # srun
    ],
)
def test_examples_take_devices_and_num_nodes_from_the_launcher(variables, expected, monkeypatch):
    for key in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("MPI_LOCALNRANKS", "PMI_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    cluster = _cluster_module()
    assert cluster.launched_layout(None, None) == expected
    assert cluster.launched_layout(5, 7) == (5, 7)  # explicit arguments win
