"""One pipeline step of a LightningModule's own ``*_step`` method on torch's stages and schedules.

No Trainer here: :class:`PipelineEngine` takes the module, its layers and the stage plan, and runs a step on one
batch: every rank finds the model input by running the step up to ``self(...)``; the schedule moves micro-batches
through the stages; the rank with the last stage runs the step once per micro-batch with ``self(...)`` answered by
the pipeline; the result (loss, log calls, predictions) is broadcast to the other ranks of the pipeline. The step's
random draws before ``self(...)`` are recorded in the first run and replayed in the micro-batches' runs
(:mod:`.random_draws`), so every rank and micro-batch sees the same values.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_parallel.distributed.pipeline.contract import (
    PIPELINE_INPUTS_HOOK,
    ContractError,
    ModelCall,
    aggregate_logs,
    model_inputs_of_batch,
    run_step_with_output,
    step_loss,
    to_portable,
)
from lightning_parallel.distributed.pipeline.microbatch import (
    batch_size_of,
    check_batch_rows,
    detached_cpu,
    pad_batch,
    slice_batch,
)
from lightning_parallel.distributed.pipeline.parallel_dims import ParallelDims
from lightning_parallel.distributed.pipeline.random_draws import (
    RecordedDraws,
    agree_on_seed,
    draw_seed,
    recording_draws,
    replaying_draws,
    seed_default_generators,
)
from lightning_parallel.distributed.pipeline.side_inputs import side_input_dtypes
from lightning_parallel.distributed.pipeline.stage_plan import StagePlan
from lightning_parallel.distributed.pipeline.torch_schedule import TorchSchedule, build_torch_schedule
from lightning_parallel.distributed.pipeline.torch_stage import ChunkObserver, P2PObserver

__all__ = ["PipelineEngine", "StepOutcome"]


@dataclass
class StepOutcome:
    """What every rank of the pipeline learns from one step (identical on all of them)."""

    logs: list[tuple[Any, ...]] = field(default_factory=list)
    """The step's log calls, aggregated over micro-batches (see :func:`contract.aggregate_logs`)."""
    loss: Tensor | None = None
    """Training: the batch's mean loss (the mean over micro-batches of the step's loss), on CPU."""
    result: Any = None
    """Predict: the step's outputs of all micro-batches, concatenated along dim 0 when they are tensors."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Training: the non-loss entries of a dict the step returned (last micro-batch's)."""


@dataclass
class _StepState:
    step: str
    micro_batches: list[tuple[tuple[Any, ...], dict[str, Any]]]
    divisor: float
    results: dict[int, Any] = field(default_factory=dict)
    records: dict[int, list[Any]] = field(default_factory=dict)
    draws: RecordedDraws | None = None
    """The random draws of the run that learnt the input, replayed in each micro-batch's run of the step."""
    batch_size: int = 0
    bounds: list[tuple[int, int]] = field(default_factory=list)
    """Rows ``(start, stop)`` of each micro-batch in the batch."""


def _slice_output(output: Any, rows: int) -> Any:
    if isinstance(output, Tensor):
        return output[:rows]
    return tuple(o[:rows] for o in output)


def _signature(value: Any) -> tuple[Any, ...]:
    """Shape and dtype of each tensor of ``value``, in order (namedtuples, mappings and dataclasses walked as
    Lightning walks batches): what torch sizes a schedule's buffers from."""
    found: list[tuple[tuple[int, ...], torch.dtype]] = []
    apply_to_collection(value, Tensor, lambda t: found.append((tuple(t.shape), t.dtype)), allow_frozen=True)
    return tuple(found)


class PipelineEngine:
    """Runs steps of ``module`` through torch's pipeline schedules on this rank's stages.

    Args:
        module: The LightningModule (its non-local layers already replaced by ``RemoteLayer``).
        layers: All pipeline layers by index; only this rank's entries are used.
        plan: The stage plan.
        dims: Ranks and process groups.
        schedule: Canonical schedule name (``"1F1B"``, ...), used for training; evaluation runs forward-only.
        num_microbatches: Micro-batches per batch.
        device: This rank's device.
        call: The model call of the step that the pipeline answers (default: ``self(...)`` of ``module``).
        on_chunk: Told of every forward/backward chunk this rank's stages run (the strategy's events).
        on_p2p: Told of every P2P op (``"send"``/``"recv"``, bytes) this rank's stages send or receive.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        layers: Sequence[nn.Module | None],
        plan: StagePlan,
        dims: ParallelDims,
        schedule: str,
        num_microbatches: int,
        device: torch.device,
        call: ModelCall | None = None,
        on_chunk: ChunkObserver | None = None,
        on_p2p: P2PObserver | None = None,
    ) -> None:
        self.module = module
        self.call = call or ModelCall(module)
        self.layers = layers
        self.plan = plan
        self.dims = dims
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.device = device
        self.on_chunk, self.on_p2p = on_chunk, on_p2p
        self._torch_schedules: dict[tuple[Any, ...], TorchSchedule] = {}
        self._state: _StepState | None = None
        self._current: TorchSchedule | None = None
        self._draws: RecordedDraws | None = None  # the last `capture_inputs`'s, until its step runs
        self._draw_base_seed: int | None = None
        self._batches_drawn = 0
        self._sending: list[tuple[dist.Work, Tensor]] = []
        """The last outcome's sends and their buffers (the last stage's rank), until waited for."""

    @property
    def last_stage_global_rank(self) -> int:
        """Global rank (in this replica) that runs the last stage."""
        return self.dims.pipeline_global_rank(self.plan.rank_of_stage(self.plan.num_stages - 1))

    @property
    def has_last_stage(self) -> bool:
        return self.dims.global_rank == self.last_stage_global_rank

    def capture_inputs(self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        """The arguments of the step's ``self(...)`` call and their batch size.

        Every rank of the pipeline calls it for every batch (the first call agrees on a seed: a collective). The
        random draws of the run that learns the input are recorded, and replayed by the next :meth:`train_step` or
        :meth:`eval_step` in the step's runs on micro-batches (a step called without this runs as drawn).
        """
        declared = getattr(self.module, PIPELINE_INPUTS_HOOK, None) is not None
        source = f"`{PIPELINE_INPUTS_HOOK}(batch)`" if declared else f"`{step}` (run up to the model call)"
        seed = self._next_draw_seed()
        with recording_draws(device=self.device, seed=seed, source=source, exhaustive=not declared) as draws:
            model_inputs = model_inputs_of_batch(self.module, step, args, kwargs, call=self.call)
        self._draws = draws if self.has_last_stage else None  # only the last stage runs the step again
        # torch 2.11's first stage compares each micro-batch's strides with the example it inferred shapes from (a
        # contiguous one): a sliced batch (`self(tokens[:, :-1])`) raised "stride mismatch". Row chunks of a
        # contiguous input are contiguous on every release; the copy is the input's, not the activations'.
        model_inputs = apply_to_collection(model_inputs, Tensor, Tensor.contiguous)
        size = batch_size_of(model_inputs)
        if size is None:
            raise ContractError(
                f"`{step}` called the model without a tensor argument with a batch dimension; the pipeline splits"
                " the model's input into micro-batches along dim 0."
            )
        if args:
            check_batch_rows(args[0], size, step=step)
        return model_inputs, size

    # ------------------------------------------------------------------ training
    def train_step(
        self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, model_inputs: Any, divisor: float
    ) -> StepOutcome:
        """Forward and backward of one batch; gradients accumulate into ``.grad`` of the local parameters.

        Each micro-batch's loss is divided by ``divisor`` (micro-batches x accumulation steps) before backward,
        so the gradient is that of the mean loss over the batch (over the accumulation window).
        """
        m = self.num_microbatches
        size = batch_size_of(model_inputs)
        assert size is not None  # model_inputs come from capture_inputs, which raises when there is no batch size
        rows = size // m
        state = _StepState(step, self._micro_batches(args, kwargs, rows, size), divisor)
        state.draws, state.batch_size, self._draws = self._draws, size, None
        state.bounds = [(i * rows, (i + 1) * rows) for i in range(m)]
        built = self._torch_schedule("train", model_inputs)
        self._state, self._current = state, built
        try:
            # The target only carries each micro-batch's index to `_loss_fn`; on the host, reading it never waits for
            # the device (a device tensor's `.item()` there was one sync per micro-batch, issue 36 item 5).
            target = torch.arange(m) if built.has_last_stage else None
            inputs_args, inputs_kwargs = model_inputs if built.has_first_stage else ((), {})
            # `return_outputs=False`: the loss already ran per micro-batch in `_loss_fn`; torch would otherwise keep
            # every micro-batch's last-stage output (the logits) until the step ends and concatenate them (a copy).
            built.schedule.step(*inputs_args, target=target, return_outputs=False, **inputs_kwargs)
        finally:
            self._state, self._current = None, None
        outcome = None
        if built.has_last_stage:
            losses = [step_loss(state.results[i], step).detach().double() for i in range(m)]
            last = state.results[m - 1]
            extra = {k: v for k, v in last.items() if k != "loss"} if isinstance(last, dict) else {}
            # The mean loss travels to the host with the logged values of every micro-batch: one transfer.
            records, (loss,) = _host_records(state.records, torch.stack(losses).mean().float())
            outcome = StepOutcome(
                logs=self._portable_logs(records, [rows] * m),
                loss=loss.clone(),  # not a view of the transfer's buffer (the outcome is pickled)
                extra=detached_cpu(extra),
            )
        return self._broadcast(outcome)

    def _loss_fn(self, output: Any, target: Tensor) -> Tensor:
        state, built = self._state, self._current
        assert state is not None and built is not None
        if not built.backward_initialized:
            # torch's metadata inference: one backward through a dummy output to learn gradient shapes.
            outputs = output if isinstance(output, tuple) else (output,)
            return sum(o.float().sum() for o in outputs) * 0.0
        (index,) = target.tolist()  # a host tensor (see `train_step`): no device sync
        mb_args, mb_kwargs = state.micro_batches[index]
        with self._draws_replayed(state, index) as on_model_call:
            result, records = run_step_with_output(
                self.module, state.step, mb_args, mb_kwargs, output, call=self.call, on_model_call=on_model_call
            )
        state.results[index], state.records[index] = result, records
        return step_loss(result, state.step) / state.divisor

    # ------------------------------------------------------------------ evaluation
    def eval_step(
        self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, model_inputs: Any, collect: bool
    ) -> StepOutcome:
        """Forward-only pass of one batch; the step runs on the last stage per micro-batch.

        A batch whose size is not a multiple of ``num_microbatches`` (the last one of a loader) is padded by
        repeating its last row; padded rows never reach the step. ``collect`` gathers the step results (predict).
        """
        m = self.num_microbatches
        size = batch_size_of(model_inputs)
        assert size is not None  # model_inputs come from capture_inputs, which raises when there is no batch size
        rows = math.ceil(size / m)
        padded_args, padded_kwargs = pad_batch(model_inputs, rows * m)
        real_rows = [max(0, min(rows, size - i * rows)) for i in range(m)]
        state = _StepState(step, self._micro_batches(args, kwargs, rows, size), 1.0)
        state.draws, state.batch_size, self._draws = self._draws, size, None
        state.bounds = [(i * rows, i * rows + real_rows[i]) for i in range(m)]
        built = self._torch_schedule("eval", (padded_args, padded_kwargs))
        built.schedule.step(
            *(padded_args if built.has_first_stage else ()), **(padded_kwargs if built.has_first_stage else {})
        )
        outcome = None
        if built.has_last_stage:
            outputs = built.last_stage_outputs()
            for index, output in enumerate(outputs):
                if real_rows[index] == 0:
                    state.records[index] = []
                    continue
                mb_args, mb_kwargs = state.micro_batches[index]
                with self._draws_replayed(state, index) as on_model_call:
                    result, records = run_step_with_output(
                        self.module,
                        step,
                        mb_args,
                        mb_kwargs,
                        _slice_output(output, real_rows[index]),
                        call=self.call,
                        on_model_call=on_model_call,
                    )
                state.results[index], state.records[index] = result, records
            weights = [float(r) for r in real_rows]
            result = _merge_results([state.results[i] for i in sorted(state.results)]) if collect else None
            host_records, _ = _host_records(state.records)
            outcome = StepOutcome(logs=self._portable_logs(host_records, weights), result=result)
        return self._broadcast(outcome)

    # ------------------------------------------------------------------ random draws
    def _next_draw_seed(self) -> int:
        """The seed of this batch's recorded draws: equal on the ranks of a pipeline (the same base seed, agreed once,
        and the same count of batches), different per replica and per batch."""
        if self._draw_base_seed is None:
            # Drawn (one draw on every rank) rather than `torch.initial_seed()`: reproducible after `seed_everything`,
            # and a later run of the same module (another `fit`, `validate`) does not repeat this one's draws.
            local = int(torch.randint(0, 2**62, (), device="cpu"))
            group = self.dims.pipeline_group if self.dims.pipeline_parallel_size > 1 else None
            source = self.dims.pipeline_global_rank(0)
            self._draw_base_seed = agree_on_seed(local, src=source, group=group, device=self.device)
            if self.dims.pipeline_rank > 0:
                # The layers' own draws (dropout) run on this rank's stream, which the step no longer advances: ranks
                # seeded alike would draw the same masks in two stages. Each stage gets its own stream, once.
                seed_default_generators(self.device, draw_seed(self._draw_base_seed, self.dims.pipeline_rank, 0))
        self._batches_drawn += 1
        return draw_seed(self._draw_base_seed, self.dims.data_parallel_rank, self._batches_drawn)

    @contextmanager
    def _draws_replayed(self, state: _StepState, index: int) -> Iterator[Callable[[], None] | None]:
        """Micro-batch ``index``'s run of the step with the recorded draws replayed (yields what to call at
        ``self(...)``); without recorded draws it runs as it is."""
        if state.draws is None:
            yield None
            return
        with replaying_draws(
            state.draws,
            device=self.device,
            step=state.step,
            microbatch=index,
            rows=state.bounds[index],
            batch_size=state.batch_size,
        ) as replay:
            yield replay.model_called

    # ------------------------------------------------------------------ helpers
    def _micro_batches(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, size: int
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The step's own arguments cut into micro-batches: the batch (first argument) sliced, the rest repeated."""
        batch, rest = args[0], args[1:]
        return [
            ((slice_batch(batch, i * rows, min((i + 1) * rows, size)), *rest), kwargs)
            for i in range(self.num_microbatches)
        ]

    def _portable_logs(self, records: dict[int, list[Any]], weights: Sequence[float]) -> list[tuple[Any, ...]]:
        indices = [i for i in range(self.num_microbatches) if i in records]
        aggregated = aggregate_logs([records[i] for i in indices], [weights[i] for i in indices])
        metric_names = {id(m): name for name, m in self.module.named_modules()}
        return to_portable(aggregated, metric_names)

    def _torch_schedule(self, mode: str, model_inputs: Any) -> TorchSchedule:
        # torch sizes its receive buffers from the first micro-batch it sees; a new input shape (an evaluation
        # batch, a smaller last batch) gets its own stages and schedule instead of corrupting the old ones.
        key = (mode, _signature(model_inputs))
        if key not in self._torch_schedules:
            self._torch_schedules[key] = build_torch_schedule(
                schedule=self.schedule,
                plan=self.plan,
                # build_torch_schedule reads only this rank's layers, which are never None.
                layers=cast(Sequence[nn.Module], self.layers),
                dims=self.dims,
                num_microbatches=self.num_microbatches,
                device=self.device,
                loss_fn=self._loss_fn if mode == "train" else None,
                # Every rank of the pipeline holds the same batch: the receiving stages know the dtypes too.
                side_dtypes=side_input_dtypes(model_inputs[1]),
                on_chunk=self.on_chunk,
                on_p2p=self.on_p2p,
            )
        return self._torch_schedules[key]

    def _broadcast(self, outcome: StepOutcome | None) -> StepOutcome:
        """Collective over the pipeline group: the outcome of the last stage's rank on every rank of the pipeline.

        The last stage's rank sends without waiting for the others to receive (``broadcast_object_list`` blocked it
        until the slowest rank arrived, often the first stage still running its last backward): it goes on to its
        optimizer step as a raw torch loop does. Its sends are waited for at the next broadcast.
        """
        if self.dims.pipeline_parallel_size == 1:
            assert outcome is not None
            return outcome
        self._finish_sending()
        src, group, device = self.last_stage_global_rank, self.dims.pipeline_group, self.dims.device
        if self.dims.global_rank == src:  # pickled into bytes on the group's device, sent in two broadcasts
            assert outcome is not None
            data = torch.frombuffer(bytearray(pickle.dumps(outcome)), dtype=torch.uint8).to(device)
            size = torch.tensor([data.numel()], dtype=torch.long, device=device)
            works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in (size, data)]
            self._sending = [(work, tensor) for work, tensor in zip(works, (size, data), strict=True) if work]
            return outcome
        size = torch.empty(1, dtype=torch.long, device=device)
        dist.broadcast(size, src=src, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=src, group=group)
        received: StepOutcome = pickle.loads(data.cpu().numpy().tobytes())
        return received

    def _finish_sending(self) -> None:
        """Wait for the last outcome's sends (done long before: every rank received it to end its step)."""
        sending, self._sending = self._sending, []
        for work, _ in sending:
            work.wait()

    def clear(self) -> None:
        """Local. Drop the cached stages and schedules (their receive buffers) and the last outcome's sends (not waited
        for: every rank received them to end its step, and after a failure a peer may never)."""
        self._sending = []
        self._torch_schedules.clear()


def _merge_results(results: list[Any]) -> Any:
    if results and all(isinstance(r, Tensor) for r in results):
        return torch.cat([r.detach() for r in results]).cpu()  # one transfer, not one per micro-batch
    return [detached_cpu(r) for r in results]


def _host_records(records: dict[int, list[Any]], *also: Tensor) -> tuple[dict[int, list[Any]], list[Tensor]]:
    """The micro-batches' log records with their tensor values on the host, and host copies of ``also``.

    On a GPU each ``.cpu()`` waits for the device: copied one by one (as ``aggregate_logs`` would) that is a sync per
    micro-batch and logged name; here it is one transfer per dtype (:func:`_on_host`). Values and dtypes unchanged.
    """
    values = [r.value for rs in records.values() for r in rs if isinstance(r.value, Tensor)]
    host = iter(_on_host([*values, *also]))
    moved = {
        i: [replace(r, value=next(host)) if isinstance(r.value, Tensor) else r for r in rs] for i, rs in records.items()
    }
    return moved, list(host)


def _on_host(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Detached host tensors equal to ``tensors``: those on a device flattened into one buffer per dtype, copied to
    the host at once and cut back into their shapes (views of that buffer)."""
    result = [t.detach() for t in tensors]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(result):
        if t.device.type != "cpu":
            by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([result[i].reshape(-1) for i in indices]).cpu()
        chunks = flat.split([result[i].numel() for i in indices])
        for i, chunk in zip(indices, chunks, strict=True):
            result[i] = chunk.view(result[i].shape)
    return result
