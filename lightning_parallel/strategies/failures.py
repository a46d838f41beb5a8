"""Say which rank failed when a collective breaks because a peer died.

Gloo and NCCL report a dead peer as "Connection closed by peer [address]:port" or a timeout, without a rank. At
set-up every rank records where the others run (host name and process id: one ``all_gather_object``); when a
collective then fails, the survivor checks which recorded processes on its own host are gone and names them.
Ranks on other hosts cannot be checked this way; the message then says so.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist

__all__ = ["PeerTable", "explain_peer_failure", "record_peers"]

_PEER_FAILURE_PATTERNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "timed out",
    "Timed out",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
)


@dataclass(frozen=True)
class PeerTable:
    """Host name and process id of every rank, indexed by global rank, and an id of this run (rank 0's)."""

    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    run_id: str = ""
    """The same on every rank, new for every set-up: scopes the run's keys in the store (``failure_board.py``)."""

    def dead_local_ranks(self) -> list[int]:
        here = socket.gethostname()
        return [
            rank
            for rank, (host, pid) in enumerate(zip(self.hosts, self.pids, strict=True))
            if host == here and not _alive(pid)
        ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process stays a zombie until its parent reaps it
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def record_peers() -> PeerTable | None:
    """Collective: every rank's host and pid, and rank 0's id for this run (``None`` when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    entries: list[tuple[str, int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (socket.gethostname(), os.getpid(), uuid.uuid4().hex))
    gathered = cast(list[tuple[str, int, str]], entries)  # every rank filled its entry
    return PeerTable(hosts=tuple(e[0] for e in gathered), pids=tuple(e[1] for e in gathered), run_id=gathered[0][2])


def explain_peer_failure(
    exception: BaseException, peers: PeerTable | None, global_rank: int, published: str | None = None
) -> None:
    """Prefix a collective failure caused by a dead or failed peer with which rank it was (when it can be known).

    ``published`` is the failure another rank published before (``"rank r failed: ..."``, see ``failure_board.py``):
    the cause when that rank's process is still alive, or when it failed first and then exited.
    """
    text = str(exception)
    if peers is None or not any(pattern in text for pattern in _PEER_FAILURE_PATTERNS):
        return
    if published is not None and not published.startswith(f"rank {global_rank} failed"):
        exception.args = (f"Rank {global_rank}: a collective failed because {published}. Original error: {text}",)
        return
    dead = peers.dead_local_ranks()
    deadline = time.monotonic() + 2.0  # the peer's sockets close while its process is still being torn down
    while not dead and time.monotonic() < deadline:
        time.sleep(0.1)
        dead = peers.dead_local_ranks()
    if dead:
        cause = f"rank(s) {dead} stopped (their processes {[peers.pids[r] for r in dead]} no longer exist)"
    else:
        cause = "another rank stopped or stalled (it runs on another host or is still alive; see its log)"
    exception.args = (f"Rank {global_rank}: a collective failed because {cause}. Original error: {text}",)
