"""An unreachable lighthouse is named as our setting, on every rank of every group, within ``FaultTolerance.timeout``
(issue 44, item 3): torchft's own ``failed to connect to http://... within timeout`` named neither."""

from __future__ import annotations

import socket

import pytest
from distributed_harness import find_free_port

from lightning_parallel.fault_tolerance import FaultTolerance
from lightning_parallel.fault_tolerance.lighthouse import wait_for_lighthouse


def _config(lighthouse: str | None) -> FaultTolerance:
    return FaultTolerance(replica_group=0, num_replica_groups=2, lighthouse=lighthouse, timeout=0.5)


def test_an_unreachable_lighthouse_names_the_setting_and_the_fix() -> None:
    port = find_free_port()  # nothing listens there
    with pytest.raises(ConnectionError) as error:
        wait_for_lighthouse(_config(f"http://127.0.0.1:{port}"))
    message = str(error.value)
    assert f"no lighthouse answers at http://127.0.0.1:{port}" in message
    assert f"`FaultTolerance(lighthouse='http://127.0.0.1:{port}')`" in message
    assert "torchft_lighthouse --min_replicas 1" in message and "FaultTolerance(timeout=...)" in message


def test_the_address_from_the_environment_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{find_free_port()}")
    with pytest.raises(ConnectionError, match=r"\(\$TORCHFT_LIGHTHOUSE\)"):
        wait_for_lighthouse(_config(None))


def test_a_listening_lighthouse_passes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        wait_for_lighthouse(_config(f"http://127.0.0.1:{server.getsockname()[1]}"))


def test_a_replica_group_refuses_before_torchft_connects() -> None:
    """What each rank of each group builds first when a fault-tolerant fit starts."""
    pytest.importorskip("torchft")
    from lightning_parallel.fault_tolerance.replica_sync import ReplicaGroupSync

    with pytest.raises(ConnectionError, match=r"FaultTolerance: no lighthouse answers"):
        ReplicaGroupSync(
            _config(f"http://127.0.0.1:{find_free_port()}"),
            group_rank=0,
            group_world_size=1,
            store_host="127.0.0.1",
            store_port=find_free_port(),
            state_dict=dict,
            load_state_dict=lambda state: None,
        )
