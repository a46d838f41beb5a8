"""Whether the lighthouse a replica group is configured with answers, before torchft is asked to connect to it.

torchft's ``Manager`` fails on an unreachable lighthouse with its own ``failed to connect to http://... within timeout
of 15s``, which names neither ``FaultTolerance`` nor where the address came from. :func:`wait_for_lighthouse` opens
(and closes) a TCP connection to it first, retrying for as long as torchft would wait (``FaultTolerance.timeout``), and
raises an error that names the setting and the fix.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from lightning_parallel.fault_tolerance.config import LIGHTHOUSE_ENV, FaultTolerance

__all__ = ["wait_for_lighthouse"]


def wait_for_lighthouse(config: FaultTolerance, *, sleep: Callable[[float], None] = time.sleep) -> None:
    """Local. Return once the lighthouse accepts a TCP connection; ``ConnectionError`` after ``config.timeout``
    seconds without one, naming ``FaultTolerance``, the address and where it came from."""
    address = config.lighthouse_address()
    parts = urlsplit(address)
    host, port = parts.hostname, parts.port
    if host is None or port is None:
        raise ValueError(
            f"The lighthouse address {address!r} ({_source(config)}) needs a host and a port, e.g. 'http://host:29510'."
        )
    deadline = time.monotonic() + config.timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 2.0))):
                return
        except OSError as error:
            if time.monotonic() + 0.1 >= deadline:
                raise ConnectionError(
                    f"FaultTolerance: no lighthouse answers at {address} ({_source(config)}) after"
                    f" {config.timeout:g} s ({error}). Start it first (`torchft_lighthouse --min_replicas 1 --bind"
                    f" [::]:{port}`) on a host every replica group reaches, and pass its URL as"
                    f" `FaultTolerance(lighthouse='http://<host>:{port}')` or in ${LIGHTHOUSE_ENV}; raise"
                    " `FaultTolerance(timeout=...)` if it starts later than the groups."
                ) from error
        sleep(0.1)


def _source(config: FaultTolerance) -> str:
    return f"`FaultTolerance(lighthouse={config.lighthouse!r})`" if config.lighthouse else f"${LIGHTHOUSE_ENV}"
