"""A user module written only against the contract (not the demo GPT): fit with validation, callbacks,
test and predict under PipelineParallelStrategy; logged values and a torchmetrics metric equal single-device ones
on every rank. Also the DP x PP layout at 4 ranks."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from pipeline_helpers import fit_pipeline, fit_reference
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from training_helpers import SEED, assert_weights_close, cpu_trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy
from lightning_parallel.distributed.pipeline import ContractError
from lightning_parallel.distributed.pipeline.contract import model_inputs_of_batch

NUM_CLASSES = 4


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Classifier(pl.LightningModule):
    """Plain Lightning code plus `pipeline_layers()`: nothing else knows about pipelines."""

    def __init__(self, width: int = 16, misuse: str | None = None) -> None:
        super().__init__()
        self.misuse = misuse
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(Residual(width), Residual(width))
        self.head = nn.Linear(width, NUM_CLASSES)
        self.val_accuracy = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))

    def pipeline_layers(self):
        return [self.stem, *self.blocks, self.head]

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if self.misuse == "twice":
            logits = logits + self(x)
        if self.misuse == "submodule":
            logits = self.head(self.blocks(self.stem(x)))
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("train_count", float(len(x)), reduce_fx="sum", on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_accuracy(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", self.val_accuracy)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


def _data(num: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num, 8, generator=generator)
    return TensorDataset(inputs, torch.randint(NUM_CLASSES, (num,), generator=generator))


TRAIN, VAL = _data(64, 1), _data(22, 2)  # 22 = 2 full batches of 8 and a last batch of 6 (padded to 8)


def _run(rank: int, world_size: int, distributed: bool, root: str) -> dict:
    pl.seed_everything(SEED, verbose=False)
    module = Classifier()
    if distributed:
        strategy = PipelineParallelStrategy(schedule="1F1B", num_microbatches=4, timeout=60)
        train = DataLoader(TRAIN, batch_size=8)
    else:
        strategy = "auto"
        train = DataLoader(TRAIN, batch_size=8, sampler=DistributedSampler(TRAIN, 1, 0, shuffle=True, seed=SEED))
    val = DataLoader(VAL, batch_size=8)
    checkpoint = ModelCheckpoint(monitor="val_loss", save_top_k=1, dirpath=None)
    stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # stops after the 2nd epoch, everywhere
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_epochs=5,
        logger=CSVLogger(root, name="csv", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[checkpoint, stopping],
    )
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    logged = Path(root, "csv", "version_0", "metrics.csv").read_text() if trainer.is_global_zero else ""
    tested = trainer.test(module, dataloaders=val, verbose=False)
    predictions = trainer.predict(module, dataloaders=val)
    return {
        "epochs": trainer.current_epoch,
        "stopped": stopping.stopped_epoch,
        "fit_metrics": fit_metrics,
        "test": tested,
        "predictions": torch.cat(predictions),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "logged": logged,
        "best_model_path": checkpoint.best_model_path,
    }


def test_user_module_fits_validates_tests_and_predicts_like_single_device(tmp_path):
    (reference,) = run_distributed(
        _run, 1, args=(False, str(tmp_path / "single")), init_process_group=False, timeout=120
    )
    ranks = run_distributed(_run, 2, args=(True, str(tmp_path / "pipeline")), init_process_group=False, timeout=120)
    for result in ranks:  # identical decisions and metrics on every rank
        assert result["epochs"] == reference["epochs"] and result["stopped"] == reference["stopped"]
        assert result["fit_metrics"].keys() == reference["fit_metrics"].keys()
        for key, value in reference["fit_metrics"].items():
            assert result["fit_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert result["test"][0]["test_loss"] == pytest.approx(reference["test"][0]["test_loss"], rel=1e-5)
        assert torch.equal(result["predictions"], reference["predictions"])
        assert result["lr"] == reference["lr"]
    assert {"val_loss", "val_acc", "train_loss", "train_count"} <= reference["fit_metrics"].keys()
    assert reference["fit_metrics"]["train_count"] == 8.0
    # Rank 0 (the first stage, which never runs the user's step) wrote the last stage's values to its logger.
    header = ranks[0]["logged"].splitlines()[0].split(",")
    assert {"val_loss", "val_acc", "train_loss", "train_count"} <= set(header)
    assert ranks[0]["logged"].count("\n") == reference["logged"].count("\n")
    # ModelCheckpoint chose the same epoch (same file name) on every rank, and wrote it once.
    assert Path(ranks[0]["best_model_path"]).name == Path(reference["best_model_path"]).name
    assert ranks[0]["best_model_path"] == ranks[1]["best_model_path"]


def _misuse(rank: int, world_size: int, misuse: str) -> None:
    pl.seed_everything(SEED, verbose=False)
    trainer = cpu_trainer(
        devices=world_size,
        strategy=PipelineParallelStrategy(num_microbatches=2, timeout=30),
        max_steps=1,
    )
    trainer.fit(Classifier(misuse=misuse), train_dataloaders=DataLoader(TRAIN, batch_size=8))


@pytest.mark.parametrize(
    ("misuse", "message"),
    [("twice", "called `self(...)` a second time"), ("submodule", "lives on pipeline stage")],
)
def test_breaking_the_contract_is_a_clear_error(misuse, message):
    with pytest.raises(Exception) as error:
        run_distributed(_misuse, 2, args=(misuse,), init_process_group=False, timeout=60)
    assert message in str(error.value)
    assert ContractError.__name__ in str(error.value) or "RuntimeError" in str(error.value)


# ------------------------------------------------------------------ DP x PP
def test_two_pipelines_times_two_replicas_match_single_device():
    reference, reference_losses = fit_reference(batch_size=16, steps=3)
    results = run_distributed(
        fit_pipeline,
        4,
        args=({"pipeline_parallel_size": 2, "num_microbatches": 2}, 8, 3),
        init_process_group=False,
        timeout=180,
    )
    assert_weights_close(results[0]["weights"], reference, rtol=1e-5, atol=1e-6)
    for result in results:
        # Every rank logs its replica's loss: the mean over replicas is the single-device loss of the global batch.
        assert len(result["losses"]) == 3
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"], strict=True)]
    torch.testing.assert_close(mean, reference_losses, rtol=1e-5, atol=1e-6)
    assert results[0]["local_keys"] == results[2]["local_keys"] != results[1]["local_keys"]


def _validate_only(rank: int, world_size: int, distributed: bool, kind: str = "pipeline") -> dict:
    pl.seed_everything(SEED, verbose=False)
    module = Classifier()
    strategy: object = "auto"
    if kind == "data_parallel":
        strategy = DataParallelStrategy(timeout=60)
    elif distributed:
        strategy = PipelineParallelStrategy(schedule="GPipe", num_microbatches=2, pipeline_parallel_size=2, timeout=60)
    trainer = cpu_trainer(devices=world_size, strategy=strategy)  # validate() saves no checkpoint either way
    (metrics,) = trainer.validate(module, dataloaders=DataLoader(VAL, batch_size=8), verbose=False)
    return metrics


def test_validate_without_fit_splits_from_the_validation_batch():
    (reference,) = run_distributed(_validate_only, 1, args=(False,), init_process_group=False, timeout=120)
    for metrics in run_distributed(_validate_only, 2, args=(True,), init_process_group=False, timeout=120):
        assert metrics.keys() == reference.keys() == {"val_loss", "val_acc"}
        for key, value in reference.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_data_times_pipeline_validates_like_data_parallel():
    """2 pipelines x 2 replicas shard the validation set by replica exactly as 2 data-parallel ranks do."""
    reference = run_distributed(_validate_only, 2, args=(False, "data_parallel"), init_process_group=False, timeout=120)
    results = run_distributed(_validate_only, 4, args=(True,), init_process_group=False, timeout=180)
    for metrics in results:
        for key, value in reference[0].items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------ pipeline_inputs(batch): the step runs once
class CountingClassifier(Classifier):
    """Counts its training steps (as random masking or augmentation before `self(...)` would draw)."""

    def __init__(self) -> None:
        super().__init__()
        self.step_calls = 0

    def training_step(self, batch, batch_idx):
        self.step_calls += 1
        return super().training_step(batch, batch_idx)


class DeclaringClassifier(CountingClassifier):
    def pipeline_inputs(self, batch):
        return batch[0]  # the argument of `self(x)` in the step


def _fit_counting(rank: int, world_size: int, distributed: bool) -> dict:
    results = {}
    for declares_inputs in (True, False) if distributed else (True,):
        pl.seed_everything(SEED, verbose=False)
        module = DeclaringClassifier() if declares_inputs else CountingClassifier()
        if distributed:
            strategy = PipelineParallelStrategy(num_microbatches=4, timeout=60)
            train = DataLoader(TRAIN, batch_size=8)
        else:
            strategy = "auto"
            sampler = DistributedSampler(TRAIN, 1, 0, shuffle=True, seed=SEED)
            train = DataLoader(TRAIN, batch_size=8, sampler=sampler)
        trainer = cpu_trainer(
            devices=world_size,
            strategy=strategy,
            max_steps=3,
        )
        trainer.fit(module, train_dataloaders=train)
        weights = trainer.strategy.lightning_module_state_dict() if distributed else module.state_dict()
        results[declares_inputs] = {"calls": module.step_calls, "weights": weights}
    return results


def test_a_module_that_declares_its_pipeline_inputs_runs_its_step_once_per_micro_batch():
    (reference,) = run_distributed(_fit_counting, 1, args=(False,), init_process_group=False, timeout=120)
    first, last = run_distributed(_fit_counting, 2, args=(True,), init_process_group=False, timeout=120)
    # As on one device with 4-fold accumulation: once per micro-batch, on the last stage only.
    assert (first[True]["calls"], last[True]["calls"]) == (0, 3 * 4)
    assert_weights_close(first[True]["weights"], reference[True]["weights"], rtol=1e-5, atol=1e-6)
    # Without `pipeline_inputs`, every rank runs the step up to `self(...)` once per batch (and once at set-up).
    assert (first[False]["calls"], last[False]["calls"]) == (3 + 1, 3 * 4 + 3 + 1)
    assert_weights_close(first[False]["weights"], reference[True]["weights"], rtol=1e-5, atol=1e-6)


def test_pipeline_inputs_of_the_wrong_kind_is_a_clear_error():
    class Wrong(DeclaringClassifier):
        def pipeline_inputs(self, batch):
            return 3

    with pytest.raises(ContractError, match=r"Wrong.pipeline_inputs\(batch\)` returned int; .* a tensor, a tuple"):
        model_inputs_of_batch(Wrong(), "training_step", ((torch.zeros(2, 8), torch.zeros(2)), 0), {})
