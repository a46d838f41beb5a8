"""Train the demo GPT with ZeRO (ShardedOptimizerStrategy), save a checkpoint, show the bytes each rank holds.

    python examples/sharded_optimizer.py --stage 2 --devices 2
    python examples/sharded_optimizer.py --stage 3 --devices 2 --meta-init --checkpoint-format sharded
    torchrun --nproc-per-node=2 examples/sharded_optimizer.py --stage 2
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=R --master-addr=HOST0 --master-port=29500 \
        examples/sharded_optimizer.py --stage 2                        # two nodes (R = 0 and 1)
    # the same, sharded within each node and replicated across the two (hybrid sharding): add --shard-size 2
    srun python examples/sharded_optimizer.py --stage 2                # SLURM (examples/slurm/)
    mpirun -np 4 python examples/sharded_optimizer.py --stage 2        # MPI (needs mpi4py)

Under a launcher, ``--devices``/``--num-nodes`` default to what it started. Resume the saved checkpoint under any
strategy or world size with `--resume PATH` (e.g. `--devices 1`).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from cluster import data_parallel_replicas, launched_layout, where

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule, TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument(
        "--shard-size", type=int, default=None, help="ranks per shard group, replicated across groups (hybrid)"
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--devices", type=int, default=None, help="processes per node (default: the launcher's, or 2)")
    parser.add_argument("--num-nodes", type=int, default=None, help="default: the launcher's, or 1")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per step over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", choices=["text", "random"], default="text", help="random: seeded tokens")
    parser.add_argument("--checkpoint-format", choices=["consolidated", "sharded"], default="consolidated")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a collective (or joining) may wait")
    parser.add_argument("--save", default="zero_example.ckpt", help="where to save the checkpoint after training")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (any strategy / world size)")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--meta-init", action="store_true", help="stage 3: build on the meta device (see below)")
    args = parser.parse_args()

    devices, num_nodes = launched_layout(args.devices, args.num_nodes)
    pl.seed_everything(0)
    strategy = ShardedOptimizerStrategy(
        stage=args.stage, shard_size=args.shard_size, checkpoint_format=args.checkpoint_format, timeout=args.timeout
    )
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
    # Stage 3 with --meta-init: build the model on the meta device, so no rank ever holds all of it (the weights then
    # come from each module's reset_parameters, so they differ from a plain construction with the same seed).
    with trainer.init_module(empty_init=args.meta_init and args.stage == 3 and args.resume is None):
        model = GPTLightningModule(args.preset, block_size=args.seq_len, learning_rate=1e-3)
    batch_size = args.global_batch_size // data_parallel_replicas(trainer)
    if args.data == "random":
        samples = args.global_batch_size * args.max_steps
        data = RandomTokenDataModule(samples, seq_len=args.seq_len, batch_size=batch_size)
    else:
        data = TextDataModule(seq_len=args.seq_len, batch_size=batch_size, max_bytes=400_000)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    trainer.save_checkpoint(args.save)
    print(where(trainer), flush=True)
    print(f"rank {trainer.global_rank}: bytes held {strategy.memory_report().as_dict()}", flush=True)
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
        print(f"world_size={trainer.world_size} stage={args.stage} final metrics: {metrics} saved: {args.save}")


if __name__ == "__main__":
    main()
