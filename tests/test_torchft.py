"""Fault tolerance without restarts (issue 34): replica groups that meet through torchft's lighthouse.

The end-to-end tests act as the launcher of two replica groups (one or two processes each, gloo) and a lighthouse:
without failures the groups' weights equal one device's on the same global batch; a group SIGKILLed at a chosen
step leaves the other training, is restarted, and rejoins with its peer's weights; the run ends together. Every
process has a timeout, so a hang fails the test. The cheap tests check the configuration and that nothing imports
torchft unless a run uses it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from distributed_harness import find_free_port
from streamed_data import STREAMED_BATCH, STREAMED_SAMPLES
from torchft_worker import fit_reference, global_loss

from lightning_parallel.fault_tolerance import FaultTolerance

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "torchft_worker.py"
KILL_AT_STEP = 5
DEADLINE = 150.0  # seconds for the whole run; every wait below is bounded by it
# A dead group's heartbeat expires after 2 s; the lighthouse waits up to 5 s for a heartbeating straggler.
LIGHTHOUSE_TIMEOUTS = ("--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "2000")


def test_config_is_validated_at_the_edge() -> None:
    with pytest.raises(ValueError, match="replica_group=2"):
        FaultTolerance(replica_group=2, num_replica_groups=2)
    with pytest.raises(ValueError, match="min_replica_groups=3"):
        FaultTolerance(replica_group=0, num_replica_groups=2, min_replica_groups=3)
    with pytest.raises(ValueError, match="lighthouse='host:29510'"):
        FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse="host:29510")
    with pytest.raises(ValueError, match="timeout=0"):
        FaultTolerance(replica_group=0, num_replica_groups=1, timeout=0)
    with pytest.raises(TypeError, match="must be a `FaultTolerance"):
        from lightning_parallel import DataParallelStrategy

        DataParallelStrategy(fault_tolerance={"replica_group": 0})  # type: ignore[arg-type]


def test_cross_group_backend_follows_the_device() -> None:
    """NCCL across groups for a CUDA model (gloo would copy every step's gradients to the host and back), gloo on the
    CPU; an explicit choice is kept where it can run and refused, naming the fix, where it cannot."""
    from lightning_parallel.fault_tolerance.replica_sync import TORCHFT_PROCESS_GROUPS, cross_group_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert cross_group_backend("auto", cpu) == "gloo"
    assert cross_group_backend("auto", cuda) == "nccl"
    assert cross_group_backend("baby_nccl", cuda) == "baby_nccl"
    assert cross_group_backend("gloo", cuda) == "gloo"  # two groups sharing one GPU
    with pytest.raises(ValueError, match=r"cross_group_backend='nccl'\)` needs the model on a CUDA device.*'gloo'"):
        cross_group_backend("nccl", cpu)
    with pytest.raises(ValueError, match=r"cross_group_backend='mpi'` is invalid.*'baby_nccl'"):
        FaultTolerance(replica_group=0, num_replica_groups=1, cross_group_backend="mpi")  # type: ignore[arg-type]
    torchft = pytest.importorskip("torchft")
    assert all(hasattr(torchft, name) for name in TORCHFT_PROCESS_GROUPS.values())


def _state_reads_wait_for_the_step(rank: int, world_size: int) -> dict:
    """One replica group of one process with an in-process lighthouse: a peer's read of the state (what torchft's
    quorum thread calls to send a checkpoint) started after the commit returns only after the next step started,
    with what the optimizer step wrote, copied to the host."""
    import threading

    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    from lightning_parallel.fault_tolerance.replica_sync import ReplicaGroupSync

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    weight = torch.zeros(3)
    config = FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse=lighthouse.address(), timeout=20)
    sync = ReplicaGroupSync(
        config,
        group_rank=0,
        group_world_size=1,
        store_host="127.0.0.1",
        store_port=store.port,
        state_dict=lambda: {"w": weight},
        load_state_dict=lambda state: None,
    )
    try:
        sync.start_step()
        sync.average_gradients([torch.ones(3)])
        committed = sync.should_commit()
        sent: dict = {}
        reader = threading.Thread(target=lambda: sent.update(sync.manager._manager_state_dict()["user"]["default"]))
        reader.start()
        weight.add_(1)  # the optimizer step, after the commit
        sync.start_step()
        reader.join(30)
        return {
            "backend": sync.backend,
            "committed": committed,
            "sent": sent["w"].tolist(),
            "copied": sent["w"].data_ptr() != weight.data_ptr(),
        }
    finally:
        sync.shutdown()
        lighthouse.shutdown()


def test_a_peer_reads_the_state_only_between_steps() -> None:
    """torchft's `allow/disallow_state_dict_read` around the optimizer step (issue 42): a read that arrives after the
    commit waits for the step and sends what it wrote, as a host copy (not the live tensor the next step changes)."""
    pytest.importorskip("torchft")
    from distributed_harness import run_distributed

    [result] = run_distributed(_state_reads_wait_for_the_step, 1, init_process_group=False, timeout=90)
    assert result == {"backend": "gloo", "committed": True, "sent": [1.0, 1.0, 1.0], "copied": True}


def test_torchft_is_imported_only_by_a_fault_tolerant_run() -> None:
    """Building the strategy with the mode imports nothing of torchft; without torchft, a run says how to get it."""
    code = (
        "import sys\n"
        "import lightning_parallel\n"
        "from lightning_parallel import DataParallelStrategy, ShardedOptimizerStrategy\n"
        "from lightning_parallel.fault_tolerance import FaultTolerance\n"
        "DataParallelStrategy(fault_tolerance=FaultTolerance(replica_group=0, num_replica_groups=2))\n"
        "ShardedOptimizerStrategy(2, fault_tolerance=FaultTolerance(replica_group=0, num_replica_groups=2))\n"
        "assert not any(name.split('.')[0] == 'torchft' for name in sys.modules), 'torchft imported'\n"
        "sys.modules['torchft'] = None  # as if not installed\n"
        "from lightning_parallel.fault_tolerance.replica_sync import import_torchft\n"
        "try:\n"
        "    import_torchft()\n"
        "except ModuleNotFoundError as error:\n"
        "    assert 'lightning-parallel[torchft]' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


class _Run:
    """The test as launcher: a lighthouse and replica-group processes, all killed at the end."""

    def __init__(self, out: Path) -> None:
        self.out, self.processes, self.start = out, [], time.monotonic()
        port = find_free_port()
        lighthouse = Path(sys.executable).parent / "torchft_lighthouse"
        self.address = f"http://127.0.0.1:{port}"
        self._spawn(
            [str(lighthouse), "--min_replicas", "1", "--bind", f"[::]:{port}", *LIGHTHOUSE_TIMEOUTS],
            out / "lighthouse.log",
        )

    def _spawn(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        process = subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.processes.append(process)
        return process

    def group(self, group: int, out: Path, *extra: str) -> subprocess.Popen:
        out.mkdir(exist_ok=True)
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.address, "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=str(find_free_port()), RUST_LOG="warn", PYTHONPATH=str(ROOT))
        command = [sys.executable, str(WORKER), "--out", str(out), "--group", str(group), "--groups", "2"]
        command += ["--steps", "1000", "--stop-file", str(self.out / "stop"), "--pace", "0.05", *extra]
        return self._spawn(command, out / f"log{group}", env)

    def remaining(self) -> float:
        left = DEADLINE - (time.monotonic() - self.start)
        assert left > 0, f"the run took longer than {DEADLINE} s:\n{self.logs()}"
        return left

    def wait_for(self, condition, what: str) -> None:
        while not condition():
            if self.remaining() < 1:
                raise AssertionError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def finish_together(
        self, processes: tuple[subprocess.Popen, ...], *, last_step: Callable[[], int], extra: int
    ) -> None:
        """Have every group stop at the same step (``extra`` after the last one seen) and wait for them to exit."""
        (self.out / "stop").write_text(str(last_step() + extra))
        for process in processes:
            process.wait(timeout=self.remaining())
            assert process.returncode == 0, self.logs()

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text()[-2500:]}" for p in sorted(self.out.rglob("log*")))

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_step(*paths: Path) -> int:
    return max(r["step"] for path in paths for r in _records(path))


def _fit_two_groups(out: Path, *extra: str) -> list[list[dict]]:
    """Two replica groups of one process with the worker's options ``extra``, run to their end; each group's records."""
    run = _Run(out)
    try:
        groups = [run.group(group, out, *extra) for group in range(2)]
        for process in groups:
            process.wait(timeout=run.remaining())
            assert process.returncode == 0, run.logs()
    finally:
        run.close()
    return [_records(out / f"group{group}.jsonl") for group in range(2)]


def _assert_survived_and_rejoined(
    first: list[dict], victim_last: dict, again: list[dict], reference: torch.Tensor, *, min_joined: int, rank: int = 0
) -> None:
    """One rank's records around a replica group killed in the step after ``KILL_AT_STEP``: ``first`` the survivor's,
    ``victim_last`` the victim's last before the kill, ``again`` the restarted victim's; ``reference`` one device's
    weights after ``KILL_AT_STEP`` steps."""
    by_step: dict[int, dict] = {}
    for record in first:
        by_step.setdefault(record["step"], record)
    # Without failures: both groups hold one device's weights after the same steps (fp32 rounding).
    for record in (by_step[KILL_AT_STEP], victim_last):
        assert record["participants"] == 2
        torch.testing.assert_close(torch.tensor(record["weights"]), reference, rtol=1e-5, atol=1e-6)
    # The step the victim died in did not commit: the survivor's weights and step count stayed as they were (its
    # record repeats once), then it trained alone until the restarted group joined.
    steps = [r["step"] for r in first]
    repeats = [a for a, b in itertools.pairwise(first) if a["step"] == b["step"]]
    assert [r["step"] for r in repeats] == [KILL_AT_STEP], steps
    assert first[steps.index(KILL_AT_STEP) + 1]["weights"] == repeats[0]["weights"]
    assert sorted(set(steps)) == list(range(1, steps[-1] + 1))  # nothing else lost or repeated
    assert any(r["participants"] == 1 for r in first), "the survivor never trained alone"
    # The restarted group rejoined with the survivor's weights, equal at every step since (bit for bit), to the last.
    joined = [r for r in again if r["participants"] == 2]
    assert len(joined) >= min_joined
    for record in joined:
        assert record["weights"] == by_step[record["step"]]["weights"], (rank, record["step"])
    assert again[-1]["step"] == first[-1]["step"]


def test_a_killed_replica_group_leaves_the_others_training_and_rejoins(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    run = _Run(tmp_path)
    try:
        survivor = run.group(0, tmp_path / "first")
        victim = run.group(1, tmp_path / "first", "--kill-at-step", str(KILL_AT_STEP))
        victim.wait(timeout=run.remaining())
        assert victim.returncode == -9, run.logs()
        restarted = run.group(1, tmp_path / "restarted")  # the test is the group's launcher: start it again

        rejoined = tmp_path / "restarted" / "group1.jsonl"
        run.wait_for(lambda: sum(r["participants"] == 2 for r in _records(rejoined)) >= 3, "the restarted group")
        seen = (tmp_path / "first" / "group0.jsonl", rejoined)
        run.finish_together((survivor, restarted), last_step=lambda: _last_step(*seen), extra=3)
    finally:
        run.close()

    first = _records(tmp_path / "first" / "group0.jsonl")
    killed = _records(tmp_path / "first" / "group1.jsonl")
    assert [r["step"] for r in killed] == list(range(1, KILL_AT_STEP + 1))
    reference = torch.nn.utils.parameters_to_vector(fit_reference(KILL_AT_STEP).parameters()).detach()
    _assert_survived_and_rejoined(first, killed[-1], _records(rejoined), reference, min_joined=3)
    # How long the survivor waited around the kill is wall-clock, not asserted here: measured by
    # benchmarks/torchft_overhead.py (2-3 s, the dead group's 2 s heartbeat expiry; docs/reliability.md).

    # The run finished, with a loss on the global batch within noise of an uninterrupted run of as many steps.
    final = global_loss(first[-1]["weights"])
    uninterrupted = global_loss(
        torch.nn.utils.parameters_to_vector(fit_reference(first[-1]["step"]).parameters()).tolist()
    )
    assert abs(final - uninterrupted) < 0.05, (final, uninterrupted)


def test_groups_of_two_processes_train_like_one_device(tmp_path: Path) -> None:
    """Two replica groups of two processes each (DDP inside a group, torchft across): one device's weights."""
    pytest.importorskip("torchft")
    run = _Run(tmp_path)
    try:
        groups = [run.group(group, tmp_path, "--devices", "2", "--steps", "4") for group in range(2)]
        for process in groups:
            process.wait(timeout=run.remaining())
            assert process.returncode == 0, run.logs()
    finally:
        run.close()
    reference = torch.nn.utils.parameters_to_vector(fit_reference(4).parameters()).detach()
    for group in range(2):
        records = _records(tmp_path / f"group{group}.jsonl")  # both ranks of the group write here
        assert sorted(r["step"] for r in records) == [1, 1, 2, 2, 3, 3, 4, 4]
        assert all(r["participants"] == 2 for r in records)
        for record in records:
            if record["step"] == 4:
                torch.testing.assert_close(torch.tensor(record["weights"]), reference, rtol=1e-5, atol=1e-6)


def test_bf16_true_groups_start_together_and_train_alike(tmp_path: Path) -> None:
    """`bf16-true` (issue 42): the start-up exchange sends bf16 parameters from group 0 and bf16 zeros from group 1
    (the same bytes; fp32 zeros made the sizes differ), then the groups train with equal weights, bit for bit, near
    one device's bf16 run."""
    pytest.importorskip("torchft")
    records = _fit_two_groups(tmp_path, "--steps", "3", "--pace", "0", "--precision", "bf16-true")
    for group in range(2):
        assert [(r["step"], r["participants"]) for r in records[group]] == [(1, 2), (2, 2), (3, 2)]
    assert [r["weights"] for r in records[0]] == [r["weights"] for r in records[1]]
    model = fit_reference(3, precision="bf16-true")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = torch.nn.utils.parameters_to_vector(model.parameters()).detach().float()
    torch.testing.assert_close(torch.tensor(records[0][-1]["weights"]), reference, rtol=0, atol=2e-2)


def test_replica_groups_read_disjoint_shares_of_streamed_data(tmp_path: Path, streamed_chunks: Path) -> None:
    """Issue 43: each group is its own torch.distributed job of one process, so LitData's ``StreamingDataset`` and
    ``split_dataset_by_node(rank=dist.get_rank(), ...)`` would have both groups read all 16 samples. With the
    strategy telling LitData the data-parallel rank, and the documented line for Hugging Face, one epoch of the two
    groups reads every sample exactly once per library (16 = 2 groups x 2 steps x 4: nothing dropped), in steps that
    commit together."""
    pytest.importorskip("torchft")
    records = _fit_two_groups(tmp_path, "--steps", "100", "--pace", "0", "--data", str(streamed_chunks))
    steps = STREAMED_SAMPLES // (2 * STREAMED_BATCH)
    for group in range(2):
        assert [(r["step"], r["participants"]) for r in records[group]] == [(s, 2) for s in range(1, steps + 1)]
    assert records[0][-1]["weights"] == records[1][-1]["weights"]
    for library in ("litdata", "hf"):
        read = [[i for r in records[group] for i in r["indices"][library]] for group in range(2)]
        assert not set(read[0]) & set(read[1]), (library, read)
        assert sorted(read[0] + read[1]) == list(range(STREAMED_SAMPLES)), (library, read)


def test_hybrid_sharding_is_validated_at_the_edge() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_parallel import ShardedOptimizerStrategy

    config = FaultTolerance(replica_group=0, num_replica_groups=2)
    with pytest.raises(ValueError, match=r"stage=3.*`stage=1` or `stage=2`.*DataParallelStrategy"):
        ShardedOptimizerStrategy(3, fault_tolerance=config)
    environment = LightningEnvironment()
    environment.set_world_size(4)  # a job of four processes (the Trainer's `devices` x `num_nodes`)
    strategy = ShardedOptimizerStrategy(2, shard_size=2, fault_tolerance=config, cluster_environment=environment)
    with pytest.raises(ValueError, match=r"`shard_size=2` must equal the replica group's process count \(4\)"):
        strategy.mesh_layout  # noqa: B018 (read by `setup_environment` before joining the group)
    environment.set_world_size(1)
    with pytest.raises(ValueError, match=r"one process.*DataParallelStrategy"):
        strategy.mesh_layout  # noqa: B018


def _zero_records(path: Path, rank: int = 0) -> list[dict]:
    return [record for record in _records(path) if record["rank"] == rank]


def test_hybrid_sharding_across_replica_groups_trains_like_one_device(tmp_path: Path) -> None:
    """Two replica groups of two processes each, ZeRO-1 inside a group (shard_size=2), torchft across groups (ZeRO-2:
    the steps before the kill in the next test). Then group 1's loss is NaN for one step: it sends zero shards and
    steps with group 0's, so the groups' weights stay equal and finite."""
    pytest.importorskip("torchft")
    run = _Run(tmp_path)
    try:
        extra = ("--devices", "2", "--steps", "4", "--zero", "1", "--pace", "0")
        groups = [run.group(group, tmp_path, *extra, *(("--nan-at-step", "3") if group else ())) for group in range(2)]
        for process in groups:
            process.wait(timeout=run.remaining())
            assert process.returncode == 0, run.logs()
    finally:
        run.close()
    reference = torch.nn.utils.parameters_to_vector(fit_reference(3).parameters()).detach()
    records = [_records(tmp_path / f"group{group}.jsonl") for group in range(2)]  # both ranks of a group write
    for group in range(2):
        assert sorted((r["step"], r["rank"]) for r in records[group]) == [(s, r) for s in range(1, 5) for r in (0, 1)]
        assert all(r["participants"] == 2 for r in records[group])
        for record in records[group]:
            if record["step"] == 3:
                torch.testing.assert_close(torch.tensor(record["weights"]), reference, rtol=1e-5, atol=1e-6)
    assert any(r["loss"] != r["loss"] for r in records[1])  # the NaN step happened
    after = [{r["rank"]: r["weights"] for r in records[group] if r["step"] == 4} for group in range(2)]
    assert after[0] == after[1]
    assert all(torch.isfinite(torch.tensor(weights)).all() for weights in after[1].values())
    assert after[0][0] != torch.nn.utils.parameters_to_vector(fit_reference(4).parameters()).tolist()


def test_hybrid_sharding_survives_a_killed_replica_group(tmp_path: Path) -> None:
    """ZeRO-2 over two processes per group: one group SIGKILLed before its backward at a chosen step (both of its
    ranks), the other keeps training; the restarted group resumes from its own older checkpoint (as under torchrun),
    then its ranks heal their shards from the survivor's same ranks, and its gathered weights equal the survivor's
    from then on."""
    pytest.importorskip("torchft")
    run = _Run(tmp_path)
    zero = ("--devices", "2", "--zero", "2")
    checkpoints = ("--ckpt-dir", str(tmp_path / "group1_checkpoints"))
    try:
        survivor = run.group(0, tmp_path / "first", *zero)
        victim = run.group(1, tmp_path / "first", *zero, *checkpoints, "--kill-at-step", str(KILL_AT_STEP))
        victim.wait(timeout=run.remaining())
        assert victim.returncode == -9, run.logs()
        assert (tmp_path / "group1_checkpoints" / "last.ckpt").exists()  # from before the kill: older than the peer
        restarted = run.group(1, tmp_path / "restarted", *zero, *checkpoints)

        rejoined = tmp_path / "restarted" / "group1.jsonl"
        run.wait_for(lambda: sum(r["participants"] == 2 for r in _zero_records(rejoined)) >= 2, "the restarted group")
        seen = (tmp_path / "first" / "group0.jsonl", rejoined)
        run.finish_together((survivor, restarted), last_step=lambda: _last_step(*seen), extra=2)
    finally:
        run.close()

    killed = _zero_records(tmp_path / "first" / "group1.jsonl")
    assert [r["step"] for r in killed] == list(range(1, KILL_AT_STEP + 1))  # killed in the step after these
    reference = torch.nn.utils.parameters_to_vector(fit_reference(KILL_AT_STEP).parameters()).detach()
    for rank in (0, 1):
        # The restarted group's rank healed its shard from the survivor's same rank; after the group's all-gather
        # its whole weights equal the survivor's at every step since.
        _assert_survived_and_rejoined(
            _zero_records(tmp_path / "first" / "group0.jsonl", rank),
            _zero_records(tmp_path / "first" / "group1.jsonl", rank)[-1],
            _zero_records(rejoined, rank),
            reference,
            min_joined=2,
            rank=rank,
        )


def _heal_shards(rank: int, world_size: int) -> dict:
    """Two sets of bf16 buckets with fp32 masters on the same two ranks: the "live" one trains a step, the
    "restarted" one (other weights, no optimizer state) loads each rank's shard state from it, then settles."""
    from lightning_parallel.distributed.zero.buckets import ShardedParameterBuckets
    from lightning_parallel.distributed.zero.optimizer import ShardedOptimizer
    from lightning_parallel.fault_tolerance.shard_state import OwnedShardState

    torch.set_num_threads(1)

    def build(seed: int) -> tuple[torch.nn.Module, ShardedParameterBuckets, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3)).bfloat16()
        buckets = ShardedParameterBuckets(module, stage=2, master_dtype=torch.float32, bucket_cap_mb=64 / 2**20)
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
        ShardedOptimizer(optimizer, buckets)
        return module, buckets, optimizer

    live, live_buckets, live_optimizer = build(0)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank)).bfloat16()
    live(x).float().square().mean().backward()
    live_buckets.finish_gradient_sync()
    live_optimizer.step()
    live_buckets.all_gather_parameters()
    sent = OwnedShardState(live_buckets, live, live_optimizer).state_dict()

    restarted, buckets, optimizer = build(1)
    differed = not torch.equal(live[0].weight, restarted[0].weight)
    state = OwnedShardState(buckets, restarted, optimizer)
    state.load_state_dict(sent)
    state.settle()  # each rank loaded only its shard: the group all-gathers the rest
    mismatch = ""
    try:
        state.load_state_dict({**sent, "layout": [world_size, 1]})
    except RuntimeError as error:
        mismatch = str(error)
    return {
        "weights_equal": all(
            torch.equal(a, b) for a, b in zip(live.state_dict().values(), restarted.state_dict().values(), strict=True)
        ),
        "masters_equal": all(
            torch.equal(a.master, b.master) for a, b in zip(live_buckets.buckets, buckets.buckets, strict=True)
        ),
        "state_equal": all(
            torch.equal(live_optimizer.state[a]["exp_avg_sq"], optimizer.state[b]["exp_avg_sq"])
            for a, b in zip(live_optimizer.param_groups[0]["params"], optimizer.param_groups[0]["params"], strict=True)
        ),
        "mismatch": mismatch,
        "differed": differed,
    }


def test_a_healing_rank_takes_over_its_shard_of_a_live_rank() -> None:
    """bf16 parameters with fp32 masters (the masters travel, not the rounded weights), buffers, sharded AdamW state;
    a different layout is refused naming the settings that must agree."""
    from distributed_harness import run_distributed

    results = run_distributed(_heal_shards, 2)
    assert len(results) == 2
    for result in results:
        assert result["differed"] and result["weights_equal"] and result["masters_equal"] and result["state_equal"], (
            result
        )
        assert "shards differently" in result["mismatch"] and "bucket_cap_mb" in result["mismatch"]


# Groups configured differently (issue 44): each case as a user started it, the three runs side by side (own
# lighthouse each). Every process must stop with the error naming the difference, before any step.
MISMATCHES = {
    "width": ((), ("--width", "16"), ["parameter `net.0.weight` has shape (32, 12) in replica group 0 and (16, 12)"]),
    "shard_size": (
        ("--zero", "2", "--devices", "2"),
        ("--zero", "2", "--devices", "3"),
        ["`processes_per_group` is 2 in replica group 0, 3 in replica group 1", "`shard_size` is 2 in replica group 0"],
    ),
    "precision": (
        (),
        ("--precision", "bf16-true"),
        ["`precision` is '32-true' in replica group 0, 'bf16-true' in replica group 1", "dtype float32"],
    ),
}


def test_replica_groups_configured_differently_refuse_together(tmp_path: Path) -> None:
    """Before: widths differing aborted one group in gloo (exit -6) and shard_size 2 vs 3 timed one out with a nameless
    `TimeoutError`, while the other trained alone and exited 0. Now every process of both groups raises
    `ReplicaGroupMismatchError` naming the difference (the third process of the 3-process group, which has no peer in
    the other group, learns it from its own group), and no group records a step."""
    pytest.importorskip("torchft")
    runs: dict[str, tuple[_Run, list[subprocess.Popen]]] = {}
    try:
        for case, (first, second) in ((case, spec[:2]) for case, spec in MISMATCHES.items()):
            out = tmp_path / case
            out.mkdir()
            run = _Run(out)
            common = ("--steps", "3", "--pace", "0", "--timeout", "10")
            runs[case] = (run, [run.group(g, out, *common, *extra) for g, extra in enumerate((first, second))])
        for run, processes in runs.values():
            for process in processes:
                process.wait(timeout=run.remaining())
    finally:
        for run, _ in runs.values():
            run.close()
    for case, (run, processes) in runs.items():
        logs = run.logs()
        assert [p.returncode for p in processes] == [1, 1], (case, logs)
        for group in range(2):
            log = (tmp_path / case / f"log{group}").read_text()
            processes_in_group = 3 if case == "shard_size" and group == 1 else (2 if case == "shard_size" else 1)
            # Each of the group's processes (one log) raised it.
            raised = log.count("ReplicaGroupMismatchError: FaultTolerance: the replica groups that met")
            assert raised == processes_in_group, (case, group, raised, log[-3000:])
            for expected in MISMATCHES[case][2]:
                assert expected in log, (case, group, expected, log[-3000:])
            assert _records(tmp_path / case / f"group{group}.jsonl") == [], (case, group)  # no step trained


def _compare_three_groups(rank: int, world_size: int) -> list:
    """Three ranks of a plain gloo group play three replica groups meeting in one quorum (torch-only, no torchft)."""
    import torch.distributed as dist

    from lightning_parallel.fault_tolerance.agreement import GroupDescription, compare_descriptions

    def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        dist.all_reduce(tensor, op=op)

    def layout(width: int, precision: str = "32-true") -> GroupDescription:
        module = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
        return GroupDescription.of(
            module,
            replica_group=rank,
            strategy="DataParallelStrategy",
            processes_per_group=1,
            precision=precision,
            num_replica_groups=3,
        )

    def compare(mine: GroupDescription, counts: bool) -> tuple[str | None, bool]:
        return compare_descriptions(mine, counts=counts, rank=rank, size=3, all_reduce=all_reduce)

    return [
        compare(layout(8), True),  # all alike: nothing more is exchanged
        compare(layout(8 if rank < 2 else 16), rank < 2),  # group 2 heals with another width: only it stops
        compare(layout(8, "bf16-mixed" if rank == 1 else "32-true"), True),  # groups that count disagree: all stop
    ]


def test_layout_comparison_stops_the_groups_that_differ() -> None:
    """The comparison itself, over three ranks of a plain gloo group: groups alike exchange one fixed-size summary and
    go on; a healing group unlike the live ones is refused while they go on (warned); groups that both count and
    disagree are all refused; every message names the field and each group's value."""
    from distributed_harness import run_distributed

    results = run_distributed(_compare_three_groups, 3)
    assert [result[0] for result in results] == [(None, False)] * 3
    healing = [result[1] for result in results]
    assert [refused for _, refused in healing] == [False, False, True]
    assert {message for message, _ in healing} == {healing[0][0]}  # the same message on every group
    assert "parameter `0.weight` has shape (8, 4) in replica group 0 and (16, 4) in replica group 2" in healing[0][0]
    starting = [result[2] for result in results]
    assert [refused for _, refused in starting] == [True, True, True]
    assert (
        "`precision` is '32-true' in replica group 0, 'bf16-mixed' in replica group 1, '32-true' in replica group 2"
        in starting[0][0]
    )
    assert "parameter" not in starting[0][0]  # only what differs is named


def test_a_mismatch_names_parameters_by_name_and_count() -> None:
    from lightning_parallel.fault_tolerance.agreement import GroupDescription, describe_mismatch

    def layout(group: int, module: torch.nn.Module) -> GroupDescription:
        return GroupDescription.of(
            module,
            replica_group=group,
            strategy="DataParallelStrategy",
            processes_per_group=1,
            precision="32-true",
            num_replica_groups=2,
        )

    one, two = torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Linear(3, 3))
    assert "trainable parameter #0 is `weight` in replica group 0 and `0.weight` in replica group 1" in (
        describe_mismatch([layout(1, two), layout(0, one)])
    )
    assert "replica group 0 has 2 trainable parameters and replica group 1 has 1" in describe_mismatch(
        [layout(0, one), layout(1, torch.nn.Linear(3, 3, bias=False))]
    )
