"""Models users bring: real Hugging Face models (tiny random configs, nothing downloaded) and Lightning's demo
``Transformer`` (``nn.Transformer``), held by a LightningModule whose ``training_step`` is written as Hugging Face
users write it (``self.model(input_ids=ids, attention_mask=mask, labels=ids).loss``, with left padding).

* Data parallel and ZeRO 1/2/3, with and without ``activation_checkpointing=True``, train like one device on the
  same global batches (AdamW with weight decay, gradient clipping): the same weights and AdamW moments.
* ZeRO-3's FSDP2 units are the blocks the model declares in ``_no_split_modules`` (``GPT2Block``,
  ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``), plus the rest of the model and the root; the demo Transformer
  declares nothing, so its repeated encoder and decoder layers are its blocks. Activation checkpointing recomputes
  exactly those blocks.
* A checkpointed Hugging Face block runs without its key/value cache, as Hugging Face's own gradient checkpointing
  does: with a padding mask, recomputing a block that writes its cache again failed with a shape error.

Every distributed case runs inside one pair of forked ranks (one Trainer per case), the references in one isolated
process, to keep the file fast.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.demos.transformer import Transformer
from model_zoo import trainer
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.distributed.activation_checkpointing import apply_activation_checkpointing, is_checkpointed
from lightning_parallel.distributed.blocks import find_blocks

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, HIDDEN, LAYERS = 64, 16, 32, 2
STEPS, GLOBAL_BATCH = 3, 4
LR = 1e-3
CLIP = 0.5  # below these models' gradient norms (1.1 to 2.9 in these steps): clipping scales every step
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
WEIGHT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
"""1% of one AdamW step: AdamW divides each gradient by its own running RMS, so an element whose gradient is ~0 takes
a step set by rounding noise (measured: one element of GPT-2's ``mlp.c_fc.weight`` off by 2.5e-6, one of the demo
Transformer's ``linear2.weight`` by 1.03e-6, all else within ``TOLERANCE``, AdamW moments included)."""


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=2, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_decoder_config()))


def _qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_decoder_config(), tie_word_embeddings=True))


def _decoder_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": SEQ,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def _demo_transformer() -> nn.Module:
    return Transformer(vocab_size=VOCAB, ninp=HIDDEN, nhead=2, nhid=2 * HIDDEN, nlayers=LAYERS, dropout=0.0)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "qwen2": _qwen2,
    "demo_transformer": _demo_transformer,
}
BLOCKS = {
    # model: the qualified names (in the LightningModule) of its blocks
    "gpt2": [f"model.transformer.h.{i}" for i in range(LAYERS)],
    "llama": [f"model.model.layers.{i}" for i in range(LAYERS)],
    "qwen2": [f"model.model.layers.{i}" for i in range(LAYERS)],
    "demo_transformer": [f"model.transformer.{part}.layers.{i}" for part in ("encoder", "decoder") for i in range(2)],
}


class CausalLM(pl.LightningModule):
    """The LightningModule a Hugging Face user writes around a model."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.model = MODELS[name]()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids = batch["input_ids"]
        if self.name == "demo_transformer":  # as Lightning's LightningTransformer demo trains it
            inputs, target = ids[:, :-1], ids[:, 1:]
            return nn.functional.nll_loss(self.model(inputs, target), target.reshape(-1))
        return self.model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def _loader(replicas: int, replica: int) -> DataLoader:
    """Step k's global batch is samples ``[k*B, (k+1)*B)``; replica r takes its r-th contiguous slice of it (the
    trainer runs without Lightning's shuffling DistributedSampler, so one device sees the same samples in order)."""
    tokens = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    per_replica = GLOBAL_BATCH // replicas
    indices = [k * GLOBAL_BATCH + replica * per_replica + i for k in range(STEPS) for i in range(per_replica)]
    masks = (torch.arange(SEQ) >= (torch.arange(len(tokens)) % 4)[:, None]).long()  # 0-3 left padding tokens
    samples = [{"input_ids": tokens[i], "attention_mask": masks[i]} for i in indices]
    return DataLoader(samples, batch_size=per_replica, shuffle=False)  # type: ignore[arg-type]


def _strategy(name: str, checkpointing: bool) -> Any:
    if name == "auto":
        return "auto"
    if name == "data_parallel":
        return DataParallelStrategy(activation_checkpointing=checkpointing)
    return ShardedOptimizerStrategy(stage=int(name[-1]), activation_checkpointing=checkpointing)  # type: ignore[arg-type]


def _fit(model: str, strategy: str, checkpointing: bool, world_size: int, rank: int) -> dict[str, Any]:
    """Collective: fit, then the consolidated weights and optimizer state (complete on rank 0), the FSDP2 units
    and the checkpointed modules."""
    pl.seed_everything(0, verbose=False)
    module = CausalLM(model)
    fit_trainer = trainer(_strategy(strategy, checkpointing), world_size, max_steps=STEPS, gradient_clip_val=CLIP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache warning of checkpointed HF blocks, once per rank and class
        fit_trainer.fit(module, _loader(world_size, rank))
    weights = fit_trainer.strategy.lightning_module_state_dict()
    (optimizer,) = fit_trainer.optimizers
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in weights.items()},
        "optimizer": fit_trainer.strategy.optimizer_state(optimizer),
        "parameter_names": [name for name, _ in module.named_parameters()],  # the optimizer's indices
        "units": [name for name, m in module.named_modules() if isinstance(m, FSDPModule)],
        "checkpointed": [name for name, m in module.named_modules() if is_checkpointed(m)],
        "blocks_after_fit": [name for name, m in module.named_modules() if any(m is b for b in find_blocks(module))],
    }


CASES = [
    *((model, strategy, False) for model in MODELS for strategy in ("data_parallel", "zero1", "zero2", "zero3")),
    *((model, "zero3", True) for model in MODELS),
    ("gpt2", "data_parallel", True),
    ("llama", "zero2", True),
    ("qwen2", "zero1", True),
    ("demo_transformer", "data_parallel", True),
]


def _in_ranks(rank: int, world_size: int, cases: list[tuple[str, str, bool]]) -> dict[tuple[str, str, bool], Any]:
    return {case: _fit(*case, world_size, rank) for case in cases}


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    """One device, without checkpointing, per model (in an isolated process: Lightning leaves a seed behind)."""
    cases = [(model, "auto", False) for model in MODELS]
    (result,) = run_distributed(_in_ranks, 1, args=(cases,), init_process_group=False, launcher_env=False, timeout=180)
    return {model: result[(model, "auto", False)] for model in MODELS}


@pytest.fixture(scope="module")
def ranks() -> list[dict[tuple[str, str, bool], Any]]:
    return run_distributed(_in_ranks, 2, args=(CASES,), init_process_group=False, timeout=300)


def _case_id(case: tuple[str, str, bool]) -> str:
    model, strategy, checkpointing = case
    return f"{model}-{strategy}{'-checkpointed' if checkpointing else ''}"


def _key_biases(name: str) -> slice | None:
    """The elements of an attention's key bias: their gradient is exactly zero (softmax is invariant to adding one
    number to every score of a query, which is what a key bias adds), so AdamW steps them by rounding noise divided
    by noise (up to ``lr`` per step, not zero), and their values depend on the order of summation alone."""
    # GPT-2's fused QKV bias, nn.MultiheadAttention's; not Qwen2's `k_proj.bias`, which RoPE rotates by position.
    return slice(HIDDEN, 2 * HIDDEN) if name.endswith(("attn.c_attn.bias", "in_proj_bias")) else None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_trains_like_one_device(case: tuple[str, str, bool], ranks: list[dict], references: dict) -> None:
    model = case[0]
    result, reference = ranks[0][case], references[model]
    assert list(result["weights"]) == list(reference["weights"])  # the model's own names, tied names included
    weights = dict(result["weights"])
    state = reference["optimizer"]["state"]
    exp_avg = {name: state[index]["exp_avg"] for index, name in enumerate(reference["parameter_names"])}
    for name, elements in ((n, _key_biases(n)) for n in reference["weights"]):
        if elements is not None:  # rounding noise only (checked), within AdamW's largest steps; then left out
            assert exp_avg[name][elements].abs().max() < 1e-7, name
            torch.testing.assert_close(
                weights[name][elements], reference["weights"][name][elements], rtol=0, atol=STEPS * LR
            )
            weights[name] = weights[name].clone()
            weights[name][elements] = reference["weights"][name][elements]
    torch.testing.assert_close(weights, reference["weights"], **WEIGHT_TOLERANCE)
    optimizer, expected = result["optimizer"], reference["optimizer"]
    assert optimizer["param_groups"] == expected["param_groups"]
    assert optimizer["state"].keys() == expected["state"].keys()
    torch.testing.assert_close(optimizer["state"], expected["state"], **TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_units_and_checkpointed_modules_are_the_blocks(case: tuple[str, str, bool], ranks: list[dict]) -> None:
    model, strategy, checkpointing = case
    blocks = BLOCKS[model]
    for result in ranks:
        # ZeRO-3 (in module order): the LightningModule as the root, the rest of the network (embeddings, final
        # norm, head; tied weights stay in one unit), one unit per block.
        assert result[case]["units"] == (["", "model", *blocks] if strategy == "zero3" else [])
        assert result[case]["checkpointed"] == (blocks if checkpointing else [])
        # A second fit or validate of the module finds the same blocks (FSDP2 swapped their classes).
        assert result[case]["blocks_after_fit"] == blocks


@pytest.mark.parametrize("model", list(MODELS))
def test_blocks_are_the_declared_classes(model: str) -> None:
    """The blocks are the instances of the classes the model declares, nothing else; the demo Transformer declares
    nothing, so its repeated layers are taken."""
    module = CausalLM(model)
    blocks = find_blocks(module)
    assert [name for name, m in module.named_modules() if any(m is b for b in blocks)] == BLOCKS[model]
    declared = getattr(module.model, "_no_split_modules", None)
    classes = {type(block).__name__ for block in blocks}
    assert classes == (
        set(declared) if model != "demo_transformer" else {"TransformerEncoderLayer", "TransformerDecoderLayer"}
    )


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_checkpointed_blocks_run_without_their_cache(model: str) -> None:
    """With a padding mask, a recomputed block that wrote its key/value cache again attended to both writes (a
    shape error). GPT-2 passes the cache by position, Llama by keyword; both run without it, as Hugging Face's
    gradient checkpointing does, and the gradients equal those without checkpointing bit for bit."""
    torch.manual_seed(0)
    plain = MODELS[model]()
    checkpointed = copy.deepcopy(plain)
    assert len(apply_activation_checkpointing(checkpointed, True)) == LAYERS
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    plain(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    with pytest.warns(UserWarning, match="runs without its key/value cache"):
        checkpointed(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    with warnings.catch_warnings():  # no cache asked for: nothing to drop, nothing to say
        warnings.simplefilter("error")
        checkpointed(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
