"""Several optimizers holding the same parameter, under zero1, zero2 and zero3 (2 ranks) against one device.

On one device two optimizers that hold one ``nn.Parameter`` each step it when they step, each with its own state
for it (torch keys optimizer state by the parameter, per optimizer). The same must hold when ZeRO shards it:

* ``gan``: a GAN whose generator and discriminator share a layer (both optimizers hold it), ``toggle_optimizer``
  around each update (AdamW for the discriminator, Adam for the generator).
* ``closures``: Lightning's ``test_step_with_optimizer_closure_with_different_frequencies``: one layer held by SGD
  and Adam, gradients accumulated over synchronised backwards, ``opt.step(closure=...)`` every 2 and every 4
  batches (without its dropout: each rank would draw other masks than one device).
* ``toggle_model``: Lightning's ``..._ddp_with_toggle_model`` variant: ``opt.toggle_model(sync_grad=...)`` skips
  the gradient sync of the backwards that do not step, two backwards per closure (``retain_graph``).
* ``same_gradient``: one backward, then two optimizers step the shared backbone on the same gradient (SGD with
  momentum, AdamW with weight decay), each clipped by its own norm (``self.clip_gradients``).

Weights and each optimizer's consolidated state equal one device's. A consolidated checkpoint holds each optimizer's
own state for the shared parameters and resumes exactly, across stages.

Lightning's automatic optimization takes one optimizer only ("Training with multiple optimizers is only supported
with manual optimization"), and one torch optimizer refuses a parameter in two of its groups, so sharing needs
manual optimization; the closures above are how automatic optimization steps.
"""

from __future__ import annotations

import tempfile
from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import FEATURES, WIDTH, gan_update, loader, state_of, trainer
from torch import nn

from lightning_parallel import ShardedOptimizerStrategy

EXACT = {"rtol": 1e-5, "atol": 1e-6}
STAGES = (1, 2, 3)
STAGES_OF = {"tied_gan": (1, 2)}
"""Stage 3 keeps a parameter tied across two sub-networks in the root unit, which FSDP2 gathers only when
``training_step`` calls ``self(...)``: the tied GAN calls ``self.discriminator`` first (docs/zero.md, ZeRO-3)."""


class _GAN(pl.LightningModule):
    """Manual optimization with ``toggle_optimizer`` around each network's update (as ``model_zoo.TwoOptimizerGAN``);
    subclasses say how the networks are built and which parameters each optimizer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def discriminate(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def generator_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def discriminator_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        gan_update(self, x, self.discriminate)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator_parameters(), lr=1e-2, betas=(0.5, 0.9)),
            torch.optim.AdamW(self.discriminator_parameters(), lr=1e-2, weight_decay=0.1),
        ]


class SharedLayerGAN(_GAN):
    """A GAN whose generator and discriminator share their middle layer ``shared``: both optimizers hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.generator_in, self.generator_out = nn.Linear(4, WIDTH), nn.Linear(WIDTH, FEATURES)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.discriminator_in, self.discriminator_out = nn.Linear(FEATURES, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator_out(torch.tanh(self.shared(torch.tanh(self.generator_in(z)))))

    def discriminate(self, x: torch.Tensor) -> torch.Tensor:
        return self.discriminator_out(torch.tanh(self.shared(torch.tanh(self.discriminator_in(x)))))

    def generator_parameters(self) -> list[nn.Parameter]:
        return [*self.generator_in.parameters(), *self.shared.parameters(), *self.generator_out.parameters()]

    def discriminator_parameters(self) -> list[nn.Parameter]:
        return [*self.discriminator_in.parameters(), *self.shared.parameters(), *self.discriminator_out.parameters()]


class TiedLayerGAN(_GAN):
    """The same GAN with ``nn.Sequential`` networks that both register the shared layer: one parameter under two
    names (``generator.2.weight`` is ``discriminator.2.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        shared, tanh = nn.Linear(WIDTH, WIDTH), nn.Tanh()
        self.generator = nn.Sequential(nn.Linear(4, WIDTH), tanh, shared, tanh, nn.Linear(WIDTH, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, WIDTH), tanh, shared, tanh, nn.Linear(WIDTH, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def discriminate(self, x: torch.Tensor) -> torch.Tensor:
        return self.discriminator(x)

    def generator_parameters(self) -> list[nn.Parameter]:
        return list(self.generator.parameters())

    def discriminator_parameters(self) -> list[nn.Parameter]:
        return list(self.discriminator.parameters())


class ClosureFrequencies(pl.LightningModule):
    """Lightning's closure-with-different-frequencies GAN emulation: ``layer`` is held by SGD and by Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(FEATURES, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def loss(self, x: torch.Tensor, target: float) -> torch.Tensor:
        prediction = self(x)
        return nn.functional.mse_loss(prediction, torch.full_like(prediction, target))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_gen, opt_dis = self.optimizers()

        def gen_closure() -> None:
            self.manual_backward(self.loss(x, 1.0))

        def dis_closure() -> None:
            self.manual_backward(self.loss(x, 0.0))

        gen_closure()  # accumulates over 2 batches, then `opt_gen.step()` runs it once more
        if batch_idx % 2 == 0:
            opt_gen.step(closure=gen_closure)
            opt_gen.zero_grad()
        if batch_idx % 4 == 0:  # no accumulation of its own: it starts from what the generator left
            opt_dis.step(closure=dis_closure)
            opt_dis.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        # Lightning's test uses SGD without momentum, which keeps no state: momentum gives it some to compare.
        sgd = torch.optim.SGD(self.layer.parameters(), lr=0.1, momentum=0.9)
        return [sgd, torch.optim.Adam(self.layer.parameters(), lr=1e-2)]


class ToggleModelFrequencies(ClosureFrequencies):
    """Lightning's ``toggle_model(sync_grad=...)`` variant: backwards that do not step skip the gradient sync."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_gen, opt_dis = self.optimizers()
        gen_steps, dis_steps = batch_idx % 2 == 1, batch_idx % 4 == 0

        def closure(target: float) -> None:
            loss = self.loss(x, target)
            self.manual_backward(loss, retain_graph=True)
            self.manual_backward(loss)

        with opt_gen.toggle_model(sync_grad=gen_steps):
            closure(1.0)
            if gen_steps:
                opt_gen.step()
                opt_gen.zero_grad()
        with opt_dis.toggle_model(sync_grad=dis_steps):
            closure(0.0)
            if dis_steps:
                opt_dis.step()
                opt_dis.zero_grad()


class SameGradientTwoOptimizers(pl.LightningModule):
    """One backward; a backbone shared by two optimizers (SGD + momentum with head ``a``, AdamW with head ``b``),
    each clipped over its own parameters before it steps."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.backbone = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh())
        self.head_a = nn.Linear(WIDTH, 1)
        self.head_b = nn.Linear(WIDTH, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()
        features = self.backbone(x)
        target = y.float().unsqueeze(1)
        loss = nn.functional.mse_loss(self.head_a(features), target) + self.head_b(features).square().mean()
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt_a, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_a.step()
        self.clip_gradients(opt_b, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt_b.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD([*self.backbone.parameters(), *self.head_a.parameters()], lr=0.1, momentum=0.9),
            torch.optim.AdamW([*self.head_b.parameters(), *self.backbone.parameters()], lr=1e-2, weight_decay=0.1),
        ]


MODELS: dict[str, type[pl.LightningModule]] = {
    "gan": SharedLayerGAN,
    "tied_gan": TiedLayerGAN,
    "closures": ClosureFrequencies,
    "toggle_model": ToggleModelFrequencies,
    "same_gradient": SameGradientTwoOptimizers,
}
BATCHES = {"gan": 3, "tied_gan": 3, "closures": 8, "toggle_model": 8, "same_gradient": 3}
"""Batches per epoch (one global batch of 8 samples each)."""
SHARED = {  # a shared parameter: its index in each optimizer's state dict
    "gan": ("shared.weight", [2, 2]),
    "tied_gan": ("generator.2.weight", [2, 2]),
    "closures": ("layer.weight", [0, 0]),
    "toggle_model": ("layer.weight", [0, 0]),
    "same_gradient": ("backbone.0.weight", [0, 2]),
}
RESUMES = [(2, 2), (3, 1), (1, 3)]
"""(stage that saves, stage that resumes) of the GAN's consolidated checkpoint, taken after one epoch."""


def _fit(
    model: str, strategy: Any, devices: int, *, epochs: int = 1, ckpt_path: str | None = None
) -> tuple[pl.Trainer, pl.LightningModule]:
    """Seed, build and fit ``epochs`` epochs on this replica's slice of every global batch."""
    pl.seed_everything(0, verbose=False)
    fit_trainer = trainer(strategy, devices, max_steps=-1, max_epochs=epochs)
    sampler = getattr(fit_trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = MODELS[model]()
    data = loader(sampler["num_replicas"], sampler["rank"], steps=BATCHES[model])
    fit_trainer.fit(module, data, ckpt_path=ckpt_path)
    return fit_trainer, module


def _result(fit_trainer: pl.Trainer) -> dict[str, Any]:
    """Collective: the consolidated weights and optimizer states (complete on rank 0)."""
    strategy = fit_trainer.strategy
    weights = {name: tensor.detach().clone() for name, tensor in strategy.lightning_module_state_dict().items()}
    return {"weights": weights, "optimizers": [strategy.optimizer_state(opt) for opt in fit_trainer.optimizers]}


@cache
def _reference(model: str, epochs: int = 1) -> dict[str, Any]:
    fit_trainer, module = _fit(model, "auto", 1, epochs=epochs)
    return {"weights": state_of(module), "optimizers": [opt.state_dict() for opt in fit_trainer.optimizers]}


def _sharded_runs(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for stage in STAGES:
        for model in (model for model in MODELS if stage in STAGES_OF.get(model, STAGES)):
            fit_trainer, _ = _fit(model, ShardedOptimizerStrategy(stage=stage), world_size)
            results[(model, stage)] = _result(fit_trainer)
            if model == "gan":
                fit_trainer.save_checkpoint(f"{directory}/gan-zero{stage}.ckpt")
    for saving, resuming in RESUMES:
        path = f"{directory}/gan-zero{saving}.ckpt"
        fit_trainer, _ = _fit("gan", ShardedOptimizerStrategy(stage=resuming), world_size, epochs=2, ckpt_path=path)
        results[("resumed", saving, resuming)] = _result(fit_trainer)
    if rank == 0:
        for stage in STAGES:
            saved = torch.load(f"{directory}/gan-zero{stage}.ckpt", weights_only=True)
            results[("checkpoint", stage)] = saved["optimizer_states"]
    return results


@cache
def _results() -> dict[Any, Any]:
    with tempfile.TemporaryDirectory() as directory:
        rank0, _ = run_distributed(_sharded_runs, 2, args=(directory,), init_process_group=False, timeout=240)
    return rank0


def _assert_close(actual: Any, expected: Any, label: str) -> None:
    try:
        torch.testing.assert_close(actual, expected, **EXACT)
    except AssertionError as error:
        raise AssertionError(f"{label}: {error}") from None


def _assert_optimizer_states_equal(actual: list[dict], expected: list[dict], label: str) -> None:
    """Each optimizer's state exactly in torch's layout: the same parameters have state, each its own."""
    assert len(actual) == len(expected), label
    for number, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
        assert sorted(mine["state"]) == sorted(theirs["state"]), f"{label}, optimizer #{number}"
        for index, entry in theirs["state"].items():
            assert sorted(mine["state"][index]) == sorted(entry), f"{label}, optimizer #{number}, parameter {index}"
            for key, value in entry.items():
                _assert_close(mine["state"][index][key], value, f"{label}, optimizer #{number}, {index}/{key}")


@pytest.mark.parametrize(
    ("model", "stage"), [(model, stage) for model in MODELS for stage in STAGES_OF.get(model, STAGES)]
)
def test_optimizers_sharing_parameters_train_like_one_device(model: str, stage: int) -> None:
    result, reference = _results()[(model, stage)], _reference(model)
    _assert_close(result["weights"], reference["weights"], f"{model} zero{stage} weights")
    _assert_optimizer_states_equal(result["optimizers"], reference["optimizers"], f"{model} zero{stage}")
    # Guard: both optimizers stepped the shared parameter, each keeping its own (different) state for it.
    name, (first, second) = SHARED[model]
    own = [reference["optimizers"][0]["state"][first], reference["optimizers"][1]["state"][second]]
    assert own[0] and own[1] and _differ(own[0], own[1]), name
    assert not torch.equal(reference["weights"][name], _initial(model)[name])


def _differ(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two optimizers' states of one parameter differ (other keys, or other values)."""
    if sorted(first) != sorted(second):
        return True
    return any(not torch.equal(torch.as_tensor(first[key]), torch.as_tensor(second[key])) for key in first)


@cache
def _initial(model: str) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    return state_of(MODELS[model]())


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_holds_each_optimizers_own_state_for_the_shared_layer(stage: int) -> None:
    saved = _results()[("checkpoint", stage)]
    _assert_optimizer_states_equal(saved, _reference("gan")["optimizers"], f"checkpoint of zero{stage}")
    _, (first, second) = SHARED["gan"]
    generator, discriminator = saved[0]["state"][first], saved[1]["state"][second]
    assert not torch.equal(generator["exp_avg"], discriminator["exp_avg"])


@pytest.mark.parametrize(("saving", "resuming"), RESUMES)
def test_shared_layer_gan_resumes_exactly_across_stages(saving: int, resuming: int) -> None:
    result, reference = _results()[("resumed", saving, resuming)], _reference("gan", epochs=2)
    label = f"zero{saving} -> zero{resuming}"
    _assert_close(result["weights"], reference["weights"], f"{label} weights")
    _assert_optimizer_states_equal(result["optimizers"], reference["optimizers"], label)


def test_module_under_test_shares_the_layer() -> None:
    """Guard on the model itself: one parameter object under two names, held by both optimizers."""
    tied = TiedLayerGAN()
    assert tied.generator[2].weight is tied.discriminator[2].weight
    for module, shared in ((SharedLayerGAN(), "shared.weight"), (tied, "generator.2.weight")):
        generator, discriminator = module.configure_optimizers()
        weight = module.get_parameter(shared)
        assert any(p is weight for p in generator.param_groups[0]["params"])
        assert any(p is weight for p in discriminator.param_groups[0]["params"])
