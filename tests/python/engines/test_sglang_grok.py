"""Grok's tables (``scaling.YaRNLog``, ``scaling.ThetaScale``) against SGLang's own code, on the SGLang leg
(``scripts/test_sglang.sh``): SGLang 0.5.23's ``models/grok.py`` ``ScalingRotaryEmbedding._compute_inv_freq``, called
on the attributes it reads (the class's constructor builds a cos/sin cache and wants SGLang's server state), in
float32. The float64 re-derivation of the same source, to 1e-12, is ``tests/python/ops/test_frequencies_grok.py``;
here ropescale's float64 table must be SGLang's float32 one within float32's rounding of ``b^x``: about
``ln(b) x eps32`` relative (measured up to 1.3 of that)."""

import itertools
import math
import types
import warnings

import pytest
import torch

from support.sglang_testing import require_sglang

require_sglang()

from ropescale import scaling  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
GRID = list(itertools.product((8, 64, 128, 256), (10000, 500000, 208533496), (1.0, 4.0, 16.0, 64.0), (64, 8192),
                              ((32, 1), (8, 1)), (1.0, 0.5)))


def _sglangs(extra_method, dim, base, factor, original, beta_fast, beta_slow, extrapolation_factor):
    from sglang.srt.models.grok import ScalingRotaryEmbedding

    layer = types.SimpleNamespace(rotary_dim=dim, base=base, max_position_embeddings=original, beta_fast=beta_fast,
                                  beta_slow=beta_slow, extrapolation_factor=extrapolation_factor,
                                  extra_method=extra_method, scaling_factor=factor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # theta_scale's torch.tensor(tensor)
        return ScalingRotaryEmbedding._compute_inv_freq(layer, factor)


@pytest.mark.parametrize("dim,base,factor,original,betas,extrapolation", GRID)
def test_yarn_log_is_sglangs_own_grok_table(dim, base, factor, original, betas, extrapolation):
    own = _sglangs("yarn_log", dim, base, factor, original, *betas, extrapolation)
    method = scaling.YaRNLog(factor=factor, original_max_position=original, beta_fast=float(betas[0]),
                             beta_slow=float(betas[1]), extrapolation_factor=extrapolation)
    ours = method.inv_freq(dim, float(base), dtype=torch.float64)
    torch.testing.assert_close(own.double(), ours, rtol=2 * math.log(base) * EPS32, atol=0)


@pytest.mark.parametrize("dim,base,factor,original", sorted({case[:4] for case in GRID}))
def test_theta_scale_is_sglangs_own_grok_table(dim, base, factor, original):
    method = scaling.ThetaScale(factor=factor, original_max_position=original)
    try:
        own = _sglangs("theta_scale", dim, base, factor, original, 32, 1, 1.0)
    except OverflowError:  # SGLang's float ** overflows: ropescale refuses it by name
        with pytest.raises(ValueError, match="past a double's range"):
            method.inv_freq(dim, float(base))
        return
    ours = method.inv_freq(dim, float(base), dtype=torch.float64)
    torch.testing.assert_close(own.double(), ours, rtol=2 * max(1.0, math.log(method.scaled_base(base))) * EPS32,
                               atol=0)


def test_the_grok_config_reader_is_sglangs_get_rope_scaling():
    """``scaling.read_grok_config`` reads what SGLang's ``get_rope_scaling`` hands its ScalingRotaryEmbedding."""
    from sglang.srt.models.grok import get_rope_scaling

    config = types.SimpleNamespace(rope_type="yarn_log", original_max_position_embeddings=8192, scaling_factor=16.0,
                                   beta_fast=8, rope_theta=208533496.0, head_dim=128)
    sglang = get_rope_scaling(config)
    grok = scaling.read_grok_config(config)
    assert grok.method == scaling.YaRNLog(factor=sglang["scaling_factor"],
                                          original_max_position=sglang["max_position_embeddings"],
                                          beta_fast=float(sglang["beta_fast"]), beta_slow=float(sglang["beta_slow"]),
                                          extrapolation_factor=float(sglang["extrapolation_factor"]))
    own = _sglangs("yarn_log", 128, int(config.rope_theta), 16.0, 8192, 8, 1, 1.0)
    torch.testing.assert_close(own.double(), grok.method.inv_freq(grok.rotary_dim, grok.base, dtype=torch.float64),
                               rtol=2 * math.log(grok.base) * EPS32, atol=0)
