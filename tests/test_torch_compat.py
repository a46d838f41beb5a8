"""The private torch names behind the ``_compat`` modules resolve on the installed torch (run on every supported
release by ``make compat``): what the dry run replaces exists and is put back, a P2P op names its peer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_harness import run_distributed
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.side_inputs import (
    decoded_side_input,
    encoded_side_input,
    with_zero_gradients,
)
from lightning_parallel.distributed.pipeline.torch_stage import SideEffectFreePipelineStage

pytestmark = pytest.mark.compat  # also run on every supported torch release (`make compat`)


def test_metadata_inference_replaces_only_what_this_torch_has() -> None:
    replacements = _compat.local_metadata_inference(lambda stage: (torch.empty(2, 3, device="meta"),))
    names = {name for _, name, _ in replacements}
    for owner, name, _ in replacements:
        assert hasattr(owner, name), f"{owner.__name__}.{name} is replaced in the dry run but this torch has none"
    messages = {"_recv_meta", "_send_meta"}
    object_lists = {"_shape_inference", "recv_object_list", "send_object_list"}
    assert names >= messages or names == object_lists, names


def test_object_list_answer_is_the_previous_stage_outputs_on_meta() -> None:
    if hasattr(PipelineStage, "_recv_meta"):
        pytest.skip(f"torch {torch.__version__} infers metadata by messages (covered by the dry-run tests)")
    outputs = {0: (torch.empty(4, 8, requires_grad=True),)}
    received: list[object] = [None]
    replaced: dict[str, object] = {}

    class _Stage:
        stage_index = 1

    def shape_inference(stage: object, *args: object, **kwargs: object) -> None:
        replaced["recv_object_list"](received)  # type: ignore[operator]  # what torch 2.11's inference receives

    saved = PipelineStage._shape_inference  # type: ignore[attr-defined]
    try:  # the traced inference calls the original: stand in for it with one that only receives
        PipelineStage._shape_inference = shape_inference  # type: ignore[attr-defined]
        replaced.update((name, value) for _, name, value in _compat.local_metadata_inference(outputs.get))
        replaced["_shape_inference"](_Stage())  # type: ignore[operator]
    finally:
        PipelineStage._shape_inference = saved  # type: ignore[attr-defined]
    (meta,) = received[0]  # type: ignore[misc]
    assert meta.device.type == "meta" and meta.shape == (4, 8) and meta.requires_grad


def test_stage_class_wraps_this_torch_s_inference_method() -> None:
    name = _compat.stage_inference_method(PipelineStage)
    assert name in SideEffectFreePipelineStage.__dict__


def test_side_inputs_cross_stages_encoded_exactly_only_where_torch_makes_every_received_tensor_require_grad() -> None:
    assert _compat.every_received_tensor_requires_grad() == (torch.__version__ < "2.12")
    big = 2**53 + 1  # not a float64 value: a conversion would round it, the view keeps its bytes
    side = {
        "attention_mask": torch.tensor([[True, False], [False, True]]).t(),  # non-contiguous
        "position_ids": torch.tensor([[0, -1], [big, -big]]),
        "ids32": torch.tensor([7, -(2**31)], dtype=torch.int32),
        "ids16": torch.tensor([-1, 2**15 - 1], dtype=torch.int16),
        "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        "signed_bytes": torch.tensor([-128, 127], dtype=torch.int8),
        "scale": torch.tensor([0.5, 2.0]),
    }
    for name, value in side.items():
        sent = encoded_side_input(value).requires_grad_()  # what a stage sends where torch < 2.12
        assert sent.is_contiguous() and sent.element_size() == max(value.element_size(), 2), name
        back = decoded_side_input(sent, value.dtype)
        assert back.dtype == value.dtype and torch.equal(back, value), name

    (grads,) = run_distributed(_zero_gradients, 1, init_process_group=False)  # a backward in a fork, not here
    assert grads == {"output": [2.0, 2.0, 2.0], "received": [[[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0]]}


def _zero_gradients(rank: int, world_size: int) -> dict[str, Any]:
    received = [encoded_side_input(torch.tensor([[0, 1], [2, 3]])).requires_grad_(), torch.ones(2, requires_grad=True)]
    output = torch.ones(3, requires_grad=True)
    (tied,) = with_zero_gradients((output * 2,), received)
    assert not tied._is_view()  # torch's split backward detaches a stage's outputs in place
    tied.sum().backward()
    gradients = [output.grad, *(r.grad for r in received)]  # the received ones unused: zeros, not None
    values = [None if g is None else g.tolist() for g in gradients]
    return {"output": values[0], "received": values[1:]}


def _moves_a_split_weight(rank: int, world_size: int) -> list[float]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_parallel.distributed.zero.local_shards import as_placed, local_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tensor",))
    param = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    flat = torch.arange(20, dtype=torch.float32)
    with torch.no_grad():
        local_tensor(param).data = flat[2:14].view(4, 3)  # what the ZeRO-1/2 buckets do to a split weight
    flat.add_(1)  # the bucket's step
    grad = as_placed(param, flat[:12])
    return [float(param.full_tensor().sum()), float(grad.full_tensor().sum())]


def test_the_tensor_a_split_weight_wraps_is_its_storage() -> None:
    """``stage3_compat.wrapped_local_tensor`` (``DTensor._local_tensor``): setting its ``.data`` moves the parameter
    into a bucket (torch 2.13's ``to_local()`` returns a view of it on a parameter, which would not)."""
    (sums,) = run_distributed(_moves_a_split_weight, 1, timeout=60)
    assert sums == [float(sum(range(3, 15))), float(sum(range(1, 13)))]
