"""The dry run of a pipeline rank: torch's own schedule on the rank's own stages, on fake tensors.

One process acts as rank ``r`` of a fake process group (as :mod:`.dry_run` does for data parallelism and ZeRO) and
runs what a pipeline rank runs: ``split_into_stages`` (the stage plan, this rank's stages kept, the others replaced by
placeholders, the sync over the stage's replicas, ZeRO inside the pipeline), torch's ``PipelineStage`` objects and
schedule (``build_torch_schedule``), one warm-up step and one measured step (``schedule.step`` with the loss on the
last stage, the sync's gradient reduction, the optimizer step, ZeRO's parameter all-gather, ``zero_grad``). The peak
is therefore what torch's schedule really holds: every micro-batch's saved activations until its backward, the
receive buffers torch allocates for every micro-batch, the last stage's outputs kept for the step, the gradients
sent back, weight-gradient closures of the zero-bubble schedules.

What a fake process group cannot carry is answered locally, only while the dry run runs:

* the plan agreement (``all_gather_object`` of the stage boundaries): every rank computes the same plan, so each
  rank's entry is this rank's;
* torch's metadata inference, which sends each stage's output shapes to the next stage and its input-gradient shapes
  to the previous one: before the split, the whole model's stages run once on fake tensors and the receive answers
  from their outputs, the send sends nothing (``PipelineStage._recv_meta`` / ``_send_meta`` on torch >= 2.12,
  ``dist.recv_object_list`` / ``send_object_list`` inside ``_shape_inference`` on 2.11: see
  :func:`lightning_parallel.distributed.pipeline._compat.local_metadata_inference`).

Received activations and gradients are fake tensors of the right shape (the fake group's receive writes nothing).
:func:`measure_pipeline_step` runs the same step on real tensors in an initialised process group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import schedules

from lightning_parallel.accounting import LiveTensorPeak, live_tensors, optimizer_state_tensors
from lightning_parallel.distributed.activation_checkpointing import apply_activation_checkpointing
from lightning_parallel.distributed.pipeline import _compat, stage_split
from lightning_parallel.distributed.pipeline.config import PipelineConfig
from lightning_parallel.distributed.pipeline.model_plan import pipeline_layers_and_call
from lightning_parallel.distributed.pipeline.parallel_dims import build_parallel_dims
from lightning_parallel.distributed.pipeline.schedule import resolve_schedule
from lightning_parallel.distributed.pipeline.stage_module import StageModule
from lightning_parallel.distributed.pipeline.stage_plan import plan_for_example
from lightning_parallel.distributed.pipeline.stage_split import StageHolding, split_into_stages
from lightning_parallel.distributed.pipeline.torch_schedule import build_torch_schedule
from lightning_parallel.distributed.pipeline.zero import pipeline_zero_config
from lightning_parallel.planner._compat import FakeTensorMode, disable_current_modes
from lightning_parallel.planner.dry_run import (
    DryRunError,
    DryRunWorkload,
    Replacement,
    StepPeak,
    _ControlScalars,
    _fake_world,
    answered_locally,
    fake_world_answers,
    measure_played_step,
)

__all__ = ["PIPELINE_ZERO_STAGES", "PipelineLayout", "dry_run_pipeline", "measure_pipeline_step"]

PIPELINE_ZERO_STAGES = (0, 1, 2)
"""ZeRO stages inside the pipeline the dry run executes. ZeRO-3 inside a pipeline fails on fake tensors (FSDP's lazy
initialisation of the stages' sharded copies: a size mismatch, not investigated yet): the planner keeps the formula
for those rows."""


@dataclass(kw_only=True)
class PipelineLayout:
    """Where one pipeline rank stands: the world, the pipeline's size, schedule and counts, ZeRO inside it.

    The counts resolve and validate as ``PipelineParallelStrategy``'s do: into its own record, :attr:`config`
    (:class:`~lightning_parallel.distributed.pipeline.config.PipelineConfig`), which the dry run reads."""

    world_size: int
    pipeline_parallel_size: int
    rank: int = 0
    schedule: str = "1F1B"
    num_microbatches: int | None = None
    """Micro-batches per batch (``None``: the strategy's ``"auto"``, one per stage)."""
    stages_per_rank: int | None = None
    """``None``: the strategy's ``"auto"``, the schedule's default."""
    zero_stage: int = 0
    """ZeRO over each stage's data-parallel replicas (0: replicated); one of :data:`PIPELINE_ZERO_STAGES`."""
    partition: str = "flops"
    backend: str = "nccl"
    """The backend the real run will use (ZeRO inside the pipeline picks its collectives by it, as in
    :class:`~.dry_run.DryRunLayout`)."""
    config: PipelineConfig = field(init=False)
    """The strategy's record of the counts above, every ``None`` (``"auto"``) resolved."""

    def __post_init__(self) -> None:
        if self.zero_stage not in PIPELINE_ZERO_STAGES:
            raise ValueError(
                f"`zero_stage={self.zero_stage}` inside a pipeline cannot be dry-run; use one of {PIPELINE_ZERO_STAGES}"
                " (the planner keeps the formula for the others)."
            )
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f'`backend={self.backend!r}` is invalid: use "nccl" or "gloo".')
        if self.world_size % self.pipeline_parallel_size:  # the planner's words; `config.validate()` checks it too
            p, n = self.pipeline_parallel_size, self.world_size
            raise ValueError(f"`pipeline_parallel_size={p}` does not divide `world_size={n}`.")
        self.config = PipelineConfig.resolve(
            world_size=self.world_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            schedule=resolve_schedule(self.schedule),
            stages_per_rank="auto" if self.stages_per_rank is None else self.stages_per_rank,
            num_microbatches="auto" if self.num_microbatches is None else self.num_microbatches,
        )
        self.config.validate()
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank={self.rank}` is outside the world of {self.world_size} ranks.")


class _PipelineStepRunner:
    """One pipeline rank's stages, sync, optimizer and torch schedule, and the training step."""

    def __init__(self, workload: DryRunWorkload, layout: PipelineLayout, *, fake: bool) -> None:
        if workload.pipeline_batch is None or workload.output_loss is None:
            raise DryRunError(f"{workload.description or 'the workload'} has no pipeline loss (`output_loss`).")
        self.workload, self.layout = workload, layout
        module = workload.make_model()
        if workload.activation_checkpointing:
            apply_activation_checkpointing(module, workload.activation_checkpointing)
        self.module = module
        config = layout.config
        zero_config = pipeline_zero_config(layout.zero_stage, schedule=config.schedule)
        with disable_current_modes():  # a device mesh computes its coordinates from real tensors
            dims = build_parallel_dims(
                config.world_size,
                layout.rank,
                pipeline_parallel_size=config.pipeline_parallel_size,
                zero_config=zero_config,
            )
        self.dims = dims
        args, _ = workload.pipeline_batch(workload.make_batch())
        rows = args[0].shape[0] // config.num_microbatches
        example: tuple[tuple[Any, ...], dict[str, Any]] = (tuple(a[:rows] for a in args), {})
        del args
        layers, _ = pipeline_layers_and_call(module)
        self.metas = _stage_metas(layers, example, layout) if fake else None
        device = torch.device("cpu")
        with self._answered_locally():
            self.run = split_into_stages(
                module,
                dims=dims,
                device=device,
                num_stages=config.num_stages,
                schedule=config.effective_schedule,
                num_microbatches=config.num_microbatches,
                example=example,
                partition=layout.partition,  # type: ignore[arg-type]
                verify_layers=False,
                holding=StageHolding(zero_config=zero_config),
            )
            self.optimizer = workload.make_optimizer(module.parameters())
            self.run.setup_optimizers([self.optimizer])
            buckets = getattr(self.run.backend, "buckets", None)
            if fake and buckets is not None:  # ZeRO-1/2: one rank played, its own bucket order is every rank's
                buckets.agree_on_launch_order = False
            assert self.run.engine is not None
            self.runtime = build_torch_schedule(
                schedule=config.effective_schedule,
                plan=self.run.plan,
                layers=self.run.engine.layers,  # type: ignore[arg-type]  # only this rank's, never None, are read
                dims=dims,
                num_microbatches=config.num_microbatches,
                device=device,
                loss_fn=self._loss,
            )

    @contextmanager
    def _answered_locally(self) -> Iterator[None]:
        """In a dry run: what a fake process group cannot carry or fake tensors cannot do, answered as every rank
        would (see the module docstring); a real run: nothing changed."""
        if self.metas is None:
            yield
            return
        metas = self.metas

        def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
            object_list[:] = [obj] * len(object_list)  # every rank computed the same plan

        replacements: list[Replacement] = [
            (dist, "all_gather_object", all_gather_object),
            *fake_world_answers(self.layout.backend),
            *_compat.local_metadata_inference(metas.__getitem__),
            (schedules, "_batch_p2p", _holding(schedules._batch_p2p)),
            (stage_split, "offload_layers", _offload_fake_layers),
        ]
        with answered_locally(replacements):
            yield

    def _loss(self, output: Any, target: Any) -> Tensor:
        if not self.runtime_initialized():
            outputs = output if isinstance(output, tuple) else (output,)
            return torch.stack([o.float().sum() for o in outputs]).sum() * 0.0
        assert self.workload.output_loss is not None
        return self.workload.output_loss(output, target) / self.layout.config.num_microbatches

    def runtime_initialized(self) -> bool:
        """Whether torch finished its metadata inference (which calls the loss once on a dummy output)."""
        runtime = getattr(self, "runtime", None)
        return runtime is not None and _compat.schedule_backward_initialized(runtime.schedule)

    def step(self, tracker: LiveTensorPeak | None = None) -> None:
        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        phase("schedule")
        assert self.workload.pipeline_batch is not None
        args, target = self.workload.pipeline_batch(self.workload.make_batch())
        runtime = self.runtime
        # As `PipelineParallelStrategy.training_step` in Lightning's loop: the schedule runs with the last step's
        # gradients set aside (Lightning zeroes them after `training_step`, before its backward), so they live
        # through the whole schedule.
        params = [p for p in self.module.parameters() if p.device.type != "meta"]
        previous = [p.grad for p in params]
        for param in params:
            param.grad = None
        with self._answered_locally():
            runtime.schedule.step(  # as the engine steps: the last stage keeps no micro-batch's output
                *(args if runtime.has_first_stage else ()),
                target=target if runtime.has_last_stage else None,
                return_outputs=False,
            )
            del args, target, previous
            phase("gradient_sync")
            self.run.backend.reduce_gradients()
            phase("optimizer_step")
            self.optimizer.step()
            self.run.backend.after_optimizer_step(self.optimizer)

    def categories(self) -> dict[str, list[Tensor]]:
        params: list[Tensor] = [p for p in self.module.parameters() if p.device.type != "meta"]
        return {
            "parameters": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_state": list(optimizer_state_tensors(self.optimizer)),
        }

    def measure(self, warmup_steps: int, existing: list[Tensor]) -> StepPeak:
        return measure_played_step(self, warmup_steps, existing=existing)

    def close(self) -> None:
        """Drop the sync's hooks and the gradients: what a hook holds stays alive in a cycle the garbage collector
        cannot see, and a later measurement in this process (the next rank's dry run) would count it."""
        with self._answered_locally():
            self.run.backend.teardown()
        for param in self.module.parameters():
            param.grad = None
        self.runtime.stages.clear()


class _HeldWork:
    """A fake group's P2P work holding its op's tensor as long as the work is referenced, as a real backend's work
    does (gloo's and NCCL's keep the tensors they send or receive): torch's schedules keep the works of their sends
    until they wait on them (the multi-stage ones until the end of the step), and with them the sent activations and
    input gradients."""

    def __init__(self, work: Any, tensors: list[Tensor]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)


def _holding(batch_p2p: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def held(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
        works = batch_p2p(p2p_ops, desc=desc)
        tensors = [op.tensor for op in p2p_ops]
        if len(works) == len(p2p_ops):
            return [_HeldWork(work, [tensor]) for work, tensor in zip(works, tensors, strict=True)]
        return [_HeldWork(work, tensors) for work in works]  # one coalesced work for the batch

    return held


def _offload_fake_layers(layers: Sequence[nn.Module], indices: Sequence[int], *, keep: Collection[int] = ()) -> None:
    """``offload_layers`` for fake tensors: another rank's layers on ``meta``. A fake tensor cannot be swapped in place
    (torch's fake mode holds a weak reference to each), so each parameter and buffer is replaced by a ``meta`` one."""
    for index in indices:
        for submodule in layers[index].modules():
            if id(submodule) in keep:
                continue
            for name, param in submodule._parameters.items():
                if param is not None:
                    submodule._parameters[name] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
                    )
            for name, buffer in submodule._buffers.items():
                if buffer is not None:
                    submodule._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")


def _stage_metas(
    layers: list[nn.Module], example: tuple[tuple[Any, ...], dict[str, Any]], layout: PipelineLayout
) -> dict[int, Any]:
    """Each stage's output metadata (what torch's metadata inference sends on), the whole model's stages run once
    on fake tensors (also the input-gradient shapes sent back: the same as the previous stage's outputs)."""
    config = layout.config
    plan = plan_for_example(
        layers,
        example,
        partition=layout.partition,  # type: ignore[arg-type]
        num_stages=config.num_stages,
        pipeline_parallel_size=config.pipeline_parallel_size,
        warn=lambda message: None,
        placement=config.spec.placement,
    )
    metas = {}
    args: tuple[Any, ...] = example[0]
    for stage in range(plan.num_stages):  # with autograd on, as torch's inference runs for training: the activations
        module = StageModule(  # sent on require grad, and so do the receive buffers made from their metadata
            [layers[i] for i in plan.layers_of(stage)], is_first=stage == 0, is_last=stage == plan.num_stages - 1
        )
        output = module(*args)
        args = tuple(
            a.detach().requires_grad_(a.requires_grad) for a in (output if isinstance(output, tuple) else (output,))
        )
        metas[stage] = tuple(_on_meta(a) for a in args)  # shapes only: holds no bytes the peak would count
    return metas


def _on_meta(value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return meta.requires_grad_(value.requires_grad)


def dry_run_pipeline(workload: DryRunWorkload, layout: PipelineLayout, *, warmup_steps: int = 1) -> StepPeak:
    """The peak bytes of live tensors of pipeline rank ``layout.rank`` over one training step, on fake tensors."""
    with _fake_world(layout.rank, layout.world_size), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), _ControlScalars():
                existing = live_tensors()
                runner = _PipelineStepRunner(workload, layout, fake=True)
                return runner.measure(warmup_steps, existing)
        except DryRunError:
            raise
        except Exception as error:
            raise DryRunError(f"{workload.description or 'the model'} cannot run on fake tensors: {error}") from error


def measure_pipeline_step(workload: DryRunWorkload, layout: PipelineLayout, *, warmup_steps: int = 1) -> StepPeak:
    """The same step as :func:`dry_run_pipeline` on real tensors, in this process's initialised process group."""
    if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"measure_pipeline_step needs an initialised process group of {layout.world_size} ranks.")
    existing = live_tensors()
    return _PipelineStepRunner(workload, layout, fake=False).measure(warmup_steps, existing)
