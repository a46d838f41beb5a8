"""``ReplicaGroupSync``: one replica group's side of torchft's per-step protocol, torch-only (no Lightning).

Each step: :meth:`start_step` asks the lighthouse (through the group's torchft ``Manager``) for the quorum of groups
alive, in the background while forward and backward run; :meth:`average_gradients` all-reduces this rank's gradients
with the same rank of every other group in the quorum (one flat buffer, divided by the number of groups taking
part); :meth:`should_commit` says whether the optimizer may step (every group of the quorum finished the step without
an error). A group joining a run already under way is "healing": its gradients count as zeros, and before
:meth:`should_commit` returns it loads the state a live group sent (``load_state_dict``), so its next optimizer step
starts from the peers' weights.

What a healing group receives is read on torchft's quorum thread while this group trains. Reads are allowed from
:meth:`ReplicaGroupSync.start_step` until :meth:`ReplicaGroupSync.should_commit` returns (torchft's
``allow_state_dict_read`` / ``disallow_state_dict_read``, as its ``LocalSGD`` brackets the optimizer step), so the
optimizer step, the parameter all-gather after it and anything else between two steps never runs beside a read; on
an accelerator the read first waits for an event recorded at :meth:`~ReplicaGroupSync.start_step` (the host returns
from the optimizer step before the device finished it), then copies every tensor to the host under the lock.

torchft is imported here only, when a ``ReplicaGroupSync`` is built.
"""

from __future__ import annotations

import importlib
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import AllreduceOptions, ReduceOp

from lightning_parallel.fault_tolerance.agreement import (
    GroupDescription,
    ReplicaGroupMismatchError,
    compare_descriptions,
)
from lightning_parallel.fault_tolerance.config import CrossGroupBackend, FaultTolerance
from lightning_parallel.fault_tolerance.lighthouse import wait_for_lighthouse

__all__ = ["ReplicaGroupSync", "cross_group_backend", "import_torchft"]

TORCHFT_PROCESS_GROUPS = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL", "baby_nccl": "ProcessGroupBabyNCCL"}
"""torchft's reconfigurable process group of each resolved ``FaultTolerance.cross_group_backend``."""

TORCHFT_MISSING = (
    "`FaultTolerance` needs torchft: `pip install 'lightning-parallel[torchft]'` (or `pip install torchft==0.2.0`)."
)


class _WaitingForGroups(RuntimeError):
    """Reported to torchft so that a start-up round (no training) never commits."""


def import_torchft() -> Any:
    """The ``torchft`` module, or ``ModuleNotFoundError`` saying how to install it."""
    try:
        return importlib.import_module("torchft")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(TORCHFT_MISSING) from error


def cross_group_backend(choice: CrossGroupBackend, device: torch.device) -> str:
    """The cross-group process group for ``FaultTolerance(cross_group_backend=choice)`` and a model on ``device``:
    ``"auto"`` is ``"nccl"`` on CUDA and ``"gloo"`` elsewhere; NCCL on a CPU model raises ``ValueError``."""
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice != "gloo" and device.type != "cuda":
        raise ValueError(
            f"`FaultTolerance(cross_group_backend={choice!r})` needs the model on a CUDA device; it is on {device}."
            " Use `cross_group_backend='gloo'` (or 'auto') on the CPU."
        )
    return choice


class ReplicaGroupSync:
    """This rank's torchft ``Manager`` and the per-step calls the strategy makes on it.

    Args:
        config: the run's :class:`FaultTolerance`.
        group_rank, group_world_size: this rank and the number of ranks inside its replica group.
        store_host, store_port: the group's own ``TCPStore`` (its ``MASTER_ADDR``/``MASTER_PORT``), already running.
        state_dict: returns what a healing group needs (weights, optimizer state, step), may be references to the
            live tensors: it is called on a torchft thread while this group sends it to a peer, only between
            :meth:`start_step` and :meth:`should_commit`, and its tensors are copied to the host before the lock is
            released.
        load_state_dict: loads it, on this (the training) thread, inside :meth:`should_commit`.
        device: where the model is (``None``: the CPU): picks the cross-group process group
            (``config.cross_group_backend``) and, off the CPU, the stream whose work a read waits for.
        description: what this group compares with the other groups of every new quorum before its first cross-group
            collective of parameters or gradients (:mod:`~lightning_parallel.fault_tolerance.agreement`); ``None``:
            nothing is compared.
    """

    def __init__(
        self,
        config: FaultTolerance,
        *,
        group_rank: int,
        group_world_size: int,
        store_host: str,
        store_port: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        device: torch.device | None = None,
        description: GroupDescription | None = None,
    ) -> None:
        device = device if device is not None else torch.device("cpu")
        backend = cross_group_backend(config.cross_group_backend, device)  # local: raises before torchft starts
        torchft = import_torchft()
        wait_for_lighthouse(config)  # torchft's own connect error names neither `FaultTolerance` nor the setting
        self.config = config
        self.device = device
        self.backend = backend
        self._state_dict = state_dict
        self._written: Any = None  # an event after this group's last writes (accelerators), recorded at `start_step`
        self.description = description
        self.group_rank = group_rank
        self._checked = 0  # the process group's configuration whose groups compared their descriptions
        timeout = timedelta(seconds=config.timeout)
        self.process_group = _counting(getattr(torchft, TORCHFT_PROCESS_GROUPS[backend]))(timeout=timeout)
        self.manager = torchft.Manager(
            pg=self.process_group,
            load_state_dict=load_state_dict,
            state_dict=self._host_copy,
            min_replica_size=config.min_replica_groups,
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout),
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_world_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=config.lighthouse_address(),
            replica_id=f"replica_group_{config.replica_group}",
            # start_together gives every group the first group's weights itself (`wait_for_groups`); torchft's
            # init_sync would also heal at the first real step, dropping the other groups' first gradients.
            init_sync=not config.start_together,
        )
        self.steps_committed = 0
        self.steps_given_up = 0

    @property
    def step(self) -> int:
        """The number of steps committed by this run's quorum so far (torchft's step; a healed group takes its
        peer's)."""
        return int(self.manager.current_step())

    def start_step(self) -> None:
        """Local (starts the background quorum). Call once per optimizer step, before forward: from here until
        :meth:`should_commit` returns, a peer may read this group's state."""
        if self.device.type != "cpu":  # the last optimizer step (and all-gather) may still run on the device
            self._written = torch.accelerator.current_stream(self.device).record_event()
        self.manager.allow_state_dict_read()  # before the quorum: its thread may wait for the lock
        self.manager.start_quorum()

    def average_gradients(self, gradients: Sequence[Tensor]) -> None:
        """Cross-group collective: replace ``gradients`` by their average over the groups in this step's quorum
        (zeros from a healing group, which does not count). On a failed peer the values are unusable and
        :meth:`should_commit` answers ``False``."""
        if not gradients:
            return
        self.check_descriptions()
        flat = _flatten(gradients)
        self.manager.allreduce(flat).wait()
        _copy_into(gradients, flat)

    def average_shards(self, shards: Sequence[Tensor], used: Tensor | None) -> None:
        """Cross-group collective (hybrid sharding: this rank's manager meets the same rank of every other group):
        replace ``shards`` (this rank's reduced gradient shards) by their average over the groups in this step's
        quorum, one flat all-reduce per dtype, and ``used`` (``uint8`` flags) by 1 where any group's is. A healing
        group sends zeros, as in :meth:`average_gradients`."""
        self.check_descriptions()
        flags = used.to(torch.float32) if used is not None else None
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for tensor in [*shards, *([flags] if flags is not None else [])]:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        pending = []
        for tensors in by_dtype.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
            pending.append((tensors, flat, self.manager.allreduce(flat)))
        for tensors, flat, work in pending:
            work.wait()
            _copy_into(tensors, flat)
        if used is not None and flags is not None:
            used.copy_(flags > 0)

    def should_commit(self) -> bool:
        """Collective within the group: whether the optimizer may step. A healing group loads its peer's state here
        first (``load_state_dict``)."""
        committed = bool(self.manager.should_commit())
        self.manager.disallow_state_dict_read()  # the optimizer steps next: waits for a read in progress
        if committed:
            self.steps_committed += 1
        else:
            self.steps_given_up += 1
        return committed

    def num_participants(self) -> int:
        """Groups whose gradients the last step averaged."""
        return int(self.manager.num_participants())

    def wait_for_groups(
        self,
        parameters: Sequence[Tensor],
        *,
        step_collective: Callable[[], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Before the first step, with ``config.start_together``: take part in quorums without training (rounds that
        never commit) until all ``num_replica_groups`` groups are in one, then give every group the ``parameters``
        of the quorum's first group (a sum in which the others send zeros: exact); or until the run turns out to be
        under way already (a restarted group: it healed from a peer in the round). Raises ``TimeoutError`` after
        ``config.join_timeout`` seconds, naming how many groups came.

        In a round where this group heals, the live groups are in a training step: it then issues that step's
        cross-group collective with zeros, ``step_collective`` (``None``: one all-reduce of as many elements as
        ``parameters``, which is what a data-parallel step sends)."""
        deadline = time.monotonic() + self.config.join_timeout
        expected = self.config.num_replica_groups
        while True:
            self.manager.start_quorum()
            message, refused = self._compare_descriptions()  # before anything sized by the layout crosses the groups
            present = self.num_participants()
            starting = self.step == 0 and present >= expected
            healing = not self.manager.is_participating()
            if refused:
                pass
            elif healing and step_collective is not None:
                step_collective()
            else:
                # The parameters' own dtype on every group (bf16 under `bf16-true`): the first group's values, the
                # others' zeros, the same bytes (a data-parallel step sends gradients of the same dtype).
                flat = _flatten(parameters)
                if not (starting and self.manager.participating_rank() == 0):
                    flat.zero_()
                self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
                if starting and self.manager.errored() is None:  # a failed exchange left zeros or a part sum
                    _copy_into([parameter.detach() for parameter in parameters], flat)
            # Every rank of the group decides alike: refused if any rank was (a rank with no peer in the other
            # groups learns why here), started only if every rank's exchange went through.
            exchanged = self._agree_in_group(message, refused, exchanged=self.manager.errored() is None)
            starting = starting and exchanged
            self.manager.report_error(_WaitingForGroups("waiting for the other replica groups"))
            self.manager.should_commit()  # False; a healing group loads its peer's state here
            if starting or self.step > 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"FaultTolerance(start_together=True): after {self.config.join_timeout:g} s only {present} of"
                    f" num_replica_groups={expected} replica groups met at the lighthouse"
                    f" {self.config.lighthouse_address()}. Start the other groups' jobs, lower `num_replica_groups`,"
                    " or pass `start_together=False` to train with whichever groups are there."
                )
            sleep(0.05)

    def check_descriptions(self) -> None:
        """Cross-group, once per new quorum (the process group was configured again): compare this group's
        ``description`` with every other group's in it (:func:`.agreement.compare_descriptions`). Raises
        :class:`ReplicaGroupMismatchError` naming the differences where this group must stop; a live group that a
        healing group differs from warns and goes on without it (the healing group stops)."""
        message, refused = self._compare_descriptions()
        if refused:
            raise ReplicaGroupMismatchError(message)
        if message is not None and self.group_rank == 0:
            warnings.warn(f"{message} (replica group {self.config.replica_group} goes on without it)", stacklevel=2)

    def _compare_descriptions(self) -> tuple[str | None, bool]:
        """``(message, refused)`` of :func:`compare_descriptions`, or ``(None, False)`` in a quorum already checked, of
        one group, or whose process group could not be set up (torchft reports that error: the step does not commit)."""
        self.manager.wait_quorum()
        generation = self.process_group.generation
        if self.description is None or generation == self._checked:
            return None, False
        self._checked = generation
        if self.manager.errored() is not None or self.process_group.quorum_size < 2:
            return None, False

        def all_reduce(tensor: Tensor, op: ReduceOp.RedOpType) -> None:
            # On the process group itself: torchft's `Manager.allreduce` zeroes a healing group's tensor.
            options = AllreduceOptions()
            options.reduceOp = op  # type: ignore[assignment]  # torch stubs: ReduceOp, accepts its RedOpType
            self.process_group.allreduce([tensor], options).wait()

        try:
            return compare_descriptions(
                self.description,
                counts=self.manager.is_participating(),
                rank=self.process_group.quorum_rank,
                size=self.process_group.quorum_size,
                all_reduce=all_reduce,
                device=self.device,
            )
        except Exception as error:  # a peer failed: torchft gives the step up, as for a failed gradient all-reduce
            self.manager.report_error(error)
            return None, False

    def _agree_in_group(self, message: str | None, refused: bool, *, exchanged: bool) -> bool:
        """Collective within the group (while the groups wait for each other): raise on every rank if any rank's
        comparison refused this group (a rank with no peer in the other groups, as in a group of more processes,
        learns it here from the ranks that have one); else whether every rank's ``exchanged``."""
        results: list[Any] = [(message, refused, exchanged)]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, (message, refused, exchanged))
        for message, refused, _ in results:
            if refused:
                raise ReplicaGroupMismatchError(message)
        warn = next((message for message, _, _ in results if message is not None), None)
        if warn is not None and self.group_rank == 0:
            warnings.warn(f"{warn} (replica group {self.config.replica_group} goes on without it)", stacklevel=3)
        return all(exchanged for _, _, exchanged in results)

    def shutdown(self) -> None:
        """Local: stop the manager's servers and threads without waiting for peers."""
        self.manager.allow_state_dict_read()  # a quorum thread waiting for the lock must not outlive the manager
        self.manager.shutdown(wait=False)

    def _host_copy(self) -> dict[str, Any]:
        """On torchft's quorum thread, under its state-dict lock: the state with every tensor copied to the host,
        once the device finished this group's last step."""
        if self._written is not None:
            self._written.synchronize()
        return _to_host(self._state_dict())


def _counting(process_group: type) -> type:
    """``process_group`` (a torchft reconfigurable process group class) counting its configurations in
    ``generation`` and keeping this group's ``quorum_rank`` and ``quorum_size``: torchft configures it again for
    every new quorum, which is when groups may have joined."""

    class Counting(process_group):
        generation = 0
        quorum_rank, quorum_size = 0, 1  # this group's place in the quorum (torchft's wrappers keep no `rank()`)

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any, **kwargs: Any):
            self.generation += 1  # before: a configuration that fails (a rank with no peer) is a new quorum too
            self.quorum_rank, self.quorum_size = rank, world_size
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    Counting.__name__ = Counting.__qualname__ = f"Counting{process_group.__name__}"
    return Counting


def _to_host(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with every tensor copied to the host; other leaves as they are."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_host(item) for item in value] if isinstance(value, list) else tuple(_to_host(i) for i in value)
    return value


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new 1-D tensor of ``tensors``' elements, in their dtype when they share one."""
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def _copy_into(tensors: Sequence[Tensor], flat: Tensor) -> None:
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset : offset + count].view_as(tensor))
        offset += count
