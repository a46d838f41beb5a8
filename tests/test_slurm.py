"""SLURM: Lightning's SLURMEnvironment drives our strategies, from the variables ``srun`` sets.

In-process checks (no process group) cover every strategy's rank, world size, sampler and main-address wiring;
one real run executes ``examples/slurm/multi_node.sbatch`` with a stand-in ``srun`` that starts the 4 tasks of 2
"nodes" with the variables srun gives each task, and must equal one device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
from distributed_harness import find_free_port
from launch_helpers import (
    ROOT,
    TRAIN_ARGS,
    assert_equals_single_device,
    assert_ranks_took_part,
    clean_environment,
    describe,
    run_together,
)
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

JOB = {
    "SLURM_JOB_ID": "52781",
    "SLURM_JOB_NAME": "lightning-parallel",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_JOB_NODELIST": "node[1-2]",
}


def _task(rank: int) -> dict[str, str]:
    """What srun adds for task ``rank`` of the job above (2 tasks per node)."""
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2)}


STRATEGIES = {
    "data_parallel": (DataParallelStrategy, {}, 4, 3),
    "zero2": (ShardedOptimizerStrategy, {"stage": 2}, 4, 3),
    "zero3": (ShardedOptimizerStrategy, {"stage": 3}, 4, 3),
    # DP x PP 2 x 2: rank 3 is stage 1 of replica 1.
    "pipeline": (PipelineParallelStrategy, {"pipeline_parallel_size": 2}, 2, 1),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_slurm_variables_set_every_strategys_ranks_sampler_and_main_node(name, monkeypatch):
    strategy_class, options, replicas, replica_rank = STRATEGIES[name]
    for key, value in {**JOB, **_task(3)}.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    strategy = strategy_class(**options)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False)
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and environment.creates_processes_externally
    strategy.set_world_ranks()
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (3, 1, 1, 4)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": replicas, "rank": replica_rank}
    # Lightning's own parser: the first host of the node list, port 15000 + the job id's last 4 digits.
    assert (environment.main_address, environment.main_port) == ("node1", 15000 + 2781)


def test_master_addr_and_port_override_the_node_list(monkeypatch):
    for key, value in {**JOB, **_task(0), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        monkeypatch.setenv(key, value)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=ShardedOptimizerStrategy(stage=2))
    environment = trainer.strategy.cluster_environment
    assert (environment.main_address, environment.main_port) == ("127.0.0.1", 29517)


@pytest.mark.parametrize(("devices", "num_nodes", "hint"), [(4, 2, "Set `devices=2`"), (2, 1, "Set `num_nodes=2`")])
def test_a_trainer_that_disagrees_with_the_allocation_fails_on_every_rank_before_joining(
    devices, num_nodes, hint, monkeypatch
):
    for key, value in {**JOB, **_task(1)}.items():
        monkeypatch.setenv(key, value)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=DataParallelStrategy())
    with pytest.raises(ValueError, match=hint):  # a local check: raised before any collective, so never a hang
        trainer.strategy.setup_environment()


# A stand-in for srun: starts SLURM_NTASKS copies of the command with the variables srun sets per task.
FAKE_SRUN = """#!{python}
import os, subprocess, sys
tasks, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
procs = [
    subprocess.Popen(sys.argv[1:], env={{**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % per_node),
                                         "SLURM_NODEID": str(r // per_node), "SLURM_STEPID": "0"}})
    for r in range(tasks)
]
sys.exit(max(p.wait() for p in procs))
"""


@pytest.mark.slow
def test_multi_node_sbatch_script_trains_on_four_tasks_like_one_device(tmp_path):
    """``bash examples/slurm/multi_node.sbatch`` as sbatch runs it: the job's variables, srun per task."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    save = tmp_path / "final.ckpt"
    # node[1-2] does not resolve here: point every task at the loopback, as a user can.
    env = clean_environment(**JOB, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), PYTHON=sys.executable)
    env["PATH"] = f"{srun.parent}{os.pathsep}{env['PATH']}"
    command = ["bash", str(ROOT / "examples/slurm/multi_node.sbatch"), "examples/data_parallel.py", *TRAIN_ARGS]
    command += ["--save", str(save)]
    finished = run_together({"sbatch": command}, {"sbatch": env})
    assert finished["sbatch"].returncode == 0, describe(finished)
    output = finished["sbatch"].output
    lines = assert_ranks_took_part(output, world_size=4, num_nodes=2, environment="SLURMEnvironment")
    assert {line.main for line in lines} == {f"127.0.0.1:{env['MASTER_PORT']}"}
    assert_equals_single_device(save)


def test_sbatch_scripts_are_valid_bash_with_directives_before_the_first_command():
    for script in sorted((ROOT / "examples" / "slurm").glob("*.sbatch")):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
        lines = script.read_text().splitlines()
        first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
        directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
        assert directives and max(directives) < first_command, script  # sbatch ignores #SBATCH after a command
