"""The anchors: Lightning's and torch's own ways of doing what our strategies do, measured like ours.

:class:`MeasuredDDPStrategy` is Lightning's ``DDPStrategy`` plus the small protocol ``ParallelismMonitor`` reads
(:class:`~lightning_parallel.instrumentation.InstrumentedStrategy`), so the monitor counts its bytes as it counts
ours: the gradient all-reduce goes through the library's counting hook (the one ``DataParallelStrategy`` uses while a
monitor is attached, so both sides run the same Python hook), and ``memory_report()`` measures the local optimizer of
a ``ZeroRedundancyOptimizer``. ``ZeroRedundancyOptimizer``'s parameter broadcast is outside the ledger (it counts
all-reduce, reduce-scatter, all-gather and P2P), so that anchor's bytes on the wire are a lower bound.

:class:`MeasuredModelParallelStrategy` with :class:`FullyShardedGPT` is Lightning's FSDP2 path:
``ModelParallelStrategy`` (data parallel over every rank) and ``fully_shard`` applied per transformer block and to the
model in the module's ``configure_model``, as Lightning's documentation shows; the monitor counts FSDP2's all-gathers
and reduce-scatters with the same scoped tap it uses for our ZeRO-3 (which is FSDP2 too). With
``tensor_parallel_size=T`` and :class:`TensorParallelGPT` it is Lightning's TP + FSDP2 path (the plan written by hand
in ``configure_model``); the same tap counts tensor parallelism's ``DTensor`` collectives, as it does ours.

Lightning's ``FSDPStrategy``, ``ModelParallelStrategy`` and ``DeepSpeedStrategy`` re-run the script in every rank by
default; :func:`forked` (and :class:`MeasuredModelParallelStrategy`) starts them with ``fork`` instead. Where one
refuses to start (FSDP on CPU, DeepSpeed not installed), the harness reports it as not available, with the reason.
:func:`deepspeed` trains on CPU through :func:`benchmarks.deepspeed_anchor.cpu_deepspeed_strategy`, which skips
Lightning's CUDA-only checks (the bypasses are listed in that module's docstring; DeepSpeed is an optional install
described there).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from typing_extensions import override

from lightning_parallel._compat import MultiProcessingLauncher
from lightning_parallel.accounting import CommunicationStats, MemoryReport, module_memory_report
from lightning_parallel.demos import GPTLightningModule
from lightning_parallel.distributed.compression import low_precision_allreduce_hook
from lightning_parallel.instrumentation import Instrumentation, StrategyEvents

__all__ = [
    "FullyShardedGPT",
    "MeasuredDDPStrategy",
    "MeasuredModelParallelStrategy",
    "TensorParallelGPT",
    "ZeroRedundancyGPT",
    "deepspeed",
    "forked",
    "fsdp_shard_grad_op",
]


class MeasuredDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` (fork), counted and measured by ``ParallelismMonitor`` like our strategies."""

    def __init__(self) -> None:
        super().__init__(start_method="fork")
        self.track_communication = False
        self.communication_stats = CommunicationStats()
        self.events = StrategyEvents()  # never emits: DDP's waits run inside autograd

    def instrumentation(self) -> Instrumentation:
        return Instrumentation(data_parallel_size=self.world_size)

    def memory_report(self) -> MemoryReport:
        """Parameters, ``.grad`` and the state of the optimizer this rank steps (the local one of ZeRO's)."""
        optimizer = self.optimizers[0] if self.optimizers else None
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer = optimizer.optim
        assert self.lightning_module is not None
        return module_memory_report(self.lightning_module, optimizer)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()  # Lightning registers comm hooks on CUDA only, and none unless given one
        if self.track_communication:
            self.model.register_comm_hook(None, low_precision_allreduce_hook(None, self.communication_stats))  # type: ignore[union-attr]


class ZeroRedundancyGPT(GPTLightningModule):
    """The demo module with its AdamW wrapped in torch's ``ZeroRedundancyOptimizer`` (optimizer state sharded)."""

    @override
    def configure_optimizers(self) -> ZeroRedundancyOptimizer:
        adamw = super().configure_optimizers()
        groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in adamw.param_groups]
        defaults = {key: adamw.defaults[key] for key in ("lr", "betas", "eps")}
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **defaults)


class FullyShardedGPT(GPTLightningModule):
    """The demo module sharded with FSDP2 in ``configure_model``: ``fully_shard`` on each transformer block, then on
    the whole model (the root unit, which also holds the embedding, final norm and head), over the device mesh's
    ``data_parallel`` axis; AdamW is created afterwards, over the sharded (``DTensor``) parameters."""

    @override
    def configure_model(self) -> None:
        assert self.device_mesh is not None, "ModelParallelStrategy sets the mesh before `configure_model`"
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class _KeepParentWeightsLauncher(MultiProcessingLauncher):
    """Lightning's fork launcher, except that the parent keeps its own weights after the fit: rank 0's state dict of
    an FSDP2 model holds ``DTensor`` shards, which ``torch.load`` cannot map into the parent's plain model
    ("Callable map_location not supported with _rebuild_wrapper_subclass"). The benchmark reads the monitor's summary
    and the logged metrics, which still come back, never the parent's weights."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        output = super()._collect_rank_zero_results(trainer, results)
        return None if output is None else output._replace(weights_path=None)


class MeasuredModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (fork; every rank data parallel, or ``tensor_parallel_size`` ranks per
    tensor-parallel group and the rest data parallel), its FSDP2 and ``DTensor`` collectives counted by the monitor's
    tap; gloo on CPU (Lightning picks the backend from the device)."""

    def __init__(self, tensor_parallel_size: int = 1) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=tensor_parallel_size)
        self.track_communication = False
        self.communication_stats = CommunicationStats()
        self.events = StrategyEvents()  # never emits: FSDP2's waits run inside its hooks and autograd

    @property
    def tensor_parallel_size(self) -> int:
        size = self._tensor_parallel_size
        assert isinstance(size, int), "set in __init__"
        return size

    @override
    def setup_environment(self) -> None:
        # "auto" would be the number of nodes: every process not in a tensor-parallel group is data parallel.
        self._data_parallel_size = self.num_processes * self.num_nodes // self.tensor_parallel_size
        super().setup_environment()

    @override
    def _configure_launcher(self) -> None:  # Lightning's hook for choosing the launcher (it re-runs the script)
        self._launcher = _KeepParentWeightsLauncher(self, start_method="fork")

    def instrumentation(self) -> Instrumentation:
        return Instrumentation(data_parallel_size=self.world_size // self.tensor_parallel_size, tap="fsdp")


class TensorParallelGPT(GPTLightningModule):
    """The demo module split by tensor parallelism and sharded with FSDP2 in ``configure_model``, as a user of
    Lightning's ``ModelParallelStrategy`` writes it (Lightning's TP + FSDP2 example): the plan by hand in torch's
    styles, ``parallelize_module`` on each block over the mesh's ``tensor_parallel`` axis, then ``fully_shard`` on
    each block and on the model over its ``data_parallel`` axis. The same plan as the GPT's own
    ``tensor_parallel_plan()``, which ours reads: the MLP split Megatron's way, the attention's fused q/k/v projection
    split with its output gathered (whole heads on every rank) and its output projection split on its input features.
    """

    @override
    def configure_model(self) -> None:
        assert self.device_mesh is not None, "ModelParallelStrategy sets the mesh before `configure_model`"
        tensor_mesh, data_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        plan = {
            "attn.c_attn": ColwiseParallel(output_layouts=Replicate()),
            "attn.c_proj": RowwiseParallel(input_layouts=Replicate()),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        for block in self.model.blocks:
            parallelize_module(block, tensor_mesh, plan)
        for block in self.model.blocks:
            fully_shard(block, mesh=data_mesh)
        fully_shard(self.model, mesh=data_mesh)


def forked(strategy_class: type[Strategy]) -> type[Strategy]:
    """A subclass of a Lightning strategy that starts its ranks with ``fork`` (its own launcher re-runs the script)."""

    class Forked(strategy_class):  # type: ignore[valid-type,misc]
        @override
        def _configure_launcher(self) -> None:  # Lightning's hook for choosing the launcher
            self._launcher = MultiProcessingLauncher(self, start_method="fork")

    Forked.__name__ = Forked.__qualname__ = f"Forked{strategy_class.__name__}"
    return Forked


def fsdp_shard_grad_op() -> Strategy:
    return forked(FSDPStrategy)(sharding_strategy="SHARD_GRAD_OP")


def deepspeed(stage: int) -> Strategy:
    """Lightning's ``DeepSpeedStrategy(stage=stage)`` (fork), on CPU too.

    On CPU, Lightning refuses DeepSpeed (``setup_environment``: "only supported on CUDA GPUs"; ``setup_distributed``:
    device indices must be ``0..N-1``, a CPU device has none) and hands DeepSpeed ``device_rank=None`` (the CPU
    device's index). ``cpu_deepspeed_strategy`` skips exactly those two checks and passes the local rank instead;
    sound because DeepSpeed's CPU accelerator keeps every tensor on ``cpu`` and runs its collectives through
    ``torch.distributed`` on the gloo group Lightning creates for a CPU device. It also keeps DeepSpeed from
    JIT-compiling its C++ shared-memory all-reduce (an inference-only op) and sets the buckets to our 25 MiB.
    Without DeepSpeed installed, Lightning raises its "DeepSpeed is not available" error here (kept as the reason).
    """
    if not torch.cuda.is_available():
        from benchmarks.deepspeed_anchor import cpu_deepspeed_strategy

        return cpu_deepspeed_strategy(stage, wrap=forked)
    return forked(DeepSpeedStrategy)(stage=stage)
