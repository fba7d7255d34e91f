"""The scaling methods, and the registry every other module asks about them.

One small frozen dataclass per method turns ``(dim, base)`` into an ``inv_freq`` table through
ropescale's C++ ops and knows its attention factor (the number transformers multiplies cos and sin
by). ``resonance=True`` rounds every wavelength of the method's table to an integer AFTER the method
(Resonance RoPE, Algorithm 1; Resonance-YaRN rounds the YaRN table), and leaves the attention factor
unchanged.

Each method declares everything about itself in one place, its class, and is registered with
:func:`register` (``METHODS`` maps rope types to classes):

- its rope type, the other names it is read under, the name it is written under;
- its parameters (dataclass fields made with :func:`parameter`: the transformers key, whether a config
  must carry it, where it comes from when absent, its ``ropescale`` command-line flag);
- whether its table depends on the length (``dynamic``: the scale follows each sequence;
  ``length_dependent``: the table differs at some length, which LongRoPE's also does);
- what stock engines do with it (``stock``), which length they derive from its config
  (``stock_length_is_scaled``), whether transformers has it natively, and vLLM's rotary class for it;
- the rotary dim its table is made for (``head_dim_table``: the whole head whatever ``partial_rotary_factor``
  says, transformers' ``proportional``; else ``head_dim * partial_rotary_factor``): ``rotary_dim_for``.

:class:`RopeType` owns the naming scheme of rope types: ``resonance`` / ``resonance_<type>`` for
Resonance on a method, ``rerope`` / ``rerope_<table type>`` for ReRoPE attention over a table (``self_extend``,
``dual_chunk`` likewise for Self-Extend and Dual Chunk Attention), and each
method's aliases. ``from_hf`` reads transformers 5.x ``rope_parameters`` (and the legacy ``rope_scaling``
dict) through the registry; ``to_hf`` writes one back. Resonance on LongRoPE is written as a plain
``longrope`` whose per-pair factors hold the rounded table exactly.

By role: the registry, the naming scheme and the base class in :mod:`ropescale.scaling_registry`, the field checks
in :mod:`ropescale.scaling_checks`, the methods in a module per family (:mod:`ropescale.scaling_plain`,
:mod:`ropescale.scaling_ntk`, :mod:`ropescale.scaling_yarn`, :mod:`ropescale.scaling_llama3_longrope`,
:mod:`ropescale.scaling_grok`); this module
imports them in registration order, re-exports their names (their documented home) and reads a config
(:func:`from_hf`).
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Mapping

# The families in registration order (``METHODS`` keeps it: the command line and the tables list them so).
from .scaling_plain import Default, Linear, Proportional
from .scaling_ntk import NTK, DynamicNTK, NTKAlpha
from .scaling_yarn import DynamicYaRN, YaRN
from .scaling_llama3_longrope import Llama3, LongRoPE
from .scaling_grok import GrokRope, ThetaScale, YaRNLog, read_grok_config
from .scaling_registry import (COMMON_KEYS, FROM_CONFIG_LENGTH, HF_KEYS, LAYOUT_KEYS, METHODS,  # noqa: F401
                               PER_CHOICES, Declaration, Parameter, RopeScaling, RopeType, parameter,
                               reads_every_key, register, ropescale_rope_types, table_type_names)

__all__ = [
    "RopeScaling",
    "Default",
    "Linear",
    "Proportional",
    "NTK",
    "NTKAlpha",
    "DynamicNTK",
    "YaRN",
    "DynamicYaRN",
    "Llama3",
    "LongRoPE",
    "YaRNLog",
    "ThetaScale",
    "GrokRope",
    "read_grok_config",
    "RopeType",
    "from_hf",
    "register",
    "parameter",
    "METHODS",
    "HF_KEYS",
]


def from_hf(
    rope_parameters: Mapping[str, Any] | None,
    max_position_embeddings: int | None = None,
) -> RopeScaling:
    """Build the scaling method from a transformers ``rope_parameters`` (5.x) or legacy
    ``rope_scaling`` dict. ``max_position_embeddings`` is the config's value: transformers' dynamic
    rule uses it as the original length, YaRN and LongRoPE use it when
    ``original_max_position_embeddings`` is absent, and LongRoPE derives a missing ``factor`` from it.

    Strict, unlike transformers (which warns): a key the type does not read is an error naming it
    (and the close match, for a typo), so is a missing required key, and the values are checked by
    the method's dataclass. ``HF_KEYS`` lists the keys of every type."""
    if not rope_parameters:
        return Default()
    params = dict(rope_parameters)
    name = params.get("rope_type") or params.get("type") or "default"
    parsed = RopeType.of(params)
    if parsed.method is None or parsed.marker is not None:
        raise ValueError(f"from_hf: unknown rope_type {name!r}; ropescale knows {sorted(METHODS)}")
    cls = parsed.method
    resonance = parsed.resonance or params.get("resonance", False)
    required, optional = HF_KEYS[cls.rope_type]
    known = required | optional | COMMON_KEYS
    for key in sorted(set(params) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known - {"type"}), n=1)
        raise ValueError(
            f"from_hf: rope_type {cls.rope_type!r} has no parameter {key!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; it reads {sorted(required | optional) or 'no parameters'}")
    missing = sorted(k for k in required if params.get(k) is None)
    if missing:
        raise ValueError(f"from_hf: rope_type {cls.rope_type!r} needs {', '.join(missing)}")
    if not isinstance(resonance, bool):
        raise ValueError(f"from_hf: resonance must be true or false, got {resonance!r}")
    try:
        method = cls(**cls.read_hf(params, max_position_embeddings), resonance=resonance)
    except ValueError as err:
        message = str(err)
        if message.startswith("from_hf"):
            raise
        raise ValueError(f"from_hf: rope_type {cls.rope_type!r}: {message}") from None
    unread = getattr(method, "unread_mscale", None)
    if unread:  # a checkpoint may carry it: read as transformers reads it (exact), and said once
        warn_once(f"ropescale: rope_type {cls.rope_type!r}: {unread}; read as transformers reads it (attention "
                  f"factor {method.attention_factor:.6g})")
    return method


_warned: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` the first time this process sees ``message`` (``stacklevel`` counted from the
    caller, as ``warnings.warn``'s from its own)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)
