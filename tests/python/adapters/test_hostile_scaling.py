"""Hostile settings for the scaling methods (issue 16.5, 16.12): every dataclass checks its fields when
it is built, with a message naming the class and the field, and ``from_hf`` refuses unknown keys (with
the close match for a typo) and missing required ones for every rope type. One table per check."""

import math

import pytest

from ropescale import scaling

INF, NAN = float("inf"), float("nan")
SHORT, LONG = (1.0, 1.1), (2.0, 3.0)


# (method class, fields, message): each row is one bad field on an otherwise valid method.
BAD_FIELDS = [
    (scaling.Default, {"resonance": 1}, "Default: resonance must be True or False, got 1"),
    (scaling.Linear, {"factor": 0.5}, "Linear: factor must be a finite number >= 1, got 0.5"),
    (scaling.Linear, {"factor": INF}, "Linear: factor must be a finite number >= 1, got inf"),
    (scaling.Linear, {"factor": "4"}, "Linear: factor must be a finite number >= 1, got '4'"),
    (scaling.Proportional, {"factor": 0.5}, "Proportional: factor must be a finite number >= 1, got 0.5"),
    (scaling.Proportional, {"partial_rotary_factor": 0.0},
     "Proportional: partial_rotary_factor must be a finite number > 0 and <= 1, got 0.0"),
    (scaling.Proportional, {"partial_rotary_factor": 1.5},
     "Proportional: partial_rotary_factor must be a finite number > 0 and <= 1, got 1.5"),
    (scaling.Proportional, {"partial_rotary_factor": NAN},
     "Proportional: partial_rotary_factor must be a finite number > 0 and <= 1, got nan"),
    (scaling.Proportional, {"partial_rotary_factor": "0.25"},
     "Proportional: partial_rotary_factor must be a finite number > 0 and <= 1, got '0.25'"),
    (scaling.NTK, {"factor": NAN}, "NTK: factor must be a finite number >= 1, got nan"),
    (scaling.NTKAlpha, {"alpha": 0.5}, "NTKAlpha: alpha must be a finite number >= 1, got 0.5"),
    (scaling.NTKAlpha, {"alpha": NAN}, "NTKAlpha: alpha must be a finite number >= 1, got nan"),
    (scaling.NTKAlpha, {"alpha": "1000"}, "NTKAlpha: alpha must be a finite number >= 1, got '1000'"),
    (scaling.DynamicNTK, {"factor": 0.0}, "DynamicNTK: factor must be a finite number >= 1, got 0.0"),
    (scaling.DynamicNTK, {"original_max_position": 0}, "DynamicNTK: original_max_position must be an integer >= 1, got 0"),
    (scaling.YaRN, {"factor": 0.5}, "YaRN: factor must be a finite number >= 1, got 0.5"),
    (scaling.YaRN, {"factor": 4.0, "original_max_position": 0}, "YaRN: original_max_position must be an integer >= 1"),
    (scaling.YaRN, {"factor": 4.0, "original_max_position": 4096.5}, "original_max_position must be an integer >= 1, got 4096.5"),
    (scaling.YaRN, {"factor": 4.0, "original_max_position": True}, "original_max_position must be an integer >= 1, got True"),
    (scaling.YaRN, {"factor": 4.0, "beta_slow": 0.0}, "YaRN: beta_slow must be a finite number > 0, got 0.0"),
    # issue 55: the relation and both values, not a bound the user never typed ("must be a finite number > 2")
    (scaling.YaRN, {"factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0},
     "YaRN: beta_fast (1) must be greater than beta_slow (2) (the ramp runs from pairs turning beta_slow times"),
    (scaling.YaRN, {"factor": 4.0, "beta_fast": 2.0, "beta_slow": 2.0},
     "YaRN: beta_fast (2) must be greater than beta_slow (2)"),
    (scaling.YaRN, {"factor": 4.0, "beta_fast": INF}, "YaRN: beta_fast must be a finite number, got inf"),
    (scaling.YaRN, {"factor": 4.0, "truncate": "no"}, "YaRN: truncate must be True or False, got 'no'"),
    (scaling.YaRN, {"factor": 4.0, "mscale": NAN}, "YaRN: mscale must be a finite number, got nan"),
    (scaling.YaRN, {"factor": 4.0, "attention_factor_override": 0.0},
     "YaRN: attention_factor_override must be a finite number > 0, got 0.0"),
    (scaling.DynamicYaRN, {"factor": 0.5}, "DynamicYaRN: factor must be a finite number >= 1, got 0.5"),
    (scaling.DynamicYaRN, {"original_max_position": -4}, "DynamicYaRN: original_max_position must be an integer >= 1"),
    (scaling.Llama3, {"factor": 0.9}, "Llama3: factor must be a finite number >= 1, got 0.9"),
    (scaling.Llama3, {"low_freq_factor": 0.0}, "Llama3: low_freq_factor must be a finite number > 0, got 0.0"),
    (scaling.Llama3, {"low_freq_factor": 4.0, "high_freq_factor": 2.0},
     "Llama3: high_freq_factor (2) must be greater than low_freq_factor (4) (the ramp runs from wavelengths"),
    (scaling.Llama3, {"original_max_position": 0}, "Llama3: original_max_position must be an integer >= 1, got 0"),
    (scaling.LongRoPE, {"short_factor": (), "long_factor": LONG}, "LongRoPE: short_factor must be a non-empty sequence"),
    (scaling.LongRoPE, {"short_factor": SHORT, "long_factor": (1.0, -2.0)}, "LongRoPE: long_factor must be a non-empty"),
    (scaling.LongRoPE, {"short_factor": SHORT, "long_factor": (1.0, NAN)}, "LongRoPE: long_factor must be a non-empty"),
    (scaling.LongRoPE, {"short_factor": 3.0, "long_factor": LONG}, "LongRoPE: short_factor must be a non-empty"),
    (scaling.LongRoPE, {"short_factor": SHORT, "long_factor": (2.0,)},
     "LongRoPE: short_factor and long_factor must have the same length .* got 2 and 1"),
    (scaling.LongRoPE, {"short_factor": SHORT, "long_factor": LONG, "original_max_position": 1},
     "LongRoPE: original_max_position must be an integer >= 2"),
    (scaling.LongRoPE, {"short_factor": SHORT, "long_factor": LONG, "factor": -1.0},
     "LongRoPE: factor must be a finite number > 0, got -1.0"),
]


@pytest.mark.parametrize("cls,fields,message", BAD_FIELDS, ids=[m.split(",")[0][:60] for _, _, m in BAD_FIELDS])
def test_methods_refuse_bad_fields_at_construction(cls, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       if ".*" not in message else message):
        cls(**fields)


def test_valid_methods_still_build_and_longrope_factors_become_tuples():
    assert scaling.DynamicYaRN(original_max_position=64).factor == 1.0
    method = scaling.LongRoPE(short_factor=[1, 1.5], long_factor=[2, 4], original_max_position=16)
    assert method.short_factor == (1.0, 1.5) and method.long_factor == (2.0, 4.0)
    assert hash(method) == hash(scaling.LongRoPE(short_factor=(1.0, 1.5), long_factor=(2.0, 4.0),
                                                 original_max_position=16))
    assert scaling.YaRN(factor=4, original_max_position=16).inv_freq(8, 1e4).shape == (4,)


# (rope_parameters, max_position_embeddings, message)
BAD_HF = [
    ({"rope_type": "yarn", "fator": 4, "original_max_position_embeddings": 16}, 64,
     "rope_type 'yarn' has no parameter 'fator' (did you mean 'factor'?)"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 16}, 64, "rope_type 'yarn' needs factor"),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16}, 64, "rope_type 'yarn' needs factor"),
    ({"rope_type": "yarn", "factor": 4.0}, None, "needs original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fats": 8}, 64,
     "has no parameter 'beta_fats' (did you mean 'beta_fast'?)"),
    ({"rope_type": "dynamic_yarn", "original_max_position_embeddings": 16, "scale": 2}, 64,
     "rope_type 'dynamic_yarn' has no parameter 'scale'"),
    ({"rope_type": "linear"}, 64, "rope_type 'linear' needs factor"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, 64, "rope_type 'linear' has no parameter 'low_freq_factor'"),
    ({"rope_type": "ntk", "factr": 2.0}, 64, "has no parameter 'factr' (did you mean 'factor'?)"),
    ({"rope_type": "dynamic"}, 64, "rope_type 'dynamic' needs factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, None, "rope_type 'dynamic' needs the config's max_position_embeddings"),
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}, 64,
     "rope_type 'dynamic' has no parameter 'original_max_position_embeddings'"),
    ({"rope_type": "ntk_alpha"}, 64, "rope_type 'ntk_alpha' needs alpha"),
    ({"rope_type": "dynamic", "alpha": 1000.0, "alpah": 2.0}, 64,
     "rope_type 'ntk_alpha' has no parameter 'alpah' (did you mean 'alpha'?)"),
    # HunYuan's factor beside alpha: no table reads it, vLLM multiplies its length by it (past its table)
    ({"rope_type": "dynamic", "alpha": 1000.0, "factor": 2.0}, 64,
     "rope_type 'ntk_alpha': NTKAlpha: factor beside alpha must be 1"),
    ({"rope_type": "dynamic", "alpha": 0.0}, 64, "NTKAlpha: alpha must be a finite number >= 1, got 0.0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 16}, 64,
     "rope_type 'llama3' needs high_freq_factor"),
    ({"rope_type": "longrope", "long_factor": [1.0]}, 64, "rope_type 'longrope' needs short_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "shortfactor": [1.0]}, 64,
     "did you mean 'short_factor'?"),
    ({"rope_type": "default", "factor": 2.0}, 64, "rope_type 'default' has no parameter 'factor'"),
    ({"rope_type": "proportional", "partial_rotary_fator": 0.25}, 64,
     "rope_type 'proportional' has no parameter 'partial_rotary_fator' (did you mean 'partial_rotary_factor'?)"),
    ({"rope_type": "resonance_proportional", "partial_rotary_factor": 2.0}, 64,
     "rope_type 'proportional': Proportional: partial_rotary_factor must be a finite number > 0 and <= 1, got 2.0"),
    ({"rope_type": "resonance_yarn", "factor": 0.5, "original_max_position_embeddings": 16}, 64,
     "rope_type 'yarn': YaRN: factor must be a finite number >= 1, got 0.5"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16.5}, 64,
     "YaRN: original_max_position must be an integer >= 1, got 16.5"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": "yes"}, 64,
     "YaRN: truncate must be True or False"),
    ({"rope_type": "linear", "factor": 2.0, "resonance": "yes"}, 64, "resonance must be true or false"),
]


@pytest.mark.parametrize("params,mpe,message", BAD_HF, ids=[m[:60] for _, _, m in BAD_HF])
def test_from_hf_refuses_unknown_missing_and_bad_keys(params, mpe, message):
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        scaling.from_hf(params, mpe)


def test_from_hf_accepts_what_transformers_writes():
    # transformers' standardised rope_parameters carry rope_theta and partial_rotary_factor; legacy
    # rope_scaling dicts say "type"; an integral float is an integer.
    method = scaling.from_hf({"rope_type": "yarn", "type": "yarn", "factor": 4, "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5, "original_max_position_embeddings": 16.0,
                              "beta_fast": None, "mscale": None}, 64)
    assert method == scaling.YaRN(factor=4.0, original_max_position=16)
    assert scaling.from_hf({"type": "dynamic", "factor": 2}, 32) == scaling.DynamicNTK(factor=2.0, original_max_position=32)
    assert scaling.from_hf({"rope_type": "dynamic_yarn"}, 32) == scaling.DynamicYaRN(original_max_position=32)
    # HunYuan's checkpoints: legacy "type", factor 1.0 and YaRN's keys beside alpha (read by no table): NTK-alpha
    assert scaling.from_hf({"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0}, 32) == scaling.NTKAlpha(alpha=1000.0)
    # Gemma 4's full-attention layers: partial_rotary_factor is proportional's own parameter, factor defaults to 1
    assert scaling.from_hf({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}) == \
        scaling.Proportional(factor=1.0, partial_rotary_factor=0.25)
    longrope = scaling.from_hf({"rope_type": "longrope", "short_factor": [1, 1], "long_factor": [2, 2],
                                "original_max_position_embeddings": 16}, 64)
    assert longrope.factor == 4.0 and math.isclose(longrope.attention_factor, math.sqrt(1 + math.log(4) / math.log(16)))
    for rope_type, (required, optional) in scaling.HF_KEYS.items():
        assert rope_type in scaling.METHODS and not required & optional


def test_a_config_with_mscale_alone_reads_as_transformers_reads_it_with_a_warning(monkeypatch):
    """transformers' ``_compute_yarn_parameters`` reads ``mscale`` only beside a non-zero ``mscale_all_dim`` (else
    the attention factor is ``0.1 ln s + 1`` whatever ``mscale`` is), and so does vLLM's YaRN. The command line
    refuses ``--mscale`` alone (test_extend, test_cli); a checkpoint may carry it, so ``from_hf`` reads it as
    transformers does and says once that it changes nothing (issue 55)."""
    monkeypatch.setattr(scaling, "_warned", set())
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707}
    with pytest.warns(UserWarning, match=r"rope_type 'yarn': mscale 0.707 without mscale_all_dim changes nothing: "
                                         r"transformers' YaRN reads mscale only beside mscale_all_dim"):
        method = scaling.from_hf(params)
    assert method.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1) == \
        scaling.YaRN(factor=4.0, original_max_position=16).attention_factor
    assert method.unread_mscale is not None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaling.from_hf(params)  # said once
        for pair in ({"mscale": 0.707, "mscale_all_dim": 1.0}, {"mscale_all_dim": 1.0}, {}):
            method = scaling.from_hf({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      **pair})
            assert method.unread_mscale is None
