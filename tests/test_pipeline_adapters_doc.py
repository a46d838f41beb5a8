"""docs/pipeline.md "Wrapping an existing model" is true: its code blocks, run as written, train like one device.

The section's ``<!-- run: adapters -->`` blocks are executed into one namespace (as ``tests/test_migrating.py`` runs
docs/migrating.md's), then their modules are fitted in 2 forked ranks (real gloo, real Trainers, the default
``partition="compute"`` and 1F1B with 2 micro-batches) and on one device on the same samples in the same order
(Lightning's shuffling ``DistributedSampler`` made explicit, ``accumulate_grad_batches=2`` with half batches):

* ``LitGPT2``: a tiny random ``GPT2LMHeadModel`` (tied ``wte`` / ``lm_head``) on right-padded batches, the padding
  mask a side input; after ``fit`` the tie holds on every rank, and the consolidated checkpoint, without its
  ``model.`` prefix, loads strictly into a plain ``GPT2LMHeadModel`` equal to the one-device model.
* ``LitTransformer``: Lightning's demo ``Transformer`` (tiny, no dropout), cut after its encoder by the compute split.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from distributed_harness import run_distributed
from lightning.pytorch.demos.transformer import Transformer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from training_helpers import assert_weights_close, make_trainer
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_parallel import PipelineParallelStrategy

DOC = Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"
SECTION = "## Wrapping an existing model"
_BLOCK = re.compile(r"<!-- run: adapters -->\n```python\n(.*?)```", re.DOTALL)
SEED, VOCAB, SEQ, SAMPLES, BATCH, MICRO, STEPS = 7, 64, 16, 24, 4, 2, 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@functools.cache
def adapters() -> dict[str, Any]:
    """The namespace the section's blocks define (run once; forked ranks inherit it)."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end >= 0 else len(text)]
    blocks = _BLOCK.findall(section)
    # Every block of the section runs: these here, the timm one in tests/test_pipeline_refused_models.py.
    assert len(blocks) == section.count("```python") - section.count("<!-- run: timm -->") == 2
    namespace: dict[str, Any] = {"__name__": "pipeline_doc_adapters"}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


def gpt2_config() -> GPT2Config:
    return GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def make_gpt2() -> Any:
    return adapters()["LitGPT2"](gpt2_config())


def make_transformer() -> Any:
    """The doc's ``LitTransformer`` with a tiny demo ``Transformer`` without dropout and without the demo's
    WikiText-2 download in ``prepare_data``."""
    module = adapters()["LitTransformer"](vocab_size=VOCAB)
    module.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)
    module.prepare_data = lambda: None
    return module


def dataset(kind: str) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (SAMPLES, SEQ + 1), generator=generator)
    if kind == "transformer":
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    lengths = torch.randint(SEQ // 2, SEQ + 1, (SAMPLES,), generator=generator)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()  # right padding: every query sees itself
    return TensorDataset(tokens[:, :-1] * mask, mask)


def loader(kind: str, *, single_device: bool) -> DataLoader:
    """The pipeline's loader (Lightning puts its shuffling DistributedSampler in), or one device's: that sampler made
    explicit, with micro-batch-sized batches (accumulated over ``MICRO``)."""
    data = dataset(kind)
    if not single_device:
        return DataLoader(data, batch_size=BATCH)
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    return DataLoader(data, batch_size=BATCH // MICRO, sampler=sampler)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _one_device(rank: int, world_size: int) -> dict[str, Any]:
    result = {}
    for kind, make in (("gpt2", make_gpt2), ("transformer", make_transformer)):
        pl.seed_everything(SEED, verbose=False)
        module = make()
        make_trainer("auto", devices=1, max_steps=STEPS, accumulate=MICRO).fit(module, loader(kind, single_device=True))
        result[kind] = _state(module)
    return result


def _pipeline(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind, make in (("gpt2", make_gpt2), ("transformer", make_transformer)):
        pl.seed_everything(SEED, verbose=False)  # also the seed of Lightning's DistributedSampler
        module = make()
        strategy = PipelineParallelStrategy(schedule="1F1B", num_microbatches=MICRO, timeout=120)
        trainer = make_trainer(strategy, devices=world_size, max_steps=STEPS)
        trainer.fit(module, loader(kind, single_device=False))
        result[kind] = {"weights": _state(module), "starts": strategy.stage_plan.starts}
        if kind == "gpt2":
            trainer.save_checkpoint(checkpoint)  # a collective: every rank calls it
            result["tied"] = module.model.lm_head.weight is module.model.transformer.wte.weight
    return result


def test_the_adapters_of_the_guide_train_gpt2_and_the_demo_transformer_like_one_device(tmp_path):
    adapters()  # before forking: the ranks inherit the classes
    checkpoint = tmp_path / "gpt2.ckpt"
    (reference,) = run_distributed(_one_device, 1, init_process_group=False, timeout=120)
    results = run_distributed(_pipeline, 2, args=(str(checkpoint),), init_process_group=False, timeout=240)
    for result in results:  # the module is whole again on every rank after fit
        for kind in ("gpt2", "transformer"):
            assert_weights_close(result[kind]["weights"], reference[kind], **TOLERANCE)
        assert result["tied"]
        assert result["transformer"]["starts"] == (0, 3)  # after the encoder, as the guide says

    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert "model.transformer.wte.weight" in saved  # GPT-2's own names under the module's `model` attribute
    plain = GPT2LMHeadModel(gpt2_config())
    plain.load_state_dict({name.removeprefix("model."): tensor for name, tensor in saved.items()})
    assert plain.lm_head.weight is plain.transformer.wte.weight
    expected = {name.removeprefix("model."): tensor for name, tensor in reference["gpt2"].items()}
    assert_weights_close(_state(plain), expected, **TOLERANCE)
