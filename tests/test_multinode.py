"""Multi-node on one machine: two torchrun "nodes" on loopback, two network namespaces joined by a veth pair (so
traffic really crosses an interface between two addresses), and a node that cannot reach the main node.

Each run trains an example for 3 steps on seeded tokens and must end with the weights of one device trained on the
same global batch; every rank reports its rank, node and the main address it joined.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from distributed_harness import find_free_port
from launch_helpers import (
    Finished,
    assert_all_succeeded,
    assert_equals_single_device,
    assert_ranks_took_part,
    clean_environment,
    describe,
    example_command,
    rank_lines,
    reference_weights,
    run_together,
)

from lightning_parallel.demos import GPTLightningModule

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _static(node_rank: int, port: int, address: str = "127.0.0.1") -> list[str]:
    return [f"--node-rank={node_rank}", f"--master-addr={address}", f"--master-port={port}"]


def _c10d(node_rank: int, port: int, address: str = "127.0.0.1") -> list[str]:
    # Elastic rendezvous: the agents agree on node ranks themselves (whichever arrives first is node 0).
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={address}:{port}", "--rdzv-id=lightning_parallel_test"]


# One loopback run per strategy; the rendezvous form alternates so both forms run without extra runs. The pipeline
# is DP x PP = 2 x 2 at world size 4: each pipeline's 2 stages on one node, the gradient all-reduce across nodes
# (with `zero_stage=2`: the reduce-scatter and all-gather of each stage's shards across nodes). `zero2_hybrid`
# shards within each node (`shard_size=2`) and all-reduces the shards across the two nodes.
# No zero3 here: a torchrun job without spare restarts would fail on the known FSDP2 at-exit abort
# (docs/reliability.md); ZeRO-3 under torchrun is covered by tests/test_recovery.py, which gives it one.
LOOPBACK = {
    "data_parallel": _static,
    "zero1": _c10d,
    "zero2": _c10d,
    "zero2_hybrid": _static,
    "pipeline": _static,
    "pipeline_zero2": _c10d,
}


@pytest.fixture(scope="module")
def loopback_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict[str, Finished], Path]]:
    """``run(strategy)``: the two torchrun nodes' outputs and the saved weights of that strategy's loopback job.

    The jobs are independent (own ports, own output file), so two run at the same time: the strategy asked for and
    the next one in ``LOOPBACK`` not run yet, whose result waits here for its own test. One job leaves part of the two
    cores idle (rendezvous, process exit); the other fills it.
    """
    results: dict[str, tuple[dict[str, Finished], Path]] = {}

    def run(strategy: str) -> tuple[dict[str, Finished], Path]:
        if strategy not in results:
            partner = next((name for name in LOOPBACK if name != strategy and name not in results), None)
            batch = [strategy] if partner is None else [strategy, partner]
            commands, saves = {}, {}
            for name in batch:
                port, saves[name] = find_free_port(), tmp_path_factory.mktemp(name) / "final.ckpt"
                launcher = [*TORCHRUN, "--nnodes=2", "--nproc-per-node=2"]
                for rank in (0, 1):
                    rendezvous = LOOPBACK[name](rank, port)
                    commands[name, rank] = [*launcher, *rendezvous, *example_command(name, saves[name])]
            finished = run_together(
                {f"{name} node{rank}": command for (name, rank), command in commands.items()},
                {f"{name} node{rank}": clean_environment() for name, rank in commands},
            )
            for name in batch:
                results[name] = ({f"node{rank}": finished[f"{name} node{rank}"] for rank in (0, 1)}, saves[name])
        return results[strategy]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(LOOPBACK))
def test_two_torchrun_nodes_on_loopback_train_like_one_device(strategy, loopback_run):
    finished, save = loopback_run(strategy)
    output = assert_all_succeeded(finished)
    assert_ranks_took_part(output, world_size=4, num_nodes=2, environment="TorchElasticEnvironment")
    # Each torchrun process ran exactly one node's two ranks.
    for item in finished.values():
        lines = rank_lines(item.output)
        assert len(lines) == 2 and len({line.node_rank for line in lines}) == 1, describe(finished)
    assert_equals_single_device(save)


# ----------------------------------------------------------------------------------------- network namespaces
def _skip_or_fail(reason: str) -> None:
    """Skip with ``reason``, or fail where CI requires every launcher (``LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS=1``)."""
    if os.environ.get("LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def namespaces() -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """Two network namespaces joined by a veth pair, ``10.77.<pid>.1`` and ``.2``; removed afterwards, always.

    Yields ``({"name", "device", "address"} of node 0, the same of node 1)``. The addresses exist only inside the
    namespaces this fixture creates.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        _skip_or_fail("creating network namespaces needs root and iproute2 (`ip`); run as root to include this test")
    suffix = os.getpid() % 10_000
    nodes = [
        {"name": f"lp_a{suffix}", "device": f"lp_va{suffix}", "address": f"10.77.{suffix % 250}.1"},
        {"name": f"lp_b{suffix}", "device": f"lp_vb{suffix}", "address": f"10.77.{suffix % 250}.2"},
    ]
    setup = [["ip", "netns", "add", node["name"]] for node in nodes]
    setup.append(["ip", "link", "add", nodes[0]["device"], "type", "veth", "peer", "name", nodes[1]["device"]])
    for node in nodes:
        inside = ["ip", "netns", "exec", node["name"], "ip"]
        setup += [
            ["ip", "link", "set", node["device"], "netns", node["name"]],
            [*inside, "addr", "add", f"{node['address']}/24", "dev", node["device"]],
            [*inside, "link", "set", node["device"], "up"],
            [*inside, "link", "set", "lo", "up"],
        ]
    try:
        for command in setup:
            result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
            if result.returncode != 0:
                _skip_or_fail(f"cannot create network namespaces here (`{' '.join(command)}`: {result.stderr.strip()})")
        yield nodes[0], nodes[1]
    finally:
        for node in nodes:  # deleting a namespace deletes the veth end inside it, and so the pair
            subprocess.run(["ip", "netns", "del", node["name"]], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "link", "del", nodes[0]["device"]], capture_output=True, timeout=30, check=False)


def _interface_bytes(node: dict[str, str], direction: str) -> int:
    path = f"/sys/class/net/{node['device']}/statistics/{direction}_bytes"
    command = ["ip", "netns", "exec", node["name"], "cat", path]
    return int(subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout)


# Two strategies, one process per "host" (cheap: 2 ranks): data parallel (the gradient all-reduce crosses the veth)
# and a 2-stage pipeline split across the hosts (activations forward and gradients backward cross the veth). The
# loopback test covers every strategy at 4 ranks; this one proves the traffic leaves one address for another.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["data_parallel", "pipeline"])
def test_two_hosts_in_network_namespaces_train_like_one_device(strategy, namespaces, tmp_path):
    port, save = find_free_port(), tmp_path / "final.ckpt"
    main_address = namespaces[0]["address"]
    commands, envs = {}, {}
    for rank, node in enumerate(namespaces):
        launcher = [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", *_static(rank, port, main_address)]
        commands[f"host{rank}"] = ["ip", "netns", "exec", node["name"], *launcher, *example_command(strategy, save)]
        # gloo picks the interface by hostname otherwise, which resolves outside the namespaces.
        envs[f"host{rank}"] = clean_environment(GLOO_SOCKET_IFNAME=node["device"], TP_SOCKET_IFNAME=node["device"])
    finished = run_together(commands, envs)
    output = assert_all_succeeded(finished)
    lines = assert_ranks_took_part(output, world_size=2, num_nodes=2, environment="TorchElasticEnvironment")
    assert {line.main for line in lines} == {f"{main_address}:{port}"}
    assert_equals_single_device(save)
    # Lower bounds on what must have crossed the veth, both ways, over the 3 steps.
    if strategy == "data_parallel":  # each rank receives at least half the gradient bytes per all-reduce
        parameter_bytes = sum(p.numel() * 4 for p in GPTLightningModule("tiny", block_size=16).parameters())
        expected = 3 * parameter_bytes // 2
    else:  # the stage boundary's activations (batch 8 x 16 tokens x 64 features, fp32) each step, and their grads
        expected = 3 * 8 * 16 * 64 * 4
    for node in namespaces:
        received, sent = _interface_bytes(node, "rx"), _interface_bytes(node, "tx")
        assert received >= expected and sent >= expected, (node, received, sent, expected, describe(finished))


# --------------------------------------------------------------------------------------- unreachable main node
@pytest.mark.slow
def test_nodes_given_different_main_ports_fail_within_the_timeout_naming_the_address(tmp_path):
    """Two nodes started by hand (NODE_RANK), node 1 with a wrong MASTER_PORT: both fail and say what to check."""
    main_port, wrong_port = find_free_port(), find_free_port()
    commands, envs = {}, {}
    for node_rank, port in ((0, main_port), (1, wrong_port)):
        commands[f"node{node_rank}"] = [sys.executable, *example_command("data_parallel", tmp_path / "never.ckpt")]
        commands[f"node{node_rank}"] += ["--devices", "1", "--num-nodes", "2", "--timeout", "5"]
        envs[f"node{node_rank}"] = clean_environment(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node_rank), LOCAL_RANK="0"
        )
    # The deadline is the no-hang check: torch retries until the 5 s timeout, then our message replaces its own.
    finished = run_together(commands, envs, deadline=120)
    assert all(item.returncode not in (0, None) for item in finished.values()), describe(finished)
    node0, node1 = finished["node0"].output, finished["node1"].output
    assert f"Rank 0 waited at the main node 127.0.0.1:{main_port} for 2 processes" in node0, describe(finished)
    assert "Check that every other node started" in node0
    expected = f"Rank 1 could not join the process group at the main node 127.0.0.1:{wrong_port} within `timeout=5` s"
    assert expected in node1, describe(finished)
    assert "Check that node 0 started" in node1 and "MASTER_ADDR/MASTER_PORT" in node1 and "firewall" in node1
    assert not (tmp_path / "never.ckpt").exists()


def test_reference_run_trains():
    """The single-device reference every multi-node run is compared with (cheap, in-process)."""
    weights = reference_weights()
    assert weights and all(tensor.isfinite().all() for tensor in weights.values())


def test_gloo_takes_nccls_interface_where_only_nccls_is_set() -> None:
    """Issue 42: an NCCL-only cluster sets `NCCL_SOCKET_IFNAME`; our gloo groups get the same interface (a pure
    function of the environment and this host's interfaces: NCCL's exact names, prefixes and exclusions)."""
    from lightning_parallel.strategies.launch import gloo_socket_ifname

    host = ["lo", "docker0", "eth0", "eth1", "ib0"]
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "eth0"}, host) == "eth0"
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "eth"}, host) == "eth0"  # a prefix: the first match only
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "ib,eth"}, host) == "eth0"  # in the host's order
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "=eth1,ib0"}, host) == "eth1,ib0"  # exact names, as given
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "^docker,lo"}, host) is None  # no gloo equivalent
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "bond"}, host) is None  # nothing matches: gloo's default
    assert gloo_socket_ifname({"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "ib0"}, host) is None  # yours
    assert gloo_socket_ifname({}, host) is None
