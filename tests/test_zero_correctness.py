"""ZeRO off the happy path, against single-device Lightning on the same global batches (tests/model_zoo.py models).

* Unused parameters (an auxiliary head used every other step, a layer never used) are not stepped by zero1/zero2:
  no momentum, no weight decay, no optimizer state, as ``torch.optim`` skips a ``None`` gradient.
* A backbone unfrozen at step 2 trains from then on, a head frozen at step 3 stops (frozen parameters the
  optimizer holds stay in the layout).
* Several optimizers (a GAN in manual optimization with ``toggle_optimizer``) at stages 1, 2 and 3, a consolidated
  checkpoint of both optimizers saved and resumed, and a clear error where several optimizers are not supported
  (optimizers that share parameters: tests/test_shared_parameters.py).
* No FutureWarning from our collectives.

Each stage's cases run inside one pair of forked ranks (one Trainer per case) to keep the suite fast.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from model_zoo import AuxHeadModel, FreezeScheduleModel, TwoOptimizerGAN, _noise_for, loader, state_of, trainer

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.distributed.checkpoint import sharded_to_consolidated
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

EXACT = {"rtol": 1e-5, "atol": 1e-6}


class _StepThenZeroGradGAN(TwoOptimizerGAN):
    """The other common order, ``step()`` then ``zero_grad()``: the generator's backward also reaches the
    discriminator, whose gradient must stay untouched (``toggle_optimizer`` froze it) until its own next step."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        z = _noise_for(x, 4)
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(opt_d)
        real, fake = self.discriminator(x), self.discriminator(self(z).detach())
        self.manual_backward(bce(real, torch.ones_like(real)) + bce(fake, torch.zeros_like(fake)))
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        fake = self.discriminator(self(z))
        self.manual_backward(bce(fake, torch.ones_like(fake)))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)


class _UnfreezeThenFreezeModel(FreezeScheduleModel):
    """Unfreezes the backbone at step 2 (as its parent), then freezes the trained head at step 3."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.global_step == 3:
            self.head.requires_grad_(False)


MODELS = {
    "aux": AuxHeadModel,
    "freeze": FreezeScheduleModel,
    "refreeze": _UnfreezeThenFreezeModel,
    "gan": TwoOptimizerGAN,
    "gan2": _StepThenZeroGradGAN,
}
GAN_STEPS = 6  # manual optimization: two optimizer steps (global steps) per batch, so 3 batches
# case: (model, bucket_cap_mb, Trainer arguments). Tiny buckets split parameters over buckets and shards; one
# bucket puts both optimizers' parameters in it. Accumulating 2 micro-batches, the aux head is used in one of them.
CASES: dict[str, tuple[str, float, dict[str, Any]]] = {
    "aux": ("aux", 0.001, {"gradient_clip_val": 0.5}),
    "aux_accumulate": ("aux", 25.0, {"accumulate_grad_batches": 2, "max_steps": 2}),
    "freeze": ("freeze", 25.0, {}),
    "refreeze": ("refreeze", 0.001, {}),
    "gan": ("gan", 25.0, {"max_steps": GAN_STEPS}),
    "gan_zero_grad_after_step": ("gan2", 0.001, {"max_steps": GAN_STEPS}),
}
RESUME = {"steps": 2, "max_steps": -1}  # epochs of 2 batches: the checkpoint is taken at an epoch's end


def _fit(
    model: str, strategy: Any, devices: int, *, steps: int = 4, ckpt_path: str | None = None, **kwargs: Any
) -> tuple[pl.Trainer, pl.LightningModule]:
    """Seed, build, fit on this replica's slice of every global batch (``devices=1``: all of it), ``steps`` batches
    an epoch."""
    pl.seed_everything(0, verbose=False)
    fit_trainer = trainer(strategy, devices, **kwargs)
    sampler = getattr(fit_trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = MODELS[model]()
    fit_trainer.fit(module, loader(sampler["num_replicas"], sampler["rank"], steps=steps), ckpt_path=ckpt_path)
    return fit_trainer, module


@cache
def _reference(case: str) -> dict[str, Any]:
    model, _, options = CASES[case]
    fit_trainer, module = _fit(model, "auto", 1, **options)
    return {"weights": state_of(module), "optimizers": [opt.state_dict() for opt in fit_trainer.optimizers]}


@cache
def _initial(model: str) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    return state_of(MODELS[model]())


def _weights(fit_trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Collective: the consolidated weights (complete on rank 0)."""
    return {name: tensor.detach().clone() for name, tensor in fit_trainer.strategy.consolidated_state_dict().items()}


def _fit_cases(rank: int, world_size: int, stage: int, cases: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        model, bucket_cap_mb, options = CASES[case]
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=bucket_cap_mb)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit_trainer, _ = _fit(model, strategy, world_size, **options)
        results[case] = {
            "weights": _weights(fit_trainer),
            "optimizers": [fit_trainer.strategy.optimizer_state(opt) for opt in fit_trainer.optimizers],
            "future_warnings": [
                f"{w.filename}: {w.message}"
                for w in caught
                if issubclass(w.category, FutureWarning) and _from_our_collectives(w)
            ],
        }
        if case == "aux":
            results[case]["sharded_optimizer"] = _sharded_checkpoint_optimizer_state(fit_trainer, rank)
    return results


def _sharded_checkpoint_optimizer_state(fit_trainer: pl.Trainer, rank: int) -> dict[str, Any]:
    """Collective. Save a sharded checkpoint and read back its optimizer state, consolidated."""
    path = Path(tempfile.gettempdir()) / f"lp-zero-correctness-{os.environ['MASTER_PORT']}"  # the same on each rank
    fit_trainer.strategy.checkpoint_format = "sharded"
    fit_trainer.save_checkpoint(path)
    state = sharded_to_consolidated(path)["optimizer_states"][0]  # a collective: every rank reads
    fit_trainer.strategy.barrier()
    if rank == 0:
        shutil.rmtree(path)
    return state


def _from_our_collectives(warning: warnings.WarningMessage) -> bool:
    """Raised in our code, or torch's deprecation of the collectives ZeRO-1/2 call (Lightning's own are not ours)."""
    text = str(warning.message)
    deprecated = ("all_gather_into_tensor", "reduce_scatter_tensor")
    return "lightning_parallel" in warning.filename or any(name in text for name in deprecated)


def _assert_close(actual: Any, expected: Any, label: str) -> None:
    try:
        torch.testing.assert_close(actual, expected, **EXACT)
    except AssertionError as error:
        raise AssertionError(f"{label}: {error}") from None


def _assert_optimizer_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Exactly torch's layout: the same parameters have state, each with its own step count."""
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            _assert_close(actual["state"][index][key], value, f"state {index}/{key}")


@cache
def _stage_results(stage: int) -> dict[str, Any]:
    (rank0, _) = run_distributed(_fit_cases, 2, args=(stage, list(CASES)), init_process_group=False, timeout=180)
    return rank0


@pytest.mark.parametrize("case", ["aux", "aux_accumulate"])
@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameters_are_not_stepped(stage, case):
    result, reference = _stage_results(stage)[case], _reference(case)
    torch.testing.assert_close(result["weights"], reference["weights"], **EXACT)
    for name in ("never_used.weight", "never_used.bias"):  # AdamW's weight decay would move it
        torch.testing.assert_close(result["weights"][name], _initial("aux")[name], rtol=0, atol=0)
    _assert_optimizer_state_equal(result["optimizers"][0], reference["optimizers"][0])
    if case == "aux":  # the sharded format keeps each parameter's own `step` (the aux head's is 2, the others' 4)
        _assert_optimizer_state_equal(result["sharded_optimizer"], reference["optimizers"][0])


@pytest.mark.parametrize("case", ["freeze", "refreeze"])
@pytest.mark.parametrize("stage", [1, 2])
def test_unfrozen_backbone_trains_like_single_device(stage, case):
    result, reference = _stage_results(stage)[case], _reference(case)
    torch.testing.assert_close(result["weights"], reference["weights"], **EXACT)
    name = "backbone.0.weight"  # guard: the reference did train the backbone after unfreezing it
    assert not torch.allclose(reference["weights"][name], _initial(case)[name])


@pytest.mark.parametrize("case", ["gan", "gan_zero_grad_after_step"])
@pytest.mark.parametrize("stage", [1, 2])
def test_two_optimizer_gan_matches_single_device(stage, case):
    result, reference = _stage_results(stage)[case], _reference(case)
    torch.testing.assert_close(result["weights"], reference["weights"], **EXACT)
    for actual, expected in zip(result["optimizers"], reference["optimizers"], strict=True):
        _assert_optimizer_state_equal(actual, expected)


def test_zero2_fit_emits_no_future_warning():
    for case, result in _stage_results(2).items():
        assert result["future_warnings"] == [], case


# ------------------------------------------------------------------ stage 3, checkpoint, errors
RESUMES = [(2, 2), (3, 1)]  # (stage that saves, stage that resumes): consolidated checkpoints move across stages


def _gan_stage3_and_resume(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    fit_trainer, _ = _fit("gan", ShardedOptimizerStrategy(stage=3), world_size, max_steps=GAN_STEPS)
    results["zero3"] = _weights(fit_trainer)
    # One epoch of 2 batches, a consolidated checkpoint of both optimizers, resumed for a second epoch.
    for saving, resuming in RESUMES:
        path = f"{directory}/gan-zero{saving}.ckpt"
        fit_trainer, _ = _fit("gan", ShardedOptimizerStrategy(stage=saving), world_size, **RESUME, max_epochs=1)
        fit_trainer.save_checkpoint(path)
        strategy = ShardedOptimizerStrategy(stage=resuming)
        resumed, _ = _fit("gan", strategy, world_size, **RESUME, max_epochs=2, ckpt_path=path)
        results[(saving, resuming)] = _weights(resumed)
    return results


def test_gan_under_zero3_and_resumed_gan_checkpoints_match_single_device(tmp_path):
    rank0, _ = run_distributed(_gan_stage3_and_resume, 2, args=(str(tmp_path),), init_process_group=False, timeout=180)
    torch.testing.assert_close(rank0["zero3"], _reference("gan")["weights"], **EXACT)
    _, two_epochs = _fit("gan", "auto", 1, **RESUME, max_epochs=2)
    for saving, resuming in RESUMES:
        _assert_close(rank0[(saving, resuming)], state_of(two_epochs), f"zero{saving} -> zero{resuming}")
        saved = torch.load(tmp_path / f"gan-zero{saving}.ckpt", weights_only=True)["optimizer_states"]
        assert len(saved) == 2 and all(state["state"] for state in saved)


class _UnregisteredParameterGAN(TwoOptimizerGAN):
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        extra = torch.nn.Parameter(torch.zeros(3))  # not an attribute of the module
        generator = torch.optim.Adam([*self.generator.parameters(), extra])
        return [generator, torch.optim.Adam(self.discriminator.parameters())]


def _refused(rank: int, world_size: int, case: str) -> None:
    module = _UnregisteredParameterGAN() if case == "unregistered" else TwoOptimizerGAN()
    strategy = ShardedOptimizerStrategy(stage=2, timeout=30)
    if case == "sharded-format":
        strategy.checkpoint_format = "sharded"
    try:
        trainer(strategy, world_size).fit(module, loader(world_size, rank))
    except ValueError as error:
        raise RuntimeError(f"rank {rank} refused: {error}") from error


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("sharded-format", "`checkpoint_format='sharded'` holds one optimizer, `configure_optimizers` returned 2"),
        ("unregistered", "The optimizer holds 1 parameter(s) that are not parameters of the LightningModule"),
    ],
)
def test_several_optimizers_are_refused_clearly_where_unsupported(case, message):
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_refused, 2, args=(case,), init_process_group=False, timeout=120)
    text = str(error.value)
    assert "did not finish" not in text
    for rank in (0, 1):
        assert f"rank {rank} refused: {message}" in text, text[-3000:]


# ------------------------------------------------------------------ torch only: a parameter used on one rank only
def _partial_use(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Layer ``a`` is used on every rank, ``b`` on rank 0 only, ``c`` nowhere; SGD with momentum and weight decay."""
    results = {}
    # Both reductions: gloo defaults to the in-place all-reduce; NCCL's reduce-scatter must stay covered on CPU.
    for stage, reduction in ((1, "all_reduce"), (2, "all_reduce"), (1, "reduce_scatter"), (2, "reduce_scatter")):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({name: torch.nn.Linear(3, 2) for name in "abc"})
        buckets = ShardedParameterBuckets(model, stage=stage, bucket_cap_mb=0.0001, gradient_reduction=reduction)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        ShardedOptimizer(optimizer, buckets)
        for step in range(2):
            x = torch.full((2, 3), float(rank + 1 + step))
            loss = model["a"](x).square().sum() + (model["b"](x).square().sum() if rank == 0 else 0)
            loss.backward()
            buckets.finish_gradient_sync()
            optimizer.step()
            optimizer.zero_grad()
            buckets.all_gather_parameters()
        results[f"zero{stage}-{reduction}"] = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return results


def test_a_parameter_used_on_some_ranks_gets_the_average_over_all_ranks():
    """As DDP: the mean over ranks of each rank's gradient (zero where unused); a parameter no rank used stays."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(3, 2) for name in "abc"})
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(2):
        loss = 0
        for rank in range(2):
            x = torch.full((2, 3), float(rank + 1 + step))
            loss = loss + model["a"](x).square().sum() + (model["b"](x).square().sum() if rank == 0 else 0)
        (loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    results = run_distributed(_partial_use, 2, timeout=120)
    for result in results:
        assert len(result) == 4
        for stage in result:
            _assert_close(result[stage], model.state_dict(), stage)
            torch.testing.assert_close(result[stage]["c.weight"], initial["c.weight"], rtol=0, atol=0)


# ------------------------------------------------------------------ torch only: buckets launched in backward's order
def _out_of_order(rank: int, world_size: int) -> dict[str, Any]:
    """A model that registers its layers in the opposite order of use: buckets follow registration (one per layer)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(4, 4, bias=False) for name in ("c", "b", "a")})
    buckets = ShardedParameterBuckets(model, stage=2, bucket_cap_mb=64 / 2**20)
    names = [segment.name for bucket in buckets.buckets for segment in bucket.segments]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ShardedOptimizer(optimizer, buckets)
    orders = []
    for step in range(2):
        x = torch.full((2, 4), float(rank + 1 + step))
        model["c"](model["b"](model["a"](x))).square().sum().backward()  # gradients: c, then b, then a
        buckets.finish_gradient_sync()
        orders.append(list(buckets.launch_order))
        optimizer.step()
        optimizer.zero_grad()
        buckets.all_gather_parameters()
    return {"names": names, "orders": orders, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def test_buckets_are_launched_in_the_order_the_first_backward_completes_them():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(4, 4, bias=False) for name in ("c", "b", "a")})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        loss = sum(
            model["c"](model["b"](model["a"](torch.full((2, 4), float(rank + 1 + step))))).square().sum()
            for rank in range(2)
        )
        (loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in run_distributed(_out_of_order, 2, timeout=60):
        assert result["names"] == ["a.weight", "b.weight", "c.weight"]  # reverse registration: a used first
        assert result["orders"] == [[2, 1, 0], [2, 1, 0]]  # backward completes c, b, a; settled after step 1
        _assert_close(result["weights"], model.state_dict(), "out of order")
