"""Streamed data as users load it, for runs whose ranks are not one torch.distributed job of the whole run (torchft's
replica groups, tests/torchft_worker.py) or whose job is Ray's (tests/ray_helpers.py), issue 43.

``STREAMED_SAMPLES`` samples, written as LitData chunks by :func:`write_streamed`; :class:`StreamedMLP` reads them
twice per step, each way as a user writes it in ``train_dataloader()``: LitData's ``StreamingDataset`` (the strategy
tells it the data-parallel rank) and a Hugging Face streaming dataset split with ``split_dataset_by_node`` and the
documented line (``trainer.distributed_sampler_kwargs``). :func:`batch_indices` names the samples of a step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

STREAMED_SAMPLES, STREAMED_BATCH = 16, 4
FEATURES, CLASSES = 12, 4


def streamed_sample(index: int) -> dict[str, Any]:
    """Sample ``index``: features and a class."""
    x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))
    return {"index": index, "x": x, "y": int((x[:CLASSES] * 3).argmax())}


def write_streamed(out: Path) -> None:
    """The samples as LitData chunks of 4 samples (``litdata.optimize``) in ``out``."""
    import litdata

    indices = list(range(STREAMED_SAMPLES))
    litdata.optimize(fn=streamed_sample, inputs=indices, output_dir=str(out), chunk_size=4, num_workers=1)


class StreamedMLP(pl.LightningModule):
    """An MLP (three pipeline layers) trained on the batches of a step of each library in ``libraries``
    (``"litdata"``, ``"hf"``); ``last_loss`` is the last step's. With one library its loader is the training loader
    itself (the pipeline takes its example batch from the first loader of a dict only)."""

    def __init__(self, data_dir: Path, libraries: tuple[str, ...] = ("litdata", "hf")) -> None:
        super().__init__()
        self.data_dir, self.libraries = data_dir, libraries
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))
        self.last_loss = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def train_dataloader(self) -> DataLoader | dict[str, DataLoader]:
        loaders = {library: getattr(self, f"_{library}_loader")() for library in self.libraries}
        return loaders if len(loaders) > 1 else loaders[self.libraries[0]]

    def _litdata_loader(self) -> DataLoader:
        import litdata

        return litdata.StreamingDataLoader(litdata.StreamingDataset(str(self.data_dir)), batch_size=STREAMED_BATCH)

    def _hf_loader(self) -> DataLoader:
        from datasets import Dataset
        from datasets.distributed import split_dataset_by_node

        samples = [streamed_sample(index) for index in range(STREAMED_SAMPLES)]
        table = {key: [sample[key] for sample in samples] for key in ("index", "x", "y")}
        streaming = Dataset.from_dict(table).to_iterable_dataset(num_shards=4).with_format("torch")
        shard = self.trainer.distributed_sampler_kwargs  # the documented line (docs/reliability.md, "Data")
        hf = split_dataset_by_node(streaming, rank=shard["rank"], world_size=shard["num_replicas"])
        return DataLoader(hf, batch_size=STREAMED_BATCH)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        parts = library_batches(batch, self.libraries)
        x = torch.cat([part["x"] for part in parts.values()])
        y = torch.cat([part["y"] for part in parts.values()])
        loss = nn.functional.cross_entropy(self(x), y)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def library_batches(batch: dict[str, Any], libraries: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """A step's batch per library (one library's loader gives its batch itself)."""
    return {libraries[0]: batch} if "index" in batch else batch


def batch_indices(batch: dict[str, Any], libraries: tuple[str, ...]) -> dict[str, list[int]]:
    """The samples of a step's batch, per library."""
    return {name: part["index"].tolist() for name, part in library_batches(batch, libraries).items()}
