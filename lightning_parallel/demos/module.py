"""The shared LightningModule: a byte-level GPT trained with next-token cross-entropy."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_parallel.demos.gpt import GPT, GPTConfig
from lightning_parallel.planner.shape import TransformerShape

__all__ = ["GPTLightningModule", "next_token_loss"]

Batch = tuple[Tensor, Tensor]


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``, averaged over all ``B * T`` tokens.

    Usable as a pipeline schedule's ``loss_fn(output, target)``.
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class GPTLightningModule(LightningModule):
    """A GPT language model on byte tokens, the model every strategy in this package is demonstrated with.

    Batches are ``(inputs, targets)`` tuples of long tensors of shape ``(B, T)``, ``targets`` being ``inputs``
    shifted by one token. The training loss is the mean cross-entropy over all ``B * T`` tokens of the batch.

    Args:
        preset: Model size, a key of :data:`lightning_parallel.demos.gpt.PRESETS` (``"tiny"``, ``"small"``,
            ``"gpt-125m"``, ``"gpt-350m"``, ``"gpt-1.3b"``).
        n_layer: Number of transformer blocks; ``None`` keeps the preset's.
        n_head: Number of attention heads; ``None`` keeps the preset's.
        n_embd: Embedding width; ``None`` keeps the preset's.
        block_size: Maximum sequence length; ``None`` keeps the preset's. Must be at least the data's ``seq_len``.
        dropout: Dropout probability; ``None`` keeps the preset's (0.0).
        bias: Whether Linear and LayerNorm layers have biases; ``None`` keeps the preset's (True).
        optimizer: ``"adamw"`` or ``"sgd"`` (with momentum).
        learning_rate: Learning rate of the optimizer.
        weight_decay: Weight decay applied to weight matrices and embeddings only (not to biases or LayerNorms).
        betas: AdamW's ``(beta1, beta2)``; ignored by SGD.
        momentum: SGD's momentum; ignored by AdamW.
    """

    def __init__(
        self,
        preset: str = "tiny",
        *,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        block_size: int | None = None,
        dropout: float | None = None,
        bias: bool | None = None,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        _validate_optimizer_args(optimizer, learning_rate, weight_decay, betas, momentum)
        self.save_hyperparameters()
        overrides = dict(
            n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=dropout, bias=bias
        )
        self.config = GPTConfig.from_preset(preset, **{k: v for k, v in overrides.items() if v is not None})
        self.model = GPT(self.config)
        vocab_size = self.config.vocab_size
        # Metrics are built on the CPU even inside `trainer.init_module(empty_init=True)` (meta device): their
        # default states must hold real values. Lightning moves them to the training device with the module.
        with torch.device("cpu"):
            self.val_perplexity = Perplexity()
            self.val_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro")
            self.test_perplexity = Perplexity()
            self.test_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits ``(B, T, V)`` for token ids ``idx`` of shape ``(B, T)``."""
        return self.model(idx)

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a flat list of layers whose composition is :meth:`forward` (see :meth:`GPT.pipeline_layers`)."""
        return self.model.pipeline_layers()

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The tensor-parallel plan of ``ShardedOptimizerStrategy(stage=3, tensor_parallel_size=T)`` and
        ``PipelineParallelStrategy(tensor_parallel_size=T)``: :meth:`GPT.tensor_parallel_plan` under ``model.``."""
        return {f"model.{name}": style for name, style in self.model.tensor_parallel_plan().items()}

    def transformer_shape(self) -> TransformerShape:
        """The planner's hook (:class:`~lightning_parallel.planner.ProvidesTransformerShape`): the GPT's shape."""
        return self.model.transformer_shape()

    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy over all tokens (:func:`next_token_loss`)."""
        return next_token_loss(logits, targets)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.loss_fn(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self._evaluate(batch, "val", self.val_perplexity, self.val_accuracy)

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test", self.test_perplexity, self.test_accuracy)

    @override
    def predict_step(self, batch: Batch | Tensor, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Greedy next-token predictions ``(B, T)`` (argmax of the logits) for ``batch`` or its inputs."""
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(inputs).argmax(dim=-1)

    def _evaluate(self, batch: Batch, prefix: str, perplexity: Perplexity, accuracy: MulticlassAccuracy) -> Tensor:
        inputs, targets = batch
        logits = self(inputs).float()  # (B, T, V)
        loss = self.loss_fn(logits, targets)
        perplexity(logits, targets)
        accuracy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # (B*T, V), (B*T,)
        # Logging the metric objects lets torchmetrics sync their states across ranks at epoch end; the loss is a
        # plain tensor, so its epoch mean needs sync_dist to average over ranks.
        self.log(f"{prefix}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}_perplexity", perplexity)
        self.log(f"{prefix}_accuracy", accuracy)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW or SGD over two parameter groups: weights (>= 2-D, with weight decay) and the rest (without)."""
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": hp["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if hp["optimizer"] == "sgd":
            return torch.optim.SGD(groups, lr=hp["learning_rate"], momentum=hp["momentum"])
        return torch.optim.AdamW(groups, lr=hp["learning_rate"], betas=tuple(hp["betas"]))


def _validate_optimizer_args(
    optimizer: str, learning_rate: float, weight_decay: float, betas: tuple[float, float], momentum: float
) -> None:
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"Unknown `optimizer={optimizer!r}`. Valid optimizers: 'adamw', 'sgd'.")
    if learning_rate <= 0:
        raise ValueError(f"`learning_rate={learning_rate}` must be positive.")
    if weight_decay < 0:
        raise ValueError(f"`weight_decay={weight_decay}` must be non-negative.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"`betas={betas}` must be two numbers in [0, 1).")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"`momentum={momentum}` must be in [0, 1).")
