"""Parameter-for-parameter stand-ins of transformers' causal language models, built on ``meta`` for the planner.

:func:`build_causal_lm` turns a :class:`~lightning_parallel.planner.hf.DecoderConfig` into a module with exactly the
parameters of ``AutoModelForCausalLM.from_config(config)``: the same qualified names, shapes, registration order and
tied embeddings (``tests/test_planner_hf.py`` compares them with transformers' models). So the planner's ZeRO-1/2
buckets (reverse registration order) and FSDP2 units (repeated blocks, then the remaining children) are those of the
real model inside a LightningModule that holds it as ``self.model``.

The stand-ins also compute: ``forward`` on token ids gives logits of the right shape, with the matrix products of
the real model, so the pipeline partitioner counts each layer's FLOPs on ``meta`` as it would for the real layers.
They skip what holds no parameter and costs no FLOPs there (rotary embeddings, dropout, masks, softmax scaling).

``pipeline_layers()`` cuts the model as ``PipelineParallelStrategy`` cuts a Hugging Face model by its declared plan
(transformers' ``base_model_pp_plan``; ``distributed/pipeline/model_plan.py``): the embedding, each decoder layer,
and an epilogue of the final norm and the LM head; only hidden states ``(B, T, hidden_size)`` cross stages. GPT-2
declares no plan; its stand-in is cut the same way (token + position embeddings, each block, ``ln_f`` + head), as the
adapters of ``docs/pipeline.md`` cut it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.planner.hf import DEFAULT_SEQ_LEN_CAP, DecoderConfig
from lightning_parallel.planner.shape import TransformerShape

__all__ = ["build_causal_lm"]


def build_causal_lm(layout: DecoderConfig) -> nn.Module:
    """The stand-in of ``layout``'s causal language model, on the current default device (the planner: ``meta``)."""
    return _GPT2LMHeadModel(layout) if layout.is_gpt2 else _CausalLM(layout)


def _shape(layout: DecoderConfig) -> TransformerShape:
    return TransformerShape(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_heads=layout.num_heads,
        vocab_size=layout.vocab_size,
        max_seq_len=layout.max_position_embeddings,
        first_block_layer=1,  # pipeline_layers(): [embedding, *decoder layers, norm + lm_head]
        default_seq_len=min(layout.max_position_embeddings, DEFAULT_SEQ_LEN_CAP),
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        intermediate_size=layout.intermediate_size,
        mlp="gelu_tanh" if layout.is_gpt2 else "swiglu",  # GPT-2's gelu_new; Gemma's GeGLU saves what SwiGLU saves
        norm="layernorm" if layout.is_gpt2 else "rmsnorm",
        positions="learned" if layout.is_gpt2 else "rotary",
        fused_qkv=layout.is_gpt2,
    )


def _attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of ``(B, T, heads, head_dim)`` queries and ``(B, T, kv_heads, head_dim)`` keys and values, as two
    matrix products (what FLOP counting sees of any attention kernel; ``scaled_dot_product_attention`` counts the
    same ``4 B heads T^2 head_dim`` but is slow on ``meta``)."""
    groups = q.shape[2] // k.shape[2]  # grouped-query attention: each key/value head serves `groups` query heads
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)  # (B, T, heads, head_dim)
    scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)  # (B, heads, T, T)
    y = scores.softmax(-1) @ v.transpose(1, 2)  # (B, heads, T, head_dim)
    return y.transpose(1, 2).flatten(2)  # (B, T, heads * head_dim)


class _RMSNorm(nn.Module):
    """An RMSNorm's parameter (``weight``, as transformers names it); its forward only scales: the partitioner
    counts a norm as its output size, and ``torch.rms_norm`` is slow on ``meta``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class _Epilogue(nn.Module):
    """The last pipeline layer: the final norm, then the LM head (an adapter, not registered in the model, so the
    model's parameter names stay transformers')."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(x))  # (B, T, vocab)


# ---------------------------------------------------------------------------------------------- the Llama family
class _Attention(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        h, d = layout.hidden_size, layout.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, layout.num_heads * d, bias=layout.qkv_bias)
        self.k_proj = nn.Linear(h, layout.num_kv_heads * d, bias=layout.qkv_bias)
        self.v_proj = nn.Linear(h, layout.num_kv_heads * d, bias=layout.qkv_bias)
        self.o_proj = nn.Linear(layout.num_heads * d, h, bias=layout.o_bias)
        self.q_norm = _RMSNorm(d) if layout.qk_norm else None
        self.k_norm = _RMSNorm(d) if layout.qk_norm else None

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, heads, head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, kv_heads, head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(_attention(q, k, v))


class _MLP(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        h, i = layout.hidden_size, layout.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=layout.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=layout.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=layout.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(layout)
        self.mlp = _MLP(layout)
        self.input_layernorm = _RMSNorm(layout.hidden_size)
        self.post_attention_layernorm = _RMSNorm(layout.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _DecoderModel(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(layout.vocab_size, layout.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(layout) for _ in range(layout.num_layers))
        self.norm = _RMSNorm(layout.hidden_size)


class _StandIn(nn.Module):
    """What both stand-ins share: ``forward`` is the chain of ``pipeline_layers()``, the shape is the config's."""

    layout: DecoderConfig
    lm_head: nn.Linear

    def _add_head(self, embedding: nn.Embedding) -> None:
        """``lm_head``, registered after the body (the state dict's order), tied to ``embedding`` where configured."""
        self.lm_head = nn.Linear(self.layout.hidden_size, self.layout.vocab_size, bias=False)
        if self.layout.tie_word_embeddings:
            self.lm_head.weight = embedding.weight

    def pipeline_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def forward(self, input_ids: Tensor) -> Tensor:
        x = input_ids
        for layer in self.pipeline_layers():
            x = layer(x)  # (B, T, hidden), then (B, T, vocab)
        return x

    def transformer_shape(self) -> TransformerShape:
        """The planner's hook: the shape the config gives."""
        return _shape(self.layout)


class _CausalLM(_StandIn):
    """``LlamaForCausalLM`` and its relatives: ``model.{embed_tokens, layers, norm}`` and ``lm_head``."""

    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.layout = layout
        self.model = _DecoderModel(layout)
        self._add_head(self.model.embed_tokens)

    def pipeline_layers(self) -> list[nn.Module]:
        """``[embed_tokens, *layers, norm + lm_head]``, as the strategy cuts a model by its declared plan."""
        return [self.model.embed_tokens, *self.model.layers, _Epilogue(self.model.norm, self.lm_head)]


# ---------------------------------------------------------------------------------------------- GPT-2
class _Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: a linear layer whose weight is stored ``(in, out)``."""

    def __init__(self, num_in: int, num_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_in, num_out))
        self.bias = nn.Parameter(torch.empty(num_out))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias


class _GPT2Attention(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.head_dim = layout.head_dim
        self.c_attn = _Conv1D(layout.hidden_size, 3 * layout.hidden_size)
        self.c_proj = _Conv1D(layout.hidden_size, layout.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))  # (B, T, heads, hd)
        return self.c_proj(_attention(q, k, v))


class _GPT2MLP(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.c_fc = _Conv1D(layout.hidden_size, layout.intermediate_size)
        self.c_proj = _Conv1D(layout.intermediate_size, layout.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class _GPT2Block(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(layout.hidden_size)
        self.attn = _GPT2Attention(layout)
        self.ln_2 = nn.LayerNorm(layout.hidden_size)
        self.mlp = _GPT2MLP(layout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _GPT2Model(nn.Module):
    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(layout.vocab_size, layout.hidden_size)
        self.wpe = nn.Embedding(layout.max_position_embeddings, layout.hidden_size)  # learned positions
        self.h = nn.ModuleList(_GPT2Block(layout) for _ in range(layout.num_layers))
        self.ln_f = nn.LayerNorm(layout.hidden_size)


class _GPT2Embedding(nn.Module):
    """Pipeline layer 0 of GPT-2: token plus position embeddings (not registered in the model: a view of its
    ``wte`` and ``wpe``, so the model's parameter names stay transformers')."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        return self.wte(input_ids) + self.wpe(positions)  # (B, T, hidden)


class _GPT2LMHeadModel(_StandIn):
    """``GPT2LMHeadModel``: ``transformer.{wte, wpe, h, ln_f}`` and ``lm_head``."""

    def __init__(self, layout: DecoderConfig) -> None:
        super().__init__()
        self.layout = layout
        self.transformer = _GPT2Model(layout)
        self._add_head(self.transformer.wte)

    def pipeline_layers(self) -> list[nn.Module]:
        """``[wte + wpe, *h, ln_f + lm_head]``."""
        t = self.transformer
        return [_GPT2Embedding(t.wte, t.wpe), *t.h, _Epilogue(t.ln_f, self.lm_head)]
