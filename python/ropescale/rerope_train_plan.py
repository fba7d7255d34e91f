"""The training path's plan (:mod:`ropescale.rerope_train`): sizes, operands, the partials and the maps between
them and the rows."""

from __future__ import annotations

import dataclasses
import math

import torch

from ._composite import RegionRule, cos_sin, rotate_with_tables
from .rerope_train_kernels import Kernel, round_up


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
class Plan:
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
    kernel: Kernel
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
        self.dim = round_up(self.head_dim + (1 if self.padded else 0), self.kernel.multiple)
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
