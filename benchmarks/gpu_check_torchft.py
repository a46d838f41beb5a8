"""The torchft row of ``make gpu-check``: two replica groups of one process each, on the same device, one lighthouse.

:func:`fit_replica_groups` starts a torchft lighthouse in this process and two child processes
(``python -m benchmarks.gpu_check_torchft --group G ...``), each a replica group training
``DataParallelStrategy(fault_tolerance=FaultTolerance(replica_group=G, num_replica_groups=2))`` on its half of every
global batch, with :class:`~benchmarks.gpu_check_runs.Probe` saving checkpoints into its own folder. It returns the
global losses (the mean of the two groups') and group 0's checkpoints, to compare with one device. On one GPU both
groups share it, each its own CUDA context and (one-rank) process group; torchft joins them across over gloo (NCCL
refuses two ranks on one device).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.gpu_check_fit import CheckSettings, FitPlan, Fitted, configure_device, fit
from benchmarks.gpu_check_runs import read_states

__all__ = ["fit_replica_groups", "main"]

_ROOT = Path(__file__).resolve().parents[1]
NUM_GROUPS = 2


def _command(settings: CheckSettings, group: int, directory: Path, lighthouse: str, precision: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.gpu_check_torchft",
        f"--group={group}",
        f"--dir={directory}",
        f"--lighthouse={lighthouse}",
        f"--precision={precision}",
        f"--settings={json.dumps(asdict(settings))}",
    ]


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fit_replica_groups(settings: CheckSettings, precision: str, directory: Path, *, timeout: float) -> Fitted:
    """Fit two replica groups (child processes) to the end; raise ``RuntimeError`` with a group's last lines if one
    fails or ``timeout`` seconds pass (the groups are killed)."""
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's Rust side loads: it logs every quorum at "info"
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10_000)
    processes = []
    try:
        for group in range(NUM_GROUPS):
            out = directory / f"group{group}"
            out.mkdir(parents=True)
            path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, "PYTHONPATH": path, "RUST_LOG": "warn", "MASTER_ADDR": "127.0.0.1"}
            env["MASTER_PORT"] = str(_free_port())  # each group is its own job with its own process group
            command = _command(settings, group, out, lighthouse.address(), precision)
            with (out / "log").open("w") as log:
                processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_ROOT))
        for group, process in enumerate(processes):
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                tail = (directory / f"group{group}" / "log").read_text().strip().splitlines()[-3:]
                what = f"exit status {code}" if code is not None else f"no exit after {timeout:.0f} s"
                raise RuntimeError(f"replica group {group}: {what}: {' | '.join(tail)}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        lighthouse.shutdown()
    return _combine(directory)


def _combine(directory: Path) -> Fitted:
    """Global losses (the groups' mean: equal halves of each batch), every group's peaks, group 0's checkpoints."""
    results = [json.loads((directory / f"group{g}" / "result.json").read_text()) for g in range(NUM_GROUPS)]
    losses = [sum(step) / NUM_GROUPS for step in zip(*(r["losses"] for r in results), strict=True)]
    peaks = {name: [peak for r in results for peak in r["peaks"][name]] for name in results[0]["peaks"]}
    seconds = max(r["seconds"] for r in results)
    return Fitted(seconds, losses, peaks, read_states(directory / "group0"))


def main(argv: list[str] | None = None) -> None:
    """One replica group: fit, then write ``DIR/result.json`` (losses, peaks, seconds); checkpoints stay in DIR."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_torchft")
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--precision", required=True)
    parser.add_argument("--settings", required=True, help="CheckSettings as JSON")
    args = parser.parse_args(argv)
    settings = CheckSettings(**json.loads(args.settings))
    configure_device(settings.device)

    from lightning_parallel import DataParallelStrategy
    from lightning_parallel.demos.main import quiet_lightning
    from lightning_parallel.fault_tolerance import FaultTolerance

    quiet_lightning()
    logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector").setLevel(logging.WARNING)
    config = FaultTolerance(
        replica_group=args.group,
        num_replica_groups=NUM_GROUPS,
        lighthouse=args.lighthouse,
        timeout=60.0,
        quorum_timeout=60.0,
        join_timeout=120.0,
        # Both groups share the one GPU, and NCCL refuses two ranks on one device: "auto" would pick NCCL on CUDA.
        cross_group_backend="gloo",
    )
    strategy = DataParallelStrategy(fault_tolerance=config)
    fitted = fit(settings, FitPlan(strategy=strategy, precision=args.precision, replicas=NUM_GROUPS), args.dir)
    result = {"losses": fitted.losses, "peaks": fitted.peaks, "seconds": fitted.seconds}
    (args.dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
