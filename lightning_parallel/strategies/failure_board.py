"""Tell every rank when another rank's ``fit`` failed, so that no rank waits for a failed peer whose process lives on.

A rank whose ``fit`` raises outside a collective (in ``on_train_end``, in a callback of the last step) while its
process stays alive (a notebook kernel, a script that cleans up or retries, a debugger) keeps its connections open.
The other ranks, waiting for it in the next barrier or gather, would notice nothing until the process-group timeout
(30 minutes by default). Gloo cannot interrupt a collective that is already waiting: in torch 2.13
``ProcessGroup.abort`` and ``_abort_process_group`` only work for NCCL, and a gloo wait ends only when the peer closes
its sockets or the timeout passes (measured: an abort from another thread leaves the wait blocked). So a rank must
not *enter* such a collective with a failed peer:

* the failing rank publishes ``rank r failed: <error>`` under one key of the process group's store
  (:meth:`FailureBoard.publish`, called from the strategy's ``on_exception``; the first failure wins);
* every point where a rank may wait for a peer between training steps (Lightning's barriers, broadcasts and boolean
  reductions, the end of training, the pipeline's teardown gather) first meets the other ranks on the store
  (:meth:`FailureBoard.rendezvous`). It returns once every rank has arrived, and raises :class:`PeerFailedError`
  naming the rank as soon as the key appears, a peer's process on this host no longer exists, or a peer on another
  host stops its heartbeat.

Cost on the happy path: a few store operations at each of those points (none per step), and one thread per rank that
sleeps and bumps this rank's heartbeat counter every few seconds.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_parallel.strategies.failures import PeerTable

__all__ = ["FailureBoard", "PeerFailedError"]

HEARTBEAT_INTERVAL = 5.0
"""Seconds between two heartbeats of a rank (a thread that otherwise sleeps)."""
HEARTBEAT_STALE = 60.0
"""Seconds without a heartbeat after which a waiting rank declares a peer on another host gone. Generous, because the
heartbeat thread needs the GIL, which a long pickling (``torch.save`` of a large checkpoint) holds for a while."""
_CLOSED = 1 << 40  # added to a heartbeat counter when its rank closes its board: "stopped beating on purpose"
_FAILED_KEY = "failed"
_POLL_LIMIT = 0.02  # seconds between two polls of a rendezvous counter, at most
_CHECK_EVERY = 0.1  # seconds between two checks for a failed peer while waiting


class PeerFailedError(RuntimeError):
    """Another rank failed (or its process is gone) while this rank waited for it between collectives."""


class FailureBoard:
    """This rank's view of the failures of one run, kept in the process group's store.

    Created by every rank after the process group exists (the strategy's ``setup_environment``), closed at the
    strategy's ``teardown``; :meth:`rendezvous` and :meth:`failure` keep working after :meth:`close`.

    Args:
        store: the store of the default process group (the one Lightning's launch created).
        peers: where every rank runs, and the run's id (``record_peers``); keys are scoped to the run, so a second
            ``fit`` in the same process group never reads the first one's failure.
        global_rank, world_size: this rank and the number of ranks.
        timeout: how long a rendezvous may wait for the other ranks (the process-group timeout).
    """

    def __init__(
        self, store: dist.Store, *, peers: PeerTable, global_rank: int, world_size: int, timeout: timedelta
    ) -> None:
        self._store = dist.PrefixStore(f"lightning_parallel/{peers.run_id}/", store)
        self._peers = peers
        self.global_rank = global_rank
        self.world_size = world_size
        self.timeout = timeout
        self._rendezvous_count = 0
        self._remote_ranks = [r for r, host in enumerate(peers.hosts) if host != peers.hosts[global_rank]]
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if self._remote_ranks:  # only ranks on other hosts need a heartbeat: a local peer's pid tells more, at once
            self._store.add(_heartbeat_key(global_rank), 1)
            self._heartbeat = threading.Thread(
                target=_beat,
                args=(self._store, _heartbeat_key(global_rank), self._stop),
                name=f"lightning_parallel-heartbeat-{global_rank}",
                daemon=True,  # never keeps the interpreter alive; `close` stops it at teardown
            )
            self._heartbeat.start()

    # ------------------------------------------------------------------ publishing
    def publish(self, exception: BaseException) -> None:
        """Record that ``exception`` ended this rank's run, unless another rank's failure was recorded first."""
        message = str(exception).strip().splitlines()[0][:500] if str(exception).strip() else ""
        text = f"rank {self.global_rank} failed: {type(exception).__name__}" + (f": {message}" if message else "")
        try:
            self._store.compare_set(_FAILED_KEY, "", text)
        except dist.DistError:
            pass  # the store's host is gone: its peers notice that through their own connections

    def failure(self) -> str | None:
        """The first failure any rank published in this run (``"rank r failed: ..."``), or ``None``."""
        try:
            if not self._store.check([_FAILED_KEY]):
                return None
            return self._store.get(_FAILED_KEY).decode(errors="replace")
        except dist.DistError:
            return None

    def close(self) -> None:
        """Stop the heartbeat (and tell the other hosts it stopped on purpose). Idempotent."""
        if self._heartbeat is None or self._stop.is_set():
            return
        self._stop.set()
        self._heartbeat.join(timeout=10)
        try:
            self._store.add(_heartbeat_key(self.global_rank), _CLOSED)
        except dist.DistError:
            pass

    # ------------------------------------------------------------------ waiting
    def rendezvous(self, what: str) -> None:
        """Wait until every rank called ``rendezvous`` for the same point, watching for failed peers meanwhile.

        Every rank must call it in the same order (as with any collective). Raises :class:`PeerFailedError` naming
        the failed rank when one published a failure or is gone, and ``TimeoutError`` after :attr:`timeout`.
        """
        if self.world_size == 1:
            return
        self._rendezvous_count += 1
        key = f"rendezvous/{self._rendezvous_count}"
        self._count_up_and_wait(f"{key}/arrived", what)
        # Rank 0 usually hosts the store (Lightning's launch): it must not leave, and maybe exit and take the store
        # with it, while another rank still polls the counter above. So it also waits until every rank has seen it
        # complete; the others need the store no more for this point.
        # A rank may exit right after it counted itself out, while a slower one has yet to: `left_ranks` names who
        # counted, so that rank 0 takes only a rank gone *before* counting for a failed one.
        if self.global_rank == 0:
            self._count_up_and_wait(f"{key}/left", what, counted_ranks_key=f"{key}/left_ranks")
            for suffix in ("arrived", "left", "left_ranks"):
                self._store.delete_key(f"{key}/{suffix}")
        else:
            self._store.append(f"{key}/left_ranks", f"{self.global_rank},")  # type: ignore[attr-defined]  # not in the stubs
            self._store.add(f"{key}/left", 1)

    def _count_up_and_wait(self, key: str, what: str, *, counted_ranks_key: str | None = None) -> None:
        """Add one to ``key``, then poll it until it reaches the world size, checking for failed peers meanwhile.
        ``counted_ranks_key`` (optional) lists the ranks that counted themselves and may have exited since."""
        start = time.monotonic()
        count = self._store.add(key, 1)
        delay, next_check, next_heartbeat_check = 0.001, 0.0, start + HEARTBEAT_INTERVAL
        heartbeats: dict[int, tuple[int, float]] = {}
        while count < self.world_size:
            now = time.monotonic()
            try:
                if now >= next_check:
                    self._raise_if_a_peer_failed(what, counted_ranks_key)
                    next_check = now + _CHECK_EVERY
                if self._remote_ranks and now >= next_heartbeat_check:
                    self._raise_if_a_remote_peer_is_silent(what, heartbeats)
                    next_heartbeat_check = now + HEARTBEAT_INTERVAL
            except PeerFailedError:
                # A rank counts itself before it moves on, so one that got here and then exited (or failed later)
                # has counted already: read the counter again after the check, which is then conclusive.
                if self._store.add(key, 0) >= self.world_size:
                    return
                raise
            if now - start > self.timeout.total_seconds():
                raise TimeoutError(
                    f"Rank {self.global_rank} waited {self.timeout.total_seconds():g} s at {what} but only {count} of"
                    f" {self.world_size} ranks arrived (the process-group `timeout`); the others are stuck or slow."
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_LIMIT)
            count = self._store.add(key, 0)

    def _ranks_that_counted(self, counted_ranks_key: str | None) -> frozenset[int]:
        if counted_ranks_key is None or not self._store.check([counted_ranks_key]):
            return frozenset()
        return frozenset(int(rank) for rank in self._store.get(counted_ranks_key).decode().split(",") if rank)

    def _raise_if_a_peer_failed(self, what: str, counted_ranks_key: str | None = None) -> None:
        failure = self.failure()
        if failure is not None:
            raise PeerFailedError(
                f"Rank {self.global_rank}: {failure}. This rank stopped waiting for it at {what} (the failed rank's"
                " process may still be alive, so no collective would have noticed)."
            )
        dead = self._peers.dead_local_ranks()
        if dead and counted_ranks_key is not None:  # read only when needed: a store round-trip
            counted = self._ranks_that_counted(counted_ranks_key)
            dead = [rank for rank in dead if rank not in counted]
        if dead:
            raise PeerFailedError(
                f"Rank {self.global_rank}: rank(s) {dead} stopped (their processes"
                f" {[self._peers.pids[r] for r in dead]} no longer exist) while this rank waited for them at {what}."
            )

    def _raise_if_a_remote_peer_is_silent(self, what: str, heartbeats: dict[int, tuple[int, float]]) -> None:
        """Raise if a rank on another host has not bumped its heartbeat for ``HEARTBEAT_STALE`` seconds (a process
        on another host cannot be checked by pid). ``heartbeats`` holds each rank's last counter and since when."""
        now = time.monotonic()
        silent = []
        for rank in self._remote_ranks:
            count = self._store.add(_heartbeat_key(rank), 0)
            last = heartbeats.get(rank)
            if last is None or last[0] != count:
                heartbeats[rank] = (count, now)
            elif count < _CLOSED and now - last[1] >= HEARTBEAT_STALE:
                silent.append(rank)
        if silent:
            raise PeerFailedError(
                f"Rank {self.global_rank}: rank(s) {silent} on other hosts sent no heartbeat for {HEARTBEAT_STALE:g} s"
                f" while this rank waited for them at {what}: their processes stopped or froze; read their logs."
            )


def _heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def _beat(store: dist.Store, key: str, stop: threading.Event) -> None:
    """The heartbeat thread: bump ``key`` every ``HEARTBEAT_INTERVAL`` seconds until ``stop`` is set."""
    while not stop.wait(HEARTBEAT_INTERVAL):
        try:
            store.add(key, 1)
        except dist.DistError:
            return  # the store's host is gone; nothing left to tell
