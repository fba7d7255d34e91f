"""rerope_attention: the fused op (CPU; CUDA when a GPU exists) against a float64 two-matrix
reference, decode consistency with PreRopeCache, the SDPA limit, the composite path (agreement and
gradcheck), memory, opcheck and bad input."""

import itertools
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import ropescale
from ropescale import ops
from ropescale.cache import PreRopeCache
from support import TESTS
from support.attention import (BASE, as_layout, assert_within_sdpa_error, make_inputs, poison, reference, reference_ieee,
                               rot64, sdpa_cannot_pack, sdpa_error)


def assert_matches_reference(out, lse, ref_out, ref_lse, atol, rtol, lse_atol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    # -inf exactly where the reference has no visible key
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=lse_atol, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The reference itself: the two-matrix form equals the definition score(i,j) = <rot(q_i, r(d)), k_j>.


@pytest.mark.parametrize("leaky_k", [0.0, 4.0])
def test_reference_matches_relative_position_definition(leaky_k):
    q, k, v, qp, kp = make_inputs(1, 2, 1, 9, 9, 6, torch.float64, seed=3)
    inv_freq = ops.default_inv_freq(6, BASE).double()
    window = 3
    scores = torch.empty(1, 2, 9, 9, dtype=torch.float64)
    for i, j in itertools.product(range(9), range(9)):
        d = int(qp[0, i] - kp[0, j])
        r = d if d < window else window + (d - window) * (1 / leaky_k if leaky_k else 0.0)
        rq = rot64(q[:, :, i : i + 1], torch.tensor([[r]], dtype=torch.float64), inv_freq)
        scores[:, :, i, j] = (rq[:, :, 0] * k[:, 0, j][:, None]).sum(-1) / math.sqrt(6)
    scores = scores.masked_fill(kp[:, None, None, :] > qp[:, None, :, None], -math.inf)
    out = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, leaky_k)
    torch.testing.assert_close(ref_out, out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ref_lse, torch.logsumexp(scores, -1), atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# The grid: ReRoPE / Leaky x windows x log-n x GQA x causal (float32), odd lengths, left padding.

WINDOWS = (1, 7, 64, 10_000)
LEAKY = (0.0, 16.0, 64.0)
GQA = ((1, 1), (2, 1), (4, 1), (8, 1))  # (q heads per kv head, kv heads)
GRID = list(itertools.product(LEAKY, WINDOWS, (0, 50), GQA, (True, False)))


@pytest.mark.parametrize("leaky_k,window,logn_length,gqa,causal", GRID)
def test_cpu_matches_reference_grid(leaky_k, window, logn_length, gqa, causal):
    index = GRID.index((leaky_k, window, logn_length, gqa, causal))
    group, kv_heads = gqa
    q_len, k_len = [(37, 37), (150, 150), (1, 131), (70, 201)][index % 4]  # odd; > 1 key/query block
    dim = (16, 10, 32)[index % 3]
    q, k, v, qp, kp = make_inputs(2, group * kv_heads, kv_heads, q_len, k_len, dim, pad=index % 3 * 5, seed=index)
    inv_freq = ops.default_inv_freq(dim, BASE)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal)
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal)
    assert_matches_reference(out, lse, ref_out, ref_lse, atol=1e-5, rtol=1e-5, lse_atol=1e-5)


# The decode plan (up to 4 query rows): GQA heads share one pass over the cache, keys split in
# chunks merged by lse. Caches long enough for several chunks per head, read in place from a
# strided view (a cache with spare capacity), in every dtype.
DECODE_GRID = list(itertools.product((1, 2, 4), (0.0, 16.0), (1, 64, 10_000), ((1, 1), (4, 2), (8, 1)), (True, False)))


@pytest.mark.parametrize("q_len,leaky_k,window,gqa,causal", DECODE_GRID)
def test_cpu_decode_matches_reference(q_len, leaky_k, window, gqa, causal):
    index = DECODE_GRID.index((q_len, leaky_k, window, gqa, causal))
    group, kv_heads = gqa
    dtype = (torch.float32, torch.bfloat16, torch.float16)[index % 3]
    k_len, dim = (1100, 130, 517)[index % 3], (32, 18, 64)[index % 3]
    q, k, v, qp, kp = make_inputs(2, group * kv_heads, kv_heads, q_len, k_len, dim, dtype, pad=index % 2 * 37,
                                  seed=index)
    spare = torch.zeros(2, kv_heads, k_len + 9, dim, dtype=dtype)
    k_view, v_view = spare.clone()[:, :, :k_len], spare.clone()[:, :, 3 : k_len + 3]
    k_view.copy_(k), v_view.copy_(v)
    inv_freq = ops.default_inv_freq(dim, BASE)
    out, lse = ops.rerope_attention(q, k_view, v_view, qp, kp, inv_freq, window, leaky_k, causal=causal,
                                    logn_length=40 if index % 2 else 0)
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, leaky_k, causal=causal,
                                 logn_length=40 if index % 2 else 0)
    if dtype == torch.float32:
        assert_matches_reference(out, lse, ref_out, ref_lse, atol=1e-5, rtol=1e-5, lse_atol=1e-5)
    else:
        # A handful of rows is too few for an error statistic (test_cpu_low_precision_grid judges
        # decode-sized problems with enough heads); here the decode plan must give what the prefill
        # plan gives for the same rows: a padding query row (position -1) makes it 5 rows.
        q_ext = torch.cat((q, q[:, :, :1].expand(-1, -1, 5 - q_len, -1)), 2)
        qp_ext = torch.cat((qp, torch.full((2, 5 - q_len), -1)), 1)
        p_out, p_lse = ops.rerope_attention(q_ext, k_view, v_view, qp_ext, kp, inv_freq, window, leaky_k,
                                            causal=causal, logn_length=40 if index % 2 else 0)
        assert_same_rounding(out, lse, p_out[:, :, :q_len], p_lse[:, :, :q_len], v, same_key_blocks=False)


# ---------------------------------------------------------------------------------------------
# float16 / bfloat16 (DESIGN.md, "Versions and precision"): the rotated q/k operands and the
# probabilities before P.V are rounded to the input dtype, as SDPA and FlashAttention round them,
# with float32 accumulation, on the same path at every size. Judged against float64 relative to the
# error PyTorch's own SDPA makes in that dtype on the same inputs (SDPA_ERROR_FACTOR x sdpa_error, in
# support/attention.py, which says why the factor is 2).


def assert_same_rounding(out, lse, other_out, other_lse, v, same_key_blocks):
    """Two runs of the op over the same rows rounded the same operands: the lse (which the rounded
    probabilities do not enter) agrees to float32 summation order (observed <= 5e-7), far below what
    rounding q or k moves it by (about 1e-3). When the rows meet the keys in the same blocks (the
    prefill plan with other query rows around them), the probabilities are the same too and out
    agrees up to its own rounding; otherwise (the decode plan's chunks, keys shifted across blocks)
    each probability is rounded against another running maximum, which moves out by at most
    2u max|v| (u: the dtype's unit roundoff)."""
    assert torch.equal(torch.isinf(lse), torch.isinf(other_lse))
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse[finite], other_lse[finite], atol=2e-5, rtol=0)
    u = torch.finfo(out.dtype).eps / 2
    atol = 2 * u * out.abs().max().item() + (0.0 if same_key_blocks else 2 * u * v.abs().max().item())
    torch.testing.assert_close(out.float(), other_out.float(), atol=atol, rtol=0)


# batch, q heads, kv heads, q_len, k_len, dim, left padding, leaky_k, window, logn_length, causal, layout,
# interleaved, rotary_dim (0: dim). Odd sizes, sizes at the 128-token block edges, the decode plan
# (q_len <= 4) with many heads so that every problem has >= 64 rows.
LOW_PRECISION_CASES = [
    (2, 4, 2, 67, 140, 32, 9, 0.0, 7, 0, True, "contiguous", False, 0),
    (2, 4, 2, 67, 140, 32, 9, 16.0, 64, 0, True, "blhd", False, 0),
    (2, 4, 2, 67, 140, 32, 9, 0.0, 1, 0, False, "contiguous", False, 0),
    (1, 8, 1, 129, 129, 64, 0, 64.0, 10_000, 0, True, "contiguous", False, 0),
    (1, 4, 1, 128, 128, 80, 0, 0.0, 50, 30, True, "blhd", False, 0),
    (1, 2, 2, 127, 257, 128, 5, 16.0, 100, 100, True, "contiguous", False, 0),
    (2, 2, 1, 256, 256, 96, 20, 0.0, 130, 0, False, "blhd", False, 0),
    (2, 4, 2, 50, 90, 32, 3, 0.0, 9, 0, True, "contiguous", True, 24),
    (1, 2, 1, 40, 200, 256, 0, 16.0, 64, 0, True, "contiguous", False, 0),
    (1, 16, 2, 5, 300, 64, 0, 0.0, 33, 0, True, "contiguous", False, 0),
    (2, 32, 4, 1, 1100, 64, 37, 0.0, 64, 0, True, "cache", False, 0),
    (2, 16, 2, 4, 517, 18, 0, 16.0, 1, 40, True, "cache", False, 0),
    (2, 16, 16, 2, 130, 32, 11, 0.0, 7, 0, False, "cache", False, 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=range(len(LOW_PRECISION_CASES)))
def test_cpu_low_precision_grid(dtype, case):
    batch, q_heads, kv_heads, q_len, k_len, dim, pad, leaky_k, window, logn_length, causal, layout, interleaved, \
        rotary_dim = case
    q, k, v, qp, kp = make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype, pad=pad,
                                  seed=LOW_PRECISION_CASES.index(case))
    inv_freq = ops.default_inv_freq(rotary_dim or dim, BASE)
    kw = dict(leaky_k=leaky_k, logn_length=logn_length, causal=causal, interleaved=interleaved)
    out, lse = ops.rerope_attention(as_layout(q, layout if layout != "cache" else "contiguous"),
                                    as_layout(k, layout), as_layout(v, layout), qp, kp, inv_freq, window, **kw)
    assert out.dtype == dtype and out.is_contiguous()
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, **kw)
    sdpa_err = sdpa_error(q, k, v, qp, kp, inv_freq, logn_length=logn_length, causal=causal, interleaved=interleaved)
    assert_within_sdpa_error(out, lse, ref_out, ref_lse, sdpa_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_low_precision_same_path_at_every_size(dtype):
    """No size-dependent precision: the same rows computed as part of problems of every size (the
    decode plan up to 4 query rows, the prefill plan from 5, query blocks of 128 cut anywhere, key
    blocks of 128 cut anywhere) round the same operands."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 300, 300, 64, dtype, pad=20, seed=13)
    inv_freq = ops.default_inv_freq(64, BASE)
    kw = dict(leaky_k=16.0, logn_length=100)
    window = 40
    full_out, full_lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, window, **kw)
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, **kw)
    assert_within_sdpa_error(full_out, full_lse, ref_out, ref_lse,
                             sdpa_error(q, k, v, qp, kp, inv_freq, logn_length=100))
    # The last q_len rows alone: around the decode / prefill switch and the query block size.
    for q_len in (1, 2, 4, 5, 6, 127, 128, 129, 256):
        out, lse = ops.rerope_attention(q[:, :, -q_len:], k, v, qp[:, -q_len:], kp, inv_freq, window, **kw)
        assert_same_rounding(out, lse, full_out[:, :, -q_len:], full_lse[:, :, -q_len:], v, same_key_blocks=q_len > 4)
    # The rows of tokens 0..126 against 127 keys, then with invisible (padding) keys that push the
    # keys past one 128-key block (after them and before them).
    k_short, v_short, kp_short = k[:, :, 20:147], v[:, :, 20:147], kp[:1, 20:147].expand(2, -1)
    q_rows, qp_rows = q[:, :, 60:147], kp[:1, 60:147].expand(2, -1)
    base_out, base_lse = ops.rerope_attention(q_rows, k_short, v_short, qp_rows, kp_short, inv_freq, window, **kw)
    for extra in (1, 2, 130):
        k_pad, v_pad = k[:, :, :extra], v[:, :, :extra]
        kp_pad = torch.full((2, extra), -1)
        for keys, values, positions in (
                (torch.cat((k_short, k_pad), 2), torch.cat((v_short, v_pad), 2), torch.cat((kp_short, kp_pad), 1)),
                (torch.cat((k_pad, k_short), 2), torch.cat((v_pad, v_short), 2), torch.cat((kp_pad, kp_short), 1))):
            out, lse = ops.rerope_attention(q_rows, keys, values, qp_rows, positions, inv_freq, window, **kw)
            assert_same_rounding(out, lse, base_out, base_lse, v, same_key_blocks=False)
            out, lse = ops.rerope_attention(q_rows[:, :, -3:], keys, values, qp_rows[:, -3:], positions, inv_freq,
                                            window, **kw)
            assert_same_rounding(out, lse, base_out[:, :, -3:], base_lse[:, :, -3:], v, same_key_blocks=False)


# The CPU kernel is built once per instruction set (DEFAULT, AVX2, AVX512) and picked at run time;
# each variant, forced with ATEN_CPU_CAPABILITY in a fresh process, against the reference. Row
# lengths that are not a multiple of any vector width exercise the vector bodies and the remainders.

_VARIANT_SCRIPT = """
import sys, torch, ropescale
from ropescale import ops
sys.path.insert(0, sys.argv[2])
from support.attention import make_inputs, BASE
results = {"torch": torch.backends.cpu.get_cpu_capability(), "ropescale": ropescale._C.rerope_attention_cpu_isa(),
           "cases": []}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for q_len, k_len, dim, leaky_k in ((37, 150, 80, 16.0), (2, 300, 18, 0.0)):
        q, k, v, qp, kp = make_inputs(2, 16, 4, q_len, k_len, dim, dtype, pad=11, seed=q_len)
        inv_freq = ops.default_inv_freq(dim, BASE)
        out = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 20, leaky_k, logn_length=30)
        results["cases"].append(((q, k, v, qp, kp, inv_freq, 20, leaky_k), out))
torch.save(results, sys.argv[1])
"""


def test_every_cpu_instruction_set_variant(tmp_path):
    from pathlib import Path

    # torch trusts ATEN_CPU_CAPABILITY as given (it does not check the CPU), so only the instruction
    # sets this CPU runs are forced: DEFAULT and AVX2 on an AVX2 machine, AVX512 too where it exists.
    native = torch.backends.cpu.get_cpu_capability()
    variants = {}
    for isa in ["default", "avx2", "avx512"][: {"AVX2": 2, "AVX512": 3}.get(native, 1)]:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "PYTHONPATH": str(Path(ops.__file__).parents[1])}
        subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT, str(tmp_path / f"{isa}.pt"), str(TESTS)],
                       env=env, check=True)
        results = torch.load(tmp_path / f"{isa}.pt")
        # The variant torch uses for its own kernels under this setting is the one ropescale runs
        # (x86 builds have AVX2 and AVX512 variants; anything else runs the DEFAULT one).
        expected = results["torch"] if results["torch"] in ("AVX2", "AVX512") else "DEFAULT"
        assert results["ropescale"] == expected, results
        for (q, k, v, qp, kp, inv_freq, window, leaky_k), (out, lse) in results["cases"]:
            ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, leaky_k, logn_length=30)
            if q.dtype == torch.float32:
                assert_matches_reference(out, lse, ref_out, ref_lse, atol=1e-5, rtol=1e-5, lse_atol=1e-5)
            else:
                assert_within_sdpa_error(out, lse, ref_out, ref_lse,
                                         sdpa_error(q, k, v, qp, kp, inv_freq, logn_length=30))
        variants[results["ropescale"]] = results["cases"]
    assert "DEFAULT" in variants and (native not in ("AVX2", "AVX512") or native in variants)
    # Every variant rounds the same operands (to nearest even): their lse agree to float32 order in
    # almost every row. Not in all: the variants rotate with and without FMA, and a rotated value one
    # float32 ulp apart can round to the neighbouring bf16/fp16 value (0.8% of the rows here); an
    # operand left unrounded would move nearly every row by ~1e-3.
    for cases in variants.values():
        for (args, (out, lse)), (_, (out0, lse0)) in zip(cases, variants["DEFAULT"]):
            finite = torch.isfinite(lse0)
            assert torch.equal(finite, torch.isfinite(lse))
            moved = (lse[finite] - lse0[finite]).abs() > 2e-5
            assert moved.double().mean() < 0.05, f"{args[0].dtype}: {moved.sum()} of {moved.numel()} rows"


@pytest.mark.parametrize("dim", [2, 64, 128, 256])
def test_head_dims(dim):
    q, k, v, qp, kp = make_inputs(1, 2, 1, 21, 45, dim, seed=dim)
    inv_freq = ops.default_inv_freq(dim, BASE)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 9, 16.0)
    assert_matches_reference(out, lse, *reference(q, k, v, qp, kp, inv_freq, 9, 16.0), 1e-5, 1e-5, 1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 24])
def test_partial_rotary_and_interleaved(interleaved, rotary_dim):
    q, k, v, qp, kp = make_inputs(2, 2, 2, 33, 33, 24, pad=4, seed=rotary_dim)
    inv_freq = ops.default_inv_freq(rotary_dim, BASE)  # rotary_dim / 2 pairs of a 24-dim head
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 5, 0.0, interleaved=interleaved)
    ref = reference(q, k, v, qp, kp, inv_freq, 5, interleaved=interleaved)
    assert_matches_reference(out, lse, *ref, 1e-5, 1e-5, 1e-5)
    if interleaved:  # the layouts really differ
        other, _ = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 5, 0.0, interleaved=False)
        assert (other - out).abs().max() > 1e-3


def test_strided_inputs():
    """[B, L, H, D] storage seen as [B, H, L, D], a head-sliced k and a non-unit last-dim stride."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 45, 4, 16, generator=g).transpose(1, 2)
    k_big = torch.randn(2, 3, 45, 16, generator=g)
    k = k_big[:, 1:]  # [2, 2, 45, 16], offset storage
    v = torch.randn(2, 2, 16, 45, generator=g).transpose(-1, -2)  # last-dim stride 45
    kp = torch.arange(45).repeat(2, 1)
    inv_freq = ops.default_inv_freq(16, BASE)
    out, lse = ops.rerope_attention(q, k, v, kp, kp, inv_freq, 6, 16.0, logn_length=20)
    ref = reference(q, k, v, kp, kp, inv_freq, 6, 16.0, logn_length=20)
    assert_matches_reference(out, lse, *ref, 1e-5, 1e-5, 1e-5)
    assert out.is_contiguous()


def test_arbitrary_positions_and_explicit_scale():
    """Non-monotonic, repeated and long positions (past 2^20), int32 ids, explicit scale."""
    g = torch.Generator().manual_seed(11)
    q, k, v, _, _ = make_inputs(2, 2, 1, 40, 150, 16, seed=11)
    kp = torch.randint(0, 300, (2, 150), generator=g) + torch.tensor([[0], [1 << 21]])
    qp = torch.randint(0, 300, (2, 40), generator=g) + torch.tensor([[0], [1 << 21]])
    inv_freq = ops.yarn_inv_freq(16, BASE, 8.0, 64)
    for causal in (True, False):
        out, lse = ops.rerope_attention(q, k, v, qp.int(), kp.int(), inv_freq, 31, 0.0, 0.3, 0, causal)
        ref = reference(q, k, v, qp, kp, inv_freq, 31, 0.0, 0.3, 0, causal)
        assert_matches_reference(out, lse, *ref, 2e-5, 1e-5, 2e-5)


def test_rows_without_visible_keys_are_zero_with_minus_inf_lse():
    q, k, v, _, _ = make_inputs(1, 2, 1, 4, 6, 8)
    kp = torch.tensor([[5, 6, 7, -1, -1, 9]])
    qp = torch.tensor([[4, 6, -2, 9]])  # sees nothing / 5,6 / padding / everything valid
    out, lse = ops.rerope_attention(q, k, v, qp, kp, ops.default_inv_freq(8, BASE), 2)
    assert torch.equal(out[:, :, [0, 2]], torch.zeros(1, 2, 2, 8))
    assert torch.isneginf(lse[:, :, [0, 2]]).all() and torch.isfinite(lse[:, :, [1, 3]]).all()
    assert_matches_reference(out, lse, *reference(q, k, v, qp, kp, ops.default_inv_freq(8, BASE), 2),
                             1e-6, 1e-6, 1e-6)
    # no keys at all
    out, lse = ops.rerope_attention(q, k[:, :, :0], v[:, :, :0], qp, kp[:, :0], ops.default_inv_freq(8, BASE), 2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_window_covering_the_sequence_is_rope_attention():
    """window >= length: ordinary RoPE attention (SDPA on rotated q, k)."""
    from ropescale.rerope import rotate

    q, k, v, qp, kp = make_inputs(2, 8, 2, 150, 150, 64, seed=5)
    inv_freq = ops.default_inv_freq(64, BASE)
    for leaky_k in (0.0, 16.0):
        out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 150, leaky_k)
        expected = F.scaled_dot_product_attention(
            rotate(q, qp, inv_freq), rotate(k, kp, inv_freq), v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Decoding: token by token against PreRopeCache equals the prefill row of each token.


@pytest.mark.parametrize("leaky_k,logn_length,gqa", [(0.0, 0, (1, 2)), (16.0, 40, (4, 2)), (64.0, 0, (8, 1))])
def test_decode_with_cache_equals_prefill(leaky_k, logn_length, gqa):
    group, kv_heads = gqa
    window, length, prompt = 24, 150, 101
    q, k, v, qp, kp = make_inputs(2, group * kv_heads, kv_heads, length, length, 32, pad=13, seed=group)
    inv_freq = ops.default_inv_freq(32, BASE)
    kw = dict(leaky_k=leaky_k, logn_length=logn_length)
    full_out, full_lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, window, **kw)

    cache = PreRopeCache(capacity=16)
    keys, values, positions = cache.append(k[:, :, :prompt], v[:, :, :prompt], kp[:, :prompt])
    out, lse = ops.rerope_attention(q[:, :, :prompt], keys, values, qp[:, :prompt], positions, inv_freq, window, **kw)
    torch.testing.assert_close(out, full_out[:, :, :prompt], atol=1e-5, rtol=1e-5)
    for t in range(prompt, length):
        keys, values, positions = cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1], kp[:, t : t + 1])
        out, lse = ops.rerope_attention(q[:, :, t : t + 1], keys, values, qp[:, t : t + 1], positions, inv_freq,
                                        window, **kw)
        torch.testing.assert_close(out, full_out[:, :, t : t + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, full_lse[:, :, t : t + 1], atol=1e-5, rtol=1e-5)
    assert len(cache) == length and torch.equal(cache.keys, k) and torch.equal(cache.positions, kp)


def test_pre_rope_cache_views_growth_and_errors():
    cache = PreRopeCache(capacity=2)
    with pytest.raises(RuntimeError, match="empty"):
        cache.keys
    k = torch.randn(1, 2, 5, 4)
    cache.append(k[:, :, :3], k[:, :, :3] + 1, torch.arange(3)[None])
    keys, values, positions = cache.append(k[:, :, 3:], k[:, :, 3:] + 1, torch.arange(3, 5)[None])
    assert torch.equal(keys, k) and torch.equal(values, k + 1) and torch.equal(positions, torch.arange(5)[None])
    assert keys.stride(-1) == 1 and keys.data_ptr() == cache.keys.data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        cache.append(k[:, :, :1], k[:, :, :1], torch.zeros(1, 1))
    with pytest.raises(ValueError, match="positions must be"):
        cache.append(k[:, :, :1], k[:, :, :1], torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="the cache holds"):
        cache.append(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), torch.zeros(1, 1, dtype=torch.long))
    cache.reset()
    assert len(cache) == 0


def _filled_cache(batch=3, heads=2, length=7, dim=4, capacity=16, seed=0):
    """A cache holding ``length`` random tokens, and the same tokens as plain tensors."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, length, dim, generator=g)
    v = torch.randn(batch, heads, length, dim, generator=g)
    p = torch.randint(-1, 100, (batch, length), generator=g)
    cache = PreRopeCache(capacity=capacity)
    with torch.no_grad():
        cache.append(k, v, p)
    return cache, k, v, p


def _assert_holds(cache, k, v, p):
    assert len(cache) == k.shape[2]
    assert torch.equal(cache.keys, k) and torch.equal(cache.values, v) and torch.equal(cache.positions, p)
    assert cache.positions.dtype == torch.int64


def test_pre_rope_cache_decode_step_writes_only_its_tokens(bytes_written):
    cache, k, v, p = _filled_cache(batch=2, heads=4, length=100, dim=32, capacity=128)
    token = k.element_size() * 4 * 32  # one token of one batch row, all heads
    new_k, new_v, new_p = torch.randn(2, 4, 1, 32), torch.randn(2, 4, 1, 32), torch.full((2, 1), 100)
    with torch.no_grad():
        data_ptr = cache.keys.data_ptr()
        with bytes_written:
            keys, values, positions = cache.append(new_k, new_v, new_p)
    assert keys.data_ptr() == data_ptr and cache.capacity == 128  # no reallocation
    # k, v and positions of the one new token: O(T), where torch.cat would write the 101 tokens.
    assert bytes_written.total == 2 * (2 * token) + 2 * 8, bytes_written.ops
    _assert_holds(cache, torch.cat((k, new_k), 2), torch.cat((v, new_v), 2), torch.cat((p, new_p), 1))


def test_pre_rope_cache_with_autograd_updates_out_of_place():
    # A view handed out may be saved for backward: with grad mode on, appends leave it untouched.
    k = torch.randn(1, 2, 6, 4, requires_grad=True)
    q = torch.randn(1, 2, 1, 4, requires_grad=True)
    cache = PreRopeCache(capacity=8)
    keys, _, _ = cache.append(k[:, :, :5], k[:, :, :5] * 2, torch.arange(5)[None])
    loss = (q @ keys.transpose(-1, -2)).sum()  # saves the view `keys`
    keys2, values2, _ = cache.append(k[:, :, 5:], k[:, :, 5:] * 2, torch.tensor([[5]]))
    (loss + (q @ keys2.transpose(-1, -2)).sum() + values2.sum()).backward()
    expected_k = q.detach().sum(2, keepdim=True).expand(1, 2, 6, 4).clone()
    expected_k[:, :, :5] *= 2  # the first five keys were read twice
    torch.testing.assert_close(k.grad, expected_k + 2)
    torch.testing.assert_close(q.grad, k.detach()[:, :, :5].sum(2, keepdim=True) + k.detach().sum(2, keepdim=True))


def test_pre_rope_cache_crop():
    cache, k, v, p = _filled_cache()
    ptr = cache.keys.data_ptr()
    cache.crop(7)  # no-op
    _assert_holds(cache, k, v, p)
    cache.crop(4)
    _assert_holds(cache, k[:, :, :4], v[:, :, :4], p[:, :4])
    assert cache.keys.data_ptr() == ptr and cache.capacity == 16  # no copy
    with torch.no_grad():
        cache.append(v[:, :, :2], k[:, :, :2], p[:, :2])  # overwrites the cropped tokens
    _assert_holds(cache, torch.cat((k[:, :, :4], v[:, :, :2]), 2), torch.cat((v[:, :, :4], k[:, :, :2]), 2),
                  torch.cat((p[:, :4], p[:, :2]), 1))
    cache.crop(0)
    assert len(cache) == 0 and cache.keys.shape == (3, 2, 0, 4)


@pytest.mark.parametrize("indices", [[2, 0, 1], [1], [0, 0, 2, 2, 1], []])
@pytest.mark.parametrize("grad_mode", [False, True])
def test_pre_rope_cache_index_select(indices, grad_mode):
    cache, k, v, p = _filled_cache()
    rows = torch.tensor(indices, dtype=torch.int32)
    with torch.set_grad_enabled(grad_mode):
        cache.index_select(rows)
        _assert_holds(cache, k[rows.long()], v[rows.long()], p[rows.long()])
        assert cache.capacity == 16  # room for the next tokens is kept
        extra = torch.randn(len(indices), 2, 3, 4)
        cache.append(extra, -extra, torch.arange(3).expand(len(indices), 3))
    _assert_holds(cache, torch.cat((k[rows.long()], extra), 2), torch.cat((v[rows.long()], -extra), 2),
                  torch.cat((p[rows.long()], torch.arange(3).expand(len(indices), 3)), 1))


def test_pre_rope_cache_repeat_interleave():
    cache, k, v, p = _filled_cache()
    cache.repeat_interleave(2)
    _assert_holds(cache, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), p.repeat_interleave(2, 0))
    cache.repeat_interleave(1)
    _assert_holds(cache, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), p.repeat_interleave(2, 0))


@pytest.mark.parametrize("grad_mode", [False, True])
def test_pre_rope_cache_keeps_a_position_per_stream(grad_mode):
    """A multimodal rope's positions ``[B, T, 3]`` (one per stream) through append, growth, crop, index_select and
    repeat_interleave, kept with their tokens; one position per token after streams (or the reverse) refused."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 1, 9, 4, generator=g), torch.randn(2, 1, 9, 4, generator=g)
    p = torch.randint(0, 50, (2, 9, 3), generator=g)
    cache = PreRopeCache(capacity=2)
    with torch.set_grad_enabled(grad_mode):
        cache.append(k[:, :, :4], v[:, :, :4], p[:, :4])
        keys, values, positions = cache.append(k[:, :, 4:], v[:, :, 4:], p[:, 4:])  # grows past its capacity
        assert torch.equal(keys, k) and torch.equal(values, v) and torch.equal(positions, p)
        with pytest.raises(ValueError, match=r"\[B, T, S\].*the cache holds \(3,\) per token"):
            cache.append(k[:, :, :1], v[:, :, :1], p[:, :1, 0])
        cache.crop(7)
        cache.index_select(torch.tensor([1, 0, 1]))
        cache.repeat_interleave(2)
    rows = torch.tensor([1, 1, 0, 0, 1, 1])
    _assert_holds(cache, k[rows, :, :7], v[rows, :, :7], p[rows, :7])
    flat = PreRopeCache()
    flat.append(k[:, :, :1], v[:, :, :1], p[:, :1, 0])
    with pytest.raises(ValueError, match="positions must be"):
        flat.append(k[:, :, 1:2], v[:, :, 1:2], p[:, 1:2])
    with pytest.raises(ValueError, match="positions must be"):
        PreRopeCache().append(k, v, p[..., None])  # [B, T, S, 1]


def test_pre_rope_cache_bad_input_to_crop_index_select_repeat_interleave():
    empty = PreRopeCache()
    empty.crop(0)  # nothing cached, nothing to crop
    with pytest.raises(RuntimeError, match="index_select: the cache is empty"):
        empty.index_select(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="repeat_interleave: the cache is empty"):
        empty.repeat_interleave(2)
    cache, k, v, p = _filled_cache()
    with pytest.raises(ValueError, match=r"crop: length must be in \[0, 7\] .*got 8"):
        cache.crop(8)
    with pytest.raises(ValueError, match=r"crop: length must be in \[0, 7\] .*got -1"):
        cache.crop(-1)
    with pytest.raises(TypeError, match="crop: length must be an int, got 2.5"):
        cache.crop(2.5)
    with pytest.raises(TypeError, match="crop: length must be an int, got True"):
        cache.crop(True)
    with pytest.raises(IndexError, match=r"indices must be in \[0, 3\) .*got values in \[0, 3\]"):
        cache.index_select(torch.tensor([0, 3]))
    with pytest.raises(IndexError, match=r"indices must be in \[0, 3\) .*got values in \[-1, 1\]"):
        cache.index_select(torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="indices must be a 1-D integer tensor, got torch.float32"):
        cache.index_select(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="indices must be a 1-D integer tensor, got torch.bool"):
        cache.index_select(torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match=r"1-D integer tensor, got torch.int64 tensor of shape \(1, 2\)"):
        cache.index_select(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="indices must be a 1-D integer tensor, got list"):
        cache.index_select([0, 1])
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        cache.repeat_interleave(0)
    with pytest.raises(TypeError, match="repeats must be an int, got 2.0"):
        cache.repeat_interleave(2.0)
    _assert_holds(cache, k, v, p)  # a refused call changes nothing


# ---------------------------------------------------------------------------------------------
# Non-finite inputs (DESIGN.md, the rule every path shares): masked keys never contribute, whatever
# they hold; visible non-finite values propagate as in SDPA; a row with no visible key is 0 / -inf.
# (reference_ieee and poison: support/attention.py.)

NON_FINITE_CASES = [  # (q_len, k_len, pad, leaky_k): decode against 9 and 40 keys, prefill over 3 key blocks
    (1, 9, 3, 0.0), (1, 40, 7, 0.0), (3, 40, 5, 16.0), (300, 300, 40, 0.0), (150, 300, 40, 8.0)]


@pytest.mark.parametrize("q_len,k_len,pad,leaky_k", NON_FINITE_CASES)
@pytest.mark.parametrize("where", ["q", "k", "v", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_non_finite_inputs_follow_sdpa_on_every_path_and_size(q_len, k_len, pad, leaky_k, where, dtype):
    """NaN / +-inf in q, in k, in v (anywhere: visible or masked keys), or only in masked keys (padding
    and the causal future of every query): the finite pattern of out and lse equals the float64
    IEEE reference's on the fused CPU op, the composite path and the naive one (before the fix the
    fused op returned zeros with lse = -inf for most poisoned rows, depending on the size). Masked keys
    change no bit: on an AMX CPU the bf16/fp16 prefill's packed GEMM took a scalar P.V for a tile whose
    masked values were not finite, one ulp off the same tile with finite ones (issue 42)."""
    gen = torch.Generator().manual_seed(q_len * 7 + k_len + len(where))
    q, k, v, qp, kp = make_inputs(2, 4, 2, q_len, k_len, 16, dtype, pad=pad, seed=k_len)
    inv_freq = ops.default_inv_freq(16, BASE)
    if where == "masked":  # padding keys of batch row 1 and keys past every query (none here: prefill
        k, v = k.clone(), v.clone()  # ends at the last key) hold NaN / inf
        k[1, :, :pad] = math.nan
        v[1, :, :pad] = math.inf
        v[1, :, pad // 2] = math.nan
    else:
        count = max(2, (q if where == "q" else k).numel() // 4000)
        if where == "q":
            q = poison(q, gen, count)
        elif where == "k":
            k = poison(k, gen, count)
        else:
            v = poison(v, gen, count)
    ref_out, ref_lse = reference_ieee(q, k, v, qp, kp, inv_freq, 5, leaky_k)
    paths = {"fused": ops.rerope_attention, "composite": ops.rerope_attention_composite,
             "naive": ropescale.rerope.rerope_attention_naive}
    unavailable = []
    for name, path in paths.items():
        try:
            out, lse = path(q, k, v, qp, kp, inv_freq, 5, leaky_k)
        except RuntimeError as err:  # the plain-PyTorch paths run SDPA, which PyTorch cannot run here
            if name == "fused" or not sdpa_cannot_pack(err):
                raise
            unavailable.append(name)
            continue
        assert torch.equal(out.isfinite(), ref_out.isfinite()), f"{name}: finite pattern of out"
        assert torch.equal(lse.isfinite(), ref_lse.isfinite()), f"{name}: finite pattern of lse"
        assert torch.equal(lse.isneginf(), ref_lse.isneginf()), f"{name}: rows without a visible key"
        finite = ref_out.isfinite()
        if dtype == torch.float32:
            torch.testing.assert_close(out.double()[finite], ref_out[finite], atol=2e-5, rtol=1e-4)
    if where == "masked":  # masked keys change nothing at all
        clean_out, _ = ops.rerope_attention(*make_inputs(2, 4, 2, q_len, k_len, 16, dtype, pad=pad, seed=k_len)[:5],
                                            inv_freq, 5, leaky_k)
        torch.testing.assert_close(ops.rerope_attention(q, k, v, qp, kp, inv_freq, 5, leaky_k)[0], clean_out,
                                   rtol=0, atol=0)
    if unavailable:  # after every check the fused op (and any other path) could make
        pytest.skip(f"PyTorch's own SDPA cannot run {dtype} at this ATEN_CPU_CAPABILITY on this CPU: the {unavailable} "
                    "path(s) not checked")


def test_non_finite_value_of_a_future_key_only_reaches_later_queries():
    """Causal: a NaN in v at key position 20 leaves queries 0..19 finite and makes 20.. NaN; the same
    through the decode plan (a few queries) and the prefill plan."""
    q, k, v, qp, kp = make_inputs(1, 2, 1, 40, 40, 8)
    v = v.clone()
    v[0, 0, 20, 3] = math.nan
    inv_freq = ops.default_inv_freq(8, BASE)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 4)
    assert out[0, :, :20].isfinite().all() and lse.isfinite().all()
    assert out[0, :, 20:, 3].isnan().all() and out[0, :, 20:, :3].isfinite().all()
    out1, _ = ops.rerope_attention(q[:, :, 10:11], k, v, qp[:, 10:11], kp, inv_freq, 4)
    assert out1.isfinite().all()


# ---------------------------------------------------------------------------------------------
# scale and the position range (issue 16.8)


@pytest.mark.parametrize("q_len", [1, 40])
def test_large_finite_scale_is_a_hard_maximum(q_len):
    """scale=1e30 (finite, > 0): the softmax becomes the argmax, computed as such (before the fix
    the rows were zeros); inf, nan, 0 and negative scales are refused (bad-input suite)."""
    q, k, v, qp, kp = make_inputs(1, 2, 1, q_len, 40, 8, seed=4)
    inv_freq = ops.default_inv_freq(8, BASE)
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 6, scale=1e30)
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, 6, scale=1e30)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=0)


def test_positions_up_to_the_bound_are_accurate():
    """ReRoPE depends on position differences (no log-n here): the same prompt at positions 0.. and
    at 2^31 - 1 - L.. gives the same attention; the position error at the bound is ~1e-6 (float32
    rotation error 2e-7 per operand). One past the bound is refused."""
    L = 300
    q, k, v, qp, kp = make_inputs(1, 4, 2, L, L, 64, seed=9)
    inv_freq = ops.default_inv_freq(64, BASE)
    out0, lse0 = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 64)
    shift = 2**31 - 1 - (L - 1)
    out1, lse1 = ops.rerope_attention(q, k, v, qp + shift, kp + shift, inv_freq, 64)
    error = (out1 - out0).abs().max().item()
    assert error < 2e-5, error
    torch.testing.assert_close(lse1, lse0, atol=2e-5, rtol=0)
    with pytest.raises(RuntimeError, match="k_positions must be <= 2147483647"):
        ops.rerope_attention(q, k, v, qp + shift, kp + shift + 1, inv_freq, 64)


# ---------------------------------------------------------------------------------------------
# Composite path: equal to the fused op, differentiable.


@pytest.mark.parametrize("leaky_k,window,logn_length,causal", [
    (0.0, 1, 0, True), (0.0, 7, 30, True), (16.0, 64, 0, False), (64.0, 5, 30, True), (0.0, 10_000, 0, True)])
def test_composite_equals_fused(leaky_k, window, logn_length, causal):
    q, k, v, qp, kp = make_inputs(2, 4, 2, 77, 150, 16, pad=20, seed=window)
    inv_freq = ops.default_inv_freq(16, BASE)
    args = (q, k, v, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal)
    out, lse = ops.rerope_attention(*args)
    c_out, c_lse = ops.rerope_attention_composite(*args)
    torch.testing.assert_close(c_out, out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(c_lse), torch.isinf(lse))
    torch.testing.assert_close(c_lse[lse.isfinite()], lse[lse.isfinite()], atol=1e-5, rtol=1e-6)


def test_composite_handles_large_scores():
    """Scores in the hundreds: the sentinel shift keeps the denominator in range."""
    q, k, v, qp, kp = make_inputs(1, 2, 1, 40, 40, 16, seed=2)
    inv_freq = ops.default_inv_freq(16, BASE)
    out, lse = ops.rerope_attention_composite(q * 30, k * 30, v, qp, kp, inv_freq, 5, 0.0)
    ref_out, ref_lse = reference(q * 30, k * 30, v, qp, kp, inv_freq, 5)
    assert ref_lse.max() > 200
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("leaky_k,causal,logn_length,fast", [
    (0.0, True, 0, False), (4.0, True, 3, True), (0.0, False, 3, True)])
def test_composite_gradcheck(leaky_k, causal, logn_length, fast):
    """Both outputs, through both sides of the window; the fast (random projection) checks have a
    padded batch row too, the full Jacobian check one small batch row."""
    q, k, v, qp, kp = make_inputs(2 if fast else 1, 2, 1, 4, 6, 4, torch.float64, pad=2, seed=1)
    inv_freq = ops.default_inv_freq(4, BASE).double()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return ops.rerope_attention_composite(q, k, v, qp, kp, inv_freq, 2, leaky_k, None, logn_length, causal)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=fast)


def test_fused_op_has_no_backward():
    q, k, v, qp, kp = make_inputs(1, 2, 1, 5, 5, 8)
    q.requires_grad_()
    out, _ = ops.rerope_attention(q, k, v, qp, kp, ops.default_inv_freq(8, BASE), 2)
    with pytest.raises(RuntimeError, match="rerope_attention_composite"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------
# Memory: a 32k-token prefill never materialises Lq x Lk scores.


@pytest.mark.skipif(ropescale.build_info()["kernels"] == "reference",
                    reason="measures the fused kernel's memory; ROPESCALE_KERNELS=reference runs the composite, "
                    "which holds Lq x Lk masks")
def test_32k_prefill_peak_memory():
    # The peak is this process's VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across
    # fork + exec, so under a large pytest parent it reports the parent's RSS (seen in CI: +2 GiB).
    script = textwrap.dedent("""
        import torch
        from ropescale import ops
        def status_kib(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        torch.set_num_threads(2)
        L, D = 32768, 128
        q, k, v = (torch.randn(1, 1, L, D) for _ in range(3))
        pos = torch.arange(L)[None]
        inv_freq = ops.default_inv_freq(D, 1e4)
        try:  # reset VmHWM to the current RSS (Linux >= 4.0); without it the import's peak counts too
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        rss_before = status_kib("VmRSS")
        out, lse = ops.rerope_attention(q, k, v, pos, pos, inv_freq, 512, 16.0)
        peak = status_kib("VmHWM")
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        print((peak - rss_before) / 1024)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(ropescale.__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    extra_mib = float(result.stdout.strip().splitlines()[-1])
    # Inputs and outputs are 16 MiB each; one Lq x Lk float32 matrix would be 4 GiB.
    assert extra_mib < 512, f"extra peak RSS {extra_mib:.0f} MiB"


# ---------------------------------------------------------------------------------------------
# opcheck and bad input


def _opcheck_samples():
    q, k, v, qp, kp = make_inputs(2, 4, 2, 9, 13, 8, pad=3)
    inv_freq = ops.default_inv_freq(8, BASE)
    yield (q, k, v, qp, kp, inv_freq, 3), {}
    yield (q, k, v, qp, kp, inv_freq, 3, 16.0, 0.5, 5, False, True), {}
    yield (q[:, :, -1:], k, v, qp[:, -1:], kp, inv_freq, 100), {"leaky_k": 32.0}
    yield (q.bfloat16(), k.bfloat16(), v.bfloat16(), qp, kp, inv_freq, 2), {}


@pytest.mark.parametrize("sample", list(_opcheck_samples()), ids=range(4))
def test_opcheck(sample):
    args, kwargs = sample
    opcheck(torch.ops.ropescale.rerope_attention.default, args, kwargs)


def _bad_inputs():
    q, k, v, qp, kp = make_inputs(2, 4, 2, 5, 5, 8)
    f = ops.default_inv_freq(8, BASE)
    yield (q, k, v, qp, kp, f, 0), {}, "window must be > 0 and <= 2147483647, got 0"
    yield (q, k, v, qp, kp, f, -3), {}, "window must be > 0 and <= 2147483647, got -3"
    yield (q, k, v, qp, kp, f, 4, 0.5), {}, r"leaky_k must be 0 \(ReRoPE\) or >= 1"
    yield (q, k, v, qp, kp, f, 4, -2.0), {}, r"leaky_k must be 0 \(ReRoPE\) or >= 1"
    yield (q[:, :3], k, v, qp, kp, f, 4), {}, r"the number of q heads \(3\) must be a multiple of the number of k/v heads \(2\)"
    yield (q, k, v, qp.float(), kp, f, 4), {}, "q_positions must be an integer tensor"
    yield (q, k, v, qp, kp.double(), f, 4), {}, "k_positions must be an integer tensor"
    yield (q, k, v, qp[:1], kp, f, 4), {}, r"q_positions must have shape \[2, 5\]"
    yield (q, k, v, qp, kp[:, :4], f, 4), {}, r"k_positions must have shape \[2, 5\]"
    yield (q[:1], k, v, qp[:1], kp, f, 4), {}, "q and k must have the same batch size, got 1 and 2"
    yield (q, k, v[:, :, :4], qp, kp, f, 4), {}, "k and v must have the same shape"
    yield (q[..., :7], k[..., :7], v[..., :7], qp, kp, f[:3], 4), {}, "head dim D must be even"
    big = torch.randn(1, 1, 2, 258)
    yield (big, big, big, qp[:1, :2], kp[:1, :2], ops.default_inv_freq(258, BASE), 4), {}, "head dim D must be even and in \\[2, 256\\], got 258"
    yield (q, k, v, qp, kp, ops.default_inv_freq(10, BASE), 4), {}, "inv_freq must have between 1 and D/2 = 4"
    yield (q, k.double(), v, qp, kp, f, 4), {}, "q, k and v must have the same dtype"
    yield (q.double(), k.double(), v.double(), qp, kp, f, 4), {}, "q must be float32, float16 or bfloat16"
    yield (q[0], k, v, qp, kp, f, 4), {}, r"q must be 4-D \[B, Hq, Lq, D\]"
    yield (q, k, v, qp, kp, f, 4), {"logn_length": 1}, "logn_length must be 0 \\(off\\) or >= 2"


@pytest.mark.parametrize("args,kwargs,message", list(_bad_inputs()), ids=range(18))
def test_bad_input_raises_clear_error(args, kwargs, message):
    with pytest.raises(RuntimeError, match="rerope_attention: " + message):
        ops.rerope_attention(*args, **kwargs)


def test_composite_bad_input():
    q, k, v, qp, kp = make_inputs(1, 3, 2, 5, 5, 8)
    f = ops.default_inv_freq(8, BASE)
    with pytest.raises(RuntimeError, match="rerope_attention: window must be > 0"):
        ops.rerope_attention_composite(q[:, :2], k, v, qp, kp, f, 0)
    with pytest.raises(RuntimeError, match="rerope_attention: leaky_k must be 0"):
        ops.rerope_attention_composite(q[:, :2], k, v, qp, kp, f, 2, 0.5)
    with pytest.raises(RuntimeError, match="rerope_attention: the number of q heads"):
        ops.rerope_attention_composite(q, k, v, qp, kp, f, 2)
    with pytest.raises(RuntimeError, match="rerope_attention: q_positions must be an integer tensor"):
        ops.rerope_attention_composite(q[:, :2], k, v, qp.float(), kp, f, 2)


# ---------------------------------------------------------------------------------------------
# CUDA (run where a GPU exists): the prefill and decode kernels against the reference and the CPU op.

CUDA_GRID = list(itertools.product((0.0, 16.0), (1, 7, 64, 10_000), (0, 50), ((1, 2), (4, 2), (8, 1)), (True, False)))


@pytest.mark.cuda
@pytest.mark.parametrize("leaky_k,window,logn_length,gqa,causal", CUDA_GRID)
def test_cuda_matches_reference_grid(leaky_k, window, logn_length, gqa, causal):
    index = CUDA_GRID.index((leaky_k, window, logn_length, gqa, causal))
    group, kv_heads = gqa
    q_len, k_len = [(37, 37), (150, 150), (1, 531), (3, 200), (70, 201)][index % 5]  # prefill and decode kernels
    dim = (16, 64, 128, 256, 10)[index % 5]
    q, k, v, qp, kp = make_inputs(2, group * kv_heads, kv_heads, q_len, k_len, dim, pad=index % 3 * 5, seed=index,
                                  device="cuda")
    inv_freq = ops.default_inv_freq(dim, BASE).cuda()
    out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal)
    assert out.is_cuda and lse.is_cuda
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal)
    assert_matches_reference(out, lse, ref_out, ref_lse, atol=2e-5, rtol=2e-5, lse_atol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_and_decode_against_cpu(dtype):
    q, k, v, qp, kp = make_inputs(2, 8, 2, 1, 5000, 128, dtype, pad=100, seed=9, device="cuda")
    inv_freq = ops.default_inv_freq(128, BASE).cuda()
    for leaky_k in (0.0, 16.0):
        out, lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 512, leaky_k, logn_length=4096)
        cpu_out, cpu_lse = ops.rerope_attention(q.cpu(), k.cpu(), v.cpu(), qp.cpu(), kp.cpu(), inv_freq.cpu(), 512,
                                                leaky_k, logn_length=4096)
        torch.testing.assert_close(out.cpu().float(), cpu_out.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_decode_with_cache_and_opcheck():
    q, k, v, qp, kp = make_inputs(1, 4, 2, 40, 40, 64, device="cuda", pad=0, seed=4)
    inv_freq = ops.default_inv_freq(64, BASE).cuda()
    full_out, _ = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 8, 16.0)
    cache = PreRopeCache()
    for t in range(40):
        keys, values, positions = cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1], kp[:, t : t + 1])
        out, _ = ops.rerope_attention(q[:, :, t : t + 1], keys, values, qp[:, t : t + 1], positions, inv_freq, 8, 16.0)
        torch.testing.assert_close(out, full_out[:, :, t : t + 1], atol=1e-5, rtol=1e-5)
    opcheck(torch.ops.ropescale.rerope_attention.default, (q, k, v, qp, kp, inv_freq, 8))
    c_out, _ = ops.rerope_attention_composite(q, k, v, qp, kp, inv_freq, 8, 16.0)
    torch.testing.assert_close(c_out, full_out, atol=1e-5, rtol=1e-5)
