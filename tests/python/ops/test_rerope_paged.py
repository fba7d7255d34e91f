"""rerope_attention_paged and rerope_cache_write_ (CPU): the op against a float64 reference over each
request's gathered pages (the two-matrix reference of support/attention.py), low precision judged
against SDPA's own error, batches mixing decode, chunked-prefill, full-prefill and empty requests,
shuffled pages, the dense op's equality, the write op, opcheck, torch.compile, ROPESCALE_KERNELS=reference."""

import dataclasses
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.library import opcheck

from ropescale import ops, scaling, serving
from ropescale.rerope import rerope_attention_paged_composite, rerope_cache_write_composite
from support import TESTS
from support.attention import BASE, SDPA_ERROR_FACTOR, sdpa_error
from support.paged import make_paged, reference_paged


def paged_sdpa_error(q, dense, requests, inv_freq, scale_factors, logn_length, interleaved):
    """SDPA's largest error in q's dtype (support.attention.sdpa_error) over the requests' problems."""
    errors = []
    start = 0
    for r, ((q_len, seq), (k, v)) in enumerate(zip(requests, dense)):
        if q_len:
            kp = torch.arange(seq)[None]
            table = inv_freq if inv_freq.dim() == 1 else inv_freq[r]
            scale = (1 / math.sqrt(q.shape[-1])) * (1.0 if scale_factors is None else float(scale_factors[r]))
            errors.append(sdpa_error(q[start : start + q_len].transpose(0, 1)[None], k[None], v[None],
                                     kp[:, seq - q_len :], kp, table, scale, logn_length, True, interleaved))
        start += q_len
    return max(e[0] for e in errors), max(e[1] for e in errors)


# A batch of each kind vLLM sends: decode rows (q_len 1..4: the decode plan), chunked-prefill rows
# (seq_len > q_len > 4), full-prefill rows (q_len = seq_len), empty requests (q_len 0, and a request
# with no keys at all), lengths at and across the 128-key blocks.
# (requests, Hq, Hkv, D, rotary_dim, window, leaky_k, logn_length, interleaved, per-request tables +
# scale_factors, q layout)
CASES = [
    ([(1, 37), (0, 20), (5, 5), (70, 200), (3, 131), (130, 130)], 4, 2, 32, 32, 16, 0.0, 0, False, True,
     "contiguous"),
    ([(2, 300), (129, 140), (1, 1), (0, 0), (4, 9), (17, 17)], 8, 1, 18, 12, 7, 16.0, 40, True, False, "strided"),
    ([(40, 257), (1, 256), (256, 256), (0, 3)], 2, 2, 64, 48, 64, 0.0, 100, False, True, "head_major"),
]
BLOCK_SIZES = (1, 16, 128, 13)


def run_case(case, block_size, dtype, seed):
    requests, q_heads, kv_heads, dim, rotary_dim, window, leaky_k, logn_length, interleaved, per_request, \
        q_layout = case
    inputs, dense = make_paged(requests, q_heads, kv_heads, dim, block_size, dtype, seed, q_layout)
    if per_request:  # Dynamic NTK at each request's own length, and an attention factor per request
        inv_freq = torch.stack([ops.dynamic_ntk_inv_freq(rotary_dim, BASE, 2.0, 64, max(seq, 1))
                                for _, seq in requests])
        scale_factors = torch.linspace(0.8, 1.3, len(requests))
    else:
        inv_freq, scale_factors = ops.default_inv_freq(rotary_dim, BASE), None
    kw = dict(leaky_k=leaky_k, scale_factors=scale_factors, logn_length=logn_length, interleaved=interleaved)
    out, lse = ops.rerope_attention_paged(*inputs, inv_freq, window, **kw)
    ref_out, ref_lse = reference_paged(inputs[0], dense, requests, inv_freq, window, **kw)
    return inputs, dense, requests, inv_freq, scale_factors, (out, lse), (ref_out, ref_lse)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_float32_matches_reference(case, block_size):
    inputs, *_, (out, lse), (ref_out, ref_lse) = run_case(CASES[case], block_size, torch.float32, seed=case)
    assert out.shape == inputs[0].shape and out.dtype == torch.float32 and lse.shape == inputs[0].shape[:2]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_low_precision_within_sdpa_error(case, block_size, dtype):
    inputs, dense, requests, inv_freq, scale_factors, (out, lse), (ref_out, ref_lse) = run_case(
        CASES[case], block_size, dtype, seed=10 + case)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
    sdpa_out, sdpa_lse = paged_sdpa_error(inputs[0], dense, requests, inv_freq, scale_factors, CASES[case][7],
                                          CASES[case][8])
    err_out = (out.double() - ref_out).abs().max().item()
    err_lse = (lse.double() - ref_lse).abs().max().item()
    assert err_out <= SDPA_ERROR_FACTOR * sdpa_out, f"out error {err_out:.3g}, SDPA's {sdpa_out:.3g}"
    assert err_lse <= SDPA_ERROR_FACTOR * sdpa_lse, f"lse error {err_lse:.3g}, SDPA's {sdpa_lse:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len,seq_len", [(1, 300), (4, 129), (5, 260), (300, 300), (77, 1000)])
@pytest.mark.parametrize("block_size", (16, 128))
def test_one_request_equals_the_dense_op_exactly(q_len, seq_len, block_size, dtype):
    """One body for both ops: a request computes exactly what rerope_attention computes for the same
    problem with dense keys (the same tiles, plan, rounding and summation order)."""
    inputs, dense = make_paged([(q_len, seq_len)], 4, 2, 32, block_size, dtype, seed=q_len)
    inv_freq = ops.default_inv_freq(32, BASE)
    out, lse = ops.rerope_attention_paged(*inputs, inv_freq, 40, leaky_k=8.0, logn_length=50)
    k, v = dense[0]
    kp = torch.arange(seq_len)[None]
    dense_out, dense_lse = ops.rerope_attention(inputs[0].transpose(0, 1)[None], k[None], v[None],
                                                kp[:, seq_len - q_len :], kp, inv_freq, 40, leaky_k=8.0, logn_length=50)
    assert torch.equal(out, dense_out[0].transpose(0, 1)) and torch.equal(lse, dense_lse[0].transpose(0, 1))


def test_requests_are_independent_of_their_batch():
    """A request computes the same thing alone and in a mixed batch (its rows, its table, its scale)."""
    requests = [(1, 200), (6, 90), (90, 90), (2, 3)]
    inputs, dense = make_paged(requests, 4, 1, 16, 16, seed=5)
    inv_freq = torch.stack([ops.dynamic_ntk_inv_freq(16, BASE, 2.0, 32, seq) for _, seq in requests])
    factors = torch.tensor([1.0, 1.2, 0.9, 1.1])
    out, lse = ops.rerope_attention_paged(*inputs, inv_freq, 8, scale_factors=factors)
    q, key_cache, value_cache, block_table, seq_lens, starts = inputs
    for r in range(len(requests)):
        rows = slice(int(starts[r]), int(starts[r + 1]))
        alone = ops.rerope_attention_paged(q[rows], key_cache, value_cache, block_table[r : r + 1], seq_lens[r : r + 1],
                                           starts[r : r + 2] - starts[r], inv_freq[r : r + 1], 8,
                                           scale_factors=factors[r : r + 1])
        torch.testing.assert_close(out[rows], alone[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse[rows], alone[1], atol=1e-6, rtol=1e-6)


def test_key_rotations_remembered_between_calls_follow_every_input_they_depend_on():
    """The CPU op keeps the last call's key cos/sin (an engine step's layers share positions and tables): a
    call that changes the tables, the lengths (positions), the window's side, or Leaky's k right after another
    must still compute its own, as the reference does; the same call twice gives the same bits."""
    requests = [(1, 300), (1, 200), (2, 140)]
    inputs, dense = make_paged(requests, 4, 2, 32, 16, seed=11)
    tables = {s: torch.stack([ops.dynamic_ntk_inv_freq(32, BASE, s, 64, seq) for _, seq in requests])
              for s in (2.0, 4.0)}
    calls = [(tables[2.0], 1 << 20, 0.0), (tables[2.0], 1 << 20, 0.0), (tables[4.0], 1 << 20, 0.0),
             (tables[4.0], 50, 0.0), (tables[4.0], 50, 8.0), (tables[4.0], 50, 4.0), (tables[2.0], 1 << 20, 0.0)]
    results = []
    for inv_freq, window, leaky_k in calls:
        out, lse = ops.rerope_attention_paged(*inputs, inv_freq, window, leaky_k=leaky_k)
        ref_out, ref_lse = reference_paged(inputs[0], dense, requests, inv_freq, window, leaky_k=leaky_k)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-6)
        results.append(out)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[-1])
    # Shorter sequences over the same pages (other positions and flags), then the first call again.
    q, key_cache, value_cache, block_table, seq_lens, starts = inputs
    shorter = [(q_len, seq - 60) for q_len, seq in requests]
    out, _ = ops.rerope_attention_paged(q, key_cache, value_cache, block_table, seq_lens - 60, starts,
                                        tables[2.0], 1 << 20)
    ref_out, _ = reference_paged(q, [(k[:, : seq], v[:, : seq]) for (k, v), (_, seq) in zip(dense, shorter)],
                                 shorter, tables[2.0], 1 << 20)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    assert torch.equal(ops.rerope_attention_paged(*inputs, tables[2.0], 1 << 20)[0], results[0])


def test_int64_metadata_and_float64_table_are_taken():
    inputs, _ = make_paged([(3, 20), (20, 20)], 2, 2, 8, 16, seed=2)
    q, key_cache, value_cache, block_table, seq_lens, starts = inputs
    inv_freq = ops.default_inv_freq(8, BASE)
    out32 = ops.rerope_attention_paged(q, key_cache, value_cache, block_table.int(), seq_lens.int(), starts.int(),
                                       inv_freq, 5)
    out64 = ops.rerope_attention_paged(q, key_cache, value_cache, block_table.long(), seq_lens.long(), starts.long(),
                                       inv_freq.double(), 5)
    assert torch.equal(out32[0], out64[0]) and torch.equal(out32[1], out64[1])


def test_composite_form_matches_reference():
    """The plain-PyTorch form (ROPESCALE_KERNELS=reference's kernel, the float64 oracle of other paths)."""
    case = CASES[1]
    inputs, dense, requests, inv_freq, scale_factors, _, (ref_out, ref_lse) = run_case(case, 13, torch.float32, 3)
    q, key_cache, value_cache, *meta = inputs
    out, lse = rerope_attention_paged_composite(q.double(), key_cache.double(), value_cache.double(), *meta,
                                                inv_freq.double(), case[5], case[6], -1.0, scale_factors, case[7],
                                                case[8])
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-10, rtol=1e-10)


def test_no_backward():
    inputs, _ = make_paged([(3, 5)], 2, 1, 8, 4)
    q = inputs[0].clone().requires_grad_()
    out, _ = ops.rerope_attention_paged(q, *inputs[1:], ops.default_inv_freq(8, BASE), 3)
    with pytest.raises(RuntimeError, match="rerope_attention_paged: the fused kernels have no backward pass"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------
# rerope_cache_write_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", (1, 16, 13))
def test_cache_write_matches_plain_form(block_size, dtype):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim, tokens = 7, 3, 24, 40
    key_cache = torch.randn(num_blocks, heads, block_size, dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, heads, block_size, dim, generator=g).to(dtype)
    # vLLM's qkv projection: key and value are strided views of one buffer
    qkv = torch.randn(tokens, 3 * heads, dim, generator=g).to(dtype)
    key, value = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens] if num_blocks * block_size >= tokens else \
        torch.randint(0, num_blocks * block_size, (tokens,), generator=g).unique()[:tokens]
    slots = torch.cat([slots, torch.full((tokens - slots.numel(),), -1)])
    slots[::5] = -1  # padding tokens
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    rerope_cache_write_composite(expected_k, expected_v, key, value, slots)
    ops.rerope_cache_write_(key_cache, value_cache, key, value, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_cache_write_then_attention_equals_dense():
    """The write op stores what the attention op reads: a prefill written through slot_mapping."""
    g = torch.Generator().manual_seed(0)
    seq, heads, dim, block_size = 50, 2, 16, 16
    k, v, q = (torch.randn(seq, heads, dim, generator=g) for _ in range(3))
    kv_cache = torch.zeros(2, 6, heads, block_size, dim)  # vLLM's [2, num_blocks, ...] tensor
    block_table = torch.tensor([[4, 0, 5, 2]])
    slots = block_table[0, torch.arange(seq) // block_size] * block_size + torch.arange(seq) % block_size
    ops.rerope_cache_write_(kv_cache[0], kv_cache[1], k, v, slots)
    inv_freq = ops.default_inv_freq(dim, BASE)
    out, _ = ops.rerope_attention_paged(q, kv_cache[0], kv_cache[1], block_table, torch.tensor([seq]),
                                        torch.tensor([0, seq]), inv_freq, 9)
    pos = torch.arange(seq)[None]
    dense, _ = ops.rerope_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], pos,
                                    pos, inv_freq, 9)
    assert torch.equal(out, dense[0].transpose(0, 1))


# ---------------------------------------------------------------------------------------------
# opcheck, torch.compile, the reference kernels


def _samples():
    inputs, _ = make_paged([(1, 9), (0, 4), (6, 6), (3, 20)], 4, 2, 8, 4, seed=1)
    inv_freq = ops.default_inv_freq(8, BASE)
    yield inputs + (inv_freq, 3), {}
    yield inputs + (inv_freq[None].expand(4, 4).contiguous(), 3, 16.0, 0.5), {
        "scale_factors": torch.full((4,), 1.5), "logn_length": 5, "interleaved": True}
    bf16 = (inputs[0].bfloat16(), inputs[1].bfloat16(), inputs[2].bfloat16()) + inputs[3:]
    yield bf16 + (inv_freq, 2), {}


@pytest.mark.parametrize("sample", list(_samples()), ids=range(3))
def test_opcheck_attention(sample):
    args, kwargs = sample
    opcheck(torch.ops.ropescale.rerope_attention_paged.default, args, kwargs)


def test_opcheck_attention_with_a_workspace():
    inputs, _ = make_paged([(1, 9), (6, 6), (3, 20)], 4, 2, 64, 4, seed=2)
    q, key_cache, value_cache = (t.bfloat16() for t in inputs[:3])
    workspace = torch.zeros(ops.rerope_paged_workspace_bytes(q.shape[0], 2, 64, torch.bfloat16, max_keys=40),
                            dtype=torch.uint8)
    opcheck(torch.ops.ropescale.rerope_attention_paged.workspace,
            (q, key_cache, value_cache) + inputs[3:] + (ops.default_inv_freq(64, BASE), 3), {"workspace": workspace})


# ---------------------------------------------------------------------------------------------
# The workspace: CUDA scratch an engine reserves once (rerope_paged_workspace_bytes); checked the same
# way on every backend, ignored by the CPU kernel.


def test_workspace_bytes_follow_the_layout():
    """256 bytes of alignment slack, the queries' sin/cos (T x D/2 x 16 bytes, 256-aligned), two sides of
    max_keys pre-rotated keys (Hkv x D x 2 bytes each, 256-aligned); 0 where CUDA takes no tensor cores."""
    T, kv_heads, dim = 8192, 8, 128
    queries = 256 + T * dim // 2 * 16
    assert ops.rerope_paged_workspace_bytes(T, kv_heads, dim, torch.bfloat16, max_keys=0) == queries
    assert ops.rerope_paged_workspace_bytes(T, kv_heads, dim, torch.float16, max_keys=1000) == \
        queries + 2 * 1000 * kv_heads * dim * 2
    # The default budget: max(4 T, 65536) keys (what the op allocates for itself without a workspace).
    for tokens in (100, T, 32768):
        assert ops.rerope_paged_workspace_bytes(tokens, kv_heads, dim, torch.bfloat16) == \
            ops.rerope_paged_workspace_bytes(tokens, kv_heads, dim, torch.bfloat16, max_keys=max(4 * tokens, 65536))
    assert ops.rerope_paged_workspace_bytes(T, kv_heads, dim, torch.float32) == 0
    assert ops.rerope_paged_workspace_bytes(T, kv_heads, 256, torch.bfloat16) == 0
    assert ops.rerope_paged_workspace_bytes(T, kv_heads, 48, torch.float16) == 0
    with pytest.raises(RuntimeError, match="rerope_paged_workspace_bytes: max_keys must be >= 0"):
        ops.rerope_paged_workspace_bytes(T, kv_heads, dim, torch.bfloat16, max_keys=-5)
    with pytest.raises(RuntimeError, match="rerope_paged_workspace_bytes: head_dim must be even"):
        ops.rerope_paged_workspace_bytes(T, kv_heads, 7, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_workspace_changes_nothing_on_cpu(dtype):
    requests = [(1, 30), (9, 40), (5, 5)]
    inputs, _ = make_paged(requests, 4, 2, 64, 16, dtype=dtype, seed=6)
    inv_freq = ops.default_inv_freq(64, BASE)
    want = ops.rerope_attention_paged(*inputs, inv_freq, 7, leaky_k=8.0)
    workspace = torch.full((ops.rerope_paged_workspace_bytes(15, 2, 64, dtype) + 13,), 7, dtype=torch.uint8)
    got = ops.rerope_attention_paged(*inputs, inv_freq, 7, leaky_k=8.0, workspace=workspace)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    composite = rerope_attention_paged_composite(*inputs, inv_freq, 7, leaky_k=8.0, workspace=workspace)
    torch.testing.assert_close(composite[0], want[0], atol=2e-2 if dtype != torch.float32 else 2e-5, rtol=0)


def test_a_bad_workspace_is_refused_by_every_path():
    """Wrong dtype, shape, device, layout, or fewer bytes than this call's T needs (fp16/bf16 at the tensor
    cores' head dims): the op (CPU), its Meta kernel (FakeTensorMode) and the composite refuse alike."""
    inputs, _ = make_paged([(1, 30), (9, 40)], 4, 2, 64, 16, dtype=torch.bfloat16, seed=7)
    inv_freq = ops.default_inv_freq(64, BASE)
    T = inputs[0].shape[0]
    need = ops.rerope_paged_workspace_bytes(T, 2, 64, torch.bfloat16, max_keys=0)
    cases = [
        (torch.zeros(need, dtype=torch.int32), "workspace must be a 1-D uint8 tensor"),
        (torch.zeros(2, need, dtype=torch.uint8), "workspace must be a 1-D uint8 tensor"),
        (torch.zeros(2 * need, dtype=torch.uint8)[::2], "workspace must be contiguous"),
        (torch.zeros(need, dtype=torch.uint8, device="meta"), "workspace must be on cpu like q"),
        (torch.zeros(need - 1, dtype=torch.uint8),
         f"workspace has {need - 1} bytes, a call with T = {T} query rows needs at least {need}"),
    ]
    for workspace, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.rerope_attention_paged(*inputs, inv_freq, 7, workspace=workspace)
        with pytest.raises(RuntimeError, match=message):
            rerope_attention_paged_composite(*inputs, inv_freq, 7, workspace=workspace)
        if workspace.device.type != "meta":
            from torch._subclasses.fake_tensor import FakeTensorMode
            with FakeTensorMode() as mode:
                fake = [mode.from_tensor(t) for t in inputs + (inv_freq, workspace)]
                with pytest.raises(RuntimeError, match=message):
                    torch.ops.ropescale.rerope_attention_paged.workspace(*fake[:7], 7, workspace=fake[7])
    # Exactly enough: taken. float32 (no tensor cores on CUDA) needs none: an empty workspace is taken.
    ops.rerope_attention_paged(*inputs, inv_freq, 7, workspace=torch.zeros(need, dtype=torch.uint8))
    f32 = [t.float() if t.is_floating_point() else t for t in inputs]
    ops.rerope_attention_paged(*f32, inv_freq, 7, workspace=torch.zeros(0, dtype=torch.uint8))


def test_opcheck_cache_write():
    key_cache, value_cache = torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    opcheck(torch.ops.ropescale.rerope_cache_write_.default, (key_cache, value_cache, key, value,
                                                               torch.tensor([3, -1, 0, 11, 7])))


def test_torch_compile_of_a_function_calling_both_ops():
    inputs, _ = make_paged([(1, 9), (6, 6), (0, 2)], 4, 2, 8, 4, seed=4)
    q, key_cache, value_cache, block_table, seq_lens, starts = inputs
    inv_freq = ops.default_inv_freq(8, BASE)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    slots = torch.tensor([int(block_table[2, 0]) * 4, -1])

    def step(q, key_cache, value_cache, key, value):
        ops.rerope_cache_write_(key_cache, value_cache, key, value, slots)
        out, lse = ops.rerope_attention_paged(q * 2, key_cache, value_cache, block_table, seq_lens, starts, inv_freq, 3)
        return out + 1, lse

    eager_caches = (key_cache.clone(), value_cache.clone())
    expected = step(q, *eager_caches, key, value)
    compiled_caches = (key_cache.clone(), value_cache.clone())
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, *compiled_caches, key, value)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for compiled, eager in zip(compiled_caches, eager_caches):  # the unused slots are NaN
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(eager_caches[0][int(block_table[2, 0]), :, 0], key_cache[int(block_table[2, 0]), :, 0])


def test_reference_kernels_route_both_ops():
    """ROPESCALE_KERNELS=reference runs the plain-PyTorch forms (and refuses what the op refuses)."""
    script = textwrap.dedent("""
        import torch, ropescale
        from ropescale import ops
        from support.paged import make_paged, reference_paged
        requests = [(1, 30), (7, 7), (0, 4)]
        inputs, dense = make_paged(requests, 2, 1, 8, 16)
        f = ops.default_inv_freq(8, 1e4)
        out, lse = ops.rerope_attention_paged(*inputs, f, 5)
        ref, ref_lse = reference_paged(inputs[0], dense, requests, f, 5)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        kc, vc = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
        ops.rerope_cache_write_(kc, vc, torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.tensor([5, -1]))
        assert kc[1, 0, 1].eq(1).all() and kc.sum() == 8
        try:
            ops.rerope_cache_write_(kc, vc, torch.ones(1, 1, 8), torch.ones(1, 1, 8), torch.tensor([8]))
        except RuntimeError as e:
            assert "slot_mapping[0] = 8 is past the cache" in str(e), e
        else:
            raise AssertionError("no error")
        print("reference-ok", ropescale.build_info()["kernels"])
    """)
    env = {**os.environ, "ROPESCALE_KERNELS": "reference",
           "PYTHONPATH": os.pathsep.join([str(TESTS)] + sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reference-ok reference" in result.stdout


# A partial-rotary head (Phi-3, GLM-4) under a method whose attention factor m is not 1: transformers puts m on cos
# and sin, so the rotated dims' part of a score is times m^2 and the rest is not; the op scales whole scores, so
# the engines pass it a query whose rotated dims are times m^2 (serving.PreRopePlan.attention_arguments).
PARTIAL_REQUESTS = [(5, 30), (1, 41), (0, 7), (3, 12)]  # a chunk of a prefill, a decode row, an empty request


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("window,leaky_k,logn_length", [(6, 0.0, 0), (6, 2.0, 10)], ids=["rerope", "leaky_logn"])
def test_partial_rotary_attention_factor_on_the_rotated_dims_only(interleaved, window, leaky_k, logn_length):
    """Head dim 16, rotary dim 8, both pair layouts, a factor per request (segment) and a static one: the op fed
    by attention_arguments equals the float64 reference of transformers' rule (m on the rotated dims of q and k);
    a fully rotated head's arguments pass through untouched."""
    head_dim, rotary_dim = 16, 8
    inputs, dense = make_paged(PARTIAL_REQUESTS, 4, 2, head_dim, 16, seed=21)
    q, key_cache, value_cache, block_table, seq_lens, starts = inputs
    starts = starts.int()
    inv_freq = torch.stack([ops.dynamic_ntk_inv_freq(rotary_dim, BASE, 2.0, 16, max(seq, 1))
                            for _, seq in PARTIAL_REQUESTS])
    factors = torch.tensor([1.25, 0.8, 1.0, 1.4], dtype=torch.float64)  # m per request
    plan = serving.PreRopePlan(scaling.DynamicYaRN(original_max_position=16), BASE, rotary_dim, window, leaky_k,
                               logn_length, interleaved)
    scale = head_dim ** -0.5
    dynamic_q, dynamic_scale, dynamic_factors = plan.attention_arguments(
        q, head_dim, scale, 1.0, (factors ** 2).float(), starts)
    static = 1.3
    static_q, static_scale, static_factors = plan.attention_arguments(q, head_dim, scale, static ** 2)
    common = dict(leaky_k=leaky_k, logn_length=logn_length, interleaved=interleaved)
    for got_q, got_scale, got_factors, table, m in (
            (dynamic_q, dynamic_scale, dynamic_factors, inv_freq, factors),
            (static_q, static_scale, static_factors, inv_freq[0], torch.full((len(PARTIAL_REQUESTS),), static))):
        out, lse = ops.rerope_attention_paged(got_q, key_cache, value_cache, block_table, seq_lens, starts, table,
                                              window, scale=got_scale, scale_factors=got_factors, **common)
        ref_out, ref_lse = reference_paged(q, dense, PARTIAL_REQUESTS, table, window, scale=scale, factors=m, **common)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-6)
    assert dynamic_scale == static_scale == scale and dynamic_factors is None and static_factors is None
    flat_q, *_ = plan.attention_arguments(q.flatten(1), head_dim, scale, 1.0, (factors ** 2).float(), starts)
    assert torch.equal(flat_q.view_as(q), dynamic_q)  # [T, H * D] as [T, H, D]
    # Rows past the last segment (a padded batch) take the last segment's factor; the pass-through dims stay.
    padded = torch.cat((q, q[-1:], q[-1:]))
    padded_q, *_ = plan.attention_arguments(padded, head_dim, scale, 1.0, (factors ** 2).float(), starts)
    assert torch.equal(padded_q[: q.shape[0]], dynamic_q) and torch.equal(padded_q[-1], dynamic_q[-1])
    assert torch.equal(dynamic_q[..., rotary_dim:], q[..., rotary_dim:])
    # Every dim rotated: the op's whole-score factor is transformers' rule, the arguments pass through as given.
    full = dataclasses.replace(plan, rotary_dim=head_dim)
    factors32 = (factors ** 2).float()
    got = full.attention_arguments(q, head_dim, scale, 1.0, factors32, starts)
    assert got[0] is q and got[1] == scale and got[2] is factors32
    assert full.attention_arguments(q, head_dim, scale, static ** 2)[1] == scale * static ** 2
    # A method whose factor is 1 at every length (Dynamic NTK): no copy on a partial-rotary head either.
    ntk = dataclasses.replace(plan, method=scaling.DynamicNTK(original_max_position=16))
    ones = torch.ones(len(PARTIAL_REQUESTS))
    assert ntk.attention_arguments(q, head_dim, scale, 1.0, ones, starts)[0] is q
