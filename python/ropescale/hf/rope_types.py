"""ropescale's rope types in transformers: ``resonance``, ``resonance_yarn`` and ``dynamic_yarn``.

Registering them in ``ROPE_INIT_FUNCTIONS`` (and giving the config mixin a validator for each) lets a
config such as ``rope_parameters={"rope_type": "resonance_yarn", "factor": 8,
"original_max_position_embeddings": 4096}`` load and run in an unpatched transformers model. The
tables come from ropescale's ops, through ``ropescale.scaling.from_hf``.
"""

from __future__ import annotations

from transformers import modeling_rope_utils as rope_utils

from .. import scaling

ROPESCALE_ROPE_TYPES = ("resonance", "resonance_yarn", "dynamic_yarn")

_OPTIONAL_KEYS = {
    "resonance": {"rope_theta"},
    "resonance_yarn": {
        "rope_theta", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
        "mscale", "mscale_all_dim", "truncate",
    },
    "dynamic_yarn": {"rope_theta", "factor", "attention_factor", "beta_fast", "beta_slow", "truncate"},
}
_REQUIRED_KEYS = {
    "resonance": {"rope_type"},
    "resonance_yarn": {"rope_type", "factor"},
    "dynamic_yarn": {"rope_type", "original_max_position_embeddings"},
}


def rotary_dim_of(config, rope_parameters) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))


def _init_function(config, device=None, seq_len=None, layer_type=None):
    """A ``ROPE_INIT_FUNCTIONS`` entry: (inv_freq, attention_factor) from ropescale's ops."""
    config.standardize_rope_params()
    params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
    method = scaling.from_hf(params, config.max_position_embeddings)
    seq_len = None if seq_len is None else int(seq_len)
    inv_freq = method.inv_freq(rotary_dim_of(config, params), params["rope_theta"], seq_len=seq_len)
    return inv_freq.to(device), method.attention_factor_for(seq_len)


def _make_validator(rope_type: str):
    def validate(self, rope_parameters, ignore_keys=None):
        self._check_received_keys(
            rope_type, set(rope_parameters.keys()), set(_REQUIRED_KEYS[rope_type]),
            optional_keys=set(_OPTIONAL_KEYS[rope_type]), ignore_keys=ignore_keys,
        )
        # Build the method once: bad values get ropescale's own clear errors at load time.
        scaling.from_hf(rope_parameters, getattr(self, "max_position_embeddings", None))

    validate.__name__ = f"_validate_{rope_type}_rope_parameters"
    return validate


def register_rope_types() -> None:
    """Idempotent: adds the three rope types to transformers (done on ``import ropescale.hf``)."""
    for rope_type in ROPESCALE_ROPE_TYPES:
        rope_utils.ROPE_INIT_FUNCTIONS[rope_type] = _init_function
        setattr(rope_utils.RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters",
                _make_validator(rope_type))
