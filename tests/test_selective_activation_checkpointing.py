"""Selective activation checkpointing (``activation_checkpointing="selective"``): torchtitan's per-op policy.

The same training as without checkpointing (one device, and through ZeRO-2 and the pipeline on 2 forked gloo ranks);
the bytes a block keeps measured exactly and equal to the planner's ``"selective"`` count, between full
checkpointing and none; the policy's decisions op by op; bad values refused with the option's messages.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from test_activation_checkpointing import TOLERANCE, _gpt, _train, saved_activation_bytes
from test_activation_checkpointing_strategies import _fit
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
from training_helpers import assert_weights_close

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos.gpt import GPT, MLP, Block, GPTConfig
from lightning_parallel.distributed.activation_checkpointing import (
    _ATTENTION_DROPOUT_INDEX,
    SelectiveCheckpointing,
    _SelectivePolicy,
    apply_activation_checkpointing,
    is_checkpointed,
    validate_activation_checkpointing,
)
from lightning_parallel.planner.activations import activation_bytes

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_selective_trains_like_no_checkpointing(dropout: float) -> None:
    """AdamW steps of the demo GPT (biased Linear layers: ``aten.addmm``); with dropout the masks are redrawn in
    the recomputation from the restored RNG state, as under full checkpointing."""
    reference = _train(_gpt(dropout))
    model = _gpt(dropout)
    assert apply_activation_checkpointing(model, "selective") == ["blocks.0", "blocks.1"]
    assert all(block.forward.selective for block in model.blocks)
    torch.testing.assert_close(_train(model), reference, **TOLERANCE)


@pytest.fixture(scope="module")
def reference() -> dict[int, dict]:
    """Single-device weights without checkpointing, per global batch (ZeRO-2: 8; the 2-stage pipeline: 4)."""
    return {
        batch: run_distributed(_fit, 1, args=(None, False, batch), init_process_group=False, timeout=180)[0][0]
        for batch in (8, 4)
    }


@pytest.mark.parametrize("name", ["zero2", "pipeline"])
def test_selective_through_a_strategy_trains_like_one_device_without_it(name: str, reference: dict) -> None:
    """The tiny GPT without biases (``aten.mm``) through a real Trainer on 2 forked ranks."""
    weights, checkpointed = run_distributed(_fit, 2, args=(name, "selective", 4), init_process_group=False)[0]
    assert checkpointed == 2
    assert_weights_close(weights, reference[4 if name == "pipeline" else 8], **TOLERANCE)


# ---------------------------------------------------------------------------------------------- bytes
class _Created(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.storages += [weakref.ref(t.untyped_storage()) for t in tree_leaves(out) if isinstance(t, Tensor)]
        return out


def held_bytes(block: nn.Module, x: Tensor) -> int:
    """Bytes ``block``'s forward leaves alive for backward, its input included: the distinct storages created during
    the forward that are still alive once it returned, less its output (what the caller holds).

    Exact whatever keeps them: tensors autograd saves, and the outputs selective checkpointing caches (which
    ``saved_tensors_hooks`` never sees: torch's caching mode stores them itself). Autocast's cache of weight copies
    is emptied first, as leaving the autocast region does after a real forward.
    """
    with _Created() as created:
        y = block(x)
    torch.clear_autocast_cache()  # autocast's 16-bit weight copies: kept for backward only where autograd saved them
    gc.collect()
    alive = {s.data_ptr(): s.nbytes() for ref in created.storages if (s := ref()) is not None}
    for tensor in (y, *block.parameters()):  # the output, and the parameters' storages behind views such as `w.t()`
        alive.pop(tensor.untyped_storage().data_ptr(), None)
    held = sum(alive.values()) + x.untyped_storage().nbytes()
    y.sum().backward()  # the graph was usable: what was held was what backward needed
    return held


B, T, H = 4, 64, 64


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_selective_block_holds_what_the_planner_counts(precision: str) -> None:
    """One demo GPT block (n_embd 64, 2 heads, biased ``addmm``, torch's fused CPU attention) on 4 x 64 tokens.

    Kept under selective: the input (4 B per element), the outputs of the 1st and 3rd product (``qkv``, ``3 h``
    wide, and the MLP's first, ``4 h``), the attention output (``h``) and its fp32 log-sum-exp (one per head): per
    token ``4 h + c (3 h + 4 h + h) + 4 * 2``, 2,312 bytes in fp32 (c = 4), 1,288 under bf16 autocast (c = 2). The
    same measurement gives the planner's count for no checkpointing (and ``saved_tensors_hooks``' bytes) and for
    full checkpointing (the input alone): selective lies between them.
    """
    torch.manual_seed(0)
    block = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=H, block_size=T)).blocks[0]
    x = torch.randn(B, T, H, requires_grad=True)
    compute = 2 if precision == "bf16-mixed" else 4
    shape = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=H, block_size=T)).transformer_shape()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        plain = held_bytes(block, x)
        hooked = saved_activation_bytes(block, lambda: block(x).sum())  # the input included: LayerNorm saves it
        apply_activation_checkpointing(nn.Sequential(block), {Block})
        full = held_bytes(block, x)
        apply_activation_checkpointing(nn.Sequential(block), SelectiveCheckpointing(blocks={Block}))
        selective = held_bytes(block, x)

    def predicted(mode: str) -> int:
        common = {"seq_len": T, "samples": B, "blocks": 1, "stream_bytes": 4, "compute_bytes": compute}
        return activation_bytes(shape, **common, checkpointing=mode, with_embedding=False, with_head=False).saved

    assert (plain, full, selective) == (predicted("none"), predicted("full"), predicted("selective"))
    # Under autocast the forward also keeps the block's 16-bit weight copies (counted per block, not per token).
    assert plain == hooked
    assert full < selective < plain
    assert selective == B * T * (4 * H + compute * 8 * H + 4 * 2)
    assert selective == {"32-true": 591_872, "bf16-mixed": 329_728}[precision]


def test_two_forwards_in_one_autocast_region() -> None:
    """A pipeline stage runs several micro-batches' forwards inside one autocast region: the second finds the
    weights' 16-bit copies in autocast's cache. The recomputation must run the forward's ops (torch's replaying mode
    refuses others), so the checkpointed forward casts its weights itself. The gradients equal those without
    checkpointing with autocast's cache off (with it on, the two micro-batches share one 16-bit copy per weight,
    whose gradient sums them in bf16 before the cast back: other roundings)."""
    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=16, n_head=2))
    xs = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def grads(cache_enabled: bool = True) -> list[Tensor]:
        block.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
            outputs = [block(x) for x in xs]
        sum(out.float().square().sum() for out in outputs).backward()
        return [p.grad.clone() for p in block.parameters()]

    plain = grads(cache_enabled=False)
    apply_activation_checkpointing(nn.Sequential(block), SelectiveCheckpointing(blocks={Block}))
    torch.testing.assert_close(grads(), plain, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- the policy
def _decisions(model: nn.Module, x: Tensor) -> list[tuple[str, str]]:
    """The (op, policy) pairs of the ops one forward of ``model`` asks the selective policy about, in order."""
    policy, asked = _SelectivePolicy(), []

    class _Ask(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            decision = policy(SelectiveCheckpointContext(is_recompute=False), func, *args, **(kwargs or {}))
            asked.append((func.__name__, decision.name))
            return func(*args, **(kwargs or {}))

    with _Ask():
        model(x)
    return [(op, decision) for op, decision in asked if op.split(".")[0] in {"mm", "addmm"} or "attention" in op]


def test_the_policy_keeps_every_other_product_and_the_attention() -> None:
    """GPT's block: qkv (kept), attention (kept), c_proj (recomputed), c_fc (kept), MLP c_proj (recomputed); without
    biases the same products run as ``aten.mm``. The count starts again for each policy (each checkpointed call)."""
    save, recompute = CheckpointPolicy.MUST_SAVE.name, CheckpointPolicy.PREFER_RECOMPUTE.name
    for bias, op in ((True, "addmm.default"), (False, "mm.default")):
        block = Block(GPTConfig(n_embd=16, n_head=2, bias=bias))
        assert _decisions(block, torch.randn(2, 8, 16)) == [
            (op, save),
            ("_scaled_dot_product_flash_attention_for_cpu.default", save),
            (op, recompute),
            (op, save),
            (op, recompute),
        ]


def test_attention_with_dropout_is_recomputed() -> None:
    """A fused kernel with dropout draws its mask from the RNG: cached, it would not draw again in the
    recomputation and every later dropout of the block would get another mask. The positions of ``dropout_p`` the
    policy reads are those of torch's schemas."""
    for op, index in _ATTENTION_DROPOUT_INDEX.items():
        assert op._schema.arguments[index].name == "dropout_p"
    policy = _SelectivePolicy()
    q = torch.randn(1, 2, 4, 8)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    forward = SelectiveCheckpointContext(is_recompute=False)
    assert policy(forward, efficient, q, q, q, None, True, 0.1) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(forward, efficient, q, q, q, None, True, 0.0) is CheckpointPolicy.MUST_SAVE
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert policy(forward, flash, q, q, q, dropout_p=0.1) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(forward, flash, q, q, q) is CheckpointPolicy.MUST_SAVE


# ---------------------------------------------------------------------------------------------- the option
def test_values_and_modes() -> None:
    assert validate_activation_checkpointing("selective") == SelectiveCheckpointing()
    assert validate_activation_checkpointing(SelectiveCheckpointing(blocks={Block})).blocks == frozenset({Block})
    model = _gpt()
    assert apply_activation_checkpointing(model, SelectiveCheckpointing(blocks={MLP})) == [
        "blocks.0.mlp",
        "blocks.1.mlp",
    ]
    wrapper = model.blocks[0].mlp.forward
    apply_activation_checkpointing(model, {MLP})  # applied again: the same wrapper, whole-block now
    assert model.blocks[0].mlp.forward is wrapper and not wrapper.selective
    for strategy in (
        DataParallelStrategy(activation_checkpointing="selective"),
        ShardedOptimizerStrategy(2, activation_checkpointing="selective"),
        PipelineParallelStrategy(activation_checkpointing=SelectiveCheckpointing(blocks={Block})),
    ):
        assert strategy.activation_checkpointing in ("selective", SelectiveCheckpointing(blocks={Block}))


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.ReLU()


INVALID = {
    # name: (value, model or None for the model-free check, error type, message fragment)
    "other string": ("op", None, TypeError, "`activation_checkpointing='op'` must be True"),
    "planner's full": ("full", None, TypeError, "(the planner's 'full' is `True`)"),
    "planner's none": ("none", None, TypeError, "(the planner's 'none' is `False`)"),
    "empty blocks": (lambda: SelectiveCheckpointing(blocks=set()), None, ValueError, "Pass `blocks=None` for every"),
    "string in blocks": (
        lambda: SelectiveCheckpointing(blocks={"Block"}),
        None,
        TypeError,
        "`SelectiveCheckpointing(blocks=...)` holds 'Block', which is not",
    ),
    "list as blocks": (lambda: SelectiveCheckpointing(blocks=[Block]), None, TypeError, "pass a set of nn.Module"),
    "no blocks": ("selective", _NoBlocks, ValueError, "`activation_checkpointing='selective'` found no blocks in"),
    "class not in model": (
        SelectiveCheckpointing(blocks={MLP}),
        _NoBlocks,
        ValueError,
        "names MLP, of which `_NoBlocks` holds no",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_values_name_the_value_and_the_fix(case: str) -> None:
    value, model, error, match = INVALID[case]
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        value = value() if callable(value) and not isinstance(value, type) else value
        if model is None:
            validate_activation_checkpointing(value)
        else:
            apply_activation_checkpointing(model(), value)
    if model is not None:
        assert not any(is_checkpointed(m) for m in model().modules())


def test_a_strategy_refuses_a_bad_value_when_built() -> None:
    with pytest.raises(TypeError, match="`activation_checkpointing='Selective'` must be True"):
        ShardedOptimizerStrategy(2, activation_checkpointing="Selective")  # type: ignore[arg-type]
