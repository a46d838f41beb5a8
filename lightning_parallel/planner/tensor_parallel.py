"""The planner's arithmetic for the ``tensor`` axis (``ShardedOptimizerStrategy(stage=3, tensor_parallel_size=T)``).

The model's own plan (``tensor_parallel_plan()`` or a Hugging Face ``tp_plan``, resolved by the strategy's
:func:`~lightning_parallel.distributed.tensor_parallel.resolve_plan` on the spec's meta module) says which layers
are split and how; from it:

* each parameter's shape on one tensor rank (:func:`split_parameters`): a column split (``ColwiseParallel``) divides
  a ``Linear``'s weight and bias on dim 0 (an embedding's weight on dim 1), a row split (``RowwiseParallel``) a
  ``Linear``'s weight on dim 1 (its bias stays whole) and an embedding's on dim 0 (vocabulary-parallel); FSDP2 then
  shards those local shapes on dim 0 over the data axes, as it shards the ``DTensor``'s local piece;
* tensor parallelism's collectives per step (:func:`tensor_parallel_communication`), the monitor's definition (the
  full buffer on this rank), from torch's styles: a row split all-reduces its output in forward (a ``Partial`` sum;
  an embedding's too), a column split all-reduces its input's gradient in backward (each rank's partial product
  with its slice of the weight) unless its input is integer token ids; a column split whose output is replicated
  (``colwise_rep``, a gathered LM head) all-gathers its output in forward, and a row split whose input is
  replicated (``rowwise_rep``) all-gathers its input's gradient in backward. Each of ``tokens`` rows of the layer's
  features, in the activations' dtype. A transformer block of a Llama then all-reduces 2 activations in forward (the
  ``o`` and ``down`` outputs) and one per column split in backward (``q``, ``k``, ``v``, ``gate``, ``up``: each
  input gradient is reduced on its own);
* the activations of one rank (:func:`split_shape`): the split layers' widths (query and key/value heads, the MLP's
  intermediate features) divided by ``T``, the residual stream, norms and logits whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.distributed.tensor_parallel import resolve_plan
from lightning_parallel.planner.shape import TransformerShape
from lightning_parallel.planner.spec import ModelSpec, ParamSpec

__all__ = ["TensorParallelSplit", "split_parameters", "split_shape", "tensor_parallel_communication"]


@dataclass(frozen=True)
class TensorParallelSplit:
    """Which dimension of each split parameter the plan divides (parameter name to dim)."""

    dims: dict[str, int]
    layers: dict[str, tuple[nn.Module, object]]
    """Each split layer's name, the layer (on the meta device) and its torch style."""


def _plan_of(spec: ModelSpec) -> TensorParallelSplit:
    if spec.module is None:
        raise ValueError(
            f"`tensor_parallel_size` needs the model's layers to read its tensor-parallel plan, and the spec of"
            f" {spec.name!r} has no module: plan a model built on the meta device (`model_spec(module)`)."
        )
    key = ("tensor_parallel_split",)
    if key not in spec._cache:
        plan = resolve_plan(spec.module, owner="the planner's tensor_parallel_size")
        dims: dict[str, int] = {}
        layers: dict[str, tuple[nn.Module, object]] = {}
        for name, style in plan.styles.items():
            layer = spec.module.get_submodule(name)
            layers[name] = (layer, style)
            embedding = isinstance(layer, nn.Embedding)
            if isinstance(style, ColwiseParallel):
                dims[f"{name}.weight"] = 1 if embedding else 0
                dims[f"{name}.bias"] = 0
            elif isinstance(style, RowwiseParallel):
                dims[f"{name}.weight"] = 0 if embedding else 1
        spec._cache[key] = TensorParallelSplit(dims, layers)
    return spec._cache[key]


def split_parameters(spec: ModelSpec, tensor_parallel_size: int) -> list[ParamSpec]:
    """``spec``'s parameters as one tensor rank holds them (shapes divided on the dimension the plan splits)."""
    split = _plan_of(spec)
    local = []
    for param in spec.params:
        dim = split.dims.get(param.name)
        if dim is None or dim >= len(param.shape):
            local.append(param)
            continue
        shape = list(param.shape)
        shape[dim] //= tensor_parallel_size
        local.append(dataclasses.replace(param, shape=tuple(shape)))
    return local


def tensor_parallel_communication(spec: ModelSpec, *, tokens: int, element_bytes: int) -> dict[str, int]:
    """Bytes per collective per step of one tensor rank (see the module docstring): ``tokens`` rows (batch x sequence
    of one data-parallel replica) of each split layer's features, ``element_bytes`` each."""
    comm = {"all_reduce": 0, "all_gather": 0}
    for layer, style in _plan_of(spec).layers.values():
        if isinstance(layer, nn.Embedding):
            width_in, width_out, takes_ids = 0, layer.embedding_dim, True
        elif isinstance(layer, nn.Linear):
            width_in, width_out, takes_ids = layer.in_features, layer.out_features, False
        else:  # a norm or dropout under sequence parallelism: not counted
            continue
        # torch's styles hold their layouts as 1-tuples (`(Replicate(),)`).
        replicated_in, replicated_out = (
            _replicated(getattr(style, a, ())) for a in ("input_layouts", "output_layouts")
        )
        if isinstance(style, RowwiseParallel):
            comm["all_reduce"] += tokens * width_out * element_bytes  # the partial outputs summed in forward
            if replicated_in and not takes_ids:
                comm["all_gather"] += tokens * width_in * element_bytes  # the input's gradient gathered in backward
        elif isinstance(style, ColwiseParallel):
            if not takes_ids:
                comm["all_reduce"] += tokens * width_in * element_bytes  # the input's gradient summed in backward
            if replicated_out:
                comm["all_gather"] += tokens * width_out * element_bytes  # the output gathered in forward
    return {kind: num_bytes for kind, num_bytes in comm.items() if num_bytes}


def _replicated(layouts: object) -> bool:
    return isinstance(layouts, tuple) and len(layouts) == 1 and isinstance(layouts[0], Replicate)


def split_shape(shape: TransformerShape, tensor_parallel_size: int) -> TransformerShape:
    """The transformer shape one tensor rank computes: heads and the MLP's width divided, the rest whole."""
    t = tensor_parallel_size
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // t,
        num_kv_heads=(shape.num_kv_heads or shape.num_heads) // t,
        head_dim=shape.head_size,
        intermediate_size=shape.mlp_size // t,
    )
