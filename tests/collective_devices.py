"""A simulated accelerator for CPU runs: which tensors a GPU run would hold on the device, and what our code hands
to collectives.

On a CPU run every tensor is on the CPU, so "the consolidated checkpoint is assembled on the CPU" and "no CUDA tensor
is pickled by an object collective" hold whatever the code does. :class:`DeviceSimulation` gives those checks teeth:
it follows, op by op, where each storage would live if ``root_device`` were an accelerator, and checks every
collective against that.

Placement of a storage, following what a GPU run does:

* *device*: seeded (:meth:`DeviceSimulation.seed`: parameters, buffers, optimizer state, ZeRO's buckets), or created
  by an op with an input on the device (``torch.cat`` of gathered pieces, ``clone``, ``empty_like``, a dtype cast);
* *host*: the result of ``Tensor.cpu()`` or ``Tensor.to("cpu", ...)`` (a string: ``.to(device)`` with a
  ``torch.device`` is how Lightning and torch move to the root device, which the CPU cannot tell apart), or created
  from host inputs only. Where the CPU makes such a move a no-op (it returns the tensor itself), the simulation
  returns a copy, as the GPU would;
* unknown: created from no tensor (``torch.zeros(n, device=...)``: the CPU cannot tell ``device="cpu"`` from
  ``device=param.device``). ``copy_`` into such a buffer gives it the source's placement (a buffer allocated to
  receive device data is on the device); in-place ops and views keep a storage's placement. With
  ``factories_on_device=True`` a factory given ``device=`` as a ``torch.device`` is on the device instead (as
  ``.to(device)``: how code allocates on the root device; a string ``"cpu"`` stays the host);
* with ``object_buffers_on_device=True``, the byte buffers torch's object collectives hand to ``c10d`` ops are on the
  device, as NCCL's are (``torch.cuda.current_device()``): an object collective over NCCL holds every rank's pickled
  payload on the receiving device, which :meth:`DeviceSimulation.region` then counts.

Checks, each failure kept in :attr:`DeviceSimulation.violations`:

(a) every tensor handed to a ``c10d`` op is on ``root_device`` (the group's backend device), and is no host copy
    (NCCL refuses CPU tensors), except the byte buffers torch's object collectives make themselves;
(b) no tensor in the payload of an object collective (``all_gather_object``, ``gather_object``,
    ``broadcast_object_list``, ``scatter_object_list``, ``send_object_list``) is off the CPU or on the simulated
    device (the training tensors of ``held`` are re-seeded first, so a live ``step`` counter is caught); a ``meta``
    tensor (shapes only: torch 2.11's pipeline shape inference sends its outputs so) is not a violation;

and :meth:`DeviceSimulation.device_tensors` lists what a result (a consolidated state dict) still holds on the device.
:meth:`DeviceSimulation.region` measures the peak bytes of device storages above the region's start.

:class:`HostReads` also counts the host reads of device storages (each one, on a GPU, a wait for everything queued on
the device before it), telling the device's groups from the CPU groups of host facts.

Both a ``TorchFunctionMode`` (to see ``.cpu()`` calls the CPU turns into no-ops) and a ``TorchDispatchMode`` (every
op, including the ``c10d`` ones eager collectives go through, as ``monitor/ledger.py`` uses) are entered; nothing
of torch is replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode  # private: as monitor/ledger.py and accounting.py
from torch.utils._pytree import tree_flatten

from lightning_parallel.accounting import tensor_storages

__all__ = ["DeviceSimulation", "HostReads", "Region", "package_frame"]

DEVICE, HOST = "device", "host"

# The payload argument of each object collective (torch 2.13 names; the functions are wrapped by c10d's loggers).
_PAYLOADS: dict[Any, str] = {
    inspect.unwrap(getattr(dist, name)).__code__: argument
    for name, argument in (
        ("all_gather_object", "obj"),
        ("gather_object", "obj"),
        ("broadcast_object_list", "object_list"),
        ("scatter_object_list", "scatter_object_input_list"),
        ("send_object_list", "object_list"),
        ("recv_object_list", "object_list"),
    )
}
_RECEIVES = {inspect.unwrap(dist.recv_object_list).__code__}  # its list holds what arrives, nothing sent


def _storages(tensor: Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensor`` (the package's own walk), none for sparse, functional or fake tensors."""
    try:
        yield from tensor_storages(tensor)
    except (RuntimeError, NotImplementedError):
        return


def _tensors(value: Any) -> list[Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor)]


def _payload_tensors(value: Any, depth: int = 0) -> Iterator[Tensor]:
    """Tensors in an object collective's payload: through dicts, lists, tuples, sets and dataclasses."""
    if depth > 8:
        return
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _payload_tensors(key, depth + 1)
            yield from _payload_tensors(item, depth + 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _payload_tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            yield from _payload_tensors(getattr(value, item.name, None), depth + 1)


def _object_collective_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the object collective that issued the ``c10d`` op being dispatched, if any."""
    while frame is not None:
        if frame.f_code in _PAYLOADS:
            return frame
        frame = frame.f_back
    return None


def _targets_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` asks for a host tensor: ``.cpu()`` or ``.to("cpu", ...)``. ``.to(device)``
    with a ``torch.device`` is taken for a move to ``root_device`` (the CPU cannot tell the two apart; Lightning and
    torch move to the root device so)."""
    if func is Tensor.cpu:
        return True
    if func is not Tensor.to:
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(target, str) and torch.device(target).type == "cpu" for target in targets)


def _allocates_on_a_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call creates a tensor from no tensor on a ``torch.device`` (``torch.empty(n, device=device)``)."""
    return isinstance(kwargs.get("device"), torch.device) and not _tensors((args, kwargs))


@dataclass
class Region:
    """Device bytes over a region of code (:meth:`DeviceSimulation.region`)."""

    start_bytes: int = 0
    peak_bytes: int = 0

    @property
    def extra_bytes(self) -> int:
        """Peak bytes of device storages above those live at the region's start."""
        return self.peak_bytes - self.start_bytes


class DeviceSimulation:
    """Context manager: follow where each storage would live if ``root_device`` were an accelerator, and check the
    collectives issued meanwhile (see the module docstring).

    Args:
        root_device: the device the group's backend needs (the strategy's ``root_device``).
        held: the training tensors (parameters, optimizer state, ...), re-seeded as device tensors before each object
            collective's payload is checked; settable later (a callback sets it once the strategy is set up).
    """

    def __init__(
        self,
        *,
        root_device: torch.device,
        held: Callable[[], Iterable[Tensor]] | None = None,
        device_type_branches: tuple[str, ...] = (),
        factories_on_device: bool = False,
        object_buffers_on_device: bool = False,
    ) -> None:
        self.root_device = root_device
        self.held = held
        self.factories_on_device = factories_on_device
        self.object_buffers_on_device = object_buffers_on_device
        self.device_type_branches = device_type_branches
        """Modules whose object collectives' payloads are checked against the real device only: they move a tensor
        to the host only ``if tensor.device.type != "cpu"``, which the CPU cannot be made to take."""
        self.violations: list[str] = []
        self.object_collectives = 0
        self.tensor_collectives = 0
        self.device_bytes = 0
        self._placement: dict[int, str] = {}
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._regions: list[Region] = []
        self._moving_to_host = 0  # inside `.cpu()` / `.to("cpu")`
        self._modes = (_FunctionHook(self), _DispatchHook(self))

    def __enter__(self) -> DeviceSimulation:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._refs.clear()  # no callbacks after the run

    # ------------------------------------------------------------------ placement
    def seed(self, tensors: Iterable[Tensor]) -> None:
        """Mark ``tensors``' storages as on the device."""
        for tensor in tensors:
            self._mark(tensor, DEVICE)

    def placement(self, tensor: Tensor) -> str | None:
        """``"device"`` if any of ``tensor``'s storages is on the device, else ``"host"`` if one is known to be on the
        host, else ``None``."""
        found = {self._placement.get(storage._cdata) for storage in _storages(tensor)}
        return DEVICE if DEVICE in found else HOST if HOST in found else None

    def device_tensors(self, value: Any) -> list[str]:
        """Paths (``state/0/exp_avg``) of the tensors in ``value`` (nested dicts, lists, tuples) on the device."""
        found = []

        def walk(item: Any, path: str) -> None:
            if isinstance(item, Tensor):
                if item.device.type != "cpu" or self.placement(item) == DEVICE:
                    found.append(path)
            elif isinstance(item, dict):
                for key, child in item.items():
                    walk(child, f"{path}/{key}")
            elif isinstance(item, list | tuple):
                for index, child in enumerate(item):
                    walk(child, f"{path}/{index}")

        walk(value, "")
        return found

    @contextmanager
    def region(self) -> Generator[Region, None, None]:
        """The peak bytes of device storages while the block runs (:attr:`Region.extra_bytes`)."""
        region = Region(start_bytes=self.device_bytes, peak_bytes=self.device_bytes)
        self._regions.append(region)
        try:
            yield region
        finally:
            self._regions.remove(region)

    def _mark(self, tensor: Tensor, placement: str) -> None:
        for storage in _storages(tensor):
            self._set(storage, placement)

    def _set(self, storage: torch.UntypedStorage, placement: str) -> None:
        key = storage._cdata
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, functools.partial(self._forget_ref, key))
            self._bytes[key] = storage.nbytes()
        previous = self._placement.get(key)
        self._placement[key] = placement
        if previous != DEVICE and placement == DEVICE:
            self.device_bytes += self._bytes[key]
            for region in self._regions:
                region.peak_bytes = max(region.peak_bytes, self.device_bytes)
        elif previous == DEVICE and placement != DEVICE:
            self.device_bytes -= self._bytes[key]

    def _forget_ref(self, key: int, _ref: weakref.ref) -> None:
        self._forget(key)

    def _forget(self, key: int) -> None:
        if self._placement.pop(key, None) == DEVICE:
            self.device_bytes -= self._bytes[key]
        self._bytes.pop(key, None)
        self._refs.pop(key, None)

    # ------------------------------------------------------------------ checks
    def _violation(self, message: str) -> None:
        if message not in self.violations:
            self.violations.append(message)

    def _check_collective(self, func: Any, tensors: list[Tensor], frame: FrameType | None) -> None:
        collective = _object_collective_frame(frame)
        if collective is not None:
            self._check_payload(collective)
            if self.object_buffers_on_device:
                for tensor in tensors:
                    self._mark(tensor, DEVICE)
        else:
            self.tensor_collectives += 1
        for tensor in tensors:
            where = _issuer(frame)
            if tensor.device.type != self.root_device.type:
                self._violation(
                    f"(a) {func} from {where}: a tensor on {tensor.device}, the group needs {self.root_device}"
                )
            elif collective is None and self.placement(tensor) == HOST:
                self._violation(f"(a) {func} from {where}: a host copy {tuple(tensor.shape)} (NCCL needs the device)")

    def _check_payload(self, frame: FrameType) -> None:
        if frame.f_code in _RECEIVES:
            return
        self.object_collectives += 1
        if self.held is not None:
            self.seed(self.held())
        name = frame.f_code.co_name
        where = _issuer(frame.f_back)
        simulated = not where.startswith(self.device_type_branches) if self.device_type_branches else True
        for tensor in _payload_tensors(frame.f_locals.get(_PAYLOADS[frame.f_code])):
            if tensor.device.type == "meta":  # shapes only, no bytes: torch 2.11's pipeline shape inference sends them
                continue
            if tensor.device.type != "cpu":
                self._violation(f"(b) {name} from {where}: a tensor on {tensor.device} in the payload")
            elif simulated and self.placement(tensor) == DEVICE:
                self._violation(f"(b) {name} from {where}: a device tensor {tuple(tensor.shape)} in the payload")


def _issuer(frame: FrameType | None) -> str:
    """``module:line`` of the innermost frame outside torch (who called the collective)."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("torch") and frame.f_code.co_filename != __file__:
            return f"{module}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _FunctionHook(TorchFunctionMode):
    """Sees ``.cpu()`` / ``.to("cpu")``, which the CPU runs as no-ops that no dispatch mode sees."""

    def __init__(self, simulation: DeviceSimulation) -> None:
        super().__init__()
        self.simulation = simulation

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.simulation.factories_on_device and _allocates_on_a_device(args, kwargs):
            out = func(*args, **kwargs)
            for tensor in _tensors(out):
                self.simulation._mark(tensor, DEVICE)
            return out
        if not _targets_host(func, args, kwargs):
            return func(*args, **kwargs)
        self.simulation._moving_to_host += 1  # what the ops of the move create is on the host
        try:
            out = func(*args, **kwargs)
            if isinstance(out, Tensor) and out.device.type == "cpu":
                source = args[0]
                shared = {s._cdata for s in _storages(out)} & {s._cdata for s in _storages(source)}
                if not shared:
                    self.simulation._mark(out, HOST)
                elif self.simulation.placement(source) == DEVICE:
                    out = out.clone()  # on a GPU, a new tensor on the host
        finally:
            self.simulation._moving_to_host -= 1
        return out


class _DispatchHook(TorchDispatchMode):
    """Propagates placements through every op and checks the ``c10d`` ones."""

    def __init__(self, simulation: DeviceSimulation) -> None:
        super().__init__()
        self.simulation = simulation

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        simulation = self.simulation
        inputs = _tensors((args, kwargs))
        if func.namespace == "c10d":
            simulation._check_collective(func, inputs, sys._getframe(1))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            source = simulation.placement(args[1])
            if source is not None and simulation.placement(args[0]) is None:
                simulation._mark(args[0], source)
            return out
        placements = {simulation.placement(tensor) for tensor in inputs}
        placement = DEVICE if DEVICE in placements else HOST if HOST in placements else None
        if simulation._moving_to_host:
            placement = HOST
        if placement is None:
            return out
        existing = {storage._cdata for tensor in inputs for storage in _storages(tensor)}
        for tensor in _tensors(out):
            for storage in _storages(tensor):
                if storage._cdata not in existing:  # new storage; in place ops and views keep theirs
                    simulation._set(storage, placement)
        return out


_READS = (Tensor.tolist, Tensor.numpy)


class HostReads(DeviceSimulation):
    """A :class:`DeviceSimulation` that counts, by the innermost frame of ``lightning_parallel`` that issued it, each
    host read of a tensor a GPU run would hold on the device: ``.item()``/``bool()``/``int()``/``float()``
    (``aten._local_scalar_dense``), ``.tolist()``, ``.numpy()``, ``.cpu()``/``.to("cpu")``. On a GPU each one waits for
    everything queued on the device before it. (The CPU alone cannot tell them apart from reads of host tensors:
    ``.tolist()`` and ``.cpu()`` dispatch no read there.)

    Beyond the placements of :class:`DeviceSimulation`, every tensor handed to a collective of a device group is on the
    device (NCCL takes nothing else): of every group but ``host_groups()``, the CPU (gloo) groups of host facts.

    Args:
        root_device: as :class:`DeviceSimulation`'s.
        host_groups: the process groups whose tensors stay on the host (asked at each collective).
    """

    def __init__(
        self, *, root_device: torch.device, host_groups: Callable[[], Iterable[dist.ProcessGroup]] = tuple
    ) -> None:
        super().__init__(root_device=root_device)
        self.host_groups = host_groups
        self.by_caller: dict[str, int] = {}
        self._read_modes = (_ReadFunctions(self), _ReadOps(self))  # entered last: each sees a call first

    def __enter__(self) -> HostReads:
        super().__enter__()
        for mode in self._read_modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._read_modes):
            mode.__exit__(*exc)
        super().__exit__(*exc)

    def _observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before ``func`` runs: count it if it reads a device tensor on the host; seed what it hands to a collective
        of a device group."""
        if func is torch.ops.aten._local_scalar_dense.default or func in _READS or _targets_host(func, args, kwargs):
            if isinstance(args[0], Tensor) and self.placement(args[0]) == DEVICE:
                where = package_frame(sys._getframe(2))
                self.by_caller[where] = self.by_caller.get(where, 0) + 1
        elif getattr(func, "namespace", None) == "c10d" and not self._on_host_group(args):
            self.seed(_tensors((args, kwargs)))

    def _on_host_group(self, args: tuple[Any, ...]) -> bool:
        hosts = {id(group) for group in self.host_groups()}
        return any(id(group) in hosts for group in map(_process_group, args))


class _ReadFunctions(TorchFunctionMode):
    """Shows :class:`HostReads` every function call (``.tolist()``, ``.cpu()``), before it runs."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.reads._observe(func, args, kwargs)
        return func(*args, **kwargs)


class _ReadOps(TorchDispatchMode):
    """Shows :class:`HostReads` every op (``_local_scalar_dense``, the ``c10d`` ones), before it runs."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.reads._observe(func, args, kwargs)
        return func(*args, **kwargs)


def _process_group(arg: Any) -> dist.ProcessGroup | None:
    """The process group a ``c10d`` op's argument boxes (a ``ScriptObject``; others box a ``ReduceOp``), or ``None``."""
    if not isinstance(arg, torch.ScriptObject):
        return None
    try:
        return dist.ProcessGroup.unbox(arg)
    except RuntimeError:
        return None


def package_frame(frame: FrameType | None) -> str:
    """``path:function`` (the path below ``lightning_parallel/``) of the innermost frame of the package, or
    ``"elsewhere"`` (Lightning's or torch's own reads)."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/lightning_parallel/" in path and "/tests/" not in path:
            return f"{path.split('/lightning_parallel/')[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"
