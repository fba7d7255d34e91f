"""Position sampling for fine-tuning to a long context at a short window (issue 46, part 1): PoSE and CREAM.

Both train on ``window`` tokens whose position ids reach ``target``: the model sees the long positions (and the long
relative distances) at the cost of a short sequence. Each sampler turns one tokenised text into ``(indices,
positions)``: the tokens to train on (indices into the text) and their position ids, both ``window`` long, positions
strictly increasing and below ``target``. ``PositionSamplingCollator`` does it for transformers' Trainer (it pads
as the authors' collators do); :func:`sample_positions` for a plain loop. Every ropescale method takes the
positions: ``hf.patch``'s rotation reads ``position_ids`` (a static table at any position; a dynamic method's length
is each row's largest position + 1, as transformers computes it, so a sampled row takes the table of the length its
positions reach). KNOWN: ReRoPE-family training (``rerope_attention_train``) runs sampled positions on its fused
path, on a layout up to ReRoPE's window - 1 rows longer per skip (PoSE: one, CREAM: two); a batch with a row the
collator padded (position ids 0 after the text) still runs its composite: an ``L x L`` mask (memory quadratic in the
window).

The rules are the authors' code's, draw for draw, so that a seed gives their sequences:

- :class:`PoSE` (Zhu et al., ICLR 2024; ``dwzhu-pku/PoSE`` ``src/train_pose.py``, ``train_preprocess_function_pose``):
  two chunks. ``len_chunk = min(len(text), window)``; the first chunk is the text's ``[0, r1)`` with ``r1`` uniform
  in ``[1, (len_chunk + 1) // 2]``; the second is the ``len_chunk - r1`` tokens ending at ``r2``, uniform in
  ``[len_chunk, len(text)]``. Positions: ``0 .. len_chunk - 1``, the second chunk's all shifted by one skip ``u``
  uniform in ``[0, target - len_chunk]`` (the code's "lt = 0" revision: the first chunk always starts at 0). The
  paper describes N chunks with a skip each; its code uses two.
- :class:`CREAM` (Wu et al., NeurIPS 2024; ``bigai-nlco/CREAM`` ``src/train.py``, ``CREAM``): three segments. Per
  call (a batch: the code's ``datasets.map`` batch), head and tail lengths ``window // 3`` or ``4 * k``
  (``k = target // window``), one or the other with probability 1/2; the head keeps positions ``0 .. head - 1``,
  the tail the last ``tail`` positions below ``k * window``. Per text, the middle's end ``e`` follows a
  "truncated Gaussian" over ``f`` in ``[2, 2k]``: the code's mean ``1 + k`` and ``sigma`` (default 3.0), drawn as it
  does by inverting the Gaussian's CDF tabulated on 1000 points of ``[2, 2k]`` with ``numpy.interp`` (so the mass
  outside the interval lands on its ends, not spread over it: the code's truncation) and flooring; then ``e``
  uniform in ``[head + (len_chunk - 1) f / 2, f window / 2 - tail - 1]``. The middle's tokens are the text's at the
  same positions when the text is that long, else the ``len_chunk`` tokens before the tail; as in the code, a middle
  that ends inside the text's last ``tail`` tokens shares them with the tail (those tokens appear twice).
  ``scipy.special.erf`` in the code is ``math.erf`` here (the same function in double precision).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["PoSE", "CREAM", "PositionSamplingCollator", "sample_positions"]


def _check_lengths(name: str, window: int, target: int) -> None:
    for what, value in (("window", window), ("target", target)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {what} must be an integer >= 1, got {value!r}")
    if target < window:
        raise ValueError(f"{name}: target ({target}) must be >= window ({window}): the positions reach target")


@dataclass(frozen=True)
class PoSE:
    """PoSE's two-chunk positional skip (module docstring): ``window`` tokens, positions below ``target``."""

    window: int
    target: int

    def __post_init__(self):
        _check_lengths("PoSE", self.window, self.target)

    def sample(self, lengths: Sequence[int], rng: random.Random,
               np_rng: np.random.RandomState | None = None) -> list[tuple[list[int], list[int]]]:
        """``(indices, positions)`` per text of ``lengths[i]`` tokens, as given (the code tokenises with
        ``max_length = 5 x window``; CREAM's copy of it with ``target // window x window``: truncate the texts so);
        ``rng`` draws as the code's ``random`` module."""
        out = []
        for length in lengths:
            length = int(length)
            if length < 2:
                raise ValueError(f"PoSE: a text of {length} tokens cannot be split into two chunks")
            chunk = min(length, self.window)
            first_end = rng.randint(1, (chunk + 1) // 2)
            second_end = rng.randint(chunk, length)
            second_start = second_end - (chunk - first_end)
            skip = rng.randint(0, self.target - chunk)
            indices = list(range(first_end)) + list(range(second_start, second_end))
            positions = list(range(first_end)) + [p + skip for p in range(first_end, chunk)]
            out.append((indices, positions))
        return out


@dataclass(frozen=True)
class CREAM:
    """CREAM's head, middle and tail (module docstring): ``window`` tokens, positions below ``target``."""

    window: int
    target: int
    sigma: float = 3.0

    def __post_init__(self):
        _check_lengths("CREAM", self.window, self.target)
        k = self.target // self.window
        if k < 2:
            raise ValueError(f"CREAM: target ({self.target}) must be at least twice the window ({self.window})")
        if not (isinstance(self.sigma, (int, float)) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"CREAM: sigma must be a finite number > 0, got {self.sigma!r}")
        if self.window - 2 * max(self.window // 3, 4 * k) < 1:
            raise ValueError(f"CREAM: a window of {self.window} leaves no middle beside a head and tail of "
                             f"{max(self.window // 3, 4 * k)} (4 x target // window)")
        if self.window % 2:
            raise ValueError(f"CREAM: the window must be even (the code's f * window / 2 is then whole), got "
                             f"{self.window}")

    def _factor_table(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.target // self.window
        x = np.linspace(2, k * 2, 1000)
        mu = 1 + k
        cdf = np.array([0.5 * (1 + math.erf((v - mu) / (self.sigma * math.sqrt(2)))) for v in x])
        return x, cdf

    def sample(self, lengths: Sequence[int], rng: random.Random,
               np_rng: np.random.RandomState | None = None) -> list[tuple[list[int], list[int]]]:
        """``(indices, positions)`` per text of ``lengths[i]`` tokens (at least ``window``), one head/tail choice for
        the call; ``rng`` draws as the code's ``random`` module, ``np_rng`` as its ``numpy.random`` (a
        ``RandomState``; the code's global one)."""
        if np_rng is None:
            raise ValueError("CREAM: np_rng (a numpy RandomState) is needed: the code draws the middle's factor from "
                             "numpy's generator")
        k = self.target // self.window
        head = tail = self.window // 3 if rng.randint(0, 1) == 0 else 4 * k
        middle = self.window - head - tail
        x, cdf = self._factor_table()
        out = []
        for length in lengths:
            length = int(length)
            if length < self.window:
                raise ValueError(f"CREAM: a text of {length} tokens is shorter than the window ({self.window})")
            f = int(np.interp(np_rng.rand(), cdf, x))
            end = rng.randint(int(head + (middle - 1) * (f / 2)), f * self.window // 2 - tail - 1)
            middle_positions = list(range(end - (middle - 1), end + 1))
            positions = list(range(head)) + middle_positions + list(range(k * self.window - tail, k * self.window))
            middle_indices = (list(range(length - tail - (middle - 1) - 1, length - tail)) if end >= length
                              else middle_positions)
            indices = list(range(head)) + middle_indices + list(range(length - tail, length))
            out.append((indices, positions))
        return out


def sample_positions(input_ids: Sequence[Sequence[int]] | torch.Tensor, sampler: PoSE | CREAM,
                     rng: random.Random, np_rng: np.random.RandomState | None = None) -> dict[str, torch.Tensor]:
    """For a plain loop: the sampled ``input_ids``, ``position_ids`` and ``labels`` (LongTensors ``[B, window]``;
    a PoSE text shorter than the window gives a shorter row, padded as :class:`PositionSamplingCollator` pads)."""
    rows = [list(map(int, ids)) for ids in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
    samples = sampler.sample([len(r) for r in rows], rng, np_rng)
    return _pad([[row[i] for i in indices] for row, (indices, _) in zip(rows, samples)],
                [positions for _, positions in samples], pad_token_id=0)


def _pad(tokens: list[list[int]], positions: list[list[int]], pad_token_id: int,
         ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """The authors' collator: input ids padded with the pad token, labels with -100, position ids with 0."""
    width = max(len(t) for t in tokens)
    ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(tokens), width), ignore_index, dtype=torch.long)
    pos = torch.zeros((len(tokens), width), dtype=torch.long)
    mask = torch.zeros((len(tokens), width), dtype=torch.long)
    for i, (t, p) in enumerate(zip(tokens, positions)):
        ids[i, : len(t)] = torch.tensor(t)
        labels[i, : len(t)] = torch.tensor(t)
        pos[i, : len(p)] = torch.tensor(p)
        mask[i, : len(t)] = 1
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "attention_mask": mask}


class PositionSamplingCollator:
    """A data collator for transformers' Trainer: each feature's ``input_ids`` (a tokenised text, at least the
    window long for CREAM) becomes ``window`` sampled tokens with their position ids; one call is one batch (CREAM's
    head/tail choice is per call, as the code's per ``map`` batch). ``seed`` seeds both generators."""

    def __init__(self, sampler: PoSE | CREAM, pad_token_id: int = 0, seed: int = 0):
        if not isinstance(sampler, (PoSE, CREAM)):
            raise TypeError(f"PositionSamplingCollator: sampler must be PoSE or CREAM, got {type(sampler).__name__}")
        self.sampler, self.pad_token_id = sampler, int(pad_token_id)
        self.rng, self.np_rng = random.Random(seed), np.random.RandomState(seed)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [list(map(int, f["input_ids"])) for f in features]
        samples = self.sampler.sample([len(r) for r in rows], self.rng, self.np_rng)
        return _pad([[row[i] for i in indices] for row, (indices, _) in zip(rows, samples)],
                    [positions for _, positions in samples], self.pad_token_id)
