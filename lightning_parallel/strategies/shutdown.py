"""Free every process group, and the gloo threads behind it, before the interpreter tears itself down.

A gloo process group owns C++ threads (two ``pt_gloo_runloop`` workers and a ``gloo_tcp_loop`` per group). One
that is still alive when Python exits is destroyed during interpreter finalization (or by C++ static destructors),
with those threads joinable; the process then may die with ``terminate called without an active exception``
(SIGABRT) *after* training finished. Under torchrun that abort counts as a failure and triggers a restart that
resumes from the last checkpoint, so a finished job runs again (docs/reliability.md, "Known issue").

torch's own advice is to call ``destroy_process_group()`` before exit; Lightning does not, so every strategy of this
package registers :func:`release_process_groups` once, at ``atexit`` (which runs before finalization). Destroying the
groups is not enough to free them (measured with torch 2.13, 2 ranks, every strategy: three groups and their nine
threads were still alive after ``destroy_process_group()``):

* a ``DeviceMesh`` keeps its groups (``distributed/mesh.py``: :func:`forget_process_groups`) and stays alive in
  DTensor's caches (ZeRO-3);
* the other references to the groups (the strategy, FSDP2's and the pipeline's state, Lightning's objects) sit in
  reference cycles, which only the garbage collector frees: left alone, during finalization.

So the handler also makes every mesh forget its groups and runs the garbage collector: the groups and their threads
are gone when it returns (``tests/test_exit_status.py``). Not after a failed ``fit`` (:func:`note_failed_run`): a
group's destructor waits for its collectives still in flight, which a failed peer may never complete; that process
exits non-zero anyway, so it only destroys the groups, as before.
"""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.distributed.mesh import forget_process_groups

__all__ = ["destroy_process_group_at_exit", "note_failed_run", "release_process_groups"]

_registered = False
_run_failed = False


def release_process_groups() -> None:
    """Local. Destroy every process group (if the default one exists) and free them now: every ``DeviceMesh``
    forgets its groups, then the garbage collector frees the cycles that still hold them. The process cannot use
    a process group or a device mesh afterwards; meant for the end of a process (registered at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for obj in gc.get_objects():
        # Not `isinstance`: DeviceMesh's metaclass runs Python code per object (slow, and it warns at exit).
        if DeviceMesh in type(obj).__mro__:
            forget_process_groups(obj)
    gc.collect()


def note_failed_run() -> None:
    """Record that a ``fit`` of this process failed (the strategy's ``on_exception``): at exit, only destroy the
    groups, without waiting for their collectives in flight."""
    global _run_failed
    _run_failed = True


def _at_exit() -> None:
    if not _run_failed:
        release_process_groups()
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the release of the process groups at interpreter exit:
    :func:`release_process_groups`, or after a failed run (:func:`note_failed_run`) only ``destroy_process_group()``."""
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True
