"""The package's layers: the library never loads the demo, ``distributed/`` and the accounting module import no
Lightning, and the demo reaches the monitor and the planner only through their public hooks (``batch_size_fn`` /
``length_fn``, ``transformer_shape()``, the preset and config registries)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from training_helpers import make_trainer

from lightning_parallel import ParallelismMonitor, plan
from lightning_parallel.demos import GPT, GPTConfig, GPTLightningModule, RandomTokenDataset
from lightning_parallel.planner import TransformerShape

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_parallel"


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet) and return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_the_library_does_not_load_the_demo() -> None:
    loaded = json.loads(
        _fresh_python(
            """
            import json, sys
            import lightning_parallel, lightning_parallel.strategies.registry, lightning_parallel.cli
            print(json.dumps(sorted(m for m in sys.modules if m.startswith("lightning_parallel"))))
            """
        )
    )
    assert "lightning_parallel.strategies.registry" in loaded and "lightning_parallel.planner" in loaded
    assert [m for m in loaded if m.startswith("lightning_parallel.demos")] == []


def test_distributed_and_accounting_import_torch_only() -> None:
    """Every module under ``distributed/`` (and ``accounting``, ``choices``, ``instrumentation``), imported without
    the package's ``__init__`` (which loads the strategies), pulls in no Lightning and no other layer of the
    package."""
    offenders = json.loads(
        _fresh_python(
            f"""
            import importlib, json, pathlib, sys, types

            package = types.ModuleType("lightning_parallel")  # the package without its __init__ (the strategies)
            package.__path__ = [{str(PACKAGE_DIR)!r}]
            sys.modules["lightning_parallel"] = package
            root = pathlib.Path({str(PACKAGE_DIR)!r})
            files = sorted((root / "distributed").rglob("*.py"))  # listed without importing (unlike pkgutil)
            names = ["lightning_parallel." + n for n in ("accounting", "choices", "instrumentation")]
            names += [".".join(("lightning_parallel", *f.relative_to(root).with_suffix("").parts)) for f in files]
            names = [n.removesuffix(".__init__") for n in names]
            forbidden = ("lightning.", "lightning_parallel.strategies", "lightning_parallel.monitor",
                         "lightning_parallel.planner", "lightning_parallel.demos")
            offenders, seen = {{}}, set()
            for name in names:
                importlib.import_module(name)
                new = sorted(m for m in set(sys.modules) - seen if m == "lightning" or m.startswith(forbidden))
                if new:
                    offenders[name] = new[:3]
                seen |= set(sys.modules)
            print(json.dumps(offenders))
            """
        )
    )
    assert offenders == {}


def _branches_on(function: ast.FunctionDef, attributes: set[str]) -> list[int]:
    """Lines of ``if``/conditional expressions/comparisons in ``function`` that read ``self.<attribute>``."""
    lines = []
    for node in ast.walk(function):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Compare | ast.Match):
            tested = node.test if isinstance(node, ast.If | ast.IfExp | ast.While) else node
            for inner in ast.walk(tested):
                if (
                    isinstance(inner, ast.Attribute)
                    and inner.attr in attributes
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self"
                ):
                    lines.append(node.lineno)
    return lines


def test_no_sharded_optimizer_method_branches_on_the_zero_stage() -> None:
    """The backend chosen once in `setup` decides; the strategy never asks which stage or backend it holds."""
    tree = ast.parse((PACKAGE_DIR / "strategies" / "sharded_optimizer.py").read_text())
    (strategy,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ShardedOptimizerStrategy"]
    methods = [n for n in strategy.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) > 20
    stage_state = {"stage", "_buckets", "_fsdp_units", "_sharded_optimizers"}
    branches = {m.name: lines for m in methods if m.name != "__init__" and (lines := _branches_on(m, stage_state))}
    assert branches == {}


_PIPELINE_MODES = {"zero_stage", "_zero", "_fully_shard", "checkpoint_format", "_checkpoints"}
"""What ``PipelineParallelStrategy`` chooses its stage's backend and checkpoint format from (once: ``__init__`` and the
split's ``backend_type`` call), and the objects its methods used to branch on."""


def _asks_which_sync(function: ast.FunctionDef) -> list[int]:
    """Lines of conditions in ``function`` that ask which sync or checkpoint format it holds: a class named like one
    (``...Sync``, ``...Checkpoint``, ``PipelineZero``, ``PipelineFullyShard``: ``isinstance``/``type`` tests), or an
    attribute of the stage's backend (``run.backend.<...>``)."""
    lines = []
    for node in ast.walk(function):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Compare | ast.Match):
            tested = node.test if isinstance(node, ast.If | ast.IfExp | ast.While) else node
            for inner in ast.walk(tested):
                name = (
                    inner.id if isinstance(inner, ast.Name) else inner.attr if isinstance(inner, ast.Attribute) else ""
                )
                if (
                    name in {"sync", "backend"}
                    or name.endswith(("Sync", "Backend", "Checkpoint"))
                    or name in {"PipelineZero", "PipelineFullyShard"}
                ):
                    lines.append(node.lineno)
    return lines


def _pipeline_method_branches(source: str) -> dict[str, list[int]]:
    tree = ast.parse(source)
    (strategy,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PipelineParallelStrategy"]
    methods = [n for n in strategy.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) > 30
    return {
        m.name: lines
        for m in methods
        if m.name != "__init__" and (lines := sorted({*_branches_on(m, _PIPELINE_MODES), *_asks_which_sync(m)}))
    }


def test_no_pipeline_method_branches_on_the_zero_stage_or_the_checkpoint_format() -> None:
    """The stage's backend (``zero/backends/choice.py``, chosen at the split) and the checkpoint format (chosen in
    ``__init__``) decide; no method of the strategy asks which stage, sync or format it holds. Checks of the user's
    settings at the edge (module functions such as ``_check_callbacks``) may read them."""
    assert _pipeline_method_branches((PACKAGE_DIR / "strategies" / "pipeline.py").read_text()) == {}


def test_the_pipeline_branch_rule_sees_a_branch_on_the_mode() -> None:
    """The rule above is not vacuous: each kind of branch it forbids is found."""
    source = textwrap.dedent(
        """
        class PipelineParallelStrategy:
            def __init__(self):
                self.zero_stage = 3
        """
    )
    source += "".join(f"    def m{i}(self):\n        pass\n" for i in range(30))
    source += textwrap.indent(
        textwrap.dedent(
            """
            def stage(self):
                return 1 if self.zero_stage == 3 else 0
            def fmt(self):
                if self.checkpoint_format != "sharded":
                    return None
            def kind(self, run):
                if isinstance(run.backend, FlatBucketBackend):
                    return None
            def buckets(self, run):
                while run.backend.buckets is None:
                    pass
            """
        ),
        "    ",
    )
    assert set(_pipeline_method_branches(source)) == {"stage", "fmt", "kind", "buckets"}


class _Counted(nn.Module):
    """A model the planner knows only through the hook: a GPT under another name, reporting its shape itself."""

    def __init__(self, config: GPTConfig, *, report: object = None) -> None:
        super().__init__()
        self.network = GPT(config)
        self.config = config
        self.report = report

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.network(idx)

    def transformer_shape(self) -> TransformerShape:
        if self.report is not None:
            return self.report  # type: ignore[return-value]
        c = self.config
        return TransformerShape(
            num_layers=c.n_layer, hidden_size=c.n_embd, num_heads=c.n_head, vocab_size=c.vocab_size, max_seq_len=32
        )


_BACKEND_CLASSES = {"FlatBucketBackend", "FullyShardBackend", "ReplicatedBackend", "MasterWeightBackend"}


def test_one_chooser_builds_every_holder() -> None:
    """A whole model, a pipeline stage and the planner's dry run are held by the backend `backend_type` picks: no
    module outside `distributed/zero/backends/` imports a backend class, and no class of the pipeline implements the
    gradient sync itself (a family that forwards to the backends would)."""
    importers, syncs = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        if not relative.startswith("distributed/zero/backends/"):
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and _BACKEND_CLASSES & {alias.name for alias in node.names}:
                    importers.append(relative)
        if relative.startswith("distributed/pipeline/"):
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
                    if {"reduce_gradients", "after_optimizer_step"} <= methods:
                        syncs.append(f"{relative}:{node.name}")
    assert importers == []
    assert syncs == []


def test_the_planner_reads_the_transformer_shape_hook_not_the_demo_class() -> None:
    config = GPTConfig.from_preset("tiny")
    with torch.device("meta"):
        hooked, plain, gpt = _Counted(config), nn.Sequential(GPT(config)), GPT(config)
    hooked_plan = plan(hooked, world_size=2, batch_size=2)
    gpt_plan = plan(gpt, world_size=2, batch_size=2, seq_len=32)
    assert hooked_plan.seq_len == 32
    expected = [r.activations for r in gpt_plan.configuration("zero2").ranks]
    assert [r.activations for r in hooked_plan.configuration("zero2").ranks] == expected
    assert expected[0] is not None and expected[0] > 0
    # Without the hook (a `config` attribute is not enough): held bytes as before, no activation estimate.
    plain_plan = plan(plain, world_size=2, batch_size=2, seq_len=32)
    assert plain_plan.configuration("zero2").ranks[0].activations is None
    assert plain_plan.configuration("zero2").ranks[0].held == gpt_plan.configuration("zero2").ranks[0].held
    # The demo's registrations: a preset name and a GPTConfig plan like the module they build.
    assert str(plan(config, world_size=2)) == str(plan(gpt, world_size=2))
    with torch.device("meta"):
        module = GPTLightningModule("tiny")
    by_name, by_module = plan("tiny", world_size=4), plan(module, world_size=4)
    assert [c.ranks for c in by_name.configurations] == [c.ranks for c in by_module.configurations]
    with torch.device("meta"):
        wrong = _Counted(config, report={"num_layers": 2})
    with pytest.raises(TypeError, match=r"_Counted.transformer_shape\(\)` returned dict"):
        plan(wrong, world_size=2)


def test_the_monitor_counts_batches_with_the_given_functions(tmp_path: Path) -> None:
    def fit(**monitor_args: object) -> list:
        monitor = ParallelismMonitor(summary_path=tmp_path / "summary.json", figure_path=False, **monitor_args)
        trainer = make_trainer("auto", devices=1, max_steps=2, callbacks=[monitor])
        pl.seed_everything(0, verbose=False)
        loader = DataLoader(RandomTokenDataset(16, 8, seed=1), batch_size=4)
        trainer.fit(GPTLightningModule("tiny", block_size=8), train_dataloaders=loader)
        return [(s.samples, s.tokens) for s in monitor.steps]

    assert fit() == [(4, 32), (4, 32)]  # the default: dim 0 and elements of the (B, T) input tensor
    assert fit(batch_size_fn=lambda batch: 3 * len(batch[0]), length_fn=lambda batch: 0) == [(12, 0), (12, 0)]
    with pytest.raises(TypeError, match="batch_size_fn=4"):
        ParallelismMonitor(batch_size_fn=4)  # type: ignore[arg-type]
