"""What every example shares: read the process layout a launcher set up, and say where each rank ran.

The same example script then runs unchanged on one device, as N processes it starts itself, under
``torchrun`` (one or many nodes), under SLURM's ``srun`` and under ``mpirun``: ``--devices`` and ``--num-nodes``
default to what the launcher started, so they never disagree with it.
"""

from __future__ import annotations

import os
import socket

import lightning.pytorch as pl


def _int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def launched_layout(devices: int | None, num_nodes: int | None, default_devices: int = 2) -> tuple[int, int]:
    """``(devices per node, num_nodes)``: the values given, else the launcher's, else ``(default_devices, 1)``.

    torchrun sets ``LOCAL_WORLD_SIZE``/``WORLD_SIZE``, srun ``SLURM_NTASKS_PER_NODE``/``SLURM_NNODES``, Open MPI
    ``OMPI_COMM_WORLD_LOCAL_SIZE``/``OMPI_COMM_WORLD_SIZE`` (MPICH and Intel MPI: ``MPI_LOCALNRANKS``/``PMI_SIZE``).
    """
    for local_name, world_name in (
        ("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("MPI_LOCALNRANKS", "PMI_SIZE"),
    ):
        local, world = _int(local_name), _int(world_name)
        if local and world:
            return devices or local, num_nodes or world // local
    if _int("SLURM_NTASKS") and _int("SLURM_NTASKS_PER_NODE"):
        return devices or _int("SLURM_NTASKS_PER_NODE") or 1, num_nodes or _int("SLURM_NNODES") or 1
    return devices or default_devices, num_nodes or 1


def data_parallel_replicas(trainer: pl.Trainer) -> int:
    """How many data-parallel replicas split each global batch (all stages of one pipeline share a batch)."""
    if trainer.world_size == 1:
        return 1
    return trainer.strategy.distributed_sampler_kwargs["num_replicas"]


def where(trainer: pl.Trainer) -> str:
    """One line per rank: who it is, on which host, under which launcher, and the main node it joined."""
    environment = trainer.strategy.cluster_environment
    main = f"{environment.main_address}:{environment.main_port}" if environment is not None else "-"
    return (
        f"rank {trainer.global_rank}/{trainer.world_size} node {trainer.node_rank} local {trainer.local_rank}"
        f" host {socket.gethostname()} environment {type(environment).__name__} main {main}"
    )
