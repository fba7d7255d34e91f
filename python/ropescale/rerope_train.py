"""ReRoPE attention for training at fused-attention memory: no ``L x L`` tensor, on CPU and on CUDA.

:func:`rerope_attention_train` takes the arguments of ``torch.ops.ropescale.rerope_attention`` and
returns what :func:`ropescale.rerope.rerope_attention_composite` returns (``(out, lse)``, differentiable
in q, k and v through both outputs). For the training shape it never builds a mask or a score
matrix; every other input goes to the composite (see :func:`training_layout`).

The training shape: positions counting up per batch row (padding at negative positions), or
strictly increasing with gaps (PoSE / CREAM position sampling, :mod:`ropescale.training`). Gapped
rows are first gathered into an expanded layout (:class:`_Gaps`) in which the index distance of two
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
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings

import torch

from ._composite import RegionRule, check_rerope_attention, cos_sin, lse_dtype, non_finite_rule, rotate_with_tables
from .rerope import rerope_attention_composite

__all__ = ["rerope_attention_train", "training_layout"]

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# PyTorch's fused attention kernels, called causal, square, without a mask, with the log-sum-exp.


class _Kernel:
    """One fused attention kernel: ``forward(q, k, v, scale) -> (out, lse [B, H, L] float, state)`` and
    ``backward(dout, q, k, v, out, lse, state, scale) -> (dq, dk, dv)`` over ``[B, H, L, D]`` views
    (unit last stride), ``is_causal`` on ``Lq == Lk``."""

    name = ""
    multiple = 8  # the head dim is padded with zero columns to a multiple of this
    gqa = True  # takes k / v with fewer heads than q


class _CpuFlash(_Kernel):
    """Takes any head dim; padded to a multiple of 8 all the same, so that what the CPU path hands
    its kernel is what a fused CUDA kernel takes (the CPU tests check the CUDA path's arguments)."""

    name = "aten._scaled_dot_product_flash_attention_for_cpu"
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward

    def forward(self, q, k, v, scale):
        out, lse = self.fwd(q, k, v, 0.0, True, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, state, scale):
        return self.bwd(dout, q, k, v, out, lse, 0.0, True, scale=scale)


class _CudaFlash(_Kernel):
    name = "aten._scaled_dot_product_flash_attention"
    fwd = aten._scaled_dot_product_flash_attention
    bwd = aten._scaled_dot_product_flash_attention_backward

    def forward(self, q, k, v, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = self.fwd(q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, state, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = self.bwd(dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, True, seed,
                              offset, scale=scale)
        return dq, dk, dv


class _CudaEfficient(_Kernel):
    """Its log-sum-exp is padded to a multiple of 32 queries (what its backward reads)."""

    name = "aten._scaled_dot_product_efficient_attention"
    gqa = False
    fwd = aten._scaled_dot_product_efficient_attention
    bwd = aten._scaled_dot_product_efficient_attention_backward

    def forward(self, q, k, v, scale):
        out, lse, seed, offset = self.fwd(q, k, v, None, True, 0.0, True, scale=scale)
        return out, lse[..., : q.shape[2]], (lse.shape[-1], seed, offset)

    def backward(self, dout, q, k, v, out, lse, state, scale):
        width, seed, offset = state
        padded = lse.new_zeros(*lse.shape[:-1], width)
        padded[..., : lse.shape[-1]] = lse
        dq, dk, dv, _ = self.bwd(dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], True,
                                 scale=scale)
        return dq, dk, dv


_CPU_FLASH, _CUDA_FLASH, _CUDA_EFFICIENT = _CpuFlash(), _CudaFlash(), _CudaEfficient()


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _flash_usable(device: torch.device, head_dim: int) -> bool:
    """PyTorch's flash kernel: sm80 and later; its backward takes head dims > 192 on sm80 / sm90 only."""
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    capability = torch.cuda.get_device_capability(device)
    return (available and torch.backends.cuda.flash_sdp_enabled() and capability[0] >= 8
            and (head_dim <= 192 or capability in ((8, 0), (9, 0))))


def _kernel_for(q: torch.Tensor, head_dim: int) -> _Kernel | None:
    """The kernel for these inputs (``head_dim`` before padding), or None (the composite then)."""
    if q.device.type == "cpu":
        return _CPU_FLASH
    if q.device.type != "cuda" or q.dtype not in (torch.float32, *_HALF):
        return None  # float64 on CUDA: no fused kernel takes it
    if q.dtype in _HALF and _round_up(head_dim, 8) <= 256 and _flash_usable(q.device, _round_up(head_dim, 8)):
        return _CUDA_FLASH
    return _CUDA_EFFICIENT


# ---------------------------------------------------------------------------------------------
# Which inputs take this path.


def training_layout(q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool = True,
                    window: int | None = None) -> bool | None:
    """``None`` when these positions do not take the fused path (the composite takes them), else
    whether any key is padding (a negative position). Two layouts take it, both causal with
    ``Lq <= Lk`` (query i is key row ``i + Lk - Lq``):

    * the training layout: in every batch row b each key at position ``base_b + j`` or negative
      (padding), each query at ``base_b + i + Lk - Lq`` or negative with only padding keys up to its
      row; then query i sees key j exactly when the key is not padding and ``j <= i + Lk - Lq``, at
      distance ``i + Lk - Lq - j``. That is what a training forward hands over (``position_ids``
      counting up, with or without left or right padding; padding queries at -1 too);
    * gapped positions (PoSE, CREAM: :mod:`ropescale.training`): in every batch row its sequence
      (each key's position; at a padding key's row, the query's position if it is not negative)
      strictly increasing over its non-negative entries, with gaps and padding rows anywhere; a
      query at a non-padding key's row at that key's position, or negative (anywhere: its output is
      0 and -inf). Query i then sees the non-padding keys up to its row, at their position distance.
      These run on an expanded layout (:class:`_Gaps`); with ``window`` given, ``None`` too where
      that layout would cost more than ``_GAP_BOUND`` (2) times the composite's scores (the
      composite then runs).

    The composite takes the rest: decreasing or repeated positions (packed documents, generate()'s
    left padding at position 1), a query at another position than its key's, a query at a padding
    key's row whose position does not go on increasing (the PoSE / CREAM authors' collator pads
    position ids with 0: a batch with such a row), more queries than keys, ``causal=False``. One
    host sync."""
    padded, _, gaps = _layout(q_positions, k_positions, causal, window=window)
    if gaps is not None and window is not None and not gaps.worth_it(int(window)):
        return None
    return padded


_GAP_BOUND = 2  # the fused path takes gapped positions up to this many times the composite's scores


def _fused_scores(length: int, window: int) -> int:
    """About how many scores the fused path computes on ``length`` rows: the causal halves of the
    diagonal chunks and of the off-diagonal ones, and the far part's triangle."""
    chunk = min(window, length)
    rows = -(-length // chunk) * chunk
    far = max(0, length - window)
    return rows * chunk // 2 + (rows - chunk) * chunk // 2 + far * far // 2


@dataclasses.dataclass
class _Gaps:
    """Gapped positions laid out for the index-distance decomposition (:func:`training_layout`).

    For strictly increasing positions the position distance of two keys is at least their index
    distance, so the only pairs the decomposition would misclassify span a gap. The expanded layout
    keeps each row's entries (its non-padding keys, and the queries at padding keys' rows) in order
    and puts consecutive ones ``min(p' - p, window)`` rows apart (1 in a row whose positions span
    less than the window: every pair of it is near): two entries then sit fewer than ``window`` rows
    apart exactly when their positions do (a near pair spans only steps ``< window``, kept exactly; a
    far one spans a step of ``window`` or steps summing to its distance), and each entry keeps its
    place in causal order. The rows in between, the rows past a row's last entry (rows are padded to
    the longest) and the places of padding keys are padding keys: a negative position, zero k / v,
    invisible through the padding column. Queries are the last ``length - start`` expanded rows
    (``start``: the earliest non-padding query's row of any batch row); the rows that are not a
    query (zero q, position -1) are dropped and get no gradient, the padding queries get 0 / -inf.
    The rotations read the positions, never the rows, so every method's near and far rotations
    (Leaky's and STRING's far queries, Self-Extend's ``floor(p/G)``, log-n) are those of the real
    positions. Gathers in and out (autograd's own): O(Lk + gaps * window) memory, no host sync."""

    batch: int
    q_len: int
    k_len: int
    length: int  # Le: the expanded key rows
    start: int  # the first expanded row that is a query: Le - start query rows
    padded: bool  # the expanded layout has padding rows
    index: torch.Tensor  # [B, Lk] int64: the expanded row of each entry (row_b's sequence: _layout)
    present: torch.Tensor  # [B, Lk] bool: the entries (a non-padding key, or a padding key with a query)
    real_q: torch.Tensor  # [B, Lq] bool: non-padding queries

    @property
    def expanded_q_len(self) -> int:
        return self.length - self.start

    def worth_it(self, window: int) -> bool:
        """Whether the fused path on the expanded layout computes at most ``_GAP_BOUND`` times the scores
        of the composite (two dense ``Lq x Lk`` SDPA calls)."""
        return _fused_scores(self.length, window) <= _GAP_BOUND * 2 * self.q_len * self.k_len

    def _sources(self, dest, real, rows, width):
        """``[B, width]``: the source row of each expanded row (``rows``: none), from each source row's
        destination ``dest`` (the padding ones to spare columns: every index is written once)."""
        spare = torch.arange(rows, device=dest.device).expand(self.batch, rows)
        src = torch.full((self.batch, width + rows), rows, dtype=torch.int64, device=dest.device)
        return src.scatter_(1, torch.where(real, dest, width + spare), spare)[:, :width]

    def expand(self, q, k, v, q_positions, k_positions):
        """q, k, v ``[B, H, L, D]`` and the positions on the expanded rows (zeros / -1 in the new rows)."""
        shift, Le, Lqe = self.k_len - self.q_len, self.length, self.expanded_q_len
        key_src = self._sources(self.index, self.present, self.k_len, Le)
        query_src = self._sources(self.index[:, shift:] - self.start, self.real_q, self.q_len, Lqe)

        def take(x, src, n):
            ok = src < n
            src = torch.where(ok, src, 0)
            if x.dim() == 2:
                return torch.where(ok, x.to(torch.int64).gather(1, src), -1)
            index = src[:, None, :, None].expand(x.shape[0], x.shape[1], src.shape[1], x.shape[3])
            return torch.where(ok[:, None, :, None], x.gather(2, index), 0)

        k_positions = take(k_positions, key_src, self.k_len)
        key_src = torch.where(k_positions >= 0, key_src, self.k_len)  # padding keys' k and v: zeros
        return (take(q, query_src, self.q_len), take(k, key_src, self.k_len), take(v, key_src, self.k_len),
                take(q_positions, query_src, self.q_len), k_positions)

    def restore(self, out, lse):
        """The expanded rows' ``out [B, H, Lqe, D]`` and ``lse [B, H, Lqe]`` back at the queries' rows;
        padding queries: 0 and -inf (the composite's, whatever their inputs)."""
        shift, Lq = self.k_len - self.q_len, self.q_len
        rows = torch.where(self.real_q, self.index[:, shift:] - self.start, 0)
        out = out.gather(2, rows[:, None, :, None].expand(out.shape[0], out.shape[1], Lq, out.shape[3]))
        lse = lse.gather(2, rows[:, None, :].expand(lse.shape[0], lse.shape[1], Lq))
        return (torch.where(self.real_q[:, None, :, None], out, 0),
                torch.where(self.real_q[:, None, :], lse, float("-inf")))


def _layout(q_positions, k_positions, causal, tensors=(), window=None):
    """(:func:`training_layout` without the cost bound, whether every element of ``tensors`` is finite,
    the :class:`_Gaps` of gapped positions (needs ``window``; else None)), in one host sync."""
    if not causal:
        return None, None, None
    batch, q_len = q_positions.shape
    k_len = k_positions.shape[1]
    if batch == 0 or q_len == 0 or q_len > k_len:
        return None, None, None
    qp, kp = q_positions.to(torch.int64), k_positions.to(torch.int64)
    key_row = torch.arange(k_len, device=kp.device)
    query_row = torch.arange(q_len, device=qp.device) + (k_len - q_len)
    real = kp >= 0
    any_real = real.any(-1, keepdim=True)
    big = torch.iinfo(torch.int64).max
    base = torch.where(real, kp - key_row, torch.iinfo(torch.int64).min).amax(-1, keepdim=True)
    base = torch.where(any_real, base, 0)  # the offset, if the keys are consistent
    ok_k = (~real | (kp - key_row == base)).all()
    first_real = torch.where(real, key_row, k_len).amin(-1, keepdim=True)
    ok_q = torch.where(qp >= 0, ~any_real | (qp == base + query_row), first_real > query_row).all()
    finite = [torch.isfinite(t).all().to(kp.device) for t in tensors]
    # gapped: each row's sequence (a key's position, or where the key is padding, the query's if it has one)
    # strictly increasing over its entries; a query at a non-padding key's row at its position (or negative)
    shift = k_len - q_len
    real_q = qp >= 0
    row_q = torch.nn.functional.pad(torch.where(real_q, qp, -1), (shift, 0), value=-1)  # [B, Lk]
    sequence = torch.where(real, kp, row_q)
    present = sequence >= 0
    before = torch.nn.functional.pad(sequence.cummax(-1).values[:, :-1], (1, 0), value=-1)
    ok_gaps = (~present | (sequence > before)).all() & (~real_q | (qp == sequence[:, shift:])).all()
    stats = [ok_q & ok_k, (~real).any(), *finite, ok_gaps]
    if window is not None:  # each entry's expanded row (the first one at 0; _Gaps)
        span = sequence.amax(-1, keepdim=True) - torch.where(present, sequence, big).amin(-1, keepdim=True)
        step = torch.where(span >= window, (sequence - before).clamp(max=int(window)), 1)
        index = torch.where(present & (before >= 0), step, 0).cumsum(-1)
        lengths = torch.where(present.any(-1), index[:, -1] + 1, 0)
        start = torch.where(real_q, index[:, shift:], big).amin()
        stats += [lengths.amax(), start, real.sum(-1).amin()]
    ok, padded, *rest = torch.stack([s.to(torch.int64) for s in stats]).tolist()
    finite, rest = rest[: len(tensors)], rest[len(tensors) :]
    gaps = None
    if not ok and rest[0] and window is not None:
        length = max(1, rest[1])
        start = min(rest[2], length - 1)
        gaps = _Gaps(batch, q_len, k_len, length, start, padded=rest[3] < length, index=index, present=present,
                     real_q=real_q)
    padded = bool(padded) if ok or rest[0] else None
    return padded, all(finite), gaps


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"ropescale.rerope_attention_train: {reason}; these inputs take rerope_attention_composite, which "
            "hands SDPA an Lq x Lk mask and head dim D + 2 (on CUDA PyTorch's math kernel: O(L^2) memory)",
            stacklevel=3)


# ---------------------------------------------------------------------------------------------
# The plan: sizes, operands, the partials and the maps between them and the rows. Every per-row
# tensor is BLHD, ``[B, rows, H, ...]`` (the layout of the kernels' outputs and gradients), so the
# diagonal chunks and the far part are views; only the off-diagonal halves are copied (reversed).


def _pair_tables(positions: torch.Tensor | float, inv_freq: torch.Tensor, compute: torch.dtype, device):
    """cos, sin ``[B or 1, L or 1, 1, P]`` of ``positions * inv_freq`` (angles in float64), in ``compute``: one
    entry per pair, broadcast over the heads of a BLHD operand (``rotate_with_tables(..., half_width=True)``)."""
    if not torch.is_tensor(positions):
        positions = torch.full((1, 1), float(positions), dtype=torch.float64, device=device)
    cos, sin = cos_sin(positions, inv_freq, dtype=compute)
    return cos[:, :, None], sin[:, :, None]


@dataclasses.dataclass
class _Plan:
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    length: int  # Lk: query i is key row i + length - q_len
    head_dim: int
    window: int
    leaky_k: float
    scale: float
    logn_length: int
    interleaved: bool
    padded: bool  # padding keys: an extra head-dim column carries -inf
    kernel: _Kernel
    dtype: torch.dtype
    finite: bool = False  # q, k, v hold no NaN / inf: no finite stand-ins, no non-finite rule
    extend_group: int = 0  # Self-Extend's group G (0: ReRoPE / Leaky ReRoPE / STRING)
    far_start: int = -1  # the far side's first relative position (-1: the window; STRING's local_value)

    def __post_init__(self):
        # The far side's positions (the near side is d < window for every method this path takes)
        self.rule = RegionRule(self.window, self.leaky_k, self.extend_group, 0, self.far_start)
        self.shift = self.length - self.q_len
        self.far = self.window < self.length
        self.chunk = self.window if self.far else self.length
        self.chunks = -(-self.length // self.chunk)
        self.padded_len = self.chunks * self.chunk
        self.far_len = self.length - self.window if self.far else 0
        self.first_far = max(0, self.window - self.shift)  # the first query with a far part
        self.dim = _round_up(self.head_dim + (1 if self.padded else 0), self.kernel.multiple)
        self.compute = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.group = self.q_heads // self.kv_heads
        self.parts = (["diag"] + (["off"] if self.chunks >= 2 and self.chunk >= 2 else [])
                      + (["far"] if self.far else []))

    # -- rotations

    def rotate_(self, view, positions, inv_freq, conjugate=False, tables=None):
        """``view [B, L, H, D]`` (unit last stride) rotated in place: at integer ``positions`` by
        ropescale's rotation kernel (angles reduced in double, float32 arithmetic, one rounding), or
        by the given cos/sin ``tables`` (Leaky's fractional positions) / for float64 in PyTorch."""
        if tables is None and view.dtype != torch.float64:
            table = inv_freq.to(device=view.device, dtype=torch.float32)
            torch.ops.ropescale.apply_rotary_pos_(view.transpose(1, 2), positions, table, 1.0, self.interleaved,
                                                  conjugate=conjugate)
            return
        cos, sin = tables if tables is not None else _pair_tables(positions, inv_freq, self.compute, view.device)
        view.copy_(rotate_with_tables(view.to(self.compute), cos, sin, self.interleaved, half_width=True,
                                      conjugate=conjugate))

    def far_query_positions(self, q_positions):
        """Where the far part rotates its queries (those from ``first_far`` on): integers (ReRoPE: the
        window; Self-Extend: ``floor(p/G) + W - floor(W/G)``), fractional for Leaky ReRoPE."""
        return self.rule.far_query_positions(q_positions[:, self.first_far :])

    def far_key_positions(self, k_positions):
        """Where the far part rotates its keys (rows ``0..L-1-w``), or None: plain ReRoPE's raw keys."""
        return self.rule.far_key_positions(k_positions[:, : self.far_len])

    def leaky_tables(self, q_positions, k_positions, inv_freq, device):
        """cos/sin of the Leaky far side (fractional positions), computed once and saved for backward."""
        return (*_pair_tables(self.far_query_positions(q_positions), inv_freq, self.compute, device),
                *_pair_tables(self.far_key_positions(k_positions), inv_freq, self.compute, device))

    def logn(self, q_positions):
        """The log-n factor of each query ``[B, Lq, 1, 1]`` (compute dtype), or None."""
        if not self.logn_length:
            return None
        n = (q_positions.to(torch.int64) + 1).to(torch.float64)
        factor = torch.where(n > self.logn_length, n.clamp_min(1).log() / math.log(self.logn_length),
                             torch.ones_like(n))
        return factor.to(self.compute)[:, :, None, None]

    # -- operands

    def _buffer(self, rows, heads, first, last, device):
        """``[B, rows, heads, dim]`` with rows outside ``first..last-1`` and the padding columns zero."""
        buf = torch.empty(self.batch, rows, heads, self.dim, dtype=self.dtype, device=device)
        buf[:, :first].zero_()
        buf[:, last:].zero_()
        buf[..., self.head_dim :].zero_()
        return buf

    def operands(self, q, k, v, q_positions, k_positions, inv_freq, leaky, with_bad=False):
        """The kernels' operands as BLHD buffers, rotated (the log-n factor applied before, in the
        compute dtype), rounded once to the dtype, zero-padded (rows to whole chunks, head
        dim to ``dim``), non-finite values replaced by 0: ``qn``/``kn`` (near side, ``[B, Lp, H, dim]``),
        ``v``, and for the far part ``qf`` (query rows ``w..L-1``) and ``kf`` (key rows ``0..L-1-w``).
        With ``with_bad``, also the rows that held a non-finite operand: ``{"q": [B, Lq, Hq], "k": [B,
        Lk, Hkv]}``."""
        L, D, W, shift, device = self.length, self.head_dim, self.window, self.shift, q.device
        factor = self.logn(q_positions)
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        # log-n (or Leaky's far side): q scaled in the compute dtype, rotated there, rounded once
        qx = None
        if factor is not None or (self.far and self.leaky_k):
            qx = qt.to(self.compute) if factor is None else qt.to(self.compute) * factor
        qn = self._buffer(self.padded_len, self.q_heads, shift, L, device)
        near_q = qn[:, shift:L, :, :D]
        if factor is None:
            near_q.copy_(qt)  # rotated below, in place
        else:
            near_q.copy_(rotate_with_tables(qx, *_pair_tables(q_positions, inv_freq, self.compute, device),
                                            self.interleaved, half_width=True))
        kn = self._buffer(self.padded_len, self.kv_heads, 0, L, device)
        kn[:, :L, :, :D] = kt
        vp = self._buffer(self.padded_len, self.kv_heads, 0, L, device)
        vp[:, :L, :, :D] = v.transpose(1, 2)
        buffers = {"qn": qn, "kn": kn, "v": vp}
        if self.far:
            first, Lf = self.first_far, self.far_len
            qf = self._buffer(Lf, self.q_heads, first + shift - W, Lf, device)
            far_q = qf[:, first + shift - W :, :, :D]
            kf = self._buffer(Lf, self.kv_heads, 0, Lf, device)
            if self.leaky_k:  # fractional positions
                far_q.copy_(rotate_with_tables(qx[:, first:], *leaky[:2], self.interleaved, half_width=True))
                kf[..., :D] = rotate_with_tables(kt[:, :Lf].to(self.compute), *leaky[2:], self.interleaved,
                                                 half_width=True)
            else:  # integer positions: ReRoPE's q at the window and raw keys, Self-Extend's grouped pair
                far_positions = self.far_query_positions(q_positions)
                if factor is None:
                    far_q.copy_(qt[:, first:])
                    self.rotate_(far_q, far_positions, inv_freq)
                else:
                    far_q.copy_(rotate_with_tables(
                        qx[:, first:], *_pair_tables(far_positions, inv_freq, self.compute, device), self.interleaved,
                        half_width=True))
                kf[..., :D] = kt[:, :Lf]
                key_positions = self.far_key_positions(k_positions)
                if key_positions is not None:
                    self.rotate_(kf[..., :D], key_positions, inv_freq)
            buffers.update(qf=qf, kf=kf)
        del qx
        if factor is None:
            self.rotate_(near_q, q_positions, inv_freq)
        self.rotate_(kn[:, :L, :, :D], k_positions, inv_freq)
        bad = None
        if with_bad:
            bad = {"q": ~torch.isfinite(near_q).all(-1), "k": ~torch.isfinite(kn[:, :L, :, :D]).all(-1)}
            if self.far:
                bad["q"][:, self.first_far :] |= ~torch.isfinite(qf[:, self.first_far + shift - W :, :, :D]).all(-1)
                bad["k"][:, : self.far_len] |= ~torch.isfinite(kf[..., :D]).all(-1)
        if not self.finite:
            for t in buffers.values():  # finite stand-ins (the rule puts NaN back), then the padding column
                torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
        if self.padded:
            key_column = torch.where(k_positions < 0, float("-inf"), 0.0).to(self.dtype)[:, :, None]
            qn[..., D] = 1
            kn[:, :L, :, D] = key_column
            if self.far:
                buffers["qf"][..., D] = 1
                buffers["kf"][..., D] = key_column[:, : self.far_len]
        return buffers, bad

    # -- the partials: rows <-> a partial's [B', len, H, *tail] (BLHD; the kernels take its transpose)

    def part_rows(self, part, x, keys=False):
        """A partial's rows of the row tensor ``x [B, Lp, H, *tail]`` (``[B, Lf, ...]`` for the far
        operands), as ``[B', len, H, *tail]``: queries (``keys=False``) or keys / values."""
        B, n, C = self.batch, self.chunks, self.chunk
        tail = x.shape[2:]
        if part == "diag":
            return x.reshape(B * n, C, *tail)
        if part == "off":
            chunks = x.view(B, n, C, *tail)
            x = (chunks[:, :-1, 1:] if keys else chunks[:, 1:, : C - 1]).flip(2)
            return x.reshape(B * (n - 1), C - 1, *tail)
        return x if x.shape[1] == self.far_len else x[:, self.window : self.length]

    def partial_operands(self, part, ops):
        if part == "far":
            q, k, v = ops["qf"], ops["kf"], ops["v"][:, : self.far_len]
        else:
            q, k, v = (self.part_rows(part, ops[name], keys=name != "qn") for name in ("qn", "kn", "v"))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.group > 1 and not self.kernel.gqa:
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        return q, k, v

    def add_rows(self, part, target, y, keys=False):
        """``target[B, Lp (or Lf), H, *tail] += `` a partial's rows ``y [B', len, H, *tail]``."""
        B, n, C = self.batch, self.chunks, self.chunk
        tail = y.shape[2:]
        if part == "diag":
            target += y.reshape(target.shape)
        elif part == "off":
            chunks = target.view(B, n, C, *tail)
            view = chunks[:, :-1, 1:] if keys else chunks[:, 1:, : C - 1]
            view += y.reshape(B, n - 1, C - 1, *tail).flip(2)
        elif target.shape[1] == self.far_len:
            target += y
        else:
            target[:, self.window : self.length] += y

    def coverage(self, k_positions):
        """``{part: [B, Lp, 1] bool}``: rows that have a non-padding key in that partial (from running
        counts of non-padding keys: ``count[:, j]`` keys before row j)."""
        L, Lp, C, W = self.length, self.padded_len, self.chunk, self.window
        count = torch.nn.functional.pad((k_positions >= 0).to(torch.int64).cumsum(-1), (1, Lp - L))  # [B, Lp + 1]
        count[:, L + 1 :] = count[:, L : L + 1]
        start = count[:, :Lp:C].repeat_interleave(C, dim=1)  # keys before each row's chunk
        has = {"diag": count[:, 1:] - start > 0}
        if "off" in self.parts:  # keys i - C + 1 .. start - 1, for rows at offsets 0..C-2 of chunks 1..
            back = torch.nn.functional.pad(count[:, : Lp - C + 1], (C - 1, 0))
            offset = torch.arange(Lp, device=k_positions.device) % C
            inside = (offset <= C - 2) & (torch.arange(Lp, device=k_positions.device) >= C)
            has["off"] = inside & (start - back > 0)
        if self.far:  # keys 0 .. i - W, for rows i >= W
            has["far"] = torch.nn.functional.pad(count[:, 1 : Lp - W + 1], (W, 0)) > 0
        return {part: (h & (torch.arange(Lp, device=h.device) < L))[:, :, None] for part, h in has.items()}


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


def _forward(ctx, plan: _Plan, q, k, v, q_positions, k_positions, inv_freq):
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
    plan: _Plan = ctx.plan
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
    padded, finite, gaps = _layout(q_positions, k_positions, causal, (q, k, v), window=int(window))
    if padded is None:
        if q.requires_grad or k.requires_grad or v.requires_grad:
            _warn_once("not the training layout (causal, positions counting up or increasing with gaps, padding keys "
                       "negative)")
        return rerope_attention_composite(*composite_args, **method)
    if gaps is not None:
        if not gaps.worth_it(int(window)):
            _warn_once(f"the gaps between these positions would take more than {_GAP_BOUND} times the composite's "
                       "scores (up to window rows per gap)")
            return rerope_attention_composite(*composite_args, **method)
        padded = gaps.padded
    head_dim = q.shape[-1]
    kernel = _kernel_for(q, head_dim + (1 if padded else 0))
    if kernel is None:
        _warn_once(f"no fused attention kernel takes {q.dtype} on {q.device.type}")
        return rerope_attention_composite(*composite_args, **method)
    if gaps is not None:
        q, k, v, q_positions, k_positions = gaps.expand(q, k, v, q_positions, k_positions)
    plan = _Plan(
        batch=q.shape[0], q_heads=q.shape[1], kv_heads=k.shape[1], q_len=q.shape[2], length=k.shape[2],
        head_dim=head_dim, window=int(window), leaky_k=float(leaky_k),
        scale=1.0 / math.sqrt(head_dim) if scale is None or scale == -1 else float(scale),
        logn_length=int(logn_length), interleaved=bool(interleaved), padded=padded, kernel=kernel, dtype=q.dtype,
        finite=finite, extend_group=int(group), far_start=int(far_start))
    out, lse = _ReropeTrain.apply(q, k, v, q_positions, k_positions, inv_freq, plan)
    return (out, lse) if gaps is None else gaps.restore(out, lse)
