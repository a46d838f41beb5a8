"""Lightning strategies: thin layers over ``lightning_parallel.distributed``."""

from lightning_parallel.strategies.data_parallel import DataParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.registry import register_all
from lightning_parallel.strategies.sharded_optimizer import ShardedOptimizerStrategy

__all__ = ["DataParallelStrategy", "PipelineParallelStrategy", "ShardedOptimizerStrategy", "register_all"]
