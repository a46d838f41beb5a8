"""Unit tests (one process) for the shared demo model and data."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from training_helpers import cpu_trainer

from lightning_parallel.demos import (
    GPT,
    PRESETS,
    GPTConfig,
    GPTLightningModule,
    RandomTokenDataModule,
    RandomTokenDataset,
    TextDataModule,
    TokenChunkDataset,
    default_corpus_files,
    load_corpus,
    num_parameters,
)
from lightning_parallel.distributed.tensor_parallel import check_divisible, resolve_plan


def _tiny_model(seed: int = 0, **overrides: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("tiny", **overrides))


# --------------------------------------------------------------------------------------------------------------- model
def test_pipeline_layers_compose_to_forward() -> None:
    model = _tiny_model(n_layer=3).eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    x = idx
    layers = model.pipeline_layers()
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    assert x.shape == (2, 16, 256)
    assert len(layers) == 3 + 3
    # The layers are the model's own modules and together hold every parameter exactly once.
    layer_params = [p for layer in layers for p in layer.parameters()]
    assert {id(p) for p in layer_params} == {id(p) for p in model.parameters()}
    assert len(layer_params) == len(list(model.parameters()))


def test_init_is_deterministic_under_manual_seed() -> None:
    a, b, c = _tiny_model(0), _tiny_model(0), _tiny_model(1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert not torch.equal(a.head.weight, c.head.weight)
    # Residual projections are scaled down by 1/sqrt(2 * n_layer).
    assert a.blocks[0].attn.c_proj.weight.std() < a.blocks[0].attn.c_attn.weight.std()


def test_head_is_not_tied_and_is_causal() -> None:
    model = _tiny_model().eval()
    assert model.head.weight.data_ptr() != model.embedding.token.weight.data_ptr()
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    # Changing the last token must not change the logits of any earlier position.
    torch.testing.assert_close(model(idx)[:, :-1], model(changed)[:, :-1], rtol=0, atol=0)


def test_sequence_longer_than_block_size_raises() -> None:
    model = _tiny_model(block_size=8)
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_preset_parameter_counts() -> None:
    assert num_parameters("tiny") < 1_000_000
    assert 1_000_000 < num_parameters("small") < 10_000_000
    assert 85_000_000 < num_parameters("gpt-125m") < 125_000_000
    assert num_parameters("gpt-125m") < num_parameters("gpt-350m") < num_parameters("gpt-1.3b")
    # The helper agrees with a real model.
    assert num_parameters(GPTConfig.from_preset("tiny")) == _tiny_model().num_parameters()
    with torch.device("meta"):
        big = GPT(GPTConfig.from_preset("gpt-1.3b"))
    assert big.head.weight.is_meta
    assert big.config.vocab_size == 256


def test_from_preset_overrides() -> None:
    config = GPTConfig.from_preset("gpt-125m", vocab_size=50304, n_layer=2)
    assert (config.vocab_size, config.n_layer, config.n_embd, config.block_size) == (50304, 2, 768, 1024)
    assert GPTConfig() == GPTConfig.from_preset("tiny")


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="Unknown GPT preset 'huge'") as excinfo:
        GPTConfig.from_preset("huge")
    for name in PRESETS:
        assert repr(name) in str(excinfo.value)
    with pytest.raises(TypeError, match="n_layers"):
        GPTConfig.from_preset("tiny", n_layers=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_embd": 65, "n_head": 2}, "n_embd=65.*divisible by `n_head=2`"),
        ({"n_layer": 0}, "n_layer=0"),
        ({"vocab_size": -1}, "vocab_size=-1"),
        ({"block_size": 0}, "block_size=0"),
        ({"dropout": 1.0}, "dropout=1.0"),
    ],
)
def test_config_validation(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


# -------------------------------------------------------------------------------------------------------------- module
def test_module_hparams_optimizer_groups_and_predict() -> None:
    module = GPTLightningModule("tiny", n_layer=1, optimizer="sgd", learning_rate=0.1, weight_decay=0.01)
    assert module.config.n_layer == 1 and module.hparams.preset == "tiny"
    assert len(module.pipeline_layers()) == 1 + 3
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    assert isinstance(GPTLightningModule().configure_optimizers(), torch.optim.AdamW)
    inputs = torch.randint(0, 256, (2, 8))
    assert module.predict_step((inputs, inputs), 0).shape == (2, 8)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tensor_parallel_plan_names_the_blocks_layers_and_splits_every_preset_in_two(preset: str) -> None:
    with torch.device("meta"):
        module = GPTLightningModule(preset)
    plan = resolve_plan(module, owner="ShardedOptimizerStrategy")
    assert plan.source == "GPTLightningModule.tensor_parallel_plan()"
    layers = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert sorted(plan.styles) == sorted(
        f"model.blocks.{i}.{layer}" for i in range(module.config.n_layer) for layer in layers
    )
    check_divisible(module, plan, 2)  # no ValueError: every split dimension is even


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adam"}, "optimizer='adam'"),
        ({"learning_rate": 0.0}, "learning_rate=0.0"),
        ({"betas": (0.9, 1.5)}, "betas"),
        ({"n_head": 3}, "n_head=3"),
    ],
)
def test_module_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTLightningModule("tiny", **kwargs)


# ---------------------------------------------------------------------------------------------------------------- data
def test_default_corpus_is_the_stdlib() -> None:
    files = default_corpus_files()
    assert files == sorted(files) and len(files) > 50
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts or "tests" in f.parts for f in files)
    tokens = load_corpus(None, max_bytes=10_000)
    assert tokens.dtype == torch.long and tokens.shape == (10_000,)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256
    assert bytes(tokens[:100].tolist()) == files[0].read_bytes()[:100]


def test_load_corpus_from_file_directory_and_list(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("world")
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")  # binary: skipped in directories
    (tmp_path / ".hidden").write_text("secret")
    assert bytes(load_corpus(tmp_path).tolist()) == b"hello world"
    assert bytes(load_corpus(str(tmp_path / "b.txt")).tolist()) == b"world"
    assert bytes(load_corpus([tmp_path / "b.txt", tmp_path / "a.txt"], max_bytes=7).tolist()) == b"worldhe"


def test_load_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt.*is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=r"sub.*no text files"):
        load_corpus(tmp_path / "sub")
    with pytest.raises(ValueError, match="max_bytes=0"):
        load_corpus(None, max_bytes=0)


def test_token_chunk_dataset() -> None:
    dataset = TokenChunkDataset(torch.arange(23), seq_len=4)
    assert len(dataset) == 4  # 23 // 5, the remainder is dropped
    x, y = dataset[1]
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 31"):
        TokenChunkDataset(torch.arange(10), seq_len=30)


def test_random_token_dataset_is_deterministic() -> None:
    a, b = RandomTokenDataset(8, 16, seed=3), RandomTokenDataset(8, 16, seed=3)
    c = RandomTokenDataset(8, 16, seed=4)
    assert len(a) == 8
    torch.testing.assert_close(a.data, b.data, rtol=0, atol=0)
    assert not torch.equal(a.data, c.data)
    x, y = a[0]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert int(RandomTokenDataset(4, 8, vocab_size=5).data.max()) < 5

    datamodule = RandomTokenDataModule(10, seq_len=8, batch_size=4)
    assert len(datamodule.train_dataloader()) == 2  # drop_last
    torch.testing.assert_close(next(iter(datamodule.train_dataloader())), next(iter(datamodule.train_dataloader())))


def _split_indices(datamodule: TextDataModule, name: str) -> list[int]:
    return list(datamodule.split(name).indices)


def test_text_datamodule_splits_are_deterministic(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 20)  # 5120 bytes -> 5120 // 17 = 301 chunks

    def make(seed: int) -> TextDataModule:
        datamodule = TextDataModule(str(corpus), seq_len=16, batch_size=4, val_fraction=0.1, seed=seed)
        datamodule.setup("fit")
        return datamodule

    a, b, c = make(0), make(0), make(1)
    for name in ("train", "val", "test"):
        assert _split_indices(a, name) == _split_indices(b, name)
    assert _split_indices(a, "val") != _split_indices(c, "val")
    sizes = [len(_split_indices(a, name)) for name in ("train", "val", "test")]
    assert sizes == [256, 30, 15]
    all_indices = [i for name in ("train", "val", "test") for i in _split_indices(a, name)]
    assert sorted(all_indices) == list(range(301))
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    torch.testing.assert_close(next(iter(a.train_dataloader())), next(iter(b.train_dataloader())))


def test_text_datamodule_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"val_fraction=0\.6"):
        TextDataModule(val_fraction=0.6, test_fraction=0.5)
    with pytest.raises(ValueError, match="batch_size=0"):
        TextDataModule(batch_size=0)
    with pytest.raises(ValueError, match="max_bytes=-1"):
        TextDataModule(max_bytes=-1)
    with pytest.raises(RuntimeError, match="setup"):
        TextDataModule().train_dataloader()
    small = tmp_path / "small.txt"
    small.write_text("x" * 50)  # 5 chunks of 9 bytes: 3 for training
    with pytest.raises(ValueError, match="fewer than `batch_size=8`"):
        TextDataModule(str(small), seq_len=8).setup("fit")


# ------------------------------------------------------------------------------------------------------------- trainer
def test_fit_and_validate_tiny_model() -> None:
    pl.seed_everything(0, verbose=False)
    module = GPTLightningModule("tiny", learning_rate=3e-3)
    datamodule = TextDataModule(max_bytes=200_000, seq_len=64, batch_size=8)
    trainer = cpu_trainer(
        devices=1,
        max_steps=3,
        limit_val_batches=2,
    )
    (before,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule)
    (after,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    for key in ("val_loss", "val_perplexity", "val_accuracy"):
        assert key in trainer.callback_metrics
        assert math.isfinite(after[key])
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    assert after["val_loss"] < before["val_loss"]
    # Perplexity is exp of the mean token cross-entropy; both average over the same tokens here.
    assert after["val_perplexity"] == pytest.approx(math.exp(after["val_loss"]), rel=1e-4)
    assert 0.0 <= after["val_accuracy"] <= 1.0
    assert isinstance(module.model.blocks, nn.ModuleList)
