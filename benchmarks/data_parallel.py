"""DataParallelStrategy against its anchor, Lightning's own DDPStrategy, side by side in interleaved repeats.

A third configuration, ours with ``gradient_compression="fp16"``, is compared with ours in fp32: the same steps for
exactly half the all-reduce bytes (wire bytes ratio 0.5). Ours and the anchor also run with a plain user callback
(``harness.UserTimingCallback``: overrides ``on_train_batch_end``, reads nothing), what a typical script gets.
"""

from __future__ import annotations

import sys
from functools import partial

from benchmarks.anchors import MeasuredDDPStrategy
from benchmarks.harness import Contender, PairedConfig, PairedResults, Workload, measure_pairs, with_user_callback
from benchmarks.report import load_notes, paired_blocks, section
from lightning_parallel.strategies import DataParallelStrategy

__all__ = ["CONTENDERS", "NAME", "PAIRS", "PRESETS", "Config", "DataParallelResults", "measure", "render"]

NAME = "data_parallel"

_OURS = Contender(
    name="ours",
    label="ours: DataParallelStrategy",
    make_strategy=partial(DataParallelStrategy, start_method="fork"),
    is_ours=True,
)
_DDP = Contender(name="lightning_ddp", label="anchor: Lightning DDPStrategy", make_strategy=MeasuredDDPStrategy)

CONTENDERS: tuple[Contender, ...] = (
    _OURS,
    _DDP,
    Contender(
        name="ours_fp16",
        label="ours: DataParallelStrategy(gradient_compression='fp16')",
        make_strategy=partial(DataParallelStrategy, start_method="fork", gradient_compression="fp16"),
        is_ours=True,
    ),
    # What a typical script gets: one plain callback that overrides `on_train_batch_end` and reads nothing.
    with_user_callback(_OURS),
    with_user_callback(_DDP),
)
PAIRS: tuple[tuple[str, str], ...] = (
    ("ours", "lightning_ddp"),
    ("ours_fp16", "ours"),
    ("ours_user_callback", "lightning_ddp_user_callback"),
)


Config = PairedConfig


PRESETS: dict[str, Config] = {
    "tiny": Config(
        workload=Workload(preset="tiny", steps=4, warmup_steps=2, batch_size=4, seq_len=32, time_throughput=False),
        repeats=1,
    ),
    # The default (`make bench`): 20.5 M parameters, 2 CPU ranks of 8 x 128 tokens; a step takes ~1.5-3 s per rank.
    # 10 measured steps per fit: with 5, one repeat's median moved by +-3% between runs of the same code (ours / DDP
    # 0.960-0.991 in one `make bench`, 0.997-1.048 with 10 by hand on the same commit).
    "medium": Config(workload=Workload(preset="gpt-20m", steps=14, warmup_steps=4)),
    "small": Config(workload=Workload(steps=20)),
    "large": Config(workload=Workload(preset="gpt-125m", steps=30, warmup_steps=5, seq_len=1024, accelerator="gpu")),
}


DataParallelResults = PairedResults


def measure(config: Config) -> DataParallelResults:
    return measure_pairs(CONTENDERS, PAIRS, config)


def render(results: DataParallelResults, *, command: str) -> str:
    return section(
        f"{NAME}: DataParallelStrategy vs Lightning's DDPStrategy",
        command=command,
        notes=[
            f"{results.config.workload.describe()}; {results.config.repeats} interleaved repeats.",
            *load_notes(results.outcomes.values()),
            "Both all-reduce through the library's counting hook (a Python DDP comm hook) while `ParallelismMonitor`"
            " measures them (one fit per configuration); tokens/s divides the global batch's tokens by the median step"
            " time of the slowest rank in fits without the monitor (a step clock callback only)."
            " DDP's all-reduce waits run inside autograd: the monitor cannot time its exposed communication.",
        ],
        blocks=paired_blocks(results.comparisons, results.outcomes.values()),
    )


if __name__ == "__main__":
    from benchmarks.run_all import main

    sys.exit(main(["--only", NAME, *sys.argv[1:]]))
