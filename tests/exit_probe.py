"""Run a script as ``__main__`` and record, at the very end of interpreter exit, what is left of the process groups.

    EXIT_PROBE_DIR=DIR python tests/exit_probe.py SCRIPT [ARGS...]   (under torchrun: one file per rank)

Its ``atexit`` handler is registered before the script imports anything, so it runs after every handler the script
and the library register (``atexit`` runs last-in, first-out), just before the interpreter tears itself down.
It writes ``DIR/rank<RANK>.json``: the gloo threads still running and the process groups still held by a
``DeviceMesh``.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
from pathlib import Path


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group (Linux: ``/proc/self/task``)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _record() -> None:
    held = 0
    if "torch.distributed.device_mesh" in sys.modules:
        mesh_type = sys.modules["torch.distributed.device_mesh"].DeviceMesh
        held = sum(len(getattr(o, "_pg_registry", {})) for o in gc.get_objects() if isinstance(o, mesh_type))
    record = {"rank": int(os.environ.get("RANK", "0")), "gloo_threads": gloo_threads(), "mesh_groups": held}
    Path(os.environ["EXIT_PROBE_DIR"], f"rank{record['rank']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    atexit.register(_record)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
