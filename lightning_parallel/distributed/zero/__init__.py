"""ZeRO's building blocks, torch-only: what ``ShardedOptimizerStrategy`` and each stage of ``PipelineParallelStrategy``
hold a model with.

* :mod:`.config`: the user's settings as one frozen, validated :class:`~.config.ZeroConfig`.
* :mod:`.backends`: the three ways of holding a model behind one protocol (flat buckets, fully-shard, replicated),
  chosen once per run; a pipeline stage is held by the same ones (:class:`~.backends.StageExtensions`).
* Stages 1-2: :mod:`.layout` (which parameter goes in which bucket), :mod:`.flat_bucket` (the records),
  :mod:`.buckets` (flat buckets reduce-scattered as backward produces gradients), :mod:`.accumulation` (what each
  view's ``.grad`` is across syncs), :mod:`.optimizer` (the user's optimizer stepping this rank's shard),
  :mod:`.gather` (the all-gather after the step overlapped with the next forward), :mod:`.replicas` (hybrid
  sharding's replicate axis: a process group, or torchft across replica groups, and the shard state a healing rank
  takes over).
* Stage 3: :mod:`.stage3` (FSDP2 ``fully_shard`` per block, consolidated state), :mod:`.stage3_access` (the module
  outside a Trainer), :mod:`.stage3_gloo` (FSDP2's collectives on gloo), :mod:`.stage3_compat` (torch-version
  differences).
* :mod:`.gradient_loan`: the whole averaged gradients lent to ``.grad`` while hooks read them.

Nothing here imports Lightning or the pipeline (``tests/test_layers.py``); this ``__init__`` imports nothing, so a
submodule is loaded only when used.
"""
