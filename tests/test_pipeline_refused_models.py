"""Models the pipeline used to refuse although the guide says they train (issue 30, item 4), each the library's own
class with a tiny random config, fitted in 2 forked ranks (real gloo, real Trainers, 1F1B with 2 micro-batches)
and on one device on the same samples in the same order (Lightning's shuffling ``DistributedSampler`` made
explicit, ``accumulate_grad_batches=2`` with half batches):

* **Parameters of the model itself in an adapter**: transformers' ``SamVisionEncoder`` (SAM's ViT) keeps
  ``pos_embed`` on the model, next to its blocks, as timm's ``VisionTransformer`` keeps ``cls_token`` and
  ``pos_embed``; the first adapter holds it (``self.pos_embed = encoder.pos_embed``). timm itself cannot be a test
  dependency: it imports torchvision, and PyPI's only Linux torchvision wheels for torch 2.13 are CUDA builds whose
  ops do not load beside the CPU build of torch (``RuntimeError: operator torchvision::nms does not exist``). The
  guide's timm ViT block runs below where timm imports. A user's parameter of the LightningModule itself used by the
  first and the last layer trains like a tied weight.
* **A PEFT-wrapped Hugging Face model** (LoRA on ``LlamaForCausalLM``): the plan is read from the transformers
  model inside the wrapper; the base stays frozen, the adapters train.
* **Hugging Face BERT with adapters**: ``BertModel.forward`` calls its embeddings by keyword, which the layer check
  compares with the chain's positional call after binding both to the signature.

Checkpoints keep the model's own names (the consolidated ``.ckpt`` has one-device's keys, in its order).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from distributed_harness import run_distributed
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from training_helpers import assert_weights_close, make_trainer
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM, SamVisionConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.sam.modeling_sam import SamVisionEncoder

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.distributed.pipeline import check_layers_compose_to_forward
from lightning_parallel.distributed.pipeline.layer_registration import layer_registrations
from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call

SEED, VOCAB, SEQ, CLASSES, SAMPLES, BATCH, MICRO, STEPS = 7, 64, 8, 3, 16, 4, 2, 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
DOC = Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"


# ---------------------------------------------------------------------------------------------- SAM's ViT
class SamEmbeddings(nn.Module):  # SamVisionEncoder.forward adds `pos_embed`, a parameter of the model itself
    def __init__(self, encoder: SamVisionEncoder) -> None:
        super().__init__()
        self.patch_embed, self.pos_embed = encoder.patch_embed, encoder.pos_embed

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(pixel_values) + self.pos_embed


class PooledHead(nn.Module):
    def __init__(self, neck: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.neck, self.head = neck, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(hidden).mean((2, 3)))


class LitSam(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = SamVisionConfig(
            hidden_size=16, output_channels=8, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=4, window_size=2, global_attn_indexes=[1], mlp_dim=32,
        )  # fmt: skip
        self.model = SamVisionEncoder(config)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(pixel_values).last_hidden_state.mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def pipeline_layers(self) -> list[nn.Module]:
        return [SamEmbeddings(self.model), *self.model.layers, PooledHead(self.model.neck, self.head)]


# ---------------------------------------------------------------------------------------------- a user's tied scale
class Scaled(nn.Module):
    def __init__(self, linear: nn.Module, scale: nn.Parameter, *, before: bool) -> None:
        super().__init__()
        self.linear, self.scale, self.before = linear, scale, before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.scale) if self.before else self.linear(x) * self.scale


class LitScaled(pl.LightningModule):
    """A parameter of the LightningModule itself (``scale``), used by the first and the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Linear(8, 16), nn.Linear(16, CLASSES)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.out(x * self.scale[:CLASSES].sum())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, labels = batch
        return F.cross_entropy(self(x), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def pipeline_layers(self) -> list[nn.Module]:
        return [Scaled(self.embed, self.scale, before=False), *self.blocks, _ScaledHead(self.out, self.scale)]


class _ScaledHead(nn.Module):
    def __init__(self, out: nn.Module, scale: nn.Parameter) -> None:
        super().__init__()
        self.out, self.scale = out, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x * self.scale[:CLASSES].sum())


# ---------------------------------------------------------------------------------------------- LoRA on Llama
class LitLora(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=SEQ,
        )  # fmt: skip
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian")
        self.model = get_peft_model(LlamaForCausalLM(config), lora)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


# ---------------------------------------------------------------------------------------------- BERT
class BertBlock(nn.Module):  # BertModel.forward turns the padding mask into the attention mask of every layer
    def __init__(self, layer: nn.Module, config: BertConfig) -> None:
        super().__init__()
        self.layer, self.config = layer, config

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return self.layer(hidden, attention_mask=mask)


class BertHead(nn.Module):
    def __init__(self, model: BertForSequenceClassification) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = model.bert.pooler, model.dropout, model.classifier

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))


class LitBert(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=SEQ, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.model = BertForSequenceClassification(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        return F.cross_entropy(self(ids, attention_mask=mask), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def pipeline_layers(self) -> list[nn.Module]:  # the embeddings as they are: `forward` calls them by keyword
        bert = self.model.bert
        return [bert.embeddings, *(BertBlock(layer, bert.config) for layer in bert.encoder.layer), BertHead(self.model)]


MODELS: dict[str, Any] = {"sam": LitSam, "scaled": LitScaled, "lora": LitLora, "bert": LitBert}


def dataset(kind: str) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    if kind in ("sam", "timm"):
        return TensorDataset(torch.randn(SAMPLES, 3, 16, 16, generator=generator), labels)
    if kind == "scaled":
        return TensorDataset(torch.randn(SAMPLES, 8, generator=generator), labels)
    tokens = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=generator)
    if kind == "lora":
        return TensorDataset(tokens)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (SAMPLES,), generator=generator)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    return TensorDataset(tokens * mask, mask, labels)


def loader(kind: str, *, single_device: bool) -> DataLoader:
    data = dataset(kind)
    if not single_device:
        return DataLoader(data, batch_size=BATCH)
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    return DataLoader(data, batch_size=BATCH // MICRO, sampler=sampler)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _make(kind: str) -> pl.LightningModule:
    pl.seed_everything(SEED, verbose=False)  # also the seed of Lightning's DistributedSampler
    return MODELS[kind]()


def _one_device(rank: int, world_size: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in kinds:
        module = _make(kind)
        result[f"{kind}/initial"] = _state(module)
        make_trainer("auto", devices=1, max_steps=STEPS, accumulate=MICRO).fit(module, loader(kind, single_device=True))
        result[kind] = _state(module)
    return result


def _pipeline(rank: int, world_size: int, kinds: tuple[str, ...], directory: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in kinds:
        module = _make(kind)
        strategy = PipelineParallelStrategy(schedule="1F1B", num_microbatches=MICRO, timeout=120)
        trainer = make_trainer(strategy, devices=world_size, max_steps=STEPS)
        trainer.fit(module, loader(kind, single_device=False))
        trainer.save_checkpoint(f"{directory}/{kind}.ckpt")  # a collective: every rank calls it
        result[kind] = {"weights": _state(module), "starts": strategy.stage_plan.starts}
    return result


def _fit_both(tmp_path: Path, kinds: tuple[str, ...]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    (reference,) = run_distributed(_one_device, 1, args=(kinds,), init_process_group=False, timeout=120)
    results = run_distributed(_pipeline, 2, args=(kinds, str(tmp_path)), init_process_group=False, timeout=240)
    return reference, results


def test_top_level_parameters_peft_and_bert_train_like_one_device(tmp_path):
    kinds = tuple(MODELS)
    reference, results = _fit_both(tmp_path, kinds)
    for kind in kinds:
        for result in results:  # the module is whole again on every rank after fit
            assert len(result[kind]["starts"]) == 2
            assert_weights_close(result[kind]["weights"], reference[kind], **TOLERANCE)
        saved = torch.load(tmp_path / f"{kind}.ckpt", weights_only=True)["state_dict"]
        assert list(saved) == list(reference[kind])  # the model's own names, in one device's order
        assert_weights_close(saved, reference[kind], **TOLERANCE)
    assert "model.pos_embed" in reference["sam"]  # SAM's parameter of the model itself
    assert results[0]["sam"]["starts"] == (0, 2)  # the embeddings' adapter and the first block on rank 0
    # LoRA: the frozen base did not move, the adapters did, under PEFT's names.
    lora, initial = reference["lora"], reference["lora/initial"]
    base = "model.base_model.model.model.layers.0.self_attn.q_proj"
    assert torch.equal(lora[f"{base}.base_layer.weight"], initial[f"{base}.base_layer.weight"])
    assert not torch.equal(lora[f"{base}.lora_A.default.weight"], initial[f"{base}.lora_A.default.weight"])
    last = "model.base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
    assert not torch.equal(lora[last], initial[last])  # a block on the second stage
    # The user's tied scale moved (its gradient comes from both stages).
    assert not torch.equal(reference["scaled"]["scale"], reference["scaled/initial"]["scale"])


# ---------------------------------------------------------------------------------------------- timm, where it imports
_TIMM_BLOCK = re.compile(r"<!-- run: timm -->\n```python\n(.*?)```", re.DOTALL)


@functools.cache
def timm_namespace() -> dict[str, Any]:
    """The namespace of docs/pipeline.md's timm ViT block."""
    (code,) = _TIMM_BLOCK.findall(DOC.read_text())
    namespace: dict[str, Any] = {"__name__": "pipeline_doc_timm"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


TIMM_VIT = {
    "name": "vit_tiny_patch16_224", "pretrained": False, "img_size": 16, "patch_size": 4, "depth": 2,
    "num_classes": CLASSES, "embed_dim": 16, "num_heads": 2,
}  # fmt: skip


def make_timm_vit() -> pl.LightningModule:
    return timm_namespace()["LitViT"](**TIMM_VIT)


def test_the_guides_timm_vit_trains_like_one_device(tmp_path):
    timm = pytest.importorskip("timm", reason="timm imports torchvision, whose PyPI builds need a CUDA build of torch")
    timm_namespace()  # before forking: the ranks inherit it
    MODELS["timm"] = make_timm_vit
    try:
        reference, results = _fit_both(tmp_path, ("timm",))
    finally:
        del MODELS["timm"]
    for result in results:
        assert_weights_close(result["timm"]["weights"], reference["timm"], **TOLERANCE)
    saved = torch.load(tmp_path / "timm.ckpt", weights_only=True)["state_dict"]
    assert list(saved) == list(reference["timm"])
    assert {"model.cls_token", "model.pos_embed"} <= set(saved)
    options = {k: v for k, v in TIMM_VIT.items() if k != "name"}
    plain = timm.create_model(TIMM_VIT["name"], **options)
    plain.load_state_dict({name.removeprefix("model."): tensor for name, tensor in saved.items()})


# ---------------------------------------------------------------------------------------------- one process
def test_an_adapter_holding_parameters_of_the_model_itself_registers_them_by_the_models_names():
    module = LitSam()
    layers = module.pipeline_layers()
    (registrations, *_) = layer_registrations(module, layers)
    assert [(r.name, r.is_tensor) for r in registrations] == [("model.patch_embed", False), ("model.pos_embed", True)]


def test_an_adapter_holding_a_copy_is_refused_naming_the_tensor():
    module = LitSam()
    layers = module.pipeline_layers()
    layers[0].pos_embed = nn.Parameter(module.model.pos_embed.detach().clone())
    with pytest.raises(ValueError, match=r"item 0 \(`SamEmbeddings`\) holds the parameter `pos_embed` \(shape"):
        layer_registrations(module, layers)


def _bert_example() -> tuple[tuple[Any, ...], dict[str, Any]]:
    ids, mask, _ = dataset("bert")[:BATCH]
    return (ids,), {"attention_mask": mask}


class _BertWithTokenTypes(LitBert):
    """``forward`` passes token types to the embeddings (by keyword); the chain gives them none."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        types = torch.ones_like(input_ids)
        return self.model(input_ids, attention_mask=attention_mask, token_type_ids=types).logits


class _BertWithoutMask(LitBert):
    """The chain's blocks get the padding mask where `forward` gives them the attention mask made from it."""

    def pipeline_layers(self) -> list[nn.Module]:
        bert = self.model.bert
        return [bert.embeddings, *bert.encoder.layer, BertHead(self.model)]


class _KeywordShift(nn.Module):
    """``forward`` calls its embedding by keyword on shifted ids: a real difference in a keyword call."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(VOCAB + 1, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(input=ids + 1))


def test_the_layer_check_accepts_keyword_calls_of_the_same_tensors_and_refuses_real_differences():
    torch.manual_seed(0)
    bert = LitBert()
    check_layers_compose_to_forward(bert, bert.pipeline_layers(), _bert_example())  # BertModel calls by keyword

    typed = _BertWithTokenTypes()
    with pytest.raises(
        ValueError, match=r"pipeline layer 0 \(`BertEmbeddings`.*argument `token_type_ids`: a NoneType against a Tensor"
    ):
        check_layers_compose_to_forward(typed, typed.pipeline_layers(), _bert_example())

    unmasked = _BertWithoutMask()
    with pytest.raises(ValueError, match=r"pipeline layer 1 \(`BertLayer`.*argument `attention_mask`: "):
        check_layers_compose_to_forward(unmasked, unmasked.pipeline_layers(), _bert_example())

    shifted = _KeywordShift()
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=r"argument `input`: largest absolute difference 1"):
        check_layers_compose_to_forward(shifted, [shifted.embedding, shifted.head], ((ids,), {}))


def test_a_peft_model_is_split_along_the_plan_of_the_model_it_wraps():
    module = LitLora()
    layers, call = pipeline_layers_and_call(module)
    inner = module.model.base_model.model
    assert call.target is inner  # the wrapper's forward runs and calls it; that call is answered
    assert len(layers) == 4  # prologue, 2 blocks, epilogue
    assert any("lora_A" in name for name, _ in layers[1].named_parameters())  # the adapters go with their blocks
    ids = dataset("lora").tensors[0][:BATCH]
    check_layers_compose_to_forward(module, layers, ((ids,), {}), reference=call.reference)
