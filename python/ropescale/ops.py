"""Typed wrappers over ``torch.ops.ropescale``, with fake (meta) kernels and autograd.

Every function here is a thin call into the C++ op of the same name (schemas in
``csrc/registration.cpp``). Under ``torch.compile``, ``FakeTensorMode`` and meta tensors the ops
with tensor inputs run their C++ Meta kernels, which call the same checks as the CPU and CUDA
kernels (one check: the fake refuses what the op refuses, with the same message); the table ops,
which take no tensor, have Python fake kernels below that run the op's own checks.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import _C  # noqa: F401  (loads the library that registers torch.ops.ropescale)
from .rerope import rerope_attention_composite, rerope_attention_paged_composite, rerope_cache_write_composite
from .rerope_train import rerope_attention_train

_ops = torch.ops.ropescale

__all__ = [
    "default_inv_freq",
    "linear_inv_freq",
    "proportional_inv_freq",
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


def proportional_inv_freq(
    head_dim: int, base: float, factor: float, partial_rotary_factor: float, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """transformers' ``proportional`` (Gemma 4): ``head_dim / 2`` entries whatever ``partial_rotary_factor``
    is, ``base ** (-2i / head_dim) / factor`` (the exponent over the FULL head dim) for the first
    ``floor(partial_rotary_factor * head_dim / 2)`` pairs and 0 (not rotated) for the rest."""
    return _ops.proportional_inv_freq(head_dim, base, factor, partial_rotary_factor, dtype=dtype)


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
# Fake kernels of the table ops. They take no tensor, so no Meta kernel can serve them: the fake
# runs the op itself outside the fake mode (a table of dim/2 doubles, microseconds), which both
# applies the op's own checks and gives the exact output length.


def _table_fake(op, *args, **kwargs) -> torch.Tensor:
    with unset_fake_temporarily():
        real = op(*args, **kwargs)
    return torch.empty(real.shape, dtype=real.dtype, device="cpu")


def _register_table_fake(name: str) -> None:
    op = getattr(_ops, name)
    torch.library.register_fake(f"ropescale::{name}")(lambda *args, **kwargs: _table_fake(op, *args, **kwargs))


# Every op that makes an inv_freq table from scalars (a new method's table op is one more name here).
TABLE_OPS = ("default_inv_freq", "linear_inv_freq", "proportional_inv_freq", "ntk_inv_freq", "dynamic_ntk_inv_freq",
             "yarn_inv_freq", "llama3_inv_freq", "longrope_inv_freq")
for _name in TABLE_OPS:
    _register_table_fake(_name)


# ---------------------------------------------------------------------------------------------
# Rotation. q, k and x are [batch, heads, seq, head_dim] (any strides with a unit stride along
# head_dim: transformers' transposed view of [batch, seq, heads, head_dim] works as is); the first
# rotary_dim features are rotated and the rest copied. Pairs are (i, i + rotary_dim/2) (half-split:
# NeoX, transformers' Llama) or (2i, 2i+1) with ``interleaved=True`` (GPT-J). Math in fp32 for
# half types. ``conjugate=True`` applies the transposed map (the inverse rotation), which is also
# the backward pass.
#
# Table dtype: cos/sin either in the operands' dtype or in float32 whatever the operands' dtype
# (fp16/bf16 q and k with the float32 tables autocast leaves them, as FlashInfer's and vLLM's kernels
# take them; float64 operands too). The kernels read the tables as they are, rotate in fp32 (fp64 for
# float64 operands) and round once to the operands' dtype, which the outputs and gradients have. Any
# other mix (a half table with float32 operands, float64 tables with float32 ones) is refused.
#
# Table layouts: a full-width table (transformers' ``[.., seq, rotary_dim]``) is in the rotate-half
# layout, one entry per feature; a half-width one (``half_width=True``, ``[.., seq, rotary_dim/2]``)
# has one entry per pair. ``interleaved=True`` takes half-width tables only: a full-width table is
# ambiguous with interleaved pairs (GPT-J/Cohere repeat each entry, ``c0 c0 c1 c1``; transformers'
# Llama writes ``c0 c1 .. c0 c1``) and the wrong guess rotates silently wrong, so it is refused.
# Positions (the ``_pos`` ops) must lie within +-(2^31 - 1), where the angles are accurate to 2
# float32 ulps; CPU positions are checked, CUDA ones are not (that would cost a host sync per call).

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
    vLLM). ``interleaved=True`` (GPT-J pairs) needs ``half_width=True``: pass ``cos[..., ::2].contiguous()``
    of a GPT-J/Cohere table (``c0 c0 c1 c1``) or ``cos[..., :rotary_dim // 2]`` of a transformers Llama one;
    a full-width table is refused there, its layout being ambiguous. rotary_dim is read off the
    table; features past it are copied. cos and sin are both of x's dtype or both float32 (the
    rotation is then done in fp32 and rounded once to x's dtype: autocast's fp32 tables with half q/k);
    the output has x's dtype. Differentiable in ``x``; cos and sin are constants."""
    if _under_torch_func():
        return _RotaryFn.apply(x, cos, sin, interleaved, half_width, conjugate)
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
    counts (GQA) and, with a table of batch 1, their batch sizes may differ. cos/sin of q's dtype or
    float32, as for :func:`apply_rotary`; the outputs have q's dtype."""
    if _under_torch_func():
        return _RotaryQkFn.apply(q, k, cos, sin, interleaved, half_width, conjugate)
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
    sincos, so positions stay accurate up to ``|p| <= 2^31 - 1`` (cos/sin within 2.1e-7, two float32
    ulps, of the exact values; a float32 angle is off by 0.1 rad at 2^21). Positions beyond are
    refused (checked for CPU tensors; on CUDA the check would cost a host sync, so the range is the
    caller's contract there)."""
    if _under_torch_func():
        return _RotaryPosFn.apply(x, positions, inv_freq, scale, interleaved, conjugate)
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
    if _under_torch_func():
        return _RotaryPosQkFn.apply(q, k, positions, inv_freq, scale, interleaved, conjugate)
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


__all__ += ["apply_rotary_per_request", "apply_rotary_per_request_"]


def _per_request_key(q: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """k, or (q alone) a k of no heads, which the op skips."""
    return q.new_empty(q.shape[0], 0, q.shape[-1]) if k is None else k


def apply_rotary_per_request(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factors: torch.Tensor,
    interleaved: bool = False,
    *,
    native_angles: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An engine's packed tokens rotated, each with the table of the request it belongs to: token ``t`` of
    ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (or None) at ``positions[t]`` by row ``r = request_index[t]`` of
    ``inv_freq`` (float32 ``[R, rotary_dim / 2]``, one table per request: any real scale, no cos/sin table of
    the served length per request), cos and sin times ``attention_factors[r]`` (float32 ``[R]``): what
    :func:`apply_rotary_pos` gives each request alone with its own table and ``scale``, in one pass over a
    batch of requests of different scales. sin/cos are computed once per token, angles reduced in double; with
    ``native_angles`` (bool ``[R]``), request r's angles are instead formed as an engine's native table forms them
    (``position * inv_freq`` in float32, then float32 sin/cos, as vLLM's ``cos_sin_cache`` and transformers' rotary
    do), so that a request that fits the trained length is the native model bit for bit (with the engine's own
    float32 ``inv_freq``: ``serving.native_inv_freq``).

    On CPU tensors the values are checked (positions within +-(2^31 - 1), every ``request_index`` a row of
    ``inv_freq``, finite factors); on CUDA they are the caller's contract (a check would cost a host sync; an
    engine builds them itself). No backward pass (an inference op)."""
    q, k_out = _ops.apply_rotary_per_request(q, _per_request_key(q, k), positions, request_index, inv_freq,
                                             attention_factors, interleaved, native_angles=native_angles)
    return q, None if k is None else k_out


def apply_rotary_per_request_(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factors: torch.Tensor,
    interleaved: bool = False,
    *,
    native_angles: torch.Tensor | None = None,
) -> None:
    """:func:`apply_rotary_per_request` in place: what an engine's rotary layer runs on its q and k views."""
    _ops.apply_rotary_per_request_(q, _per_request_key(q, k), positions, request_index, inv_freq,
                                   attention_factors, interleaved, native_angles=native_angles)


def _apply_rotary_per_request_backward(ctx, *grads):
    raise RuntimeError("apply_rotary_per_request: no backward pass (an engine's inference op); train with the "
                       "static table of the request's scale (apply_rotary_pos, which is differentiable)")


torch.library.register_autograd("ropescale::apply_rotary_per_request", _apply_rotary_per_request_backward)


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


# op: (how many rotated tensors lead its arguments, the constant tensors after them, its keyword-only
# flags). The rest of its positional arguments are flags too.
_DIFFERENTIABLE = {
    "apply_rotary": (1, ("cos", "sin"), ("half_width", "conjugate")),
    "apply_rotary_qk": (2, ("cos", "sin"), ("half_width", "conjugate")),
    "apply_rotary_pos": (1, ("positions", "inv_freq"), ("conjugate",)),
    "apply_rotary_pos_qk": (2, ("positions", "inv_freq"), ("conjugate",)),
}


def _save_rotation(ctx, op: str, args, keywords: dict) -> None:
    """setup_context of every rotary op: the constants saved (refused if they require grad), the flags kept."""
    rotated, constants, _ = _DIFFERENTIABLE[op]
    tensors = args[rotated: rotated + len(constants)]
    _refuse_constant_grads(op, **dict(zip(constants, tensors)))
    ctx.save_for_backward(*tensors)
    ctx.flags, ctx.keywords = tuple(args[rotated + len(constants):]), dict(keywords)


def _rotate_back(ctx, grads, single, pair):
    """The backward of every rotary op: the gradients present, rotated by the same op with conjugate flipped
    (``pair`` when both q and k have one, else ``single`` on each)."""
    constants = ctx.saved_tensors
    keywords = {**ctx.keywords, "conjugate": not ctx.keywords["conjugate"]}
    grads = [_unit_last_stride(g) for g in grads]
    if len(grads) == 2 and None not in grads:
        return tuple(pair(*grads, *constants, *ctx.flags, **keywords))
    return tuple(None if g is None else single(g, *constants, *ctx.flags, **keywords) for g in grads)


def _register_rotation_autograd(op: str) -> None:
    rotated, constants, _ = _DIFFERENTIABLE[op]
    single, pair = getattr(_ops, op.removesuffix("_qk")), getattr(_ops, op)

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        _save_rotation(ctx, op, inputs, keyword_only_inputs)

    def backward(ctx, *grads):
        return (*_rotate_back(ctx, grads, single, pair), *[None] * (len(constants) + len(ctx.flags)))

    torch.library.register_autograd(f"ropescale::{op}", backward, setup_context=setup_context)


for _op in _DIFFERENTIABLE:
    _register_rotation_autograd(_op)

# torch.func (grad, vjp, jacrev, and vmap over them): the autograd registration above is an
# autograd.Function that functorch cannot transform (PyTorch refuses it: "must override the
# setup_context staticmethod"). Under a torch.func transform the wrappers go through the Functions
# below instead: the same setup and backward, with a generated vmap rule and every argument
# positional. forward runs the op (one transform level lower, where nothing requires grad); backward
# calls the wrappers, so that it is transformable in turn (jacrev = vmap over it).
# (torch.ops.ropescale.* called directly under torch.func still gets PyTorch's refusal.)


def _under_torch_func() -> bool:
    return torch._C._are_functorch_transforms_active()


def _rotation_function(op: str) -> type[torch.autograd.Function]:
    rotated, constants, keyword_names = _DIFFERENTIABLE[op]
    forward_op = getattr(_ops, op)

    def split(args):
        return args[: len(args) - len(keyword_names)], dict(zip(keyword_names, args[len(args) - len(keyword_names):]))

    def forward(*args):
        positional, keywords = split(args)
        return forward_op(*positional, **keywords)

    def setup_context(ctx, inputs, output):
        _save_rotation(ctx, op, *split(inputs))

    def backward(ctx, *grads):
        single, pair = globals()[op.removesuffix("_qk")], globals()[op]  # the wrappers: transformable
        return (*_rotate_back(ctx, grads, single, pair),
                *[None] * (len(constants) + len(ctx.flags) + len(keyword_names)))

    return type(f"_{op}_function", (torch.autograd.Function,), {
        "generate_vmap_rule": True, "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context), "backward": staticmethod(backward)})


_RotaryFn, _RotaryQkFn, _RotaryPosFn, _RotaryPosQkFn = (_rotation_function(op) for op in _DIFFERENTIABLE)


# ReRoPE attention (csrc/cpu/rerope_attention.cpp, csrc/cuda/rerope_attention.cu), with its plain-PyTorch,
# differentiable twin (rerope.py) and the training path (rerope_train.py: fused kernels, no L x L).

__all__ += ["rerope_attention", "rerope_attention_composite", "rerope_attention_train"]


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
    *,
    group: int = 0,
    chunk_size: int = 0,
    far_start: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReRoPE attention over un-rotated ``q`` ``[B, Hq, Lq, D]`` and ``k``/``v`` ``[B, Hkv, Lk, D]``.

    ``score(i, j) = scale * <rot(q_i, r(p_i - p_j)), k_j>`` with ``r(d) = d`` for ``d < window``,
    else ``window`` (ReRoPE, ``leaky_k = 0``) or ``window + (d - window) / leaky_k`` (Leaky ReRoPE);
    ``out = softmax(score) @ v``. Positions are integer ``[B, Lq]`` / ``[B, Lk]``: causal masking is
    by position (``p_j > p_i`` is masked), and a negative position marks padding (such a key is
    never attended; such a query sees nothing). Positions (and ``window``) must be ``<= 2^31 - 1``,
    the range where the rotation angles are accurate to 2 float32 ulps (checked for CPU tensors; on
    CUDA the check would cost a host sync per call, so there it is the caller's contract).
    ``logn_length > 0`` scales each query by ``max(1, ln(p + 1) / ln(logn_length))``; ``scale`` is
    finite and ``> 0``, ``None`` (the schema's ``-1``) for ``1/sqrt(D)``; ``inv_freq`` may cover fewer
    than ``D / 2`` pairs (partial rotary). GQA when ``Hq`` is a multiple of ``Hkv``.

    Returns ``(out, lse)``: ``out`` in q's dtype (float32 accumulation), ``lse`` the natural-log
    softmax denominator, float32 ``[B, Hq, Lq]``; a row with no visible key gives zeros and
    ``-inf``. Non-finite inputs follow SDPA: a masked key never contributes, whatever it holds; a
    NaN/inf in a query or a visible key or value makes that row's (or that feature's) output
    non-finite, never zeros. One op serves prefill (``Lq = Lk``) and decoding against a
    :class:`ropescale.cache.PreRopeCache` (``Lq = 1``).

    The other training-free methods over the same raw-key cache (docs/DESIGN.md, "Self-Extend and Dual Chunk
    Attention") change only which pairs are near and where the far side rotates q and k (query position
    ``i``, key position ``j``):

    * Self-Extend, ``group = G >= 1`` (``window = W >= 1``, ``leaky_k = 0``): near ``i - j < W`` as ReRoPE; far
      q at ``floor(i/G) + W - floor(W/G)``, far k at ``floor(j/G)``;
    * Dual Chunk Attention, ``chunk_size = C >= 1`` with ``window`` = Qwen's ``local_size`` ``S`` in ``[0, C)``
      (``leaky_k = 0``, causal only), chunks of ``n = C - S``: near when the key is in the query's chunk, or in
      the previous one while ``i mod n <= S``; far q at ``min(2n - 1, C)``, far k at ``j mod n``.

    ``far_start = s >= 0`` (at most ``window``; ``-1``: ``window``) moves where the far side of (Leaky) ReRoPE
    starts: ``r(d) = s + (d - window) / leaky_k``. STRING (An et al., 2025) is ``window = S`` (its
    ``shifted_offset``), ``leaky_k = 1`` and ``far_start = W`` (its ``local_value``): ``r(d) = d - S + W`` past S
    (its attention factor is the caller's ``scale``; see :mod:`ropescale.attention_rules`).

    The fused kernels have no backward pass: train through :func:`rerope_attention_train` (same
    arguments, same result, differentiable, at the memory of PyTorch's fused attention kernels).
    """
    return _ops.rerope_attention(
        q, k, v, q_positions, k_positions, inv_freq, window, float(leaky_k),
        -1.0 if scale is None else float(scale), logn_length, causal, interleaved, group=group, chunk_size=chunk_size,
        far_start=far_start,
    )


def _rerope_attention_backward(ctx, grad_out, grad_lse):
    raise RuntimeError(
        "rerope_attention: the fused kernels have no backward pass; train through "
        "ropescale.ops.rerope_attention_train (same arguments, same result, differentiable, no L x L tensor) "
        "or its oracle ropescale.ops.rerope_attention_composite"
    )


torch.library.register_autograd("ropescale::rerope_attention", _rerope_attention_backward)


# ---------------------------------------------------------------------------------------------
# Paged ReRoPE attention, the engine form (docs/DESIGN.md, "Paged ReRoPE attention"), with the
# plain-PyTorch twins of its two ops (rerope.py).

__all__ += ["rerope_attention_paged", "rerope_paged_workspace_bytes", "rerope_cache_write_",
            "rerope_attention_paged_composite", "rerope_cache_write_composite"]


def rerope_attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    inv_freq: torch.Tensor,
    window: int,
    leaky_k: float = 0.0,
    scale: float | None = None,
    scale_factors: torch.Tensor | None = None,
    logn_length: int = 0,
    interleaved: bool = False,
    workspace: torch.Tensor | None = None,
    *,
    group: int = 0,
    chunk_size: int = 0,
    far_start: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReRoPE attention of packed requests over a paged cache of raw keys (vLLM's layout and metadata).

    q ``[T, Hq, D]`` (request r owns rows ``query_start_loc[r]:query_start_loc[r+1]``), ``key_cache`` /
    ``value_cache`` ``[num_blocks, Hkv, block_size, D]``, ``block_table`` ``[R, max_blocks]``, ``seq_lens``
    ``[R]``. Key slot j of request r has position j; its queries are the last ``q_len`` positions
    (``seq_lens[r] - q_len + i``). ``inv_freq`` ``[P]`` or one table per request ``[R, P]``;
    ``scale_factors`` ``[R]`` multiplies each request's softmax scale. The rest as
    :func:`rerope_attention` (``group``: Self-Extend, ``chunk_size``: Dual Chunk Attention, by each request's
    positions). Returns ``(out [T, Hq, D], lse float32 [T, Hq])``.

    On CPU tensors the metadata values are checked (pages inside the cache, ``q_len <= seq_len <=``
    the pages' capacity, ``query_start_loc`` from 0 to T, non-decreasing): an error names the request.
    On CUDA they are the caller's contract. No backward pass (an inference op).

    ``workspace``: scratch for the CUDA tensor-core prefill, a 1-D uint8 tensor on q's device of
    :func:`rerope_paged_workspace_bytes` bytes for the most query rows a call will have: an engine
    allocates it once (where its memory profiling sees it) and passes it to every call; its contents are
    overwritten. Without it the op allocates its own, and only when a tensor-core row can exist (never on
    a decode step). Ignored on CPU (still checked). With a workspace the op is the overload
    ``rerope_attention_paged.workspace`` (the workspace is a mutated argument), which has no autograd.
    """
    args = (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, float(leaky_k),
            -1.0 if scale is None else float(scale), scale_factors, logn_length, interleaved)
    if workspace is None:
        return _ops.rerope_attention_paged(*args, group=group, chunk_size=chunk_size, far_start=far_start)
    return _ops.rerope_attention_paged.workspace(*args, group=group, chunk_size=chunk_size, far_start=far_start,
                                                 workspace=workspace)


def rerope_paged_workspace_bytes(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                 max_keys: int | None = None) -> int:
    """Bytes of :func:`rerope_attention_paged`'s ``workspace`` for calls of up to ``tokens`` query rows (an
    engine's largest batch, e.g. vLLM's ``max_num_batched_tokens``), ``kv_heads`` k/v heads of ``head_dim``
    in ``dtype``: the queries' sin/cos of the CUDA tensor-core prefill, plus room to pre-rotate ``max_keys``
    keys per call (None: ``max(4 * tokens, 65536)``, the op's own default; 0: none, every tensor-core request
    rotates its key tiles in the kernel, slower for Leaky ReRoPE and the dynamic methods but on the tensor
    cores at any length). 0 where CUDA needs no workspace (float32, head dims other than 64/80/96/128)."""
    return _ops.rerope_paged_workspace_bytes(tokens, kv_heads, head_dim, dtype, -1 if max_keys is None else max_keys)


def rerope_cache_write_(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Stores raw ``key``/``value`` ``[T, Hkv, D]`` into the pages at ``slot_mapping`` (int64 ``[T]``,
    ``page * block_size + offset``; negative slots are skipped), in place."""
    _ops.rerope_cache_write_(key_cache, value_cache, key, value, slot_mapping)


def _rerope_attention_paged_backward(ctx, grad_out, grad_lse):
    raise RuntimeError(
        "rerope_attention_paged: the fused kernels have no backward pass (an inference op); train through "
        "ropescale.ops.rerope_attention_composite"
    )


torch.library.register_autograd("ropescale::rerope_attention_paged", _rerope_attention_paged_backward)
