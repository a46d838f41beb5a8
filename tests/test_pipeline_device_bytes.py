"""Device bytes of a pipeline's checkpoints and of the reassembly after a run (issue 42, item 1).

A model is pipelined because it does not fit on one accelerator, so saving it and handing it back must not put it
whole on one. Three places did: the consolidated checkpoint gathered every stage's state with ``gather_object`` (over
NCCL every rank's pickled tensors land on rank 0's GPU at once: pipeline size x the largest stage), ZeRO-3 inside the
pipeline gathered every tensor of the stage whole on the device before copying any, and the reassembly after ``fit``
received every other stage onto each rank's device. A CPU run cannot see where a tensor would live, so these tests
run under :class:`collective_devices.DeviceSimulation` (``factories_on_device``: buffers allocated on the root device
count; ``object_buffers_on_device``: an object collective's byte buffers are on the device, as NCCL's are) and check,
on every rank, with the stages' training state on the simulated device:

* the consolidated model and optimizer state hold nothing on the device, equal one device's, and the device bytes in
  flight while consolidating stay within two tensors (one in flight; gloo drops a finished buffer a moment late) and
  the ranks' pickled structures, below one stage's state, where the old gather held every stage's;
* ``PipelineRun.reassemble`` leaves the whole module on the host, equal to one device's, and held no more than two
  tensors beyond the stage while doing it;
* with ``zero_stage=3`` over two replicas, the same for the gather of the shards (each whole tensor copied to the host
  before the next is gathered) and for the teardown's restore.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from collective_devices import DeviceSimulation
from distributed_harness import run_distributed
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.checkpoint_format import CHECKPOINT_FORMATS, whole_model_state
from lightning_parallel.distributed.pipeline.parallel_dims import build_parallel_dims
from lightning_parallel.distributed.pipeline.stage_split import StageHolding, split_into_stages
from lightning_parallel.distributed.pipeline.zero import pipeline_zero_config

WIDTH, NUM_LAYERS, STEPS, BATCH = 64, 6, 2, 8
CPU = torch.device("cpu")
TENSOR_BYTES = WIDTH * WIDTH * 4
"""The largest tensor: one layer's fp32 weight (or its Adam moment)."""
STRUCTURE_BYTES = 8 * 1024
"""Room for one rank's pickled structure in an object collective (names, shapes, dtypes, settings: ~2 KiB here)."""


class _Chain(nn.Module):
    """A plain ``nn.Module``: ``NUM_LAYERS`` square linear layers, each its own pipeline layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(NUM_LAYERS))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)


def _batches() -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))] * STEPS


def _one_device(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for index, batch in enumerate(_batches()):
        model.training_step(batch, index).backward()  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer.state_dict()


def _training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """What training holds on the device: the stage's parameters (ZeRO-3: its shards) and buffers, the optimizer's
    state."""
    held = [*model.parameters(), *model.buffers()]
    held += [value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]
    return held


def _nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _save_and_reassemble(rank: int, world_size: int, pipeline_parallel_size: int, zero_stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Chain()
    reference, reference_optimizer = _one_device(copy.deepcopy(model))
    layout = [[name for name, _ in model.named_parameters()]]
    zero_config = pipeline_zero_config(zero_stage)
    dims = build_parallel_dims(world_size, rank, pipeline_parallel_size=pipeline_parallel_size, zero_config=zero_config)
    run = split_into_stages(
        model,
        dims=dims,
        device=CPU,
        num_stages=pipeline_parallel_size,
        schedule="GPipe",
        num_microbatches=2,
        partition=[stage * NUM_LAYERS // pipeline_parallel_size for stage in range(1, pipeline_parallel_size)],
        holding=StageHolding(zero_config=zero_config),
        optimizer_layouts=[layout],
    )
    assert run.engine is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # this rank's stage only (ZeRO-3: its shards)
    run.setup_optimizers([optimizer])
    dp, replica = dims.data_parallel_size, dims.data_parallel_rank
    for index, (inputs, targets) in enumerate(_batches()):
        rows = slice(replica * BATCH // dp, (replica + 1) * BATCH // dp)  # this replica's part
        batch = (inputs[rows], targets[rows])
        model_inputs, _ = run.engine.capture_inputs("training_step", (batch, index), {})
        run.engine.train_step("training_step", (batch, index), {}, model_inputs=model_inputs, divisor=2)
        run.backend.reduce_gradients()
        optimizer.step()
        run.backend.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    # Training's tensors, as training left them (the reassembly then moves the module's to the host; ZeRO-3's restore
    # puts the user's layers back in place of the sharded copies the optimizer keeps).
    training = _training_tensors(model, optimizer)
    stage_bytes = _nbytes(training)
    simulation = DeviceSimulation(
        root_device=CPU, held=lambda: training, factories_on_device=True, object_buffers_on_device=True
    )
    with simulation:
        simulation.seed(training)
        with simulation.region() as saving:
            model_state = whole_model_state(model, run)
            optimizer_state = CHECKPOINT_FORMATS["consolidated"].optimizer_state(run, optimizer, [optimizer])
        with simulation.region() as reassembling:
            run.reassemble(model, device=CPU)
        whole = model.state_dict()
        left_on_device = simulation.device_tensors([model_state, optimizer_state, whole])
    run.backend.teardown()
    result: dict[str, Any] = {
        "violations": simulation.violations,
        "left_on_device": left_on_device,
        "saving_bytes": saving.extra_bytes,
        "reassembling_bytes": reassembling.extra_bytes,
        "stage_bytes": stage_bytes,
    }
    torch.testing.assert_close(whole, reference.state_dict(), msg=f"reassembled on rank {rank}")
    if dims.pipeline_rank == 0:
        torch.testing.assert_close(model_state, reference.state_dict(), msg=f"consolidated on rank {rank}")
        assert optimizer_state is not None
        torch.testing.assert_close(optimizer_state["state"], reference_optimizer["state"])
    return result


@pytest.mark.parametrize(
    ("pipeline_parallel_size", "zero_stage", "world_size"),
    [(3, 0, 3), (2, 3, 4)],
    ids=["3_stages", "2_stages_x_2_replicas_zero3"],
)
def test_saving_and_reassembling_hold_one_tensor_in_flight_on_the_device(
    pipeline_parallel_size: int, zero_stage: int, world_size: int
) -> None:
    results = run_distributed(_save_and_reassemble, world_size, args=(pipeline_parallel_size, zero_stage), timeout=120)
    in_flight = 2 * TENSOR_BYTES + pipeline_parallel_size * STRUCTURE_BYTES
    for rank, result in enumerate(results):
        assert result["violations"] == [], f"rank {rank}"
        assert result["left_on_device"] == [], f"rank {rank}: left on the device"
        assert result["saving_bytes"] <= in_flight, f"rank {rank}: {result['saving_bytes']} device bytes in flight"
        assert result["reassembling_bytes"] <= in_flight, f"rank {rank}: {result['reassembling_bytes']} while whole"
        assert in_flight < result["stage_bytes"], "the bound tells the tensors in flight from one stage's state"
