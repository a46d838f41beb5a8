"""``lightning-parallel plan``: the planner on the command line (``main(argv)`` returns the exit code)."""

from __future__ import annotations

import argparse
import re
import sys

from lightning_parallel.distributed.pipeline.schedule import SCHEDULE_SPECS
from lightning_parallel.planner.estimate import OPTIMIZER_STATES, PRECISION_BYTES
from lightning_parallel.planner.plan import plan

__all__ = ["main", "parse_memory"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20}
_UNITS.update({"g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40})


def parse_memory(text: str) -> int:
    """``"80GiB"`` -> bytes; decimal (GB) and binary (GiB) units, or plain bytes.

    Raises:
        ValueError: for anything else (the message shows valid examples).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read the memory size {text!r}: use e.g. '80GiB', '24GB', '16g' or a byte count.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-parallel plan",
        description="Predict memory per rank and bytes per step of every strategy for a model, and recommend one.",
    )
    parser.add_argument(
        "model",
        help="a preset (tiny, small, gpt-125m, gpt-350m, gpt-1.3b), a parameter count (350M, 1.3e9), a Hugging Face"
        " config.json or a directory holding one (local files only; gpt2, llama, mistral, qwen2, qwen3, gemma) or a"
        " LightningModule class path (package.module:Class, constructed without arguments on the meta device)",
    )
    parser.add_argument("--world-size", type=int, required=True, help="total number of devices (processes)")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines the devices are spread over")
    parser.add_argument("--device-memory", type=parse_memory, default=None, help="memory per device, e.g. 80GiB")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--precision", default="32-true", choices=sorted(PRECISION_BYTES))
    parser.add_argument("--batch-size", type=int, default=8, help="samples per batch of one data-parallel replica")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's longest)")
    parser.add_argument("--num-microbatches", type=int, default=None, help="pipeline micro-batches (default: stages)")
    parser.add_argument("--schedule", default="1F1B", choices=list(SCHEDULE_SPECS))
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="ZeRO-1/2 bucket size in MiB")
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default="none",
        metavar="{none,selective,full}",
        help="none (default); full (the bare flag: every transformer block recomputed in backward, the strategies'"
        " activation_checkpointing=True); selective (torchtitan's per-op policy: every other matmul output and the"
        " attention output kept)",
    )
    parser.add_argument(
        "--attention",
        default=None,
        metavar="{flash,math}",
        help="attention kernel: flash (flash / memory-efficient SDPA, no s^2 scores stored; the default) or math"
        " (softmax(q k^T) v written out, transformers' eager: the s^2 probabilities stored)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="measure each row's peak (a pipeline row: its largest pipeline rank, torch's schedule played) by running"
        " one training step of the model on fake"
        " tensors as one simulated rank (no memory, no data, no process group; seconds per row at any world size),"
        " instead of the activation formula: the 'peak (dry run)' column, used for 'fits' and the recommendation"
        " (within 1%% of the peak measured inside a Trainer in the tests; the step is played in Lightning's order)."
        " Pipeline rows with ZeRO-3 inside or uneven stages, 16-bit precisions, parameter counts and models that"
        " cannot run on fake tensors keep the"
        " formula ('formula' in that column). Needs transformers for a Hugging Face config.",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="above 1: one more row, ZeRO-3 with the model's tensor-parallel plan split over that many ranks"
        " (a LightningModule path with a tensor_parallel_plan() or a Hugging Face model inside)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-parallel plan`` with ``argv`` (without the program and ``plan`` words); return the exit code."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = plan(**vars(args))  # each option's dest is the keyword of `plan` it sets
    except ValueError as error:
        print(f"lightning-parallel plan: error: {error}", file=sys.stderr)
        return 2
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
