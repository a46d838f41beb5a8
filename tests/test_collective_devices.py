"""Where the tensors our code hands to collectives and assembles for checkpoints would live on an accelerator.

Issue 36, items 4 and 7: the consolidated ZeRO-1/2 state was assembled on rank 0's device (a save could run a model
that fits only because of ZeRO out of memory), and 0-dim optimizer state (a fused or capturable Adam's ``step``, a
device tensor) went into object collectives as it was (it unpickles onto the sender's device index). A CPU run cannot
see either, so these tests run under :class:`collective_devices.DeviceSimulation`, which follows where every storage
would live if the root device were an accelerator and checks each collective (see its docstring):

* torch-only, 2 gloo ranks: ZeRO-1/2's consolidation (optimizer state, fp32 masters, model state) holds nothing on
  the device, keeps the device bytes above training's within one gathered bucket and this rank's shard, and puts
  host copies of the fused AdamW's ``step`` into its object collectives (as does ``gather_scalar_states``);
* real ``Trainer.fit`` of ZeRO-1/2/3, data parallel and pipeline on 2 ranks (and ZeRO at world size 1), saving a
  checkpoint and resuming from it: every tensor collective gets tensors on the strategy's ``root_device`` and no host
  copy, no object collective's payload holds a device tensor, and ZeRO-1/2's and the pipeline's saved checkpoints
  none either (the pipeline's device bytes while saving: ``tests/test_pipeline_device_bytes.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import pytest
import torch
from collective_devices import DeviceSimulation
from distributed_harness import run_distributed
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset
from training_helpers import SEQ_LEN, make_module, make_trainer

from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, ShardedOptimizerStrategy
from lightning_parallel.demos import RandomTokenDataset
from lightning_parallel.distributed.checkpoint import gather_scalar_states, scalar_states
from lightning_parallel.distributed.zero.backends.replicated import cloned_state
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer

CPU = torch.device("cpu")


# ------------------------------------------------------------------ torch only: the consolidation itself
def _held(model: nn.Module, optimizer: torch.optim.Optimizer, buckets: ShardedParameterBuckets) -> list[Tensor]:
    """What training holds on the device: parameters, the optimizer's tensors and state, the buckets."""
    held = [*model.parameters(), *model.buffers()]
    held += [param for group in optimizer.param_groups for param in group["params"]]
    held += [value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]
    for bucket in buckets.buckets:
        held += [t for t in (bucket.flat_params, bucket.shard_grads, bucket.full_grads, bucket.master) if t is not None]
    return held


def _consolidate_zero(rank: int, world_size: int, master: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(16)])  # ~32 small buckets
    dtype = torch.bfloat16 if master else torch.float32
    model.to(dtype)
    buckets = ShardedParameterBuckets(
        model, stage=2, bucket_cap_mb=1024 / 2**20, master_dtype=torch.float32 if master else None
    )
    # fused: `step` is a tensor on the parameters' device, as items 7's CUDA case
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sharded = ShardedOptimizer(optimizer, buckets)
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
        model(x).float().square().mean().backward()
        buckets.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad()
        buckets.all_gather_parameters()
    plain_model = nn.Linear(4, 4)  # a replicated optimizer's scalars, gathered as pipeline stages gather them
    plain = torch.optim.Adam(plain_model.parameters(), fused=True)
    plain_model(torch.ones(1, 4)).sum().backward()
    plain.step()

    def held() -> list[Tensor]:
        return [*_held(model, optimizer, buckets), *plain_model.parameters(), *plain.state[plain_model.weight].values()]

    with DeviceSimulation(root_device=CPU, held=held) as simulation:
        simulation.seed(held())
        with simulation.region() as saving:
            optimizer_state = sharded.consolidated_state_dict()
            model_state = cloned_state(model)
            names = sharded.scalar_states_by_name()
            gathered = gather_scalar_states(scalar_states(plain_model.named_parameters(), plain))
    state_bytes = 4 if master else dtype.itemsize  # the stepped tensors' dtype: the fp32 master's, else the model's
    return {
        "violations": simulation.violations,
        "on_device": simulation.device_tensors([optimizer_state, model_state, names, gathered]),
        "extra_bytes": saving.extra_bytes,
        # One bucket of one state key at a time: this rank's shard and the gathered pieces (rank 0), in buffers
        # reused for every bucket (however late gloo's worker thread lets go of a finished gather's tensors).
        "bound": max((world_size + 1) * bucket.shard_numel * state_bytes for bucket in buckets.buckets),
        "state_bytes": sum(
            v.numel() * v.element_size() for s in optimizer_state.get("state", {}).values() for v in s.values()
        ),
        "object_collectives": simulation.object_collectives,
        "keys": sorted(optimizer_state),
    }


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_with_fp32_masters"])
def test_zero_consolidation_is_assembled_on_the_host_one_bucket_at_a_time(master):
    results = run_distributed(_consolidate_zero, 2, args=(master,), timeout=60)
    for rank, result in enumerate(results):
        assert result["violations"] == [], f"rank {rank}"
        assert result["on_device"] == [], f"rank {rank}: left on the device"
        assert result["extra_bytes"] <= result["bound"], f"rank {rank}: {result['extra_bytes']} device bytes in flight"
        assert result["object_collectives"] >= 3  # the scalars of the consolidation, of the names, of the plain state
    root = results[0]
    assert root["keys"] == (["master_weights", "param_groups", "state"] if master else ["param_groups", "state"])
    assert root["state_bytes"] > 8 * root["bound"]  # far below the whole state: assembling it on the device fails


# ------------------------------------------------------------------ real training: save, resume, every collective
GLOBAL_BATCH = 8


def _strategy(spec: str) -> Any:
    if spec == "data_parallel":
        return DataParallelStrategy()
    if spec == "pipeline":
        return PipelineParallelStrategy(num_microbatches=2, timeout=60)
    stages: dict[str, Literal[1, 2, 3]] = {"zero1": 1, "zero2": 2, "zero3": 3}
    checkpoint_format: Literal["consolidated", "sharded"] = "sharded" if spec.endswith("_sharded") else "consolidated"
    return ShardedOptimizerStrategy(
        stage=stages[spec.removesuffix("_sharded")], bucket_cap_mb=0.02, checkpoint_format=checkpoint_format, timeout=60
    )


class _Watch(Callback):
    """Seeds the simulation with training's tensors once the strategy holds them; checks what a save assembled."""

    def __init__(self, simulation: DeviceSimulation, *, check_saved: bool) -> None:
        self.simulation = simulation
        self.check_saved = check_saved
        self.saved_on_device: list[str] = []
        self.saves = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.simulation.root_device = trainer.strategy.root_device

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.simulation.held = lambda: _training_tensors(trainer)
        self.simulation.seed(_training_tensors(trainer))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.saves += 1
        if self.check_saved and trainer.is_global_zero:
            saved = {key: checkpoint[key] for key in ("state_dict", "optimizer_states")}
            self.saved_on_device += self.simulation.device_tensors(saved)


def _training_tensors(trainer: pl.Trainer) -> list[Tensor]:
    module = trainer.lightning_module
    held = [*module.parameters(), *module.buffers()]
    held += [param.grad for param in module.parameters() if param.grad is not None]
    for optimizer in trainer.optimizers:
        held += [param for group in optimizer.param_groups for param in group["params"]]
        held += [value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]
    return held


def _fit_save_resume(rank: int, world_size: int, spec: str, directory: str) -> dict[str, Any]:
    per_rank = GLOBAL_BATCH // world_size
    dataset = RandomTokenDataset(GLOBAL_BATCH, SEQ_LEN, seed=7)
    loader = DataLoader(Subset(dataset, range(rank * per_rank, (rank + 1) * per_rank)), batch_size=per_rank)
    path = Path(directory) / "last.ckpt"
    # The pipeline's step outcome reaches the host through `_on_host`, which copies `if t.device.type != "cpu"`.
    simulation = DeviceSimulation(
        root_device=CPU, device_type_branches=("lightning_parallel.distributed.pipeline.engine",)
    )
    watch = _Watch(simulation, check_saved=spec.startswith(("zero1", "zero2", "pipeline")))
    with simulation:
        for resume in (False, True):
            saver = ModelCheckpoint(dirpath=directory, filename="last", enable_version_counter=False)
            trainer = make_trainer(
                _strategy(spec),
                devices=world_size,
                max_steps=3 if resume else 2,
                use_distributed_sampler=False,
                callbacks=[watch] if resume else [watch, saver],
                enable_checkpointing=not resume,
            )
            trainer.fit(make_module("adamw"), train_dataloaders=loader, ckpt_path=str(path) if resume else None)
            assert trainer.global_step == (3 if resume else 2)
    return {
        "violations": simulation.violations,
        "saved_on_device": watch.saved_on_device,
        "saves": watch.saves,
        "object_collectives": simulation.object_collectives,
        "tensor_collectives": simulation.tensor_collectives,
    }


@pytest.mark.parametrize(
    ("spec", "world_size"),
    [
        ("zero1", 2),
        ("zero2", 2),
        ("zero2_sharded", 2),
        ("zero3", 2),
        ("data_parallel", 2),
        ("pipeline", 2),
        ("zero2", 1),  # the replicated backend
    ],
)
def test_training_saving_and_resuming_hand_collectives_tensors_where_they_belong(tmp_path, spec, world_size):
    results = run_distributed(
        _fit_save_resume, world_size, args=(spec, str(tmp_path)), init_process_group=False, timeout=120
    )
    for rank, result in enumerate(results):
        assert result["violations"] == [], f"rank {rank}"
        assert result["saved_on_device"] == [], f"rank {rank}: the saved checkpoint holds device tensors"
        assert result["saves"] >= 1
        if world_size > 1:
            assert result["object_collectives"] > 0 and result["tensor_collectives"] > 0
