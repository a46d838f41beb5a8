"""ZeRO stage 3 through torch's FSDP2 (``fully_shard``), applied automatically per block
(:func:`~lightning_parallel.distributed.blocks.find_blocks`: the blocks a model declares, else its repeated blocks).

FSDP2 is torch's maintained engine for parameter sharding (DTensor parameters sharded on dim 0, all-gathered per
block for forward/backward, gradients reduce-scattered), so we only decide *where* to apply it, materialise
meta-device models shard by shard, and convert state dicts to the plain (consolidated) layout.

fp32 master weights for 16-bit training (ZeRO paper section 3.1): the sharded parameters are fp32 (the masters, what
the optimizer steps, so its state is fp32) and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
all-gathers them in bf16 for forward/backward and reduce-scatters the gradients in fp32
(:func:`upcast_16bit_parameters`, :func:`master_weight_policy`).
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from lightning_parallel.distributed.blocks import find_blocks
from lightning_parallel.distributed.broadcast import broadcast_from_rank0  # re-exported: the ZeRO-3 backend's
from lightning_parallel.distributed.checkpoint import FlatPiece, ShardedCheckpointReader, even_split, place_scalar_state
from lightning_parallel.distributed.zero import stage3_compat

__all__ = [
    "apply_fully_shard",
    "broadcast_from_rank0",
    "cast_parameters",
    "consolidated_model_state",
    "consolidated_optimizer_state",
    "contains",
    "fsdp_units",
    "gathered_through_backward",
    "load_consolidated_model_state",
    "load_consolidated_optimizer_state",
    "load_from_reader",
    "master_weight_policy",
    "materialize_meta_module",
    "named_sharded_pieces",
    "refresh_gradient_dtypes",
    "round_parameters",
    "shard_coordinates",
    "sharded_pieces",
    "upcast_16bit_parameters",
]


def apply_fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    keep_wrapped_model_gathered: bool = True,
) -> list[nn.Module]:
    """Shard each block (:func:`~lightning_parallel.distributed.blocks.find_blocks`), then each top-level child
    holding the remaining parameters, then ``module`` itself as the root unit; return the units, the root last.

    A unit that holds only some of the names of a tied parameter (e.g. an embedding whose weight is also the LM
    head's) is not sharded on its own: sharding it would untie the weights. Whatever no unit covers (tied weights,
    parameters of the LightningModule itself) is sharded with the root; FSDP2 gathers a unit's parameters in its
    ``forward`` hook, which fires when ``training_step`` calls ``self(...)``.

    The root is sharded even when it holds no parameter: FSDP2 shares one communication context between a root and
    the units below it, and recycles the reduce-scatter input (a unit's whole gradients in the reduce dtype) of one
    unit when the next unit reduces. A unit nested in no other unit is a root of its own with a context of its own,
    which keeps its last reduce-scatter input until the end of backward: with the blocks as siblings every block's
    whole fp32 gradients stayed alive until backward ended (measured: 12 x 27 MiB per rank on a 12-layer GPT, d=768).
    Call :func:`~lightning_parallel.distributed.zero.stage3_compat.initialise_root` once the parameters are materialised
    so that the root stays the root whichever unit's forward runs first.

    Every unit reshards after its forward except those :func:`gathered_through_backward` names (with
    ``keep_wrapped_model_gathered``; a pipeline stage passes ``False``: its micro-batches' forwards and backwards
    interleave, so no forward ends just before its backward).

    Idempotent: units that are already sharded (a second ``fit``/``validate`` of the same module) are kept as they are.
    """
    policy = mp_policy or MixedPrecisionPolicy()
    units = fsdp_units(module)
    if not units or units[-1] is not module:
        units.append(module)
    gathered = gathered_through_backward(module, units) if keep_wrapped_model_gathered else [module]
    for unit in units:
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
            if unit is not module:
                # FSDP2 keeps a root unit gathered from forward to backward. Should a nested unit's forward run before
                # the root was initialised, that unit would become a root of its own: it must reshard all the same.
                assert isinstance(unit, FSDPModule)  # fully_shard swapped its class
                unit.set_reshard_after_forward(not any(unit is kept for kept in gathered), recurse=False)
    return units


def gathered_through_backward(module: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The units that stay gathered from their forward to their backward: the root ``module`` (FSDP2's own rule:
    backward would gather it again at once), and, when the root holds no parameter of its own, the one unit all the
    others are nested in, if there is one: the model a LightningModule wraps (``self.model``, which holds the
    embedding and the head). Its forward encloses every other unit's and ends just before backward starts, which
    needs it first, so resharding it in between saved no memory at the peak (backward's start) and cost one more
    all-gather of its parameters per step; FSDP2 applied to that model directly (Lightning's ``ModelParallelStrategy``
    with ``fully_shard(self.model)``) keeps it gathered as its root (measured: 4% of a ZeRO-3 step at ``gpt-20m``,
    whose embedding and head are 31% of the parameters). ``units``: :func:`fsdp_units`' (``module`` may be among
    them)."""
    inner = [unit for unit in units if unit is not module]
    covered = {id(p) for unit in inner for p in unit.parameters()}
    if any(id(p) not in covered for p in module.parameters()):
        return [module]
    top = [unit for unit in inner if not any(other is not unit and contains(other, unit) for other in inner)]
    return [module, top[0]] if len(top) == 1 else [module]


def contains(outer: nn.Module, inner: nn.Module) -> bool:
    """Whether ``inner`` is ``outer`` or one of its submodules (by identity)."""
    return any(child is inner for child in outer.modules())


# ---------------------------------------------------------------------- fp32 master weights
def _is_16bit(tensor: Tensor) -> bool:
    return tensor.dtype in (torch.bfloat16, torch.float16)


@torch.no_grad()
def upcast_16bit_parameters(module: nn.Module) -> torch.dtype | None:
    """Local. Make every 16-bit floating-point parameter fp32 (exact) before sharding, so the shards are the fp32
    masters; buffers keep their dtype (FSDP2 does not cast buffers). Returns the 16-bit dtype found (the dtype to
    compute in), ``None`` when no parameter is 16-bit (``32-true``, ``*-mixed``: nothing changes).

    FSDP2's shards (a second fit: masters already) are left alone. A ``DTensor`` split by tensor parallelism only is
    replaced by an fp32 parameter (ties kept): assigning ``.data`` would change its dtype but not its local tensor's.
    """
    found = None
    upcast: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if not _is_16bit(param) or _is_fsdp_shard(param):
                continue
            found = found or param.dtype
            if not isinstance(param, DTensor):
                param.data = param.data.to(torch.float32)
                continue
            if id(param) not in upcast:
                upcast[id(param)] = nn.Parameter(param.detach().to(torch.float32), requires_grad=param.requires_grad)
            owner.register_parameter(name, upcast[id(param)])  # replaces the 16-bit one under its name
    return found


def _is_fsdp_shard(param: Tensor) -> bool:
    return isinstance(param, DTensor) and "shard" in (param.device_mesh.mesh_dim_names or ())


def master_weight_policy(
    compute_dtype: torch.dtype | None, *, reduce_dtype: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """FSDP2's policy: compute in ``compute_dtype`` from the fp32 sharded parameters (the masters; ``None``: in the
    parameters' own dtype, no masters) and reduce gradients in ``reduce_dtype`` (``gradient_compression``; ``None``:
    fp32 beside masters, else the parameters' dtype). FSDP2 casts the reduced shard to the sharded parameters' dtype
    before adding it to their ``.grad``."""
    if compute_dtype is None:
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype or torch.float32)


def refresh_gradient_dtypes(unit: nn.Module) -> None:
    """Local; call before each forward of a unit sharded with :func:`master_weight_policy` (fp32 masters or a
    ``reduce_dtype``), while training.

    FSDP2 fixes a unit's gradient dtypes (``FSDPParamGroup._orig_dtype``/``_reduce_dtype``) at its first forward,
    from the parameters that require grad at that moment: a unit frozen then (``toggle_optimizer`` in a GAN's first
    step, a backbone unfrozen later) gets none, and once it trains its bf16 gradients are neither reduced in fp32 nor
    cast to the fp32 shard ("attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype
    Float"). This recomputes them from the parameters that require grad now, with FSDP2's own ``_init_mp_dtypes``.
    Private FSDP2 names (no public API; checked against torch 2.13); a version without them fails here by name.
    """
    if not isinstance(unit, FSDPModule):
        return
    try:
        for group in stage3_compat.param_groups_of(unit):
            group._init_mp_dtypes()
    except AttributeError as error:  # pragma: no cover - only on a torch version that moved these fields
        raise RuntimeError(
            f"This torch version's FSDP2 has no `{error.name}` where lightning_parallel expects it (written for torch"
            " 2.13): ZeRO-3 with fp32 master weights cannot follow `requires_grad` changes. Use"
            " `ShardedOptimizerStrategy(stage=3, master_weights=None)` or stage 2."
        ) from error


@torch.no_grad()
def round_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Local. Round each fp32 parameter shard to ``dtype`` and back, as if it had been initialised in ``dtype``."""
    for param in module.parameters():
        local = _local(param)
        if local.dtype == torch.float32:
            local.copy_(local.to(dtype))


def cast_parameters(module: nn.Module, state: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``state`` with the fp32 entries of ``module``'s parameters cast to ``dtype`` (buffers as they are)."""
    names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {
        name: value.to(dtype) if name in names and isinstance(value, Tensor) and value.dtype == torch.float32 else value
        for name, value in state.items()
    }


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The units holding parameters that :func:`apply_fully_shard` shards, in its order, without sharding anything
    (the planner's view); ``module`` is among them when it holds parameters no other unit covers (else
    :func:`apply_fully_shard` adds it as a root without parameters of its own)."""
    units = find_blocks(module)
    units += _remaining_children(module, units)
    units = [unit for unit in units if not _splits_a_tie(module, unit)]
    covered = {id(p) for unit in units for p in unit.parameters()}
    if any(id(p) not in covered for p in module.parameters()):
        units.append(module)
    return units


def _remaining_children(module: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Direct children holding parameters that no unit covers yet; a container without ``forward``
    (``ModuleList``/``ModuleDict``, which ``fully_shard`` refuses) is replaced by its own such children."""
    found: list[nn.Module] = []
    for child in module.children():
        covered = {id(p) for unit in units + found for p in unit.parameters()}
        if child in units or all(id(p) in covered for p in child.parameters()):
            continue  # no parameters, or all of them sharded by units already
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            found += _remaining_children(child, units + found)
        else:
            found.append(child)
    return found


def _splits_a_tie(root: nn.Module, unit: nn.Module) -> bool:
    prefix = next(name for name, m in root.named_modules() if m is unit) + "."
    names_of: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return any(0 < sum(n.startswith(prefix) for n in names) < len(names) for names in names_of.values())


def materialize_meta_module(module: nn.Module, device: torch.device) -> bool:
    """Allocate only the local shards of a meta-device module and initialise them by calling every module's
    ``reset_parameters()``, children before parents, so a model-level initialisation (e.g. GPT-2's scaled
    residual init) has the last word over the layers' defaults. Returns whether anything was on the meta device.

    Only modules that own meta tensors are emptied (``to_empty(recurse=False)``): calling it on the root would also
    overwrite torchmetrics states with uninitialised memory.
    """
    found = False
    for submodule in module.modules():
        if isinstance(submodule, Metric) and any(_metric_tensors_on_meta(submodule)):
            raise RuntimeError(
                f"The torchmetrics metric `{type(submodule).__name__}` was created on the meta device, so its default"
                " state values are lost. Create metrics outside `trainer.init_module(empty_init=True)`, e.g. under"
                " `with torch.device('cpu'):` in `__init__`, or in `setup()`."
            )
        own = itertools.chain(submodule.parameters(recurse=False), submodule.buffers(recurse=False))
        if any(t.is_meta for t in own):
            submodule.to_empty(device=device, recurse=False)
            found = True
    if not found:
        return False
    with torch.no_grad(), _seed_per_rank_from_rank0(device, shard_rank=_shard_rank_of(module)):
        for submodule in reversed(list(module.modules())):
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset) and not isinstance(submodule, Metric):
                reset()
    return True


def _shard_rank_of(module: nn.Module) -> int | None:
    """This rank's position on the axis that shards ``module``'s parameters (``None``: none is a DTensor)."""
    for param in module.parameters():
        if isinstance(param, DTensor):
            return shard_coordinates(param)[0]
    return None


def shard_coordinates(param: Tensor) -> tuple[int, int]:
    """``(rank, size)`` of this rank on the mesh axis that shards ``param``'s dim 0 (FSDP2: ``Shard(0)``; under HSDP
    the other axis replicates). A plain tensor: the world's."""
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if placement.is_shard():
                return param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim)
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_first_replica(param: Tensor) -> bool:
    """Whether this rank is on the first replica group of ``param`` (HSDP: the one that writes its pieces)."""
    if not isinstance(param, DTensor):
        return True
    return all(
        param.device_mesh.get_local_rank(dim) == 0
        for dim, placement in enumerate(param.placements)
        if placement.is_replicate()
    )


@contextmanager
def _seed_per_rank_from_rank0(device: torch.device, *, shard_rank: int | None = None) -> Generator[None, None, None]:
    """Collective when ranks are joined on the CPU: initialise shards from ``seed + shard_rank``, ``seed`` drawn on
    rank 0 (``shard_rank``: the rank on the axis that shards; under HSDP the replicas of a shard draw the same values;
    ``None``: the global rank).

    On the CPU, DTensor has no random-number tracker (it warns "DTensor random operators may not have complete support
    on cpu device mesh") and draws each shard from the rank's own generator: with a common seed
    (``seed_everything``) every rank drew the same values, so rank 1's half of each parameter equalled rank 0's
    (measured), and without one the initialisation depended on every rank's seed. Each rank's own generator state
    is restored afterwards. On GPUs DTensor's tracker (seeded from rank 0) draws the shards; nothing changes there.
    """
    if device.type != "cpu" or not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        dist.broadcast(seed, src=0)
        torch.manual_seed(int(seed.item()) + (dist.get_rank() if shard_rank is None else shard_rank))
        yield


def _metric_tensors_on_meta(metric: Metric) -> Any:
    for default in metric._defaults.values():
        if isinstance(default, Tensor):
            yield default.is_meta


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def consolidated_model_state(module: nn.Module) -> dict[str, Any]:
    """Collective. The full state dict under the model's own names on rank 0 (empty elsewhere)."""
    return get_model_state_dict(module, options=_FULL)


def load_consolidated_model_state(module: nn.Module, state_dict: dict[str, Any], *, strict: bool = True) -> None:
    """Collective. Every rank passes the full state dict; each keeps its shards. A state dict of another model is
    refused with a ``ValueError`` on every rank before any collective."""
    if strict:
        expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        given = {name: tuple(t.shape) for name, t in state_dict.items() if isinstance(t, Tensor)}
        if expected != given:
            differing = sorted(set(expected.items()) ^ set(given.items()))[:3]
            raise ValueError(
                f"The checkpoint does not match this model (differing entries, e.g. {differing}): it was saved from a"
                " different model or configuration."
            )
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, state_dict, options=options)


def _names_by_index(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    name_of = {param: name for name, param in module.named_parameters()}
    return [name_of[param] for group in optimizer.param_groups for param in group["params"]]


def consolidated_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, with_master_weights: bool = False
) -> dict[str, Any]:
    """Collective. The plain ``optimizer.state_dict()`` layout (integer keys in param-group order) on rank 0.

    ``with_master_weights``: the sharded parameters are fp32 masters of a 16-bit model; add them, whole, as
    ``"master_weights": {index: fp32 tensor}`` (the layout of ``distributed/zero/optimizer.py``).
    """
    # The full layout: "state" maps names to dicts, "param_groups" is a list (torch types both as one union).
    by_name: dict[str, Any] = get_optimizer_state_dict(module, optimizer, options=_FULL)
    masters = get_model_state_dict(module, options=_FULL) if with_master_weights else {}
    if dist.get_rank() != 0:
        return {}
    names = _names_by_index(module, optimizer)
    index_of = {name: index for index, name in enumerate(names)}
    state = {index_of[name]: value for name, value in by_name["state"].items()}
    groups = []
    for group in by_name["param_groups"]:
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = [index_of[name] for name in group["params"]]
        groups.append(saved)
    consolidated: dict[str, Any] = {"state": state, "param_groups": groups}
    if with_master_weights:
        consolidated["master_weights"] = {index: masters[name] for index, name in enumerate(names) if name in masters}
    return consolidated


def load_consolidated_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Collective. Every rank passes the plain (integer-keyed) state dict; each keeps its shards."""
    names = _names_by_index(module, optimizer)
    state = {names[int(index)]: value for index, value in state_dict["state"].items()}
    groups = []
    for group in state_dict["param_groups"]:
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = [names[int(index)] for index in group["params"]]
        groups.append(saved)
    if _holds_tensor_state(state_dict["state"]):
        # torch maps the saved param groups onto this optimizer's by their keys: a key added after the optimizer was
        # built (`initial_lr`, which SWA's scheduler sets when averaging starts) fails with a KeyError. Take such
        # settings from the checkpoint first, as `Optimizer.load_state_dict` would.
        for group, saved in zip(optimizer.param_groups, groups, strict=False):
            for key, value in saved.items():
                group.setdefault(key, value)
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": groups}, options=options)
    else:
        # Nothing to shard (SGD without momentum): torch's `set_optimizer_state_dict` learns the device from a tensor
        # state and fails without one ("Expected device to be set"); the plain layout loads as it is.
        optimizer.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
    masters = state_dict.get("master_weights")
    if masters:  # saved with fp32 masters: they replace the upcast 16-bit weights the model state gave (exact resume)
        named = {names[int(index)]: tensor for index, tensor in masters.items()}
        set_model_state_dict(module, named, options=StateDictOptions(full_state_dict=True, strict=False))


def _holds_tensor_state(state: Mapping[Any, Any]) -> bool:
    """Whether any parameter's optimizer state holds a tensor with dimensions (Adam's moments, SGD's momentum)."""
    return any(isinstance(v, Tensor) and v.dim() > 0 for entry in state.values() for v in entry.values())


def sharded_pieces(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[FlatPiece]:
    """This rank's rows of every parameter and optimizer state, as flat pieces (FSDP2 shards dim 0 like
    ``torch.chunk``, so rank r's rows are one contiguous range of the flattened tensor)."""
    return named_sharded_pieces(module.named_parameters(), optimizer)


def named_sharded_pieces(
    named_parameters: Iterable[tuple[str, Tensor]], optimizer: torch.optim.Optimizer | None
) -> list[FlatPiece]:
    """:func:`sharded_pieces` of these ``(name, parameter)`` pairs (parameters held outside one module: the
    pipeline's ZeRO-3 copies after its teardown)."""
    pieces = []
    for name, param in named_parameters:
        local = _local(param.detach())
        rank, world_size = shard_coordinates(param)
        if param.dim() == 0 or local.numel() == 0 or not is_first_replica(param):
            if param.dim() == 0 and dist.get_rank() == 0:
                pieces.append(FlatPiece("param", name, 0, 1, local.reshape(1)))
            continue
        row_numel = param.numel() // param.shape[0]
        start = even_split(param.shape[0], rank, world_size)[0] * row_numel
        stop = start + local.numel()
        pieces.append(FlatPiece("param", name, start, stop, local.reshape(-1)))
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                pieces.append(FlatPiece(key, name, start, stop, _local(value).reshape(-1)))
    return pieces


def _local_range(param: Tensor) -> tuple[int, int]:
    local = _local(param)
    rank, world_size = shard_coordinates(param)
    if param.dim() == 0:
        return (0, 1) if dist.get_rank() == 0 else (0, 0)
    row_numel = param.numel() // param.shape[0] if param.shape[0] else 0
    start = even_split(param.shape[0], rank, world_size)[0] * row_numel
    return start, start + local.numel()


@torch.no_grad()
def load_from_reader(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, reader: ShardedCheckpointReader, *, strict: bool = True
) -> None:
    """Collective. Load this rank's rows of parameters (``optimizer=None``) or of the optimizer state straight
    from a sharded checkpoint, never the whole tensors."""
    named = dict(module.named_parameters())
    ranges = {name: _local_range(param) for name, param in named.items()}
    if optimizer is None:
        _load_parameters(module, named, ranges, reader, strict=strict)
    else:
        _load_optimizer_state(optimizer, named, ranges, reader)


def _load_parameters(
    module: nn.Module, named: Mapping[str, Tensor], ranges: dict, reader: ShardedCheckpointReader, *, strict: bool
) -> None:
    shapes = reader.meta["shapes"]
    if strict and {n: tuple(p.shape) for n, p in named.items()} != {n: tuple(s) for n, s in shapes.items()}:
        raise ValueError(
            f"The sharded checkpoint {reader.path} holds parameters of other names or shapes than this model"
            " (it comes from a different model)."
        )
    requests = [
        ("param", name, *ranges[name]) for name in named if name in shapes and ranges[name][1] > ranges[name][0]
    ]
    values = reader.read(requests, with_buffers=True)
    for name, param in named.items():
        key = ("param", name, *ranges[name])
        if key in values:
            _local(param).view(-1).copy_(values[key])
    buffers = dict(module.named_buffers())
    for entry, tensor in values.items():
        if isinstance(entry, str) and entry.removeprefix("buffer/") in buffers:
            buffers[entry.removeprefix("buffer/")].copy_(tensor)


def _load_optimizer_state(
    optimizer: torch.optim.Optimizer, named: Mapping[str, Tensor], ranges: dict, reader: ShardedCheckpointReader
) -> None:
    name_of = {param: name for name, param in named.items()}
    for group, saved in zip(optimizer.param_groups, reader.meta["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    requests = [(key, name_of[p], *ranges[name_of[p]]) for p in params for key in reader.keys_of(name_of[p])]
    values = reader.read([r for r in requests if r[0] != "param" and r[3] > r[2]])
    optimizer.state.clear()
    group_of = {id(param): group for group in optimizer.param_groups for param in group["params"]}
    for param in params:
        name = name_of[param]
        state = {}
        for key in (k for k in reader.keys_of(name) if k != "param"):
            local = torch.zeros_like(_local(param))
            piece = (key, name, *ranges[name])
            if piece in values:
                local.view(-1).copy_(values[piece])
            state[key] = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        if state:
            scalars = reader.meta["scalars"].get(name, {})
            group = group_of[id(param)]
            state.update({k: place_scalar_state(k, v, param=param, group=group) for k, v in scalars.items()})
            optimizer.state[param] = state
