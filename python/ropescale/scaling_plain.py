"""Plain RoPE and position interpolation: :class:`Default`, :class:`Linear`, :class:`Proportional` (registered on
import; :mod:`ropescale.scaling` is their public path)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import ops
from .scaling_checks import check_float, fail, is_number
from .scaling_registry import FACTOR_HELP, RopeScaling, parameter, register


@register("default", stock="plain", transformers_native=True, vllm_rotary_class="RotaryEmbedding",
          cli_names=("default", "resonance"))
@dataclass(frozen=True)
class Default(RopeScaling):
    """Plain RoPE (or Resonance RoPE with ``resonance=True``)."""


@register("linear", stock="same", transformers_native=True, vllm_rotary_class="LinearScalingRotaryEmbedding")
@dataclass(frozen=True)
class Linear(RopeScaling):
    """Position interpolation (Chen et al.): ``theta / factor``."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=FACTOR_HELP)

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "factor", minimum=1.0)

    def _table(self, dim, base, seq_len, dtype):
        return ops.linear_inv_freq(dim, base, self.factor, dtype=dtype)


# transformers' ``proportional`` (Gemma 4's full-attention layers): its table spans the whole head (head_dim_table),
# the pairs past partial_rotary_factor at frequency 0 (identity). Resonance on it is well defined: the op leaves a zero
# frequency (infinite wavelength) alone and rounds the rotated pairs' wavelengths, so resonance_proportional is kept.
@register("proportional", stock="same", transformers_native=True, head_dim_table=True)
@dataclass(frozen=True)
class Proportional(RopeScaling):
    """transformers' ``proportional`` (Gemma 4): on heads of ``d`` features, ``b^(-2i/d) / factor`` (the exponent over
    the FULL head dim) for the first ``floor(partial_rotary_factor * d / 2)`` pairs and 0 (not rotated) for the
    rest; ``d / 2`` entries whatever ``partial_rotary_factor`` is, so ``inv_freq`` takes the head dim as ``dim``
    (``rotary_dim_for``). ``partial_rotary_factor`` is a parameter of the method here, not the caller's rotary dim.
    Attention factor 1; ``partial_rotary_factor=1`` is ``linear``."""

    # transformers' init function reads ``factor`` but its validator does not list it (5.23 warns "Unrecognized keys"
    # and still uses it): a ropescale key, so the validators of ropescale's types (resonance_/rerope_proportional)
    # ignore it and ``to_hf`` writes it only when it scales (a Gemma 4 config, factor 1, is written as it was).
    factor: float = parameter(1.0, cli="--factor", help=FACTOR_HELP, ropescale_key=True)
    partial_rotary_factor: float = parameter(1.0)

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "factor", minimum=1.0)
        value = self.partial_rotary_factor
        if not is_number(value) or not math.isfinite(value) or not 0.0 < value <= 1.0:
            fail(self, "partial_rotary_factor", "a finite number > 0 and <= 1")

    def _table(self, dim, base, seq_len, dtype):
        return ops.proportional_inv_freq(dim, base, self.factor, self.partial_rotary_factor, dtype=dtype)

