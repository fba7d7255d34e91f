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


@dataclass(frozen=True)
class RopeScaling:
    """Base class: the unscaled table. Subclasses override ``_table`` and ``attention_factor_for``."""

    resonance: bool = False

    rope_type: ClassVar[str] = "default"
    #: True when the table depends on the current sequence length (needs a pre-RoPE KV cache).
    dynamic: ClassVar[bool] = False

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

    def _table(self, dim, base, seq_len, dtype):
        return ops.linear_inv_freq(dim, base, self.factor, dtype=dtype)


@dataclass(frozen=True)
class NTK(RopeScaling):
    """NTK-aware scaling (bloc97): the base raised to ``base * factor ** (dim / (dim - 2))``.
    transformers has no static NTK type; ``to_hf`` writes it as ropescale's own ``ntk``."""

    factor: float = 1.0
    rope_type: ClassVar[str] = "ntk"

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
    the sequence grows (``factor`` defaults to 1: plain RoPE until the original length is passed)."""

    rope_type: ClassVar[str] = "dynamic_yarn"
    dynamic: ClassVar[bool] = True

    def _scale(self, seq_len):
        if seq_len is None:
            return max(self.factor, 1.0)
        return max(self.factor, 1.0, seq_len / self.original_max_position)


@dataclass(frozen=True)
class Llama3(RopeScaling):
    """Llama 3.1's piecewise wavelength rule."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rope_type: ClassVar[str] = "llama3"

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


def from_hf(
    rope_parameters: Mapping[str, Any] | None,
    max_position_embeddings: int | None = None,
) -> RopeScaling:
    """Build the scaling method from a transformers ``rope_parameters`` (5.x) or legacy
    ``rope_scaling`` dict. ``max_position_embeddings`` is the config's value: transformers' dynamic
    rule uses it as the original length, and YaRN/LongRoPE derive a missing ``factor`` from it."""
    if not rope_parameters:
        return Default()
    params = dict(rope_parameters)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    resonance = bool(params.pop("resonance", False))
    if rope_type == "resonance":
        rope_type, resonance = "default", True
    elif rope_type.startswith(RESONANCE_PREFIX) and rope_type[len(RESONANCE_PREFIX):] in METHODS:
        rope_type, resonance = rope_type[len(RESONANCE_PREFIX):], True
    if rope_type not in METHODS:
        raise ValueError(f"from_hf: unknown rope_type {rope_type!r}; ropescale knows {sorted(METHODS)}")
    # Not scaling parameters: the caller passes base and rotary dim to inv_freq().
    for key in ("rope_theta", "partial_rotary_factor"):
        params.pop(key, None)
    original = params.pop("original_max_position_embeddings", None)
    factor = params.pop("factor", None)
    attention = params.pop("attention_factor", None)

    def need(value, name):
        if value is None:
            raise ValueError(f"from_hf: rope_type {rope_type!r} needs {name}")
        return value

    cls = METHODS[rope_type]
    if rope_type == "default":
        out = Default(resonance=resonance)
    elif rope_type in ("linear", "ntk"):
        out = cls(factor=float(need(factor, "factor")), resonance=resonance)
    elif rope_type == "dynamic":
        out = DynamicNTK(
            factor=float(need(factor, "factor")),
            original_max_position=int(need(max_position_embeddings, "max_position_embeddings")),
            resonance=resonance,
        )
    elif rope_type in ("yarn", "dynamic_yarn"):
        original = int(need(original or max_position_embeddings, "original_max_position_embeddings"))
        if factor is None:
            factor = 1.0 if rope_type == "dynamic_yarn" else need(max_position_embeddings, "factor") / original
        out = cls(
            factor=float(factor),
            original_max_position=original,
            beta_fast=float(params.pop("beta_fast", None) or 32.0),
            beta_slow=float(params.pop("beta_slow", None) or 1.0),
            truncate=bool(params.pop("truncate", True)),
            mscale=params.pop("mscale", None),
            mscale_all_dim=params.pop("mscale_all_dim", None),
            attention_factor_override=attention,
            resonance=resonance,
        )
    elif rope_type == "llama3":
        out = Llama3(
            factor=float(need(factor, "factor")),
            low_freq_factor=float(need(params.pop("low_freq_factor", None), "low_freq_factor")),
            high_freq_factor=float(need(params.pop("high_freq_factor", None), "high_freq_factor")),
            original_max_position=int(need(original, "original_max_position_embeddings")),
            resonance=resonance,
        )
    else:  # longrope
        original = int(need(original or max_position_embeddings, "original_max_position_embeddings"))
        if factor is None and max_position_embeddings is not None:
            factor = max_position_embeddings / original
        out = LongRoPE(
            short_factor=tuple(float(f) for f in need(params.pop("short_factor", None), "short_factor")),
            long_factor=tuple(float(f) for f in need(params.pop("long_factor", None), "long_factor")),
            original_max_position=original,
            factor=None if factor is None else float(factor),
            attention_factor_override=attention,
            resonance=resonance,
        )
    return out

