"""Gradients read in hooks under ZeRO are DDP's (issue 30, item 1).

Lightning's habits, on 2 real gloo ranks: ``self.log_dict(grad_norm(self, norm_type))`` in
``on_before_optimizer_step`` (its "track gradient norms" recipe) for norm types 2, 1 and inf, a gradient read in
``on_after_backward`` (also in the micro-steps of gradient accumulation, where DDP holds this rank's sum), a clip by
hand in ``on_before_optimizer_step`` that must change the step, and Lightning's own manual-optimization closure test
(two optimizers sharing a layer, ``.grad`` all-reduced by the user after ``manual_backward``). What reaches rank 0's
logger and the weights after training are compared value by value with one device (no accumulation) or with
``data_parallel`` (accumulation, manual optimization: DDP's own semantics).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import model_zoo as zoo
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from training_helpers import assert_weights_close

from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy

GLOBAL_BATCH, STEPS, FEATURES = 8, 3, 6
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
STRATEGIES: dict[str, Any] = {
    "data_parallel": lambda: DataParallelStrategy(find_unused_parameters=True),  # the module has an unused layer
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: "zero3",
    "zero2 hybrid": lambda: ShardedOptimizerStrategy(stage=2, shard_size=1),
    "zero3 hybrid": lambda: ShardedOptimizerStrategy(stage=3, shard_size=1),
}


class GradientReader(pl.LightningModule):
    """A user's MLP that logs Lightning's gradient norms, reads a gradient after backward and clips by hand."""

    def __init__(self, *, clip_by_hand: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(16, 3)
        self.unused = nn.Linear(2, 2)  # no gradient: no key, as on one device
        self.blocks[0].requires_grad_(False)  # frozen, yet in the optimizer (ZeRO-1/2 bucket it): no key either
        self.clip_by_hand = clip_by_hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_after_backward(self) -> None:
        self.log("after_backward/out.weight", self.out.weight.grad.sum())
        self.log("after_backward/unused_is_none", float(self.unused.weight.grad is None))

    def on_before_optimizer_step(self, optimizer) -> None:
        for norm_type in (2, 1, "inf"):
            self.log_dict(grad_norm(self, norm_type=norm_type))
        if self.clip_by_hand:  # changes the step: the shards must take it back
            torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class ClosureGAN(BoringModel):
    """Lightning's ``TesManualOptimizationDDPModel`` (tests/trainer/optimization/test_manual_optimization.py,
    ``test_step_with_optimizer_closure_with_different_frequencies_ddp_spawn``) as it is, without its dropout (so
    that two strategies draw nothing and compare exactly) and with the step counts kept instead of mocked."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps = {"sgd": 0, "adam": 0}

    def loss_ones(self, batch, prediction):
        return torch.nn.functional.mse_loss(prediction, torch.ones_like(prediction))

    def loss_zeros(self, batch, prediction):
        return torch.nn.functional.mse_loss(prediction, torch.zeros_like(prediction))

    def manual_sync_grad(self) -> bool:
        dist.all_reduce(self.layer.weight.grad.data, async_op=False)
        return True

    def training_step(self, batch, batch_idx):
        opt_gen, opt_dis = self.optimizers()
        world_size = dist.get_world_size(dist.group.WORLD)
        assert world_size == 2
        make_gen_optimizer_step = batch_idx % 2 == 1
        make_dis_optimizer_step = batch_idx % 4 == 0

        def compute_loss():
            predictions = self(batch)
            return self.loss_ones(None, predictions), self.loss_zeros(None, predictions)

        def make_manual_backward(loss, retain_graph=False, make_optimizer_step=True):
            self.manual_backward(loss, retain_graph=retain_graph)
            if make_optimizer_step:
                grad_clone = self.layer.weight.grad.clone()
                assert self.manual_sync_grad()
                self.layer.weight.grad /= world_size
                assert torch.equal(self.layer.weight.grad, grad_clone)  # every rank holds the averaged gradient

        def gen_closure():
            loss_ones_gen, _ = compute_loss()
            make_manual_backward(loss_ones_gen, retain_graph=True, make_optimizer_step=make_gen_optimizer_step)
            make_manual_backward(loss_ones_gen, make_optimizer_step=make_gen_optimizer_step)

        def dis_closure():
            loss_ones_gen, _ = compute_loss()
            make_manual_backward(loss_ones_gen, retain_graph=True, make_optimizer_step=make_dis_optimizer_step)
            make_manual_backward(loss_ones_gen, make_optimizer_step=make_dis_optimizer_step)

        if make_gen_optimizer_step:
            opt_gen.step(closure=gen_closure)
            self.steps["sgd"] += 1
            opt_gen.zero_grad()
        if make_dis_optimizer_step:
            opt_dis.step(closure=dis_closure)
            self.steps["adam"] += 1

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.Adam(self.layer.parameters(), lr=0.001)]


class LoggedEveryBatch(pl.Callback):
    """What reaches the loggers after each batch (rank 0's ``callback_metrics``)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        self.rows.append({name: float(value) for name, value in trainer.callback_metrics.items()})


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    count = GLOBAL_BATCH * STEPS * 2
    x = torch.randn(count, FEATURES, generator=generator)
    return TensorDataset(x, torch.randint(0, 3, (count,), generator=generator))


def _loader(replicas: int, replica: int, *, batch: int) -> DataLoader:
    """Batch k of the run is the k-th run of ``batch * replicas`` samples; replica r takes its r-th slice."""
    per = batch
    indices = [k * per * replicas + replica * per + i for k in range(STEPS * 2) for i in range(per)]
    return DataLoader(Subset(_dataset(), indices), batch_size=per, shuffle=False)


def _fit_reader(strategy: Any, devices: int, replica: int, *, accumulate: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    logged = LoggedEveryBatch()
    trainer = zoo.trainer(strategy, devices, max_steps=STEPS, accumulate_grad_batches=accumulate, callbacks=[logged])
    trainer.fit(GradientReader(), _loader(devices, replica, batch=GLOBAL_BATCH // devices // accumulate))
    state = trainer.strategy.lightning_module_state_dict() if devices > 1 else trainer.lightning_module.state_dict()
    return {"logged": logged.rows, "weights": {name: tensor.detach().clone() for name, tensor in state.items()}}


def _fit_gan(strategy: Any, devices: int, replica: int) -> dict[str, Any]:
    pl.seed_everything(42, verbose=False)
    module = ClosureGAN()
    data = DataLoader(Subset(RandomDataset(32, 64), range(replica, 64, devices)), batch_size=2)
    zoo.trainer(strategy, devices, max_steps=-1, max_epochs=1, limit_train_batches=8).fit(module, data)
    state = module.trainer.strategy.lightning_module_state_dict()
    return {"steps": module.steps, "weights": {name: tensor.detach().clone() for name, tensor in state.items()}}


def _in_ranks(rank: int, world_size: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    results: dict[Any, Any] = {}
    for name, strategy in STRATEGIES.items():
        results[name, "no accumulation"] = _fit_reader(strategy(), world_size, rank, accumulate=1)
        results[name, "accumulation"] = _fit_reader(strategy(), world_size, rank, accumulate=2)
        if "hybrid" not in name:
            results[name, "manual closure"] = _fit_gan(strategy(), world_size, rank)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_distributed(_in_ranks, 2, init_process_group=False, timeout=280)


@pytest.fixture(scope="module")
def one_device() -> dict[str, Any]:
    return _fit_reader("auto", 1, 0, accumulate=1)


def _assert_rows_equal(actual: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert sorted(got) == sorted(want), f"batch {step}: keys differ"
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"batch {step}: {key}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_grad_norm_logged_in_hooks_equals_one_device(ranks, one_device, strategy: str) -> None:
    result = ranks[0][strategy, "no accumulation"]
    keys = set(one_device["logged"][0])
    assert {"grad_2.0_norm_total", "grad_1.0_norm_total", "grad_inf_norm_total", "grad_2.0_norm/out.weight"} <= keys
    assert not any("unused" in key for key in keys if key.startswith("grad_"))  # no gradient: no key
    assert not any("blocks.0" in key for key in keys) and "grad_2.0_norm/blocks.1.0.weight" in keys  # frozen: none
    _assert_rows_equal(result["logged"], one_device["logged"])
    # The clip by hand in `on_before_optimizer_step` changed the step as on one device.
    assert_weights_close(result["weights"], one_device["weights"], **TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [name for name in STRATEGIES if name != "data_parallel"])
def test_gradients_read_with_accumulation_equal_ddp(ranks, strategy: str) -> None:
    """In the micro-steps without a sync, ``on_after_backward`` reads this rank's sum (DDP's ``no_sync``)."""
    reference = ranks[0]["data_parallel", "accumulation"]
    result = ranks[0][strategy, "accumulation"]
    _assert_rows_equal(result["logged"], reference["logged"])
    assert_weights_close(result["weights"], reference["weights"], **TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_lightning_manual_optimization_closure_test_passes(ranks, strategy: str) -> None:
    reference = ranks[0]["data_parallel", "manual closure"]
    result = ranks[0][strategy, "manual closure"]
    assert result["steps"] == reference["steps"] == {"sgd": 4, "adam": 2}
    assert_weights_close(result["weights"], reference["weights"], **TOLERANCE)


def _storage_keys(tensor: torch.Tensor) -> dict[int, int]:
    """The bytes of each storage behind ``tensor``, by storage identity."""
    from lightning_parallel.accounting import tensor_storages

    return {storage._cdata: storage.nbytes() for storage in tensor_storages(tensor)}


def _lend_bf16_gradients(rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    """bf16 parameters with fp32 masters (`bf16-true`), stages 1 and 2: the bytes a loan allocates, what it lends,
    and the buckets after it is handed back."""
    import copy

    from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
    from lightning_parallel.distributed.zero.gradient_loan import BucketGradientLoan
    from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer

    torch.set_num_threads(1)
    results = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).bfloat16()
        reference = copy.deepcopy(module)
        buckets = ShardedParameterBuckets(module, stage=stage, master_dtype=torch.float32, bucket_cap_mb=64 / 2**20)
        ShardedOptimizer(torch.optim.AdamW(module.parameters(), lr=0.1), buckets)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank)).bfloat16()
        module(x).float().square().mean().backward()
        buckets.finish_gradient_sync()
        buffers = [t for b in buckets.buckets for t in (b.full_grads, b.shard_grads, b.master, b.flat_params)]
        held = {key for tensor in buffers if tensor is not None for key in _storage_keys(tensor)}
        loan = BucketGradientLoan(buckets)
        # The storages behind what is lent (`.grad`) and what the loan keeps (its gathered buffers) that the buckets
        # did not hold before: what the loan allocated, to the byte (gloo may free its own temporaries later).
        new = {}
        for tensor in [*(p.grad for p in module.parameters() if p.grad is not None), *loan._whole]:
            new.update({key: nbytes for key, nbytes in _storage_keys(tensor).items() if key not in held})
        lent = {name: param.grad.clone() for name, param in module.named_parameters()}
        # DDP's average as the buckets take it: each rank's bf16 gradient over the world size in fp32, summed (two
        # terms: exact in any order), rounded to bf16.
        reference(x).float().square().mean().backward()
        equal = True
        for name, param in reference.named_parameters():
            average = param.grad.float() / world_size
            dist.all_reduce(average)
            equal = equal and torch.equal(lent[name], average.to(torch.bfloat16))
        loan.hand_back()
        results[stage] = {
            "allocated": sum(new.values()),
            "padded_parameters": sum(bucket.numel for bucket in buckets.buckets),
            "lent_dtypes": sorted({str(grad.dtype) for grad in lent.values()}),
            "equal_to_ddp": equal,
            "stage1_bucket_zero": all(b.full_grads is None or not b.full_grads.any() for b in buckets.buckets),
        }
    return results


def test_a_bf16_loan_allocates_the_parameters_bytes() -> None:
    """Issue 42: with fp32 masters a stage-2 loan allocated ~6 bytes a parameter (an fp32 whole buffer and bf16
    copies of it) where docs/zero.md says 2 (the parameters' bytes): now exactly 2 a (padded) parameter, and stage 1
    gathers into the 16-bit bucket it holds anyway (no gradient bytes, zeroed again at hand-back); the lent gradients
    are DDP's, bit for bit."""
    for result in run_distributed(_lend_bf16_gradients, 2):
        padded = result[2]["padded_parameters"]
        assert padded >= 66  # 5 * 7 + 7 + 7 * 3 + 3 parameters, buckets padded to the world size
        assert result[2]["allocated"] == 2 * padded  # was 4 * padded + 2 * 66 = 412 bytes
        assert result[1]["allocated"] == 0
        for stage in (1, 2):
            assert result[stage]["lent_dtypes"] == ["torch.bfloat16"]
            assert result[stage]["equal_to_ddp"] and result[stage]["stage1_bucket_zero"], (stage, result[stage])
