"""ZeRO-3 (FSDP2) memory: one root unit above every block, so FSDP2 keeps one reduce-scatter input alive at a time.

A unit nested in no other unit is an FSDP2 root of its own, with its own communication context, and keeps its last
reduce-scatter input (its whole gradients in the reduce dtype) until backward ends: with sibling blocks and no common
root, every block's whole gradients were alive at once near the end of backward (12 x 27 MiB per rank on the
benchmark's GPT). ``apply_fully_shard`` makes the module itself the root (even without parameters of its own) and
``initialise_root`` keeps it the root when ``training_step`` calls a child before ``self(...)``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from distributed_harness import run_distributed
from model_zoo import TwoOptimizerGAN, fit_in_rank, single_device
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_parallel.distributed.zero import stage3 as zero3
from lightning_parallel.distributed.zero.stage3_compat import initialise_root

WIDTH, NUM_BLOCKS, BATCH = 64, 6, 4
FULL_BLOCK_GRADIENT = WIDTH * WIDTH * 4  # bytes: one block's whole gradient in fp32, FSDP2's reduce-scatter input


class _SiblingBlocks(nn.Module):
    """Blocks and a head that are siblings: without a root unit each would be an FSDP2 root of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(WIDTH, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class _NewStorages(TorchDispatchMode):
    """Weak references to the storages of ``nbytes`` bytes that ops return while the mode is on (a view, such as
    gloo's chunks of a reduce-scatter input, shares its base's storage: counted once)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.created: dict[int, weakref.ref] = {}  # the StorageImpl's address -> the storage

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes() == self.nbytes:
                storage = tensor.untyped_storage()
                self.created[storage._cdata] = weakref.ref(storage)
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.created.values())


def _reduce_scatter_inputs_alive(rank: int, world_size: int) -> list[int]:
    """At the start of the first block's backward, once every later unit has reduced its gradients: how many whole
    fp32 block gradients are alive. Parameters are gathered in bf16 (fp32 masters, fp32 reduction), so the gathered
    parameters and autograd's gradients (bf16) and the shards (half a block in fp32) have other sizes."""
    torch.manual_seed(0)
    model = _SiblingBlocks()
    policy = zero3.master_weight_policy(torch.bfloat16)
    units = zero3.apply_fully_shard(model, init_device_mesh("cpu", (world_size,)), mp_policy=policy)
    initialise_root(units[-1])
    tracker = _NewStorages(FULL_BLOCK_GRADIENT)
    counts: list[int] = []
    model.blocks[0].register_full_backward_pre_hook(lambda module, grad: counts.append(tracker.alive()))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the second step runs with FSDP2 initialised and the gradients existing
        with tracker:
            model(x).sum().backward()
    return counts


def test_one_reduce_scatter_input_is_alive_at_a_time() -> None:
    for counts in run_distributed(_reduce_scatter_inputs_alive, 2):
        # The previous unit's (kept until the next unit reduces), and at times the one before it while its
        # collective is still being released (timing of gloo's thread): never one per later block (NUM_BLOCKS - 1).
        assert len(counts) == 2 and max(counts) <= 2 < NUM_BLOCKS - 1, counts


def _gan(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return fit_in_rank(TwoOptimizerGAN, "zero3", world_size)


def test_a_step_calling_a_child_before_self_trains_like_one_device() -> None:
    # `training_step` runs `self.discriminator(x)` before `self(z)`: the discriminator's unit runs forward first and
    # must not become a root of its own (FSDP2 would refuse the LightningModule's forward after it).
    weights = run_distributed(_gan, 2, init_process_group=False, timeout=180)[0]
    torch.testing.assert_close(weights, single_device(TwoOptimizerGAN), rtol=1e-5, atol=1e-6)
