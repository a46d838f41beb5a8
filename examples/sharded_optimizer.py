"""Train the demo GPT with ZeRO (ShardedOptimizerStrategy), save a checkpoint, and show the bytes each rank holds.

    python examples/sharded_optimizer.py --stage 2 --devices 2
    python examples/sharded_optimizer.py --stage 3 --devices 2 --checkpoint-format sharded
    torchrun --nproc-per-node=2 examples/sharded_optimizer.py --stage 2 --devices 2

Resume the saved checkpoint under any strategy or world size with `--resume PATH` (e.g. `--devices 1`).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl

from lightning_parallel import ShardedOptimizerStrategy
from lightning_parallel.demos import GPTLightningModule, TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--checkpoint-format", choices=["consolidated", "sharded"], default="consolidated")
    parser.add_argument("--save", default="zero_example.ckpt", help="where to save the checkpoint after training")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (any strategy / world size)")
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()

    pl.seed_everything(0)
    strategy = ShardedOptimizerStrategy(stage=args.stage, checkpoint_format=args.checkpoint_format)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        limit_val_batches=4,
        val_check_interval=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    # Stage 3: build the model on the meta device, so no rank ever holds all of it.
    with trainer.init_module(empty_init=args.stage == 3 and args.resume is None):
        model = GPTLightningModule(args.preset, learning_rate=1e-3)
    data = TextDataModule(seq_len=model.config.block_size, batch_size=8, max_bytes=400_000)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    trainer.save_checkpoint(args.save)
    report = strategy.memory_report().as_dict()
    print(f"rank {trainer.global_rank}: bytes held {report}", flush=True)
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
        print(f"world_size={trainer.world_size} stage={args.stage} final metrics: {metrics} saved: {args.save}")


if __name__ == "__main__":
    main()
