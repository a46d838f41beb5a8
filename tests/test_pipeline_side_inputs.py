"""Side inputs (issue 13, item 4): tensors every pipeline layer needs, passed to the model by keyword.

``MaskedEncoder`` calls ``self(tokens, attention_mask=mask, position_ids=positions)``; its embedding layer takes
``position_ids``, its attention blocks and its pooling head take ``attention_mask``, and no layer returns either.
Under the pipeline each stage gets the micro-batch's side inputs and every layer those it takes by name. Checked
against single-device Lightning on the same global batches (2 forked ranks: 1F1B, GPipe, Interleaved1F1B and
ZBVZeroBubble with 4 stages; on torch 2.11 the bool mask and int64 positions cross the stages encoded), and the
padding mask must matter (the same data with every token unmasked trains other weights).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from training_helpers import assert_weights_close

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.distributed.pipeline import check_layers_compose_to_forward

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)

VOCAB, SEQ, WIDTH, CLASSES = 32, 8, 16, 3
GLOBAL_BATCH, STEPS = 8, 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(SEQ, WIDTH)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(position_ids)


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        attended, _ = self.attention(h, h, h, key_padding_mask=~attention_mask, need_weights=False)
        x = x + attended
        return x + self.mlp(x)


class MaskedPoolHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, *, attention_mask: torch.Tensor) -> torch.Tensor:
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * weights).sum(1) / weights.sum(1))


class MaskedEncoder(pl.LightningModule):
    """A padded-sequence classifier: the mask and the position ids go to the layers by keyword, never returned."""

    def __init__(self, ignore_padding: bool = False) -> None:
        super().__init__()
        self.ignore_padding = ignore_padding
        self.embedding = Embed()
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(3))
        self.pool = MaskedPoolHead()

    def forward(self, tokens: torch.Tensor, *, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> Any:
        x = self.embedding(tokens, position_ids=position_ids)
        for block in self.blocks:
            x = block(x, attention_mask=attention_mask)
        return self.pool(x, attention_mask=attention_mask)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.pool]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, mask, labels = batch
        if self.ignore_padding:
            mask = torch.ones_like(mask)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = self(tokens, attention_mask=mask, position_ids=positions)
        return nn.functional.cross_entropy(logits, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def _loader(replicas: int = 1, replica: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    n = GLOBAL_BATCH * STEPS
    tokens = torch.randint(VOCAB, (n, SEQ), generator=generator)
    lengths = torch.randint(2, SEQ + 1, (n,), generator=generator)
    mask = torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)
    labels = torch.randint(CLASSES, (n,), generator=generator)
    per_replica = GLOBAL_BATCH // replicas
    indices = [k * GLOBAL_BATCH + replica * per_replica + i for k in range(STEPS) for i in range(per_replica)]
    return DataLoader(Subset(TensorDataset(tokens, mask, labels), indices), batch_size=per_replica, shuffle=False)


def _fit(strategy: Any, devices: int, **model_kwargs: Any) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    trainer = zoo.trainer(strategy, devices, max_steps=STEPS)
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    module = MaskedEncoder(**model_kwargs)
    trainer.fit(module, _loader(sampler["num_replicas"], sampler["rank"]))
    return zoo.state_of(module)  # after teardown the pipeline's module is whole on every rank


def _reference_rank(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"masked": _fit("auto", 1), "unmasked": _fit("auto", 1, ignore_padding=True)}


def _pipeline_rank(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    def pipeline(**kwargs: Any) -> PipelineParallelStrategy:
        return PipelineParallelStrategy(timeout=120, **kwargs)

    return {
        "1f1b": _fit(pipeline(schedule="1F1B"), world_size),
        "gpipe": _fit(pipeline(schedule="GPipe", num_microbatches=4), world_size),
        "interleaved": _fit(pipeline(schedule="Interleaved1F1B"), world_size),
        # A V: the tip's two stages hand the side inputs over without P2P, backward split into input and weights.
        "zbv": _fit(pipeline(schedule="ZBVZeroBubble"), world_size),
    }


def test_side_inputs_reach_every_stage_and_train_like_one_device() -> None:
    (reference,) = run_distributed(_reference_rank, 1, init_process_group=False, timeout=120)
    # The mask matters: without it the same data trains other weights.
    assert not torch.allclose(reference["masked"]["pool.head.weight"], reference["unmasked"]["pool.head.weight"])
    results = run_distributed(_pipeline_rank, 2, init_process_group=False, timeout=240)
    for result in results:
        for name, weights in result.items():
            try:
                assert_weights_close(weights, reference["masked"], **TOLERANCE)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from error


def test_the_layer_check_gives_each_layer_the_side_inputs_it_takes() -> None:
    module = MaskedEncoder()
    tokens, mask, _ = next(iter(_loader()))
    positions = torch.arange(SEQ).expand_as(tokens)
    example = ((tokens,), {"attention_mask": mask, "position_ids": positions})
    check_layers_compose_to_forward(module, module.pipeline_layers(), example)

    class ForgetsTheMask(MaskedEncoder):
        def forward(self, tokens: torch.Tensor, *, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> Any:
            x = self.embedding(tokens, position_ids=position_ids)
            for block in self.blocks:
                x = block(x, attention_mask=torch.ones_like(attention_mask))
            return self.pool(x, attention_mask=attention_mask)

    forgetful = ForgetsTheMask()
    with pytest.raises(ValueError, match=r"pipeline layer 1 \(`MaskedBlock`"):
        check_layers_compose_to_forward(forgetful, forgetful.pipeline_layers(), example)
