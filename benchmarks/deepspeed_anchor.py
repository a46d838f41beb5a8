"""DeepSpeed ZeRO stages 1-2 as a measured anchor on CPU: the one place that makes DeepSpeed run here.

DeepSpeed is an optional, benchmark-only dependency. It installs as pure Python (no C++ op is built at install time)
next to the CPU build of torch, with a constraint so that pip never replaces torch by a CUDA build::

    echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > /tmp/torch-constraint.txt
    DS_BUILD_OPS=0 pip install deepspeed --no-build-isolation -c /tmp/torch-constraint.txt

(``--no-build-isolation``: DeepSpeed's ``setup.py`` imports torch; in an isolated build environment pip would fetch
a fresh, multi-GB torch for the build. It is therefore not a ``pyproject.toml`` extra: an extra cannot carry these
flags.) This module imports DeepSpeed only when used: without it :class:`DeepSpeedRunner` raises ``ImportError`` and
:func:`cpu_deepspeed_strategy` Lightning's ``MisconfigurationException`` ("you must have DeepSpeed installed"), which
the harness reports as the anchor's reason for not running.

Two users:

* ``benchmarks/peak_memory.py``: :class:`DeepSpeedRunner` is a drop-in for its ``_Runner`` under the strategy names
  ``deepspeed_zero1`` / ``deepspeed_zero2``: ``deepspeed.initialize`` on the same GPT and ``torch.optim.AdamW``
  (lr 1e-4, fp32) in the already-initialised gloo group, stepped by the same plain loop (``engine(x)``,
  ``engine.backward(loss)``, ``engine.step()``), with :meth:`DeepSpeedRunner.categories` naming DeepSpeed's own
  buffers, which the generic ``optimizer_state_tensors`` / ``.grad`` scan cannot see (:func:`zero_tensor_categories`).
* ``benchmarks/anchors.py``: :func:`cpu_deepspeed_strategy` is Lightning's ``DeepSpeedStrategy`` that trains on CPU.

Every bypass needed on CPU (DeepSpeed 0.19.8, Lightning 2.6.6, torch 2.13 CPU):

1. **No shared-memory all-reduce op** (:func:`skip_shm_comm_op`). DeepSpeed picks its CPU accelerator by itself when
   no GPU is found (``DS_ACCELERATOR=cpu`` forces it; its ``is_available()`` is ``True`` and its communication
   backend is gloo without oneCCL). But ``deepspeed.comm``'s ``TorchBackend`` JIT-compiles the C++ op
   ``deepspeed_shm_comm`` (ninja + g++) when it wraps the process group: 164 s on this 2-core machine, in every rank
   at once, on the first run. That op serves only ``inference_all_reduce`` (tensor-parallel inference), which falls
   back to ``torch.distributed.all_reduce`` without it; training's collectives are plain ``torch.distributed`` calls
   on gloo. We mark it incompatible in ``deepspeed.ops.__compatible_ops__`` (DeepSpeed's own per-process table of
   which ops may be loaded, kept as one dict "so edits to it persist"), so it is never built: nothing is compiled.
2. **``LOCAL_RANK``** must be set before ``deepspeed.initialize`` (the engine asserts it); ``peak_memory.py`` sets
   ``RANK`` / ``WORLD_SIZE`` only, so :class:`DeepSpeedRunner` sets ``LOCAL_RANK`` to the global rank (one machine).
3. **Lightning's CUDA-only assumptions** (:func:`cpu_deepspeed_strategy`): ``DeepSpeedStrategy.setup_environment``
   raises for any accelerator but CUDA; its ``setup_distributed`` checks that the devices' indices are ``0..N-1``,
   which CPU devices (index ``None``) never are; and it passes ``device_rank=root_device.index`` (``None`` on CPU) to
   ``deepspeed.initialize``, whose engine compares it with 0 (``TypeError``). The first two are skipped, the third
   passes the local rank (DeepSpeed's CPU ``set_device`` is a no-op). Everything else of Lightning's set-up runs
   (world ranks, ``deepspeed.init_distributed`` on gloo, the engine, the precision plugin, the optimizer wrapping).
4. **Bucket sizes**: DeepSpeed's ``reduce_bucket_size`` / ``allgather_bucket_size`` (5e8 elements by default, 2e8 in
   Lightning) are set to 25 MiB of fp32 (:data:`BUCKET_ELEMENTS`), our strategies' ``bucket_cap_mb`` default. Not
   needed to run, but with ``contiguous_gradients`` (the default) both stages allocate their gradient bucket as
   ``torch.empty(reduce_bucket_size)`` whatever the model's size: 2 GB of tensor bytes at DeepSpeed's default (mostly
   untouched, so RSS hardly shows it) would swamp the breakdown of a 100 M-parameter model. :class:`DeepSpeedRunner`
   also caps it at the model's size (ours: a bucket is at most the parameters it holds), else the 0.1 M-parameter
   quick check shows a 25 MiB bucket. ``overlap_comm`` stays off at both stages (DeepSpeed's default below stage 3;
   Lightning's default ``True`` is passed as ``False``: it double-buffers for CUDA streams, which CPU has not).

What DeepSpeed holds at fp32 (no mixed precision): the model's parameters, flattened per parameter group into one
buffer each (the parameters are views into it); an fp32 copy of this rank's partition of it (``4 Psi / N``: even
at fp32 DeepSpeed steps a separate copy and copies it back), counted as **optimizer state** with AdamW's
``exp_avg`` / ``exp_avg_sq`` of the partition (``8 Psi / N``); as **gradients**: ``.grad`` as backward produces it
until its bucket is reduced, the bucket buffer, the reduced partition (``grads_in_partition`` at stage 2,
``averaged_gradients`` at stage 1) and the fp32 partition's ``.grad`` at the step. AdamW steps one flat partition
per group, so its temporaries (``exp_avg_sq.sqrt()``, the division) are partition-sized too: ``2 x 4 Psi / N`` of
"other" at the optimizer step (measured: 372.9 MiB at world size 2 on the 97.7 M model).

Correctness: :func:`check_against_single_process` trains DeepSpeed at world size 2 and one process with plain AdamW
on the same global batches; ``python -m benchmarks.deepspeed_anchor`` runs it for both stages and prints the numbers.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch import Tensor, nn
from torch.nn import functional as F
from typing_extensions import override

from lightning_parallel.accounting import MemoryReport, storage_bytes
from lightning_parallel.demos.gpt import GPT, GPTConfig

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__all__ = [
    "BUCKET_ELEMENTS",
    "STRATEGIES",
    "CPUDeepSpeedStrategy",
    "DeepSpeedRunner",
    "check_against_single_process",
    "cpu_deepspeed_strategy",
    "skip_shm_comm_op",
    "zero_config",
    "zero_tensor_categories",
]

STRATEGIES = ("deepspeed_zero1", "deepspeed_zero2")
"""The names ``benchmarks/peak_memory.py`` runs through :class:`DeepSpeedRunner`."""
BUCKET_ELEMENTS = 25 * 2**20 // 4
"""DeepSpeed's reduce / all-gather bucket, in elements: 25 MiB of fp32 (our ``bucket_cap_mb`` default)."""
SHM_COMM_OP = "deepspeed_shm_comm"
"""``ShareMemCommBuilder.NAME``: the C++ op ``deepspeed.comm`` would JIT-compile on a CPU accelerator."""


def skip_shm_comm_op() -> None:
    """Bypass 1 (module docstring): never JIT-compile DeepSpeed's shared-memory all-reduce op on CPU.

    Call before ``deepspeed.init_distributed`` / ``deepspeed.initialize`` in the process that wraps the group (a
    forked rank inherits it). Raises :class:`ImportError` without DeepSpeed.
    """
    import deepspeed.ops

    # The first read probes every op (0.2 s) and caches the dict in the module; `build_shm_op` reads this entry.
    compatible = deepspeed.ops.__compatible_ops__
    if SHM_COMM_OP not in compatible:
        raise RuntimeError(f"DeepSpeed has no op {SHM_COMM_OP!r} any more: review `skip_shm_comm_op` for this version.")
    compatible[SHM_COMM_OP] = False


def zero_config(
    stage: int, *, micro_batch_size: int, bucket_elements: int = BUCKET_ELEMENTS, **overrides: Any
) -> dict[str, Any]:
    """The DeepSpeed config of a measured ZeRO-1/2 run: fp32, no clipping, our bucket size (bypass 4).

    Args:
        stage: ZeRO stage, 1 or 2.
        micro_batch_size: sequences per rank per step.
        bucket_elements: DeepSpeed's ``reduce_bucket_size`` and ``allgather_bucket_size``, in elements.
        overrides: top-level config entries that replace these.
    """
    if stage not in (1, 2):
        raise ValueError(f"`stage={stage}`: this anchor runs DeepSpeed ZeRO stage 1 or 2.")
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as every other contender steps
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket_elements,
            "allgather_bucket_size": bucket_elements,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
        "steps_per_print": 2**31 - 1,
        **overrides,
    }


def zero_tensor_categories(zero_optimizer: Any, module: nn.Module) -> dict[str, list[Tensor]]:
    """DeepSpeed ZeRO-1/2's tensors by category for :class:`~lightning_parallel.accounting.LiveTensorPeak`.

    ``parameters``: the module's parameters (views into DeepSpeed's flat per-group buffers, so the buffers count);
    ``gradients``: ``.grad``, the bucket buffers, the partition buffer (stage 2), the averaged partitions (stage 1) and
    the fp32 partitions' ``.grad``; ``optimizer_state``: the inner optimizer's per-element state **and** the fp32
    partitions it steps (DeepSpeed's master copy, kept even at fp32).

    Args:
        zero_optimizer: the ``DeepSpeedZeroOptimizer`` (``engine.optimizer``).
        module: the model DeepSpeed wraps (``engine.module``).
    """
    params = list(module.parameters())
    fp32_partitions = list(zero_optimizer.single_partition_of_fp32_groups)
    gradients = [p.grad for p in params if p.grad is not None]
    gradients += [p.grad for p in fp32_partitions if p.grad is not None]
    gradients += [buffer for bucket in zero_optimizer.ipg_buckets.values() for buffer in bucket.buffer]
    if getattr(zero_optimizer, "grads_in_partition", None) is not None:
        gradients.append(zero_optimizer.grads_in_partition)
    for averaged in zero_optimizer.averaged_gradients.values():
        gradients += [g for g in averaged or [] if isinstance(g, Tensor)]
    state = [
        value
        for per_param in zero_optimizer.optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, Tensor) and value.dim() > 0
    ]
    return {
        "parameters": params + list(zero_optimizer.bit16_groups_flat),
        "gradients": gradients,
        "optimizer_state": state + fp32_partitions,
    }


class DeepSpeedRunner:
    """``peak_memory.py``'s ``_Runner`` for DeepSpeed ZeRO-1/2: the engine, its step and what counts as what.

    Same constructor and methods as ``_Runner`` (``module``, ``step(batch, tracker)``, ``categories()``). Needs the
    gloo process group initialised (``peak_memory.py``'s ranks do it) and DeepSpeed installed (else
    :class:`ImportError`). ``backward`` includes DeepSpeed's gradient reduction (its hooks run inside
    ``engine.backward``); ``optimizer_step`` includes its parameter all-gather.
    """

    def __init__(self, strategy: str, model: nn.Module, rank: int, world_size: int, settings: Any) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"Unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
        if settings.bf16:
            raise ValueError(f"{strategy}: `bf16=True` is not measured for DeepSpeed (fp32 only); drop `--bf16`.")
        import deepspeed

        if settings.activation_checkpointing:
            from lightning_parallel.distributed.activation_checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(model, True)
        skip_shm_comm_op()
        os.environ.setdefault("LOCAL_RANK", str(rank))  # bypass 2: one machine, local rank = global rank
        self.strategy = strategy
        self.module = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # peak_memory.py's hyperparameters
        # A bucket never holds more than the model: DeepSpeed allocates the whole bucket even then (bypass 4).
        bucket = min(BUCKET_ELEMENTS, sum(p.numel() for p in model.parameters()))
        config = zero_config(int(strategy[-1]), micro_batch_size=settings.batch_size, bucket_elements=bucket)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        assert dist.get_world_size() == world_size, "DeepSpeed must run in peak_memory.py's process group"

    def step(self, batch: tuple[Tensor, Tensor], tracker: Any | None = None) -> Tensor:
        """One optimizer step on ``batch`` (inputs, targets); returns the loss (detached)."""

        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        inputs, targets = batch
        phase("forward")
        logits = self.engine(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        del logits
        phase("backward")
        self.engine.backward(loss)
        phase("optimizer_step")
        self.engine.step()  # steps the fp32 partition, all-gathers the parameters, zeroes the gradients
        return loss.detach()

    def categories(self) -> dict[str, list[Tensor]]:
        return zero_tensor_categories(self.optimizer, self.module)


# ---------------------------------------------------------------------------------------- Lightning's strategy
class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` with its two CUDA-only checks skipped (bypass 3), measurable on CPU.

    Sound on CPU: DeepSpeed's CPU accelerator places every tensor on ``cpu`` and its collectives are
    ``torch.distributed`` calls on the gloo group Lightning asks for (``DDPStrategy``'s backend for a CPU root device);
    the skipped checks only protect a CUDA device choice (one GPU per local rank, indices ``0..N-1``).
    """

    @override
    def setup_environment(self) -> None:
        # Skip `DeepSpeedStrategy.setup_environment` ("only supported on CUDA GPUs"), run its parent's.
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        # `DeepSpeedStrategy.setup_distributed` without `_validate_device_index_selection` (CPU devices have no index):
        # the rest is its body. `_init_deepspeed_distributed` is Lightning's private method (2.6).
        from lightning.fabric.utilities.seed import reset_seed

        skip_shm_comm_op()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        # Lightning's body (2.6, a private method) with `device_rank=self.local_rank` instead of
        # `self.root_device.index`: a CPU device's index is None, which DeepSpeed's engine compares with 0 (TypeError);
        # a negative rank would make it train alone (world size 1). On CPU, `set_device(rank)` is a no-op.
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    def memory_report(self) -> MemoryReport:
        """What ``ParallelismMonitor`` reports as held: the categories of :func:`zero_tensor_categories`."""
        assert self.lightning_module is not None
        held = zero_tensor_categories(self.deepspeed_engine.optimizer, self.lightning_module)
        return MemoryReport(**{name: storage_bytes(tensors) for name, tensors in held.items()})

    def gradient_tensors(self) -> list[Tensor]:
        """Every gradient tensor DeepSpeed holds (the monitor's peak breakdown counts them as gradients)."""
        assert self.lightning_module is not None
        return zero_tensor_categories(self.deepspeed_engine.optimizer, self.lightning_module)["gradients"]


def cpu_deepspeed_strategy(stage: int, *, wrap: Callable[[type[Strategy]], type[Strategy]] | None = None) -> Strategy:
    """Lightning's ``DeepSpeedStrategy(stage=stage)`` that trains on a CPU Trainer (fp32, our bucket size).

    Args:
        stage: ZeRO stage, 1 or 2.
        wrap: turns the strategy class into another (``benchmarks.anchors.forked``: start the ranks with ``fork``).

    Raises:
        MisconfigurationException: DeepSpeed is not installed (Lightning's message says how to install it).
    """
    if stage not in (1, 2):
        raise ValueError(f"`stage={stage}`: the CPU DeepSpeed anchor runs ZeRO stage 1 or 2.")
    strategy_class: type[Strategy] = CPUDeepSpeedStrategy if wrap is None else wrap(CPUDeepSpeedStrategy)
    return strategy_class(
        stage=stage,
        reduce_bucket_size=BUCKET_ELEMENTS,
        allgather_bucket_size=BUCKET_ELEMENTS,
        overlap_comm=False,  # bypass 4: double buffering for CUDA streams only
    )


# --------------------------------------------------------------------------------------------- correctness check
def _batches(*, vocab: int, batch_size: int, seq_len: int, steps: int, world_size: int) -> list[tuple[Tensor, Tensor]]:
    """``steps`` global batches of ``world_size * batch_size`` sequences; rank r trains rows ``r*B:(r+1)*B``."""
    generator = torch.Generator().manual_seed(1234)
    shape = (world_size * batch_size, seq_len)
    return [
        (torch.randint(vocab, shape, generator=generator), torch.randint(vocab, shape, generator=generator))
        for _ in range(steps)
    ]


def _check_config() -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)


def _check_rank(rank: int, world_size: int, stage: int, steps: int) -> tuple[list[float], dict[str, Tensor]]:
    torch.manual_seed(0)
    model = GPT(_check_config())
    settings = argparse.Namespace(batch_size=4, bf16=False, activation_checkpointing=False)
    runner = DeepSpeedRunner(f"deepspeed_zero{stage}", model, rank, world_size, settings)
    batches = _batches(vocab=256, batch_size=4, seq_len=64, steps=steps, world_size=world_size)
    losses = []
    for inputs, targets in batches:
        rows = slice(rank * 4, (rank + 1) * 4)
        loss = runner.step((inputs[rows], targets[rows]))
        dist.all_reduce(loss)  # the global batch's mean loss: ranks hold equal numbers of tokens
        losses.append(loss.item() / world_size)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _single_process(steps: int, world_size: int) -> tuple[list[float], dict[str, Tensor]]:
    torch.manual_seed(0)
    model = GPT(_check_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for inputs, targets in _batches(vocab=256, batch_size=4, seq_len=64, steps=steps, world_size=world_size):
        logits = model(inputs)  # (W*B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def check_against_single_process(stage: int, *, world_size: int = 2, steps: int = 5) -> dict[str, Any]:
    """Train DeepSpeed ZeRO-``stage`` in ``world_size`` forked gloo ranks and one plain AdamW process on the same
    global batches (the tiny GPT, fp32, same seed); the per-step losses and the largest parameter difference.

    Returns a dict with ``deepspeed_losses``, ``single_losses``, ``max_loss_diff``, ``max_param_diff`` (rank 0's
    parameters against the single process's after the last step).
    """
    from benchmarks.peak_memory import run_forked  # its forked-rank runner (imported late: it imports us lazily)

    ds_losses, ds_state = run_forked(
        _check_rank, (stage, steps), world_size=world_size, timeout=600, what=f"DeepSpeed ZeRO-{stage}"
    )[0]
    single_losses, single_state = _single_process(steps, world_size)
    return {
        "deepspeed_losses": ds_losses,
        "single_losses": single_losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(ds_losses, single_losses, strict=True)),
        "max_param_diff": max((ds_state[k] - v).abs().max().item() for k, v in single_state.items()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Check DeepSpeed ZeRO-1/2 on CPU against a single AdamW process.")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # before the first fork (a forked child of a process whose OpenMP pool ran can hang)
    for stage in args.stages:
        result = check_against_single_process(stage, world_size=args.world_size, steps=args.steps)
        pairs_of = result["deepspeed_losses"], result["single_losses"]
        pairs = ", ".join(f"{a:.7f}/{b:.7f}" for a, b in zip(*pairs_of, strict=True))
        print(f"ZeRO-{stage} ws {args.world_size}: losses deepspeed/single {pairs}")
        print(f"  max |loss diff| {result['max_loss_diff']:.2e}, max |param diff| {result['max_param_diff']:.2e}")


if __name__ == "__main__":
    main()
