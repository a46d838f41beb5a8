"""lightning_parallel: PyTorch Lightning strategies for data parallel, pipeline parallel and ZeRO training.

Importing this package registers its strategy names with Lightning, so ``Trainer(strategy="data_parallel")``
works after ``import lightning_parallel``.
"""

from lightning_parallel.distributed.activation_checkpointing import SelectiveCheckpointing
from lightning_parallel.distributed.pipeline.random_draws import InconsistentDrawError
from lightning_parallel.monitor import ParallelismMonitor
from lightning_parallel.planner import plan
from lightning_parallel.strategies import (
    DataParallelStrategy,
    PipelineParallelStrategy,
    ShardedOptimizerStrategy,
    register_all,
)

__all__ = [
    "DataParallelStrategy",
    "InconsistentDrawError",
    "ParallelismMonitor",
    "PipelineParallelStrategy",
    "SelectiveCheckpointing",
    "ShardedOptimizerStrategy",
    "__version__",
    "plan",
]
__version__ = "0.1.0"

register_all()
