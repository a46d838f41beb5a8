"""Pipeline 2 x 2 with ``zero_stage`` 0 / 1 / 2, and a tied against an untied GPT (issue 13's benchmark).

Both comparisons run through the shared harness (interleaved repeats, every fit measured by ``ParallelismMonitor``):

* **ZeRO inside the pipeline**: ``PipelineParallelStrategy(pipeline_parallel_size=2, zero_stage=z)`` on 4 processes
  (2 stages x 2 replicas), 1F1B; bytes held per rank (the worst) and throughput as a ratio of ``zero_stage=0``.
  Goal: throughput ratio >= 0.95.
* **Tied weights**: the demo GPT with its LM head tied to the token embedding (first and last stage hold a copy;
  one all-reduce of the tied gradient per step) against the untied one, 2 stages; goal: throughput ratio >= 0.97.

    python -m benchmarks.pipeline_zero [--preset tiny|small] [--repeats N]

Prints Markdown for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import lightning.pytorch as pl

from benchmarks.harness import Contender, Workload, compare, run_interleaved
from benchmarks.report import comparison_table, machine_description, outcome_table
from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPTLightningModule
from lightning_parallel.demos.main import quiet_lightning

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"preset": "tiny", "batch_size": 8, "seq_len": 32, "steps": 6, "warmup_steps": 2},
    "small": {"preset": "small", "batch_size": 16, "seq_len": 128, "steps": 12, "warmup_steps": 4},
}


def _zero(stage: int) -> Contender:
    return Contender(
        name=f"zero_stage={stage}",
        label=f"ours: pipeline 2x2, zero_stage={stage}",
        make_strategy=partial(
            PipelineParallelStrategy,
            start_method="fork",
            pipeline_parallel_size=2,
            num_microbatches=4,
            zero_stage=stage,
        ),
        is_ours=True,
    )


def _tied_gpt(workload: Workload) -> pl.LightningModule:
    module = GPTLightningModule(workload.preset, **workload.overrides)
    module.model.head.weight = module.model.embedding.token.weight  # GPT-2's tie: embedding = LM head
    return module


def _pipeline(name: str, label: str, **kwargs: Any) -> Contender:
    return Contender(
        name=name,
        label=label,
        make_strategy=partial(PipelineParallelStrategy, start_method="fork", num_microbatches=4),
        is_ours=True,
        **kwargs,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    quiet_lightning()
    settings = PRESETS[args.preset]
    zero_workload = Workload(devices=4, **settings)
    zero = run_interleaved([_zero(0), _zero(1), _zero(2)], zero_workload, repeats=args.repeats)
    tied_workload = Workload(devices=2, **settings)
    tied = run_interleaved(
        [
            _pipeline("tied", "ours: pipeline, tied GPT (embedding = LM head)", make_module=_tied_gpt),
            _pipeline("untied", "ours: pipeline, untied GPT"),
        ],
        tied_workload,
        repeats=args.repeats,
    )
    comparisons = [
        compare(zero["zero_stage=1"], zero["zero_stage=0"]),
        compare(zero["zero_stage=2"], zero["zero_stage=0"]),
    ]
    print(
        f"`python -m benchmarks.pipeline_zero --preset {args.preset} --repeats {args.repeats}`; {machine_description()}"
    )
    print(f"\nZeRO inside the pipeline: {zero_workload.describe()}; pipeline 2 stages x 2 replicas, 1F1B, m=4.\n")
    print(comparison_table(comparisons))
    print()
    print(outcome_table(zero.values()))
    print(f"\nTied weights: {tied_workload.describe()}; 2 stages, 1F1B, m=4.\n")
    print(comparison_table([compare(tied["tied"], tied["untied"])]))
    print()
    print(outcome_table(tied.values()))
    return 0


if __name__ == "__main__":
    # Through the imported module: every fit runs in a fresh process (benchmarks.isolation), which unpickles this
    # module's functions by their name, `benchmarks.pipeline_zero`, not `__main__`.
    from benchmarks import pipeline_zero

    sys.exit(pipeline_zero.main())
