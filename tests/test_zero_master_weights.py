"""``precision="bf16-true"`` under ZeRO: bf16 parameters and gradients, fp32 master weights in each rank's shard.

Checked against a single-process reference written here with the same arithmetic (ZeRO paper, section 3.1): a bf16
model copy computes each rank's slice of the global batch, its gradients are cast to fp32 and averaged, an fp32 AdamW
steps the fp32 master weights, which are rounded back into the bf16 model. Stages 1, 2 and 3 at world size 2, the
bytes each rank holds (exactly the formula, and the planner), consolidated checkpoints (the bf16 ``state_dict`` of
single-device Lightning plus the masters) resumed exactly, a plain bf16 checkpoint resumed, and
``master_weights=None`` (bf16 parameters stepped directly, as plain Lightning). World size 1 keeps the masters too
(against the same reference with one rank), and its checkpoints resume exactly at world size 2 and the reverse.

All distributed cases share one pair of forked ranks (each Trainer costs seconds).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import CLASSES, FEATURES, GLOBAL_BATCH, TwoOptimizerGAN, dataset, loader, trainer
from torch import nn

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.planner import plan
from lightning_parallel.planner.estimate import OPTIMIZER_STATES, PRECISION_BYTES, EstimateContext, estimate_zero12
from lightning_parallel.planner.spec import model_spec

WORLD_SIZE = 2
STEPS = 4
# The reference does the same arithmetic in the same order (fp32 g/2 + g/2 is exact, AdamW is element-wise), so the
# bf16 weights, the fp32 masters and the fp32 Adam state are bit-identical at every stage (measured max difference
# 0.0; the masters differ from the bf16 weights by up to 9.5e-4, so they are not trivially equal).
BF16_CLOSE = {"rtol": 0.0, "atol": 0.0}
MASTER_CLOSE = {"rtol": 0.0, "atol": 0.0}


class MasterWeightsModel(pl.LightningModule):
    """Two residual blocks (stage 3 shards each) and a head; 365 parameters, odd, so ZeRO pads at world size 2."""

    def __init__(self, unfreeze_at: int = 0) -> None:
        super().__init__()
        self.unfreeze_at = unfreeze_at
        """The blocks are frozen before this step (the optimizer holds them all along)."""
        self.blocks = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(2))
        self.head = nn.Linear(FEATURES, CLASSES)
        self.scale = nn.Parameter(torch.ones(1))  # a 1-row parameter: stage 3 pads its shard too
        self.blocks.requires_grad_(unfreeze_at == 0)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.blocks.requires_grad_(self.global_step >= self.unfreeze_at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y).float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _adamw(self.parameters())


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


NUMEL = 2 * (FEATURES * FEATURES + FEATURES) + FEATURES * CLASSES + CLASSES + 1


# ---------------------------------------------------------------------------------------------- the reference
def _global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = dataset(steps=steps)
    return [data[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH] for k in range(steps)]


def _reference(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    master: bool = True,
    start: dict[str, Any] | None = None,
    accumulate: int = 1,
    fp32_accumulation: bool = False,
    clip: float | None = None,
    unfreeze_at: int = 0,
    world_size: int = WORLD_SIZE,
) -> dict[str, Any]:
    """One process, the arithmetic of ZeRO on ``world_size`` ranks: each rank's slice through the bf16 model, the
    gradients averaged (fp32 with ``master``, else bf16) and stepped by AdamW on the fp32 masters (else on the bf16
    parameters). ``start``: a checkpoint to continue from (``state_dict``, ``optimizer_states``). ``accumulate``
    micro-batches per step (Lightning divides each loss by it), summed in bf16 ``.grad`` (stages 1-2, as on one
    device) or in fp32 (``fp32_accumulation``: FSDP2 with ``reduce_dtype=fp32``); ``clip``: the global norm;
    ``unfreeze_at``: the blocks get no gradient (so AdamW skips them) before this step."""
    pl.seed_everything(0, verbose=False)
    model = MasterWeightsModel().to(torch.bfloat16)  # what HalfPrecision.convert_module does
    if start is not None:
        model.load_state_dict(start["state_dict"])
    params = dict(model.named_parameters())
    masters = {name: param.detach().float() for name, param in params.items()}
    stepped = masters if master else params
    optimizer = _adamw(list(stepped.values()))
    if start is not None:
        saved = start["optimizer_states"][0]
        optimizer.load_state_dict(saved)  # casts the state to the stepped tensors' dtype
        for index, tensor in (saved.get("master_weights") or {}).items():
            list(masters.values())[index].copy_(tensor)
    for step in range(len(batches) // accumulate):
        model.blocks.requires_grad_(step >= unfreeze_at)
        averaged: dict[str, torch.Tensor] = {}
        for rank in range(world_size):
            micro_batches = batches[step * accumulate : (step + 1) * accumulate]
            for name, grad in _rank_gradients(model, micro_batches, rank, world_size, fp32_accumulation).items():
                grad = (grad.float() if master else grad) / world_size
                averaged[name] = grad if name not in averaged else averaged[name] + grad
        for name, tensor in stepped.items():
            tensor.grad = averaged.get(name)  # None: frozen, not stepped
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(stepped.values()), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(masters[name] if master else param)
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
        "masters": masters,
        "optimizer": optimizer.state_dict(),
    }


def _rank_gradients(
    model: MasterWeightsModel,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world_size: int,
    fp32: bool,
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradient summed over ``micro_batches`` (each loss divided by their number, as Lightning
    does): in the bf16 ``.grad`` (autograd's accumulation), or in fp32 (``fp32``)."""
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    model.zero_grad(set_to_none=True)
    summed: dict[str, torch.Tensor] = {}
    for x, y in micro_batches:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # HalfPrecision.forward_context
        try:
            loss = model.training_step((x[rows].to(torch.bfloat16), y[rows]), 0)
        finally:
            torch.set_default_dtype(default)
        (loss / len(micro_batches) if len(micro_batches) > 1 else loss).backward()
        if fp32:
            summed = {name: summed.get(name, 0) + _grad(param).float() for name, param in _trained(model)}
            model.zero_grad(set_to_none=True)
    return summed if fp32 else {name: _grad(param) for name, param in _trained(model)}


def _trained(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


# ---------------------------------------------------------------------------------------------- inside the ranks
FITS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_no_master": {"stage": 2, "master_weights": None},
    "zero3_no_master": {"stage": 3, "master_weights": None},
}
UNFREEZE_AT = 2
ACCUMULATE_CLIP = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "max_steps": 2}  # clips every step
# (stage that saves after one epoch of 2 batches, stage that resumes for a second, checkpoint format)
RESUMES = [(2, 2, "consolidated"), (3, 1, "consolidated"), (1, 3, "consolidated"), (2, 3, "sharded"), (3, 2, "sharded")]


def _fit(
    strategy: Any,
    devices: int,
    *,
    steps: int = STEPS,
    ckpt_path: str | None = None,
    model: Callable[[], pl.LightningModule] = MasterWeightsModel,
    **kwargs: Any,
) -> tuple[pl.Trainer, pl.LightningModule]:
    """Seed, build, fit ``precision="bf16-true"`` on this replica's slice of every global batch."""
    pl.seed_everything(0, verbose=False)
    fit_trainer = trainer(strategy, devices, precision="bf16-true", **kwargs)
    sampler = getattr(fit_trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = model()
    fit_trainer.fit(module, loader(sampler["num_replicas"], sampler["rank"], steps=steps), ckpt_path=ckpt_path)
    return fit_trainer, module


def _facts(fit_trainer: pl.Trainer, *, optimizer: int = 0) -> dict[str, Any]:
    """Collective: consolidated weights and optimizer state (complete on rank 0) and this rank's bytes."""
    strategy = fit_trainer.strategy
    weights = {name: tensor.detach().clone() for name, tensor in strategy.consolidated_state_dict().items()}
    optimizer_state = strategy.optimizer_state(fit_trainer.optimizers[optimizer])
    return {"weights": weights, "optimizer": optimizer_state, "memory": strategy.memory_report().as_dict()}


def _in_ranks(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for case, options in FITS.items():
        fit_trainer, module = _fit(ShardedOptimizerStrategy(**options), world_size)
        results[case] = _facts(fit_trainer)
        if case == "zero3":
            results.update(_validate_and_refit(fit_trainer, module, rank, world_size))
    for stage in (1, 2, 3):
        fit_trainer, _ = _fit(ShardedOptimizerStrategy(stage=stage), world_size, **ACCUMULATE_CLIP)
        results[f"zero{stage}_accumulate_clip"] = _facts(fit_trainer)
    for stage in (2, 3):  # `requires_grad` changes: FSDP2 must still reduce the unfrozen gradients in fp32
        strategy = ShardedOptimizerStrategy(stage=stage)
        fit_trainer, _ = _fit(strategy, world_size, model=lambda: MasterWeightsModel(unfreeze_at=UNFREEZE_AT))
        results[f"zero{stage}_unfreeze"] = _facts(fit_trainer)
        fit_trainer, _ = _fit(ShardedOptimizerStrategy(stage=stage), world_size, model=TwoOptimizerGAN, max_steps=6)
        results[f"zero{stage}_gan"] = _facts(fit_trainer, optimizer=1)
    for saving, resuming, checkpoint_format in RESUMES:
        path = f"{directory}/zero{saving}-{checkpoint_format}.ckpt"
        strategy = ShardedOptimizerStrategy(stage=saving, checkpoint_format=checkpoint_format)
        saved, _ = _fit(strategy, world_size, steps=2, max_steps=-1, max_epochs=1)
        saved.save_checkpoint(path)
        strategy = ShardedOptimizerStrategy(stage=resuming, checkpoint_format=checkpoint_format)
        resumed, _ = _fit(strategy, world_size, steps=2, max_steps=-1, max_epochs=2, ckpt_path=path)
        resumed.strategy.checkpoint_format = "consolidated"  # for `_facts`' optimizer state
        results[(saving, resuming, checkpoint_format)] = _facts(resumed)
    for saving, resuming, checkpoint_format in FROM_WORLD_SIZE_1:  # written by `_fits_at_world_size_1`
        strategy = ShardedOptimizerStrategy(stage=resuming, checkpoint_format=checkpoint_format)
        path = f"{directory}/ws1-zero{saving}-{checkpoint_format}.ckpt"
        resumed, _ = _fit(strategy, world_size, steps=2, max_steps=-1, max_epochs=2, ckpt_path=path)
        resumed.strategy.checkpoint_format = "consolidated"
        results[("from_world_size_1", saving, resuming, checkpoint_format)] = _facts(resumed)
    plain = f"{directory}/plain.ckpt"  # written by single-device Lightning in the parent
    resumed, _ = _fit(
        ShardedOptimizerStrategy(stage=2), world_size, steps=2, max_steps=-1, max_epochs=2, ckpt_path=plain
    )
    results["from_plain"] = _facts(resumed)
    return results


def _validate_and_refit(fit_trainer: pl.Trainer, module: pl.LightningModule, rank: int, world_size: int) -> dict:
    """Stage 3: the same (sharded) module validated, then fitted again; its fp32 masters must not be rounded."""
    fit_trainer.validate(module, loader(world_size, rank), verbose=False)
    results: dict[str, Any] = {"after_validate": {name: p.dtype for name, p in module.named_parameters()}}
    results["after_validate_masters"] = _facts(fit_trainer)["optimizer"].get("master_weights")  # on rank 0
    refit = trainer(ShardedOptimizerStrategy(stage=3), world_size, precision="bf16-true", max_steps=1)
    refit.fit(module, loader(world_size, rank))
    results["after_refit"] = {name: p.dtype for name, p in module.named_parameters()}
    results["after_refit_state"] = {k: v.dtype for k, v in refit.strategy.consolidated_state_dict().items()}
    return results


# ---------------------------------------------------------------------------------------------- world size 1
# (stage that saves after one epoch of 2 batches, stage that resumes for a second, checkpoint format): saved at world
# size 1 and resumed by the ranks, and saved by the ranks (`RESUMES`) and resumed at world size 1.
FROM_WORLD_SIZE_1 = [(1, 3, "consolidated"), (3, 2, "sharded")]
TO_WORLD_SIZE_1 = [(1, 2, "consolidated"), (3, 1, "consolidated"), (2, 3, "sharded")]
NONFINITE_STEP = 1


class NonFiniteOnceModel(MasterWeightsModel):
    """A NaN loss at step ``NONFINITE_STEP``, which the strategy skips."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == NONFINITE_STEP else loss


class LBFGSModel(MasterWeightsModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


def _fits_at_world_size_1(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    """One process (Lightning's one-process group): the fits, and the checkpoints the ranks resume."""
    results: dict[Any, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for stage in (1, 2, 3):
            fit_trainer, _ = _fit(ShardedOptimizerStrategy(stage=stage), world_size)
            results[f"zero{stage}"] = {**_facts(fit_trainer), "backend": type(fit_trainer.strategy.backend).__name__}
    results["warnings"] = [str(w.message) for w in caught]
    for stage in (1, 3):
        fit_trainer, _ = _fit(ShardedOptimizerStrategy(stage=stage), world_size, **ACCUMULATE_CLIP)
        results[f"zero{stage}_accumulate_clip"] = _facts(fit_trainer)
    fit_trainer, _ = _fit(ShardedOptimizerStrategy(stage=2), world_size, model=NonFiniteOnceModel)
    results["nonfinite"] = _facts(fit_trainer)
    fit_trainer, module = _fit(ShardedOptimizerStrategy(stage=2, master_weights=None), world_size)
    results["no_master"] = {"weights": module.state_dict(), "backend": type(fit_trainer.strategy.backend).__name__}
    pl.seed_everything(0, verbose=False)
    fp32 = trainer(ShardedOptimizerStrategy(stage=2), world_size, precision="32-true", max_steps=1)
    fp32.fit(MasterWeightsModel(), loader())
    results["fp32_backend"] = type(fp32.strategy.backend).__name__  # type: ignore[attr-defined]
    try:
        _fit(ShardedOptimizerStrategy(stage=3), world_size, model=LBFGSModel)
    except TypeError as error:
        results["lbfgs"] = str(error)
    for saving, _, checkpoint_format in FROM_WORLD_SIZE_1:
        strategy = ShardedOptimizerStrategy(stage=saving, checkpoint_format=checkpoint_format)
        saved, _ = _fit(strategy, world_size, steps=2, max_steps=-1, max_epochs=1)
        saved.save_checkpoint(f"{directory}/ws1-zero{saving}-{checkpoint_format}.ckpt")
    return results


def _resumes_at_world_size_1(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for saving, resuming, checkpoint_format in TO_WORLD_SIZE_1:  # written by the ranks (`RESUMES`)
        strategy = ShardedOptimizerStrategy(stage=resuming, checkpoint_format=checkpoint_format)
        path = f"{directory}/zero{saving}-{checkpoint_format}.ckpt"
        resumed, _ = _fit(strategy, world_size, steps=2, max_steps=-1, max_epochs=2, ckpt_path=path)
        resumed.strategy.checkpoint_format = "consolidated"  # for `_facts`' optimizer state
        results[(saving, resuming, checkpoint_format)] = _facts(resumed)
    return results


@cache
def _runs(directory: str) -> tuple[tuple[dict[Any, Any], ...], dict[Any, Any]]:
    """The ranks' results, and world size 1's (``"resumed"``: from the ranks' checkpoints)."""
    # A plain single-device bf16-true checkpoint after one epoch of 2 batches, for the ranks to resume from.
    plain, _ = _fit("auto", 1, steps=2, max_steps=-1, max_epochs=1)
    plain.save_checkpoint(f"{directory}/plain.ckpt")
    options: dict[str, Any] = {"args": (directory,), "init_process_group": False, "timeout": 300}
    (alone,) = run_distributed(_fits_at_world_size_1, 1, **options)
    ranks = tuple(run_distributed(_in_ranks, WORLD_SIZE, **options))
    (resumed,) = run_distributed(_resumes_at_world_size_1, 1, **options)
    return ranks, {**alone, "resumed": resumed}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("master-weights")


@pytest.fixture(scope="module")
def ranks(workdir: Path) -> tuple[dict[Any, Any], ...]:
    return _runs(str(workdir))[0]


@pytest.fixture(scope="module")
def alone(workdir: Path) -> dict[Any, Any]:
    """World size 1's results."""
    return _runs(str(workdir))[1]


def _masters(optimizer_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    names = list(dict(MasterWeightsModel().named_parameters()))
    return {names[int(index)]: tensor for index, tensor in optimizer_state["master_weights"].items()}


def _max_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((actual[name].float() - tensor.float()).abs().max().item() for name, tensor in expected.items())


def _assert_fp32_masters_like(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """A bf16-true run with fp32 masters ended as the reference did: weights, masters and optimizer state."""
    weights = result["weights"]
    # The checkpointed model is bf16, under the names single-device Lightning bf16-true saves.
    assert {name: t.dtype for name, t in weights.items()} == {name: torch.bfloat16 for name in reference["weights"]}
    torch.testing.assert_close(weights, reference["weights"], **BF16_CLOSE)
    masters = _masters(result["optimizer"])
    assert all(tensor.dtype == torch.float32 for tensor in masters.values())
    torch.testing.assert_close(masters, reference["masters"], **MASTER_CLOSE)
    # The optimizer state is fp32 (it follows the masters) and equals the reference's.
    for index, entry in reference["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert result["optimizer"]["state"][index][key].dtype == torch.float32
            torch.testing.assert_close(result["optimizer"]["state"][index][key], entry[key], **MASTER_CLOSE)
    # Guard: the masters hold more than the bf16 weights do (otherwise the test could not tell them apart).
    assert _max_difference(masters, {n: w.float() for n, w in weights.items()}) > 0


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_true_steps_fp32_masters_like_the_reference(ranks, stage):
    _assert_fp32_masters_like(ranks[0][f"zero{stage}"], _reference(_global_batches(STEPS)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_and_clipping_with_fp32_masters(ranks, stage):
    """Micro-batch gradients summed in the bf16 bucket (stages 1-2, as single-device bf16-true sums ``.grad``) or
    in fp32 (stage 3: FSDP2 accumulates in its fp32 ``reduce_dtype``), clipped by the norm of the fp32 gradients."""
    result = ranks[0][f"zero{stage}_accumulate_clip"]
    reference = _reference(_global_batches(STEPS), accumulate=2, fp32_accumulation=stage == 3, clip=0.05)
    unclipped = _reference(_global_batches(STEPS), accumulate=2, fp32_accumulation=stage == 3)
    assert _max_difference(unclipped["masters"], reference["masters"]) > 1e-4  # guard: clipping changed the run
    # Measured bit-identical too. The masters' tolerance leaves room for the clip norm's order of summation (ours
    # over shards, torch's `clip_grad_norm_` per tensor) and is far below what the accumulation dtype changes (the
    # other accumulation differs by 2.2e-4 in the masters, 9.8e-4 in the bf16 weights).
    torch.testing.assert_close(_masters(result["optimizer"]), reference["masters"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)


@pytest.mark.parametrize("stage", [2, 3])
def test_requires_grad_changes_train_fp32_masters(ranks, stage):
    """A backbone unfrozen at step 2 (stage 3: FSDP2 fixes a unit's gradient dtypes at its first forward, while the
    unit was frozen), and a GAN toggling its two optimizers each step: as the reference, and stage 3 as stage 2."""
    result = ranks[0][f"zero{stage}_unfreeze"]
    reference = _reference(_global_batches(STEPS), unfreeze_at=UNFREEZE_AT)
    torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)
    torch.testing.assert_close(_masters(result["optimizer"]), reference["masters"], **MASTER_CLOSE)
    pl.seed_everything(0, verbose=False)
    initial = MasterWeightsModel().to(torch.bfloat16).state_dict()  # guard: the blocks trained after unfreezing,
    assert not torch.equal(result["weights"]["blocks.0.weight"], initial["blocks.0.weight"])
    always_trained = _reference(_global_batches(STEPS))["weights"]  # and not from the start
    assert not torch.equal(result["weights"]["blocks.0.weight"], always_trained["blocks.0.weight"])
    if stage == 3:
        gan, expected = ranks[0]["zero3_gan"], ranks[0]["zero2_gan"]
        torch.testing.assert_close(gan["weights"], expected["weights"], **BF16_CLOSE)
        torch.testing.assert_close(gan["optimizer"]["master_weights"], expected["optimizer"]["master_weights"])


def test_a_sharded_module_keeps_its_fp32_masters_through_validate_and_a_second_fit(ranks):
    result = ranks[0]
    assert set(result["after_validate"].values()) == {torch.float32}
    torch.testing.assert_close(result["after_validate_masters"], result["zero3"]["optimizer"]["master_weights"])
    assert set(result["after_refit"].values()) == {torch.float32}
    assert set(result["after_refit_state"].values()) == {torch.bfloat16}


@pytest.mark.parametrize("stage", [2, 3])
def test_master_weights_none_steps_bf16_parameters_directly(ranks, stage):
    result = ranks[0][f"zero{stage}_no_master"]
    reference = _reference(_global_batches(STEPS), master=False)
    assert "master_weights" not in result["optimizer"]
    for entry in result["optimizer"]["state"].values():
        assert entry["exp_avg"].dtype == torch.bfloat16  # the optimizer stepped the bf16 parameters
    torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)
    # Plain Lightning bf16-true on one device computes the whole batch's gradient at once (other bf16 roundings),
    # so it is close to, not equal to, the two-rank arithmetic: measured 3.9e-3 at most, one bf16 ulp of |w| < 1.
    _, single = _fit("auto", 1)
    torch.testing.assert_close(result["weights"], single.state_dict(), rtol=0, atol=8e-3)


def test_bytes_per_rank_equal_the_formula_and_the_planner(ranks):
    n, psi = WORLD_SIZE, NUMEL
    padded = -(-psi // n) * n  # one bucket, padded to a multiple of the world size
    shard = padded // n
    owned = [min(psi, (r + 1) * shard) - r * shard for r in range(n)]  # real elements of rank r's shard
    predicted = plan(MasterWeightsModel(), world_size=n, precision="bf16-true", optimizer="adamw")
    for stage in (1, 2):
        for rank, result in enumerate(ranks):
            gradients = 2 * padded + 4 * shard if stage == 1 else 4 * shard  # bf16 bucket (stage 1) + fp32 shard
            expected = {
                "parameters": 2 * padded,  # the bf16 flat bucket
                "gradients": gradients,
                "optimizer_state": 4 * shard + 8 * owned[rank],  # fp32 master shard + exp_avg + exp_avg_sq
            }
            measured = {k: v for k, v in result[f"zero{stage}"]["memory"].items() if k != "total"}
            assert measured == expected, (stage, rank)
            estimate = predicted.configuration(f"zero{stage}").ranks[rank]
            assert (estimate.parameters, estimate.gradients, estimate.optimizer_state) == tuple(expected.values())
    for rank, result in enumerate(ranks):
        # Stage 3: fp32 parameter and gradient shards (each parameter's rows padded to a multiple of N), fp32 Adam
        # state of the real rows; the fp32 shards are the masters.
        rows = [p.shape[0] if p.dim() else 1 for p in MasterWeightsModel().parameters()]
        numels = [p.numel() for p in MasterWeightsModel().parameters()]
        padded_shards = sum(-(-d0 // n) * (numel // d0) for d0, numel in zip(rows, numels, strict=True))
        local = sum(
            max(0, min(-(-d0 // n), d0 - rank * -(-d0 // n))) * (numel // d0)
            for d0, numel in zip(rows, numels, strict=True)
        )
        expected = {"parameters": 4 * padded_shards, "gradients": 4 * padded_shards, "optimizer_state": 8 * local}
        measured = {k: v for k, v in result["zero3"]["memory"].items() if k != "total"}
        assert measured == expected, rank
        estimate = predicted.configuration("zero3").ranks[rank]
        assert (estimate.parameters, estimate.gradients, estimate.optimizer_state) == tuple(expected.values())


@pytest.mark.parametrize(("saving", "resuming", "checkpoint_format"), RESUMES)
def test_zero_checkpoint_resumes_exactly(ranks, saving, resuming, checkpoint_format):
    """Both formats keep the fp32 masters (consolidated: the optimizer state's ``master_weights``; sharded: the
    ``param`` pieces are the masters), across stages."""
    result = ranks[0][(saving, resuming, checkpoint_format)]
    uninterrupted = _reference(_global_batches(2) * 2)  # two epochs of the same 2 batches
    torch.testing.assert_close(result["weights"], uninterrupted["weights"], **BF16_CLOSE)
    torch.testing.assert_close(_masters(result["optimizer"]), uninterrupted["masters"], **MASTER_CLOSE)


def test_consolidated_checkpoint_holds_what_single_device_saves_and_loads_there(ranks, workdir):
    path = workdir / "zero2-consolidated.ckpt"  # written by the ranks, as `plain.ckpt` by single-device Lightning
    checkpoint = torch.load(path, weights_only=True)
    plain = torch.load(workdir / "plain.ckpt", weights_only=True)
    assert {k: (v.dtype, v.shape) for k, v in checkpoint["state_dict"].items()} == {
        k: (v.dtype, v.shape) for k, v in plain["state_dict"].items()
    }
    state = checkpoint["optimizer_states"][0]
    assert sorted(state["master_weights"]) == list(range(len(list(MasterWeightsModel().parameters()))))
    # Plain single-device Lightning bf16-true loads it: the model is bf16, torch casts the fp32 state to bf16.
    model = MasterWeightsModel.load_from_checkpoint(path).to(torch.bfloat16)
    torch.testing.assert_close(model.state_dict(), checkpoint["state_dict"], rtol=0, atol=0)
    optimizer = _adamw(model.parameters())
    optimizer.load_state_dict(state)
    assert all(entry["exp_avg"].dtype == torch.bfloat16 for entry in optimizer.state.values())


def test_plain_bf16_checkpoint_resumes_with_masters_from_the_bf16_weights(ranks, workdir):
    result = ranks[0]["from_plain"]
    start = torch.load(workdir / "plain.ckpt", weights_only=True)
    reference = _reference(_global_batches(2), start=start)
    torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)
    torch.testing.assert_close(_masters(result["optimizer"]), reference["masters"], **MASTER_CLOSE)


# ---------------------------------------------------------------------------------------------- world size 1
def _as_checkpoint(result: dict[str, Any], *, with_masters: bool = True) -> dict[str, Any]:
    """The end of a reference run as the checkpoint ``_reference(start=...)`` continues from."""
    optimizer = copy.deepcopy(result["optimizer"])
    if with_masters:  # indices as in "state": the order of the model's parameters
        optimizer["master_weights"] = {index: t.clone() for index, t in enumerate(result["masters"].values())}
    return {"state_dict": result["weights"], "optimizer_states": [optimizer]}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_1_steps_fp32_masters_like_the_reference(alone, stage):
    """Moving a run from 2 devices to 1 keeps its arithmetic: the bf16 gradient of the whole batch is upcast (nothing
    to average), fp32 AdamW steps an fp32 master of every parameter, which is rounded into the bf16 weights."""
    result, reference = alone[f"zero{stage}"], _reference(_global_batches(STEPS), world_size=1)
    assert result["backend"] == "MasterWeightBackend"
    _assert_fp32_masters_like(result, reference)
    plain = _reference(_global_batches(STEPS), world_size=1, master=False)  # guard: what world size 1 did before
    assert _max_difference(result["weights"], plain["weights"]) > 0
    assert not any("master_weights" in message for message in alone["warnings"]), alone["warnings"]


@pytest.mark.parametrize("stage", [1, 3])
def test_world_size_1_clips_the_fp32_gradients(alone, stage):
    """Micro-batch gradients summed in the bf16 bucket (stage 3 too: at world size 1 it uses stage 2's buckets, not
    FSDP2's fp32 accumulation), clipped by the norm of the fp32 gradients, as the sharded stages 1-2 do."""
    result = alone[f"zero{stage}_accumulate_clip"]
    reference = _reference(_global_batches(STEPS), accumulate=2, clip=0.05, world_size=1)
    unclipped = _reference(_global_batches(STEPS), accumulate=2, world_size=1)
    assert _max_difference(unclipped["masters"], reference["masters"]) > 1e-4  # guard: clipping changed the run
    torch.testing.assert_close(_masters(result["optimizer"]), reference["masters"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)


def test_world_size_1_skips_a_nonfinite_step_without_touching_masters_or_state(alone):
    batches = _global_batches(STEPS)
    del batches[NONFINITE_STEP]  # a skipped step changes nothing: training went on as if the batch was not there
    reference = _reference(batches, world_size=1)
    result = alone["nonfinite"]
    torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)
    torch.testing.assert_close(_masters(result["optimizer"]), reference["masters"], **MASTER_CLOSE)
    assert {int(entry["step"]) for entry in result["optimizer"]["state"].values()} == {STEPS - 1}


def test_world_size_1_without_16bit_parameters_or_masters_trains_plainly(alone):
    assert alone["fp32_backend"] == "ReplicatedBackend"
    assert alone["no_master"]["backend"] == "ReplicatedBackend"
    _, single = _fit("auto", 1)  # `master_weights=None`: exactly plain single-device Lightning
    torch.testing.assert_close(alone["no_master"]["weights"], single.state_dict(), rtol=0, atol=0)


def test_world_size_1_refuses_a_shape_dependent_optimizer_with_masters(alone):
    assert "cannot shard `LBFGS`" in alone["lbfgs"]
    assert "At world size 1 the fp32 master weights are flat buckets too: pass `master_weights=None`" in alone["lbfgs"]


def test_world_size_1_bytes_equal_the_formula_and_the_planners_zero12_at_n_1(alone):
    p = NUMEL  # one bucket, whose only shard is all of it: no padding at world size 1
    context = EstimateContext(
        model_spec(MasterWeightsModel()),
        1,
        OPTIMIZER_STATES["adamw"],
        *PRECISION_BYTES["bf16-true"],
        GLOBAL_BATCH,
        1,
    )
    for stage in (1, 2, 3):
        expected = {
            "parameters": 2 * p,  # the bf16 bucket
            "gradients": (2 * p if stage == 1 else 0) + 4 * p,  # bf16 bucket (stage 1) + fp32 gradients
            "optimizer_state": 4 * p + 8 * p,  # fp32 master + exp_avg + exp_avg_sq
        }
        measured = {k: v for k, v in alone[f"zero{stage}"]["memory"].items() if k != "total"}
        assert measured == expected, stage
        estimate = estimate_zero12(context, stage=min(stage, 2), bucket_cap_mb=25.0).ranks[0]
        assert (estimate.parameters, estimate.gradients, estimate.optimizer_state) == tuple(expected.values())


@pytest.mark.parametrize(("saving", "resuming", "checkpoint_format"), TO_WORLD_SIZE_1)
def test_world_size_2_checkpoint_resumes_exactly_at_world_size_1(alone, saving, resuming, checkpoint_format):
    first = _reference(_global_batches(2))  # the epoch the ranks trained before saving
    uninterrupted = _reference(_global_batches(2), world_size=1, start=_as_checkpoint(first))
    result = alone["resumed"][(saving, resuming, checkpoint_format)]
    torch.testing.assert_close(result["weights"], uninterrupted["weights"], **BF16_CLOSE)
    torch.testing.assert_close(_masters(result["optimizer"]), uninterrupted["masters"], **MASTER_CLOSE)
    # Guard: the masters carried over matter (masters restarted from the bf16 weights train another run).
    restarted = _reference(_global_batches(2), world_size=1, start=_as_checkpoint(first, with_masters=False))
    assert _max_difference(restarted["masters"], uninterrupted["masters"]) > 0


@pytest.mark.parametrize(("saving", "resuming", "checkpoint_format"), FROM_WORLD_SIZE_1)
def test_world_size_1_checkpoint_resumes_exactly_at_world_size_2(ranks, workdir, saving, resuming, checkpoint_format):
    first = _reference(_global_batches(2), world_size=1)  # the epoch world size 1 trained before saving
    uninterrupted = _reference(_global_batches(2), start=_as_checkpoint(first))
    result = ranks[0][("from_world_size_1", saving, resuming, checkpoint_format)]
    torch.testing.assert_close(result["weights"], uninterrupted["weights"], **BF16_CLOSE)
    torch.testing.assert_close(_masters(result["optimizer"]), uninterrupted["masters"], **MASTER_CLOSE)
    restarted = _reference(_global_batches(2), start=_as_checkpoint(first, with_masters=False))
    assert _max_difference(restarted["masters"], uninterrupted["masters"]) > 0
    if checkpoint_format == "consolidated":  # the sharded backends' format: masters and state fp32, whole shapes
        state = torch.load(workdir / f"ws1-zero{saving}-consolidated.ckpt", weights_only=True)["optimizer_states"][0]
        shapes = [tuple(param.shape) for param in MasterWeightsModel().parameters()]
        assert {i: (t.dtype, tuple(t.shape)) for i, t in state["master_weights"].items()} == {
            i: (torch.float32, shape) for i, shape in enumerate(shapes)
        }
        assert {entry["exp_avg"].dtype for entry in state["state"].values()} == {torch.float32}


def test_master_weights_is_validated():
    with pytest.raises(ValueError, match=r"`master_weights='bf16'` is invalid. Valid options: 'fp32' .*, None"):
        ShardedOptimizerStrategy(master_weights="bf16")  # type: ignore[arg-type]
