"""The pipeline off the happy path (issue 10): exact like one device, or a clear error on every rank before training.

Each test forks 2 ranks once and runs several cases in them (real gloo, real Trainers), against single-device
Lightning on the same global batches (``model_zoo.single_device``):

* BatchNorm: torch's shape inference no longer folds an extra (or garbage) batch into the running statistics, and
  after ``fit`` every rank's module is whole again (every key, ``model(x)``, ``validate``, a new Trainer with
  ``ckpt_path``);
* a freeze/unfreeze schedule trains like one device;
* a positional ``reduce_fx="sum"`` sums over micro-batches;
* ``pipeline_layers()`` that is not ``forward``, LBFGS and ``sync_batchnorm=True`` are refused on both ranks;
* a run that fails mid-training leaves placeholders that raise on ``state_dict()`` instead of returning a part.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from training_helpers import assert_weights_close

from lightning_parallel import PipelineParallelStrategy

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class EvaluatedCNN(zoo.BatchNormCNN):
    """BatchNormCNN with a validation step (the module reused after ``fit``)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))


def _gpipe() -> PipelineParallelStrategy:
    # One micro-batch: BatchNorm then normalises the whole batch, as on one device (it normalises per micro-batch).
    return PipelineParallelStrategy(schedule="GPipe", num_microbatches=1, timeout=120)


def _reused_after_fit(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = EvaluatedCNN()
    trainer = zoo.trainer(_gpipe(), world_size)
    trainer.fit(module, zoo.loader())
    trainer.save_checkpoint(checkpoint)
    result: dict[str, Any] = {"after_fit": zoo.state_of(module)}
    x = zoo.dataset()[:8][0]
    module.eval()
    result["output"] = module(x).detach()
    (metrics,) = trainer.validate(module, zoo.loader(), verbose=False)  # the same Trainer splits it again
    result["val_loss"] = metrics["val_loss"]
    resumed = zoo.trainer(_gpipe(), world_size)  # a new Trainer loads a whole checkpoint into the same object
    resumed.fit(module, zoo.loader(), ckpt_path=checkpoint)
    result["after_resume"] = zoo.state_of(module)
    result["resumed_step"] = resumed.global_step
    return result


def test_batchnorm_trains_like_one_device_and_the_module_is_whole_again_on_every_rank(tmp_path):
    reference = zoo.single_device(EvaluatedCNN)
    results = run_distributed(
        _reused_after_fit, 2, args=(str(tmp_path / "fit.ckpt"),), init_process_group=False, timeout=180
    )
    single = EvaluatedCNN()
    single.load_state_dict(reference)
    single.eval()
    x = zoo.dataset()[:8][0]
    with torch.no_grad():
        expected_output = single(x)
    expected_val = torch.stack(
        [nn.functional.cross_entropy(single(bx), by) for bx, by in zoo.loader()]
    ).mean()  # equal batches: Lightning's epoch mean
    for result in results:
        # Weights and buffers: running_mean/var and num_batches_tracked count only the real batches.
        assert_weights_close(result["after_fit"], reference, **TOLERANCE)
        torch.testing.assert_close(result["output"], expected_output, **TOLERANCE)
        torch.testing.assert_close(result["val_loss"], float(expected_val), **TOLERANCE)
        assert result["resumed_step"] == zoo.STEPS
        assert_weights_close(result["after_resume"], reference, **TOLERANCE)
    assert int(reference["conv2.1.num_batches_tracked"]) == zoo.STEPS


def _freeze_schedule(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return zoo.fit_in_rank(zoo.FreezeScheduleModel, PipelineParallelStrategy(timeout=120), world_size)


def test_unfreezing_layers_mid_training_trains_like_one_device():
    reference = zoo.single_device(zoo.FreezeScheduleModel)
    pl.seed_everything(0, verbose=False)
    initial = zoo.state_of(zoo.FreezeScheduleModel())
    assert not torch.equal(reference["backbone.0.weight"], initial["backbone.0.weight"])  # the unfreeze trained it
    rank0, _ = run_distributed(_freeze_schedule, 2, init_process_group=False, timeout=180)
    assert_weights_close(rank0, reference, **TOLERANCE)


class _LBFGSModel(zoo.ResidualMLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class _TwiceSGD(torch.optim.SGD):
    """An optimizer unknown to the setup check that evaluates the closure twice per step."""

    def step(self, closure: Any = None) -> Any:
        closure()
        return super().step(closure)


class _TwiceClosureModel(zoo.ResidualMLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _TwiceSGD(self.parameters(), lr=0.1)


class _PositionalSum(zoo.ResidualMLP):
    """Logs the sum of the batch's first feature with a positional ``reduce_fx="sum"``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        # prog_bar, logger, on_step, on_epoch, reduce_fx
        self.log("feature_sum", x[:, 0].sum(), False, True, True, False, "sum")
        return loss


class _FailsAtStep1(zoo.ResidualMLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise KeyError("user error at step 1")
        return super().training_step(batch, batch_idx)


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["feature_sum"]))


def _error(run: Any) -> str:
    try:
        run()
    except Exception as error:  # the test asserts on the type and the text
        return f"{type(error).__name__}: {error}"
    return "no error"


def _refusals_and_logging(rank: int, world_size: int) -> dict[str, Any]:
    def fit(module: pl.LightningModule, **kwargs: Any) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        trainer = zoo.trainer(PipelineParallelStrategy(timeout=120), world_size, **kwargs)
        trainer.fit(module, zoo.loader())
        return trainer

    result = {
        "wrong_layers": _error(lambda: fit(zoo.ResidualMLP(wrong_layers=True))),
        "lbfgs": _error(lambda: fit(_LBFGSModel())),
        "closure_twice": _error(lambda: fit(_TwiceClosureModel())),
        "sync_batchnorm": _error(lambda: fit(zoo.BatchNormCNN(), sync_batchnorm=True)),
    }
    recorder = _Recorder()
    fit(_PositionalSum(), callbacks=[recorder])
    result["feature_sums"] = recorder.values
    failing = _FailsAtStep1()
    result["failed_fit"] = _error(lambda: fit(failing))
    result["state_dict_after_failure"] = _error(failing.state_dict)
    return result


def test_refusals_on_every_rank_and_a_positional_reduce_fx():
    results = run_distributed(_refusals_and_logging, 2, init_process_group=False, timeout=180)
    expected_sums = [float(x[:, 0].sum()) for x, _ in zoo.loader()]
    for result in results:
        assert result["wrong_layers"].startswith("ValueError: `pipeline_layers()` of `ResidualMLP` does not compose")
        assert "pipeline layer 2 (`Sequential`, `blocks.1.body`)" in result["wrong_layers"]
        assert "verify_layers=False" in result["wrong_layers"]
        assert result["lbfgs"].startswith("ValueError: `LBFGS` re-evaluates the loss")
        assert result["closure_twice"].startswith("RuntimeError: `_TwiceSGD` re-evaluates the loss")
        assert result["sync_batchnorm"].startswith("ValueError: `Trainer(sync_batchnorm=True)` is not supported")
        assert "'pipeline'" in result["sync_batchnorm"]
        torch.testing.assert_close(result["feature_sums"], expected_sums, **TOLERANCE)  # not the micro-batch mean
        assert result["failed_fit"] == "KeyError: 'user error at step 1'"  # the user's error, not a teardown one
        assert result["state_dict_after_failure"].startswith("RuntimeError: `")
        assert "pipeline run that failed" in result["state_dict_after_failure"]


@pytest.mark.parametrize("wrong", [False, True])
def test_the_layer_check_runs_alone_without_side_effects(wrong):
    # One process, no Trainer: the check itself leaves BatchNorm statistics and the RNG stream untouched.
    from lightning_parallel.distributed.pipeline.verify import check_layers_compose_to_forward

    torch.manual_seed(0)
    module = zoo.BatchNormCNN() if not wrong else zoo.ResidualMLP(wrong_layers=True)
    before = zoo.state_of(module)
    rng = torch.get_rng_state()
    x = zoo.dataset()[:8][0]
    if wrong:
        with pytest.raises(ValueError, match=r"pipeline layer 2 \(`Sequential`, `blocks.1.body`\)"):
            check_layers_compose_to_forward(module, module.pipeline_layers(), ((x,), {}))
    else:
        check_layers_compose_to_forward(module, module.pipeline_layers(), ((x,), {}))
    assert_weights_close(zoo.state_of(module), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)


class _SlicedInputGPT(zoo.TiedGPT):
    """Feeds the model a non-contiguous slice of the batch (``tokens[:, :-1]``), as language models often do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        sliced = tokens[:, :-1]
        assert not sliced.is_contiguous()
        return nn.functional.cross_entropy(self(sliced).flatten(0, 1), targets[:, :-1].flatten())


def _sliced_input(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    strategy = PipelineParallelStrategy(num_microbatches=2, timeout=120)
    return zoo.fit_in_rank(_SlicedInputGPT, strategy, world_size, kind="tokens")


def test_a_non_contiguous_model_input_trains_like_one_device():
    """torch 2.11's first stage compared its input's strides with the example it inferred shapes from, and raised
    ``PipeliningShapeError: stride mismatch`` for a sliced batch."""
    reference = zoo.single_device(_SlicedInputGPT, kind="tokens")
    rank0, _ = run_distributed(_sliced_input, 2, init_process_group=False, timeout=180)
    assert_weights_close(rank0, reference, **TOLERANCE)
