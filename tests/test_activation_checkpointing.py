"""Activation checkpointing (lightning_parallel.distributed.activation_checkpointing): the same training as without
it, the same names and state-dict keys, fewer bytes saved for backward (counted exactly through
``saved_tensors_hooks``), the option's validation, and its composition with ZeRO-3's FSDP2 units and pipeline stages
(the module checkpointed before the strategy's set-up, as the strategies' ``activation_checkpointing`` option does)."""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler
from training_helpers import SEED, SEQ_LEN, make_module, make_trainer

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import RandomTokenDataset
from lightning_parallel.demos.gpt import GPT, MLP, Block, GPTConfig
from lightning_parallel.demos.module import next_token_loss
from lightning_parallel.distributed.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_modules,
    is_checkpointed,
    validate_activation_checkpointing,
)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _gpt(dropout: float = 0.0, *, block_size: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=block_size, dropout=dropout))


def _train(model: nn.Module, *, steps: int = 3, batch: int = 4, seq: int = 32) -> dict[str, Tensor]:
    """AdamW steps on seeded tokens (dropout draws from the global RNG, seeded the same for every run)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=generator)
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_weights_equal_training_without_checkpointing(dropout: float) -> None:
    reference = _train(_gpt(dropout))
    model = _gpt(dropout)
    assert apply_activation_checkpointing(model, True) == ["blocks.0", "blocks.1"]
    trained = _train(model)
    assert trained.keys() == reference.keys()
    torch.testing.assert_close(trained, reference, **TOLERANCE)
    if dropout:  # the comparison can fail: dropout changes training, so equal weights need the same masks
        with pytest.raises(AssertionError):
            torch.testing.assert_close(trained, _train(_gpt(0.0)), **TOLERANCE)


def test_dropout_masks_are_replayed_in_backward() -> None:
    """The recomputation draws the dropout mask the forward drew (non-reentrant checkpoint restores the RNG state);
    without that restore the gradients differ, which is what this test would catch."""
    block = Block(GPTConfig(n_embd=32, n_head=2, dropout=0.5))
    x = torch.randn(2, 8, 32, requires_grad=True)

    def grads(run: Any) -> list[Tensor]:
        torch.manual_seed(5)
        block.zero_grad()
        x.grad = None
        run(x).square().sum().backward()
        return [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]

    plain = grads(Block.forward.__get__(block))
    apply_activation_checkpointing(nn.Sequential(block, copy.deepcopy(block)), {Block})
    assert is_checkpointed(block)
    torch.testing.assert_close(grads(block), plain, rtol=0, atol=0)
    unpreserved = grads(lambda t: checkpoint(Block.forward, block, t, use_reentrant=False, preserve_rng_state=False))
    assert any(not torch.equal(a, b) for a, b in zip(unpreserved, plain, strict=True))


class _NormBlock(nn.Module):
    """A residual block with BatchNorm: its running statistics are buffers the forward updates."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


def test_batchnorm_statistics_are_updated_once_per_forward() -> None:
    """torch's checkpoint alone runs the block's forward again in backward, which would update BatchNorm's running
    statistics (and `num_batches_tracked`) twice per step: a silently different model."""
    torch.manual_seed(0)
    plain = nn.Sequential(_NormBlock(), _NormBlock())
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, True) == ["0", "1"]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, checkpointed)]
    for step in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip((plain, checkpointed), optimizers, strict=True):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert int(checkpointed[0].norm.num_batches_tracked) == 3
    torch.testing.assert_close(checkpointed.state_dict(), plain.state_dict(), **TOLERANCE)


def test_lightning_fit_equals_without_checkpointing() -> None:
    """A single-device Trainer run of the demo GPTLightningModule, checkpointed through the LightningModule."""

    def fit(policy: Any) -> dict[str, Tensor]:
        module = make_module()
        assert apply_activation_checkpointing(module, policy) == (
            ["model.blocks.0", "model.blocks.1"] if policy else []
        )
        make_trainer("auto", devices=1, max_steps=3).fit(module, train_dataloaders=_loader(1))
        return {name: t.detach().clone() for name, t in module.state_dict().items()}

    torch.testing.assert_close(fit(True), fit(False), **TOLERANCE)


# ---------------------------------------------------------------------------------------------- names and keys
def test_names_keys_unchanged_and_idempotent() -> None:
    model = _gpt()
    keys = list(model.state_dict())
    parameters = [name for name, _ in model.named_parameters()]
    modules = [name for name, _ in model.named_modules()]
    names = apply_activation_checkpointing(model, True)
    wrapped = [model.blocks[0].forward, model.blocks[1].forward]
    assert apply_activation_checkpointing(model, True) == names  # applied twice: not wrapped twice
    assert apply_activation_checkpointing(model, {Block}) == names
    assert [model.blocks[0].forward, model.blocks[1].forward] == wrapped
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model.named_parameters()] == parameters
    assert [name for name, _ in model.named_modules()] == modules
    # A checkpoint of the wrapped model loads into a plain one and back (strict).
    _gpt().load_state_dict(model.state_dict())
    model.load_state_dict(_gpt().state_dict())
    # Copies (deepcopy, pickle) stay checkpointed, each wrapper calling its own copy.
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(is_checkpointed(block) for block in clone.blocks)
        assert clone.blocks[0].forward.module is clone.blocks[0]
        torch.testing.assert_close(_train(clone, steps=1), _train(copy.deepcopy(model), steps=1), rtol=0, atol=0)


def test_nested_classes_checkpoint_the_outermost() -> None:
    model = _gpt()
    assert apply_activation_checkpointing(model, {Block, MLP}) == ["blocks.0", "blocks.1"]
    assert not is_checkpointed(model.blocks[0].mlp)
    assert [m.__class__ for m in checkpointed_modules(_gpt(), {MLP})] == [MLP, MLP]
    assert checkpointed_modules(model, False) == []


# ---------------------------------------------------------------------------------------------- bytes
def saved_activation_bytes(model: nn.Module, run: Any) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` runs, parameters excluded.

    Every saved tensor passes the pack hook; tensors saved inside a checkpointed region go to the checkpoint's own
    (inner) hook instead and are dropped, while the region's inputs are saved through ours. A storage saved by several
    ops is counted once (keyed by its address: every saved storage stays alive until backward, so none is reused).
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    output.backward()
    return sum(seen.values())


BATCH, SEQ = 4, 256


def measure_gpt_saved_bytes() -> dict[str, int]:
    """Saved-for-backward bytes of the demo GPT (2 blocks, n_embd 64, 2 heads, vocabulary 256, fp32) on a
    ``BATCH x SEQ`` batch with the loss: without and with checkpointing, and of one block alone (its input counted)."""
    model = _gpt(block_size=SEQ)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step(m: nn.Module) -> Any:
        return lambda: next_token_loss(m(inputs), targets)

    without = saved_activation_bytes(model, step(model))
    block_input = model.embedding(inputs).detach().requires_grad_()
    one_block = saved_activation_bytes(model.blocks[0], lambda: model.blocks[0](block_input).sum())
    apply_activation_checkpointing(model, True)
    with_checkpointing = saved_activation_bytes(model, step(model))
    return {"without": without, "with": with_checkpointing, "one_block": one_block}


def test_saved_activation_bytes_fall_to_the_block_inputs() -> None:
    measured = measure_gpt_saved_bytes()
    num_layers, input_bytes = 2, BATCH * SEQ * 64 * 4  # each block's input: (B, T, C) fp32
    # Exact: every block's saved tensors are replaced by its input, the rest of the graph saves what it saved.
    assert measured["with"] == measured["without"] - num_layers * (measured["one_block"] - input_bytes)
    # The figures (1,024 tokens): 10,037,284 B without (9,802 per token), 2,123,812 B with (2,074 per token); the
    # targets are a view of the (B, T + 1) token tensor, whose 8,224 bytes nll_loss keeps.
    assert measured == {"without": 10_037_284, "with": 2_123_812, "one_block": 4_218_880}


# ---------------------------------------------------------------------------------------------- validation
class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.ReLU()


INVALID = {
    # name: (value, model or None for the model-free check, error type, message fragment)
    "int": (1, None, TypeError, "activation_checkpointing=1"),
    "list": ([Block], None, TypeError, "set of nn.Module classes"),
    "string in set": ({"Block"}, None, TypeError, "'Block', which is not"),
    "instance in set": ({nn.Linear(1, 1)}, None, TypeError, "Pass the classes themselves"),
    "non-module class": ({int}, None, TypeError, "<class 'int'>"),
    "empty set": (set(), None, ValueError, "Pass `False` to turn it off"),
    "no blocks": (True, _NoBlocks, ValueError, "found no blocks in `_NoBlocks`"),
    "class not in model": ({MLP, nn.Linear}, _NoBlocks, ValueError, "names MLP, of which `_NoBlocks` holds no"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_values_name_the_value_and_the_fix(case: str) -> None:
    value, model, error, match = INVALID[case]
    with pytest.raises(error, match=match.replace("(", r"\(").replace("[", r"\[")):
        if model is None:
            validate_activation_checkpointing(value)
        else:
            apply_activation_checkpointing(model(), value)
    if model is not None:  # nothing was wrapped before the error
        assert not any(is_checkpointed(m) for m in model().modules())


def test_valid_values() -> None:
    assert validate_activation_checkpointing(False) is False
    assert validate_activation_checkpointing(True) is True
    assert validate_activation_checkpointing({Block}) == frozenset({Block})


# ---------------------------------------------------------------------------------------------- composition
def _loader(devices: int, per_device_batch: int = 4) -> DataLoader:
    """As training_helpers.fit_tiny: at one device the permutation Lightning's DistributedSampler uses, explicitly."""
    dataset = RandomTokenDataset(96, SEQ_LEN, seed=7)
    if devices == 1:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(dataset, batch_size=per_device_batch, sampler=sampler)
    return DataLoader(dataset, batch_size=per_device_batch, shuffle=False)


COMPOSED = {
    # name: (strategy, per-device batch): global batch 8 like the single-device reference (the pipeline's replica
    # takes the whole batch)
    "zero3": (lambda: "zero3_notebook", 4),
    "pipeline_1f1b": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, start_method="fork"), 8),
    # Backward split into input and weight gradients (two passes over each stage's graph).
    "pipeline_zero_bubble": (
        lambda: PipelineParallelStrategy(
            pipeline_parallel_size=2, schedule="InterleavedZeroBubble", num_microbatches=4, start_method="fork"
        ),
        8,
    ),
}


def _fit_composed(rank: int, world_size: int, case: str | None) -> dict[str, Tensor]:
    """In an isolated process: fit on 2 fork-launched ranks with every block checkpointed before the strategy's
    set-up (before fully_shard / the split), or (``case=None``) on one device without checkpointing."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    module = make_module()
    if case is None:
        make_trainer("auto", devices=1, max_steps=3).fit(module, train_dataloaders=_loader(1, 8))
        return {name: t.detach().clone() for name, t in module.state_dict().items()}
    strategy, per_device_batch = COMPOSED[case]
    apply_activation_checkpointing(module, True)
    trainer = make_trainer(strategy(), devices=2, max_steps=3)
    trainer.fit(module, train_dataloaders=_loader(2, per_device_batch))
    state = module.state_dict() if trainer.strategy.launcher.is_interactive_compatible else None
    if state is None:
        state = trainer.strategy.lightning_module_state_dict()
    return {name: t.detach().clone() for name, t in state.items()}


@pytest.mark.slow
def test_composes_with_zero3_units_and_pipeline_stages() -> None:
    """Checkpointed blocks under ZeRO-3 (FSDP2 units applied after the wrap) and a 2-stage 1F1B pipeline train
    like one device without checkpointing."""
    (reference,) = run_distributed(_fit_composed, 1, args=(None,), init_process_group=False, launcher_env=False)
    for case in COMPOSED:
        (state,) = run_distributed(
            _fit_composed, 1, args=(case,), init_process_group=False, launcher_env=False, timeout=180
        )
        assert state.keys() == reference.keys(), case
        torch.testing.assert_close(state, reference, **TOLERANCE, msg=lambda m, case=case: f"{case}: {m}")
