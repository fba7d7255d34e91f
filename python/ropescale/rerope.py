"""ReRoPE attention in plain PyTorch: the differentiable composite path and the naive two-matrix form.

Both take the arguments of ``torch.ops.ropescale.rerope_attention`` (q, k NOT rotated) and return
``(out, lse)``:

* :func:`rerope_attention_composite` is the training path (Leaky ReRoPE fine-tuning) and a second
  oracle for the fused kernels: two calls to ``torch.nn.functional.scaled_dot_product_attention``,
  one over the near band (``p_q - p_k < window``, operands rotated at their own positions) and one
  over the far part (query rotated at ``window``, raw key; Leaky: the interpolated pair), merged by
  their log-sum-exp. Gradients come from PyTorch's own SDPA backward. Self-Extend (``group``) and Dual
  Chunk Attention (``chunk_size``) are the same two calls under their own region rule
  (``_composite.RegionRule``: which pairs are near, where the far side rotates q and k).
* :func:`rerope_attention_naive` is Su's reference formulation: two full ``Lq x Lk`` score
  matrices selected by the window rule, then a softmax. O(L^2) memory; the baseline the fused op
  is benchmarked against.

Both check their arguments with the op's own check (``torch.ops.ropescale._check_rerope_attention``,
the C++ function the fused kernels and their Meta kernel call), so they refuse what the op refuses
with its messages; they also take float64. Non-finite inputs follow the rule every path shares
(``non_finite_rule``): masked keys never contribute, whatever they hold; visible non-finite values
propagate as in SDPA.

The math is in ``ropescale._composite`` (torch only); what this module adds is the composite's shortcut:
the fused op's lse as the shift of its softmax parts, where the native kernel runs.
"""

from __future__ import annotations

import torch

from . import _C, _composite, reference
from ._composite import rerope_attention_naive, rerope_cache_write_composite, rotate

__all__ = ["rerope_attention_composite", "rerope_attention_naive", "rerope_attention_paged_composite",
           "rerope_cache_write_composite", "rotate"]


def _fused_lse(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length, causal,
               interleaved, *, group=0, chunk_size=0, far_start=-1):
    """The fused op's lse (no gradient), or None where the op does not take these inputs (float64,
    mixed dtypes, head dims it does not compile, a device this build has no kernel for) or runs the
    composite itself (``ROPESCALE_KERNELS=reference``). The lse is >= every visible score of its row, so
    it serves as the composite's shift in place of two ``q k^T`` passes for the row maxima (which cost
    more than both SDPA calls together)."""
    if reference.KERNELS == "reference":
        return None
    dtype, dim = q.dtype, q.shape[-1]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != dtype or v.dtype != dtype:
        return None
    if dim % 2 or dim > 256 or not (q.device.type == "cpu" or (q.is_cuda and _C.build_info()["cuda"])):
        return None
    _, lse = torch.ops.ropescale.rerope_attention(q, k, v, q_positions, k_positions, inv_freq, window,
                                                  float(leaky_k), _composite.schema_scale(scale), logn_length,
                                                  causal, interleaved, group=group, chunk_size=chunk_size,
                                                  far_start=far_start)
    return lse


def rerope_attention_composite(
    q, k, v, q_positions, k_positions, inv_freq, window, leaky_k=0.0, scale=-1.0, logn_length=0, causal=True,
    interleaved=False, *, group=0, chunk_size=0, far_start=-1,
):
    """ReRoPE / Leaky ReRoPE / Self-Extend / Dual Chunk attention from two PyTorch SDPA calls, differentiable
    end to end.

    Same arguments and semantics as :func:`ropescale.ops.rerope_attention`. The near pairs and the far ones
    (``_composite.RegionRule``) each go through ``scaled_dot_product_attention`` with their own boolean mask;
    their partial softmaxes are merged by log-sum-exp. ``lse`` is float32 (float64 for float64 inputs, which this
    path accepts for gradcheck and references). SDPA does not return the log-sum-exp, so each call gets a
    sentinel key and two value columns that make it return its softmax denominator too; the shift they
    need (at least the row's largest visible score) is the fused op's lse, computed first without
    gradient (float64 inputs, which the op does not take, and ``ROPESCALE_KERNELS=reference``: the row
    maxima, in query chunks). Cost: two SDPA calls plus one fused call; memory: the ``Lq x Lk`` boolean
    masks SDPA takes (plus what the chosen SDPA backend needs).
    """
    return _composite.rerope_attention_composite(
        q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length, causal, interleaved,
        group=group, chunk_size=chunk_size, far_start=far_start, row_bound=_fused_lse)


def rerope_attention_paged_composite(
    q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, leaky_k=0.0, scale=-1.0,
    scale_factors=None, logn_length=0, interleaved=False, workspace=None, *, group=0, chunk_size=0, far_start=-1,
):
    """:func:`ropescale.ops.rerope_attention_paged` in plain PyTorch (also float64). Returns ``(out [T, Hq, D],
    lse float32 [T, Hq])``; one :func:`rerope_attention_composite` call per request over its gathered pages.
    Runs the op's own checks first (``ropescale::_check_rerope_attention_paged``), so it refuses what the op
    refuses and never indexes outside the cache."""
    return _composite.rerope_attention_paged_composite(
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, leaky_k, scale,
        scale_factors, logn_length, interleaved, workspace, group=group, chunk_size=chunk_size, far_start=far_start,
        row_bound=_fused_lse)
