"""Hostile inputs to the rotary ops, one table: each row fails with the same message from the real
op on CPU tensors and from its fake kernel (FakeTensorMode, torch.compile), which run the same C++
check. Rows marked fake=False check data (position ranges) or mix devices (where the real call
itself dispatches to the Meta kernel)."""

import pytest
import torch

from support.bad_input import escape, row, suite
from ropescale import ops

R = torch.ops.ropescale
x = torch.randn(2, 3, 5, 8)
q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
half = torch.randn(2, 5, 4)
pos, inv = torch.arange(5), ops.default_inv_freq(8, 1e4)
meta = torch.device("meta")
BIG = 2**31  # one past the accurate range

ROWS = [
    # shapes
    row("x 3-D", R.apply_rotary, x[0], cos, sin, message="apply_rotary: x must be 4-D"),
    row("x 5-D", R.apply_rotary_pos, x[None], pos, inv, message="apply_rotary_pos: x must be 4-D"),
    row("k 3-D", R.apply_rotary_qk, q, k[0], cos, sin, message="apply_rotary_qk: k must be 4-D"),
    row("cos 1-D", R.apply_rotary, x, cos[0, 0], sin[0, 0], message="apply_rotary: cos must be \\[seq, rotary_dim\\]"),
    row("sin shape", R.apply_rotary, x, cos, sin[:1], message="sin and cos must have the same shape"),
    row("table seq", R.apply_rotary, x, cos[:, :4], sin[:, :4], message="cos/sin cover 4 positions but x has seq length 5"),
    row("table batch", R.apply_rotary, x, torch.randn(3, 5, 8), torch.randn(3, 5, 8),
        message="cos/sin has 3 batch rows, which must be 1 or the batch size of x"),
    row("odd rotary_dim", R.apply_rotary, x, cos[..., :5], sin[..., :5],
        message=escape("rotary_dim (cos.size(-1)) must be a positive even number, got 5")),
    row("empty table", R.apply_rotary, x, cos[..., :0], sin[..., :0],
        message=escape("rotary_dim (cos.size(-1)) must be a positive even number, got 0")),
    row("rotary_dim > head_dim", R.apply_rotary, x, torch.randn(2, 5, 10), torch.randn(2, 5, 10),
        message=escape("rotary_dim (cos.size(-1)) = 10 is larger than head_dim = 8")),
    row("q/k seq", R.apply_rotary_qk, q, k[:, :, :4], cos, sin, message="q and k must have the same sequence length"),
    row("q/k head_dim", R.apply_rotary_qk, q, torch.randn(2, 2, 5, 10), cos, sin,
        message="q and k must have the same head_dim"),
    row("positions 3-D", R.apply_rotary_pos, x, pos[None, None], inv,
        message="apply_rotary_pos: positions must be \\[seq\\] or \\[batch, seq\\]"),
    row("positions length", R.apply_rotary_pos, x, pos[:4], inv,
        message="positions has 4 entries per row but x has seq length 5"),
    row("inv_freq 2-D", R.apply_rotary_pos, x, pos, inv[None], message="inv_freq must be 1-D"),
    row("empty inv_freq", R.apply_rotary_pos, x, pos, inv[:0],
        message=escape("rotary_dim (2 * inv_freq.size(0)) must be a positive even number, got 0")),
    row("odd head_dim", R.apply_rotary_pos, torch.randn(2, 3, 5, 7), pos, inv,
        message=escape("rotary_dim (2 * inv_freq.size(0)) = 8 is larger than head_dim = 7")),
    # dtypes
    row("int32 x", R.apply_rotary, x.int(), cos, sin, message="x must be float32, float16, bfloat16 or float64, got Int"),
    row("int32 x (positions)", R.apply_rotary_pos, x.int(), pos, inv, message="x must be float32, float16, bfloat16"),
    # tables: both float32, or both the operands' dtype (float32 tables with any operands: autocast's)
    row("float64 tables, float32 x", R.apply_rotary, x, cos.double(), sin.double(),
        message=escape("apply_rotary: cos and sin must both be float32 or both have the dtype of x (Float), got Double and Double")),
    row("bfloat16 tables, float32 q", R.apply_rotary_qk, q, k, cos.bfloat16(), sin.bfloat16(),
        message=escape("apply_rotary_qk: cos and sin must both be float32 or both have the dtype of q (Float), got BFloat16 and BFloat16")),
    row("float16 tables, float64 x", R.apply_rotary_, x.double(), cos.half(), sin.half(),
        message=escape("apply_rotary_: cos and sin must both be float32 or both have the dtype of x (Double), got Half and Half")),
    row("bfloat16 tables, float16 q", R.apply_rotary_qk_, q.half(), k.half(), cos.bfloat16(), sin.bfloat16(),
        message=escape("cos and sin must both be float32 or both have the dtype of q (Half), got BFloat16 and BFloat16")),
    row("float32 cos, bfloat16 sin", R.apply_rotary, x.bfloat16(), cos, sin.bfloat16(),
        message=escape("cos and sin must both be float32 or both have the dtype of x (BFloat16), got Float and BFloat16")),
    row("float64 cos, float32 sin, float64 x", R.apply_rotary, x.double(), cos.double(), sin,
        message=escape("apply_rotary: cos and sin must both be float32 or both have the dtype of x (Double), got Double and Float")),
    row("q/k dtype", R.apply_rotary_qk, q, k.half(), cos, sin, message="q and k must have the same dtype"),
    row("float positions", R.apply_rotary_pos, x, pos.float(), inv, message="positions must be int32 or int64, got Float"),
    row("float64 inv_freq", R.apply_rotary_pos, x, pos, inv.double(), message="inv_freq must be float32, got Double"),
    # scalars
    row("nan scale", R.apply_rotary_pos, x, pos, inv, float("nan"), message="scale must be finite, got nan"),
    row("inf scale", R.apply_rotary_pos_qk, q, k, pos, inv, float("inf"), message="scale must be finite, got inf"),
    # layouts
    row("strided head_dim", R.apply_rotary, torch.randn(2, 3, 5, 16)[..., ::2], cos, sin,
        message="x must have a unit stride along head_dim"),
    row("strided table", R.apply_rotary, x, torch.randn(2, 5, 16)[..., ::2], sin,
        message="cos and sin must have a unit stride along their last dimension"),
    # the ambiguous interleaved full-width table (issue 16.4)
    row("interleaved full-width", R.apply_rotary, x, cos, sin, True,
        message=escape("apply_rotary: interleaved=True takes a half-width table (half_width=True")),
    row("interleaved full-width qk_", R.apply_rotary_qk_, q.clone(), k.clone(), cos, sin, True,
        message="apply_rotary_qk_: interleaved=True takes a half-width table"),
    # devices: one meta tensor among CPU ones, any argument (the real call runs the Meta kernel)
    row("meta cos", R.apply_rotary, x, cos.to(meta), sin, message=escape("apply_rotary: cos must be on the same device as x (cpu), got meta"), fake=False),
    row("meta sin", R.apply_rotary_, x.clone(), cos, sin.to(meta), message="apply_rotary_: sin must be on the same device as x", fake=False),
    row("meta k", R.apply_rotary_qk, q, k.to(meta), cos, sin, message=escape("apply_rotary_qk: k must be on the same device as q (cpu), got meta"), fake=False),
    row("meta x", R.apply_rotary, x.to(meta), cos, sin, message=escape("apply_rotary: cos must be on the same device as x (meta), got cpu"), fake=False),
    row("meta positions", R.apply_rotary_pos, x, pos.to(meta), inv, message="apply_rotary_pos: positions must be on the same device as x", fake=False),
    row("meta inv_freq", R.apply_rotary_pos_qk, q, k, pos, inv.to(meta), message="apply_rotary_pos_qk: inv_freq must be on the same device as q", fake=False),
    # positions outside the accurate range |p| <= 2^31 - 1 (a data check: CPU tensors)
    row("position 2^31", R.apply_rotary_pos, x, pos + BIG - 4, inv,
        message=escape("apply_rotary_pos: positions must be within +-2147483647"), fake=False),
    row("position -2^31", R.apply_rotary_pos_, x.clone(), pos - BIG, inv, message="positions must be within", fake=False),
    row("position int64 min", R.apply_rotary_pos_qk, q, k, torch.full((5,), -2**63), inv,
        message="positions must be within", fake=False),
]


test_real_op, test_fake_kernel = suite(ROWS)


def test_int32_positions_are_always_in_range():
    """The bound is int32's own range: int32 positions, even the extremes, are accepted."""
    p = torch.tensor([0, 1, -1, 2**31 - 1, -(2**31) + 1], dtype=torch.int32)
    R.apply_rotary_pos(x, p, inv)


# What the dtype rule accepts: float32 tables with float16, bfloat16 and float64 operands, every table
# op, full- and half-width; the real op and its fake kernel agree on the output (the operands' dtype).
_ACCEPTED = [
    ("apply_rotary", lambda d, t: (x.to(d), *t), {}),
    ("apply_rotary_", lambda d, t: (x.to(d), *t), {}),
    ("apply_rotary_qk", lambda d, t: (q.to(d), k.to(d), *t), {}),
    ("apply_rotary_qk_", lambda d, t: (q.to(d), k.to(d), *t), {}),
    ("apply_rotary", lambda d, t: (x.to(d), half, half, True), {"half_width": True}),
    ("apply_rotary_qk", lambda d, t: (q.to(d), k.to(d), half, half), {"half_width": True, "conjugate": True}),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", range(len(_ACCEPTED)), ids=lambda i: _ACCEPTED[i][0])
def test_float32_tables_are_accepted(dtype, case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, make_args, kwargs = _ACCEPTED[case]
    op = getattr(R, name)
    args = make_args(dtype, (cos, sin))
    assert all(a.dtype == torch.float32 for a in args if isinstance(a, torch.Tensor) and a.dim() == 3)
    out = op(*args, **kwargs)
    written = [a for a in args[:2] if isinstance(a, torch.Tensor) and a.dim() == 4] if name.endswith("_") else None
    outs = written if out is None else (out if isinstance(out, (tuple, list)) else [out])
    assert all(o.dtype == dtype for o in outs)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    if fake is not None:
        for f, o in zip(fake if isinstance(fake, (tuple, list)) else [fake], outs):
            assert f.dtype == o.dtype == dtype and f.shape == o.shape and f.stride() == o.stride()
