"""The CUDA kernels, where a GPU exists (every test is marked ``cuda`` and skips cleanly elsewhere;
``scripts/gpu_check.sh`` runs them):

* the tensor-core ReRoPE prefill (fp16/bf16, head dims 64/80/96/128) against the float64 reference,
  within twice the error PyTorch's SDPA makes in the same dtype on the same inputs;
* the masking rule for non-finite values: a masked key never contributes, whatever it holds; a
  visible non-finite value propagates, with the pattern of the float64 reference, at decode and
  prefill sizes;
* CUDA against CPU on the same inputs, for every op with a CUDA kernel: the rotary ops (with
  frequency tables computed on the CPU and moved to the GPU) and ReRoPE attention (fused and
  composite);
* the paged op (rerope_attention_paged, rerope_cache_write_) against its float64 oracle: decode rows
  on the SIMT kernel, fp16/bf16 prefill rows on the tensor cores (and the SIMT fallback for caches
  whose rows are not 16-byte aligned), bad metadata as NaN rows; past the pre-rotation budget (70k
  keys), with reserved workspaces of every size (bit for bit the same rows), decode steps without
  tensor-core allocations, short requests with a 128k block table.

The reference and the SDPA-relative tolerance come from support/attention.py.
"""

import math

import pytest
import torch

from ropescale import ops
from ropescale.rerope import (rerope_attention_composite, rerope_attention_paged_composite,
                              rerope_cache_write_composite)
from support.attention import BASE, as_layout, assert_within_sdpa_error, make_inputs, reference, sdpa_error
from support.paged import make_paged

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


def to_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


# ---------------------------------------------------------------------------------------------
# The tensor-core prefill (fp16/bf16, more than 16 queries, head dims 64/80/96/128).

# batch, q heads, kv heads, q_len, k_len, dim, left padding, leaky_k, window, logn_length, causal, layout,
# interleaved, rotary_dim (0: dim). Lengths off the 64-query blocks and 64-key tiles, GQA 1 to 8, ReRoPE and
# Leaky, log-n, padding (batch row b left-padded by pad * b), causal and not, partial rotary. Every problem
# has at least 64 rows (see SDPA_ERROR_FACTOR).
TENSOR_CORE_CASES = [
    (2, 4, 2, 67, 140, 64, 9, 0.0, 7, 0, True, "contiguous", False, 0),
    (1, 8, 1, 129, 129, 64, 0, 16.0, 50, 0, True, "blhd", False, 0),
    (1, 4, 1, 100, 300, 80, 0, 0.0, 64, 100, True, "contiguous", False, 0),
    (2, 2, 2, 65, 65, 96, 20, 16.0, 33, 0, False, "contiguous", False, 0),
    (1, 4, 2, 200, 333, 128, 0, 64.0, 100, 150, True, "cache", False, 0),
    (2, 2, 1, 17, 130, 128, 5, 0.0, 1, 0, True, "contiguous", False, 0),
    (1, 2, 1, 90, 90, 96, 0, 16.0, 10_000, 0, True, "contiguous", True, 64),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", TENSOR_CORE_CASES, ids=range(len(TENSOR_CORE_CASES)))
def test_tensor_core_prefill_within_sdpa_error(dtype, case):
    batch, q_heads, kv_heads, q_len, k_len, dim, pad, leaky_k, window, logn_length, causal, layout, interleaved, \
        rotary_dim = case
    q, k, v, qp, kp = make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype, pad=pad,
                                  seed=TENSOR_CORE_CASES.index(case))
    inv_freq = ops.default_inv_freq(rotary_dim or dim, BASE)
    kw = dict(leaky_k=leaky_k, logn_length=logn_length, causal=causal, interleaved=interleaved)
    q_d, k_d, v_d, qp_d, kp_d, inv_freq_d = to_device(q, k, v, qp, kp, inv_freq)
    out, lse = ops.rerope_attention(as_layout(q_d, layout if layout != "cache" else "contiguous"),
                                    as_layout(k_d, layout), as_layout(v_d, layout), qp_d, kp_d, inv_freq_d, window,
                                    **kw)
    assert out.device.type == DEVICE and out.dtype == dtype and out.is_contiguous()
    ref_out, ref_lse = reference(q, k, v, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal, interleaved)
    err = sdpa_error(q, k, v, qp, kp, inv_freq, None, logn_length, causal, interleaved)
    assert_within_sdpa_error(out.cpu(), lse.cpu(), ref_out, ref_lse, err)


def test_16_bit_prefill_runs_on_tensor_cores():
    """The cases above reach the tensor-core kernel (not the SIMT fallback), as the profiler sees it."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, qp, kp = to_device(*make_inputs(1, 4, 2, 67, 140, 64, torch.bfloat16, seed=1))
    inv_freq = ops.default_inv_freq(64, BASE).to(DEVICE)
    names = {}
    for label, args in {"bf16": (q, k, v), "fp32": (q.float(), k.float(), v.float())}.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ops.rerope_attention(*args, qp, kp, inv_freq, 16)
            torch.cuda.synchronize()
        names[label] = " ".join(event.name for event in prof.events())
    assert "rerope_prefill_tc_kernel" in names["bf16"], names["bf16"]
    assert "rerope_prefill_tc_kernel" not in names["fp32"] and "rerope_prefill_kernel" in names["fp32"]


# ---------------------------------------------------------------------------------------------
# Non-finite values: masked keys never contribute, visible ones propagate (the rule every path shares).


def reference_by_pairs(q, k, v, qp, kp, inv_freq, window, leaky_k=0.0, logn_length=0, causal=True):
    """float64 (out, lse) where out sums p * v over the visible (query, key) pairs only, so a masked key's V
    never enters (not even as 0 * NaN) and a visible key's non-finite V propagates as IEEE arithmetic does.
    The probabilities are reference()'s: its output with V the identity."""
    batch, kv_heads, k_len, _ = k.shape
    eye = torch.eye(k_len, dtype=torch.float64).expand(batch, kv_heads, k_len, k_len)
    probs, lse = reference(q, k, eye, qp, kp, inv_freq, window, leaky_k, None, logn_length, causal)
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
    if causal:
        visible &= kp[:, None, :] <= qp[:, :, None]
    v = v.double().repeat_interleave(q.shape[1] // kv_heads, 1)
    terms = probs[..., None] * v[:, :, None]  # [B, H, Lq, Lk, D]
    out = torch.where(visible[:, None, :, :, None], terms, 0).sum(-2)
    return out, lse


def plant_nonfinite(q, k, v, qp, kp):
    """Copies with planted values: padding keys (masked for every query) NaN in V and inf in K; one key that
    the later queries see and the earlier ones do not (causal) an inf in one V column; one visible query a
    NaN; the last key of the last batch row a NaN in K; padding queries NaN. Rows that see none of them are
    untouched."""
    q, k, v = q.clone(), k.clone(), v.clone()
    padding = kp < 0
    v.masked_fill_(padding[:, None, :, None], math.nan)
    k.masked_fill_(padding[:, None, :, None], math.inf)
    k_len, q_len, dim = k.shape[2], q.shape[2], q.shape[3]
    v[0, 0, k_len - 1 - q_len // 2, dim // 2] = math.inf
    q[0, -1, q_len // 3, 1] = math.nan
    k[-1, -1, -1, 0] = math.nan
    q.masked_fill_((qp < 0)[:, None, :, None], math.nan)
    return q, k, v


# (q_len, k_len): decode against 9 and 40 keys, a few decode queries, prefill (tensor cores for 16-bit).
NONFINITE_SIZES = [(1, 9), (1, 40), (3, 40), (70, 70), (37, 150)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("q_len,k_len", NONFINITE_SIZES)
def test_masked_keys_never_contribute_and_visible_nonfinite_values_propagate(dtype, q_len, k_len):
    q, k, v, qp, kp = make_inputs(2, 4, 2, q_len, k_len, 64, dtype, pad=q_len // 2 + 3, seed=q_len + k_len)
    inv_freq = ops.default_inv_freq(64, BASE)
    bad_q, bad_k, bad_v = plant_nonfinite(q, k, v, qp, kp)
    kw = dict(leaky_k=16.0, logn_length=0, causal=True)
    clean_out, clean_lse = ops.rerope_attention(*to_device(q, k, v, qp, kp, inv_freq), 7, **kw)
    out, lse = ops.rerope_attention(*to_device(bad_q, bad_k, bad_v, qp, kp, inv_freq), 7, **kw)
    out, lse, clean_out, clean_lse = out.cpu().double(), lse.cpu().double(), clean_out.cpu().double(), \
        clean_lse.cpu().double()
    ref_out, ref_lse = reference_by_pairs(bad_q, bad_k, bad_v, qp, kp, inv_freq, 7, 16.0, 0, True)
    assert torch.equal(out.isfinite(), ref_out.isfinite())
    assert torch.equal(lse.isfinite(), ref_lse.isfinite())
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)  # no visible key: -inf, decided by the mask
    # Both kinds of rows occur, and a row with one non-finite column.
    finite_per_row = ref_out.isfinite().sum(-1)
    assert (finite_per_row == 64).any() and (finite_per_row == 0).any() and (
        (finite_per_row > 0) & (finite_per_row < 64)).any()
    # Where the reference is finite, the result on the clean inputs (up to a rounding of the dtype).
    atol = 2 * torch.finfo(dtype).eps * clean_out.abs().max().item()
    finite = ref_out.isfinite()
    torch.testing.assert_close(out[finite], clean_out[finite], atol=atol, rtol=0)
    rows = ref_lse.isfinite()
    torch.testing.assert_close(lse[rows], clean_lse[rows], atol=1e-5, rtol=1e-6)


def test_nonfinite_pattern_is_the_same_on_cuda_cpu_and_the_composite_path():
    q, k, v, qp, kp = make_inputs(2, 4, 2, 37, 150, 64, torch.bfloat16, pad=20, seed=5)
    inv_freq = ops.default_inv_freq(64, BASE)
    bad = plant_nonfinite(q, k, v, qp, kp)
    patterns = []
    for run, device in ((ops.rerope_attention, DEVICE), (ops.rerope_attention, "cpu"),
                        (rerope_attention_composite, DEVICE)):
        out, lse = run(*(t.to(device) for t in (*bad, qp, kp, inv_freq)), 7, 16.0)
        patterns.append((out.isfinite().cpu(), lse.isfinite().cpu()))
    for out_finite, lse_finite in patterns[1:]:
        assert torch.equal(out_finite, patterns[0][0]) and torch.equal(lse_finite, patterns[0][1])


# ---------------------------------------------------------------------------------------------
# CUDA against CPU on the same inputs, every op with a CUDA kernel.


def assert_close_to_cpu(got, want):
    """fp32: the last bits (the GPU contracts a*b+c into FMA, the CPU may not); fp16/bf16: one rounding."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        atol = torch.finfo(want.dtype).eps * want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def rotary_calls(dtype, layout):
    """(name, call(q, k) -> tensors) for every rotary op, with tables built on the CPU (the frequency
    ops run there) and moved to q's device by the call."""
    gen = torch.Generator().manual_seed(3)
    batch, seq, head_dim, rotary_dim = 2, 37, 64, 48
    positions = torch.randint(0, 2**20, (batch, seq), generator=gen)
    inv_freq = ops.yarn_inv_freq(rotary_dim, BASE, 4.0, 4096)
    angles = positions.double()[..., None] * inv_freq.double()
    cos_half, sin_half = angles.cos().float(), angles.sin().float()
    cos_full, sin_full = torch.cat((cos_half, cos_half), -1), torch.cat((sin_half, sin_half), -1)

    def tables(x, half):
        cos, sin = (cos_half, sin_half) if half else (cos_full, sin_full)
        return cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)

    def in_place(op, make_args, **kwargs):
        def call(q, k):
            q, k = q.clone(), k.clone()
            if "qk" in op.__name__:
                op(q, k, *make_args(q), **kwargs)
                return q, k
            op(q, *make_args(q), **kwargs)
            return (q,)
        return call

    pos = lambda x: (positions.to(x.device), inv_freq.to(x.device), 0.5)  # noqa: E731
    return [
        ("apply_rotary", lambda q, k: (ops.apply_rotary(q, *tables(q, False)),)),
        ("apply_rotary half_width interleaved",
         lambda q, k: (ops.apply_rotary(q, *tables(q, True), True, half_width=True),)),
        ("apply_rotary conjugate", lambda q, k: (ops.apply_rotary(q, *tables(q, False), conjugate=True),)),
        ("apply_rotary_", in_place(ops.apply_rotary_, lambda x: tables(x, False))),
        ("apply_rotary_qk", lambda q, k: ops.apply_rotary_qk(q, k, *tables(q, False))),
        ("apply_rotary_qk_", in_place(ops.apply_rotary_qk_, lambda x: tables(x, True), half_width=True)),
        ("apply_rotary_pos", lambda q, k: (ops.apply_rotary_pos(q, *pos(q)),)),
        ("apply_rotary_pos interleaved", lambda q, k: (ops.apply_rotary_pos(q, *pos(q), True),)),
        ("apply_rotary_pos_", in_place(ops.apply_rotary_pos_, pos)),
        ("apply_rotary_pos_qk", lambda q, k: ops.apply_rotary_pos_qk(q, k, *pos(q))),
        ("apply_rotary_pos_qk_", in_place(ops.apply_rotary_pos_qk_, pos, conjugate=True)),
    ], (batch, seq, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "blhd"])
def test_rotary_ops_cuda_match_cpu(dtype, layout):
    calls, (batch, seq, head_dim) = rotary_calls(dtype, layout)
    gen = torch.Generator().manual_seed(4)
    q = as_layout(torch.randn(batch, 8, seq, head_dim, generator=gen).to(dtype), layout)
    k = as_layout(torch.randn(batch, 2, seq, head_dim, generator=gen).to(dtype), layout)
    for name, call in calls:
        want = call(q, k)
        got = call(q.to(DEVICE), k.to(DEVICE))
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            assert g.device.type == DEVICE, name
            assert_close_to_cpu(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("q_len,k_len,dim", [(1, 300, 64), (5, 140, 128), (70, 201, 96), (40, 90, 256)])
def test_rerope_attention_cuda_matches_cpu(dtype, q_len, k_len, dim):
    """Decode and prefill plans, the tensor-core and SIMT kernels, D 256 (compact tiles on 99 KiB parts)."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, q_len, k_len, dim, dtype, pad=7, seed=q_len)
    inv_freq = ops.default_inv_freq(dim, BASE)
    for leaky_k, logn_length in ((0.0, 0), (16.0, 100)):
        kw = dict(leaky_k=leaky_k, logn_length=logn_length)
        cpu_out, cpu_lse = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 33, **kw)
        out, lse = ops.rerope_attention(*to_device(q, k, v, qp, kp, inv_freq), 33, **kw)
        tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.cpu().float(), cpu_out.float(), **tolerance)
        torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-4, rtol=1e-5)
        c_out, c_lse = rerope_attention_composite(*to_device(q, k, v, qp, kp, inv_freq), 33, **kw)
        torch.testing.assert_close(c_out.cpu().float(), cpu_out.float(), **tolerance)


# ---------------------------------------------------------------------------------------------
# rerope_attention_paged and rerope_cache_write_ (the paged kernels of rerope_attention.cuh), against
# the plain-PyTorch oracle rerope_attention_paged_composite in float64 on the CPU.

# (q_len, seq_len) per request: decode rows, a chunked-prefill row (a chunk at the end of a longer
# sequence), a full prefill, an empty row range, a one-token sequence; the window puts near, band and
# far key tiles in the longer requests. The batches: support.paged.make_paged (shuffled pages, NaN in every
# slot no request owns), with int32 metadata as vLLM passes it.
PAGED_REQUESTS = [(1, 300), (17, 90), (70, 70), (0, 6), (1, 1), (5, 140)]


def paged_tables(count, dim, per_request):
    """The tables of a paged batch: one shared inv_freq, or a row and a scale factor per request."""
    base_table = ops.default_inv_freq(dim, BASE)
    if per_request:  # as Dynamic NTK/YaRN give each request the table of its own length
        inv_freq = torch.stack([base_table / (1.0 + 0.75 * r) for r in range(count)])
        scale_factors = torch.tensor([1.0 + 0.1 * r for r in range(count)])
        return inv_freq, scale_factors
    return base_table, None


def paged_on(device, args):
    return [None if t is None else t.to(device) for t in args]


def assert_within_twice_the_composite(out, lse, low_out, low_lse, ref_out, ref_lse):
    """The kernel's ``out``/``lse`` against the float64 reference within twice the error the composite makes
    in the same dtype on the same inputs (+1e-6)."""
    def err(got, ref):
        return (got.cpu().double() - ref.double()).abs().max().item()
    for name, got, low, ref in (("out", out, low_out, ref_out), ("lse", lse, low_lse, ref_lse)):
        assert err(got, ref) <= 2 * err(low, ref) + 1e-6, (name, err(got, ref), err(low, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size,dim,kv_heads,per_request", [(16, 64, 2, False), (5, 128, 1, True),
                                                                 (1, 96, 4, True)])
def test_rerope_attention_paged_cuda_matches_the_float64_oracle(dtype, block_size, dim, kv_heads, per_request):
    """Decode, chunked-prefill and prefill rows in one launch, shuffled pages, GQA, per-request tables.
    fp32 within 2e-5; fp16/bf16 within twice the error of the same composite computation in that dtype."""
    (q, key_cache, value_cache, block_table, seq_lens, qsl), _ = make_paged(
        PAGED_REQUESTS, 4, kv_heads, dim, block_size, dtype, seed=block_size, index_dtype=torch.int32)
    inv_freq, scale_factors = paged_tables(len(PAGED_REQUESTS), dim, per_request)
    for leaky_k, logn_length in ((0.0, 0), (16.0, 100)):
        kw = dict(leaky_k=leaky_k, logn_length=logn_length, scale_factors=scale_factors)
        ref_out, ref_lse = rerope_attention_paged_composite(q.double(), key_cache.double(), value_cache.double(),
                                                            block_table, seq_lens, qsl, inv_freq, 33, **kw)
        dev = paged_on(DEVICE, [q, key_cache, value_cache, block_table, seq_lens, qsl, inv_freq, scale_factors])
        out, lse = ops.rerope_attention_paged(*dev[:7], 33, leaky_k=leaky_k, logn_length=logn_length,
                                              scale_factors=dev[7])
        assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
        out, lse = out.cpu().double(), lse.cpu().double()
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # no NaN slot was read
        err_out = (out - ref_out).abs().max().item()
        err_lse = (lse - ref_lse.double()).abs().max().item()
        if dtype == torch.float32:
            assert err_out <= 2e-5 and err_lse <= 2e-5 * (1 + ref_lse.abs().max().item())
        else:
            low_out, low_lse = rerope_attention_paged_composite(*dev[:7], 33, leaky_k=leaky_k,
                                                                logn_length=logn_length, scale_factors=dev[7])
            assert_within_twice_the_composite(out, lse, low_out, low_lse, ref_out, ref_lse)


# Long-ish prefill rows beside decode rows: a full prefill of several 64-query blocks, a chunk of 300
# queries starting mid-sequence (at 700 of 1000), a short prefill, decode rows. fp16/bf16 at the
# tensor-core head dims: the requests of more than 4 rows run on the tensor cores, the others on SIMT.
PAGED_TENSOR_CORE_REQUESTS = [(1, 1000), (257, 257), (1, 33), (300, 1000), (3, 700), (9, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size,dim,kv_heads,leaky_k,logn_length,aligned",
                         [(16, 128, 2, 0.0, 0, True), (1, 64, 1, 16.0, 300, True), (7, 80, 4, 0.0, 0, True),
                          (16, 96, 2, 8.0, 0, False)])
def test_rerope_attention_paged_cuda_tensor_core_prefill_beside_decode_rows(dtype, block_size, dim, kv_heads, leaky_k,
                                                                            logn_length, aligned):
    """The paged op's tensor-core prefill (and, with caches whose rows are not 16-byte aligned, the SIMT
    fallback) against the float64 oracle, within twice the error of the composite in that dtype."""
    (q, key_cache, value_cache, block_table, seq_lens, qsl), _ = make_paged(
        PAGED_TENSOR_CORE_REQUESTS, 8, kv_heads, dim, block_size, dtype, seed=dim, index_dtype=torch.int32)
    inv_freq, scale_factors = paged_tables(len(PAGED_TENSOR_CORE_REQUESTS), dim, per_request=True)
    kw = dict(leaky_k=leaky_k, logn_length=logn_length)
    ref_out, ref_lse = rerope_attention_paged_composite(q.double(), key_cache.double(), value_cache.double(),
                                                        block_table, seq_lens, qsl, inv_freq, 100,
                                                        scale_factors=scale_factors, **kw)
    dev = paged_on(DEVICE, [q, key_cache, value_cache, block_table, seq_lens, qsl, inv_freq, scale_factors])
    if not aligned:  # the caches one element past a 16-byte boundary
        dev[1] = torch.empty(dev[1].numel() + 1, dtype=dtype, device=DEVICE)[1:].view_as(dev[1]).copy_(dev[1])
        dev[2] = torch.empty(dev[2].numel() + 1, dtype=dtype, device=DEVICE)[1:].view_as(dev[2]).copy_(dev[2])
    out, lse = ops.rerope_attention_paged(*dev[:7], 100, scale_factors=dev[7], **kw)
    low_out, low_lse = rerope_attention_paged_composite(*dev[:7], 100, scale_factors=dev[7], **kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # no NaN slot was read
    assert_within_twice_the_composite(out, lse, low_out, low_lse, ref_out, ref_lse)


@pytest.mark.parametrize("spoil", ["page past the cache", "negative page", "seq_len past the table",
                                   "q_len past seq_len"])
def test_rerope_attention_paged_cuda_bad_metadata_gives_nan_rows_and_reads_nothing_outside(spoil):
    """On CUDA the metadata values are the caller's contract (no host sync): a request whose metadata
    points outside the cache gets NaN rows; the other requests are unaffected."""
    (q, key_cache, value_cache, block_table, seq_lens, qsl), _ = make_paged(PAGED_REQUESTS, 4, 2, 64, 16, torch.float32,
                                                                           seed=3, index_dtype=torch.int32)
    inv_freq, _ = paged_tables(len(PAGED_REQUESTS), 64, per_request=False)
    ref_out, ref_lse = rerope_attention_paged_composite(q.double(), key_cache.double(), value_cache.double(),
                                                        block_table, seq_lens, qsl, inv_freq, 33)
    bad = 1
    if spoil == "page past the cache":
        block_table[bad, 0] = key_cache.shape[0]
    elif spoil == "negative page":
        block_table[bad, 1] = -1
    elif spoil == "seq_len past the table":
        seq_lens[bad] = block_table.shape[1] * key_cache.shape[2] + 1
    else:
        seq_lens[bad] = int(qsl[bad + 1] - qsl[bad]) - 1
    out, lse = ops.rerope_attention_paged(*paged_on(DEVICE, [q, key_cache, value_cache, block_table, seq_lens, qsl,
                                                             inv_freq]), 33)
    torch.cuda.synchronize()  # no illegal address
    rows = torch.zeros(q.shape[0], dtype=torch.bool)
    rows[int(qsl[bad]): int(qsl[bad + 1])] = True
    assert torch.isnan(out.cpu()[rows]).all() and torch.isnan(lse.cpu()[rows]).all()
    torch.testing.assert_close(out.cpu()[~rows].double(), ref_out[~rows], atol=2e-5, rtol=2e-5)


# Issue 26's cliffs. A chunk of queries against more keys than the op's own pre-rotation budget
# (max(4 T, 65536) keys) stays on the tensor cores, rotating its key tiles in the kernel (the emulated
# tests assert the path); a reserved workspace of any size gives the same rows bit for bit (the keys
# rotated in the kernel and by the pre-pass are the same bits); decode steps allocate nothing for the
# tensor cores; a short request with a block table sized for a long max_model_len splits its keys over
# the grid (same results).


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("leaky_k,window", [(0.0, 512), (16.0, 2048), (0.0, 1 << 20)],
                         ids=["rerope", "leaky", "rope"])
def test_rerope_attention_paged_cuda_long_context_stays_exact_past_the_budget(dtype, leaky_k, window):
    """128 queries at the end of 70,000 keys (past the op's own budget of 65,536) beside decode rows, against
    the float64 oracle within twice the composite's error in that dtype; then the same call with reserved
    workspaces of every budget (none: every tensor-core request rotates in the kernel; enough for all)."""
    requests = [(1, 3000), (128, 70_000), (1, 17)]
    args = list(make_paged(requests, 4, 2, 128, 16, dtype, seed=11, index_dtype=torch.int32)[0])
    inv_freq = ops.default_inv_freq(128, BASE)
    kw = dict(leaky_k=leaky_k)
    ref_out, ref_lse = rerope_attention_paged_composite(args[0].double(), args[1].double(), args[2].double(),
                                                        *args[3:], inv_freq, window, **kw)
    dev = paged_on(DEVICE, args + [inv_freq])
    out, lse = ops.rerope_attention_paged(*dev, window, **kw)
    low_out, low_lse = rerope_attention_paged_composite(*dev, window, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # no NaN slot was read
    assert_within_twice_the_composite(out, lse, low_out, low_lse, ref_out, ref_lse)
    T = args[0].shape[0]
    for max_keys in (0, 1000, 70_000):  # in-kernel; in-kernel (70k keys past 1000); pre-rotated
        workspace = torch.empty(ops.rerope_paged_workspace_bytes(T, 2, 128, dtype, max_keys=max_keys),
                                dtype=torch.uint8, device=DEVICE)
        again = ops.rerope_attention_paged(*dev, window, workspace=workspace, **kw)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), max_keys


def test_rerope_attention_paged_cuda_decode_steps_allocate_nothing_for_the_tensor_cores():
    """A decode step (one row per request) at Hkv 8, D 128, bf16 used to allocate two 128 MiB key
    workspaces; its peak now stays within the splits' partials and the small task lists."""
    requests = [(1, 4096)] * 8
    args = paged_on(DEVICE, list(make_paged(requests, 32, 8, 128, 16, torch.bfloat16, seed=12,
                                            index_dtype=torch.int32)[0]) + [ops.default_inv_freq(128, BASE)])
    ops.rerope_attention_paged(*args, 512)  # warm up (the caching allocator, the opt-ins)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ops.rerope_attention_paged(*args, 512)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 16 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rerope_attention_paged_cuda_short_requests_with_a_long_block_table(dtype):
    """Block tables sized for a 128k max_model_len, requests of 4k and 100 keys decoding: each request
    spreads its keys over the splits by its own length (the emulated test checks the split lengths)."""
    requests = [(1, 4096), (1, 100), (2, 2000)]
    args = list(make_paged(requests, 8, 2, 64, 16, dtype, seed=13, index_dtype=torch.int32,
                           table_pages=131072 // 16)[0])
    inv_freq = ops.default_inv_freq(64, BASE)
    ref_out, ref_lse = rerope_attention_paged_composite(args[0].double(), args[1].double(), args[2].double(),
                                                        *args[3:], inv_freq, 256)
    dev = paged_on(DEVICE, args + [inv_freq])
    out, lse = ops.rerope_attention_paged(*dev, 256)
    err_out = (out.cpu().double() - ref_out).abs().max().item()
    err_lse = (lse.cpu().double() - ref_lse.double()).abs().max().item()
    if dtype == torch.float32:
        assert err_out <= 2e-5 and err_lse <= 2e-5 * (1 + ref_lse.abs().max().item())
    else:
        low_out, low_lse = rerope_attention_paged_composite(*dev, 256)
        assert err_out <= 2 * (low_out.cpu().double() - ref_out).abs().max().item() + 1e-6
        assert err_lse <= 2 * (low_lse.cpu().double() - ref_lse.double()).abs().max().item() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rerope_cache_write_cuda_matches_the_composite(dtype):
    """Raw rows at their slots (strided key/value), negative slots skipped, untouched slots kept."""
    g = torch.Generator().manual_seed(5)
    key_cache = torch.randn(4, 2, 5, 24, generator=g).to(dtype)
    value_cache = torch.randn(4, 2, 5, 24, generator=g).to(dtype)
    key = torch.randn(11, 4, 24, generator=g).to(dtype)[:, ::2]  # strided rows
    value = torch.randn(11, 2, 24, generator=g).to(dtype)
    slot_mapping = torch.tensor([7, -1, 0, 19, 3, 11, 12, -5, 8, 15, 1])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    rerope_cache_write_composite(want_k, want_v, key, value, slot_mapping)
    got_k, got_v = key_cache.to(DEVICE), value_cache.to(DEVICE)
    ops.rerope_cache_write_(got_k, got_v, *to_device(key, value, slot_mapping))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
