"""Plan the model a Hugging Face ``transformers`` config describes: a config object or a local ``config.json``.

``plan(LlamaConfig(...))``, ``plan("path/to/config.json")`` and ``plan("path/to/checkpoint_dir")`` plan the causal
language model ``AutoModelForCausalLM.from_config(config)`` would build. transformers is never imported: a config
object is read through its ``to_dict()`` (duck typing), a file as JSON, so the planner works where transformers is not
installed (a laptop planning a cluster job) and nothing is ever downloaded.

From the config's well-known keys (``hidden_size``/``n_embd``, ``num_hidden_layers``/``n_layer``, ...; a key the
file leaves out takes the config class's default, as transformers does) this module resolves a
:class:`DecoderConfig`, and :mod:`.hf_modules` builds a parameter-for-parameter copy of the model on the ``meta``
device: the same names, shapes, registration order and tied embeddings, hence the same ZeRO buckets and FSDP2 units
as the real model (``tests/test_planner_hf.py`` compares them with transformers' own models).

Only architectures whose layout is known here are planned (:data:`SUPPORTED_MODEL_TYPES`); any other ``model_type``
is refused with an error saying what to pass instead. We do not approximate an unknown architecture with a
Llama-shaped one: the planner's promise is exact bytes (checked against ``ParallelismMonitor``), and a guess is off
by a factor for common cases (a mixture of experts holds ``num_local_experts`` MLPs per layer, fused or extra norms,
per-layer widths), a silent error in the very number a user decides with. The module instance gives exact bytes for
any architecture (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``, then
``plan(model)``), only without pipeline and activation numbers; the error says so.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_SEQ_LEN_CAP",
    "SUPPORTED_MODEL_TYPES",
    "DecoderConfig",
    "HFConfigError",
    "decoder_config",
    "hf_notes",
    "read_hf_config",
]

CONFIG_NAME = "config.json"
DEFAULT_SEQ_LEN_CAP = 4096
"""The planner's default ``seq_len`` for a config is ``min(max_position_embeddings, 4096)``: recent models accept
32k-128k tokens (long-context fine-tuning), but are mostly trained at a few thousand, and attention scores grow with
the square of the length; ``seq_len=`` / ``--seq-len`` plans any other length."""


class HFConfigError(ValueError):
    """A Hugging Face config the planner cannot read (the message names the value and the fix)."""


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """A decoder-only causal language model as its config describes it: everything its parameters depend on."""

    model_type: str
    """The config's ``model_type`` (``"llama"``, ``"gpt2"``, ...)."""
    causal_lm: str
    """transformers' class whose parameters these are (``"LlamaForCausalLM"``)."""
    origin: str
    """Where the config came from: a path, or the config object's class name."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the MLP's hidden layer (GPT-2: ``n_inner``, ``4 * n_embd`` when unset)."""
    num_layers: int
    """Decoder layers (``num_hidden_layers``/``n_layer``)."""
    num_heads: int
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    head_dim: int
    max_position_embeddings: int
    """The longest sequence; GPT-2's learned position embeddings have this many rows (``n_positions``)."""
    tie_word_embeddings: bool
    """The LM head shares the token embedding's weight (counted once)."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Qwen3: an RMSNorm of ``head_dim`` on queries and keys in every layer."""
    is_gpt2: bool = False
    """GPT-2's layout (learned positions, LayerNorms with biases, fused ``c_attn``, ``Conv1D`` weights ``(in, out)``)
    instead of the Llama family's (rotary positions, RMSNorms, separate projections, gated MLP)."""
    named_architecture: str | None = None
    """The class ``config.json``'s ``architectures`` names, when it is not :attr:`causal_lm`."""


@dataclass(frozen=True)
class _Architecture:
    causal_lm: str
    defaults: Mapping[str, Any]
    """The config class's defaults of the keys read (transformers 5.23; what a key left out of the file means)."""
    biases: Callable[[Mapping[str, Any]], tuple[bool, bool, bool]] = lambda c: (False, False, False)
    """``(q/k/v, o, MLP)`` biases from the resolved keys; fixed where the architecture ignores the config."""
    qk_norm: bool = False
    is_gpt2: bool = False


def _llama_defaults(**changes: Any) -> dict[str, Any]:
    defaults = {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    return defaults | changes


_QWEN = {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "max_position_embeddings": 32768}
_ARCHITECTURES: dict[str, _Architecture] = {
    "gpt2": _Architecture(
        "GPT2LMHeadModel",
        _llama_defaults(
            vocab_size=50257,
            hidden_size=768,
            intermediate_size=None,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        is_gpt2=True,
    ),
    "llama": _Architecture(
        "LlamaForCausalLM",
        _llama_defaults(attention_bias=False, mlp_bias=False),
        lambda c: (c["attention_bias"], c["attention_bias"], c["mlp_bias"]),
    ),
    "mistral": _Architecture(
        "MistralForCausalLM",
        _llama_defaults(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072),
    ),
    "qwen2": _Architecture("Qwen2ForCausalLM", _llama_defaults(**_QWEN), lambda c: (True, False, False)),
    "qwen3": _Architecture(
        "Qwen3ForCausalLM",
        _llama_defaults(**_QWEN, head_dim=128, attention_bias=False),
        lambda c: (c["attention_bias"], c["attention_bias"], False),
        qk_norm=True,
    ),
    "gemma": _Architecture(
        "GemmaForCausalLM",
        _llama_defaults(
            vocab_size=256000,
            hidden_size=3072,
            intermediate_size=24576,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=256,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            attention_bias=False,
        ),
        lambda c: (c["attention_bias"], c["attention_bias"], False),
    ),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_ARCHITECTURES)
"""``model_type`` values the planner lays out exactly."""

_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
}
"""Each key's spellings: the Llama family's names first, GPT-2's own second (its ``attribute_map``)."""


# ---------------------------------------------------------------------------------------------- reading
def read_hf_config(model: Any) -> tuple[dict[str, Any], str] | None:
    """The keys and the origin of a Hugging Face config, or ``None`` when ``model`` is not one.

    A config is an object with a ``model_type`` string and ``to_dict()`` (a transformers ``PretrainedConfig``), a
    mapping with a ``model_type`` (a ``config.json``'s contents), a path (``str``/``PathLike``) to a ``config.json``
    or to a directory holding one. A string is taken as a path when it names an existing file or directory, or looks
    like a path (contains ``/``, ends in ``.json``); others (presets, counts, class paths) return ``None``.

    Raises:
        HFConfigError: For a path-like string that is no local config (a Hub name like ``"meta-llama/Llama-2-7b-hf"``
            among them: nothing is downloaded), or a file that is not a config.
    """
    if isinstance(model, Mapping):
        return (dict(model), "config mapping") if isinstance(model.get("model_type"), str) else None
    if isinstance(getattr(model, "model_type", None), str) and callable(getattr(model, "to_dict", None)):
        return dict(model.to_dict()), type(model).__name__
    if isinstance(model, os.PathLike) or (isinstance(model, str) and _looks_like_path(model)):
        return _read_file(Path(model)), str(model)
    return None


def _looks_like_path(text: str) -> bool:
    return os.path.exists(text) or "/" in text or os.sep in text or text.endswith(".json")


def _read_file(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.is_file():
        raise HFConfigError(_missing_file_message(path, file))
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HFConfigError(f"`{file}` is not a JSON config file ({error}); pass a model's `config.json`.") from error
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise HFConfigError(
            f"`{file}` has no `model_type`, so it is not a transformers model config; pass the `config.json` that"
            " `config.save_pretrained(directory)` writes (or that directory)."
        )
    return values


def _missing_file_message(path: Path, file: Path) -> str:
    if path.is_dir():
        return f"The directory `{path}` holds no `{CONFIG_NAME}`; pass a directory `config.save_pretrained()` wrote."
    hub = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path)) is not None
    hint = (
        f" `{path}` looks like a Hugging Face Hub name: the planner reads only local files and never downloads."
        " Save the config locally first (`AutoConfig.from_pretrained(name).save_pretrained(directory)`) and pass"
        " the directory, or pass the config object itself."
        if hub
        else ""
    )
    return f"No such file or directory: `{path}` (a model config is a local `{CONFIG_NAME}` or its directory).{hint}"


# ---------------------------------------------------------------------------------------------- the layout
def decoder_config(values: Mapping[str, Any], origin: str) -> DecoderConfig:
    """Resolve the layout of the config ``values`` (a ``config.json``'s keys) read from ``origin``.

    Raises:
        HFConfigError: For a ``model_type`` the planner does not know, or a key whose value is not valid.
    """
    model_type = values["model_type"]
    arch = _ARCHITECTURES.get(model_type)
    if arch is None:
        raise HFConfigError(_unknown_architecture_message(model_type, values, origin))
    c = {key: _read(values, key, default, origin) for key, default in arch.defaults.items()}
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv_heads = c["num_key_value_heads"] or heads
    if c["head_dim"] is None and h % heads:
        raise HFConfigError(f"`hidden_size={h}` in {origin} is not a multiple of `num_attention_heads={heads}`.")
    if heads % kv_heads:
        raise HFConfigError(
            f"`num_attention_heads={heads}` in {origin} is not a multiple of `num_key_value_heads={kv_heads}`."
        )
    qkv_bias, o_bias, mlp_bias = arch.biases(c)
    architectures = values.get("architectures") or []
    named = next((a for a in architectures if isinstance(a, str) and a != arch.causal_lm), None)
    return DecoderConfig(
        model_type=model_type,
        causal_lm=arch.causal_lm,
        origin=origin,
        vocab_size=c["vocab_size"],
        hidden_size=h,
        intermediate_size=c["intermediate_size"] or 4 * h,
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=c["head_dim"] or h // heads,
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"],
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=arch.qk_norm,
        is_gpt2=arch.is_gpt2,
        named_architecture=named if arch.causal_lm not in architectures else None,
    )


def _read(values: Mapping[str, Any], key: str, default: Any, origin: str) -> Any:
    name = next((alias for alias in _ALIASES.get(key, (key,)) if alias in values), key)
    value = values.get(name, default)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise HFConfigError(f"`{name}={value!r}` in {origin} must be true or false.")
        return value
    # `None` means "derived": KV heads = heads and head_dim = width / heads in every family (Llama's own rule),
    # GPT-2's `n_inner` = 4 x width (the keys whose class default is None).
    if value is None and (default is None or key in ("num_key_value_heads", "head_dim")):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFConfigError(f"`{name}={value!r}` in {origin} must be a positive integer.")
    return value


def _unknown_architecture_message(model_type: str, values: Mapping[str, Any], origin: str) -> str:
    nested = ""
    if "text_config" in values:
        nested = " It nests a `text_config`: pass that (its language model) if it is one of these."
    return (
        f"The planner does not know the parameter layout of `model_type={model_type!r}` ({origin}); it plans"
        f" {', '.join(SUPPORTED_MODEL_TYPES)} exactly and does not guess others (a wrong layout would be a wrong"
        f" byte count).{nested} Plan the model itself instead: `with torch.device('meta'): model ="
        " AutoModelForCausalLM.from_config(config)`, then `plan(model, ...)` (exact bytes for data parallel and"
        " ZeRO; no pipeline or activation numbers), or pass its parameter count."
    )


def hf_notes(layout: DecoderConfig) -> list[str]:
    """What the plan of ``layout`` assumes, for the plan's notes."""
    if layout.is_gpt2:
        cut = "[wte + wpe, each block, ln_f + lm_head] (GPT-2 declares no base_model_pp_plan: pipeline_layers() so)"
    else:
        cut = "[embed_tokens, each layer, norm + lm_head] (as PipelineParallelStrategy cuts it by its declared plan)"
    notes = [
        f"{layout.causal_lm} from {layout.origin}: every parameter as transformers builds it (names, shapes, tied"
        f" embeddings), so bytes held and sent are exact; pipelines cut its {layout.num_layers} decoder layers as"
        f" {cut}, sending only hidden states between stages."
    ]
    if layout.qk_norm or layout.model_type == "gemma":
        extra = "the RMSNorms of queries and keys" if layout.qk_norm else "Gemma's (1 + weight) RMSNorm"
        notes.append(
            f"Activations: counted as a Llama block (gated MLP of width {layout.intermediate_size},"
            f" {layout.num_kv_heads} key/value heads); {extra} is not counted."
        )
    if layout.named_architecture is not None:
        notes.append(
            f"The config names {layout.named_architecture}; planned as {layout.causal_lm} (only the head differs)."
        )
    return notes
