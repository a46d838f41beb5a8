"""How a model tells the planner its shape: the :class:`TransformerShape` hook, presets and config types.

The planner reads parameters, FSDP2 units and pipeline layers from any module itself. What it cannot read from the
parameters is the activation size: for that a model implements :class:`ProvidesTransformerShape` (one method,
``transformer_shape()``), as torchtitan's models report their own parameter and FLOP counts. Models without it are
planned without an activation estimate.

Names and config objects map to modules through two small registries, filled by the package that defines the model
(``lightning_parallel.demos`` registers its GPT presets and ``GPTConfig``); the planner never imports a model package
at import time. A preset name it does not know yet makes it import :data:`PRESET_PACKAGES` once, which registers them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_parallel.choices import check_choice

__all__ = [
    "PRESET_PACKAGES",
    "ProvidesTransformerShape",
    "TransformerShape",
    "build_from_config",
    "preset_builder",
    "preset_names",
    "register_config_type",
    "register_preset",
    "transformer_shape_of",
]


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A decoder-only transformer as the planner's activation estimate sees it."""

    num_layers: int
    """Transformer blocks."""
    hidden_size: int
    """Width of the residual stream (``n_embd``)."""
    num_heads: int
    """Attention heads per block."""
    vocab_size: int
    """Rows of the output head (the logits are ``vocab_size`` wide)."""
    max_seq_len: int
    """The longest sequence the model takes; the planner's default ``seq_len`` unless :attr:`default_seq_len` is set."""
    first_block_layer: int = 1
    """Index of the first block in ``pipeline_layers()`` (blocks are contiguous: ``[embedding, *blocks, ...]``)."""
    default_seq_len: int | None = None
    """The planner's default ``seq_len`` when it should be shorter than :attr:`max_seq_len` (a Hugging Face config's
    ``max_position_embeddings`` of 128k tokens); ``None``: ``max_seq_len``."""
    # What the activation count (:mod:`.activations`) reads; the defaults describe the demo GPT (GPT-2's block).
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention when fewer than :attr:`num_heads`); ``None``: :attr:`num_heads`."""
    head_dim: int | None = None
    """Width of one head; ``None``: ``hidden_size // num_heads``."""
    intermediate_size: int | None = None
    """Width of the MLP's hidden layer; ``None``: ``4 * hidden_size``."""
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """``"gelu"``: two products around a GELU (GPT); ``"gelu_tanh"``: the same with GPT-2's tanh GELU written out in
    element-wise ops (transformers' ``gelu_new``); ``"swiglu"``: gated, three products (Llama)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """``"layernorm"`` (GPT) or ``"rmsnorm"`` computed in fp32 as Llama's ``LlamaRMSNorm``."""
    positions: Literal["learned", "rotary"] = "learned"
    """Learned position embeddings (GPT) or rotary embeddings (Llama)."""
    fused_qkv: bool = True
    """Queries, keys and values come from one product (GPT's ``c_attn``) rather than three (Llama)."""
    dropout: bool = False
    """Dropout is active in training (each dropout saves a 1-byte mask per element)."""

    def __post_init__(self) -> None:
        check_choice("TransformerShape.mlp", self.mlp, Literal["gelu", "gelu_tanh", "swiglu"])
        check_choice("TransformerShape.norm", self.norm, Literal["layernorm", "rmsnorm"])
        check_choice("TransformerShape.positions", self.positions, Literal["learned", "rotary"])

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head width."""
        return self.num_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values)."""
        return (self.num_kv_heads or self.num_heads) * self.head_size

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def matmul_widths(self) -> list[int]:
        """Output widths of a block's matrix products in forward order (GPT: qkv, proj, fc, proj; Llama: q, k, v, o,
        gate, up, down)."""
        h, i = self.hidden_size, self.mlp_size
        attention = [self.q_dim + 2 * self.kv_dim] if self.fused_qkv else [self.q_dim, self.kv_dim, self.kv_dim]
        mlp = [i, i, h] if self.mlp == "swiglu" else [i, h]
        return [*attention, h, *mlp]

    def block_weight_numel(self) -> int:
        """Elements of a block's matrix-product weights (what autocast copies to 16 bits), biases and norms not."""
        h, i = self.hidden_size, self.mlp_size
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + (3 if self.mlp == "swiglu" else 2) * h * i

    def example_inputs(self, batch_size: int, seq_len: int) -> tuple[Tensor, ...]:
        """Token ids ``(batch_size, seq_len)`` on the meta device: the input of ``forward``."""
        return (torch.empty(batch_size, seq_len, dtype=torch.long, device="meta"),)

    def is_block(self, layer_index: int) -> bool:
        """Whether pipeline layer ``layer_index`` is a transformer block."""
        return self.first_block_layer <= layer_index < self.first_block_layer + self.num_layers


@runtime_checkable
class ProvidesTransformerShape(Protocol):
    """The planner's hook: a module (the LightningModule or a plain ``nn.Module``) that reports its shape.

    .. code-block:: python

        class MyModel(LightningModule):
            def transformer_shape(self) -> TransformerShape:
                return TransformerShape(
                    num_layers=12, hidden_size=768, num_heads=12, vocab_size=50304, max_seq_len=1024
                )
    """

    def transformer_shape(self) -> TransformerShape: ...


def transformer_shape_of(module: nn.Module | None) -> TransformerShape | None:
    """The shape ``module`` reports through :class:`ProvidesTransformerShape`, or ``None``.

    Raises:
        TypeError: If ``transformer_shape()`` returns something other than a :class:`TransformerShape`.
    """
    if not isinstance(module, ProvidesTransformerShape):
        return None
    shape = module.transformer_shape()
    if not isinstance(shape, TransformerShape):
        raise TypeError(
            f"`{type(module).__name__}.transformer_shape()` returned {type(shape).__name__}; it must return a"
            " `lightning_parallel.planner.TransformerShape`."
        )
    return shape


# ------------------------------------------------------------------------------------------------------ registries
PRESET_PACKAGES: tuple[str, ...] = ("lightning_parallel.demos",)
"""Packages imported (once, on the first unknown name, never at import time) to register their presets."""

_PRESETS: dict[str, Callable[[], nn.Module]] = {}
_CONFIG_TYPES: dict[type, Callable[[Any], nn.Module]] = {}
_loaded_preset_packages = False


def register_preset(name: str, build: Callable[[], nn.Module]) -> None:
    """Let ``plan(name)`` plan the module ``build()`` returns (called under ``torch.device("meta")``)."""
    _PRESETS[name] = build


def register_config_type(config_type: type, build: Callable[[Any], nn.Module]) -> None:
    """Let ``plan(config)`` take instances of ``config_type``: ``build(config)`` returns the module (on meta)."""
    _CONFIG_TYPES[config_type] = build


def _load_preset_packages() -> None:
    global _loaded_preset_packages
    if not _loaded_preset_packages:
        _loaded_preset_packages = True
        for package in PRESET_PACKAGES:
            importlib.import_module(package)


def preset_builder(name: str) -> Callable[[], nn.Module] | None:
    """The builder registered for preset ``name``, or ``None``."""
    if name not in _PRESETS:
        _load_preset_packages()
    return _PRESETS.get(name)


def preset_names() -> list[str]:
    """Every registered preset name."""
    _load_preset_packages()
    return list(_PRESETS)


def build_from_config(config: Any) -> nn.Module | None:
    """The module a registered config type builds from ``config`` on the meta device, or ``None`` if unregistered."""
    for config_type, build in _CONFIG_TYPES.items():
        if isinstance(config, config_type):
            with torch.device("meta"):
                return build(config)
    return None
