"""Typed wrappers over ``torch.ops.ropescale``, with fake (meta) kernels and autograd.

Every function here is a thin call into the C++ op of the same name (schemas in
``csrc/registration.cpp``). Under ``torch.compile``, ``FakeTensorMode`` and meta tensors the ops
with tensor inputs run their C++ Meta kernels, which call the same checks as the CPU and CUDA
kernels (one check: the fake refuses what the op refuses, with the same message); the table ops,
which take no tensor, have Python fake kernels that run the op's own checks.

By role: the frequency tables, research quantities and table fakes in :mod:`ropescale.ops_frequencies`, the
rotation and its autograd in :mod:`ropescale.ops_rotary` (both re-exported here, the names' documented home), the
ReRoPE attention ops below.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.ropescale)
from .ops_frequencies import TABLE_OPS  # noqa: F401  (re-exported: ops.TABLE_OPS)
from .ops_frequencies import (base_lower_bound, default_inv_freq, dynamic_ntk_inv_freq,
                              effective_context_length, feature_gap, linear_inv_freq, llama3_inv_freq,
                              longrope_attention_factor, longrope_inv_freq, ntk_inv_freq, proportional_inv_freq,
                              resonance_inv_freq, similarity_decay, yarn_attention_factor, yarn_inv_freq,
                              yarn_log_inv_freq)
from .ops_rotary import (apply_rotary, apply_rotary_, apply_rotary_per_request, apply_rotary_per_request_,
                         apply_rotary_pos, apply_rotary_pos_, apply_rotary_pos_qk, apply_rotary_pos_qk_,
                         apply_rotary_qk, apply_rotary_qk_)
from .rerope import rerope_attention_composite, rerope_attention_paged_composite, rerope_cache_write_composite
from .rerope_train import rerope_attention_train

_ops = torch.ops.ropescale

__all__ = [
    "default_inv_freq",
    "linear_inv_freq",
    "proportional_inv_freq",
    "ntk_inv_freq",
    "dynamic_ntk_inv_freq",
    "yarn_inv_freq",
    "yarn_log_inv_freq",
    "yarn_attention_factor",
    "llama3_inv_freq",
    "longrope_inv_freq",
    "longrope_attention_factor",
    "resonance_inv_freq",
    "similarity_decay",
    "effective_context_length",
    "base_lower_bound",
    "feature_gap",
    "apply_rotary",
    "apply_rotary_",
    "apply_rotary_qk",
    "apply_rotary_qk_",
    "apply_rotary_pos",
    "apply_rotary_pos_",
    "apply_rotary_pos_qk",
    "apply_rotary_pos_qk_",
    "apply_rotary_per_request",
    "apply_rotary_per_request_",
]


# ReRoPE attention (csrc/cpu/rerope_attention.cpp, csrc/cuda/rerope_attention.cu), with its plain-PyTorch,
# differentiable twin (rerope.py) and the training path (rerope_train.py: fused kernels, no L x L).

__all__ += ["rerope_attention", "rerope_attention_composite", "rerope_attention_train"]


def rerope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    window: int,
    leaky_k: float = 0.0,
    scale: float | None = None,
    logn_length: int = 0,
    causal: bool = True,
    interleaved: bool = False,
    *,
    group: int = 0,
    chunk_size: int = 0,
    far_start: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReRoPE attention over un-rotated ``q`` ``[B, Hq, Lq, D]`` and ``k``/``v`` ``[B, Hkv, Lk, D]``.

    ``score(i, j) = scale * <rot(q_i, r(p_i - p_j)), k_j>`` with ``r(d) = d`` for ``d < window``,
    else ``window`` (ReRoPE, ``leaky_k = 0``) or ``window + (d - window) / leaky_k`` (Leaky ReRoPE);
    ``out = softmax(score) @ v``. Positions are integer ``[B, Lq]`` / ``[B, Lk]``: causal masking is
    by position (``p_j > p_i`` is masked), and a negative position marks padding (such a key is
    never attended; such a query sees nothing). Positions (and ``window``) must be ``<= 2^31 - 1``,
    the range where the rotation angles are accurate to 2 float32 ulps (checked for CPU tensors; on
    CUDA the check would cost a host sync per call, so there it is the caller's contract).
    ``logn_length > 0`` scales each query by ``max(1, ln(p + 1) / ln(logn_length))``; ``scale`` is
    finite and ``> 0``, ``None`` (the schema's ``-1``) for ``1/sqrt(D)``; ``inv_freq`` may cover fewer
    than ``D / 2`` pairs (partial rotary). GQA when ``Hq`` is a multiple of ``Hkv``.

    Returns ``(out, lse)``: ``out`` in q's dtype (float32 accumulation), ``lse`` the natural-log
    softmax denominator, float32 ``[B, Hq, Lq]``; a row with no visible key gives zeros and
    ``-inf``. Non-finite inputs follow SDPA: a masked key never contributes, whatever it holds; a
    NaN/inf in a query or a visible key or value makes that row's (or that feature's) output
    non-finite, never zeros. One op serves prefill (``Lq = Lk``) and decoding against a
    :class:`ropescale.cache.PreRopeCache` (``Lq = 1``).

    The other training-free methods over the same raw-key cache (docs/DESIGN.md, "Self-Extend and Dual Chunk
    Attention") change only which pairs are near and where the far side rotates q and k (query position
    ``i``, key position ``j``):

    * Self-Extend, ``group = G >= 1`` (``window = W >= 1``, ``leaky_k = 0``): near ``i - j < W`` as ReRoPE; far
      q at ``floor(i/G) + W - floor(W/G)``, far k at ``floor(j/G)``;
    * Dual Chunk Attention, ``chunk_size = C >= 1`` with ``window`` = Qwen's ``local_size`` ``S`` in ``[0, C)``
      (``leaky_k = 0``, causal only), chunks of ``n = C - S``: near when the key is in the query's chunk, or in
      the previous one while ``i mod n <= S``; far q at ``min(2n - 1, C)``, far k at ``j mod n``.

    ``far_start = s >= 0`` (at most ``window``; ``-1``: ``window``) moves where the far side of (Leaky) ReRoPE
    starts: ``r(d) = s + (d - window) / leaky_k``. STRING (An et al., 2025) is ``window = S`` (its
    ``shifted_offset``), ``leaky_k = 1`` and ``far_start = W`` (its ``local_value``): ``r(d) = d - S + W`` past S
    (its attention factor is the caller's ``scale``; see :mod:`ropescale.attention_rules`).

    The fused kernels have no backward pass: train through :func:`rerope_attention_train` (same
    arguments, same result, differentiable, at the memory of PyTorch's fused attention kernels).
    """
    return _ops.rerope_attention(
        q, k, v, q_positions, k_positions, inv_freq, window, float(leaky_k),
        -1.0 if scale is None else float(scale), logn_length, causal, interleaved, group=group, chunk_size=chunk_size,
        far_start=far_start,
    )


def _rerope_attention_backward(ctx, grad_out, grad_lse):
    raise RuntimeError(
        "rerope_attention: the fused kernels have no backward pass; train through "
        "ropescale.ops.rerope_attention_train (same arguments, same result, differentiable, no L x L tensor) "
        "or its oracle ropescale.ops.rerope_attention_composite"
    )


torch.library.register_autograd("ropescale::rerope_attention", _rerope_attention_backward)


# ---------------------------------------------------------------------------------------------
# Paged ReRoPE attention, the engine form (docs/DESIGN.md, "Paged ReRoPE attention"), with the
# plain-PyTorch twins of its two ops (rerope.py).

__all__ += ["rerope_attention_paged", "rerope_paged_workspace_bytes", "rerope_cache_write_",
            "rerope_attention_paged_composite", "rerope_cache_write_composite"]


def rerope_attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    inv_freq: torch.Tensor,
    window: int,
    leaky_k: float = 0.0,
    scale: float | None = None,
    scale_factors: torch.Tensor | None = None,
    logn_length: int = 0,
    interleaved: bool = False,
    workspace: torch.Tensor | None = None,
    *,
    group: int = 0,
    chunk_size: int = 0,
    far_start: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReRoPE attention of packed requests over a paged cache of raw keys (vLLM's layout and metadata).

    q ``[T, Hq, D]`` (request r owns rows ``query_start_loc[r]:query_start_loc[r+1]``), ``key_cache`` /
    ``value_cache`` ``[num_blocks, Hkv, block_size, D]``, ``block_table`` ``[R, max_blocks]``, ``seq_lens``
    ``[R]``. Key slot j of request r has position j; its queries are the last ``q_len`` positions
    (``seq_lens[r] - q_len + i``). ``inv_freq`` ``[P]`` or one table per request ``[R, P]``;
    ``scale_factors`` ``[R]`` multiplies each request's softmax scale. The rest as
    :func:`rerope_attention` (``group``: Self-Extend, ``chunk_size``: Dual Chunk Attention, by each request's
    positions). Returns ``(out [T, Hq, D], lse float32 [T, Hq])``.

    On CPU tensors the metadata values are checked (pages inside the cache, ``q_len <= seq_len <=``
    the pages' capacity, ``query_start_loc`` from 0 to T, non-decreasing): an error names the request.
    On CUDA they are the caller's contract. No backward pass (an inference op).

    ``workspace``: scratch for the CUDA tensor-core prefill, a 1-D uint8 tensor on q's device of
    :func:`rerope_paged_workspace_bytes` bytes for the most query rows a call will have: an engine
    allocates it once (where its memory profiling sees it) and passes it to every call; its contents are
    overwritten. Without it the op allocates its own, and only when a tensor-core row can exist (never on
    a decode step). Ignored on CPU (still checked). With a workspace the op is the overload
    ``rerope_attention_paged.workspace`` (the workspace is a mutated argument), which has no autograd.
    """
    args = (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, float(leaky_k),
            -1.0 if scale is None else float(scale), scale_factors, logn_length, interleaved)
    if workspace is None:
        return _ops.rerope_attention_paged(*args, group=group, chunk_size=chunk_size, far_start=far_start)
    return _ops.rerope_attention_paged.workspace(*args, group=group, chunk_size=chunk_size, far_start=far_start,
                                                 workspace=workspace)


def rerope_paged_workspace_bytes(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                 max_keys: int | None = None) -> int:
    """Bytes of :func:`rerope_attention_paged`'s ``workspace`` for calls of up to ``tokens`` query rows (an
    engine's largest batch, e.g. vLLM's ``max_num_batched_tokens``), ``kv_heads`` k/v heads of ``head_dim``
    in ``dtype``: the queries' sin/cos of the CUDA tensor-core prefill, plus room to pre-rotate ``max_keys``
    keys per call (None: ``max(4 * tokens, 65536)``, the op's own default; 0: none, every tensor-core request
    rotates its key tiles in the kernel, slower for Leaky ReRoPE and the dynamic methods but on the tensor
    cores at any length). 0 where CUDA needs no workspace (float32, head dims other than 64/80/96/128)."""
    return _ops.rerope_paged_workspace_bytes(tokens, kv_heads, head_dim, dtype, -1 if max_keys is None else max_keys)


def rerope_cache_write_(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Stores raw ``key``/``value`` ``[T, Hkv, D]`` into the pages at ``slot_mapping`` (int64 ``[T]``,
    ``page * block_size + offset``; negative slots are skipped), in place."""
    _ops.rerope_cache_write_(key_cache, value_cache, key, value, slot_mapping)


def _rerope_attention_paged_backward(ctx, grad_out, grad_lse):
    raise RuntimeError(
        "rerope_attention_paged: the fused kernels have no backward pass (an inference op); train through "
        "ropescale.ops.rerope_attention_composite"
    )


torch.library.register_autograd("ropescale::rerope_attention_paged", _rerope_attention_paged_backward)
