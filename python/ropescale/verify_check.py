"""A ``ropescale verify`` check's verdict (:class:`Check`), below every module of verify that makes one:
:mod:`ropescale.verify` re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

VERDICTS = ("exact", "different", "ignored", "unexplained", "short", "refused", "inconclusive")


@dataclass(frozen=True)
class Check:
    name: str  # "served length", "scaling"
    verdict: str  # one of VERDICTS
    detail: str
    distance: float | None = None  # the engine's from the declared (scaling: mean |delta log p| nats; length: tokens)
    bound: float | None = None  # "exact" only when distance <= bound
    formula: str | None = None  # what explains a wrong verdict: the formula's label (``key=engine value``), the keys

    def measured(self) -> str:
        if self.distance is None:
            return ""
        bound = "none stated" if self.bound is None else f"{self.bound:.3g}"
        return f" [distance {self.distance:.3g}, bound {bound}]"

    @property
    def ok(self) -> bool:
        return self.verdict == "exact"
