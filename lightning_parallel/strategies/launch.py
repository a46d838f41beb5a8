"""The one place that decides how processes start and checks the launch environment.

Every strategy of this package goes through these functions, so ``start_method`` spellings, their errors and the
check of ``devices``/``num_nodes`` against what a cluster launcher (torchrun, SLURM, MPI, ...) set up are the same
everywhere. Checks here read only local facts (arguments, environment variables), so every rank reaches the same
verdict before the first collective: a bad configuration raises on all ranks instead of hanging one of them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.choices import check_choice
from lightning_parallel.strategies.failures import record_peers
from lightning_parallel.strategies.fork_safety import ForkSafeLauncher
from lightning_parallel.strategies.shutdown import destroy_process_group_at_exit

__all__ = [
    "ConsolidatingLauncher",
    "StartMethod",
    "check_start_method_fits_launcher",
    "configure_launcher",
    "explain_unreachable_main",
    "gloo_socket_ifname",
    "init_process_group_after_restart",
    "set_up_distributed_environment",
    "to_timeout",
    "validate_launch_environment",
    "validate_start_method",
]

StartMethod = Literal["popen", "spawn", "fork"]


def validate_start_method(start_method: str) -> str:
    """Return ``start_method`` if valid, else raise ``ValueError`` listing the valid ones and when to use each."""
    check_choice(
        "start_method",
        start_method,
        StartMethod,
        notes={
            "popen": "re-launch the script, the default for scripts and the CLI",
            "spawn": "fresh interpreters, picklable code",
            "fork": "Jupyter notebooks",
        },
        unknown=True,
    )
    if start_method == "fork" and not hasattr(os, "fork"):
        raise ValueError("`start_method='fork'` is not available on this platform. Use 'spawn' or 'popen'.")
    return start_method


def to_timeout(timeout: timedelta | float) -> timedelta:
    """Accept a ``timedelta`` or seconds (friendlier in YAML/CLI) for the process-group timeout."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"`timeout={timeout!r}` must be a `datetime.timedelta` or a number of seconds.")
    if seconds <= 0:
        raise ValueError(f"`timeout={timeout!r}` must be positive (seconds before a stuck collective fails).")
    return timedelta(seconds=seconds)


def validate_launch_environment(
    cluster_environment: ClusterEnvironment, *, num_processes: int, num_nodes: int, local_rank: int
) -> None:
    """Check ``devices``/``num_nodes`` against what an external launcher set up, before any collective.

    Lightning only runs the cluster environment's own check when it launches the processes itself; under
    torchrun, SLURM, MPI or a hand-made launcher a mismatch would otherwise make ``init_process_group`` wait for
    ranks that never come.
    """
    cluster_environment.validate_settings(num_devices=num_processes, num_nodes=num_nodes)
    expected = num_processes * num_nodes
    if cluster_environment.creates_processes_externally:
        launched = os.environ.get("WORLD_SIZE")
        if launched is not None and launched.isdigit() and int(launched) != expected:
            raise ValueError(
                f"The launcher started WORLD_SIZE={launched} processes, but the Trainer was given"
                f" `devices={num_processes}` and `num_nodes={num_nodes}` ({num_processes} * {num_nodes} = {expected})."
                f" Set `devices` to the processes per node and `num_nodes` so that their product is {launched}."
            )
    if local_rank >= num_processes:
        raise ValueError(
            f"This process has LOCAL_RANK={local_rank}, but the Trainer was given `devices={num_processes}`:"
            f" local ranks must be below `devices`. Set `devices` to the number of processes per node"
            f" ({local_rank + 1} or more)."
        )


def check_start_method_fits_launcher(cluster_environment: ClusterEnvironment, start_method: str) -> None:
    """Refuse a fork/spawn start when torchrun, SLURM or MPI already started this process as one rank.

    Each such rank would start ``devices`` processes of its own, with duplicate ranks that never form a group
    (Lightning's own ``ddp_spawn`` does the same). Only ``popen`` joins the processes an external launcher made.
    """
    if start_method != "popen" and cluster_environment.creates_processes_externally:
        launcher = type(cluster_environment).__name__
        raise ValueError(
            f"`start_method={start_method!r}` (the `_spawn`/`_notebook` strategy names) starts its own processes, but"
            f" this process was already started as one rank by an external launcher ({launcher}: torchrun, srun,"
            " mpirun, ...). Use the plain strategy name (e.g. 'zero2' instead of 'zero2_notebook') or"
            " `start_method='popen'`."
        )


def configure_launcher(strategy: Any, configure_default: Callable[[], None], fork_launcher: type) -> None:
    """Every strategy's ``_configure_launcher``: refuse a fork/spawn start under an external launcher, let Lightning
    pick its launcher (``configure_default``: the parent's method), then use ``fork_launcher`` for fork/spawn (our
    launchers check for a CUDA context before forking and may send back the whole model)."""
    check_start_method_fits_launcher(strategy.cluster_environment, strategy.start_method)
    configure_default()
    if strategy.start_method != "popen":
        strategy._launcher = fork_launcher(strategy, start_method=strategy.start_method)


class ConsolidatingLauncher(ForkSafeLauncher):
    """Lightning's fork/spawn launcher (with the CUDA-before-fork check), but the weights sent back to the parent
    process are the whole model.

    Lightning's own launcher sends rank 0's ``module.state_dict()``, which under sharding is only rank 0's shard.
    The strategy's ``consolidated_state_dict()`` (a collective: every rank takes part) gives the full, plain
    state dict on rank 0, which the parent then loads into the user's module as with any other strategy.
    """

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        state_dict = trainer.strategy.consolidated_state_dict()
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            trainer.strategy.checkpoint_io.save_checkpoint(state_dict, output.weights_path)
        return output


def init_process_group_after_restart(strategy: Any, backend: str) -> None:
    """Under torchrun after a restart, join the process group through a store prefix of this attempt.

    torch 2.13's restarted workers connect to the agent's store, which still holds the previous attempt's gloo
    addresses under the same keys; a worker that reads a stale one fails with "connectFullMesh ... Connection
    refused". Lightning then finds the group initialised and skips its own set-up. Nothing changes on a first start.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    strategy.set_world_ranks()
    environment = strategy.cluster_environment
    timeout = strategy.timeout
    store = dist.TCPStore(
        environment.main_address, environment.main_port, strategy.world_size, is_master=False, timeout=timeout
    )
    device = strategy.root_device
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_parallel/restart_{restart}", store),
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        timeout=timeout,
        # As Lightning's own set-up passes it on a first start: bound to its GPU, NCCL initialises eagerly, the
        # mesh's sub-groups are split from the world communicator, and barriers run on the right device.
        device_id=device if device.type != "cpu" else None,
    )


def gloo_socket_ifname(environment: Mapping[str, str], interfaces: Sequence[str]) -> str | None:
    """The ``GLOO_SOCKET_IFNAME`` to set from NCCL's ``NCCL_SOCKET_IFNAME``, or ``None`` to leave it alone.

    Our gloo groups (ZeRO's per-step checks, CPU worlds) need the interface NCCL-only clusters name only for NCCL;
    without it gloo picks the address the hostname resolves to, which across nodes may be unreachable. Unset when
    ``GLOO_SOCKET_IFNAME`` is set (yours wins) or ``NCCL_SOCKET_IFNAME`` is not. NCCL's syntax: ``=eth0,eth1`` exact
    names (kept as they are), ``eth,ib`` prefixes (the first of ``interfaces`` matching one: gloo wants the same
    number of interfaces on every node), ``^docker,lo`` an exclusion (no gloo equivalent: ``None``).

    Args:
        environment: the environment variables (``os.environ``).
        interfaces: this host's network interface names in index order (``socket.if_nameindex()``).
    """
    nccl = environment.get("NCCL_SOCKET_IFNAME", "").strip()
    if environment.get("GLOO_SOCKET_IFNAME") or not nccl or nccl.startswith("^"):
        return None
    if nccl.startswith("="):
        return nccl[1:]
    prefixes = [prefix for prefix in nccl.split(",") if prefix]
    return next((name for name in interfaces if name.startswith(tuple(prefixes))), None)


def _use_nccl_interface_for_gloo() -> None:
    """Local, before the first gloo group: ``GLOO_SOCKET_IFNAME`` from ``NCCL_SOCKET_IFNAME`` where only that is set."""
    value = gloo_socket_ifname(os.environ, [name for _, name in socket.if_nameindex()])
    if value is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = value
        rank_zero_info(f"GLOO_SOCKET_IFNAME={value} (from NCCL_SOCKET_IFNAME={os.environ['NCCL_SOCKET_IFNAME']}).")


def set_up_distributed_environment(strategy: Any, join_process_group: Callable[[], None]) -> Any:
    """Every strategy's ``setup_environment``: check the launch, join the group, record where the peers run.

    ``join_process_group`` is the strategy's parent ``setup_environment`` (Lightning's, which creates the group).
    Returns the :class:`~lightning_parallel.strategies.failures.PeerTable` used to name a dead rank later.
    """
    if not strategy.layout_from_environment:
        validate_launch_environment(
            strategy.cluster_environment,
            num_processes=strategy.num_processes,
            num_nodes=strategy.num_nodes,
            local_rank=strategy.cluster_environment.local_rank(),
        )
    _use_nccl_interface_for_gloo()
    try:
        init_process_group_after_restart(strategy, strategy._get_process_group_backend())
        join_process_group()
        destroy_process_group_at_exit()
    except dist.DistError as error:
        raise explain_unreachable_main(error, strategy) from error
    return record_peers()


def explain_unreachable_main(error: Exception, strategy: Any) -> Exception:
    """Name the main address and the fixes when joining the process group failed (store timeout, refused, ...).

    torch retries the connection to ``MASTER_ADDR:MASTER_PORT`` until the strategy's ``timeout`` and then raises
    e.g. "The client socket has timed out ... (127.0.0.1, 29500)", which says nothing about what to check.
    """
    environment = strategy.cluster_environment
    try:
        where = f"{environment.main_address}:{environment.main_port}"
    except Exception:  # an environment that cannot even tell its address
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    seconds = strategy.timeout.total_seconds()
    cause = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    settings = (
        "MASTER_ADDR/MASTER_PORT (torchrun: --master-addr/--master-port or --rdzv-endpoint), and that no firewall"
        " blocks that port between the nodes."
    )
    if strategy.global_rank == 0:  # rank 0 hosts the store at the main address and waits for the others
        return RuntimeError(
            f"Rank 0 waited at the main node {where} for {strategy.world_size} processes, but not all of them joined"
            f" within `timeout={seconds:g}` s ({cause}). Check that every other node started, that their"
            f" MASTER_ADDR is an address of this node they can reach, that all use the same {settings}"
        )
    return RuntimeError(
        f"Rank {strategy.global_rank} could not join the process group at the main node {where} within"
        f" `timeout={seconds:g}` s ({cause}). Check that node 0 started and is listening there, that MASTER_ADDR"
        f" is an address of node 0 that this node can reach, that every node uses the same {settings}"
    )
