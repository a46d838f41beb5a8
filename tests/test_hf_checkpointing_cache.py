"""Activation checkpointing of a Hugging Face Llama as the README trains it, ``use_cache`` left at its default
(issue 44, item 2).

The README's step, ``self.model(input_ids=ids, labels=ids).loss``, on a tiny random ``LlamaConfig`` (nothing
downloaded; ``use_cache=True`` is the config's default, even in training), under every ``activation_checkpointing``
mode (``True``, ``"selective"``, a set of classes, ``SelectiveCheckpointing(blocks=...)``) and every strategy that
offers it, with eager and SDPA attention: each fit equals one device without checkpointing (fp32: the weights after
3 AdamW steps, to rounding). Hugging Face's model builds its key/value cache above the blocks and hands it to each;
a recomputed block would append to it a second time (eager: a shape error in backward; SDPA with ``"selective"``:
torch's replaying mode finds an op it did not cache). A checkpointed model runs with the cache off, as Hugging
Face's own gradient checkpointing does.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from test_hf_models import SEQ, VOCAB, _decoder_config
from torch import Tensor
from torch.utils.data import DataLoader
from training_helpers import assert_weights_close

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.distributed.activation_checkpointing import SelectiveCheckpointing

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH = 3, 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # AdamW: an element with a ~0 gradient steps by rounding noise
ATTENTION = ("eager", "sdpa")


def _modes() -> dict[str, Any]:
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    return {
        "True": True,
        "selective": "selective",
        "classes": {layer},
        "SelectiveCheckpointing": SelectiveCheckpointing(blocks={layer}),
    }


class ReadmeLlama(pl.LightningModule):
    """The README's module: a Hugging Face Llama whose step returns ``self.model(input_ids=ids, labels=ids).loss``."""

    def __init__(self, attention: str) -> None:
        super().__init__()
        config = transformers.LlamaConfig(**_decoder_config(), attn_implementation=attention)  # test_hf_models's
        assert config.use_cache  # the default, left as it is
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        ids = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(replicas: int, replica: int) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    per = GLOBAL_BATCH // replicas
    indices = [k * GLOBAL_BATCH + replica * per + i for k in range(STEPS) for i in range(per)]
    return DataLoader(tokens[indices], batch_size=per, shuffle=False)  # type: ignore[arg-type]


STRATEGIES: dict[str, Any] = {
    "data_parallel": lambda mode: DataParallelStrategy(activation_checkpointing=mode),
    **{
        f"zero{stage}": lambda mode, stage=stage: ShardedOptimizerStrategy(stage=stage, activation_checkpointing=mode)
        for stage in (1, 2, 3)
    },
    "pipeline": lambda mode: PipelineParallelStrategy(
        pipeline_parallel_size=2, num_microbatches=2, activation_checkpointing=mode
    ),
}


def _fit(strategy: Any, world_size: int, rank: int, attention: str) -> dict[str, Tensor]:
    pl.seed_everything(0, verbose=False)
    module = ReadmeLlama(attention)
    trainer = zoo.trainer(strategy, world_size, max_steps=STEPS)
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    trainer.fit(module, _loader(sampler["num_replicas"], sampler["rank"]))
    state = trainer.strategy.lightning_module_state_dict() if world_size > 1 else module.state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def _in_ranks(rank: int, world_size: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    results: dict[Any, Any] = {}
    for attention in ATTENTION:
        for name, make in STRATEGIES.items():
            for mode, value in _modes().items():
                try:
                    results[name, mode, attention] = _fit(make(value), world_size, rank, attention)
                except Exception as error:  # reported per case by the test below
                    results[name, mode, attention] = f"{type(error).__name__}: {error}"
    return results


@pytest.fixture(scope="module")
def one_device() -> dict[str, dict[str, Tensor]]:
    return {attention: _fit("auto", 1, 0, attention) for attention in ATTENTION}


@pytest.fixture(scope="module")
def two_ranks() -> dict[Any, Any]:
    return run_distributed(_in_ranks, 2, init_process_group=False, timeout=900)[0]


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("mode", ["True", "selective", "classes", "SelectiveCheckpointing"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_checkpointed_llama_with_its_default_cache_equals_one_device(
    two_ranks, one_device, strategy: str, mode: str, attention: str
) -> None:
    result = two_ranks[strategy, mode, attention]
    assert not isinstance(result, str), result
    assert_weights_close(result, one_device[attention], **TOLERANCE)
