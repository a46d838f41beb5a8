"""Lightning strategies: thin layers over ``lightning_parallel.distributed``."""

from lightning_parallel.strategies.data_parallel import DataParallelStrategy
from lightning_parallel.strategies.registry import register_all

__all__ = ["DataParallelStrategy", "register_all"]
