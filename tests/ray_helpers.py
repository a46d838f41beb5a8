"""The training function the Ray Train tests run in every Ray worker (imported there by name: tests/ is on the
workers' ``PYTHONPATH``), and what it leaves in its output folder for the test to read.

One ``TorchTrainer`` run covers every check, since starting Ray's workers costs far more than training the tiny GPT:

* first attempt: each strategy in ``config["runs"]`` trains ``EQUAL_STEPS`` steps and saves its consolidated weights
  (``<label>.ckpt``), the batches each rank read (``<label>_batches_rank<r>.json``) and how each Trainer was wired
  (``wiring_rank<r>.json``: Ray's process group kept, no launcher); then the resumable run
  (``config["resumable"]``) trains with ``RayTrainReportCallback`` until rank ``KILL_RANK`` dies (``os._exit``) at
  step ``KILL_STEP``;
* second attempt (Ray restarted the workers, ``FailureConfig``): the resumable run continues from Ray's latest
  checkpoint (written at the end of epoch ``KILL_STEP // STEPS_PER_EPOCH - 1``) to its end and saves
  ``resumable.ckpt``; ``starts.txt`` gets one ``attempt rank global_step`` line per fit start.

Before the resumable run, each strategy in ``config["streamed"]`` trains one epoch of ``tests/streamed_data.py``'s
``StreamedMLP`` on the LitData chunks in ``config["streamed_dir"]`` and a Hugging Face streaming dataset, and saves
the sample indices of every step this rank trained on (``streamed_<label>_rank<r>.json``, issue 43).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import ray.train
import torch
import torch.distributed as dist
from launch_helpers import GLOBAL_BATCH, SEQ_LEN  # the Ray runs are compared with the launchers' reference
from lightning.pytorch.callbacks import Callback
from ray.train.lightning import RayLightningEnvironment
from streamed_data import StreamedMLP, batch_indices
from training_helpers import cpu_trainer

from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule
from lightning_parallel.integrations.ray import (
    RayTrainReportCallback,
    prepare_trainer,
    ray_strategy,
    resume_checkpoint_path,
)

EQUAL_STEPS = 3  # as tests/launch_helpers.py's reference_weights
STEPS_PER_EPOCH, EPOCHS = 2, 4  # the resumable run: a checkpoint reported to Ray every 2 steps
KILL_STEP, KILL_RANK = 5, 1


class _RecordBatches(Callback):
    """Every batch this rank reads: ``[global_step, sum of the inputs, first token]``."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        inputs = batch[0]
        self.batches.append([trainer.global_step, int(inputs.sum()), int(inputs.flatten()[0])])


class _KillOnce(Callback):
    """Rank ``KILL_RANK`` exits hard at the start of step ``KILL_STEP``, once (a marker file remembers it), while
    the other rank waits in that step's collectives."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == KILL_RANK and trainer.global_step == KILL_STEP and not self.marker.exists():
            self.marker.touch()
            # Die only once Ray's controller registered the checkpoints reported so far (public API, blocks until
            # every report in flight is processed): the restart then resumes from the last one, deterministically.
            ray.train.get_all_reported_checkpoints(timeout_s=120)
            os._exit(1)


class _RecordIndices(Callback):
    """The samples of every step this rank trains on, per library (``streamed_data.batch_indices``)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, list[int]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append(batch_indices(batch, pl_module.libraries))


class _RecordStart(Callback):
    def __init__(self, path: Path, attempt: int) -> None:
        self.path, self.attempt = path, attempt

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        with self.path.open("a") as file:
            file.write(f"{self.attempt} {trainer.global_rank} {trainer.global_step}\n")


def _ray_trainer(spec: dict[str, Any], *, callbacks: list[Callback], **limits: Any) -> pl.Trainer:
    """A Trainer with the Ray variant of ``spec``'s strategy, through ``prepare_trainer``."""
    pl.seed_everything(0, verbose=False)
    trainer = cpu_trainer(
        devices="auto",
        strategy=ray_strategy(spec["name"], timeout=60, **spec["options"]),
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        limit_val_batches=0,
        **limits,
    )
    return prepare_trainer(trainer)


def _fit(spec: dict[str, Any], *, steps: int, samples: int, callbacks: list[Callback], ckpt_path: str | None) -> Any:
    trainer = _ray_trainer(spec, callbacks=callbacks, max_steps=steps)
    model = GPTLightningModule("tiny", block_size=SEQ_LEN, learning_rate=1e-3)
    batch_size = GLOBAL_BATCH // trainer.distributed_sampler_kwargs["num_replicas"]
    trainer.fit(
        model, datamodule=RandomTokenDataModule(samples, seq_len=SEQ_LEN, batch_size=batch_size), ckpt_path=ckpt_path
    )
    return trainer


def train_loop_per_worker(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    ray_group = dist.group.WORLD  # Ray created it before calling this function
    wiring: dict[str, Any] = {}
    with resume_checkpoint_path() as ckpt_path:
        attempt = 0 if ckpt_path is None else 1
        if ckpt_path is None:
            for label, spec in config["runs"].items():
                recorder = _RecordBatches()
                trainer = _fit(
                    spec, steps=EQUAL_STEPS, samples=GLOBAL_BATCH * EQUAL_STEPS, callbacks=[recorder], ckpt_path=None
                )
                trainer.save_checkpoint(out / f"{label}.ckpt")
                wiring[label] = {
                    "same_group": dist.group.WORLD is ray_group,
                    # Lightning's script launcher starts children only where the environment did not start them.
                    "external": trainer.strategy.cluster_environment.creates_processes_externally,
                    "environment": type(trainer.strategy.cluster_environment).__name__,
                    "world_size": trainer.world_size,
                    "global_rank": trainer.global_rank,
                }
                (out / f"{label}_batches_rank{rank}.json").write_text(json.dumps(recorder.batches))
            (out / f"wiring_rank{rank}.json").write_text(json.dumps(wiring))
            for label, spec in config.get("streamed", {}).items():
                indices = _RecordIndices()
                module = StreamedMLP(Path(config["streamed_dir"]), tuple(spec["libraries"]))
                _ray_trainer(spec, callbacks=[indices], max_epochs=1).fit(module)
                (out / f"streamed_{label}_rank{rank}.json").write_text(json.dumps(indices.steps))
        callbacks = [RayTrainReportCallback(), _KillOnce(out / "killed"), _RecordStart(out / "starts.txt", attempt)]
        steps = STEPS_PER_EPOCH * EPOCHS
        trainer = _fit(
            config["resumable"],
            steps=steps,
            samples=GLOBAL_BATCH * STEPS_PER_EPOCH,
            callbacks=callbacks,
            ckpt_path=ckpt_path,
        )
        trainer.save_checkpoint(out / "resumable.ckpt")
