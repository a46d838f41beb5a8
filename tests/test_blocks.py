"""Which modules are a model's blocks (lightning_parallel.distributed.blocks): ZeRO-3's FSDP2 units and what
``activation_checkpointing=True`` recomputes. One process, no Trainer: declared blocks (``_no_split_modules``, read
duck-typed as Hugging Face models declare them), repeated blocks in containers of one class, and in containers that
mix classes. Real Hugging Face models are in ``test_hf_models.py``."""

from __future__ import annotations

import pytest
from torch import Tensor, nn

from lightning_parallel.distributed.activation_checkpointing import checkpointed_modules
from lightning_parallel.distributed.blocks import declared_block_names, find_blocks
from lightning_parallel.distributed.zero.stage3 import fsdp_units

WIDTH = 8


class Block(nn.Module):
    """A residual MLP block: submodules of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm(x))


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


def _names(root: nn.Module, modules: list[nn.Module]) -> list[str]:
    names = {id(m): name for name, m in root.named_modules()}
    return [names[id(m)] for m in modules]


def _holder(**children: nn.Module) -> nn.Module:
    """What the strategies shard: the LightningModule holding the network as a child."""
    holder = nn.Module()
    for name, child in children.items():
        holder.add_module(name, child)
    return holder


# ---------------------------------------------------------------------------------------------- repeated blocks
def test_a_sequential_mixing_classes_gives_its_repeated_blocks() -> None:
    """`nn.Sequential(stem, *blocks, head)`: before, no unit (the whole container was gathered at once) and
    activation checkpointing refused the model."""
    model = _holder(net=nn.Sequential(Stem(), Block(), Block(), Block(), nn.Linear(WIDTH, 2)))
    assert _names(model, find_blocks(model)) == ["net.1", "net.2", "net.3"]
    # The stem and the head stay with the container, sharded as one unit after the blocks (FSDP2: inner first).
    assert _names(model, fsdp_units(model)) == ["net.1", "net.2", "net.3", "net"]
    assert _names(model, checkpointed_modules(model, True)) == ["net.1", "net.2", "net.3"]


def test_a_module_list_mixing_classes_gives_its_repeated_blocks() -> None:
    model = _holder(layers=nn.ModuleList([Block(), Block(), nn.Linear(WIDTH, 2)]), out=nn.Linear(2, 2))
    assert _names(model, find_blocks(model)) == ["layers.0", "layers.1"]
    # A ModuleList has no forward of its own: its other children become units one by one.
    assert _names(model, fsdp_units(model)) == ["layers.0", "layers.1", "layers.2", "out"]


def test_single_layers_in_a_mix_are_not_blocks() -> None:
    """The two Linear of an MLP (`Linear, ReLU, Linear`) are layers, not repeated blocks: in a container mixing
    classes only modules with submodules count, so the MLP is not cut into one unit per layer."""
    mlp = _holder(mlp=nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)))
    assert find_blocks(mlp) == []
    assert _names(mlp, fsdp_units(mlp)) == ["mlp"]
    with pytest.raises(ValueError, match="found no blocks in `Module`") as error:
        checkpointed_modules(mlp, True)
    # The message states the rule the code applies, including why this model does not satisfy it.
    assert "no submodule declares `_no_split_modules`" in str(error.value)
    assert "children with submodules of their own: single layers such as Linear do not count" in str(error.value)
    # Nor do single layers beside the blocks (two Linear around them): only the blocks are taken.
    model = _holder(net=nn.Sequential(nn.Linear(3, WIDTH), Block(), Block(), nn.Linear(WIDTH, 2)))
    assert _names(model, find_blocks(model)) == ["net.1", "net.2"]


def test_containers_of_one_class_keep_the_previous_rule() -> None:
    """All children of one class, >= 2 of them, any trainable: blocks, single layers included (a list of Linear
    is its author's list of layers)."""
    linears = _holder(layers=nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    assert _names(linears, find_blocks(linears)) == ["layers.0", "layers.1", "layers.2"]
    frozen = _holder(layers=nn.ModuleList(Block() for _ in range(2)))
    frozen.requires_grad_(False)
    assert find_blocks(frozen) == []  # nothing to train: not blocks (a declared block would still count, below)
    one = _holder(layers=nn.ModuleList([Block()]))
    assert find_blocks(one) == []


def test_blocks_do_not_nest_and_come_in_module_order() -> None:
    """A block's own containers are not searched again; blocks of a container found later in the walk (inside
    the stem) still come back in module order."""
    stem = nn.Sequential(Block(), Block())  # one class: both blocks
    model = _holder(net=nn.Sequential(stem, Block(), Block()))  # Sequential + 2 Block: the two Block
    found = _names(model, find_blocks(model))
    assert found == ["net.0.0", "net.0.1", "net.1", "net.2"]
    assert all(".mlp" not in name for name in found)


# ---------------------------------------------------------------------------------------------- declared blocks
class Layer(nn.Module):
    """A decoder layer of a declaring model, not held in any container."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()


class Declaring(nn.Module):
    """A model that declares its blocks as Hugging Face's PreTrainedModel does (a class attribute list)."""

    _no_split_modules = ["Layer", "NotInThisModel"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, WIDTH)
        self.first, self.second = Layer(), Layer()
        # Repeated, but not declared: inside a declaring model only its declaration counts.
        self.heads = nn.ModuleList(Block() for _ in range(2))


def test_declared_blocks_are_the_instances_of_the_named_classes() -> None:
    model = _holder(model=Declaring(), extra=nn.ModuleList(Block() for _ in range(2)))
    # The declaring model's blocks by name (the undeclared repeated `heads` are not), the repeated rule elsewhere;
    # a declared name without an instance ("NotInThisModel") is ignored.
    assert _names(model, find_blocks(model)) == ["model.first", "model.second", "extra.0", "extra.1"]
    assert _names(model, checkpointed_modules(model, True)) == ["model.first", "model.second", "extra.0", "extra.1"]
    assert declared_block_names(model) == {"Layer", "NotInThisModel"}


def test_declared_blocks_count_frozen_and_names_declared_by_parts() -> None:
    """A frozen declared block is still sharded by itself; names come from every declaring submodule (a vision
    tower declaring its own layers inside a declaring language model), as accelerate collects them."""

    class Tower(nn.Module):
        _no_split_modules = {"Block"}  # transformers 5 stores a set

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

    outer = Declaring()
    outer.tower = Tower()
    outer.requires_grad_(False)
    model = _holder(model=outer)
    names = _names(model, find_blocks(model))
    # Outermost instances: the Blocks inside each Layer are not taken again, the tower's and the heads' are.
    tower = ["model.tower.layers.0", "model.tower.layers.1"]
    assert names == ["model.first", "model.second", "model.heads.0", "model.heads.1", *tower]


def test_a_declaration_matching_nothing_falls_back_to_repeated_blocks() -> None:
    model = _holder(net=nn.Sequential(Stem(), Block(), Block()))
    model.net._no_split_modules = ["GPT2Block"]  # type: ignore[assignment]
    assert _names(model, find_blocks(model)) == ["net.1", "net.2"]
    # And declarations that are not lists of names declare nothing.
    model.net._no_split_modules = None  # type: ignore[assignment]
    assert _names(model, find_blocks(model)) == ["net.1", "net.2"]


def test_the_root_is_never_a_block() -> None:
    model = Declaring()
    model._no_split_modules = ["Declaring", "Layer"]  # type: ignore[assignment]
    assert _names(model, find_blocks(model)) == ["first", "second"]
