"""Leave the process group before the interpreter tears down C++ objects.

A gloo process group that is still alive when Python exits is destroyed during static destruction, while its
background threads may still be joinable; the process then dies with ``terminate called without an active exception``
(SIGABRT) *after* training finished. Under torchrun that abort counts as a failure and triggers a restart that
resumes from the last checkpoint, so a finished job silently runs again (seen with ``zero3`` about every other run on
a loaded 2-core machine). torch's own advice is to call ``destroy_process_group()`` before exit; Lightning does not,
so every strategy of this package registers it once, at ``atexit``, which runs before static destruction.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

__all__ = ["destroy_process_group_at_exit"]

_registered = False


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler that destroys the default process group if it still exists."""
    global _registered
    if not _registered:
        atexit.register(_destroy_if_initialized)
        _registered = True
