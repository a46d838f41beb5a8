"""docs/migrating.md is true: checkpoints cross between Lightning's strategies and ours, the Horovod port trains like
one device, and every snippet in the page runs (or, for a user's old code, at least parses).

* Lightning ``DDPStrategy`` -> ours -> ``DDPStrategy`` (and -> ZeRO-2 -> ``DDPStrategy``): real 2-rank fits, each
  resuming the other's checkpoint; weights and AdamW state equal an uninterrupted single-device run.
* Lightning ``FSDPStrategy`` cannot run on CPU (its accelerator check, then torch's FSDP1 given ``device_id=None``),
  so the format is checked with torch's FSDP1 on CPU (``device_id=cpu``): our checkpoint loads into it with the
  calls Lightning's ``FSDPStrategy.load_checkpoint`` makes, and the full state dict it gives back equals ours.
* ``examples/from_horovod.py``: its ``main()`` in 2 forked ranks with torchrun's variables, and under ``mpirun -np 2``
  where Open MPI is installed (CI), against one device.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from launch_helpers import assert_all_succeeded, assert_ranks_took_part, clean_environment, run_together
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, StrategyRegistry
from model_zoo import ResidualMLP, _Residual, loader, state_of, trainer
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, OptimStateKeyType, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, DistributedSampler
from training_helpers import assert_weights_close
from typing_extensions import override

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "migrating.md"
EXAMPLES = ROOT / "examples"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class AdamResidualMLP(ResidualMLP):
    """The zoo's residual MLP with AdamW, so checkpoints carry optimizer state (exp_avg, exp_avg_sq, step)."""

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------------------------- checkpoints, DDP <-> ours
def _fit(strategy: Any, world_size: int, rank: int, max_steps: int, resume: str | None, save: str | None) -> dict:
    """Every step trains on the same global batch (one batch per epoch), so a resume continues exactly. A resumed
    run starts from other initial weights: only a checkpoint that really loaded can give the expected result."""
    pl.seed_everything(0 if resume is None else 1, verbose=False)
    module = AdamResidualMLP()
    fit_trainer = trainer(strategy, world_size, max_steps=max_steps)
    fit_trainer.fit(module, loader(world_size, rank, steps=1), ckpt_path=resume)
    if save is not None:
        fit_trainer.save_checkpoint(save)
    optimizer = fit_trainer.optimizers[0]
    return {"weights": state_of(module), "optimizer": fit_trainer.strategy.optimizer_state(optimizer)}


def _round_trips(rank: int, world_size: int, workdir: str) -> dict:
    ddp, ours, zero = (f"{workdir}/{name}.ckpt" for name in ("ddp", "ours", "zero"))
    _fit(DDPStrategy(), world_size, rank, 2, None, ddp)  # Lightning's DDP writes a checkpoint at step 2
    return {
        "ours from ddp": _fit(DataParallelStrategy(), world_size, rank, 4, ddp, ours),
        "ddp from ours": _fit(DDPStrategy(), world_size, rank, 6, ours, None),
        "zero2 from ddp": _fit(ShardedOptimizerStrategy(stage=2), world_size, rank, 4, ddp, zero),
        "ddp from zero2": _fit(DDPStrategy(), world_size, rank, 6, zero, None),
    }


def _single_device(max_steps: int) -> dict:
    pl.seed_everything(0, verbose=False)
    module = AdamResidualMLP()
    fit_trainer = trainer("auto", 1, max_steps=max_steps)
    fit_trainer.fit(module, loader(steps=1))
    return {"weights": state_of(module), "optimizer": fit_trainer.optimizers[0].state_dict()}


def _assert_same_state(actual: dict, expected: dict, label: str) -> None:
    assert_weights_close(actual["weights"], expected["weights"], **TOLERANCE)
    state, reference = actual["optimizer"]["state"], expected["optimizer"]["state"]
    assert sorted(state) == sorted(reference), label
    for index, values in reference.items():
        for key, value in values.items():
            torch.testing.assert_close(state[index][key], value, **TOLERANCE, msg=lambda m, k=key: f"{label} {k}: {m}")


def test_lightning_ddp_and_our_strategies_resume_each_others_checkpoints(tmp_path):
    results = run_distributed(_round_trips, 2, args=(str(tmp_path),), init_process_group=False, timeout=180)
    expected = {4: _single_device(4), 6: _single_device(6)}
    initial = _single_device(0)["weights"]
    for label, result in results[0].items():
        steps = 6 if label.startswith("ddp") else 4
        _assert_same_state(result, expected[steps], label)
        assert any(not torch.equal(result["weights"][k], initial[k]) for k in initial), label


# ------------------------------------------------------------------------- checkpoints, FSDP (full) format <-> ours
def _through_fsdp(rank: int, world_size: int, checkpoint_path: str) -> dict[str, torch.Tensor] | None:
    """Load our checkpoint into torch FSDP1 with the calls Lightning's ``FSDPStrategy.load_checkpoint`` makes (weights
    and AdamW state), then take the weights out as its ``lightning_module_state_dict`` does (``"full"``)."""
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    module = AdamResidualMLP()
    # What Lightning passes (use_orig_params=True), except device_id: Lightning gives None on CPU, which torch refuses.
    fsdp = FullyShardedDataParallel(
        module, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({_Residual})
    )
    optimizer = module.configure_optimizers()  # over the original parameters, as Lightning's FSDP does
    full = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, full):
        fsdp.load_state_dict(checkpoint["state_dict"])
        state = FullyShardedDataParallel.rekey_optim_state_dict(
            checkpoint["optimizer_states"][0], OptimStateKeyType.PARAM_NAME, fsdp
        )
        optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(fsdp, optimizer, state))
    # Lightning's FSDPStrategy (state_dict_type="full") writes the weights with this call, but with
    # offload_to_cpu=True, which makes torch 2.13's FSDP1 segfault on CPU tensors; hence False. (Its optimizer call,
    # FSDP.optim_state_dict, returns AdamW's exp_avg overwritten by exp_avg_sq on CPU with either setting: not used.)
    save = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, save):
        weights = fsdp.state_dict()
    return weights if rank == 0 else None


def test_our_checkpoint_weights_round_trip_through_fsdp_full_state_dict(tmp_path):
    # Ours writes after 2 steps on 2 ranks (one more small fit: the format, not the trajectory, is under test here).
    path = str(tmp_path / "ours.ckpt")
    run_distributed(_save_ours, 2, args=(path,), init_process_group=False, timeout=180)
    ours = torch.load(path, weights_only=True)
    written = run_distributed(_through_fsdp, 2, args=(path,), timeout=180)[0]
    assert list(written) == list(ours["state_dict"])  # same names, same order: no FSDP prefixes
    assert_weights_close(written, ours["state_dict"], rtol=0, atol=0)


def _save_ours(rank: int, world_size: int, path: str) -> None:
    _fit(DataParallelStrategy(), world_size, rank, 2, None, path)


# ------------------------------------------------------------------------------------------------- Horovod port
def _import_example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import from_horovod

    return from_horovod


HOROVOD_ARGS = ["--max-steps", "3", "--batch-size", "4", "--fp16-allreduce"]
# fp16 all-reduce of the gradients: each rank's half-gradient is rounded to fp16 (relative 2^-11) before the sum.
# Measured: 4.6e-6 at most from one device, against < 1e-7 for an fp32 all-reduce.
FP16_TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}


def _horovod_reference() -> dict[str, torch.Tensor]:
    """One device on the global batch (2 x 4) with the lr the example scales by the world size (Horovod's rule)."""
    example = _import_example()
    pl.seed_everything(0, verbose=False)
    model = example.Net(lr=0.01 * 2, momentum=0.5)
    dataset = example.mnist_shaped(4 * 2 * 3)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer("auto", 1, max_steps=3).fit(model, DataLoader(dataset, batch_size=8, sampler=sampler))
    return state_of(model)


def _assert_horovod_port_trained_like_one_device(checkpoint: Path) -> None:
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    reference = _horovod_reference()
    assert_weights_close(saved, reference, **FP16_TOLERANCE)
    largest = max(float((saved[name] - reference[name]).abs().max()) for name in reference)
    assert largest > 5e-7, f"weights equal one device to {largest:.1e}: were the gradients all-reduced in fp16?"
    pl.seed_everything(0, verbose=False)
    initial = _import_example().Net(lr=0.0, momentum=0.0).state_dict()
    assert all(not torch.equal(saved[name], initial[name]) for name in initial)


def _run_example_main(rank: int, world_size: int, save: str) -> None:
    example = _import_example()
    sys.argv = ["from_horovod.py", *HOROVOD_ARGS, "--save", save]
    example.main()


def test_horovod_port_under_torchrun_variables_trains_like_one_device(tmp_path):
    save = tmp_path / "final.ckpt"
    env = {"LOCAL_WORLD_SIZE": "2"}  # as torchrun sets it; the example reads its layout from it
    run_distributed(_run_example_main, 2, args=(str(save),), init_process_group=False, env=env, timeout=180)
    _assert_horovod_port_trained_like_one_device(save)


# `mpirun -np 2` exactly as tests/test_mpi.py runs it (skips here, fails in CI, where Open MPI is missing).
from test_mpi import mpirun  # noqa: E402, F401  (a pytest fixture, shared by import)


@pytest.mark.slow
def test_horovod_port_under_mpirun_trains_like_one_device(mpirun, tmp_path):  # noqa: F811
    save = tmp_path / "final.ckpt"
    command = [*mpirun, sys.executable, str(EXAMPLES / "from_horovod.py"), *HOROVOD_ARGS, "--save", str(save)]
    finished = run_together({"mpirun": command}, {"mpirun": clean_environment()})
    output = assert_all_succeeded(finished)
    assert_ranks_took_part(output, world_size=2, num_nodes=1, environment="MPIEnvironment")
    _assert_horovod_port_trained_like_one_device(save)


# ------------------------------------------------------------------------------------- docs/migrating.md snippets
_BLOCK = re.compile(r"<!-- (run|before|in (\S+)) -->\n```python\n(.*?)```", re.DOTALL)
_CLASSES: dict[str, Any] = {
    "DataParallelStrategy": DataParallelStrategy,
    "ShardedOptimizerStrategy": ShardedOptimizerStrategy,
    "PipelineParallelStrategy": PipelineParallelStrategy,
    "DDPStrategy": DDPStrategy,
    "FSDPStrategy": FSDPStrategy,
    "DeepSpeedStrategy": DeepSpeedStrategy,
    "Trainer": pl.Trainer,
}
# Where a Lightning strategy forwards **kwargs: DDP's to torch's DistributedDataParallel, FSDP's to FSDP1.
_FORWARDED = {"DDPStrategy": torch.nn.parallel.DistributedDataParallel, "FSDPStrategy": FullyShardedDataParallel}


def test_every_python_block_in_the_migration_guide_is_marked_and_runs():
    text = DOC.read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) == text.count("```python") >= 10  # every block carries a marker
    for kind, source_file, code in blocks:
        if kind == "run":
            exec(compile(code, str(DOC), "exec"), {"__name__": "migrating_snippet"})  # builds strategies, no fit
        elif kind == "before":
            ast.parse(code)  # the user's current code (Horovod, raw torch): it must at least be Python
        else:
            source = [line.strip() for line in (ROOT / source_file).read_text().splitlines()]
            for line in filter(None, (line.strip() for line in code.splitlines())):
                assert line in source, f"{line!r} is not in {source_file}"


def _calls_in_inline_code(text: str) -> list[ast.Call]:
    calls = []
    for span in re.findall(r"`([^`\n]+)`", text):
        try:
            node = ast.parse(span, mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in _CLASSES:
            calls.append(node)
    return calls


def test_every_strategy_and_trainer_call_in_the_guide_tables_uses_real_arguments():
    calls = _calls_in_inline_code(DOC.read_text())
    assert len(calls) >= 40
    for call in calls:
        name = call.func.id
        accepted = set(inspect.signature(_CLASSES[name]).parameters)
        if name in _FORWARDED:
            accepted |= set(inspect.signature(_FORWARDED[name]).parameters)
        for keyword in call.keywords:
            assert keyword.arg in accepted, f"{ast.unparse(call)}: {name} has no argument {keyword.arg!r}"
        strategy = next((k.value for k in call.keywords if k.arg == "strategy"), None)
        if isinstance(strategy, ast.Constant):
            assert strategy.value in StrategyRegistry, ast.unparse(call)
        if name.endswith(("ParallelStrategy", "OptimizerStrategy")):
            _CLASSES[name](**{k.arg: ast.literal_eval(k.value) for k in call.keywords})  # our values are valid


def test_readme_links_the_migration_guide():
    assert "(docs/migrating.md)" in (ROOT / "README.md").read_text()
