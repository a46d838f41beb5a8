"""The planner on Hugging Face transformers configs: a config object or a local config.json plans exactly the model
transformers builds from it (parameter names, shapes, ties, FSDP2 units, hence every byte of data parallel and ZeRO),
the CLI takes the file, bad paths and Hub names are refused, and a real fit of a tied transformers Llama under
data_parallel, zero2, zero3 and a 2-stage pipeline holds and sends exactly the bytes the planner predicts from the
config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from distributed_harness import run_distributed
from torch import Tensor
from torch.utils.data import DataLoader
from training_helpers import assert_monitor_equals_plan, make_trainer

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.demos import RandomTokenDataset
from lightning_parallel.monitor import ParallelismMonitor
from lightning_parallel.planner import largest_fitting, main, plan
from lightning_parallel.planner.hf import SUPPORTED_MODEL_TYPES, HFConfigError
from lightning_parallel.planner.spec import model_spec

transformers = pytest.importorskip("transformers")

NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # tiny vocabularies


def _llama(**changes: Any) -> Any:
    options = dict(
        vocab_size=101, hidden_size=32, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return transformers.LlamaConfig(**{**options, **changes})


def _small(config_class: str, **options: Any) -> Any:
    base = dict(
        vocab_size=101, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return getattr(transformers, config_class)(**{**base, **options})


CONFIGS = {
    # GPT-2: learned positions (n_positions rows), LayerNorm biases, Conv1D weights (in, out), tied head.
    "gpt2_tied": lambda: transformers.GPT2Config(
        vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=48, **NO_SPECIAL_TOKENS
    ),
    "gpt2_untied_n_inner": lambda: transformers.GPT2Config(
        vocab_size=101,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=48,
        n_inner=40,
        tie_word_embeddings=False,
        **NO_SPECIAL_TOKENS,
    ),
    "llama_untied_gqa": lambda: _llama(),
    "llama_tied": lambda: _llama(tie_word_embeddings=True, num_key_value_heads=4),
    "llama_biases": lambda: _llama(attention_bias=True, mlp_bias=True),
    "qwen2_qkv_biases": lambda: _small("Qwen2Config", num_key_value_heads=2),
    "qwen3_qk_norm": lambda: _small("Qwen3Config", num_key_value_heads=2, head_dim=16),
    "mistral_head_dim": lambda: _small("MistralConfig", num_key_value_heads=1, head_dim=12),
    "gemma_tied": lambda: _small("GemmaConfig", num_key_value_heads=2, head_dim=8),
}


def _real(config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _held(result: Any, name: str) -> list[tuple[int, int, int, dict[str, int]]]:
    config = result.configuration(name)
    return [(r.parameters, r.gradients, r.optimizer_state, r.communication) for r in config.ranks]


# ---------------------------------------------------------------------------------------------- the layout
@pytest.mark.parametrize("case", list(CONFIGS))
def test_parameters_equal_the_transformers_model(case: str) -> None:
    config = CONFIGS[case]()
    real = _real(config)
    spec = model_spec(config)
    assert spec.num_parameters == sum(p.numel() for p in set(real.parameters()))
    # Names, shapes and order (ZeRO-1/2 buckets follow reverse registration order; FSDP2 shards dim 0).
    assert [(p.name, p.shape) for p in spec.params] == [(n, tuple(p.shape)) for n, p in real.named_parameters()]
    from_module = model_spec(real)
    assert spec.units == from_module.units  # FSDP2 units as ShardedOptimizerStrategy(stage=3) applies them
    # Hence every byte held and sent by data parallel and ZeRO, with padding (world size 4, odd counts).
    planned, measured = plan(config, world_size=4), plan(real, world_size=4)
    for name in ("data_parallel", "zero1", "zero2", "zero3"):
        assert _held(planned, name) == _held(measured, name), name


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_a_config_json_with_only_its_model_type_means_the_class_defaults(model_type: str, tmp_path: Path) -> None:
    """A key the file leaves out takes the config class's default, as transformers reads it (full-size models, on
    meta)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    config = transformers.AutoConfig.for_model(model_type)
    with torch.device("meta"):
        real = transformers.AutoModelForCausalLM.from_config(config)
    spec = model_spec(tmp_path)
    assert [(p.name, p.shape) for p in spec.params] == [(n, tuple(p.shape)) for n, p in real.named_parameters()]
    assert spec.shape is not None
    assert spec.shape.max_seq_len == config.max_position_embeddings


def test_llama_2_7b_has_its_published_parameter_count() -> None:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008)
    assert model_spec(config).num_parameters == 6_738_415_616


# ---------------------------------------------------------------------------------------------- inputs
def test_config_object_and_saved_config_json_give_the_same_plan(tmp_path: Path) -> None:
    config = _llama(tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    expected = plan(config, world_size=4, batch_size=4)
    assert expected.seq_len == 64  # max_position_embeddings
    contents = json.loads((tmp_path / "config.json").read_text())
    for source in (tmp_path / "config.json", str(tmp_path / "config.json"), tmp_path, str(tmp_path), contents):
        result = plan(source, world_size=4, batch_size=4)
        assert result.configurations == expected.configurations, source
        assert (result.num_parameters, result.seq_len) == (expected.num_parameters, expected.seq_len)


def test_pipeline_layers_are_embedding_each_layer_and_norm_with_head() -> None:
    """The split PipelineParallelStrategy makes of the model by its declared plan: the embedding, each decoder layer,
    then the final norm and the head in one layer (distributed/pipeline/model_plan.py)."""
    config = _llama(tie_word_embeddings=True, num_hidden_layers=4)
    spec = model_spec(config)
    h, v = config.hidden_size, config.vocab_size
    real = _real(config)
    layer = sum(p.numel() for p in real.model.layers[0].parameters())
    # The tied weight belongs to the first and the last layer (each stage that uses it keeps a copy).
    assert spec.layer_numels() == [v * h, *[layer] * 4, h + v * h]
    assert spec.layer_output_numels(2, 8) == [2 * 8 * h] * 5 + [2 * 8 * v]
    result = plan(config, world_size=4, batch_size=4, seq_len=8)
    names = [c.name for c in result.configurations]
    assert "pipeline pp=2, dp=2" in names and "pipeline pp=4, dp=1" in names
    pp4 = result.configuration("pipeline pp=4, dp=1")
    assert sum(r.parameters for r in pp4.ranks) == 4 * (spec.num_parameters + v * h)  # the head's copy
    # Stage boundaries send the hidden states (B, T, h) forward and their gradient back; the first and the last
    # rank sum their copies' gradients (one flag element with them).
    assert pp4.ranks[1].communication == {"send": 2 * 4 * 8 * h * 4, "recv": 2 * 4 * 8 * h * 4}
    tied = (v * h + 1) * 4
    assert pp4.ranks[0].communication["all_reduce"] == pp4.ranks[3].communication["all_reduce"] == tied
    # On the wire: an all-reduce over those 2 ranks (not over the data-parallel group of 1).
    assert pp4.wire_bytes(4) == 2 * (4 * 8 * h * 4) + tied
    gpt2 = model_spec(CONFIGS["gpt2_tied"]())
    assert len(gpt2.layer_numels()) == 1 + 2 + 1 and gpt2.layer_numels()[0] == (101 + 48) * 32  # wte + wpe


def test_seq_len_defaults_to_the_config_capped_at_4096() -> None:
    gpt2 = plan(CONFIGS["gpt2_tied"](), world_size=2)
    assert gpt2.seq_len == 48  # n_positions
    mistral = plan(_small("MistralConfig", num_key_value_heads=2, max_position_embeddings=131072), world_size=2)
    assert mistral.seq_len == 4096
    assert "seq_len defaults to 4096 tokens" in str(mistral)
    assert (
        plan(
            _small("MistralConfig", num_key_value_heads=2, max_position_embeddings=131072), world_size=2, seq_len=512
        ).seq_len
        == 512
    )


def test_cli_plans_a_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _llama().save_pretrained(tmp_path)
    assert main([str(tmp_path / "config.json"), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"Model LlamaForCausalLM ({tmp_path / 'config.json'})" in out
    assert "| zero3 |" in out and "| pipeline pp=2, dp=2 |" in out and "Recommended:" in out
    assert main([str(tmp_path), "--world-size", "2", "--seq-len", "16"]) == 0
    assert "batch 8 x 16 tokens" in capsys.readouterr().out


def test_largest_fitting_scales_a_transformers_config_in_its_layers(tmp_path: Path) -> None:
    """Qwen2 derives `layer_types` from its layer count; scaled as config.json keys, nothing else has to agree."""
    config = _small("Qwen2Config", num_key_value_heads=2, num_hidden_layers=4)
    options = {"world_size": 2, "batch_size": 2, "seq_len": 16}

    def total(layers: int, name: str) -> int:
        scaled = _small("Qwen2Config", num_key_value_heads=2, num_hidden_layers=layers)
        return plan(scaled, **options).configuration(name).max_total

    memory = total(6, "zero2")
    config.save_pretrained(tmp_path)
    for source in (config, tmp_path):
        answers = {a.configuration: a for a in largest_fitting(source, device_memory=memory, max_value=12, **options)}
        assert answers["zero2"].value == 6 and answers["zero2"].total_bytes == memory
        assert total(answers["data_parallel"].value + 1, "data_parallel") > memory
    with pytest.raises(TypeError, match="scale_field='hidden_act'"):
        largest_fitting(config, device_memory=memory, scale_field="hidden_act", **options)


# ---------------------------------------------------------------------------------------------- errors
def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BAD_INPUTS = {
    "hub name": (lambda tmp: "meta-llama/Llama-2-7b-hf", "reads only local files and never downloads"),
    "missing file": (lambda tmp: str(tmp / "nowhere" / "config.json"), "No such file or directory"),
    "directory without config": (lambda tmp: tmp, "holds no `config.json`"),
    "not json": (lambda tmp: _write(tmp / "config.json", "model_type: llama"), "is not a JSON config file"),
    "no model_type": (lambda tmp: _write(tmp / "config.json", '{"hidden_size": 8}'), "has no `model_type`"),
    "unknown architecture": (
        lambda tmp: _write(tmp / "config.json", '{"model_type": "mixtral"}'),
        r"does not know the parameter layout of `model_type='mixtral'`.*AutoModelForCausalLM.from_config",
    ),
    "bad value": (
        lambda tmp: _write(tmp / "config.json", '{"model_type": "llama", "hidden_size": "big"}'),
        "`hidden_size='big'` in .* must be a positive integer",
    ),
    "heads do not divide": (
        lambda tmp: {"model_type": "qwen2", "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 4},
        "`num_attention_heads=6` in config mapping is not a multiple of `num_key_value_heads=4`",
    ),
    "unknown config object": (lambda tmp: transformers.BertConfig(), "`model_type='bert'` \\(BertConfig\\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_configs_are_refused_with_the_fix(case: str, tmp_path: Path) -> None:
    make, message = BAD_INPUTS[case]
    with pytest.raises(HFConfigError, match=message):
        plan(make(tmp_path), world_size=2)


def test_cli_refuses_a_hub_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["meta-llama/Llama-2-7b-hf", "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face Hub name" in err and "save_pretrained" in err


@pytest.mark.slow
def test_reading_a_config_json_needs_no_transformers(tmp_path: Path) -> None:
    """A fresh interpreter where importing transformers fails plans a config.json (Lightning is imported first:
    torchmetrics imports transformers when it is installed, which is not the library's doing)."""
    config = CONFIGS["qwen2_qkv_biases"]()
    config.save_pretrained(tmp_path)
    expected = model_spec(config).num_parameters
    script = (
        "import sys, lightning.pytorch\n"
        "for name in [n for n in sys.modules if n == 'transformers' or n.startswith('transformers.')]:\n"
        "    del sys.modules[name]\n"
        "sys.modules['transformers'] = None  # any `import transformers` from here on raises ImportError\n"
        "from lightning_parallel.planner import plan\n"
        f"print(plan({str(tmp_path)!r}, world_size=2).num_parameters)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) == expected


# ---------------------------------------------------------------------------------------------- against a real fit
BATCH, SEQ, STEPS = 4, 16, 2
FIT_CONFIG = {  # tied, grouped-query attention, an odd parameter count (ZeRO-1/2 and FSDP2 pad at world size 2)
    "vocab_size": 99, "hidden_size": 30, "intermediate_size": 52, "num_hidden_layers": 2, "num_attention_heads": 3,
    "num_key_value_heads": 1, "max_position_embeddings": SEQ, "tie_word_embeddings": True, **NO_SPECIAL_TOKENS,
}  # fmt: skip


class CausalLMModule(pl.LightningModule):
    """A transformers causal LM as a user trains it: ``self.model``, next-token cross-entropy, AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**FIT_CONFIG))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


STRATEGIES = {  # case: (Trainer strategy, the planner's configuration at world size 2)
    "data_parallel": (lambda: "data_parallel_notebook", "data_parallel"),
    "zero2": (lambda: "zero2_notebook", "zero2"),
    "zero3": (lambda: "zero3_notebook", "zero3"),
    # The model's declared plan (base_model_pp_plan): nothing written, split by the same partitioner.
    "pipeline": (
        lambda: PipelineParallelStrategy(pipeline_parallel_size=2, start_method="fork"),
        "pipeline pp=2, dp=1",
    ),
}


def _measure(rank: int, world_size: int, case: str, devices: int) -> dict:
    """In an isolated process: fit with the monitor on `devices` fork-launched ranks, return its JSON summary."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        monitor = ParallelismMonitor(summary_path=Path(tmp, "summary.json"), figure_path=False)
        trainer = make_trainer(STRATEGIES[case][0](), devices=devices, max_steps=STEPS, callbacks=[monitor])
        loader = DataLoader(RandomTokenDataset(32, SEQ, vocab_size=FIT_CONFIG["vocab_size"], seed=3), batch_size=BATCH)
        trainer.fit(CausalLMModule(), train_dataloaders=loader)
        return json.loads(Path(tmp, "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STRATEGIES))
def test_planner_from_config_equals_monitor_of_a_transformers_fit(case: str) -> None:
    world_size = 2
    (summary,) = run_distributed(
        _measure, world_size=1, args=(case, world_size), init_process_group=False, launcher_env=False, timeout=240
    )
    predicted = plan(
        transformers.LlamaConfig(**FIT_CONFIG),
        world_size=world_size,
        batch_size=BATCH,
        process_group_backend="gloo",  # measured on gloo, where ZeRO-1/2 all-reduce their buckets
    ).configuration(STRATEGIES[case][1])
    assert len(summary["ranks"]) == world_size == len(predicted.ranks)
    # Under the pipeline the first rank's batch, (inputs, targets) of int64 tokens, goes to the other rank.
    batch_broadcast = 2 * BATCH * SEQ * 8 if case == "pipeline" else None
    assert_monitor_equals_plan(summary["ranks"], predicted.ranks, batch_broadcast=batch_broadcast)
