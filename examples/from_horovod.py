"""Horovod's PyTorch MNIST recipe (``examples/pytorch/pytorch_mnist.py``) ported to lightning_parallel.

Each Horovod line is named in a comment next to what replaces it. MNIST-shaped random data keeps it offline.

    horovodrun -np 2 -H localhost:2 python train.py       # Horovod
    mpirun -np 2 python examples/from_horovod.py          # the same launcher (needs `pip install -e ".[mpi]"`)
    torchrun --nproc-per-node=2 examples/from_horovod.py  # or torchrun, srun, or no launcher at all:
    python examples/from_horovod.py --devices 2           # the Trainer starts the second process itself

Horovod's ``horovodrun -np 4 -H host1:2,host2:2`` is ``mpirun -np 4 -H host1:2,host2:2`` (Open MPI's own ``-H``)
or ``torchrun --nnodes=2 --nproc-per-node=2`` on each host. Keep the Trainer under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from cluster import launched_layout, where
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import DataParallelStrategy

IMAGE_PIXELS, CLASSES = 28 * 28, 10


class Net(pl.LightningModule):
    """The Horovod example's model and optimizer, as a LightningModule (the training loop moves into Lightning)."""

    def __init__(self, lr: float, momentum: float) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.layers = nn.Sequential(nn.Linear(IMAGE_PIXELS, 64), nn.ReLU(), nn.Linear(64, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        # metric_average(loss, "avg_loss") / hvd.allreduce(loss): sync_dist=True averages over ranks.
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # optimizer = hvd.DistributedOptimizer(optim.SGD(...)): a plain optimizer; the strategy averages gradients.
        # hvd.broadcast_optimizer_state(optimizer, root_rank=0): nothing to write, every rank builds the same one.
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def mnist_shaped(samples: int, seed: int = 0) -> TensorDataset:
    """Seeded random images and labels with MNIST's shapes (flattened 28x28 pixels, 10 classes)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, IMAGE_PIXELS, generator=generator)
    return TensorDataset(images, torch.randint(0, CLASSES, (samples,), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32, help="per process, as in Horovod's example")
    parser.add_argument("--lr", type=float, default=0.01, help="for one process; scaled by the world size")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradient all-reduce")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=None, help="processes per node (default: the launcher's, or 2)")
    parser.add_argument("--num-nodes", type=int, default=None)
    parser.add_argument("--save", default=None, help="save a checkpoint here at the end")
    args = parser.parse_args()

    # hvd.init(): nothing to call. mpirun / torchrun / srun started the processes, or the Trainer starts them.
    devices, num_nodes = launched_layout(args.devices, args.num_nodes)
    # torch.manual_seed(args.seed): the same initial weights everywhere (the strategy also broadcasts rank 0's).
    pl.seed_everything(0)
    # compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    compression = "fp16" if args.fp16_allreduce else None
    # hvd.DistributedOptimizer(..., compression=compression) + hvd.broadcast_parameters(model.state_dict(), 0):
    strategy = DataParallelStrategy(gradient_compression=compression)
    # torch.cuda.set_device(hvd.local_rank()): accelerator="auto" gives each process its own GPU (CPU here).
    trainer = pl.Trainer(
        accelerator="auto",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    # lr_scaler = hvd.size(): the global batch is batch_size x world size, so scale the learning rate alike.
    model = Net(lr=args.lr * trainer.world_size, momentum=args.momentum)
    # DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank()) and set_epoch(epoch): the
    # Trainer inserts it (shuffle=True, seed 0) when it sees a plain DataLoader.
    train_loader = DataLoader(mnist_shaped(args.batch_size * trainer.world_size * args.max_steps), args.batch_size)
    trainer.fit(model, train_loader)
    print(where(trainer), flush=True)
    # if hvd.rank() == 0: torch.save(model.state_dict(), path): save_checkpoint writes once, from rank 0.
    if args.save:
        trainer.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
