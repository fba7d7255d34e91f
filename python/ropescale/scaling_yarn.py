"""The YaRN family: :class:`YaRN` and :class:`DynamicYaRN` (registered on import; :mod:`ropescale.scaling` is their
public path)."""

from __future__ import annotations

from dataclasses import dataclass

from . import ops
from .scaling_checks import check_bool, check_choice, check_float, check_greater, check_int
from .scaling_registry import (FROM_CONFIG_LENGTH, ORIGINAL_HELP, ORIGINAL_KEY, PER_CHOICES, RopeScaling, parameter,
                               per_parameter, register)


_YARN_FACTOR_HELP = "scale factor s: the table is set for s x L"



def check_ramp(method) -> None:
    """YaRN's ramp fields, shared with Grok's yarn_log: factor >= 1, the original length, beta_fast > beta_slow > 0."""
    check_float(method, "factor", minimum=1.0)
    check_int(method, "original_max_position", 1)
    check_float(method, "beta_slow", above=0.0)
    check_greater(method, "beta_fast", "beta_slow", "the ramp runs from pairs turning beta_slow times over the "
                  "original length, interpolated, to those turning beta_fast times, kept")


@register("yarn", stock="same", stock_length_is_scaled=True, transformers_native=True,
          vllm_rotary_class="YaRNScalingRotaryEmbedding", cli_names=("yarn", "resonance_yarn"))
@dataclass(frozen=True)
class YaRN(RopeScaling):
    """YaRN (Peng et al.): NTK-by-parts table and attention temperature ``0.1 ln(s) + 1``."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=_YARN_FACTOR_HELP)
    original_max_position: int = parameter(4096, hf=ORIGINAL_KEY, fallback=FROM_CONFIG_LENGTH,
                                           cli="--original-max-position", help=ORIGINAL_HELP)
    beta_fast: float = parameter(32.0, cli="--beta-fast", help="YaRN beta_fast")
    beta_slow: float = parameter(1.0, cli="--beta-slow", help="YaRN beta_slow")
    truncate: bool = parameter(True, cli="--truncate",
                               help="YaRN truncate: round the ramp's bounds to whole pairs (--no-truncate: keep them "
                                    "fractional, as gpt-oss does)")
    mscale: float | None = parameter(None, cli="--mscale",
                                     help="YaRN mscale m (DeepSeek): the attention factor is (0.1 m ln s + 1) / "
                                          "(0.1 m' ln s + 1), m' = --mscale-all-dim, when both are set (else 0.1 ln s "
                                          "+ 1)")
    mscale_all_dim: float | None = parameter(None, cli="--mscale-all-dim",
                                             help="YaRN mscale_all_dim m' (DeepSeek): the divisor of the attention "
                                                  "factor; DeepSeek's MLA also multiplies its softmax scale by "
                                                  "(0.1 m' ln s + 1)^2")
    attention_factor_override: float | None = parameter(
        None, hf="attention_factor", cli="--attention-factor",
        help="the attention factor on cos and sin, fixed, in place of YaRN's own rule of s (config key "
             "attention_factor)")

    def __post_init__(self):
        super().__post_init__()
        check_ramp(self)
        check_bool(self, "truncate")
        check_float(self, "mscale", optional=True)
        check_float(self, "mscale_all_dim", optional=True)
        check_float(self, "attention_factor_override", above=0.0, optional=True)

    @property
    def unread_mscale(self) -> str | None:
        """Why this method's ``mscale`` changes nothing, or None (not set, or it counts): transformers' YaRN
        (``_compute_yarn_parameters``) reads ``mscale`` only beside a non-zero ``mscale_all_dim``, taking
        ``0.1 ln s + 1`` whatever ``mscale`` alone is, and so does ropescale (``attention_factor_for``) and vLLM's YaRN
        rotary. The command line refuses it (a flag that does nothing); ``from_hf`` reads a config that carries it as
        transformers does, with a warning (checkpoints do)."""
        if not self.mscale or self.mscale_all_dim:
            return None
        return (f"mscale {self.mscale:g} without mscale_all_dim changes nothing: transformers' YaRN reads mscale only "
                "beside mscale_all_dim (the attention factor is then (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s "
                "+ 1)), else 0.1 ln s + 1 whatever mscale is, as vLLM's YaRN does (only vLLM's DeepSeek model reads "
                "mscale alone)")

    def _scale(self, seq_len: int | None) -> float:
        return self.factor

    def scale_at(self, seq_len):
        return self._scale(seq_len)

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


@register("dynamic_yarn", dynamic=True)
@dataclass(frozen=True)
class DynamicYaRN(YaRN):
    """Dynamic YaRN: YaRN at scale ``s = max(factor, seq_len / original_max_position)``, recomputed as
    the sequence grows (``factor`` defaults to 1: plain RoPE until the original length is passed).
    ``factor`` is a FLOOR applied at every length (above 1, no length runs native), not the length the
    model may be served to: that one is written apart (``ropescale extend --max-length``)."""

    factor: float = parameter(1.0, cli="--floor",
                              help="the floor F of its scale s = max(F, len/L), applied at EVERY length (requests "
                                   "shorter than F x L are then no longer native)")
    per: str = per_parameter()

    def __post_init__(self):
        super().__post_init__()
        check_choice(self, "per", PER_CHOICES)

    def _scale(self, seq_len):
        if seq_len is None:
            return self.factor
        return max(self.factor, seq_len / self.original_max_position)

