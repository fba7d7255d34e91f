"""Self-Extend and Dual Chunk Attention (issue 31) and STRING (issue 44) through the ReRoPE ops (docs/DESIGN.md,
"Self-Extend and Dual Chunk Attention", "STRING"): the dense op, the paged op, the composite, the naive form, the reference kernels and the
training path, each against the float64 per-region references of support/attention.py
(``reference_self_extend``, ``reference_dual_chunk``, ``reference_string``: its authors' two passes). Prefill, chunked prefill, decode (both CPU plans) and
packed paged batches; float32 to 1e-5, fp16/bf16 within 2x PyTorch's own SDPA error; GQA, padding, odd sizes
across the CPU kernel's 128-key / 128-query tiles, strided operands, interleaved pairs, partial rotary, long
positions; the methods' parameter corners; opcheck; gradcheck of the Self-Extend training path; and the bad
parameters, refused alike by the op, its fake kernel, and every plain-PyTorch path."""

import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

from ropescale import ops, rerope
from ropescale import reference as reference_kernels
from ropescale.rerope_train import rerope_attention_train
from support import TESTS
from support.attention import (BASE, as_layout, assert_within_sdpa_error, logn_factor, make_inputs, reference,
                               reference_dual_chunk, reference_self_extend, reference_string, sdpa_error)
from support.paged import make_paged

ROPE = 1 << 30  # a ReRoPE window past every distance here: plain RoPE attention


@dataclasses.dataclass(frozen=True)
class Method:
    """One parameter set of Self-Extend (``group``; ``window`` = W) or Dual Chunk Attention (``chunk_size``;
    ``window`` = Qwen's local_size), as the ops take it, and its float64 reference."""

    window: int
    group: int = 0
    chunk_size: int = 0
    local_value: int = -1  # STRING's W (``window`` is its shifted offset S); -1: not STRING

    def __str__(self):
        if self.local_value >= 0:
            return f"string-S{self.window}-W{self.local_value}"
        if self.chunk_size:
            return f"dca-C{self.chunk_size}-S{self.window}"
        return f"se-W{self.window}-G{self.group}"

    @property
    def kw(self):
        if self.local_value >= 0:  # STRING: ReRoPE's far rule with slope 1, starting at W
            return dict(leaky_k=1.0, far_start=self.local_value)
        return dict(group=self.group, chunk_size=self.chunk_size)

    def reference(self, q, k, v, qp, kp, inv_freq, scale=None, logn_length=0, causal=True, interleaved=False):
        """(out, lse) in float64. log-n scales the whole query before any rotation (a rotation is linear), so
        the references, which have no log-n, take the scaled query."""
        q = q.double() * logn_factor(qp, logn_length)[:, None, :, None]
        inv_freq = inv_freq.double()
        if self.local_value >= 0:
            return reference_string(q, k, v, qp, kp, inv_freq, self.window, self.local_value, scale, causal,
                                    interleaved)
        if self.chunk_size:
            return reference_dual_chunk(q, k, v, qp, kp, inv_freq, self.chunk_size, self.window, scale, causal,
                                        interleaved)
        return reference_self_extend(q, k, v, qp, kp, inv_freq, self.window, self.group, scale, causal, interleaved)


SE = Method  # Method(W, group=G)


def STRING(shifted_offset, local_value):
    return Method(shifted_offset, local_value=local_value)


def DCA(chunk_size, local_size):
    return Method(local_size, chunk_size=chunk_size)


# Parameter corners. Self-Extend: G dividing W and not, W = 1 (the near band is the diagonal), a window wider
# than a 128-key tile. Dual Chunk: local_size 0, local_size >= n (the successive region all near), the paper's
# example (chunk_size = c - 1 = 9, local_size = w - 1 = 3), chunks longer than a tile.
# STRING: W = 0 (the far side starts at distance 0), W = S (plain RoPE), S = 1, an offset wider than a tile.
METHODS = [SE(4, group=2), SE(5, group=3), SE(1, group=6), SE(40, group=8), SE(150, group=3),
           DCA(24, 5), DCA(40, 0), DCA(30, 20), DCA(9, 3), DCA(200, 30),
           STRING(40, 8), STRING(5, 0), STRING(1, 1), STRING(150, 128), STRING(33, 33)]

# (Lq, Lk): prefill, chunked prefill (the queries a suffix of the keys), a decode step, the decode plan's
# largest problem (<= 4 rows); odd lengths across the CPU kernel's 128-row / 128-key tiles.
SHAPES = {"prefill": (130, 130), "chunked": (70, 201), "decode": (1, 300), "decode-plan": (4, 131)}
GQA = ((1, 1), (2, 2), (4, 1))  # (q heads per kv head, kv heads)


def inv_freq_of(dim):
    return ops.default_inv_freq(dim, BASE)


def assert_close_to(out, lse, ref_out, ref_lse, tol=1e-5):
    """float32 against float64: out and lse to ``tol`` (absolute and relative), -inf exactly where no key is
    visible, zero rows there."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    rows = torch.isfinite(ref_lse)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[rows], ref_lse[rows], atol=tol, rtol=tol)


def paths():
    """The paths that take float32 inputs: the fused op and the composite."""
    return {"native": ops.rerope_attention, "composite": ops.rerope_attention_composite}


# ---------------------------------------------------------------------------------------------
# The dense op and the composite, float32: every method x every shape, with GQA, left padding, log-n,
# causal=False (Self-Extend), long positions.

GRID = [(m, s) for m in METHODS for s in SHAPES]


def grid_case(method, shape, dims):
    """The float32 grid's case (method, shape), its head dim one of ``dims``: (q, k, v, qp, kp, inv_freq) and
    the op's keyword arguments (log-n, causal)."""
    index = GRID.index((method, shape))
    q_len, k_len = SHAPES[shape]
    group, kv_heads = GQA[index % 3]
    dim = dims[index % 3]
    offset = (0, 0, 0, 10**6)[index % 4]  # long positions: 10^6 past the start
    causal = bool(method.chunk_size) or index % 5 != 2  # Self-Extend also without the causal mask
    logn_length = 50 if index % 4 == 1 else 0
    q, k, v, qp, kp = make_inputs(2, group * kv_heads, kv_heads, q_len, k_len, dim, pad=index % 3 * 7, seed=index,
                                  offset=offset)
    return (q, k, v, qp, kp, inv_freq_of(dim)), dict(logn_length=logn_length, causal=causal)


@pytest.mark.parametrize("method,shape", GRID, ids=[f"{m}-{s}" for m, s in GRID])
def test_float32_matches_reference(method, shape):
    inputs, kw = grid_case(method, shape, (16, 10, 32))
    ref = method.reference(*inputs, **kw)
    for name, path in paths().items():
        out, lse = path(*inputs, method.window, **kw, **method.kw)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32, name
        assert_close_to(out, lse, *ref)


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_float64_composite_and_naive_equal_reference(method):
    """The plain-PyTorch forms in float64 equal the references to rounding: any difference in the region rule
    (one pair on the wrong side, one position off) shows."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 70, 150, 8, torch.float64, pad=11, seed=3)
    inv_freq = inv_freq_of(8).double()
    ref_out, ref_lse = method.reference(q, k, v, qp, kp, inv_freq, logn_length=40)
    for path in (ops.rerope_attention_composite, rerope.rerope_attention_naive):
        out, lse = path(q, k, v, qp, kp, inv_freq, method.window, logn_length=40, **method.kw)
        assert out.dtype == torch.float64
        assert torch.equal(lse.isneginf(), ref_lse.isneginf())
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[lse.isfinite()], ref_lse[ref_lse.isfinite()], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("method", [SE(5, group=3), DCA(30, 20), STRING(40, 8)], ids=str)
def test_positions_at_the_bound(method):
    """Positions up to 2^31 - 1 (the op's accurate range): the floors and chunk offsets of large positions, on
    every path (the grid has positions at 10^6)."""
    length = 150
    q, k, v, qp, kp = make_inputs(1, 4, 2, length, length, 16, seed=8, offset=2**31 - 1 - (length - 1))
    inv_freq = inv_freq_of(16)
    ref = method.reference(q, k, v, qp, kp, inv_freq)
    for path in paths().values():
        assert_close_to(*path(q, k, v, qp, kp, inv_freq, method.window, **method.kw), *ref, tol=2e-5)


@pytest.mark.parametrize("method", [SE(5, group=3), DCA(24, 5)], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [8, 24])
def test_partial_rotary_and_interleaved(method, interleaved, rotary_dim):
    q, k, v, qp, kp = make_inputs(2, 2, 2, 70, 133, 24, pad=4, seed=rotary_dim)
    inv_freq = inv_freq_of(rotary_dim)  # rotary_dim / 2 pairs of a 24-dim head
    ref = method.reference(q, k, v, qp, kp, inv_freq, interleaved=interleaved)
    for path in paths().values():
        assert_close_to(*path(q, k, v, qp, kp, inv_freq, method.window, interleaved=interleaved, **method.kw), *ref)


@pytest.mark.parametrize("method", [SE(40, group=8), DCA(200, 30)], ids=str)
@pytest.mark.parametrize("q_len", [1, 3, 77])
def test_strided_operands(method, q_len):
    """q as the [B, H, L, D] view of [B, L, H, D] storage, k and v views of a longer cache buffer, an
    explicit scale."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, q_len, 260, 32, pad=9, seed=q_len)
    inv_freq = inv_freq_of(32)
    ref = method.reference(q, k, v, qp, kp, inv_freq, scale=0.3)
    for path in paths().values():
        got = path(as_layout(q, "blhd"), as_layout(k, "cache"), as_layout(v, "cache"), qp, kp, inv_freq,
                   method.window, scale=0.3, **method.kw)
        assert_close_to(*got, *ref)


@pytest.mark.parametrize("method", [SE(7, group=3), DCA(40, 9), DCA(12, 10)], ids=str)
def test_arbitrary_positions(method):
    """Non-monotonic and repeated positions, int32 ids, padding anywhere: every pair is placed by its positions,
    whatever the rows' order (the kernel classifies tiles by position ranges)."""
    g = torch.Generator().manual_seed(11)
    q, k, v, _, _ = make_inputs(2, 4, 2, 40, 150, 16, seed=11)
    kp = torch.randint(-3, 300, (2, 150), generator=g) + torch.tensor([[0], [1 << 21]])
    qp = torch.randint(-3, 300, (2, 40), generator=g) + torch.tensor([[0], [1 << 21]])
    kp[1].masked_fill_(kp[1] < 1 << 21, -1)
    qp[1].masked_fill_(qp[1] < 1 << 21, -1)
    inv_freq = inv_freq_of(16)
    for causal in (True, False) if method.group else (True,):
        ref = method.reference(q, k, v, qp, kp, inv_freq, causal=causal)
        for path in paths().values():
            assert_close_to(*path(q, k, v, qp.int(), kp.int(), inv_freq, method.window, causal=causal, **method.kw),
                            *ref, tol=2e-5)


@pytest.mark.parametrize("method", [SE(5, group=3), DCA(24, 5)], ids=str)
def test_masked_non_finite_keys_change_nothing(method):
    """NaN / inf in padding keys and values and in keys after every query: masked, never read into a row."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 70, 200, 16, pad=9, seed=12)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, :9], v_bad[1, :, :9] = math.nan, math.inf  # row 1's padding keys
    qp, kp_future = qp[:, :50], kp.clone()
    kp_future[:, 180:] += 500  # keys after every query (causal)
    k_bad[:, :, 180:], v_bad[:, :, 180:] = math.inf, math.nan
    inv_freq = inv_freq_of(16)
    for path in paths().values():
        clean = path(q[:, :, :50], k, v, qp, kp_future, inv_freq, method.window, **method.kw)
        poisoned = path(q[:, :, :50], k_bad, v_bad, qp, kp_future, inv_freq, method.window, **method.kw)
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)
        assert_close_to(*clean, *method.reference(q[:, :, :50], k, v, qp, kp_future, inv_freq))


def test_rows_without_visible_keys():
    """Padding queries, queries before every key, and a call with no keys: zeros and lse = -inf."""
    q, k, v, _, _ = make_inputs(1, 2, 1, 4, 6, 8)
    kp = torch.tensor([[5, 6, 7, -1, -1, 9]])
    qp = torch.tensor([[4, 6, -2, 9]])
    inv_freq = inv_freq_of(8)
    for method in (SE(2, group=2), DCA(4, 1)):
        for path in paths().values():
            out, lse = path(q, k, v, qp, kp, inv_freq, method.window, **method.kw)
            assert torch.equal(out[:, :, [0, 2]], torch.zeros(1, 2, 2, 8))
            assert torch.isneginf(lse[:, :, [0, 2]]).all() and torch.isfinite(lse[:, :, [1, 3]]).all()
            assert_close_to(out, lse, *method.reference(q, k, v, qp, kp, inv_freq))
            out, lse = path(q, k[:, :, :0], v[:, :, :0], qp, kp[:, :0], inv_freq, method.window, **method.kw)
            assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# The methods' limits, op against op (no reference in between).


@pytest.mark.parametrize("window", [1, 6, 64])
def test_self_extend_group_1_is_rope_attention(window):
    q, k, v, qp, kp = make_inputs(2, 4, 2, 70, 201, 16, pad=5, seed=window)
    inv_freq = inv_freq_of(16)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, window, group=1)
    rope_out, rope_lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, ROPE)
    torch.testing.assert_close(out, rope_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rope_lse, atol=1e-5, rtol=1e-5)
    assert_close_to(out, lse, *reference(q, k, v, qp, kp, inv_freq, ROPE))


def test_self_extend_group_past_every_position_is_rerope():
    """G past every position with W < G: the grouped q at W, the grouped k at 0: ReRoPE with window W."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 130, 130, 16, pad=5, seed=2)
    inv_freq = inv_freq_of(16)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 6, group=1000)
    want = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 6)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size,local_size", [(24, 5), (40, 0), (130, 10)])
def test_dual_chunk_short_sequence_is_rope_attention(chunk_size, local_size):
    """Up to length min(C + 1, 2n) Dual Chunk Attention is RoPE attention (local_size < n here)."""
    length = min(chunk_size + 1, 2 * (chunk_size - local_size))
    q, k, v, qp, kp = make_inputs(2, 4, 2, length, length, 16, pad=3, seed=chunk_size)
    inv_freq = inv_freq_of(16)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, local_size, chunk_size=chunk_size)
    rope_out, rope_lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, ROPE)
    torch.testing.assert_close(out, rope_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rope_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", [SE(5, group=3), DCA(24, 5)], ids=str)
def test_decode_steps_equal_prefill_rows(method):
    """Token by token over a growing key set (the decode plan) equals the prefill's rows."""
    q, k, v, qp, kp = make_inputs(2, 8, 2, 140, 140, 16, pad=13, seed=6)
    inv_freq = inv_freq_of(16)
    full_out, full_lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, method.window, **method.kw)
    for t in (0, 1, 23, 24, 64, 127, 128, 139):
        out, lse = ops.rerope_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], qp[:, t : t + 1],
                                        kp[:, : t + 1], inv_freq, method.window, **method.kw)
        torch.testing.assert_close(out, full_out[:, :, t : t + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, full_lse[:, :, t : t + 1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# float16 / bfloat16: the fused op within SDPA_ERROR_FACTOR x PyTorch's own SDPA error on the same inputs
# (support.attention.sdpa_error; every problem has >= 64 rows, as that bound needs).

# method, batch, q heads, kv heads, q_len, k_len, dim, left padding, layout, interleaved, rotary_dim (0: dim), logn
LOW_PRECISION_CASES = [
    (SE(40, group=4), 1, 4, 2, 130, 130, 64, 0, "contiguous", False, 0, 0),
    (SE(5, group=3), 2, 4, 2, 67, 140, 32, 9, "blhd", False, 0, 30),
    (SE(16, group=2), 1, 32, 4, 2, 300, 64, 0, "cache", True, 48, 0),
    (DCA(200, 30), 1, 4, 1, 130, 300, 64, 0, "contiguous", False, 0, 0),
    (DCA(24, 5), 2, 4, 2, 67, 140, 32, 9, "blhd", True, 24, 0),
    (DCA(40, 0), 1, 32, 4, 1, 517, 64, 0, "cache", False, 0, 100),
    (STRING(40, 8), 1, 4, 2, 130, 130, 64, 0, "contiguous", False, 0, 0),
    (STRING(100, 16), 2, 4, 2, 67, 300, 32, 9, "blhd", True, 24, 0),
    (STRING(200, 128), 1, 32, 4, 1, 517, 64, 0, "cache", False, 0, 100),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=[f"{c[0]}-{c[4]}x{c[5]}" for c in LOW_PRECISION_CASES])
def test_low_precision_within_sdpa_error(case, dtype):
    check_low_precision(case, dtype, "cpu")


def check_low_precision(case, dtype, device):
    """The dense op on ``device`` in ``dtype`` within twice SDPA's error, inputs and references on the CPU."""
    method, batch, q_heads, kv_heads, q_len, k_len, dim, pad, layout, interleaved, rotary_dim, logn = case
    q, k, v, qp, kp = make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype, pad=pad,
                                  seed=LOW_PRECISION_CASES.index(case))
    inv_freq = inv_freq_of(rotary_dim or dim)
    dq, dk, dv, dqp, dkp, df = (t.to(device) for t in (q, k, v, qp, kp, inv_freq))
    out, lse = ops.rerope_attention(as_layout(dq, layout if layout != "cache" else "contiguous"),
                                    as_layout(dk, layout), as_layout(dv, layout), dqp, dkp, df, method.window,
                                    logn_length=logn, interleaved=interleaved, **method.kw)
    assert out.dtype == dtype and out.is_contiguous() and out.device.type == device
    ref_out, ref_lse = method.reference(q, k, v, qp, kp, inv_freq, logn_length=logn, interleaved=interleaved)
    assert_within_sdpa_error(out.cpu(), lse.cpu(), ref_out, ref_lse,
                             method_sdpa_error(method, q, k, v, qp, kp, inv_freq, (ref_out, ref_lse), logn_length=logn,
                                               interleaved=interleaved))


def method_sdpa_error(method, q, k, v, qp, kp, inv_freq, ref, **kw):
    """The error PyTorch's SDPA makes in q's dtype on these inputs: the larger of plain RoPE attention's (the shared
    rule, ``sdpa_error``) and that of the method itself computed by PyTorch's SDPA (the composite: two SDPA calls in
    the dtype, as the methods' authors compute them), each ``(out, lse)`` against its float64 reference. RoPE's alone
    is a baseline of another attention pattern: a method whose far side sharpens a row (STRING, Self-Extend) can
    exceed twice it on some inputs while staying within the composite's (measured: STRING 2.5x RoPE's, 1.7x the
    composite's, on seed 4 of the bf16 partial-rotary case)."""
    rope = sdpa_error(q, k, v, qp, kp, inv_freq, **kw)
    out, lse = ops.rerope_attention_composite(q, k, v, qp, kp, inv_freq, method.window, **kw, **method.kw)
    rows = torch.isfinite(ref[1])
    own = ((out.double() - ref[0]).abs()[rows].max().item(), (lse.double() - ref[1]).abs()[rows].max().item())
    return max(rope[0], own[0]), max(rope[1], own[1])


# ---------------------------------------------------------------------------------------------
# The paged op: packed requests (decode rows, chunked prefill, full prefill, empty), pages shuffled
# (support.paged.make_paged), each request's query i at position seq_len - q_len + i.

REQUESTS = [(1, 300), (0, 20), (5, 5), (70, 201), (3, 131), (130, 130), (1, 1)]
PAGED_METHODS = [SE(5, group=3), SE(40, group=4), DCA(24, 5), DCA(40, 0), DCA(30, 20), STRING(40, 8), STRING(5, 0)]


def paged_reference(method, q, dense, requests, inv_freq, logn_length=0, interleaved=False):
    """(out [T, Hq, D], lse [T, Hq]) in float64: each request's dense keys through the method's reference."""
    total, q_heads, dim = q.shape
    out = torch.zeros(total, q_heads, dim, dtype=torch.float64)
    lse = torch.full((total, q_heads), -math.inf, dtype=torch.float64)
    start = 0
    for (q_len, seq), (k, v) in zip(requests, dense):
        if q_len:
            kp = torch.arange(seq)[None]
            o, l = method.reference(q[start : start + q_len].transpose(0, 1)[None], k[None], v[None],
                                    kp[:, seq - q_len :], kp, inv_freq, logn_length=logn_length,
                                    interleaved=interleaved)
            out[start : start + q_len], lse[start : start + q_len] = o[0].transpose(0, 1), l[0].transpose(0, 1)
        start += q_len
    return out, lse


@pytest.mark.parametrize("block_size", [16, 13])
@pytest.mark.parametrize("method", PAGED_METHODS, ids=str)
def test_paged_float32_matches_reference(method, block_size):
    index = PAGED_METHODS.index(method)
    q_heads, kv_heads = ((4, 2), (8, 1), (2, 2))[index % 3]
    logn_length, interleaved = (0, 40)[index % 2], index == 2
    inputs, dense = make_paged(REQUESTS, q_heads, kv_heads, 16, block_size, seed=index,
                               q_layout=("contiguous", "strided", "head_major")[index % 3])
    inv_freq = inv_freq_of(16)
    ref = paged_reference(method, inputs[0], dense, REQUESTS, inv_freq, logn_length, interleaved)
    for name, path in {"native": ops.rerope_attention_paged, "composite": ops.rerope_attention_paged_composite}.items():
        out, lse = path(*inputs, inv_freq, method.window, logn_length=logn_length, interleaved=interleaved,
                        **method.kw)
        assert out.shape == inputs[0].shape and lse.dtype == torch.float32, name
        assert_close_to(out, lse, *ref)


@dataclasses.dataclass(frozen=True)
class ReRoPE:
    """(Leaky) ReRoPE with Method's interface, for the tests that run every region rule."""

    window: int
    leaky_k: float = 0.0

    def __str__(self):
        return f"rerope-w{self.window}-k{self.leaky_k:g}"

    @property
    def kw(self):
        return dict(leaky_k=self.leaky_k)

    def reference(self, q, k, v, qp, kp, inv_freq, scale=None, logn_length=0, causal=True, interleaved=False):
        return reference(q, k, v, qp, kp, inv_freq, self.window, self.leaky_k, scale, logn_length, causal, interleaved)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("method", [ReRoPE(300), ReRoPE(300, 4.0), SE(300, group=3), DCA(700, 60)], ids=str)
def test_decode_plan_every_work_split(method, threads):
    """The decode plan splits a call into units of (request, span of kv heads, chunk of key blocks), their
    number following the thread count (about 8 units a thread): with three kv heads and 19 blocks of 128
    keys, 1 and 2 threads put every kv head in one unit, 3 threads spans of two heads and a shorter last one,
    5 threads one head per unit. Every split must give the reference (pages of 16 slots, 1 to 4 query
    rows)."""
    requests = [(1, 1300), (4, 700), (2, 129)]
    inputs, dense = make_paged(requests, 6, 3, 32, 16, seed=threads)
    inv_freq = inv_freq_of(32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = ops.rerope_attention_paged(*inputs, inv_freq, method.window, logn_length=900, **method.kw)
    finally:
        torch.set_num_threads(before)
    assert_close_to(out, lse, *paged_reference(method, inputs[0], dense, requests, inv_freq, logn_length=900))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("method", [SE(40, group=4), DCA(24, 5), STRING(40, 8)], ids=str)
def test_paged_low_precision_within_sdpa_error(method, dtype):
    check_paged_low_precision(method, dtype, [(1, 300), (70, 201), (3, 131), (130, 130)], "cpu")


def check_paged_low_precision(method, dtype, requests, device):
    """The paged op on ``device`` in ``dtype`` within twice SDPA's error over the requests' problems."""
    inputs, dense = make_paged(requests, 8, 2, 64, 16, dtype, seed=5)
    inv_freq = inv_freq_of(64)
    out, lse = ops.rerope_attention_paged(*(t.to(device) for t in (*inputs, inv_freq)), method.window, **method.kw)
    assert out.dtype == dtype and out.device.type == device
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = paged_reference(method, inputs[0], dense, requests, inv_freq)
    errors, start = [], 0
    for q_len, seq in requests:  # SDPA's error over the requests' problems
        kp = torch.arange(seq)[None]
        k, v = dense[len(errors)]
        errors.append(sdpa_error(inputs[0][start : start + q_len].transpose(0, 1)[None], k[None], v[None],
                                 kp[:, seq - q_len :], kp, inv_freq))
        start += q_len
    bound = (max(e[0] for e in errors), max(e[1] for e in errors))
    assert_within_sdpa_error(out[None], lse[None], ref_out[None], ref_lse[None], bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len,seq_len", [(1, 300), (4, 129), (77, 260)])
@pytest.mark.parametrize("method", [SE(5, group=3), DCA(30, 20)], ids=str)
def test_one_request_equals_the_dense_op_exactly(method, q_len, seq_len, dtype):
    """One kernel body for both ops: a request computes exactly what rerope_attention computes for it."""
    inputs, dense = make_paged([(q_len, seq_len)], 4, 2, 32, 16, dtype, seed=q_len)
    inv_freq = inv_freq_of(32)
    out, lse = ops.rerope_attention_paged(*inputs, inv_freq, method.window, logn_length=50, **method.kw)
    k, v = dense[0]
    kp = torch.arange(seq_len)[None]
    d_out, d_lse = ops.rerope_attention(inputs[0].transpose(0, 1)[None], k[None], v[None], kp[:, seq_len - q_len :],
                                        kp, inv_freq, method.window, logn_length=50, **method.kw)
    assert torch.equal(out, d_out[0].transpose(0, 1)) and torch.equal(lse, d_lse[0].transpose(0, 1))


def test_paged_workspace_overload_forwards_the_method():
    requests = [(1, 30), (9, 40), (5, 5)]
    inputs, _ = make_paged(requests, 4, 2, 64, 16, torch.bfloat16, seed=6)
    inv_freq = inv_freq_of(64)
    workspace = torch.zeros(ops.rerope_paged_workspace_bytes(15, 2, 64, torch.bfloat16), dtype=torch.uint8)
    for method in (SE(5, group=3), DCA(24, 5)):
        want = ops.rerope_attention_paged(*inputs, inv_freq, method.window, **method.kw)
        got = ops.rerope_attention_paged(*inputs, inv_freq, method.window, workspace=workspace, **method.kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        rerope_out = ops.rerope_attention_paged(*inputs, inv_freq, max(method.window, 1), workspace=workspace)[0]
        assert (rerope_out.float() - got[0].float()).abs().max() > 1e-2  # the method reached the kernel


# ---------------------------------------------------------------------------------------------
# The reference kernels (ROPESCALE_KERNELS=reference's functions, called directly here and routed once in a
# fresh process): the arguments reach the composite.


@pytest.mark.parametrize("method", [SE(5, group=3), DCA(24, 5)], ids=str)
def test_reference_kernel_functions(method):
    q, k, v, qp, kp = make_inputs(2, 4, 2, 70, 130, 16, torch.bfloat16, pad=5, seed=4)
    inv_freq = inv_freq_of(16)
    out, lse = reference_kernels.rerope_attention(q, k, v, qp, kp, inv_freq, method.window, **method.kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = method.reference(q, k, v, qp, kp, inv_freq)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=0)  # float32 math, out rounded to bf16
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    requests = [(1, 140), (0, 3), (30, 70), (12, 12)]
    inputs, dense = make_paged(requests, 4, 2, 16, 13, seed=4)
    ref = paged_reference(method, inputs[0], dense, requests, inv_freq, logn_length=20)
    assert_close_to(*reference_kernels.rerope_attention_paged(*inputs, inv_freq, method.window, logn_length=20,
                                                              **method.kw), *ref)
    workspace = torch.zeros(0, dtype=torch.uint8)
    assert_close_to(*reference_kernels.rerope_attention_paged_workspace(
        *inputs, inv_freq, method.window, logn_length=20, workspace=workspace, **method.kw), *ref)


def test_reference_kernels_route_the_arguments():
    script = textwrap.dedent("""
        import torch, ropescale
        from ropescale import ops
        from support.attention import make_inputs, reference_dual_chunk, reference_self_extend
        from support.paged import make_paged
        assert ropescale.build_info()["kernels"] == "reference"
        f = ops.default_inv_freq(16, 1e4)
        q, k, v, qp, kp = make_inputs(2, 4, 2, 40, 70, 16, pad=5)
        for got, want in (
                (ops.rerope_attention(q, k, v, qp, kp, f, 5, group=3), reference_self_extend(q, k, v, qp, kp, f, 5, 3)),
                (ops.rerope_attention(q, k, v, qp, kp, f, 5, chunk_size=24),
                 reference_dual_chunk(q, k, v, qp, kp, f, 24, 5))):
            torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=1e-5)
        (pq, kc, vc, table, lens, starts), dense = make_paged([(40, 70)], 4, 2, 16, 16)
        out, _ = ops.rerope_attention_paged(pq, kc, vc, table, lens, starts, f, 5, chunk_size=24)
        want = reference_dual_chunk(pq.transpose(0, 1)[None], dense[0][0][None], dense[0][1][None], kp[:1, 30:],
                                    torch.arange(70)[None], f, 24, 5)[0]
        torch.testing.assert_close(out.double(), want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        print("reference-ok")
    """)
    env = {**os.environ, "ROPESCALE_KERNELS": "reference", "PYTHONPATH": os.pathsep.join([str(TESTS)] + sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "reference-ok" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# The training path: Self-Extend through PyTorch's fused kernels (float64 and float32, gradients against the
# naive form's autograd), gradcheck; Dual Chunk Attention refused.


def grads_of(fn, q, k, v, g_out, g_lse):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0) * g_lse).sum()
    return (out, lse), torch.autograd.grad(loss, (q, k, v))


# batch, q heads, kv heads, q_len, k_len, dim, W, G, logn, left padding, interleaved, rotary_dim (0: dim)
TRAIN_CASES = [
    (2, 4, 2, 37, 37, 16, 7, 2, 0, 3, False, 0),
    (2, 4, 1, 20, 30, 16, 5, 3, 10, 4, False, 0),  # the last 20 queries of 30 keys
    (1, 2, 2, 70, 70, 12, 16, 5, 0, 0, True, 8),
    (1, 2, 1, 12, 12, 8, 1, 4, 0, 0, False, 0),  # W = 1
    (1, 2, 1, 9, 9, 8, 20, 2, 0, 0, False, 0),  # L < W: no grouped pair
]


def check_training_path(method, inputs, inv_freq, dtype, logn=0, interleaved=False):
    """The training path against the naive form's autograd in float64 (out, lse and the gradients of q, k, v) and
    against the method's float64 reference (out, lse)."""
    q, k, v, qp, kp = inputs
    kw = dict(logn_length=logn, interleaved=interleaved, **method.kw)
    gen = torch.Generator().manual_seed(7)
    g_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64)
    (out, lse), grads = grads_of(
        lambda q, k, v: rerope_attention_train(q, k, v, qp, kp, inv_freq, method.window, **kw),
        q, k, v, g_out.to(dtype), g_lse.to(dtype))
    (ref_out, ref_lse), ref_grads = grads_of(
        lambda q, k, v: rerope.rerope_attention_naive(q, k, v, qp, kp, inv_freq.double(), method.window, **kw),
        q.double(), k.double(), v.double(), g_out, g_lse)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[lse.isfinite()], ref_lse[ref_lse.isfinite()], atol=tol, rtol=tol)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=10 * tol, rtol=10 * tol, msg=f"d{name}")
    want = method.reference(q, k, v, qp, kp, inv_freq, logn_length=logn, interleaved=interleaved)
    torch.testing.assert_close(out.double(), want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[lse.isfinite()], want[1][want[1].isfinite()], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", TRAIN_CASES, ids=range(len(TRAIN_CASES)))
def test_self_extend_training_path(case, dtype):
    batch, q_heads, kv_heads, q_len, k_len, dim, window, group, logn, pad, interleaved, rotary_dim = case
    inputs = make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype, pad=pad, seed=TRAIN_CASES.index(case))
    check_training_path(SE(window, group=group), inputs,
                        inv_freq_of(rotary_dim or dim).to(dtype), dtype, logn, interleaved)


def test_self_extend_training_path_gradcheck():
    """Both outputs, through both regions, a padded batch row, G not dividing W."""
    q, k, v, qp, kp = make_inputs(2, 2, 1, 7, 9, 6, torch.float64, pad=2, seed=3)
    inv_freq = inv_freq_of(6).double()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq, 3, logn_length=3, group=2)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


# batch, q heads, kv heads, q_len, k_len, dim, S, W, left padding, interleaved, rotary_dim (0: dim)
STRING_TRAIN_CASES = [
    (2, 4, 2, 37, 37, 16, 7, 2, 3, False, 0),
    (2, 4, 1, 20, 30, 16, 5, 0, 4, False, 0),  # the last 20 queries of 30 keys; W = 0
    (1, 2, 2, 70, 70, 12, 16, 16, 0, True, 8),  # W = S: RoPE attention
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", STRING_TRAIN_CASES, ids=range(len(STRING_TRAIN_CASES)))
def test_string_training_path(case, dtype):
    """STRING through the training path (ReRoPE's far part with slope 1, starting at W), against the naive form's
    autograd and the authors' two-pass reference."""
    batch, q_heads, kv_heads, q_len, k_len, dim, shifted, local, pad, interleaved, rotary_dim = case
    inputs = make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype, pad=pad,
                         seed=STRING_TRAIN_CASES.index(case))
    check_training_path(STRING(shifted, local), inputs,
                        inv_freq_of(rotary_dim or dim).to(dtype), dtype, interleaved=interleaved)


def test_string_training_path_gradcheck():
    """Both outputs, through both sides, a padded batch row, W < S."""
    q, k, v, qp, kp = make_inputs(2, 2, 1, 7, 9, 6, torch.float64, pad=2, seed=3)
    inv_freq = inv_freq_of(6).double()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq, 3, **STRING(3, 1).kw)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("shifted", [1, 6, 64])
def test_string_local_value_at_the_offset_is_rope_attention(shifted):
    """W = S shifts nothing: RoPE attention; and W < S differs from it once some distance reaches S."""
    q, k, v, qp, kp = make_inputs(1, 4, 2, 80, 80, 16, seed=shifted)
    inv_freq = inv_freq_of(16)
    rope = reference(q.double(), k.double(), v.double(), qp, kp, inv_freq.double(), ROPE)
    assert_close_to(*ops.rerope_attention(q, k, v, qp, kp, inv_freq, shifted, **STRING(shifted, shifted).kw), *rope)
    out, _ = ops.rerope_attention(q, k, v, qp, kp, inv_freq, shifted, **STRING(shifted, shifted - 1).kw)
    assert (out.double() - rope[0]).abs().max() > 1e-3


def test_string_is_leaky_rerope_with_slope_one_shifted():
    """The far rule, written out: a pair at distance d >= S sees d - S + W, so against a single-pair brute force
    (one key per query, whose score alone sets the lse) the rotation is at that distance exactly."""
    q, k, v, qp, kp = make_inputs(1, 1, 1, 1, 200, 8, torch.float64, seed=2)
    inv_freq = inv_freq_of(8).double()
    shifted, local = 50, 7
    for j in (0, 100, 150, 151, 199):  # d = 199, 99, 49 (near), 48 (near), 0
        out, lse = ops.rerope_attention_composite(q, k[:, :, j:j + 1], v[:, :, j:j + 1], qp, kp[:, j:j + 1], inv_freq,
                                                  shifted, **STRING(shifted, local).kw)
        d = 199 - j
        r = d if d < shifted else d - shifted + local
        rotated = reference(q, k[:, :, j:j + 1], v[:, :, j:j + 1], torch.tensor([[r]]), torch.tensor([[0]]), inv_freq,
                            ROPE)
        torch.testing.assert_close(lse, rotated[1], atol=1e-12, rtol=1e-12)


def test_self_extend_training_fallback_keeps_the_group():
    """Inputs outside the training layout (non-causal, arbitrary positions) take the composite, as Self-Extend."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 30, 50, 16, pad=3, seed=5)
    inv_freq = inv_freq_of(16)
    method = SE(6, group=4)
    with warnings.catch_warnings():  # the fallback's warning, once per process (another test may have had it)
        warnings.simplefilter("ignore")
        out, lse = rerope_attention_train(q.requires_grad_(), k, v, qp, kp, inv_freq, 6, causal=False, group=4)
    assert_close_to(out.detach(), lse, *method.reference(q, k, v, qp, kp, inv_freq, causal=False))
    shuffled = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    out, lse = rerope_attention_train(q, k[:, :, shuffled], v[:, :, shuffled], qp, kp[:, shuffled], inv_freq, 6,
                                      group=4)
    assert_close_to(out.detach(), lse, *method.reference(q, k, v, qp, kp, inv_freq))


@pytest.mark.parametrize("method", [SE(3, group=2), DCA(5, 1)], ids=str)
def test_composite_gradcheck(method):
    q, k, v, qp, kp = make_inputs(2, 2, 1, 6, 11, 4, torch.float64, pad=2, seed=1)
    inv_freq = inv_freq_of(4).double()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        out, lse = ops.rerope_attention_composite(q, k, v, qp, kp, inv_freq, method.window, **method.kw)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_dual_chunk_has_no_training_path():
    q, k, v, qp, kp = make_inputs(1, 2, 1, 12, 12, 8)
    with pytest.raises(NotImplementedError, match="Dual Chunk Attention .* no training path.*training-free"):
        rerope_attention_train(q.requires_grad_(), k, v, qp, kp, inv_freq_of(8), 2, chunk_size=6)


# ---------------------------------------------------------------------------------------------
# opcheck (schema, fake kernel, autograd registration, torch.compile) with the new arguments.


def _dense_samples():
    q, k, v, qp, kp = make_inputs(2, 4, 2, 9, 13, 8, pad=3)
    f = inv_freq_of(8)
    yield "se", (q, k, v, qp, kp, f, 3), {"group": 2}
    yield "se-noncausal", (q, k, v, qp, kp, f, 3, 0.0, 0.5, 5, False, True), {"group": 3}
    yield "dca-decode", (q[:, :, -1:], k, v, qp[:, -1:], kp, f, 0), {"chunk_size": 4}
    yield "dca-bf16", (q.bfloat16(), k.bfloat16(), v.bfloat16(), qp, kp, f, 2), {"chunk_size": 5}


@pytest.mark.parametrize("args,kwargs", [s[1:] for s in _dense_samples()], ids=[s[0] for s in _dense_samples()])
def test_opcheck_dense(args, kwargs):
    opcheck(torch.ops.ropescale.rerope_attention.default, args, kwargs)


def test_opcheck_paged():
    inputs, _ = make_paged([(1, 9), (0, 4), (6, 6), (3, 20)], 4, 2, 8, 4, seed=1)
    f = inv_freq_of(8)
    opcheck(torch.ops.ropescale.rerope_attention_paged.default, inputs + (f, 3), {"group": 2, "logn_length": 5})
    opcheck(torch.ops.ropescale.rerope_attention_paged.default, inputs + (f, 1), {"chunk_size": 4})
    bf16 = tuple(t.bfloat16() for t in inputs[:3]) + inputs[3:]
    workspace = torch.zeros(ops.rerope_paged_workspace_bytes(10, 2, 8, torch.bfloat16), dtype=torch.uint8)
    opcheck(torch.ops.ropescale.rerope_attention_paged.workspace, bf16 + (f, 2),
            {"chunk_size": 5, "workspace": workspace})


# ---------------------------------------------------------------------------------------------
# Bad parameters: the op (CPU), its fake kernel (FakeTensorMode), and every plain-PyTorch path refuse each row
# with one message, naming the argument.

_g = torch.Generator().manual_seed(0)
BQ, BK, BV = (torch.randn(2, h, 5, 8, generator=_g) for h in (4, 2, 2))
BPOS = torch.arange(5).expand(2, 5).contiguous()
BF = inv_freq_of(8)

# id, (window, leaky_k, group, chunk_size, causal[, far_start]), what the message must name
BAD = [
    ("group -1", (3, 0.0, -1, 0, True), "group"),
    ("chunk_size -2", (3, 0.0, 0, -2, True), "chunk_size"),
    ("group and chunk_size", (3, 0.0, 2, 8, True), "group.*chunk_size|chunk_size.*group"),
    ("self-extend leaky", (3, 8.0, 2, 0, True), "leaky_k"),
    ("dual chunk leaky", (3, 8.0, 0, 8, True), "leaky_k"),
    ("local_size = chunk_size", (8, 0.0, 0, 8, True), "window|local_size"),
    ("local_size > chunk_size", (9, 0.0, 0, 8, True), "window|local_size"),
    ("local_size -1", (-1, 0.0, 0, 8, True), "window|local_size"),
    ("dual chunk not causal", (2, 0.0, 0, 8, False), "causal"),
    ("self-extend window 0", (0, 0.0, 2, 0, True), "window"),
    ("self-extend window -4", (-4, 0.0, 2, 0, True), "window"),
    # STRING's far_start (the far side's first relative position): in [0, window], ReRoPE's rule only
    ("far_start past the window", (3, 1.0, 0, 0, True, 4), "far_start"),
    ("far_start -2", (3, 1.0, 0, 0, True, -2), "far_start"),
    ("far_start with self-extend", (3, 0.0, 2, 0, True, 1), "far_start"),
    ("far_start with dual chunk", (3, 0.0, 0, 8, True, 1), "far_start"),
]


def _dense_call(fn, params, tensors=(BQ, BK, BV, BPOS, BPOS, BF)):
    window, leaky_k, group, chunk_size, causal, far_start = (*params, -1)[:6]
    return lambda: fn(*tensors, window, leaky_k, -1.0, 0, causal, False, group=group, chunk_size=chunk_size,
                      far_start=far_start)


def _message(call):
    with pytest.raises((RuntimeError, ValueError)) as info:
        call()
    return info.type, str(info.value).splitlines()[0]


@pytest.mark.parametrize("params,names", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_parameters_dense(params, names):
    kind, message = _message(_dense_call(torch.ops.ropescale.rerope_attention, params))
    assert message.startswith("rerope_attention: ") and re.search(names, message), message
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(t) for t in (BQ, BK, BV, BPOS, BPOS, BF))
        assert _message(_dense_call(torch.ops.ropescale.rerope_attention, params, fake)) == (kind, message)
    for fn in (ops.rerope_attention, ops.rerope_attention_composite, rerope.rerope_attention_naive,
               rerope_attention_train, reference_kernels.rerope_attention):
        assert _message(_dense_call(fn, params)) == (kind, message), fn.__name__
    bf16 = tuple(t.bfloat16() for t in (BQ, BK, BV)) + (BPOS, BPOS, BF)
    assert _message(_dense_call(ops.rerope_attention, params, bf16)) == (kind, message)


PQ = torch.randn(6, 4, 8, generator=_g)
PK, PV = torch.randn(5, 2, 4, 8, generator=_g), torch.randn(5, 2, 4, 8, generator=_g)
PMETA = (torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32), torch.tensor([9, 7]), torch.tensor([0, 1, 6]))


def _paged_call(fn, params, tensors=(PQ, PK, PV, *PMETA, BF), **extra):
    window, leaky_k, group, chunk_size, _, far_start = (*params, -1)[:6]
    return lambda: fn(*tensors, window, leaky_k, -1.0, None, 0, False, group=group, chunk_size=chunk_size,
                      far_start=far_start, **extra)


@pytest.mark.parametrize("params,names", [b[1:] for b in BAD if b[1][4]], ids=[b[0] for b in BAD if b[1][4]])
def test_bad_parameters_paged(params, names):
    kind, message = _message(_paged_call(torch.ops.ropescale.rerope_attention_paged, params))
    assert message.startswith("rerope_attention_paged: ") and re.search(names, message), message
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(t) for t in (PQ, PK, PV, *PMETA, BF))
        assert _message(_paged_call(torch.ops.ropescale.rerope_attention_paged, params, fake)) == (kind, message)
    workspace = torch.zeros(64, dtype=torch.uint8)
    assert _message(_paged_call(torch.ops.ropescale.rerope_attention_paged.workspace, params,
                                workspace=workspace)) == (kind, message)
    for fn in (ops.rerope_attention_paged, ops.rerope_attention_paged_composite,
               reference_kernels.rerope_attention_paged):
        assert _message(_paged_call(fn, params)) == (kind, message), fn.__name__


@pytest.mark.parametrize("method", [SE(4, group=2), DCA(8, 0), DCA(8, 7), STRING(3, 0), STRING(3, 3)], ids=str)
def test_good_parameters_are_taken_by_every_check(method):
    """The corners of the accepted range pass the op's checks (and the fake kernel's)."""
    for fn in (ops.rerope_attention_composite, rerope.rerope_attention_naive):
        fn(BQ, BK, BV, BPOS, BPOS, BF, method.window, **method.kw)
    ops.rerope_attention(BQ, BK, BV, BPOS, BPOS, BF, method.window, **method.kw)
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(t) for t in (BQ, BK, BV, BPOS, BPOS, BF))
        torch.ops.ropescale.rerope_attention(*fake, method.window, **method.kw)


# ---------------------------------------------------------------------------------------------
# CUDA (run where a GPU exists): the same grids through the CUDA kernels (SIMT in float32, tensor cores in
# fp16/bf16 at head dims 64-128), inputs and references made on the CPU as above.


def on_cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


@pytest.mark.cuda
@pytest.mark.parametrize("method,shape", GRID, ids=[f"{m}-{s}" for m, s in GRID])
def test_cuda_float32_matches_reference(method, shape):
    inputs, kw = grid_case(method, shape, (16, 64, 128))
    out, lse = ops.rerope_attention(*on_cuda(*inputs), method.window, **kw, **method.kw)
    assert out.is_cuda and lse.is_cuda
    assert_close_to(out.cpu(), lse.cpu(), *method.reference(*inputs, **kw), tol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=[f"{c[0]}-{c[4]}x{c[5]}" for c in LOW_PRECISION_CASES])
def test_cuda_low_precision_within_sdpa_error(case, dtype):
    check_low_precision(case, dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("method", PAGED_METHODS, ids=str)
def test_cuda_paged_float32_matches_reference(method, dim):
    index = PAGED_METHODS.index(method)
    inputs, dense = make_paged(REQUESTS, 4, 2, dim, 16, seed=index)
    inv_freq = inv_freq_of(dim)
    out, lse = ops.rerope_attention_paged(*on_cuda(*inputs, inv_freq), method.window, **method.kw)
    assert_close_to(out.cpu(), lse.cpu(), *paged_reference(method, inputs[0], dense, REQUESTS, inv_freq), tol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("method", [SE(40, group=4), DCA(24, 5), DCA(200, 30)], ids=str)
def test_cuda_paged_low_precision_within_sdpa_error(method, dtype):
    """Prefill rows through the tensor-core paged kernel, decode rows through the SIMT one."""
    check_paged_low_precision(method, dtype, [(1, 300), (70, 201), (3, 131), (130, 130), (257, 400)], "cuda")
