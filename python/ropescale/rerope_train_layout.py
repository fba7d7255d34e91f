"""Which inputs take the training path (:mod:`ropescale.rerope_train`): :func:`training_layout`, and the expanded
layout of gapped positions (:class:`Gaps`) that the path runs on."""

from __future__ import annotations

import dataclasses

import torch


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
      These run on an expanded layout (:class:`Gaps`); with ``window`` given, ``None`` too where
      that layout would cost more than ``GAP_BOUND`` (2) times the composite's scores (the
      composite then runs).

    The composite takes the rest: decreasing or repeated positions (packed documents, generate()'s
    left padding at position 1), a query at another position than its key's, a query at a padding
    key's row whose position does not go on increasing (the PoSE / CREAM authors' collator pads
    position ids with 0: a batch with such a row), more queries than keys, ``causal=False``. One
    host sync."""
    padded, _, gaps = read_layout(q_positions, k_positions, causal, window=window)
    if gaps is not None and window is not None and not gaps.worth_it(int(window)):
        return None
    return padded


GAP_BOUND = 2  # the fused path takes gapped positions up to this many times the composite's scores


def _fused_scores(length: int, window: int) -> int:
    """About how many scores the fused path computes on ``length`` rows: the causal halves of the
    diagonal chunks and of the off-diagonal ones, and the far part's triangle."""
    chunk = min(window, length)
    rows = -(-length // chunk) * chunk
    far = max(0, length - window)
    return rows * chunk // 2 + (rows - chunk) * chunk // 2 + far * far // 2


@dataclasses.dataclass
class Gaps:
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
    index: torch.Tensor  # [B, Lk] int64: the expanded row of each entry (row_b's sequence: layout)
    present: torch.Tensor  # [B, Lk] bool: the entries (a non-padding key, or a padding key with a query)
    real_q: torch.Tensor  # [B, Lq] bool: non-padding queries

    @property
    def expanded_q_len(self) -> int:
        return self.length - self.start

    def worth_it(self, window: int) -> bool:
        """Whether the fused path on the expanded layout computes at most ``GAP_BOUND`` times the scores
        of the composite (two dense ``Lq x Lk`` SDPA calls)."""
        return _fused_scores(self.length, window) <= GAP_BOUND * 2 * self.q_len * self.k_len

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


def read_layout(q_positions, k_positions, causal, tensors=(), window=None):
    """(:func:`training_layout` without the cost bound, whether every element of ``tensors`` is finite,
    the :class:`Gaps` of gapped positions (needs ``window``; else None)), in one host sync."""
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
    if window is not None:  # each entry's expanded row (the first one at 0; Gaps)
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
        gaps = Gaps(batch, q_len, k_len, length, start, padded=rest[3] < length, index=index, present=present,
                     real_q=real_q)
    padded = bool(padded) if ok or rest[0] else None
    return padded, all(finite), gaps
