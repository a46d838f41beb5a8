"""The planner's activation count equals the bytes autograd saves for backward, measured on CPU, for the demo GPT and
transformers' Llama (grouped-query attention, SwiGLU, RMSNorm, rotary) and GPT-2, in fp32 and under bf16 autocast,
with fused (SDPA) and explicit attention, with and without full activation checkpointing; and the inputs of
``plan`` (``attention``, ``activation_checkpointing``) are validated at the edge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_activation_checkpointing import saved_activation_bytes
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_parallel.demos.gpt import GPT, GPTConfig
from lightning_parallel.distributed.activation_checkpointing import apply_activation_checkpointing
from lightning_parallel.planner import main, plan
from lightning_parallel.planner.activations import activation_bytes, recompute_fraction
from lightning_parallel.planner.shape import TransformerShape
from lightning_parallel.planner.spec import model_spec

transformers = pytest.importorskip("transformers")

B, T, V = 2, 8, 32
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _gpt() -> tuple[nn.Module, TransformerShape, Callable[[Tensor], Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=T, vocab_size=V))
    return model, model.transformer_shape(), model


def _hf(config: Any, implementation: str) -> tuple[nn.Module, TransformerShape, Callable[[Tensor], Tensor]]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).train()
    shape = model_spec(config).shape
    assert shape is not None
    return model, shape, lambda ids: model(input_ids=ids, use_cache=False).logits  # training: no cache


def _llama(implementation: str) -> tuple[nn.Module, TransformerShape, Callable[[Tensor], Tensor]]:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return _hf(config, implementation)


def _gpt2(implementation: str) -> tuple[nn.Module, TransformerShape, Callable[[Tensor], Tensor]]:
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return _hf(config, implementation)


MODELS = {
    # The demo GPT calls F.scaled_dot_product_attention: torch's fused CPU kernel ("flash"), or its math backend.
    "gpt": (_gpt, "flash"),
    "gpt_math": (_gpt, "math"),
    "llama_sdpa": (lambda: _llama("sdpa"), "flash"),
    "llama_eager": (lambda: _llama("eager"), "math"),
    "gpt2_sdpa": (lambda: _gpt2("sdpa"), "flash"),
}
CASES = [  # (model, precision, checkpointing)
    *[(m, "32-true", "none") for m in MODELS],
    ("gpt", "32-true", "full"),
    ("llama_sdpa", "32-true", "full"),
    ("gpt", "bf16-mixed", "none"),
    ("gpt", "bf16-mixed", "full"),
    ("llama_sdpa", "bf16-mixed", "none"),
    ("llama_eager", "bf16-mixed", "none"),
    ("llama_sdpa", "bf16-mixed", "full"),
    # Not here: the demo GPT's math backend under autocast (torch's SDPA math upcasts to fp32 on CPU, which
    # transformers' eager attention, the "math" the planner models, does not).
]


def _measure(case: str, precision: str, checkpointing: str) -> tuple[int, int, TransformerShape]:
    """Saved-for-backward bytes of a step (forward, next-token cross-entropy), and of one block alone."""
    build, attention = MODELS[case]
    model, shape, forward = build()
    generator = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, V, (B, T), generator=generator), torch.randint(0, V, (B, T), generator=generator)
    backends = [SDPBackend.MATH] if attention == "math" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    blocks = model.blocks if isinstance(model, GPT) else getattr(model, "model", getattr(model, "transformer", None))
    with sdpa_kernel(backends), autocast:
        if checkpointing == "full":
            apply_activation_checkpointing(model, True)
        measured = saved_activation_bytes(model, lambda: F.cross_entropy(forward(ids).flatten(0, 1), targets.flatten()))
    assert blocks is not None
    return measured, 0, shape


@pytest.mark.parametrize(("case", "precision", "checkpointing"), CASES)
def test_saved_bytes_equal_the_measurement(case: str, precision: str, checkpointing: str) -> None:
    measured, _, shape = _measure(case, precision, checkpointing)
    stream, compute = (4, 2) if precision == "bf16-mixed" else (4, 4)
    predicted = activation_bytes(
        shape,
        seq_len=T,
        samples=B,
        blocks=shape.num_layers,
        stream_bytes=stream,
        compute_bytes=compute,
        attention=MODELS[case][1],
        checkpointing=checkpointing,
    )
    assert predicted.saved == measured


def test_plan_uses_the_count_with_its_transient() -> None:
    """``plan``'s activations are the saved bytes plus the largest transient of backward (the loss's two fp32
    ``(tokens, V)`` gradients without checkpointing)."""
    model, shape, _ = _gpt()
    result = plan(model, world_size=1, batch_size=B, seq_len=T, attention="flash")
    expected = activation_bytes(shape, seq_len=T, samples=B, blocks=2, stream_bytes=4, compute_bytes=4)
    assert expected.transient == 2 * 4 * V * B * T
    assert result.configuration("data_parallel").ranks[0].activations == expected.peak


def test_flash_drops_the_quadratic_term_and_checkpointing_orders_the_modes() -> None:
    """Llama 3 8B at 8192 tokens: flash stores no s^2 scores; none > selective > full; selective reruns about 9% of
    a step (the k, o and up projections' FLOPs), full a third."""
    shape = model_spec(transformers.LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256,
    )).shape  # fmt: skip
    assert shape is not None
    common = {"seq_len": 8192, "samples": 1, "blocks": 32, "stream_bytes": 4, "compute_bytes": 2}
    flash, math = (activation_bytes(shape, **common, attention=a).saved for a in ("flash", "math"))
    assert math - flash > 32 * 32 * 8192 * 8192 * 4  # at least the fp32 probabilities of every block
    modes = [activation_bytes(shape, **common, checkpointing=m).saved for m in ("none", "selective", "full")]
    assert modes == sorted(modes, reverse=True)
    assert 0.08 < recompute_fraction(shape, "selective", seq_len=8192) < 0.10
    assert recompute_fraction(shape, "full", seq_len=8192) == pytest.approx(1 / 3)


INVALID = {
    "attention": ({"attention": "xformers"}, ValueError, r"`attention='xformers'` is invalid. Valid options: 'flash'"),
    "mode": (
        {"activation_checkpointing": "partial"},
        ValueError,
        r"`activation_checkpointing='partial'` is invalid. Valid options: 'none'.*'selective'.*'full'",
    ),
    "type": ({"activation_checkpointing": 1}, TypeError, "activation_checkpointing=1"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_bad_inputs_name_the_value_and_the_options(case: str) -> None:
    options, error, message = INVALID[case]
    with pytest.raises(error, match=message):
        plan("tiny", world_size=2, **options)


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiny", "--world-size", "2", "--attention", "math", "--activation-checkpointing", "selective"]) == 0
    out = capsys.readouterr().out
    assert "math attention, selective activation checkpointing. Per rank" in out
    assert main(["tiny", "--world-size", "2", "--attention", "sdpa"]) == 2
    assert "`attention='sdpa'` is invalid. Valid options: 'flash'" in capsys.readouterr().err
    assert main(["tiny", "--world-size", "2", "--activation-checkpointing"]) == 0  # the bare flag: full
    assert "full activation checkpointing. Per rank" in capsys.readouterr().out
