"""Clipping over ranks through fixed subclasses of Lightning's precision plugins (``strategies/clipping.py``), built
from the Trainer's plugin through the public constructors; nothing assigned to the Trainer's plugin object."""

from __future__ import annotations

import pytest
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_parallel.strategies import clipping
from lightning_parallel.strategies.clipping import with_clipping, with_scaler

FIXED = {clipping.ClippingPrecision, clipping.ClippingDoublePrecision, clipping.ClippingHalfPrecision}
FIXED |= {clipping.ClippingMixedPrecision}

PLUGINS = {
    "32-true": Precision,
    "64-true": DoublePrecision,
    "bf16-true": lambda: HalfPrecision("bf16-true"),
    "16-true": lambda: HalfPrecision("16-true"),
    "bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
}


@pytest.mark.parametrize("precision", list(PLUGINS))
def test_a_fixed_class_per_lightning_precision(precision: str) -> None:
    plugin = PLUGINS[precision]()
    before = dict(vars(plugin))
    calls = []
    clipped = with_clipping(plugin, lambda optimizer, value: calls.append((optimizer, value)))
    assert type(clipped) in FIXED and isinstance(clipped, type(plugin)) and clipped is not plugin
    assert clipped.precision == plugin.precision
    assert vars(plugin) == before  # the Trainer's plugin is left as it is
    assert getattr(clipped, "scaler", None) is getattr(plugin, "scaler", None)
    clipped.clip_grad_by_norm("optimizer", 2)
    assert calls == [("optimizer", 2.0)]
    assert with_clipping(clipped, print) is clipped and clipped.clip_over_ranks is print  # a second fit


def test_a_sharded_scaler_through_the_constructor() -> None:
    plugin = MixedPrecision("16-mixed", "cpu")
    scaler = ShardedGradScaler(device="cpu")
    replaced = with_scaler(plugin, scaler)
    assert type(replaced) is MixedPrecision and replaced.scaler is scaler and plugin.scaler is not scaler
    clipped = with_scaler(with_clipping(plugin, print), scaler)
    assert type(clipped) is clipping.ClippingMixedPrecision
    assert clipped.scaler is scaler and clipped.clip_over_ranks is print
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    assert with_scaler(bf16, scaler) is bf16  # no scaler: nothing to replace


class CustomPrecision(Precision):
    """A user's own plugin class: no constructor we can call."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


class CustomScaled(MixedPrecision):
    pass


def test_a_plugin_class_we_do_not_know_gets_the_fallback_adapter() -> None:
    plugin = CustomPrecision(3.0)
    clipped = with_clipping(plugin, print)
    assert isinstance(clipped, CustomPrecision) and type(clipped) not in FIXED and clipped.factor == 3.0
    assert clipped.clip_over_ranks is print and "clip_over_ranks" not in vars(plugin)
    with pytest.raises(TypeError, match="CustomScaled"):
        with_scaler(CustomScaled("16-mixed", "cpu"), ShardedGradScaler(device="cpu"))
