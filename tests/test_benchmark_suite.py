"""Integration: the benchmark suite (``python -m benchmarks.run_all``) at its tiny preset, in this process.

One run of the suite (every benchmark, 1-2 forked CPU ranks per fit, gloo) is shared by the tests of this module; it
writes RESULTS.md and the figures into a temporary folder, never into ``benchmarks/``. The facts checked are exact
(bytes, stage splits, schedules) and hold whichever optional anchors (FSDP, DeepSpeed) are installed or run here: an
anchor either ran or says why it did not.
"""

from __future__ import annotations

import math
import os
import sys
from functools import partial
from pathlib import Path

import lightning.pytorch  # imported before forking so the ranks inherit it
import pytest
import torch

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `benchmarks` is a folder at the repository root, not an installed package
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks import data_parallel, harness, pipeline, report, run_all, tensor_parallel, zero  # noqa: E402
from lightning_parallel import DataParallelStrategy  # noqa: E402
from lightning_parallel.monitor import ParallelismMonitor  # noqa: E402
from lightning_parallel.planner.bubble import (  # noqa: E402
    ActionCosts,
    schedule_order,
    simulate_schedule,
    simulated_bubble,
)

pytestmark = pytest.mark.timeout(300)  # the suite forks ~25 short fits; a hung rank fails the module


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[run_all.SuiteResults, Path]:
    real_results = _REPO_ROOT / "benchmarks" / "RESULTS.md"
    before = real_results.read_bytes() if real_results.exists() else None
    path = tmp_path_factory.mktemp("bench") / "RESULTS.md"
    torch.set_num_threads(1)
    results = run_all.run_suite(run_all.SuiteConfig(preset="tiny", results_path=path))
    assert (real_results.read_bytes() if real_results.exists() else None) == before, "must not write benchmarks/"
    return results, path


def _comparison(results: run_all.SuiteResults, benchmark: str, ours: str, anchor: str) -> harness.Comparison:
    return next(c for c in results.benchmarks[benchmark].comparisons if (c.ours, c.anchor) == (ours, anchor))


def _label(contenders: tuple[harness.Contender, ...], name: str) -> str:
    return next(c.label for c in contenders if c.name == name)


def test_every_pair_ran_or_its_anchor_says_why(suite: tuple[run_all.SuiteResults, Path]) -> None:
    results, path = suite
    assert results.failed == {}
    assert list(results.benchmarks) == ["data_parallel", "zero", "pipeline", "tensor_parallel"]
    text = path.read_text()
    pairs = {
        "data_parallel": data_parallel.PAIRS,
        "zero": zero.PAIRS,
        "pipeline": (("1F1B, m=4", "raw"),),
        "tensor_parallel": tensor_parallel.PAIRS,
    }
    for name, expected in pairs.items():
        comparisons = results.benchmarks[name].comparisons
        assert len(comparisons) == len(expected), name
        for c in comparisons:
            if c.unavailable is None:
                assert len(c.throughput) == 1 and all(math.isfinite(r) and r > 0 for r in c.throughput), c
                assert c.held is not None and c.held > 0 and c.peak is not None and c.peak > 0, c
            else:  # an optional anchor that is not installed or refuses this machine
                assert c.unavailable and not c.throughput, c
                assert f"not available: `{c.unavailable}`" in text
    for outcome in results.benchmarks["zero"].outcomes.values():  # ours always run
        assert outcome.runs or not outcome.contender.is_ours


def test_every_fit_records_the_load_and_every_section_shows_it(suite: tuple[run_all.SuiteResults, Path]) -> None:
    results, path = suite
    for name, measured in results.benchmarks.items():
        for outcome in measured.outcomes.values():
            for run in outcome.runs:
                assert run.load is not None and len(run.load) == 2, (name, outcome.contender.name)
                assert all(math.isfinite(value) and value >= 0 for value in run.load)
    text = path.read_text()
    sections = ("summary", "data_parallel", "zero", "pipeline", "tensor_parallel")
    for name in sections:
        body = text.split(f"<!-- begin {name} -->")[1].split(f"<!-- end {name} -->")[0]
        assert "Load 1-min average during the runs" in body, name
        assert "exposed comm ms/step, ours / anchor" in body, name
    loads = [v for m in results.benchmarks.values() for o in m.outcomes.values() for v in o.loads]
    assert ("**Warning: noisy run.**" in text) == (max(loads) > (os.cpu_count() or 1) + 0.5)


def test_exposed_communication_is_measured_where_the_waits_run_in_our_code(
    suite: tuple[run_all.SuiteResults, Path],
) -> None:
    outcomes = suite[0].benchmarks["zero"].outcomes
    for name in ("zero1", "zero2", "zero1_no_overlap", "zero2_no_overlap", "zero2_compiled"):
        exposed = outcomes[name].median(lambda run: run.exposed_s)
        assert exposed is not None and 0 <= exposed < max(outcomes[name].runs[0].step_s), name
    assert outcomes[zero.DDP].median(lambda run: run.exposed_s) is None  # inside DDP's reducer: not timed
    comparison = _comparison(
        suite[0], "zero", _label(zero.CONTENDERS, "zero2"), _label(zero.CONTENDERS, "zero2_no_overlap")
    )
    assert comparison.exposed_s[0] is not None and comparison.exposed_s[1] is not None
    assert comparison.wire == 1.0 and comparison.held == 1.0  # the overlap moves the wait, not the bytes


def test_new_zero_contenders_hold_what_their_counterparts_hold(suite: tuple[run_all.SuiteResults, Path]) -> None:
    results = suite[0]
    labels = {name: _label(zero.CONTENDERS, name) for name in ("zero3", "fsdp2", "zero2_compiled", "ddp_compiled")}
    fsdp2 = _comparison(results, "zero", labels["zero3"], labels["fsdp2"])
    if fsdp2.unavailable is None:  # both FSDP2 with one unit per block and the root: the same shards
        assert fsdp2.held == 1.0
    compiled = _comparison(results, "zero", labels["zero2_compiled"], labels["ddp_compiled"])
    outcomes = results.benchmarks["zero"].outcomes
    assert outcomes["zero2_compiled"].runs[0].held == outcomes["zero2"].runs[0].held  # compiled in place
    if compiled.unavailable is None:
        # On gloo ZeRO-2 all-reduces its buckets (faster there) and all-gathers: 1.5x DDP's ring bytes.
        assert compiled.wire == pytest.approx(1.5, rel=1e-3) and compiled.held is not None and compiled.held < 1


def test_tables_render_the_spread_and_the_load_warning() -> None:
    comparison = harness.Comparison("ours: x", "anchor: y", throughput=[1.10, 0.90, 1.00], exposed_s=(0.012, None))
    table = report.comparison_table([comparison])
    assert "| 1.000 (0.900-1.100) | 1.100, 0.900, 1.000 | 12.0 / not measured |" in table
    assert table.endswith("| - |")  # CPU seconds per step: not measured
    comparison.cpu = [0.98, 0.96, 1.01]
    assert report.comparison_table([comparison]).endswith("| 0.980 (0.960-1.010) |")
    outcome = harness.Outcome(harness.Contender(name="x", label="ours: x", is_ours=True))
    outcome.runs = [harness.Run(step_s=[1.0], tokens=1, held=[], peak=[], load=(0.5, 1.5))]
    notes = report.load_notes([outcome])
    assert notes[0].endswith(f" 0.50 / 1.00 / 1.50 (min / median / max), {os.cpu_count()} cores.")
    assert len(notes) == (2 if 1.5 > (os.cpu_count() or 1) + 0.5 else 1)
    outcome.runs[0].load = (0.5, (os.cpu_count() or 1) + 1.0)
    assert report.load_notes([outcome])[1].startswith("**Warning: noisy run.**")
    assert report.load_notes([]) == ["Load 1-min average during the runs: not recorded."]


def _missing() -> None:
    raise ImportError("not installed here")


def test_an_anchor_that_cannot_start_is_reported_and_ours_is_not_excused() -> None:
    missing = _missing  # module-level: every fit runs in a fresh process, which unpickles the contender
    workload = harness.Workload(preset="tiny", steps=2, warmup_steps=1, devices=1)
    anchor = harness.Contender(name="missing", label="anchor: missing", make_strategy=missing)
    outcomes = harness.run_interleaved([anchor], workload, repeats=2)
    assert outcomes["missing"].unavailable == "ImportError: not installed here"
    assert outcomes["missing"].runs == []
    assert harness.compare(outcomes["missing"], outcomes["missing"]).unavailable == "ImportError: not installed here"
    ours = harness.Contender(name="ours", label="ours: broken", make_strategy=missing, is_ours=True)
    with pytest.raises(RuntimeError, match="ours: broken failed: ImportError: not installed here"):
        harness.run_interleaved([ours], workload, repeats=1)


def test_an_error_raised_while_handling_another_names_both() -> None:
    """A rank that died first (the launcher's error) and the teardown error that followed it: the line says both."""
    try:
        try:
            raise ChildProcessError("process 0 terminated with signal SIGSEGV")
        except ChildProcessError:
            raise NotImplementedError("Cannot copy out of meta tensor; no data!") from None
    except NotImplementedError as error:
        assert harness.one_line(error) == "NotImplementedError: Cannot copy out of meta tensor; no data!"
    try:
        try:
            raise ChildProcessError("traceback\nprocess 0 terminated with signal SIGSEGV")
        except ChildProcessError:
            raise NotImplementedError("Cannot copy out of meta tensor; no data!")  # noqa: B904 (the chain under test)
    except NotImplementedError as error:
        assert harness.one_line(error) == (
            "NotImplementedError: Cannot copy out of meta tensor; no data! (while handling ChildProcessError: process 0"
            " terminated with signal SIGSEGV)"
        )


class _RecordsFits(lightning.pytorch.Callback):
    """Appends a line at the start of every fit on every rank: whether a ParallelismMonitor is among the Trainer's
    callbacks, the global rank, the rank's process id and its parent's."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: lightning.pytorch.Trainer, pl_module: lightning.pytorch.LightningModule) -> None:
        monitored = any(isinstance(c, ParallelismMonitor) for c in trainer.callbacks)
        with self.path.open("a") as file:
            file.write(f"{int(monitored)} {trainer.global_rank} {os.getpid()} {os.getppid()}\n")

    @staticmethod
    def read(path: Path) -> list[tuple[int, ...]]:
        return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


def _records_fits(path: Path) -> list[lightning.pytorch.Callback]:
    return [_RecordsFits(path)]


def _recorded_data_parallel(log: Path) -> harness.Contender:
    """Ours, data parallel, writing a line per fit and rank to ``log`` (module-level parts: every fit runs in a fresh
    process, which unpickles the contender)."""
    return harness.Contender(
        name="ours",
        label="ours: data parallel",
        make_strategy=partial(DataParallelStrategy, start_method="fork"),
        make_callbacks=partial(_records_fits, log),
        is_ours=True,
    )


def test_throughput_is_timed_without_the_monitor_and_figures_come_from_one_monitored_fit(tmp_path: Path) -> None:
    log = tmp_path / "fits"
    workload = harness.Workload(preset="tiny", steps=3, warmup_steps=1, devices=1)
    outcome = harness.run_interleaved([_recorded_data_parallel(log)], workload, repeats=2)["ours"]
    # One fit under the monitor, then one timed fit per repeat without it.
    assert [monitored for monitored, *_ in _RecordsFits.read(log)] == [1, 0, 0]
    first, second = outcome.runs
    assert len(first.step_s) == len(second.step_s) == 2 and first.step_s != second.step_s
    assert first.cpu_s is not None and len(first.cpu_s) == 2 and all(seconds > 0 for seconds in first.cpu_s)
    assert first.monitored_step_s == second.monitored_step_s and len(first.monitored_step_s or []) == 2
    assert first.held == second.held and first.held[0]["parameters"] > 0  # the monitor's figures, reused


def test_every_fit_forks_its_ranks_from_a_process_of_its_own(tmp_path: Path) -> None:
    """Issue 46: forking ~20 fits' ranks from one long-lived parent ended in a rank's SIGSEGV; each fit now runs in a
    fresh process (benchmarks.isolation), which forks its ranks and exits with the fit."""
    log = tmp_path / "fits"
    workload = harness.Workload(preset="tiny", steps=2, warmup_steps=1, devices=2, batch_size=2, seq_len=16)
    harness.run_interleaved([_recorded_data_parallel(log)], workload, repeats=2)  # one monitored fit, two timed
    fits: dict[int, set[int]] = {}  # the process that forked the ranks -> their ranks
    for _, rank, pid, parent in _RecordsFits.read(log):
        assert os.getpid() not in (pid, parent)
        fits.setdefault(parent, set()).add(rank)
    assert list(fits.values()) == [{0, 1}] * 3  # three fits, each with its own parent of both ranks


def test_fp16_compression_sends_exactly_half_the_bytes(suite: tuple[run_all.SuiteResults, Path]) -> None:
    results, _ = suite
    labels = [_label(data_parallel.CONTENDERS, name) for name in ("ours_fp16", "ours", "lightning_ddp")]
    assert _comparison(results, "data_parallel", labels[0], labels[1]).wire == 0.5
    same = _comparison(results, "data_parallel", labels[1], labels[2])  # the same DDP reducer, the same model
    assert same.wire == 1.0 and same.held == 1.0


def test_zero_stages_send_what_ddp_sends_and_hold_less(suite: tuple[run_all.SuiteResults, Path]) -> None:
    outcomes = suite[0].benchmarks["zero"].outcomes

    def held(name: str, kind: str) -> int:
        return max(rank[kind] for rank in outcomes[name].runs[0].held)

    ddp = outcomes[zero.DDP].runs[0]
    assert ddp.payload is not None and set(ddp.payload[0]) == {"all_reduce"}
    for name in ("zero1", "zero2"):  # gloo: all-reduce (faster there than a reduce-scatter) + all-gather of the buckets
        run = outcomes[name].runs[0]
        assert run.payload is not None and set(run.payload[0]) == {"all_reduce", "all_gather"}, name
        assert run.wire == pytest.approx(1.5 * ddp.wire, rel=1e-3), name
    for name in ("zero1", "zero2", "zero3", "ddp_zero_redundancy"):
        assert held(name, "optimizer_state") < 0.6 * held(zero.DDP, "optimizer_state"), name
    assert held("zero2", "gradients") < 0.6 * held(zero.DDP, "gradients")
    assert held("zero3", "parameters") < 0.6 * held(zero.DDP, "parameters")


def test_scaling_is_the_sharding_arithmetic_and_the_planner_predicts_it(
    suite: tuple[run_all.SuiteResults, Path],
) -> None:
    results = suite[0].benchmarks["zero"]
    measured = {name: results.measured(name) for name in zero.SCALED}
    assert all(sorted(series) == [1, 2] for series in measured.values())
    whole = measured[zero.DDP][1][0]
    for series in measured.values():
        assert series[1] == (whole, 0.0)  # one rank holds the whole model and state and sends nothing
    assert measured[zero.DDP][2][0] == whole  # DDP replicates everything
    at_two = [measured[name][2][0] for name in (zero.DDP, "zero1", "zero2", "zero3")]
    assert at_two == sorted(at_two, reverse=True) and len(set(at_two)) == 4  # each stage shards one more kind
    assert results.planner_agreement() == 0.0  # bytes held and on the wire, exactly
    assert sorted(results.predicted["zero3"]) == [ws for ws in zero.PREDICTED_WORLD_SIZES if ws > 1]


def test_pipeline_pair_holds_the_same_bytes_and_schedules_keep_their_micro_batches(
    suite: tuple[run_all.SuiteResults, Path],
) -> None:
    results = suite[0].benchmarks["pipeline"]
    assert results.comparisons[0].held == 1.0  # the same split and optimizer on both sides
    assert set(results.timelines) == {(schedule, 4) for schedule in pipeline.SCHEDULES}
    in_flight = {
        key: [pipeline.peak_in_flight(rank["steps"][0]["timeline"]) for rank in run.ranks]
        for key, run in results.timelines.items()
    }
    assert in_flight[("GPipe", 4)] == [4, 4]  # every forward before any backward
    assert in_flight[("1F1B", 4)] == [2, 1]  # at most p - rank micro-batches in flight
    for run in results.timelines.values():
        mean, worst = pipeline.bubble(run)
        assert 0 < mean <= worst < 1


def test_tensor_parallel_pair_trains_alike_and_holds_and_sends_what_lightnings_does(
    suite: tuple[run_all.SuiteResults, Path],
) -> None:
    """Ours (the GPT's own plan) and Lightning's ModelParallelStrategy (the same plan by hand in `configure_model`):
    the same losses, the same bytes held (the planner's `zero3 tp=2` row, exactly) and the same collectives."""
    from lightning_parallel.demos import GPTLightningModule
    from lightning_parallel.planner import plan

    results = suite[0].benchmarks["tensor_parallel"]
    comparison = results.comparisons[0]
    assert comparison.unavailable is None  # ModelParallelStrategy, parallelize_module and fully_shard run on gloo
    assert comparison.held == 1.0 and comparison.wire == 1.0
    ours, anchor = (results.outcomes[name].runs[0] for name in ("zero3_tp", "model_parallel_tp"))
    assert ours.loss is not None and ours.loss == pytest.approx(anchor.loss, abs=1e-5)  # same weights, same batches
    assert ours.payload is not None and ours.payload == anchor.payload
    workload = tensor_parallel.PRESETS["tiny"].workload
    planned = plan(
        GPTLightningModule(workload.preset),
        world_size=workload.devices,
        batch_size=workload.batch_size,
        seq_len=workload.tokens_per_sequence,
        tensor_parallel_size=tensor_parallel.TENSOR_PARALLEL_SIZE,
        process_group_backend="gloo",
    ).configuration(f"zero3 tp={tensor_parallel.TENSOR_PARALLEL_SIZE}")
    assert [sum(rank.values()) for rank in ours.held] == [rank.held for rank in planned.ranks]


def test_results_md_has_the_summary_first_and_every_figure(suite: tuple[run_all.SuiteResults, Path]) -> None:
    _, path = suite
    text = path.read_text()
    sections = ("summary", "data_parallel", "zero", "pipeline", "tensor_parallel")
    starts = [text.index(f"<!-- begin {name} -->") for name in sections]
    assert starts == sorted(starts)
    for name in ("throughput_ratios", "scaling", "pipeline_timeline"):
        assert (path.parent / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"(figures/{name}.png)" in text, name
    assert (path.parent / "figures" / "pipeline_timeline.json").read_text().startswith('{"traceEvents"')


def test_presets_and_arguments_are_validated() -> None:
    for module in run_all.BENCHMARKS.values():
        assert set(module.PRESETS) == set(run_all.PRESET_NAMES), module.NAME
    assert run_all.SuiteConfig().preset == run_all.DEFAULT_PRESET == "medium"
    assert zero.PRESETS["medium"].workload.preset == data_parallel.PRESETS["medium"].workload.preset == "gpt-20m"
    suite = run_all.SuiteConfig(preset="small", repeats=1, steps=2)
    config = run_all.configure(pipeline, suite)
    assert (config.repeats, config.workload.steps, config.workload.warmup_steps) == (1, 2, 1)
    assert suite.command() == "python -m benchmarks.run_all --preset small --repeats 1 --steps 2"
    with pytest.raises(ValueError, match="nope"):
        run_all.SuiteConfig(only=("nope",))
    with pytest.raises(ValueError, match="repeats=0"):
        run_all.SuiteConfig(repeats=0)
    with pytest.raises(ValueError, match="warmup_steps=4"):
        harness.Workload(steps=4, warmup_steps=4)
    with pytest.raises(SystemExit):
        run_all.main(["--preset", "huge"])


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_measured_chunk_costs_are_read_back_from_the_timelines(schedule: str) -> None:
    """The bubble table's "planned with the measured chunk costs": timelines whose every chunk lasts what known costs
    say give those costs back (per stage and kind), and the plan played with them."""
    p, m, v = 2, 4, 1 if schedule == "1F1B" else 2
    costs = ActionCosts(
        forward=(1.0, 2.0, 3.0, 4.0)[: p * v], input_grad=(5.0, 6.0, 7.0, 8.0)[: p * v], weight_grad=(9.0,) * (p * v)
    )
    ranks = []
    for actions in schedule_order(schedule, p, m, v):
        timeline, clock = [], 0.0
        for kind, stage, _ in (step for action in actions for step in action):
            seconds = costs.of(kind, stage)
            timeline.append(["B" if kind == "I" else kind, stage, clock, clock + seconds])
            clock += seconds + 0.5  # time between chunks does not count
        ranks.append({"steps": [{"timeline": timeline}] * 3})
    run = harness.Run(step_s=[], tokens=0, held=[], peak=[], ranks=ranks)
    measured = pipeline.measured_costs(schedule, p, m, run)
    for stage in range(p * v):
        for kind in "FB" if schedule == "1F1B" else "FIWB":  # 1F1B runs whole backwards: I and W are not seen apart
            assert measured.of(kind, stage) == costs.of(kind, stage), (kind, stage)
    kwargs = {"pipeline_parallel_size": p, "num_microbatches": m, "stages_per_rank": v}
    planned = simulated_bubble(schedule, **kwargs, costs=costs)
    assert pipeline.planned_with_measured_costs(schedule, p, m, run) == planned


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_time_outside_chunks_is_read_back_from_the_timelines(schedule: str) -> None:
    """The bubble table's "planned with the run's costs": timelines with 0.5 before every chunk and 0.75 after a
    forward of the last stage, whose windows hold the plan's waits and 2.0 more, give back 0.5 between actions,
    0.25 of loss and 2.0 at the edges, and the plan played with them and the chunk costs."""
    p, m, v = 2, 4, 1 if schedule == "1F1B" else 2
    chunks = ActionCosts(
        forward=(1.0, 2.0, 3.0, 4.0)[: p * v], input_grad=(5.0, 6.0, 7.0, 8.0)[: p * v], weight_grad=(9.0,) * (p * v)
    )
    costs = ActionCosts(**{**vars(chunks), "between_actions": 0.5, "loss": 0.25, "edges": 2.0})
    order = schedule_order(schedule, p, m, v)
    played = simulate_schedule(order, costs)
    ranks = []
    for rank, actions in enumerate(order):
        timeline, clock = [], 0.0
        for kind, stage, _ in (step for action in actions for step in action):
            seconds = costs.of(kind, stage)
            timeline.append(["B" if kind == "I" else kind, stage, clock, clock + seconds])
            clock += seconds + (0.75 if (kind, stage) == ("F", p * v - 1) else 0.5)
        busy = sum(end - start for *_, start, end in timeline)
        span = timeline[-1][3] - timeline[0][2]
        waits = played.starts[rank] + (played.makespan - costs.edges) - played.ends[rank]
        idle = span + waits + 2.0 - busy
        ranks.append({"steps": [{"step": step, "timeline": timeline, "pipeline_idle_s": idle} for step in range(3)]})
    run = harness.Run(step_s=[], tokens=0, held=[], peak=[], ranks=ranks)
    measured = pipeline.measured_overheads(schedule, p, m, run)
    assert (measured.between_actions, measured.loss) == (0.5, 0.25)
    assert measured.edges == pytest.approx(2.0)
    # Every chunk lasts its stage's cost: the play of each step as it ran is the play with the run's costs.
    assert pipeline.planned_with_run_costs(schedule, p, m, run) == simulate_schedule(order, measured).bubble
