"""ReRoPE attention for training at fused-attention memory: no ``L x L`` tensor, on CPU and on CUDA.

:func:`rerope_attention_train` takes the arguments of ``torch.ops.ropescale.rerope_attention`` and
returns what :func:`ropescale.rerope.rerope_attention_composite` returns (``(out, lse)``, differentiable
in q, k and v through both outputs). For the training shape it never builds a mask or a score
matrix; every other input goes to the composite (see :func:`training_layout`).

The training shape: positions counting up per batch row (padding at negative positions), or
strictly increasing with gaps (PoSE / CREAM position sampling, :mod:`ropescale.training`). Gapped
rows are first gathered into an expanded layout (:class:`Gaps`) in which the index distance of two
keys is below the window exactly when their position distance is: a gap of ``g`` missing positions
becomes ``min(g, window - 1)`` padding rows (none in a row whose positions span less than the
window), rows are padded to the longest, and the outputs are gathered back. Everything below then
runs on that layout unchanged; the rotations read the real positions. Memory O(L + gaps * window);
where that layout would cost more than twice the composite's scores (many gaps of about the window
or more), the composite runs instead.

How (causal attention, key ``j`` at index distance ``d = i - j`` from query ``i``):

* far part (``d >= window``): queries rotated at ``window`` (Leaky: at ``w + (p - w)/k``; STRING: at ``p - w + s``,
  its ``local_value`` ``s``, through Leaky's path with ``k = 1``; Self-Extend: at
  ``floor(p/G) + w - floor(w/G)``) against raw keys (Leaky: rotated at ``p/k``; Self-Extend: at ``floor(p/G)``):
  query rows ``window..L-1`` against key rows ``0..L-1-window``, one ``is_causal`` call on a square problem;
* near band (``d < window``): the sequence in chunks of ``window`` (the last one zero-padded), folded
  into the batch: each chunk's queries against its own keys (``is_causal``), and against the
  previous chunk's keys whose index in the chunk is greater than the query's, which is causal once
  both orders are reversed: chunk offsets ``0..w-2`` of the queries against ``1..w-1`` of the
  previous chunk's keys, reversed.

Each partial is one call to one of PyTorch's fused attention kernels with its log-sum-exp (CPU:
``_scaled_dot_product_flash_attention_for_cpu``; CUDA: ``_scaled_dot_product_flash_attention`` for
fp16/bf16 on sm80+, else ``_scaled_dot_product_efficient_attention``), head dim D (padded with zero
columns to a multiple of 8, on CPU too: the CPU path hands its kernel what a CUDA kernel takes),
``is_causal`` on a square problem, no mask. The partials are merged by their log-sum-exp.

Backward (the ring-attention rule): each partial's backward kernel is called with the MERGED output
and log-sum-exp, so it computes the global probabilities of its own scores and the global
``rowsum(dO * O)``; the partial gradients of the rotated operands add up to the exact gradients,
which are rotated back (the rotations run outside the kernels, in float32, and are recomputed in
backward: what is saved is q, k, v, out and lse, and Leaky's far-side cos/sin). The gradient
through ``lse`` is one more backward call per partial (value column 0 of ones, ``dO`` column 0 =
the lse gradient, output zeros: ``dS = P * g``).

Padding keys (negative positions) get an extra head-dim column, 1 in every query and ``-inf`` in a
padding key (0 in the others), so their scores are ``-inf`` exactly and no mask is needed. Non-finite
inputs follow the rule every path shares (``_composite.non_finite_rule``: the kernels see finite
stand-ins and the rule puts NaN back), with one difference: a row with a visible key whose k holds a
NaN/inf is NaN, where SDPA's arithmetic keeps it finite if every such score is ``-inf``.

By role: the kernels in :mod:`ropescale.rerope_train_kernels`, which inputs take the path and the expanded layout
in :mod:`ropescale.rerope_train_layout`, the plan in :mod:`ropescale.rerope_train_plan`; the autograd function and
the entry point here.
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from ._composite import check_rerope_attention, lse_dtype, non_finite_rule
from .rerope import rerope_attention_composite
from .rerope_train_kernels import kernel_for
from .rerope_train_layout import GAP_BOUND, read_layout, training_layout
from .rerope_train_plan import Plan

__all__ = ["rerope_attention_train", "training_layout"]

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"ropescale.rerope_attention_train: {reason}; these inputs take rerope_attention_composite, which "
            "hands SDPA an Lq x Lk mask and head dim D + 2 (on CUDA PyTorch's math kernel: O(L^2) memory)",
            stacklevel=3)


# ---------------------------------------------------------------------------------------------
# The autograd function


class _ReropeTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_positions, k_positions, inv_freq, plan):
        with torch.autocast(q.device.type, enabled=False):
            return _forward(ctx, plan, q, k, v, q_positions, k_positions, inv_freq)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        with torch.autocast(ctx.plan_device, enabled=False):
            dq, dk, dv = _backward(ctx, grad_out, grad_lse)
        return dq, dk, dv, None, None, None, None


def _forward(ctx, plan: Plan, q, k, v, q_positions, k_positions, inv_freq):
    B, L, Lp, D, Hq, shift = plan.batch, plan.length, plan.padded_len, plan.head_dim, plan.q_heads, plan.shift
    qp, kp = q_positions.to(torch.int64), k_positions.to(torch.int64)
    leaky = plan.leaky_tables(qp, kp, inv_freq, q.device) if plan.far and plan.leaky_k else ()
    ops, bad = plan.operands(q, k, v, qp, kp, inv_freq, leaky, with_bad=not plan.finite)
    has = plan.coverage(kp)
    lses, outs, states = {}, {}, {}
    for part in plan.parts:
        out_p, lse_p, states[part] = plan.kernel.forward(*plan.partial_operands(part, ops), plan.scale)
        outs[part] = out_p.transpose(1, 2)  # [B', len, Hq, dim]
        lses[part] = lse_p.transpose(1, 2)
    del ops
    # merge: lse = log sum_p exp(lse_p); out = sum_p exp(lse_p - lse) out_p over the rows each covers
    rows = {}
    for part in plan.parts:
        r = torch.full((B, Lp, Hq), float("-inf"), dtype=plan.compute, device=q.device)
        _place(plan, part, r, lses[part].to(plan.compute))
        rows[part] = torch.where(has[part], r, float("-inf")) if plan.padded else r
    lse = torch.logsumexp(torch.stack([rows[p] for p in plan.parts]), dim=0)  # [B, Lp, Hq]; -inf: no key
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    acc = None  # [B, Lp, Hq, D]: the diagonal chunks cover every row, the other parts add theirs
    for part in plan.parts:
        weight = torch.exp(rows[part] - safe)[..., None]  # 0 where the part has no key for the row
        out_p = outs.pop(part)[..., :D]
        if plan.padded:  # a row whose keys in this part are all padding: the kernels disagree on it
            out_p = torch.where(_part_view(plan, part, has[part][..., None]), out_p, 0.0)
        contribution = _part_view(plan, part, weight) * out_p
        if acc is None:
            acc = contribution.reshape(B, Lp, Hq, D)
        else:
            plan.add_rows(part, acc, contribution)
        del contribution
    out = acc[:, shift:L].to(q.dtype).transpose(1, 2)
    lse = lse[:, shift:L].to(lse_dtype(q)).transpose(1, 2)
    del acc
    final_out, final_lse = out, lse  # rows without a visible key: 0 and -inf already
    if not plan.finite:  # the non-finite rule: a row with a non-finite query or visible key is poisoned
        key_row = torch.arange(L, device=q.device)[None, :, None]
        first_bad = torch.where(bad["k"] & (kp >= 0)[..., None], key_row, L).amin(dim=1)  # [B, Hkv]
        first_bad = first_bad.repeat_interleave(plan.group, dim=1)  # [B, Hq]
        reach = torch.arange(plan.q_len, device=q.device) + shift
        poison = bad["q"].transpose(1, 2) | (first_bad[:, :, None] <= reach)
        row_stat = torch.where(poison, float("nan"), lse)
        final_out, final_lse = non_finite_rule(out, lse, row_stat, v, qp, kp, True)
    ctx.save_for_backward(q, k, v, qp, kp, inv_freq, out, lse, *leaky)
    ctx.plan, ctx.states, ctx.plan_device = plan, states, q.device.type
    ctx.set_materialize_grads(False)
    return final_out, final_lse


def _part_view(plan, part, x):
    """The rows of a row tensor ``x [B, Lp, H or 1, *tail]`` a partial's queries are, as ``[B', len, ...]``."""
    if part == "far":
        return x[:, plan.window : plan.length]
    return plan.part_rows(part, x)


def _place(plan, part, target, y):
    """``target[rows of the partial] = y`` (``y`` a partial's query rows ``[B', len, H, *tail]``)."""
    B, n, C = plan.batch, plan.chunks, plan.chunk
    tail = y.shape[2:]
    if part == "diag":
        target.copy_(y.reshape(target.shape))
    elif part == "off":
        target.view(B, n, C, *tail)[:, 1:, : C - 1] = y.reshape(B, n - 1, C - 1, *tail).flip(2)
    else:
        target[:, plan.window : plan.length] = y


def _backward(ctx, grad_out, grad_lse):
    q, k, v, qp, kp, inv_freq, out, lse, *leaky = ctx.saved_tensors
    plan: Plan = ctx.plan
    B, L, Lp, D, Dp, Hq, shift = (plan.batch, plan.length, plan.padded_len, plan.head_dim, plan.dim, plan.q_heads,
                                  plan.shift)
    if grad_out is None and grad_lse is None:
        return None, None, None
    ops, _ = plan.operands(q, k, v, qp, kp, inv_freq, leaky)
    shapes = {name: t.shape for name, t in ops.items()}
    has = plan.coverage(kp)
    seen = torch.zeros_like(has["diag"])
    for part in plan.parts:
        seen = seen | has[part]
    seen = seen[:, shift:L]  # [B, Lq, 1]: rows with a visible key (the others are constants)
    lse_rows = torch.zeros(B, Lp, Hq, dtype=plan.compute, device=q.device)
    lse_rows[:, shift:L] = torch.where(torch.isfinite(lse), lse, 0.0).transpose(1, 2)
    calls = []  # (dO rows, O rows, values: v, or column 0 of ones for the lse gradient)
    if grad_out is not None:
        d_rows = plan._buffer(Lp, Hq, shift, L, q.device)
        d_rows[:, shift:L, :, :D] = torch.where(seen[..., None], grad_out.transpose(1, 2), 0.0)
        o_rows = plan._buffer(Lp, Hq, shift, L, q.device)
        o_rows[:, shift:L, :, :D] = out.transpose(1, 2)
        calls.append((d_rows, o_rows, False))
    if grad_lse is not None:
        d_rows = q.new_zeros(B, Lp, Hq, Dp)
        d_rows[:, shift:L, :, 0] = torch.where(seen, grad_lse.transpose(1, 2), 0.0)
        calls.append((d_rows, q.new_zeros(B, Lp, Hq, Dp), True))
    grads = {}

    def add(name, part, y, keys=False):
        """Accumulate a partial's rows ``y`` into ``grads[name]`` (the diagonal chunks and the far
        operands' own rows start their buffer)."""
        if name not in grads:
            if part == "diag":
                grads[name] = y.reshape(B, Lp, *y.shape[2:]).to(plan.compute)
                return
            if part == "far" and name != "v":
                grads[name] = y.to(plan.compute)
                return
            grads[name] = torch.zeros(shapes[name], dtype=plan.compute, device=q.device)
        plan.add_rows(part, grads[name] if name != "v" or part != "far" else grads[name][:, : plan.far_len], y,
                      keys=keys)

    for part in plan.parts:
        pq, pk, pv = plan.partial_operands(part, ops)
        lse_p = _part_view(plan, part, lse_rows).transpose(1, 2)
        for d_rows, o_rows, ones in calls:
            values = pv
            if ones:
                values = torch.zeros_like(pv)
                values[..., 0] = 1
            dq_p, dk_p, dv_p = plan.kernel.backward(_part_view(plan, part, d_rows).transpose(1, 2), pq, pk, values,
                                                    _part_view(plan, part, o_rows).transpose(1, 2), lse_p,
                                                    ctx.states[part], plan.scale)
            if plan.group > 1 and not plan.kernel.gqa:
                dk_p = dk_p.unflatten(1, (plan.kv_heads, plan.group)).sum(2)
                dv_p = dv_p.unflatten(1, (plan.kv_heads, plan.group)).sum(2)
            far = part == "far"
            add("qf" if far else "qn", part, dq_p.transpose(1, 2))
            add("kf" if far else "kn", part, dk_p.transpose(1, 2), keys=True)
            if not ones:
                add("v", part, dv_p.transpose(1, 2), keys=True)
    del ops
    dq = grads["qn"][:, shift:L, :, :D]
    dk = grads["kn"][:, :L, :, :D]
    plan.rotate_(dq, qp, inv_freq, conjugate=True)
    plan.rotate_(dk, kp, inv_freq, conjugate=True)
    if plan.far:
        first, W, Lf = plan.first_far, plan.window, plan.far_len
        far_q = grads["qf"][:, first + shift - W :, :, :D]
        far_k = grads["kf"][..., :D]
        if plan.leaky_k:
            plan.rotate_(far_q, None, inv_freq, conjugate=True, tables=leaky[:2])
            plan.rotate_(far_k, None, inv_freq, conjugate=True, tables=leaky[2:])
        else:
            plan.rotate_(far_q, plan.far_query_positions(qp), inv_freq, conjugate=True)
            key_positions = plan.far_key_positions(kp)
            if key_positions is not None:
                plan.rotate_(far_k, key_positions, inv_freq, conjugate=True)
        dq[:, first:] += far_q
        dk[:, :Lf] += far_k
    factor = plan.logn(qp)
    if factor is not None:
        dq *= factor
    dv = grads["v"][:, :L, :, :D] if "v" in grads else None  # None: only lse had a gradient
    return tuple(None if g is None else g.to(t.dtype, copy=True).transpose(1, 2)
                 for g, t in ((dq, q), (dk, k), (dv, v)))


# ---------------------------------------------------------------------------------------------
# The entry point


def rerope_attention_train(
    q, k, v, q_positions, k_positions, inv_freq, window, leaky_k=0.0, scale=-1.0, logn_length=0, causal=True,
    interleaved=False, *, group=0, chunk_size=0, far_start=-1,
):
    """ReRoPE / Leaky ReRoPE / Self-Extend attention for training, at the memory of PyTorch's fused attention.

    Same arguments, semantics and results as :func:`ropescale.ops.rerope_attention` /
    :func:`ropescale.rerope.rerope_attention_composite` (``lse`` float32, float64 for float64 inputs;
    differentiable in q, k, v through ``out`` and ``lse``). For the training layout
    (:func:`training_layout`: causal, positions counting up or strictly increasing with gaps as PoSE /
    CREAM sample them, padding keys at negative positions) it calls only PyTorch's fused attention
    kernels, ``is_causal`` on square problems without a mask, and never builds an ``Lq x Lk`` tensor
    (see the module docstring; gapped positions on an expanded layout, up to ``window - 1`` rows more
    per gap). Other inputs (non-causal, other position patterns, gaps that would cost more than twice
    the composite's scores, float64 on CUDA, another device) take the composite, with a warning once
    per reason.

    Self-Extend (``group``) has ReRoPE's structure (near ``d < window``, the far part ``d >= window``), only its
    far positions differ (the grouped ones, integers: rotated by ropescale's kernel like the window). Dual Chunk
    Attention (``chunk_size``) is refused: it is a training-free inference method with no training path here.
    """
    check_rerope_attention(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                           group, chunk_size, far_start, causal)
    if chunk_size:
        raise NotImplementedError(
            "rerope_attention_train: Dual Chunk Attention (chunk_size > 0) has no training path: it is a "
            "training-free inference method; run it with ropescale.ops.rerope_attention (no backward), or, where a "
            "gradient is really wanted, ropescale.ops.rerope_attention_composite (differentiable, Lq x Lk masks)")
    composite_args = (q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length, causal,
                      interleaved)
    method = dict(group=group, far_start=far_start)
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported here: it is heavy
    if dtensor is not None and any(isinstance(t, dtensor.DTensor) for t in (q, k, v)):
        _warn_once("DTensor activations (this path has no sharding rule)")
        return rerope_attention_composite(*composite_args, **method)
    padded, finite, gaps = read_layout(q_positions, k_positions, causal, (q, k, v), window=int(window))
    if padded is None:
        if q.requires_grad or k.requires_grad or v.requires_grad:
            _warn_once("not the training layout (causal, positions counting up or increasing with gaps, padding keys "
                       "negative)")
        return rerope_attention_composite(*composite_args, **method)
    if gaps is not None:
        if not gaps.worth_it(int(window)):
            _warn_once(f"the gaps between these positions would take more than {GAP_BOUND} times the composite's "
                       "scores (up to window rows per gap)")
            return rerope_attention_composite(*composite_args, **method)
        padded = gaps.padded
    head_dim = q.shape[-1]
    kernel = kernel_for(q, head_dim + (1 if padded else 0))
    if kernel is None:
        _warn_once(f"no fused attention kernel takes {q.dtype} on {q.device.type}")
        return rerope_attention_composite(*composite_args, **method)
    if gaps is not None:
        q, k, v, q_positions, k_positions = gaps.expand(q, k, v, q_positions, k_positions)
    plan = Plan(
        batch=q.shape[0], q_heads=q.shape[1], kv_heads=k.shape[1], q_len=q.shape[2], length=k.shape[2],
        head_dim=head_dim, window=int(window), leaky_k=float(leaky_k),
        scale=1.0 / math.sqrt(head_dim) if scale is None or scale == -1 else float(scale),
        logn_length=int(logn_length), interleaved=bool(interleaved), padded=padded, kernel=kernel, dtype=q.dtype,
        finite=finite, extend_group=int(group), far_start=int(far_start))
    out, lse = _ReropeTrain.apply(q, k, v, q_positions, k_positions, inv_freq, plan)
    return (out, lse) if gaps is None else gaps.restore(out, lse)
