"""Our strategies inside Ray Train's ``TorchTrainer`` (``lightning_parallel.integrations.ray``), on a local Ray
cluster with 2 CPU workers: the same weights as one device, a pipeline's stages on one batch, and a worker killed
mid-run restarted by Ray and resumed from Ray's checkpoint.

One local cluster per module and one ``TorchTrainer`` run for all of them (``tests/ray_helpers.py``): Ray's start
and its workers' imports cost far more than training. Skipped without Ray (``pip install -e ".[ray]"``), except
under ``LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS=1`` (CI), where a missing Ray fails.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS") == "1":  # CI (.ci/run): a missing Ray fails, as mpirun does
    import ray
else:
    ray = pytest.importorskip("ray", reason='Ray is not installed: `pip install -e ".[ray]"`')
pytest.importorskip("ray.train.torch")

import lightning.pytorch as pl
import ray_helpers
import torch
from launch_helpers import TOLERANCE, reference_weights, single_device_weights
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from streamed_data import STREAMED_SAMPLES
from training_helpers import assert_weights_close

from lightning_parallel import DataParallelStrategy
from lightning_parallel.integrations.ray import (
    RayPipelineParallelStrategy,
    RayShardedOptimizerStrategy,
    prepare_trainer,
    ray_strategy,
)

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 300  # the whole TorchTrainer run (2 worker starts); a hang fails the tests instead of blocking CI

# Each strategy at world size 2 (pipeline: one pipeline of 2 stages, so both stages read the whole global batch).
RUNS: dict[str, dict[str, Any]] = {
    "data_parallel": {"name": "data_parallel", "options": {}},
    "zero1": {"name": "zero1", "options": {}},
    "zero2_shard_size_1": {"name": "zero2", "options": {"shard_size": 1}},  # hybrid: 2 replicas of 1 shard
    "zero3_shard_size_2": {"name": "zero3", "options": {"shard_size": 2}},
    "pipeline_zero1": {"name": "pipeline", "options": {"zero_stage": 1}},
}
RESUMABLE = {"name": "zero2", "options": {}}
# One epoch of LitData and Hugging Face streamed data (issue 43): two replicas, or one pipeline of two stages (LitData
# only: the pipeline takes its example batch from the first loader of a dict of loaders, not the dict of batches).
BOTH = ["litdata", "hf"]
STREAMED: dict[str, dict[str, Any]] = {
    "data_parallel": {"name": "data_parallel", "options": {}, "libraries": BOTH},
    "zero3_shard_size_2": {"name": "zero3", "options": {"shard_size": 2}, "libraries": BOTH},
    "pipeline": {"name": "pipeline", "options": {"num_microbatches": 2}, "libraries": ["litdata"]},
}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for this module: 2 logical CPUs (one per worker; Ray's controller takes none, and fewer
    idle workers are prestarted), a small object store, no dashboard, no log forwarding; the workers import this
    checkout and the test helpers. Measured on 2 shared cores (load ~9): Ray's start 19 s, the first worker group
    up and importing 55 s, all training 12 s, the restart 43 s."""
    env_vars = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "RAY_TRAIN_V2_ENABLED": "1",
    }
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 1024**2,
        log_to_driver=False,
        runtime_env={"env_vars": env_vars},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def streamed_config(request) -> dict[str, Any]:
    """The streamed runs and their LitData chunks (written before Ray starts: ``litdata.optimize`` forks); none
    without LitData or ``datasets`` (the other checks still run)."""
    try:
        chunks = request.getfixturevalue("streamed_chunks")
    except pytest.skip.Exception:
        return {}
    return {"streamed": STREAMED, "streamed_dir": str(chunks)}


@pytest.fixture(scope="module")
def ray_run(streamed_config, ray_cluster, tmp_path_factory):
    """The one TorchTrainer run (``tests/ray_helpers.py``); its output folder and Ray's ``Result``."""
    out = tmp_path_factory.mktemp("ray_out")
    trainer = TorchTrainer(
        ray_helpers.train_loop_per_worker,
        train_loop_config={"out": str(out), "runs": RUNS, "resumable": RESUMABLE, **streamed_config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo", timeout_s=60),
        run_config=RunConfig(
            name="lightning_parallel_test",
            storage_path=str(tmp_path_factory.mktemp("ray_storage")),
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        ray.shutdown()  # kills the workers still waiting
        pytest.fail(f"The Ray Train run did not finish within {DEADLINE_S} s")
    if "error" in outcome:
        raise outcome["error"]
    return out, outcome["result"]


def _saved_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
@pytest.mark.parametrize("label", list(RUNS))
def test_each_strategy_in_ray_trains_like_one_device(ray_run, label):
    out, _ = ray_run
    assert_weights_close(_saved_weights(out / f"{label}.ckpt"), reference_weights(), **TOLERANCE)


@pytest.mark.slow
def test_every_strategy_joins_rays_process_group_and_launches_nothing(ray_run):
    out, _ = ray_run
    for rank in (0, 1):
        wiring = json.loads((out / f"wiring_rank{rank}.json").read_text())
        assert set(wiring) == set(RUNS)
        for label, facts in wiring.items():
            expected = {"same_group": True, "external": True, "environment": "RayLightningEnvironment"}
            assert facts == {**expected, "world_size": 2, "global_rank": rank}, label


@pytest.mark.slow
def test_pipeline_stages_in_ray_read_the_same_batch(ray_run):
    out, _ = ray_run
    batches = [json.loads((out / f"pipeline_zero1_batches_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert len(batches[0]) == ray_helpers.EQUAL_STEPS
    assert batches[0] == batches[1]
    # Data parallel splits each global batch: its two ranks read different halves (the check above can fail).
    halves = [json.loads((out / f"data_parallel_batches_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert halves[0] != halves[1]


@pytest.mark.slow
@pytest.mark.parametrize("label", list(STREAMED))
def test_each_worker_reads_its_replicas_share_of_streamed_data_in_ray(ray_run, label):
    """Issue 43, Ray Train: LitData's ``StreamingDataset`` (its rank and size: Ray's process group's, or the replica's
    as the pipeline tells it) and ``split_dataset_by_node`` with ``trainer.distributed_sampler_kwargs``. Two replicas
    read disjoint halves; the two stages of one pipeline read the same batches, the whole data set. One epoch covers
    every sample once per library."""
    pytest.importorskip("litdata")
    pytest.importorskip("datasets")
    out, _ = ray_run
    steps = [json.loads((out / f"streamed_{label}_rank{rank}.json").read_text()) for rank in (0, 1)]
    replicas = steps[:1] if label == "pipeline" else steps
    if label == "pipeline":
        assert steps[0] == steps[1]
    for library in STREAMED[label]["libraries"]:
        read = [[i for step in rank_steps for i in step[library]] for rank_steps in replicas]
        assert sorted(i for share in read for i in share) == list(range(STREAMED_SAMPLES)), (library, read)


@pytest.mark.slow
def test_killed_worker_is_restarted_by_ray_and_resumes_from_its_checkpoint(ray_run):
    out, result = ray_run
    assert (out / "killed").exists(), "rank 1 was never killed"
    starts = sorted(tuple(map(int, line.split())) for line in (out / "starts.txt").read_text().splitlines())
    resumed_at = (ray_helpers.KILL_STEP // ray_helpers.STEPS_PER_EPOCH) * ray_helpers.STEPS_PER_EPOCH
    # attempt rank global_step: both ranks started at 0, then (after Ray restarted them) at the last report.
    assert starts == [(0, 0, 0), (0, 1, 0), (1, 0, resumed_at), (1, 1, resumed_at)]
    steps = ray_helpers.STEPS_PER_EPOCH * ray_helpers.EPOCHS
    assert result.error is None
    assert result.metrics["step"] == steps and result.checkpoint is not None
    samples = ray_helpers.GLOBAL_BATCH * ray_helpers.STEPS_PER_EPOCH
    assert_weights_close(
        _saved_weights(out / "resumable.ckpt"), single_device_weights(steps=steps, samples=samples), **TOLERANCE
    )


# ---------------------------------------------------------------------------------------------- no Ray cluster needed
def test_ray_strategy_builds_the_ray_variant_of_a_registry_name():
    strategy = ray_strategy("zero3", shard_size=2)
    assert isinstance(strategy, RayShardedOptimizerStrategy)
    assert (strategy.stage, strategy.shard_size) == (3, 2)
    pipeline = ray_strategy("pipeline_gpipe", zero_stage=1)
    assert isinstance(pipeline, RayPipelineParallelStrategy) and pipeline.schedule == "GPipe"
    with pytest.raises(ValueError, match=r"zero2_notebook.*\['data_parallel'"):
        ray_strategy("zero2_notebook")


def test_prepare_trainer_names_the_ray_variant_and_the_environment():
    plain = pl.Trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match="RayDataParallelStrategy"):
        prepare_trainer(plain)
    without_environment = pl.Trainer(strategy=ray_strategy("zero2"), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match="RayLightningEnvironment"):
        prepare_trainer(without_environment)
    # With the environment, `prepare_trainer` passes the Trainer on: every fit of the Ray run goes through it.


def test_the_ray_environment_outside_a_ray_worker_names_the_fix():
    """In the driver (here: the pytest process, no Ray Train session) Ray's environment has no rank to give."""
    from ray.train.lightning import RayLightningEnvironment

    with pytest.raises(
        RuntimeError, match=r"RayShardedOptimizerStrategy with `RayLightningEnvironment\(\)`.*not a Ray"
    ):
        pl.Trainer(strategy=ray_strategy("zero2"), plugins=[RayLightningEnvironment()], accelerator="cpu", devices=1)
