"""Checkpoints written by ropescale main at a77b43e still read exactly: the same logits, the same parsed method,
the same tables, the same vLLM classification.

The data (``tests/data/checkpoints/<case>/``, made once by ``make_checkpoints.py`` there: read it for how each
case was written) is a record of what users' saved checkpoints mean. Do not regenerate it to make this test pass:
a failure here means a checkpoint a user saved would now load as another model.

For every case: the directory is reloaded with plain transformers after ``import ropescale.hf``, patched with
``ropescale.hf.patch(model)`` (no arguments: what the config records), and run on the stored 40-token input
(the original length is 16); the logits must equal the stored ones to 1e-6 (fp32, one thread: today's code gives
an exact match). ``read_config``'s repr, its ``inv_freq`` at seq_len None/8/40 (float64, rtol 1e-12) and
attention factors must equal the stored ones, and so must what ``ropescale.vllm`` decides from the config at
engine start (read from the config-level code that imports without vLLM; cross-checked against the plugin's own
functions where vLLM is installed). The last tests plant wrong values to show each check can fail.
"""

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import ropescale.hf  # noqa: E402  (registers ropescale's rope types in transformers)
from ropescale import config as config_lib  # noqa: E402
from ropescale import serving  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data" / "checkpoints"
# Every case the data holds (a case missing from the folder fails, it is not skipped).
CASES = (
    "default", "resonance", "linear", "ntk", "dynamic_ntk", "yarn", "dynamic_yarn", "llama3", "longrope",
    "resonance_yarn", "resonance_longrope", "resonance_linear", "resonance_ntk", "resonance_dynamic_ntk",
    "resonance_dynamic_yarn", "resonance_llama3", "yarn_target_vllm", "resonance_yarn_target_vllm", "rerope",
    "leaky_rerope_logn_yarn", "rerope_ntk", "rerope_dynamic_yarn", "rerope_longrope", "yarn_mscale_patch",
    "thirdparty_yarn", "thirdparty_longrope", "thirdparty_dynamic", "legacy_ntk",
)
FILES = {"config.json", "generation_config.json", "model.safetensors", "expected.json", "expected.safetensors"}
LOGITS_TOL = dict(rtol=1e-6, atol=1e-6)
TABLE_TOL = dict(rtol=1e-12, atol=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as the data was made: the same reduction order."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def load(directory: Path, patch: bool = True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' key warnings; ReRoPE types warn until patched
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
    if patch:
        ropescale.hf.patch(model)
    return model


def stored(directory: Path) -> tuple[dict, torch.Tensor]:
    expected = json.loads((directory / "expected.json").read_text())
    return expected, load_file(str(directory / "expected.safetensors"))["logits"]


def logits_of(model, expected: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([expected["input_ids"]])).logits.float()


def engine_classification(config) -> dict:
    """What ``ropescale.vllm`` decides from a config at engine start (``rotary.get_rope``), through the serving
    core's functions the plugin calls (they import without vLLM): ``ropescale_rotary`` (the layer gets
    ropescale's rotary, not vLLM's: a ropescale rope type other than ``ntk``, or a method recorded in the
    entry), ``pre_rope`` (``needs_pre_rope`` of ``config.read(rope_parameters, max_position, entry,
    rotary_dim)``: consulted only for ropescale's rotary), the parsed flags, and ``max_model_len`` as vLLM derives it (``model_max_length`` or
    ``max_position_embeddings``, times ``factor`` where vLLM multiplies)."""
    params = config.rope_parameters
    entry = getattr(config, config_lib.CONFIG_KEY, None)
    rotary_dim = config_lib.rotary_dim_of(config)
    parsed = config_lib.read(params, config.max_position_embeddings, entry, rotary_dim)
    found = {
        "ropescale_rotary": serving.ropescale_rotary(params, entry),
        "pre_rope": serving.needs_pre_rope(parsed),
        "per_length": bool(parsed.per_length),
        "length_free": bool(parsed.length_free),
        "dynamic": bool(parsed.method.dynamic),
        "recorded": bool(parsed.recorded),
        "attention": parsed.attention,
        "max_model_len": config_lib.vllm_max_model_len(params, config.max_position_embeddings,
                                                       getattr(config, config_lib.SERVED_LENGTH_KEY, None)),
    }
    return found, parsed


# The checks, one function each, so the planted tests below show each of them failing.


def check_logits(model, expected: dict, want: torch.Tensor) -> float:
    got = logits_of(model, expected)
    diff = (got - want).abs().max().item()
    print(f"{expected['case']}: max |logit diff| {diff:.3e}")
    torch.testing.assert_close(got, want, **LOGITS_TOL,
                               msg=lambda m: f"{expected['case']}: logits moved (max |diff| {diff:.3e}): {m}")
    return diff


# Fields methods gained after a77b43e, at the default that keeps the old behaviour: an old checkpoint reads as
# the method it was, plus these (issue 29: the dynamic methods' ``per``, "step" being the only rule they had).
ADDED_AT_DEFAULT = (", per='step'",)


def as_read_then(parsed) -> str:
    """``read_config``'s answer as a77b43e's ``RopeConfig`` printed it. Its attention fields were ReRoPE's (window,
    leaky_k, logn_length); every attention's parameters are one mapping since issue 44 (``attentions``)."""
    method = repr(parsed.method)
    for added in ADDED_AT_DEFAULT:
        method = method.replace(added, "")
    rerope = dict(parsed.parameters) if parsed.attention == "rerope" else {}
    assert parsed.attention in ("sdpa", "rerope"), "a77b43e had no other attention"
    return (f"RopeConfig(method={method}, base={parsed.base!r}, attention={parsed.attention!r}, "
            f"window={rerope.get('window')!r}, leaky_k={float(rerope.get('leaky_k', 0.0))!r}, "
            f"logn_length={int(rerope.get('logn_length', 0))!r}, recorded={parsed.recorded!r})")


def check_parse(config, expected: dict):
    parsed = config_lib.read_config(config)
    assert as_read_then(parsed) == expected["read_config_repr"], f"{expected['case']}: read_config reads another method"
    assert config.rope_parameters.get("rope_type") == expected["rope_type"]
    return parsed


def check_tables(parsed, expected: dict) -> None:
    rotary_dim = expected["rotary_dim"]
    assert parsed.base == expected["base"]
    for key, values in expected["inv_freq"].items():
        seq_len = None if key == "none" else int(key)
        got = parsed.method.inv_freq(rotary_dim, parsed.base, seq_len=seq_len, dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(values, dtype=torch.float64), **TABLE_TOL,
                                   msg=lambda m: f"{expected['case']}: inv_freq(seq_len={seq_len}) moved: {m}")
        factor = parsed.method.attention_factor_for(seq_len)
        assert math.isclose(factor, expected["attention_factor"][key], rel_tol=1e-12, abs_tol=0.0), (
            f"{expected['case']}: attention factor at seq_len={seq_len}: {factor!r} != "
            f"{expected['attention_factor'][key]!r}")


# Decisions changed on purpose since a77b43e, per case: {field: the value now, and why}.
CHANGED_ON_PURPOSE = {
    # issue 45: vLLM 0.32 serves a stock `dynamic` config as plain RoPE up to max_position_embeddings and NaN past
    # it (`ropescale verify` found it); the plugin now serves the type as transformers does
    "thirdparty_dynamic": {"ropescale_rotary": True},
}


def check_engine(config, expected: dict) -> None:
    found, parsed = engine_classification(config)
    want = {**expected["vllm"], **CHANGED_ON_PURPOSE.get(expected["case"], {})}
    assert found == want, f"{expected['case']}: vLLM would classify it otherwise"
    # the engine parses it as read_config does
    assert as_read_then(parsed) == expected["read_config_repr"], f"{expected['case']}: the engine's read differs"


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_written_at_a77b43e_reloads_exactly(case):
    directory = DATA / case
    expected, want = stored(directory)
    assert expected["case"] == case
    model = load(directory)
    check_logits(model, expected, want)
    parsed = check_parse(model.config, expected)
    check_tables(parsed, expected)
    check_engine(model.config, expected)


@pytest.mark.parametrize("case", [c for c in CASES if "rerope" not in c])
def test_without_the_patch_transformers_runs_the_same_table(case):
    """After ``import ropescale.hf`` alone (rope types registered, no patch), transformers' own rotary with
    ropescale's tables gives the saved model's logits to 1e-5 (docs/DESIGN.md, "Checkpoints": float32 angles, not
    the patch's double ones). ReRoPE checkpoints need the patch (unpatched they warn and attend with RoPE)."""
    directory = DATA / case
    expected, want = stored(directory)
    got = logits_of(load(directory, patch=False), expected)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_data_is_complete():
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(CASES)
    for case in CASES:
        assert {p.name for p in (DATA / case).iterdir()} == FILES, case
    assert (DATA / "make_checkpoints.py").is_file()
    # One set of weights for every case (ropescale extend hard-links them): the logits differ by the rope alone.
    weights = {(DATA / case / "model.safetensors").read_bytes() for case in CASES}
    assert len(weights) == 1


# Planted faults: each check must fail on a checkpoint or record that is not what was stored.


def edited_copy(tmp_path: Path, case: str, edit) -> Path:
    directory = tmp_path / case
    shutil.copytree(DATA / case, directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def test_planted_a_changed_factor_fails_every_check(tmp_path):
    def factor(config):  # YaRN 4 -> 4.5, kept consistent (entry and rope_parameters agree) so that it still loads
        config["rope_parameters"]["factor"] = 4.5
        config["ropescale"]["method"]["factor"] = 4.5
        config["max_position_embeddings"] = 72

    directory = edited_copy(tmp_path, "yarn", factor)
    expected, want = stored(directory)
    model = load(directory)
    with pytest.raises(AssertionError, match="logits moved"):
        check_logits(model, expected, want)
    with pytest.raises(AssertionError, match="read_config reads another method"):
        check_parse(model.config, expected)
    with pytest.raises(AssertionError, match="inv_freq"):
        check_tables(config_lib.read_config(model.config), expected)
    with pytest.raises(AssertionError, match="vLLM would classify it otherwise"):
        check_engine(model.config, expected)


def test_planted_a_changed_served_length_fails_the_engine_check_alone(tmp_path):
    def served(config):
        config["model_max_length"] = 128

    directory = edited_copy(tmp_path, "dynamic_yarn", served)
    expected, want = stored(directory)
    model = load(directory)
    check_logits(model, expected, want)
    check_tables(check_parse(model.config, expected), expected)
    with pytest.raises(AssertionError, match="vLLM would classify it otherwise"):
        check_engine(model.config, expected)


def test_planted_a_logit_a_few_ulps_off_and_an_attention_factor_off_are_caught(tmp_path):
    directory = DATA / "leaky_rerope_logn_yarn"
    expected, want = stored(directory)
    model = load(directory)
    off = want.clone()
    off[0, 39, 7] += 4e-6  # ~20 float32 ulps at this magnitude
    save_file({"logits": off}, str(tmp_path / "off.safetensors"))
    with pytest.raises(AssertionError, match="logits moved"):
        check_logits(model, expected, load_file(str(tmp_path / "off.safetensors"))["logits"])
    wrong = dict(expected, attention_factor={**expected["attention_factor"], "40": 1.0})
    with pytest.raises(AssertionError, match="attention factor at seq_len=40"):
        check_tables(config_lib.read_config(model.config), wrong)
