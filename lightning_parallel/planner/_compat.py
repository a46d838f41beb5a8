"""Every private torch name the planner's dry run uses, in one place for version bumps (checked with torch 2.11,
2.13 and 2.14).

* ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes and storages but no memory, as
  torch.compile and torchtitan's memory estimator use them.
* ``FakeStore`` (``torch.testing._internal.distributed.fake_pg``): the store of the ``"fake"`` process-group backend
  that torch's own tests and torchtitan use to act as one rank of any world.
* ``disable_current_modes`` (``torch.utils._python_dispatch._disable_current_modes``): leaves the fake mode for a
  moment (a device mesh computes its coordinates from a real tensor).
* ``DeviceMesh._concatenate``: FSDP2 joins a tensor-parallel weight's data and tensor sub-meshes into one with it
  (torch 2.11-2.14: ``FSDPParam``), computing the new mesh's coordinates from real tensors:
  :func:`meshes_made_outside_fake_mode` gives the dry run versions of it and of ``DeviceMesh.__getitem__`` that
  leave the fake mode.
* ``torch.ops._c10d_functional.wait_tensor`` (:data:`WAIT_TENSOR`): the wait on a functional collective (DTensor's
  redistributions), which the dry run answers as the eager kernel does (its input back).
* :func:`forget_cached_shardings`: DTensor's process-wide caches keyed on a device mesh (the sharding propagator's,
  the redistribution planner's, ``MeshTopoInfo.build_from_mesh``'s), each cleared where this torch has it.

``TorchDispatchMode`` and ``torch.utils._pytree`` are used as torch's own documentation and libraries use them (the
way to write a dispatch mode; pytrees), unchanged since torch 2.0; they are imported where needed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

__all__ = [
    "WAIT_TENSOR",
    "FakeStore",
    "FakeTensorMode",
    "disable_current_modes",
    "forget_cached_shardings",
    "meshes_made_outside_fake_mode",
]

WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
"""The wait on a functional collective's result (torch 2.11-2.14)."""


def meshes_made_outside_fake_mode() -> list[tuple[Any, str, Any]]:
    """``(DeviceMesh, name, replacement)`` for the dry run's ``answered_locally``: a sub-mesh (``mesh["shard"]``) and
    FSDP2's join of a tensor-parallel weight's sub-meshes (``DeviceMesh._concatenate``) computed outside the fake
    mode. Both compute the new mesh's coordinates from the meshes' real tensors: in the fake mode the join has no
    kernel (``nonzero``) and a sub-mesh's local rank would read a fake scalar (measured: a shard rank of 1 in a shard
    group of 1, every unsplit parameter's local shard empty)."""

    def outside_fake_mode(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with disable_current_modes():
                return method(*args, **kwargs)

        return call

    return [
        (DeviceMesh, "_concatenate", staticmethod(outside_fake_mode(DeviceMesh._concatenate))),
        (DeviceMesh, "__getitem__", outside_fake_mode(DeviceMesh.__getitem__)),
    ]


def forget_cached_shardings() -> None:
    """Empty DTensor's process-wide caches keyed on a device mesh (the dry run calls it before and after its fake
    world).

    A ``DeviceMesh`` compares equal to any mesh of the same shape and names, whatever its process groups; so the
    sharding propagator's caches (Python and C++), the redistribution planner's and ``MeshTopoInfo``'s would hand a
    later real mesh of that shape the dry run's fake groups, whose collectives do nothing (measured: a ZeRO-3 fit
    after a ZeRO-3 dry run in the same process clipped by the local gradient norm, also in processes forked from
    it). Private torch functions, all of them only clear caches; one this torch lacks has no cache to clear.
    """
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    clear_sharding_propagation = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_sharding_propagation is not None:
        clear_sharding_propagation()
    clear_planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planner is not None:
        clear_planner()
    topology = getattr(_collective_utils, "MeshTopoInfo", None)
    if topology is not None and hasattr(topology.build_from_mesh, "cache_clear"):
        topology.build_from_mesh.cache_clear()
