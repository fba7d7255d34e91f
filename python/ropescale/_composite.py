"""The plain-PyTorch math of the kernel ops: the one rotation and ReRoPE attention's composite forms.

The lowest Python layer above the native library: it imports torch only, and the one thing of ropescale's it
calls is the ops' argument checks (``torch.ops.ropescale._check_*``, the C++ functions the native kernels and
their Meta kernels call), so every path here refuses what the op refuses, with its message. Never a kernel
op: ``ROPESCALE_KERNELS=reference`` routes the kernel ops to these functions (:mod:`ropescale.reference`).
The public names are in :mod:`ropescale.rerope` (the ReRoPE forms, ``rotate``) and :mod:`ropescale.reference`
(the ops' twins); the rest of the package calls the shared helpers from here.

Rotation: :func:`cos_sin` forms the angles (in float64, as the native kernels do) and
:func:`rotate_with_tables` rotates; everything that rotates in plain PyTorch (the rotary ops' twins,
:func:`rotate`, the ReRoPE composites, the training path's Python rotations, ``ropescale check``'s references)
calls these two.

The family's region rule (ReRoPE, Leaky ReRoPE, Self-Extend, Dual Chunk Attention: which (query, key) pairs are
near, where the far side rotates q and k) is :class:`RegionRule`, the one Python statement of it: the composites,
the naive form and the training path read it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Rotation


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the plain-PyTorch math runs in for operands of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0,
            dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions[..., None] * inv_freq`` (any real positions), times ``scale``, one entry per
    pair ``[..., P]``, in ``dtype``. The angles are formed in float64, as the native kernels form them, so
    that long positions stay accurate (a float32 angle is off by 0.1 rad at 2^21)."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def full_width(table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A half-width table (one entry per pair) spread over both features of each pair."""
    return table.repeat_interleave(2, dim=-1) if interleaved else torch.cat((table, table), dim=-1)


def _pair_halves(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the second member of every pair: ``(t[..., 0::2], t[..., 1::2])`` or the two halves."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def rotate_with_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, *,
                       half_width: bool = False, conjugate: bool = False,
                       compute: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., D]`` with its first ``rotary_dim`` features rotated by ``cos``/``sin`` (broadcast against
    them), the features past ``rotary_dim`` as they are: the rotation of every plain-PyTorch path.

    Pairs are ``(i, i + rotary_dim/2)`` (half-split) or ``(2i, 2i+1)`` (``interleaved``). The tables are full
    width, one entry per feature (``x cos + rotate_half(x) sin``, transformers' formula; rotary_dim is their
    width), or with ``half_width`` one entry per pair (rotary_dim twice their width). ``conjugate``: the
    transposed map (the inverse rotation). Computed in ``compute`` (default :func:`compute_dtype`) and
    rounded once to x's dtype. Differentiable in ``x``."""
    compute = compute or compute_dtype(x.dtype)
    rotary_dim = 2 * cos.shape[-1] if half_width else cos.shape[-1]
    cos, sin = cos.to(compute), sin.to(compute)
    x1, x2 = _pair_halves(x[..., :rotary_dim].to(compute), interleaved)
    c1, c2 = (cos, cos) if half_width else _pair_halves(cos, interleaved)
    s1, s2 = (sin, sin) if half_width else _pair_halves(sin, interleaved)
    if conjugate:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    y = (torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)).to(x.dtype)
    return y if rotary_dim == x.shape[-1] else torch.cat((y, x[..., rotary_dim:]), dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``x`` ``[B, H, L, D]`` rotated at per-token ``positions`` ``[B, L]`` (any real values).

    Angles are formed in float64 (accurate at long positions); the rotation runs in float32
    (float64 for float64 inputs) and the result has ``x``'s dtype. Dimensions from
    ``2 * len(inv_freq)`` on are left as they are. Differentiable in ``x``.
    """
    cos, sin = cos_sin(positions, inv_freq)
    return rotate_with_tables(x, cos[:, None], sin[:, None], interleaved, half_width=True)


# ---------------------------------------------------------------------------------------------
# ReRoPE attention: the arguments of ``torch.ops.ropescale.rerope_attention`` (q, k NOT rotated), ``(out, lse)``.


def schema_scale(scale):
    """The op's ``scale`` argument: ``None`` is the schema's ``-1`` (1/sqrt(D))."""
    return -1.0 if scale is None else float(scale)


# ---------------------------------------------------------------------------------------------
# The region rule of the ReRoPE family (docs/DESIGN.md, "Self-Extend and Dual Chunk Attention"): each (query
# position i, key position j) pair is near or far; near pairs rotate q at i and k at j, far pairs at the rule's
# far positions. The one Python statement of it: the composites, the naive form and the training path read it.


@dataclasses.dataclass(frozen=True)
class RegionRule:
    """Which pairs are near and where the far side rotates its operands, from the op's ``window``,
    ``leaky_k``, ``group`` and ``chunk_size`` (validated by the op's checks, not here):

    * ReRoPE / Leaky ReRoPE / STRING (``group = chunk_size = 0``): near iff ``j >= i - window + 1``; far q at
      ``s`` (Leaky, STRING: ``s + (i - window) / leaky_k``), far k unrotated (Leaky, STRING: at ``j / leaky_k``),
      ``s = far_start`` (``-1``: ``window``; STRING: its ``local_value``, with ``leaky_k = 1``);
    * Self-Extend (``group = G >= 1``, ``window = W``): near as ReRoPE; far q at ``floor(i/G) + W - floor(W/G)``,
      far k at ``floor(j/G)``;
    * Dual Chunk Attention (``chunk_size = C >= 1``, ``window`` = Qwen's ``local_size`` ``S``, ``n = C - S``):
      near iff ``j >= n floor(i/n) - (n if i mod n <= S else 0)``; far q at ``min(2n - 1, C)``, far k at ``j mod n``.

    Positions are int64 tensors (negative: padding; rotated all the same, never attended)."""

    window: int
    leaky_k: float = 0.0
    group: int = 0
    chunk_size: int = 0
    far_start: int = -1

    @property
    def far_value(self) -> int:
        """Where the far side starts: the relative position at distance ``window`` (ReRoPE's ``window``)."""
        return self.window if self.far_start < 0 else self.far_start

    @property
    def chunk(self) -> int:
        """Dual Chunk Attention's chunk length ``n = chunk_size - local_size``."""
        return self.chunk_size - self.window

    def near_start(self, q_positions: torch.Tensor) -> torch.Tensor:
        """The first key position on the near side of each query position (later keys too: causal=False)."""
        if not self.chunk_size:
            return q_positions - (self.window - 1)
        n = self.chunk
        start = torch.div(q_positions, n, rounding_mode="floor") * n
        return torch.where(q_positions - start <= self.window, start - n, start)

    def near(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """``[B, Lq, Lk]``: whether each (query, key) pair is near (by positions ``[B, Lq]``, ``[B, Lk]``)."""
        return k_positions[:, None, :] >= self.near_start(q_positions)[:, :, None]

    def far_query_positions(self, q_positions: torch.Tensor) -> torch.Tensor:
        """Where the far side rotates each query: int64, or float64 for Leaky ReRoPE (fractional)."""
        if self.chunk_size:
            return torch.full_like(q_positions, min(2 * self.chunk - 1, self.chunk_size))
        if self.group:
            return torch.div(q_positions, self.group, rounding_mode="floor") + (
                self.window - self.window // self.group)
        if self.leaky_k:
            return self.far_value + (q_positions - self.window).to(torch.float64) / self.leaky_k
        return torch.full_like(q_positions, self.far_value)

    def far_key_positions(self, k_positions: torch.Tensor) -> torch.Tensor | None:
        """Where the far side rotates each key: int64, float64 for Leaky ReRoPE, None for plain ReRoPE (the
        key as it is)."""
        if self.chunk_size:
            return torch.remainder(k_positions, self.chunk)
        if self.group:
            return torch.div(k_positions, self.group, rounding_mode="floor")
        if self.leaky_k:
            return k_positions.to(torch.float64) / self.leaky_k
        return None


def check_rerope_attention(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                           group=0, chunk_size=0, far_start=-1, causal=True):
    """The op's own check (``ropescale::_check_rerope_attention``, float64 allowed): every plain-PyTorch path
    refuses what the op refuses, with its message."""
    torch.ops.ropescale._check_rerope_attention(
        q, k, v, q_positions, k_positions, inv_freq, window, float(leaky_k), schema_scale(scale), logn_length,
        allow_float64=True, group=group, chunk_size=chunk_size, far_start=far_start, causal=causal)


def _prepare(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length, causal, interleaved,
             group, chunk_size, far_start=-1):
    """Everything both plain-PyTorch paths share: the op's own check, then the scaled and rotated
    operands of each side and the visibility / near masks ``[B, Lq, Lk]``."""
    check_rerope_attention(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                           group, chunk_size, far_start, causal)
    rule = RegionRule(int(window), float(leaky_k), int(group), int(chunk_size), int(far_start))
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None or scale == -1 else float(scale)
    qp = q_positions.to(torch.int64)
    kp = k_positions.to(torch.int64)
    if logn_length > 0:
        n = (qp + 1).to(torch.float64)
        factor = torch.where(n > logn_length, n.clamp_min(1).log() / math.log(logn_length), torch.ones_like(n))
        q = q * factor.to(q.dtype)[:, None, :, None]
    q_near, k_near = rotate(q, qp, inv_freq, interleaved), rotate(k, kp, inv_freq, interleaved)
    q_far = rotate(q, rule.far_query_positions(qp), inv_freq, interleaved)
    far_k = rule.far_key_positions(kp)
    k_far = k if far_k is None else rotate(k, far_k, inv_freq, interleaved)
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
    if causal:
        visible = visible & (kp[:, None, :] <= qp[:, :, None])
    near = rule.near(qp, kp)
    return scale, (q_near, k_near), (q_far, k_far), visible, near


def _finite_or_zero(x):
    """x with its non-finite elements replaced by 0 (differentiable where x is finite): SDPA must
    never see a masked key's NaN (its boolean mask adds -inf to the NaN score, and its P.V computes
    0 * NaN); what visible non-finite values do to a row is put back by non_finite_rule."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def non_finite_rule(out, lse, row_stat, v, qp, kp, causal):
    """The rule every path shares (DESIGN.md): rows with no visible key (by the positions) give zeros
    and ``lse = -inf``; a row with a visible key whose ``row_stat`` (its largest visible score, or its
    lse, computed from the raw inputs with masked scores at -inf) is NaN, +inf or -inf is NaN in
    ``out`` and ``lse`` (SDPA's softmax of such scores); ``out[i, d]`` is NaN where a key visible to
    query i has a non-finite ``v[d]``, even at probability 0 (SDPA's P.V computes ``0 * inf``).
    ``out`` / ``lse`` are computed from finite stand-ins of the inputs. No host sync."""
    batch, q_heads, q_len, dim = out.shape
    group = q_heads // v.shape[1]
    big = torch.iinfo(torch.int64).max
    key_valid = kp >= 0
    first_key = torch.where(key_valid, kp, big).amin(dim=-1, keepdim=True) if kp.shape[-1] else \
        torch.full_like(qp[:, :1], big)
    seen = (qp >= 0) & (first_key < big) & ((first_key <= qp) if causal else True)  # [B, Lq]
    seen_h = seen[:, None, :]
    poison = seen_h & ~torch.isfinite(row_stat)  # [B, Hq, Lq]
    # The smallest valid position of a key with a non-finite v[d], per (batch, kv head, d).
    bad_v = ~torch.isfinite(v) & key_valid[:, None, :, None]
    first_bad = torch.where(bad_v, kp[:, None, :, None], big).amin(dim=2) if v.shape[2] else \
        torch.full((batch, v.shape[1], dim), big, dtype=torch.int64, device=v.device)
    first_bad = first_bad.repeat_interleave(group, dim=1)[:, :, None, :]  # [B, Hq, 1, D]
    reach = qp[:, None, :, None] if causal else torch.full_like(qp[:, None, :, None], big - 1)
    bad_out = seen_h[..., None] & (first_bad <= reach)
    nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
    out = torch.where(seen_h[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    out = torch.where(poison[..., None] | bad_out, nan, out)
    lse = torch.where(seen_h, lse, torch.full((), float("-inf"), dtype=lse.dtype, device=lse.device))
    lse = torch.where(poison, torch.full((), float("nan"), dtype=lse.dtype, device=lse.device), lse)
    return out, lse


def lse_dtype(q):
    # float32 as the fused op; float64 inputs (gradcheck, references) keep float64.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _scores(q, k, scale):
    """``scale * q k^T`` with GQA: ``[B, Hq, Lq, D] x [B, Hkv, Lk, D] -> [B, Hq, Lq, Lk]``."""
    group = q.shape[1] // k.shape[1]
    return torch.matmul(q, k.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale


def rerope_attention_naive(
    q, k, v, q_positions, k_positions, inv_freq, window, leaky_k=0.0, scale=-1.0, logn_length=0, causal=True,
    interleaved=False, *, group=0, chunk_size=0, far_start=-1,
):
    """Su's formulation: both score matrices in full, selected per pair by the region rule
    (:class:`RegionRule`: ReRoPE's ``p_q - p_k < window``, Self-Extend's, Dual Chunk Attention's), masked,
    softmax. Runs in the inputs' dtype (float32 math for half types), O(Lq x Lk) memory."""
    scale, (q_near, k_near), (q_far, k_far), visible, near = _prepare(
        q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length, causal, interleaved,
        group, chunk_size, far_start
    )
    compute = compute_dtype(q.dtype)
    s_near = _scores(q_near.to(compute), k_near.to(compute), scale)
    s_far = _scores(q_far.to(compute), k_far.to(compute), scale)
    scores = torch.where(near[:, None], s_near, s_far).masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    probs = _finite_or_zero(probs)  # poisoned rows: NaN put back by the rule
    group = q.shape[1] // k.shape[1]
    out = torch.matmul(probs, _finite_or_zero(v.to(compute)).repeat_interleave(group, dim=1))
    qp, kp = q_positions.to(torch.int64), k_positions.to(torch.int64)
    out, lse = non_finite_rule(out, lse, lse, v, qp, kp, causal)
    return out.to(q.dtype), lse.to(lse_dtype(q))


def _row_max(q, k, visible, scale, budget_bytes=64 << 20):
    """Largest visible score of each query row, ``[B, Hq, Lq]`` (-inf where none), in query chunks
    so that no more than ``budget_bytes`` of scores exist at once. No gradient."""
    batch, q_heads, q_len, _ = q.shape
    k_len = k.shape[2]
    if k_len == 0:  # no key: no visible score (amax has nothing to reduce)
        return torch.full((batch, q_heads, q_len), float("-inf"), dtype=torch.float32, device=q.device)
    out = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    chunk = max(1, budget_bytes // max(1, 4 * batch * q_heads * k_len))
    compute = compute_dtype(q.dtype)
    for i0 in range(0, q_len, chunk):
        s = _scores(q[:, :, i0 : i0 + chunk].to(compute), k.to(compute), scale)
        s = s.masked_fill(~visible[:, None, i0 : i0 + chunk], float("-inf"))
        out[:, :, i0 : i0 + chunk] = s.amax(dim=-1).float()
    return out


def _sdpa_with_denominator(q, k, v, visible, shift, scale, key_excluded):
    """One side through SDPA, returning its UNnormalised parts relative to ``exp(shift)``:
    ``A = sum_j exp(s_j - shift) v_j`` and ``N = sum_j exp(s_j - shift)``.

    ``key_excluded`` ``[B, Hkv, Lk]`` marks keys whose (raw) k is not finite: their score in any row
    is -inf (probability 0) or NaN / +inf (a poisoned row, which the caller overwrites), so they
    take no part; their finite stand-in k (zeros) gets a score of -inf through an extra column (1 in
    q, -inf in such a key), as the raw scores would.

    SDPA returns only the normalised output, so two columns and one sentinel key are added: the
    value columns hold 1 for the real keys / 1 for the sentinel, and the sentinel key's score is
    ``shift`` (an extra q column carries ``shift / scale``, matched by a 1 in the sentinel key).
    With ``w`` the sentinel's probability and ``u`` the real keys' total one, ``N = u / w`` and
    ``A = out / w``, exactly and differentiably (``shift`` is a constant the result does not depend
    on). Because ``shift`` is at least the row's largest visible score (the row maximum, or a bound
    above it such as the fused op's lse), ``w >= 1 / (Lk + 1)``: no underflow.
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    # Exactly the sentinel score SDPA will compute (q's dtype rounds shift / scale).
    beta = (shift / scale if scale != 0 else torch.zeros_like(shift)).to(q.dtype)
    shift_eff = beta.to(compute_dtype(q.dtype)) * scale
    ones_q = q.new_ones(batch, q_heads, q_len, 1)
    q_x = torch.cat((q, beta[..., None], ones_q), dim=-1)
    exclusion = torch.where(key_excluded, float("-inf"), 0.0).to(k.dtype)[..., None]
    k_x = torch.cat((k, k.new_zeros(batch, kv_heads, k_len, 1), exclusion), dim=-1)
    sentinel_k = k.new_zeros(batch, kv_heads, 1, dim + 2)
    sentinel_k[..., dim] = 1
    k_x = torch.cat((k_x, sentinel_k), dim=2)
    v_x = torch.cat((v, v.new_ones(batch, kv_heads, k_len, 1), v.new_zeros(batch, kv_heads, k_len, 1)), dim=-1)
    sentinel_v = v.new_zeros(batch, kv_heads, 1, dim + 2)
    sentinel_v[..., dim + 1] = 1
    v_x = torch.cat((v_x, sentinel_v), dim=2)
    mask = torch.cat((visible, visible.new_ones(batch, q_len, 1)), dim=-1)[:, None]
    out = F.scaled_dot_product_attention(
        q_x, k_x, v_x, attn_mask=mask, scale=scale, enable_gqa=q_heads != kv_heads
    )
    compute = shift_eff.dtype
    out = out.to(compute)
    w = out[..., dim + 1 : dim + 2]
    return out[..., :dim] / w, (out[..., dim] / w[..., 0]), shift_eff


# A function of the op's arguments (its keyword-only ``group`` and ``chunk_size`` as keywords) returning,
# without gradient, a bound on each row's visible scores ``[B, Hq, Lq]``: >= the largest one, NaN where one is
# NaN / +inf (the fused op's lse is one); or None where it has none for these inputs.
RowBound = Callable[..., torch.Tensor | None]


def rerope_attention_composite(
    q, k, v, q_positions, k_positions, inv_freq, window, leaky_k=0.0, scale=-1.0, logn_length=0, causal=True,
    interleaved=False, *, group=0, chunk_size=0, far_start=-1, row_bound: RowBound | None = None,
):
    """ReRoPE / Leaky ReRoPE / Self-Extend / Dual Chunk attention from two PyTorch SDPA calls, differentiable
    end to end.

    Same arguments and semantics as :func:`ropescale.ops.rerope_attention`. The near pairs and the far
    ones (:class:`RegionRule`) each go through ``scaled_dot_product_attention`` with their own boolean mask;
    their partial softmaxes are merged by log-sum-exp. ``lse`` is float32 (float64 for float64 inputs, which this
    path accepts for gradcheck and references). SDPA does not return the log-sum-exp, so each call gets a
    sentinel key and two value columns that make it return its softmax denominator too (see
    ``_sdpa_with_denominator``); the shift they need (at least the row's largest visible score) is
    ``row_bound`` of the arguments, called after the op's check (:mod:`ropescale.rerope` passes the fused
    op's lse), or without one (or where it gives None) the row maxima, two ``q k^T`` passes in query chunks.
    Cost: two SDPA calls plus the bound; memory: the ``Lq x Lk`` boolean masks SDPA takes (plus what the
    chosen SDPA backend needs).
    """
    op_scale = scale
    scale, (q_near, k_near), (q_far, k_far), visible, near = _prepare(
        q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length, causal, interleaved,
        group, chunk_size, far_start
    )
    mask_near, mask_far = visible & near, visible & ~near
    with torch.no_grad():
        # The largest visible score of each row, or a bound above it: computed from the raw inputs, so
        # NaN where a visible score is NaN / +inf (the rule reads that below).
        row_stat = None if row_bound is None else row_bound(
            q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, op_scale, logn_length, causal, interleaved,
            group=group, chunk_size=chunk_size, far_start=far_start)
        if row_stat is None:
            row_stat = torch.maximum(_row_max(q_near, k_near, mask_near, scale),
                                     _row_max(q_far, k_far, mask_far, scale))
        shift = torch.where(torch.isfinite(row_stat), row_stat, torch.zeros_like(row_stat))
    excluded_near, excluded_far = (~torch.isfinite(t).all(dim=-1) for t in (k_near, k_far))
    q_near, k_near, q_far, k_far = (_finite_or_zero(t) for t in (q_near, k_near, q_far, k_far))
    v_finite = _finite_or_zero(v)
    a_near, n_near, shift_eff = _sdpa_with_denominator(q_near, k_near, v_finite, mask_near, shift, scale,
                                                       excluded_near)
    a_far, n_far, _ = _sdpa_with_denominator(q_far, k_far, v_finite, mask_far, shift, scale, excluded_far)
    total = n_near + n_far
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    out = (a_near + a_far) / safe_total[..., None]
    lse = torch.where(seen, shift_eff + safe_total.log(), torch.full_like(total, float("-inf")))
    qp, kp = q_positions.to(torch.int64), k_positions.to(torch.int64)
    out, lse = non_finite_rule(out, lse, row_stat, v, qp, kp, causal)
    return out.to(q.dtype), lse.to(lse_dtype(q))


# ---------------------------------------------------------------------------------------------
# The paged, variable-length form (docs/DESIGN.md, "Paged ReRoPE attention"): what an engine with a
# paged cache of raw keys calls. Plain PyTorch: each request's pages gathered into dense keys, then
# rerope_attention_composite. The oracle of the fused kernels and their ROPESCALE_KERNELS=reference form.


def _int64_list(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.to("cpu", torch.int64).tolist()]


def rerope_attention_paged_composite(
    q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, leaky_k=0.0, scale=-1.0,
    scale_factors=None, logn_length=0, interleaved=False, workspace=None, *, group=0, chunk_size=0, far_start=-1,
    row_bound: RowBound | None = None,
):
    """:func:`ropescale.ops.rerope_attention_paged` in plain PyTorch (also float64). Returns ``(out [T, Hq, D],
    lse float32 [T, Hq])``; one :func:`rerope_attention_composite` call per request over its gathered pages
    (``row_bound`` passed on). Runs the op's own checks first (``ropescale::_check_rerope_attention_paged``),
    so it refuses what the op refuses and never indexes outside the cache."""
    torch.ops.ropescale._check_rerope_attention_paged(
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, float(leaky_k),
        schema_scale(scale), scale_factors, logn_length, allow_float64=True, workspace=workspace, group=group,
        chunk_size=chunk_size, far_start=far_start)
    total, q_heads, head_dim = q.shape
    block_size = key_cache.shape[2]
    starts, lengths = _int64_list(query_start_loc), _int64_list(seq_lens)
    out = q.new_zeros(total, q_heads, value_cache.shape[-1])
    lse = torch.full((total, q_heads), float("-inf"), dtype=lse_dtype(q), device=q.device)
    default_scale = 1.0 / math.sqrt(head_dim) if scale is None or scale == -1.0 else float(scale)
    for r, seq_len in enumerate(lengths):
        begin, end = starts[r], starts[r + 1]
        q_len = end - begin
        if q_len <= 0 or seq_len <= 0:
            continue
        pages = block_table[r, : -(-seq_len // block_size)].to(torch.int64)
        k = key_cache[pages].transpose(0, 1).reshape(key_cache.shape[1], -1, head_dim)[:, :seq_len]
        v = value_cache[pages].transpose(0, 1).reshape(value_cache.shape[1], -1, value_cache.shape[-1])[:, :seq_len]
        k_positions = torch.arange(seq_len, device=q.device)[None]
        q_positions = k_positions[:, seq_len - q_len:]
        table = inv_freq if inv_freq.dim() == 1 else inv_freq[r]
        factor = 1.0 if scale_factors is None else float(scale_factors[r])
        o, l = rerope_attention_composite(
            q[begin:end].transpose(0, 1)[None], k[None], v[None], q_positions, k_positions, table, window,
            leaky_k=leaky_k, scale=default_scale * factor, logn_length=logn_length, interleaved=interleaved,
            group=group, chunk_size=chunk_size, far_start=far_start, row_bound=row_bound)
        out[begin:end] = o[0].transpose(0, 1)
        lse[begin:end] = l[0].transpose(0, 1)
    return out, lse


def rerope_cache_write_composite(key_cache, value_cache, key, value, slot_mapping):
    """:func:`ropescale.ops.rerope_cache_write_` in plain PyTorch: raw ``key``/``value`` ``[T, Hkv, D]`` into
    the pages at ``slot_mapping`` (negative slots skipped). Runs the op's checks first."""
    torch.ops.ropescale._check_rerope_cache_write(key_cache, value_cache, key, value, slot_mapping)
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    pages, offsets = slots // block_size, slots % block_size
    key_cache[pages, :, offsets] = key[keep].to(key_cache.dtype)
    value_cache[pages, :, offsets] = value[keep].to(value_cache.dtype)
