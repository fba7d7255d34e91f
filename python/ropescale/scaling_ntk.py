"""The NTK family: :class:`NTK`, HunYuan's :class:`NTKAlpha` (both NTK-aware tables at a scaled base) and
:class:`DynamicNTK` (registered on import; :mod:`ropescale.scaling` is their public path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from . import ops
from .scaling_checks import check_choice, check_float, check_int, is_number
from .scaling_registry import (FACTOR_HELP, FROM_CONFIG_LENGTH, ORIGINAL_HELP, PER_CHOICES, RopeScaling, parameter,
                               per_parameter, register)


class _NTKAware:
    """NTK-aware scaling's table, shared by :class:`NTK` (its ``factor``) and :class:`NTKAlpha` (HunYuan's
    ``alpha``): the default table at base ``b * s^(d/(d-2))`` (``ops.ntk_inv_freq``), written for stock engines as
    ``default`` with that base (the same table in every engine) and the method recorded in the entry."""

    _stretch: ClassVar[str]  # the field that is s

    def scaled_base(self, base: float, dim: int) -> float:
        """The base ``ops.ntk_inv_freq`` raises to (csrc/frequencies.cpp): ``b * s^(d/(d-2))``."""
        return float(base) * float(getattr(self, self._stretch)) ** (dim / (dim - 2))

    def stock_parameters(self, base, rotary_dim):
        if self.resonance:
            return super().stock_parameters(base, rotary_dim)
        return {"rope_type": "default", "rope_theta": self.scaled_base(base, rotary_dim)}, self.to_hf(base=base)

    def _table(self, dim, base, seq_len, dtype):
        return ops.ntk_inv_freq(dim, base, getattr(self, self._stretch), dtype=dtype)


# Stock engines serve it as ``default`` with the scaled base; vLLM's own ``ntk`` is another formula (base b*s,
# frequencies divided by s^(2/d)), which vLLM keeps.
@register("ntk", stock="same", vllm_owns_name=True)
@dataclass(frozen=True)
class NTK(_NTKAware, RopeScaling):
    """NTK-aware scaling (bloc97): the base raised to ``base * factor ** (dim / (dim - 2))``.
    transformers has no static NTK type: ropescale writes it as ``default`` with that base (the same
    table in every engine) and records the method; it reads its former ``ntk`` type too."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=FACTOR_HELP)
    _stretch: ClassVar[str] = "factor"

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "factor", minimum=1.0)


# HunYuan's NTK-alpha: its checkpoints label it ``dynamic`` with an ``alpha`` key, a fixed table (claims). Sources:
# transformers 5.23 models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py (``compute_ntk_alpha_rope_parameters``), vLLM
# 0.32 model_executor/layers/rotary_embedding/dynamic_ntk_alpha_rope.py (picked by get_rope for "dynamic" + "alpha").
# HunYuan's checkpoints carry YaRN's keys and factor 1.0 beside alpha, which neither reads (unread_keys).
@register("ntk_alpha", stock="same", claims=(("dynamic", "alpha"),), transformers_model_type=True,
          unread_keys=("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"))
@dataclass(frozen=True)
class NTKAlpha(_NTKAware, RopeScaling):
    """HunYuan's NTK-alpha: NTK-aware scaling with ``alpha`` for the factor, base ``b * alpha^(d/(d-2))``, attention
    factor 1, one table at every length. A config ``{"rope_type": "dynamic", "alpha": A}`` (HunYuan's checkpoints) reads
    as this method, not as Dynamic NTK (``claims``; transformers' HunYuan and vLLM read it so too). Written, like
    :class:`NTK`, as ``default`` with the scaled base (every engine's table, in every family; transformers reads
    ``dynamic`` + ``alpha`` in HunYuan's model only). ``alpha`` sets no length: the config's ``max_position_embeddings``
    is kept. HunYuan's ``factor`` (1.0 in its checkpoints) must be 1: no table reads it, but vLLM multiplies
    ``max_position_embeddings`` by it for a ``dynamic`` type (its table would end before the length vLLM allows)."""

    alpha: float = parameter(1.0, required=True, cli="--alpha",
                             help="HunYuan's NTK alpha: the base b x alpha^(d/(d-2)), at every length")
    _stretch: ClassVar[str] = "alpha"

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "alpha", minimum=1.0)

    @classmethod
    def read_hf(cls, params, max_position_embeddings):
        factor = params.get("factor")
        if factor is not None and (not is_number(factor) or factor != 1):
            raise ValueError(f"NTKAlpha: factor beside alpha must be 1 (no table reads it, and vLLM would derive a "
                             f"max_model_len of factor x max_position_embeddings, past its table), got {factor!r}")
        return super().read_hf(params, max_position_embeddings)



@register("dynamic", aliases=("dynamic_ntk",), written_type="dynamic_ntk", dynamic=True, transformers_native=True,
          cli_names=("dynamic", "dynamic_ntk"),
          vllm_stock_wrong="vLLM 0.32's DynamicNTKScalingRotaryEmbedding takes max_position_embeddings as both the "
                           "trained and the served length: plain RoPE up to it and a table that ends there (NaN past "
                           "it), while vLLM derives max_model_len = factor x max_position_embeddings")
@dataclass(frozen=True)
class DynamicNTK(RopeScaling):
    """Dynamic NTK (emozilla): NTK whose factor grows with the length past
    ``original_max_position`` (transformers uses ``max_position_embeddings`` there). Written as
    ``dynamic_ntk``: stock vLLM serves transformers' ``dynamic`` as plain RoPE with a table shorter than
    the length it allows (NaN logprobs past it, no error)."""

    factor: float = parameter(1.0, required=True, cli="--factor",
                              help="scale factor s in the base b*((s*len/L) - (s-1))^(d/(d-2)) past L, native up to L")
    # transformers' dynamic rule reads the config's max_position_embeddings, not a rope parameter.
    original_max_position: int = parameter(2048, hf=None, fallback=FROM_CONFIG_LENGTH, cli="--original-max-position",
                                           help=ORIGINAL_HELP)
    per: str = per_parameter()

    def __post_init__(self):
        super().__post_init__()
        check_float(self, "factor", minimum=1.0)
        check_int(self, "original_max_position", 1)
        check_choice(self, "per", PER_CHOICES)

    def _table(self, dim, base, seq_len, dtype):
        return ops.dynamic_ntk_inv_freq(
            dim, base, self.factor, self.original_max_position, seq_len or 0, dtype=dtype
        )
