"""Hostile inputs to rerope_attention, one table: each row fails with the same message from the
real op on CPU tensors, from its fake kernel (FakeTensorMode: the Meta kernel, the same C++ check)
and from the composite path (rerope_attention_composite, which runs that check as the op
ropescale::_check_rerope_attention). Rows marked fake=False check data (position ranges) or mix
devices (where the real call itself dispatches to the Meta kernel)."""

import pytest
import torch

from bad_input import escape, parametrize, row, run_real, suite
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
