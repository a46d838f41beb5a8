"""Uneven pipeline stages (issue 32, item 3): the first and last stage may hold fewer blocks.

* ``first_stage_fewer_layers`` / ``last_stage_fewer_layers`` (torchtitan's
  ``pipeline_parallel_first_stage_less_layers``): with uniform layers the lightened stage holds exactly that many
  fewer; with every placement (loop, V) and several stages per rank; refused with an explicit list and for bad
  values, naming the value and the fix.
* ``partition="flops"`` (``"compute"`` its older name) and ``"parameters"`` on models whose embedding and head are
  large (the demo GPT and a Hugging Face Llama with tied weights, vocabulary 32k): both count the embedding and the
  head (a tied weight in both stages that hold a copy; the head's projection FLOPs), so the blocks move off their
  stages by themselves; where a rank holds several stages (the V: rank 0 holds the first *and* the last) the ranks
  are balanced, not only the stages.
* The planner's per-rank numbers follow the same stage plan.
* One real 2-rank fit under ``ZBVZeroBubble`` with uneven stages, equal to one device.

Pure planning tests except the fit (one process of 2 gloo ranks and one reference).
"""

from __future__ import annotations

import random

import pytest
import torch
from distributed_harness import run_distributed
from pipeline_helpers import fit_pipeline, fit_reference, tiny_module
from torch import nn
from training_helpers import SEQ_LEN, assert_weights_close
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPT, GPTConfig
from lightning_parallel.distributed.pipeline import UnevenStages, plan_stages
from lightning_parallel.distributed.pipeline.balance import balance_ranks, balanced_boundaries, stage_costs
from lightning_parallel.distributed.pipeline.layer_costs import layer_compute_costs, layer_parameter_costs
from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan, plan_for_example
from lightning_parallel.planner.estimate import OPTIMIZER_STATES, PRECISION_BYTES, EstimateContext, estimate_pipeline
from lightning_parallel.planner.spec import model_spec

BATCH, STEPS = 8, 3
SGD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _sizes(plan: StagePlan) -> list[int]:
    return [len(plan.layers_of(s)) for s in range(plan.num_stages)]


def _rank_sums(plan: StagePlan, costs: list[int] | list[float]) -> list[float]:
    return [
        sum(costs[i] for s in plan.stages_of(r) for i in plan.layers_of(s)) for r in range(plan.pipeline_parallel_size)
    ]


# ------------------------------------------------------------------ the option
@pytest.mark.parametrize(
    ("first", "last", "sizes"),
    [(0, 0, [5, 5]), (2, 0, [4, 6]), (0, 2, [6, 4]), (1, 1, [5, 5]), (4, 0, [3, 7])],
)
def test_with_uniform_layers_the_lightened_stage_holds_that_many_fewer(first, last, sizes):
    uneven = UnevenStages(first_stage_fewer_layers=first, last_stage_fewer_layers=last)
    plan = plan_stages([1.0] * 10, num_stages=2, pipeline_parallel_size=2, uneven=uneven)
    assert _sizes(plan) == sizes


@pytest.mark.parametrize("name", ["first_stage_fewer_layers", "last_stage_fewer_layers"])
def test_more_fewer_layers_than_the_model_has_is_refused(name):
    """Up to the number of layers is planned (10 on 10 layers still leaves each stage a layer); more is a mistake."""
    plan_stages([1.0] * 10, num_stages=2, pipeline_parallel_size=2, uneven=UnevenStages(**{name: 10}))
    with pytest.raises(ValueError, match=f"`{name}=11` is larger than the model's 10 pipeline layers"):
        plan_stages([1.0] * 10, num_stages=2, pipeline_parallel_size=2, uneven=UnevenStages(**{name: 11}))


def test_uniform_blocks_with_an_embedding_and_a_head_as_torchtitan_splits_them():
    """8 blocks, embedding and head of a block's cost each, 4 stages: with one fewer on each end [emb, 1 block], [3],
    [3], [1 block, head] (torchtitan's split with ``input_weight=output_weight=2``); the even split leaves 2 blocks
    beside the head."""
    costs = [1.0] * 10  # [embedding, 8 blocks, head]
    even = plan_stages(costs, num_stages=4, pipeline_parallel_size=4)
    uneven = plan_stages(
        costs,
        num_stages=4,
        pipeline_parallel_size=4,
        uneven=UnevenStages(first_stage_fewer_layers=1, last_stage_fewer_layers=1),
    )
    assert _sizes(even) == [2, 2, 3, 3]
    assert _sizes(uneven) == [2, 3, 3, 2]
    assert stage_costs(costs, uneven.starts, extra_first=1.0, extra_last=1.0) == [3.0, 3.0, 3.0, 3.0]


@pytest.mark.parametrize(("placement", "first_and_last_rank"), [("loop", (0, 1)), ("v", (0, 0))])
def test_several_stages_per_rank_and_the_v_lighten_the_end_stages(placement, first_and_last_rank):
    """16 uniform layers, 2 ranks x 2 stages: the first and last stage hold 2 fewer; in the V both are on rank 0,
    which then holds 4 fewer layers than rank 1, the ranks balanced with the extras counted."""
    uneven = UnevenStages(first_stage_fewer_layers=2, last_stage_fewer_layers=2)
    plan = plan_stages([1.0] * 16, num_stages=4, pipeline_parallel_size=2, placement=placement, uneven=uneven)
    assert (plan.rank_of_stage(0), plan.rank_of_stage(3)) == first_and_last_rank
    sizes = _sizes(plan)
    assert sizes[0] == sizes[1] - 2 and sizes[3] == sizes[2] - 2
    ranks = _rank_sums(plan, [1.0] * 16)
    assert ranks == ([8.0, 8.0] if placement == "loop" else [6.0, 10.0])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"first_stage_fewer_layers": -1}, ValueError, "`first_stage_fewer_layers=-1` must be 0 or more"),
        ({"last_stage_fewer_layers": 1.5}, TypeError, "`last_stage_fewer_layers=1.5` must be an int"),
        ({"first_stage_fewer_layers": True}, TypeError, "`first_stage_fewer_layers=True` must be an int"),
        (
            {"partition": [3], "last_stage_fewer_layers": 2},
            ValueError,
            "`first_stage_fewer_layers=0` / `last_stage_fewer_layers=2` lighten the stages of an automatic partition,"
            " but `partition=[3]` (an explicit list) already fixes every stage. Move the boundaries",
        ),
    ],
)
def test_bad_values_are_refused_at_the_constructor(kwargs, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        PipelineParallelStrategy(**kwargs)


def test_the_strategy_keeps_the_option():
    strategy = PipelineParallelStrategy(partition="parameters", first_stage_fewer_layers=2)
    assert strategy.uneven_stages == UnevenStages(first_stage_fewer_layers=2)
    assert PipelineParallelStrategy().partition == "flops" and PipelineParallelStrategy().uneven_stages.is_even


# ------------------------------------------------------------------ the automatic methods, large embedding and head
def _big_vocab_gpt() -> tuple[list[nn.Module], tuple[tuple[torch.Tensor], dict]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32000, n_layer=4, n_embd=64, n_head=2, block_size=64))
    return model.pipeline_layers(), ((torch.zeros(8, 64, dtype=torch.long),), {})


def _tied_llama_layers() -> list[nn.Module]:
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    holder = nn.Module()
    holder.model = LlamaForCausalLM(config)
    layers, _ = pipeline_layers_and_call(holder)
    return layers


def test_flops_is_compute_and_counts_the_heads_projection():
    layers, example = _big_vocab_gpt()
    flops = layer_compute_costs(layers, *example)
    assert flops[-1] > 30 * flops[1]  # the head's (B, T, C) x (C, V) product: 32k / (12 x 64) ~ 42 blocks' worth
    plans = [
        plan_for_example(layers, example, partition=name, num_stages=2, pipeline_parallel_size=2)
        for name in ("flops", "compute")
    ]
    assert plans[0] == plans[1]
    assert plans[0].starts == (0, len(layers) - 1)  # the head alone on the last stage: every block moves off it


def test_parameters_count_the_embedding_and_the_head_and_balance_memory():
    layers, example = _big_vocab_gpt()
    params = layer_parameter_costs(layers)
    plan = plan_for_example(layers, example, partition="parameters", num_stages=2, pipeline_parallel_size=2)
    assert plan.starts == (0, 3)  # [embedding, 2 blocks] | [2 blocks, norm, head]
    low, high = sorted(_rank_sums(plan, params))
    assert high / low < 1.01  # the whole model's parameters (and so gradients and optimizer state) split evenly


def test_a_tied_weight_counts_on_both_stages_that_hold_a_copy():
    """Llama's declared plan with tied embeddings: the prologue and the epilogue each hold the 32k x 64 weight (each
    stage keeps a copy), so "parameters" balances what each rank really holds."""
    layers = _tied_llama_layers()
    params = layer_parameter_costs(layers)
    embedding = 32000 * 64
    assert params[0] == embedding and params[-1] >= embedding  # the epilogue: the final norm and the tied head
    plan = plan_for_example(layers, None, partition="parameters", num_stages=2, pipeline_parallel_size=2)
    held = [sum(p.numel() for s in plan.stages_of(r) for i in plan.layers_of(s) for p in layers[i].parameters())
            for r in range(2)]  # fmt: skip
    assert held == _rank_sums(plan, params) and max(held) / min(held) < 1.01


@pytest.mark.parametrize("partition", ["flops", "parameters"])
def test_in_the_v_rank_0_holds_the_embedding_and_the_head_and_no_block(partition):
    """The V lays the first and the last stage on rank 0. Balancing stages alone gives rank 0 a block beside the
    embedding and the head; balancing the ranks moves every block to rank 1."""
    layers, example = _big_vocab_gpt()
    plan = plan_for_example(layers, example, partition=partition, num_stages=4, pipeline_parallel_size=2, placement="v")
    assert plan.stages_of(0) == [0, 3]
    assert list(plan.layers_of(0)) == [0] and list(plan.layers_of(3)) == [len(layers) - 1]
    costs = layer_parameter_costs(layers) if partition == "parameters" else layer_compute_costs(layers, *example)
    by_stage = StagePlan(
        starts=tuple(balanced_boundaries(costs, 4)), num_layers=len(layers), pipeline_parallel_size=2, placement="v"
    )
    assert max(_rank_sums(plan, costs)) < max(_rank_sums(by_stage, costs))


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_balancing_the_ranks_never_loads_the_heaviest_rank_more(placement):
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(4, 14)
        costs = [rng.choice([1.0, 1.0, 2.0, 10.0, 40.0]) for _ in range(n)]
        starts = balanced_boundaries(costs, 4)
        plan = StagePlan(starts=tuple(starts), num_layers=n, pipeline_parallel_size=2, placement=placement)
        refined = balance_ranks(costs, starts, rank_of_stage=plan.rank_of_stage, num_ranks=2)
        after = StagePlan(starts=tuple(refined), num_layers=n, pipeline_parallel_size=2, placement=placement)
        assert refined[0] == 0 and all(a < b for a, b in zip(refined, [*refined[1:], n], strict=False))
        assert max(_rank_sums(after, costs)) <= max(_rank_sums(plan, costs))


# ------------------------------------------------------------------ the planner
def _ctx(n_layer: int = 6) -> EstimateContext:
    module = tiny_module("sgd", n_layer)
    element, activation = PRECISION_BYTES["32-true"]
    return EstimateContext(model_spec(module), 2, OPTIMIZER_STATES["sgd"], element, activation, BATCH, SEQ_LEN)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_the_planner_holds_what_the_uneven_plan_holds(schedule):
    ctx = _ctx()
    v = 1 if schedule == "1F1B" else 2
    uneven = UnevenStages(first_stage_fewer_layers=2)
    estimate = estimate_pipeline(
        ctx, pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, stages_per_rank=v, uneven=uneven
    )
    even = estimate_pipeline(ctx, pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, stages_per_rank=v)
    plan = ctx.spec.stage_plan(
        num_stages=2 * v,
        pipeline_parallel_size=2,
        batch_size=BATCH,
        seq_len=SEQ_LEN,
        placement="v" if schedule == "ZBVZeroBubble" else "loop",
        uneven=uneven,
    )
    numels = ctx.spec.layer_numels()
    assert [r.parameters for r in estimate.ranks] == [4 * n for n in _rank_sums(plan, numels)]
    assert [r.parameters for r in estimate.ranks] != [r.parameters for r in even.ranks]
    assert "first_stage_fewer_layers=2, last_stage_fewer_layers=0" in estimate.strategy


# ------------------------------------------------------------------ one real fit
def test_uneven_v_stages_train_like_one_device():
    """ZBVZeroBubble on 2 ranks, 6 blocks, one fewer on the first and the last stage (both on rank 0): the split is
    the planned one (and the planner's), uneven, and the weights are those of one device."""
    options = {
        "schedule": "ZBVZeroBubble",
        "num_microbatches": 4,
        "first_stage_fewer_layers": 1,
        "last_stage_fewer_layers": 1,
    }
    reference, reference_losses = fit_reference(batch_size=BATCH, steps=STEPS, n_layer=6)
    rank0, rank1 = run_distributed(
        fit_pipeline, 2, args=(options, BATCH, STEPS, "sgd", 6), init_process_group=False, timeout=180
    )
    assert_weights_close(rank0["weights"], reference, **SGD_TOLERANCE)
    for result in (rank0, rank1):
        torch.testing.assert_close(result["losses"], reference_losses, rtol=1e-6, atol=1e-6)
    uneven = UnevenStages(first_stage_fewer_layers=1, last_stage_fewer_layers=1)
    planned = _ctx().spec.stage_plan(
        num_stages=4, pipeline_parallel_size=2, batch_size=BATCH, seq_len=SEQ_LEN, placement="v", uneven=uneven
    )
    assert rank0["starts"] == rank1["starts"] == planned.starts
    even = _ctx().spec.stage_plan(
        num_stages=4, pipeline_parallel_size=2, batch_size=BATCH, seq_len=SEQ_LEN, placement="v"
    )
    assert planned.starts != even.starts
    blocks = [sum(1 for i in planned.layers_of(s) if 1 <= i <= 6) for s in range(4)]  # layers: [emb, 6 blocks, ...]
    assert blocks[0] < blocks[1] and blocks[3] < blocks[2], blocks
