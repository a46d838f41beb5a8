"""Random draws of a pipelined step, the same on every rank and micro-batch that runs it.

Torch only. Under the pipeline a step runs more than once per batch: every rank learns the first stage's input on the
whole batch (the step run up to ``self(...)``, or ``pipeline_inputs(batch)``), then the rank with the last stage runs
the step once per micro-batch. A step that draws before ``self(...)`` (the noise of a denoising or diffusion model, a
mask for masked modelling) would draw different values in each of those runs: different RNG states per rank (each
stage's dropout consumes its stream differently), and a micro-batch's ``randn_like`` of ``B / m`` rows is not a slice
of the whole batch's draw. The model would then see one noise and the loss another.

So, per batch:

* :func:`recording_draws`: every rank of a pipeline learns the input in a forked RNG seeded alike (:func:`draw_seed`
  of a base seed agreed once, :func:`agree_on_seed`, the batch's number and the replica), and keeps every random op's
  output in order (the ops torch tags ``nondeterministic_seeded``: ``randn``, ``rand_like``, ``normal_``,
  ``bernoulli_``, ``randint``, ``randperm``, ``multinomial``, dropout, ...).
* :func:`replaying_draws`: the last stage's run of the step on micro-batch ``i`` gets, for the k-th draw before
  ``self(...)``, the k-th recorded one: the whole value where the shapes are equal (a draw whose shape does not depend
  on the batch, such as a diffusion timestep shared by the batch), its rows of micro-batch ``i`` where the recorded
  dim 0 is the batch and the new one the micro-batch's rows (the batch is cut the same way). Anything else, or
  another count or order of draws, raises :class:`InconsistentDrawError` naming the draw. Draws after ``self(...)``
  draw from a forked stream of their own per micro-batch.

Dropout inside the layers runs in the stages' forward, outside both, on each rank's own stream, which the step's
draws no longer advance. Those streams would then run in lockstep on ranks seeded alike (``seed_everything``), and
two stages would draw the same masks: the engine reseeds every pipeline rank but the first once from the agreed seed
and its rank (Megatron-LM offsets its seed by the pipeline rank likewise), so each stage draws its own, as the layers
of one device do. Draws from Python's ``random`` or NumPy's global generator before ``self(...)`` cannot be
replayed (they never reach torch's dispatcher): a step that makes them is refused (their generator's state is compared
before and after). Cost: the recorded outputs are held until the batch's step ends (on the last stage; the other
ranks drop them after the input is known), and the step runs under a ``TorchDispatchMode`` (one Python call per op).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Private torch name: `TorchDispatchMode` (torch.utils._python_dispatch) sees every aten op a step runs, with its
# tags, below autograd (`accounting.py` and `monitor/ledger.py` use it for the same reason); no public API reports
# random ops.
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.distributed.pipeline.contract import ContractError

__all__ = [
    "Draw",
    "DrawReplay",
    "InconsistentDrawError",
    "RecordedDraws",
    "agree_on_seed",
    "draw_seed",
    "forked_rng",
    "recording_draws",
    "replaying_draws",
    "seed_default_generators",
]

RANDOM_OP_TAG = torch.Tag.nondeterministic_seeded
"""The tag torch gives every aten op that draws from a generator (in-place and ``out=`` variants included)."""

_NOT_COMPARED = frozenset({"size", "generator", "out", "dtype", "layout", "device", "pin_memory", "memory_format"})
"""Arguments of a random op that may differ between the whole batch and a micro-batch (or are checked on the
output): the rest (``low``/``high``, ``mean``/``std``, ``p``, ``n`` of ``randperm``) must be equal."""

_MASK_63 = (1 << 63) - 1
_HOW_TO_FIX = (
    " Draw per sample along dim 0 (`torch.randn(x.shape[0], ...)`, `torch.randn_like(x)`) or with a shape that does"
    " not depend on the batch, make the draw in `pipeline_inputs(batch)` or the data pipeline, or after `self(...)`."
)


class InconsistentDrawError(ContractError):
    """A random draw before ``self(...)`` that the pipeline cannot give the same values on every rank and
    micro-batch that runs the step."""


@dataclass(frozen=True)
class Draw:
    """One random op of the recorded run: its name, its compared arguments and its outputs (kept copies)."""

    op: str
    arguments: tuple[tuple[str, Any], ...]
    outputs: tuple[Tensor, ...]

    def describe(self, outputs: Sequence[Tensor] | None = None) -> str:
        return f"`{self.op}` of shape {_shapes(self.outputs if outputs is None else outputs)}"


@dataclass
class RecordedDraws:
    """The draws of one batch's input-learning run, in order."""

    seed: int
    """The seed of the forked stream they came from; each micro-batch's stream derives from it."""
    source: str
    """What ran: "`training_step` up to `self(...)`" or "`pipeline_inputs(batch)`" (for error messages)."""
    exhaustive: bool
    """``True`` when the step itself was recorded: its runs on micro-batches must make exactly these draws before
    ``self(...)``. ``False`` for ``pipeline_inputs``: the step may make fewer (draws only that method needs)."""
    draws: list[Draw] = field(default_factory=list)


def draw_seed(*keys: int) -> int:
    """A 63-bit seed mixed from ``keys`` (SplitMix64 steps): the same keys give the same seed on every rank."""
    state = 0x9E3779B97F4A7C15
    for key in keys:
        state = (state ^ (key & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state & _MASK_63


def agree_on_seed(seed: int, *, src: int, group: Any, device: torch.device) -> int:
    """Collective over ``group`` (skipped when it is ``None``): every rank gets global rank ``src``'s ``seed``."""
    if group is None:
        return seed & _MASK_63
    box = torch.tensor([seed & _MASK_63], dtype=torch.int64, device=device)
    dist.broadcast(box, src=src, group=group)
    return int(box.item())


@contextmanager
def forked_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block on the CPU's and ``device``'s default generators seeded with ``seed``; restore both after.

    Saved and restored by hand, as in :mod:`.side_effects`: ``torch.random.fork_rng`` asks for the current
    accelerator, which initialises CUDA in a CPU process.
    """
    accelerator = getattr(torch, device.type) if device.type != "cpu" else None
    cpu_state = torch.get_rng_state()
    device_state = accelerator.get_rng_state(device) if accelerator is not None else None
    try:
        seed_default_generators(device, seed)
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if accelerator is not None:
            accelerator.set_rng_state(device_state, device)


def seed_default_generators(device: torch.device, seed: int) -> None:
    """Seed the CPU's and ``device``'s default generators (not every device's, as ``torch.manual_seed`` would)."""
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        accelerator = getattr(torch, device.type)
        with accelerator.device(device):
            accelerator.manual_seed(seed)


# ------------------------------------------------------------------ recording
@contextmanager
def recording_draws(*, device: torch.device, seed: int, source: str, exhaustive: bool) -> Iterator[RecordedDraws]:
    """Run the block in :func:`forked_rng` and record its random ops' outputs.

    With ``exhaustive`` (the step itself runs), a draw from Python's ``random`` or NumPy's global generator in the
    block raises :class:`InconsistentDrawError` after it: every rank runs this block on the same batch before the
    schedule, so they all raise before any send.
    """
    recorded = RecordedDraws(seed=seed, source=source, exhaustive=exhaustive)
    host = _host_rng_states()
    with forked_rng(device, seed), _Recorder(recorded.draws):
        yield recorded
    if exhaustive:
        _check_host_rng(host, f"{source} draws from {{}} before `self(...)`")


class _Recorder(TorchDispatchMode):
    def __init__(self, draws: list[Draw]) -> None:
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if RANDOM_OP_TAG in func.tags:
            # Copies: the step may change a draw in place afterwards (`noise.mul_(sigma)`); in-place ops return
            # their argument.
            kept = tuple(t.detach().clone() for t in _tensors(out))
            self.draws.append(Draw(_op_name(func), _compared_arguments(func, args, kwargs), kept))
        return out


# ------------------------------------------------------------------ replaying
class DrawReplay(TorchDispatchMode):
    """The random ops of one micro-batch's run of the step: replayed from ``recorded`` until :meth:`model_called`.

    Args:
        recorded: The batch's recorded draws.
        step: The step's name (for errors).
        microbatch: Index of the micro-batch.
        rows: Its rows ``(start, stop)`` in the batch.
        batch_size: Rows of the whole batch (dim 0 of a recorded per-sample draw).
    """

    def __init__(
        self, recorded: RecordedDraws, *, step: str, microbatch: int, rows: tuple[int, int], batch_size: int
    ) -> None:
        super().__init__()
        self.recorded, self.step, self.microbatch = recorded, step, microbatch
        self.rows, self.batch_size = rows, batch_size
        self.replayed = 0
        self.model_was_called = False
        self._host = _host_rng_states()

    def model_called(self) -> None:
        """The step reached ``self(...)``: later draws are new ones. Checks that nothing recorded is left over."""
        if self.model_was_called:
            return
        self.model_was_called = True
        where = f"`{self.step}` draws from {{}} before `self(...)` on micro-batch {self.microbatch}"
        _check_host_rng(self._host, where)
        left = self.recorded.draws[self.replayed :]
        if self.recorded.exhaustive and left:
            raise InconsistentDrawError(
                f"`{self.step}` called `self(...)` on micro-batch {self.microbatch} after {self.replayed} random"
                f" draws, but {self.recorded.source} made {len(self.recorded.draws)} on the whole batch (the first"
                f" missing one: {left[0].describe()}). The draws before `self(...)` must not depend on the batch's"
                f" size or content.{_HOW_TO_FIX}"
            )

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if RANDOM_OP_TAG not in func.tags or self.model_was_called:
            return func(*args, **kwargs)
        index = self.replayed
        self.replayed += 1
        op, arguments = _op_name(func), _compared_arguments(func, args, kwargs)
        if index >= len(self.recorded.draws):
            raise InconsistentDrawError(
                f"`{self.step}` draws `{op}` before `self(...)` on micro-batch {self.microbatch} (draw {index + 1}),"
                f" but {self.recorded.source} made only {_count(self.recorded.draws)} on the whole batch"
                f"{_listed(self.recorded.draws)}. Every rank and micro-batch must see the same values: make the same"
                " draws, in the same order, in `pipeline_inputs(batch)` and in the step before `self(...)`, or draw"
                " after `self(...)`."
            )
        draw = self.recorded.draws[index]
        if op != draw.op or arguments != draw.arguments:
            raise InconsistentDrawError(
                f"`{self.step}` makes draw {index + 1} before `self(...)` as `{op}{_args(arguments)}` on micro-batch"
                f" {self.microbatch}, but {self.recorded.source} made it as `{draw.op}{_args(draw.arguments)}`, of"
                f" shape {_shapes(draw.outputs)}, on the whole batch. Draws whose kind or arguments depend on the batch"
                f" (`randperm(len(x))`, `randint(0, len(x), ...)`) cannot be cut into micro-batches.{_HOW_TO_FIX}"
            )
        # The op runs (from this micro-batch's forked stream) for its output's shape, dtype and device (and to write
        # an in-place or `out=` argument); its values are then replaced by the recorded ones.
        out = func(*args, **_without_generator(func, kwargs))
        fresh = _tensors(out)
        with torch.no_grad():
            for kept, new in zip(draw.outputs, fresh, strict=True):
                new.copy_(self._part(draw, kept, new, fresh))
        return out

    def _part(self, draw: Draw, kept: Tensor, new: Tensor, fresh: Sequence[Tensor]) -> Tensor:
        """The part of recorded output ``kept`` that this micro-batch's output ``new`` gets."""
        start, stop = self.rows
        if kept.dtype == new.dtype and kept.shape == new.shape:
            return kept
        per_sample = kept.dim() == new.dim() >= 1 and kept.shape[0] == self.batch_size and new.shape[0] == stop - start
        if kept.dtype == new.dtype and per_sample and kept.shape[1:] == new.shape[1:]:
            return kept[start:stop]
        raise InconsistentDrawError(
            f"`{self.step}` draws {draw.describe(fresh)} before `self(...)` on micro-batch {self.microbatch} (rows"
            f" {start}:{stop} of {self.batch_size}), where {self.recorded.source} drew {draw.describe()}"
            f"{_dtypes(kept, new)} on the whole batch. The pipeline gives every rank and micro-batch the same values"
            " only for a draw of the same shape, or of the whole batch's shape with dim 0 cut to the micro-batch's"
            f" rows (here {stop - start} of {self.batch_size}).{_HOW_TO_FIX}"
        )


@contextmanager
def replaying_draws(
    recorded: RecordedDraws,
    *,
    device: torch.device,
    step: str,
    microbatch: int,
    rows: tuple[int, int],
    batch_size: int,
) -> Iterator[DrawReplay]:
    """Run one micro-batch's step in a forked RNG (seeded from the batch's seed and ``microbatch``) with its draws
    before ``self(...)`` replayed from ``recorded``; call the yielded :meth:`DrawReplay.model_called` at ``self(...)``.

    Raises:
        InconsistentDrawError: At a draw that cannot be replayed (see :class:`DrawReplay`).
    """
    replay = DrawReplay(recorded, step=step, microbatch=microbatch, rows=rows, batch_size=batch_size)
    with forked_rng(device, draw_seed(recorded.seed, microbatch + 1)), replay:
        yield replay


# ------------------------------------------------------------------ helpers
def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def _op_name(func: Any) -> str:
    return str(func.overloadpacket)  # "aten.randn": `randn.generator` and `randn.default` are one kind of draw


def _compared_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The op's scalar arguments (positional ones by position): ``low``/``high``, ``mean``/``std``, ``p``, the ``n``
    of ``randperm``. Sizes (lists), tensors and the keywords that may differ per micro-batch are not compared."""
    compared = [
        (str(position), value)
        for position, value in enumerate(args)
        if value is not None and not isinstance(value, Tensor | list | tuple)
    ]
    compared += [
        (name, value)
        for name, value in sorted(kwargs.items())
        if name not in _NOT_COMPARED and value is not None and not isinstance(value, Tensor | list | tuple)
    ]
    return tuple(compared)


def _without_generator(func: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    # The user's own generator advanced once, in the recorded run, as on one device; a replayed draw must not advance
    # it again (dispatch passes `generator` as a keyword: it is keyword-only in every random op's schema).
    if kwargs.get("generator") is None:
        return kwargs
    return {**kwargs, "generator": None}


def _host_rng_states() -> tuple[Any, Any]:
    numpy = sys.modules.get("numpy")  # a step cannot draw from NumPy without importing it
    return random.getstate(), numpy.random.get_state(legacy=False) if numpy is not None else None


def _check_host_rng(before: tuple[Any, Any], message: str) -> None:
    after = _host_rng_states()
    changed = []
    if after[0] != before[0]:
        changed.append("Python's `random`")
    if before[1] is not None and after[1] is not None and not _same_numpy_state(before[1], after[1]):
        changed.append("NumPy's global generator (`numpy.random`)")
    if changed:
        raise InconsistentDrawError(
            message.format(" and ".join(changed)) + ", whose values the pipeline cannot give every rank and"
            " micro-batch that runs the step (it replays torch's draws only). Draw with torch (`torch.rand`,"
            f" `torch.randn_like`, ...) instead.{_HOW_TO_FIX}"
        )


def _same_numpy_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    state_a, state_b = a["state"], b["state"]
    return bool(
        state_a["pos"] == state_b["pos"]
        and (state_a["key"] == state_b["key"]).all()
        and a["has_gauss"] == b["has_gauss"]
        and a["gauss"] == b["gauss"]
    )


def _count(draws: Sequence[Draw]) -> str:
    return f"{len(draws)} draw{'' if len(draws) == 1 else 's'}"


def _shapes(tensors: Sequence[Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


def _listed(draws: Sequence[Draw]) -> str:
    return f" ({', '.join(d.describe() for d in draws)})" if draws else ""


def _args(arguments: tuple[tuple[str, Any], ...]) -> str:
    shown = (f"{value!r}" if name.isdigit() else f"{name}={value!r}" for name, value in arguments)
    return f"({', '.join(shown)})" if arguments else ""


def _dtypes(kept: Tensor, new: Tensor) -> str:
    return f" (dtype {kept.dtype}, now {new.dtype})" if kept.dtype != new.dtype else ""
