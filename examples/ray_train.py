"""Train the demo GPT with one of our strategies inside Ray Train's ``TorchTrainer`` (``pip install -e ".[ray]"``).

    python examples/ray_train.py --strategy zero2 --num-workers 2                  # a local Ray cluster, CPU workers
    python examples/ray_train.py --strategy zero3 --shard-size 2 --num-workers 4
    python examples/ray_train.py --strategy pipeline --zero-stage 1 --num-workers 2
    python examples/ray_train.py --strategy pipeline --pipeline-parallel-size 2 --num-workers 4   # DP x PP = 2 x 2
    # on a Ray cluster (`ray start --head` on one node, `ray start --address=HEAD:6379` on the others), from any node:
    python examples/ray_train.py --address auto --use-gpu --num-workers 8 --strategy zero2 \
        --storage-path /shared/ray_results --preset gpt-125m --data text

Ray starts one worker per ``--num-workers`` and the process group; each worker builds the Trainer with the strategy's
Ray variant (``lightning_parallel.integrations.ray``), ``RayLightningEnvironment`` and our ``RayTrainReportCallback``
(Ray's, reporting a checkpoint after each epoch's last step, so that a restart resumes exactly). A worker that dies
restarts the whole group (up to ``--max-failures`` times), and the run resumes from the last reported checkpoint.
Prints the final loss.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayLightningEnvironment
from ray.train.torch import TorchConfig, TorchTrainer

from lightning_parallel.demos import GPTLightningModule, RandomTokenDataModule, TextDataModule
from lightning_parallel.integrations.ray import (
    RayTrainReportCallback,
    prepare_trainer,
    ray_strategy,
    resume_checkpoint_path,
)

STRATEGY_OPTIONS = ("shard_size", "pipeline_parallel_size", "zero_stage")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Runs in every Ray worker: one Trainer, resumed from Ray's latest checkpoint if this is a restart."""
    torch.set_num_threads(config["threads"])
    pl.seed_everything(0, verbose=False)
    strategy = ray_strategy(config["strategy"], **config["options"])
    trainer = pl.Trainer(
        accelerator="auto",
        devices="auto",
        strategy=strategy,
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()],
        max_steps=config["max_steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,  # Ray keeps the checkpoints (RunConfig's storage)
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    model = GPTLightningModule(config["preset"], block_size=config["seq_len"], learning_rate=1e-3)
    # All stages of one pipeline read the same batch: split the global batch over the data-parallel replicas only.
    replicas = strategy.distributed_sampler_kwargs["num_replicas"]
    batch_size = config["global_batch_size"] // replicas
    if config["data"] == "random":
        # Two epochs' worth of samples, so Ray gets a checkpoint half-way.
        samples = config["global_batch_size"] * max(1, config["max_steps"] // 2)
        data: pl.LightningDataModule = RandomTokenDataModule(samples, seq_len=config["seq_len"], batch_size=batch_size)
    else:
        data = TextDataModule(seq_len=config["seq_len"], batch_size=batch_size, max_bytes=400_000)
    with resume_checkpoint_path() as ckpt_path:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero2", help="data_parallel, zero1, zero2, zero3, pipeline, ...")
    parser.add_argument("--num-workers", type=int, default=2, help="Ray workers (one per GPU with --use-gpu)")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--shard-size", type=int, default=None, help="ZeRO: ranks per shard group (hybrid sharding)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=None, help="pipeline: stages per pipeline")
    parser.add_argument("--zero-stage", type=int, default=None, help="pipeline: ZeRO stage of each stage (0-2)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per step over all replicas")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", choices=["text", "random"], default="random")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL")
    parser.add_argument("--address", default=None, help="an existing Ray cluster ('auto'); default: a local one")
    parser.add_argument("--storage-path", default=None, help="where Ray keeps checkpoints (shared on a cluster)")
    parser.add_argument("--max-failures", type=int, default=1, help="worker-group restarts Ray may do")
    parser.add_argument(
        "--name", default=None, help="Ray's run name; an existing run's name resumes it (default: a new name)"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a collective may wait (Ray's TorchConfig)")
    args = parser.parse_args()

    options = {name: getattr(args, name) for name in STRATEGY_OPTIONS if getattr(args, name) is not None}
    # The workers import this repository's package and the demo; a local cluster inherits this interpreter's path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env_vars = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    if args.address is None:
        ray.init(num_cpus=args.num_workers + 1, include_dashboard=False, runtime_env={"env_vars": env_vars})
    else:
        ray.init(address=args.address, runtime_env={"env_vars": env_vars})
    config = {
        "strategy": args.strategy,
        "options": options,
        "max_steps": args.max_steps,
        "preset": args.preset,
        "global_batch_size": args.global_batch_size,
        "seq_len": args.seq_len,
        "data": args.data,
        "threads": 1 if not args.use_gpu else max(1, (os.cpu_count() or 1) // max(1, args.num_workers)),
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        torch_config=TorchConfig(backend="nccl" if args.use_gpu else "gloo", timeout_s=args.timeout),
        run_config=RunConfig(
            name=args.name or f"lightning_parallel_{args.strategy}_{time.strftime('%Y%m%d_%H%M%S')}",
            storage_path=args.storage_path or os.path.join(tempfile.gettempdir(), "ray_results"),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    print(f"strategy={args.strategy} num_workers={args.num_workers} steps={result.metrics.get('step')}", flush=True)
    print(f"final loss: {result.metrics['train_loss']:.4f} checkpoint: {result.checkpoint.path}", flush=True)


if __name__ == "__main__":
    main()
