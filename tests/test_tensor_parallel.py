"""Tensor parallelism (``tensor_parallel_size``): the ``tensor`` axis of the mesh, the plan from the model, ZeRO-3
over the data axes (torchtitan's TP + FSDP2), equal to one device.

* unit: the mesh layout with the axis innermost; the plan from ``tensor_parallel_plan()``, else Hugging Face's
  ``tp_plan``, else a refusal naming both; style names; sizes that do not divide refused naming them.
* refused before any process group: a head count the tensor size does not divide.
* integration: ``ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2)`` on 2 forked ranks (data 1 x tensor 2)
  trains an own module through its plan and a Hugging Face Llama through its own to one device's weights, AdamW
  moments and logged losses, with gradient clipping on the global norm, Lightning's ``DistributedSampler`` giving
  both tensor ranks the same batch; the consolidated checkpoint loads into a plain module. A 2 x 2 run on 4 processes
  checks the same for Llama with ZeRO-3 sharding over 2 data-parallel ranks.
* ZeRO-1/2 (``stage=1`` or ``2``): the flat buckets hold the split weights' local slices; the same cases (own module,
  Llama, tied Qwen2, bf16 with fp32 masters, a hook reading the gradients, gradient accumulation) at 1 x 2, Llama at
  2 x 2 (hybrid too), and a one-device checkpoint resumed at each stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from model_zoo import trainer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, DistributedSampler
from training_helpers import refusal_before_the_process_group

from lightning_parallel import (
    DataParallelStrategy,
    ParallelismMonitor,
    ShardedOptimizerStrategy,
)
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.tensor_parallel import check_divisible, resolve_plan
from lightning_parallel.fault_tolerance import FaultTolerance

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, HIDDEN, STEPS, GLOBAL_BATCH, LR, CLIP = 64, 8, 32, 3, 4, 1e-3, 0.5
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class Block(nn.Module):
    """Pre-norm attention and MLP; the attention reshapes with ``-1`` heads, so a column split keeps whole heads."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.head_dim = HIDDEN // heads
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        # No key bias: its gradient is exactly zero (softmax ignores a number added to every score of a query), so
        # AdamW would step it by rounding noise divided by noise, differently at every layout.
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh_local, T, hs)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))  # (B, T, nh_local * hs)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class OwnModel(pl.LightningModule):
    """A module of our own that declares its plan; the embedding, norms and head stay whole."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(heads) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.losses: list[float] = []

    def tensor_parallel_plan(self) -> dict[str, Any]:
        return {
            "blocks.*.q": "colwise",
            "blocks.*.k": "colwise",
            "blocks.*.v": ColwiseParallel(),
            "blocks.*.o": "rowwise",
            "blocks.*.up": "colwise",
            "blocks.*.down": RowwiseParallel(),
        }

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def _llama_config(**overrides: Any) -> Any:
    options = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": SEQ,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    return transformers.LlamaConfig(**{**options, **overrides})


class Llama(OwnModel):
    """A Hugging Face Llama with nothing written for tensor parallelism."""

    tensor_parallel_plan = None  # type: ignore[assignment]  # not the hook: the model's own plan

    def __init__(self, **config: Any) -> None:
        pl.LightningModule.__init__(self)
        self.model = transformers.LlamaForCausalLM(_llama_config(**config))
        self.losses = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss


class Qwen2(Llama):
    """A Hugging Face Qwen2 whose LM head is tied to the input embedding: both split on the vocabulary, still tied."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        config = transformers.Qwen2Config(**_llama_config().to_dict())
        config.tie_word_embeddings = True
        self.model = transformers.Qwen2ForCausalLM(config)
        self.losses = []


class GradientReader(Llama):
    """Reads every gradient in ``on_before_optimizer_step``, as a user's hook does: whole plain tensors, as on one
    device (the strategy lends them gathered)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [param.grad for param in self.parameters()]
        assert all(type(grad) is Tensor for grad in grads), {type(grad) for grad in grads}
        self.losses.append(sum(float(grad.norm()) for grad in grads if grad is not None))


MODELS = {
    "own": OwnModel,
    "llama": Llama,
    "qwen2": Qwen2,
    "llama_bf16": Llama,
    "llama_checkpointed": Llama,
    "llama_reads_gradients": GradientReader,
    "llama_hybrid": Llama,
    "llama_accumulated": GradientReader,
}
"""Cases by name: ``*_bf16`` trains with ``precision="bf16-true"`` and fp32 master weights (one device: the strategy at
world size 1, which keeps them too), ``*_checkpointed`` with ``activation_checkpointing=True``, ``*_hybrid`` with
``shard_size=1`` (4 ranks: 2 replicas x 1 shard x 2 tensor ranks, HSDP over the data axes), ``*_accumulated`` with
``accumulate_grad_batches=2``; ``llama_reads_gradients`` and ``llama_accumulated`` log the sum of their gradients'
norms beside each loss."""
BF16_CLOSE = {"rtol": 0.0, "atol": 2**-8}
"""One bf16 step at the weights' scale (below 1): the split layers sum their partial products in another order."""


# ---------------------------------------------------------------------- unit: the mesh
def test_tensor_axis_is_innermost() -> None:
    layout = MeshLayout.for_sharding(8, None, tensor_parallel_size=2)
    assert layout.shape == (1, 4, 1, 2) and layout.data_parallel_size == 4
    assert [layout.coordinates(rank) for rank in (0, 1, 2, 7)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 1, 0, 0),
        (0, 3, 0, 1),
    ]
    assert [layout.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.group_ranks("tensor", 5) == [4, 5] and layout.group_ranks("shard", 5) == [1, 3, 5, 7]
    assert all(layout.global_rank(*layout.coordinates(rank)) == rank for rank in range(8))
    hybrid = MeshLayout(8, shard_size=2, tensor_parallel_size=2)
    assert hybrid.shape == (2, 2, 1, 2) and hybrid.group_ranks("replicate", 1) == [1, 5]
    assert MeshLayout(4).axes == ("replicate", "shard", "pp")  # no tensor axis built without tensor parallelism


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MeshLayout(6, tensor_parallel_size=4), "`tensor_parallel_size=4` does not divide the world size (6)"),
        (lambda: MeshLayout(4, shard_size=4, tensor_parallel_size=2), "does not divide the 2 data-parallel ranks"),
        (lambda: MeshLayout(4, tensor_parallel_size=0), "`tensor_parallel_size=0` is invalid"),
    ],
)
def test_layout_refuses_sizes(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


# ---------------------------------------------------------------------- unit: the plan
def test_plan_from_the_hook() -> None:
    plan = resolve_plan(OwnModel(), owner="S")
    assert sorted(plan.styles) == sorted(f"blocks.{i}.{n}" for i in (0, 1) for n in ("q", "k", "v", "o", "up", "down"))
    assert isinstance(plan.styles["blocks.1.q"], ColwiseParallel)
    assert isinstance(plan.styles["blocks.0.down"], RowwiseParallel)
    assert plan.source == "OwnModel.tensor_parallel_plan()"


def test_plan_from_hugging_face() -> None:
    plan = resolve_plan(Llama(), owner="S")
    assert plan.source == "the Hugging Face tp_plan of 'model'"
    assert isinstance(plan.styles["model.lm_head"], ColwiseParallel)  # colwise_gather_output: logits gathered
    assert isinstance(plan.styles["model.model.embed_tokens"], RowwiseParallel)  # vocabulary-parallel
    assert isinstance(plan.styles["model.model.layers.1.self_attn.o_proj"], RowwiseParallel)
    assert len(plan.styles) == 2 + 2 * 7
    assert dict(plan.head_counts) == {
        "`model.config.num_attention_heads`": 4,
        "`model.config.num_key_value_heads`": 2,
    }


def test_missing_plan_names_both_ways() -> None:
    module = pl.LightningModule()
    module.layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"define `tensor_parallel_plan\(self\)`.*`base_model_tp_plan`"):
        resolve_plan(module, owner="ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2)")


def test_plan_refuses_unknown_names_and_styles() -> None:
    model = OwnModel()
    model.tensor_parallel_plan = lambda: {"blocks.*.qq": "colwise"}  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"names 'blocks\.\*\.qq', which matches no module"):
        resolve_plan(model, owner="S")
    model.tensor_parallel_plan = lambda: {"blocks.*.q": "packed_colwise"}  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="the style 'packed_colwise', which is not supported: use one of"):
        resolve_plan(model, owner="S")


def test_sizes_that_do_not_divide_are_refused() -> None:
    llama = Llama(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(
        ValueError, match=r"`tensor_parallel_size=4` does not divide `model.config.num_key_value_heads` = 2"
    ):
        check_divisible(llama, resolve_plan(llama, owner="S"), 4)
    own = OwnModel()
    own.blocks[0].up = nn.Linear(HIDDEN, 30)
    own.blocks[0].down = nn.Linear(30, HIDDEN)
    with pytest.raises(ValueError, match=r"does not divide the 30 output features of 'blocks\.0\.up'"):
        check_divisible(own, resolve_plan(own, owner="S"), 4)


def test_strategies_refuse_what_does_not_compose() -> None:
    with pytest.raises(
        ValueError, match=r"`DataParallelStrategy` does not split layers.*ShardedOptimizerStrategy\(tensor_parallel"
    ):
        DataParallelStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="fault tolerance across replica groups runs without tensor parallelism"):
        ShardedOptimizerStrategy(
            stage=2, tensor_parallel_size=2, fault_tolerance=FaultTolerance(replica_group=0, num_replica_groups=2)
        )
    with pytest.raises(ValueError, match="checkpoints are written consolidated"):
        ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2, checkpoint_format="sharded")
    assert ShardedOptimizerStrategy(stage=2, tensor_parallel_size=1).tensor_parallel_size == 1


# ---------------------------------------------------------------------- refused before any process group
class Unplanned(OwnModel):
    """No ``tensor_parallel_plan()`` and no Hugging Face model."""

    tensor_parallel_plan = None  # type: ignore[assignment]


REFUSED = {
    "heads": (
        lambda: Llama(num_attention_heads=2, num_key_value_heads=1),
        2,
        "does not divide `model.config.num_key_value_heads` = 1",
    ),
    "no plan": (Unplanned, 2, "define `tensor_parallel_plan(self)`"),
    "world": (OwnModel, 4, "`tensor_parallel_size=4` does not divide the world size (2)"),
}


def _fit_refused(rank: int, world_size: int, case: str) -> str:
    make, tensor, _ = REFUSED[case]
    strategy = ShardedOptimizerStrategy(stage=3, tensor_parallel_size=tensor, start_method="popen")
    return refusal_before_the_process_group(lambda: trainer(strategy, world_size, max_steps=1).fit(make(), _loader(1)))


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_on_every_rank_before_the_process_group(case: str) -> None:
    messages = run_distributed(_fit_refused, 2, args=(case,), init_process_group=False, timeout=60)
    assert all(REFUSED[case][2] in message for message in messages), messages


# ---------------------------------------------------------------------- integration: equal to one device
def _tokens() -> Tensor:
    return torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _loader(replicas: int) -> DataLoader:
    """``replicas`` > 0: Lightning replaces the sampler by its shuffling ``DistributedSampler`` (seed 0) with the
    strategy's data-parallel rank and size, so replica ``r`` reads the samples ``r, r + R, ...`` of each global batch
    of the shuffled order, which together are one device's batch of the same order (``replicas=0``: that one device,
    with the sampler Lightning would give one replica)."""
    data = list(_tokens())
    if replicas == 0:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[arg-type]
        return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)  # type: ignore[arg-type]
    return DataLoader(data, batch_size=GLOBAL_BATCH // replicas, shuffle=False)  # type: ignore[arg-type]


def _fit(name: str, rank: int, world_size: int, tensor: int, directory: str, stage: int = 3) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = MODELS[name]()
    precision = "bf16-true" if name.endswith("_bf16") else "32-true"
    checkpointing = name.endswith("_checkpointed")
    shard_size = 1 if name.endswith("_hybrid") else None
    strategy: Any = ShardedOptimizerStrategy(
        stage=stage, tensor_parallel_size=tensor, shard_size=shard_size, activation_checkpointing=checkpointing
    )
    if world_size == 1:
        strategy = ShardedOptimizerStrategy(stage=3) if precision == "bf16-true" else "auto"
    distributed = world_size > 1
    fit = trainer(
        strategy,
        world_size,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        use_distributed_sampler=distributed,
        precision=precision,
        accumulate_grad_batches=2 if name.endswith("_accumulated") else 1,
    )
    fit.fit(module, _loader(world_size // tensor if world_size > 1 else 0))
    (optimizer,) = fit.optimizers
    result = {
        "weights": {key: value.detach().clone() for key, value in fit.strategy.lightning_module_state_dict().items()},
        "optimizer": fit.strategy.optimizer_state(optimizer),
        "losses": module.losses,
        "sampler": fit.strategy.distributed_sampler_kwargs if world_size > 1 else None,
    }
    if world_size > 1:
        result["split"] = [n for n, p in module.named_parameters() if _split(p)]
        # `full_module()` on every rank, then rank 0 alone calls the model: the split layers whole, no collective.
        with fit.strategy.full_module() as whole, torch.no_grad():
            if rank == 0 and not name.endswith("_bf16"):
                result["rank_zero_logits"] = _logits(whole, _tokens()[:2])
                result["still_split"] = [n for n, p in whole.named_parameters() if isinstance(p, DTensor)]
        result["split_again"] = [n for n, p in module.named_parameters() if _split(p)]
        path = f"{directory}/{name}-{world_size}-{stage}.ckpt"  # rank 0 writes, every rank calls
        fit.save_checkpoint(path)
        result["checkpoint"] = path if rank == 0 else None
        result["tied"] = name == "qwen2" and module.model.lm_head.weight is module.model.model.embed_tokens.weight
    return result


def _split(param: Tensor) -> bool:
    return isinstance(param, DTensor) and "tensor" in (param.device_mesh.mesh_dim_names or ())


def _logits(module: pl.LightningModule, ids: Tensor) -> Tensor:
    return module.model(input_ids=ids).logits if hasattr(module, "model") else module(ids)


def _assert_rank_zero_alone_computes_like_one_device(result: dict[str, Any], name: str, reference: dict) -> None:
    """What rank 0 computed alone inside ``full_module()``: the one-device model's logits (same weights, within the
    training tolerance); no parameter left split inside the block, every one split again after it."""
    plain = MODELS[name]()
    plain.load_state_dict(reference["weights"])
    with torch.no_grad():
        expected = _logits(plain, _tokens()[:2])
    torch.testing.assert_close(result["rank_zero_logits"], expected, **TOLERANCE)
    assert result["still_split"] == []
    assert result["split_again"] == result["split"]


def _in_ranks(rank: int, world_size: int, cases: list[tuple[str, int, int]], directory: str = "") -> dict[str, Any]:
    """Each case ``(name, tensor_parallel_size, stage)`` fitted in turn; results under the name (ZeRO-3) or
    ``name@zero1``/``name@zero2``."""
    return {
        name if stage == 3 else f"{name}@zero{stage}": _fit(name, rank, world_size, tensor, directory, stage)
        for name, tensor, stage in cases
    }


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    cases = [(name, 1, 3) for name in MODELS]
    (result,) = run_distributed(_in_ranks, 1, args=(cases,), init_process_group=False, launcher_env=False, timeout=180)
    return result


def _assert_like_one_device(result: dict[str, Any], reference: dict[str, Any], *, losses: bool = True) -> None:
    assert list(result["weights"]) == list(reference["weights"])  # the single-device numbering
    torch.testing.assert_close(result["weights"], reference["weights"], **TOLERANCE)
    assert result["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
    torch.testing.assert_close(result["optimizer"]["state"], reference["optimizer"]["state"], **TOLERANCE)
    if losses:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-6, atol=1e-6)


def test_one_by_two_trains_like_one_device(references: dict[str, Any], tmp_path: Path) -> None:
    cases = [(name, 2, 3) for name in MODELS if not name.endswith("_hybrid")]
    ranks = run_distributed(_in_ranks, 2, args=(cases, str(tmp_path)), init_process_group=False, timeout=300)
    for name in ("own", "llama", "qwen2", "llama_checkpointed", "llama_reads_gradients", "llama_accumulated"):
        _assert_like_one_device(ranks[0][name], references[name])
        assert ranks[1][name]["losses"] == ranks[0][name]["losses"]  # both tensor ranks read the same batch
        assert [rank[name]["sampler"] for rank in ranks] == [{"num_replicas": 1, "rank": 0}] * 2
    for name in ("own", "llama", "qwen2"):
        _assert_rank_zero_alone_computes_like_one_device(ranks[0][name], name, references[name])
    assert len(ranks[0]["own"]["split"]) == 2 * (6 * 2 - 1)  # weights and biases of the six split layers, no k bias
    assert "model.model.embed_tokens.weight" in ranks[0]["llama"]["split"]
    assert ranks[0]["qwen2"]["tied"]  # one parameter for the embedding and the head after the split
    bf16, expected = ranks[0]["llama_bf16"], references["llama_bf16"]
    assert all(value.dtype == torch.bfloat16 for value in bf16["weights"].values())
    torch.testing.assert_close(bf16["weights"], expected["weights"], **BF16_CLOSE)
    torch.testing.assert_close(bf16["losses"], expected["losses"], rtol=1e-4, atol=0)
    # The consolidated checkpoint loads into the plain module on one device.
    checkpoint = torch.load(ranks[0]["llama"]["checkpoint"], weights_only=False)
    plain = Llama()
    plain.load_state_dict(checkpoint["state_dict"])
    torch.testing.assert_close(plain.state_dict(), references["llama"]["weights"], **TOLERANCE)


@pytest.mark.slow
def test_two_by_two_trains_like_one_device(references: dict[str, Any], tmp_path: Path) -> None:
    # ZeRO-1/2 too: the buckets sharded over the 2 data-parallel ranks (or replicated across 2 groups of 1: hybrid).
    cases = [("llama", 2, 3), ("llama_hybrid", 2, 3), ("llama", 2, 1), ("llama", 2, 2), ("llama_hybrid", 2, 2)]
    ranks = run_distributed(_in_ranks, 4, args=(cases, str(tmp_path)), init_process_group=False, timeout=420)
    for name in ("llama_hybrid", "llama", "llama@zero1", "llama@zero2", "llama_hybrid@zero2"):
        _assert_like_one_device(ranks[0][name], references["llama"], losses=False)
        _assert_rank_zero_alone_computes_like_one_device(ranks[0][name], "llama", references["llama"])
    assert [rank["llama"]["sampler"] for rank in ranks] == [{"num_replicas": 2, "rank": r // 2} for r in range(4)]
    assert ranks[1]["llama"]["losses"] == ranks[0]["llama"]["losses"]  # a tensor-parallel group: one batch
    # Each data-parallel rank's loss is the mean over its half of the batch: their mean is the one device's.
    halves = torch.tensor([ranks[0]["llama"]["losses"], ranks[2]["llama"]["losses"]])
    torch.testing.assert_close(halves.mean(0).tolist(), references["llama"]["losses"], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- resumed at another layout
def _resume(rank: int, world_size: int, directory: str, steps: int, resume: bool) -> dict[int, dict[str, Tensor]]:
    """One device saves after ``STEPS`` (one epoch), or resumes from it; 2 ranks (1 x 2) resume from it too, at each
    ZeRO stage in turn (the results by stage)."""
    results = {}
    for stage in (1, 2, 3) if world_size > 1 else (0,):
        pl.seed_everything(0, verbose=False)
        module = Llama()
        strategy: Any = "auto" if world_size == 1 else ShardedOptimizerStrategy(stage=stage, tensor_parallel_size=2)
        distributed = world_size > 1
        fit = trainer(
            strategy, world_size, max_steps=steps, gradient_clip_val=CLIP, use_distributed_sampler=distributed
        )
        path = f"{directory}/one-device.ckpt"
        fit.fit(module, _loader(1 if world_size > 1 else 0), ckpt_path=path if resume else None)
        if world_size == 1 and steps == STEPS:
            fit.save_checkpoint(path)
        results[stage] = {
            key: value.detach().clone() for key, value in fit.strategy.lightning_module_state_dict().items()
        }
    return results


def test_one_device_checkpoint_resumes_under_tensor_parallelism(tmp_path: Path) -> None:
    def one_device(steps: int, resume: bool) -> dict[str, Tensor]:
        args = (str(tmp_path), steps, resume)
        (weights,) = run_distributed(_resume, 1, args=args, init_process_group=False, launcher_env=False, timeout=120)
        return weights[0]

    one_device(STEPS, False)  # saves its checkpoint after the first epoch
    expected = one_device(2 * STEPS, True)  # Lightning's resume, on one device (weights, AdamW moments, loop state)
    resumed = run_distributed(_resume, 2, args=(str(tmp_path), 2 * STEPS, True), init_process_group=False, timeout=240)
    for stage in (1, 2, 3):  # ZeRO-1/2: the moments cut into each split weight's local slice of the buckets
        torch.testing.assert_close(resumed[0][stage], expected, **TOLERANCE)


def _sharded_then_tensor_parallel(rank: int, world_size: int, directory: str, tensor: int) -> dict[str, Tensor]:
    """``tensor=1``: ZeRO-3 writes a sharded checkpoint after an epoch, resumes it; ``tensor=2``: 1 x 2 resumes it."""
    pl.seed_everything(0, verbose=False)
    path = f"{directory}/sharded"
    if tensor == 1:
        strategy = ShardedOptimizerStrategy(stage=3, checkpoint_format="sharded")
        first = trainer(strategy, world_size, max_steps=STEPS, gradient_clip_val=CLIP, use_distributed_sampler=True)
        first.fit(Llama(), _loader(world_size))
        first.save_checkpoint(path)
    resumed = trainer(
        ShardedOptimizerStrategy(stage=3, tensor_parallel_size=tensor),
        world_size,
        max_steps=2 * STEPS,
        gradient_clip_val=CLIP,
        use_distributed_sampler=True,
    )
    resumed.fit(Llama(), _loader(world_size // tensor), ckpt_path=path)
    return {key: value.detach().clone() for key, value in resumed.strategy.lightning_module_state_dict().items()}


def test_sharded_checkpoint_resumes_under_tensor_parallelism(tmp_path: Path) -> None:
    """A sharded directory (ranges of dim 0 per rank) is read whole under tensor parallelism: the same weights as
    resuming it without."""
    args = (str(tmp_path),)
    (expected, _) = run_distributed(
        _sharded_then_tensor_parallel, 2, args=(*args, 1), init_process_group=False, timeout=180
    )
    (resumed, _) = run_distributed(
        _sharded_then_tensor_parallel, 2, args=(*args, 2), init_process_group=False, timeout=180
    )
    torch.testing.assert_close(resumed, expected, **TOLERANCE)


# ---------------------------------------------------------------------- the monitor counts tensor parallelism's traffic
def _monitored(rank: int, world_size: int) -> dict[str, int]:
    pl.seed_everything(0, verbose=False)
    strategy = ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2)
    monitor = ParallelismMonitor(figure_path=False)
    fit = trainer(strategy, world_size, max_steps=STEPS, use_distributed_sampler=True, callbacks=[monitor])
    fit.fit(OwnModel(), _loader(1))
    return dict(strategy.communication_stats.bytes_by_collective)


def test_monitor_counts_tensor_parallel_all_reduces() -> None:
    """Per step and block of :class:`OwnModel`: forward all-reduces the outputs of the two row splits (``o``,
    ``down``), backward the input gradients of the four column splits (``q``, ``k``, ``v``, ``up``); each an
    activation of ``(B, T, HIDDEN)`` fp32. ZeRO-3 over one data-parallel rank adds no all-reduce."""
    (counted, _) = run_distributed(_monitored, 2, init_process_group=False, timeout=180)
    activation = GLOBAL_BATCH * (SEQ - 1) * HIDDEN * 4
    assert counted["all_reduce"] == STEPS * 2 * (2 + 4) * activation


# ---------------------------------------------------------------------- ZeRO-1/2 over the data axes
ZERO12 = [
    ("own", 1),
    ("own", 2),
    ("llama", 1),
    ("llama", 2),
    ("qwen2", 2),
    ("llama_bf16", 1),
    ("llama_bf16", 2),
    ("llama_reads_gradients", 1),
    ("llama_reads_gradients", 2),
    ("llama_accumulated", 1),
    ("llama_accumulated", 2),
]
"""ZeRO-1/2 with tensor parallelism: the flat buckets hold each split weight's local shard."""


def test_zero12_one_by_two_trains_like_one_device(references: dict[str, Any], tmp_path: Path) -> None:
    cases = [(name, 2, stage) for name, stage in ZERO12]
    ranks = run_distributed(_in_ranks, 2, args=(cases, str(tmp_path)), init_process_group=False, timeout=300)
    for name, stage in ZERO12:
        result, reference = ranks[0][f"{name}@zero{stage}"], references[name]
        if name.endswith("_bf16"):
            assert all(value.dtype == torch.bfloat16 for value in result["weights"].values())
            torch.testing.assert_close(result["weights"], reference["weights"], **BF16_CLOSE)
            torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-4, atol=0)
            continue
        _assert_like_one_device(result, reference)
        _assert_rank_zero_alone_computes_like_one_device(result, name, reference)
        assert ranks[1][f"{name}@zero{stage}"]["losses"] == result["losses"]
    assert ranks[0]["qwen2@zero2"]["tied"]
    checkpoint = torch.load(ranks[0]["llama@zero1"]["checkpoint"], weights_only=False)
    plain = Llama()
    plain.load_state_dict(checkpoint["state_dict"])
    torch.testing.assert_close(plain.state_dict(), references["llama"]["weights"], **TOLERANCE)
