"""User-like models that are not our demo GPT, and the harness that trains them like one device.

Each model is the kind a user brings on day one; each exercises one path off the happy path:

* :class:`BatchNormCNN` -- BatchNorm running statistics (buffers that change in forward), a conv stack.
* :class:`AuxHeadModel` -- an auxiliary head used every other step and a layer that is never used, AdamW with
  weight decay (unused parameters must not be stepped).
* :class:`FreezeScheduleModel` -- a backbone frozen at first and unfrozen at step ``unfreeze_at``.
* :class:`TwoOptimizerGAN` -- generator and discriminator, manual optimization with ``toggle_optimizer``.
* :class:`TiedGPT` -- a tiny language model whose LM head shares the embedding's weight (:class:`TiedLM`: the same
  model as a plain ``nn.Module``).
* :class:`RankSeededModel` -- every rank builds different initial weights (no common seed).
* :class:`ResidualMLP` -- residual blocks; ``wrong_layers=True`` gives a ``pipeline_layers()`` that is not
  ``forward`` (it drops the residual connection).

All take ``(x, y)`` batches from :func:`loader` (classification, or next-token for :class:`TiedGPT`) and have a
``pipeline_layers()`` method. :func:`single_device` and :func:`fit_ranks` train the same global batches on one
device and on N forked ranks (see ``distributed_harness.run_distributed``) and return comparable weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from training_helpers import cpu_trainer

FEATURES, CLASSES, WIDTH = 12, 4, 24
GLOBAL_BATCH = 8
STEPS = 4
VOCAB, SEQ = 32, 8


# ---------------------------------------------------------------------------------------------------- models
class BatchNormCNN(pl.LightningModule):
    """Conv -> BatchNorm -> ReLU, twice, then a linear head; SGD with momentum."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.conv1 = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 3, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv2(self.conv1(x.view(-1, 1, 4, 3))))

    def pipeline_layers(self) -> list[nn.Module]:
        return [_Reshape(), self.conv1, self.conv2, self.head]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class _Reshape(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 1, 4, 3)


class AuxHeadModel(pl.LightningModule):
    """A trunk and a main head; an auxiliary head adds its loss on even steps only; ``never_used`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, CLASSES)
        self.aux_head = nn.Linear(WIDTH, CLASSES)
        self.never_used = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.trunk, self.head]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.trunk(x)
        loss = nn.functional.cross_entropy(self.head(features), y)
        if batch_idx % 2 == 0:
            loss = loss + 0.5 * nn.functional.cross_entropy(self.aux_head(features), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class FreezeScheduleModel(pl.LightningModule):
    """Fine-tuning schedule: ``backbone`` starts frozen and is unfrozen when ``global_step == unfreeze_at``.

    The optimizer holds every parameter from the start (the common recipe); frozen ones have no gradient.
    """

    def __init__(self, unfreeze_at: int = 2) -> None:
        super().__init__()
        self.unfreeze_at = unfreeze_at
        self.backbone = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, CLASSES)
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.backbone[0], self.backbone[1], self.backbone[2], self.backbone[3], self.head]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.unfreeze_at:
            self.backbone.requires_grad_(True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TwoOptimizerGAN(pl.LightningModule):
    """A tiny GAN in manual optimization: one optimizer per network, ``toggle_optimizer`` around each update.

    Noise is drawn from a generator seeded by ``batch_idx`` and the batch's content, so every strategy draws the
    same noise for the same samples whatever the rank.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, WIDTH), nn.Tanh(), nn.Linear(WIDTH, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        loss_d, loss_g = gan_update(self, x, self.discriminator)
        self.log_dict({"loss_d": loss_d, "loss_g": loss_g})

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.9)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.9)),
        ]


def gan_update(
    module: pl.LightningModule, x: torch.Tensor, discriminate: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One manual-optimization GAN step on real samples ``x``: the discriminator's update, then the generator's
    (``module(z)``), each inside ``toggle_optimizer`` of its optimizer (``module.optimizers()`` is ``(generator's,
    discriminator's)``). Returns the two losses ``(discriminator, generator)``."""
    opt_g, opt_d = module.optimizers()
    z = _noise_for(x, 4)
    bce = nn.functional.binary_cross_entropy_with_logits

    module.toggle_optimizer(opt_d)
    real, fake = discriminate(x), discriminate(module(z).detach())
    loss_d = bce(real, torch.ones_like(real)) + bce(fake, torch.zeros_like(fake))
    opt_d.zero_grad()
    module.manual_backward(loss_d)
    opt_d.step()
    module.untoggle_optimizer(opt_d)

    module.toggle_optimizer(opt_g)
    fake = discriminate(module(z))
    loss_g = bce(fake, torch.ones_like(fake))
    opt_g.zero_grad()
    module.manual_backward(loss_g)
    opt_g.step()
    module.untoggle_optimizer(opt_g)
    return loss_d, loss_g


def _noise_for(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-sample noise that depends only on the sample (not on the rank or the batch it lands in)."""
    seeds = (x.detach().abs().sum(dim=1) * 1e4).long()
    return torch.stack([torch.randn(dim, generator=torch.Generator().manual_seed(int(s))) for s in seeds])


class TiedLM(nn.Module):
    """Embedding -> two MLP blocks -> LM head that shares the embedding's weight (as GPT-2 and most LMs do).

    A plain ``nn.Module`` with a ``training_step``, which the pipeline split runs from a torch loop; :class:`TiedGPT`
    is the same model as a LightningModule.
    """

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return through(self.pipeline_layers(), tokens)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())


class TiedGPT(TiedLM, pl.LightningModule):
    """:class:`TiedLM` (its default sizes) trained by Lightning with AdamW."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def through(layers: Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``x`` through ``layers`` in turn: the ``forward`` of a model that is exactly its ``pipeline_layers()``."""
    for layer in layers:
        x = layer(x)
    return x


class RankSeededModel(pl.LightningModule):
    """Builds its initial weights from a seed of its own rank, as a script without ``seed_everything`` does.

    Every strategy must start all ranks from rank 0's weights, so the run equals one device seeded with 0.
    """

    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(100 + rank)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2))
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return through(self.pipeline_layers(), x)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.inp, *self.blocks, self.out]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ResidualMLP(pl.LightningModule):
    """Residual blocks ``x + f(x)``; with ``wrong_layers=True`` ``pipeline_layers()`` forgets the residual."""

    def __init__(self, wrong_layers: bool = False) -> None:
        super().__init__()
        self.wrong_layers = wrong_layers
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(_Residual() for _ in range(2))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def pipeline_layers(self) -> list[nn.Module]:
        blocks = [block.body for block in self.blocks] if self.wrong_layers else list(self.blocks)
        return [self.inp, *blocks, self.out]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


# ---------------------------------------------------------------------------------------------------- data
def dataset(kind: str = "classification", *, steps: int = STEPS, global_batch: int = GLOBAL_BATCH) -> TensorDataset:
    """Seeded samples: ``(x, y)`` for classification, ``(tokens, next tokens)`` for ``kind="tokens"``."""
    generator = torch.Generator().manual_seed(3)
    count = steps * global_batch
    if kind == "tokens":
        tokens = torch.randint(0, VOCAB, (count, SEQ + 1), generator=generator)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    x = torch.randn(count, FEATURES, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (count,), generator=generator))


def loader(
    replicas: int = 1,
    replica: int = 0,
    *,
    kind: str = "classification",
    steps: int = STEPS,
    global_batch: int = GLOBAL_BATCH,
) -> DataLoader:
    """Step k's global batch is samples ``[k*B, (k+1)*B)``; replica r takes its r-th contiguous slice of it."""
    per_replica = global_batch // replicas
    indices = [k * global_batch + replica * per_replica + i for k in range(steps) for i in range(per_replica)]
    data = Subset(dataset(kind, steps=steps, global_batch=global_batch), indices)
    return DataLoader(data, batch_size=per_replica, shuffle=False)


def trainer(strategy: Any, devices: int, *, max_steps: int = STEPS, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer that leaves data sharding to :func:`loader`."""
    options: dict[str, Any] = {
        "devices": devices,
        "strategy": strategy,
        "max_steps": max_steps,
        "use_distributed_sampler": False,
        "num_sanity_val_steps": 0,
    }
    return cpu_trainer(**{**options, **kwargs})


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def single_device(
    make_model: Callable[[], pl.LightningModule], *, kind: str = "classification", steps: int = STEPS, **kwargs: Any
) -> dict[str, torch.Tensor]:
    """Weights after training ``make_model()`` on one device over every global batch (seed 0 before building)."""
    pl.seed_everything(0, verbose=False)
    module = make_model()
    trainer("auto", 1, max_steps=steps, **kwargs).fit(module, loader(kind=kind, steps=steps))
    return state_of(module)


def fit_in_rank(
    make_model: Callable[[], pl.LightningModule],
    strategy: Any,
    world_size: int,
    *,
    kind: str = "classification",
    steps: int = STEPS,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Inside a rank of ``run_distributed(..., init_process_group=False)``: fit, return the consolidated weights
    (complete on rank 0; a collective, every rank calls it)."""
    pl.seed_everything(0, verbose=False)
    fit_trainer = trainer(strategy, world_size, max_steps=steps, **kwargs)
    sampler = fit_trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
    module = make_model()
    fit_trainer.fit(module, loader(sampler["num_replicas"], sampler["rank"], kind=kind, steps=steps))
    state = fit_trainer.strategy.lightning_module_state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}
