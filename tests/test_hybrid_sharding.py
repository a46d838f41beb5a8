"""Hybrid sharding (``ShardedOptimizerStrategy(shard_size=K)``) and the one mesh every strategy builds.

One 4-rank forked run (2 shard groups of 2 ranks, ``distributed/mesh.py``'s ``replicate x shard``) holds every
training case, a few steps of the tiny GPT each:

* a ``shard_size`` that does not divide the world is refused on every rank before any collective (the run goes on);
* stages 1, 2 and 3 each equal one device on the same global batch (fp32 rounding), with the monitor's bytes held
  and bytes per step equal to the planner's (``zero{S} shard=2``), and the groups the mesh hands out;
* stage 3 built on the meta device initialises both replicas of a shard alike;
* checkpoints written under ``shard_size=2`` resume exactly under ``shard_size=None`` and under one device, and
  one-device checkpoints resume under ``shard_size=2`` (tests/test_checkpoints.py's uninterrupted reference).
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from test_checkpoints import _assert_same_training_state, _loader, _trainer, _uninterrupted
from torch.utils.data import DataLoader
from training_helpers import assert_monitor_equals_plan, assert_weights_close, fit_tiny, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.monitor import ParallelismMonitor
from lightning_parallel.planner import plan

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

WORLD_SIZE, SHARD_SIZE = 4, 2
PER_DEVICE_BATCH, STEPS = 2, 3
# Clipping (active: the norm is taken over one shard group's shards only, the replicas hold the same) and 2
# accumulated micro-batches (no communication on the first) in every training case.
CLIP_AND_ACCUMULATE: dict[str, Any] = {"gradient_clip_val": 0.05, "accumulate": 2}
# AdamW over 3 clipped steps: fp32 rounding of differently ordered sums (as tests/test_checkpoints.py); measured max
# |diff| 2.2e-6, the same with `shard_size=None` and `shard_size=1`.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


# ---------------------------------------------------------------------------------------------- layout arithmetic
def test_mesh_layout_coordinates_and_groups() -> None:
    layout = MeshLayout.for_sharding(8, 4)
    assert layout.shape == (2, 4, 1) and layout.is_hybrid
    assert [layout.coordinates(r) for r in (0, 5)] == [(0, 0, 0), (1, 1, 0)]
    assert layout.group_ranks("shard", 5) == [4, 5, 6, 7]
    assert layout.group_ranks("replicate", 5) == [1, 5]
    pipeline = MeshLayout(8, pipeline_parallel_size=2)
    assert pipeline.shape == (4, 1, 2)
    assert pipeline.group_ranks("pp", 5) == [4, 5] and pipeline.group_ranks("replicate", 5) == [1, 3, 5, 7]
    assert [pipeline.data_parallel_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert MeshLayout.for_sharding(4, None).shape == (1, 4, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_size": 3}, "`shard_size=3` does not divide the 4 data-parallel ranks (world size 4)"),
        ({"shard_size": 0}, "`shard_size=0` is invalid"),
        ({"shard_size": True}, "`shard_size=True` is invalid"),
        ({"pipeline_parallel_size": 3}, "`pipeline_parallel_size=3` must be a positive divisor"),
    ],
)
def test_mesh_layout_refuses_degrees_that_do_not_fit(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshLayout(4, **kwargs)


# ---------------------------------------------------------------------------------------------- training
def _train(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    with pytest.raises(ValueError, match=r"`shard_size=3` does not divide the 4 data-parallel ranks"):
        fit_tiny(ShardedOptimizerStrategy(stage=2, shard_size=3), devices=4, per_device_batch=PER_DEVICE_BATCH)
    results: dict[str, Any] = {}
    for stage in (1, 2, 3):
        summary_path = Path(directory, f"summary{stage}.json")
        monitor = ParallelismMonitor(summary_path=summary_path, figure_path=False)
        strategy = ShardedOptimizerStrategy(stage=stage, shard_size=SHARD_SIZE)
        weights = fit_tiny(
            strategy,
            devices=world_size,
            per_device_batch=PER_DEVICE_BATCH,
            max_steps=STEPS,
            callbacks=[monitor],
            **CLIP_AND_ACCUMULATE,
        )
        mesh = strategy.device_mesh
        results[f"groups{stage}"] = {
            axis: torch.distributed.get_process_group_ranks(mesh.get_group(axis)) for axis in mesh.mesh_dim_names or ()
        }
        if rank == 0:
            results[f"weights{stage}"] = weights
            results[f"summary{stage}"] = json.loads(summary_path.read_text())
    results["sampler"] = strategy.distributed_sampler_kwargs
    results["meta_init_shards"] = _meta_init_shards(world_size)
    results["data_parallel_mesh"] = _data_parallel_mesh(world_size)
    return results


class _ReadsTheMesh(GPTLightningModule):
    """Reads the strategy's mesh in ``configure_model``, as a user building a parallel model would."""

    def configure_model(self) -> None:
        mesh = self.trainer.strategy.device_mesh
        self.seen_mesh = (mesh.mesh_dim_names, tuple(mesh.shape))


def _data_parallel_mesh(world_size: int) -> tuple:
    module = _ReadsTheMesh("tiny", block_size=16, bias=False)
    trainer = make_trainer(DataParallelStrategy(), devices=world_size, max_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader(RandomTokenDataset(8, 16, seed=7), batch_size=2))
    return module.seen_mesh


def _meta_init_shards(world_size: int) -> dict[str, torch.Tensor]:
    """Stage 3 built on the meta device: each rank initialises only its shard; both replicas of a shard must draw
    the same values (seeded by the shard rank). One step, then this rank's local shards."""
    strategy = ShardedOptimizerStrategy(stage=3, shard_size=SHARD_SIZE)
    trainer = make_trainer(strategy, devices=world_size, max_steps=1)
    with trainer.init_module(empty_init=True):
        module = make_module()
    trainer.fit(module, train_dataloaders=DataLoader(RandomTokenDataset(16, 16, seed=7), batch_size=2))
    return {name: param.to_local().detach().clone() for name, param in module.named_parameters()}


@cache
def _trained(directory: str) -> list[dict[str, Any]]:
    return run_distributed(_train, WORLD_SIZE, args=(directory,), init_process_group=False, timeout=180)


@cache
def _one_device() -> dict[str, torch.Tensor]:
    (weights,) = run_distributed(_fit_one_device, 1, init_process_group=False, timeout=60)
    return weights


def _fit_one_device(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return fit_tiny(
        "auto", devices=1, per_device_batch=PER_DEVICE_BATCH * WORLD_SIZE, max_steps=STEPS, **CLIP_AND_ACCUMULATE
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _trained(str(tmp_path_factory.mktemp("hybrid")))


def test_every_strategy_exposes_the_mesh(trained: list[dict[str, Any]]) -> None:
    # Data parallel: every rank a replica; readable in `configure_model`.
    assert trained[0]["data_parallel_mesh"] == (("replicate", "shard", "pp"), (4, 1, 1))
    with pytest.raises(RuntimeError, match=r"`ShardedOptimizerStrategy.device_mesh` is built in `setup_environment`"):
        ShardedOptimizerStrategy(shard_size=2).device_mesh  # noqa: B018


def test_meta_device_init_gives_both_replicas_of_a_shard_the_same_values(trained: list[dict[str, Any]]) -> None:
    shards = [result["meta_init_shards"] for result in trained]
    for rank in (0, 1):  # rank r and r + 2 hold the same shard in the two replica groups
        assert_weights_close(shards[rank], shards[rank + 2], rtol=0, atol=0)
    assert any(not torch.equal(shards[0][name], shards[1][name]) for name in shards[0] if shards[0][name].numel())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_equals_one_device(trained: list[dict[str, Any]], stage: int) -> None:
    expected = _one_device()
    actual = trained[0][f"weights{stage}"]
    assert_weights_close(actual, expected, **TOLERANCE)
    # 2 x 2: shard within consecutive ranks, replicate across the groups; every rank reads its own slice.
    for rank, result in enumerate(trained):
        groups = result[f"groups{stage}"]
        assert groups["shard"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert groups["replicate"] == [rank % 2, rank % 2 + 2]
        assert groups["pp"] == [rank]
        assert result["sampler"] == {"num_replicas": 4, "rank": rank}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_bytes_per_rank_equal_the_planner(trained: list[dict[str, Any]], stage: int) -> None:
    predicted = plan(
        make_module(),
        world_size=WORLD_SIZE,
        num_nodes=WORLD_SIZE // SHARD_SIZE,
        batch_size=PER_DEVICE_BATCH,
        seq_len=16,
        process_group_backend="gloo",
    ).configuration(f"zero{stage} shard={SHARD_SIZE}")
    assert predicted.strategy == f"ShardedOptimizerStrategy(stage={stage}, shard_size={SHARD_SIZE})"
    summary = trained[0][f"summary{stage}"]
    sharded_over_all = plan(make_module(), world_size=WORLD_SIZE, batch_size=PER_DEVICE_BATCH, seq_len=16)
    assert_monitor_equals_plan(summary["ranks"], predicted.ranks)
    # Sharded over 2 ranks instead of 4: twice the optimizer state of `shard_size=None`, up to the padding.
    everywhere = sharded_over_all.configuration(f"zero{stage}").ranks[0]
    assert predicted.ranks[0].optimizer_state > 1.9 * everywhere.optimizer_state
    across = predicted.ranks[0].other_groups
    assert [(kind, size) for kind, _, size in across] == [("all_reduce", 2)]


# ---------------------------------------------------------------------------------------------- checkpoints
def _save_or_resume(rank: int, world_size: int, steps: list[tuple[str, str, str, bool]]) -> list[dict | None]:
    """Each step ``(layout, checkpoint format, path, resume)`` as tests/test_checkpoints.py's ``_run``: save after 2
    steps, or resume from ``path`` (from other weights) to 4 steps and return the consolidated state."""
    torch.set_num_threads(1)
    return [_one(rank, world_size, *step) for step in steps]


def _strategy(layout: str, checkpoint_format: str) -> Any:
    if layout == "single":
        return "auto"
    stage, _, shard = layout.partition(" shard=")
    return ShardedOptimizerStrategy(
        stage=int(stage[-1]),
        shard_size=int(shard) if shard else None,
        bucket_cap_mb=0.02,
        checkpoint_format=checkpoint_format,  # type: ignore[arg-type]
    )


def _one(rank: int, world_size: int, layout: str, checkpoint_format: str, path: str, resume: bool) -> dict | None:
    module = make_module("adamw")
    strategy = _strategy(layout, checkpoint_format)
    if not resume:
        saver = ModelCheckpoint(dirpath=Path(path).parent, filename=Path(path).stem, enable_version_counter=False)
        trainer = _trainer(strategy, world_size, max_steps=2, callbacks=[saver], enable_checkpointing=True)
        trainer.fit(module, train_dataloaders=_loader(world_size, rank))
        return None
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.5)  # a resume that ignored the checkpoint would not equal the uninterrupted run
    trainer = _trainer(strategy, world_size, max_steps=4)
    trainer.fit(module, train_dataloaders=_loader(world_size, rank), ckpt_path=path)
    assert trainer.global_step == 4
    if isinstance(trainer.strategy, ShardedOptimizerStrategy):
        trainer.strategy.checkpoint_format = "consolidated"  # read back the plain layout to compare
    weights = trainer.strategy.lightning_module_state_dict()
    optimizer_state = trainer.strategy.optimizer_state(trainer.optimizers[0])
    return {"weights": weights, "optimizer": optimizer_state} if rank == 0 else None


def test_checkpoints_move_between_shard_sizes_and_one_device(tmp_path: Path) -> None:
    ckpt = {name: str(tmp_path / name / "run.ckpt") for name in ("single", "z2h", "z3h", "z1h", "z3")}
    # One device saves; 4 ranks save under hybrid layouts and resume from every other layout; one device resumes.
    run_distributed(_save_or_resume, 1, args=([("single", "consolidated", ckpt["single"], False)],), timeout=60,
                    init_process_group=False)  # fmt: skip
    hybrid = [
        ("zero2 shard=2", "sharded", ckpt["z2h"], False),
        ("zero3 shard=2", "sharded", ckpt["z3h"], False),
        ("zero1 shard=2", "consolidated", ckpt["z1h"], False),
        ("zero3", "sharded", ckpt["z3"], False),
        ("zero3", "consolidated", ckpt["z2h"], True),  # sharded zero2 x (2 x 2) -> zero3 over all 4
        ("zero1 shard=2", "consolidated", ckpt["z3h"], True),  # sharded zero3 x (2 x 2) -> zero1 x (2 x 2)
        ("zero2 shard=2", "consolidated", ckpt["z3"], True),  # sharded zero3 over all 4 -> zero2 x (2 x 2)
        ("zero3 shard=2", "consolidated", ckpt["single"], True),  # one device -> zero3 x (2 x 2)
    ]
    results = run_distributed(_save_or_resume, 4, args=(hybrid,), init_process_group=False, timeout=240)[0]
    # Plain Lightning reads the consolidated file; the sharded directory needs our strategy (at one device too).
    single = [("single", "consolidated", ckpt["z1h"], True), ("zero2", "consolidated", ckpt["z3h"], True)]
    results += run_distributed(_save_or_resume, 1, args=(single,), init_process_group=False, timeout=60)[0]
    resumed = [result for result in results if result is not None]
    assert len(resumed) == 6
    for result in resumed:
        _assert_same_training_state(result, _uninterrupted())


# ---------------------------------------------------------------------- user-like models (not the demo)
USER_MODELS = {"aux_head": zoo.AuxHeadModel, "freeze_schedule": zoo.FreezeScheduleModel}


def _user_models(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        f"{name}-zero{stage}": zoo.fit_in_rank(make, ShardedOptimizerStrategy(stage, shard_size=SHARD_SIZE), world_size)
        for name, make in USER_MODELS.items()
        for stage in (1, 2, 3)
    }


def test_hybrid_sharding_trains_user_models_like_one_device() -> None:
    # An aux head used every other step beside a layer never used (AdamW with weight decay must not step them), and
    # a backbone frozen for two steps then unfrozen: 2 x 2 hybrid sharding at every stage against one device.
    fitted = run_distributed(_user_models, WORLD_SIZE, init_process_group=False, timeout=240)[0]
    for name, make in USER_MODELS.items():
        reference = zoo.single_device(make)
        for stage in (1, 2, 3):
            assert_weights_close(fitted[f"{name}-zero{stage}"], reference, rtol=1e-5, atol=1e-6)
