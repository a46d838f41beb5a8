"""Activation bytes of a transformer, counted tensor by tensor: what autograd saves for backward, and the transients.

The count follows what the model's forward really saves (``torch.autograd.graph.saved_tensors_hooks`` sees it), one
term per saved tensor, so ``tests/test_planner_activations.py`` can require it to *equal* the bytes measured on CPU
for the demo GPT and transformers' Llama and GPT-2 (fp32 and bf16 autocast; fused and explicit attention; with and
without activation checkpointing). Per token and block, with hidden size ``h``, ``H`` query heads of width ``d``
(``q = H d``), ``K`` key/value heads (``k = K d``), MLP width ``I``, sequence length ``s``, ``p`` bytes per element of
the residual stream (the parameters' dtype: 4 under ``*-mixed``) and ``c`` of the matrix products (2 under autocast
or 16-bit, else 4):

* **Norms** (two per block, one before the head). LayerNorm: its input ``p h``, mean and reciprocal standard deviation
  (8 bytes, fp32), and the output the next matrix product keeps (``c h``; under autocast the bf16 copy).
  RMSNorm as Llama writes it (in fp32): the fp32 input ``4 h`` (the stream itself when ``p = 4``), ``1/rms`` (4), the
  normalised fp32 tensor ``4 h``, the cast back to ``p`` when ``p < 4`` (``p h``, the weight's product keeps it), and
  the product's input ``c h``.
* **Attention**, ``attention="flash"`` (flash / memory-efficient / cuDNN ``scaled_dot_product_attention``, and torch's
  fused CPU kernel): queries, keys and values ``c (q + 2k)`` (after rotary embeddings; no ``K``-to-``H`` repeat: the
  kernels take grouped-query attention as is), the output ``c q`` (which the output projection reads without a copy)
  and the log-sum-exp, ``4 H``. No ``s``-sized term: the scores are never stored.
  ``attention="math"`` (an explicit ``softmax(q k^T) v``, transformers' ``eager``): queries, keys and values repeated
  to ``H`` heads ``3 c q``, the fp32 softmax ``4 H s`` (plus its cast ``c H s`` under 16 bits), the output copy
  ``c q``, and with dropout a mask ``H s`` and the dropped probabilities ``c H s``.
* **MLP**: GELU (GPT): the first product's output and the activation's, ``2 c I``; GPT-2's tanh GELU written out
  (transformers' ``gelu_new``) ``5 c I``. Gated (SwiGLU, Llama): gate, up, SiLU(gate) and their product, ``4 c I``.
* Under **autocast** every matrix product casts its own 16-bit copy of a norm's output (autocast caches only weight
  casts): Llama keeps three copies for ``q``, ``k``, ``v`` and two for gate and up; GPT's fused ``qkv`` one.
* **Dropout** (``TransformerShape.dropout``): a 1-byte mask per element after attention, after the MLP, and after the
  embedding.
* **Autocast** keeps the 16-bit copy of every weight a matrix product used (``c`` bytes per weight element of each
  block, and the head's), once per forward, not per token.
* **Outside the blocks**: token ids (8 bytes per token), learned position ids (8 per position) or rotary cos/sin
  (``2 s d`` fp32; not kept by checkpointed blocks), the final norm, the log-probabilities of the loss (``4 V`` per
  token; ``c V`` in 16-bit precision), the targets (8 per token) and the loss's 4-byte weight total.

Activation checkpointing (``checkpointing``):

* ``"full"``: each block keeps only its input (``p h`` per token); backward recomputes one block at a time, holding
  its saved tensors (as without checkpointing) for one (micro-)batch. The strategies' ``activation_checkpointing=True``.
* ``"selective"``: torchtitan's per-op selective checkpointing (``activation_checkpoint.mode = "selective"``,
  ``selective_ac_option = "op"``, the setting of its Llama 3 8B runs: ``torchtitan/models/llama3/train_configs``
  and ``docs/performance.md``): in each block the outputs of the 1st, 3rd, 5th and 7th matrix product (Llama:
  ``q``, ``v``, gate, down projections; GPT: the fused ``qkv`` and the MLP's first) and the flash attention's
  output and log-sum-exp are saved, the rest recomputed; each block also keeps its input. torchtitan's per-layer
  option (``selective_ac_option = "2"``: every second block fully checkpointed) is not modelled.

Peak: the bytes saved at the end of forward (:attr:`ActivationBytes.saved`) plus the largest transient of backward
(:attr:`ActivationBytes.transient`): the loss's two fp32 ``(tokens, V)`` buffers (the gradient of the
log-probabilities, then of the logits) when the head is here, or the block being recomputed, whichever is larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_parallel.choices import check_choice
from lightning_parallel.planner.shape import TransformerShape

__all__ = [
    "ATTENTION_KERNELS",
    "CHECKPOINTING_MODES",
    "ActivationBytes",
    "AttentionKernel",
    "CheckpointingMode",
    "activation_bytes",
    "block_bytes_per_token",
    "check_attention",
    "check_checkpointing",
    "recompute_fraction",
]

AttentionKernel = Literal["flash", "math"]
CheckpointingMode = Literal["none", "selective", "full"]

ATTENTION_KERNELS: dict[str, str] = {
    "flash": "fused SDPA: flash / memory-efficient / cuDNN, torch's CPU kernel; no s^2 scores stored",
    "math": "explicit softmax(q k^T) v, transformers' eager: the s^2 probabilities stored",
}
CHECKPOINTING_MODES: dict[str, str] = {
    "none": "every block's saved tensors kept",
    "selective": "torchtitan's per-op selective: every other matmul output and the attention output kept",
    "full": "each block keeps its input and is recomputed in backward",
}


def check_attention(value: object) -> None:
    """Raise ``ValueError`` naming ``value`` and the valid kernels unless it is one of them."""
    check_choice("attention", value, AttentionKernel, notes=ATTENTION_KERNELS)


def check_checkpointing(value: object) -> None:
    """Raise ``ValueError`` naming ``value`` and the valid modes unless it is one of them."""
    check_choice("activation_checkpointing", value, CheckpointingMode, notes=CHECKPOINTING_MODES)


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one rank."""

    saved: int
    """What autograd holds for backward when forward ends (what ``saved_tensors_hooks`` counts)."""
    transient: int
    """The largest extra in backward: the loss's gradients, or the block being recomputed under checkpointing."""

    @property
    def peak(self) -> int:
        return self.saved + self.transient


def _norm(shape: TransformerShape, p: int, c: int, *, readers: int = 1) -> float:
    """Bytes per token one norm saves, its input and the input of the ``readers`` matrix products that read its
    output included (under autocast each product casts its own 16-bit copy: autocast caches only weights)."""
    h = shape.hidden_size
    output = c * h * (readers if c < p else 1)
    if shape.norm == "layernorm":
        return p * h + 8 + output
    return 4 * h + 4 + 4 * h + (p * h if p < 4 else 0) + output


def _attention(shape: TransformerShape, *, s: int, c: int, attention: str) -> float:
    q, k, heads = shape.q_dim, shape.kv_dim, shape.num_heads
    if attention == "flash":
        return c * (2 * q + 2 * k) + 4 * heads
    probabilities = 4 * heads * s + (c * heads * s if c < 4 else 0)
    dropout = (heads * s + c * heads * s) if shape.dropout else 0
    return 4 * c * q + probabilities + dropout


def block_bytes_per_token(shape: TransformerShape, *, seq_len: int, stream_bytes: int, compute_bytes: int,
                          attention: str) -> float:  # fmt: skip
    """Bytes one block saves per token without checkpointing (the module docstring's terms; weights not included)."""
    p, c, h, i = stream_bytes, compute_bytes, shape.hidden_size, shape.mlp_size
    mlp = _MLP_TENSORS[shape.mlp] * c * i
    dropout = 2 * h if shape.dropout else 0
    norms = _norm(shape, p, c, readers=1 if shape.fused_qkv else 3) + _norm(shape, p, c, readers=mlp_inputs(shape))
    return norms + _attention(shape, s=seq_len, c=c, attention=attention) + mlp + dropout


_MLP_TENSORS = {"gelu": 2, "gelu_tanh": 5, "swiglu": 4}
"""``I``-wide tensors an MLP saves per token: GELU's input and output; GPT-2's tanh GELU written out (transformers'
``NewGELUActivation``: the input, ``x + 0.044715 x^3``, its tanh, the product with ``x``, the output); SwiGLU's
gate, up, SiLU(gate) and product."""


def mlp_inputs(shape: TransformerShape) -> int:
    """Matrix products reading the MLP's input: gate and up (SwiGLU), else one."""
    return 2 if shape.mlp == "swiglu" else 1


def _selective_bytes_per_token(
    shape: TransformerShape, *, stream_bytes: int, compute_bytes: int, attention: str
) -> float:
    """Bytes per token a block keeps under torchtitan's per-op selective checkpointing: its input, the outputs of its
    odd-numbered matrix products, and the flash attention's output and log-sum-exp."""
    c = compute_bytes
    saved_matmuls = sum(shape.matmul_widths()[0::2])
    fused = c * shape.q_dim + 4 * shape.num_heads if attention == "flash" else 0
    return stream_bytes * shape.hidden_size + c * saved_matmuls + fused


def _outside_blocks(shape: TransformerShape, *, seq_len: int, stream_bytes: int, compute_bytes: int,
                    with_embedding: bool, with_head: bool, rotary_tables: bool) -> tuple[float, float]:  # fmt: skip
    """``(bytes per token, bytes per sequence batch)`` saved outside the blocks on a rank."""
    p, c = stream_bytes, compute_bytes
    per_token = per_batch = 0.0
    if with_embedding:
        per_token += 8 + (shape.hidden_size if shape.dropout else 0)  # token ids (int64), the embedding's mask
        if shape.positions == "learned":
            per_batch += 8 * seq_len  # the position ids, one (T,) int64 for the batch
    if rotary_tables and shape.positions == "rotary":
        per_batch += 2 * seq_len * shape.head_size * 4  # cos and sin (1, 1, T, d) in fp32, shared by the blocks
    if with_head:
        log_probs = 4 if (c < p or p == 4) else c
        per_token += _norm(shape, p, c) + log_probs * shape.vocab_size + 8  # + the targets (int64)
        per_batch += 4  # the loss's total weight
    return per_token, per_batch


def activation_bytes(
    shape: TransformerShape,
    *,
    seq_len: int,
    samples: float,
    blocks: float,
    stream_bytes: int,
    compute_bytes: int,
    attention: str = "flash",
    checkpointing: str = "none",
    with_embedding: bool = True,
    with_head: bool = True,
    recompute_samples: float | None = None,
    batches: int = 1,
) -> ActivationBytes:
    """Activation bytes of ``blocks`` transformer blocks (and the embedding and head where held) for ``samples``
    sequences of ``seq_len`` tokens (the module docstring's count).

    Args:
        shape: The model's transformer shape.
        seq_len: Tokens per sequence.
        samples: Sequences whose activations are held at once (a pipeline stage: its micro-batches in flight).
        blocks: Transformer blocks held (may be 0: a pipeline stage without blocks).
        stream_bytes: Bytes per element of the residual stream (the parameters' dtype).
        compute_bytes: Bytes per element of matrix products (2 under autocast or 16-bit, else 4).
        attention: ``"flash"`` or ``"math"`` (:data:`ATTENTION_KERNELS`).
        checkpointing: ``"none"``, ``"selective"`` or ``"full"`` (:data:`CHECKPOINTING_MODES`).
        with_embedding: The token embedding is here (token ids and position ids are saved).
        with_head: The final norm, the head and the loss are here.
        recompute_samples: Sequences backpropagated at once (one micro-batch); ``None``: ``samples``.
        batches: (Micro-)batches whose per-batch tensors (position ids, rotary tables) are held at once.
    """
    check_attention(attention)
    check_checkpointing(checkpointing)
    p, c, s = stream_bytes, compute_bytes, seq_len
    tokens = samples * s
    one = (samples if recompute_samples is None else recompute_samples) * s  # tokens of one micro-batch
    full_block = block_bytes_per_token(shape, seq_len=s, stream_bytes=p, compute_bytes=c, attention=attention)
    casts = c * shape.block_weight_numel() if c < p else 0  # autocast's 16-bit weight copies, per block
    per_token, per_batch = _outside_blocks(
        shape, seq_len=s, stream_bytes=p, compute_bytes=c, with_embedding=with_embedding, with_head=with_head,
        rotary_tables=blocks > 0 and checkpointing == "none",  # checkpointed blocks do not save their tables
    )  # fmt: skip
    if with_head and c < p:
        per_batch += c * shape.vocab_size * shape.hidden_size  # the head's 16-bit weight copy
    if checkpointing == "none":
        kept, kept_casts = full_block, casts
    elif checkpointing == "full":
        kept, kept_casts = p * shape.hidden_size, 0
    else:
        kept, kept_casts = _selective_bytes_per_token(shape, stream_bytes=p, compute_bytes=c, attention=attention), 0
    saved = blocks * (tokens * kept + kept_casts) + tokens * per_token + batches * per_batch
    loss_gradients = 2 * 4 * shape.vocab_size * one if with_head else 0
    # The block being recomputed: its saved tensors beyond what it kept (its input, the selected outputs).
    recompute = min(blocks, 1) * (one * (full_block - kept) + casts) if checkpointing != "none" else 0
    return ActivationBytes(saved=int(saved), transient=int(max(loss_gradients, recompute)))


def recompute_fraction(shape: TransformerShape | None, mode: str, *, seq_len: int) -> float:
    """Extra compute of a training step under checkpointing ``mode``, as a fraction of the step without it (forward
    1, backward 2): ``"full"`` reruns every block's forward, ``1/3``; ``"selective"`` reruns the matrix products it
    does not save (the even-numbered ones: Llama's k, o and up projections) and the element-wise ops (not counted);
    ``"none"``: 0. Attention counts ``4 s q`` FLOPs per token (scores and their product with the values)."""
    if mode == "none" or shape is None:
        return 0.0
    if mode == "full":
        return 1 / 3
    inputs = _matmul_inputs(shape)
    widths = shape.matmul_widths()
    flops = [2 * i * w for i, w in zip(inputs, widths, strict=True)]
    forward = sum(flops) + 4 * seq_len * shape.q_dim
    return sum(flops[1::2]) / (3 * forward)


def _matmul_inputs(shape: TransformerShape) -> list[int]:
    """Input widths of the products of :meth:`TransformerShape.matmul_widths`, in the same order."""
    h, i = shape.hidden_size, shape.mlp_size
    attention = [h] if shape.fused_qkv else [h, h, h]
    mlp = [h, h, i] if shape.mlp == "swiglu" else [h, i]
    return [*attention, shape.q_dim, *mlp]
