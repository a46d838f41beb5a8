"""Start the examples under real launchers (torchrun, srun-like environments, mpirun) and check what they did.

Every example prints one line per rank (``rank R/W node N local L host H environment E main ADDR:PORT``) and saves
its final weights with ``--save``; tests compare those weights with one in-process, single-device run on the same
global batch (:func:`reference_weights`).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler
from training_helpers import assert_weights_close, cpu_trainer

from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

STEPS, GLOBAL_BATCH, SEQ_LEN = 3, 8, 16
# Seeded tokens, one global batch of 8 per step split over the data-parallel replicas: every layout trains on the
# same samples as one device does.
TRAIN_ARGS = ["--data", "random", "--max-steps", str(STEPS), "--seq-len", str(SEQ_LEN)]
TRAIN_ARGS += ["--global-batch-size", str(GLOBAL_BATCH)]
# The example script and its arguments for each strategy. At world size 4 the pipeline is DP x PP = 2 x 2; at
# world size 2 it is one pipeline of 2 stages.
STRATEGIES: dict[str, tuple[str, list[str]]] = {
    "data_parallel": ("data_parallel.py", []),
    "zero1": ("sharded_optimizer.py", ["--stage", "1"]),
    "zero2": ("sharded_optimizer.py", ["--stage", "2"]),
    "zero3": ("sharded_optimizer.py", ["--stage", "3"]),
    "zero2_hybrid": ("sharded_optimizer.py", ["--stage", "2", "--shard-size", "2"]),
    "pipeline": ("pipeline_parallel.py", ["--pipeline-parallel-size", "2"]),
    "pipeline_zero2": ("pipeline_parallel.py", ["--pipeline-parallel-size", "2", "--zero-stage", "2"]),
}
# AdamW over 3 steps: fp32 rounding of differently ordered reductions (as in tests/test_data_parallel.py).
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

_LAUNCHER_VARIABLES = re.compile(
    r"^(MASTER_|WORLD_SIZE|RANK|LOCAL_|NODE_RANK|GROUP_|ROLE_|TORCHELASTIC_|SLURM_|OMPI_|PMI)"
)
# Not anchored to line starts: mpirun forwards each rank's output in chunks that may share a line.
_RANK_LINE = re.compile(r"rank (\d+)/(\d+) node (\d+) local (\d+) host (\S+) environment (\w+) main ([^\s:]+:\d+)")


def example_command(strategy: str, save: Path, *extra: str) -> list[str]:
    """``[script, args...]`` that trains ``strategy`` on the shared tiny setting and saves the weights to ``save``."""
    script, args = STRATEGIES[strategy]
    return [str(EXAMPLES / script), *args, *TRAIN_ARGS, "--save", str(save), *extra]


def clean_environment(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, one thread per process, no GPUs, the repository on
    ``PYTHONPATH``, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if not _LAUNCHER_VARIABLES.match(key)}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", **extra})
    return env


@dataclass
class Finished:
    name: str
    returncode: int | None
    output: str


def run_together(commands: dict[str, Sequence[str]], envs: dict[str, dict[str, str]], *, deadline: float = 240):
    """Start every command at once (own session each), wait for all; kill every tree still running at the deadline.

    Returns ``{name: Finished}``; ``returncode`` is ``None`` for a process killed at the deadline.
    """
    started = {}
    for name, command in commands.items():
        log = tempfile.TemporaryFile("w+")  # closed below
        process = subprocess.Popen(
            list(command), cwd=ROOT, env=envs[name], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        started[name] = (process, log)
    end = time.monotonic() + deadline
    while time.monotonic() < end and any(process.poll() is None for process, _ in started.values()):
        time.sleep(0.2)
    finished = {}
    for name, (process, log) in started.items():
        returncode = process.poll()
        if returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.seek(0)
        finished[name] = Finished(name, returncode, log.read())
        log.close()
    return finished


def describe(finished: dict[str, Finished], tail: int = 3000) -> str:
    """Every process's exit status and the tail of its output, for assertion messages."""
    parts = []
    for item in finished.values():
        status = "killed at the deadline" if item.returncode is None else f"exit {item.returncode}"
        parts.append(f"===== {item.name}: {status} =====\n{item.output[-tail:]}")
    return "\n".join(parts)


EXIT_ABORT = "terminate called without an active exception"
"""The known, rare abort of a gloo process at interpreter exit, after training (docs/reliability.md, "Known issue")."""


def assert_all_succeeded(finished: dict[str, Finished]) -> str:
    """Every process exited 0; returns all output joined.

    A launcher that failed only because a rank hit the known exit abort passes with a warning: the callers' own checks
    (every rank reported the end of training, the saved weights equal one device's) still decide."""
    failed = [item for item in finished.values() if item.returncode != 0]
    assert all(EXIT_ABORT in item.output for item in failed), describe(finished)
    if failed:
        known = "a rank aborted at exit after training (known issue, docs/reliability.md)"
        warnings.warn(f"{known}: {describe(finished)}", stacklevel=2)
    return "\n".join(item.output for item in finished.values())


@dataclass(frozen=True)
class RankLine:
    global_rank: int
    world_size: int
    node_rank: int
    local_rank: int
    host: str
    environment: str
    main: str


def rank_lines(output: str) -> list[RankLine]:
    """The ``rank R/W node N ...`` lines the examples print, one per rank that finished training."""
    return [
        RankLine(int(r), int(w), int(n), int(lr), host, env, main)
        for r, w, n, lr, host, env, main in _RANK_LINE.findall(output)
    ]


def assert_ranks_took_part(output: str, *, world_size: int, num_nodes: int, environment: str) -> list[RankLine]:
    """Ranks ``0..world_size-1`` each reported once, from the expected node and local rank, under ``environment``."""
    lines = sorted(rank_lines(output), key=lambda line: line.global_rank)
    assert [line.global_rank for line in lines] == list(range(world_size)), output[-3000:]
    per_node = world_size // num_nodes
    for line in lines:
        assert line.world_size == world_size, line
        assert (line.node_rank, line.local_rank) == divmod(line.global_rank, per_node), line
        assert line.environment == environment, line
    assert len({line.main for line in lines}) == 1, lines  # every rank joined the same main node
    return lines


@functools.cache
def reference_weights() -> dict[str, torch.Tensor]:
    """Final weights of a plain single-device Trainer on the same global batches (same seed, model, data).

    With several ranks Lightning replaces the examples' sequential sampler by ``DistributedSampler(shuffle=True,
    seed=0)``, so rank r takes ``perm[r::N]`` of one permutation; here that permutation is explicit, so step k
    sees exactly the samples the N ranks see together at step k.
    """
    return single_device_weights(steps=STEPS, samples=GLOBAL_BATCH * STEPS)


def single_device_weights(*, steps: int, samples: int) -> dict[str, torch.Tensor]:
    """The tiny GPT (seed 0) trained by one device for ``steps`` global batches of ``GLOBAL_BATCH`` drawn from
    ``samples`` random sequences by Lightning's shuffling sampler (``seed=0``, reseeded every epoch)."""
    pl.seed_everything(0, verbose=False)
    model = GPTLightningModule("tiny", block_size=SEQ_LEN, learning_rate=1e-3)
    dataset = RandomTokenDataset(samples, SEQ_LEN, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer = cpu_trainer(devices=1, max_steps=steps, limit_val_batches=0)
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_equals_single_device(checkpoint: Path) -> None:
    """The weights saved by a distributed run equal the single-device run's, and training really moved them."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    reference = reference_weights()
    assert_weights_close(saved, reference, **TOLERANCE)
    pl.seed_everything(0, verbose=False)
    initial = GPTLightningModule("tiny", block_size=SEQ_LEN, learning_rate=1e-3).state_dict()
    assert any(not torch.equal(initial[name], saved[name]) for name in initial)
