"""Pipelines for the models users bring (issue 21): models written before ``pipeline_layers()`` existed.

* Lightning's demo ``Transformer`` (``nn.Transformer`` with a ``PositionalEncoding`` that caches a plain tensor
  attribute at its first forward) cut into adapter layers that pass the target along with the encoder's output:
  a real 2-rank fit with the default ``partition="compute"`` (whose FLOP count once ran a ``meta`` copy of each
  layer and refused the cached CPU tensor) and with ``partition="parameters"``, each equal to one device.
  Every tensor a stage sends is contiguous (gloo's ``irecv`` refuses the others).
* One process: FLOP counting leaves the layers as they were, ``"parameters"`` and an explicit list run no layer,
  a layer whose FLOPs cannot be counted splits by parameters with a warning, and namedtuple inputs keep their type
  in the layer check, the FLOP count and the timing.
"""

from __future__ import annotations

import math
import warnings
from collections import namedtuple
from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
from distributed_harness import run_distributed
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import Tensor, nn
from training_helpers import assert_weights_close

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.accounting import LiveTensorPeak
from lightning_parallel.distributed.pipeline import check_layers_compose_to_forward
from lightning_parallel.distributed.pipeline.layer_costs import (
    layer_compute_costs,
    layer_parameter_costs,
    measure_layer_times,
)
from lightning_parallel.distributed.pipeline.stage_module import StageModule
from lightning_parallel.distributed.pipeline.stage_plan import plan_for_example
from lightning_parallel.distributed.pipeline.verify import _clone, _to

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


# ------------------------------------------------------------------------------------ the demo Transformer, cut
class Embed(nn.Module):
    """The demo's first lines of ``forward``: embed and position-encode source and target."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.embedding, self.pos_encoder, self.scale = model.embedding, model.pos_encoder, math.sqrt(model.ninp)

    def forward(self, inputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        source, target = self.embedding(inputs) * self.scale, self.embedding(target) * self.scale
        return self.pos_encoder(source), self.pos_encoder(target)


class Encode(nn.Module):
    """One encoder layer (and the encoder's final norm after the last); the target passes through."""

    def __init__(self, layer: nn.Module, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layer, self.norm = layer, norm

    def forward(self, source: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        source = self.layer(source)
        return (source if self.norm is None else self.norm(source)), target


class Decode(nn.Module):
    """One decoder layer over the encoder's output (``memory``), with the causal mask ``nn.TransformerDecoder`` uses."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, memory: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        mask = nn.Transformer.generate_square_subsequent_mask(target.size(1), device=target.device)
        return memory, self.layer(target, memory, tgt_mask=mask, tgt_is_causal=True)


class Head(nn.Module):
    """The decoder's final norm and the demo's output lines (log-probabilities, flattened over tokens)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.norm, self.decoder, self.vocab_size = model.transformer.decoder.norm, model.decoder, model.vocab_size

    def forward(self, memory: Tensor, target: Tensor) -> Tensor:
        return torch.log_softmax(self.decoder(self.norm(target)), dim=-1).view(-1, self.vocab_size)


def transformer_layers(model: Transformer) -> list[nn.Module]:
    encoder, decoder = model.transformer.encoder, model.transformer.decoder
    *first, last = encoder.layers
    return [
        Embed(model),
        *(Encode(layer) for layer in first),
        Encode(last, encoder.norm),
        *(Decode(layer) for layer in decoder.layers),
        Head(model),
    ]


class PipelinedTransformer(LightningTransformer):
    """Lightning's ``LightningTransformer``, tiny and without dropout, plus ``pipeline_layers()``."""

    def __init__(self) -> None:
        super().__init__(vocab_size=zoo.VOCAB)
        self.model = Transformer(vocab_size=zoo.VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)

    def prepare_data(self) -> None:  # the demo downloads WikiText-2 here; the tests bring their own tokens
        pass

    def pipeline_layers(self) -> list[nn.Module]:
        return transformer_layers(self.model)


def _fit_transformers(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for partition in ("compute", "parameters"):
        pl.seed_everything(0, verbose=False)
        module = PipelinedTransformer()
        strategy = PipelineParallelStrategy(partition=partition, timeout=120)
        trainer = zoo.trainer(strategy, world_size)
        trainer.fit(module, zoo.loader(kind="tokens"))
        results[partition] = {
            "weights": {k: v.detach().clone() for k, v in strategy.lightning_module_state_dict().items()},
            "starts": strategy.stage_plan.starts,
        }
    return results


def test_lightning_demo_transformer_trains_in_a_pipeline_like_one_device():
    reference = zoo.single_device(PipelinedTransformer, kind="tokens")
    results = run_distributed(_fit_transformers, 2, init_process_group=False, timeout=180)
    for result in results[0].values():
        assert_weights_close(result["weights"], reference, **TOLERANCE)
        assert list(result["weights"]) == list(reference)  # the demo's own parameter names
    # The compute split cuts after the encoder: the first stage sends (memory, target) and receives the gradient of
    # memory from the decoder's cross-attention, laid out transposed (gloo refused it before it was made contiguous).
    assert results[0]["compute"]["starts"] == (0, 3)


# -------------------------------------------------------------------------------------------------- planning
def _demo_transformer() -> tuple[Transformer, list[nn.Module], Tensor]:
    torch.manual_seed(0)
    model = Transformer(vocab_size=zoo.VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)
    tokens = torch.randint(0, zoo.VOCAB, (4, zoo.SEQ))
    return model, transformer_layers(model), tokens


def test_flop_count_runs_with_a_cached_plain_tensor_and_leaves_the_layers_as_they_were():
    model, layers, tokens = _demo_transformer()
    before_forward = layer_compute_costs(layers, (tokens, tokens))
    assert model.pos_encoder.pe is None  # the count did not leave a fake cache behind
    model(tokens, tokens)  # what the layer check does first: PositionalEncoding caches `pe` (a plain CPU tensor)
    cached, state = model.pos_encoder.pe, {k: v.clone() for k, v in model.state_dict().items()}
    assert cached is not None and not cached.is_meta
    assert layer_compute_costs(layers, (tokens, tokens)) == before_forward
    assert model.pos_encoder.pe is cached
    assert_weights_close(model.state_dict(), state, rtol=0, atol=0)
    assert all(not p.is_meta for p in model.parameters())
    assert before_forward[1] < before_forward[3]  # a decoder layer (self and cross attention) costs more
    # nn.TransformerDecoder reads its (real) mask to decide whether it is causal: it stays real, so that works.
    memory = torch.randn(4, zoo.SEQ, 16)
    (whole_decoder,) = layer_compute_costs([_WholeDecoder(model.transformer.decoder)], (memory, memory))
    assert whole_decoder > before_forward[3]  # two decoder layers


class _WholeDecoder(nn.Module):
    def __init__(self, decoder: nn.TransformerDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, memory: Tensor, target: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(target.size(1))
        return self.decoder(target, memory, tgt_mask=mask)


def test_batchnorm_statistics_survive_the_flop_count():
    module = zoo.BatchNormCNN()
    module.train()
    before = zoo.state_of(module)
    layer_compute_costs(module.pipeline_layers(), (zoo.dataset()[:8][0],))
    assert_weights_close(zoo.state_of(module), before, rtol=0, atol=0)


class _Exploding(nn.Module):
    """A layer that must not run: planning by parameters or by an explicit list calls no layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        raise AssertionError("planning ran this layer")


class _ReadsAValue(nn.Module):
    """Reads a value computed from its parameters (``.item()``): its FLOPs cannot be counted with fake parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        return h * float(h.abs().max().item() > 0)


def test_parameters_and_explicit_partitions_run_no_layer_and_an_uncountable_layer_splits_by_parameters():
    layers: list[nn.Module] = [_Exploding(4), _Exploding(8), _Exploding(2)]  # parameters 20, 72, 6
    example: tuple[tuple[Any, ...], dict[str, Any]] = ((torch.zeros(2, 4),), {})
    plan = plan_for_example(layers, example, partition="parameters", num_stages=2, pipeline_parallel_size=2)
    assert plan.starts == (0, 1)
    plan = plan_for_example(layers, example, partition=[2], num_stages=2, pipeline_parallel_size=2)
    assert plan.starts == (0, 2)

    layers = [nn.Linear(4, 4), _ReadsAValue(4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))]
    with pytest.raises(RuntimeError, match=r"pipeline layer 1 \(`_ReadsAValue`\)"):
        layer_compute_costs(layers, (torch.zeros(2, 4),))
    messages: list[str] = []
    plan = plan_for_example(
        layers, example, partition="compute", num_stages=2, pipeline_parallel_size=2, warn=messages.append
    )
    assert plan.starts == (0, 2)  # parameter counts 20, 20, 40
    assert len(messages) == 1 and "pipeline layer 1 (`_ReadsAValue`)" in messages[0]
    assert "splits by parameter counts instead" in messages[0] and "partition='measured'" in messages[0]
    assert layer_parameter_costs(layers) == [20, 20, 40]
    with warnings.catch_warnings(record=True) as caught:  # the default `warn` is warnings.warn
        warnings.simplefilter("always")
        plan_for_example(layers, example, partition="compute", num_stages=2, pipeline_parallel_size=2)
    assert any("_ReadsAValue" in str(w.message) for w in caught)


def test_a_stage_sends_contiguous_outputs_and_input_gradients():
    transposed = _Transpose()
    x = torch.randn(2, 3, 4)
    first = StageModule([transposed], is_first=True, is_last=False)
    last = StageModule([transposed], is_first=False, is_last=True)
    assert not transposed(x).is_contiguous()
    assert first(x).is_contiguous() and torch.equal(first(x), transposed(x))
    assert not last(x).is_contiguous()  # the last stage's output is not sent
    received = torch.randn(2, 3, 4, requires_grad=True)  # a later stage's input, whose gradient goes back
    (gradient,) = torch.autograd.grad(last(received), received, torch.randn(2, 4, 3))
    assert gradient.is_contiguous()
    (plain,) = torch.autograd.grad(transposed(received), received, torch.randn(2, 4, 3))
    assert not plain.is_contiguous()  # what torch would have sent


class _Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


# -------------------------------------------------------------------------------------------------- namedtuples
Pair = namedtuple("Pair", ["features", "scale"])


class _PairInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(zoo.FEATURES, zoo.WIDTH)

    def forward(self, pair: Pair) -> Tensor:
        return self.linear(pair.features) * pair.scale


class _PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = _PairInput(), nn.Linear(zoo.WIDTH, zoo.CLASSES)

    def forward(self, pair: Pair) -> Tensor:
        return self.out(self.inp(pair))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.inp, self.out]


def test_namedtuple_inputs_keep_their_type():
    pair = Pair(torch.randn(4, zoo.FEATURES), torch.full((4, 1), 2.0))
    assert type(_clone(pair)) is Pair and type(_to(pair, torch.device("cpu"))) is Pair
    assert torch.equal(_clone({"batch": [pair]})["batch"][0].features, pair.features)
    model = _PairModel()
    check_layers_compose_to_forward(model, model.pipeline_layers(), ((pair,), {}))
    assert len(layer_compute_costs(model.pipeline_layers(), (pair,))) == 2
    assert len(measure_layer_times(model.pipeline_layers(), (pair,), device=torch.device("cpu"), repeats=1)) == 2


def test_attention_on_cpu_counts_in_the_compute_partition():
    # torch's FLOP counter has no formula for the CPU attention kernel; without ours an attention layer weighed as
    # little as its projections, and `partition="compute"` piled attention layers onto one CPU stage.
    attention = nn.MultiheadAttention(16, 2, batch_first=True)

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = attention

        def forward(self, x: Tensor) -> Tensor:
            return self.attention(x, x, x, need_weights=False)[0]

    x = torch.randn(2, 64, 16)
    (cost,) = layer_compute_costs([SelfAttention()], (x,))
    projections = 2 * 2 * 64 * 16 * (3 * 16 + 16)  # q, k, v and output projections: 2 * tokens * d_in * d_out
    scores = 2 * 2 * 2 * 64 * 64 * 8 * 2  # (Q K^T and A V) x 2 FLOPs x batch x heads x T x T x head_dim
    assert cost >= projections + scores


def test_the_layer_check_compares_a_large_output_without_copying_it_whole_in_float64():
    # A language model's logits (batch x sequence x vocabulary) dominate the set-up peak of the check: forward's
    # output and the chain's are held once each; the float64 comparison runs in chunks (it held 4 more copies).
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1 << 16))
    x = torch.randn(64, 8)
    output_bytes = 64 * (1 << 16) * 4
    with LiveTensorPeak() as peak:
        check_layers_compose_to_forward(model, list(model), ((x,), {}))
    result = peak.result()
    assert result.peak_bytes - result.start_bytes <= 2 * output_bytes + 3 * (1 << 20) * 8, result
