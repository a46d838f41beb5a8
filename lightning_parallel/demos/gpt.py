"""A small GPT-style decoder-only language model in plain torch (no Lightning).

The model follows nanoGPT / GPT-2 (pre-LayerNorm blocks, learned position embeddings, GELU MLP) with two deliberate
differences that make it easy to parallelise:

* the language-model head is **not** tied to the token embedding, so the first and the last pipeline stage hold
  independent parameters;
* :meth:`GPT.pipeline_layers` lists the model as a flat sequence of single-tensor-in, single-tensor-out modules whose
  composition is exactly :meth:`GPT.forward`, so a pipeline splitter can cut it anywhere.

Tokens are bytes by default (``vocab_size=256``), so no tokenizer or download is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from lightning_parallel.planner.shape import TransformerShape

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "LMHead",
    "TokenEmbedding",
    "num_parameters",
]

PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests and fast multi-process CPU tests (~0.1 M parameters).
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
    # The CPU demo (~3 M parameters).
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128},
    # The benchmarks' default throughput size on CPU (20.5 M parameters); an 8192-token vocabulary gives the embedding
    # and LM head a realistic share. The demo data are bytes (< 256), which fit any vocabulary.
    "gpt-20m": {"n_layer": 8, "n_head": 6, "n_embd": 384, "block_size": 128, "vocab_size": 8192},
    # The benchmarks' memory size on CPU (97.7 M parameters, GPT-2 small's blocks with an 8192-token vocabulary and
    # short sequences); bytes (< 256) fit its vocabulary too.
    "gpt-100m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 128, "vocab_size": 8192},
    # GPU sizes: GPT-2 / GPT-3 shapes with the byte-level vocabulary unless overridden.
    "gpt-125m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
    "gpt-350m": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024},
    "gpt-1.3b": {"n_layer": 24, "n_head": 32, "n_embd": 2048, "block_size": 1024},
}
"""Named model sizes for :meth:`GPTConfig.from_preset`, as overrides of :class:`GPTConfig`'s fields."""


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT` model. The defaults are the ``"tiny"`` preset."""

    vocab_size: int = 256
    """Number of distinct tokens; 256 means raw bytes, so no tokenizer is needed."""
    block_size: int = 64
    """Maximum sequence length (number of learned position embeddings)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 2
    """Number of attention heads per block; must divide ``n_embd``."""
    n_embd: int = 64
    """Width of the residual stream (embedding dimension)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches. Keep 0.0 for exact comparisons."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias (the LM head never does, as in GPT-2)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`GPTConfig.{name}={value!r}` must be a positive integer.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"`n_embd={self.n_embd}` must be divisible by `n_head={self.n_head}` so that every head gets the same "
                f"width; pick an `n_head` that divides {self.n_embd} or change `n_embd`."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout={self.dropout!r}` must be in [0, 1).")

    @property
    def head_size(self) -> int:
        """Width of one attention head (``n_embd // n_head``)."""
        return self.n_embd // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """Build the config of a named preset, optionally changing some fields.

        Args:
            name: One of the keys of :data:`PRESETS`: ``"tiny"``, ``"small"``, ``"gpt-125m"``, ``"gpt-350m"``,
                ``"gpt-1.3b"``.
            **overrides: Field values that replace the preset's (for example ``n_layer=4``).

        Raises:
            ValueError: If ``name`` is not a known preset (the message lists the valid names) or an override is invalid.
            TypeError: If an override is not a field of :class:`GPTConfig`.
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown GPT preset {name!r}. Valid presets: {', '.join(map(repr, PRESETS))}.")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise TypeError(f"Unknown GPTConfig field(s) {unknown}. Valid fields: {sorted(valid)}.")
        return replace(cls(**PRESETS[name]), **overrides)


class TokenEmbedding(nn.Module):
    """Token embedding plus learned position embedding, followed by dropout: ``(B, T)`` long -> ``(B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.token = nn.Embedding(config.vocab_size, config.n_embd)
        self.position = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        """Embed token ids ``idx`` of shape ``(B, T)`` with ``T <= block_size``."""
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"Sequence length {T} exceeds `block_size={self.block_size}`; use shorter sequences.")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.token(idx) + self.position(pos)  # (B, T, C) + (T, C) -> (B, T, C)
        return self.dropout(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via :func:`torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` of shape ``(B, T, C)``; each position sees itself and earlier positions only."""
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, nh, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: ``C -> 4C -> GELU -> C``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to ``x`` of shape ``(B, T, C)``."""
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        """Transform ``x`` of shape ``(B, T, C)`` into a tensor of the same shape."""
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class LMHead(nn.Linear):
    """Projection from the residual stream to vocabulary logits: ``(B, T, C) -> (B, T, V)``.

    Not tied to the token embedding: tying would make the first and last pipeline stages share a parameter.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.n_embd, config.vocab_size, bias=False)


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Submodules, in execution order: ``embedding`` (:class:`TokenEmbedding`), ``blocks`` (``nn.ModuleList`` of
    :class:`Block`), ``norm`` (final ``nn.LayerNorm``) and ``head`` (:class:`LMHead`).

    Weights are initialised GPT-2 style from torch's global RNG, so ``torch.manual_seed(s)`` before construction
    gives identical weights in every process.

    Args:
        config: The model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = LMHead(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise weights GPT-2 style.

        Linear and Embedding weights are drawn from N(0, 0.02), biases are zero, LayerNorms are identity. The output
        projections of each residual branch use std ``0.02 / sqrt(2 * n_layer)`` so that the residual stream's variance
        does not grow with depth (GPT-2 paper, section 2.3).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: Tensor) -> Tensor:
        """Compute next-token logits.

        Args:
            idx: Token ids of shape ``(B, T)`` with ``T <= config.block_size``.

        Returns:
            Logits of shape ``(B, T, vocab_size)``; position ``t`` predicts token ``t + 1``.
        """
        x = self.embedding(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.norm(x)  # (B, T, C)
        return self.head(x)  # (B, T, V)

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a flat list ``[embedding, *blocks, norm, head]`` of one-tensor-in, one-tensor-out modules.

        Applying them in order is exactly :meth:`forward`, so a pipeline splitter may cut between any two of them.
        The returned modules are the model's own (not copies).
        """
        return [self.embedding, *self.blocks, self.norm, self.head]

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Which layers tensor parallelism splits, and how: module names relative to this model, ``*`` for one level
        of the name, and Hugging Face's style names (docs/tensor_parallel.md).

        The MLP is split Megatron's way: ``c_fc`` by columns (each tensor rank computes its slice of the ``4C``
        hidden features and their GELU), ``c_proj`` by rows (the partial products summed by one all-reduce). The
        attention's projections are split too, but its heads are not: ``c_attn`` holds the queries, keys and values
        in one ``(3C, C)`` matrix, so a plain column split would give a rank all the queries and half the keys rather
        than whole heads. Its output is gathered instead (``colwise_rep``: an all-gather of ``(B, T, 3C)``), every
        tensor rank attends over all heads, and ``c_proj`` takes that replicated input split on its features
        (``rowwise_rep``). Splitting the heads needs separate ``q``/``k``/``v`` layers (or a strided split of the
        fused one). The embeddings, the LayerNorms and the LM head stay whole on every tensor rank.
        """
        return {
            "blocks.*.attn.c_attn": "colwise_rep",
            "blocks.*.attn.c_proj": "rowwise_rep",
            "blocks.*.mlp.c_fc": "colwise",
            "blocks.*.mlp.c_proj": "rowwise",
        }

    def num_parameters(self) -> int:
        """Total number of parameters (every parameter is counted once; nothing is shared)."""
        return sum(p.numel() for p in self.parameters())

    def transformer_shape(self) -> TransformerShape:
        """The planner's hook (:class:`~lightning_parallel.planner.ProvidesTransformerShape`): this model's shape."""
        # Imported here: this module is plain torch and must stay importable without the library's Lightning layer.
        from lightning_parallel.planner.shape import TransformerShape

        c = self.config
        return TransformerShape(
            num_layers=c.n_layer,
            hidden_size=c.n_embd,
            num_heads=c.n_head,
            vocab_size=c.vocab_size,
            max_seq_len=c.block_size,
            first_block_layer=1,  # pipeline_layers(): [embedding, *blocks, norm, head]
            dropout=c.dropout > 0,  # each dropout saves a 1-byte mask per element in training
        )


def num_parameters(config: GPTConfig | str) -> int:
    """Count the parameters of a :class:`GPT` without allocating its weights.

    Args:
        config: A config, or the name of a preset in :data:`PRESETS`.

    Returns:
        The number of parameters, computed on the ``meta`` device so even the largest preset costs no memory.
    """
    if isinstance(config, str):
        config = GPTConfig.from_preset(config)
    with torch.device("meta"):
        model = GPT(config)
    return model.num_parameters()
