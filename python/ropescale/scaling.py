"""One small frozen dataclass per RoPE scaling method.

Each method turns ``(dim, base)`` into an ``inv_freq`` table through ropescale's C++ ops and knows
its attention factor (the number transformers multiplies cos and sin by). ``resonance=True``
rounds every wavelength of the method's table to an integer AFTER the method (Resonance RoPE,
Algorithm 1; Resonance-YaRN rounds the YaRN table), and leaves the attention factor unchanged.

``from_hf`` reads transformers 5.x ``rope_parameters`` (and the legacy ``rope_scaling`` dict);
``to_hf`` writes one back. Resonance on top of a method is the rope type ``resonance_<type>``
(``resonance`` alone for plain RoPE), except LongRoPE, whose per-pair factors can hold the rounded
table exactly: ``to_hf`` writes Resonance-LongRoPE as a plain ``longrope`` with those factors.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from . import ops

__all__ = [
    "RopeScaling",
    "Default",
    "Linear",
    "NTK",
    "DynamicNTK",
    "YaRN",
    "DynamicYaRN",
    "Llama3",
    "LongRoPE",
    "from_hf",
    "METHODS",
]


# Every method checks its fields when it is built (``__post_init__``), with the bounds the C++ table
# ops enforce (csrc/frequencies.cpp), so ``hf.patch``, ``ropescale extend``, the CLI and ``from_hf``
# refuse a bad setting before anything is patched or written, never at the first forward.


def _fail(obj, name: str, expected: str) -> None:
    raise ValueError(f"{type(obj).__name__}: {name} must be {expected}, got {getattr(obj, name)!r}")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_float(obj, name: str, *, minimum: float | None = None, above: float | None = None,
                 optional: bool = False) -> None:
    """``obj.name`` is a finite real number, ``>= minimum`` / ``> above`` where given (None allowed when
    ``optional``)."""
    value = getattr(obj, name)
    if value is None and optional:
        return
    bounds = [f">= {minimum:g}"] if minimum is not None else []
    bounds += [f"> {above:g}"] if above is not None else []
    expected = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not _is_number(value) or not math.isfinite(value):
        _fail(obj, name, expected)
    if (minimum is not None and value < minimum) or (above is not None and value <= above):
        _fail(obj, name, expected)


def _check_int(obj, name: str, minimum: int, why: str = "") -> None:
    value = getattr(obj, name)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        _fail(obj, name, f"an integer >= {minimum}{why}")


def _check_bool(obj, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        _fail(obj, name, "True or False")


@dataclass(frozen=True)
class RopeScaling:
    """Base class: the unscaled table. Subclasses override ``_table`` and ``attention_factor_for``."""

    resonance: bool = False

    rope_type: ClassVar[str] = "default"
    #: True when the table depends on the current sequence length (needs a pre-RoPE KV cache).
    dynamic: ClassVar[bool] = False

    def __post_init__(self):
        _check_bool(self, "resonance")

    def inv_freq(
        self, dim: int, base: float, seq_len: int | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The ``dim // 2`` inverse frequencies for rotary dim ``dim`` and base ``base``. ``seq_len``
        (largest position + 1) matters only for dynamic methods and LongRoPE."""
        table = self._table(dim, base, seq_len, torch.float64)
        if self.resonance:
            table = ops.resonance_inv_freq(table)
        return table.to(dtype or torch.float32)

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin at the method's own scale (1 for most methods)."""
        return self.attention_factor_for(None)

    def attention_factor_for(self, seq_len: int | None) -> float:
        return 1.0

    def to_hf(self, base: float | None = None) -> dict[str, Any]:
        """A transformers ``rope_parameters`` dict for this method (``rope_theta`` when ``base`` is given)."""
        params: dict[str, Any] = {"rope_type": self._hf_type()}
        for f in dataclasses.fields(self):
            if f.name == "resonance":
                continue
            value = getattr(self, f.name)
            if value is not None:
                params[_HF_NAMES.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        if base is not None:
            params["rope_theta"] = float(base)
        return params

    def _hf_type(self) -> str:
        if not self.resonance:
            return self.rope_type
        return "resonance" if self.rope_type == "default" else RESONANCE_PREFIX + self.rope_type

    def _table(self, dim: int, base: float, seq_len: int | None, dtype: torch.dtype) -> torch.Tensor:
        return ops.default_inv_freq(dim, base, dtype=dtype)


@dataclass(frozen=True)
class Default(RopeScaling):
    """Plain RoPE (or Resonance RoPE with ``resonance=True``)."""


@dataclass(frozen=True)
class Linear(RopeScaling):
    """Position interpolation (Chen et al.): ``theta / factor``."""

    factor: float = 1.0
    rope_type: ClassVar[str] = "linear"

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)

    def _table(self, dim, base, seq_len, dtype):
        return ops.linear_inv_freq(dim, base, self.factor, dtype=dtype)


@dataclass(frozen=True)
class NTK(RopeScaling):
    """NTK-aware scaling (bloc97): the base raised to ``base * factor ** (dim / (dim - 2))``.
    transformers has no static NTK type; ``to_hf`` writes it as ropescale's own ``ntk``."""

    factor: float = 1.0
    rope_type: ClassVar[str] = "ntk"

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)

    def _table(self, dim, base, seq_len, dtype):
        return ops.ntk_inv_freq(dim, base, self.factor, dtype=dtype)


@dataclass(frozen=True)
class DynamicNTK(RopeScaling):
    """Dynamic NTK (emozilla): NTK whose factor grows with the length past
    ``original_max_position`` (transformers uses ``max_position_embeddings`` there)."""

    factor: float = 1.0
    original_max_position: int = 2048
    rope_type: ClassVar[str] = "dynamic"
    dynamic: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        _check_int(self, "original_max_position", 1)

    def _table(self, dim, base, seq_len, dtype):
        return ops.dynamic_ntk_inv_freq(
            dim, base, self.factor, self.original_max_position, seq_len or 0, dtype=dtype
        )

    def to_hf(self, base=None):
        params = super().to_hf(base)
        # transformers' dynamic rule reads config.max_position_embeddings, not a rope parameter.
        params.pop("original_max_position_embeddings")
        return params


@dataclass(frozen=True)
class YaRN(RopeScaling):
    """YaRN (Peng et al.): NTK-by-parts table and attention temperature ``0.1 ln(s) + 1``."""

    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    rope_type: ClassVar[str] = "yarn"

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        _check_int(self, "original_max_position", 1)
        _check_float(self, "beta_slow", above=0.0)
        _check_float(self, "beta_fast", above=self.beta_slow)
        _check_bool(self, "truncate")
        _check_float(self, "mscale", optional=True)
        _check_float(self, "mscale_all_dim", optional=True)
        _check_float(self, "attention_factor_override", above=0.0, optional=True)

    def _scale(self, seq_len: int | None) -> float:
        return self.factor

    def _table(self, dim, base, seq_len, dtype):
        return ops.yarn_inv_freq(
            dim, base, self._scale(seq_len), self.original_max_position,
            self.beta_fast, self.beta_slow, self.truncate, dtype=dtype,
        )

    def attention_factor_for(self, seq_len):
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        # The op applies transformers' rule: the mscale ratio only when both are non-zero.
        return ops.yarn_attention_factor(
            self._scale(seq_len), float(self.mscale or 0.0), float(self.mscale_all_dim or 0.0)
        )


@dataclass(frozen=True)
class DynamicYaRN(YaRN):
    """Dynamic YaRN: YaRN at scale ``s = max(factor, seq_len / original_max_position)``, recomputed as
    the sequence grows (``factor`` defaults to 1: plain RoPE until the original length is passed).
    ``factor`` is a FLOOR applied at every length (above 1, no length runs native), not the length the
    model may be served to: that one is written apart (``ropescale extend --max-length``)."""

    rope_type: ClassVar[str] = "dynamic_yarn"
    dynamic: ClassVar[bool] = True

    def _scale(self, seq_len):
        if seq_len is None:
            return self.factor
        return max(self.factor, seq_len / self.original_max_position)


@dataclass(frozen=True)
class Llama3(RopeScaling):
    """Llama 3.1's piecewise wavelength rule."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rope_type: ClassVar[str] = "llama3"

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        _check_float(self, "low_freq_factor", above=0.0)
        _check_float(self, "high_freq_factor", above=self.low_freq_factor)
        _check_int(self, "original_max_position", 1)

    def _table(self, dim, base, seq_len, dtype):
        return ops.llama3_inv_freq(
            dim, base, self.factor, self.low_freq_factor, self.high_freq_factor,
            self.original_max_position, dtype=dtype,
        )


@dataclass(frozen=True)
class LongRoPE(RopeScaling):
    """LongRoPE: per-pair short/long factors, long once ``seq_len > original_max_position``.
    ``factor`` (for the attention factor) defaults to ``max_position / original_max_position``."""

    short_factor: tuple[float, ...] = field(default_factory=tuple)
    long_factor: tuple[float, ...] = field(default_factory=tuple)
    original_max_position: int = 4096
    factor: float | None = None
    attention_factor_override: float | None = None
    rope_type: ClassVar[str] = "longrope"

    def __post_init__(self):
        super().__post_init__()
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            try:
                factors = tuple(value)
            except TypeError:
                factors = None
            if not factors or not all(_is_number(f) and math.isfinite(f) and f > 0 for f in factors):
                _fail(self, name, "a non-empty sequence of finite numbers > 0 (one per rotary pair)")
            object.__setattr__(self, name, tuple(float(f) for f in factors))  # hashable, compares equal
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"LongRoPE: short_factor and long_factor must have the same length (one per rotary "
                             f"pair), got {len(self.short_factor)} and {len(self.long_factor)}")
        # The attention factor divides by ln(original_max_position).
        _check_int(self, "original_max_position", 2, " (the attention factor divides by its log)")
        _check_float(self, "factor", above=0.0, optional=True)
        _check_float(self, "attention_factor_override", above=0.0, optional=True)

    def _table(self, dim, base, seq_len, dtype):
        return ops.longrope_inv_freq(
            dim, base, self.short_factor, self.long_factor, self.original_max_position, seq_len or 0, dtype=dtype
        )

    def attention_factor_for(self, seq_len):
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        return ops.longrope_attention_factor(self.factor or 1.0, self.original_max_position)

    def to_hf(self, base=None):
        """``factor`` is always written (1.0 when unset, as the attention factor uses it): without it
        transformers would derive one from ``max_position_embeddings``. With ``resonance=True`` the
        rounded short and long tables are written as the factors of a plain ``longrope`` (``theta_i /
        rounded_i``), which transformers and vLLM run natively; that needs ``base``."""
        params = super().to_hf(base)
        params["factor"] = float(self.factor or 1.0)
        if self.resonance:
            if base is None:
                raise ValueError("to_hf: Resonance LongRoPE is written as longrope factors, which needs base")
            dim = 2 * len(self.short_factor)
            plain = ops.default_inv_freq(dim, float(base), dtype=torch.float64)
            for name, seq_len in (("short_factor", None), ("long_factor", self.original_max_position + 1)):
                rounded = self.inv_freq(dim, float(base), seq_len=seq_len, dtype=torch.float64)
                params[name] = (plain / rounded).tolist()
            params["rope_type"] = "longrope"
        return params


# transformers' parameter names for ours.
_HF_NAMES = {
    "original_max_position": "original_max_position_embeddings",
    "attention_factor_override": "attention_factor",
}

METHODS: dict[str, type[RopeScaling]] = {
    "default": Default,
    "linear": Linear,
    "ntk": NTK,
    "dynamic": DynamicNTK,
    "yarn": YaRN,
    "dynamic_yarn": DynamicYaRN,
    "llama3": Llama3,
    "longrope": LongRoPE,
}

# Resonance on top of another method: ``resonance`` (plain RoPE) or ``resonance_<rope type>``.
RESONANCE_PREFIX = "resonance_"


# The keys ``from_hf`` reads for each rope type (besides ``rope_type``/``type``): (required, optional).
# ``original_max_position_embeddings`` is required by yarn/dynamic_yarn/longrope only where the
# caller gives no ``max_position_embeddings`` to stand in for it (transformers' standardisation).
_ORIGINAL = "original_max_position_embeddings"
_YARN_OPTIONAL = {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
HF_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "ntk": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "yarn": (frozenset({"factor"}), frozenset({_ORIGINAL, *_YARN_OPTIONAL})),
    "dynamic_yarn": (frozenset(), frozenset({"factor", _ORIGINAL, *_YARN_OPTIONAL})),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor", _ORIGINAL}), frozenset()),
    "longrope": (frozenset({"short_factor", "long_factor"}), frozenset({_ORIGINAL, "factor", "attention_factor"})),
}
# Keys every type may carry that are not scaling parameters: the caller passes base and rotary dim
# to inv_freq(); ``resonance: true`` is the same as the ``resonance_`` prefix.
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor", "resonance"})


def _number(value):
    """A real number as float (an integral one as int); anything else as given, for the method's own check."""
    if _is_number(value):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def _integer(value):
    """An integral number (4096 or 4096.0) as int; anything else as given, for the method's own check."""
    if _is_number(value) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return value


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
    rope_type = params.get("rope_type") or params.get("type") or "default"
    resonance = params.get("resonance", False)
    if rope_type == "resonance":
        rope_type, resonance = "default", True
    elif isinstance(rope_type, str) and rope_type.startswith(RESONANCE_PREFIX) \
            and rope_type[len(RESONANCE_PREFIX):] in METHODS:
        rope_type, resonance = rope_type[len(RESONANCE_PREFIX):], True
    if rope_type not in METHODS:
        raise ValueError(f"from_hf: unknown rope_type {rope_type!r}; ropescale knows {sorted(METHODS)}")
    required, optional = HF_KEYS[rope_type]
    known = required | optional | _COMMON_KEYS
    for key in sorted(set(params) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known - {"type"}), n=1)
        raise ValueError(
            f"from_hf: rope_type {rope_type!r} has no parameter {key!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; it reads {sorted(required | optional) or 'no parameters'}")
    missing = sorted(k for k in required if params.get(k) is None)
    if missing:
        raise ValueError(f"from_hf: rope_type {rope_type!r} needs {', '.join(missing)}")
    if not isinstance(resonance, bool):
        raise ValueError(f"from_hf: resonance must be true or false, got {resonance!r}")

    def original_length():
        value = params.get(_ORIGINAL)
        if value is None:
            value = max_position_embeddings
        if value is None:
            raise ValueError(f"from_hf: rope_type {rope_type!r} needs {_ORIGINAL} (or the config's "
                             "max_position_embeddings)")
        return _integer(value)

    def get(key, default=None):
        value = params.get(key)
        return default if value is None else _number(value)

    try:
        if rope_type == "default":
            return Default(resonance=resonance)
        if rope_type in ("linear", "ntk"):
            return METHODS[rope_type](factor=get("factor"), resonance=resonance)
        if rope_type == "dynamic":
            # transformers' dynamic rule reads the config's max_position_embeddings as the original length.
            if max_position_embeddings is None:
                raise ValueError("from_hf: rope_type 'dynamic' needs the config's max_position_embeddings")
            return DynamicNTK(factor=get("factor"), original_max_position=_integer(max_position_embeddings),
                              resonance=resonance)
        if rope_type in ("yarn", "dynamic_yarn"):
            return METHODS[rope_type](
                factor=get("factor", 1.0),
                original_max_position=original_length(),
                beta_fast=get("beta_fast", 32.0),
                beta_slow=get("beta_slow", 1.0),
                truncate=params.get("truncate", True),
                mscale=get("mscale"),
                mscale_all_dim=get("mscale_all_dim"),
                attention_factor_override=get("attention_factor"),
                resonance=resonance,
            )
        if rope_type == "llama3":
            return Llama3(
                factor=get("factor"),
                low_freq_factor=get("low_freq_factor"),
                high_freq_factor=get("high_freq_factor"),
                original_max_position=_integer(params[_ORIGINAL]),
                resonance=resonance,
            )
        # longrope
        original = original_length()
        factor = get("factor")
        if factor is None and max_position_embeddings is not None and _is_number(original) and original > 0:
            factor = max_position_embeddings / original
        return LongRoPE(
            short_factor=params["short_factor"],
            long_factor=params["long_factor"],
            original_max_position=original,
            factor=factor,
            attention_factor_override=get("attention_factor"),
            resonance=resonance,
        )
    except ValueError as err:
        message = str(err)
        if message.startswith("from_hf"):
            raise
        raise ValueError(f"from_hf: rope_type {rope_type!r}: {message}") from None
