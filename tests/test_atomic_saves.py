"""A process SIGKILLed while writing a checkpoint leaves the previous one intact and loadable.

Each case writes checkpoint "old", then starts writing "new" to the same path in a child process and SIGKILLs it at
a spread of moments during the write. Afterwards the path must load and be either the complete "old" or the complete
"new" checkpoint, never a mix or a truncated file. Consolidated files go through our strategies' checkpoint IO
(Lightning's atomic write); sharded directories through our staged write and rename.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_parallel.distributed.checkpoint import (
    FlatPiece,
    is_sharded_checkpoint,
    save_sharded_checkpoint,
    sharded_to_consolidated,
)

NUMEL = 8_000_000  # 32 MB per tensor: a write takes long enough to be interrupted at many points


def _tensors(marker: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((NUMEL,), marker), "b": torch.full((NUMEL // 2,), marker)}


def _save_consolidated(path: Path, marker: float) -> None:
    checkpoint = {"state_dict": _tensors(marker), "global_step": int(marker)}
    TorchCheckpointIO().save_checkpoint(checkpoint, path)


def _save_sharded(path: Path, marker: float) -> None:
    tensors = _tensors(marker)
    pieces = [FlatPiece("param", name, 0, t.numel(), t) for name, t in tensors.items()]
    meta = {
        "lightning": {"global_step": int(marker)},
        "shapes": {name: tuple(t.shape) for name, t in tensors.items()},
        "state_dict_order": list(tensors),
        "param_groups": None,
        "scalars": {},
    }
    save_sharded_checkpoint(path, pieces, buffers={}, meta=meta)


def _load(path: Path) -> tuple[int, set[float]]:
    if is_sharded_checkpoint(path):
        checkpoint = sharded_to_consolidated(path)
    else:
        checkpoint = torch.load(path, weights_only=True)
    values = {float(t.unique().item()) for t in checkpoint["state_dict"].values()}
    return checkpoint["global_step"], values


def _writer(save, path: Path, ready) -> None:
    torch.set_num_threads(1)
    ready.set()
    save(path, 2.0)
    os._exit(0)


@pytest.mark.parametrize("kind", ["consolidated", "sharded"])
def test_a_killed_save_never_replaces_the_previous_checkpoint(tmp_path, kind):
    save = _save_consolidated if kind == "consolidated" else _save_sharded
    path = tmp_path / "last.ckpt"
    context = multiprocessing.get_context("fork")
    outcomes = []
    for delay in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
        save(path, 1.0)  # the previous checkpoint
        ready = context.Event()
        writer = context.Process(target=_writer, args=(save, path, ready))
        writer.start()
        ready.wait(30)
        time.sleep(delay)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        step, values = _load(path)  # loads: never truncated or mixed
        assert (step, values) in ((1, {1.0}), (2, {2.0})), (delay, step, values)
        outcomes.append(step)
    assert 1 in outcomes, "no kill landed inside a write; the test did not test anything"


def test_a_save_killed_between_its_two_renames_still_resumes_from_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    _save_sharded(path, 1.0)
    path.rename(path.with_name(path.name + ".previous"))  # the state after the first rename, before the second
    assert is_sharded_checkpoint(path)
    assert _load(path) == (1, {1.0})
