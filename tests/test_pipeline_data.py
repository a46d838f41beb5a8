"""Data as users load it, under the pipeline (issue 43): every rank of a pipeline trains on its first rank's batch.

The two cases of the issue with the real libraries: a LitData ``StreamingDataset`` built in ``train_dataloader()``
(it shards by torch.distributed's global rank: the two ranks of one pipeline read different samples) and Hugging
Face's ``DataCollatorForLanguageModeling`` (it draws the masks while collating, differently on each rank). Plus the
refusal of loaders of different lengths, and the replica's share read by LitData under 2 x 2 data x pipeline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from training_helpers import SEED, assert_weights_close, make_trainer

from lightning_parallel import (
    DataParallelStrategy,
    ParallelismMonitor,
    PipelineParallelStrategy,
    ShardedOptimizerStrategy,
)
from lightning_parallel.distributed.pipeline.replica_batches import (
    BatchBroadcast,
    InconsistentBatchesError,
    broadcast_batch,
    replica_batches,
)

litdata = pytest.importorskip("litdata")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
split_dataset_by_node = pytest.importorskip("datasets.distributed").split_dataset_by_node

NUM_SAMPLES, WIDTH, BATCH = 64, 8, 8


# ---------------------------------------------------------------------------------------------- the broadcast
def _broadcast_rank(rank: int, world_size: int) -> dict[str, Any]:
    exchange = BatchBroadcast(group=dist.group.WORLD, src=0, device=torch.device("cpu"))
    batch = {"ids": torch.arange(6).view(2, 3) + rank, "text": ["a", rank], "mask": torch.ones(2, dtype=torch.bool)}
    received, payload = broadcast_batch(batch, exchange)
    same_length = [b.tolist() for b in replica_batches([torch.tensor([rank, i]) for i in range(3)], exchange)]
    errors = []
    for batches in ([torch.tensor([i]) for i in range(3 + rank)], iter([torch.tensor([i]) for i in range(3 + rank)])):
        try:
            list(replica_batches(batches, exchange))
        except InconsistentBatchesError as error:
            errors.append(str(error))
    return {
        "ids": received["ids"].tolist(),
        "text": received["text"],
        "mask": received["mask"].tolist(),
        "payload": payload,
        "batches": same_length,
        "errors": errors,
    }


def test_a_batch_tree_is_the_first_ranks_on_every_rank_and_different_lengths_are_refused_on_every_rank():
    for result in run_distributed(_broadcast_rank, 2):
        assert result["ids"] == [[0, 1, 2], [3, 4, 5]] and result["text"] == ["a", 0] and result["mask"] == [True] * 2
        assert result["payload"] == 6 * 8 + 2  # int64 ids and bool mask; the description is not counted
        assert result["batches"] == [[0, 0], [0, 1], [0, 2]]
        by_length, by_end = result["errors"]
        assert "different lengths (rank 0: 3, rank 1: 4)" in by_length
        assert "distributed_sampler_kwargs" in by_length  # the fix
        assert "loader of global rank(s) [0] ended after 3 batches" in by_end  # an iterable without a length


# ---------------------------------------------------------------------------------------------- LitData
def _sample(index: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(WIDTH, generator=g)
    return {"index": index, "x": x, "y": torch.tanh(x @ torch.linspace(-1, 1, WIDTH)).unsqueeze(0)}


@pytest.fixture(scope="module")
def streaming_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 samples of a teacher regression, written by ``litdata.optimize`` (chunks of 16)."""
    path = tmp_path_factory.mktemp("litdata") / "optimized"
    litdata.optimize(fn=_sample, inputs=list(range(NUM_SAMPLES)), output_dir=str(path), chunk_size=16, num_workers=1)
    return path


class Regressor(pl.LightningModule):
    """Builds its loader where LitData and Lightning say to: in ``train_dataloader()``."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.stem, self.hidden, self.head = nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.hidden(self.stem(x)))

    def pipeline_layers(self):
        return [self.stem, self.hidden, self.head]

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def train_dataloader(self):
        return litdata.StreamingDataLoader(litdata.StreamingDataset(str(self.data_dir)), batch_size=BATCH)


class BatchRecorder(pl.Callback):
    """Each rank's training batches (their sample indices or a fingerprint), as every rank's hooks see them."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if "index" in batch:
            self.batches.append(batch["index"].tolist())
        else:
            digest = hashlib.sha256()
            for key in ("input_ids", "labels"):
                digest.update(batch[key].cpu().numpy().tobytes())
            self.batches.append(digest.hexdigest())


class HuggingFaceRegressor(Regressor):
    """The same samples as a Hugging Face streaming ``IterableDataset``, split with the documented line."""

    def train_dataloader(self):
        rows = [_sample(i) for i in range(NUM_SAMPLES)]
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        dataset = datasets.Dataset.from_dict(columns).to_iterable_dataset().with_format("torch")
        # The one line (docs/pipeline.md, "Data"): the data-parallel rank and size, under every strategy.
        shard = self.trainer.distributed_sampler_kwargs
        dataset = split_dataset_by_node(dataset, rank=shard["rank"], world_size=shard["num_replicas"])
        return DataLoader(dataset, batch_size=BATCH)


def _fit_regressor(rank: int, world_size: int, data_dir: Path | None, strategy_name: str, summary: Path | None) -> dict:
    pl.seed_everything(SEED, verbose=False)
    module = Regressor(data_dir) if data_dir is not None else HuggingFaceRegressor(Path())
    recorder = BatchRecorder()
    strategy = {
        "pipeline": lambda: PipelineParallelStrategy(num_microbatches=2, timeout=60),
        "pipeline_2x2": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=60),
        "one_device": lambda: DataParallelStrategy(timeout=60),
        "data_parallel": lambda: DataParallelStrategy(timeout=60),
        "zero_hybrid": lambda: ShardedOptimizerStrategy(stage=2, shard_size=2, timeout=60),
    }[strategy_name]()
    callbacks: list[pl.Callback] = [recorder]
    if summary is not None:
        callbacks.append(ParallelismMonitor(summary_path=summary, figure_path=False))
    trainer = make_trainer(strategy, devices=world_size, max_epochs=1, max_steps=-1, callbacks=callbacks)
    trainer.fit(module)
    state = {name: value.detach().clone() for name, value in module.state_dict().items()}
    return {"state": state, "batches": recorder.batches, "steps": trainer.global_step}


def test_litdata_streaming_dataset_trains_as_one_device_under_the_pipeline(streaming_dir: Path, tmp_path: Path):
    """The issue's case 1: it used to train rank 0's samples 0-7 against rank 1's targets 32-39 (and half the data)."""
    (reference,) = run_distributed(
        _fit_regressor, 1, args=(streaming_dir, "one_device", None), init_process_group=False, timeout=120
    )
    summary = tmp_path / "summary.json"
    results = run_distributed(
        _fit_regressor, 2, args=(streaming_dir, "pipeline", summary), init_process_group=False, timeout=120
    )
    assert reference["steps"] == NUM_SAMPLES // BATCH
    for result in results:
        # Every rank trains the whole data set, one replica's share, in one device's order; weights as one device's.
        assert result["batches"] == reference["batches"]
        assert sorted(i for batch in result["batches"] for i in batch) == list(range(NUM_SAMPLES))
        assert_weights_close(result["state"], reference["state"], rtol=1e-5, atol=1e-6)
    # The batch's bytes (index int64, x fp32 8 x 8, y fp32 8 x 1) on both ranks, in every step that trains it.
    ranks = json.loads(summary.read_text())["ranks"]
    for measured in ranks:
        broadcasts = [step["communication"].get("broadcast") for step in measured["steps"]]
        assert broadcasts == [BATCH * 8 + BATCH * WIDTH * 4 + BATCH * 4] * (NUM_SAMPLES // BATCH)


@pytest.mark.parametrize(
    ("strategy_name", "world_size", "per_pipeline"),
    [("data_parallel", 2, 1), ("zero_hybrid", 4, 1), ("pipeline_2x2", 4, 2)],
)
def test_litdata_reads_each_replicas_share(streaming_dir: Path, strategy_name: str, world_size: int, per_pipeline):
    """Under data parallelism and ZeRO (``shard_size`` too) LitData's global rank is the data-parallel rank; under
    2 x 2 the strategy tells it the replica's. The replicas' shares cover the data once."""
    results = run_distributed(
        _fit_regressor, world_size, args=(streaming_dir, strategy_name, None), init_process_group=False, timeout=180
    )
    _assert_each_replica_reads_its_share(results, per_pipeline)


def _assert_each_replica_reads_its_share(results: list[dict], per_pipeline: int) -> None:
    """The ranks of one pipeline train on the same batches; the replicas' samples are the data set, each once."""
    for first in range(0, len(results), per_pipeline):
        assert all(results[first + k]["batches"] == results[first]["batches"] for k in range(per_pipeline))
    samples = [i for result in results[::per_pipeline] for batch in result["batches"] for i in batch]
    assert sorted(samples) == list(range(NUM_SAMPLES))


@pytest.mark.parametrize(
    ("strategy_name", "world_size", "per_pipeline"), [("data_parallel", 2, 1), ("pipeline_2x2", 4, 2)]
)
def test_hugging_face_split_dataset_by_node_reads_each_replicas_share(
    strategy_name: str, world_size: int, per_pipeline
):
    """``split_dataset_by_node(ds, rank=..., world_size=...)`` given ``trainer.distributed_sampler_kwargs``: under
    data parallelism the global rank and world size, under 2 x 2 the replica's; each sample read once."""
    results = run_distributed(
        _fit_regressor, world_size, args=(None, strategy_name, None), init_process_group=False, timeout=180
    )
    _assert_each_replica_reads_its_share(results, per_pipeline)


# ---------------------------------------------------------------------------------------------- HF collator
VOCAB = 32


def _tokenizer() -> Any:
    """A word-level tokenizer built in memory (no download): ids 0-3 are the special tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "[CLS]": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        cls_token="[CLS]",
    )


class MaskedLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.mixer, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.mixer(self.embedding(ids))))

    def pipeline_layers(self):
        return [self.embedding, self.mixer, nn.Tanh(), self.head]

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_masked_lm(rank: int, world_size: int, num_workers: int) -> list[str]:
    pl.seed_everything(SEED, workers=True, verbose=False)
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(4, VOCAB, (12,), generator=g).tolist()} for _ in range(56)]
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm_probability=0.3)
    loader = DataLoader(samples, batch_size=BATCH, collate_fn=collator, num_workers=num_workers)
    recorder = BatchRecorder()
    strategy = PipelineParallelStrategy(num_microbatches=2, timeout=60)
    trainer = make_trainer(strategy, devices=world_size, max_epochs=2, max_steps=-1, callbacks=[recorder])
    trainer.fit(MaskedLM(), train_dataloaders=loader)
    return recorder.batches


@pytest.mark.parametrize("num_workers", [0, 1])
def test_masked_lm_collator_batches_are_identical_on_every_stage(num_workers: int):
    """The issue's case 2: the stages' masks agreed in 2 of 7 steps; now in every step (2 epochs of 7)."""
    first, last = run_distributed(_fit_masked_lm, 2, args=(num_workers,), init_process_group=False, timeout=120)
    assert len(first) == 14 and first == last
    assert len(set(first)) == 14  # a different masking every step


# ---------------------------------------------------------------------------------------------- resume
def _fit_and_resume(
    rank: int, world_size: int, data_dir: Path, checkpoints: Path, stop_at: int | None, resume: str = "here"
) -> dict:
    """An uninterrupted epoch (``stop_at=None``), or one stopped after ``stop_at`` steps and resumed from there
    (``resume="here"``), or only stopped (``"elsewhere"``: another world size resumes it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps: int, ckpt_path: Path | None, callbacks: list[pl.Callback]) -> BatchRecorder:
        pl.seed_everything(SEED, verbose=False)
        recorder = BatchRecorder()
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=60)
        trainer = make_trainer(
            strategy,
            devices=world_size,
            max_epochs=1,
            max_steps=max_steps,
            callbacks=[recorder, *callbacks],
            enable_checkpointing=bool(callbacks),
        )
        trainer.fit(Regressor(data_dir), ckpt_path=ckpt_path)
        return recorder

    if stop_at is None:
        return {"batches": fit(-1, None, []).batches}
    saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=stop_at, save_top_k=-1)
    before = fit(stop_at, None, [saver]).batches
    if resume == "elsewhere":
        return {"before": before}
    after = fit(-1, checkpoints / f"epoch=0-step={stop_at}.ckpt", []).batches
    return {"batches": before + after, "before": before}


def _resume(rank: int, world_size: int, data_dir: Path, checkpoint: Path) -> list[Any]:
    pl.seed_everything(SEED, verbose=False)
    recorder = BatchRecorder()
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=60)
    trainer = make_trainer(strategy, devices=world_size, max_epochs=1, max_steps=-1, callbacks=[recorder])
    trainer.fit(Regressor(data_dir), ckpt_path=checkpoint)
    return recorder.batches


@pytest.mark.parametrize(("world_size", "stop_at"), [(2, 3), (4, 1), (4, 3)])
def test_a_run_stopped_mid_epoch_resumes_litdata_at_the_next_unseen_samples(
    streaming_dir: Path, tmp_path: Path, world_size: int, stop_at: int
):
    """LitData's ``StreamingDataLoader`` saves its position; under the pipeline a resumed run goes on with the next
    unseen samples, on every rank, exactly as the uninterrupted run: one pipeline of two stages, and two replicas of
    it (2 x 2), where LitData reads the replica's share and its own resume code counts the global world size."""
    args = (streaming_dir, tmp_path / "checkpoints")
    uninterrupted = run_distributed(
        _fit_and_resume, world_size, args=(*args, None), init_process_group=False, timeout=120
    )
    resumed = run_distributed(_fit_and_resume, world_size, args=(*args, stop_at), init_process_group=False, timeout=120)
    for whole, split in zip(uninterrupted, resumed, strict=True):
        assert len(split["before"]) == stop_at
        assert split["batches"] == whole["batches"]  # none skipped, none repeated
    shares = {tuple(map(tuple, result["batches"])) for result in resumed}  # one per replica
    assert len(shares) == world_size // 2
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(NUM_SAMPLES))


def test_a_run_stopped_on_two_replicas_resumes_litdata_on_one(streaming_dir: Path, tmp_path: Path):
    """Stopped under 2 x 2 after one step (each replica trained 8 of its 32 samples), resumed by one pipeline of two
    ranks: LitData re-stripes the rest of the epoch for the new replica count, so the resumed run trains the 48
    samples no replica trained, none twice."""
    checkpoints = tmp_path / "checkpoints"
    stopped = run_distributed(
        _fit_and_resume, 4, args=(streaming_dir, checkpoints, 1, "elsewhere"), init_process_group=False, timeout=120
    )
    before = {tuple(map(tuple, result["before"])) for result in stopped}
    assert len(before) == 2 and all(len(share) == 1 for share in before)
    checkpoint = checkpoints / "epoch=0-step=1.ckpt"
    first, last = run_distributed(_resume, 2, args=(streaming_dir, checkpoint), init_process_group=False, timeout=120)
    assert first == last
    trained = [i for share in before for batch in share for i in batch] + [i for batch in first for i in batch]
    assert sorted(trained) == list(range(NUM_SAMPLES))


# ---------------------------------------------------------------------------------------------- refusal
class UnevenRegressor(Regressor):
    """Each rank loads its own list of samples, rank 1 one batch more than rank 0 (an uneven split by the rank)."""

    def train_dataloader(self):
        rank = self.trainer.global_rank
        return DataLoader([_sample(i) for i in range(4 * BATCH + rank * BATCH)], batch_size=BATCH)


def _fit_uneven(rank: int, world_size: int) -> str:
    strategy = PipelineParallelStrategy(num_microbatches=2, timeout=60)
    trainer = make_trainer(strategy, devices=world_size, max_epochs=1, max_steps=-1, use_distributed_sampler=False)
    try:
        trainer.fit(UnevenRegressor(Path()))
    except InconsistentBatchesError as error:
        return f"{error} (after {trainer.global_step} steps)"
    return "trained"


def test_loaders_of_different_lengths_stop_every_rank_before_the_first_step():
    for message in run_distributed(_fit_uneven, 2, init_process_group=False, timeout=120):
        assert "different lengths (rank 0: 4, rank 1: 5)" in message
        assert message.endswith("(after 0 steps)")
