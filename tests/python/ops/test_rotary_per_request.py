"""apply_rotary_per_request(_): an engine's packed tokens, each rotated with the table of its request (per-request
YaRN served by an engine's own attention, keys rotated when written). Against a float64 reference written here from
the definition, against apply_rotary_pos on each request alone (the same kernel, bit for bit), over dtype x layout
(vLLM's q/k views of one qkv row) x GQA x partial rotary x odd sizes; opcheck, torch.compile, bad input."""

from __future__ import annotations

import pytest
import torch

from ropescale import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Below this, an error is the rounding of a zero (the float64 reference is exact where plain PyTorch is too).
ERROR_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
HEAD_DIM = 24


def tables(rotary_dim: int, scales=(1.0, 2.5, 4.0, 1.0, 7.3)) -> tuple[torch.Tensor, torch.Tensor]:
    """One YaRN table and attention factor per request (any real scale), float32 ``[R, P]`` and ``[R]``."""
    inv_freq = torch.stack([ops.yarn_inv_freq(rotary_dim, 10000.0, s, 64) for s in scales])
    factors = torch.tensor([ops.yarn_attention_factor(s) if s > 1 else 1.0 for s in scales], dtype=torch.float32)
    return inv_freq, factors


def packed(tokens: int, heads: int, kv_heads: int, dtype, layout: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D]: contiguous, or vLLM's views of one fused qkv row (non-dense, row stride
    (Hq + 2 Hk) D), or views one element off an aligned base (no vector access)."""
    if layout == "contiguous":
        return (torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(dtype),
                torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen).to(dtype))
    width = (heads + 2 * kv_heads) * HEAD_DIM
    offset = 1 if layout == "misaligned" else 0
    qkv = torch.randn(tokens, width + offset, generator=gen).to(dtype)[:, offset:]
    q, k, _ = qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
    return q.view(tokens, heads, HEAD_DIM), k.view(tokens, kv_heads, HEAD_DIM)


def reference(x, positions, request_index, inv_freq, factors, interleaved, dtype=torch.float64):
    """The definition: pair i of token t turned by positions[t] * inv_freq[r, i], cos and sin times factors[r],
    r = request_index[t]; in float64 from the float32 tables (the reference), or with float32 cos/sin and the
    rotation in x's dtype (what plain PyTorch gets: the precision rule's yardstick)."""
    rows = request_index.long()
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(compute)[:, None] * inv_freq.to(compute)[rows]
    cos = (angles.cos() * factors.to(compute)[rows][:, None]).to(dtype)[:, None]  # [T, 1, P]
    sin = (angles.sin() * factors.to(compute)[rows][:, None]).to(dtype)[:, None]
    pairs = inv_freq.shape[1]
    x = x.to(dtype)
    rotated = x[..., : 2 * pairs]
    if interleaved:
        a, b = rotated[..., 0::2], rotated[..., 1::2]
    else:
        a, b = rotated[..., :pairs], rotated[..., pairs:]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    y = torch.stack((ya, yb), dim=-1).flatten(-2) if interleaved else torch.cat((ya, yb), dim=-1)
    return torch.cat((y, x[..., 2 * pairs:]), dim=-1)


def assert_matches(got, x, positions, request_index, inv_freq, factors, interleaved, what):
    expected = reference(x, positions, request_index, inv_freq, factors, interleaved)
    plain = reference(x, positions, request_index, inv_freq, factors, interleaved, dtype=x.dtype)
    plain_error = (plain.double() - expected).abs().max().item() if x.numel() else 0.0
    error = (got.double() - expected).abs().max().item() if x.numel() else 0.0
    tolerance = 2.0 * plain_error + ERROR_FLOOR[x.dtype]
    assert got.dtype == x.dtype and got.shape == x.shape
    assert error <= tolerance, f"{what}: max error {error:.3g} > {tolerance:.3g} (plain PyTorch: {plain_error:.3g})"


def step(tokens: int, requests: int, gen, index_dtype=torch.int32):
    """A step's packed tokens: request r owns a run of tokens (prefill chunks and decode rows), positions
    continuing from where each request stands."""
    request_index = torch.sort(torch.randint(0, requests, (tokens,), generator=gen)).values.to(index_dtype)
    starts = torch.randint(0, 70000, (requests,), generator=gen)
    positions = torch.empty(tokens, dtype=torch.int64)
    for r in range(requests):
        rows = (request_index == r).nonzero().flatten()
        positions[rows] = starts[r] + torch.arange(rows.numel())
    return positions, request_index


# ---------------------------------------------------------------------------------------------
# The grid


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [24, 10], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("layout", ["contiguous", "qkv_views", "misaligned"])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_matches_reference(dtype, interleaved, rotary_dim, layout, tokens):
    gen = torch.Generator().manual_seed(tokens * 7 + rotary_dim)
    inv_freq, factors = tables(rotary_dim)
    positions, request_index = step(tokens, inv_freq.shape[0], gen, torch.int64 if tokens == 5 else torch.int32)
    q, k = packed(tokens, 5, 3, dtype, layout, gen)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors, interleaved)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # out of place leaves the inputs alone
    for x, y, name in ((q0, q_out, "q"), (k0, k_out, "k")):
        assert_matches(y, x, positions, request_index, inv_freq, factors, interleaved, f"{name} {layout}")
    # In place on the views: the same values, the features past rotary_dim untouched, the rest of the row (v) too.
    base = q._base if q._base is not None else None
    before = base.clone() if base is not None else None
    ops.apply_rotary_per_request_(q, k, positions, request_index, inv_freq, factors, interleaved)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)
    if base is not None:  # the value columns of the fused row: not written
        v_columns = slice(base.shape[1] - 3 * HEAD_DIM, None)
        assert torch.equal(base[:, v_columns], before[:, v_columns])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_request_equals_its_own_static_rotation_bit_for_bit(dtype):
    """A batch of mixed scales gives each request exactly what apply_rotary_pos gives it alone with its own
    table and attention factor: the engine's batch is the static model of each request's scale."""
    gen = torch.Generator().manual_seed(3)
    inv_freq, factors = tables(HEAD_DIM)
    positions, request_index = step(41, inv_freq.shape[0], gen)
    q, k = packed(41, 4, 2, dtype, "qkv_views", gen)
    q_out, k_out = ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors)
    for r in range(inv_freq.shape[0]):
        rows = (request_index == r).nonzero().flatten()
        if rows.numel() == 0:
            continue
        alone = [ops.apply_rotary_pos(x[rows].transpose(0, 1)[None], positions[rows], inv_freq[r],
                                      float(factors[r]))[0].transpose(0, 1) for x in (q, k)]
        assert torch.equal(q_out[rows], alone[0]) and torch.equal(k_out[rows], alone[1]), f"request {r}"


def test_q_alone_and_empty_steps():
    gen = torch.Generator().manual_seed(5)
    inv_freq, factors = tables(HEAD_DIM)
    positions, request_index = step(9, 5, gen)
    q, k = packed(9, 3, 1, torch.float32, "contiguous", gen)
    q_out, none = ops.apply_rotary_per_request(q, None, positions, request_index, inv_freq, factors)
    assert none is None
    assert torch.equal(q_out, ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors)[0])
    q_copy = q.clone()
    ops.apply_rotary_per_request_(q_copy, None, positions, request_index, inv_freq, factors)
    assert torch.equal(q_copy, q_out)
    # No tokens (and no requests): nothing to do, outputs of the inputs' shapes.
    empty = torch.empty(0, 3, HEAD_DIM)
    out = ops.apply_rotary_per_request(empty, empty[:, :1], positions[:0], request_index[:0], inv_freq[:0], factors[:0])
    assert out[0].shape == (0, 3, HEAD_DIM) and out[1].shape == (0, 1, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# opcheck, torch.compile (vLLM's compiled mode traces the functional op; its rotary calls it on views)


def _opcheck_samples():
    gen = torch.Generator().manual_seed(11)
    for dtype, layout, interleaved, rotary_dim in [(torch.float32, "contiguous", False, 24),
                                                   (torch.bfloat16, "qkv_views", True, 10),
                                                   (torch.float16, "misaligned", False, 16)]:
        inv_freq, factors = tables(rotary_dim)
        positions, request_index = step(13, inv_freq.shape[0], gen)
        q, k = packed(13, 4, 2, dtype, layout, gen)
        yield "apply_rotary_per_request", (q, k, positions, request_index, inv_freq, factors, interleaved)
        yield "apply_rotary_per_request_", (q.clone(), k.clone(), positions.int(), request_index, inv_freq, factors,
                                            interleaved)


def test_opcheck():
    seen = set()
    for name, args in _opcheck_samples():
        torch.library.opcheck(getattr(torch.ops.ropescale, name).default, args)
        seen.add(name)
    assert seen == {"apply_rotary_per_request", "apply_rotary_per_request_"}


def test_torch_compile_fullgraph_on_a_fused_qkv_row_matches_eager():
    def rotary_layer(qkv, positions, request_index, inv_freq, factors):
        q, k, v = qkv.split([4 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM], dim=-1)
        q, k = q.view(q.shape[0], -1, HEAD_DIM), k.view(k.shape[0], -1, HEAD_DIM)
        q, k = ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors)
        return torch.cat((q.flatten(1) * 2, k.flatten(1), v), dim=-1)  # no reduction: exact against eager

    gen = torch.Generator().manual_seed(2)
    inv_freq, factors = tables(HEAD_DIM)
    compiled = torch.compile(rotary_layer, fullgraph=True, dynamic=True)
    for tokens in (7, 19):  # a second size: the graph is not specialised to the first
        positions, request_index = step(tokens, 5, gen)
        qkv = torch.randn(tokens, 8 * HEAD_DIM, generator=gen)
        torch.testing.assert_close(compiled(qkv, positions, request_index, inv_freq, factors),
                                   rotary_layer(qkv, positions, request_index, inv_freq, factors), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the op and the argument; nothing read out of bounds.


def _bad_cases():
    R = torch.ops.ropescale
    q, k = torch.randn(5, 3, 8), torch.randn(5, 1, 8)
    pos, idx = torch.arange(5), torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    inv = torch.stack([ops.default_inv_freq(8, 1e4), ops.linear_inv_freq(8, 1e4, 2.0)])
    fac = torch.ones(2)
    f = R.apply_rotary_per_request
    yield "apply_rotary_per_request: q must be 3-D", lambda: f(q[None], k, pos, idx, inv, fac)
    yield "q and k must have the same tokens and head_dim", lambda: f(q, k[:4], pos, idx, inv, fac)
    yield "q and k must have the same dtype", lambda: f(q, k.half(), pos, idx, inv, fac)
    yield "q must be float32, float16, bfloat16 or float64, got Int", lambda: f(q.int(), k.int(), pos, idx, inv, fac)
    yield "q must have a unit stride along head_dim", lambda: f(torch.randn(5, 3, 16)[..., ::2], k, pos, idx, inv, fac)
    yield r"positions must be 1-D with one entry per token of q \(5\)", lambda: f(q, k, pos[:4], idx, inv, fac)
    yield "request_index must be int32 or int64, got Float", lambda: f(q, k, pos, idx.float(), inv, fac)
    yield r"inv_freq must be 2-D \[requests, rotary_dim / 2\]", lambda: f(q, k, pos, idx, inv[0], fac)
    yield "inv_freq must be float32, got Double", lambda: f(q, k, pos, idx, inv.double(), fac)
    yield "attention_factors must be float32, got Double", lambda: f(q, k, pos, idx, inv, fac.double())
    yield r"attention_factors must be \[requests\] with one entry per row of inv_freq \(2\)", lambda: f(
        q, k, pos, idx, inv, fac[:1])
    yield "inv_freq has no rows", lambda: f(q, k, pos, idx, inv[:0], fac[:0])
    yield r"rotary_dim \(2 \* inv_freq.size\(1\)\) = 10 is larger than head_dim = 8", lambda: f(
        q, k, pos, idx, torch.ones(2, 5), fac)
    yield r"request_index must be in \[0, 2\) \(the rows of inv_freq\), got values from 0 to 2", lambda: f(
        q, k, pos, idx + torch.tensor([0, 0, 0, 0, 1], dtype=torch.int32), inv, fac)
    yield r"request_index must be in \[0, 2\).*got values from -1 to 1", lambda: f(q, k, pos, idx - (idx == 0).int(),
                                                                                   inv, fac)
    yield "attention_factors must be finite", lambda: f(q, k, pos, idx, inv, torch.tensor([1.0, float("nan")]))
    yield r"positions must be within \+-2147483647", lambda: f(q, k, pos + 2**31, idx, inv, fac)
    yield r"request_index must be on the same device as q \(cpu\), got meta", lambda: f(
        q, k, pos, idx.to("meta"), inv, fac)
    yield r"inv_freq must be on the same device as q \(cpu\), got meta", lambda: f(q, k, pos, idx, inv.to("meta"), fac)
    yield "apply_rotary_per_request_: q is written in place but shares memory with k", lambda: (
        R.apply_rotary_per_request_(q, q, pos, idx, inv, fac))
    yield "apply_rotary_per_request_: q requires grad, but the in-place rotation is not differentiable", lambda: (
        R.apply_rotary_per_request_(q.clone().requires_grad_() * 1, k, pos, idx, inv, fac))
    yield "apply_rotary_per_request: no backward pass", lambda: ops.apply_rotary_per_request(
        q.clone().requires_grad_(), k, pos, idx, inv, fac)[0].sum().backward()


@pytest.mark.parametrize("message, call", list(_bad_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input(message, call):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_meta_tensors_take_the_same_checks():
    """FakeTensorMode / meta tensors (torch.compile's tracing) refuse what the op refuses, and shape the outputs."""
    q, k = torch.empty(5, 3, 8, device="meta"), torch.empty(5, 1, 8, device="meta")
    pos, idx = torch.empty(5, dtype=torch.long, device="meta"), torch.empty(5, dtype=torch.int32, device="meta")
    inv, fac = torch.empty(2, 4, device="meta"), torch.empty(2, device="meta")
    out = torch.ops.ropescale.apply_rotary_per_request(q, k, pos, idx, inv, fac)
    assert out[0].shape == q.shape and out[1].shape == k.shape and out[0].device.type == "meta"
    with pytest.raises(RuntimeError, match="attention_factors must be \\[requests\\]"):
        torch.ops.ropescale.apply_rotary_per_request(q, k, pos, idx, inv, fac[:1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "qkv_views", "misaligned"])
def test_cuda_matches_reference(dtype, layout):
    gen = torch.Generator().manual_seed(8)
    inv_freq, factors = tables(HEAD_DIM)
    positions, request_index = step(53, 5, gen)
    q, k = packed(53, 8, 2, dtype, layout, gen)
    args = [t.cuda() for t in (positions, request_index, inv_freq, factors)]
    q_out, k_out = ops.apply_rotary_per_request(q.cuda(), k.cuda(), *args)
    for x, y in ((q, q_out), (k, k_out)):
        assert_matches(y.cpu(), x, positions, request_index, inv_freq, factors, False, f"cuda {layout}")
    q_cuda, k_cuda = q.cuda(), k.cuda()
    ops.apply_rotary_per_request_(q_cuda, k_cuda, *args)
    assert torch.equal(q_cuda, q_out) and torch.equal(k_cuda, k_out)


def test_native_angles_reproduce_an_engines_native_table():
    """``native_angles[r]``: request r's angles formed as vLLM's cos_sin_cache and transformers' rotary form the native
    model's (a float32 product, float32 sin/cos), so a request that fits the trained length is the native model as
    the engine serves it. Against that table (torch's own float32 math) within float32 rounding; ropescale's accurate
    angles are up to 2.4e-4 rad from it at positions below 8k, which is what the flag is for."""
    from ropescale import serving

    gen = torch.Generator().manual_seed(9)
    inv_freq = torch.stack([serving.native_inv_freq(HEAD_DIM, 10000.0), ops.yarn_inv_freq(HEAD_DIM, 10000.0, 3.0, 64)])
    factors = torch.tensor([1.0, ops.yarn_attention_factor(3.0)])
    native = torch.tensor([True, False])
    positions = torch.randint(4000, 8192, (40,), generator=gen)
    request_index = (torch.arange(40) >= 30).to(torch.int32)  # 30 native tokens, 10 of a scaled request
    q, k = packed(40, 3, 1, torch.float32, "qkv_views", gen)
    got_q, got_k = ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors, native_angles=native)
    angles = positions.float()[:, None] * inv_freq[0]  # the engines' native table: float32 throughout
    cos, sin = angles.cos(), angles.sin()
    for x, y in ((q, got_q), (k, got_k)):
        want = ops.apply_rotary(x[:30].transpose(0, 1)[None], cos[:30], sin[:30], half_width=True)[0].transpose(0, 1)
        torch.testing.assert_close(y[:30], want, atol=1e-6, rtol=1e-6)
        assert_matches(y[30:], x[30:], positions[30:], request_index[30:], inv_freq, factors, False, "scaled rows")
    accurate, _ = ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors)
    assert (accurate[:30] - got_q[:30]).abs().max() > 1e-5  # without the flag: ropescale's accurate angles
    with pytest.raises(RuntimeError, match="native_angles must be bool \\[requests\\]"):
        ops.apply_rotary_per_request(q, k, positions, request_index, inv_freq, factors, native_angles=native[:1])
