"""The RESULTS.md section of the ZeRO benchmark (:mod:`benchmarks.zero`): tables of medians and goals."""

from __future__ import annotations

import itertools
import statistics

from benchmarks.results import machine_description, markdown_table, today
from benchmarks.zero import DDP, NAME, OURS, ZERO_REDUNDANCY, RunConfig, ZeroResults
from lightning_parallel.demos.gpt import GPTConfig, num_parameters

__all__ = ["DEEPSPEED_VENV_OUTCOME", "FSDP_BYPASS_OUTCOME", "render_markdown"]

_MIB = 1024**2

DEEPSPEED_VENV_OUTCOME = (
    "In a fresh throw-away venv, `pip install torch==2.13.0 lightning==2.6.6 deepspeed` installs deepspeed 0.19.8"
    " (its CPU accelerator is detected), but a fork-started `Trainer(accelerator='cpu', devices=2,"
    " strategy=DeepSpeedStrategy(stage=2))` stops in `setup_environment`: `RuntimeError: The DeepSpeed strategy is"
    " only supported on CUDA GPUs but `CPUAccelerator` is used.` (checked 2026-11-30). It is not installed in the"
    " project's venv, so the benchmark records the error above."
)
"""What happened when DeepSpeed was tried outside the project's environment (not re-run by the benchmark)."""

FSDP_BYPASS_OUTCOME = (
    "Bypassing that check (a subclass of `FSDPStrategy` with the fork launcher) gets one step further:"
    " `RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is detected.` from torch's"
    " FSDP1 constructor, because Lightning passes `device_id=root_device.index` (`None` on CPU)."
)
"""What happened when Lightning's CPU check was bypassed by hand (not re-run by the benchmark)."""


def _mib(value: float) -> str:
    return "-" if value != value else f"{value / _MIB:,.2f}"


def _num(value: float, digits: int) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _model_text(run: RunConfig) -> str:
    overrides = {k: v for k, v in (("n_layer", run.n_layer), ("n_embd", run.n_embd)) if v is not None}
    params = num_parameters(GPTConfig.from_preset(run.preset, **overrides))
    shape = "".join(f", {k}={v}" for k, v in overrides.items())
    return f"GPT preset `{run.preset}`{shape} ({params / 1e6:.2f} M parameters, {params * 4 / 1e6:.0f} MB in fp32)"


def _ratio(results: ZeroResults, name: str, anchor: str, key: str = "tokens_per_s") -> float:
    return statistics.median(results.ratios(name, anchor, key))


def _throughput_rows(results: ZeroResults) -> list[list[str]]:
    rows = []
    for name, contender in results.contenders.items():
        runs = results.throughput[name]
        peak = statistics.median(run.peak() for run in runs)
        rows.append(
            [
                contender.label,
                str(contender.stage),
                _num(results.median(name, "tokens_per_s"), 0),
                _num(results.median(name, "tokens_per_s_median_step"), 0),
                _num(_ratio(results, name, DDP), 3),
                _num(_ratio(results, name, ZERO_REDUNDANCY), 3),
                _num(results.median(name, "final_loss"), 4),
                _mib(results.comm(name)),
                *(_mib(results.comm(name, f"{c}_bytes")) for c in ("all_reduce", "reduce_scatter", "all_gather")),
                _mib(results.comm(name, "broadcast_bytes")),
                _mib(peak),
            ]
        )
    return rows


def _memory_rows(results: ZeroResults, world_size: int) -> list[list[str]]:
    ddp_peak = results.memory[(DDP, world_size)].peak()
    rows = []
    for name, contender in results.contenders.items():
        run = results.memory[(name, world_size)]
        rows.append(
            [
                contender.label,
                str(contender.stage),
                _mib(run.peak()),
                _num(run.peak() / ddp_peak, 3),
                _mib(run.held("rss_at_setup")),
                _mib(max(p - s for p, s in zip(run.summary["peak_mem"], run.probe["rss_at_setup"], strict=True))),
                _mib(run.held("parameter_bytes")),
                _mib(run.held("gradient_bytes")),
                _mib(run.held("optimizer_state_bytes")),
            ]
        )
    return rows


def _scaling_rows(results: ZeroResults) -> list[list[str]]:
    sizes = results.config.memory_world_sizes
    rows = []
    for name in (*OURS, DDP):
        peaks = [results.memory[(name, ws)].peak() for ws in sizes]
        falls = all(later < earlier for earlier, later in itertools.pairwise(peaks))
        rows.append([results.contenders[name].label, *(_mib(p) for p in peaks), _yes_no(falls)])
    return rows


def _anchors_of_stage(results: ZeroResults, stage: int) -> list[str]:
    return [DDP] + [n for n, c in results.contenders.items() if n not in OURS and n != DDP and c.stage == stage]


def _goal_rows(results: ZeroResults) -> list[list[str]]:
    rows = []
    for anchor, goal in ((DDP, 0.95), (ZERO_REDUNDANCY, 1.0)):
        anchor_label = results.contenders[anchor].label.removeprefix("anchor: ")
        for key, how in (("tokens_per_s", "window wall time"), ("tokens_per_s_median_step", "median step time")):
            ratios = results.ratios("zero2", anchor, key)
            median = statistics.median(ratios)
            measured = f"{median:.3f} (per repeat: {', '.join(f'{r:.3f}' for r in ratios)})"
            rows.append(
                [f"stage 2 throughput / {anchor_label}, {how}", measured, f">= {goal}", _yes_no(median >= goal)]
            )
    largest = max(results.config.memory_world_sizes)
    for stage, name in enumerate(OURS, start=1):
        ours = results.memory[(name, largest)].peak()
        anchors = _anchors_of_stage(results, stage)
        peaks = {a: results.memory[(a, largest)].peak() for a in anchors}
        measured = f"{ours / _MIB:,.1f} vs " + ", ".join(f"{a} {p / _MIB:,.1f}" for a, p in peaks.items())
        rows.append(
            [
                f"stage {stage} peak RSS/rank (MiB), world size {largest}",
                measured,
                "< each",
                _yes_no(ours < min(peaks.values())),
            ]
        )
    ddp_bytes = results.comm(DDP)
    for stage, name in enumerate(OURS, start=1):
        ours = results.comm(name)
        target = "= DDP" if stage < 3 else "= DDP (ZeRO-3 needs 1.5x by design)"
        measured = f"{ours:,.0f} / {ddp_bytes:,.0f} B = {ours / ddp_bytes:.5f}"
        rows.append(
            [
                f"stage {stage} bytes received/rank/step vs DDP",
                measured,
                target,
                _yes_no(abs(ours / ddp_bytes - 1) < 1e-3),
            ]
        )
    for row in _scaling_rows(results)[: len(OURS)]:
        rows.append([f"peak RSS/rank falls with world size: {row[0]}", " > ".join(row[1:-1]), "falling", row[-1]])
    return rows


def render_markdown(results: ZeroResults, *, command: str) -> str:
    """The RESULTS.md section: command, date, machine, setup, tables of medians, unavailable anchors and goals."""
    cfg = results.config
    tp, mem = cfg.throughput, cfg.memory
    largest = max(cfg.memory_world_sizes)
    tp_header = ["configuration", "stage", "tokens/s", "tokens/s (median step)", "x DDP", "x DDP+ZeRO-opt"]
    tp_header += ["final loss", "MiB received/rank/step", "all-reduce MiB", "reduce-scatter MiB", "all-gather MiB"]
    tp_header += ["broadcast MiB", "peak MiB/rank"]
    mem_header = ["configuration", "stage", "peak MiB/rank", "x DDP", "RSS at setup MiB", "growth in fit MiB"]
    mem_header += ["parameters MiB", "gradients MiB"]
    mem_header += ["optimizer state MiB"]
    scaling_header = ["configuration", *(f"world size {ws}" for ws in cfg.memory_world_sizes), "falls"]
    unavailable = "\n".join(f"- `{name}`: `{error}`" for name, error in results.unavailable.items()) or "- none"
    title = "ShardedOptimizerStrategy (ZeRO 1/2/3) vs Lightning DDP, ZeroRedundancyOptimizer, FSDP, DeepSpeed"
    return f"""## {NAME}: {title}

- Command: `{command}`
- Date: {today()}
- Machine: {machine_description()}
- Throughput part: {_model_text(tp)}, AdamW, fp32, {tp.devices} CPU processes (fork, gloo),
  {tp.batch_size} x {tp.seq_len} tokens per process per step, {tp.steps} steps of which {tp.warmup_steps} warm-up,
  {cfg.repeats} repeats in alternating order; medians over repeats; ratios are taken per repeat, then the median.
- Memory part: {_model_text(mem)}, AdamW, fp32, {mem.batch_size} x {mem.seq_len} tokens per process per step,
  {mem.steps} steps, once at each world size {", ".join(map(str, cfg.memory_world_sizes))}.
- Stage 3 creates the model under `trainer.init_module(empty_init=True)` (not at world size 1, where the strategy
  cannot take a meta-device model), so its initial weights (each submodule's `reset_parameters`) and its loss differ
  from the others'.
- Peak MiB/rank: the largest rank's peak RSS during `fit`. The ranks are forked, so it includes what they inherit
  from the parent (torch, the corpus, and the model the parent built, except for stage 3): "RSS at setup" is that
  start, "growth in fit" the largest rank's peak minus its start. glibc's mmap threshold is fixed at 1 MiB
  (`mallopt`) before forking, so freed tensors leave the RSS at once instead of staying in the heap.
- Bytes held (parameters / gradients / optimizer state, largest rank, after the last step): ours from
  `ShardedOptimizerStrategy.memory_report()`, the anchors from the storages of their parameters, `.grad` and
  optimizer state (the local optimizer's for ZeroRedundancyOptimizer). DDP's reducer also keeps a flat copy of
  the gradients in its buckets, which Python cannot see: its gradient bytes are a lower bound.
- Communication: a counting shim around `all_reduce`, `broadcast`, `all_gather_single` and
  `reduce_scatter_single` (the deprecated `*_into_tensor`/`*_tensor` spellings go through these), installed in
  every rank before `fit`, the same for all; DDP's gradient all-reduce is routed through torch's stock
  `allreduce_hook` so that the shim sees it. "Received" is what a rank receives under bandwidth-optimal algorithms
  (all-reduce 2(N-1)/N S, reduce-scatter and all-gather (N-1)/N S, broadcast S on non-source ranks), averaged over
  ranks; the other columns are payload sizes S (the full tensor) per step.

### Throughput and communication, world size {tp.devices}

{markdown_table(tp_header, _throughput_rows(results))}

### Memory per rank, world size {largest}

{markdown_table(mem_header, _memory_rows(results, largest))}

### Peak RSS per rank (MiB) by world size

{markdown_table(scaling_header, _scaling_rows(results))}

### Anchors that did not run

{unavailable}

{FSDP_BYPASS_OUTCOME}

{DEEPSPEED_VENV_OUTCOME}

### Goals

{markdown_table(["goal", "measured", "target", "met"], _goal_rows(results))}
"""
