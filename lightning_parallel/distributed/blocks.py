"""The blocks of a model: what ZeRO-3 shards as one FSDP2 unit each, what ``activation_checkpointing=True``
recomputes, and what ZeRO-1/2's overlapped all-gather waits for block by block.

:func:`find_blocks` looks at each part of the model in turn (outermost first) and takes the first rule that applies:

1. **Declared blocks.** A module that declares ``_no_split_modules`` (Hugging Face's ``PreTrainedModel``: a list of
   class *names*, ``["LlamaDecoderLayer"]``; the convention accelerate's ``device_map`` and FSDP auto-wrapping use)
   gets as blocks the instances of the declared classes (or of their subclasses) inside it, the outermost where they
   nest. The names are
   collected over the declaring module's submodules that declare them too, as accelerate does, so a composite model
   (a vision tower inside a language model) counts the blocks its parts declare. A declared block counts whether it
   is trainable or frozen (a frozen tower is sharded all the same); a declared name with no instance is ignored, and
   a model whose names match nothing falls back to rule 2. Read duck-typed: transformers is never imported.
2. **Repeated blocks.** Elsewhere, in every ``ModuleList``/``Sequential`` whose children hold a trainable parameter:

   * all children, when they are all of one class and there are >= 2 of them (transformer blocks; a list of
     ``nn.Linear`` layers counts too: its author made them the model's layers);
   * in a container that mixes classes (``nn.Sequential(stem, *blocks, head)``, ``nn.ModuleList([*blocks, head])``),
     the children of each class with >= 2 children that have submodules of their own. The other children are left
     to the surrounding unit. Single layers (``nn.Linear``, ``nn.LayerNorm``, ...) never count in a mix, so the two
     ``nn.Linear`` of an MLP written ``nn.Sequential(Linear, ReLU, Linear)`` are not cut apart: sharding or
     recomputing one linear layer at a time saves nothing a block would not, and costs a collective (ZeRO-3) per
     layer.

Blocks never nest (nothing inside a block is searched again) and come back in ``module.modules()`` order, which is
the order of the forward pass for the usual models.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["declared_block_names", "find_blocks", "outermost_modules"]


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of ``module`` (see the module docstring), in ``module.modules()`` order; never ``module`` itself."""
    position = {id(m): index for index, m in enumerate(module.modules())}
    blocks: list[nn.Module] = []
    done: set[int] = set()  # modules inside a block, or inside a model whose blocks are declared
    for sub in module.modules():  # pre-order: a parent comes before its children
        if id(sub) in done:
            continue
        declared = _declared_blocks(sub, root=module)
        if declared:
            blocks += declared
            done.update(id(m) for m in sub.modules())
        elif isinstance(sub, nn.ModuleList | nn.Sequential):
            repeated = _repeated_children(sub)
            blocks += repeated
            done.update(id(m) for block in repeated for m in block.modules())
    return sorted(blocks, key=lambda m: position[id(m)])


def declared_block_names(module: nn.Module) -> set[str]:
    """The class names ``module`` and its submodules declare in ``_no_split_modules`` (empty when none does)."""
    return {name for sub in module.modules() for name in _own_declaration(sub)}


def _own_declaration(module: nn.Module) -> set[str]:
    # transformers 4.x declares a class attribute list, 5.x a set on the instance (merged from its children in
    # `post_init`); anything else under that name (None, a non-string) declares nothing.
    value = getattr(module, "_no_split_modules", None)
    if not isinstance(value, list | tuple | set | frozenset):
        return set()
    return {name for name in value if isinstance(name, str)}


def _declared_blocks(model: nn.Module, *, root: nn.Module) -> list[nn.Module]:
    """The outermost instances of the classes ``model`` declares, holding parameters; empty when ``model`` itself
    declares nothing or none of its names has an instance."""
    if not _own_declaration(model):
        return []
    names = declared_block_names(model)
    found = [
        m for m in model.modules() if m is not model and m is not root and _is_named(m, names) and _has_parameters(m)
    ]
    return outermost_modules(model, found)


def _is_named(module: nn.Module, names: set[str]) -> bool:
    # Any class of its MRO: FSDP2 swaps a sharded block's class for `FSDP<Class>(FSDPModule, <Class>)`, and a second
    # `fit` of the same module must find the same blocks.
    return any(cls.__name__ in names for cls in type(module).__mro__)


def _repeated_children(container: nn.Module) -> list[nn.Module]:
    children = list(container.children())
    by_class: dict[type[nn.Module], list[nn.Module]] = {}
    for child in children:
        by_class.setdefault(type(child), []).append(child)
    mixed = len(by_class) > 1
    chosen: set[int] = set()
    for members in by_class.values():
        if len(members) < 2 or (mixed and not all(_has_submodules(m) for m in members)):
            continue
        if any(p.requires_grad for m in members for p in m.parameters()):
            chosen.update(id(m) for m in members)
    return [child for child in children if id(child) in chosen]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _has_submodules(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def outermost_modules(root: nn.Module, chosen: Iterable[nn.Module]) -> list[nn.Module]:
    """``chosen`` without the modules nested in another chosen one, in ``root.modules()`` order."""
    chosen_ids = {id(m) for m in chosen}
    result: list[nn.Module] = []
    inside: set[int] = set()
    for m in root.modules():  # pre-order: a parent comes before its children
        if id(m) in inside:
            continue
        if id(m) in chosen_ids:
            result.append(m)
            inside.update(id(sub) for sub in m.modules())
    return result
