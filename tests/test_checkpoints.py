"""Checkpoints move between strategies and world sizes and continue exactly as an uninterrupted run.

Each case trains 2 optimizer steps under strategy A at world size a, saves, then resumes under strategy B at world
size b for 2 more steps. Weights *and* optimizer state (AdamW's exp_avg, exp_avg_sq, step) must equal 4
uninterrupted single-device steps.

Every step uses the same global batch of 8 samples (rank r of N takes samples ``[r*8/N, (r+1)*8/N)``), so the
trajectory depends only on the restored state and the step count, not on how Lightning replays a partly
consumed epoch's data order after a resume (which is Lightning's behaviour, the same for every strategy).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset
from training_helpers import SEQ_LEN, assert_weights_close, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

GLOBAL_BATCH = 8
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # AdamW (see test_data_parallel.TOLERANCE)


def _strategy(spec: str, checkpoint_format: str):
    if spec == "single":
        return "auto"
    if spec == "data_parallel":
        return DataParallelStrategy()
    return ShardedOptimizerStrategy(stage=int(spec[-1]), bucket_cap_mb=0.02, checkpoint_format=checkpoint_format)


def _loader(world_size: int, rank: int) -> DataLoader:
    per_rank = GLOBAL_BATCH // world_size
    dataset = Subset(RandomTokenDataset(GLOBAL_BATCH, SEQ_LEN, seed=7), range(rank * per_rank, (rank + 1) * per_rank))
    return DataLoader(dataset, batch_size=per_rank, shuffle=False)


def _trainer(strategy, world_size: int, max_steps: int, **kwargs):
    return make_trainer(strategy, devices=world_size, max_steps=max_steps, use_distributed_sampler=False, **kwargs)


def _run(rank: int, world_size: int, spec: str, checkpoint_format: str, path: str, resume: bool) -> dict | None:
    module = make_module("adamw")
    strategy = _strategy(spec, checkpoint_format)
    if resume:
        # Start from other weights than the saving run: a resume that ignored the checkpoint would otherwise train the
        # same 4 steps on the same batch and still equal the uninterrupted run.
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.add_(0.5)
        trainer = _trainer(strategy, world_size, max_steps=4)
        trainer.fit(module, train_dataloaders=_loader(world_size, rank), ckpt_path=path)
    else:
        # Saved by ModelCheckpoint, as users do (it writes at the end of each epoch: 1 step here).
        saver = ModelCheckpoint(dirpath=Path(path).parent, filename=Path(path).stem, enable_version_counter=False)
        trainer = _trainer(strategy, world_size, max_steps=2, callbacks=[saver], enable_checkpointing=True)
        trainer.fit(module, train_dataloaders=_loader(world_size, rank))
        return None
    assert trainer.global_step == 4
    if isinstance(trainer.strategy, ShardedOptimizerStrategy):
        trainer.strategy.checkpoint_format = "consolidated"  # read back the plain layout to compare
    weights = trainer.strategy.lightning_module_state_dict()
    optimizer_state = trainer.strategy.optimizer_state(trainer.optimizers[0])
    return {"weights": weights, "optimizer": optimizer_state}


@cache
def _uninterrupted() -> dict:
    (result,) = run_distributed(_run_uninterrupted, world_size=1, init_process_group=False, timeout=60)
    return result


def _run_uninterrupted(rank: int, world_size: int) -> dict:
    module = make_module("adamw")
    trainer = _trainer("auto", 1, max_steps=4)
    trainer.fit(module, train_dataloaders=_loader(1, 0))
    return {"weights": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}


def _assert_same_training_state(result: dict, expected: dict) -> None:
    assert_weights_close(result["weights"], expected["weights"], **TOLERANCE)
    state, reference = result["optimizer"]["state"], expected["optimizer"]["state"]
    assert sorted(state) == sorted(reference)
    for index in reference:
        assert state[index].keys() == reference[index].keys()
        for key, value in reference[index].items():
            torch.testing.assert_close(state[index][key], value, **TOLERANCE)
    assert _hyperparameters(result["optimizer"]) == _hyperparameters(expected["optimizer"])


def _hyperparameters(optimizer_state: dict) -> list[dict]:
    """Param-group settings with tuples as lists (FSDP2's state-dict round trip turns `betas` into a list)."""
    return [
        {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
        for group in optimizer_state["param_groups"]
    ]


CASES = [
    # (format, save strategy, save world size, resume strategy, resume world size)
    ("consolidated", "zero2", 2, "single", 1),
    ("consolidated", "single", 1, "zero1", 2),
    ("consolidated", "zero2", 2, "zero3", 4),
    ("consolidated", "zero3", 4, "zero2", 2),
    ("consolidated", "zero1", 2, "data_parallel", 2),
    ("consolidated", "data_parallel", 2, "zero3", 2),
    ("sharded", "zero2", 2, "zero2", 4),
    ("sharded", "zero2", 4, "zero1", 2),
    ("sharded", "zero3", 2, "zero3", 4),
    ("sharded", "zero3", 4, "zero2", 2),
    ("sharded", "zero1", 2, "data_parallel", 2),
    ("sharded", "zero2", 1, "zero3", 2),
]


@pytest.mark.parametrize(
    ("checkpoint_format", "save_spec", "save_size", "resume_spec", "resume_size"),
    CASES,
    ids=[f"{c[0]}-{c[1]}x{c[2]}-to-{c[3]}x{c[4]}" for c in CASES],
)
def test_checkpoint_resumes_under_another_strategy_and_world_size_exactly(
    tmp_path, checkpoint_format, save_spec, save_size, resume_spec, resume_size
):
    path = str(tmp_path / "run.ckpt")
    run_distributed(
        _run, save_size, args=(save_spec, checkpoint_format, path, False), init_process_group=False, timeout=120
    )
    assert Path(path).is_dir() == (checkpoint_format == "sharded" and save_spec.startswith("zero"))
    results = run_distributed(
        _run, resume_size, args=(resume_spec, "consolidated", path, True), init_process_group=False, timeout=120
    )
    _assert_same_training_state(results[0], _uninterrupted())


def test_consolidated_zero_checkpoint_loads_with_plain_lightning_load_from_checkpoint(tmp_path):
    path = str(tmp_path / "zero3.ckpt")
    run_distributed(_run, 2, args=("zero3", "consolidated", path, False), init_process_group=False, timeout=120)
    loaded = GPTLightningModule.load_from_checkpoint(path, map_location="cpu")
    saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    assert_weights_close(loaded.state_dict(), saved, rtol=0, atol=0)
    untrained = make_module("adamw").state_dict()
    assert not torch.equal(saved["model.head.weight"], untrained["model.head.weight"])


def _resume_into_other_model(rank: int, world_size: int, path: str, stage: int) -> None:
    module = GPTLightningModule("tiny", block_size=SEQ_LEN, n_embd=32, bias=False)
    trainer = _trainer(ShardedOptimizerStrategy(stage=stage, timeout=30), world_size, max_steps=4)
    try:
        trainer.fit(module, train_dataloaders=_loader(world_size, rank), ckpt_path=path)
    except ValueError as error:
        raise RuntimeError(f"rank {rank} refused: {error}") from error


@pytest.mark.parametrize("resume_stage", [2, 3])
@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_checkpoint_of_a_different_model_is_refused_on_every_rank(tmp_path, checkpoint_format, resume_stage):
    path = str(tmp_path / "run.ckpt")
    run_distributed(_run, 2, args=("zero2", checkpoint_format, path, False), init_process_group=False, timeout=120)
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_resume_into_other_model, 2, args=(path, resume_stage), init_process_group=False, timeout=60)
    text = str(error.value)
    assert "did not finish" not in text
    for rank in (0, 1):
        assert f"rank {rank} refused: " in text
        assert "different model" in text.split(f"rank {rank} refused: ")[1].splitlines()[0]


def test_sharded_checkpoint_converts_to_a_file_plain_lightning_loads(tmp_path):
    from lightning_parallel.distributed.checkpoint import consolidate_checkpoint

    sharded = str(tmp_path / "sharded.ckpt")
    consolidated = str(tmp_path / "consolidated.ckpt")
    run_distributed(_run, 2, args=("zero3", "sharded", sharded, False), init_process_group=False, timeout=120)
    run_distributed(_run, 2, args=("zero3", "consolidated", consolidated, False), init_process_group=False, timeout=120)
    converted = consolidate_checkpoint(sharded, tmp_path / "converted.ckpt")
    loaded = GPTLightningModule.load_from_checkpoint(converted, map_location="cpu")
    expected = torch.load(consolidated, map_location="cpu", weights_only=False)
    assert_weights_close(loaded.state_dict(), expected["state_dict"], rtol=0, atol=0)
    plain = torch.load(converted, map_location="cpu", weights_only=False)
    assert plain["global_step"] == expected["global_step"] == 2
    assert _hyperparameters(plain["optimizer_states"][0]) == _hyperparameters(expected["optimizer_states"][0])


def _read_own_rows(rank: int, world_size: int, path: str) -> dict:
    from lightning_parallel.distributed.checkpoint import ShardedCheckpointReader, even_split

    reader = ShardedCheckpointReader(path)
    total = 0
    requests = []
    for name, shape in reader.meta["shapes"].items():
        numel = torch.Size(shape).numel()
        total += numel * 4 * len(reader.keys_of(name))
        start, stop = even_split(numel, rank, world_size)
        requests += [(key, name, start, stop) for key in reader.keys_of(name) if stop > start]
    values = reader.read(requests)
    return {"bytes_read": reader.bytes_read, "total": total, "requests": len(values)}


def test_resuming_a_sharded_checkpoint_reads_only_the_ranges_a_rank_holds(tmp_path):
    path = str(tmp_path / "sharded.ckpt")
    run_distributed(_run, 4, args=("zero3", "sharded", path, False), init_process_group=False, timeout=120)
    results = run_distributed(_read_own_rows, 4, args=(path,), timeout=60)
    for result in results:
        # Each rank asked for a quarter of every tensor; it may load a few whole pieces that straddle its range.
        assert result["total"] / 4 <= result["bytes_read"] <= result["total"] / 2


# ------------------------------------------------------------------ damaged and tampered files
class _RunsCodeWhenUnpickled:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.makedirs, (self.marker,))


def _resume_from(rank: int, world_size: int, path: str, spec: str) -> None:
    trainer = _trainer(_strategy(spec, "consolidated"), world_size, max_steps=4)
    try:
        trainer.fit(make_module("adamw"), train_dataloaders=_loader(world_size, rank), ckpt_path=path)
    except ValueError as error:
        raise RuntimeError(f"rank {rank} refused: {type(error).__name__}: {error}") from error


def _damage(path: Path, how: str, tmp_path: Path) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "code":
        torch.save({"state_dict": {}, "payload": _RunsCodeWhenUnpickled(str(tmp_path / "pwned"))}, path)
    elif how == "missing-shard":
        next(path.glob("*.distcp")).unlink()


@pytest.mark.parametrize(
    ("how", "checkpoint_format", "resume_spec"),
    [
        ("truncated", "consolidated", "zero2"),
        ("code", "consolidated", "data_parallel"),
        ("missing-shard", "sharded", "zero3"),
        ("missing-shard", "sharded", "data_parallel"),
    ],
)
def test_damaged_or_tampered_checkpoints_are_refused_clearly_on_every_rank(
    tmp_path, how, checkpoint_format, resume_spec
):
    path = tmp_path / "run.ckpt"
    run_distributed(_run, 2, args=("zero2", checkpoint_format, str(path), False), init_process_group=False, timeout=60)
    _damage(path, how, tmp_path)
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_resume_from, 2, args=(str(path), resume_spec), init_process_group=False, timeout=60)
    text = str(error.value)
    assert "did not finish" not in text
    for rank in (0, 1):
        assert f"rank {rank} refused: DamagedCheckpointError: Cannot " in text, text[-2000:]
    assert not (tmp_path / "pwned").exists(), "code from the checkpoint ran"
