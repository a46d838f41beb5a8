"""The planner's dry run: one real training step of the model on fake tensors, its peak measured per rank.

Instead of a formula, the dry run executes a warm-up step and then one measured training step of the model, in
Lightning's order (forward and loss, ``zero_grad``, backward, gradient sync, optimizer step, ZeRO's parameter
all-gather: the last step's gradients live through the forward, as in a ``Trainer``) under the chosen layout, with
the project's own building blocks: ``ShardedParameterBuckets`` + ``ShardedOptimizer`` at ZeRO-1/2 (hybrid through a
shard and a replicate group), ``apply_fully_shard`` at ZeRO-3 (HSDP when hybrid) and a bucket-for-bucket
stand-in of ``DistributedDataParallel``'s reducer for data parallelism (DDP's C++ reducer reads its tensors' data,
which fake tensors have none of: :class:`_ReplicatedBuckets`). Every tensor is a ``FakeTensor`` (torch's
``FakeTensorMode``): shapes, dtypes and storages of the right size, no memory, no data. Collectives go to torch's fake
process group, which lets this one process act as rank ``r`` of a world of any size; so one simulated rank plans for
1,024 GPUs in seconds.

The peak is measured by :class:`~lightning_parallel.accounting.LiveTensorPeak`, the measure the demo table, the
monitor and ``benchmarks/peak_memory.py`` report: fake storages count their full ``nbytes``. Activations, autograd's
saved tensors, temporaries (the optimizer's ``foreach`` intermediates), communication buffers and activation
checkpointing are therefore what the code really allocates, not an estimate. Storages that only C++ holds (DDP's
buckets) count, as on a real run, from the first op of the measured step that touches them.

Data-dependent control values (``.item()``, ``.tolist()`` of a flag tensor) have no value on a fake tensor: they read
the tensor's constant where torch kept one, else 1 (every parameter got a gradient, every value finite). A model whose
forward branches on its data, or one that fails on fake tensors, is not dry-run: :func:`dry_run` raises
:class:`DryRunError` and the planner keeps its formula for that model (marked in the table).

:func:`measure_step` runs the very same step on real tensors in an initialised process group: the tests compare the
two (``tests/test_planner_dry_run.py``).
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_parallel.accounting import LiveTensorPeak, PeakMemory, live_tensors, optimizer_state_tensors
from lightning_parallel.distributed.activation_checkpointing import apply_activation_checkpointing
from lightning_parallel.distributed.mesh import MeshLayout
from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer
from lightning_parallel.distributed.zero.stage3_compat import initialise_root
from lightning_parallel.distributed.zero.stage3_gloo import GlooAllGather, GlooGradientReduction
from lightning_parallel.planner._compat import FakeStore, FakeTensorMode, disable_current_modes, forget_cached_shardings

__all__ = [
    "DRY_RUN_STRATEGIES",
    "DryRunError",
    "DryRunLayout",
    "DryRunWorkload",
    "backend_device",
    "dry_run",
    "measure_step",
]

DRY_RUN_STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3")
"""The layouts this module executes (the pipeline's: :mod:`.dry_run_pipeline`)."""


class DryRunError(RuntimeError):
    """The model could not run one step on fake tensors (data-dependent code, an op without a fake kernel, ...)."""


@dataclass(kw_only=True)
class DryRunLayout:
    """Where one rank stands: the strategy, the world and its groups, and the options that change what it holds."""

    strategy: str
    """``"data_parallel"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``."""
    world_size: int
    rank: int = 0
    """The simulated rank (its shard is the one measured; shards differ by at most a padding row)."""
    shard_size: int | None = None
    """ZeRO: ranks per shard group (``None``: the whole world); smaller than the world: hybrid (HSDP at stage 3)."""
    bucket_cap_mb: float = 25.0
    """ZeRO-1/2 bucket size, and DDP's."""
    backend: str = "nccl"
    """The backend the real run will use: on ``"gloo"`` ZeRO all-reduces gradient buckets and broadcasts parameter
    shards (what :func:`~lightning_parallel.distributed.zero.buckets.default_gradient_reduction` and
    ``stage3_gloo.py`` pick there), on ``"nccl"`` it reduce-scatters and all-gathers."""

    def __post_init__(self) -> None:
        if self.strategy not in DRY_RUN_STRATEGIES:
            raise ValueError(f"`strategy={self.strategy!r}` cannot be dry-run; use one of {DRY_RUN_STRATEGIES}.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank={self.rank}` is outside the world of {self.world_size} ranks.")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f'`backend={self.backend!r}` is invalid: use "nccl" or "gloo".')
        MeshLayout.for_sharding(self.world_size, self.shard_size)  # validates shard_size


@dataclass(kw_only=True)
class DryRunWorkload:
    """What one training step computes: the model, one batch, the loss and the optimizer."""

    make_model: Callable[[], nn.Module]
    """Builds the model (called under ``FakeTensorMode`` in a dry run: its parameters are fake)."""
    make_batch: Callable[[], Any]
    """One local batch (called under ``FakeTensorMode`` in a dry run)."""
    loss: Callable[[nn.Module, Any], Tensor]
    """``loss(model, batch)``: the scalar that backward starts from."""
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = field(
        default=lambda params: torch.optim.AdamW(params, lr=1e-4)
    )
    activation_checkpointing: bool | str = False
    """As the strategies' ``activation_checkpointing`` (``True``/``"full"`` or ``"selective"``)."""
    description: str = ""
    pipeline_batch: Callable[[Any], tuple[tuple[Any, ...], Any]] | None = None
    """A pipeline's view of a batch: ``(model inputs, target)``; the schedule cuts both into micro-batches."""
    output_loss: Callable[[Any, Any], Tensor] | None = None
    """``output_loss(output, target)``: a micro-batch's loss on the last stage (``None``: no pipeline dry run)."""


@dataclass
class StepPeak:
    """The measured step's peak on one rank (:class:`~lightning_parallel.accounting.PeakMemory`'s figures)."""

    peak_bytes: int
    breakdown: dict[str, int]
    phase: str | None

    @classmethod
    def of(cls, peak: PeakMemory) -> StepPeak:
        return cls(peak.peak_bytes, dict(peak.breakdown), peak.phase)


# ------------------------------------------------------------------------------------------------- fake scalars
class _ControlScalars(TorchDispatchMode):
    """Gives data-dependent reads of fake tensors a value: the constant torch kept for a small tensor made from a
    literal (also through a collective, which on one simulated rank leaves rank-agreed values as they are), else 1."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            constant = getattr(tensor, "constant", None)
            if constant is not None:
                return constant.item()
            if tensor.dtype == torch.bool:
                return True
            return 1.0 if tensor.is_floating_point() or tensor.is_complex() else 1
        if func.namespace != "c10d":
            return func(*args, **kwargs)
        kept = [
            (t, t.constant)  # type: ignore[attr-defined]
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, Tensor) and getattr(t, "constant", None) is not None
        ]
        out = func(*args, **kwargs)
        for tensor, constant in kept:  # the fake mode forgets a constant written to; a fake collective wrote nothing
            tensor.constant = constant  # type: ignore[attr-defined]
        return out


# ------------------------------------------------------------------------------------------ DDP's reducer, in Python
class _ReplicatedBuckets:
    """DDP's reducer with ``gradient_as_bucket_view=True`` (``DataParallelStrategy``'s default), bucket for bucket.

    Parameters in reverse registration order fill flat buckets of ``bucket_cap_mb`` (DDP's smaller 1 MiB first bucket
    applies only when ``bucket_cap_mb`` is left unset, and ``DataParallelStrategy`` always sets it); as
    backward accumulates a parameter's gradient, it is copied into its slot and ``.grad`` becomes a view of the slot
    (the fresh gradient is freed); a full bucket is divided by the world size and all-reduced in place. DDP's C++
    reducer holds its buckets where no Python object names them, so a live-tensor measurement counts each from the
    first op that touches it in the measured step: the stand-in allocates each at that moment and drops it with the
    step's ``zero_grad``. The first bucket is the exception: a real run holds it from the start of every step
    (measured against DDP: live before backward's first gradient), so the stand-in holds it throughout.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        cap, size = int(bucket_cap_mb * 1024 * 1024), 0
        for param in reversed(params):
            nbytes = param.numel() * param.element_size()
            if not self.buckets or size + nbytes > cap or self.buckets[-1][0].dtype != param.dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += nbytes
        self._slot: dict[nn.Parameter, tuple[int, int]] = {}
        for index, bucket in enumerate(self.buckets):
            offset = 0
            for param in bucket:
                self._slot[param] = (index, offset)
                offset += param.numel()
        self._flat: list[Tensor | None] = [None] * len(self.buckets)
        self._first = self._allocate(0) if self.buckets else None
        self._ready = [0] * len(self.buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    def _on_gradient(self, param: Tensor) -> None:
        assert isinstance(param, nn.Parameter) and param.grad is not None
        index, offset = self._slot[param]
        bucket = self.buckets[index]
        flat = self._flat[index]
        if flat is None:
            flat = self._flat[index] = self._allocate(index)
        view = flat[offset : offset + param.numel()].view_as(param)
        view.copy_(param.grad)
        param.grad = view
        self._ready[index] += 1
        if self._ready[index] == len(bucket):
            self._ready[index] = 0
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)

    def _allocate(self, index: int) -> Tensor:
        if index == 0 and getattr(self, "_first", None) is not None:
            return self._first  # type: ignore[return-value]
        bucket = self.buckets[index]
        return torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def end_step(self) -> None:
        """After ``zero_grad``: the buckets are no longer named by any gradient (see the class docstring)."""
        self._flat = [None] * len(self.buckets)


# ----------------------------------------------------------------------------------------------------- the step
class _StepRunner:
    """One rank's model, optimizer and wrappers for ``layout``, and the training step."""

    def __init__(
        self, workload: DryRunWorkload, layout: DryRunLayout, *, fake: bool, device: torch.device | None = None
    ) -> None:
        self.workload = workload
        self.layout = layout
        # Where the rank's tensors live: the CPU on fake tensors, else the process group's device (NCCL: the GPU).
        device = torch.device("cpu") if device is None else device
        self.device = device
        module = workload.make_model()
        if not fake:  # fake tensors are the CPU's (and `.to` on them would swap every parameter)
            module.to(device)
        if workload.activation_checkpointing:
            apply_activation_checkpointing(module, workload.activation_checkpointing)
        self.module = module
        self.model: nn.Module = module
        self.buckets: ShardedParameterBuckets | None = None
        self.sharded: ShardedOptimizer | None = None
        self.replicated: _ReplicatedBuckets | None = None
        mesh_layout = MeshLayout.for_sharding(layout.world_size, layout.shard_size)
        strategy = layout.strategy
        if strategy == "data_parallel":
            if fake:  # DDP's C++ reducer reads its parameters' data: the stand-in does what it does
                self.replicated = _ReplicatedBuckets(module, bucket_cap_mb=layout.bucket_cap_mb)
            else:
                self.model = DistributedDataParallel(module, bucket_cap_mb=layout.bucket_cap_mb,
                                                     gradient_as_bucket_view=True)  # fmt: skip
            self.optimizer = workload.make_optimizer(module.parameters())
        elif strategy in ("zero1", "zero2"):
            shard, replicate = _groups(mesh_layout, device.type)
            zero3.broadcast_from_rank0(module, device)
            self.optimizer = workload.make_optimizer(module.parameters())
            gloo = layout.backend == "gloo"
            self.buckets = ShardedParameterBuckets(
                module,
                stage=int(strategy[-1]),
                group=shard,
                replicate_group=replicate,
                bucket_cap_mb=layout.bucket_cap_mb,
                gradient_reduction="all_reduce" if gloo else "reduce_scatter",
                parameter_gather="broadcasts" if gloo else "all_gather",
            )
            self.buckets.agree_on_launch_order = False  # one rank played: its own order is every rank's
            self.sharded = ShardedOptimizer(self.optimizer, self.buckets)
        else:  # zero3
            zero3.broadcast_from_rank0(module, device)
            mesh = _mesh(mesh_layout, device.type)
            if not mesh_layout.is_hybrid:
                mesh = mesh["shard"]
            units = zero3.apply_fully_shard(module, mesh)
            initialise_root(units[-1])
            if layout.backend == "gloo" and mesh_layout.shard_size > 1:  # as `install_gloo_collectives` on gloo
                GlooAllGather(None).install(units)  # type: ignore[arg-type]
                GlooGradientReduction().install(units, replicated=mesh_layout.is_hybrid)  # type: ignore[arg-type]
            self.optimizer = workload.make_optimizer(module.parameters())

    def step(self, tracker: LiveTensorPeak | None = None) -> None:
        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        phase("forward")
        batch = _to_device(self.workload.make_batch(), self.device)
        loss = self.workload.loss(self.model, batch)
        del batch
        # Lightning's order: `training_step`, then `zero_grad`, then backward; the last step's gradients live
        # through this forward (ZeRO-3's sharded ones, a pipeline's whole stage's: see `dry_run_pipeline`).
        self.optimizer.zero_grad()
        phase("backward")
        loss.backward()
        del loss
        if self.buckets is not None:
            phase("gradient_sync")
            self.buckets.finish_gradient_sync()
        phase("optimizer_step")
        self.optimizer.step()
        if self.buckets is not None and self.sharded is not None:
            phase("parameter_all_gather")
            self.buckets.all_gather_parameters(self.sharded.bucket_indices)
        if self.replicated is not None:
            self.replicated.end_step()

    def categories(self) -> dict[str, list[Tensor]]:
        params: list[Tensor] = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        if self.buckets is not None:
            grads += self.buckets.gradient_buffers()
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": list(optimizer_state_tensors(self.optimizer)),
        }

    def measure(self, warmup_steps: int, existing: list[Tensor]) -> StepPeak:
        return measure_played_step(self, warmup_steps, existing=existing)

    def close(self) -> None:
        """Drop the gradient hooks: a hook held by a parameter in C++ keeps the whole step's state (buckets, model,
        optimizer) alive in a cycle the garbage collector cannot see, which a later measurement would count."""
        if self.buckets is not None:
            self.buckets.remove_hooks()
        if self.replicated is not None:
            self.replicated.remove_hooks()
        for param in self.module.parameters():
            param.grad = None


class PlayedStep(Protocol):
    """One rank's training step set up to be played (here and in :mod:`.dry_run_pipeline`)."""

    def step(self, tracker: LiveTensorPeak | None = None) -> None: ...

    def categories(self) -> dict[str, list[Tensor]]: ...

    def close(self) -> None: ...


def measure_played_step(played: PlayedStep, warmup_steps: int, *, existing: list[Tensor]) -> StepPeak:
    """The peak of ``played``'s step after ``warmup_steps`` steps (the optimizer state exists from the first step
    on); ``played`` is closed afterwards, also on an error. ``existing``: the tensors alive before ``played`` was
    built (:func:`~lightning_parallel.accounting.live_tensors`), whatever else the process holds (a notebook's data,
    models, earlier results), which are not the step's and do not count."""
    try:
        for _ in range(warmup_steps):
            played.step()
        gc.collect()
        with LiveTensorPeak(categories=played.categories, exclude=lambda: existing) as tracker:
            played.step(tracker)
        return StepPeak.of(tracker.result())
    finally:
        played.close()


def _groups(layout: MeshLayout, device_type: str) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """ZeRO's shard group and replicate group of this rank (``None``, ``None``: the whole world shards)."""
    if not layout.is_hybrid:
        return None, None
    mesh = _mesh(layout, device_type)
    return mesh.get_group("shard"), mesh.get_group("replicate")


def _mesh(layout: MeshLayout, device_type: str) -> Any:
    """The ``("replicate", "shard")`` device mesh of ``layout``, built on real tensors (also in a dry run)."""
    from torch.distributed.device_mesh import init_device_mesh

    with disable_current_modes():
        shape = (layout.replicate_size, layout.shard_size)
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


# ---------------------------------------------------------------------------------------------------- entry points
@contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        raise DryRunError(
            "The dry run acts as one rank of a fake process group, but a process group is already initialised in this"
            " process: plan before `init_process_group`, or in a separate process."
        )
    forget_cached_shardings()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_cached_shardings()


def dry_run(workload: DryRunWorkload, layout: DryRunLayout, *, warmup_steps: int = 1) -> StepPeak:
    """The peak bytes of live tensors of rank ``layout.rank`` over one training step, on fake tensors.

    Runs ``warmup_steps`` steps (the optimizer state exists from the first on) and then one measured step, all on
    fake tensors in a fake process group of ``layout.world_size`` ranks; no memory, data or network is used.

    Raises:
        DryRunError: the model cannot run on fake tensors (the message holds the reason), or a process group is
            already initialised in this process.
    """
    with _fake_world(layout.rank, layout.world_size), warnings.catch_warnings():
        # Code that compares data pointers (to skip a copy onto itself) reads 0 on every fake tensor: harmless.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), _ControlScalars():
                existing = live_tensors()
                runner = _StepRunner(workload, layout, fake=True)
                return runner.measure(warmup_steps, existing)
        except DryRunError:
            raise
        except Exception as error:  # any op without a fake kernel, data-dependent code, ...
            raise DryRunError(f"{workload.description or 'the model'} cannot run on fake tensors: {error}") from error


def measure_step(
    workload: DryRunWorkload, layout: DryRunLayout, *, warmup_steps: int = 1, device: torch.device | None = None
) -> StepPeak:
    """The same step as :func:`dry_run` on real tensors, in this process's initialised process group (rank
    ``dist.get_rank()`` of ``layout.world_size``); what a real run holds, measured the same way. The model, its
    batches and the groups' tensors live on ``device``; ``None``: the device of the group's backend
    (:func:`backend_device`: the current GPU under NCCL, which refuses CPU tensors; the CPU under gloo), as a
    strategy's root device is."""
    if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"measure_step needs an initialised process group of {layout.world_size} ranks.")
    device = device if device is not None else backend_device(str(dist.get_backend()))
    existing = live_tensors()
    return _StepRunner(workload, layout, fake=False, device=device).measure(warmup_steps, existing)


def backend_device(backend: str) -> torch.device:
    """The device a process-group backend's collectives take tensors on, per torch's
    ``Backend.default_device_backend_map``: ``"gloo"`` the CPU, ``"nccl"`` CUDA (its current device); a backend of
    several devices (``"cpu:gloo,cuda:nccl"``) its accelerator. ``ValueError`` for a backend torch maps to none."""
    if ":" in backend:
        types = [part.split(":", 1)[0] for part in backend.split(",")]
        return torch.device(next((t for t in types if t != "cpu"), "cpu"))
    types = [t for t, name in dist.Backend.default_device_backend_map.items() if name == backend.lower()]
    if not types:
        raise ValueError(f"`backend={backend!r}`: no device is known for it; pass `measure_step(..., device=...)`.")
    return torch.device("cpu" if "cpu" in types else types[0])


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples and lists of them: what the workloads make) on ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(item, device) for item in batch)
    return batch


# ------------------------------------------------------------------------------------------------------ workloads
def language_model_workload(
    make_model: Callable[[], nn.Module],
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    activation_checkpointing: bool | str = False,
    description: str = "",
) -> DryRunWorkload:
    """A causal language model's step: ``(batch_size, seq_len)`` token ids in, logits ``(B, T, V)`` out (a tensor, or an
    output with ``.logits`` as transformers' models return), cross-entropy against random next tokens."""

    def make_batch() -> tuple[Tensor, Tensor]:
        return (
            torch.randint(vocab_size, (batch_size, seq_len)),
            torch.randint(vocab_size, (batch_size, seq_len)),
        )

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = model(inputs)
        logits = getattr(logits, "logits", logits)
        value = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        del logits
        return value

    def output_loss(logits: Any, targets: Tensor) -> Tensor:
        logits = getattr(logits, "logits", logits)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    extra: dict[str, Any] = {} if optimizer is None else {"make_optimizer": optimizer}
    return DryRunWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=loss,
        activation_checkpointing=activation_checkpointing,
        description=description,
        pipeline_batch=lambda batch: ((batch[0],), batch[1]),
        output_loss=output_loss,
        **extra,
    )


def module_workload(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    *,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    activation_checkpointing: bool | str = False,
    description: str = "",
) -> DryRunWorkload:
    """Any module's step: ``model(*make_inputs())``, the loss the mean of its (first) floating output."""

    def loss(model: nn.Module, batch: tuple[Any, ...]) -> Tensor:
        output = model(*batch)
        first = next(t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point())
        return first.float().mean()

    extra: dict[str, Any] = {} if optimizer is None else {"make_optimizer": optimizer}
    return DryRunWorkload(
        make_model=make_model,
        make_batch=make_inputs,
        loss=loss,
        activation_checkpointing=activation_checkpointing,
        description=description,
        **extra,
    )


def materialise(meta_module: nn.Module) -> Callable[[], nn.Module]:
    """A builder of a copy of ``meta_module`` (a module on the ``meta`` device, as the planner's specs hold) with
    empty storages: under ``FakeTensorMode``, fake ones."""

    def build() -> nn.Module:
        with disable_current_modes():  # a copy of meta tensors, outside the fake mode
            copied = copy.deepcopy(meta_module)
        return copied.to_empty(device="cpu")

    return build
