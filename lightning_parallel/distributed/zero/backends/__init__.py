"""The ways ``ShardedOptimizerStrategy`` holds a model, behind one torch-only protocol chosen once in ``setup``.

* :class:`FlatBucketBackend` (stages 1-2): parameters live in flat buckets that are reduce-scattered as backward
  produces gradients; the user's optimizer steps this rank's shard, then the buckets are all-gathered.
* :class:`FullyShardBackend` (stage 3): torch's FSDP2 ``fully_shard`` per repeated block.
* :class:`ReplicatedBackend` (world size 1): plain single-device training, nothing sharded; with 16-bit parameters
  and fp32 master weights, :class:`MasterWeightBackend` (stage-1/2 buckets over one rank).

With 16-bit parameters (``Trainer(precision="bf16-true")``) and ``master_weights="fp32"`` (the strategy's default)
both sharded backends keep fp32 master weights in the shard: stages 1-2 an fp32 copy of each bucket's shard beside
the bf16 buckets (``distributed/zero/buckets.py``), stage 3 fp32 sharded parameters that FSDP2 casts to bf16 for compute
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). Gradients are reduced in fp32 in both. Consolidated
checkpoints hold the bf16 model (as single-device ``bf16-true`` saves it) and the fp32 masters under the optimizer
state's ``"master_weights"`` entry.

The strategy calls the :class:`ZeroBackend` protocol (the
:class:`~lightning_parallel.distributed.gradient_sync.GradientSync` protocol plus holding the module) and never asks
which backend it holds (DeepSpeed likewise picks its ZeRO optimizer once). It builds whichever :func:`backend_type`
chose from two frozen records, passed whole: the user's settings
(:class:`~lightning_parallel.distributed.zero.config.ZeroConfig`, validated in the strategy's ``__init__``) and this
run's :class:`ZeroContext` (ranks, mesh, listeners, and the Lightning side's helpers as plain callables); each
backend reads what it needs. No Lightning type appears here: the precision plugin's ``convert_module`` is passed in
as a callable, and the plugin to train with (clipping over shards, a sharded grad scaler) is built from the
backend's :attr:`~ZeroBackend.clips_over_ranks` and :attr:`~ZeroBackend.shards_gradients` by the thin Lightning
adapter ``strategies/zero_precision.py``.
"""

from lightning_parallel.distributed.zero.backends.choice import backend_type
from lightning_parallel.distributed.zero.backends.context import (
    NoParameterCallbacks,
    ParameterCallbacks,
    StageExtensions,
    ZeroContext,
    broadcast_on_its_device,
)
from lightning_parallel.distributed.zero.backends.flat_buckets import FlatBucketBackend
from lightning_parallel.distributed.zero.backends.fully_shard import FullyShardBackend
from lightning_parallel.distributed.zero.backends.master_weights import MasterWeightBackend
from lightning_parallel.distributed.zero.backends.protocol import ZeroBackend
from lightning_parallel.distributed.zero.backends.replicated import ReplicatedBackend

__all__ = [
    "FlatBucketBackend",
    "FullyShardBackend",
    "MasterWeightBackend",
    "NoParameterCallbacks",
    "ParameterCallbacks",
    "ReplicatedBackend",
    "StageExtensions",
    "ZeroBackend",
    "ZeroContext",
    "backend_type",
    "broadcast_on_its_device",
]
