"""Grok's two rope tables, as SGLang serves xAI's Grok: :class:`YaRNLog` (``yarn_log``) and :class:`ThetaScale`
(``theta_scale``), registered on import (:mod:`ropescale.scaling` is their public path), and :func:`read_grok_config`,
which reads a Grok config's TOP-LEVEL keys as SGLang's ``get_rope_scaling`` does.

Source: SGLang 0.5.23 (the PyPI wheel), ``python/sglang/srt/models/grok.py``: ``get_rope_scaling``,
``ScalingRotaryEmbedding._compute_inv_freq`` (its ``extra_method``) and ``_yarn_linear_ramp_mask``, with the correction
range of ``sglang/srt/layers/rotary_embedding/yarn.py`` (``yarn_find_correction_range``, truncated: floor and ceil).
SGLang computes YaRN's mscale ``(0.1 ln s + 1) * attn_factor`` but leaves it off cos and sin (commented out): the
attention factor is 1. Its cos/sin cache has ``original_max_position_embeddings * scaling_factor`` rows (``arange`` of
that float: its ceiling), never extended for Grok: the longest it serves (:attr:`GrokRope.cache_length`).
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from . import ops
from .scaling_checks import check_float, check_int, fail, is_number
from .scaling_plain import Default
from .scaling_registry import (FACTOR_HELP, FROM_CONFIG_LENGTH, ORIGINAL_HELP, ORIGINAL_KEY, RopeScaling, parameter,
                               register)
from .scaling_yarn import check_ramp

_TWO_PI = 2 * math.pi


@register("yarn_log")
@dataclass(frozen=True)
class YaRNLog(RopeScaling):
    """Grok's ``yarn_log``: YaRN's ramp (truncated correction range over ``beta_fast``/``beta_slow``), the mask
    ``m_i = (1 - ramp_i) * extrapolation_factor`` and the tables ``theta_i`` and ``theta_i / s`` blended
    geometrically, ``exp(m_i ln(theta_i) + (1 - m_i) ln(theta_i / s))`` (``ops.yarn_log_inv_freq``); attention factor
    1 (SGLang computes an mscale and does not apply it)."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=FACTOR_HELP)
    original_max_position: int = parameter(4096, hf=ORIGINAL_KEY, fallback=FROM_CONFIG_LENGTH,
                                           cli="--original-max-position", help=ORIGINAL_HELP)
    beta_fast: float = parameter(32.0, cli="--beta-fast", help="YaRN beta_fast")
    beta_slow: float = parameter(1.0, cli="--beta-slow", help="YaRN beta_slow")
    extrapolation_factor: float = parameter(
        1.0, cli="--extrapolation-factor",
        help="yarn_log: the weight e in [0, 1] of the original table in the kept pairs (the mask (1 - ramp) x e)")

    def __post_init__(self):
        super().__post_init__()
        check_ramp(self)
        check_float(self, "extrapolation_factor", minimum=0.0)
        if self.extrapolation_factor > 1:
            fail(self, "extrapolation_factor", "in [0, 1] (the weight of the original table in a geometric blend: "
                                               "past 1 the kept pairs would turn faster than the original ones)")

    def scale_at(self, seq_len):
        return self.factor

    def _table(self, dim, base, seq_len, dtype):
        return ops.yarn_log_inv_freq(dim, base, self.factor, self.original_max_position, self.beta_fast,
                                     self.beta_slow, self.extrapolation_factor, dtype=dtype)


# Written, like NTK, as ``default`` with the changed base (every engine's table) and the method in the entry.
@register("theta_scale", stock="same")
@dataclass(frozen=True)
class ThetaScale(RopeScaling):
    """Grok's ``theta_scale``: the default table at the base ``b^(ln(L s / 2 pi) / ln(L / 2 pi))`` (the wavelength
    ``L`` turns into ``L s``), attention factor 1. Written as ``default`` with that base, the method recorded."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=FACTOR_HELP)
    original_max_position: int = parameter(4096, hf=ORIGINAL_KEY, fallback=FROM_CONFIG_LENGTH,
                                           cli="--original-max-position", help=ORIGINAL_HELP)

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "factor", minimum=1.0)
        check_int(self, "original_max_position", 7, " (ln(L / 2 pi) divides the exponent: L must exceed 2 pi)")

    def scaled_base(self, base: float) -> float:
        """``base ** (ln(L s / 2 pi) / ln(L / 2 pi))``, in double as SGLang's Grok computes it."""
        length = self.original_max_position
        exponent = math.log(length * self.factor / _TWO_PI) / math.log(length / _TWO_PI)
        try:
            scaled = float(base) ** exponent
        except OverflowError:
            scaled = math.inf
        if not math.isfinite(scaled):
            raise ValueError(f"ThetaScale: the base {float(base):g}^{exponent:g} (factor {self.factor:g}, "
                             f"original_max_position {length}) is past a double's range")
        return scaled

    def scale_at(self, seq_len):
        return self.factor

    def stock_parameters(self, base, rotary_dim):
        if self.resonance:
            return super().stock_parameters(base, rotary_dim)
        return {"rope_type": "default", "rope_theta": self.scaled_base(base)}, self.to_hf(base=base)

    def _table(self, dim, base, seq_len, dtype):
        return ops.default_inv_freq(dim, self.scaled_base(base), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# A Grok config's top-level keys, read as SGLang 0.5.23's get_rope_scaling and Grok1Attention read them.

#: The keys ``get_rope_scaling`` reads beside ``rope_type``, with its defaults (None: it has none, and SGLang's
#: ScalingRotaryEmbedding fails without the value).
GROK_KEYS: dict[str, Any] = {"original_max_position_embeddings": None, "scaling_factor": None,
                             "extrapolation_factor": 1.0, "attn_factor": 1.0, "beta_fast": 32, "beta_slow": 1}
#: The other keys of Grok's rotary: its base (``rope_theta``, else ``rope_parameters["rope_theta"]``, else 10000,
#: truncated to an integer), head dim (default 128) and ``rope_rotate_half_dims`` (rotary dim ``head_dim // 2``).
GROK_ROTARY_KEYS = ("rope_type", "rope_theta", "head_dim", "rope_rotate_half_dims")
#: The ``extra_method`` values SGLang's Grok knows and ropescale's method for each (None: not representable).
GROK_TYPES: dict[str, type[RopeScaling] | None] = {"original": Default, "yarn_log": YaRNLog,
                                                   "theta_scale": ThetaScale, "yarn": None, "yarn_linear": None}


@dataclass(frozen=True)
class GrokRope:
    """What SGLang's Grok rotates with: the method, the base (``int(rope_theta)``, as ``Grok1Attention`` passes it),
    the rotary dim, and the rows of its cos/sin cache (``ceil(original_max_position_embeddings * scaling_factor)``;
    None for plain RoPE, whose cache ``get_rope`` sizes): a position at or past it is past SGLang's table."""

    method: RopeScaling
    base: float
    rotary_dim: int
    cache_length: int | None


def _value(config, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _keys(config) -> list[str]:
    if isinstance(config, Mapping):
        return [str(k) for k in config]
    return list(vars(config)) if hasattr(config, "__dict__") else []


def read_grok_config(config: Mapping[str, Any] | Any) -> GrokRope:
    """The rope of a Grok config (a ``config.json`` dict or a config object), read from its top-level keys as SGLang
    0.5.23's ``get_rope_scaling`` does: ``rope_type`` (absent or empty: plain RoPE; ``yarn_log``, ``theta_scale``,
    ``original`` = the unscaled table over a cache of ``L x s`` rows), ``original_max_position_embeddings`` (L),
    ``scaling_factor`` (s), ``extrapolation_factor``, ``beta_fast``, ``beta_slow`` (SGLang's defaults 1, 32, 1) and
    ``attn_factor`` (read into an mscale SGLang never applies: checked, read by no table). Refused with a ValueError:
    a key misspelled (a close match of one of these), L or s missing (SGLang has no default), SGLang's own ``yarn``
    / ``yarn_linear`` blend (no registered method: its ramp widens a degenerate range the other way and weighs the
    mask by ``extrapolation_factor``), a type SGLang does not know, a nested ``rope_parameters``/``rope_scaling``
    naming a scaled type (SGLang's Grok reads neither), and every value the method's own checks refuse."""
    known = set(GROK_KEYS) | set(GROK_ROTARY_KEYS)
    # keys of the model beside them (its length, a transformers-style rope dict): never a misspelling
    others = {"max_position_embeddings", "context_len", "rope_parameters", "rope_scaling"}
    for key in _keys(config):
        if key not in known | others:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            if close:
                raise ValueError(f"read_grok_config: {key!r} is not a key SGLang's Grok reads (did you mean "
                                 f"{close[0]!r}?); it reads {sorted(known)}")
    for nested in ("rope_parameters", "rope_scaling"):
        params = _value(config, nested)
        nested_type = (params.get("rope_type") or params.get("type")) if isinstance(params, Mapping) else None
        if nested_type not in (None, "default"):
            raise ValueError(f"read_grok_config: {nested} names rope_type {nested_type!r}, which SGLang's Grok never "
                             "reads (it reads the top-level keys only): move it there or remove it")
    rope_theta = _value(config, "rope_theta")
    if rope_theta is None:
        params = _value(config, "rope_parameters")
        rope_theta = params["rope_theta"] if params else 10000
    if not is_number(rope_theta) or not math.isfinite(rope_theta) or int(rope_theta) <= 1:
        raise ValueError(f"read_grok_config: rope_theta must be a finite number > 1, got {rope_theta!r}")
    base = float(int(rope_theta))
    head_dim = _value(config, "head_dim", 128)
    if not isinstance(head_dim, numbers.Integral) or isinstance(head_dim, bool) or head_dim < 2:
        raise ValueError(f"read_grok_config: head_dim must be an integer >= 2, got {head_dim!r}")
    half = _value(config, "rope_rotate_half_dims", False)
    if not isinstance(half, bool):
        raise ValueError(f"read_grok_config: rope_rotate_half_dims must be true or false, got {half!r}")
    rotary_dim = int(head_dim) // 2 if half else int(head_dim)
    rope_type = _value(config, "rope_type")
    if not rope_type:
        return GrokRope(Default(), base, rotary_dim, None)
    if not isinstance(rope_type, str) or rope_type not in GROK_TYPES:
        raise ValueError(f"read_grok_config: rope_type {rope_type!r} is not one SGLang's Grok knows (its "
                         f"ScalingRotaryEmbedding raises for it); it knows {sorted(GROK_TYPES)}")
    cls = GROK_TYPES[rope_type]
    if cls is None:
        raise ValueError(f"read_grok_config: rope_type {rope_type!r} (SGLang's Grok: theta and theta/s blended "
                         "linearly, the mask times extrapolation_factor, a degenerate ramp widened downward) is not "
                         "a registered method; ropescale reads yarn_log, theta_scale and original")
    values = {key: _value(config, key, default) for key, default in GROK_KEYS.items()}
    missing = [key for key in ("original_max_position_embeddings", "scaling_factor") if values[key] is None]
    if missing:
        raise ValueError(f"read_grok_config: rope_type {rope_type!r} needs {' and '.join(missing)} (SGLang's "
                         "get_rope_scaling has no default for it)")
    attn_factor = values["attn_factor"]
    if not is_number(attn_factor) or not math.isfinite(attn_factor):
        raise ValueError(f"read_grok_config: attn_factor must be a finite number (SGLang multiplies it into an "
                         f"mscale it does not apply), got {attn_factor!r}")
    original, factor = values["original_max_position_embeddings"], values["scaling_factor"]
    if is_number(original) and math.isfinite(original) and float(original).is_integer():
        original = int(original)
    fields = {"factor": factor, "original_max_position": original}
    if cls is YaRNLog:
        fields.update(beta_fast=values["beta_fast"], beta_slow=values["beta_slow"],
                      extrapolation_factor=values["extrapolation_factor"])
    try:
        method = cls(**fields) if cls is not Default else Default()
        if cls is Default:  # original: the plain table over a cache of L x s rows; YaRNLog checks L and s
            YaRNLog(**fields)
        if cls is ThetaScale:
            method.scaled_base(base)
    except ValueError as err:
        raise ValueError(f"read_grok_config: rope_type {rope_type!r}: {err}") from None
    return GrokRope(method, base, rotary_dim, math.ceil(original * factor))
