"""The float64 references of ReRoPE attention the op tests share (test_rerope_attention, test_rerope_paged,
test_rerope_training, test_cuda_kernels): Su's two-matrix form and its IEEE variant for non-finite inputs,
the per-region forms of Self-Extend and Dual Chunk Attention (test_self_extend_dca_reference), STRING's from its
authors' two-pass code,
random inputs with prefill positions and left padding, operand layouts, and the low-precision bound (the
error PyTorch's own SDPA makes in that dtype on the same inputs)."""

import math

import pytest
import torch

BASE = 10000.0


# ---------------------------------------------------------------------------------------------
# float64 reference, from Su's description: two full score matrices merged by the window rule.


def rot64(x, positions, inv_freq, interleaved=False):
    """x [B, H, L, D] rotated at positions [B, L] (float64; dims past 2*len(inv_freq) untouched)."""
    x = x.double()
    pairs = inv_freq.numel()
    ang = positions.double()[:, None, :, None] * inv_freq.double().to(x.device)
    cos, sin = ang.cos(), ang.sin()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * pairs : 2], x[..., 1 : 2 * pairs : 2]
    else:
        x1, x2 = x[..., :pairs], x[..., pairs : 2 * pairs]
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    return torch.cat((rotated, x[..., 2 * pairs :]), -1)


def logn_factor(qp, logn_length):
    n = (qp + 1).double()
    if logn_length <= 0:
        return torch.ones_like(n)
    return torch.where(n > logn_length, n.clamp_min(1).log() / math.log(logn_length), torch.ones_like(n))


def reference(q, k, v, qp, kp, inv_freq, window, leaky_k=0.0, scale=None, logn_length=0, causal=True,
              interleaved=False, factor=1.0):
    """(out, lse) in float64. Negative positions are padding; a row with no visible key gives 0 / -inf.

    ``factor``: a method's attention factor m as transformers applies it, on cos and sin: every rotated dim
    (the first ``2 * len(inv_freq)``) of q and of k times m, the rest as they are, so the rotated dims' part of
    each score is times m^2 and the rest is not (the whole score only on a fully rotated head)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q = q * logn_factor(qp, logn_length)[:, None, :, None]
    rotated = 2 * inv_freq.numel()

    def scaled(x):  # the rotated dims times the factor (transformers: cos and sin times it)
        return x if factor == 1.0 else torch.cat((x[..., :rotated] * factor, x[..., rotated:]), -1)

    def rot(x, positions):
        return scaled(rot64(x, positions, inv_freq, interleaved))

    a_near = rot(q, qp) @ rot(k, kp).transpose(-1, -2)
    if leaky_k:
        a_far = rot(q, window + (qp.double() - window) / leaky_k) @ rot(k, kp.double() / leaky_k).transpose(-1, -2)
    else:
        a_far = rot(q, torch.full_like(qp, window)) @ scaled(k).transpose(-1, -2)
    dist = qp[:, :, None] - kp[:, None, :]
    scores = torch.where((dist < window)[:, None], a_near, a_far) * scale
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
    if causal:
        visible &= dist >= 0
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(lse.isfinite(), lse, 0)[..., None])
    return probs @ v, lse


# ---------------------------------------------------------------------------------------------
# float64 references of the other raw-key methods (docs/DESIGN.md, "Self-Extend and Dual Chunk
# Attention"): one full score matrix per region, each with that region's query and key rotations,
# selected per (query, key) pair by region, then one softmax (what merging the regions' attentions by
# log-sum-exp computes).


def _per_pair_attention(scores, qp, kp, v, causal):
    """(out, lse) of the selected scores [B, H, Lq, Lk] (already scaled): padding (a negative position)
    and, when causal, keys after the query masked; a row with no visible key gives 0 / -inf."""
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
    if causal:
        visible &= kp[:, None, :] <= qp[:, :, None]
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(lse.isfinite(), lse, 0)[..., None])
    return probs @ v, lse


def _raw_inputs(q, k, v, scale):
    q, k, v = q.double(), k.double(), v.double()
    heads = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q, k.repeat_interleave(heads, 1), v.repeat_interleave(heads, 1), scale


def reference_self_extend(q, k, v, qp, kp, inv_freq, window, group, scale=None, causal=True, interleaved=False):
    """Self-Extend (Jin et al. 2024) in float64, (out, lse). Neighbour region ``qp - kp < window``: q at qp,
    k at kp (plain RoPE). Grouped region ``qp - kp >= window``: q at ``qp // group + window - window //
    group``, k at ``kp // group`` (floors of the absolute positions; the paper's integer shift). Keys after
    the query (``causal=False``) fall in the neighbour region, as in ReRoPE's reference. Negative positions
    are padding."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (window, group)):
        raise ValueError(f"window and group must be integers > 0, got {window!r}, {group!r}")
    q, k, v, scale = _raw_inputs(q, k, v, scale)
    qp, kp = qp.long(), kp.long()
    a_near = rot64(q, qp, inv_freq, interleaved) @ rot64(k, kp, inv_freq, interleaved).transpose(-1, -2)
    shift = window - window // group
    a_group = rot64(q, torch.div(qp, group, rounding_mode="floor") + shift, inv_freq, interleaved) @ rot64(
        k, torch.div(kp, group, rounding_mode="floor"), inv_freq, interleaved).transpose(-1, -2)
    dist = qp[:, :, None] - kp[:, None, :]
    scores = torch.where((dist < window)[:, None], a_near, a_group) * scale
    return _per_pair_attention(scores, qp, kp, v, causal)


def reference_dual_chunk(q, k, v, qp, kp, inv_freq, chunk_size, local_size, scale=None, causal=True,
                         interleaved=False):
    """Dual Chunk Attention (An et al. 2024) with Qwen's parameters, in float64, (out, lse). Chunks of
    ``n = chunk_size - local_size`` positions; chunk ``p // n``, offset ``p % n``. Every key at its offset.
    The query: at its offset for keys of its own chunk (intra), at ``min(n + offset, chunk_size)`` for
    keys of the previous chunk (successive), at ``min(2n - 1, chunk_size)`` for keys of earlier chunks
    (inter). Causal only (vLLM refuses causal=False too). Negative positions are padding."""
    if not (all(isinstance(x, int) and not isinstance(x, bool) for x in (chunk_size, local_size))
            and 0 <= local_size < chunk_size):
        raise ValueError(f"need integers 0 <= local_size < chunk_size, got {chunk_size!r}, {local_size!r}")
    if not causal:
        raise ValueError("Dual Chunk Attention is defined for causal attention only")
    q, k, v, scale = _raw_inputs(q, k, v, scale)
    qp, kp = qp.long(), kp.long()
    n = chunk_size - local_size
    q_off, k_off = torch.remainder(qp, n), torch.remainder(kp, n)
    k_rot = rot64(k, k_off, inv_freq, interleaved).transpose(-1, -2)
    a_intra = rot64(q, q_off, inv_freq, interleaved) @ k_rot
    a_succ = rot64(q, (q_off + n).clamp(max=chunk_size), inv_freq, interleaved) @ k_rot
    a_inter = rot64(q, torch.full_like(qp, min(2 * n - 1, chunk_size)), inv_freq, interleaved) @ k_rot
    apart = (torch.div(qp, n, rounding_mode="floor")[:, :, None]
             - torch.div(kp, n, rounding_mode="floor")[:, None, :])[:, None]
    scores = torch.where(apart == 0, a_intra, torch.where(apart == 1, a_succ, a_inter)) * scale
    return _per_pair_attention(scores, qp, kp, v, causal)


def reference_string(q, k, v, qp, kp, inv_freq, shifted_offset, local_value, scale=None, causal=True,
                     interleaved=False, attention_factor=1.0):
    """STRING (An et al., ICLR 2025) in float64, (out, lse), built as its authors' code computes it
    (HKUNLP/STRING ``string_for_llama.py``, ``forward`` and ``string_flash_forward``): keys and the "diag" queries
    rotated at their own positions, the "shifted" queries at ``p - S + W`` (``position_ids - diag_size +
    local_window``), cos and sin times ``attention_factor`` (theirs: ``0.1 ln 2 + 1``); two attentions, the diag one
    over the keys less than S behind the query, the shifted one over the keys S or more behind, merged as their
    code merges them (``out1 / (1 + exp(lse2 - lse1)) + out2 / (1 + exp(lse1 - lse2))``). The regions partition the
    pairs as their decode path does (``k_cache_diag``: the last S keys); their prefill's flash window
    ``[S, 0]`` also lets the key at distance exactly S into the diag side (DESIGN.md, "STRING"). Keys after the
    query (``causal=False``) are on the diag side. Negative positions are padding."""
    if not (all(isinstance(x, int) and not isinstance(x, bool) for x in (shifted_offset, local_value))
            and 0 <= local_value <= shifted_offset and shifted_offset >= 1):
        raise ValueError(f"need integers 0 <= local_value <= shifted_offset, shifted_offset >= 1, got "
                         f"{shifted_offset!r}, {local_value!r}")
    q, k, v, scale = _raw_inputs(q, k, v, scale)
    qp, kp = qp.long(), kp.long()
    m = float(attention_factor)
    keys = rot64(k, kp, inv_freq, interleaved) * m
    diag_q = rot64(q, qp, inv_freq, interleaved) * m
    shifted_q = rot64(q, qp - shifted_offset + local_value, inv_freq, interleaved) * m
    dist = (qp[:, :, None] - kp[:, None, :])[:, None]
    visible = ((qp[:, :, None] >= 0) & (kp[:, None, :] >= 0))[:, None]
    if causal:
        visible = visible & (dist >= 0)

    def attend(queries, keep):
        scores = (queries @ keys.transpose(-1, -2) * scale).masked_fill(~(visible & keep), -math.inf)
        lse = torch.logsumexp(scores, -1)
        probs = torch.exp(scores - torch.where(lse.isfinite(), lse, 0)[..., None])
        return probs @ v, lse

    out1, lse1 = attend(diag_q, dist < shifted_offset)
    out2, lse2 = attend(shifted_q, dist >= shifted_offset)
    # their merge; a side with no key (lse -inf) gets weight 0
    gap21 = torch.where(lse2.isfinite(), torch.sigmoid(lse1 - lse2), torch.ones_like(lse1))
    gap12 = torch.where(lse1.isfinite(), torch.sigmoid(lse2 - lse1), torch.ones_like(lse2))
    gap21 = torch.where(lse1.isfinite(), gap21, torch.zeros_like(gap21))
    gap12 = torch.where(lse2.isfinite(), gap12, torch.zeros_like(gap12))
    return out1 * gap21[..., None] + out2 * gap12[..., None], torch.logaddexp(lse1, lse2)


def make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype=torch.float32, pad=0, offset=0, seed=0,
                device="cpu"):
    """Random q/k/v and prefill-style positions: keys 0..k_len-1 (+offset), queries the last q_len of them;
    batch row b > 0 left-padded by pad*b tokens (position -1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, k_len, dim, generator=g).to(device=device, dtype=dtype)
    kp = torch.arange(k_len).repeat(batch, 1) + offset
    for b in range(batch):
        n_pad = min(pad * b, k_len)
        kp[b, :n_pad] = -1
        kp[b, n_pad:] = torch.arange(k_len - n_pad) + offset
    qp = kp[:, k_len - q_len :].clone()
    return q, k, v, qp.to(device), kp.to(device)


# ---------------------------------------------------------------------------------------------
# float16 / bfloat16: judged against float64 relative to the error PyTorch's own SDPA makes in that
# dtype on the same inputs (test_rerope_attention's section on low precision says why).

# Bound = 2 x SDPA's largest error on the same inputs, flash-attention's rule. A largest error is a
# statistic of the sample: every problem judged this way has at least 64 rows (the op's error is
# then 0.5x to 1.25x SDPA's on this grid); on problems of 2 to 40 rows the ratio of two maxima
# ranged up to 2.8 on its own, so smaller decode problems are judged against the prefill plan instead.
SDPA_ERROR_FACTOR = 2


def sdpa_cannot_pack(err: RuntimeError) -> bool:
    """A PyTorch bug: on an AMX CPU with ATEN_CPU_CAPABILITY lowered below AVX512 (default), SDPA's own bf16/fp16 CPU
    kernel asks oneDNN to pack (the hardware could) with ATen code built only for AVX-512."""
    return "pack_vnni2 is only supported" in str(err)


def sdpa_error(q, k, v, qp, kp, inv_freq, scale=None, logn_length=0, causal=True, interleaved=False):
    """Largest |error| against float64 of (out, lse) from PyTorch's SDPA in q's dtype on the
    plain-attention problem with the same inputs: RoPE attention (ReRoPE with a window past every
    distance), q (times its log-n factor) and k rotated and rounded to the dtype, the same
    visibility (causal, padding), through the CPU flash kernel SDPA runs (it returns the lse too).
    Rows with no visible key are left out."""
    from ropescale.rerope import rotate

    dtype, group = q.dtype, q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    factor = logn_factor(qp, logn_length)[:, None, :, None]
    q_rot = rotate(q.double() * factor, qp, inv_freq, interleaved).to(dtype)
    k_rot = rotate(k.double(), kp, inv_freq, interleaved).to(dtype)
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
    if causal:
        visible &= kp[:, None, :] <= qp[:, :, None]
    mask = torch.zeros(visible.shape).masked_fill(~visible, -math.inf)[:, None]
    try:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_rot, k_rot.repeat_interleave(group, 1), v.repeat_interleave(group, 1), 0.0, False, attn_mask=mask,
            scale=scale)
    except RuntimeError as err:
        if sdpa_cannot_pack(err):
            pytest.skip(f"PyTorch's own SDPA cannot run {dtype} at this ATEN_CPU_CAPABILITY on this CPU "
                        f"({err}), so its error, the bound here, cannot be measured")
        raise
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, 1 << 40, 0.0, scale, logn_length, causal, interleaved)
    rows = torch.isfinite(ref_lse)
    return ((out.double() - ref_out).abs()[rows].max().item(), (lse.double() - ref_lse).abs()[rows].max().item())


def assert_within_sdpa_error(out, lse, ref_out, ref_lse, sdpa_err):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    rows = torch.isfinite(ref_lse)
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))
    err_out = (out.double() - ref_out).abs()[rows].max().item()
    err_lse = (lse.double() - ref_lse).abs()[rows].max().item()
    assert 0 < sdpa_err[0] and 0 < sdpa_err[1]
    assert err_out <= SDPA_ERROR_FACTOR * sdpa_err[0], f"out error {err_out:.3g}, SDPA's {sdpa_err[0]:.3g}"
    assert err_lse <= SDPA_ERROR_FACTOR * sdpa_err[1], f"lse error {err_lse:.3g}, SDPA's {sdpa_err[1]:.3g}"


def as_layout(t, layout, spare=9):
    """t [B, H, L, D] with other strides holding the same values: "blhd" the [B, H, L, D] view of
    [B, L, H, D] storage (as attention layers hand it over), "cache" a view of a longer buffer (a
    cache with spare capacity, starting 3 tokens in)."""
    if layout == "blhd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "cache":
        buffer = torch.zeros(*t.shape[:2], t.shape[2] + spare, t.shape[3], dtype=t.dtype, device=t.device)
        buffer[:, :, 3 : 3 + t.shape[2]] = t
        return buffer[:, :, 3 : 3 + t.shape[2]]
    return t


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: the IEEE reference over the visible pairs, and inputs with non-finite values.


def reference_ieee(q, k, v, qp, kp, inv_freq, window, leaky_k=0.0, causal=True):
    """(out, lse) in float64 with SDPA's IEEE arithmetic over the VISIBLE pairs only: softmax of the
    visible scores (NaN for a row with a NaN / +inf score or only -inf ones), out[i, d] = the sum
    over visible j of p_ij * v_j[d] (0 * inf is NaN), rows without a visible key 0 / -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    a_near = rot64(q, qp, inv_freq) @ rot64(k, kp, inv_freq).transpose(-1, -2)
    if leaky_k:
        a_far = rot64(q, window + (qp.double() - window) / leaky_k, inv_freq) @ rot64(
            k, kp.double() / leaky_k, inv_freq).transpose(-1, -2)
    else:
        a_far = rot64(q, torch.full_like(qp, window), inv_freq) @ k.transpose(-1, -2)
    dist = qp[:, :, None] - kp[:, None, :]
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
    if causal:
        visible &= dist >= 0
    scores = (torch.where((dist < window)[:, None], a_near, a_far) * scale).masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(scores, -1)
    pairs = probs[..., None] * v[:, :, None]  # [B, H, Lq, Lk, D]
    out = torch.where(visible[:, None, :, :, None], pairs, torch.zeros(())).sum(-2)
    lse = torch.logsumexp(scores, -1)
    seen = visible.any(-1)[:, None]
    lse = torch.where(seen & lse.isneginf(), math.nan, lse)
    return torch.where(seen[..., None], out, 0.0), torch.where(seen, lse, -math.inf)


def poison(t, gen, count, values=(math.nan, math.inf, -math.inf)):
    t = t.clone()
    flat = t.view(-1)
    idx = torch.randint(0, flat.numel(), (count,), generator=gen)
    for n, i in enumerate(idx.tolist()):
        flat[i] = values[n % len(values)]
    return t
