"""``FaultTolerance``: where a replica group finds its peers (torchft's lighthouse) and how long it waits for them.

Plain data, validated when constructed (on every rank, before any collective); no torchft import here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from lightning_parallel.choices import check_choice

__all__ = ["LIGHTHOUSE_ENV", "CrossGroupBackend", "FaultTolerance"]

CrossGroupBackend = Literal["auto", "gloo", "nccl", "baby_nccl"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The environment variable torchft reads the lighthouse address from when ``lighthouse`` is not given."""


@dataclass(kw_only=True, frozen=True)
class FaultTolerance:
    """Train the replicated dimension as independent replica groups that survive each other's failures (torchft).

    Each replica group is its own job (its own launch: torchrun, SLURM, ...), holding a full model replica over its
    own ranks. The groups meet through torchft's lighthouse: at every step they form a quorum of the groups alive,
    average gradients over it, and the optimizer steps only if the step committed. A group that dies leaves the
    others training; restarted by its launcher, it fetches the weights, optimizer state and step from a live
    group and rejoins at the next step (docs/reliability.md).
    """

    replica_group: int
    """This job's replica group, ``0 <= replica_group < num_replica_groups`` (its slice of the data)."""

    num_replica_groups: int
    """How many replica groups the run has when all are alive (the data is split over them)."""

    lighthouse: str | None = None
    """The lighthouse's address, e.g. ``"http://host:29510"``; ``None`` reads ``$TORCHFT_LIGHTHOUSE``."""

    start_together: bool = True
    """Wait (up to ``join_timeout``) before the first step until all ``num_replica_groups`` groups are in the
    quorum, so a run without failures trains every group's data from the first step. A group that finds the run
    already past step 0 (a restart) joins at once. ``False``: train with whichever groups are there."""

    min_replica_groups: int = 1
    """A step commits only if at least this many groups took part (torchft's ``min_replica_size``)."""

    timeout: float = 30.0
    """Seconds a cross-group collective, checkpoint transfer or commit may wait before the step is given up."""

    quorum_timeout: float = 60.0
    """Seconds a group waits for a quorum (the lighthouse waits for stragglers up to its ``--join_timeout_ms``)."""

    join_timeout: float = 300.0
    """Seconds ``start_together`` waits for all groups to arrive before it raises."""

    cross_group_backend: CrossGroupBackend = "auto"
    """The process group the groups average gradients over (torchft's reconfigurable ones): ``"auto"`` picks
    ``"nccl"`` when the model is on a CUDA device and ``"gloo"`` on the CPU (gloo on a GPU copies every step's
    gradients to the host and back). ``"baby_nccl"`` runs NCCL in a child process (a hung collective is killed with
    it, at ~1 GB more GPU memory for its CUDA context, and no overlap with compute); ``"gloo"`` is needed where two
    groups share one GPU (NCCL refuses two ranks of one communicator on the same device)."""

    def __post_init__(self) -> None:
        for name in ("num_replica_groups", "min_replica_groups", "replica_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"`FaultTolerance({name}={value!r})` must be an int.")
        if self.num_replica_groups < 1:
            raise ValueError(f"`FaultTolerance(num_replica_groups={self.num_replica_groups})` must be >= 1.")
        if not 0 <= self.replica_group < self.num_replica_groups:
            raise ValueError(
                f"`FaultTolerance(replica_group={self.replica_group})` must be in [0, num_replica_groups ="
                f" {self.num_replica_groups}): number the groups 0, 1, ... and give each job its own."
            )
        if not 1 <= self.min_replica_groups <= self.num_replica_groups:
            raise ValueError(
                f"`FaultTolerance(min_replica_groups={self.min_replica_groups})` must be between 1 and"
                f" num_replica_groups={self.num_replica_groups}."
            )
        for name in ("timeout", "quorum_timeout", "join_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"`FaultTolerance({name}={value!r})` must be a positive number of seconds.")
        check_choice("FaultTolerance.cross_group_backend", self.cross_group_backend, CrossGroupBackend)
        if self.lighthouse is not None and not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"`FaultTolerance(lighthouse={self.lighthouse!r})` must be the lighthouse's URL, e.g."
                " 'http://host:29510' (start it with `torchft_lighthouse --min_replicas 1`)."
            )

    def lighthouse_address(self) -> str:
        """The lighthouse URL: ``lighthouse``, else ``$TORCHFT_LIGHTHOUSE``; raises ``ValueError`` naming both."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                "FaultTolerance needs the lighthouse's address: pass `FaultTolerance(lighthouse='http://host:29510')`"
                f" or set ${LIGHTHOUSE_ENV} (start the lighthouse with `torchft_lighthouse --min_replicas 1`)."
            )
        return address
