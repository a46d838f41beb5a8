"""The whole model, for the length of a user's hook, in a module split into pipeline stages.

Torch-only. During a pipeline run each rank's module holds only its stages; the other layers are
:class:`~.remote_layer.RemoteLayer` placeholders, and the layer objects that left the rank sit on the ``meta`` device
(:func:`~.reassemble.offload_layers`). A hook that reads the model (``grad_norm(self)``, a weight norm,
``self.state_dict()``) would see one stage. :meth:`WholeModelView.open` (a collective over each pipeline group, every
rank calls it) gathers every other stage's parameters and buffers (and, asked for, their gradients) from the ranks
that hold them and puts those layers back in the module under their own names, the tensors on this rank's device;
:meth:`OpenView.close` (local) puts the placeholders and the ``meta`` tensors back, and the copies are freed.

What the module holds while open, on every rank (so a ``sync_dist`` log or a monitored value agrees everywhere):

* This rank's own parameters stay the tensors training uses (the same ``nn.Parameter`` objects): a hook that writes
  them (or their ``.grad``) writes what the optimizer steps. Every rank runs the hook on the same values, so a
  deterministic write (clipping by hand, a weight constraint) is made by the owner of each tensor too.
* Other stages' parameters are copies (``requires_grad`` as on their owner); writing them changes nothing.
* A tied parameter is one ``nn.Parameter`` in all its places (this rank's copy if it holds one), as on one device.
* Gradients (``grads="reduced"``): the stage's ``.grad`` after the replicas' average and the tied copies' sum (what
  the optimizer steps); others' received. ``grads="local"`` (before that reduction, e.g. right after backward): every
  parameter's ``.grad`` is the replicas' average and, for a tied parameter, the sum of its copies' gradients, as one
  device holds it; where that differs from this rank's own ``.grad`` (data parallelism, a tied copy) the hook sees a
  copy and this rank's ``.grad`` is put back afterwards (writes to it are then not kept).

Cost per open, ``W`` the whole model's bytes (parameters and buffers) and ``p`` the pipeline size: each pipeline rank
broadcasts what it owns over the pipeline group (``p`` broadcasts per dtype), every rank receives ``W`` minus its own
share, and holds it until the view closes; gradients add the parameters' bytes again (plus, with ``grads="local"``
and data parallelism, one all-reduce of the stage's gradients over its replicas). The first open also gathers what
each rank holds (one ``all_gather_object``), kept for the run. The flags that travel with the values (``requires_grad``,
"has a gradient") are read on the host once per open, all of them in one read (on a GPU each read waits for everything
queued before it; one read per parameter would wait as many times).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.accounting import CommunicationStats
from lightning_parallel.distributed.pipeline.split_layers import SplitLayers

__all__ = ["GradientMode", "HookCost", "OpenView", "WholeModelView"]

GradientMode = Literal["none", "local", "reduced"]
"""``"none"``: weights and buffers only; ``"reduced"``: ``.grad`` as the optimizer steps it (after the replicas'
average and the tied copies' sum); ``"local"``: before that reduction, the view computes it."""


@dataclass(frozen=True)
class _Held:
    """One tensor a pipeline rank holds, named as in the whole module (a tied parameter by its canonical name)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


@dataclass(frozen=True)
class _Segment:
    """One piece of a rank's flat message: a tensor's values, its gradient, or a flag."""

    name: str
    kind: Literal["weight", "grad", "requires_grad", "has_grad"]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class HookCost:
    """What one open exchanged on this rank."""

    sent_bytes: int = 0
    received_bytes: int = 0
    collectives: int = 0
    held_bytes: int = 0
    """Bytes of other stages' tensors (and gradients computed by the view) held while open."""


@dataclass
class OpenView:
    """The module with the whole model in it; :meth:`close` (local) puts the split back."""

    cost: HookCost
    _placeholders: list[tuple[str, nn.Module]] = field(default_factory=list)
    _tensors: list[tuple[nn.Module, str, Tensor | None, bool, bool]] = field(default_factory=list)
    _grads: list[tuple[nn.Parameter, Tensor | None]] = field(default_factory=list)
    _modes: list[tuple[nn.Module, bool]] = field(default_factory=list)
    _module: nn.Module | None = None

    def close(self) -> None:
        """Local. This rank's ``.grad`` put back where the view showed another value, the other stages' layers back
        on ``meta`` and their placeholders back in the module. Idempotent."""
        module, self._module = self._module, None
        if module is None:
            return
        for parameter, grad in self._grads:
            parameter.grad = grad
        for submodule, leaf, original, is_parameter, persistent in self._tensors:
            if is_parameter:
                submodule.register_parameter(leaf, original)  # type: ignore[arg-type]
            else:
                submodule.register_buffer(leaf, original, persistent=persistent)
        for submodule, training in self._modes:
            submodule.training = training
        for name, placeholder in self._placeholders:
            module.set_submodule(name, placeholder)
        self._grads, self._tensors, self._modes, self._placeholders = [], [], [], []

    @property
    def is_open(self) -> bool:
        return self._module is not None


class WholeModelView:
    """Opens the whole model in a split module (one per split; see the module docstring).

    Args:
        module: The user's split module.
        split: Every pipeline layer (other ranks' on ``meta``), where each sits in ``module``, which stage holds it,
            and the ranks, as the split keeps them.
        aliases: Other name -> canonical name of every parameter with several names (tied weights).
        device: Where received tensors are put (this rank's device).
        stats: Where to count the bytes (``None``: not counted), asked at every open.
    """

    def __init__(
        self,
        module: nn.Module,
        split: SplitLayers,
        *,
        aliases: Mapping[str, str],
        device: torch.device,
        stats: Callable[[], CommunicationStats | None] = lambda: None,
    ) -> None:
        self.module = module
        self.layers = list(split.layers)
        self.registrations = [list(r) for r in split.registrations]
        self.dims = split.dims
        self.aliases = dict(aliases)
        self.device = device
        self.stats = stats
        self.local = split.local
        self.local_modules = {id(m) for i in self.local for m in self.layers[i].modules()}
        self._held: list[list[_Held]] | None = None  # per pipeline rank, gathered at the first open

    # ------------------------------------------------------------------ what each rank holds
    def _own_tensors(self) -> dict[str, Tensor]:
        """Canonical name -> this rank's parameter or buffer (the module's own objects)."""
        found: dict[str, Tensor] = {}
        for name, parameter in self.module.named_parameters():
            found.setdefault(self.aliases.get(name, name), parameter)
        for name, buffer in self.module.named_buffers():
            found.setdefault(name, buffer)
        return found

    def _held_by_rank(self) -> list[list[_Held]]:
        """Collective the first time (one ``all_gather_object`` over the pipeline group), then cached."""
        if self._held is None:
            own = [
                _Held(name, tuple(t.shape), t.dtype, isinstance(t, nn.Parameter))
                for name, t in self._own_tensors().items()
            ]
            gathered: list[Any] = [None] * self.dims.pipeline_parallel_size
            dist.all_gather_object(gathered, own, group=self.dims.pipeline_group)
            self._held = gathered
        return self._held

    def _segments(self, held: list[list[_Held]], grads: GradientMode) -> list[list[_Segment]]:
        """What each pipeline rank sends: the tensors it is the lowest holder of (with a ``requires_grad`` flag per
        parameter), and the gradients (every copy's with ``grads="local"``: the receivers sum them) with a "has a
        gradient" flag each."""
        owner: dict[str, int] = {}
        for rank, entries in enumerate(held):
            for entry in entries:
                owner.setdefault(entry.name, rank)
        result = []
        for rank, entries in enumerate(held):
            owned = [e for e in entries if owner[e.name] == rank]
            segments = [_Segment(e.name, "weight", e.shape, e.dtype) for e in owned]
            segments += [_Segment(e.name, "requires_grad", (), torch.float32) for e in owned if e.is_parameter]
            if grads != "none":
                senders = [e for e in entries if e.is_parameter and (grads == "local" or owner[e.name] == rank)]
                segments += [_Segment(e.name, "grad", e.shape, e.dtype) for e in senders]
                segments += [_Segment(e.name, "has_grad", (), torch.float32) for e in senders]
            result.append(segments)
        return result

    # ------------------------------------------------------------------ open
    def open(self, grads: GradientMode = "none") -> OpenView:
        """Collective over each pipeline group (and, with ``grads="local"``, the replicas): every rank calls it at
        the same point. Returns the open view; :meth:`OpenView.close` undoes it."""
        with torch.no_grad():
            return self._open(grads)

    def _open(self, grads: GradientMode) -> OpenView:
        dims, cost = self.dims, HookCost()
        held = self._held_by_rank()
        own = self._own_tensors()
        own_grads, own_has_grad = self._own_gradients(own, held[dims.pipeline_rank], grads, cost)
        values: dict[tuple[str, str], list[Tensor]] = {}
        flags: dict[tuple[str, str], list[Tensor | bool]] = {}  # on the host where this rank knows them
        for rank, segments in enumerate(self._segments(held, grads)):
            if rank == dims.pipeline_rank:
                received, known = self._own_values(segments, own, own_grads, own_has_grad)
            else:
                received, known = self._broadcast_from(rank, segments, cost), [None] * len(segments)
            if rank == dims.pipeline_rank and segments:
                self._broadcast_own(segments, received, cost)
            for segment, value, flag in zip(segments, received, known, strict=True):
                key = (segment.name, segment.kind)
                if segment.kind in ("requires_grad", "has_grad"):
                    flags.setdefault(key, []).append(value if flag is None else flag)
                else:
                    values.setdefault(key, []).append(value)
        view = OpenView(cost=cost, _module=self.module)
        self._install(view, own, values, _read_flags(flags), grads)
        stats = self.stats()
        if stats is not None and cost.sent_bytes:
            stats.record("broadcast", cost.sent_bytes)
        return view

    def _own_gradients(
        self, own: dict[str, Tensor], entries: list[_Held], grads: GradientMode, cost: HookCost
    ) -> tuple[dict[str, Tensor | None], dict[str, Tensor | bool]]:
        """This rank's gradients as it sends them, and whether each is one (a host fact, or a device flag where the
        replicas' flags were reduced: read with the others in :func:`_read_flags`); with ``grads="local"`` averaged
        over the replicas first (one flat all-reduce of copies, the stage's own ``.grad`` untouched)."""
        if grads == "none":
            return {}, {}
        result: dict[str, Tensor | None] = {e.name: own[e.name].grad for e in entries if e.is_parameter}
        has_grad: dict[str, Tensor | bool] = {name: grad is not None for name, grad in result.items()}
        if grads == "reduced" or self.dims.data_parallel_size == 1:
            return result, has_grad
        names = list(result)
        parts: list[Tensor] = [_or_zeros(result[n], own[n]) for n in names]
        flags = _on_device([float(has_grad[n]) for n in names], self.device)
        flat = torch.cat([*(p.reshape(-1).to(flags.dtype) for p in parts), flags]) if names else flags
        dist.all_reduce(flat, group=self.dims.data_parallel_group)
        cost.collectives += 1
        cost.sent_bytes += flat.numel() * flat.element_size()
        flat[: flat.numel() - len(names)] /= self.dims.data_parallel_size
        offset, reduced = 0, (flat[flat.numel() - len(names) :] > 0).to(torch.float32)
        for index, (name, part) in enumerate(zip(names, parts, strict=True)):
            # Zeros where no replica had a gradient (each sent zeros): what is sent then, as for `None`.
            result[name] = flat[offset : offset + part.numel()].view_as(part).to(part.dtype)
            has_grad[name] = reduced[index]
            offset += part.numel()
        return result, has_grad

    def _own_values(
        self,
        segments: list[_Segment],
        own: dict[str, Tensor],
        own_grads: dict[str, Tensor | None],
        own_has_grad: dict[str, Tensor | bool],
    ) -> tuple[list[Tensor], list[bool | None]]:
        """What this rank sends (its tensors, its gradients or zeros, its flags) and, for each, the flag where the host
        knows it (``None`` for the rest). The host's flags go to the device in one copy that does not wait for the
        stream; they are sent, never read back."""
        known: list[bool | None] = [None] * len(segments)
        for index, segment in enumerate(segments):
            if segment.kind == "requires_grad":
                known[index] = own[segment.name].requires_grad
            elif segment.kind == "has_grad" and not isinstance(has_grad := own_has_grad[segment.name], Tensor):
                known[index] = has_grad
        host = [float(flag) for flag in known if flag is not None]
        moved = iter(_on_device(host, self.device).unbind() if host else ())
        result = []
        for segment, flag in zip(segments, known, strict=True):
            if segment.kind == "weight":
                result.append(own[segment.name].detach())
            elif segment.kind == "grad":
                result.append(_or_zeros(own_grads.get(segment.name), own[segment.name]).detach())
            elif flag is not None:
                result.append(next(moved))
            else:  # "has_grad" reduced over the replicas, on the device
                reduced = own_has_grad[segment.name]
                assert isinstance(reduced, Tensor)
                result.append(reduced)
        return result, known

    def _broadcast_own(self, segments: list[_Segment], values: list[Tensor], cost: HookCost) -> None:
        for dtype, indices in _by_dtype(segments).items():
            flat = torch.cat([values[i].reshape(-1).to(dtype) for i in indices])
            dist.broadcast(flat, src=self.dims.global_rank, group=self.dims.pipeline_group)
            cost.collectives += 1
            cost.sent_bytes += flat.numel() * flat.element_size()

    def _broadcast_from(self, rank: int, segments: list[_Segment], cost: HookCost) -> list[Tensor]:
        result: list[Tensor | None] = [None] * len(segments)
        for dtype, indices in _by_dtype(segments).items():
            flat = torch.empty(sum(segments[i].numel for i in indices), dtype=dtype, device=self.device)
            dist.broadcast(flat, src=self.dims.pipeline_global_rank(rank), group=self.dims.pipeline_group)
            cost.collectives += 1
            cost.received_bytes += flat.numel() * flat.element_size()
            offset = 0
            for i in indices:
                result[i] = flat[offset : offset + segments[i].numel].view(segments[i].shape)
                offset += segments[i].numel
        return [r for r in result if r is not None]

    # ------------------------------------------------------------------ install
    def _install(
        self,
        view: OpenView,
        own: dict[str, Tensor],
        values: dict[tuple[str, str], list[Tensor]],
        flags: dict[tuple[str, str], list[bool]],
        grads: GradientMode,
    ) -> None:
        shown: dict[str, Tensor] = {}  # canonical name -> what the module shows (one object per tied parameter)
        for name in {n for n, kind in values if kind == "weight"}:
            if name in own:
                shown[name] = own[name]
                continue
            (value,) = values[(name, "weight")]
            if (name, "requires_grad") in flags:  # a parameter
                shown[name] = nn.Parameter(value, requires_grad=flags[(name, "requires_grad")][0])
            elif value.is_floating_point() or value.is_complex():
                shown[name] = value
            else:
                shown[name] = value.clone()  # integer buffers: a view of the flat message would be fine too
            view.cost.held_bytes += value.numel() * value.element_size()
        if grads != "none":
            self._show_gradients(view, own, shown, values, flags, grads)
        for index, registrations in enumerate(self.registrations):
            if index in self.local:
                continue
            for registration in registrations:
                name = registration.name
                if registration.attribute is not None:  # a tensor an adapter holds itself: an empty slot here
                    prefix, _, leaf = name.rpartition(".")
                    self._put(view, self.module.get_submodule(prefix), leaf, shown.get(self.aliases.get(name, name)))
                    continue
                placeholder = self.module.get_submodule(name)
                self._fill(view, name, registration.holder, shown, training=placeholder.training)
                view._placeholders.append((name, placeholder))
                self.module.set_submodule(name, registration.holder)

    def _show_gradients(
        self,
        view: OpenView,
        own: dict[str, Tensor],
        shown: dict[str, Tensor],
        values: dict[tuple[str, str], list[Tensor]],
        flags: dict[tuple[str, str], list[bool]],
        grads: GradientMode,
    ) -> None:
        for name, parameter in shown.items():
            contributions = values.get((name, "grad"))
            if contributions is None:
                continue
            has_grad = any(flags[(name, "has_grad")])
            summed = contributions[0]
            for term in contributions[1:]:  # in pipeline-rank order: the same bits on every rank
                summed = summed + term
            grad = summed.to(parameter.dtype) if has_grad else None
            if name not in own:
                parameter.grad = grad
                view.cost.held_bytes += summed.numel() * summed.element_size() if has_grad else 0
            elif grads == "local" and (len(contributions) > 1 or self.dims.data_parallel_size > 1):
                view._grads.append((parameter, parameter.grad))  # type: ignore[arg-type]
                parameter.grad = grad

    def _fill(self, view: OpenView, prefix: str, layer: nn.Module, shown: dict[str, Tensor], *, training: bool) -> None:
        """Put the shown tensors into an offloaded layer's modules (those a local layer shares stay as they are)."""
        for name, submodule in layer.named_modules(prefix=prefix, remove_duplicate=False):
            if id(submodule) in self.local_modules:
                continue
            view._modes.append((submodule, submodule.training))
            submodule.training = training
            for leaf, tensor in [*submodule._parameters.items(), *submodule._buffers.items()]:
                if tensor is not None:
                    full = f"{name}.{leaf}"
                    self._put(view, submodule, leaf, shown.get(self.aliases.get(full, full)))

    @staticmethod
    def _put(view: OpenView, submodule: nn.Module, leaf: str, value: Tensor | None) -> None:
        """Show ``value`` as ``submodule.<leaf>`` (a parameter or buffer slot) until the view closes."""
        if value is None:
            return
        if leaf in submodule._parameters:
            view._tensors.append((submodule, leaf, submodule._parameters[leaf], True, True))
            submodule.register_parameter(leaf, value)  # type: ignore[arg-type]
        else:
            persistent = leaf not in submodule._non_persistent_buffers_set
            view._tensors.append((submodule, leaf, submodule._buffers[leaf], False, persistent))
            submodule.register_buffer(leaf, value, persistent=persistent)


def _on_device(flags: list[float], device: torch.device) -> Tensor:
    """Host flags as a float32 tensor on ``device``: one copy, which does not wait for the device's stream (a copy
    to the device from pageable memory is staged at once; without ``non_blocking`` torch also waits for the stream)."""
    return torch.tensor(flags, dtype=torch.float32).to(device, non_blocking=True)


def _read_flags(flags: dict[tuple[str, str], list[Tensor | bool]]) -> dict[tuple[str, str], list[bool]]:
    """Every flag of an open (``requires_grad``, "has a gradient") on the host: those this rank knows as they are,
    the others (received, or reduced over the replicas: float32 scalars on the device) in one read. On a GPU each read
    waits for everything queued on the device, so one per open instead of one per parameter (none when every flag is
    this rank's own)."""
    on_device = [flag.reshape(()) for values in flags.values() for flag in values if isinstance(flag, Tensor)]
    read = iter(torch.stack(on_device).tolist() if on_device else ())
    return {key: [bool(next(read)) if isinstance(f, Tensor) else f for f in values] for key, values in flags.items()}


def _or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def _by_dtype(segments: list[_Segment]) -> dict[torch.dtype, list[int]]:
    """Indices of ``segments`` per dtype, in a fixed order (every rank builds the same messages)."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, segment in enumerate(segments):
        groups.setdefault(segment.dtype, []).append(index)
    return dict(sorted(groups.items(), key=lambda item: str(item[0])))
