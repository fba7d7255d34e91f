"""Position sampling for fine-tuning to a long context at a short window (issue 46, part 1): PoSE and CREAM.

Both train on ``window`` tokens whose position ids reach ``target``: the model sees the long positions (and the long
relative distances) at the cost of a short sequence. Each sampler turns one tokenised text into ``(indices,
positions)``: the tokens to train on (indices into the text) and their position ids, both ``window`` long, positions
strictly increasing and below ``target``. ``PositionSamplingCollator`` does it for transformers' Trainer (it pads
as the authors' collators do); :func:`sample_positions` for a plain loop. Every ropescale method takes the
positions: ``hf.patch``'s rotation reads ``position_ids`` (a static table at any position; a dynamic method's length
is each row's largest position + 1, as transformers computes it, so a sampled row takes the table of the length its
positions reach). ReRoPE-family training (``rerope_attention_train``) runs sampled positions on its fused path, on a
layout up to ReRoPE's window - 1 rows longer per skip (PoSE: one, CREAM: two), a batch with a row the collator padded
(position ids 0 after the text) included: its padding queries are set aside, no ``L x L`` mask is built.

The collator (and :func:`sample_positions`) takes each text as it comes, up to :attr:`PoSE.text_length` /
:attr:`CREAM.text_length` tokens (what the authors' code truncates its texts to); a longer text is refused by name,
or cut to that length (its first tokens, as a tokenizer's truncation keeps them) with ``truncate=True``. A feature's
own ``labels`` (a prompt masked with -100) are sampled with the same indices as its tokens; without them the labels
are the sampled tokens (the authors' ``labels = input_ids``). Padding (a PoSE text shorter than the window) takes
``pad_token_id``, which may be None (a tokenizer without a pad token: Llama, Mistral): the padding is after the text,
masked (attention mask 0) and unscored (labels -100), so no real token sees its id, and id 0 fills it.

The rules are the authors' code's, draw for draw, so that a seed gives their sequences:

- :class:`PoSE` (Zhu et al., ICLR 2024; ``dwzhu-pku/PoSE`` ``src/train_pose.py``, ``train_preprocess_function_pose``):
  two chunks. ``len_chunk = min(len(text), window)``; the first chunk is the text's ``[0, r1)`` with ``r1`` uniform
  in ``[1, (len_chunk + 1) // 2]``; the second is the ``len_chunk - r1`` tokens ending at ``r2``, uniform in
  ``[len_chunk, len(text)]`` (a 1-token text: the first chunk alone, at position 0, the three draws made as the code
  makes them). Positions: ``0 .. len_chunk - 1``, the second chunk's all shifted by one skip ``u``
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

    @property
    def text_length(self) -> int:
        """The longest text the authors' code samples from: it tokenises with ``max_length = 5 x window``."""
        return 5 * self.window

    def sample(self, lengths: Sequence[int], rng: random.Random,
               np_rng: np.random.RandomState | None = None) -> list[tuple[list[int], list[int]]]:
        """``(indices, positions)`` per text of ``lengths[i]`` tokens, as given (the code tokenises with
        ``max_length = 5 x window``; CREAM's copy of it with ``target // window x window``: truncate the texts so);
        ``rng`` draws as the code's ``random`` module."""
        out = []
        for length in lengths:
            length = int(length)
            if length < 1:
                raise ValueError(f"PoSE: a text of {length} tokens has nothing to sample (at least one token)")
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

    @property
    def text_length(self) -> int:
        """The longest text CREAM's positions describe: ``target // window x window`` (its tail takes the text's
        last tokens at the positions just below that length; its code's texts are tokenised to it)."""
        return self.target // self.window * self.window

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
                     rng: random.Random, np_rng: np.random.RandomState | None = None,
                     truncate: bool = False) -> dict[str, torch.Tensor]:
    """For a plain loop: the sampled ``input_ids``, ``position_ids`` and ``labels`` (LongTensors ``[B, window]``;
    a PoSE text shorter than the window gives a shorter row, padded as :class:`PositionSamplingCollator` pads).
    Texts longer than the sampler's ``text_length`` are refused, or cut to it with ``truncate=True``."""
    rows = [list(map(int, ids)) for ids in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
    return _sample("sample_positions", rows, [None] * len(rows), sampler, rng, np_rng, 0, truncate)


def _sample(caller: str, rows: list[list[int]], labels: list[list[int] | None], sampler: PoSE | CREAM,
            rng: random.Random, np_rng: np.random.RandomState | None, pad_token_id: int,
            truncate: bool) -> dict[str, torch.Tensor]:
    """Each text (and its labels, where given) sampled with the sampler's indices, then padded."""
    if not rows:
        raise ValueError(f"{caller}: an empty batch (no texts to sample from)")
    limit = sampler.text_length
    for n, row in enumerate(rows):
        if len(row) > limit and not truncate:
            raise ValueError(
                f"{caller}: text {n} has {len(row)} tokens, more than {type(sampler).__name__}'s texts "
                f"({limit}: {'5 x window' if isinstance(sampler, PoSE) else 'target // window x window'}, where its "
                f"authors' code truncates them); tokenise with truncation=True, max_length={limit}, or pass "
                f"truncate=True to cut each text to its first {limit} tokens")
    rows = [row[:limit] for row in rows]
    labels = [None if lab is None else lab[:limit] for lab in labels]
    samples = sampler.sample([len(r) for r in rows], rng, np_rng)
    tokens = [[row[i] for i in indices] for row, (indices, _) in zip(rows, samples)]
    targets = [t if lab is None else [lab[i] for i in indices] for t, lab, (indices, _) in zip(tokens, labels, samples)]
    return _pad(tokens, targets, [positions for _, positions in samples], pad_token_id)


def _pad(tokens: list[list[int]], labels: list[list[int]], positions: list[list[int]], pad_token_id: int,
         ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """The authors' collator: input ids padded with the pad token, labels with -100, position ids with 0."""
    width = max(len(t) for t in tokens)
    ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    targets = torch.full((len(tokens), width), ignore_index, dtype=torch.long)
    pos = torch.zeros((len(tokens), width), dtype=torch.long)
    mask = torch.zeros((len(tokens), width), dtype=torch.long)
    for i, (t, lab, p) in enumerate(zip(tokens, labels, positions)):
        ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        targets[i, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        pos[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, : len(t)] = 1
    return {"input_ids": ids, "position_ids": pos, "labels": targets, "attention_mask": mask}


def _ids(feature: Any, key: str, n: int) -> list[int]:
    value = feature[key]
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
            isinstance(v, Sequence) for v in value):
        raise ValueError(f"PositionSamplingCollator: feature {n}'s {key} must be one sequence of integer ids (one "
                         f"tokenised text), got {type(feature[key]).__name__}")
    return list(map(int, value))


class PositionSamplingCollator:
    """A data collator for transformers' Trainer: each feature's ``input_ids`` (a tokenised text, at least the
    window long for CREAM, at most the sampler's ``text_length`` unless ``truncate=True``) becomes ``window`` sampled
    tokens with their position ids, and its ``labels`` (where the feature has them: a prompt masked with -100, the
    text's length) the labels at the same indices; one call is one batch (CREAM's head/tail choice is per call, as
    the code's per ``map`` batch). ``pad_token_id`` None (a tokenizer without a pad token) pads with id 0: padding
    is masked and unscored (module docstring). ``seed`` seeds both generators."""

    def __init__(self, sampler: PoSE | CREAM, pad_token_id: int | None = 0, seed: int = 0, truncate: bool = False):
        if not isinstance(sampler, (PoSE, CREAM)):
            raise TypeError(f"PositionSamplingCollator: sampler must be PoSE or CREAM, got {type(sampler).__name__}")
        if pad_token_id is None:
            pad_token_id = 0
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)) or pad_token_id < 0:
            raise ValueError(f"PositionSamplingCollator: pad_token_id must be a token id (an integer >= 0) or None, "
                             f"got {pad_token_id!r}")
        if not isinstance(truncate, bool):
            raise ValueError(f"PositionSamplingCollator: truncate must be True or False, got {truncate!r}")
        self.sampler, self.pad_token_id, self.truncate = sampler, int(pad_token_id), truncate
        self.rng, self.np_rng = random.Random(seed), np.random.RandomState(seed)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows, labels = [], []
        for n, feature in enumerate(features):
            row = _ids(feature, "input_ids", n)
            mask = feature.get("attention_mask")
            if mask is not None and not all(int(m) for m in (mask.tolist() if hasattr(mask, "tolist") else mask)):
                raise ValueError(f"PositionSamplingCollator: feature {n}'s attention_mask has zeros: a padded text "
                                 "would have its padding sampled as tokens; tokenise without padding (the collator "
                                 "pads)")
            label = _ids(feature, "labels", n) if feature.get("labels") is not None else None
            if label is not None and len(label) != len(row):
                raise ValueError(f"PositionSamplingCollator: feature {n}'s labels ({len(label)}) and input_ids "
                                 f"({len(row)}) differ in length: the labels are sampled with the tokens' indices, "
                                 "one label a token")
            rows.append(row)
            labels.append(label)
        return _sample("PositionSamplingCollator", rows, labels, self.sampler, self.rng, self.np_rng,
                       self.pad_token_id, self.truncate)
