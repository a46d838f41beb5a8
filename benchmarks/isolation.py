"""Every fit in a process of its own, forked from a fresh interpreter that has run no fit.

Each fit used to fork its ranks from the one long-lived benchmark process; after ~20 fits (ZeRO-3, FSDP2, compiled
models, DeepSpeed, ...) a forked ZeRO-3 rank died with SIGSEGV and the rest of ``make bench``'s zero section was lost
(issue 46). Now the benchmark process only schedules: :func:`in_fresh_process` runs one fit in a child of
multiprocessing's *forkserver*, a clean interpreter started once that imports torch, Lightning and the benchmarks
(:data:`PRELOAD`) and then does nothing but fork. The child forks the fit's ranks as before (the strategies' ``fork``
launcher) and exits with the fit, so nothing a fit leaves behind (threads, allocator state, compiled graphs, gloo
state, leaked memory) reaches the next one, and a fit costs one fork, not an interpreter start.

What runs there must pickle: a contender is built from module-level functions, classes and ``functools.partial``, never
a lambda or a local function.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from lightning_parallel.demos.main import quiet_lightning

__all__ = ["PRELOAD", "FitFailed", "in_fresh_process", "one_line", "return_freed_memory_to_os"]

PRELOAD = ["benchmarks.run_all"]
"""Modules the fork server imports once (every benchmark, torch, Lightning and the library), so a fit's process starts
with them imported."""

T = TypeVar("T")


class FitFailed(Exception):
    """A function run by :func:`in_fresh_process` raised (its error in one line, :func:`one_line`; the traceback went
    to the child's stderr) or its process died before returning."""


def one_line(error: BaseException) -> str:
    """The last non-empty line of an error's message (a forked rank's traceback ends with its real error), and that
    of the error it was raised while handling, if any (a rank that died first: the launcher's teardown error that
    follows names only its own symptom). A :class:`FitFailed` is already that line."""
    if isinstance(error, FitFailed):
        return str(error)

    def last_line(exception: BaseException) -> str:
        lines = [line.strip() for line in str(exception).splitlines() if line.strip()]
        return f"{type(exception).__name__}: {lines[-1] if lines else ''}"

    first = error.__cause__ if error.__cause__ is not None else None
    if first is None and not error.__suppress_context__:  # `raise ... from None` hides the context on purpose
        first = error.__context__
    text = last_line(error)
    if first is not None:
        text += f" (while handling {last_line(first)})"
    return text[:300]


def return_freed_memory_to_os() -> bool:
    """Fix glibc's mmap threshold at 1 MiB before forking, so freed tensors leave the RSS at once (glibc otherwise
    raises it after large frees and RSS shows the allocator's history); ``False`` where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-3, 2**20))  # M_MMAP_THRESHOLD from <malloc.h>


def in_fresh_process(function: Callable[..., T], /, *args: Any, release_freed_memory: bool = True, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` in a new child of the fork server; its return value (which must pickle).

    The child sets one intra-op thread before it forks ranks (a forked child of a process whose OpenMP pool ran can
    hang), quiets Lightning and, with ``release_freed_memory`` (for fits that measure memory), fixes glibc's mmap
    threshold (:func:`return_freed_memory_to_os`). Fits timed for throughput pass ``False``: with the threshold fixed
    every tensor of 1 MiB or more is a fresh mapping, page-faulted and zeroed by the kernel at each allocation, which
    made the medium GPT's steps ~30% slower than the same fit with glibc's own threshold (1.8 against 1.4 s per ZeRO-3
    step), a cost no user's run pays and one that falls on each side by how much it allocates per step.

    Raises:
        FitFailed: If ``function`` raised (the message is its error in one line) or the child died first (a signal).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # only read when the server starts, on the first call
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_child, args=(sender, function, args, kwargs, release_freed_memory), name="lp-bench-fit"
    )
    process.start()
    sender.close()  # the child holds the only sending end: its death ends `recv` with EOFError
    try:
        status, value = receiver.recv()
    except EOFError:
        process.join()
        raise FitFailed(
            f"the fit's process died before returning (exit code {process.exitcode}; negative: the signal that ended"
            " it); its ranks' errors are above"
        ) from None
    finally:
        receiver.close()
    process.join()
    if status == "error":
        raise FitFailed(value)
    return value  # type: ignore[no-any-return]


def _child(
    sender: Connection,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    release_freed_memory: bool,
) -> None:
    torch.set_num_threads(1)
    quiet_lightning()
    if release_freed_memory:
        return_freed_memory_to_os()
    try:
        result: tuple[str, Any] = ("ok", function(*args, **kwargs))
    except BaseException as error:  # reported to the parent, which decides (an anchor's error is a result)
        traceback.print_exc()
        result = ("error", one_line(error))
    sender.send(result)
    sender.close()
