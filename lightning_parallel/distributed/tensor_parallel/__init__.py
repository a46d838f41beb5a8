"""Tensor parallelism: the ``tensor`` axis of the mesh (``distributed/mesh.py``), the model's plan resolved to
torch's parallel styles (:mod:`.plan`), applied with ``parallelize_module`` (:mod:`.apply`), and the gradient norm
over ``DTensor`` gradients on several meshes (:mod:`.norm`); the split layers whole again for one rank's calls
(:mod:`.whole`). docs/tensor_parallel.md."""

from lightning_parallel.distributed.tensor_parallel.apply import apply_tensor_parallel, is_tensor_parallel
from lightning_parallel.distributed.tensor_parallel.norm import clip_grad_norm_of_placed_
from lightning_parallel.distributed.tensor_parallel.plan import (
    HOOK_NAME,
    STYLE_NAMES,
    TensorParallelPlan,
    check_divisible,
    resolve_plan,
    style_from_name,
)
from lightning_parallel.distributed.tensor_parallel.whole import whole_layers

__all__ = [
    "HOOK_NAME",
    "STYLE_NAMES",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "check_divisible",
    "clip_grad_norm_of_placed_",
    "is_tensor_parallel",
    "resolve_plan",
    "style_from_name",
    "whole_layers",
]
