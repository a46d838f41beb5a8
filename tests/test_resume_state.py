"""A sharded-format resume continues exactly: weights and every optimizer state entry, parameter by parameter.

The models give their parameters different AdamW ``step`` counts, as users' models do: an auxiliary head used on
every other step (``AuxHeadModel``: its ``step`` is about half the trunk's, ``never_used`` has no state at all) and
a backbone frozen for the first steps (the pipeline case: the two stages hold parameters with different counts).
Each case trains one epoch of 3 steps under one strategy, saves a sharded checkpoint, resumes in a new Trainer under
another strategy for a second epoch, and must end with exactly the state of two uninterrupted single-device epochs:
the weights and each parameter's ``exp_avg``, ``exp_avg_sq`` and ``step`` (the resume is at an epoch boundary, so
``batch_idx`` and the data restart as in the uninterrupted run).

All cases run in one pair of forked ranks (one Trainer per fit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import AuxHeadModel, FreezeScheduleModel, loader, trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

EPOCH_STEPS = 3  # odd: the aux head's `step` (2 after one epoch) differs from the trunk's (3)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class _FreezeThenAdamW(FreezeScheduleModel):
    """The backbone is frozen until step 2 (so its AdamW ``step`` lags the head's by 2), also after a resume."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.backbone.requires_grad_(self.global_step >= self.unfreeze_at)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


MODELS = {"aux": AuxHeadModel, "freeze": _FreezeThenAdamW}
CASES = [
    # (world size, model, strategy that saves sharded, strategy that resumes)
    (2, "aux", "zero3", "zero3"),
    (2, "aux", "zero3", "data_parallel"),
    (2, "aux", "zero1", "zero2"),
    (2, "aux", "zero2", "data_parallel"),
    (2, "freeze", "zero3", "zero1"),
    (2, "freeze", "pipeline", "pipeline"),
    (2, "freeze", "pipeline", "zero3"),
    (1, "aux", "zero3", "zero3"),  # world size 1: nothing sharded, the module and optimizer as they are
]


def _strategy(spec: str) -> Any:
    if spec == "data_parallel":
        return DataParallelStrategy(find_unused_parameters=True, timeout=60)  # the aux head is unused every other step
    if spec == "pipeline":
        return PipelineParallelStrategy(schedule="GPipe", num_microbatches=2, checkpoint_format="sharded", timeout=60)
    # Tiny buckets: parameters straddle buckets and shards at stages 1-2.
    return ShardedOptimizerStrategy(stage=int(spec[-1]), bucket_cap_mb=0.001, checkpoint_format="sharded", timeout=60)


def _fit(model: str, strategy: Any, devices: int, *, max_epochs: int, ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    module = MODELS[model]()
    if ckpt_path is not None:  # other weights than the saved ones: a resume that ignored them could not pass
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.add_(0.5)
    fit_trainer = trainer(strategy, devices, max_steps=-1, max_epochs=max_epochs)
    sampler = getattr(fit_trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    data = loader(sampler["num_replicas"], sampler["rank"], steps=EPOCH_STEPS)
    fit_trainer.fit(module, data, ckpt_path=ckpt_path)
    return fit_trainer


def _training_state(fit_trainer: pl.Trainer, path: Path) -> dict[str, Any] | None:
    """Collective. The run's consolidated checkpoint (what one device would save), read back on rank 0."""
    if hasattr(fit_trainer.strategy, "checkpoint_format"):
        fit_trainer.strategy.checkpoint_format = "consolidated"
    fit_trainer.save_checkpoint(path)
    if not fit_trainer.is_global_zero:
        return None
    saved = torch.load(path, weights_only=True)
    return {"weights": saved["state_dict"], "optimizer": saved["optimizer_states"][0]}


def _save_and_resume(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    results = {}
    for index, case in enumerate(CASES):
        size, model, saving, resuming = case
        if size != world_size:
            continue
        sharded = f"{directory}/case{index}-sharded"
        _fit(model, _strategy(saving), world_size, max_epochs=1).save_checkpoint(sharded)
        resumed = _fit(model, _strategy(resuming), world_size, max_epochs=2, ckpt_path=sharded)
        assert resumed.global_step == 2 * EPOCH_STEPS
        results[case] = _training_state(resumed, Path(directory) / f"case{index}-resumed.ckpt")
    return results


def _uninterrupted(model: str) -> dict[str, Any]:
    fit_trainer = _fit(model, "auto", 1, max_epochs=2)
    return {"weights": fit_trainer.lightning_module.state_dict(), "optimizer": fit_trainer.optimizers[0].state_dict()}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """Every case's resumed state (rank 0's), each world size's cases in one forked run."""
    results = {}
    for world_size in sorted({case[0] for case in CASES}):
        directory = str(tmp_path_factory.mktemp(f"resume{world_size}"))
        ranks = run_distributed(_save_and_resume, world_size, args=(directory,), init_process_group=False, timeout=240)
        results.update(ranks[0])
    return results


@pytest.mark.parametrize("case", CASES, ids=lambda case: "{}-ws{}-{}-{}".format(case[1], case[0], *case[2:]))
def test_sharded_resume_equals_an_uninterrupted_run_state_for_state(resumed, case) -> None:
    model = case[1]
    result, expected = resumed[case], _uninterrupted(model)
    torch.testing.assert_close(result["weights"], expected["weights"], **TOLERANCE)
    state, reference = result["optimizer"]["state"], expected["optimizer"]["state"]
    assert sorted(state) == sorted(reference)  # the same parameters have state (`never_used` has none)
    steps = {index: float(entry["step"]) for index, entry in reference.items()}
    assert len(set(steps.values())) > 1, steps  # guard: the model does give parameters different counts
    for index, entry in reference.items():
        assert sorted(state[index]) == sorted(entry), index
        for key, value in entry.items():
            exact = {"rtol": 0.0, "atol": 0.0} if key == "step" else TOLERANCE
            try:
                torch.testing.assert_close(state[index][key], value, **exact)
            except AssertionError as error:
                raise AssertionError(f"parameter {index}, {key}: {error}") from None
