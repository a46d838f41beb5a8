"""Pipeline layers from a model's own declaration: transformers' ``base_model_pp_plan`` and the head's ``_pp_plan``.

Torch-only: transformers is never imported here (duck typing on the attributes a ``PreTrainedModel`` has), so the
package works without it. A Hugging Face model declares how it pipelines: the base model's children in order
(``{"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states", "attention_mask"],
["hidden_states"]), "norm": (...)}``) and the head's (``{"lm_head": (["hidden_states"], ["logits"])}``). A
LightningModule that holds such a model and defines no ``pipeline_layers()`` is split along that declaration:

* layer 0, the **prologue**: the declared modules before the blocks (the embedding), run through the base model's
  own ``forward`` up to its first block, so whatever ``forward`` does there (GPT-NeoX's embedding dropout, Gemma's
  scaling) happens as on one device;
* one layer per **block** of the declared ``ModuleList``;
* the **epilogue**: the declared modules after the blocks (the final norm) and the head's (``lm_head``), run through
  the model's own ``forward`` from its last block on, so what it does to the logits (Gemma's soft-capping, Cohere's
  scale) happens too.

Only hidden states cross stages. What ``forward`` computes *around* its blocks (the causal mask, rotary position
embeddings, position ids; per block where a model gives blocks different masks) is recomputed on every stage by
:class:`BlockInputs`: the base model's own ``forward`` runs with every block swapped for a recorder, on an input of
the right shape and dtype, and stops after the last block. Each stage therefore computes exactly the keyword
arguments ``forward`` would give its blocks, with the model's own code, for any model following the convention.
Modules outside every layer (the rotary embedding: buffers only) stay on every rank.

The user's step calls the model as usual, ``self.model(input_ids=ids, labels=ids).loss``: :class:`DeclaredPlanCall`
answers that call on the last stage with the model's own output type, the loss computed by the model's own
``loss_function`` from the pipeline's logits and the micro-batch's ``labels``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.contract import ModelCall
from lightning_parallel.distributed.pipeline.layer_registration import resolve_pipeline_layers

__all__ = [
    "BlockInputs",
    "DeclaredPlan",
    "DeclaredPlanCall",
    "declared_plan_layers",
    "find_declared_plan",
    "pipeline_layers_and_call",
]

_HEAD_ONLY = ("labels", "logits_to_keep", "num_items_in_batch")
"""Arguments of a causal-LM call that only the head uses: never sent through the stages."""
_REFUSED = ("inputs_embeds", "past_key_values")
_UNSUPPORTED_FLAGS = ("use_cache", "output_hidden_states", "output_attentions")


@dataclass(frozen=True)
class DeclaredPlan:
    """How a model declares its pipeline split."""

    model: nn.Module
    """The model the step calls (``LlamaForCausalLM``, or a base model such as ``LlamaModel``)."""
    base: nn.Module
    """``model.base_model`` (the module whose ``forward`` runs the blocks)."""
    pre: tuple[str, ...]
    """Children of ``base`` declared before the blocks (``("embed_tokens",)``)."""
    blocks: str
    """The child of ``base`` that is the ``ModuleList`` of blocks (``"layers"``)."""
    post: tuple[str, ...]
    """Children of ``base`` declared after the blocks (``("norm",)``)."""
    head: tuple[str, ...]
    """Children of ``model`` declared by its head plan (``("lm_head",)``); empty for a base model."""

    @property
    def is_causal_lm(self) -> bool:
        return bool(self.head)

    def __deepcopy__(self, memo: dict[int, Any]) -> DeclaredPlan:
        # A layer copied for timing (`partition="measured"`) keeps pointing at the one model: copying the plan would
        # copy the whole model once per layer.
        return self


def find_declared_plan(module: nn.Module) -> DeclaredPlan | None:
    """The outermost submodule of ``module`` that declares a pipeline plan (``supports_pp_plan``), as a plan.

    Returns ``None`` when no submodule declares one.

    Raises:
        ValueError: If two separate models declare plans, or the declaration does not describe the model (a plan
            naming a missing child, no ``ModuleList`` of blocks, a head that is not declared).
    """
    found: list[nn.Module] = []
    for submodule in module.modules():
        if _declares_plan(submodule) and not any(_contains(outer, submodule) for outer in found):
            found.append(submodule)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(type(m).__name__ for m in found)
        raise ValueError(
            f"`{type(module).__name__}` holds several models that declare a pipeline plan ({names}); which one the"
            " pipeline should split is ambiguous. Define `pipeline_layers()` to say it."
        )
    return _plan_of(found[0])


def _declares_plan(module: nn.Module) -> bool:
    # Only a model whose class says it (transformers' `PreTrainedModel.supports_pp_plan` property): a wrapper that
    # forwards unknown attributes to the model it wraps (PEFT's `PeftModel` -> `LoraModel` -> the transformers
    # model, through `__getattr__`) would answer `True` too, and its plan would be looked up on the wrapper. The
    # wrapper's forward still runs: it calls the model, and that call is the one the pipeline answers.
    if inspect.getattr_static(module, "supports_pp_plan", None) is None:
        return False
    try:
        return getattr(module, "supports_pp_plan", False) is True and isinstance(
            getattr(module, "base_model", None), nn.Module
        )
    except Exception:  # a property of another library failing on a module it does not know
        return False


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _plan_of(model: nn.Module) -> DeclaredPlan:
    base: nn.Module = model.base_model  # type: ignore[assignment]
    name = type(model).__name__
    declared = dict(getattr(base, "_pp_plan", None) or getattr(model.config, "base_model_pp_plan", None) or {})
    children = dict(base.named_children())
    missing = [key for key in declared if key not in children]
    lists = [key for key in declared if isinstance(children.get(key), nn.ModuleList)]
    if missing or len(lists) != 1:
        problem = f"names {missing}, which it does not have" if missing else f"has {len(lists)} ModuleLists of blocks"
        raise ValueError(
            f"`{name}` declares the pipeline plan {list(declared)} for `{type(base).__name__}`, which {problem};"
            " PipelineParallelStrategy needs one ModuleList of blocks among the declared children. Define"
            " `pipeline_layers()` in your LightningModule instead."
        )
    keys = list(declared)
    position = keys.index(lists[0])
    head: tuple[str, ...] = ()
    if model is not base:
        head_plan = dict(getattr(type(model), "_pp_plan", None) or {})
        outputs = [outs for _, outs in head_plan.values()]
        if not head_plan or any(list(outs) != ["logits"] for outs in outputs) or any("." in k for k in head_plan):
            raise ValueError(
                f"`{name}` declares a pipeline plan for its base model `{type(base).__name__}` but not one this"
                f" strategy can run for its head (`_pp_plan={head_plan or None}`; supported: modules mapping"
                " hidden states to `logits`, as causal language models declare). Define `pipeline_layers()` in your"
                " LightningModule, or pipeline the base model and put the head in your step."
            )
        head = tuple(head_plan)
    return DeclaredPlan(
        model=model,
        base=base,
        pre=tuple(keys[:position]),
        blocks=lists[0],
        post=tuple(keys[position + 1 :]),
        head=head,
    )


# ---------------------------------------------------------------------------------------------- block inputs
class _StopAfterLastBlock(Exception):
    pass


_Records = dict[int, tuple[tuple[Any, ...], dict[str, Any]]]


class _BlockRecorder(nn.Module):
    """Stands in for block ``index`` while a declared model's ``forward`` runs around the pipeline: records the
    block's arguments and passes the hidden states through; the last one stops ``forward`` there, or returns the
    stage's real hidden states (``final``) so that ``forward`` goes on with them. Attribute reads fall back to the
    real block (``decoder_layer.attention_type``)."""

    def __init__(self, index: int, block: nn.Module, records: _Records, *, is_last: bool, final: Tensor | None):
        super().__init__()
        self.index, self.records, self.is_last, self.final = index, records, is_last, final
        object.__setattr__(self, "_block", block)  # not a child: the recorder must not own the block's tensors

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        self.records[self.index] = ((hidden_states, *args), kwargs)
        if not self.is_last:
            return hidden_states
        if self.final is None:
            raise _StopAfterLastBlock
        return self.final

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)


def run_around_blocks(
    plan: DeclaredPlan,
    root: nn.Module,
    blocks: Sequence[nn.Module],
    records: _Records,
    inputs: Mapping[str, Tensor],
    side: Mapping[str, Tensor],
    *,
    final: Tensor | None = None,
) -> Any:
    """``root(**inputs, **side)`` (the base model or the whole model) with every block swapped for a recorder.

    Without ``final`` it stops after the last block (``None`` is returned); with ``final`` the last block returns
    it and ``forward`` finishes (its output is returned: what the model computes after its blocks, with the
    stage's hidden states). Declared modules before the blocks are skipped when ``inputs`` has no ``input_ids``
    (they live on the first stage; ``forward`` then starts from ``inputs_embeds``). Everything is put back after.

    Raises:
        RuntimeError: If ``forward`` does not call every declared block.
    """
    container = cast(nn.ModuleList, plan.base.get_submodule(plan.blocks))
    originals = list(container)
    count = len(blocks)
    recorders = [
        _BlockRecorder(i, block, records, is_last=i == count - 1, final=final) for i, block in enumerate(blocks)
    ]
    replaced = {name: plan.base.get_submodule(name) for name in plan.pre if "input_ids" not in inputs}
    output = None
    try:
        for i, recorder in enumerate(recorders):
            container[i] = recorder
        for name in replaced:
            setattr(plan.base, name, nn.Identity())
        try:
            output = root(**inputs, **side, use_cache=False)
        except _StopAfterLastBlock:
            pass
    finally:
        for i, original in enumerate(originals):
            container[i] = original
        for name, original in replaced.items():
            setattr(plan.base, name, original)
    if len(records) != count:
        raise RuntimeError(
            f"`{type(root).__name__}.forward` called {len(records)} of its {count} declared blocks; the pipeline"
            " needs every block called once, in order. Define `pipeline_layers()` in your LightningModule instead."
        )
    return output


class BlockInputs:
    """What the base model's ``forward`` gives each block, recomputed on any stage from the batch's shape.

    The base model's own ``forward`` runs with every block replaced by a :class:`_BlockRecorder` (and stops after
    the last one); on the first stage from the ``input_ids`` (the real embedding runs: the recorded input of block 0
    is the prologue's output), on a later stage from ``inputs_embeds`` of the received hidden states' shape in the
    embedding's dtype, as on one device. The keyword arguments are detached (no parameter is involved in them:
    every parameter belongs to a pipeline layer) and cached for the last input seen, so the blocks of one stage
    compute them once per micro-batch.
    """

    def __init__(self, plan: DeclaredPlan, blocks: Sequence[nn.Module], embedding_dtype: torch.dtype) -> None:
        self.plan = plan
        self.blocks = list(blocks)  # the real blocks (on `meta` where another rank runs them): attribute reads
        self.embedding_dtype = embedding_dtype
        self._key: tuple[Any, ...] | None = None
        self._kept: tuple[Any, ...] = ()  # the key's tensors, alive while cached (their ids stay theirs)
        self._calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockInputs:
        return self  # shared by a layer's copy (see `DeclaredPlan.__deepcopy__`): it reads the model, holds no weights

    def for_block(
        self, index: int, hidden_states: Tensor, side: Mapping[str, Tensor]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments besides the hidden states that ``forward`` gives block ``index`` for a micro-batch with
        these hidden states: ``(positional, keyword)``."""
        if self._key_of(hidden_states, side) != self._key:
            inputs_embeds = hidden_states.new_zeros(tuple(hidden_states.shape), dtype=self.embedding_dtype)
            self.run(side, inputs_embeds=inputs_embeds)
        return self._calls[index]

    def run(self, side: Mapping[str, Tensor], **inputs: Tensor) -> Tensor:
        """Run the base model's ``forward`` (from ``input_ids`` or ``inputs_embeds``) up to its last block; cache
        every block's other arguments; return the hidden states block 0 receives.

        Also under the FLOP count before the split, whose fake parameters make the embedding's output fake: the
        arguments ``forward`` builds from the shapes (position ids, masks) stay real, so its checks on them run.
        """
        first = self._record(side, inputs)
        self._key = self._key_of(first, side)
        self._kept = tuple(side.values())
        return first

    def _record(self, side: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Tensor:
        records: _Records = {}
        run_around_blocks(self.plan, self.plan.base, self.blocks, records, inputs, side)
        self._calls = [
            apply_to_collection((records[i][0][1:], records[i][1]), Tensor, Tensor.detach) for i in range(len(records))
        ]
        return records[0][0][0]

    @staticmethod
    def _key_of(hidden_states: Tensor, side: Mapping[str, Tensor]) -> tuple[Any, ...]:
        # The type tells real from fake tensors (FLOP counting runs the layers on fake ones); side inputs by identity
        # (their values shape the mask), held alive in `_kept` while cached so that no other tensor takes their id.
        kind = (type(hidden_states), tuple(hidden_states.shape), hidden_states.device)
        return (*kind, tuple((name, id(t)) for name, t in sorted(side.items())))


# ---------------------------------------------------------------------------------------------- the layers
class _Prologue(nn.Module):
    """Layer 0: the declared modules before the blocks, through the base model's ``forward`` (input ids -> the
    hidden states block 0 receives)."""

    def __init__(self, plan: DeclaredPlan, inputs: BlockInputs) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({name: plan.base.get_submodule(name) for name in plan.pre})
        object.__setattr__(self, "_inputs", inputs)

    def forward(self, input_ids: Tensor, **side: Tensor) -> Tensor:
        inputs: BlockInputs = object.__getattribute__(self, "_inputs")
        return inputs.run(side, input_ids=input_ids).contiguous()


class _Block(nn.Module):
    """One declared block, called with the keyword arguments ``forward`` would give it."""

    def __init__(self, index: int, block: nn.Module, inputs: BlockInputs) -> None:
        super().__init__()
        self.index, self.block = index, block
        object.__setattr__(self, "_inputs", inputs)

    def forward(self, hidden_states: Tensor, **side: Tensor) -> Tensor:
        inputs: BlockInputs = object.__getattribute__(self, "_inputs")
        args, kwargs = inputs.for_block(self.index, hidden_states, side)
        output = self.block(hidden_states, *args, **kwargs)
        return output[0] if isinstance(output, tuple) else output


class _Epilogue(nn.Module):
    """The last layer: the declared modules after the blocks (the final norm) and of the head (``lm_head``), run
    through the model's own ``forward`` from the last block on, so whatever it does there (Gemma's logit soft-capping,
    Cohere's logit scale) happens as on one device. Hidden states in; logits (a base model: the last hidden states)
    out."""

    def __init__(self, plan: DeclaredPlan, inputs: BlockInputs) -> None:
        super().__init__()
        parts = {name: plan.base.get_submodule(name) for name in plan.post}
        parts.update({f"head.{name}": plan.model.get_submodule(name) for name in plan.head})
        self.parts = nn.ModuleDict({name.replace(".", "_"): part for name, part in parts.items()})
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_inputs", inputs)

    def forward(self, hidden_states: Tensor, **side: Tensor) -> Tensor:
        plan: DeclaredPlan = object.__getattribute__(self, "_plan")
        inputs: BlockInputs = object.__getattribute__(self, "_inputs")
        zeros = hidden_states.new_zeros(tuple(hidden_states.shape), dtype=inputs.embedding_dtype)
        output = run_around_blocks(
            plan, plan.model, inputs.blocks, {}, {"inputs_embeds": zeros}, side, final=hidden_states
        )
        return output.logits if plan.is_causal_lm else output.last_hidden_state


def declared_plan_layers(plan: DeclaredPlan) -> list[nn.Module]:
    """The pipeline layers of ``plan``: the prologue, one per block, and the epilogue (final norm and head).

    The layers are adapters around the model's own modules (not registered anywhere themselves), so the
    LightningModule keeps its own parameter names: checkpoints load with ``load_from_checkpoint`` and the model
    round-trips through ``save_pretrained``/``from_pretrained``.
    """
    blocks = list(cast(nn.ModuleList, plan.base.get_submodule(plan.blocks)))
    embedding = next((p for name in plan.pre for p in plan.base.get_submodule(name).parameters()), None)
    dtype = embedding.dtype if embedding is not None else torch.get_default_dtype()
    inputs = BlockInputs(plan, blocks, dtype)
    layers: list[nn.Module] = [_Prologue(plan, inputs)]
    layers += [_Block(index, block, inputs) for index, block in enumerate(blocks)]
    layers.append(_Epilogue(plan, inputs))
    return layers


# ---------------------------------------------------------------------------------------------- the model call
class DeclaredPlanCall(ModelCall):
    """The step's call of the declared model (``self.model(input_ids=ids, labels=ids)``), answered by the pipeline.

    The pipeline's input is the call's ``input_ids`` (positional) and its other tensor arguments the base model
    takes (``attention_mask``, ``position_ids``, ...: side inputs every stage receives). ``labels`` and the other
    head-only arguments stay on the last stage: the answer is the model's own output type with ``logits`` from the
    pipeline and ``loss = model.loss_function(logits, labels, vocab_size)``, as the model computes it.
    """

    def __init__(self, plan: DeclaredPlan) -> None:
        super().__init__(plan.model)
        self.plan = plan
        self._signature = inspect.signature(plan.model.forward)
        base_parameters = inspect.signature(plan.base.forward).parameters
        self._base_names = {
            name
            for name, p in base_parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(
                f"`{type(self.target).__name__}(...)` was called with unexpected arguments: {error}"
            ) from error
        arguments = dict(bound.arguments)
        for name, parameter in self._signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:  # the forward's `**kwargs`: flattened
                arguments.update(arguments.pop(name, {}))
        return arguments

    def model_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        arguments = self._bind(args, kwargs)
        name = type(self.target).__name__
        refused = [key for key in _REFUSED if arguments.get(key) is not None]
        if refused or not isinstance(arguments.get("input_ids"), Tensor):
            what = f"`{refused[0]}`" if refused else "no `input_ids` tensor"
            raise ValueError(
                f"The step called `{name}` with {what}; PipelineParallelStrategy splits a declared model from its"
                " `input_ids` (the first stage embeds them) and trains without a key-value cache. Pass"
                " `input_ids=...` (and optionally `attention_mask`, `position_ids`, `labels`)."
            )
        flags = [key for key in _UNSUPPORTED_FLAGS if arguments.get(key)]
        if flags:
            raise ValueError(
                f"The step called `{name}` with `{flags[0]}=True`, which PipelineParallelStrategy does not support for"
                " a declared model: only the hidden states cross stages, so the answer holds `loss` and `logits`"
                " (no cache, no per-layer hidden states or attentions). Remove the argument, or define"
                " `pipeline_layers()`."
            )
        side = {
            key: value
            for key, value in arguments.items()
            if isinstance(value, Tensor) and key != "input_ids" and key in self._base_names and key not in _HEAD_ONLY
        }
        return (arguments["input_ids"],), side

    def answer(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        arguments = self._bind(args, kwargs)
        plan = self.plan
        if not plan.is_causal_lm:
            return _output_class("BaseModelOutputWithPast")(last_hidden_state=output)
        logits = output
        keep = arguments.get("logits_to_keep", 0)
        if isinstance(keep, int) and keep > 0:
            logits = logits[:, -keep:, :]
        elif isinstance(keep, Tensor):
            logits = logits[:, keep, :]
        loss = None
        labels = arguments.get("labels")
        if labels is not None:
            extra = {k: v for k, v in arguments.items() if k == "num_items_in_batch"}
            model: Any = plan.model  # a transformers model: `loss_function` and `config` are its own
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **extra)
        result = _output_class("CausalLMOutputWithPast")(loss=loss, logits=logits)
        if arguments.get("return_dict") is False:
            return result.to_tuple()
        return result

    def reference(self, *args: Any, **kwargs: Any) -> Tensor:
        """``forward``'s result for the pipeline's input (what the chain of layers must give): logits, or the last
        hidden states of a base model."""
        output = self.target(input_ids=args[0], **kwargs, use_cache=False)
        return output.logits if self.plan.is_causal_lm else output.last_hidden_state


def _output_class(name: str) -> Any:
    # The model is a transformers model, so transformers is importable; imported here so this package never needs it.
    from transformers import modeling_outputs

    return getattr(modeling_outputs, name)


def pipeline_layers_and_call(module: nn.Module) -> tuple[list[nn.Module], ModelCall]:
    """The pipeline layers of ``module`` and the call of its steps that the pipeline answers.

    ``pipeline_layers()`` when the module defines it (its steps call ``self(...)``); otherwise the layers of the model
    it holds that declares a plan (its steps call that model, ``self.model(...)``).

    Raises:
        TypeError: If the module defines neither (the message says both ways).
        ValueError: As :func:`~.layer_registration.resolve_pipeline_layers` and :func:`find_declared_plan`.
    """
    if not callable(getattr(module, "pipeline_layers", None)):
        plan = find_declared_plan(module)
        if plan is not None:
            return declared_plan_layers(plan), DeclaredPlanCall(plan)
    return resolve_pipeline_layers(module), ModelCall(module)
