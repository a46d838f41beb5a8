"""The ZeRO settings as one frozen, validated record, built once from ``ShardedOptimizerStrategy``'s arguments.

Torch-only (no Lightning). The strategy builds a :class:`ZeroConfig` in ``__init__`` (every rank, before any
collective: a bad value raises the same ``ValueError`` everywhere) and hands it whole to the backend it chooses in
``setup`` (``distributed/zero/backends/``), which reads the fields it needs. Whether ``shard_size`` divides the world
size is checked once the world size is known (:class:`~lightning_parallel.distributed.mesh.MeshLayout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from lightning_parallel.choices import check_choice
from lightning_parallel.distributed.compression import compression_dtype
from lightning_parallel.distributed.mesh import validate_shard_size

__all__ = ["MasterWeights", "OverlapParamGather", "Stage", "ZeroConfig", "ZeroGradientCompression", "zero_options"]

Stage = Literal[1, 2, 3]
MasterWeights = Literal["fp32"] | None
"""``"fp32"``: 16-bit parameters are stepped through fp32 master weights in the shard; ``None``: stepped directly."""
OverlapParamGather = bool | Literal["auto"]
ZeroGradientCompression = Literal["bf16", "fp16"] | None
"""The dtype gradients are reduced in on the wire (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)``, DeepSpeed's
``communication_data_type``); ``None``: the gradients' own (fp32 beside fp32 masters). The name and values are
``DataParallelStrategy(gradient_compression=)``'s, less ``"powersgd"``."""


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How ZeRO shards and steps; validated on construction (a ``ValueError`` naming the bad value and the fix).

    ``ShardedOptimizerStrategy``'s docstring describes each setting at length; the fields keep its argument names.
    """

    stage: Stage = 2
    """1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)."""
    shard_size: int | None = None
    """Ranks per shard group (a divisor of the world size); ``None`` shards over every rank."""
    bucket_cap_mb: float = 25.0
    """Size of the flat gradient buckets of stages 1-2, in MiB."""
    master_weights: MasterWeights = "fp32"
    """With 16-bit parameters, ``"fp32"`` steps fp32 masters of this rank's shard; ``None`` the 16-bit parameters."""
    overlap_param_gather: OverlapParamGather = "auto"
    """Stages 1-2: ``True``/``"auto"`` overlap the all-gather after the step with the next forward; ``False`` waits."""
    gradient_compression: ZeroGradientCompression = None
    """``"bf16"``/``"fp16"``: reduce gradients in that dtype (half the bytes of fp32), accumulated into the shard in its
    own dtype (fp32 under ``32-true`` or beside fp32 masters); ``None``: reduce in the shard's dtype."""

    def __post_init__(self) -> None:
        check_choice(
            "stage",
            self.stage,
            Stage,
            notes={1: "optimizer state sharded", 2: "+ gradients", 3: "+ parameters"},
        )
        check_choice(
            "master_weights",
            self.master_weights,
            MasterWeights,
            notes={
                "fp32": "step fp32 master weights of 16-bit parameters, the default",
                None: "step the 16-bit parameters directly",
            },
        )
        check_choice(
            "overlap_param_gather",
            self.overlap_param_gather,
            OverlapParamGather,
            notes={"auto": "the default", True: "", False: ""},
        )
        if self.gradient_compression == "powersgd":
            raise ValueError(
                "`gradient_compression='powersgd'` is not supported by ZeRO: its low-rank factors need whole gradient"
                " matrices, which ZeRO reduces as flat buckets or FSDP2 shards. Use 'bf16' or 'fp16' (half the bytes"
                " of fp32), or `DataParallelStrategy(gradient_compression='powersgd')`."
            )
        check_choice(
            "gradient_compression",
            self.gradient_compression,
            ZeroGradientCompression,
            notes={
                None: "reduce in the gradients' shard dtype, the default",
                "bf16": "reduce in bfloat16, half the bytes of fp32",
                "fp16": "reduce in float16, half the bytes of fp32",
            },
        )
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"`bucket_cap_mb={self.bucket_cap_mb!r}` must be a positive number of MiB.")
        validate_shard_size(self.shard_size)

    def overlaps_param_gather(self, *, world_size: int) -> bool:
        """:attr:`overlap_param_gather` resolved for a fit at ``world_size`` (stages 1-2): ``"auto"`` overlaps
        whatever the callbacks, since the stale-read guard makes every read between steps wait for what it reads;
        one rank has nothing to gather."""
        return world_size > 1 and self.overlap_param_gather is not False

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """:attr:`gradient_compression` as the dtype gradients are reduced in, ``None`` without compression."""
        return None if self.gradient_compression is None else compression_dtype(self.gradient_compression)


def zero_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ZeroConfig` fields other than ``stage`` among a strategy ``__init__``'s arguments (its
    ``locals()``): the ZeRO options both ZeRO strategies take under the same names, forwarded in one place
    (``ZeroConfig(stage=..., **zero_options(locals()))``; :class:`ZeroConfig` validates them)."""
    return {field.name: arguments[field.name] for field in fields(ZeroConfig) if field.name != "stage"}
