"""RULER's scoring (:mod:`ropescale.ruler`; RULER's ``scripts/eval``): the prediction cleaned, the metrics, the
effective length."""

from __future__ import annotations

import re
from typing import Mapping, Sequence


#: RULER's bar: Llama-2-7B's average at 4k. A length counts as effective when the average exceeds it.
THRESHOLD = 85.6


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: stripped, control characters turned into newlines, stripped again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric of the synthetic tasks: per prediction the fraction of its references it contains
    (case-insensitive), averaged, x 100, rounded to 2 decimals."""
    per = [sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references)]
    return round(sum(per) / len(predictions) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric of its QA tasks: per prediction 1 when it contains any of its references."""
    per = [max(float(r.lower() in p.lower()) for r in refs) for p, refs in zip(predictions, references)]
    return round(sum(per) / len(predictions) * 100, 2)


def effective_length(averages: Mapping[int, float], threshold: float = THRESHOLD) -> int | None:
    """The longest length whose average exceeds ``threshold`` with every shorter length's average above it
    too (RULER's effective length); None when the shortest length does not pass."""
    best = None
    for length in sorted(averages):
        if not averages[length] > threshold:  # NaN fails too
            break
        best = length
    return best
