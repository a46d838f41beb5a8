"""The user contract: run a LightningModule's own step with ``self(...)`` answered by the pipeline.

Torch/Lightning-module level, no Trainer logic. Three things happen to a step:

* :func:`model_inputs_of_batch` gives the first stage's input for a batch: the module's own
  ``pipeline_inputs(batch)`` when it defines one (the step does not run), else :func:`capture_model_inputs`, which
  runs the step until it calls ``self(...)`` and returns those arguments; nothing after that call runs, and nothing
  is logged (that partial run is one run of the step more per batch than on one device).
* :func:`run_step_with_output` runs the step on one micro-batch with ``self(...)`` returning the pipeline's output
  for it, recording what the step logs instead of logging it.
* :func:`aggregate_logs` / :func:`replay_logs` turn the per-micro-batch records into one ``self.log`` call per name,
  made identically on every rank of the pipeline (so every rank syncs, and callbacks decide the same).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

# Not torch-only, but no Lightning either: torchmetrics depends on torch and lightning-utilities. A logged `Metric`
# keeps its own state across micro-batches and must be recognised so it is not averaged like a value.
from torchmetrics import Metric

PIPELINE_INPUTS_HOOK = "pipeline_inputs"
"""The optional LightningModule method ``pipeline_inputs(batch)``: the arguments of the step's model call for
``batch`` (a tensor, a tuple of positional arguments or a dict of keyword arguments)."""

__all__ = [
    "PIPELINE_INPUTS_HOOK",
    "ContractError",
    "LogRecord",
    "ModelCall",
    "aggregate_logs",
    "capture_model_inputs",
    "model_inputs_of_batch",
    "replay_logs",
    "run_step_with_output",
    "step_loss",
]

_CONTRACT = (
    "Under PipelineParallelStrategy a step must call `self(...)` exactly once (the pipeline answers it with the"
    " last stage's output for the micro-batch) and must not call the model's layers directly."
)


class ContractError(RuntimeError):
    """A step broke the pipeline contract (called ``self(...)`` twice, never, or reached into submodules)."""


class _InputsCaptured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


@dataclass
class LogRecord:
    """One ``self.log`` call of a step (or the aggregate over micro-batches)."""

    name: str
    value: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    signature: inspect.Signature | None = field(default=None, repr=False, compare=False)
    """The signature of the module's ``log`` method (LightningModule's), which tells where ``reduce_fx`` sits among
    positional arguments (after prog_bar, logger, on_step, on_epoch); ``None``: only a keyword ``reduce_fx`` counts."""


class ModelCall:
    """The call of a step that the pipeline answers: by default the LightningModule's own ``self(...)``.

    ``target`` is the module whose call is intercepted; :meth:`model_inputs` turns the call's arguments into the
    first stage's input, :meth:`answer` turns the last stage's output into what the call returns to the step, and
    :meth:`reference` is ``forward``'s result for the pipeline's input (what the chain of layers must equal). A model
    that declares its own split answers its own call instead (:class:`~.model_plan.DeclaredPlanCall`).
    """

    def __init__(self, target: nn.Module) -> None:
        self.target = target

    def model_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The first stage's input for a call ``target(*args, **kwargs)`` (here: the call's own arguments)."""
        return args, kwargs

    def answer(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the call ``target(*args, **kwargs)`` of one micro-batch returns, given the last stage's output."""
        return output

    def reference(self, *args: Any, **kwargs: Any) -> Any:
        """``target``'s own ``forward`` on the pipeline's input."""
        return self.target(*args, **kwargs)


@contextmanager
def _patched(
    module: nn.Module, target: nn.Module, forward: Callable[..., Any], log: Callable[..., None]
) -> Iterator[None]:
    # Instance attributes shadow the class's methods for the duration of the step: `self(x)` (or `self.model(x)`,
    # for a model that declares its split) reaches `target.forward`, `self.log_dict` calls `self.log`.
    target.__dict__["forward"] = forward
    module.__dict__["log"] = log
    try:
        yield
    finally:
        target.__dict__.pop("forward", None)
        module.__dict__.pop("log", None)


def capture_model_inputs(
    module: nn.Module, step: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, call: ModelCall | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``module.<step>(*args, **kwargs)`` up to its call of the model and return the pipeline's input.

    ``call`` says which call (default: ``self(...)``) and how its arguments become the pipeline's input.

    Raises:
        ContractError: If the step returns without calling the model.
    """
    call = call or ModelCall(module)

    def forward(*fargs: Any, **fkwargs: Any) -> Any:
        raise _InputsCaptured(fargs, fkwargs)

    with _patched(module, call.target, forward, lambda *a, **k: None):
        try:
            getattr(module, step)(*args, **kwargs)
        except _InputsCaptured as captured:
            return call.model_inputs(captured.args, captured.kwargs)
    raise ContractError(f"`{step}` returned without calling {_called(module, call)}. {_CONTRACT}")


def model_inputs_of_batch(
    module: nn.Module, step: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, call: ModelCall | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The pipeline's input for the step ``module.<step>(*args, **kwargs)`` (``args[0]`` is the batch).

    A module that defines ``pipeline_inputs(batch)`` says it itself, and its step then runs exactly as often as on one
    device with ``num_microbatches``-fold accumulation: once per micro-batch, on the last stage. Otherwise the step
    runs up to its model call (:func:`capture_model_inputs`): one partial run more per batch, whose side effects and
    random draws (masking, augmentation, counters) happen one time too many.

    Raises:
        ContractError: If ``pipeline_inputs`` returns something else than a tensor, a tuple or a dict, or (without
            it) the step returns without calling the model.
    """
    call = call or ModelCall(module)
    declare = getattr(module, PIPELINE_INPUTS_HOOK, None)
    if declare is None:
        return capture_model_inputs(module, step, args, kwargs, call=call)
    declared = declare(args[0])
    if isinstance(declared, Tensor):
        return call.model_inputs((declared,), {})
    if isinstance(declared, Mapping):
        return call.model_inputs((), dict(declared))
    if isinstance(declared, tuple | list):
        return call.model_inputs(tuple(declared), {})
    raise ContractError(
        f"`{type(module).__name__}.{PIPELINE_INPUTS_HOOK}(batch)` returned {type(declared).__name__}; it must return"
        f" the arguments of {_called(module, call)} in `{step}` for that batch: a tensor, a tuple of positional"
        " arguments or a dict of keyword arguments."
    )


def _called(module: nn.Module, call: ModelCall) -> str:
    if call.target is module:
        return "`self(...)`"
    name = next((n for n, m in module.named_modules() if m is call.target), type(call.target).__name__)
    return f"`self.{name}(...)`"


def run_step_with_output(
    module: nn.Module,
    step: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    *,
    call: ModelCall | None = None,
    on_model_call: Callable[[], None] | None = None,
) -> tuple[Any, list[LogRecord]]:
    """Run ``module.<step>`` with its model call (``self(...)`` by default) answered from ``output``; return the
    step's result and its log calls. ``on_model_call`` is told when the step reaches that call (before it is
    answered): the end of the part of the step whose random draws are replayed (:mod:`.random_draws`).

    Raises:
        ContractError: If the step calls the model twice or not at all.
    """
    call = call or ModelCall(module)
    calls = 0
    records: list[LogRecord] = []
    signature = _log_signature(type(module))

    def forward(*fargs: Any, **fkwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ContractError(f"`{step}` called {_called(module, call)} a second time. {_CONTRACT}")
        if on_model_call is not None:
            on_model_call()
        return call.answer(output, fargs, fkwargs)

    def log(name: str, value: Any, *largs: Any, **lkwargs: Any) -> None:
        records.append(LogRecord(name, value, largs, lkwargs, signature))

    with _patched(module, call.target, forward, log):
        result = getattr(module, step)(*args, **kwargs)
    if calls == 0:
        raise ContractError(f"`{step}` did not call {_called(module, call)}. {_CONTRACT}")
    return result, records


def _log_signature(module_class: type) -> inspect.Signature | None:
    """The signature of ``module_class.log`` (``None`` where it has none)."""
    log_method = getattr(module_class, "log", None)
    return _signature(log_method) if callable(log_method) else None


@functools.lru_cache(maxsize=64)
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    """Read once per function: the last stage runs the step once per micro-batch (``inspect.signature`` costs ~0.06 ms
    a call)."""
    return inspect.signature(function)


def step_loss(output: Any, step: str = "training_step") -> Tensor:
    """The loss of a ``training_step`` result (a tensor or a dict with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise ContractError(
            f"`{step}` returned {type(output).__name__}; under PipelineParallelStrategy it must return the loss tensor"
            " or a dict with a 'loss' tensor (returning None to skip a batch is not supported)."
        )
    return loss


def _reduce_fx(record: LogRecord) -> Any:
    """The ``reduce_fx`` of a ``self.log(name, value, *args, **kwargs)`` call, positional or by keyword."""
    if "reduce_fx" in record.kwargs or record.signature is None:
        return record.kwargs.get("reduce_fx", "mean")
    try:
        bound = record.signature.bind_partial(None, record.name, record.value, *record.args, **record.kwargs)
    except TypeError:  # not a valid `self.log` call: Lightning raises its own error when the call is replayed
        return "mean"
    return bound.arguments.get("reduce_fx", "mean")


def aggregate_logs(per_microbatch: Sequence[Sequence[LogRecord]], weights: Sequence[float]) -> list[LogRecord]:
    """One record per logged name: the weighted mean over micro-batches (``reduce_fx`` "sum"/"max"/"min" honoured).

    With equal micro-batches and a mean-reduced quantity (a mean loss) this is exactly the value of the whole batch.
    A logged ``Metric`` object is kept as is (its state was updated once per micro-batch).
    """
    order: list[str] = []
    grouped: dict[str, list[tuple[LogRecord, float]]] = {}
    for records, weight in zip(per_microbatch, weights, strict=True):
        for record in records:
            if record.name not in grouped:
                order.append(record.name)
                grouped[record.name] = []
            grouped[record.name].append((record, weight))
    result = []
    for name in order:
        entries = grouped[name]
        last = entries[-1][0]
        if isinstance(last.value, Metric):
            result.append(last)
            continue
        values = [torch.as_tensor(r.value).detach().double().cpu() for r, _ in entries]
        reduce_fx = _reduce_fx(last)
        if reduce_fx in ("sum", torch.sum):
            value = torch.stack(values).sum()
        elif reduce_fx in ("max", torch.max):
            value = torch.stack(values).max()
        elif reduce_fx in ("min", torch.min):
            value = torch.stack(values).min()
        else:
            w = torch.tensor([wt for _, wt in entries], dtype=torch.float64)
            value = (torch.stack(values) * w).sum() / w.sum()
        dtype = last.value.dtype if isinstance(last.value, Tensor) and last.value.is_floating_point() else None
        result.append(LogRecord(name, value.to(dtype or torch.float32), last.args, last.kwargs, last.signature))
    return result


def to_portable(records: Sequence[LogRecord], metric_names: dict[int, str]) -> list[tuple[Any, ...]]:
    """Records as picklable tuples: tensors on CPU, ``Metric`` objects by their attribute path."""
    portable: list[tuple[Any, ...]] = []
    for record in records:
        if isinstance(record.value, Metric):
            cache = record.value._forward_cache
            cache = cache.detach().cpu() if isinstance(cache, Tensor) else cache
            portable.append(("metric", record.name, metric_names[id(record.value)], cache, record.args, record.kwargs))
        else:
            value = record.value.detach().cpu() if isinstance(record.value, Tensor) else record.value
            portable.append(("value", record.name, value, None, record.args, record.kwargs))
    return portable


def replay_logs(module: Any, portable: Sequence[tuple[Any, ...]], *, device: torch.device, is_source: bool) -> None:
    """Call ``module.log`` once per record, the same calls on every rank of the pipeline.

    On ranks that did not run the step (``is_source=False``) a logged ``Metric`` keeps its empty state, so when
    torchmetrics syncs at epoch end over all ranks it adds nothing but still takes part in the collective; its
    step value (``_forward_cache``) is the one the last stage computed.
    """
    submodules = dict(module.named_modules())
    for kind, name, value, cache, args, kwargs in portable:
        if kind == "metric":
            metric = submodules[value]
            if not is_source:
                metric._forward_cache = cache.to(device) if isinstance(cache, Tensor) else cache
                metric._update_count = max(metric._update_count, 1)  # "took part": no compute-before-update warning
            module.log(name, metric, *args, **kwargs)
        else:
            module.log(name, value.to(device) if isinstance(value, Tensor) else value, *args, **kwargs)
