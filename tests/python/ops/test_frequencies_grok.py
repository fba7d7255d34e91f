"""Grok's two tables (``yarn_log``, ``theta_scale``) against a float64 re-derivation of their source, SGLang 0.5.23's
``python/sglang/srt/models/grok.py`` (``ScalingRotaryEmbedding._compute_inv_freq`` with its ``extra_method``, Grok's
``_yarn_linear_ramp_mask``, and ``yarn_find_correction_range`` of ``layers/rotary_embedding/yarn.py``), the op
``yarn_log_inv_freq`` (opcheck, dtypes, bad input), the methods' checks, rope_parameters and the Grok config reader
(``scaling.read_grok_config``: SGLang's ``get_rope_scaling`` over the top-level keys). SGLang itself lives in another
venv: its own class is compared in ``tests/python/engines/test_sglang_grok.py`` (the SGLang leg)."""

import itertools
import math
import random
import types

import pytest
import torch
from torch.library import opcheck

from ropescale import cli, config as config_lib, ops, scaling

R = torch.ops.ropescale
GROK_BASE = 208533496.0  # an integer base of Grok's size (SGLang passes int(rope_theta))


# ---------------------------------------------------------------------------------------------
# The layer reference: SGLang's _compute_inv_freq, re-derived in float64 (its code, line for line, in double)


def _correction_dim(rotations, dim, base, original):
    return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))


def ref_grok(extra_method, dim, base, factor, original, beta_fast=32, beta_slow=1, extrapolation_factor=1.0):
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    # yarn_find_correction_range, truncate=True (floor / ceil), clamped to [0, dim - 1]
    low = max(math.floor(_correction_dim(beta_fast, dim, base, original)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, original)), dim - 1)
    if low == high:  # Grok's own _yarn_linear_ramp_mask: low -= 0.001 (yarn.py's and transformers': high += 0.001)
        low -= 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = (1 - ramp) * extrapolation_factor
    if extra_method == "yarn_log":
        return torch.exp(torch.log(inv_freq_extrapolation) * mask + torch.log(inv_freq_interpolation) * (1.0 - mask))
    assert extra_method == "theta_scale"
    exponents = torch.arange(0, dim, 2, dtype=torch.float64)
    theta_scale_exponent = base ** (math.log(original * factor / (2 * math.pi)) / math.log(original / (2 * math.pi)))
    return 1.0 / (theta_scale_exponent ** (exponents / dim))


def ref_resonance(inv_freq):
    return 2 * math.pi / (2 * math.pi / inv_freq).round()


def _cases():
    rng = random.Random(57)
    grid = list(itertools.product((2, 4, 8, 64, 96, 128, 256), (1e4, 5e5, GROK_BASE), (1.0, 1.5, 8.0, 16.0, 64.0),
                                  (7, 64, 1000, 8192), ((32, 1), (8, 1), (64.0, 2.0), (1.5, 0.5)), (1.0, 0.5, 0.0)))
    cases = rng.sample(grid, 120)
    # edge cases: a ramp of one pair, the whole head kept or interpolated, Grok-2's scale, SGLang's defaults
    cases += [(128, GROK_BASE, 16.0, 8192, (8, 1), 1.0), (128, 1e4, 4.0, 4096, (32, 1), 1.0),
              (2, 1e4, 2.0, 4096, (32, 1), 1.0), (256, 1e6, 1.0, 4096, (32, 1), 0.3), (64, 1e4, 4.0, 10**7, (32, 1), 1),
              (64, 1.5, 4.0, 64, (32, 1), 1.0), (6, 1e4, 3.0, 20, (2, 1), 0.75)]
    return cases


CASES = _cases()
# yarn_log takes any L >= 1: lengths below 2 pi beta_slow clamp the range to [0, 0], where Grok's ramp differs
YARN_LOG_CASES = CASES + [(d, 1e4, 4.0, L, (32, 1), e) for d in (8, 64) for L in (1, 3, 6) for e in (1.0, 0.5)]


def _id(case):
    dim, base, factor, original, (fast, slow), extrapolation = case
    return f"d{dim}-b{base:g}-s{factor:g}-L{original}-bf{fast:g}-bs{slow:g}-e{extrapolation:g}"


def _compare(name, got, expected, case):
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0, msg=lambda m: f"{name} {_id(case)}: {m}")


@pytest.mark.parametrize("case", YARN_LOG_CASES, ids=_id)
def test_yarn_log_is_sglangs_grok_formula(case):
    dim, base, factor, original, (fast, slow), extrapolation = case
    method = scaling.YaRNLog(factor=factor, original_max_position=original, beta_fast=float(fast),
                             beta_slow=float(slow), extrapolation_factor=float(extrapolation))
    expected = ref_grok("yarn_log", dim, base, factor, original, fast, slow, extrapolation)
    for seq_len in (None, 1, original * 100):  # one table at every length
        _compare("yarn_log", method.inv_freq(dim, base, seq_len, dtype=torch.float64), expected, case)
    assert method.attention_factor_for(None) == method.attention_factor_for(10**6) == 1.0  # SGLang leaves mscale off
    resonance = scaling.from_hf({**method.to_hf(), "rope_type": "resonance_yarn_log"})
    torch.testing.assert_close(resonance.inv_freq(dim, base, dtype=torch.float64), ref_resonance(expected),
                               rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 2], ids=_id)
def test_theta_scale_is_sglangs_grok_formula(case):
    dim, base, factor, original, _, _ = case
    method = scaling.ThetaScale(factor=factor, original_max_position=original)
    exponent = math.log(original * factor / (2 * math.pi)) / math.log(original / (2 * math.pi))
    if math.log10(base) * exponent > 300:  # SGLang's own float ** raises OverflowError there
        with pytest.raises(ValueError, match="ThetaScale: the base .* is past a double's range"):
            method.inv_freq(dim, base)
        return
    expected = ref_grok("theta_scale", dim, base, factor, original)
    for seq_len in (None, original * 100):
        _compare("theta_scale", method.inv_freq(dim, base, seq_len, dtype=torch.float64), expected, case)
    assert method.attention_factor_for(None) == 1.0
    resonance = scaling.ThetaScale(factor=factor, original_max_position=original, resonance=True)
    torch.testing.assert_close(resonance.inv_freq(dim, base, dtype=torch.float64), ref_resonance(expected),
                               rtol=1e-12, atol=0)


def test_the_grids_cover_the_edges_and_grok_rounding_matters():
    """The grid reaches every region: a ramp clamped to [0, 0], where Grok's ramp widens downward (pair 0
    interpolated) and YaRN's upward (pair 0 kept), every extrapolation weight, a single pair."""
    grok = ref_grok("yarn_log", 8, 1e4, 4.0, 6)
    assert torch.allclose(grok, ref_grok("yarn_log", 8, 1e4, 1.0, 6) / 4.0, rtol=1e-12)  # every pair interpolated
    yarn = ops.yarn_inv_freq(8, 1e4, 4.0, 6, dtype=torch.float64)  # YaRN's own ramp there keeps pair 0
    assert yarn[0] == 1.0 and grok[0] == 0.25
    assert {c[5] for c in CASES} == {0.0, 0.3, 0.5, 0.75, 1.0} and min(c[0] for c in CASES) == 2


# ---------------------------------------------------------------------------------------------
# The op: opcheck, dtypes, bad input


@pytest.mark.parametrize("args,kwargs", [((64, 1e4, 8.0, 512), {}), ((128, GROK_BASE, 16.0, 8192, 8.0, 1.0, 0.5), {}),
                                         ((8, 1e4, 4.0, 6), {"dtype": torch.float64})])
def test_opcheck_yarn_log(args, kwargs):
    opcheck(R.yarn_log_inv_freq.default, args, kwargs)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32, torch.float64))
@pytest.mark.parametrize("dim", (2, 64, 130))
def test_yarn_log_dtypes_are_the_double_table_rounded(dtype, dim):
    double = ops.yarn_log_inv_freq(dim, 1e4, 8.0, 512, 16.0, 1.0, 0.75, dtype=torch.float64)
    got = ops.yarn_log_inv_freq(dim, 1e4, 8.0, 512, 16.0, 1.0, 0.75, dtype=dtype)
    assert got.dtype == dtype and got.shape == (dim // 2,) and torch.equal(got, double.to(dtype))
    assert ops.yarn_log_inv_freq(dim, 1e4, 8.0, 512).dtype == torch.float32


nan, inf = float("nan"), float("inf")
BAD_OP = [
    ((64, nan, 2.0, 128), "yarn_log_inv_freq: base must be > 1, got nan"),
    ((64, 1e4, nan, 128), "yarn_log_inv_freq: factor must be >= 1, got nan"),
    ((64, 1e4, inf, 128), "yarn_log_inv_freq: factor must be >= 1, got inf"),
    ((64, 1e4, 0.5, 128), "yarn_log_inv_freq: factor must be >= 1, got 0.5"),
    ((63, 1e4, 2.0, 128), "yarn_log_inv_freq: dim must be a positive even number, got 63"),
    ((64, 1e4, 2.0, 0), "yarn_log_inv_freq: original_max_position must be > 0, got 0"),
    ((64, 1e4, 2.0, 128, 1.0, 32.0), "yarn_log_inv_freq: beta_fast must be > beta_slow, got beta_fast=1, beta_slow=32"),
    ((64, 1e4, 2.0, 128, inf, 1.0), "yarn_log_inv_freq: beta_fast must be > beta_slow, got beta_fast=inf"),
    ((64, 1e4, 2.0, 128, nan, 1.0), "yarn_log_inv_freq: beta_fast must be > beta_slow, got beta_fast=nan"),
    ((64, 1e4, 2.0, 128, 32.0, 0.0), "yarn_log_inv_freq: beta_slow must be > 0, got 0"),
    ((64, 1e4, 2.0, 128, 32.0, nan), "yarn_log_inv_freq: beta_slow must be > 0, got nan"),
    ((64, 1e4, 2.0, 128, 32.0, 1.0, 1.5), "yarn_log_inv_freq: extrapolation_factor must be in [0, 1]"),
    ((64, 1e4, 2.0, 128, 32.0, 1.0, -0.1), "yarn_log_inv_freq: extrapolation_factor must be in [0, 1]"),
    ((64, 1e4, 2.0, 128, 32.0, 1.0, nan), "yarn_log_inv_freq: extrapolation_factor must be in [0, 1]"),
]


@pytest.mark.parametrize("args,message", BAD_OP, ids=[m for _, m in BAD_OP])
def test_yarn_log_op_refuses_bad_input_and_so_does_its_fake(args, message):
    pattern = message.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(RuntimeError, match=pattern):
        R.yarn_log_inv_freq(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode(), pytest.raises(RuntimeError, match=pattern):
        R.yarn_log_inv_freq(*args)


# ---------------------------------------------------------------------------------------------
# The methods: checks, rope_parameters, the written config, the command line


BAD_FIELDS = [
    (scaling.YaRNLog, {"factor": 0.5}, "YaRNLog: factor must be a finite number >= 1, got 0.5"),
    (scaling.YaRNLog, {"factor": nan}, "YaRNLog: factor must be a finite number >= 1, got nan"),
    (scaling.YaRNLog, {"beta_fast": 1.0, "beta_slow": 2.0},
     r"YaRNLog: beta_fast \(1\) must be greater than beta_slow \(2\)"),
    (scaling.YaRNLog, {"beta_slow": inf}, "YaRNLog: beta_slow must be a finite number > 0, got inf"),
    (scaling.YaRNLog, {"extrapolation_factor": 1.5}, r"YaRNLog: extrapolation_factor must be in \[0, 1\]"),
    (scaling.YaRNLog, {"extrapolation_factor": -0.5}, "YaRNLog: extrapolation_factor must be a finite number >= 0"),
    (scaling.YaRNLog, {"extrapolation_factor": nan}, "YaRNLog: extrapolation_factor must be a finite number"),
    (scaling.YaRNLog, {"original_max_position": 0}, "YaRNLog: original_max_position must be an integer >= 1"),
    (scaling.ThetaScale, {"factor": inf}, "ThetaScale: factor must be a finite number >= 1, got inf"),
    (scaling.ThetaScale, {"original_max_position": 6},
     r"ThetaScale: original_max_position must be an integer >= 7 \(ln\(L / 2 pi\) divides"),
    (scaling.ThetaScale, {"original_max_position": 4096.0}, "ThetaScale: original_max_position must be an integer"),
]


@pytest.mark.parametrize("cls,fields,message", BAD_FIELDS, ids=[m for _, _, m in BAD_FIELDS])
def test_bad_fields_are_refused_by_name(cls, fields, message):
    with pytest.raises(ValueError, match=message):
        cls(**{"factor": 4.0, **fields})


def test_rope_parameters_read_and_write_both_methods():
    params = {"rope_type": "yarn_log", "factor": 16, "original_max_position_embeddings": 8192, "beta_fast": 8,
              "beta_slow": 1, "extrapolation_factor": 0.5}
    method = scaling.from_hf(params)
    assert method == scaling.YaRNLog(factor=16.0, original_max_position=8192, beta_fast=8.0, extrapolation_factor=0.5)
    assert scaling.from_hf(method.to_hf(base=1e4)) == method
    assert scaling.from_hf({"rope_type": "yarn_log", "factor": 4}, 2048).original_max_position == 2048  # fallback
    with pytest.raises(ValueError, match="rope_type 'yarn_log' has no parameter 'extrapolation_facter' "
                                         r"\(did you mean 'extrapolation_factor'\?\)"):
        scaling.from_hf({**params, "extrapolation_facter": 0.5})
    with pytest.raises(ValueError, match="rope_type 'theta_scale' needs factor"):
        scaling.from_hf({"rope_type": "theta_scale", "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="from_hf: rope_type 'yarn_log': YaRNLog: extrapolation_factor"):
        scaling.from_hf({**params, "extrapolation_factor": 2.0})
    # theta_scale is written as every engine's default table at the changed base, the method recorded
    theta = scaling.ThetaScale(factor=16.0, original_max_position=8192)
    written = config_lib.write(theta, GROK_BASE, 128, 8192)
    assert written.rope_parameters == {"rope_type": "default", "rope_theta": theta.scaled_base(GROK_BASE)}
    assert written.max_position_embeddings == 8192 * 16
    read = config_lib.read(written.rope_parameters, written.max_position_embeddings, written.entry, 128)
    assert read.method == theta and read.base == GROK_BASE
    # yarn_log is a ropescale type (stock engines refuse it by name), vLLM's length L x s
    written = config_lib.write(method, 1e4, 128, 8192)
    assert written.rope_parameters["rope_type"] == "yarn_log" and written.entry is None
    assert config_lib.vllm_max_model_len(written.rope_parameters, written.max_position_embeddings) == 8192 * 16
    assert config_lib.read(written.rope_parameters, written.max_position_embeddings).method == method


def test_the_command_line_builds_both(capsys):
    import json

    assert cli.main(["table", "--method", "yarn_log", "--factor", "4", "--original-max-position", "64",
                     "--beta-fast", "8", "--extrapolation-factor", "0.5", "--dim", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = ref_grok("yarn_log", 16, 1e4, 4.0, 64, 8, 1, 0.5)
    assert [r["inv_freq"] for r in out["rows"]] == pytest.approx(expected.tolist(), rel=1e-6)
    assert out["attention_factor"] == 1.0
    assert cli.main(["table", "--method", "theta_scale", "--factor", "4", "--original-max-position", "64",
                     "--dim", "16", "--resonance", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = ref_resonance(ref_grok("theta_scale", 16, 1e4, 4.0, 64))
    assert [r["inv_freq"] for r in out["rows"]] == pytest.approx(expected.tolist(), rel=1e-6)
    # a value the method refuses: a usage error
    with pytest.raises(SystemExit) as exc:
        cli.main(["table", "--method", "yarn_log", "--factor", "4", "--extrapolation-factor", "2"])
    assert exc.value.code == 2 and "extrapolation_factor must be in [0, 1]" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# A Grok config's top-level keys (SGLang's get_rope_scaling)

GROK = {"rope_type": "yarn_log", "original_max_position_embeddings": 8192, "scaling_factor": 16.0,
        "extrapolation_factor": 1.0, "attn_factor": 1.0, "beta_fast": 8, "beta_slow": 1, "rope_theta": 208533496.7,
        "head_dim": 128, "max_position_embeddings": 131072, "num_attention_heads": 64, "hidden_size": 8192}


def test_read_grok_config_reads_the_top_level_keys_as_sglang():
    grok = scaling.read_grok_config(GROK)
    assert grok.method == scaling.YaRNLog(factor=16.0, original_max_position=8192, beta_fast=8.0)
    assert grok.base == 208533496.0 and grok.rotary_dim == 128  # int(rope_theta), as Grok1Attention passes it
    assert grok.cache_length == 131072 == torch.arange(8192 * 16.0, dtype=torch.float32).numel()
    torch.testing.assert_close(grok.method.inv_freq(grok.rotary_dim, grok.base, dtype=torch.float64),
                               ref_grok("yarn_log", 128, 208533496.0, 16.0, 8192, 8, 1), rtol=1e-12, atol=0)
    # SGLang's defaults: extrapolation_factor 1, beta_fast 32, beta_slow 1; a config object reads the same
    bare = {k: v for k, v in GROK.items() if k not in ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow")}
    assert scaling.read_grok_config(types.SimpleNamespace(**bare)).method == scaling.YaRNLog(
        factor=16.0, original_max_position=8192)
    theta = scaling.read_grok_config({**GROK, "rope_type": "theta_scale", "rope_rotate_half_dims": True})
    assert theta.method == scaling.ThetaScale(factor=16.0, original_max_position=8192) and theta.rotary_dim == 64
    original = scaling.read_grok_config({**GROK, "rope_type": "original", "scaling_factor": 1.5,
                                          "original_max_position_embeddings": 1001})
    assert original.method == scaling.Default() and original.cache_length == 1502  # ceil(1501.5)
    plain = scaling.read_grok_config({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert (plain.method, plain.base, plain.rotary_dim, plain.cache_length) == (scaling.Default(), 5e5, 128, None)


GROK_REFUSED = [
    ({"scaling_facter": 16.0},
     r"'scaling_facter' is not a key SGLang's Grok reads \(did you mean 'scaling_factor'\?\)"),
    ({"beta_fats": 16.0}, r"did you mean 'beta_fast'\?"),
    ({"scaling_factor": None}, "rope_type 'yarn_log' needs scaling_factor"),
    ({"original_max_position_embeddings": None, "scaling_factor": None},
     "needs original_max_position_embeddings and scaling_factor"),
    ({"rope_type": "yarn"}, "rope_type 'yarn' .* is not a registered method"),
    ({"rope_type": "yarn_linear"}, "rope_type 'yarn_linear' .* is not a registered method"),
    ({"rope_type": "longrope"}, "rope_type 'longrope' is not one SGLang's Grok knows"),
    ({"rope_type": ["yarn_log"]}, r"rope_type \['yarn_log'\] is not one SGLang's Grok knows"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling names rope_type 'yarn', which SGLang's Grok"),
    ({"attn_factor": "1"}, "attn_factor must be a finite number"),
    ({"extrapolation_factor": 1.5}, r"rope_type 'yarn_log': YaRNLog: extrapolation_factor must be in \[0, 1\]"),
    ({"beta_fast": 1, "beta_slow": 8}, "YaRNLog: beta_fast .* must be greater than beta_slow"),
    ({"scaling_factor": 0.5}, "YaRNLog: factor must be a finite number >= 1, got 0.5"),
    ({"scaling_factor": nan}, "YaRNLog: factor must be a finite number >= 1, got nan"),
    ({"original_max_position_embeddings": 8192.5}, "original_max_position must be an integer >= 1, got 8192.5"),
    ({"rope_type": "theta_scale", "original_max_position_embeddings": 6}, "ThetaScale: original_max_position must be"),
    ({"rope_type": "theta_scale", "scaling_factor": 1e300}, "ThetaScale: the base .* is past a double's range"),
    ({"rope_theta": nan}, "rope_theta must be a finite number > 1"),
    ({"rope_rotate_half_dims": "yes"}, "rope_rotate_half_dims must be true or false"),
]


@pytest.mark.parametrize("change,message", GROK_REFUSED, ids=[m[:60] for _, m in GROK_REFUSED])
def test_read_grok_config_refuses_what_it_cannot_represent(change, message):
    with pytest.raises(ValueError, match="read_grok_config: .*" + message):
        scaling.read_grok_config({**GROK, **change})
