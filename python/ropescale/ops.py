"""Typed wrappers over ``torch.ops.ropescale``, with fake (meta) kernels and autograd.

Every function here is a thin call into the C++ op of the same name (schemas in
``csrc/registration.cpp``). Fake kernels let the ops run under ``torch.compile`` and
``FakeTensorMode``; they only describe output shapes and dtypes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.ropescale)

_ops = torch.ops.ropescale

__all__ = [
    "default_inv_freq",
    "linear_inv_freq",
    "ntk_inv_freq",
    "dynamic_ntk_inv_freq",
    "yarn_inv_freq",
    "yarn_attention_factor",
    "llama3_inv_freq",
    "longrope_inv_freq",
    "longrope_attention_factor",
    "resonance_inv_freq",
    "similarity_decay",
    "effective_context_length",
    "base_lower_bound",
    "feature_gap",
]


# ---------------------------------------------------------------------------------------------
# Frequency tables: float32 CPU tensors of length dim // 2 unless ``dtype`` asks otherwise.


def default_inv_freq(dim: int, base: float, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``base ** (-2i/dim)`` for ``i < dim/2``: the unscaled RoPE table."""
    return _ops.default_inv_freq(dim, base, dtype=dtype)


def linear_inv_freq(dim: int, base: float, factor: float, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Position interpolation (Chen et al.): the default table divided by ``factor``."""
    return _ops.linear_inv_freq(dim, base, factor, dtype=dtype)


def ntk_inv_freq(dim: int, base: float, factor: float, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """NTK-aware scaling: the default table at base ``base * factor ** (dim / (dim - 2))``."""
    return _ops.ntk_inv_freq(dim, base, factor, dtype=dtype)


def dynamic_ntk_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    seq_len: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dynamic NTK: NTK with the factor grown to ``seq_len``; the default table while
    ``seq_len <= original_max_position`` (transformers passes ``max_position_embeddings``)."""
    return _ops.dynamic_ntk_inv_freq(dim, base, factor, original_max_position, seq_len, dtype=dtype)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """YaRN's NTK-by-parts table: ``theta`` kept for pairs turning more than ``beta_fast`` times over
    the original context, ``theta / factor`` below ``beta_slow`` turns, a linear ramp between."""
    return _ops.yarn_inv_freq(dim, base, factor, original_max_position, beta_fast, beta_slow, truncate, dtype=dtype)


def yarn_attention_factor(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's factor on cos and sin: ``0.1 * ln(factor) + 1``, or the DeepSeek
    ``mscale`` / ``mscale_all_dim`` ratio when both are non-zero (as transformers)."""
    return _ops.yarn_attention_factor(factor, mscale, mscale_all_dim)


def llama3_inv_freq(
    dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Llama 3.1's piecewise rule: long wavelengths divided by ``factor``, short ones kept, a smooth
    blend between ``L / low_freq_factor`` and ``L / high_freq_factor``."""
    return _ops.llama3_inv_freq(
        dim, base, factor, low_freq_factor, high_freq_factor, original_max_position, dtype=dtype
    )


def longrope_inv_freq(
    dim: int,
    base: float,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_max_position: int,
    seq_len: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """LongRoPE: ``theta_i / short_factor[i]``, or ``/ long_factor[i]`` once ``seq_len`` exceeds
    ``original_max_position``."""
    return _ops.longrope_inv_freq(
        dim, base, [float(f) for f in short_factor], [float(f) for f in long_factor],
        original_max_position, seq_len, dtype=dtype,
    )


def longrope_attention_factor(factor: float, original_max_position: int) -> float:
    """LongRoPE's factor on cos and sin: ``sqrt(1 + ln(factor) / ln(original_max_position))``."""
    return _ops.longrope_attention_factor(factor, original_max_position)


def resonance_inv_freq(inv_freq: torch.Tensor, original_max_position: int = 0) -> torch.Tensor:
    """Resonance RoPE: every wavelength ``2*pi/theta`` rounded to the nearest integer (the authors'
    code), or only those shorter than ``original_max_position`` when it is positive. Apply it after
    any other table (Resonance-YaRN rounds the YaRN table)."""
    return _ops.resonance_inv_freq(inv_freq, original_max_position)


# ---------------------------------------------------------------------------------------------
# Research quantities.


def similarity_decay(inv_freq: torch.Tensor, max_distance: int) -> torch.Tensor:
    """``B_m = sum_i cos(m * theta_i)`` for ``m = 0..max_distance`` (float64), Men et al."""
    return _ops.similarity_decay(inv_freq, max_distance)


def effective_context_length(inv_freq: torch.Tensor, max_distance: int) -> int:
    """Largest ``L <= max_distance`` with ``B_m >= 0`` for every ``m <= L`` (``max_distance`` when the
    curve never goes negative in range: a lower bound then)."""
    return _ops.effective_context_length(inv_freq, max_distance)


def base_lower_bound(context_length: int, dim: int) -> float:
    """Smallest base whose ``B_m`` stays ``>= 0`` over ``[0, context_length]`` (Men et al., Table 2).
    Found by a 0.1% geometric scan from base 2 and bisection in the first good step: the set of
    good bases is not an interval, so a plain bisection would be wrong."""
    return _ops.base_lower_bound(context_length, dim)


def feature_gap(inv_freq: torch.Tensor, train_length: int, test_length: int) -> torch.Tensor:
    """Resonance feature gap per pair (float64): the largest distance, over positions
    ``n in [train_length, test_length)``, from the rotated unit feature at ``n`` to the nearest one
    seen at a training position ``m < train_length``."""
    return _ops.feature_gap(inv_freq, train_length, test_length)


# ---------------------------------------------------------------------------------------------
# Fake kernels: output shape and dtype only.


def _table_fake(dim: int, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.empty(dim // 2, dtype=dtype or torch.float32, device="cpu")


@torch.library.register_fake("ropescale::default_inv_freq")
def _(dim, base, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::linear_inv_freq")
def _(dim, base, factor, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::ntk_inv_freq")
def _(dim, base, factor, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::dynamic_ntk_inv_freq")
def _(dim, base, factor, original_max_position, seq_len, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::yarn_inv_freq")
def _(dim, base, factor, original_max_position, beta_fast=32.0, beta_slow=1.0, truncate=True, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::llama3_inv_freq")
def _(dim, base, factor, low_freq_factor, high_freq_factor, original_max_position, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::longrope_inv_freq")
def _(dim, base, short_factor, long_factor, original_max_position, seq_len, *, dtype=None):
    return _table_fake(dim, dtype)


@torch.library.register_fake("ropescale::resonance_inv_freq")
def _(inv_freq, original_max_position=0):
    return torch.empty_like(inv_freq)


@torch.library.register_fake("ropescale::similarity_decay")
def _(inv_freq, max_distance):
    return inv_freq.new_empty(max_distance + 1, dtype=torch.float64)


@torch.library.register_fake("ropescale::feature_gap")
def _(inv_freq, train_length, test_length):
    return inv_freq.new_empty(inv_freq.shape[0], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Rotation. q, k and x are [batch, heads, seq, head_dim] (any strides with a unit stride along
# head_dim: transformers' transposed view of [batch, seq, heads, head_dim] works as is); the first
# rotary_dim features are rotated and the rest copied. Pairs are (i, i + rotary_dim/2) (half-split:
# NeoX, transformers' Llama) or (2i, 2i+1) with ``interleaved=True`` (GPT-J). Math in fp32 for
# half types. ``conjugate=True`` applies the transposed map (the inverse rotation), which is also
# the backward pass.

__all__ += [
    "apply_rotary",
    "apply_rotary_",
    "apply_rotary_qk",
    "apply_rotary_qk_",
    "apply_rotary_pos",
    "apply_rotary_pos_",
    "apply_rotary_pos_qk",
    "apply_rotary_pos_qk_",
]


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    *,
    half_width: bool = False,
    conjugate: bool = False,
) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with cos/sin broadcast over heads: exactly transformers'
    ``apply_rotary_pos_emb`` for its ``[batch or 1, seq, rotary_dim]`` tables (also ``[seq, rotary_dim]``).
    ``half_width=True`` takes one entry per pair instead, ``[.., seq, rotary_dim / 2]`` (flash-attn,
    vLLM). rotary_dim is read off the table; features past it are copied. Differentiable in ``x``;
    cos and sin are constants."""
    return _ops.apply_rotary(x, cos, sin, interleaved, half_width=half_width, conjugate=conjugate)


def apply_rotary_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    *,
    half_width: bool = False,
    conjugate: bool = False,
) -> None:
    """:func:`apply_rotary` in place (features past rotary_dim are left untouched). Not differentiable."""
    _ops.apply_rotary_(x, cos, sin, interleaved, half_width=half_width, conjugate=conjugate)


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    *,
    half_width: bool = False,
    conjugate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` on q and k in one pass, cos/sin read once per token: transformers'
    ``apply_rotary_pos_emb(q, k, cos, sin)``. q and k share seq length, head_dim and dtype; their head
    counts (GQA) and, with a table of batch 1, their batch sizes may differ."""
    return _ops.apply_rotary_qk(q, k, cos, sin, interleaved, half_width=half_width, conjugate=conjugate)


def apply_rotary_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    *,
    half_width: bool = False,
    conjugate: bool = False,
) -> None:
    """:func:`apply_rotary_qk` in place. Not differentiable."""
    _ops.apply_rotary_qk_(q, k, cos, sin, interleaved, half_width=half_width, conjugate=conjugate)


def apply_rotary_pos(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
    interleaved: bool = False,
    *,
    conjugate: bool = False,
) -> torch.Tensor:
    """Rotation of pair ``i`` by ``positions * inv_freq[i]``, cos and sin multiplied by ``scale`` (an
    attention factor), computed on the fly: positions int32/int64 ``[seq]`` or ``[batch, seq]``,
    inv_freq float32 ``[rotary_dim / 2]``. The angle is reduced in double before a full-precision
    sincos, so positions in the millions stay accurate (a float32 angle does not)."""
    return _ops.apply_rotary_pos(x, positions, inv_freq, scale, interleaved, conjugate=conjugate)


def apply_rotary_pos_(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
    interleaved: bool = False,
    *,
    conjugate: bool = False,
) -> None:
    """:func:`apply_rotary_pos` in place. Not differentiable."""
    _ops.apply_rotary_pos_(x, positions, inv_freq, scale, interleaved, conjugate=conjugate)


def apply_rotary_pos_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
    interleaved: bool = False,
    *,
    conjugate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_pos` on q and k in one pass, sin/cos computed once per token."""
    return _ops.apply_rotary_pos_qk(q, k, positions, inv_freq, scale, interleaved, conjugate=conjugate)


def apply_rotary_pos_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
    interleaved: bool = False,
    *,
    conjugate: bool = False,
) -> None:
    """:func:`apply_rotary_pos_qk` in place. Not differentiable."""
    _ops.apply_rotary_pos_qk_(q, k, positions, inv_freq, scale, interleaved, conjugate=conjugate)


# Fake kernels: outputs take the inputs' layout (as the real kernels' empty_like does). Devices are
# checked here too, so that torch.compile and meta tensors report a mix of devices clearly.


def _check_devices(op: str, x: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != x.device:
            raise RuntimeError(
                f"{op}: {name} must be on the same device as the rotated tensor ({x.device}), got {t.device}"
            )


@torch.library.register_fake("ropescale::apply_rotary")
def _(x, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    _check_devices("apply_rotary", x, cos=cos, sin=sin)
    return torch.empty_like(x)


@torch.library.register_fake("ropescale::apply_rotary_")
def _(x, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    _check_devices("apply_rotary_", x, cos=cos, sin=sin)


@torch.library.register_fake("ropescale::apply_rotary_qk")
def _(q, k, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    _check_devices("apply_rotary_qk", q, k=k, cos=cos, sin=sin)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("ropescale::apply_rotary_qk_")
def _(q, k, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    _check_devices("apply_rotary_qk_", q, k=k, cos=cos, sin=sin)


@torch.library.register_fake("ropescale::apply_rotary_pos")
def _(x, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    _check_devices("apply_rotary_pos", x, positions=positions, inv_freq=inv_freq)
    return torch.empty_like(x)


@torch.library.register_fake("ropescale::apply_rotary_pos_")
def _(x, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    _check_devices("apply_rotary_pos_", x, positions=positions, inv_freq=inv_freq)


@torch.library.register_fake("ropescale::apply_rotary_pos_qk")
def _(q, k, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    _check_devices("apply_rotary_pos_qk", q, k=k, positions=positions, inv_freq=inv_freq)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("ropescale::apply_rotary_pos_qk_")
def _(q, k, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    _check_devices("apply_rotary_pos_qk_", q, k=k, positions=positions, inv_freq=inv_freq)


# Autograd: the map is linear in x (q, k), so the backward is the same op with conjugate flipped
# (the transposed map; the inverse rotation), done by the same kernels; it is itself differentiable.
# cos/sin, positions and inv_freq are constants: asking for their gradient is an error, not a
# silent zero.


def _refuse_constant_grads(op: str, **constants: torch.Tensor) -> None:
    for name, t in constants.items():
        if t.requires_grad:
            raise RuntimeError(
                f"{op}: no gradient flows to {name}: it is treated as a constant. Pass {name}.detach(), "
                "or compute the rotation with plain PyTorch ops if you need its gradient."
            )


def _unit_last_stride(grad: torch.Tensor | None) -> torch.Tensor | None:
    """Incoming gradients may have any strides (autograd hands out expanded zeros, for one); the
    kernels need a unit stride along head_dim."""
    if grad is None or grad.stride(-1) == 1:
        return grad
    return grad.contiguous()


def _setup_rotary(ctx, inputs, keyword_only_inputs, output):
    x, cos, sin, interleaved = inputs
    _refuse_constant_grads("apply_rotary", cos=cos, sin=sin)
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved
    ctx.half_width = keyword_only_inputs["half_width"]
    ctx.conjugate = keyword_only_inputs["conjugate"]


def _backward_rotary(ctx, grad):
    cos, sin = ctx.saved_tensors
    grad = _unit_last_stride(grad)
    grad_x = _ops.apply_rotary(
        grad, cos, sin, ctx.interleaved, half_width=ctx.half_width, conjugate=not ctx.conjugate
    )
    return grad_x, None, None, None


def _setup_rotary_qk(ctx, inputs, keyword_only_inputs, output):
    q, k, cos, sin, interleaved = inputs
    _refuse_constant_grads("apply_rotary_qk", cos=cos, sin=sin)
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved
    ctx.half_width = keyword_only_inputs["half_width"]
    ctx.conjugate = keyword_only_inputs["conjugate"]


def _backward_rotary_qk(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = _unit_last_stride(grad_q), _unit_last_stride(grad_k)
    kwargs = dict(half_width=ctx.half_width, conjugate=not ctx.conjugate)
    if grad_q is not None and grad_k is not None:
        grad_q, grad_k = _ops.apply_rotary_qk(grad_q, grad_k, cos, sin, ctx.interleaved, **kwargs)
    elif grad_q is not None:
        grad_q = _ops.apply_rotary(grad_q, cos, sin, ctx.interleaved, **kwargs)
    elif grad_k is not None:
        grad_k = _ops.apply_rotary(grad_k, cos, sin, ctx.interleaved, **kwargs)
    return grad_q, grad_k, None, None, None


def _setup_rotary_pos(ctx, inputs, keyword_only_inputs, output):
    x, positions, inv_freq, scale, interleaved = inputs
    _refuse_constant_grads("apply_rotary_pos", inv_freq=inv_freq)
    ctx.save_for_backward(positions, inv_freq)
    ctx.scale = scale
    ctx.interleaved = interleaved
    ctx.conjugate = keyword_only_inputs["conjugate"]


def _backward_rotary_pos(ctx, grad):
    positions, inv_freq = ctx.saved_tensors
    grad = _unit_last_stride(grad)
    grad_x = _ops.apply_rotary_pos(grad, positions, inv_freq, ctx.scale, ctx.interleaved, conjugate=not ctx.conjugate)
    return grad_x, None, None, None, None


def _setup_rotary_pos_qk(ctx, inputs, keyword_only_inputs, output):
    q, k, positions, inv_freq, scale, interleaved = inputs
    _refuse_constant_grads("apply_rotary_pos_qk", inv_freq=inv_freq)
    ctx.save_for_backward(positions, inv_freq)
    ctx.scale = scale
    ctx.interleaved = interleaved
    ctx.conjugate = keyword_only_inputs["conjugate"]


def _backward_rotary_pos_qk(ctx, grad_q, grad_k):
    positions, inv_freq = ctx.saved_tensors
    grad_q, grad_k = _unit_last_stride(grad_q), _unit_last_stride(grad_k)
    args = (positions, inv_freq, ctx.scale, ctx.interleaved)
    conjugate = not ctx.conjugate
    if grad_q is not None and grad_k is not None:
        grad_q, grad_k = _ops.apply_rotary_pos_qk(grad_q, grad_k, *args, conjugate=conjugate)
    elif grad_q is not None:
        grad_q = _ops.apply_rotary_pos(grad_q, *args, conjugate=conjugate)
    elif grad_k is not None:
        grad_k = _ops.apply_rotary_pos(grad_k, *args, conjugate=conjugate)
    return grad_q, grad_k, None, None, None, None


torch.library.register_autograd("ropescale::apply_rotary", _backward_rotary, setup_context=_setup_rotary)
torch.library.register_autograd("ropescale::apply_rotary_qk", _backward_rotary_qk, setup_context=_setup_rotary_qk)
torch.library.register_autograd(
    "ropescale::apply_rotary_pos", _backward_rotary_pos, setup_context=_setup_rotary_pos
)
torch.library.register_autograd(
    "ropescale::apply_rotary_pos_qk", _backward_rotary_pos_qk, setup_context=_setup_rotary_pos_qk
)
# ReRoPE attention (csrc/cpu/rerope_attention.cpp, csrc/cuda/rerope_attention.cu).

from .rerope import rerope_attention_composite  # noqa: E402  (plain-PyTorch, differentiable twin)

__all__ += ["rerope_attention", "rerope_attention_composite"]


def rerope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    window: int,
    leaky_k: float = 0.0,
    scale: float | None = None,
    logn_length: int = 0,
    causal: bool = True,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReRoPE attention over un-rotated ``q`` ``[B, Hq, Lq, D]`` and ``k``/``v`` ``[B, Hkv, Lk, D]``.

    ``score(i, j) = scale * <rot(q_i, r(p_i - p_j)), k_j>`` with ``r(d) = d`` for ``d < window``,
    else ``window`` (ReRoPE, ``leaky_k = 0``) or ``window + (d - window) / leaky_k`` (Leaky ReRoPE);
    ``out = softmax(score) @ v``. Positions are integer ``[B, Lq]`` / ``[B, Lk]``: causal masking is
    by position (``p_j > p_i`` is masked), and a negative position marks padding (such a key is
    never attended; such a query sees nothing). ``logn_length > 0`` scales each query by
    ``max(1, ln(p + 1) / ln(logn_length))``; ``scale`` defaults to ``1/sqrt(D)``; ``inv_freq`` may
    cover fewer than ``D / 2`` pairs (partial rotary). GQA when ``Hq`` is a multiple of ``Hkv``.

    Returns ``(out, lse)``: ``out`` in q's dtype (float32 accumulation), ``lse`` the natural-log
    softmax denominator, float32 ``[B, Hq, Lq]``; a row with no visible key gives zeros and
    ``-inf``. One op serves prefill (``Lq = Lk``) and decoding against a
    :class:`ropescale.cache.PreRopeCache` (``Lq = 1``).

    The fused kernels have no backward pass: train through :func:`rerope_attention_composite`,
    which computes the same result differentiably from two PyTorch SDPA calls.
    """
    return _ops.rerope_attention(
        q, k, v, q_positions, k_positions, inv_freq, window, float(leaky_k),
        -1.0 if scale is None else float(scale), logn_length, causal, interleaved,
    )


@torch.library.register_fake("ropescale::rerope_attention")
def _(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k=0.0, scale=-1.0, logn_length=0, causal=True,
      interleaved=False):
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: "rerope_attention: q and k must be 4-D")
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _rerope_attention_backward(ctx, grad_out, grad_lse):
    raise RuntimeError(
        "rerope_attention: the fused kernels have no backward pass; train through "
        "ropescale.ops.rerope_attention_composite (same arguments, same result, differentiable)"
    )


torch.library.register_autograd("ropescale::rerope_attention", _rerope_attention_backward)
