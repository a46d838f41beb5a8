"""Sharded checkpoints that load at any world size and under any of our strategies.

Layout of a sharded checkpoint directory (written in parallel by all ranks with ``torch.distributed.checkpoint``,
no gather to rank 0):

* one DCP entry per *piece*: ``"{key}/{parameter name}/{start}_{stop}"`` holds elements ``[start, stop)`` of the
  flattened parameter (``key`` is ``"param"`` for the values, or an optimizer state key such as ``"exp_avg"``);
  each rank writes the pieces it owns (ZeRO-1/2: its bucket shard; ZeRO-3: its rows; data parallel: an even
  split of every parameter, so the writes are parallel there too);
* ``"buffer/{name}"``: module buffers, written by rank 0;
* ``meta.pt``: everything else, written by rank 0: Lightning's training state (epoch, loops, callbacks,
  schedulers, ...), parameter shapes, the optimizer's param groups with parameter *names*, and each parameter's
  own 0-dim state by name (Adam's ``step``: a parameter without a gradient in some steps, such as an auxiliary
  head or a layer frozen for a while, has a count of its own).

Flat element ranges do not depend on the world size or the stage, so a reader can reassemble any range. The
directory is written under a temporary name and renamed into place, so an interrupted save never replaces the
previous checkpoint.
"""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "META_FILE",
    "DamagedCheckpointError",
    "FlatPiece",
    "ShardedCheckpointReader",
    "ShardedPieces",
    "add_aliases",
    "build_meta",
    "consolidate_checkpoint",
    "even_split",
    "gather_scalar_states",
    "host_copies",
    "host_copy",
    "is_sharded_checkpoint",
    "load_module_state",
    "param_groups_by_name",
    "place_scalar_state",
    "read_sharded_checkpoint",
    "replicated_pieces",
    "resolve_sharded_path",
    "safe_load",
    "save_sharded_checkpoint",
    "scalar_states",
    "sharded_to_consolidated",
]

META_FILE = "meta.pt"
FORMAT_VERSION = 1


@dataclass
class FlatPiece:
    """Elements ``[start, stop)`` of the flattened parameter ``name`` for ``key`` (``"param"`` or a state key)."""

    key: str
    name: str
    start: int
    stop: int
    tensor: Tensor

    @property
    def entry(self) -> str:
        return f"{self.key}/{self.name}/{self.start}_{self.stop}"


@dataclass(kw_only=True)
class ShardedPieces:
    """What this rank writes into a sharded checkpoint: its pieces and the optimizer's layout."""

    pieces: list[FlatPiece]
    """The flat ranges of parameters and optimizer state this rank owns."""
    group_params: list[list[nn.Parameter]] | None
    """The optimizer's parameter lists in the single-device layout (before any sharding)."""
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each parameter's own 0-dim optimizer state (Adam's ``step``) by name, complete on rank 0, which writes it
    (:func:`scalar_states`)."""


class DamagedCheckpointError(ValueError):
    """A checkpoint file is truncated, tampered with, or not a checkpoint at all."""


def safe_load(path: str | Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never code from the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for damaged files
        raise DamagedCheckpointError(
            f"Cannot load checkpoint {path}: it is truncated, was modified, or is not a checkpoint"
            f" ({type(error).__name__}: {str(error).splitlines()[0][:200]}). Nothing was loaded; resume from an"
            " earlier checkpoint."
        ) from error


def even_split(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of ``numel`` elements, as ``torch.chunk`` would cut it."""
    chunk = -(-numel // world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel)


def replicated_pieces(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, rank: int, world_size: int
) -> list[FlatPiece]:
    """Pieces of a module whose parameters and optimizer state every rank holds whole (data parallel, one device):
    each rank writes an even ``1/world_size`` of every tensor, so the writes are parallel and nothing is doubled."""
    pieces = []
    for name, param in module.named_parameters():
        start, stop = even_split(param.numel(), rank, world_size)
        if start == stop:
            continue
        pieces.append(FlatPiece("param", name, start, stop, param.detach().reshape(-1)[start:stop]))
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                pieces.append(FlatPiece(key, name, start, stop, value.reshape(-1)[start:stop]))
    return pieces


def host_copy(tensor: Tensor) -> Tensor:
    """A detached, independent copy of ``tensor`` on the CPU (a copy also when it is on the CPU already).

    Whatever our code assembles for a checkpoint or puts into an object collective goes through this, one tensor at a
    time: a consolidated state built on the device would need a second copy of the model there at the moment of a
    save, and a CUDA tensor pickled by ``all_gather_object`` unpickles onto the *sender's* device index (rank 0 would
    receive tensors on ``cuda:1``; torch documents the object collectives as pickling tensors as they are).
    """
    return tensor.detach().to("cpu", copy=True)


def host_copies(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with every tensor replaced by its :func:`host_copy`."""
    if isinstance(value, Tensor):
        return host_copy(value)
    if isinstance(value, dict):
        return {key: host_copies(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(host_copies(item) for item in value)
    return value


def place_scalar_state(key: str, value: Any, *, param: Tensor, group: Mapping[str, Any]) -> Any:
    """A private copy of a loaded 0-dim optimizer state value, placed as ``torch.optim.Optimizer.load_state_dict``
    places it: Adam's ``step`` moves to ``param``'s device as fp32 when the group is ``fused`` or ``capturable`` (their
    kernels read it there; checkpoints hold it on the CPU, :func:`host_copy`), else stays where it is (the CPU);
    other tensors take ``param``'s device (and its dtype when floating point)."""
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(device=param.device, dtype=torch.float32, copy=True)
        return value.clone()
    dtype = param.dtype if param.is_floating_point() else value.dtype
    return value.to(device=param.device, dtype=dtype, copy=True)


def scalar_states(
    named_parameters: Iterable[tuple[str, Tensor]], optimizer: torch.optim.Optimizer | None
) -> dict[str, dict[str, Any]]:
    """Each parameter's own 0-dim optimizer state (Adam's ``step``) by name, for the parameters that have state in
    ``optimizer`` (what ``meta.pt`` keeps under ``"scalars"``; per-element state goes into the pieces).

    Per parameter, never one parameter's for all: torch's optimizers skip a parameter whose gradient is ``None``, so
    an auxiliary head used every other step has half the trunk's ``step``, and AdamW's bias correction reads it.
    Host copies (:func:`host_copy`): a fused or capturable Adam keeps ``step`` on the device.
    """
    if optimizer is None:
        return {}
    scalars = {}
    for name, param in named_parameters:
        state = optimizer.state.get(param)
        if state:
            scalars[name] = {k: host_copies(v) for k, v in state.items() if not (isinstance(v, Tensor) and v.dim() > 0)}
    return scalars


def gather_scalar_states(
    local: Mapping[str, dict[str, Any]], *, group: dist.ProcessGroup | None = None
) -> dict[str, dict[str, Any]]:
    """Collective over ``group`` when distributed: the union of every rank's :func:`scalar_states`, for writers
    whose ranks hold different parameters (pipeline stages). A name held by several ranks (replicas, tied copies)
    has the same state on each; the lowest rank's is kept."""
    if not _is_distributed():
        return dict(local)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, host_copies(dict(local)), group=group)
    merged: dict[str, dict[str, Any]] = {}
    for states in gathered:
        for name, state in states.items():
            merged.setdefault(name, state)
    return merged


def build_meta(
    module: torch.nn.Module,
    *,
    lightning_checkpoint: dict[str, Any],
    param_groups: list[dict[str, Any]] | None,
    scalars: dict[str, dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``meta.pt`` content and the buffers to write. ``param_groups`` name their parameters (not indices);
    ``scalars`` holds each parameter's own 0-dim optimizer state (:func:`scalar_states`).

    A tied parameter (one tensor under several names, e.g. an embedding reused as the LM head) is written once
    under its first name; ``aliases`` maps its other names to it, so loading restores every name.
    """
    canonical = {id(param): name for name, param in module.named_parameters()}
    aliases = {
        name: canonical[id(param)]
        for name, param in module.named_parameters(remove_duplicate=False)
        if canonical[id(param)] != name
    }
    state_dict = module.state_dict()
    buffers = {
        name: tensor for name, tensor in state_dict.items() if name not in aliases and name not in canonical.values()
    }
    meta = {
        "lightning": lightning_checkpoint,
        "shapes": {name: tuple(param.shape) for name, param in module.named_parameters()},
        "aliases": aliases,
        "state_dict_order": list(state_dict),
        "param_groups": param_groups,
        "scalars": scalars,
    }
    return meta, buffers


def add_aliases(state_dict: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Tensor]:
    """Restore the other names of tied parameters (see :func:`build_meta`), in the saved order."""
    for alias, name in meta.get("aliases", {}).items():
        state_dict[alias] = state_dict[name]
    order = meta["state_dict_order"]
    return dict(sorted(state_dict.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))


def param_groups_by_name(module: torch.nn.Module, groups: list[list[Any]], hyperparameters: list[dict]) -> list[dict]:
    """Param groups with parameter names instead of tensors (world-size independent)."""
    name_of = {param: name for name, param in module.named_parameters()}
    named = []
    for params, group in zip(groups, hyperparameters, strict=True):
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = [name_of[param] for param in params]
        named.append(saved)
    return named


def load_module_state(module: nn.Module, state_dict: Any, *, strict: bool) -> None:
    """``module.load_state_dict`` with torch's shape/key mismatch turned into a ``ValueError`` that says what happened.

    Every rank loads the same file, so every rank raises the same error (nothing hangs, nothing is trained).
    """
    try:
        module.load_state_dict(state_dict, strict=strict)
    except RuntimeError as error:
        text = str(error)
        if "size mismatch" not in text and "Missing key" not in text and "Unexpected key" not in text:
            raise
        details = "; ".join(line.strip() for line in text.splitlines()[1:4])
        raise ValueError(
            f"The checkpoint does not match this model ({details} ...): it was saved from a different model or"
            " configuration. Load a checkpoint of this model, or pass `strict=False` only if you mean a partial load."
        ) from error


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = resolve_sharded_path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def resolve_sharded_path(path: str | Path) -> Path:
    """``path``, or the previous checkpoint a save was replacing when it was killed between its two renames."""
    path = Path(path)
    previous = path.with_name(path.name + ".previous")
    if not path.exists() and (previous / META_FILE).is_file():
        return previous
    return path


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def save_sharded_checkpoint(
    path: str | Path, pieces: Iterable[FlatPiece], *, buffers: dict[str, Tensor], meta: dict[str, Any]
) -> None:
    """Collective when distributed. Every rank passes its own pieces; ``buffers``/``meta`` are used on rank 0."""
    path = Path(path)
    rank = dist.get_rank() if _is_distributed() else 0
    staging = path.with_name(path.name + ".partial")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    if _is_distributed():
        dist.barrier()
    entries: dict[str, Tensor] = {piece.entry: piece.tensor.detach().contiguous().cpu() for piece in pieces}
    if rank == 0:
        entries.update({f"buffer/{name}": tensor.detach().cpu() for name, tensor in buffers.items()})
    dcp.save(entries, checkpoint_id=staging)
    if rank == 0:
        torch.save({**meta, "format_version": FORMAT_VERSION}, staging / META_FILE)
        previous = path.with_name(path.name + ".previous")
        if path.exists():
            shutil.rmtree(previous, ignore_errors=True)
            path.rename(previous)  # replaced only once the new one is complete
        staging.rename(path)
        shutil.rmtree(previous, ignore_errors=True)
    if _is_distributed():
        dist.barrier()


def read_sharded_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str, str], Tensor]]:
    """Collective when distributed. Load ``meta.pt`` and every piece, reassembled per ``(key, name)`` (flat)."""
    path = resolve_sharded_path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint directory (no {META_FILE} or .metadata).")
    meta = safe_load(path / META_FILE)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    entries = {
        key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    _dcp_load(entries, path)
    flat: dict[tuple[str, str], list[tuple[int, int, Tensor]]] = defaultdict(list)
    buffers = {}
    for entry, tensor in entries.items():
        if entry.startswith("buffer/"):
            buffers[entry.removeprefix("buffer/")] = tensor
            continue
        key, rest = entry.split("/", 1)
        name, span = rest.rsplit("/", 1)
        start, stop = (int(x) for x in span.split("_"))
        flat[(key, name)].append((start, stop, tensor))
    assembled = {}
    for (key, name), parts in flat.items():
        numel = math.prod(meta["shapes"][name])
        full = torch.empty(numel, dtype=parts[0][2].dtype)
        covered = 0
        for start, stop, tensor in sorted(parts, key=lambda part: part[0]):
            full[start:stop] = tensor
            covered += stop - start
        if covered != numel:
            raise ValueError(f"Sharded checkpoint {path} is incomplete: `{key}` of `{name}` covers {covered}/{numel}.")
        assembled[(key, name)] = full
    meta["buffers"] = buffers
    return meta, assembled


def _dcp_load(entries: dict[str, Tensor], path: Path) -> None:
    try:
        dcp.load(entries, checkpoint_id=path)
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        raise DamagedCheckpointError(
            f"Cannot read sharded checkpoint {path}: a data file is missing or damaged ({type(error).__name__})."
            " Nothing was loaded; resume from an earlier checkpoint."
        ) from error


def sharded_to_consolidated(path: str | Path) -> dict[str, Any]:
    """Collective when distributed. A sharded checkpoint as the plain Lightning checkpoint dict (consolidated)."""
    meta, flat = read_sharded_checkpoint(path)
    shapes = meta["shapes"]
    state_dict = {name: flat[("param", name)].view(shapes[name]) for name in shapes}
    state_dict.update(meta["buffers"])
    checkpoint = dict(meta["lightning"])
    checkpoint["state_dict"] = add_aliases(state_dict, meta)
    if meta.get("param_groups") is not None:
        checkpoint["optimizer_states"] = [_consolidated_optimizer(meta, flat)]
    return checkpoint


def _consolidated_optimizer(meta: dict[str, Any], flat: dict[tuple[str, str], Tensor]) -> dict[str, Any]:
    shapes = meta["shapes"]
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in meta["param_groups"]:
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = []
        for name in group["params"]:
            entry = {key: tensor.view(shapes[name]) for (key, other), tensor in flat.items() if other == name}
            entry.pop("param", None)
            if entry:
                # A private copy per parameter: optimizers increment `step` in place.
                scalars = meta["scalars"].get(name, {})
                entry.update({k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars.items()})
                state[index] = entry
            saved["params"].append(index)
            index += 1
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def consolidate_checkpoint(sharded_path: str | Path, output_file: str | Path) -> Path:
    """Convert a sharded checkpoint directory into one consolidated Lightning ``.ckpt`` (single process, no GPU).

    The result loads with ``LightningModule.load_from_checkpoint`` and plain single-device Lightning.
    """
    checkpoint = sharded_to_consolidated(sharded_path)
    output_file = Path(output_file)
    partial = output_file.with_name(output_file.name + ".partial")
    torch.save(checkpoint, partial)
    partial.replace(output_file)
    return output_file


class ShardedCheckpointReader:
    """Reads element ranges of a sharded checkpoint, loading only the pieces that overlap them.

    A rank asks for exactly what it will hold (its bucket shard, its rows), so resuming never materialises the
    full state on a rank that does not hold it. :meth:`read` is collective when distributed: every rank calls it
    the same number of times, with its own (possibly empty) requests.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = resolve_sharded_path(path)
        if not is_sharded_checkpoint(self.path):
            raise FileNotFoundError(f"{self.path} is not a sharded checkpoint directory (no {META_FILE} or .metadata).")
        self.meta = safe_load(self.path / META_FILE)
        metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
        self._pieces: dict[tuple[str, str], list[tuple[int, int, str, torch.dtype]]] = defaultdict(list)
        self.buffer_entries: dict[str, Any] = {}
        self.bytes_read = 0  # what this rank loaded so far: the test of "only the ranges it holds"
        for entry, item in metadata.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata):  # bytes entries have no tensor size
                continue
            if entry.startswith("buffer/"):
                self.buffer_entries[entry] = item
                continue
            key, rest = entry.split("/", 1)
            name, span = rest.rsplit("/", 1)
            start, stop = (int(x) for x in span.split("_"))
            self._pieces[(key, name)].append((start, stop, entry, item.properties.dtype))

    def keys_of(self, name: str) -> list[str]:
        """State keys saved for parameter ``name`` (``"param"`` and optimizer keys)."""
        return sorted(key for key, other in self._pieces if other == name)

    def read(self, requests: Iterable[tuple[str, str, int, int]], *, with_buffers: bool = False) -> dict[Any, Tensor]:
        """Tensors for ``(key, name, start, stop)`` requests (flat), plus ``"buffer/<name>"`` entries if asked."""
        requests = list(requests)
        entries: dict[str, Tensor] = {}
        plan = []
        for key, name, start, stop in requests:
            overlapping = [p for p in self._pieces.get((key, name), []) if p[0] < stop and p[1] > start]
            if sum(min(stop, p[1]) - max(start, p[0]) for p in overlapping) != stop - start:
                raise ValueError(
                    f"Sharded checkpoint {self.path} lacks elements [{start}, {stop}) of `{key}` of `{name}`."
                )
            for piece_start, piece_stop, entry, dtype in overlapping:
                entries.setdefault(entry, torch.empty(piece_stop - piece_start, dtype=dtype))
            plan.append(((key, name, start, stop), overlapping))
        if with_buffers:
            for entry, item in self.buffer_entries.items():
                entries[entry] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        _dcp_load(entries, self.path)
        self.bytes_read += sum(tensor.numel() * tensor.element_size() for tensor in entries.values())
        result: dict[Any, Tensor] = {}
        for (key, name, start, stop), overlapping in plan:
            out = torch.empty(stop - start, dtype=overlapping[0][3] if overlapping else torch.float32)
            for piece_start, piece_stop, entry, _ in overlapping:
                lo, hi = max(start, piece_start), min(stop, piece_stop)
                out[lo - start : hi - start] = entries[entry][lo - piece_start : hi - piece_start]
            result[(key, name, start, stop)] = out
        if with_buffers:
            result.update({entry: entries[entry] for entry in self.buffer_entries})
        return result
