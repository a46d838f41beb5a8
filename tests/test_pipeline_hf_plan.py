"""Hugging Face models under PipelineParallelStrategy with nothing to write (issue 21).

A LightningModule that holds a transformers model declaring ``base_model_pp_plan`` (Llama, Qwen2, ...) and defines
no ``pipeline_layers()`` trains with its ``training_step`` written as HF users write it
(``self.model(input_ids=ids, attention_mask=mask, labels=labels).loss``). Real gloo ranks, real Trainers, tiny random
configs (no downloads), against one device with ``accumulate_grad_batches`` = micro-batches on the same samples in
the same order (each micro-batch's loss is its own token mean, as in an accumulation window):

* Llama (grouped-query attention, untied) under every schedule; Gemma2 (embedding scaling and logit soft-capping
  in its ``forward``, a sliding-window mask for some layers: each stage recomputes what ``forward`` does); Qwen2
  with tied embeddings and a left-padding mask (a side input; every stage rebuilds the causal mask from it) with
  AdamW and clipping, moments included; validation from ``.logits``; the consolidated checkpoint loads with
  ``load_from_checkpoint`` and round-trips through ``save_pretrained`` / ``from_pretrained``;
* 2 x 2 data x pipeline parallelism with ZeRO-1 and ZeRO-2 inside the pipeline;
* crash #1: an adapter layer registered in the module that holds GPT-2's own modules (reachable under two names);
* refusals: no ``pipeline_layers()`` and no plan, a head without a plan, ``inputs_embeds``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
import torch.nn.functional as F
from distributed_harness import run_distributed
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from training_helpers import assert_weights_close
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lightning_parallel import PipelineParallelStrategy

VOCAB, SEQ, BATCH, STEPS, MICRO = 64, 16, 8, 3, 2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
ADAM_TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def _config(kind: str) -> Any:
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    if kind == "llama":
        return LlamaConfig(**common, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen2":
        return Qwen2Config(
            **common, num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True
        )
    if kind == "gemma2":  # embedding scaling, per-layer sliding-window masks, logit soft-capping in its forward
        return Gemma2Config(
            **common,
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            final_logit_softcapping=3.0,
            max_position_embeddings=64,
        )
    raise ValueError(kind)


class LitCausalLM(pl.LightningModule):
    """A LightningModule as HF users write one: the model, its own loss, no pipeline code."""

    def __init__(self, kind: str = "llama", optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "gemma2": Gemma2ForCausalLM}[kind](
            _config(kind)
        )
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, mask = batch
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        self.log("val_loss", F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _dataset(padded: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    if padded:  # left padding of different lengths (only a mask hides it from the causal attention); micro-batches
        lengths = torch.randint(SEQ // 2, SEQ + 1, (len(ids),), generator=generator)  # hold different token counts
        mask = (torch.arange(SEQ) >= SEQ - lengths[:, None]).long()
    return TensorDataset(ids, mask)


def _loader(padded: bool, *, batch_size: int = BATCH, replicas: int = 1, replica: int = 0) -> DataLoader:
    """Step k's global batch is samples ``[k*B, (k+1)*B)``, replica r's slice of it; no shuffling."""
    per_replica = BATCH // replicas
    indices = [k * BATCH + replica * per_replica + i for k in range(STEPS) for i in range(per_replica)]
    return DataLoader(Subset(_dataset(padded), indices), batch_size=batch_size // replicas, shuffle=False)


def _trainer(strategy: Any, devices: int, **kwargs: Any) -> pl.Trainer:
    return zoo.trainer(strategy, devices, max_steps=STEPS, gradient_clip_val=1.0, **kwargs)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _adam_state(trainer: pl.Trainer, module: nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = trainer.optimizers[0]
    return {
        f"{names[id(p)]}.{key}": value.detach().clone()
        for group in optimizer.param_groups
        for p in group["params"]
        for key, value in optimizer.state[p].items()
        if key != "step"
    }


class _LlamaDeclaringItsInputs(LitCausalLM):
    """Says what its step passes to `self.model(...)`, so the pipeline never runs the step to learn it."""

    def pipeline_inputs(self, batch: Any) -> dict[str, torch.Tensor]:
        ids, mask = batch
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _reference(make: Any, padded: bool, *, adam: bool = False) -> dict[str, Any]:
    """One device, ``accumulate_grad_batches`` = micro-batches, the same samples in the same order."""
    pl.seed_everything(0, verbose=False)
    module = make()
    trainer = _trainer("auto", 1, accumulate_grad_batches=MICRO)
    trainer.fit(module, _loader(padded, batch_size=BATCH // MICRO))
    result = {"weights": _state(module)}
    if adam:
        result["adam"] = _adam_state(trainer, module)
    return result


def _references(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "llama": _reference(LitCausalLM, False),
        "qwen2": _reference(lambda: LitCausalLM("qwen2", "adamw"), True, adam=True),
        "gpt2": _reference(GPT2WithAdapter, False),
        "gemma2": _reference(lambda: LitCausalLM("gemma2"), True),
    }


# ------------------------------------------------------------------------------------------------- 2 ranks
def _pipeline(**kwargs: Any) -> PipelineParallelStrategy:
    return PipelineParallelStrategy(num_microbatches=MICRO, timeout=120, **kwargs)


def _fit(make: Any, strategy: PipelineParallelStrategy, world_size: int, padded: bool, **kwargs: Any) -> Any:
    pl.seed_everything(0, verbose=False)
    module = make()
    trainer = _trainer(strategy, world_size, **kwargs)
    sampler = strategy.distributed_sampler_kwargs
    trainer.fit(module, _loader(padded, replicas=sampler["num_replicas"], replica=sampler["rank"]))
    return module, trainer


def _two_ranks(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for schedule in SCHEDULES:
        strategy = _pipeline(schedule=schedule)
        module, _ = _fit(LitCausalLM, strategy, world_size, False)
        result[f"llama_{schedule}"] = _state(module)
        result[f"llama_{schedule}_starts"] = strategy.stage_plan.starts
        result["llama_layers"] = strategy.stage_plan.num_layers
    strategy = _pipeline(partition="measured")  # layers timed on copies: the copies share the one model
    module, _ = _fit(LitCausalLM, strategy, world_size, False)
    result["llama_measured"] = _state(module)
    module, _ = _fit(_LlamaDeclaringItsInputs, _pipeline(), world_size, False)
    result["llama_declaring_inputs"] = _state(module)
    strategy = _pipeline()
    module, trainer = _fit(lambda: LitCausalLM("qwen2", "adamw"), strategy, world_size, True)
    result["qwen2"] = _state(module)
    result["qwen2_tied"] = module.model.lm_head.weight is module.model.model.embed_tokens.weight
    result["qwen2_copied"] = strategy.tied_layout.copied
    trainer.save_checkpoint(checkpoint)
    (metrics,) = trainer.validate(module, _loader(True), verbose=False)
    result["val_loss"] = metrics["val_loss"]
    module, _ = _fit(lambda: LitCausalLM("gemma2"), _pipeline(), world_size, True)
    result["gemma2"] = _state(module)
    module, _ = _fit(GPT2WithAdapter, _pipeline(), world_size, False)
    result["gpt2"] = _state(module)
    result["gpt2_tied"] = module.model.lm_head.weight is module.model.transformer.wte.weight
    return result


def test_declared_plan_models_train_like_one_device_with_every_schedule(tmp_path):
    (references,) = run_distributed(_references, 1, init_process_group=False, timeout=180)
    checkpoint = tmp_path / "qwen2.ckpt"
    results = run_distributed(_two_ranks, 2, args=(str(checkpoint),), init_process_group=False, timeout=300)
    for result in results:  # every rank holds the whole trained model again after `fit`
        assert result["llama_layers"] == 1 + 4 + 1  # prologue, 4 decoder layers, epilogue (norm, lm_head)
        for schedule in SCHEDULES:
            assert_weights_close(result[f"llama_{schedule}"], references["llama"]["weights"], **TOLERANCE)
        assert len(result["llama_Interleaved1F1B_starts"]) == 4  # 2 virtual stages per rank
        assert_weights_close(result["llama_measured"], references["llama"]["weights"], **TOLERANCE)
        assert_weights_close(result["llama_declaring_inputs"], references["llama"]["weights"], **TOLERANCE)
        assert_weights_close(result["qwen2"], references["qwen2"]["weights"], **ADAM_TOLERANCE)
        assert result["qwen2_tied"] and result["qwen2_copied"] == {"model.model.embed_tokens.weight": (0, 1)}
        assert_weights_close(result["gpt2"], references["gpt2"]["weights"], **TOLERANCE)
        assert_weights_close(result["gemma2"], references["gemma2"]["weights"], **TOLERANCE)
        assert result["gpt2_tied"]

    # The consolidated checkpoint is single-device Lightning's: the module's own names, AdamW's moments equal.
    saved = torch.load(checkpoint, weights_only=True)
    expected_moments = references["qwen2"]["adam"]
    names = list(LitCausalLM("qwen2").state_dict())
    moments = {
        f"{names_by_index}.{key}": value
        for index, names_by_index in enumerate(_parameter_names(LitCausalLM("qwen2")))
        for key, value in saved["optimizer_states"][0]["state"][index].items()
        if key != "step"
    }
    assert set(saved["state_dict"]) == set(names)
    assert_weights_close(moments, expected_moments, **ADAM_TOLERANCE)
    restored = LitCausalLM.load_from_checkpoint(checkpoint)
    assert_weights_close(_state(restored), references["qwen2"]["weights"], **ADAM_TOLERANCE)
    restored.model.save_pretrained(tmp_path / "hf")
    again = Qwen2ForCausalLM.from_pretrained(tmp_path / "hf")
    assert_weights_close(_state(again), _state(restored.model), rtol=0, atol=0)
    assert again.lm_head.weight is again.model.embed_tokens.weight

    # Validation from `.logits` on the pipeline equals the trained model's on one device.
    with torch.no_grad():
        losses = [
            F.cross_entropy(
                restored.model(input_ids=ids, attention_mask=mask).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
            )
            for ids, mask in _loader(True)
        ]
    for result in results:
        torch.testing.assert_close(result["val_loss"], float(torch.stack(losses).mean()), rtol=1e-4, atol=1e-5)


def _parameter_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters()]


# ------------------------------------------------------------------------------------------------- 2 x 2
def _data_x_pipeline(rank: int, world_size: int) -> dict[str, Any]:
    result = {}
    for zero_stage in (1, 2):
        strategy = _pipeline(pipeline_parallel_size=2, zero_stage=zero_stage)
        module, _ = _fit(LitCausalLM, strategy, world_size, False)
        result[zero_stage] = _state(module)
    return result


def _reference_2x2(rank: int, world_size: int) -> dict[str, Any]:
    # Two replicas of micro-batches of BATCH / 2 / MICRO samples each: one device accumulates 2 x MICRO of them.
    pl.seed_everything(0, verbose=False)
    module = LitCausalLM()
    trainer = _trainer("auto", 1, accumulate_grad_batches=2 * MICRO)
    trainer.fit(module, _loader(False, batch_size=BATCH // (2 * MICRO)))
    return _state(module)


def test_declared_plan_with_data_parallel_replicas_and_zero_inside_the_pipeline():
    (reference,) = run_distributed(_reference_2x2, 1, init_process_group=False, timeout=120)
    results = run_distributed(_data_x_pipeline, 4, init_process_group=False, timeout=300)
    for result in results:
        for zero_stage in (1, 2):
            assert_weights_close(result[zero_stage], reference, **TOLERANCE)


# ------------------------------------------------------------------------------------------------- crash #1
class _GPT2Embeddings(nn.Module):
    """GPT-2 has no module that adds ``wpe`` to ``wte``: an adapter holding GPT-2's own modules."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))


class _GPT2Head(nn.Module):
    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class GPT2WithAdapter(pl.LightningModule):
    """The adapters are registered in the module, so GPT-2's ``wte``/``wpe``/``ln_f``/``lm_head`` have two names
    (crash #1: rank 1 failed with "Cannot copy out of meta tensor")."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0)
        config.embd_pdrop = config.attn_pdrop = 0.0
        self.model = GPT2LMHeadModel(config)
        self.embeddings, self.head = _GPT2Embeddings(self.model.transformer), _GPT2Head(self.model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(ids)
        for block in self.model.transformer.h:
            hidden = block(hidden)
        return self.head(hidden)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embeddings, *self.model.transformer.h, self.head]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        logits = self(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


# ------------------------------------------------------------------------------------------------- refusals
class _NoPlan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = _config("llama")
        config.pad_token_id = 0
        self.model = LlamaForSequenceClassification(config)


class _EmbedsStep(LitCausalLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self.model(inputs_embeds=self.model.model.embed_tokens(ids), labels=ids).loss


class _HiddenStatesStep(LitCausalLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self.model(input_ids=ids, labels=ids, output_hidden_states=True).loss


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    def error(make: Any) -> str:
        try:
            _fit(make, _pipeline(), world_size, False)
        except Exception as caught:
            return f"{type(caught).__name__}: {caught}"
        return "no error"

    return {
        "no_plan": error(_NoPlan),
        "head": error(_Classifier),
        "embeds": error(_EmbedsStep),
        "hidden_states": error(_HiddenStatesStep),
    }


def test_refusals_name_the_problem_and_the_fix_on_every_rank():
    for result in run_distributed(_refusals, 2, init_process_group=False, timeout=180):
        assert result["no_plan"].startswith("TypeError: `_NoPlan` has no `pipeline_layers()` method and holds no")
        assert "base_model_pp_plan" in result["no_plan"]
        assert result["head"].startswith("ValueError: `LlamaForSequenceClassification` declares a pipeline plan")
        assert "pipeline_layers()" in result["head"]
        assert result["embeds"].startswith("ValueError: The step called `LlamaForCausalLM` with `inputs_embeds`")
        assert result["hidden_states"].startswith(
            "ValueError: The step called `LlamaForCausalLM` with `output_hidden_states=True`"
        )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_declared_plan_layers_compose_to_the_models_forward(kind):
    # One process: the layers made from the plan, chained, give the model's own logits (a padding mask included).
    from lightning_parallel.distributed.pipeline.layer_costs import layer_compute_costs
    from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call
    from lightning_parallel.distributed.pipeline.verify import check_layers_compose_to_forward

    torch.manual_seed(0)
    module = LitCausalLM(kind)
    layers, call = pipeline_layers_and_call(module)
    ids, mask = next(iter(_loader(True)))
    example = call.model_inputs((), {"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert set(example[1]) == {"attention_mask"}  # labels stay on the last stage
    check_layers_compose_to_forward(module, layers, example, reference=call.reference)
    # partition="compute" counts every layer (raises if one cannot be counted): no fallback to parameter counts.
    costs = layer_compute_costs(layers, *example)
    blocks = costs[1:-1]
    assert len(set(blocks)) == 1 and blocks[0] > costs[0]  # equal blocks; the embedding is a lookup


# ------------------------------------------------------------------------------------------------- launched
@pytest.mark.slow
def test_the_huggingface_example_under_torchrun_saves_and_exports(tmp_path):
    # As a user launches it: two processes from torchrun, a Qwen2 split by its plan; the checkpoint and the
    # `save_pretrained` export hold the same trained weights under HF's names.
    import subprocess
    import sys

    from distributed_harness import find_free_port
    from launch_helpers import EXAMPLES, ROOT, clean_environment
    from transformers import AutoModelForCausalLM

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}", str(EXAMPLES / "pipeline_huggingface.py"), "--arch", "qwen2",
        "--max-steps", "3", "--save", str(tmp_path / "model.ckpt"), "--export", str(tmp_path / "hf"),
    ]  # fmt: skip
    completed = subprocess.run(
        command, cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=240, check=False
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "split starts=(0, " in output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    saved = torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"]
    assert saved["model.model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    trained = {f"model.{name}": tensor for name, tensor in exported.state_dict().items()}
    assert_weights_close({k: saved[k] for k in trained}, trained, rtol=0, atol=0)
