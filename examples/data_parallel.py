"""Train the demo GPT with DataParallelStrategy.

    python examples/data_parallel.py --devices 2                       # 2 processes on this machine (popen)
    python examples/data_parallel.py --devices 2 --compression fp16    # half the all-reduce bytes
    torchrun --nproc-per-node=2 examples/data_parallel.py --devices 2  # the same under torchrun

The default start method re-launches this script once per extra process, so keep the Trainer under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl

from lightning_parallel import DataParallelStrategy
from lightning_parallel.demos import GPTLightningModule, TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model size: tiny, small, gpt-125m, ...")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="per device; the global batch is this x world size")
    parser.add_argument("--compression", choices=["fp16", "bf16", "powersgd"], default=None)
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = GPTLightningModule(args.preset, learning_rate=1e-3)
    data = TextDataModule(seq_len=model.config.block_size, batch_size=args.batch_size, max_bytes=400_000)
    strategy = DataParallelStrategy(gradient_compression=args.compression, powersgd_start_iter=2)
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
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
        print(f"world_size={trainer.world_size} final metrics: {metrics}")


if __name__ == "__main__":
    main()
