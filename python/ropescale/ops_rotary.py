"""The rotary ops (``apply_rotary*``, the per-request rotation) as typed wrappers, with their autograd and the
``torch.func`` path. Re-exported by :mod:`ropescale.ops`, their documented home."""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.ropescale)

_ops = torch.ops.ropescale


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
