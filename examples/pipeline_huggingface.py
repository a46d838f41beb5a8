"""Pipeline-parallel training of a Hugging Face causal LM with nothing pipeline-specific in the LightningModule.

The module holds a transformers model that declares its split (``base_model_pp_plan``: Llama, Mistral, Qwen2,
Gemma, ...) and its ``training_step`` is what HF users write; PipelineParallelStrategy cuts the model along the
declaration. Needs ``pip install transformers``; no download: a tiny random model by architecture name, or your own
``config.json`` (a file or the directory ``save_pretrained`` wrote), trained on the demo's byte-level text.

    python examples/pipeline_huggingface.py --devices 2                              # Llama, 2 stages, 1F1B (popen)
    python examples/pipeline_huggingface.py --devices 4 --pipeline-parallel-size 2 --zero-stage 2   # 2 x 2 + ZeRO-2
    python examples/pipeline_huggingface.py --arch qwen2 --schedule Interleaved1F1B
    python examples/pipeline_huggingface.py --config path/to/config.json --save model.ckpt --export hf_model/
    torchrun --nproc-per-node=2 examples/pipeline_huggingface.py                     # the same under torchrun

``--export`` writes the trained model with ``save_pretrained`` (rank 0), loadable with ``from_pretrained``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from cluster import data_parallel_replicas, launched_layout
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import TextDataModule

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class LitCausalLM(pl.LightningModule):
    """Any causal LM of transformers, trained as HF users write it: the model computes its own loss."""

    def __init__(self, config: Any, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_config(config)
        self.learning_rate = learning_rate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, _ = batch  # the demo's (inputs, next tokens); HF shifts the labels itself
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, _ = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def _config(args: argparse.Namespace) -> Any:
    if args.config:  # a local config.json or directory: nothing is downloaded
        return AutoConfig.from_pretrained(args.config, local_files_only=True)
    # Byte-level text: 256 tokens. Small enough for CPUs; the architecture is the real one.
    return AutoConfig.for_model(args.arch, vocab_size=256, max_position_embeddings=args.seq_len, **_TINY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama", help="a transformers model_type with a pipeline plan")
    parser.add_argument("--config", default=None, help="a local config.json (or its directory) instead of --arch")
    parser.add_argument("--devices", type=int, default=None, help="processes per node (default: the launcher's, or 2)")
    parser.add_argument("--num-nodes", type=int, default=None)
    parser.add_argument("--pipeline-parallel-size", default="auto", help="ranks per pipeline ('auto': all)")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--save", default=None, help="save a consolidated Lightning checkpoint here")
    parser.add_argument("--export", default=None, help="rank 0 writes the trained model with save_pretrained here")
    args = parser.parse_args()

    devices, num_nodes = launched_layout(args.devices, args.num_nodes)
    pl.seed_everything(0)
    model = LitCausalLM(_config(args))
    size = args.pipeline_parallel_size
    strategy = PipelineParallelStrategy(
        pipeline_parallel_size=size if size == "auto" else int(size),
        schedule=args.schedule,
        num_microbatches=args.num_microbatches,
        zero_stage=args.zero_stage,
        activation_checkpointing=False,
    )
    trainer = pl.Trainer(
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=2,
        val_check_interval=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    batch_size = args.global_batch_size // data_parallel_replicas(trainer)
    trainer.fit(model, datamodule=TextDataModule(seq_len=args.seq_len, batch_size=batch_size, max_bytes=500_000))
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
        print(f"split starts={strategy.stage_plan.starts} of {strategy.stage_plan.num_layers} layers: {metrics}")
    if args.save:
        trainer.save_checkpoint(args.save)  # a collective: every rank calls it
    if args.export and trainer.is_global_zero:  # after `fit` every rank holds the whole model again
        model.model.save_pretrained(args.export)
        print(f"exported to {args.export}", flush=True)


if __name__ == "__main__":
    main()
