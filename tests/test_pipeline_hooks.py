"""The whole model in the LightningModule's own hooks under the pipeline (issue 30, items 1 and 2).

A user-like module (``model_zoo.TiedGPT``: embedding tied to the LM head, two blocks) logs Lightning's
``grad_norm(self, norm_type)`` for the norms 2, 1 and inf in ``on_before_optimizer_step`` and for 2 in
``on_after_backward``, clips its gradients by hand there too, logs a weight norm in ``on_train_batch_end`` and
``on_validation_epoch_end``. What reaches the logger (rank 0, and every other rank) is compared key by key and
value by value with one device, and the weights after training too: 2 stages (world 2, in one process set with a run
where only the weight hooks are overridden) and 2 x 2 data x pipeline (world 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import grad_norm
from training_helpers import assert_weights_close

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.strategies.pipeline_hooks import HookWindows

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
CLIP = 0.05  # below every step's gradient norm: the hand clipping acts on every step


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call: ``{step: {key: value}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items() if k != "epoch"})


class WeightHooksGPT(zoo.TiedGPT):
    """Logs a weight norm in the training and validation hooks (SGD, so the weights show every gradient)."""

    def weight_norm(self) -> torch.Tensor:
        return torch.stack([p.detach().norm() for p in self.parameters()]).norm()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("w_norm", self.weight_norm())
        self.log("num_parameters", float(len(list(self.parameters()))))  # the tie counted once, as on one device

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, sync_dist=True)  # each replica has its share of the batches

    def on_validation_epoch_end(self) -> None:
        self.log("val_w_norm", self.weight_norm(), sync_dist=True)
        self.log("val_state_keys", float(len(self.state_dict())))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class GradientHooksGPT(WeightHooksGPT):
    """Adds Lightning's documented habit: ``grad_norm`` in ``on_before_optimizer_step`` (and after backward), and
    clipping by hand there (a write every rank makes to the tensors it owns)."""

    def on_after_backward(self) -> None:
        self.log_dict({f"after_backward/{k}": v for k, v in grad_norm(self, norm_type=2).items()})

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for norm_type in (2, 1, "inf"):
            self.log_dict(grad_norm(self, norm_type=norm_type))
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)


def _fit(
    make_model: Any, strategy: Any, devices: int, replicas: int = 1, replica: int = 0, **kwargs: Any
) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    logger = MemoryLogger()
    trainer = zoo.trainer(strategy, devices, logger=logger, log_every_n_steps=1, **kwargs)
    module = make_model()
    loader = zoo.loader(replicas, replica, kind="tokens")
    trainer.fit(module, loader, val_dataloaders=zoo.loader(replicas, replica, kind="tokens", steps=2))
    return {"metrics": logger.metrics, "weights": zoo.state_of(module)}


def _reference(make_model: Any) -> dict[str, Any]:
    (result,) = run_distributed(_reference_rank, 1, args=(make_model,), init_process_group=False, timeout=120)
    return result


def _reference_rank(rank: int, world_size: int, make_model: Any) -> dict[str, Any]:
    return _fit(make_model, "auto", 1)


def _two_stages(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    # Monitoring a value logged in a hook: every rank must take the same decision (saving is a collective).
    best = ModelCheckpoint(dirpath=directory, monitor="val_w_norm", mode="max", save_top_k=1)
    weights = PipelineParallelStrategy(schedule="GPipe", timeout=60)
    return {
        "gradients": _fit(GradientHooksGPT, PipelineParallelStrategy(timeout=60), world_size),
        "weights": _fit(WeightHooksGPT, weights, world_size, callbacks=[best], enable_checkpointing=True),
        "best": best.best_model_path,
    }


def _two_by_two(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, timeout=60)
    return {"gradients": _fit(GradientHooksGPT, strategy, world_size, replicas=2, replica=rank // 2)}


def _assert_same_logs(actual: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    assert sorted(actual) == sorted(expected)
    for step, metrics in expected.items():
        assert sorted(actual[step]) == sorted(metrics), step
        for key, value in metrics.items():
            torch.testing.assert_close(actual[step][key], value, **TOLERANCE, msg=f"step {step}, {key}")


def _check(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    grad_keys = [k for metrics in reference["metrics"].values() for k in metrics if k.startswith("grad_")]
    assert {k.split("_norm")[0] for k in grad_keys} <= {"grad_2.0", "grad_1.0", "grad_inf"}
    for result in results:  # rank 0's logger, and every other rank's: the same decisions everywhere
        _assert_same_logs(result["metrics"], reference["metrics"])
        assert_weights_close(result["weights"], reference["weights"], **TOLERANCE)


def test_hooks_see_the_whole_model_on_two_stages(tmp_path: Path) -> None:
    references = {"gradients": _reference(GradientHooksGPT), "weights": _reference(WeightHooksGPT)}
    assert "grad_inf_norm/head.weight" not in references["gradients"]["metrics"][0]  # tied: one name, as one device
    results = run_distributed(_two_stages, 2, args=(str(tmp_path),), init_process_group=False, timeout=240)
    for name, reference in references.items():
        _check([result[name] for result in results], reference)
    assert results[0]["best"] == results[1]["best"]
    saved = torch.load(results[0]["best"], weights_only=True)["state_dict"]  # written after the hook closed
    assert sorted(saved) == sorted(references["weights"]["weights"])


@pytest.mark.parametrize("world_size", [4])
def test_hooks_see_the_whole_model_on_two_by_two(world_size: int) -> None:
    reference = _reference(GradientHooksGPT)
    results = run_distributed(_two_by_two, world_size, init_process_group=False, timeout=240)
    _check([result["gradients"] for result in results], reference)


def test_sharded_stages_warn_that_the_hooks_see_one_stage() -> None:
    """With ZeRO's shards (a backend that shards the gradients) nothing is gathered: a warning names the hooks, and
    no callback is added."""
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    callbacks = list(trainer.callbacks)
    windows = HookWindows()
    with pytest.warns(
        UserWarning, match=r"on_after_backward, on_before_optimizer_step, on_train_batch_end.*zero_stage"
    ):
        windows.attach(trainer, GradientHooksGPT(), make_view=_no_view, shards=True)
    assert trainer.callbacks == callbacks
    windows.attach(trainer, zoo.TiedGPT(), make_view=_no_view, shards=True)  # overrides none: silent


def _no_view() -> Any:
    raise AssertionError("no view is built")
