"""Bring your own LightningModule: Lightning's own ``LightningCLI`` with lightning_parallel's strategy names.

    python examples/user_module_cli.py fit --trainer.devices=2 --trainer.strategy=zero2 --trainer.max_epochs=2
    python examples/user_module_cli.py fit --trainer.devices=2 --trainer.strategy=data_parallel
    python examples/user_module_cli.py fit --trainer.devices=2 \\
        --trainer.strategy=lightning_parallel.ShardedOptimizerStrategy --trainer.strategy.stage=1

The one line that matters is ``import lightning_parallel``: it registers ``zero2``, ``data_parallel``, ``pipeline``,
... with Lightning, and must run before the Trainer is built (so: at the top of the file that calls
``LightningCLI``). A class path (``lightning_parallel.ShardedOptimizerStrategy``) works without it, because
jsonargparse imports the class itself. With the default ``start_method="popen"`` Lightning re-runs this script once
per extra process, hence the ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers "zero2", "data_parallel", ... before the Trainer is built)


class Regression(pl.LightningModule):
    """A two-layer MLP fitting a fixed random linear map with mean squared error.

    Args:
        num_features: Input and output width.
        hidden: Width of the hidden layer.
        learning_rate: AdamW's learning rate.
    """

    def __init__(self, num_features: int = 16, hidden: int = 64, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(num_features, hidden), nn.GELU(), nn.Linear(hidden, num_features))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = F.mse_loss(self.net(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", F.mse_loss(self.net(inputs), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


class RegressionData(pl.LightningDataModule):
    """Pairs ``(x, x @ W)`` for a random ``W``, the same in every process for the same ``seed``.

    Args:
        num_samples: Training pairs (and as many validation pairs).
        num_features: Width of ``x``; must match the model's ``num_features``.
        batch_size: Pairs per batch, per process.
        seed: Seed of ``W`` and of the inputs.
    """

    def __init__(self, num_samples: int = 512, num_features: int = 16, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(num_features, num_features, generator=generator)
        inputs = torch.randn(2 * num_samples, num_features, generator=generator)  # (2N, F)
        pairs = TensorDataset(inputs, inputs @ weight)
        self.train_set = torch.utils.data.Subset(pairs, range(num_samples))
        self.val_set = torch.utils.data.Subset(pairs, range(num_samples, 2 * num_samples))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def main() -> None:
    LightningCLI(Regression, RegressionData)


if __name__ == "__main__":
    main()
