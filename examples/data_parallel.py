"""Train the demo GPT with DataParallelStrategy. The same script runs under every launcher:

    python examples/data_parallel.py --devices 1                        # one device
    python examples/data_parallel.py --devices 2 --compression fp16     # 2 processes it starts itself (popen)
    torchrun --nproc-per-node=2 examples/data_parallel.py               # torchrun, one node
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=R --master-addr=HOST0 --master-port=29500 \
        examples/data_parallel.py                                       # torchrun, two nodes (R = 0 and 1)
    srun python examples/data_parallel.py                               # SLURM (examples/slurm/)
    mpirun -np 4 python examples/data_parallel.py                       # MPI (needs mpi4py)

Under a launcher, ``--devices``/``--num-nodes`` default to what it started. ``--global-batch-size`` is split over
the ranks, so every layout trains on the same batches. Keep the Trainer under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from cluster import data_parallel_replicas, launched_layout, where

from lightning_parallel import DataParallelStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule, TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model size: tiny, small, gpt-125m, ...")
    parser.add_argument("--devices", type=int, default=None, help="processes per node (default: the launcher's, or 2)")
    parser.add_argument("--num-nodes", type=int, default=None, help="default: the launcher's, or 1")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per step over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", choices=["text", "random"], default="text", help="random: seeded tokens")
    parser.add_argument("--compression", choices=["fp16", "bf16", "powersgd"], default=None)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a collective (or joining) may wait")
    parser.add_argument("--save", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()

    devices, num_nodes = launched_layout(args.devices, args.num_nodes)
    pl.seed_everything(0)
    model = GPTLightningModule(args.preset, block_size=args.seq_len, learning_rate=1e-3)
    strategy = DataParallelStrategy(gradient_compression=args.compression, powersgd_start_iter=2, timeout=args.timeout)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        limit_val_batches=4,
        val_check_interval=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    batch_size = args.global_batch_size // data_parallel_replicas(trainer)
    if args.data == "random":
        samples = args.global_batch_size * args.max_steps
        data = RandomTokenDataModule(samples, seq_len=args.seq_len, batch_size=batch_size)
    else:
        data = TextDataModule(seq_len=args.seq_len, batch_size=batch_size, max_bytes=400_000)
    trainer.fit(model, datamodule=data)
    print(where(trainer), flush=True)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
        print(f"world_size={trainer.world_size} final metrics: {metrics}")


if __name__ == "__main__":
    main()
