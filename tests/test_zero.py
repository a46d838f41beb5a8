"""ShardedOptimizerStrategy (ZeRO 1/2/3) in real Trainers on forked CPU ranks: equivalence, memory, bad input."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from training_helpers import SEQ_LEN, _loader_for, assert_weights_close, fit_tiny, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule, RandomTokenDataset

GLOBAL_BATCH = 8
STEPS = 3
# (optimizer, accumulate_grad_batches, gradient_clip_val); SGD has momentum 0.9, AdamW two param groups.
CONFIGS = {"adamw-acc2-clip": ("adamw", 2, 0.5), "sgd-acc2-clip": ("sgd", 2, 0.5)}
TOLERANCE = {"sgd": {"rtol": 1e-5, "atol": 1e-6}, "adamw": {"rtol": 1e-4, "atol": 1e-5}}


@cache
def _reference(config: str) -> dict:
    optimizer, accumulate, clip = CONFIGS[config]
    return fit_tiny(
        "auto",
        devices=1,
        per_device_batch=GLOBAL_BATCH,
        max_steps=STEPS,
        accumulate=accumulate,
        optimizer=optimizer,
        gradient_clip_val=clip,
    )


def _fit_sharded(rank: int, world_size: int, strategy_name: str, stage: int, config: str) -> dict:
    optimizer, accumulate, clip = CONFIGS[config]
    if strategy_name == "data_parallel":
        strategy = DataParallelStrategy()
    else:
        # Small buckets: several buckets, parameters split across bucket and shard boundaries.
        strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.05)
    return fit_tiny(
        strategy,
        devices=world_size,
        per_device_batch=GLOBAL_BATCH // world_size,
        max_steps=STEPS,
        accumulate=accumulate,
        optimizer=optimizer,
        gradient_clip_val=clip,
    )


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(
    ("strategy_name", "stage", "world_size"),
    [("zero", 1, 2), ("zero", 2, 2), ("zero", 3, 2), ("zero", 2, 4), ("zero", 3, 4), ("data_parallel", 0, 2)],
    ids=["zero1-ws2", "zero2-ws2", "zero3-ws2", "zero2-ws4", "zero3-ws4", "data_parallel-ws2"],
)
def test_sharded_training_matches_single_device_on_the_same_global_batch(strategy_name, stage, world_size, config):
    results = run_distributed(
        _fit_sharded, world_size, args=(strategy_name, stage, config), init_process_group=False, timeout=180
    )
    optimizer = CONFIGS[config][0]
    assert_weights_close(results[0], _reference(config), **TOLERANCE[optimizer])


def test_clipping_is_active_in_the_equivalence_configs():
    """Guards the test above: with clipping off the reference moves differently, so clipping is really tested."""
    unclipped = fit_tiny("auto", devices=1, per_device_batch=GLOBAL_BATCH, max_steps=STEPS, accumulate=2)
    head = "model.head.weight"
    assert not torch.allclose(unclipped[head], _reference("adamw-acc2-clip")[head], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ memory
def _memory(rank: int, world_size: int, stage: int) -> dict:
    strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.05)
    fit_tiny(strategy, devices=world_size, per_device_batch=2, max_steps=1, optimizer="adamw")
    report = strategy.memory_report().as_dict()
    buckets = getattr(strategy.backend, "buckets", None)  # FlatBucketBackend's (stages 1-2)
    report["num_buckets"] = len(buckets.buckets) if buckets is not None else 0
    return report


def _unsharded_parameter_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in make_module().parameters())


@pytest.mark.parametrize(("stage", "world_size"), [(1, 2), (2, 2), (2, 4), (3, 2)])
def test_bytes_held_per_rank_are_the_unsharded_bytes_divided_by_world_size(stage, world_size):
    reports = run_distributed(_memory, world_size, args=(stage,), init_process_group=False, timeout=120)
    psi = _unsharded_parameter_bytes()
    element = 4
    for report in reports:
        # Padding: each bucket is padded to a multiple of the world size (< world_size elements per bucket);
        # FSDP2 pads each parameter's dim 0 to a multiple of the world size (bounded below by 2 rows per rank).
        padding = report["num_buckets"] * world_size * element if stage < 3 else psi // 8
        # AdamW keeps exp_avg and exp_avg_sq: 2 * Psi unsharded.
        assert 2 * psi / world_size - 2 * padding <= report["optimizer_state"] <= 2 * psi / world_size + 2 * padding
        if stage == 1:  # the full buffers only: each rank's reduced shard is its slice of them (in place)
            assert psi <= report["gradients"] <= psi + padding
        else:
            assert psi / world_size - padding <= report["gradients"] <= psi / world_size + padding
        if stage == 3:
            assert psi / world_size - padding <= report["parameters"] <= psi / world_size + padding
        else:
            assert psi <= report["parameters"] <= psi + padding
    if stage < 3:
        # Each element's optimizer state lives on exactly one rank.
        assert sum(report["optimizer_state"] for report in reports) == 2 * psi


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "`stage=4` is invalid. Valid options: 1"),
        ({"stage": 0}, "`stage=0` is invalid"),
        ({"checkpoint_format": "zip"}, "`checkpoint_format='zip'` is invalid"),
        ({"start_method": "thread"}, "Unknown `start_method='thread'`"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError) as error:
        ShardedOptimizerStrategy(**kwargs)
    assert message in str(error.value)


def _fit_with_optimizer(rank: int, world_size: int, kind: str) -> None:
    module = make_module()
    assert kind == "lbfgs"  # several optimizers, also sharing parameters, are supported (test_shared_parameters.py)
    module.configure_optimizers = lambda: torch.optim.LBFGS(module.parameters())
    loader = torch.utils.data.DataLoader(RandomTokenDataset(8, SEQ_LEN), batch_size=2)
    trainer = make_trainer(ShardedOptimizerStrategy(stage=2, timeout=30), devices=world_size, max_steps=1)
    try:
        trainer.fit(module, train_dataloaders=loader)
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"rank {rank} refused: {type(error).__name__}: {error}") from error


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("lbfgs", "TypeError: ShardedOptimizerStrategy cannot shard `LBFGS`"),
    ],
)
def test_unshardable_optimizers_are_refused_on_every_rank(kind, message):
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_fit_with_optimizer, args=(kind,), init_process_group=False, timeout=60)
    text = str(error.value)
    assert "did not finish" not in text
    for rank in (0, 1):
        assert f"rank {rank} refused: {message}" in text, text[-3000:]


# ------------------------------------------------------------------ stage 3 never materialises the full model
def _fit_meta_initialised(rank: int, world_size: int) -> dict:
    strategy = ShardedOptimizerStrategy(stage=3)
    trainer = make_trainer(strategy, devices=world_size, max_steps=2, limit_val_batches=2, val_check_interval=2)
    with trainer.init_module(empty_init=True):
        module = GPTLightningModule("tiny", block_size=SEQ_LEN)
    on_meta = all(p.is_meta for p in module.parameters())
    data = RandomTokenDataModule(num_samples=32, seq_len=SEQ_LEN, batch_size=2)
    trainer.fit(module, datamodule=data)
    local_numel = sum(p.to_local().numel() for p in module.parameters())
    return {
        "on_meta_before_fit": on_meta,
        "local_numel": local_numel,
        "full_numel": sum(p.numel() for p in module.parameters()),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_perplexity": float(trainer.callback_metrics["val_perplexity"]),
    }


def test_stage3_with_empty_init_never_holds_the_full_model_and_trains():
    results = run_distributed(_fit_meta_initialised, 2, init_process_group=False, timeout=120)
    for result in results:
        assert result["on_meta_before_fit"]
        # Each rank holds its half (FSDP2 pads dim 0 by at most one row per parameter).
        assert result["local_numel"] <= result["full_numel"] / 2 + 64 * 20
        # GPT-2 init through the children-first `reset_parameters()` pass gives a sane initial loss (ln 256 = 5.5),
        # and torchmetrics states created on the meta device were reset (a garbage state gives nan/inf).
        assert 4.5 < result["val_loss"] < 6.5
        assert 50 < result["val_perplexity"] < 700


def _fit_bf16(rank: int, world_size: int, stage: int) -> dict:
    strategy = ShardedOptimizerStrategy(stage=stage) if stage else "auto"
    return fit_tiny(
        strategy,
        devices=world_size,
        per_device_batch=GLOBAL_BATCH // world_size,
        max_steps=STEPS,
        optimizer="sgd",
        precision="bf16-mixed",
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_precision_matches_single_device_bf16(stage):
    (reference,) = run_distributed(_fit_bf16, 1, args=(0,), init_process_group=False, timeout=120)
    results = run_distributed(_fit_bf16, 2, args=(stage,), init_process_group=False, timeout=120)
    # bf16 autocast: the reduction order of the averaged gradient is the only difference.
    assert_weights_close(results[0], reference, rtol=1e-2, atol=1e-3)


# ------------------------------------------------------------------ schedulers, evaluation
def _with_scheduler(module):
    def configure_optimizers():
        optimizer = type(module).configure_optimizers(module)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module.configure_optimizers = configure_optimizers
    return module


def _fit_scheduled(rank: int, world_size: int, stage: int) -> dict:
    import training_helpers

    original = training_helpers.make_module
    training_helpers.make_module = lambda optimizer="adamw", learning_rate=None: _with_scheduler(
        original(optimizer, learning_rate)
    )
    strategy = ShardedOptimizerStrategy(stage=stage) if stage else "auto"
    return fit_tiny(strategy, devices=world_size, per_device_batch=GLOBAL_BATCH // world_size, max_steps=STEPS)


@pytest.mark.parametrize("stage", [2, 3])
def test_lr_scheduler_steps_the_sharded_param_groups(stage):
    (reference,) = run_distributed(_fit_scheduled, 1, args=(0,), init_process_group=False, timeout=120)
    unscheduled = _fit_sharded_reference_without_scheduler()
    results = run_distributed(_fit_scheduled, 2, args=(stage,), init_process_group=False, timeout=120)
    assert_weights_close(results[0], reference, **TOLERANCE["adamw"])
    assert not torch.allclose(reference["model.head.weight"], unscheduled["model.head.weight"], rtol=1e-4, atol=1e-5)


def _fit_sharded_reference_without_scheduler() -> dict:
    return fit_tiny("auto", devices=1, per_device_batch=GLOBAL_BATCH, max_steps=STEPS)


def _validate(rank: int, world_size: int, stage: int) -> dict:
    module = make_module()
    data = RandomTokenDataModule(num_samples=32, seq_len=SEQ_LEN, batch_size=16 // world_size)
    strategy = ShardedOptimizerStrategy(stage=stage) if stage else "auto"
    trainer = make_trainer(strategy, devices=world_size, max_steps=1, limit_val_batches=None)
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
    (test_metrics,) = trainer.test(module, datamodule=data, verbose=False)
    return {**metrics, **test_metrics}


@pytest.mark.parametrize("stage", [2, 3])
def test_validate_and_test_give_the_single_device_metrics(stage):
    (reference,) = run_distributed(_validate, 1, args=(0,), init_process_group=False, timeout=120)
    results = run_distributed(_validate, 2, args=(stage,), init_process_group=False, timeout=120)
    assert set(reference) >= {"val_loss", "val_perplexity", "val_accuracy", "test_loss"}
    for key, value in reference.items():
        assert results[0][key] == pytest.approx(value, rel=1e-5), key


# ------------------------------------------------------------------ manual optimization
class _ManualAccumulation(GPTLightningModule):
    """Two synchronised backwards per optimizer step (manual accumulation), clipping through Lightning."""

    def __init__(self) -> None:
        super().__init__("tiny", block_size=SEQ_LEN, bias=False, optimizer="adamw", learning_rate=1e-3)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        inputs, targets = batch
        half = inputs.shape[0] // 2
        for part in (slice(0, half), slice(half, None)):
            self.manual_backward(self.loss_fn(self(inputs[part]), targets[part]) / 2)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()


def _fit_manual(rank: int, world_size: int, stage: int) -> dict:
    import lightning.pytorch as pl

    pl.seed_everything(1234, verbose=False)
    module = _ManualAccumulation()
    strategy = ShardedOptimizerStrategy(stage=stage, bucket_cap_mb=0.05) if stage else "auto"
    trainer = make_trainer(strategy, devices=world_size, max_steps=STEPS)
    trainer.fit(module, train_dataloaders=_loader_for(world_size, GLOBAL_BATCH // world_size))
    state = module.state_dict() if world_size == 1 else trainer.strategy.lightning_module_state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manual_optimization_accumulating_over_synchronised_backwards(stage):
    (reference,) = run_distributed(_fit_manual, 1, args=(0,), init_process_group=False, timeout=120)
    results = run_distributed(_fit_manual, 2, args=(stage,), init_process_group=False, timeout=120)
    assert_weights_close(results[0], reference, **TOLERANCE["adamw"])


def _fit_with_frozen_embedding(rank: int, world_size: int, stage: int) -> dict:
    import training_helpers

    original = training_helpers.make_module

    def frozen(optimizer="sgd", learning_rate=None):
        module = original(optimizer, learning_rate)
        module.model.embedding.requires_grad_(False)  # still listed in configure_optimizers' param groups
        return module

    training_helpers.make_module = frozen
    strategy = ShardedOptimizerStrategy(stage=stage) if stage else "auto"
    return fit_tiny(strategy, devices=world_size, per_device_batch=GLOBAL_BATCH // world_size, optimizer="sgd")


@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_parameters_in_the_optimizer_stay_frozen(stage):
    (reference,) = run_distributed(_fit_with_frozen_embedding, 1, args=(0,), init_process_group=False, timeout=120)
    results = run_distributed(_fit_with_frozen_embedding, 2, args=(stage,), init_process_group=False, timeout=120)
    assert_weights_close(results[0], reference, **TOLERANCE["sgd"])
    untrained = make_module("sgd").state_dict()
    for name in ("model.embedding.token.weight", "model.embedding.position.weight"):
        torch.testing.assert_close(results[0][name], untrained[name], rtol=0, atol=0)


class _BatchNormModule(GPTLightningModule):
    """The tiny GPT with a BatchNorm over the embedding: buffers that each rank updates with its own batches."""

    def __init__(self) -> None:
        super().__init__("tiny", block_size=SEQ_LEN, bias=False)
        self.norm_in = torch.nn.BatchNorm1d(SEQ_LEN)

    def forward(self, idx):
        return super().forward(idx) + self.norm_in(idx.float()).unsqueeze(-1)


def _buffers_after_validate(rank: int, world_size: int, stage: int) -> dict:
    import lightning.pytorch as pl

    pl.seed_everything(1234, verbose=False)
    module = _BatchNormModule()
    strategy = ShardedOptimizerStrategy(stage=stage)
    data = RandomTokenDataModule(num_samples=32, seq_len=SEQ_LEN, batch_size=4, shuffle=True)
    trainer = make_trainer(strategy, devices=world_size, max_steps=2, limit_val_batches=None)
    trainer.fit(module, datamodule=data)
    trainer.validate(module, datamodule=data, verbose=False)
    return {"running_mean": module.norm_in.running_mean.clone(), "batches": module.norm_in.num_batches_tracked}


@pytest.mark.parametrize("stage", [2, 3])
def test_every_rank_evaluates_with_rank_zero_buffers(stage):
    rank0, rank1 = run_distributed(_buffers_after_validate, 2, args=(stage,), init_process_group=False, timeout=120)
    assert rank0["batches"] == 2
    torch.testing.assert_close(rank1["running_mean"], rank0["running_mean"], rtol=0, atol=0)


# ------------------------------------------------------------------ Lightning's fork launcher, world size 1
def _fit_with_registry_name(rank: int, world_size: int, name: str) -> dict:
    return fit_tiny(name, devices=2, per_device_batch=GLOBAL_BATCH // 2, max_steps=STEPS, optimizer="sgd")


@pytest.mark.parametrize("name", ["zero2_notebook", "zero3_notebook"])
def test_fork_launcher_brings_the_whole_trained_model_back_to_the_parent(name):
    reference = fit_tiny("auto", devices=1, per_device_batch=GLOBAL_BATCH, max_steps=STEPS, optimizer="sgd")
    (weights,) = run_distributed(
        _fit_with_registry_name, 1, args=(name,), init_process_group=False, launcher_env=False, timeout=120
    )
    assert_weights_close(weights, reference, **TOLERANCE["sgd"])


def _empty_init_at_world_size_one(rank: int, world_size: int) -> float:
    trainer = make_trainer(ShardedOptimizerStrategy(stage=3), devices=1, max_steps=2)
    with trainer.init_module(empty_init=True):
        module = GPTLightningModule("tiny", block_size=SEQ_LEN)
    trainer.fit(module, datamodule=RandomTokenDataModule(num_samples=16, seq_len=SEQ_LEN, batch_size=4))
    return float(trainer.callback_metrics["train_loss"])


def test_stage3_empty_init_works_at_world_size_one():
    (loss,) = run_distributed(_empty_init_at_world_size_one, 1, init_process_group=False, timeout=60)
    assert 4.5 < loss < 6.5


# ------------------------------------------------------------------ tied weights
class _TiedEmbeddingModule(GPTLightningModule):
    """The tiny GPT with its LM head tied to the token embedding (one tensor under two names)."""

    def __init__(self) -> None:
        super().__init__("tiny", block_size=SEQ_LEN, bias=False, optimizer="sgd", learning_rate=0.1)
        self.model.head.weight = self.model.embedding.token.weight


def _fit_tied(rank: int, world_size: int, stage: int, path: str) -> dict:
    import lightning.pytorch as pl

    pl.seed_everything(1234, verbose=False)
    module = _TiedEmbeddingModule()
    strategy = ShardedOptimizerStrategy(stage=stage, checkpoint_format="sharded") if stage else "auto"
    trainer = make_trainer(strategy, devices=world_size, max_steps=STEPS)
    trainer.fit(module, train_dataloaders=_loader_for(world_size, GLOBAL_BATCH // world_size))
    if stage:
        trainer.save_checkpoint(path)
        trainer.strategy.checkpoint_format = "consolidated"
    state = module.state_dict() if world_size == 1 else trainer.strategy.lightning_module_state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tied_weights_stay_tied_and_train_like_single_device(tmp_path, stage):
    from lightning_parallel.distributed.checkpoint import sharded_to_consolidated

    (reference,) = run_distributed(_fit_tied, 1, args=(0, ""), init_process_group=False, timeout=120)
    path = str(tmp_path / "tied.ckpt")
    results = run_distributed(_fit_tied, 2, args=(stage, path), init_process_group=False, timeout=120)
    assert_weights_close(results[0], reference, **TOLERANCE["sgd"])
    head, token = "model.head.weight", "model.embedding.token.weight"
    torch.testing.assert_close(results[0][head], results[0][token], rtol=0, atol=0)
    saved = sharded_to_consolidated(path)["state_dict"]
    assert_weights_close(saved, reference, **TOLERANCE["sgd"])


def _fit_twice_across_a_new_world(rank: int, world_size: int, store: str) -> dict:
    """Two fits of one Trainer, the world group destroyed and created again between them (a restart in the same
    process): the second fit trains, with its gloo checks group built in the new world."""
    import torch.distributed as dist

    strategy = ShardedOptimizerStrategy(stage=2, timeout=30)
    trainer = make_trainer(strategy, devices=world_size, max_steps=1)
    module, loader = make_module("adamw"), _loader_for(world_size, 2)
    trainer.fit(module, train_dataloaders=loader)
    first = strategy.host_groups.world
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(module, train_dataloaders=loader)
    second = strategy.host_groups.world
    return {
        "steps": trainer.global_step,
        "rebuilt": second is not first,
        "ranks": dist.get_process_group_ranks(second),  # registered in the new world (the destroyed one's is not)
        "backend": dist.get_backend(second),
    }


def test_the_checks_group_is_rebuilt_when_the_world_group_is(tmp_path):
    """Issue 42: the cached gloo group of the per-step trainable check belonged to the destroyed world group."""
    results = run_distributed(_fit_twice_across_a_new_world, 2, args=(str(tmp_path / "store"),), timeout=120)
    assert results == [{"steps": 2, "rebuilt": True, "ranks": [0, 1], "backend": "gloo"}] * 2
