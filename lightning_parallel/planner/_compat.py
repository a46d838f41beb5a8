"""Every private torch name the planner's dry run uses, in one place for version bumps (checked with torch 2.11,
2.13 and 2.14).

* ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes and storages but no memory, as
  torch.compile and torchtitan's memory estimator use them.
* ``FakeStore`` (``torch.testing._internal.distributed.fake_pg``): the store of the ``"fake"`` process-group backend
  that torch's own tests and torchtitan use to act as one rank of any world.
* ``disable_current_modes`` (``torch.utils._python_dispatch._disable_current_modes``): leaves the fake mode for a
  moment (a device mesh computes its coordinates from a real tensor).
* :func:`forget_cached_shardings`: DTensor's process-wide caches keyed on a device mesh (the sharding propagator's,
  the redistribution planner's, ``MeshTopoInfo.build_from_mesh``'s), each cleared where this torch has it.

``TorchDispatchMode`` and ``torch.utils._pytree`` are used as torch's own documentation and libraries use them (the
way to write a dispatch mode; pytrees), unchanged since torch 2.0; they are imported where needed.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

__all__ = ["FakeStore", "FakeTensorMode", "disable_current_modes", "forget_cached_shardings"]


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
