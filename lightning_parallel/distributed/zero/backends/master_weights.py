"""World size 1 with 16-bit parameters: the fp32 master weights of ZeRO, with nothing to shard.

``ShardedOptimizerStrategy(master_weights="fp32")`` under ``Trainer(precision="bf16-true")`` steps fp32 masters at
every world size, so moving a run from N devices to one (a laptop debug run) keeps its arithmetic and its
checkpoints. At world size 1 :class:`MasterWeightBackend` is the stage-1/2 bucket backend over the one-process group
that Lightning creates: each bucket's only shard is the whole bucket, so every trainable parameter has an fp32
master, and the sharded backends' code does the rest unchanged (the user's optimizer steps 1-D views of the masters,
gradients are upcast to fp32 by the one-rank "reduce-scatter", which sums nothing, clipping and the non-finite-loss
check see those fp32 gradients, the stepped masters are rounded into the 16-bit parameters, and the consolidated
optimizer state holds the masters under ``"master_weights"``). A checkpoint therefore resumes exactly at world size 1
from world size N and the reverse.
"""

from __future__ import annotations

from dataclasses import replace

from torch.optim import Optimizer

from lightning_parallel.distributed.zero.backends.context import ZeroContext
from lightning_parallel.distributed.zero.backends.flat_buckets import FlatBucketBackend
from lightning_parallel.distributed.zero.config import ZeroConfig
from lightning_parallel.distributed.zero.optimizer import check_shardable

__all__ = ["MasterWeightBackend"]


class MasterWeightBackend(FlatBucketBackend):
    """World size 1, 16-bit parameters, ``master_weights="fp32"``: stage-1/2 buckets whose shard is the whole bucket.

    Stage 1 keeps its 16-bit gradient bucket between steps, as at any world size; stages 2 and 3 use stage 2's
    buckets (with one rank there is nothing more for stage 3 to shard). With ``P`` trainable elements (the buckets
    need no padding at world size 1) and AdamW, the bytes held after a step are: parameters ``2P`` (the bf16
    buckets), gradients ``2P + 4P`` (stage 1: bf16 bucket + fp32 gradients) or ``4P`` (stages 2-3), optimizer state
    ``4P + 8P`` (fp32 master + exp_avg + exp_avg_sq): the ZeRO-1/2 formulas of docs/zero.md at ``N = 1``.

    Its one-process collectives are copies: nothing is counted as communication, and no wait is timed as exposed.
    """

    def __init__(self, config: ZeroConfig, context: ZeroContext) -> None:
        assert config.master_weights == "fp32", "the strategy chooses this backend for `master_weights='fp32'` only"
        # Stage 3 steps stage 2's buckets; one rank communicates nothing: no bytes to count.
        super().__init__(replace(config, stage=min(config.stage, 2)), replace(context, stats=None))

    @property
    def times_exposed_communication(self) -> bool:
        return False

    def setup_optimizers(self, optimizers: list[Optimizer]) -> None:
        for optimizer in optimizers:
            try:
                check_shardable(optimizer, warn=_not_yet)  # `super()` warns about an optimizer we do not know
            except TypeError as error:
                raise TypeError(
                    f"{error} At world size 1 the fp32 master weights are flat buckets too: pass"
                    " `master_weights=None` to step the 16-bit parameters directly (plain single-device training)."
                ) from error
        super().setup_optimizers(optimizers)


def _not_yet(message: str) -> None:
    del message  # warned once, by `FlatBucketBackend.setup_optimizers`
