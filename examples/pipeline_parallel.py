"""Train the demo GPT with PipelineParallelStrategy: the module only adds ``pipeline_layers()``.

    python examples/pipeline_parallel.py --devices 2                                # 2 stages, 1F1B (popen)
    python examples/pipeline_parallel.py --devices 4 --pipeline-parallel-size 2      # 2 pipelines x 2 replicas
    python examples/pipeline_parallel.py --devices 4 --pipeline-parallel-size 2 --zero-stage 2  # + ZeRO-2 per stage
    python examples/pipeline_parallel.py --devices 2 --schedule Interleaved1F1B      # 2 virtual stages per rank
    torchrun --nproc-per-node=2 examples/pipeline_parallel.py                       # the same under torchrun
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=R --master-addr=HOST0 --master-port=29500 \
        examples/pipeline_parallel.py --pipeline-parallel-size 2    # DP x PP 2 x 2, stages on both nodes (R=0, 1)
    srun python examples/pipeline_parallel.py / mpirun -np 4 python examples/pipeline_parallel.py  (SLURM / MPI)
    python examples/pipeline_parallel.py --accelerator cuda --devices 1 --preset gpt-350m --precision bf16-mixed

Under a launcher, ``--devices``/``--num-nodes`` default to what it started. Keep the Trainer under
``if __name__ == "__main__":`` (the default start method re-launches this script). At the end every rank prints its
stages, bytes and peak memory; rank 0 the metrics, the stage split and the throughput.
"""

from __future__ import annotations

import argparse
import resource
import time

import lightning.pytorch as pl
import torch
from cluster import data_parallel_replicas, launched_layout, where
from lightning.pytorch.callbacks import Callback

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule, TextDataModule


class _Report(Callback):
    """Inside every rank, at the end of training: its stages, bytes held, peak memory; rank 0 adds the metrics and
    the throughput of one pipeline replica after ``warmup`` steps (every rank of a replica sees the same batch)."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup, self.tokens, self.start = warmup, 0, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx + 1 == self.warmup:
            self.start = time.perf_counter()
        elif batch_idx + 1 > self.warmup:
            self.tokens += batch[0].numel()

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        states = [v for state in trainer.optimizers[0].state.values() for v in state.values()]
        optimizer_bytes = sum(v.numel() * v.element_size() for v in states if isinstance(v, torch.Tensor))
        device = strategy.root_device
        if device.type == "cuda":
            peak = f"peak CUDA memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
        else:  # ru_maxrss is in KiB on Linux
            peak = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
        stages = strategy.stage_plan.stages_of(strategy.parallel_dims.pipeline_rank)
        print(
            f"rank {trainer.global_rank}: stages {stages} params {param_bytes / 2**20:.1f} MiB, optimizer state"
            f" {optimizer_bytes / 2**20:.1f} MiB, {peak}, device {device}",
            flush=True,
        )
        if trainer.is_global_zero:
            elapsed = time.perf_counter() - self.start
            replicas = trainer.world_size // strategy.pipeline_parallel_size
            metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
            print(f"world_size={trainer.world_size} split starts={strategy.stage_plan.starts} metrics: {metrics}")
            if self.tokens and elapsed > 0:
                rate = self.tokens * replicas / elapsed
                print(f"throughput: {rate:,.0f} tokens/s (after {self.warmup} warm-up steps)", flush=True)
            else:
                print(f"throughput: not measured (train more than {self.warmup} warm-up steps)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model size: tiny, small, gpt-125m, gpt-350m, ...")
    parser.add_argument("--devices", type=int, default=None, help="processes per node (default: the launcher's, or 2)")
    parser.add_argument("--num-nodes", type=int, default=None, help="default: the launcher's, or 1")
    parser.add_argument("--pipeline-parallel-size", default="auto", help="ranks per pipeline ('auto': all)")
    parser.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, ...")
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument(
        "--zero-stage", type=int, default=0, choices=[0, 1, 2], help="ZeRO across each stage's replicas"
    )
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=16, help="over all pipeline replicas")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's block size")
    parser.add_argument("--data", choices=["text", "random"], default="text", help="random: seeded tokens")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a collective (or joining) may wait")
    parser.add_argument("--save", default=None, help="save a (consolidated) checkpoint here at the end")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn", "fork"])
    args = parser.parse_args()

    devices, num_nodes = launched_layout(args.devices, args.num_nodes)
    pl.seed_everything(0)
    model = GPTLightningModule(args.preset, block_size=args.seq_len, learning_rate=1e-3)
    seq_len = model.config.block_size
    size = args.pipeline_parallel_size
    strategy = PipelineParallelStrategy(
        pipeline_parallel_size=size if size == "auto" else int(size),
        schedule=args.schedule,
        num_microbatches=args.num_microbatches,
        zero_stage=args.zero_stage,
        start_method=args.start_method,
        timeout=args.timeout,
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=4,
        val_check_interval=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[_Report()],
    )
    batch_size = args.global_batch_size // data_parallel_replicas(trainer)
    samples = args.global_batch_size * args.max_steps
    random_data = RandomTokenDataModule(samples, seq_len=seq_len, batch_size=batch_size)
    data = (
        random_data
        if args.data == "random"
        else TextDataModule(seq_len=seq_len, batch_size=batch_size, max_bytes=2_000_000)
    )
    trainer.fit(model, datamodule=data)
    print(where(trainer), flush=True)
    if args.save:
        trainer.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
