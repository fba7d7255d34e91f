"""The registered scaling methods as the suites loop over them: one place, so a method added to the registry
(``ropescale.scaling.register``) is covered by every suite that loops over methods without touching it."""

from __future__ import annotations

import dataclasses

from ropescale import scaling


def registered(**declared) -> dict[str, type[scaling.RopeScaling]]:
    """The registered methods by rope type, those whose declarations equal ``declared`` (e.g. ``dynamic=False``)."""
    return {name: cls for name, cls in scaling.METHODS.items()
            if all(getattr(cls, key) == value for key, value in declared.items())}


def instance(cls: type[scaling.RopeScaling], *, pairs: int, original: int, factor: float = 4.0,
             **fields) -> scaling.RopeScaling:
    """One setting of ``cls`` that scales (its fields set by name): ``factor``, the ``original`` length,
    ``alpha`` (NTK-alpha), LongRoPE-style per-pair factors for ``pairs`` rotary pairs (short ones near 1, long ones up to ``pairs/2``), and
    ``partial_rotary_factor`` 0.5 for a method that reads it itself (proportional: half its pairs at frequency 0)."""
    values = {
        "factor": factor,
        "alpha": factor,  # NTK-alpha's (HunYuan) stretch
        "original_max_position": original,
        "partial_rotary_factor": 0.5,
        "short_factor": tuple(1.0 + 0.05 * i for i in range(pairs)),
        "long_factor": tuple(1.0 + 0.5 * i for i in range(pairs)),
    }
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in values.items() if k in names}, **fields})
