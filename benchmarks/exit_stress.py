"""Count how torchrun'd training jobs end: exit statuses and the known exit abort (docs/reliability.md).

Runs small jobs of ``examples/fault_tolerant.py`` (2 ranks, gloo, CPU, one thread per rank) one after another, per
strategy, with and without a rank killed mid-run (then torchrun restarts the job once and the restarted attempt
resumes from the last checkpoint, as in ``tests/test_recovery.py``). No spare restart: an abort at exit makes the
job fail, so every abort is counted. Every job has a timeout. Not part of the test suite (it takes minutes)::

    python benchmarks/exit_stress.py --strategies zero3 pipeline --runs 10 --kill-every 2 --out runs/exit_stress

Writes one JSON line per job to ``<out>/jobs.jsonl`` (torchrun's status, each worker's exit code as torchrun reports
it, whether the abort text appeared, CPU seconds) and prints a table per strategy. With ``--core-dumps`` a worker
that aborts leaves ``core*`` in its job folder (kernel ``core_pattern`` permitting), for ``gdb -batch -ex bt``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fault_tolerant.py"
EXIT_ABORT = "terminate called without an active exception"
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(directory: Path, strategy: str, *, kill: bool, steps: int, every: int, timeout: float, cores: bool) -> dict:
    """One torchrun job in ``directory``; returns what happened."""
    directory.mkdir(parents=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--max-restarts={1 if kill else 0}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        str(SCRIPT), "--strategy", strategy, "--dir", str(directory / "ckpt"), "--max-steps", str(steps),
        "--every", str(every),
    ]  # fmt: skip
    if kill:
        command += ["--kill-rank", "1", "--kill-at-step", str(steps * 2 // 3)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"})

    def allow_cores() -> None:
        if cores:
            resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    cpu, start = _children_cpu(), time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=allow_cores
        )
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = None
        output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
    (directory / "output.txt").write_text(output)
    shutil.rmtree(directory / "ckpt", ignore_errors=True)
    return {
        "strategy": strategy,
        "kill": kill,
        "returncode": returncode,
        "worker_exitcodes": [int(code) for code in _WORKER_EXIT.findall(output)],
        "aborts": output.count(EXIT_ABORT),
        "finished": f"finished at step {steps}" in output,
        "cores": sorted(p.name for p in directory.glob("core*")),
        "seconds": round(time.monotonic() - start, 1),
        "cpu_seconds": round(_children_cpu() - cpu, 1),
        "directory": str(directory),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["zero3", "pipeline", "zero2", "data_parallel"])
    parser.add_argument("--runs", type=int, default=5, help="jobs per strategy")
    parser.add_argument("--first-index", type=int, default=0, help="index of the first job (decides which kill)")
    parser.add_argument("--kill-every", type=int, default=2, help="every Nth job kills rank 1 (0: never)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per job")
    parser.add_argument("--cpu-budget", type=float, default=float("inf"), help="stop after this many CPU seconds")
    parser.add_argument("--core-dumps", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    spent = 0.0
    with (args.out / "jobs.jsonl").open("a") as log:
        for index in range(args.first_index, args.first_index + args.runs):
            for strategy in args.strategies:
                kill = args.kill_every > 0 and index % args.kill_every == args.kill_every - 1
                name = f"{time.strftime('%H%M%S')}-{strategy}-{index}{'-kill' if kill else ''}"
                result = run_job(
                    args.out / name, strategy, kill=kill, steps=args.steps, every=args.every,
                    timeout=args.timeout, cores=args.core_dumps,
                )  # fmt: skip
                results.append(result)
                log.write(json.dumps(result) + "\n")
                log.flush()
                spent += result["cpu_seconds"]
                print(json.dumps(result), flush=True)
                if spent > args.cpu_budget:
                    break
            if spent > args.cpu_budget:
                print(f"CPU budget of {args.cpu_budget:g} s spent", flush=True)
                break
    table: Counter[tuple[str, bool, str]] = Counter()
    for result in results:
        status = "timeout" if result["returncode"] is None else f"rc={result['returncode']}"
        table[(result["strategy"], result["kill"], f"{status} aborts={result['aborts']}")] += 1
    for (strategy, kill, status), count in sorted(table.items()):
        print(f"{strategy:14} {'killed+restarted' if kill else 'uninterrupted':16} {status:22} x{count}")
    print(f"CPU seconds: {spent:.0f}")


if __name__ == "__main__":
    main()
