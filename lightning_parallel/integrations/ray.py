"""Ray Train: our strategies inside ``ray.train.torch.TorchTrainer``, the way Ray's own Lightning strategies run.

Ray Train starts one worker process per ``ScalingConfig.num_workers``, creates the torch process group itself
(``TorchConfig``: backend, timeout) and then calls the training function in every worker. Ray's ``prepare_trainer``
accepts only Ray's three strategies (``RayDDPStrategy``, ``RayFSDPStrategy``, ``RayDeepSpeedStrategy``); this module
gives ours the same treatment:

* :class:`RayDataParallelStrategy`, :class:`RayShardedOptimizerStrategy`, :class:`RayPipelineParallelStrategy`: the
  strategies of this package with Ray's device (``ray.train.torch.get_device()``) and Ray's layout (world size and
  ranks from ``RayLightningEnvironment``, never checked against ``devices``/``num_nodes``: Ray places the workers).
  They start no process and join the process group Ray created. Unlike Ray's strategies they keep our data sampler
  on the data-parallel rank: all stages of one pipeline read the same batch;
* :func:`ray_strategy` builds one of them from a registry name (``"zero2"``, ``"pipeline"``, ...);
* :func:`prepare_trainer` is Ray's check for them (Ray's own strategies are passed on to Ray's);
* :class:`RayTrainReportCallback`: Ray's callback of that name (a checkpoint and the metrics reported to Ray once per
  epoch), reporting at the end of the epoch's last training step instead of in ``on_train_epoch_end``, so that a
  resumed run trains exactly as an uninterrupted one;
* :func:`resume_checkpoint_path`: the Lightning checkpoint inside Ray's latest reported checkpoint; pass it to
  ``fit(ckpt_path=...)`` so a run restarted by ``FailureConfig(max_failures=...)`` continues where the last report
  left it.

Only this module imports Ray; nothing else in the package imports this module. See docs/running-on-a-cluster.md
("Ray Train") and ``examples/ray_train.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import ray.train
import ray.train.lightning
import ray.train.torch
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from ray.train.lightning import RayLightningEnvironment
from typing_extensions import override

from lightning_parallel.strategies.base import LightningParallelStrategy
from lightning_parallel.strategies.data_parallel import DataParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.sharded_optimizer import ShardedOptimizerStrategy

__all__ = [
    "RayDataParallelStrategy",
    "RayPipelineParallelStrategy",
    "RayShardedOptimizerStrategy",
    "RayTrainReportCallback",
    "prepare_trainer",
    "ray_strategy",
    "resume_checkpoint_path",
]


def _check_ray_environment(strategy: LightningParallelStrategy) -> None:
    """Local: refuse a Trainer without ``RayLightningEnvironment`` (every rank, before any collective)."""
    environment = strategy.cluster_environment
    if not isinstance(environment, RayLightningEnvironment):
        raise ValueError(
            f"{type(strategy).__name__} runs inside Ray Train and reads the ranks from Ray, but the Trainer's cluster"
            f" environment is {type(environment).__name__}. Pass"
            " `plugins=[ray.train.lightning.RayLightningEnvironment()]` to the Trainer."
        )


def _check_in_ray_worker(strategy: LightningParallelStrategy) -> None:
    """Local: with ``RayLightningEnvironment``, refuse to run outside a Ray Train worker (the driver, a plain script),
    where Ray's environment cannot say a rank and Ray's own error names neither the strategy nor the fix."""
    if not isinstance(strategy.cluster_environment, RayLightningEnvironment):
        return  # `setup_environment` names the missing environment
    try:
        ray.train.get_context().get_world_size()
    except RuntimeError as error:
        raise RuntimeError(
            f"{type(strategy).__name__} with `RayLightningEnvironment()` reads its ranks from Ray Train, but this"
            " process is not a Ray Train worker (the driver or a plain script). Build the Trainer inside the training"
            " function you pass to `ray.train.torch.TorchTrainer(train_func, scaling_config=...)` and start it with"
            ' `.fit()` (docs/running-on-a-cluster.md, "Ray Train"); to train without Ray, use the plain strategy'
            f" ({', '.join(plain.__name__ for plain in _RAY_CLASSES)}) without `RayLightningEnvironment`."
        ) from error


class _InRayWorker(LightningParallelStrategy):
    """What every Ray variant changes: the layout and device come from Ray, the cluster environment must be Ray's."""

    layout_from_environment = True

    @override
    def set_world_ranks(self) -> None:  # Lightning reads the environment's ranks here, in `Trainer.__init__`
        _check_in_ray_worker(self)
        super().set_world_ranks()

    @property
    @override
    def root_device(self) -> torch.device:
        return ray.train.torch.get_device()

    @override
    def setup_environment(self) -> None:
        _check_ray_environment(self)
        super().setup_environment()


class RayDataParallelStrategy(_InRayWorker, DataParallelStrategy):
    """:class:`~lightning_parallel.DataParallelStrategy` in a Ray Train worker (same arguments); the process group
    and its backend and timeout are Ray's (``TorchConfig``). Use with ``RayLightningEnvironment``."""


class RayShardedOptimizerStrategy(_InRayWorker, ShardedOptimizerStrategy):
    """:class:`~lightning_parallel.ShardedOptimizerStrategy` (ZeRO-1/2/3, ``shard_size`` for hybrid sharding) in a
    Ray Train worker (same arguments); the process group is Ray's. Use with ``RayLightningEnvironment``."""


class RayPipelineParallelStrategy(_InRayWorker, PipelineParallelStrategy):
    """:class:`~lightning_parallel.PipelineParallelStrategy` (with ``zero_stage``) in a Ray Train worker (same
    arguments); the process group is Ray's. Ranks ``r`` with the same data-parallel rank (one pipeline) read the
    same batch. Use with ``RayLightningEnvironment``."""


_RAY_CLASSES: dict[type, type[LightningParallelStrategy]] = {
    DataParallelStrategy: RayDataParallelStrategy,
    ShardedOptimizerStrategy: RayShardedOptimizerStrategy,
    PipelineParallelStrategy: RayPipelineParallelStrategy,
}


def _ray_names() -> list[str]:
    """The registry names :func:`ray_strategy` accepts: ours that start no process (``start_method="popen"``)."""
    return sorted(
        name
        for name, entry in StrategyRegistry.items()
        if entry["strategy"] in _RAY_CLASSES and entry["init_params"].get("start_method", "popen") == "popen"
    )


def ray_strategy(name: str, **options: Any) -> LightningParallelStrategy:
    """The Ray Train variant of the registered strategy ``name``, e.g. ``ray_strategy("zero3", shard_size=2)``.

    Args:
        name: one of this package's registry names that starts no process: ``"data_parallel"``, ``"zero1"``,
            ``"zero2"``, ``"zero3"``, ``"sharded_optimizer"``, ``"pipeline"``, ``"pipeline_gpipe"``,
            ``"pipeline_interleaved"`` (Ray starts the workers, so the ``_spawn``/``_notebook`` names are refused).
        options: the strategy's own arguments (``shard_size``, ``pipeline_parallel_size``, ``zero_stage``, ...),
            over the name's settings.
    """
    valid = _ray_names()
    if name not in valid:
        raise ValueError(
            f"`ray_strategy({name!r})`: not a strategy of lightning_parallel that runs in Ray's workers. Ray starts"
            f" the processes, so choose one of {valid} (the `_spawn`/`_notebook` names start their own)."
        )
    entry = StrategyRegistry[name]
    return _RAY_CLASSES[entry["strategy"]](**{**entry["init_params"], **options})


class RayTrainReportCallback(ray.train.lightning.RayTrainReportCallback):
    """Ray's ``RayTrainReportCallback`` (same arguments, same checkpoint layout: ``checkpoint.ckpt`` in the reported
    directory), reporting after the last training step of each epoch, and after the step that reaches ``max_steps``.

    Ray's own reports in ``on_train_epoch_end``. Lightning 2.6 resumes a checkpoint saved there exactly under
    ``max_epochs``, but one batch off under ``max_steps``: the restored loop starts the next epoch's data one batch
    late (measured: one device, 2 batches per epoch, ``max_steps=8``, resumed from epoch 1's end: weights 2e-3 away
    from the uninterrupted run's). A checkpoint saved at the end of the epoch's last batch resumes exactly under
    both (``tests/test_ray_train.py`` kills a worker in a ``max_steps`` run).
    """

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # reported at the last batch's end instead

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        reached_max_steps = trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps
        if trainer.is_last_batch or reached_max_steps:
            super().on_train_epoch_end(trainer, pl_module)  # Ray's save-report-barrier, as it does at epoch end


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Ray's ``prepare_trainer`` for this package's strategies: check the Trainer fits a Ray Train worker.

    Raises ``ValueError`` naming the fix for one of our plain strategies (use its ``Ray...`` variant or
    :func:`ray_strategy`) and for a cluster environment other than ``RayLightningEnvironment``. A Trainer with one of
    Ray's own strategies goes to ``ray.train.lightning.prepare_trainer``.
    """
    strategy = trainer.strategy
    ray_classes = tuple(_RAY_CLASSES.values())
    if not isinstance(strategy, LightningParallelStrategy):
        return ray.train.lightning.prepare_trainer(trainer)
    if not isinstance(strategy, ray_classes):
        variant = next(ray_class for plain, ray_class in _RAY_CLASSES.items() if isinstance(strategy, plain))
        raise ValueError(
            f"{type(strategy).__name__} starts and joins its own processes; in a Ray Train worker use"
            f" `lightning_parallel.integrations.ray.{variant.__name__}` (same arguments) or `ray_strategy(name)`."
        )
    _check_ray_environment(strategy)
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set in Trainer.__init__
    rays_callback = any(type(callback) is ray.train.lightning.RayTrainReportCallback for callback in callbacks)
    if rays_callback and trainer.max_steps >= 0:
        rank_zero_warn(
            "`ray.train.lightning.RayTrainReportCallback` saves in `on_train_epoch_end`, which Lightning resumes one"
            f" batch off under `max_steps={trainer.max_steps}`. Use"
            " `lightning_parallel.integrations.ray.RayTrainReportCallback` (same arguments) for restarts that train"
            " exactly as an uninterrupted run."
        )
    return trainer


@contextmanager
def resume_checkpoint_path() -> Iterator[str | None]:
    """In a Ray Train worker: the path of the Lightning checkpoint inside Ray's latest reported checkpoint (written
    by a ``RayTrainReportCallback``, ours or Ray's), or ``None`` on a first start. Valid inside the ``with`` block::

        with resume_checkpoint_path() as ckpt_path:
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    """
    checkpoint = ray.train.get_checkpoint()
    name = RayTrainReportCallback.CHECKPOINT_NAME
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Ray's checkpoint {directory} has no {name}: it was not reported by a `RayTrainReportCallback`."
                " Resume from your own checkpoint file instead."
            )
        yield path
