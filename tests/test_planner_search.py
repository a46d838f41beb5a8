"""The search when nothing in the table fits (issue 35, item 2), and the pipeline rows at batch 1 (item 1's last
point): fast, on the demo's "small" preset."""

from __future__ import annotations

import pytest

from lightning_parallel.planner import plan
from lightning_parallel.planner.search import shard_sizes

OPTIONS = {"world_size": 4, "num_nodes": 2, "precision": "bf16-mixed", "batch_size": 16, "seq_len": 128}


def test_nothing_fits_is_said_first_then_the_cheapest_fit_is_named() -> None:
    smallest = {mode: min(c.max_total for c in plan("small", **OPTIONS, activation_checkpointing=mode).configurations)
                for mode in ("none", "full")}  # fmt: skip
    assert smallest["full"] < smallest["none"]
    memory = (smallest["full"] + smallest["none"]) // 2  # fits only with checkpointing
    result = plan("small", **OPTIONS, device_memory=memory)
    assert result.table_fits is False and result.closest is not None
    chosen = result.recommended
    assert chosen is not None and chosen.fits and chosen.max_total <= memory
    assert chosen.checkpointing in ("selective", "full") and result.num_searched > len(result.configurations)
    text = str(result)
    assert text.index("Nothing in the table fits") < text.index("the cheapest that fits") < text.index("Recommended:")
    assert f"Recommended: {chosen.name}, {chosen.checkpointing} activation checkpointing (fits:" in text
    argument = {"full": "activation_checkpointing=True", "selective": 'activation_checkpointing="selective"'}
    assert argument[chosen.checkpointing] in (result.trainer_line or "")
    assert "applied in the model" not in text


@pytest.mark.parametrize(("mode", "argument"), [("full", True), ("selective", "selective")])
def test_the_strategy_lines_pass_the_checkpointing_mode(mode: str, argument: object) -> None:
    """Every row's ``Trainer(strategy=...)`` value builds the strategy with the mode the row assumes, registry names
    included (none of them: a mode needs the constructor)."""
    import lightning_parallel

    result = plan("small", **OPTIONS, activation_checkpointing=mode)  # no device memory: no search, the table
    names = {name: getattr(lightning_parallel, name) for name in lightning_parallel.__all__}
    lines = {config.name: config.strategy for config in result.configurations}
    assert any("shard_size=" in line for line in lines.values()) and any("Pipeline" in line for line in lines.values())
    for name, line in lines.items():
        strategy = eval(line, names)  # our own line, evaluated: it builds the strategy
        assert strategy.activation_checkpointing == argument, name
    assert f"activation_checkpointing={argument!r}".replace("'", '"') in (result.trainer_line or "")


def test_nothing_fits_anywhere_is_flagged() -> None:
    result = plan("small", **OPTIONS, device_memory=2**20)
    assert result.recommended is not None and result.recommended.fits is False
    assert "NOTHING FITS" in str(result)


def test_a_roomy_device_needs_no_checkpointing() -> None:
    result = plan("small", **OPTIONS, device_memory=2**40)
    assert result.table_fits and result.recommended is not None
    assert (result.recommended.name, result.recommended.checkpointing) == ("data_parallel", "none")


def test_pipeline_rows_at_batch_one_run_gpipe_with_one_microbatch() -> None:
    result = plan("small", world_size=4, batch_size=1, seq_len=128)
    pp2 = result.configuration("pipeline pp=2, dp=2")
    assert "num_microbatches=1, schedule='GPipe'" in pp2.strategy
    assert pp2.bubble == pytest.approx(1 / 2)
    assert any("batch 1 < 2 stages" in note for note in pp2.notes)
    assert "pipeline pp=4, dp=1" in [c.name for c in result.configurations]


def test_shard_groups_are_node_aligned() -> None:
    assert shard_sizes(64, 8) == [2, 4, 8, 16, 32]
    assert shard_sizes(12, 2) == [2, 3, 6]  # 4 straddles a node of 6
