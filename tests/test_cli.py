"""The ``lightning-parallel`` CLI: parsing (names, class paths, YAML), errors, generated configs, real runs.

Every config in ``examples/configs`` trains for 2 steps on 2 (DP x PP: 4) forked CPU ranks inside this process
(``--trainer.strategy.start_method=fork``), and the runs agree with each other. Three runs re-launch Python through
each entry point with the default popen launcher (console script, ``python -m``, a user's script); their weights
must equal the forked runs' weights.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.cli import main, run_cli
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule
from lightning_parallel.demos.module import next_token_loss

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
CONFIG_NAMES = ("data_parallel", "zero1", "zero2", "zero3", "pipeline", "pipeline_dp")
# Configs whose global batch is 2 x 8 sequences split over two data-parallel replicas: the same training run.
SAME_RUN_AS_DATA_PARALLEL = ("zero1", "zero2", "zero3", "pipeline_dp")
DEADLINE_S = 240  # per process group collective, and per re-launched command

# Two optimizer steps, one validation batch, little of the corpus. No biases: a key bias gets an exactly-zero
# gradient, which Adam turns into rounding-sized steps that differ between exact-arithmetic-equivalent strategies.
QUICK = [
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.accelerator=cpu",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    f"--trainer.strategy.timeout={DEADLINE_S}",
    "--model.bias=false",
    "--data.max_bytes=50000",
]


@pytest.fixture(autouse=True)
def command_line(monkeypatch):
    """As under the console script: LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's."""
    monkeypatch.setattr(sys, "argv", ["lightning-parallel"])


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def _initial_weights() -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)  # the configs' seed_everything
    return _state(GPTLightningModule("tiny", bias=False))


def _parse(args: list[str]) -> Any:
    """Instantiate (not run) the CLI's classes for ``args``; return the Trainer's strategy."""
    return run_cli(["--trainer.accelerator=cpu", *args], run=False).trainer.strategy


# ------------------------------------------------------------------ parsing: names, class paths, YAML
@pytest.mark.parametrize(
    ("args", "expected_class", "expected"),
    [
        (["--trainer.strategy=zero2"], ShardedOptimizerStrategy, {"stage": 2, "start_method": "popen"}),
        (["--trainer.strategy=zero3_notebook"], ShardedOptimizerStrategy, {"stage": 3, "start_method": "fork"}),
        (["--trainer.strategy=data_parallel"], DataParallelStrategy, {"gradient_compression": None}),
        # A bare class path (no init_args), which jsonargparse would hand to the Trainer as a name.
        (
            ["--trainer.strategy=lightning_parallel.DataParallelStrategy"],
            DataParallelStrategy,
            {"start_method": "popen"},
        ),
        (["--trainer.strategy=ShardedOptimizerStrategy"], ShardedOptimizerStrategy, {"stage": 2}),
        (
            ["--trainer.strategy=pipeline_interleaved_spawn"],
            PipelineParallelStrategy,
            {"schedule": "Interleaved1F1B", "start_method": "spawn"},
        ),
        (
            [
                "--trainer.strategy=lightning_parallel.ShardedOptimizerStrategy",
                "--trainer.strategy.stage=1",
                "--trainer.strategy.timeout=90",
                "--trainer.strategy.checkpoint_format=sharded",
            ],
            ShardedOptimizerStrategy,
            {"stage": 1, "timeout": timedelta(seconds=90), "checkpoint_format": "sharded"},
        ),
        (
            [
                "--trainer.strategy=DataParallelStrategy",  # a short name works for an imported class
                "--trainer.strategy.gradient_compression=fp16",
                "--trainer.strategy.timeout=0:05:00",
                "--trainer.strategy.uneven_inputs=true",
            ],
            DataParallelStrategy,
            {"gradient_compression": "fp16", "timeout": timedelta(minutes=5), "uneven_inputs": True},
        ),
    ],
)
def test_strategy_names_and_class_paths_build_our_strategies(args, expected_class, expected):
    strategy = _parse(["--trainer.devices=2", *args])
    assert type(strategy) is expected_class
    for attribute, value in expected.items():
        assert getattr(strategy, attribute) == value, attribute


def test_yaml_class_path_and_init_args(tmp_path):
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        "trainer:\n"
        "  devices: 4\n"
        "  strategy:\n"
        "    class_path: lightning_parallel.PipelineParallelStrategy\n"
        "    init_args:\n"
        "      pipeline_parallel_size: 2\n"
        "      schedule: GPipe\n"
        "      num_microbatches: 4\n"
        "      partition: [2]\n"
        "      timeout: 0:30:00\n"
        "model:\n"
        "  preset: tiny\n"
        "  n_layer: 3\n"
    )
    cli = run_cli(["--config", str(config), "--trainer.accelerator=cpu"], run=False)
    strategy = cli.trainer.strategy
    assert type(strategy) is PipelineParallelStrategy
    assert (strategy.pipeline_parallel_size, strategy.schedule, strategy.partition) == (2, "GPipe", [2])
    assert strategy.num_microbatches == 4
    assert strategy.timeout == timedelta(minutes=30)  # as the generated configs write it
    assert cli.model.config.n_layer == 3
    assert type(cli.datamodule).__name__ == "TextDataModule"  # the default --data


def test_data_defaults_to_text_and_can_be_picked_by_name():
    cli = run_cli(["--data=RandomTokenDataModule", "--data.num_samples=12", "--trainer.accelerator=cpu"], run=False)
    assert type(cli.datamodule) is RandomTokenDataModule
    assert cli.datamodule.num_samples == 12


@pytest.mark.parametrize("name", ["zero4", "data-parallel", "lightning_parallel.NoSuchStrategy"])
def test_unknown_strategy_name_lists_the_valid_ones(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--trainer.strategy={name}", "--trainer.accelerator=cpu"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"Unknown strategy name `--trainer.strategy={name}`" in error
    for valid in ("data_parallel", "zero1", "zero2", "zero3", "pipeline", "pipeline_interleaved_notebook", "ddp"):
        assert f" {valid}," in error or f" {valid}." in error, valid


def test_invalid_init_arg_is_a_parse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.strategy=lightning_parallel.ShardedOptimizerStrategy", "--trainer.strategy.stage=4"])
    assert exit_info.value.code == 2
    assert "stage" in capsys.readouterr().err


# ------------------------------------------------------------------ plan subcommand
def test_plan_goes_to_the_planner(monkeypatch):
    calls = []
    planner = types.ModuleType("lightning_parallel.planner")
    planner.main = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "lightning_parallel.planner", planner)
    assert main(["plan", "--model.preset=tiny", "--devices=8"]) == 7
    assert calls == [["--model.preset=tiny", "--devices=8"]]


def test_plan_without_the_planner_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lightning_parallel.planner", None)  # makes the import fail
    assert main(["plan"]) == 2
    assert "lightning_parallel.planner" in capsys.readouterr().err


# ------------------------------------------------------------------ generated configs
def test_configs_show_our_docstrings_as_comments():
    texts = {name: (CONFIGS / f"{name}.yaml").read_text() for name in CONFIG_NAMES}
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(CONFIG_NAMES)
    assert "# 1, 2 or 3. (type: Literal[1, 2, 3], default: 2)\n      stage: 3\n" in texts["zero3"]
    assert '# Ranks per pipeline; ``"auto"`` uses all ranks' in texts["pipeline_dp"]
    assert "pipeline_parallel_size: 2\n" in texts["pipeline_dp"]
    assert '# ``None`` (fp32 all-reduce), ``"fp16"`` / ``"bf16"``' in texts["data_parallel"]
    assert "# Model size, a key of" in texts["zero1"]
    for name, text in texts.items():
        assert "timeout: 0:30:00\n" in text, name  # timedelta | float round-trips through YAML
        assert "precision_plugin:" not in text, name  # Trainer-owned strategy arguments are left out


@pytest.mark.slow
def test_checked_in_configs_are_what_regenerate_writes():
    completed = subprocess.run(
        [sys.executable, str(CONFIGS / "regenerate.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


# ------------------------------------------------------------------ every config trains (forked ranks)
@pytest.fixture(scope="module")
def forked_fit(tmp_path_factory):
    """``fit`` of one config on forked ranks inside this process; results cached per config name."""
    results: dict[str, tuple[Any, Any]] = {}

    def fit(name: str) -> tuple[Any, Any]:
        if name not in results:
            root = tmp_path_factory.mktemp(name)
            args = ["fit", "--config", str(CONFIGS / f"{name}.yaml"), *QUICK, "--trainer.strategy.start_method=fork"]
            cli = run_cli([*args, f"--trainer.default_root_dir={root}", "--trainer.enable_checkpointing=false"])
            results[name] = (cli.trainer, _state(cli.model))
        return results[name]

    return fit


EXPECTED_STRATEGY = {
    "data_parallel": (DataParallelStrategy, {}),
    "zero1": (ShardedOptimizerStrategy, {"stage": 1}),
    "zero2": (ShardedOptimizerStrategy, {"stage": 2}),
    "zero3": (ShardedOptimizerStrategy, {"stage": 3}),
    "pipeline": (PipelineParallelStrategy, {"pipeline_parallel_size": 2}),
    "pipeline_dp": (PipelineParallelStrategy, {"pipeline_parallel_size": 2}),
}


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_trains_on_forked_ranks(name, forked_fit):
    trainer, weights = forked_fit(name)
    expected_class, attributes = EXPECTED_STRATEGY[name]
    assert type(trainer.strategy) is expected_class
    assert trainer.num_devices == (4 if name == "pipeline_dp" else 2)
    for attribute, value in attributes.items():
        assert getattr(trainer.strategy, attribute) == value
    assert trainer.state.status == TrainerStatus.FINISHED
    assert {"train_loss", "val_loss", "val_perplexity"} <= set(trainer.callback_metrics)
    initial = _initial_weights()
    assert weights.keys() == initial.keys()
    changed = [key for key in weights if not torch.equal(weights[key], initial[key])]
    assert len(changed) == len(weights), (
        f"parameters not trained (or not sent back to rank 0): {set(weights) - set(changed)}"
    )


@pytest.mark.parametrize("name", SAME_RUN_AS_DATA_PARALLEL)
def test_configs_with_the_same_global_batch_train_the_same_weights(name, forked_fit):
    _, reference = forked_fit("data_parallel")
    trainer, weights = forked_fit(name)
    torch.testing.assert_close(weights, reference)
    torch.testing.assert_close(
        trainer.callback_metrics["val_loss"], forked_fit("data_parallel")[0].callback_metrics["val_loss"]
    )


# ------------------------------------------------------------------ validate / test / predict (forked ranks)
def _expected_eval_loss(num_samples: int, seq_len: int, batch_size: int) -> torch.Tensor:
    """Mean of the per-batch losses of the untrained seeded model over the evaluation set, in one process."""
    module = _initial_module()
    data = RandomTokenDataModule(num_samples, seq_len=seq_len, batch_size=batch_size)
    with torch.no_grad():
        losses = [next_token_loss(module(x), y) for x, y in data.val_dataloader()]
    return torch.stack(losses).mean()


def _initial_module() -> GPTLightningModule:
    pl.seed_everything(0, verbose=False)
    return GPTLightningModule("tiny", bias=False).eval()


def test_validate_test_predict_subcommands(tmp_path):
    data = ["--data=RandomTokenDataModule", "--data.num_samples=32", "--data.seq_len=16", "--data.batch_size=8"]
    common = [
        "--config",
        str(CONFIGS / "zero2.yaml"),
        *QUICK,
        *data,
        "--trainer.strategy.start_method=fork",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.limit_val_batches=null",
    ]
    expected = _expected_eval_loss(32, 16, 8)  # 4 batches: 2 per rank, averaged over both ranks
    validate = run_cli(["validate", *common])
    torch.testing.assert_close(validate.trainer.callback_metrics["val_loss"], expected)
    test = run_cli(["test", *common])  # RandomTokenDataModule tests on its validation set
    assert test.trainer.state.fn == TrainerFn.TESTING
    torch.testing.assert_close(test.trainer.callback_metrics["test_loss"], expected)
    predict = run_cli(["predict", *common])
    assert predict.trainer.state.fn == TrainerFn.PREDICTING
    assert predict.trainer.state.status == TrainerStatus.FINISHED
    assert predict.trainer.num_devices == 2


# ------------------------------------------------------------------ the popen launcher through each entry point
def _run(command: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-6000:]
    return output


def _checkpoint_weights(root: Path) -> dict[str, torch.Tensor]:
    checkpoints = sorted((root / "checkpoints").glob("*.ckpt"))
    assert [c.name for c in checkpoints] == ["epoch=0-step=2.ckpt"], checkpoints
    return torch.load(checkpoints[0], map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry_point", "name"),
    [
        pytest.param([str(Path(sys.executable).with_name("lightning-parallel"))], "zero2", id="console-script-zero2"),
        pytest.param([sys.executable, "-m", "lightning_parallel"], "pipeline", id="python-m-pipeline"),
    ],
)
def test_popen_relaunch_through_the_entry_point(entry_point, name, tmp_path, forked_fit):
    if not Path(entry_point[0]).exists():
        pytest.fail(f"{entry_point[0]} is missing: install the package (`pip install -e .`) to get the console script")
    root = tmp_path / "run"
    args = ["fit", "--config", str(CONFIGS / f"{name}.yaml"), *QUICK, f"--trainer.default_root_dir={root}"]
    output = _run([*entry_point, *args], cwd=tmp_path)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in output
    # The re-launched rank 1 parsed the same command line: the result is the forked run's, bit for bit.
    torch.testing.assert_close(_checkpoint_weights(root), forked_fit(name)[1], rtol=0, atol=0)


@pytest.mark.slow
def test_user_module_with_lightning_cli_and_our_strategy_name(tmp_path):
    output = _run(
        [
            sys.executable,
            str(ROOT / "examples" / "user_module_cli.py"),
            "fit",
            "--trainer.strategy=zero2",
            "--trainer.devices=2",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert "ShardedOptimizerStrategy(stage=2) bytes held per rank" in output
    assert "  rank 0: parameters" in output and "  rank 1: parameters" in output
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in output


def test_main_module_is_the_cli():
    assert importlib.import_module("lightning_parallel.__main__").main is main
