"""Which layers tensor parallelism splits, and how: the model's own plan resolved to torch's parallel styles.

The plan comes, in this order, from

1. a ``tensor_parallel_plan()`` method of the module (the LightningModule), returning ``{name: style}``: a module
   name relative to the module (``"blocks.*.attn.qkv"``: ``*`` matches one level of the name, as in torch's
   ``parallelize_module`` and Hugging Face's plans), and a style, either one of :data:`STYLE_NAMES` or a torch
   ``ParallelStyle`` (``ColwiseParallel(...)``, ``RowwiseParallel(...)``, ``SequenceParallel()``,
   ``PrepareModuleInput(...)``) passed through as it is;
2. else each Hugging Face model inside the module: its ``tp_plan`` (the class's ``_tp_plan``, such as
   ``lm_head: colwise_gather_output``, merged with ``config.base_model_tp_plan`` and the vocabulary-parallel input
   embedding) or, in older ``transformers``, ``config.base_model_tp_plan`` under the base model's prefix;
3. else a ``ValueError`` naming both ways to give one.

Hugging Face's style names map to torch's styles as ``transformers`` itself maps them
(``transformers/distributed/tensor_parallel.py``): ``colwise`` splits a ``Linear``'s output features (the input
replicated, each rank's output a slice of the features: its attention heads, its MLP columns), ``rowwise`` its input
features (the partial products summed over the tensor ranks: one all-reduce), ``*_rep``/``*_gather_output`` return a
replicated output (the LM head's logits gathered). Attention modules then see ``num_heads / T`` local heads: Hugging
Face's attention reshapes with ``-1`` heads (``view(*input_shape, -1, head_dim)``), so nothing else changes; a
module of one's own must do the same (or read its local head count from the weight). :func:`check_divisible` refuses
head counts and split dimensions that the tensor size does not divide, naming both.

Torch only: the hook is found by name, no Lightning import.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "HOOK_NAME",
    "STYLE_NAMES",
    "TensorParallelPlan",
    "check_divisible",
    "resolve_plan",
    "style_from_name",
]

HOOK_NAME = "tensor_parallel_plan"
"""The method of the module that returns its plan."""

_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # An embedding split on the vocabulary (rows): each rank looks up its rows, the others' give zeros, summed.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    # An embedding split on the features (columns), gathered.
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    # Norms and dropout on sequence shards: the neighbours must produce and take sequence-sharded activations
    # (torch's `ColwiseParallel(input_layouts=Shard(1))` / `RowwiseParallel(output_layouts=Shard(1))`).
    "sequence_parallel": SequenceParallel,
}
STYLE_NAMES: tuple[str, ...] = tuple(_STYLES)
"""The style names a plan may use (Hugging Face's spelling); other Hugging Face styles (packed, MoE, ``replicate``)
are refused naming these."""


def style_from_name(name: str, *, entry: str) -> ParallelStyle:
    """torch's style for a plan's style name; ``ValueError`` naming the valid ones for another (``entry``: the plan
    key, for the message)."""
    factory = _STYLES.get(name)
    if factory is None:
        raise ValueError(
            f"The tensor-parallel plan gives `{entry!r}` the style {name!r}, which is not supported: use one of"
            f" {list(STYLE_NAMES)}, or a torch `ParallelStyle` (ColwiseParallel, RowwiseParallel, SequenceParallel)"
            f" from `{HOOK_NAME}()`."
        )
    return factory()


@dataclass(frozen=True)
class TensorParallelPlan:
    """A resolved plan: concrete module names (relative to the module it was resolved on) and torch styles."""

    styles: dict[str, ParallelStyle]
    """Each split module's name and its style, wildcards expanded."""
    source: str
    """Where the plan came from, for messages: ``"tensor_parallel_plan()"`` or ``"Hugging Face tp_plan of 'model'"``."""
    head_counts: tuple[tuple[str, int], ...] = ()
    """``(what, count)`` of the attention heads the split divides (from Hugging Face configs)."""


def resolve_plan(module: nn.Module, *, owner: str) -> TensorParallelPlan:
    """Local. ``module``'s plan: its :data:`HOOK_NAME` method, else the Hugging Face models in it, else a
    ``ValueError`` naming both (``owner``: the strategy, as the user wrote it, for the message).

    Raises:
        ValueError: no plan; a key that matches no module (a typo would leave a layer whole on every rank, each rank
            then computing it on its slice); an unknown style name.
    """
    hook = getattr(module, HOOK_NAME, None)
    heads: tuple[tuple[str, int], ...]
    if callable(hook):
        entries, source, heads = hook(), f"{type(module).__name__}.{HOOK_NAME}()", ()
        if not isinstance(entries, Mapping) or not entries:
            raise TypeError(
                f"`{source}` returned {entries!r}: return a non-empty dict from module names (wildcards `*` allowed)"
                f" to style names ({list(STYLE_NAMES)}) or torch `ParallelStyle`s."
            )
    else:
        entries, source, heads = _hugging_face_plan(module)
        if not entries:
            raise ValueError(
                f"`{owner}` needs a tensor-parallel plan, and `{type(module).__name__}` gives none: define"
                f" `{HOOK_NAME}(self)` on it, returning which modules to split and how (e.g."
                ' `{"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}`, docs/tensor_parallel.md), or'
                " hold a Hugging Face model whose config declares `base_model_tp_plan` (Llama, Qwen2, Mistral, ...)."
                " Or drop `tensor_parallel_size`."
            )
    return TensorParallelPlan(styles=_expand(module, entries, source=source), source=source, head_counts=heads)


def _hugging_face_plan(module: nn.Module) -> tuple[dict[str, Any], str, tuple[tuple[str, int], ...]]:
    """The plans of the outermost Hugging Face models in ``module`` under their names, and their head counts."""
    entries: dict[str, Any] = {}
    holders: list[str] = []
    heads: list[tuple[str, int]] = []
    for name, child in module.named_modules():
        config: Any = getattr(child, "config", None)
        if getattr(config, "base_model_tp_plan", None) is None or any(_is_below(name, held) for held in holders):
            continue
        holders.append(name)
        prefix = f"{name}." if name else ""
        plan = getattr(child, "tp_plan", None)
        if not isinstance(plan, Mapping) or not plan:  # older transformers: the base model's plan only
            base = getattr(child, "base_model_prefix", "")
            inner = f"{base}." if base and isinstance(getattr(child, base, None), nn.Module) else ""
            plan = {f"{inner}{key}": value for key, value in (config.base_model_tp_plan or {}).items()}
        entries.update({f"{prefix}{key}": value for key, value in plan.items()})
        for attribute in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(config, attribute, None)
            if isinstance(count, int):
                heads.append((f"`{prefix or type(child).__name__ + '.'}config.{attribute}`", count))
    shown = ", ".join(repr(name) for name in holders)
    return entries, f"the Hugging Face tp_plan of {shown}", tuple(heads)


def _is_below(name: str, holder: str) -> bool:
    return holder == "" or name.startswith(f"{holder}.")


def _expand(module: nn.Module, entries: Mapping[str, Any], *, source: str) -> dict[str, ParallelStyle]:
    """Concrete names for the plan's patterns (``*`` per level of the dotted name), each with its style."""
    names = [name for name, _ in module.named_modules() if name]
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in entries.items():
        atoms = pattern.split(".")
        matched = [
            name
            for name in names
            if len(parts := name.split(".")) == len(atoms)
            and all(fnmatch.fnmatchcase(part, atom) for part, atom in zip(parts, atoms, strict=True))
        ]
        if not matched:
            raise ValueError(
                f"The tensor-parallel plan ({source}) names {pattern!r}, which matches no module of"
                f" `{type(module).__name__}`: plan keys are module names relative to it (e.g. {names[:3]}), with `*`"
                " for one level of the name."
            )
        resolved = style if isinstance(style, ParallelStyle) else style_from_name(str(style), entry=pattern)
        styles.update(dict.fromkeys(matched, resolved))
    return styles


def check_divisible(module: nn.Module, plan: TensorParallelPlan, tensor_parallel_size: int) -> None:
    """Local. ``ValueError`` naming the sizes when ``tensor_parallel_size`` does not divide a head count of the plan
    or a dimension it splits (a ``Linear``'s output features under a column split, input features under a row split;
    an embedding's rows or columns): every rank must hold whole heads and equal slices."""
    t = tensor_parallel_size
    for what, count in plan.head_counts:
        if count % t:
            raise ValueError(
                f"`tensor_parallel_size={t}` does not divide {what} = {count}: each tensor rank must hold whole"
                f" attention heads. Use a tensor_parallel_size that divides {count}."
            )
    for name, style in plan.styles.items():
        dims = _split_dimension(module.get_submodule(name), style)
        if dims is not None and dims[1] % t:
            raise ValueError(
                f"`tensor_parallel_size={t}` does not divide the {dims[1]} {dims[0]} of {name!r}, which the"
                f" tensor-parallel plan ({plan.source}) splits: use a tensor_parallel_size that divides {dims[1]}."
            )


def _split_dimension(layer: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """``(what, size)`` of the dimension ``style`` splits in ``layer`` (``None``: not a column or row split)."""
    if isinstance(layer, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return "output features", layer.out_features
        if isinstance(style, RowwiseParallel):
            return "input features", layer.in_features
    if isinstance(layer, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return "embedding features", layer.embedding_dim
        if isinstance(style, RowwiseParallel):
            return "embedding rows (vocabulary)", layer.num_embeddings
    return None
