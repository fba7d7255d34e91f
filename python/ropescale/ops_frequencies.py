"""The frequency-table ops (``torch.ops.ropescale.*_inv_freq`` and friends) and the research quantities, as typed
wrappers, with the Python fake kernels of the table ops (they take no tensor, so no Meta kernel can serve them).
Re-exported by :mod:`ropescale.ops`, their documented home."""

from __future__ import annotations

from typing import Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import _C  # noqa: F401  (loads the library that registers torch.ops.ropescale)

_ops = torch.ops.ropescale


# ---------------------------------------------------------------------------------------------
# Frequency tables: float32 CPU tensors of length dim // 2 unless ``dtype`` asks otherwise.


def default_inv_freq(dim: int, base: float, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``base ** (-2i/dim)`` for ``i < dim/2``: the unscaled RoPE table."""
    return _ops.default_inv_freq(dim, base, dtype=dtype)


def linear_inv_freq(dim: int, base: float, factor: float, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Position interpolation (Chen et al.): the default table divided by ``factor``."""
    return _ops.linear_inv_freq(dim, base, factor, dtype=dtype)


def proportional_inv_freq(
    head_dim: int, base: float, factor: float, partial_rotary_factor: float, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """transformers' ``proportional`` (Gemma 4): ``head_dim / 2`` entries whatever ``partial_rotary_factor``
    is, ``base ** (-2i / head_dim) / factor`` (the exponent over the FULL head dim) for the first
    ``floor(partial_rotary_factor * head_dim / 2)`` pairs and 0 (not rotated) for the rest."""
    return _ops.proportional_inv_freq(head_dim, base, factor, partial_rotary_factor, dtype=dtype)


def ntk_inv_freq(dim: int, base: float, factor: float, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """NTK-aware scaling: the default table at base ``base * factor ** (dim / (dim - 2))``."""
    return _ops.ntk_inv_freq(dim, base, factor, dtype=dtype)


def dynamic_ntk_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    seq_len: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dynamic NTK: NTK with the factor grown to ``seq_len``; the default table while
    ``seq_len <= original_max_position`` (transformers passes ``max_position_embeddings``)."""
    return _ops.dynamic_ntk_inv_freq(dim, base, factor, original_max_position, seq_len, dtype=dtype)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """YaRN's NTK-by-parts table: ``theta`` kept for pairs turning more than ``beta_fast`` times over
    the original context, ``theta / factor`` below ``beta_slow`` turns, a linear ramp between."""
    return _ops.yarn_inv_freq(dim, base, factor, original_max_position, beta_fast, beta_slow, truncate, dtype=dtype)


def yarn_log_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    extrapolation_factor: float = 1.0,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Grok's ``yarn_log`` (SGLang's ``models/grok.py``): YaRN's truncated ramp, the mask ``m_i = (1 - ramp_i) *
    extrapolation_factor``, and ``theta`` and ``theta / factor`` blended geometrically,
    ``exp(m_i ln(theta_i) + (1 - m_i) ln(theta_i / factor))``."""
    return _ops.yarn_log_inv_freq(dim, base, factor, original_max_position, beta_fast, beta_slow, extrapolation_factor,
                                  dtype=dtype)


def yarn_attention_factor(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's factor on cos and sin: ``0.1 * ln(factor) + 1``, or the DeepSeek
    ``mscale`` / ``mscale_all_dim`` ratio when both are non-zero (as transformers)."""
    return _ops.yarn_attention_factor(factor, mscale, mscale_all_dim)


def llama3_inv_freq(
    dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Llama 3.1's piecewise rule: long wavelengths divided by ``factor``, short ones kept, a smooth
    blend between ``L / low_freq_factor`` and ``L / high_freq_factor``."""
    return _ops.llama3_inv_freq(
        dim, base, factor, low_freq_factor, high_freq_factor, original_max_position, dtype=dtype
    )


def longrope_inv_freq(
    dim: int,
    base: float,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_max_position: int,
    seq_len: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """LongRoPE: ``theta_i / short_factor[i]``, or ``/ long_factor[i]`` once ``seq_len`` exceeds
    ``original_max_position``."""
    return _ops.longrope_inv_freq(
        dim, base, [float(f) for f in short_factor], [float(f) for f in long_factor],
        original_max_position, seq_len, dtype=dtype,
    )


def longrope_attention_factor(factor: float, original_max_position: int) -> float:
    """LongRoPE's factor on cos and sin: ``sqrt(1 + ln(factor) / ln(original_max_position))``."""
    return _ops.longrope_attention_factor(factor, original_max_position)


def resonance_inv_freq(inv_freq: torch.Tensor, original_max_position: int = 0) -> torch.Tensor:
    """Resonance RoPE: every wavelength ``2*pi/theta`` rounded to the nearest integer (the authors'
    code), or only those shorter than ``original_max_position`` when it is positive. Apply it after
    any other table (Resonance-YaRN rounds the YaRN table)."""
    return _ops.resonance_inv_freq(inv_freq, original_max_position)


# ---------------------------------------------------------------------------------------------
# Research quantities.


def similarity_decay(inv_freq: torch.Tensor, max_distance: int) -> torch.Tensor:
    """``B_m = sum_i cos(m * theta_i)`` for ``m = 0..max_distance`` (float64), Men et al."""
    return _ops.similarity_decay(inv_freq, max_distance)


def effective_context_length(inv_freq: torch.Tensor, max_distance: int) -> int:
    """Largest ``L <= max_distance`` with ``B_m >= 0`` for every ``m <= L`` (``max_distance`` when the
    curve never goes negative in range: a lower bound then)."""
    return _ops.effective_context_length(inv_freq, max_distance)


def base_lower_bound(context_length: int, dim: int) -> float:
    """Smallest base whose ``B_m`` stays ``>= 0`` over ``[0, context_length]`` (Men et al., Table 2).
    Found by a 0.1% geometric scan from base 2 and bisection in the first good step: the set of
    good bases is not an interval, so a plain bisection would be wrong."""
    return _ops.base_lower_bound(context_length, dim)


def feature_gap(inv_freq: torch.Tensor, train_length: int, test_length: int) -> torch.Tensor:
    """Resonance feature gap per pair (float64): the largest distance, over positions
    ``n in [train_length, test_length)``, from the rotated unit feature at ``n`` to the nearest one
    seen at a training position ``m < train_length``."""
    return _ops.feature_gap(inv_freq, train_length, test_length)


# ---------------------------------------------------------------------------------------------
# Fake kernels of the table ops. They take no tensor, so no Meta kernel can serve them: the fake
# runs the op itself outside the fake mode (a table of dim/2 doubles, microseconds), which both
# applies the op's own checks and gives the exact output length.


def _table_fake(op, *args, **kwargs) -> torch.Tensor:
    with unset_fake_temporarily():
        real = op(*args, **kwargs)
    return torch.empty(real.shape, dtype=real.dtype, device="cpu")


def _register_table_fake(name: str) -> None:
    op = getattr(_ops, name)
    torch.library.register_fake(f"ropescale::{name}")(lambda *args, **kwargs: _table_fake(op, *args, **kwargs))


# Every op that makes an inv_freq table from scalars (a new method's table op is one more name here).
TABLE_OPS = ("default_inv_freq", "linear_inv_freq", "proportional_inv_freq", "ntk_inv_freq", "dynamic_ntk_inv_freq",
             "yarn_inv_freq", "yarn_log_inv_freq", "llama3_inv_freq", "longrope_inv_freq")
for _name in TABLE_OPS:
    _register_table_fake(_name)
