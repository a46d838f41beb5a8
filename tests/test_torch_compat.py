"""The private torch names behind the ``_compat`` modules resolve on the installed torch (run on every supported
release by ``make compat``): what the dry run replaces exists and is put back, a P2P op names its peer."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.distributed.pipeline import _compat
from lightning_parallel.distributed.pipeline.schedule import SideEffectFreePipelineStage

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


def test_integer_side_inputs_are_refused_by_name_only_where_torch_cannot_send_them() -> None:
    side = {
        "attention_mask": torch.ones(2, 4, dtype=torch.bool),
        "scale": torch.ones(2),
        "position_ids": torch.arange(4),
    }
    if torch.__version__ >= _compat.INTEGER_ACTIVATIONS_SINCE:
        _compat.refuse_integer_side_inputs(side)  # sent between stages as they are
        return
    with pytest.raises(
        RuntimeError, match=r"`attention_mask` \(torch.bool\), `position_ids` \(torch.int64\) are not"
    ) as e:
        _compat.refuse_integer_side_inputs(side)
    assert "torch >= 2.12" in str(e.value) and "scale" not in str(e.value)
