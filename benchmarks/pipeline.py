"""PipelineParallelStrategy against a raw ``torch.distributed.pipelining`` loop, and the bubble of every schedule.

* **Lightning overhead**: our strategy in ``Trainer.fit`` against a hand-written loop over the same stage split,
  ``PipelineStage``, ``Schedule1F1B`` and micro-batches with an AdamW step (no Lightning), interleaved repeats. Both
  sides time a step from the batch in hand to the optimizer step done, the slowest rank's.
* **Bubble**: every schedule at several micro-batch counts, one run each; the idle share of each rank's schedule
  (``ParallelismMonitor``'s ``bubble_fraction``: time outside its stages' forward/backward chunks) against theory
  ``(p - 1) / (v m + p - 1)`` and the planner's play of torch's order (unit costs; the chunk costs the run measured:
  :func:`planned_with_measured_costs`; those and the time the run spent outside chunks without waiting for another
  rank: :func:`planned_with_run_costs`), and the most micro-batches whose forward ran and backward did not
  (activations held).
* **Picture**: one step per schedule (``figures/pipeline_timeline.png``) and the 1F1B step as a Chrome trace
  (``figures/pipeline_timeline.json``, for https://ui.perfetto.dev), from the monitor's per-rank timelines.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from benchmarks import figures
from benchmarks.harness import (
    Comparison,
    Contender,
    Outcome,
    Run,
    Workload,
    compare,
    monitored_fit,
    run_interleaved,
)
from benchmarks.report import comparison_table, load_notes, markdown_table, outcome_table, section
from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.accounting import module_memory_report, peak_memory_bytes
from lightning_parallel.demos import GPTLightningModule, TextDataModule, next_token_loss
from lightning_parallel.distributed.pipeline.layer_costs import layer_compute_costs
from lightning_parallel.distributed.pipeline.schedule import schedule_spec
from lightning_parallel.distributed.pipeline.stage_module import StageModule
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan, plan_stages
from lightning_parallel.planner import pipeline_bubble
from lightning_parallel.planner.bubble import (
    ActionCosts,
    action_needs,
    schedule_order,
    simulate_schedule,
    simulated_bubble,
)

__all__ = ["NAME", "PRESETS", "Config", "PipelineResults", "measure", "render", "write_figures"]

NAME = "pipeline"
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Every schedule; those with two stages per rank (interleaved, V-shaped) run ``Config.interleaved_microbatches``."""


@dataclass(frozen=True, kw_only=True)
class Config:
    workload: Workload
    """``devices`` pipeline ranks, one stage each for the overhead pair; the whole batch goes through the pipeline."""
    num_microbatches: int = 4
    """Micro-batches of the overhead pair and the picture."""
    bubble_microbatches: tuple[int, ...] = (2, 4, 8)
    """Micro-batch counts of GPipe and 1F1B's bubble."""
    interleaved_microbatches: tuple[int, ...] = (4, 8)
    """Micro-batch counts of the interleaved schedules (2 stages per rank)."""
    repeats: int = 3


PRESETS: dict[str, Config] = {
    "tiny": Config(
        workload=Workload(preset="tiny", batch_size=8, seq_len=32, steps=6, warmup_steps=2, time_throughput=False),
        bubble_microbatches=(4,),
        interleaved_microbatches=(4,),
        repeats=1,
    ),
    # The default (`make bench`): the 20.5 M model, the whole batch of 16 x 128 tokens through 2 stages (a rank's
    # compute per step is that of a data-parallel rank of 8 sequences); fewer bubble runs than `small`, which show the
    # same arithmetic.
    "medium": Config(
        workload=Workload(preset="gpt-20m", batch_size=16, steps=10, warmup_steps=3),  # 7 measured steps per fit
        bubble_microbatches=(4, 8),
        interleaved_microbatches=(4,),
    ),
    "small": Config(workload=Workload(batch_size=16, steps=12, warmup_steps=4)),
    "large": Config(
        workload=Workload(preset="gpt-125m", batch_size=16, seq_len=1024, steps=20, warmup_steps=5, accelerator="gpu")
    ),
}


def _split(workload: Workload) -> list[int]:
    """First layer of every stage but the first: the strategy's ``"compute"`` balance, fixed for both sides."""
    layers = GPTLightningModule(workload.preset, **workload.overrides).pipeline_layers()
    example = torch.zeros(workload.batch_size, workload.tokens_per_sequence, dtype=torch.long)
    costs = layer_compute_costs(layers, (example,))
    return list(plan_stages(costs, num_stages=workload.devices, pipeline_parallel_size=workload.devices).starts[1:])


def ours(schedule: str, num_microbatches: int, partition: str | list[int] = "compute") -> Contender:
    return Contender(
        name=f"{schedule}, m={num_microbatches}",
        label=f"ours: PipelineParallelStrategy({schedule}, m={num_microbatches})",
        make_strategy=partial(
            PipelineParallelStrategy,
            start_method="fork",
            schedule=schedule,
            num_microbatches=num_microbatches,
            partition=partition,
        ),
        is_ours=True,
    )


def raw(num_microbatches: int, boundaries: list[int]) -> Contender:
    return Contender(
        name="raw",
        label=f"anchor: raw torch.distributed.pipelining loop (1F1B, m={num_microbatches})",
        run=partial(_raw_run, num_microbatches=num_microbatches, boundaries=boundaries),
    )


def _raw_rank(rank: int, workload: Workload, num_microbatches: int, boundaries: list[int], folder: str) -> None:
    torch.set_num_threads(1)
    world_size = workload.devices
    device = torch.device("cpu") if workload.accelerator == "cpu" else torch.device("cuda", rank)
    store = dist.FileStore(str(Path(folder, "store")), world_size)
    backend = "gloo" if device.type == "cpu" else "nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        layers = GPTLightningModule(workload.preset, **workload.overrides).pipeline_layers()
        split = StagePlan(starts=(0, *boundaries), num_layers=len(layers), pipeline_parallel_size=world_size)
        module = StageModule([layers[i] for i in split.layers_of(rank)]).to(device)
        schedule = Schedule1F1B(
            PipelineStage(module, rank, world_size, device), num_microbatches, loss_fn=next_token_loss
        )
        optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4, betas=(0.9, 0.95))
        data = TextDataModule(seq_len=workload.tokens_per_sequence, batch_size=workload.batch_size, max_bytes=400_000)
        data.setup("fit")
        step_s, cpu_s = [], []
        for _, (inputs, targets) in zip(range(workload.steps), data.train_dataloader(), strict=False):
            start, cpu_start = time.perf_counter(), time.process_time()
            optimizer.zero_grad()  # before the step, as Lightning does: the gradients are held when measured
            if rank == 0:
                schedule.step(inputs.to(device))
            elif rank == world_size - 1:
                schedule.step(target=targets.to(device))
            else:
                schedule.step()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s.append(time.perf_counter() - start)
            cpu_s.append(time.process_time() - cpu_start)
        held = module_memory_report(module, optimizer)
        record = {"step_s": step_s[workload.warmup_steps :], "peak": peak_memory_bytes(device)}
        record["cpu_s"] = cpu_s[workload.warmup_steps :]
        record["held"] = {k: v for k, v in held.as_dict().items() if k != "total"}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _raw_run(workload: Workload, num_microbatches: int, boundaries: list[int]) -> Run:
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="lp-bench-raw-") as folder:
        args = (workload, num_microbatches, boundaries, folder)
        processes = [context.Process(target=_raw_rank, args=(rank, *args)) for rank in range(workload.devices)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(600)
        if any(process.exitcode != 0 for process in processes):
            raise RuntimeError(f"The raw pipeline loop failed: exit codes {[p.exitcode for p in processes]}.")
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(workload.devices)]
    return Run(
        step_s=[max(step) for step in zip(*(r["step_s"] for r in ranks), strict=True)],
        cpu_s=[max(step) for step in zip(*(r["cpu_s"] for r in ranks), strict=True)],
        tokens=workload.batch_size * workload.tokens_per_sequence,
        held=[r["held"] for r in ranks],
        peak=[r["peak"] for r in ranks],
        world_size=workload.devices,
    )


@dataclass
class PipelineResults:
    config: Config
    outcomes: dict[str, Outcome]
    comparisons: list[Comparison]
    split: list[int]
    timelines: dict[tuple[str, int], Run] = field(default_factory=dict)
    """(schedule, micro-batches) -> its run."""


def bubble(run: Run) -> tuple[float, float]:
    """Median over measured steps of the mean over ranks, and of the worst rank, of the monitor's bubble fraction."""
    per_step = list(zip(*([s["bubble_fraction"] for s in rank["steps"]] for rank in run.ranks), strict=True))
    return statistics.median(statistics.fmean(s) for s in per_step), statistics.median(max(s) for s in per_step)


def peak_in_flight(events: list[list[Any]]) -> int:
    """The most micro-batches (stage x micro-batch pairs) whose forward ran and backward did not, on one rank."""
    in_flight = peak = 0
    for kind, *_ in sorted(events, key=lambda e: e[2]):
        in_flight += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, in_flight)
    return peak


def measure(config: Config) -> PipelineResults:
    """The overhead pair (interleaved repeats), then one run per schedule and micro-batch count."""
    split = _split(config.workload)
    m = config.num_microbatches
    outcomes = run_interleaved([ours("1F1B", m, split), raw(m, split)], config.workload, repeats=config.repeats)
    results = PipelineResults(config, outcomes, [compare(*outcomes.values())], split)
    short = replace(config.workload, steps=config.workload.warmup_steps + 3)  # enough for a median of 3 steps
    for schedule in SCHEDULES:
        counts = config.interleaved_microbatches if _two_stages(schedule) else config.bubble_microbatches
        for count in counts:
            print(f"=== bubble: {schedule}, m={count}", flush=True)
            results.timelines[(schedule, count)] = monitored_fit(ours(schedule, count), short)
    return results


def _two_stages(schedule: str) -> bool:
    return schedule_spec(schedule).default_stages_per_rank == 2


def _planned(schedule: str, p: int, m: int) -> str:
    """The planner's predicted bubble (``lightning-parallel plan``), as it tells a user choosing a schedule."""
    v = 2 if _two_stages(schedule) else 1
    bubble = pipeline_bubble(schedule, pipeline_parallel_size=p, num_microbatches=m, stages_per_rank=v)
    return f"{bubble:.3f}"


Step = tuple[str, int, int]


def _paired_steps(schedule: str, p: int, m: int, run: Run) -> Iterator[tuple[int, list[Step], list[Any], Any]]:
    """Every rank's measured steps whose chunks pair up with its actions in torch's order of ``schedule`` (the
    planner's :func:`~lightning_parallel.planner.bubble.schedule_order`; a backward chunk ``B`` is an input gradient
    ``I`` or a whole backward): ``(rank, planned steps, timeline events, step record)``."""
    order = schedule_order(schedule, p, m, 2 if _two_stages(schedule) else 1)
    for rank, (actions, measured) in enumerate(zip(order, run.ranks, strict=True)):
        planned = [step for action in actions for step in action]
        for record in measured["steps"]:
            events = record["timeline"]
            if [("B" if k == "I" else k, s) for k, s, _ in planned] == [(k, s) for k, s, *_ in events]:
                yield rank, planned, events, record


def measured_costs(schedule: str, p: int, m: int, run: Run) -> ActionCosts:
    """Each stage's median forward, input gradient and weight gradient chunk seconds in ``run``'s timelines.

    Each rank's chunks are paired with its actions (:func:`_paired_steps`; a step whose chunks do not pair up is left
    out). Where a stage ran only whole backwards, its input and weight gradients are half of one each. The first
    stage's input gradient is free (torch computes none), as :class:`ActionCosts` has it.
    """
    chunks: dict[tuple[str, int], list[float]] = {}
    for _, planned, events, _ in _paired_steps(schedule, p, m, run):
        for (kind, stage, _), (*_, start, end) in zip(planned, events, strict=True):
            chunks.setdefault((kind, stage), []).append(end - start)
    stages = range(p * (2 if _two_stages(schedule) else 1))

    def median(kind: str, stage: int) -> float:
        return statistics.median(chunks[(kind, stage)]) if (kind, stage) in chunks else 0.0

    split = [("W", s) in chunks for s in stages]
    return ActionCosts(
        forward=tuple(median("F", s) for s in stages),
        input_grad=tuple(median("I", s) if split[s] else median("B", s) / 2 for s in stages),
        weight_grad=tuple(median("W", s) if split[s] else median("B", s) / 2 for s in stages),
    )


def measured_overheads(schedule: str, p: int, m: int, run: Run) -> ActionCosts:
    """:func:`measured_costs` plus the time ``run``'s ranks spent outside chunks without waiting for another rank:

    * ``between_actions``: the median gap before an action whose inputs were made on its own rank (a weight gradient,
      the first stage's forward, the V's tip), which waits for nothing but the schedule's own work and P2P calls;
    * ``loss``: the median such gap right after a forward of the last stage, less ``between_actions``;
    * ``edges``: per step, the least over ranks of the window (busy + idle) less the span of its chunks (before the
      first chunk and after the last one: splitting the batch, the outcome's broadcast), less the waits the plan
      plays there (a later stage waiting for its first input, a rank done before the last one); the median over
      steps.

    A gap before an action that needs another rank's output is left out: that wait is what the plan plays.
    """
    v = 2 if _two_stages(schedule) else 1
    last = p * v - 1
    order = schedule_order(schedule, p, m, v)
    local = [{stage for action in actions for _, stage, _ in action} for actions in order]
    between: list[float] = []
    after_loss: list[float] = []
    edges: dict[int, list[float]] = {}
    for rank, planned, events, record in _paired_steps(schedule, p, m, run):
        for k in range(1, len(planned)):
            if any(need[1] not in local[rank] for need in action_needs(planned[k], last)):
                continue
            kind, stage, _ = planned[k - 1]
            (after_loss if (kind, stage) == ("F", last) else between).append(events[k][2] - events[k - 1][3])
        busy = sum(end - start for *_, start, end in events)
        span = events[-1][3] - events[0][2]
        edges.setdefault(record["step"], []).append((rank, record["pipeline_idle_s"] + busy - span))
    per_action = statistics.median(between) if between else 0.0
    loss = max(0.0, statistics.median(after_loss) - per_action) if after_loss else 0.0
    costs = replace(measured_costs(schedule, p, m, run), between_actions=per_action, loss=loss)
    played = simulate_schedule(order, costs)
    waits = [start + played.makespan - end for start, end in zip(played.starts, played.ends, strict=True)]
    per_step = [min(max(0.0, outside - waits[rank]) for rank, outside in ranks) for ranks in edges.values()]
    return replace(costs, edges=statistics.median(per_step) if per_step else 0.0)


def planned_with_measured_costs(schedule: str, p: int, m: int, run: Run) -> float:
    """The planner's play of torch's order of ``schedule`` with the chunk costs ``run`` measured: what the bubble
    would be with those stages and no overhead between chunks (no P2P wait, no loss, no schedule work)."""
    v = 2 if _two_stages(schedule) else 1
    costs = measured_costs(schedule, p, m, run)
    return simulated_bubble(schedule, pipeline_parallel_size=p, num_microbatches=m, stages_per_rank=v, costs=costs)


def planned_with_run_costs(schedule: str, p: int, m: int, run: Run) -> float:
    """The plan with everything ``run`` measured outside the waits between ranks: each step played as it ran, every
    chunk with its own time (:attr:`ActionCosts.actions`: on a shared machine one slow chunk makes the ranks that need
    it wait, and that wait is the plan's to play), plus the run's time outside chunks (:func:`measured_overheads`);
    the median over steps whose chunks pair up with the order on every rank. What remains between this and the
    measured bubble is time between chunks that no measured overhead explains: P2P latency and waits."""
    v = 2 if _two_stages(schedule) else 1
    overheads = measured_overheads(schedule, p, m, run)
    steps: dict[int, dict[int, tuple[tuple[Step, float], ...]]] = {}
    for rank, planned, events, record in _paired_steps(schedule, p, m, run):
        timed = tuple((step, end - start) for step, (*_, start, end) in zip(planned, events, strict=True))
        steps.setdefault(record["step"], {})[rank] = timed
    order = schedule_order(schedule, p, m, v)
    bubbles = [
        simulate_schedule(order, replace(overheads, actions=sum(ranks.values(), ()))).bubble
        for ranks in steps.values()
        if len(ranks) == p
    ]
    return statistics.median(bubbles) if bubbles else float("nan")


def render(results: PipelineResults, *, command: str) -> str:
    cfg, p = results.config, results.config.workload.devices
    rows = []
    for (schedule, m), run in results.timelines.items():
        mean, worst = bubble(run)
        in_flight = ", ".join(str(peak_in_flight(rank["steps"][0]["timeline"])) for rank in run.ranks)
        held = max(sum(rank.values()) for rank in run.held) / 2**20
        peak = max(run.peak) / 2**20
        with_costs = planned_with_measured_costs(schedule, p, m, run)
        with_run = planned_with_run_costs(schedule, p, m, run)
        cells = [_planned(schedule, p, m), f"{with_costs:.3f}", f"{with_run:.3f}", f"{mean:.3f}", f"{worst:.3f}"]
        cells.append(f"{mean / with_run:.2f}")
        rows.append([f"{schedule}, m={m}", *cells, in_flight, f"{held:.1f}", f"{peak:.1f}"])
    header = ["schedule", "bubble planned", "planned with the measured chunk costs", "planned with the run's costs"]
    header += ["measured, mean of ranks", "worst rank", "measured / planned with the run's costs"]
    header += ["peak in-flight micro-batches per rank", "held MiB/rank", "peak MiB/rank"]
    bubbles = markdown_table(header, rows)
    return section(
        f"{NAME}: PipelineParallelStrategy vs a raw torch.distributed.pipelining loop",
        command=command,
        notes=[
            f"Overhead pair: {cfg.workload.describe()} (the whole batch through {p} stages, split at layers"
            f" {results.split} on both sides), 1F1B with m={cfg.num_microbatches}; {cfg.repeats} interleaved repeats."
            " Both timed without the monitor (ours: a step clock callback; the raw loop: a clock around the step);"
            " the bubble and timeline come from fits under `ParallelismMonitor` (it times every chunk).",
            *load_notes(results.outcomes.values()),
            "Bubble: the monitor's idle share of each rank's schedule, median over 3 steps after the warm-up, beside"
            " the planner's prediction (`lightning-parallel plan`: torch's own order of the schedule's actions played"
            " with equal blocks, F = I = W = 1 and free communication; planner/bubble.py), and the same order played"
            " with the chunk costs this run measured (each stage's median forward, input and weight gradient:"
            " `planner.bubble.ActionCosts`): what unequal stages and I != W alone make of the plan. The rest of the"
            " measured bubble is time between chunks: P2P waits, the last stage's loss (the step run per micro-batch),"
            " the schedule's own work per action, and the step's outcome sent from the last stage."
            " Planned with the run's costs: each step played as it ran, every chunk with its own time"
            " (`ActionCosts.actions`), plus the time the run spent outside chunks without waiting for another rank"
            " (`ActionCosts.between_actions`, `loss`, `edges`, measured from the gaps before actions whose inputs are"
            " local: `measured_overheads`), median over steps; the goal (issue 46) is the measured bubble within 1.5x"
            " of it. What remains between the two is waiting that the plan does not play: P2P latency."
            " In-flight micro-batches bound the activations a rank holds; held: parameters + gradients + optimizer"
            " state of the largest rank; peak: the largest rank's peak memory (RSS on CPU), 1F1B vs ZBV at the same m.",
        ],
        blocks={
            "Ours / raw loop": comparison_table(results.comparisons),
            "Overhead pair: medians over repeats": outcome_table(results.outcomes.values()),
            "Bubble per schedule": bubbles,
            "Timeline": f"One step with m={cfg.num_microbatches}, one band per rank; forward blue, backward green,"
            " weight gradients yellow. The 1F1B step as a Chrome trace: `figures/pipeline_timeline.json`.\n\n"
            "![pipeline timeline](figures/pipeline_timeline.png)",
        },
    )


def write_figures(results: PipelineResults, folder: Path) -> None:
    m = results.config.num_microbatches
    pictured = {f"{s}, m={count}": run.ranks for (s, count), run in results.timelines.items() if count == m}
    figures.timeline_chart(pictured, folder / "pipeline_timeline.png")
    figures.chrome_trace(results.timelines[("1F1B", m)].ranks, folder / "pipeline_timeline.json")


if __name__ == "__main__":
    from benchmarks.run_all import main

    sys.exit(main(["--only", NAME, *sys.argv[1:]]))
