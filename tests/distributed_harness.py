"""Fork N ranks joined by a real gloo process group, with a deadline and per-rank tracebacks.

Forking inherits the already-imported torch/Lightning, so a 2-rank test costs ~0.1-1 s instead of the ~9 s of
torch's ``MultiProcessTestCase``. Each rank writes its traceback to a file, so a failure shows the rank that
raised first instead of the "connection reset" of the rank that survived it. A rank that does not finish by the
deadline is killed and the test fails with the ranks that were still running named.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]


class DistributedTestError(AssertionError):
    """One or more ranks failed or timed out; the message holds each failed rank's traceback."""


_HANDED_OUT: set[int] = set()


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port() -> int:
    """A port free now, below the kernel's ephemeral range, not handed out before by this process.

    A port the kernel picked for ``bind(0)`` lies in the ephemeral range, which every outgoing connection (gloo's
    pairs, the torchft lighthouse's clients, ...) also draws from: in the seconds a spawned process takes to import
    torch and bind it, another connection could take it (one CI run's rendezvous failed so). Ports below the range
    are only ever taken by an explicit bind.
    """
    low, _ = _ephemeral_ports()
    first = 20000 if low > 21000 else 1024
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(first, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port found in [{first}, {low})")


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: Path,
    init_process_group: bool,
    timeout: float,
    extra_env: dict[str, str] | None,
    args: tuple[Any, ...],
) -> None:
    exit_code = 0
    try:
        torch.set_num_threads(1)
        if extra_env is not None:
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", **extra_env})
        if init_process_group:
            store = dist.FileStore(str(workdir / "store"), world_size)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
        result = fn(rank, world_size, *args)
        with open(workdir / f"result_{rank}.pkl", "wb") as file:
            pickle.dump(result, file)
    except BaseException:
        (workdir / f"error_{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        exit_code = 1
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    os._exit(exit_code)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    launcher_env: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` forked processes; return each rank's result.

    Args:
        fn: module-level or local function; its return value must be picklable.
        timeout: seconds for the whole run (and the process group's collective timeout).
        init_process_group: join the ranks in a gloo group first. ``False`` leaves that to the code under test
            (a Lightning ``Trainer``), with ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``
            set as torchrun would.
        env: extra environment variables for every rank.
        launcher_env: set the torchrun-style variables above. ``False`` runs ``fn`` in a clean isolated process
            (``world_size=1``), e.g. to let Lightning's own fork launcher start the ranks under a deadline.
    """
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="lp-dist-") as tmp:
        workdir = Path(tmp)
        extra_env = None
        if launcher_env:
            extra_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(find_free_port()),
                "WORLD_SIZE": str(world_size),
                **(env or {}),
            }
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, workdir, init_process_group, timeout, extra_env, args),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for rank in hung:
            processes[rank].kill()
            processes[rank].join(5)
        _raise_on_failure(workdir, processes, hung, timeout)
        results = []
        for rank in range(world_size):
            with open(workdir / f"result_{rank}.pkl", "rb") as file:
                results.append(pickle.load(file))
        return results


def _raise_on_failure(workdir: Path, processes: list[multiprocessing.Process], hung: list[int], timeout: float) -> None:
    errors = []
    for rank in range(len(processes)):
        path = workdir / f"error_{rank}.txt"
        if path.exists():
            stamp, _, text = path.read_text().partition("\n")
            errors.append((float(stamp), rank, text))
    crashed = [
        rank
        for rank, process in enumerate(processes)
        if rank not in hung and process.exitcode not in (0, 1) and not (workdir / f"error_{rank}.txt").exists()
    ]
    if not errors and not hung and not crashed:
        return
    lines = []
    if hung:
        lines.append(f"ranks {hung} did not finish within {timeout:.0f} s and were killed")
    for rank in crashed:
        lines.append(f"rank {rank} died with exit code {processes[rank].exitcode}")
    # The earliest traceback is the root cause; the others are usually its consequences.
    for _, rank, text in sorted(errors):
        lines.append(f"--- rank {rank} ---\n{text}")
    raise DistributedTestError("\n".join(lines))
