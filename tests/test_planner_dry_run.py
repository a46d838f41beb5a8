"""The planner's dry run (one step on fake tensors, one simulated rank) against the same step on real gloo ranks.

Both sides run ``lightning_parallel.planner.dry_run``'s step with the project's building blocks (torch's DDP on the
real side, its bucket-for-bucket stand-in on the fake side; ZeRO-1/2 buckets; ZeRO-3 ``fully_shard``; hybrid groups)
and measure the peak with ``LiveTensorPeak``. Goal (issue 32): the dry run's peak within 3% of the real one. Models:
the demo GPT, transformers' Llama and GPT-2 (tiny configs), a small hand-written ResNet-like conv net (torchvision's
resnet18 cannot be installed beside the CPU torch here: PyPI's torchvision wheels are CUDA builds) and a user's own
module (``LIGHTNING_PARALLEL_DRY_RUN_FULL=1``: every model under every strategy). The real ranks of every case run in
one ``run_distributed`` call (one fork per world size).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_parallel.demos.gpt import GPT, GPTConfig
from lightning_parallel.distributed.zero.config import MasterWeights
from lightning_parallel.planner.dry_run import (
    DryRunError,
    DryRunLayout,
    DryRunWorkload,
    backend_device,
    dry_run,
    language_model_workload,
    measure_step,
    module_workload,
)
from tests.distributed_harness import run_distributed

transformers = pytest.importorskip("transformers")

TOLERANCE = 0.03
STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3")


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def _conv_net() -> nn.Module:
    """resnet18's structure in small: stem, residual blocks, pooling, classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        _ResidualBlock(16),
        _ResidualBlock(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


class UserModel(nn.Module):
    """A user's own module: gated MLP blocks with a skip connection and a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256), nn.GELU(),
                                                  nn.Linear(256, 128)) for _ in range(3))  # fmt: skip
        self.out = nn.Linear(128, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h), h.detach()


def _workload(name: str) -> DryRunWorkload:
    if name.startswith("gpt") and name != "gpt2":  # "gpt", "gpt-full-ac", "gpt-selective-ac"
        config = GPTConfig.from_preset("tiny")
        mode: bool | str = {"gpt": False, "gpt-full-ac": True, "gpt-selective-ac": "selective"}[name]
        return language_model_workload(lambda: GPT(config), batch_size=8, seq_len=64, vocab_size=config.vocab_size,
                                       activation_checkpointing=mode)  # fmt: skip
    if name == "llama":
        llama = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128,
        )  # fmt: skip
        return language_model_workload(lambda: transformers.AutoModelForCausalLM.from_config(llama), batch_size=4,
                                       seq_len=64, vocab_size=512)  # fmt: skip
    if name == "gpt2":
        gpt2 = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)
        return language_model_workload(lambda: transformers.AutoModelForCausalLM.from_config(gpt2), batch_size=4,
                                       seq_len=64, vocab_size=512)  # fmt: skip
    if name == "convnet":
        return module_workload(_conv_net, lambda: (torch.randn(8, 3, 32, 32),))
    assert name == "user"
    return module_workload(UserModel, lambda: (torch.randn(16, 24, 32),))


MODELS = ("gpt", "llama", "gpt2", "convnet", "user")
FULL_MATRIX = os.environ.get("LIGHTNING_PARALLEL_DRY_RUN_FULL") == "1"
"""Every model x every strategy (26 cases, ~3 minutes here); by default the demo GPT under every strategy and one or
two strategies of each other model (14 cases), to keep the suite fast."""
_SOME = {"llama": ("data_parallel", "zero3"), "gpt2": ("zero2",), "convnet": ("data_parallel",), "user": ("zero1",)}
CASES = [
    (model, strategy, 2, None)
    for model in MODELS
    for strategy in STRATEGIES
    if FULL_MATRIX or strategy in _SOME.get(model, STRATEGIES)
]
CASES += [("gpt-full-ac", "zero3", 2, None), ("gpt-selective-ac", "zero2", 2, None)]
"""Activation checkpointing (the strategies' ``activation_checkpointing=True`` / ``"selective"``)."""
HYBRID = [("gpt", "zero2", 4, 2), ("gpt", "zero3", 4, 2)]
"""Hybrid sharding: 2 shard groups of 2 ranks (4 ranks), ZeRO-2 buckets and HSDP."""


def _layout(strategy: str, world_size: int, shard_size: int | None, rank: int) -> DryRunLayout:
    return DryRunLayout(strategy=strategy, world_size=world_size, rank=rank, shard_size=shard_size, backend="gloo")


def _real_peaks(rank: int, world_size: int, cases: list[tuple[str, str, int, int | None]]) -> dict[Any, int]:
    peaks = {}
    for model, strategy, _, shard_size in cases:
        torch.manual_seed(0)
        peak = measure_step(_workload(model), _layout(strategy, world_size, shard_size, rank))
        peaks[(model, strategy)] = peak.peak_bytes
    return peaks


@pytest.fixture(scope="module")
def real_peaks() -> dict[tuple[str, str, int], int]:
    """Each case's peak on the last rank of a real gloo world."""
    found = {}
    for world_size, cases in ((2, CASES), (4, HYBRID)):
        ranks = run_distributed(_real_peaks, world_size, args=(cases,), timeout=300)
        found.update({(m, s, world_size): peak for (m, s), peak in ranks[-1].items()})
    return found


@pytest.mark.parametrize(("model", "strategy", "world_size", "shard_size"), CASES + HYBRID)
def test_dry_run_peak_within_3_percent(
    real_peaks: dict[tuple[str, str, int], int], model: str, strategy: str, world_size: int, shard_size: int | None
) -> None:
    predicted = dry_run(_workload(model), _layout(strategy, world_size, shard_size, world_size - 1)).peak_bytes
    measured = real_peaks[(model, strategy, world_size)]
    assert abs(predicted - measured) <= TOLERANCE * measured, (model, strategy, predicted, measured)


def test_measure_step_runs_on_the_backends_device() -> None:
    """Issue 42: `measure_step` put everything on the CPU, which an NCCL group refuses; it now takes the device of
    the group's backend (the strategy's root device), unless told one."""
    assert backend_device("gloo") == torch.device("cpu")
    assert backend_device("nccl") == torch.device("cuda")
    assert backend_device("cpu:gloo,cuda:nccl") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"backend='smoke'.*measure_step\(\.\.\., device=\.\.\.\)"):
        backend_device("smoke")


def test_dry_run_plans_a_large_world_with_one_rank() -> None:
    """One process plans rank 0 of 1,024 ranks: ZeRO-2's optimizer state is that rank's 1/1024 shard."""
    small = dry_run(_workload("gpt"), DryRunLayout(strategy="zero2", world_size=2)).breakdown["optimizer_state"]
    large = dry_run(_workload("gpt"), DryRunLayout(strategy="zero2", world_size=1024)).breakdown["optimizer_state"]
    assert 0 < large * 400 < small


def test_dry_run_refuses_a_data_dependent_model() -> None:
    """A forward whose output shape depends on the data cannot run on fake tensors: DryRunError names the model."""

    class Selects(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.linear(x)[x[:, 0] > 0]

    workload = module_workload(Selects, lambda: (torch.randn(8, 4),), description="Selects")
    with pytest.raises(DryRunError, match="Selects cannot run on fake tensors"):
        dry_run(workload, DryRunLayout(strategy="data_parallel", world_size=2))


def test_dry_run_layout_validates() -> None:
    with pytest.raises(ValueError, match="cannot be dry-run"):
        DryRunLayout(strategy="pipeline", world_size=2)
    with pytest.raises(ValueError, match="shard_size=3"):
        DryRunLayout(strategy="zero2", world_size=4, shard_size=3)


def test_plan_dry_run_rows_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan(dry_run=True)``: each data-parallel / ZeRO / hybrid row's peak is the dry run of rank 0 of its layout,
    ``fits`` uses it; a pipeline row's is the largest of its pipeline ranks' dry runs (``dry_run_pipeline``); the CLI
    shows the column with ``--dry-run``."""
    from lightning_parallel.planner import main, plan

    result = plan("tiny", world_size=2, batch_size=8, seq_len=64, dry_run=True, process_group_backend="gloo",
                  device_memory=2**30)  # fmt: skip
    zero2 = result.configuration("zero2")
    expected = dry_run(_workload("gpt"), _layout("zero2", 2, None, 0)).peak_bytes
    # The preset's registered builder (the demo's module) holds a few bytes the bare GPT above does not.
    assert zero2.peak is not None and abs(zero2.peak - expected) < 0.01 * expected
    assert zero2.max_total == zero2.peak and zero2.fits
    pipeline = next(c for c in result.configurations if c.name.startswith("pipeline"))
    assert pipeline.peak is not None and pipeline.max_total == pipeline.peak
    assert "| formula |" not in result.table() and "peak (dry run)" in result.table()
    assert main(["tiny", "--world-size", "1", "--batch-size", "2", "--seq-len", "16", "--dry-run"]) == 0
    assert "peak (dry run)" in capsys.readouterr().out


def test_a_zero3_fit_after_a_zero3_dry_run_equals_one_device() -> None:
    """Plan, then train, in one process (a notebook): the dry run's fake mesh must not stay in DTensor's caches,
    which match meshes by shape, not by process group. Before they were emptied, this fit (forked from the process
    that had dry-run, clipping the sharded gradients' norm) clipped by each rank's local norm."""
    from test_zero import TOLERANCE as FIT_TOLERANCE
    from test_zero import _fit_manual
    from training_helpers import assert_weights_close

    dry_run(_workload("gpt"), _layout("zero3", 2, None, 1))
    (reference,) = run_distributed(_fit_manual, 1, args=(0,), init_process_group=False, timeout=120)
    results = run_distributed(_fit_manual, 2, args=(3,), init_process_group=False, timeout=120)
    assert_weights_close(results[0], reference, **FIT_TOLERANCE["adamw"])


_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip


def _llama_module() -> Any:
    """A LightningModule holding a transformers Llama, as a user writes one (built lazily: Lightning's import)."""
    import lightning.pytorch as pl

    class LlamaModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_LLAMA))

        def forward(self, inputs: Tensor) -> Tensor:
            return self.model(inputs).logits

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            inputs, targets = batch
            logits = self(inputs)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LlamaModule()


def _trainer_peaks(
    rank: int, world_size: int, strategies: tuple[str, ...], precision: str = "32-true", fits: int = 1
) -> dict[str, int]:
    """Each strategy's peak tensor bytes on this rank in a real Trainer (the monitor's measure, step 1); with
    ``fits > 1`` the smallest of that many fits' (gloo frees a finished collective's tensors on its worker thread a
    moment after the wait: one measurement can count them, as one did under a loaded machine)."""
    import gc

    from torch.utils.data import DataLoader, TensorDataset
    from training_helpers import make_trainer

    from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy
    from lightning_parallel.accounting import live_tensors, tensor_storages
    from lightning_parallel.monitor import ParallelismMonitor

    torch.set_num_threads(1)
    # What this forked rank inherited from the pytest process (earlier tests' tensors) stays alive through every fit
    # and is in the monitor's count: taken out, as the dry run takes out what its process held.
    gc.collect()
    inherited = {s._cdata: s.nbytes() for t in live_tensors() for s in tensor_storages(t)}
    data = TensorDataset(torch.randint(512, (32, 64)), torch.randint(512, (32, 64)))
    peaks = {}
    for name in strategies:
        torch.manual_seed(0)
        # "zero3_tp2": `ShardedOptimizerStrategy(stage=3, tensor_parallel_size=2)` (test_planner_tensor_parallel.py)
        measured = []
        for _ in range(fits):
            torch.manual_seed(0)
            tensor = int(name.partition("_tp")[2] or 1)
            strategy = (
                DataParallelStrategy()
                if name == "data_parallel"
                else ShardedOptimizerStrategy(stage=int(name[4]), tensor_parallel_size=tensor)
            )
            monitor = ParallelismMonitor(peak_tensors_step=1, figure_path=False, summary_path=None)
            trainer = make_trainer(strategy, devices=world_size, max_steps=2, callbacks=[monitor], precision=precision)
            trainer.fit(_llama_module(), train_dataloaders=DataLoader(data, batch_size=4))
            assert monitor.summary is not None
            measured.append(
                next(r for r in monitor.summary["ranks"] if r["rank"] == rank)["peak_tensors"]["peak_bytes"]
            )
        peaks[name] = min(measured) - sum(inherited.values())
    return peaks


def test_dry_run_of_a_lightning_module_with_a_hugging_face_model_predicts_the_trainer() -> None:
    """Issue 32's measure: the peak of the strategy inside a Trainer (the monitor's), not only of a plain step. A
    LightningModule holding transformers' Llama, 2 ranks, 4 x 64 tokens per rank: the dry run of the module (its
    forward, as ``plan`` runs a LightningModule) within 3% on each rank."""
    strategies = ("data_parallel", "zero3")
    ranks = run_distributed(_trainer_peaks, 2, args=(strategies,), init_process_group=False, timeout=240)
    workload = language_model_workload(_llama_module, batch_size=4, seq_len=64, vocab_size=512)
    for name in strategies:
        for rank, measured in enumerate(r[name] for r in ranks):
            predicted = dry_run(workload, _layout(name, 2, None, rank)).peak_bytes
            assert predicted == pytest.approx(measured, rel=TOLERANCE), (name, rank, predicted, measured)


MASTER_CASES: list[tuple[str, str, MasterWeights]] = [
    ("gpt", "zero1", "fp32"),
    ("gpt", "zero2", "fp32"),
    ("gpt", "zero2", None),
]
"""ZeRO-1/2 of a ``bf16-true`` model: fp32 master weights of the shard (``master_weights="fp32"``, the default), and
the bf16 parameters stepped directly (``None``)."""


def _bf16_layout(strategy: str, rank: int, master_weights: MasterWeights) -> DryRunLayout:
    return DryRunLayout(strategy=strategy, world_size=2, rank=rank, backend="gloo", precision="bf16-true",
                        master_weights=master_weights)  # fmt: skip


def _real_bf16_peaks(rank: int, world_size: int) -> dict[tuple[str, str, MasterWeights], int]:
    peaks = {}
    for model, strategy, master_weights in MASTER_CASES:
        torch.manual_seed(0)
        peaks[(model, strategy, master_weights)] = measure_step(
            _workload(model), _bf16_layout(strategy, rank, master_weights)
        ).peak_bytes
    return peaks


def test_dry_run_of_bf16_zero_with_fp32_masters_within_3_percent() -> None:
    """The dry run holds a ZeRO model as the strategy does (its ``ZeroBackend``, chosen by its ``backend_type``): with
    ``precision="bf16-true"`` the fp32 master shards, the fp32 optimizer state and the bucket casts are in the peak,
    on every rank (measured here: within 0.01% of the real gloo step), and the masters cost what they hold."""
    ranks = run_distributed(_real_bf16_peaks, 2, timeout=300)
    predicted = {}
    for model, strategy, master_weights in MASTER_CASES:
        for rank, measured in enumerate(r[(model, strategy, master_weights)] for r in ranks):
            peak = dry_run(_workload(model), _bf16_layout(strategy, rank, master_weights)).peak_bytes
            assert abs(peak - measured) <= TOLERANCE * measured, (model, strategy, master_weights, rank, peak, measured)
            predicted[(model, strategy, master_weights, rank)] = peak
    # The masters are held: fp32 copies of this rank's shard (and fp32, not bf16, optimizer state) cost more.
    assert predicted[("gpt", "zero2", "fp32", 0)] > predicted[("gpt", "zero2", None, 0)]
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        DryRunLayout(strategy="zero2", world_size=2, precision="bf16-mixed")


def test_plan_dry_runs_bf16_true_zero_rows_with_their_masters() -> None:
    """``plan(precision="bf16-true", dry_run=True)``: the data-parallel and ZeRO rows are dry-run (ZeRO holding its
    fp32 masters), the pipeline rows keep the formula (the pipeline's dry run plays fp32 only), with a note."""
    from lightning_parallel.planner import plan

    result = plan("tiny", world_size=2, batch_size=8, seq_len=64, dry_run=True, process_group_backend="gloo",
                  precision="bf16-true")  # fmt: skip
    zero2 = result.configuration("zero2")
    expected = dry_run(_workload("gpt"), _bf16_layout("zero2", 0, "fp32")).peak_bytes
    assert zero2.peak is not None and abs(zero2.peak - expected) < 0.01 * expected
    assert all(c.peak is not None for c in result.configurations if not c.name.startswith("pipeline"))
    assert all(c.peak is None for c in result.configurations if c.name.startswith("pipeline"))
    assert any("16-bit precision keep the formula" in note for note in result.assumptions)


def test_dry_run_of_bf16_zero_with_fp32_masters_predicts_the_trainer() -> None:
    """The measure of a real ``Trainer(precision="bf16-true")`` with ``ShardedOptimizerStrategy(stage=1/2)`` (fp32
    masters, the overlapped parameter all-gather): the dry run of the module within 3% on each rank."""
    strategies = ("zero1", "zero2")
    ranks = run_distributed(_trainer_peaks, 2, args=(strategies, "bf16-true"), init_process_group=False, timeout=240)
    workload = language_model_workload(_llama_module, batch_size=4, seq_len=64, vocab_size=512)
    for name in strategies:
        for rank, measured in enumerate(r[name] for r in ranks):
            predicted = dry_run(workload, _bf16_layout(name, rank, "fp32")).peak_bytes
            assert predicted == pytest.approx(measured, rel=TOLERANCE), (name, rank, predicted, measured)


def test_the_dry_run_counts_only_its_own_step() -> None:
    """What the process already holds (a notebook's data and models, earlier results) is not the planned step's: a
    4 MiB tensor alive beside the dry run leaves its peak as it was, to the byte."""
    layout = DryRunLayout(strategy="zero2", world_size=2)
    without = dry_run(_workload("gpt"), layout)
    ballast = torch.zeros(2**20)
    with_ballast = dry_run(_workload("gpt"), layout)
    assert with_ballast.peak_bytes == without.peak_bytes and ballast.numel() == 2**20
