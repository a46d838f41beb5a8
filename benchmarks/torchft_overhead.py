"""What fault tolerance without restarts (torchft, docs/reliability.md) costs per step, and what a failure costs.

Drives ``examples/fault_tolerant.py`` under torchrun on this machine (gloo, CPU, one thread per process); every job
has a timeout. Not part of the test suite (it takes minutes)::

    python benchmarks/torchft_overhead.py --repeats 3 --steps 40 --out runs/torchft_overhead

1. Overhead without failures: the same global batch and model trained by two data-parallel processes, once as one
   job (``DataParallelStrategy``, DDP's all-reduce) and once as two replica groups of one process each meeting at a
   lighthouse (``FaultTolerance``). The two kinds alternate (``--repeats`` pairs) so that load from other work on a
   shared machine falls on both; each pair's ratio of median step times is reported (steps after the first
   ``--warmup``).
2. A failure: group 1 SIGKILLs itself at ``--kill-at-step``; its torchrun restarts it. Reported: the survivor's
   longest wait between two steps, its steps/s while alone and with its peer, samples/s lost while the group is
   down (it trains only its own half of each global batch), and the time from the kill until the restarted group
   trains again (torchrun's restart, Python and Lightning start-up, fetching the state from the survivor).

Hybrid sharding across groups (``--strategy zero2 --nproc-per-group 2``): the one job is ``2 x 2`` processes of
``ShardedOptimizerStrategy(2, shard_size=2)`` (a plain process group across the shard groups), the replica groups are
two jobs of two processes each sharding among themselves, torchft across them.

Prints a JSON summary and writes it to ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fault_tolerant.py"
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _median_step(records: list[dict], warmup: int) -> float:
    times = [r["time"] for r in records if r["step"] > warmup]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


class Jobs:
    """Processes started here, each in its own session, killed (with their children) on exit."""

    def __init__(self, out: Path, timeout: float) -> None:
        self.out, self.timeout, self.processes = out, timeout, []

    def start(self, command: list[str], log: str, **env: str) -> subprocess.Popen:
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_LOG": "warn", "OMP_NUM_THREADS": "1", **env}
        with (self.out / log).open("a") as file:
            process = subprocess.Popen(
                command, stdout=file, stderr=subprocess.STDOUT, env=environment, cwd=ROOT, start_new_session=True
            )
        self.processes.append(process)
        return process

    def wait(self, process: subprocess.Popen) -> int:
        return process.wait(timeout=self.timeout)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        self.processes.clear()


def _train_args(args: argparse.Namespace, run: Path, record: Path) -> list[str]:
    steps = ["--dir", str(run), "--max-steps", str(args.steps), "--every", "1000000", "--record", str(record)]
    shape = ["--preset", args.preset, "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch)]
    return [str(SCRIPT), *steps, *shape]


def _torchrun(nproc: int, *, max_restarts: int = 0) -> list[str]:
    port = str(_free_port())
    return [
        str(BIN / "torchrun"),
        f"--nproc-per-node={nproc}",
        f"--master-port={port}",
        f"--max-restarts={max_restarts}",
    ]


def _lighthouse(jobs: Jobs) -> str:
    port = _free_port()
    command = [str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}"]
    jobs.start([*command, "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "2000"], "lighthouse.log")
    return f"http://127.0.0.1:{port}"


def ddp_run(args: argparse.Namespace, jobs: Jobs, run: Path) -> float:
    run.mkdir(parents=True)
    record = run / "rank0.jsonl"
    strategy = ["--strategy", args.strategy]
    if args.strategy != "data_parallel":
        strategy += ["--shard-size", str(args.nproc_per_group)]
    command = [*_torchrun(2 * args.nproc_per_group), *_train_args(args, run, record), *strategy]
    process = jobs.start(command, "ddp.log")
    assert jobs.wait(process) == 0, f"the DDP job failed; see {jobs.out / 'ddp.log'}"
    return _median_step(_records(record), args.warmup)


def ft_run(args: argparse.Namespace, jobs: Jobs, run: Path, *, kill_at_step: int = -1) -> list[list[dict]]:
    run.mkdir(parents=True)
    lighthouse = _lighthouse(jobs)
    groups = []
    for group in range(2):
        extra = ["--replica-group", str(group), "--num-replica-groups", "2", "--strategy", args.strategy]
        if group == 1 and kill_at_step >= 0:
            extra += ["--kill-rank", "0", "--kill-at-step", str(kill_at_step)]
        record = run / f"group{group}.jsonl"
        command = [*_torchrun(args.nproc_per_group, max_restarts=1), *_train_args(args, run, record), *extra]
        groups.append(jobs.start(command, f"ft_group{group}.log", TORCHFT_LIGHTHOUSE=lighthouse))
    for process in groups:
        assert jobs.wait(process) == 0, f"a replica group failed; see {jobs.out}/ft_group*.log"
    jobs.close()  # the lighthouse
    return [_records(run / f"group{group}.jsonl") for group in range(2)]


def failure_summary(groups: list[list[dict]], kill_at_step: int, global_batch: int) -> dict[str, float]:
    survivor, victim = groups
    gaps = [(b["time"] - a["time"], b) for a, b in itertools.pairwise(survivor)]
    alone = [r for r in survivor if r["groups"] == 1 and r["step"] > kill_at_step]
    together = [r for r in survivor if r["groups"] == 2 and r["step"] <= kill_at_step]
    killed_at = next(r["time"] for r in survivor if r["step"] == kill_at_step)  # the survivor's last step with both
    back = next(r for r in victim if r["step"] > kill_at_step + 1 and r["groups"] == 2)

    def rate(records: list[dict]) -> float:
        return (len(records) - 1) / (records[-1]["time"] - records[0]["time"])

    alone_rate, together_rate = rate(alone), rate(together[2:])
    return {
        "longest_wait_s": max(gap for gap, _ in gaps),
        "steps_per_s_both": together_rate,
        "steps_per_s_alone": alone_rate,
        "samples_per_s_both": together_rate * global_batch,
        "samples_per_s_alone": alone_rate * global_batch / 2,
        "steps_alone": len(alone),
        "kill_to_rejoined_s": back["time"] - killed_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/torchft_overhead"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--kill-at-step", type=int, default=10)
    parser.add_argument("--kill-steps", type=int, default=80, help="steps of the run with a failure")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one job may take")
    parser.add_argument("--strategy", default="data_parallel", choices=["data_parallel", "zero1", "zero2"])
    parser.add_argument("--nproc-per-group", type=int, default=1, help="processes per replica group")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=False)
    jobs = Jobs(args.out, args.timeout)
    pairs = []
    try:
        for repeat in range(args.repeats):
            ddp = ddp_run(args, jobs, args.out / f"ddp{repeat}")
            ft = _median_step(ft_run(args, jobs, args.out / f"ft{repeat}")[0], args.warmup)
            pairs.append({"ddp_step_s": ddp, "ft_step_s": ft, "ratio": ft / ddp})
            print(json.dumps(pairs[-1]), flush=True)
        failure = None
        if args.kill_steps > 0:
            args.steps = args.kill_steps
            groups = ft_run(args, jobs, args.out / "failure", kill_at_step=args.kill_at_step)
            failure = failure_summary(groups, args.kill_at_step, args.global_batch)
    finally:
        jobs.close()
    summary = {
        "setting": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs) if pairs else None,
        "failure": failure,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
