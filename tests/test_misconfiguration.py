"""Table of misconfigurations: each gives a clear error of the right type on every rank, within seconds, no hang.

Every case runs on 2 forked ranks started like torchrun; a case passes when both ranks raise the expected error
type with a message naming the bad value (and the fix), and neither rank is still waiting when the harness deadline
(below the process-group timeout of the cases that create a group) hits.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from torch.utils.data import DataLoader, Subset
from training_helpers import SEQ_LEN, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset


def _loader(rank: int, batches: int = 4) -> DataLoader:
    dataset = RandomTokenDataset(8, SEQ_LEN, seed=rank)
    return DataLoader(Subset(dataset, range(batches * 2)), batch_size=2)


def _fit(strategy, *, devices: int = 2, num_nodes: int = 1, module=None, loader=None, **kwargs) -> None:
    trainer = make_trainer(strategy, devices=devices, max_steps=2, num_nodes=num_nodes, **kwargs)
    module = module if module is not None else make_module()
    trainer.fit(module, train_dataloaders=loader if loader is not None else _loader(0))


def _lbfgs_module():
    module = make_module()
    module.configure_optimizers = lambda: torch.optim.LBFGS(module.parameters())
    return module


def _saved_checkpoint(directory: Path, checkpoint_format: str) -> str:
    path = directory / f"{checkpoint_format}.ckpt"
    if not path.exists():
        run_distributed(_save, 2, args=(str(path), checkpoint_format), init_process_group=False, timeout=60)
    return str(path)


def _save(rank: int, world_size: int, path: str, checkpoint_format: str) -> None:
    trainer = make_trainer(ShardedOptimizerStrategy(checkpoint_format=checkpoint_format), devices=2, max_steps=1)
    trainer.fit(make_module(), train_dataloaders=_loader(rank))
    trainer.save_checkpoint(path)


def _other_model():
    return GPTLightningModule("tiny", block_size=SEQ_LEN, n_embd=32, bias=False)


# (id, what every rank runs, expected error type, text the message must contain, extra environment)
CASES = [
    ("dp-start-method", lambda r, d: DataParallelStrategy(start_method="forkserver"), ValueError,
     "Unknown `start_method='forkserver'`. Valid options: 'popen'", {}),
    ("dp-compression-name", lambda r, d: DataParallelStrategy(gradient_compression="int8"), ValueError,
     "Unknown `gradient_compression='int8'`. Valid options: None, 'fp16', 'bf16', 'powersgd'", {}),
    ("dp-powersgd-rank", lambda r, d: DataParallelStrategy(gradient_compression="powersgd", powersgd_rank=0),
     ValueError, "`powersgd_rank=0` is invalid", {}),
    ("dp-powersgd-start", lambda r, d: DataParallelStrategy(powersgd_start_iter=1), ValueError,
     "`powersgd_start_iter=1` is invalid", {}),
    ("dp-uneven-option", lambda r, d: DataParallelStrategy(uneven_inputs="sometimes"), ValueError,
     "`uneven_inputs='sometimes'` is invalid. Valid options: 'auto', True, False", {}),
    ("dp-bucket-size", lambda r, d: DataParallelStrategy(bucket_cap_mb=0), ValueError,
     "`bucket_cap_mb=0` must be a positive", {}),
    ("dp-negative-timeout", lambda r, d: DataParallelStrategy(timeout=-5), ValueError,
     "`timeout=-5` must be positive", {}),
    ("dp-timeout-type", lambda r, d: DataParallelStrategy(timeout="soon"), TypeError,
     "`timeout='soon'` must be a `datetime.timedelta` or a number of seconds", {}),
    ("dp-nonfinite-policy", lambda r, d: DataParallelStrategy(nonfinite_loss="retry"), ValueError,
     "`nonfinite_loss='retry'` is invalid. Valid options: 'skip'", {}),
    ("zero-nonfinite-policy", lambda r, d: ShardedOptimizerStrategy(nonfinite_loss=None), ValueError,
     "`nonfinite_loss=None` is invalid", {}),
    ("zero-stage", lambda r, d: ShardedOptimizerStrategy(stage=4), ValueError,
     "`stage=4` is invalid. Valid options: 1", {}),
    ("zero-stage-bool", lambda r, d: ShardedOptimizerStrategy(stage=True), ValueError, "`stage=True` is invalid", {}),
    ("zero-checkpoint-format", lambda r, d: ShardedOptimizerStrategy(checkpoint_format="zip"), ValueError,
     "`checkpoint_format='zip'` is invalid. Valid options: 'consolidated', 'sharded'", {}),
    ("zero-start-method", lambda r, d: ShardedOptimizerStrategy(start_method="thread"), ValueError,
     "Unknown `start_method='thread'`", {}),
    ("zero-shard-size", lambda r, d: ShardedOptimizerStrategy(shard_size=0), ValueError,
     "`shard_size=0` is invalid: pass a positive number of ranks", {}),
    ("zero-shard-size-divides", lambda r, d: _fit(ShardedOptimizerStrategy(shard_size=3, timeout=20)), ValueError,
     "`shard_size=3` does not divide the 2 data-parallel ranks (world size 2)", {}),
    ("pipeline-schedule", lambda r, d: PipelineParallelStrategy(schedule="zigzag"), ValueError,
     "Unknown `schedule='zigzag'`. Valid schedules (case-insensitive): GPipe, 1F1B", {}),
    ("pipeline-microbatches", lambda r, d: PipelineParallelStrategy(num_microbatches=0), ValueError,
     "`num_microbatches=0` is invalid", {}),
    ("pipeline-partition", lambda r, d: PipelineParallelStrategy(partition="random"), ValueError,
     "`partition='random'` is invalid. Valid options: 'flops' (or its older name 'compute')", {}),
    ("pipeline-fewer-layers-with-list",
     lambda r, d: PipelineParallelStrategy(partition=[2], first_stage_fewer_layers=1), ValueError,
     "`first_stage_fewer_layers=1` / `last_stage_fewer_layers=0` lighten the stages of an automatic partition", {}),
    ("pipeline-fewer-layers-than-the-model",
     lambda r, d: _fit(PipelineParallelStrategy(first_stage_fewer_layers=99, timeout=20)), ValueError,
     "`first_stage_fewer_layers=99` is larger than the model's", {}),
    ("pipeline-size-divides", lambda r, d: _fit(PipelineParallelStrategy(pipeline_parallel_size=3, timeout=20)),
     ValueError, "is not divisible by `pipeline_parallel_size=3`", {}),
    ("pipeline-too-few-microbatches", lambda r, d: _fit(PipelineParallelStrategy(num_microbatches=1, timeout=20)),
     ValueError, "needs at least as many micro-batches as pipeline", {}),
    ("launcher-world-size", lambda r, d: _fit(DataParallelStrategy(timeout=20)), ValueError,
     "The launcher started WORLD_SIZE=4 processes, but the Trainer was given `devices=2`", {"WORLD_SIZE": "4"}),
    ("num-nodes-product", lambda r, d: _fit(ShardedOptimizerStrategy(timeout=20), num_nodes=2), ValueError,
     "(2 * 2 = 4)", {}),
    ("torchrun-devices", lambda r, d: _fit(ShardedOptimizerStrategy(timeout=20), devices=1), ValueError,
     "`devices=1`", {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}),
    ("notebook-name-under-torchrun", lambda r, d: make_trainer("data_parallel_notebook", devices=2, max_steps=1),
     ValueError, "`start_method='fork'` (the `_spawn`/`_notebook` strategy names) starts its own processes",
     {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}),
    ("zero-spawn-under-slurm", lambda r, d: make_trainer(ShardedOptimizerStrategy(start_method="spawn"), devices=2,
     max_steps=1), ValueError, "already started as one rank by an external launcher (SLURMEnvironment",
     {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "node1",
      "SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}),
    ("pipeline-fork-under-torchrun", lambda r, d: make_trainer(PipelineParallelStrategy(start_method="fork"),
     devices=2, max_steps=1), ValueError, "Use the plain strategy name",
     {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}),
    ("zero-lbfgs", lambda r, d: _fit(ShardedOptimizerStrategy(timeout=20), module=_lbfgs_module()), TypeError,
     "ShardedOptimizerStrategy cannot shard `LBFGS`", {}),
    ("dp-rank-without-batches", lambda r, d: _fit(
        DataParallelStrategy(timeout=20), loader=_loader(r, batches=3 if r == 0 else 0), use_distributed_sampler=False
    ), ValueError, "received no training batch at all", {}),
    ("checkpoint-missing", lambda r, d: make_trainer(ShardedOptimizerStrategy(timeout=20), devices=2, max_steps=2).fit(
        make_module(), train_dataloaders=_loader(r), ckpt_path=str(d / "nope.ckpt")), FileNotFoundError, "nope.ckpt",
     {}),
    ("checkpoint-other-model", lambda r, d: make_trainer(ShardedOptimizerStrategy(timeout=20), devices=2, max_steps=2)
     .fit(_other_model(), train_dataloaders=_loader(r), ckpt_path=_saved_checkpoint(d, "consolidated")), ValueError,
     "The checkpoint does not match this model", {}),
    ("sharded-checkpoint-other-model", lambda r, d: make_trainer(ShardedOptimizerStrategy(stage=3, timeout=20),
     devices=2, max_steps=2).fit(_other_model(), train_dataloaders=_loader(r),
                                 ckpt_path=_saved_checkpoint(d, "sharded")),
     ValueError, "comes from a different model", {}),
    ("dp-checkpoint-other-model", lambda r, d: make_trainer(DataParallelStrategy(timeout=20), devices=2, max_steps=2)
     .fit(_other_model(), train_dataloaders=_loader(r), ckpt_path=_saved_checkpoint(d, "consolidated")), ValueError,
     "The checkpoint does not match this model", {}),
]  # fmt: skip


def _run_case(rank: int, world_size: int, index: int, directory: str) -> None:
    _, action, _, _, _ = CASES[index]
    start = time.monotonic()
    try:
        action(rank, Path(directory))
    except Exception as error:
        elapsed = time.monotonic() - start
        raise RuntimeError(f"rank {rank} raised {type(error).__name__} after {elapsed:.1f}s: {error}") from error
    raise AssertionError(f"rank {rank} raised nothing")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("checkpoints")
    for checkpoint_format in ("consolidated", "sharded"):
        _saved_checkpoint(directory, checkpoint_format)
    return directory


def test_the_table_has_at_least_twenty_cases():
    assert len(CASES) >= 20
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_misconfiguration_fails_fast_and_clearly_on_every_rank(index, checkpoints):
    _, _, error_type, message, env = CASES[index]
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_run_case, 2, args=(index, str(checkpoints)), init_process_group=False, env=env, timeout=60)
    text = str(failure.value)
    assert "did not finish" not in text, f"a rank hung:\n{text[-3000:]}"
    for rank in (0, 1):
        line = next((ln for ln in text.splitlines() if ln.startswith(f"RuntimeError: rank {rank} raised ")), None)
        assert line is not None, text[-3000:]
        assert f"raised {error_type.__name__} after " in line, line
        assert message in line, line
