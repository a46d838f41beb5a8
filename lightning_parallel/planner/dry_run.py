"""The planner's dry run: one real training step of the model on fake tensors, its peak measured per rank.

Instead of a formula, the dry run executes a warm-up step and then one measured training step of the model, in
Lightning's order (forward and loss, ``zero_grad``, backward, gradient sync, optimizer step, ZeRO's parameter
all-gather: the last step's gradients live through the forward, as in a ``Trainer``) under the chosen layout. ZeRO
rows are held as ``ShardedOptimizerStrategy`` holds a model: the ``ZeroBackend`` (``distributed/zero/backends/``)
that the strategy's chooser ``backend_type`` picks, built from a ``ZeroConfig`` and a ``ZeroContext`` on
the (fake) mesh, and driven by the strategy's own calls (``convert_module``, ``setup_module``, ``setup_optimizers``,
``wait_for_parameters``, ``reduce_gradients``, ``after_optimizer_step``); so whatever the backend holds is measured
as the strategy holds it: fp32 master weights of 16-bit parameters (``precision="bf16-true"``), the parameter
all-gather in flight through the next forward (``overlap_param_gather``), HSDP when hybrid. Data parallelism is
``DistributedDataParallel`` on real tensors and a bucket-for-bucket stand-in of its reducer on fake ones (DDP's C++
reducer reads its tensors' data, which fake tensors have none of: :class:`_ReplicatedBuckets`).

Every tensor is a ``FakeTensor`` (torch's ``FakeTensorMode``): shapes, dtypes and storages of the right size, no
memory, no data. Collectives go to torch's fake process group, which lets this one process act as rank ``r`` of a
world of any size; so one simulated rank plans for 1,024 GPUs in seconds.

The peak is measured by :class:`~lightning_parallel.accounting.LiveTensorPeak`, the measure the demo table, the
monitor and ``benchmarks/peak_memory.py`` report: fake storages count their full ``nbytes``. Activations, autograd's
saved tensors, temporaries (the optimizer's ``foreach`` intermediates), communication buffers and activation
checkpointing are therefore what the code really allocates, not an estimate. Storages that only C++ holds (DDP's
buckets) count, as on a real run, from the first op of the measured step that touches them.

What a fake process group and fake tensors cannot do is answered locally for the length of the dry run only
(:func:`answered_locally`): ``dist.get_backend`` names the real run's backend (the fake group says ``"fake"``; ZeRO
picks its collectives by it), and ``nn.Module.to`` leaves a module whose tensors are already on the device and in
the dtype asked for as it is (moving a fake tensor swaps it in place, which torch refuses).

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
from lightning_parallel.distributed.tensor_parallel import apply_tensor_parallel, resolve_plan
from lightning_parallel.distributed.zero.backends import ZeroBackend, ZeroContext, backend_type
from lightning_parallel.distributed.zero.config import MasterWeights, OverlapParamGather, Stage, ZeroConfig
from lightning_parallel.planner._compat import (
    WAIT_TENSOR,
    FakeStore,
    FakeTensorMode,
    disable_current_modes,
    forget_cached_shardings,
    meshes_made_outside_fake_mode,
)

__all__ = [
    "DRY_RUN_STRATEGIES",
    "PRECISIONS",
    "DryRunError",
    "DryRunLayout",
    "DryRunWorkload",
    "answered_locally",
    "backend_device",
    "cast_floating_tensors",
    "dry_run",
    "fake_world_answers",
    "measure_step",
]

DRY_RUN_STRATEGIES = ("data_parallel", "zero1", "zero2", "zero3")
"""The layouts this module executes (the pipeline's: :mod:`.dry_run_pipeline`)."""

PRECISIONS: dict[str, torch.dtype] = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}
"""The Lightning precisions the dry run plays, with the dtype each converts the module (and floating inputs) to."""

TENSOR_PARALLEL_STRATEGIES = ("zero1", "zero2", "zero3")
"""The rows the dry run plays with ``tensor_parallel_size > 1`` (``ShardedOptimizerStrategy``'s stages)."""


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
    """The backend the real run will use: on ``"gloo"`` ZeRO-1/2 all-reduce gradient buckets, ZeRO-3 reduce-scatters
    by point-to-point sends, and both broadcast parameter shards (what
    :func:`~lightning_parallel.distributed.zero.buckets.default_gradient_reduction` and ``stage3_gloo.py`` pick
    there), on ``"nccl"`` they reduce-scatter and all-gather."""
    precision: str = "32-true"
    """As the Trainer's: one of :data:`PRECISIONS` (``"bf16-true"``: a bf16 model, which ZeRO steps through fp32
    masters unless ``master_weights=None``)."""
    master_weights: MasterWeights = "fp32"
    """ZeRO, as ``ShardedOptimizerStrategy``'s: with 16-bit parameters, ``"fp32"`` steps fp32 masters of the shard."""
    overlap_param_gather: OverlapParamGather = "auto"
    """ZeRO-1/2, as ``ShardedOptimizerStrategy``'s: the all-gather after the step in flight through the next
    forward (``"auto"``/``True``) or waited for at once (``False``)."""
    tensor_parallel_size: int = 1
    """ZeRO (stages 1-3), as ``ShardedOptimizerStrategy``'s: ranks that split each layer of the model's tensor-parallel
    plan (``tensor_parallel_plan()`` or a Hugging Face ``tp_plan``) over the mesh's innermost ``tensor`` axis, ZeRO
    sharding over the ``world_size / tensor_parallel_size`` data-parallel ranks (stages 1-2: flat buckets of the split
    weights' local slices; docs/tensor_parallel.md)."""

    def __post_init__(self) -> None:
        if self.strategy not in DRY_RUN_STRATEGIES:
            raise ValueError(f"`strategy={self.strategy!r}` cannot be dry-run; use one of {DRY_RUN_STRATEGIES}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"`precision={self.precision!r}` cannot be dry-run; use one of {tuple(PRECISIONS)}.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank={self.rank}` is outside the world of {self.world_size} ranks.")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f'`backend={self.backend!r}` is invalid: use "nccl" or "gloo".')
        if self.tensor_parallel_size != 1 and self.strategy not in TENSOR_PARALLEL_STRATEGIES:
            raise ValueError(
                f"`tensor_parallel_size={self.tensor_parallel_size}` is dry-run with ZeRO only (`strategy='zero1'`,"
                f" `'zero2'` or `'zero3'`, as `ShardedOptimizerStrategy(tensor_parallel_size=...)` takes it), not"
                f" {self.strategy!r}."
            )
        self.mesh_layout  # noqa: B018  # validates shard_size and tensor_parallel_size
        if self.strategy != "data_parallel":
            self.zero_config  # noqa: B018  # validates the ZeRO settings

    @property
    def mesh_layout(self) -> MeshLayout:
        """The strategy's mesh layout for this world: ``(replicate, shard, pp)``, and ``tensor`` when splitting."""
        return MeshLayout.for_sharding(self.world_size, self.shard_size, tensor_parallel_size=self.tensor_parallel_size)

    @property
    def zero_config(self) -> ZeroConfig:
        """The ZeRO settings of this layout, as ``ShardedOptimizerStrategy`` builds them from its arguments."""
        stages: dict[str, Stage] = {"zero1": 1, "zero2": 2, "zero3": 3}
        return ZeroConfig(
            stage=stages[self.strategy],
            shard_size=self.shard_size,
            bucket_cap_mb=self.bucket_cap_mb,
            master_weights=self.master_weights,
            overlap_param_gather=self.overlap_param_gather,
        )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating tensors and of the batch's floating inputs under :attr:`precision`."""
        return PRECISIONS[self.precision]


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
    literal (also through a collective, which on one simulated rank leaves rank-agreed values as they are), else 1.

    Also waits on a functional collective (``_c10d_functional.wait_tensor``, what ``DTensor``'s redistributions of
    tensor parallelism issue) as torch's eager kernel does, returning its input: the fake kernel returns a new
    tensor, which would count every gathered or reduced activation twice (measured: one extra logits-sized tensor
    in a Llama's vocabulary-gathered LM head)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is WAIT_TENSOR:
            return args[0]
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
        self.module = module
        self.model: nn.Module = module
        self.backend: ZeroBackend | None = None
        self.replicated: _ReplicatedBuckets | None = None
        if layout.strategy == "data_parallel":
            if not fake:  # fake tensors are the CPU's (and `.to` on them would swap every parameter)
                module.to(device)
            cast_floating_tensors(module, layout.dtype)  # the precision plugin's `convert_module`
            if workload.activation_checkpointing:
                apply_activation_checkpointing(module, workload.activation_checkpointing)
            if fake:  # DDP's C++ reducer reads its parameters' data: the stand-in does what it does
                self.replicated = _ReplicatedBuckets(module, bucket_cap_mb=layout.bucket_cap_mb)
            else:
                self.model = DistributedDataParallel(module, bucket_cap_mb=layout.bucket_cap_mb,
                                                     gradient_as_bucket_view=True)  # fmt: skip
            self.optimizer = workload.make_optimizer(module.parameters())
            return
        self.backend = _zero_backend(layout, device)
        # `ShardedOptimizerStrategy.setup`'s order: convert, split (tensor parallel), checkpoint activations, hold the
        # module, the optimizer.
        self.backend.convert_module(module, convert=lambda m: cast_floating_tensors(m, layout.dtype))
        if layout.tensor_parallel_size > 1:  # the strategy's `split_module`, on the backend's (fake) mesh
            mesh = getattr(self.backend, "mesh", None)
            assert mesh is not None  # a tensor axis needs 2 ranks or more
            plan = resolve_plan(module, owner=f"the dry run's tensor_parallel_size={layout.tensor_parallel_size}")
            apply_tensor_parallel(module, plan, mesh["tensor"], device)
        if workload.activation_checkpointing:
            apply_activation_checkpointing(module, workload.activation_checkpointing)
        self.backend.setup_module(module, device)
        self.optimizer = workload.make_optimizer(module.parameters())
        self.backend.setup_optimizers([self.optimizer])
        buckets = getattr(self.backend, "buckets", None)
        if fake and buckets is not None:  # ZeRO-1/2: one rank played, its own bucket order is every rank's
            buckets.agree_on_launch_order = False

    def step(self, tracker: LiveTensorPeak | None = None) -> None:
        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        phase("forward")
        backend = self.backend
        if backend is not None:  # as the strategy's `training_step`: the rest waits in the blocks' pre-hooks
            backend.wait_for_parameters(everywhere=False)
        batch = _to_device(self.workload.make_batch(), self.device, self.layout.dtype)
        loss = self.workload.loss(self.model, batch)
        del batch
        # Lightning's order: `training_step`, then `zero_grad`, then backward; the last step's gradients live
        # through this forward (ZeRO-3's sharded ones, a pipeline's whole stage's: see `dry_run_pipeline`).
        self.optimizer.zero_grad()
        phase("backward")
        if backend is not None:  # the strategy's `pre_backward`
            backend.wait_for_parameters()
        loss.backward()
        del loss
        if backend is not None:
            phase("gradient_sync")
            backend.reduce_gradients()
        phase("optimizer_step")
        self.optimizer.step()
        if backend is not None:
            phase("parameter_all_gather")
            backend.after_optimizer_step(self.optimizer)
        if self.replicated is not None:
            self.replicated.end_step()

    def categories(self) -> dict[str, list[Tensor]]:
        params: list[Tensor] = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        if self.backend is not None:
            grads += self.backend.gradient_buffers()
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
        if self.backend is not None:
            self.backend.abandon_in_flight()
            self.backend.teardown()
        if self.replicated is not None:
            self.replicated.remove_hooks()
        for param in self.module.parameters():
            param.grad = None


def _zero_backend(layout: DryRunLayout, device: torch.device) -> ZeroBackend:
    """The backend ``ShardedOptimizerStrategy`` holds the model with in ``layout`` (its chooser, its records), on the
    strategy's ``("replicate", "shard", "pp")`` mesh of this (real or fake) world (and ``"tensor"`` when splitting)."""
    config = layout.zero_config
    is_sharding = layout.world_size > 1
    keeps_masters = layout.dtype != torch.float32 and config.master_weights == "fp32"
    mesh = None
    if is_sharding:
        with disable_current_modes():  # a device mesh computes its coordinates from real tensors
            mesh = layout.mesh_layout.build(device.type)
    context = ZeroContext(rank=dist.get_rank(), world_size=layout.world_size, mesh=mesh)
    return backend_type(config.stage, is_sharding=is_sharding, keeps_masters=keeps_masters)(config, context)


def cast_floating_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    """The floating parameters and buffers of ``module`` in ``dtype``, as Lightning's ``bf16-true`` /
    ``16-true`` ``convert_module`` casts them (``module.to(dtype)``), through ``.data`` as ZeRO-3's fp32 masters are
    made: ``module.to`` would swap a fake tensor, which torch refuses (its fake mode holds a weak reference to it)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)


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


Replacement = tuple[Any, str, Any]
"""``(owner, attribute name, value)``: what :func:`answered_locally` puts in place for its block."""


@contextmanager
def answered_locally(replacements: Iterable[Replacement]) -> Iterator[None]:
    """For the block only: each ``owner.name`` is ``value``; every attribute is put back on exit, also on an error.

    Only the dry runs use it, only inside their fake world: what a fake process group cannot carry and fake tensors
    cannot do, answered as every rank of the real run would (:func:`fake_world_answers`; the pipeline's add the plan
    agreement, torch's stage metadata and held sends: :mod:`.dry_run_pipeline`). Nothing trains meanwhile.
    """
    replacements = list(replacements)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def fake_world_answers(backend: str) -> list[Replacement]:
    """What every dry run answers locally: ``dist.get_backend`` names ``backend``, the real run's (the fake group
    says ``"fake"``, and ZeRO picks its collectives by the backend's name); ``nn.Module.to`` leaves a module already
    where and what it is asked to be as it is (:func:`_to_unless_there`)."""

    def get_backend(group: Any = None) -> str:
        del group
        return backend

    return [
        (dist, "get_backend", get_backend),
        (nn.Module, "to", _to_unless_there(nn.Module.to)),
        *meshes_made_outside_fake_mode(),
    ]


def _to_unless_there(module_to: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``nn.Module.to`` that leaves a module alone when its tensors are already there: moving a fake tensor swaps it
    in place, which torch refuses (its fake mode holds a weak reference to it); the split and ZeRO's set-up move the
    module to the device it is on."""

    def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if all((device is None or t.device == device) and (dtype is None or t.dtype == dtype) for t in tensors):
            return module
        return module_to(module, *args, **kwargs)

    return to


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
            with (
                FakeTensorMode(allow_non_fake_inputs=True),
                _ControlScalars(),
                answered_locally(fake_world_answers(layout.backend)),
            ):
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


def _to_device(batch: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``batch`` (a tensor, or tuples and lists of them: what the workloads make) on ``device``, its floating tensors
    in ``dtype`` (as Lightning's ``bf16-true`` / ``16-true`` ``convert_input`` casts them)."""
    if isinstance(batch, Tensor):
        return batch.to(device, dtype=dtype) if batch.is_floating_point() else batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(item, device, dtype) for item in batch)
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

    pipeline = {"pipeline_batch": lambda batch: ((batch[0],), batch[1]), "output_loss": output_loss}
    return _workload(make_model, make_batch, loss, optimizer, activation_checkpointing, description, **pipeline)


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

    return _workload(make_model, make_inputs, loss, optimizer, activation_checkpointing, description)


def _workload(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[], Any],
    loss: Callable[[nn.Module, Any], Tensor],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
    activation_checkpointing: bool | str,
    description: str,
    **pipeline: Any,
) -> DryRunWorkload:
    """The workload functions' :class:`DryRunWorkload`: ``optimizer`` ``None`` keeps its default; ``pipeline``: its
    ``pipeline_batch`` and ``output_loss``."""
    extra: dict[str, Any] = {} if optimizer is None else {"make_optimizer": optimizer}
    return DryRunWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=loss,
        activation_checkpointing=activation_checkpointing,
        description=description,
        **pipeline,
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
