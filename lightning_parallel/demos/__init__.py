"""The shared demo: a byte-level GPT LightningModule and its data, used by examples, tests and benchmarks.

``lightning_parallel.demos.gpt`` is plain torch and can be imported without Lightning.
"""

from __future__ import annotations

from functools import partial

from lightning_parallel.demos.data import (
    RandomTokenDataModule,
    RandomTokenDataset,
    TextDataModule,
    TokenChunkDataset,
    default_corpus_files,
    load_corpus,
)
from lightning_parallel.demos.gpt import (
    GPT,
    MLP,
    PRESETS,
    Block,
    CausalSelfAttention,
    GPTConfig,
    LMHead,
    TokenEmbedding,
    num_parameters,
)
from lightning_parallel.demos.module import GPTLightningModule, next_token_loss
from lightning_parallel.demos.stats import RunStats, RunSummary, peak_memory_bytes, summarize
from lightning_parallel.planner.shape import register_config_type, register_preset

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTLightningModule",
    "LMHead",
    "RandomTokenDataModule",
    "RandomTokenDataset",
    "RunStats",
    "RunSummary",
    "TextDataModule",
    "TokenChunkDataset",
    "TokenEmbedding",
    "default_corpus_files",
    "load_corpus",
    "next_token_loss",
    "num_parameters",
    "peak_memory_bytes",
    "summarize",
]

# The planner knows the demo only through these registrations (and the `transformer_shape()` hook of the models):
# `plan("gpt-1.3b")` and `plan(GPTConfig(...))` work; the library itself never imports this package.
register_config_type(GPTConfig, GPT)
for _name in PRESETS:
    register_preset(_name, partial(GPTLightningModule, _name))
