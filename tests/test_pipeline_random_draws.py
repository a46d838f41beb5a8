"""Random draws in a pipelined step (issue 30, item 3): every rank and micro-batch that runs the step sees the same.

A denoising step, ``noise = torch.randn_like(x); loss = mse(self(x + noise), noise)``, learnt nothing under the
pipeline (score 1.01 against 0.03 on one device): the first stage's run of the step and the last stage's
per-micro-batch runs drew different noise. Now the input-learning run's draws are recorded and replayed
(``distributed/pipeline/random_draws.py``):

* unit (no processes): record/replay per micro-batch (slices, equal-shape draws, in-place and ``out=`` draws,
  dropout in the step), the RNG streams left as they were, and the refusals (a shape that is neither, another count
  or order of draws, ``randperm(len(x))``, Python's and NumPy's generators);
* two forked ranks, real Trainers: the denoising model trains within 2x of one device's score after 200 steps,
  without and with ``pipeline_inputs``; the noise the first stage's run drew is, row for row, the noise each
  micro-batch's step drew on the last stage (in validation too, on a padded batch); dropout inside the layers draws
  per stage and per micro-batch, as on one device; and a step whose draw cannot be made consistent fails with an
  error naming the draw.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from training_helpers import cpu_trainer

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.distributed.pipeline.random_draws import (
    InconsistentDrawError,
    RecordedDraws,
    draw_seed,
    recording_draws,
    replaying_draws,
)

CPU = torch.device("cpu")
SEED = 1234
FEATURES, HIDDEN, LATENT = 8, 32, 2
NUM_SAMPLES, BATCH, STEPS = 256, 32, 200
RECORDED_BATCHES = (1, 2)  # by global step; step 0 also runs torch's shape inference through the layers


# ------------------------------------------------------------------ unit: record and replay
def _record(fn: Any, *args: Any, exhaustive: bool = True) -> tuple[Any, RecordedDraws]:
    with recording_draws(
        device=CPU, seed=7, source="`training_step` (run up to the model call)", exhaustive=exhaustive
    ) as r:
        out = fn(*args)
    return out, r


def _replay(recorded: RecordedDraws, fn: Any, *args: Any, microbatch: int, rows: tuple[int, int], size: int) -> Any:
    with replaying_draws(
        recorded, device=CPU, step="training_step", microbatch=microbatch, rows=rows, batch_size=size
    ) as replay:
        out = fn(*args)
        replay.model_called()
        after = torch.randn(3)  # a draw after `self(...)`: from the micro-batch's own forked stream
    return out, after


def _denoising_prefix(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    noise = torch.randn_like(x)  # per sample: sliced
    timestep = torch.rand(())  # one per batch: the same value for every micro-batch
    table = torch.randn(4, 3)  # shape independent of the batch: the same value
    mask = torch.empty(x.shape[0], 2).bernoulli_(0.5)  # in place
    scale = torch.empty(x.shape[0])
    torch.rand(x.shape[0], out=scale)  # out=
    dropped = F.dropout(x, 0.5)  # dropout in the step itself, before `self(...)`
    noise.mul_(2.0)  # changing a draw afterwards does not change what was recorded
    return noise, timestep, table, mask, scale, dropped


def test_micro_batches_replay_the_slices_and_equal_shaped_draws_of_the_whole_batch():
    x = torch.randn(8, 3)
    state = torch.get_rng_state()
    whole, recorded = _record(_denoising_prefix, x)
    assert torch.equal(torch.get_rng_state(), state)  # the step's draws do not advance the global stream
    assert [d.op for d in recorded.draws] == [
        "aten.randn_like",
        "aten.rand",
        "aten.randn",
        "aten.bernoulli_",
        "aten.rand",
        "aten.bernoulli_",
    ]
    again, _ = _record(_denoising_prefix, x)  # the same seed draws the same on every rank
    for a, b in zip(whole, again, strict=True):
        assert torch.equal(a, b)
    afters = []
    for i in range(4):
        rows = (2 * i, 2 * i + 2)
        part, after = _replay(recorded, _denoising_prefix, x[2 * i : 2 * i + 2], microbatch=i, rows=rows, size=8)
        noise, timestep, table, mask, scale, dropped = part
        assert torch.equal(noise, whole[0][2 * i : 2 * i + 2])
        assert torch.equal(timestep, whole[1]) and torch.equal(table, whole[2])
        assert torch.equal(mask, whole[3][2 * i : 2 * i + 2]) and torch.equal(scale, whole[4][2 * i : 2 * i + 2])
        assert torch.equal(dropped, whole[5][2 * i : 2 * i + 2])
        afters.append(after)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(afters[0], afters[1])  # later draws differ per micro-batch


def test_a_generator_of_the_user_advances_once_per_batch_as_on_one_device():
    generator = torch.Generator().manual_seed(3)

    def prefix(x):
        return torch.randn(x.shape[0], generator=generator)

    whole, recorded = _record(prefix, torch.zeros(4))
    state = generator.get_state()
    part, _ = _replay(recorded, prefix, torch.zeros(2), microbatch=1, rows=(2, 4), size=4)
    assert torch.equal(part, whole[2:]) and torch.equal(generator.get_state(), state)


def test_pipeline_inputs_may_draw_more_than_the_step_and_seeds_differ_per_replica_and_batch():
    def declared(x):
        return x + torch.randn_like(x), torch.rand(x.shape[0])  # augmentation the step does not repeat

    _, recorded = _record(declared, torch.zeros(4, 2), exhaustive=False)
    part, _ = _replay(recorded, lambda x: torch.randn_like(x), torch.zeros(2, 2), microbatch=0, rows=(0, 2), size=4)
    assert part.shape == (2, 2)
    assert len({draw_seed(5, replica, batch) for replica in range(2) for batch in range(3)}) == 6


@pytest.mark.parametrize(
    ("whole", "micro", "message"),
    [
        (lambda x: torch.randn(2 * x.shape[0]), lambda x: torch.randn(2 * x.shape[0]), r"`aten.randn` of shape \(4,\)"),
        (lambda x: torch.randn(x.shape[0]), lambda x: torch.randn(x.shape[0], 1), r"drew `aten.randn` of shape \(8,\)"),
        (lambda x: torch.rand(x.shape[0]), lambda x: torch.rand(()), r"draws `aten.rand` of shape \(\) "),
        (
            lambda x: torch.randperm(x.shape[0]),
            lambda x: torch.randperm(x.shape[0]),
            r"`aten.randperm\(2\)`.*`aten.randperm\(8\)`",
        ),
        (lambda x: torch.randn_like(x), lambda x: torch.rand_like(x), r"as `aten.rand_like` .* as `aten.randn_like`"),
        (
            lambda x: torch.randn_like(x),
            lambda x: (torch.randn_like(x), torch.rand(1)),
            r"\(draw 2\), .* made only 1 draw on the whole batch",
        ),
        (lambda x: (torch.randn_like(x), torch.rand(1)), lambda x: torch.randn_like(x), r"after 1 random draws"),
    ],
    ids=["not-per-sample", "other-dims", "scalar", "randperm", "other-op", "one-more", "one-less"],
)
def test_a_draw_that_cannot_be_made_consistent_is_refused_naming_it(whole, micro, message):
    _, recorded = _record(whole, torch.zeros(8, 3))
    with pytest.raises(InconsistentDrawError, match=message) as error:
        _replay(recorded, micro, torch.zeros(2, 3), microbatch=1, rows=(2, 4), size=8)
    assert "pipeline_inputs(batch)" in str(error.value)  # says how to fix


@pytest.mark.parametrize(
    ("draw", "name"), [(lambda: random.random(), "Python's `random`"), (lambda: np.random.rand(2), "NumPy")]
)
def test_draws_torch_cannot_see_are_refused(draw, name):
    with pytest.raises(InconsistentDrawError, match=name):
        _record(draw)
    _record(draw, exhaustive=False)  # in `pipeline_inputs`: it decides the input alone, on every rank
    _, recorded = _record(lambda: None, exhaustive=False)
    with pytest.raises(InconsistentDrawError, match=f"`training_step` draws from {name}"):
        _replay(recorded, draw, microbatch=0, rows=(0, 2), size=4)


# ------------------------------------------------------------------ two ranks: the denoising model
class RecordingDropout(nn.Module):
    """Dropout that keeps its masks while ``flags["recording"]`` is set (a dict shared with the module: on a rank
    that does not hold this layer, the module holds a placeholder in its place during ``fit``)."""

    def __init__(self, flags: dict[str, bool], p: float = 0.1) -> None:
        super().__init__()
        self.p, self.flags = p, flags
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = torch.rand_like(x) >= self.p
        if self.flags["recording"]:
            self.masks.append(keep.clone())
        return x * keep / (1 - self.p)


class Denoiser(pl.LightningModule):
    """Predicts the noise added to samples from a 2-dimensional subspace of 8 features (diffusion-style)."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.flags = {"recording": False}
        self.first = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.drop_first = RecordingDropout(self.flags)
        self.second = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.drop_second = RecordingDropout(self.flags)
        self.head = nn.Linear(HIDDEN, FEATURES)
        self.noises: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop_second(self.second(self.drop_first(self.first(x)))))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.first, self.drop_first, self.second, self.drop_second, self.head]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flags["recording"] = self.global_step in RECORDED_BATCHES

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn_like(x)
        if self.flags["recording"]:
            self.noises.append(noise.clone())
        if self.fail:
            torch.randperm(x.shape[0])  # a permutation of the batch cannot be cut into micro-batches
        return noise

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        noise = self._noise(x)
        loss = F.mse_loss(self(x + noise), noise)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        noise = self._noise(x)
        self.log("val_loss", F.mse_loss(self(x + noise), noise))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class DeclaringDenoiser(Denoiser):
    """The same step, with the model input declared: ``pipeline_inputs`` draws the noise the step draws again."""

    def pipeline_inputs(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        return x + self._noise(x)


def _data(num: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(FEATURES, LATENT, generator=torch.Generator().manual_seed(0)))[0]
    return 0.3 * torch.randn(num, LATENT, generator=generator) @ basis.T  # (num, FEATURES), rank 2


TRAIN = TensorDataset(_data(NUM_SAMPLES, 1))
VAL = TensorDataset(_data(21, 3))  # one batch of 21: micro-batches of 11 and 10 rows (padded to 22)


def _score(module: nn.Module) -> float:
    """Mean squared error of the predicted noise on held-out samples and noise (about 0.02 is the best possible)."""
    generator = torch.Generator().manual_seed(99)
    x = _data(512, 2)
    noise = torch.randn(x.shape, generator=generator)
    module.eval()
    with torch.no_grad():
        return float(F.mse_loss(module(x + noise), noise))


def _fit(module: Denoiser, world_size: int, steps: int) -> pl.Trainer:
    pl.seed_everything(SEED, verbose=False)
    if world_size == 1:  # the pipeline's shuffling DistributedSampler, made explicit (see docs/pipeline.md, Data)
        loader = DataLoader(TRAIN, batch_size=BATCH, sampler=DistributedSampler(TRAIN, 1, 0, shuffle=True, seed=SEED))
        strategy: Any = "auto"
    else:
        loader = DataLoader(TRAIN, batch_size=BATCH, shuffle=False)
        strategy = PipelineParallelStrategy(schedule="1F1B", num_microbatches=2, partition=[2], timeout=60)
    trainer = cpu_trainer(
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
    )
    trainer.fit(module, train_dataloaders=loader)
    return trainer


def _train(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, cls in (("step", Denoiser), ("pipeline_inputs", DeclaringDenoiser))[: 1 if world_size == 1 else 2]:
        pl.seed_everything(SEED, verbose=False)
        module = cls()
        trainer = _fit(module, world_size, STEPS)
        results[name] = {
            "score": _score(module),  # after `fit` every rank's module is whole again
            "noises": module.noises,
            "masks": {
                key: layer.masks for key, layer in (("first", module.drop_first), ("second", module.drop_second))
            },
        }
    if world_size > 1:  # validation steps draw consistently too, on a batch that is padded to be split
        module.noises, module.flags["recording"] = [], True
        (metrics,) = trainer.validate(module, DataLoader(VAL, batch_size=len(VAL)), verbose=False)
        # The first noise is the set-up's run of the step (the layer check's input), outside the engine.
        results["validate"] = {"val_loss": metrics["val_loss"], "noises": module.noises[1:]}
    return results


def _assert_noise_is_consistent(first: dict[str, Any], last: dict[str, Any], batches: int) -> None:
    """The noise of each batch's input-learning run (every rank) is, row for row, the noise each micro-batch's step
    drew on the last stage."""
    runs = 3  # per batch on the last stage: the input-learning run, then the step on each of the 2 micro-batches
    assert len(first["noises"]) == batches
    assert len(last["noises"]) == batches * runs
    for batch in range(batches):
        whole = first["noises"][batch]
        on_last = last["noises"][batch * runs : (batch + 1) * runs]
        assert torch.equal(on_last[0], whole)  # the same draw on both ranks
        torch.testing.assert_close(torch.cat(on_last[1:]), whole, rtol=0, atol=0)
        if batch:
            assert not torch.equal(whole, first["noises"][batch - 1])  # a new draw per batch


def test_the_denoising_model_trains_like_one_device_with_and_without_pipeline_inputs():
    (reference,) = run_distributed(_train, 1, init_process_group=False, timeout=120)
    first, last = run_distributed(_train, 2, init_process_group=False, timeout=120)
    best = reference["step"]["score"]
    assert best < 0.2  # one device learns it (predicting no noise scores 1.0)
    for name in ("step", "pipeline_inputs"):
        assert first[name]["score"] == last[name]["score"] <= 2 * best, (name, first[name]["score"], best)
        _assert_noise_is_consistent(first[name], last[name], len(RECORDED_BATCHES))
        # Dropout inside the layers: each stage's own draws (stage 0 holds `first`, stage 1 `second`), a new mask
        # per micro-batch, none of them replayed.
        assert not first[name]["masks"]["second"] and not last[name]["masks"]["first"]
        masks_0, masks_1 = first[name]["masks"]["first"], last[name]["masks"]["second"]
        assert len(masks_0) == len(masks_1) == 2 * len(RECORDED_BATCHES)
        assert not torch.equal(masks_0[0], masks_0[1]) and not torch.equal(masks_1[0], masks_1[1])
        assert not any(torch.equal(a, b) for a, b in zip(masks_0, masks_1, strict=True))
    _assert_noise_is_consistent(first["validate"], last["validate"], 1)
    assert first["validate"]["val_loss"] == last["validate"]["val_loss"] < 0.2


def _fit_failing(rank: int, world_size: int) -> None:
    _fit(Denoiser(fail=True), world_size, 2)


def test_a_step_whose_draw_cannot_be_made_consistent_fails_naming_the_draw():
    with pytest.raises(Exception, match=r"`aten.randperm\(16\)`.*`aten.randperm\(32\)`"):
        run_distributed(_fit_failing, 2, init_process_group=False, timeout=60)
