"""Which configuration to recommend, and the ``Trainer(...)`` line that selects it.

With ``device_memory`` given, :func:`~lightning_parallel.planner.plan` recommends the cheapest layout that fits
over every option (:mod:`lightning_parallel.planner.search`). Without it, and when choosing among the table's rows,
the rule, in order (each step only among configurations that fit; all of them when no memory is given):

1. ``data_parallel`` when it fits: no sharding overhead, the least code in the way.
2. ``zero1``, then ``zero2``: the same bytes on the wire as data parallel (reduce-scatter + all-gather), less memory.
3. Within one node: ``zero3`` (1.5x data parallel's traffic, no bubble), else the pipeline with the fewest stages
   that fits. Across nodes: the pipeline with the fewest stages that fits first (point-to-point activations are
   far fewer bytes than ZeRO-3's per-step gathers over the slower links), then ``zero3``.
4. Nothing fits: the configuration with the smallest per-rank total, flagged as not fitting.
"""

from __future__ import annotations

from lightning_parallel.planner.estimate import ConfigEstimate

__all__ = ["recommend", "trainer_line"]


def recommend(configs: list[ConfigEstimate], *, num_nodes: int) -> ConfigEstimate | None:
    """Pick a configuration by the rule in this module's docstring (``None`` when ``configs`` is empty)."""
    if not configs:
        return None
    fitting = [c for c in configs if c.fits is not False]
    by_name = {c.name: c for c in fitting}
    for name in ("data_parallel", "zero1", "zero2"):
        if name in by_name:
            return by_name[name]
    pipelines = sorted((c for c in fitting if c.name.startswith("pipeline")), key=_pipeline_size)
    zero3 = [by_name["zero3"]] if "zero3" in by_name else []
    ordered = zero3 + pipelines if num_nodes == 1 else pipelines + zero3
    if ordered:
        return ordered[0]
    return min(configs, key=lambda c: c.max_total)


def _pipeline_size(config: ConfigEstimate) -> int:
    return int(config.name.split("pp=")[1].split(",")[0])


def trainer_line(config: ConfigEstimate, *, world_size: int, num_nodes: int, precision: str) -> str:
    """``Trainer(...)`` with the devices, nodes, precision and strategy of ``config``."""
    devices = world_size // num_nodes
    nodes = f", num_nodes={num_nodes}" if num_nodes > 1 else ""
    prec = "" if precision in ("32-true", "32") else f", precision={precision!r}"
    return f"Trainer(devices={devices}{nodes}, strategy={config.strategy}{prec})"
