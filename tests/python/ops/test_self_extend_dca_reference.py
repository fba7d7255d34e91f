"""The float64 references of Self-Extend and Dual Chunk Attention (support.attention.reference_self_extend,
reference_dual_chunk) against their definitions (docs/DESIGN.md, "Self-Extend and Dual Chunk Attention"):
plain RoPE attention where the methods must reduce to it, hand-computed relative positions per region
(read back from the references' scores), the authors' region-by-region algorithms merged by log-sum-exp,
and GQA, padding and interleaved pairs."""

import math

import pytest
import torch

from support.attention import BASE, make_inputs, reference, reference_dual_chunk, reference_self_extend, rot64

ROPE = 1 << 40  # a ReRoPE window past every distance: plain RoPE attention


def inv_freq_of(dim, base=BASE):
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def assert_same(got, want, tol=1e-12):
    (out, lse), (ref_out, ref_lse) = got, want
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


def relative_positions(method, qp, kp, theta=0.01, **kwargs):
    """The relative position r(i, j) each visible (query, key) pair sees in ``method`` (a reference),
    read back from its scores: one frequency theta, key (1, 0) and two query heads (1, 0) and (0, 1) on
    it, so the scores are cos(theta r) and -sin(theta r); values one-hot per key, so ``out`` is the
    attention matrix and log(out) + lse the scores. NaN where a pair is not visible. |theta r| < pi."""
    batch, q_len, k_len = qp.shape[0], qp.shape[1], kp.shape[1]
    q = torch.zeros(batch, 2, q_len, 2, dtype=torch.float64)
    q[:, 0, :, 0] = 1
    q[:, 1, :, 1] = 1
    k = torch.zeros(batch, 1, k_len, 2, dtype=torch.float64)
    k[..., 0] = 1
    v = torch.eye(k_len, dtype=torch.float64).expand(batch, 1, k_len, k_len)
    out, lse = method(q, k, v, qp, kp, torch.tensor([theta], dtype=torch.float64), scale=1.0, **kwargs)
    scores = out.log() + lse[..., None]  # -inf where not visible
    rel = torch.atan2(-scores[:, 1], scores[:, 0]) / theta
    return torch.where(torch.isfinite(scores[:, 0]), rel, math.nan)


def attention_from_relative(q, k, v, rel, inv_freq, scale=None):
    """Causal single-row-per-query attention from hand-given relative positions ``rel`` [Lq, Lk] (NaN:
    not visible), for batch 1 and Hq == Hkv: score(i, j) = <rot(q_i, rel[i, j]), k_j> * scale, the RoPE
    identity <rot(q, a), rot(k, b)> = <rot(q, a - b), k>."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.full((q.shape[1], q.shape[2], k.shape[2]), -math.inf, dtype=torch.float64)
    for i in range(rel.shape[0]):
        for j in range(rel.shape[1]):
            if not math.isnan(rel[i, j]):
                rq = rot64(q[:, :, i : i + 1], torch.tensor([[rel[i, j]]], dtype=torch.float64), inv_freq)
                scores[:, i, j] = (rq[0, :, 0] * k[0, :, j]).sum(-1) * scale
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ v[0])[None], lse[None]


# ---------------------------------------------------------------------------------------------
# Self-Extend


@pytest.mark.parametrize("window", [1, 5, 16])
def test_self_extend_group_1_is_rope(window):
    """G = 1: the grouped positions are the positions and the shift W - W // 1 is 0."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 24, 40, 16, torch.float64, pad=3, seed=1)
    inv_freq = inv_freq_of(16)
    assert_same(reference_self_extend(q, k, v, qp, kp, inv_freq, window, 1), reference(q, k, v, qp, kp, inv_freq, ROPE))


@pytest.mark.parametrize("group", [2, 3, 8])
def test_self_extend_window_past_every_distance_is_rope(group):
    q, k, v, qp, kp = make_inputs(2, 4, 2, 24, 40, 16, torch.float64, pad=3, seed=2)
    inv_freq = inv_freq_of(16)
    assert_same(reference_self_extend(q, k, v, qp, kp, inv_freq, 40, group), reference(q, k, v, qp, kp, inv_freq, ROPE))


def test_self_extend_group_past_every_position_is_rerope():
    """G > every position and W < G: grouped q at W, grouped k at 0, so the far region is ReRoPE's."""
    q, k, v, qp, kp = make_inputs(2, 4, 2, 24, 40, 16, torch.float64, pad=3, seed=3)
    inv_freq = inv_freq_of(16)
    assert_same(reference_self_extend(q, k, v, qp, kp, inv_freq, 6, 64), reference(q, k, v, qp, kp, inv_freq, 6))


# Hand-computed: query i, keys 0..i. Neighbour (i - j < W): i - j. Grouped (i - j >= W): i//G + W - W//G - j//G.
#   i=9, W=4, G=2: grouped q at 4 + 2 = 6; keys 0..5 -> 6,6,5,5,4,4; keys 6..9 -> 3,2,1,0.
#   i=8, W=5, G=2: grouped q at 4 + 3 = 7; keys 0..3 -> 7,7,6,6; keys 4..8 -> 4,3,2,1,0. Distance 5 == W
#   (key 3) is grouped: 6, where the neighbour rule would give 5 (with G | W both give W; here they differ),
#   and LongLM's fractional shift W - W/G = 2.5 would give 5.5.
#   i=14, W=4, G=3: grouped q at 4 + 3 = 7; keys 0..10 -> 7,7,7,6,6,6,5,5,5,4,4; keys 11..14 -> 3,2,1,0.
SELF_EXTEND_CASES = [
    (9, 4, 2, [6, 6, 5, 5, 4, 4, 3, 2, 1, 0]),
    (8, 5, 2, [7, 7, 6, 6, 4, 3, 2, 1, 0]),
    (14, 4, 3, [7, 7, 7, 6, 6, 6, 5, 5, 5, 4, 4, 3, 2, 1, 0]),
]


@pytest.mark.parametrize("i, window, group, expected", SELF_EXTEND_CASES)
def test_self_extend_hand_computed_relative_positions(i, window, group, expected):
    qp, kp = torch.tensor([[i]]), torch.arange(i + 1)[None]
    rel = relative_positions(reference_self_extend, qp, kp, window=window, group=group)
    torch.testing.assert_close(rel[0, 0], torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("i, window, group, expected", SELF_EXTEND_CASES)
def test_self_extend_hand_computed_angles(i, window, group, expected):
    """The same cases on random q/k/v with 4 frequencies: out and lse equal attention built by hand from
    the expected relative position of each key."""
    g = torch.Generator().manual_seed(i)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (1, i + 1, i + 1))
    inv_freq = inv_freq_of(8)
    qp, kp = torch.tensor([[i]]), torch.arange(i + 1)[None]
    want = attention_from_relative(q, k, v, torch.tensor([expected], dtype=torch.float64), inv_freq)
    assert_same(reference_self_extend(q, k, v, qp, kp, inv_freq, window, group), want)


def longlm_self_extend(q, k, v, inv_freq, window, group):
    """The authors' algorithm (Jin et al. 2024, Algorithm 1; LongLM's patches), for batch 1, positions
    0..L-1, full prefill: neighbour scores (RoPE at the positions) and grouped scores (q at pos // G +
    W - W // G, k at pos // G), merged by replacement with mask = tril(ones) less tril(ones([L - W, L - W]))
    placed at [W:, :-W]."""
    length = q.shape[2]
    pos = torch.arange(length)[None]
    ngb = rot64(q, pos, inv_freq) @ rot64(k, pos, inv_freq).transpose(-1, -2)
    grp_q = rot64(q, pos // group + window - window // group, inv_freq)
    grp = grp_q @ rot64(k, pos // group, inv_freq).transpose(-1, -2)
    mask = torch.tril(torch.ones(length, length))
    if length > window:
        mask[window:, :-window] -= torch.tril(torch.ones(length - window, length - window))
    scores = torch.where(mask.bool(), ngb, grp) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.tril(torch.ones(length, length)).bool(), -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_self_extend_grouped_positions_join_the_window():
    """Every grouped pair sees a relative position >= W and the largest is i // G + W - W // G at key 0:
    with G | W, length (L - W) * G + W keeps every position <= L - 1 (the paper's extended length)."""
    window, group, trained = 8, 4, 32
    length = (trained - window) * group + window
    pos = torch.arange(length)[None]
    rel = relative_positions(reference_self_extend, pos, pos, theta=0.05, window=window, group=group)
    dist = (pos[0, :, None] - pos[0, None, :]).double()
    grouped = dist >= window
    assert rel[0][grouped].min().round() == window
    assert rel[0][grouped].max().round() == trained - 1
    torch.testing.assert_close(rel[0][(dist >= 0) & ~grouped], dist[(dist >= 0) & ~grouped], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Dual Chunk Attention


@pytest.mark.parametrize("chunk_size, local_size", [(24, 5), (24, 0), (9, 3)])
def test_dual_chunk_short_sequence_is_rope(chunk_size, local_size):
    """With local_size < chunk_size - local_size, every position up to chunk_size sees its true distance
    (the successive query min(n + offset, chunk_size) is the position itself): length chunk_size + 1 is plain
    RoPE attention, and one more token is not (its distance to key 0 is clipped to chunk_size)."""
    length = chunk_size + 1
    q, k, v, qp, kp = make_inputs(2, 4, 2, length, length, 16, torch.float64, pad=2, seed=5)
    inv_freq = inv_freq_of(16)
    assert_same(reference_dual_chunk(q, k, v, qp, kp, inv_freq, chunk_size, local_size),
                reference(q, k, v, qp, kp, inv_freq, ROPE))
    q, k, v, qp, kp = make_inputs(1, 2, 2, length + 1, length + 1, 16, torch.float64, seed=5)
    out, _ = reference_dual_chunk(q, k, v, qp, kp, inv_freq, chunk_size, local_size)
    rope_out, _ = reference(q, k, v, qp, kp, inv_freq, ROPE)
    torch.testing.assert_close(out[:, :, :-1], rope_out[:, :, :-1], atol=1e-12, rtol=1e-12)
    assert (out[:, :, -1] - rope_out[:, :, -1]).abs().max() > 1e-6


def test_dual_chunk_wide_local_window_limits_exactness():
    """local_size >= n: the third chunk starts at 2n <= chunk_size and is inter-chunk there, so plain RoPE
    holds only up to length 2n (chunk_size=10, local_size=6: n = 4, inter query at min(7, 10) = 7)."""
    pos = torch.arange(12)[None]
    rel = relative_positions(reference_dual_chunk, pos, pos, chunk_size=10, local_size=6)
    dist = (pos[0, :, None] - pos[0, None, :]).double()
    torch.testing.assert_close(rel[0, :8, :8].nan_to_num(-1), dist[:8, :8].where(dist[:8, :8] >= 0, -1.0),
                               atol=1e-6, rtol=0)
    assert rel[0, 8, 0].round() == 7  # true distance 8: inter-chunk, query at 2n - 1 = 7, key 0 at offset 0


# Hand-computed, the paper's Figure 2 example in Qwen's parameters: pretraining c = 10, chunk s = 6, local
# window w = 4 is chunk_size = c - 1 = 9, local_size = w - 1 = 3 (n = 9 - 3 = 6). Keys at p % 6.
#   intra (same chunk): query at i % 6; successive (previous chunk): query at min(6 + i % 6, 9) (the paper's
#   [6, 7, 8, 9, 9, 9]); inter (earlier chunks): query at min(2 * 6 - 1, 9) = 9 (the paper's c - 1).
DCA_ROWS = {
    0: [0],
    5: [5, 4, 3, 2, 1, 0],  # chunk 0: true distances
    6: [6, 5, 4, 3, 2, 1, 0],  # chunk 1 offset 0: successive q at 6 -> 6 - j (true), key 6 intra
    9: [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],  # offset 3 = local_size: successive q at 9 = 6 + 3, still true
    10: [9, 8, 7, 6, 5, 4, 4, 3, 2, 1, 0],  # offset 4: successive q clipped to 9 -> key 0 sees 9 (true 10)
    11: [9, 8, 7, 6, 5, 4, 5, 4, 3, 2, 1, 0],  # successive q 9: keys 0..5 -> 9..4; intra keys 6..11 -> 5..0
    12: [9, 8, 7, 6, 5, 4, 6, 5, 4, 3, 2, 1, 0],  # chunk 2: inter keys 0..5 (q 9), successive 6..11 (q 6)
    15: [9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],  # successive q min(6 + 3, 9) = 9; intra 12..15
    17: [9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5, 4, 5, 4, 3, 2, 1, 0],  # offset 5: successive q clipped to 9
    18: [9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5, 4, 6, 5, 4, 3, 2, 1, 0],  # chunk 3: keys 0..11 inter, 12..17 succ
}


def test_dual_chunk_hand_computed_relative_positions():
    pos = torch.arange(19)[None]
    rel = relative_positions(reference_dual_chunk, pos, pos, chunk_size=9, local_size=3)
    for i, expected in DCA_ROWS.items():
        row = torch.full((19,), math.nan, dtype=torch.float64)
        row[: i + 1] = torch.tensor(expected, dtype=torch.float64)
        torch.testing.assert_close(rel[0, i], row, atol=1e-6, rtol=0, equal_nan=True, msg=f"query {i}")


def test_dual_chunk_hand_computed_angles():
    """Rows of the hand-computed table on random q/k/v with 4 frequencies, as attention built by hand."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 19, 8, generator=g, dtype=torch.float64) for _ in range(3))
    inv_freq = inv_freq_of(8)
    rows = sorted(DCA_ROWS)
    rel = torch.full((len(rows), 19), math.nan, dtype=torch.float64)
    for r, i in enumerate(rows):
        rel[r, : i + 1] = torch.tensor(DCA_ROWS[i], dtype=torch.float64)
    want = attention_from_relative(q[:, :, rows], k, v, rel, inv_freq)
    got = reference_dual_chunk(q[:, :, rows], k, v, torch.tensor([rows]), torch.arange(19)[None], inv_freq, 9, 3)
    assert_same(got, want)


@pytest.mark.parametrize("chunk_size, local_size, largest", [(24, 5, 24), (32, 8, 32), (10, 6, 7), (16, 0, 16)])
def test_dual_chunk_largest_relative_distance(chunk_size, local_size, largest):
    """Over a long random-length case (many chunks, left padding): every pair sees a distance in
    [0, min(chunk_size, 2n - 1)], that bound is reached, same-chunk pairs see their true distance, and a
    previous-chunk pair sees its true distance exactly when the query's offset is <= local_size."""
    n = chunk_size - local_size
    qp = kp = torch.stack([torch.arange(200), torch.arange(200) - 37])  # row 1: 37 padding tokens
    rel = relative_positions(reference_dual_chunk, qp, kp, theta=0.05, chunk_size=chunk_size, local_size=local_size)
    dist = (qp[:, :, None] - kp[:, None, :]).double()
    seen = ~rel.isnan()
    assert torch.equal(seen, (dist >= 0) & (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0))
    rounded = rel[seen].round()
    torch.testing.assert_close(rel[seen], rounded, atol=1e-6, rtol=0)
    assert rounded.min() == 0 and rounded.max() == largest == min(chunk_size, 2 * n - 1)
    apart = (qp // n)[:, :, None] - (kp // n)[:, None, :]
    torch.testing.assert_close(rel[seen & (apart == 0)], dist[seen & (apart == 0)], atol=1e-6, rtol=0)
    near = seen & (apart == 1) & ((qp % n)[:, :, None] <= local_size)
    torch.testing.assert_close(rel[near], dist[near], atol=1e-6, rtol=0)


def chunkllama_dual_chunk(q, k, v, inv_freq, chunk_size, local_size):
    """The authors' and vLLM's algorithm (ChunkLlama's forward, vLLM's dual_chunk_flash_attn prefill), for
    batch 1, positions 0..L-1: per chunk of n = chunk_size - local_size queries, causal attention over its own
    chunk (q at offset), attention over the whole previous chunk (q at min(offset + n, chunk_size)) and over
    every earlier key (q at min(2n - 1, chunk_size)), keys at p % n; the parts merged by log-sum-exp."""
    n = chunk_size - local_size
    length = q.shape[2]
    pos = torch.arange(length)
    k_rot = rot64(k, (pos % n)[None], inv_freq)
    scale = 1 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for begin in range(0, length, n):
        end = min(begin + n, length)
        qs, offs = q[:, :, begin:end], (pos[begin:end] % n)[None]
        parts = []
        s = rot64(qs, offs, inv_freq) @ k_rot[:, :, begin:end].transpose(-1, -2) * scale
        parts.append((s.masked_fill(~torch.tril(torch.ones(end - begin, end - begin)).bool(), -math.inf),
                      v[:, :, begin:end]))
        if begin >= n:
            s = rot64(qs, (offs + n).clamp(max=chunk_size), inv_freq) @ k_rot[:, :, begin - n : begin].transpose(-1, -2)
            parts.append((s * scale, v[:, :, begin - n : begin]))
        if begin >= 2 * n:
            far = rot64(qs, torch.full_like(offs, min(2 * n - 1, chunk_size)), inv_freq)
            s = far @ k_rot[:, :, : begin - n].transpose(-1, -2)
            parts.append((s * scale, v[:, :, : begin - n]))
        part_lse = torch.stack([torch.logsumexp(s, -1) for s, _ in parts])
        part_out = torch.stack([torch.softmax(s, -1) @ vs for s, vs in parts])
        lse = torch.logsumexp(part_lse, 0)
        outs.append((part_out * torch.exp(part_lse - lse)[..., None]).sum(0))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


@pytest.mark.parametrize("method, parameters", [
    *(("self_extend", wg) for wg in [(4, 2), (5, 2), (7, 3), (1, 4)]),  # (window, group)
    *(("dual_chunk", cl) for cl in [(9, 3), (12, 4), (10, 6), (8, 0)]),  # (chunk_size, local_size)
])
def test_reference_matches_the_authors_algorithm(method, parameters):
    """Each reference against a re-implementation of its authors' algorithm (LongLM's grouped attention,
    ChunkLlama's three chunk regions)."""
    reference, authors, length, seed = {"self_extend": (reference_self_extend, longlm_self_extend, 30, 4),
                                        "dual_chunk": (reference_dual_chunk, chunkllama_dual_chunk, 40, 8)}[method]
    q, k, v, qp, kp = make_inputs(1, 2, 2, length, length, 8, torch.float64, seed=seed)
    inv_freq = inv_freq_of(8)
    assert_same(reference(q, k, v, qp, kp, inv_freq, *parameters), authors(q, k, v, inv_freq, *parameters))


def test_dual_chunk_refuses_bad_parameters():
    q, k, v, qp, kp = make_inputs(1, 2, 2, 4, 4, 8, torch.float64)
    inv_freq = inv_freq_of(8)
    for chunk_size, local_size in [(8, 8), (8, 9), (8, -1), (8.0, 2), (8, True)]:
        with pytest.raises(ValueError):
            reference_dual_chunk(q, k, v, qp, kp, inv_freq, chunk_size, local_size)
    with pytest.raises(ValueError, match="causal"):
        reference_dual_chunk(q, k, v, qp, kp, inv_freq, 8, 2, causal=False)
    for window, group in [(0, 2), (4, 0), (4.0, 2), (4, True)]:
        with pytest.raises(ValueError):
            reference_self_extend(q, k, v, qp, kp, inv_freq, window, group)


# ---------------------------------------------------------------------------------------------
# Both: GQA, padding, interleaved pairs, decode rows

METHODS = {
    "self_extend": lambda *a, **kw: reference_self_extend(*a, 5, 2, **kw),
    "self_extend_g3": lambda *a, **kw: reference_self_extend(*a, 4, 3, **kw),
    "dual_chunk": lambda *a, **kw: reference_dual_chunk(*a, 9, 3, **kw),
    "dual_chunk_wide": lambda *a, **kw: reference_dual_chunk(*a, 10, 6, **kw),
}


@pytest.mark.parametrize("name", METHODS)
def test_gqa_is_repeated_kv_heads(name):
    """Query head h reads kv head h // (Hq / Hkv) (repeat_interleave, as transformers' repeat_kv)."""
    method = METHODS[name]
    q, k, v, qp, kp = make_inputs(2, 6, 2, 20, 30, 8, torch.float64, pad=4, seed=9)
    inv_freq = inv_freq_of(8)
    assert_same(method(q, k, v, qp, kp, inv_freq), method(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                          qp, kp, inv_freq))
    # a query head alone against its own kv head
    out, lse = method(q, k, v, qp, kp, inv_freq)
    for h in range(6):
        one = method(q[:, h : h + 1], k[:, h // 3 : h // 3 + 1], v[:, h // 3 : h // 3 + 1], qp, kp, inv_freq)
        assert_same((out[:, h : h + 1], lse[:, h : h + 1]), one)


@pytest.mark.parametrize("name", METHODS)
def test_padding_is_invisible(name):
    """A left-padded row (position -1 before its tokens) equals the same row without the padding; a padded
    query row gives 0 / -inf."""
    method = METHODS[name]
    q, k, v, qp, kp = make_inputs(3, 4, 2, 30, 30, 8, torch.float64, pad=5, seed=10)
    inv_freq = inv_freq_of(8)
    out, lse = method(q, k, v, qp, kp, inv_freq)
    for b in range(3):
        real = kp[b] >= 0
        alone = method(q[b : b + 1, :, real], k[b : b + 1, :, real], v[b : b + 1, :, real], qp[b : b + 1, real],
                       kp[b : b + 1, real], inv_freq)
        assert_same((out[b : b + 1, :, real], lse[b : b + 1, :, real]), alone)
        assert torch.equal(out[b, :, ~real], torch.zeros_like(out[b, :, ~real]))
        assert torch.isneginf(lse[b, :, ~real]).all()
    # padding in the middle of the keys (a masked slot) changes nothing either
    kp_holes = kp.clone()
    kp_holes[:, 3] = -1
    keep = torch.arange(30) != 3
    a = method(q, k, v, qp, kp_holes, inv_freq)
    b_ = method(q, k[:, :, keep], v[:, :, keep], qp, kp[:, keep], inv_freq)
    assert_same(a, b_)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("rotary", [8, 4])
def test_interleaved_pairs_are_a_permutation(name, rotary):
    """Interleaved pairs (2i, 2i+1) on q and k equal half-split pairs (i, i + pairs) on the same values
    permuted: scores are dot products, so out and lse agree (also with a partial rotary dim)."""
    method = METHODS[name]
    q, k, v, qp, kp = make_inputs(2, 4, 2, 24, 24, 8, torch.float64, pad=3, seed=11)
    inv_freq = inv_freq_of(rotary)
    pairs = rotary // 2
    perm = torch.cat((torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, 8)))
    assert_same(method(q, k, v, qp, kp, inv_freq, interleaved=True),
                method(q[..., perm], k[..., perm], v, qp, kp, inv_freq, interleaved=False))
    # and interleaving is not a no-op
    out, _ = method(q, k, v, qp, kp, inv_freq, interleaved=False)
    assert pairs > 1 and (out - method(q, k, v, qp, kp, inv_freq, interleaved=True)[0]).abs().max() > 1e-6


@pytest.mark.parametrize("name", METHODS)
def test_decode_rows_equal_prefill_rows(name):
    """Positions, not row indices, decide every rotation: the last queries alone (decode, q_len < k_len)
    equal the last rows of the full prefill."""
    method = METHODS[name]
    q, k, v, qp, kp = make_inputs(2, 4, 2, 40, 40, 8, torch.float64, pad=6, seed=12)
    inv_freq = inv_freq_of(8)
    out, lse = method(q, k, v, qp, kp, inv_freq)
    assert_same(method(q[:, :, -3:], k, v, qp[:, -3:], kp, inv_freq), (out[:, :, -3:], lse[:, :, -3:]))
