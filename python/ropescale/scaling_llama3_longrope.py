"""Llama 3.1's wavelength rule and LongRoPE's per-pair factors: :class:`Llama3`, :class:`LongRoPE` (registered on
import; :mod:`ropescale.scaling` is their public path)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import ops
from .scaling_checks import check_float, check_greater, check_int, fail, is_number
from .scaling_registry import (FACTOR_HELP, FROM_CONFIG_LENGTH, ORIGINAL_HELP, ORIGINAL_KEY, RopeScaling, parameter,
                               register)


@register("llama3", stock="same", stock_length_is_scaled=True, transformers_native=True,
          vllm_rotary_class="Llama3RotaryEmbedding")
@dataclass(frozen=True)
class Llama3(RopeScaling):
    """Llama 3.1's piecewise wavelength rule."""

    factor: float = parameter(8.0, required=True, cli="--factor", help=FACTOR_HELP)
    low_freq_factor: float = parameter(1.0, required=True)
    high_freq_factor: float = parameter(4.0, required=True)
    original_max_position: int = parameter(8192, hf=ORIGINAL_KEY, required=True, cli="--original-max-position",
                                           help=ORIGINAL_HELP)

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "factor", minimum=1.0)
        check_float(self, "low_freq_factor", above=0.0)
        check_greater(self, "high_freq_factor", "low_freq_factor", "the ramp runs from wavelengths L / "
                       "low_freq_factor, divided by factor, to L / high_freq_factor, kept")
        check_int(self, "original_max_position", 1)

    def _table(self, dim, base, seq_len, dtype):
        return ops.llama3_inv_freq(
            dim, base, self.factor, self.low_freq_factor, self.high_freq_factor,
            self.original_max_position, dtype=dtype,
        )


# Resonance on it is written as a plain longrope whose factors hold the rounded table (resonance_type=False).
@register("longrope", stock="same", stock_length_is_scaled=True, transformers_native=True,
          resonance_type=False)
@dataclass(frozen=True)
class LongRoPE(RopeScaling):
    """LongRoPE: per-pair short/long factors, long once ``seq_len > original_max_position``.
    ``factor`` (for the attention factor) defaults to ``max_position / original_max_position``."""

    short_factor: tuple[float, ...] = parameter(required=True, factory=tuple, cli="--longrope-factors",
                                                help="per-pair factors up to L")
    long_factor: tuple[float, ...] = parameter(required=True, factory=tuple, cli="--longrope-factors",
                                               help="per-pair factors past L")
    original_max_position: int = parameter(4096, hf=ORIGINAL_KEY, fallback=FROM_CONFIG_LENGTH,
                                           cli="--original-max-position", help=ORIGINAL_HELP)
    factor: float | None = parameter(None, cli="--factor",
                                     help="the length scale s its long factors were searched for (the attention "
                                          "factor, and the length s x L it is served to)")
    attention_factor_override: float | None = parameter(
        None, hf="attention_factor", cli="--attention-factor",
        help="the attention factor on cos and sin, fixed, in place of LongRoPE's own rule of s and L (config key "
             "attention_factor)")

    def __post_init__(self):
        super().__post_init__()
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            try:
                factors = tuple(value)
            except TypeError:
                factors = None
            if not factors or not all(is_number(f) and math.isfinite(f) and f > 0 for f in factors):
                fail(self, name, "a non-empty sequence of finite numbers > 0 (one per rotary pair)")
            object.__setattr__(self, name, tuple(float(f) for f in factors))  # hashable, compares equal
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"LongRoPE: short_factor and long_factor must have the same length (one per rotary "
                             f"pair), got {len(self.short_factor)} and {len(self.long_factor)}")
        # The attention factor divides by ln(original_max_position).
        check_int(self, "original_max_position", 2, " (the attention factor divides by its log)")
        check_float(self, "factor", above=0.0, optional=True)
        check_float(self, "attention_factor_override", above=0.0, optional=True)

    @property
    def length_dependent(self) -> bool:
        return self.short_factor != self.long_factor

    @property
    def two_tables(self) -> bool:
        return self.short_factor != self.long_factor

    def long_table(self):
        return dataclasses.replace(self, short_factor=self.long_factor)

    def check_rotary_dim(self, dim):
        if len(self.short_factor) != dim // 2:
            raise ValueError(f"LongRoPE: {len(self.short_factor)} factors per list, but rotary dim {dim} has "
                             f"{dim // 2} pairs")

    @classmethod
    def read_hf(cls, params, max_position_embeddings):
        values = super().read_hf(params, max_position_embeddings)
        original = values.get("original_max_position")
        if values.get("factor") is None and max_position_embeddings is not None and is_number(original) \
                and original > 0:
            values["factor"] = max_position_embeddings / original
        return values

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
