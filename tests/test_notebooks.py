"""The notebooks in ``notebooks/``: outputs stripped in git, and each one executed end to end in a real Jupyter kernel.

Each notebook trains with 2 processes forked from the kernel (the ``*_notebook`` strategies). After its last cell the
test runs one more cell in the same kernel that prints the facts the notebook showed (loss curves, per-rank bytes,
parameters returned to the kernel) as JSON, and asserts on those numbers, not only on "no cell raised".
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lightning_parallel.demos import GPTLightningModule

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 240
KERNEL_NAME = "lightning-parallel-tests"
MAX_STEPS = 30

# Run in the kernel after the notebook: every run's loss curve, bytes held per rank, and the size of the model that
# came back to the kernel's process.
FACTS_CELL = """\
import json as _json
_facts = {}
_first = next(iter(runs.values()))[0].lightning_module.state_dict()
for _name, (_trainer, _logger) in runs.items():
    _metrics = _trainer.callback_metrics
    _state = _trainer.lightning_module.state_dict()
    _facts[_name] = {
        "loss": loss_curve(_logger),
        "memory": {k: float(v) for k, v in _metrics.items() if k.startswith("memory/")},
        "comm_bytes_per_step": float(_metrics.get("stats/comm_bytes_per_step", float("nan"))),
        "world_size": int(_metrics["stats/world_size"]),
        "returned_parameters": sum(p.numel() for p in _trainer.lightning_module.parameters()),
        "max_weight_difference_to_first_run": max((_state[k] - v).abs().max().item() for k, v in _first.items()),
    }
print(_json.dumps(_facts))
"""


def test_notebooks_exist() -> None:
    assert NOTEBOOKS == ["data_parallel.ipynb", "overview.ipynb", "pipeline_parallel.ipynb", "sharded_optimizer.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_outputs_are_stripped(name: str) -> None:
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name} cell {index} has outputs: run `python notebooks/strip_outputs.py`"
            assert cell.execution_count is None, f"{name} cell {index} has an execution count"


@pytest.fixture(scope="module")
def kernel_environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernelspec that starts this interpreter (the venv's), found through JUPYTER_PATH: no global install."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lightning_parallel tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return root


@pytest.fixture(scope="module")
def executed(kernel_environment: Path) -> dict[str, tuple[nbformat.NotebookNode, dict] | BaseException]:
    """Every notebook executed end to end, each in its own fresh kernel, the kernels running at the same time.

    One kernel keeps about one of the two cores busy while it imports torch and Lightning and between its forked
    runs; the notebooks share nothing (each run logs into its own temporary directory), so the kernels overlap.
    Returns ``{name: (the executed notebook, the facts its extra cell printed)}``, or the exception it raised, which
    that notebook's test raises again.
    """
    with pytest.MonkeyPatch.context() as monkeypatch:  # the kernels inherit this environment when they start
        monkeypatch.setenv("JUPYTER_PATH", str(kernel_environment))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the kernel must never create a CUDA context before forking
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        outcomes = asyncio.run(_execute_all(NOTEBOOKS))
    return dict(zip(NOTEBOOKS, outcomes, strict=True))


async def _execute_all(names: list[str]) -> list[tuple[nbformat.NotebookNode, dict] | BaseException]:
    return await asyncio.gather(*(_execute(name) for name in names), return_exceptions=True)


async def _execute(name: str) -> tuple[nbformat.NotebookNode, dict]:
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(FACTS_CELL))
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},  # the kernel's cwd: `import training_report` works
    )
    await client.async_execute()
    stdout = [out["text"] for out in notebook.cells[-1].outputs if out.get("name") == "stdout"]
    return notebook, json.loads("".join(stdout).strip().splitlines()[-1])


def _outputs_of_type(notebook: nbformat.NotebookNode, mime: str) -> list[str]:
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if mime in data:
                found.append(data[mime])
    return found


def _full_model_parameters() -> int:
    return sum(p.numel() for p in GPTLightningModule("tiny").parameters())


def _check_common(notebook: nbformat.NotebookNode, facts: dict) -> None:
    """Every run trained on 2 ranks for MAX_STEPS logged steps, learned, and returned the whole model; the notebook
    showed a plot and a memory table with one row per run and rank."""
    full = _full_model_parameters()
    for name, run in facts.items():
        steps, losses = run["loss"]
        assert steps == list(range(MAX_STEPS)), name
        assert losses[-1] < losses[0] - 1.0, (name, losses[0], losses[-1])  # ~5.6 (uniform over 256 bytes) -> < 3.5
        assert run["world_size"] == 2, name
        assert run["returned_parameters"] == full, name
        assert set(run["memory"]) == {
            f"memory/{f}_rank{r}" for f in ("parameters", "gradients", "optimizer_state") for r in (0, 1)
        }, name
    assert _outputs_of_type(notebook, "image/png"), "no loss-curve plot"
    tables = [t for t in _outputs_of_type(notebook, "text/markdown") if t.startswith("| run | rank |")]
    assert len(tables) == 1
    for name in facts:
        for rank in (0, 1):
            assert f"| {name} | {rank} |" in tables[0]


def _held(run: dict, field: str, rank: int) -> float:
    return run["memory"][f"memory/{field}_rank{rank}"]


def _check_sharded(run: dict, reference: dict, field: str) -> None:
    """``field`` is split across the 2 ranks: each holds about half of the reference's (flat buckets pad a little)."""
    whole = _held(reference, field, 0)
    assert _held(reference, field, 1) == whole
    assert whole <= _held(run, field, 0) + _held(run, field, 1) <= whole * 1.02
    for rank in (0, 1):
        assert 0.45 * whole < _held(run, field, rank) < 0.55 * whole


def _check_overview(facts: dict) -> None:
    data_parallel, zero2, pipeline = facts["data parallel"], facts["ZeRO-2"], facts["pipeline (1F1B)"]
    assert zero2["loss"][1] == pytest.approx(data_parallel["loss"][1], rel=1e-4)
    assert _held(zero2, "parameters", 0) == _held(data_parallel, "parameters", 0)
    _check_sharded(zero2, data_parallel, "gradients")
    _check_sharded(zero2, data_parallel, "optimizer_state")
    # Each pipeline rank holds only its stage's layers: the two add up to the whole model, exactly.
    assert _held(pipeline, "parameters", 0) + _held(pipeline, "parameters", 1) == _held(data_parallel, "parameters", 0)


def _check_data_parallel(facts: dict) -> None:
    plain, fp16, powersgd = facts["all-reduce"], facts["fp16"], facts["PowerSGD"]
    assert plain["comm_bytes_per_step"] == 4 * _full_model_parameters()  # one fp32 all-reduce of every gradient
    assert fp16["comm_bytes_per_step"] == plain["comm_bytes_per_step"] / 2
    assert 0 < powersgd["comm_bytes_per_step"] < plain["comm_bytes_per_step"] / 10


def _check_sharded_optimizer(facts: dict) -> None:
    reference = facts["data parallel"]
    for name, run in facts.items():
        assert run["loss"][1] == pytest.approx(reference["loss"][1], rel=1e-4), name
        # The whole model, gathered from the shards into the kernel's module, equals data parallelism's weights.
        assert run["max_weight_difference_to_first_run"] < 1e-5, name
    sharded = {"ZeRO-1": ["optimizer_state"], "ZeRO-2": ["optimizer_state", "gradients"]}
    sharded["ZeRO-3"] = [*sharded["ZeRO-2"], "parameters"]
    for name, fields in sharded.items():
        for field in ("parameters", "gradients", "optimizer_state"):
            if field in fields:
                _check_sharded(facts[name], reference, field)
            else:  # ZeRO-1's gradients too: its reduced shard is a slice of the full bucket (reduced in place)
                assert _held(facts[name], field, 0) == _held(reference, field, 0), (name, field)


def _check_pipeline(facts: dict) -> None:
    whole_bytes = 4 * _full_model_parameters()
    gpipe = facts["GPipe"]
    for name, run in facts.items():
        assert run["loss"][1] == pytest.approx(gpipe["loss"][1], rel=1e-4), name
        assert _held(run, "parameters", 0) + _held(run, "parameters", 1) == whole_bytes, name
        assert 0 < _held(run, "parameters", 0) < whole_bytes, name


CHECKS = {
    "overview.ipynb": _check_overview,
    "data_parallel.ipynb": _check_data_parallel,
    "sharded_optimizer.ipynb": _check_sharded_optimizer,
    "pipeline_parallel.ipynb": _check_pipeline,
}


@pytest.mark.slow
@pytest.mark.timeout(4 * CELL_TIMEOUT_S)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_a_real_kernel(name: str, executed: dict) -> None:
    outcome = executed[name]
    if isinstance(outcome, BaseException):
        raise outcome
    notebook, facts = outcome
    _check_common(notebook, facts)
    CHECKS[name](facts)
