"""Hostile inputs to rerope_attention, one table: each row fails with the same message from the
real op on CPU tensors, from its fake kernel (FakeTensorMode: the Meta kernel, the same C++ check)
and from the composite path (rerope_attention_composite, which runs that check as the op
ropescale::_check_rerope_attention). Rows marked fake=False check data (position ranges) or mix
devices (where the real call itself dispatches to the Meta kernel)."""

import pytest
import torch

from support.bad_input import escape, parametrize, row, run_real, suite
from ropescale import ops

R = torch.ops.ropescale
gen = torch.Generator().manual_seed(0)
q, k, v = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
pos = torch.arange(5).expand(2, 5).contiguous()
f = ops.default_inv_freq(8, 1e4)
meta = torch.device("meta")
BIG = 2**31  # one past the accurate range
A = R.rerope_attention


def args(**change):
    base = dict(q=q, k=k, v=v, q_positions=pos, k_positions=pos, inv_freq=f, window=3)
    base.update(change)
    return tuple(base.values())


ROWS = [
    # shapes
    row("q 3-D", A, *args(q=q[0]), message=escape("rerope_attention: q must be 4-D [B, Hq, Lq, D]")),
    row("k 3-D", A, *args(k=k[0]), message="rerope_attention: k must be 4-D"),
    row("v 5-D", A, *args(v=v[None]), message="rerope_attention: v must be 4-D"),
    row("k/v shape", A, *args(v=v[:, :, :4]), message="k and v must have the same shape"),
    row("batch", A, *args(q=q[:1], q_positions=pos[:1]), message="q and k must have the same batch size, got 1 and 2"),
    row("Hq % Hkv", A, *args(q=q[:, :3]), message=escape("the number of q heads (3) must be a multiple of the number of k/v heads (2)")),
    row("head dim mismatch", A, *args(q=torch.randn(2, 4, 5, 10)), message="q and k must have the same head dim"),
    row("odd D", A, *args(q=q[..., :7], k=k[..., :7], v=v[..., :7], inv_freq=f[:3]), message="head dim D must be even"),
    row("D > 256", A, *args(q=torch.randn(2, 4, 5, 258), k=torch.randn(2, 2, 5, 258), v=torch.randn(2, 2, 5, 258)),
        message=escape("head dim D must be even and in [2, 256], got 258")),
    row("inv_freq too long", A, *args(inv_freq=ops.default_inv_freq(10, 1e4)), message="inv_freq must have between 1 and D/2 = 4"),
    row("empty inv_freq", A, *args(inv_freq=f[:0]), message="inv_freq must have between 1 and D/2 = 4 entries"),
    row("inv_freq 2-D", A, *args(inv_freq=f[None]), message="inv_freq must be a 1-D floating tensor"),
    row("q_positions shape", A, *args(q_positions=pos[:1]), message=escape("q_positions must have shape [2, 5]")),
    row("k_positions 1-D", A, *args(k_positions=pos[0]), message=escape("k_positions must have shape [2, 5]")),
    # dtypes
    row("int32 q", A, *args(q=q.int(), k=k.int(), v=v.int()), message="q must be float32, float16 or bfloat16, got Int"),
    row("float64 q", A, *args(q=q.double(), k=k.double(), v=v.double()), message="q must be float32, float16 or bfloat16, got Double"),
    row("mixed dtypes", A, *args(v=v.half()), message="q, k and v must have the same dtype"),
    row("float positions", A, *args(q_positions=pos.float()), message="q_positions must be an integer tensor"),
    row("int inv_freq", A, *args(inv_freq=torch.ones(4, dtype=torch.int64)), message="inv_freq must be a 1-D floating tensor"),
    # scalars
    row("window 0", A, *args(window=0), message="window must be > 0 and <= 2147483647, got 0"),
    row("window -3", A, *args(window=-3), message="window must be > 0 and <= 2147483647, got -3"),
    row("window 2^31", A, *args(window=BIG), message="window must be > 0 and <= 2147483647, got 2147483648"),
    row("leaky_k 0.5", A, *args(), 0.5, message=escape("leaky_k must be 0 (ReRoPE) or >= 1")),
    row("leaky_k nan", A, *args(), float("nan"), message=escape("leaky_k must be 0 (ReRoPE) or >= 1")),
    row("leaky_k inf", A, *args(), float("inf"), message=escape("leaky_k must be 0 (ReRoPE) or >= 1")),
    row("scale nan", A, *args(), 0.0, float("nan"), message=escape("scale must be finite and > 0 (or -1, None in Python, for 1/sqrt(D)), got nan")),
    row("scale inf", A, *args(), 0.0, float("inf"), message="scale must be finite and > 0.*got inf"),
    row("scale 0", A, *args(), 0.0, 0.0, message="scale must be finite and > 0.*got 0"),
    row("scale -2", A, *args(), 0.0, -2.0, message="scale must be finite and > 0.*got -2"),
    row("scale -inf", A, *args(), 0.0, float("-inf"), message="scale must be finite and > 0.*got -inf"),
    row("logn_length 1", A, *args(), logn_length=1, message=escape("logn_length must be 0 (off) or >= 2")),
    # devices: one meta tensor among CPU ones, any argument (the real call runs the Meta kernel)
    row("meta k", A, *args(k=k.to(meta)), message=escape("rerope_attention: k must be on cpu like q, got meta"), fake=False),
    row("meta v", A, *args(v=v.to(meta)), message="rerope_attention: v must be on cpu like q, got meta", fake=False),
    row("meta q", A, *args(q=q.to(meta)), message="rerope_attention: k must be on meta like q, got cpu", fake=False),
    row("meta q_positions", A, *args(q_positions=pos.to(meta)), message="q_positions must be on cpu like q, got meta", fake=False),
    row("meta k_positions", A, *args(k_positions=pos.to(meta)), message="k_positions must be on cpu like q, got meta", fake=False),
    row("meta inv_freq", A, *args(inv_freq=f.to(meta)), message="inv_freq must be on cpu like q, got meta", fake=False),
    # positions beyond the accurate range (a data check: CPU tensors); negative ones are padding
    row("q position 2^31", A, *args(q_positions=pos + BIG - 4), message=escape("q_positions must be <= 2147483647"), fake=False),
    row("k position 2^62", A, *args(k_positions=pos + 2**62), message="k_positions must be <= 2147483647", fake=False),
]


test_real_op, test_fake_kernel = suite(ROWS)


COMPOSITE_ROWS = [r for r in ROWS if r.id not in ("float64 q",)]  # the composite also takes float64


@parametrize(COMPOSITE_ROWS)
def test_composite_path(r):
    """The composite path refuses what the op refuses, with the op's message (never a raw
    broadcasting error)."""
    run_real(dataclasses_replace(r, call=ops.rerope_attention_composite))


def dataclasses_replace(r, **change):
    import dataclasses

    return dataclasses.replace(r, **change)


def test_padding_positions_far_below_zero_are_fine():
    """Only positions above the range are refused: any negative position is padding."""
    qp = pos.clone()
    qp[0, 0] = -(2**62)
    out, lse = A(q, k, v, qp, pos, f, 3)
    assert lse[0, :, 0].eq(float("-inf")).all() and out[0, :, 0].eq(0).all()
    A(q, k, v, pos + 2**31 - 1 - 4, pos + 2**31 - 1 - 4, f, 3)  # the largest accepted positions


# ---------------------------------------------------------------------------------------------
# rerope_attention_paged and rerope_cache_write_: the same two tests per table (real op, fake kernel).
# Rows marked fake=False check metadata VALUES (CPU: a page outside the cache, a sequence longer than its
# pages, lengths that disagree) or mix devices.

PA = R.rerope_attention_paged
pq = torch.randn(6, 4, 8, generator=gen)
kc, vc = torch.randn(5, 2, 4, 8, generator=gen), torch.randn(5, 2, 4, 8, generator=gen)
table = torch.tensor([[0, 1, 2], [3, 4, 7]], dtype=torch.int32)  # request 1 reads 2 pages; its third is garbage
lens = torch.tensor([9, 7], dtype=torch.int32)
starts = torch.tensor([0, 1, 6], dtype=torch.int32)


def pargs(**change):
    base = dict(q=pq, key_cache=kc, value_cache=vc, block_table=table, seq_lens=lens, query_start_loc=starts,
                inv_freq=f, window=3)
    base.update(change)
    return tuple(base.values())


def with_value(t, index, value):
    t = t.clone()
    t[index] = value
    return t


PAGED_ROWS = [
    # shapes
    row("q 4-D", PA, *pargs(q=pq[None]), message=escape("rerope_attention_paged: q must be 3-D [T, Hq, D]")),
    row("key_cache 3-D", PA, *pargs(key_cache=kc[0]), message=escape("key_cache must be 4-D [num_blocks, Hkv, block_size, D]")),
    row("value_cache shape", PA, *pargs(value_cache=vc[:4]), message="key_cache and value_cache must have the same shape"),
    row("head dim", PA, *pargs(q=torch.randn(6, 4, 10)), message="q and key_cache must have the same head dim, got 10 and 8"),
    row("Hq % Hkv", PA, *pargs(q=pq[:, :3]), message=escape("the number of q heads (3) must be a multiple of the number of k/v heads (2)")),
    row("odd D", PA, *pargs(q=pq[..., :7], key_cache=torch.randn(5, 2, 4, 7), value_cache=torch.randn(5, 2, 4, 7),
                            inv_freq=f[:3]),
        message="head dim D must be even"),
    row("cache layout", PA, *pargs(key_cache=kc.transpose(2, 3).contiguous().transpose(2, 3)),
        message=escape("key_cache must have its last two dims (block_size, D) contiguous")),
    row("block_table 1-D", PA, *pargs(block_table=table[0]), message=escape("block_table must have shape [R, max_blocks] with R = 2")),
    row("block_table rows", PA, *pargs(block_table=table[:1]), message=escape("block_table must have shape [R, max_blocks] with R = 2")),
    row("seq_lens 2-D", PA, *pargs(seq_lens=lens[None]), message=escape("seq_lens must be 1-D [R]")),
    row("query_start_loc length", PA, *pargs(query_start_loc=starts[:2]), message=escape("query_start_loc must have shape [R + 1] = [3]")),
    row("inv_freq 3-D", PA, *pargs(inv_freq=f[None, None]), message=escape("inv_freq must be a floating tensor [P] or [R, P]")),
    row("inv_freq rows", PA, *pargs(inv_freq=f.expand(3, 4)), message=escape("a 2-D inv_freq must have one row per request, [2, P]")),
    row("inv_freq too long", PA, *pargs(inv_freq=ops.default_inv_freq(10, 1e4)), message="inv_freq must have between 1 and D/2 = 4"),
    row("scale_factors shape", PA, *pargs(), scale_factors=torch.ones(3), message=escape("scale_factors must be a floating tensor [R] = [2]")),
    # dtypes
    row("int32 q", PA, *pargs(q=pq.int(), key_cache=kc.int(), value_cache=vc.int()), message="q must be float32, float16 or bfloat16, got Int"),
    row("float64 q", PA, *pargs(q=pq.double(), key_cache=kc.double(), value_cache=vc.double()), message="q must be float32, float16 or bfloat16, got Double"),
    row("cache dtype", PA, *pargs(key_cache=kc.half(), value_cache=vc.half()), message="key_cache and value_cache must have q's dtype Float, got Half"),
    row("k/v cache dtypes", PA, *pargs(value_cache=vc.half()), message="key_cache and value_cache must have the same dtype"),
    row("float block_table", PA, *pargs(block_table=table.float()), message=escape("block_table must be an integer tensor (int32 or int64), got Float")),
    row("float seq_lens", PA, *pargs(seq_lens=lens.float()), message="seq_lens must be an integer tensor"),
    row("float query_start_loc", PA, *pargs(query_start_loc=starts.double()), message="query_start_loc must be an integer tensor"),
    row("int inv_freq", PA, *pargs(inv_freq=torch.ones(4, dtype=torch.int64)), message="inv_freq must be a floating tensor"),
    row("int scale_factors", PA, *pargs(), scale_factors=torch.ones(2, dtype=torch.int64), message="scale_factors must be a floating tensor"),
    # scalars
    row("window 0", PA, *pargs(window=0), message="rerope_attention_paged: window must be > 0 and <= 2147483647, got 0"),
    row("window -3", PA, *pargs(window=-3), message="window must be > 0 and <= 2147483647, got -3"),
    row("window 2^31", PA, *pargs(window=BIG), message="window must be > 0 and <= 2147483647, got 2147483648"),
    row("leaky_k 0.5", PA, *pargs(), 0.5, message=escape("leaky_k must be 0 (ReRoPE) or >= 1")),
    row("scale nan", PA, *pargs(), 0.0, float("nan"), message="scale must be finite and > 0.*got nan"),
    row("scale 0", PA, *pargs(), 0.0, 0.0, message="scale must be finite and > 0.*got 0"),
    row("logn_length 1", PA, *pargs(), logn_length=1, message=escape("logn_length must be 0 (off) or >= 2")),
    # devices: one meta tensor among CPU ones (the real call runs the Meta kernel)
    row("meta key_cache", PA, *pargs(key_cache=kc.to(meta)), message="key_cache must be on cpu like q, got meta", fake=False),
    row("meta value_cache", PA, *pargs(value_cache=vc.to(meta)), message="value_cache must be on cpu like q, got meta", fake=False),
    row("meta block_table", PA, *pargs(block_table=table.to(meta)), message="block_table must be on cpu like q, got meta", fake=False),
    row("meta seq_lens", PA, *pargs(seq_lens=lens.to(meta)), message="seq_lens must be on cpu like q, got meta", fake=False),
    row("meta query_start_loc", PA, *pargs(query_start_loc=starts.to(meta)), message="query_start_loc must be on cpu like q, got meta", fake=False),
    row("meta inv_freq", PA, *pargs(inv_freq=f.to(meta)), message="inv_freq must be on cpu like q, got meta", fake=False),
    row("meta scale_factors", PA, *pargs(), scale_factors=torch.ones(2, device=meta), message="scale_factors must be on cpu like q, got meta", fake=False),
    row("meta q", PA, *pargs(q=pq.to(meta)), message="key_cache must be on meta like q, got cpu", fake=False),
    # values (CPU): never a read outside the cache; the error names the request
    row("page -1", PA, *pargs(block_table=with_value(table, (1, 1), -1)),
        message=escape("request 1: block_table[1, 1] = -1 is outside the cache's [0, num_blocks) = [0, 5)"), fake=False),
    row("page num_blocks", PA, *pargs(block_table=with_value(table, (0, 2), 5)),
        message=escape("request 0: block_table[0, 2] = 5 is outside the cache's"), fake=False),
    row("page 2^32 + 1 (int64)", PA, *pargs(block_table=with_value(table.long(), (0, 0), 2**32 + 1)),
        message=escape("block_table holds 4294967297, outside int32"), fake=False),
    row("seq_len past the pages", PA, *pargs(seq_lens=with_value(lens, 1, 13)),
        message=escape("request 1: seq_lens[1] = 13 must be in [0, max_blocks * block_size] = [0, 12]"), fake=False),
    row("seq_len negative", PA, *pargs(seq_lens=with_value(lens, 0, -1)),
        message=escape("request 0: seq_lens[0] = -1 must be in [0, max_blocks * block_size]"), fake=False),
    row("q_len > seq_len", PA, *pargs(seq_lens=with_value(lens, 1, 4)),
        message=escape("request 1 has 5 queries (query_start_loc[r+1] - query_start_loc[r]) but seq_lens[1] = 4 keys"), fake=False),
    row("query_start_loc[0] != 0", PA, *pargs(query_start_loc=torch.tensor([1, 1, 6])),
        message=escape("query_start_loc[0] must be 0, got 1"), fake=False),
    row("query_start_loc decreasing", PA, *pargs(query_start_loc=torch.tensor([0, 7, 6])),
        message=escape("query_start_loc must be non-decreasing, got query_start_loc[1] = 7 > query_start_loc[2] = 6 (request 1)"), fake=False),
    row("query_start_loc end != T", PA, *pargs(query_start_loc=torch.tensor([0, 1, 5])),
        message=escape("query_start_loc[R] = query_start_loc[2] must be T = 6 (q's rows), got 5"), fake=False),
    row("scale_factors 0", PA, *pargs(), scale_factors=torch.tensor([1.0, 0.0]),
        message=escape("request 1: scale_factors[1] must be finite and > 0, got 0"), fake=False),
]

test_real_op_paged, test_fake_kernel_paged = suite(PAGED_ROWS)


@parametrize([r for r in PAGED_ROWS if r.id != "float64 q"])
def test_composite_path_paged(r):
    """The plain-PyTorch form refuses what the op refuses (it runs ropescale::_check_rerope_attention_paged)."""
    run_real(dataclasses_replace(r, call=ops.rerope_attention_paged_composite))


W = R.rerope_cache_write_
wk, wv = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
slots = torch.tensor([0, -1, 19])  # 5 pages of 4 slots: 19 is the last


def wargs(**change):
    base = dict(key_cache=kc.clone(), value_cache=vc.clone(), key=wk, value=wv, slot_mapping=slots)
    base.update(change)
    return tuple(base.values())


WRITE_ROWS = [
    row("key 2-D", W, *wargs(key=wk[0]), message=escape("rerope_cache_write_: key must be 3-D [T, Hkv, D]")),
    row("cache 3-D", W, *wargs(key_cache=kc[0]), message=escape("rerope_cache_write_: key_cache must be 4-D")),
    row("value shape", W, *wargs(value=wv[:2]), message="key and value must have the same shape"),
    row("heads", W, *wargs(key=wk[:, :1], value=wv[:, :1]), message=escape("key must have the cache's heads and head dim [T, 2, 8]")),
    row("head dim", W, *wargs(key=wk[..., :6], value=wv[..., :6]), message=escape("key must have the cache's heads and head dim [T, 2, 8]")),
    row("key dtype", W, *wargs(key=wk.half(), value=wv.half()), message="key and value must have the cache's dtype Float, got Half"),
    row("int cache", W, *wargs(key_cache=kc.int(), value_cache=vc.int(), key=wk.int(), value=wv.int()),
        message="key_cache must be float32, float16, bfloat16 or float64, got Int"),
    row("float slots", W, *wargs(slot_mapping=slots.float()), message="slot_mapping must be an integer tensor"),
    row("slots length", W, *wargs(slot_mapping=slots[:2]), message=escape("slot_mapping must have shape [T] = [3]")),
    row("cache layout", W, *wargs(value_cache=vc.transpose(2, 3).contiguous().transpose(2, 3)),
        message=escape("value_cache must have its last two dims (block_size, D) contiguous")),
    row("meta slots", W, *wargs(slot_mapping=slots.to(meta)), message="slot_mapping must be on cpu like key, got meta", fake=False),
    row("meta value_cache", W, *wargs(value_cache=vc.to(meta)), message="value_cache must be on cpu like key, got meta", fake=False),
    row("slot past the cache", W, *wargs(slot_mapping=torch.tensor([0, -1, 20])),
        message=escape("rerope_cache_write_: slot_mapping[2] = 20 is past the cache's num_blocks * block_size = 20 slots"),
        fake=False),
]

test_real_op_write, test_fake_kernel_write = suite(WRITE_ROWS)


@parametrize(WRITE_ROWS)
def test_composite_path_write(r):
    run_real(dataclasses_replace(r, call=ops.rerope_cache_write_composite))
