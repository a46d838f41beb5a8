"""A dead or failing rank never hangs the job: the other ranks exit with an error well within the timeout."""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl
import pytest
from distributed_harness import DistributedTestError, run_distributed
from torch import nn
from torch.utils.data import DataLoader
from training_helpers import SEQ_LEN, make_module, make_trainer, strategy_of

from lightning_parallel.demos import RandomTokenDataset

PROCESS_GROUP_TIMEOUT = 20  # seconds; every survivor must be out well before the harness deadline
FAILING_RANK = 1
FAILING_STEP = 2


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _FailOnce(pl.Callback):
    """Makes rank 1 fail at step 2: killed in forward, in backward, while rank 0 waits in a collective, or by an
    exception raised in training_step on that rank only."""

    # ZeRO-1/2 keep overlapping the parameter all-gather with any callback (no declaration needed since the
    # stale-read guard): its failure paths are tested with this one.

    def __init__(self, where: str) -> None:
        self.where = where

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank != FAILING_RANK or batch_idx != FAILING_STEP:
            return
        if self.where == "forward":
            _die()
        elif self.where == "collective":
            time.sleep(2)  # rank 0 is inside the gradient all-reduce / reduce-scatter by now
            _die()
        elif self.where == "backward":
            # A hook on an activation fires inside backward (ZeRO-3's sharded parameters get no autograd hooks).
            layer = next(m for m in pl_module.modules() if isinstance(m, nn.Linear))

            def kill_in_backward(module, inputs, output) -> None:
                output.register_hook(lambda grad: _die())

            layer.register_forward_hook(kill_in_backward)
        elif self.where == "exception":
            original = pl_module.training_step

            def failing_step(*args, **kwargs):
                pl_module.training_step = original
                raise RuntimeError("training_step failed on rank 1 only")

            pl_module.training_step = failing_step


def _train(rank: int, world_size: int, spec: str, where: str) -> None:
    loader = DataLoader(RandomTokenDataset(64, SEQ_LEN, seed=rank), batch_size=4)
    # Under the pipeline rank 1 holds the last stage: killing it in forward/backward leaves rank 0 inside a pipeline
    # send/recv.
    strategy = strategy_of(spec, timeout=PROCESS_GROUP_TIMEOUT)
    trainer = make_trainer(strategy, devices=world_size, max_steps=10, callbacks=[_FailOnce(where)])
    start = time.monotonic()
    try:
        trainer.fit(make_module(), train_dataloaders=loader)
    except BaseException as error:
        raise RuntimeError(
            f"rank {rank} stopped after {time.monotonic() - start:.1f}s with {type(error).__name__}: {error}"
        ) from error


@pytest.mark.parametrize("where", ["forward", "backward", "collective", "exception"])
@pytest.mark.parametrize("spec", ["data_parallel", "zero2", "zero3", "pipeline"])
def test_survivors_exit_with_an_error_when_one_rank_dies(spec, where):
    # The harness deadline (the process-group timeout plus start-up) is the "never hangs" check; no speed claim.
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_train, 2, args=(spec, where), init_process_group=False, timeout=PROCESS_GROUP_TIMEOUT + 40)
    text = str(failure.value)
    assert "did not finish" not in text, f"a rank hung:\n{text[-3000:]}"
    survivor = next(line for line in text.splitlines() if line.startswith("RuntimeError: rank 0 stopped after "))
    if where == "exception":
        assert "training_step failed on rank 1 only" in text
    else:
        assert "rank 1 died with exit code -9" in text
        # The survivor names the rank that died (same host: its process is gone).
        assert "Rank 0: a collective failed because rank(s) [1] stopped" in survivor, survivor
