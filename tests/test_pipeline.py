"""PipelineParallelStrategy: unit tier (config, splitting) and integration tier (real Trainers on forked ranks).

Every training run is compared with single-device training on the same batches (Lightning's
``DistributedSampler(shuffle=True, seed=SEED)`` permutation, used explicitly by the reference): weights and the
logged ``train_loss`` of every step, to fp32 rounding.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import DistributedTestError, run_distributed
from pipeline_helpers import fit_pipeline, fit_reference, tiny_module, train_loader
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics.classification import MulticlassAccuracy
from training_helpers import SEED, SEQ_LEN, assert_weights_close, make_trainer

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPT, GPTConfig, RandomTokenDataset
from lightning_parallel.distributed.pipeline import (
    ContractError,
    balanced_boundaries,
    layer_compute_costs,
    layer_parameter_costs,
    resolve_schedule,
)
from lightning_parallel.distributed.pipeline.contract import (
    LogRecord,
    aggregate_logs,
    capture_model_inputs,
    run_step_with_output,
)
from lightning_parallel.distributed.pipeline.layer_costs import measure_layer_times
from lightning_parallel.distributed.pipeline.microbatch import DivisibleBatches, pad_batch, slice_batch

BATCH = 8
STEPS = 3
SGD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
ADAM_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


# ------------------------------------------------------------------ unit
@pytest.mark.parametrize("name", ["1f1b", "GPIPE", "interleaved1f1b", "LoopedBFS", "interleavedzerobubble"])
def test_schedule_names_are_case_insensitive(name):
    assert resolve_schedule(name).lower() == name.lower()


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown `schedule='zb'`. Valid schedules .*GPipe, 1F1B, Interleaved1F1B"):
        PipelineParallelStrategy(schedule="zb")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_method": "forkserver"}, "Unknown `start_method='forkserver'`"),
        ({"num_microbatches": 0}, "`num_microbatches=0` is invalid"),
        ({"pipeline_parallel_size": -1}, "`pipeline_parallel_size=-1` is invalid"),
        ({"partition": "memory"}, "`partition='memory'` is invalid"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        PipelineParallelStrategy(**kwargs)


def test_balanced_split_minimises_the_slowest_stage():
    assert balanced_boundaries([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_boundaries([10, 1, 1, 1, 1, 6], 2) == [0, 1]
    assert balanced_boundaries([1, 5, 5, 5, 5, 9], 3) == [0, 3, 5]
    with pytest.raises(ValueError, match="Cannot split 2 pipeline layers into 3 stages"):
        balanced_boundaries([1, 1], 3)


def test_compute_costs_weigh_the_lm_head_not_the_embedding():
    """By parameters the embedding is heavy and the head light; by FLOPs it is the other way round."""
    config = GPTConfig(vocab_size=4096, n_layer=4, n_embd=64, n_head=2, block_size=64)
    model = GPT(config)
    layers = model.pipeline_layers()
    params = layer_parameter_costs(layers)
    flops = layer_compute_costs(layers, (torch.zeros(8, 64, dtype=torch.long),))
    assert params[0] > params[1] and flops[0] < flops[1]  # embedding: many parameters, no matmul
    assert flops[-1] > 4 * flops[1]  # the LM head costs more than a block at this vocabulary
    assert balanced_boundaries(flops, 2) != balanced_boundaries(params, 2)


class _Steps(torch.nn.Module):
    """A stand-in LightningModule for the contract functions: a step that calls ``self(...)`` ``calls`` times."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls
        self.accuracy = MulticlassAccuracy(num_classes=3, average="micro")

    def forward(self, x):
        raise AssertionError("the real forward never runs under the contract")

    def log(self, *args, **kwargs):
        raise AssertionError("the real log never runs under the contract")

    def training_step(self, batch, batch_idx):
        x = batch[0]
        outputs = [self(x) for _ in range(self.calls)]
        self.log("loss", outputs[0].sum() if outputs else 0.0)
        self.log("count", float(len(x)), reduce_fx="sum")
        return outputs[0].sum() if outputs else None


def test_the_contract_answers_self_with_the_pipeline_output_and_records_logs():
    batch = (torch.arange(6.0).view(3, 2), torch.zeros(3))
    args, kwargs = capture_model_inputs(_Steps(1), "training_step", (batch, 0), {})
    assert torch.equal(args[0], batch[0]) and kwargs == {}
    result, records = run_step_with_output(_Steps(1), "training_step", (batch, 0), {}, torch.ones(3, 2))
    assert result.item() == 6.0 and [r.name for r in records] == ["loss", "count"]
    with pytest.raises(ContractError, match="a second time"):
        run_step_with_output(_Steps(2), "training_step", (batch, 0), {}, torch.ones(3, 2))
    with pytest.raises(ContractError, match="returned without calling `self"):
        capture_model_inputs(_Steps(0), "training_step", (batch, 0), {})


def test_logs_are_aggregated_over_micro_batches_weighted_by_size():
    metric = MulticlassAccuracy(num_classes=3, average="micro")
    first = [LogRecord("loss", torch.tensor(1.0)), LogRecord("n", 4.0, kwargs={"reduce_fx": "sum"})]
    second = [LogRecord("loss", torch.tensor(4.0)), LogRecord("n", 2.0, kwargs={"reduce_fx": "sum"})]
    second.append(LogRecord("acc", metric))
    loss, count, acc = aggregate_logs([first, second], [4.0, 2.0])
    assert loss.value.item() == pytest.approx(2.0) and count.value.item() == 6.0 and acc.value is metric


def test_batches_are_sliced_and_padded_along_dim_zero():
    batch = {"x": torch.arange(10).view(5, 2), "tag": "same"}
    assert slice_batch(batch, 3, 5)["x"].tolist() == [[6, 7], [8, 9]]
    assert pad_batch(batch, 8)["x"][5:].tolist() == [[8, 9]] * 3
    loader = DataLoader(list(range(22)), batch_size=8)
    batches = DivisibleBatches(loader, 4, on_skip=lambda size: None)
    assert batches.known_partial_batch == 6 and len(batches) == 2 and [len(b) for b in batches] == [8, 8]
    assert len(DivisibleBatches(DataLoader(list(range(20)), batch_size=8), 4, on_skip=print)) == 3


def test_measured_layer_times_leave_the_model_untouched():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(256, (4, 16))
    rng = torch.get_rng_state()
    times = measure_layer_times(model.pipeline_layers(), (tokens,), device=torch.device("cpu"))
    assert len(times) == 5 and all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


# ------------------------------------------------------------------ equivalence, 2 ranks
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_two_ranks_match_single_device(schedule):
    reference, reference_losses = fit_reference(batch_size=BATCH, steps=STEPS)
    options = {"schedule": schedule, "num_microbatches": 4}
    rank0, rank1 = run_distributed(fit_pipeline, 2, args=(options, BATCH, STEPS), init_process_group=False, timeout=120)
    assert_weights_close(rank0["weights"], reference, **SGD_TOLERANCE)
    assert rank1["weights"] == {}  # consolidated on rank 0 only
    for result in (rank0, rank1):  # the last stage's losses reach every rank
        torch.testing.assert_close(result["losses"], reference_losses, rtol=1e-6, atol=1e-6)
    assert not set(rank0["local_keys"]) & set(rank1["local_keys"])
    assert set(rank0["local_keys"]) | set(rank1["local_keys"]) == set(reference)


def test_measured_partition_agrees_on_every_rank_and_trains_exactly():
    reference, _ = fit_reference(batch_size=BATCH, steps=STEPS)
    options = {"partition": "measured", "num_microbatches": 4}
    rank0, rank1 = run_distributed(fit_pipeline, 2, args=(options, BATCH, STEPS), init_process_group=False, timeout=120)
    assert rank0["starts"] == rank1["starts"]
    assert_weights_close(rank0["weights"], reference, **SGD_TOLERANCE)


def test_accumulation_and_global_norm_clipping_match_single_device():
    trainer_kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    reference, reference_losses = fit_reference(batch_size=BATCH, steps=STEPS, optimizer="adamw", **trainer_kwargs)
    options = {"schedule": "1F1B", "num_microbatches": 2}
    rank0, _ = run_distributed(
        fit_pipeline,
        2,
        args=(options, BATCH, STEPS, "adamw", 2, trainer_kwargs),
        init_process_group=False,
        timeout=120,
    )
    assert_weights_close(rank0["weights"], reference, **ADAM_TOLERANCE)
    torch.testing.assert_close(rank0["losses"], reference_losses, rtol=1e-6, atol=1e-6)


def test_each_rank_holds_only_its_stage():
    rank0, rank1 = run_distributed(
        fit_pipeline, 2, args=({"partition": [3]}, BATCH, 1, "adamw"), init_process_group=False, timeout=120
    )
    reference, _ = fit_reference(batch_size=BATCH, steps=1, optimizer="adamw")
    layers = [
        ["model.embedding."],
        ["model.blocks.0."],
        ["model.blocks.1."],
        ["model.norm."],
        ["model.head."],
    ]
    for result, stage_layers in ((rank0, layers[:3]), (rank1, layers[3:])):
        expected = sum(
            t.numel() * t.element_size()
            for k, t in reference.items()
            if any(k.startswith(prefix) for group in stage_layers for prefix in group)
        )
        assert result["param_bytes"] == expected
        # AdamW: exp_avg and exp_avg_sq per parameter (+ a 4-byte float step per parameter tensor).
        num_tensors = len(result["local_keys"])
        assert result["optimizer_bytes"] == 2 * expected + 4 * num_tensors
    assert rank0["param_bytes"] + rank1["param_bytes"] == sum(t.numel() * 4 for t in reference.values())


# ------------------------------------------------------------------ bad input: every rank, no hang
class _NoLayers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).sum()

    def forward(self, x):
        return self.layer(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DictLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return {"hidden": self.linear(x)}


class _DictOutputs(_NoLayers):
    def __init__(self) -> None:
        super().__init__()
        self.first = _DictLayer()
        self.second = torch.nn.Linear(4, 4)
        del self.layer

    def forward(self, x):
        return self.second(self.first(x)["hidden"])

    def pipeline_layers(self):
        return [self.first, self.second]


def _fit_bad(rank: int, world_size: int, module_name: str, strategy_kwargs: dict, batch_size: int) -> None:
    module = {"gpt": tiny_module, "no_layers": _NoLayers, "dict_outputs": _DictOutputs}[module_name]()
    if module_name == "gpt":
        loader = train_loader(batch_size, single_device=False)
    else:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=batch_size)
    trainer = make_trainer(PipelineParallelStrategy(timeout=20, **strategy_kwargs), devices=world_size, max_steps=1)
    trainer.fit(module, train_dataloaders=loader)


@pytest.mark.parametrize(
    ("module_name", "strategy_kwargs", "batch_size", "message"),
    [
        ("gpt", {"schedule": "1F1B", "num_microbatches": 1}, 8, "needs at least as many micro-batches as pipeline"),
        ("gpt", {"num_microbatches": 4}, 6, "batch size 6 is not divisible by `num_microbatches=4`"),
        ("gpt", {"schedule": "LoopedBFS", "stages_per_rank": 3}, 8, "Cannot split 5 pipeline layers into 6 stages"),
        ("gpt", {"pipeline_parallel_size": 3}, 8, "world size (2) is not divisible by `pipeline_parallel_size=3`"),
        ("no_layers", {}, 4, "has no `pipeline_layers()` method"),
        ("dict_outputs", {}, 4, "Pipeline layer 0 (`_DictLayer`) returned a dict"),
    ],
    ids=["microbatches-lt-stages", "indivisible-batch", "more-stages-than-layers", "world-size", "no-layers", "dict"],
)
def test_bad_input_raises_on_every_rank_without_hanging(module_name, strategy_kwargs, batch_size, message):
    with pytest.raises(DistributedTestError) as error:
        run_distributed(
            _fit_bad, 2, args=(module_name, strategy_kwargs, batch_size), init_process_group=False, timeout=60
        )
    text = str(error.value)
    assert "did not finish" not in text
    assert text.count(message) >= 2, text  # both ranks raised it


# ------------------------------------------------------------------ launchers
def _fit_with_fork_launcher(rank: int, world_size: int) -> dict:
    module = tiny_module("sgd")
    trainer = make_trainer("pipeline_notebook", devices=2, max_steps=STEPS)
    trainer.fit(module, train_dataloaders=train_loader(BATCH, single_device=False))
    assert isinstance(trainer.strategy, PipelineParallelStrategy) and trainer.strategy.schedule == "1F1B"
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_fork_registry_name_returns_the_whole_model_to_the_parent():
    reference, _ = fit_reference(batch_size=BATCH, steps=STEPS)
    (weights,) = run_distributed(
        _fit_with_fork_launcher, world_size=1, init_process_group=False, launcher_env=False, timeout=120
    )
    assert_weights_close(weights, reference, **SGD_TOLERANCE)


# ------------------------------------------------------------------ 4 stages, precision
def test_four_stages_on_four_ranks_match_single_device():
    reference, reference_losses = fit_reference(batch_size=BATCH, steps=STEPS, n_layer=4)
    results = run_distributed(
        fit_pipeline, 4, args=({"num_microbatches": 4}, BATCH, STEPS, "sgd", 4), init_process_group=False, timeout=180
    )
    assert_weights_close(results[0]["weights"], reference, **SGD_TOLERANCE)
    assert len({r["starts"] for r in results}) == 1 and len(results[0]["starts"]) == 4
    for result in results:
        torch.testing.assert_close(result["losses"], reference_losses, rtol=1e-6, atol=1e-6)


def test_bf16_mixed_trains_like_single_device_bf16_mixed():
    trainer_kwargs = {"precision": "bf16-mixed"}
    reference, reference_losses = fit_reference(batch_size=BATCH, steps=STEPS, **trainer_kwargs)
    rank0, _ = run_distributed(
        fit_pipeline,
        2,
        args=({"num_microbatches": 4}, BATCH, STEPS, "sgd", 2, trainer_kwargs),
        init_process_group=False,
        timeout=120,
    )
    # bf16 rounds the matmuls of each micro-batch separately: equal to bf16 precision, not fp32.
    assert_weights_close(rank0["weights"], reference, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(rank0["losses"], reference_losses, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ partial last training batch
def _fit_partial(rank: int, world_size: int, num_samples: int) -> dict:
    module = tiny_module("sgd")
    dataset = RandomTokenDataset(num_samples, SEQ_LEN, seed=7)
    strategy = PipelineParallelStrategy(num_microbatches=4, timeout=60)
    trainer = make_trainer(strategy, devices=world_size, max_steps=-1, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=DataLoader(dataset, batch_size=BATCH))
    return {
        "weights": strategy.consolidated_state_dict(),
        "global_step": trainer.global_step,
        "warned": any("skips a last training batch of 6 samples" in str(w.message) for w in caught),
    }


def _fit_partial_reference(rank: int, world_size: int) -> dict:
    module = tiny_module("sgd")
    dataset = RandomTokenDataset(22, SEQ_LEN, seed=7)
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        drop_last=True,
        sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED),
    )
    trainer = make_trainer("auto", devices=1, max_steps=-1, max_epochs=1)
    trainer.fit(module, train_dataloaders=loader)
    return module.state_dict()


def test_a_last_training_batch_that_cannot_be_split_is_skipped_with_a_warning():
    # 22 samples in batches of 8: two full batches and a last one of 6, which 4 micro-batches cannot split.
    rank0, rank1 = run_distributed(_fit_partial, 2, args=(22,), init_process_group=False, timeout=120)
    assert rank0["global_step"] == rank1["global_step"] == 2
    assert rank0["warned"]
    (reference,) = run_distributed(_fit_partial_reference, 1, init_process_group=False, timeout=120)
    assert_weights_close(rank0["weights"], reference, **SGD_TOLERANCE)
