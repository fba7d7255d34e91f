"""``ropescale extend`` rewrites only what it is asked to, and writes every attention ropescale has (issue 42).

Variant keys: where the method written is of the family of SRC's own, every field no flag gives is SRC's
(DeepSeek-V3's ``mscale``/``mscale_all_dim``, which reach MLA's softmax scale; gpt-oss's ``truncate: false``; Llama
3's frequency bounds; a dynamic method's floor and ``per``), the output lists them, each flag overrides, another
method keeps nothing, and a fixed ``attention_factor`` at another scale is refused naming the key. Hostile flag values
are refused before anything is written.

Attentions: ReRoPE (plain and leaky), Self-Extend and Dual Chunk Attention (with and without its temperature), over
SRC's own table or --method's, each reloading as ``hf.patch(model, attention=...)`` on the same weights (logits and the
written config)."""

import json
import math
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from ropescale import cli, config as config_lib, hf, scaling  # noqa: E402
from ropescale.tiny_models import VOCAB, build  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ORIGINAL = 16  # the tiny models' "pre-training" length (their max_position_embeddings is 64)
LENGTH = 40  # past every window below, and past DCA's every region (chunks of 8)
YARN_4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


def ids(length=LENGTH, seed=3):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def logits(model, length=LENGTH):
    with torch.no_grad():
        return model(ids(length)).logits


def source(tmp_path, family="Llama", rope_parameters=None, name="src"):
    """The family's tiny model with ``rope_parameters``, saved to ``tmp_path / name``: (path, model)."""
    model = build(family, rope_parameters)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path).eval()


def extend(capsys, src, dst, *options):
    """``ropescale extend SRC DST OPTIONS``: (the config.json written, what it printed)."""
    assert cli.main(["extend", str(src), str(dst), *map(str, options)]) == 0
    out = capsys.readouterr().out
    return json.loads((dst / "config.json").read_text()), out


def usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        cli.main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: ropescale extend" in err and "Traceback" not in err
    return err


def kept_line(out):
    return next((line for line in out.splitlines() if line.startswith("kept from SRC")), None)


# ---------------------------------------------------------------------------------------------
# What SRC's method has and no flag gives is kept

# family: (SRC's rope_parameters, the keys extend --method yarn --factor 8 keeps, the line that lists them)
VARIANTS = {
    # MLA's softmax scale reads mscale_all_dim and the factor (transformers' DeepseekV3Attention); m != m' so that the
    # cos/sin factor differs from 1 too.
    "DeepSeek-V3": ({**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0}, {"mscale": 0.707, "mscale_all_dim": 1.0},
                    "kept from SRC (a flag overrides each): mscale=0.707, mscale_all_dim=1"),
    # (L = 32: at L = 16 the tiny head's ramp bounds are whole pairs either way)
    "gpt-oss": ({**YARN_4, "original_max_position_embeddings": 32, "truncate": False}, {"truncate": False},
                "kept from SRC (a flag overrides each): truncate=False"),
}


@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_a_new_factor_keeps_the_variant_keys_and_reloads_as_the_model_transformers_builds_from_them(
        tmp_path, capsys, family):
    # issue 42.2: `extend --method yarn --factor 8` wrote DeepSeek-V3's YaRN without mscale/mscale_all_dim (MLA's
    # softmax scale and the cos/sin factor changed) and gpt-oss's with truncate true over false.
    rope, kept, line = VARIANTS[family]
    src, model = source(tmp_path, family, rope)
    written, out = extend(capsys, src, tmp_path / "dst", "--method", "yarn", "--factor", 8)
    assert kept_line(out) == line
    want = {**rope, "factor": 8.0}
    params = written["rope_parameters"]
    assert {key: params.get(key) for key in want} == want
    assert written["ropescale"]["method"] == params  # the vLLM plugin serves the same method
    reloaded = load(tmp_path / "dst")
    direct = build(family, want)  # transformers' own model of the written keys, SRC's weights
    direct.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits(reloaded), logits(direct), atol=1e-6, rtol=0)
    # the kept keys matter: without them the model is another one
    dropped = build(family, {key: value for key, value in want.items() if key not in kept})
    dropped.load_state_dict(model.state_dict())
    assert not torch.allclose(logits(dropped), logits(direct), atol=1e-4, rtol=0)
    # ropescale reads the same method back (hf.patch(model) on the reload, the vLLM plugin)
    assert config_lib.read_config(reloaded.config).method == scaling.from_hf(want)
    # a flag overrides what would be kept
    options = {"DeepSeek-V3": ["--mscale", 1.0, "--mscale-all-dim", 0.5], "gpt-oss": ["--truncate"]}[family]
    written, out = extend(capsys, src, tmp_path / "flags", "--method", "yarn", "--factor", 8, *options)
    assert kept_line(out) is None
    overridden = {"DeepSeek-V3": {"mscale": 1.0, "mscale_all_dim": 0.5}, "gpt-oss": {"truncate": True}}[family]
    assert {key: written["rope_parameters"][key] for key in overridden} == overridden


def test_llama3_keeps_its_frequency_bounds(tmp_path, capsys):
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
            "original_max_position_embeddings": ORIGINAL}
    src, _ = source(tmp_path, "Llama", rope)
    written, out = extend(capsys, src, tmp_path / "dst", "--method", "llama3", "--factor", 8)
    assert kept_line(out) == "kept from SRC (a flag overrides each): low_freq_factor=2, high_freq_factor=8"
    assert written["rope_parameters"] == {**rope, "factor": 8.0, "rope_theta": 10000.0}
    # --dry-run: the config alone on stdout, what was kept on stderr
    assert cli.main(["extend", str(src), str(tmp_path / "dry"), "--method", "llama3", "--factor", "8",
                     "--dry-run"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["rope_parameters"] == written["rope_parameters"]
    assert kept_line(printed.err) == kept_line(out) and not (tmp_path / "dry").exists()


def test_yarn_flags_on_a_plain_model_and_nothing_kept_from_another_method(tmp_path, capsys):
    src, _ = source(tmp_path)
    written, out = extend(capsys, src, tmp_path / "d1", "--method", "yarn", "--factor", 4, "--no-truncate",
                          "--beta-fast", 16, "--beta-slow", 2, "--mscale", 0.5, "--mscale-all-dim", 0.25,
                          "--attention-factor", 1.1)
    assert kept_line(out) is None
    assert written["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "mscale": 0.5,
                                          "mscale_all_dim": 0.25, "attention_factor": 1.1, "rope_theta": 10000.0,
                                          # stock SGLang's key: its factor (0.05 ln 4 + 1) / (0.025 ln 4 + 1) times it
                                          "attn_factor": pytest.approx(1.1 * (0.025 * math.log(4.0) + 1.0)
                                                                       / (0.05 * math.log(4.0) + 1.0), rel=1e-12)}
    # Llama 3 over a DeepSeek-style YaRN: another method, nothing of SRC's
    src, _ = source(tmp_path, "Llama", {**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False,
                                        "beta_fast": 16.0}, name="yarn")
    written, out = extend(capsys, src, tmp_path / "d2", "--method", "llama3", "--factor", 8)
    assert kept_line(out) is None
    assert written["rope_parameters"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                          "rope_theta": 10000.0}


def test_dynamic_yarn_and_yarn_are_one_family_but_a_scale_is_never_a_floor(tmp_path, capsys):
    # YaRN's factor is its scale, Dynamic YaRN's the FLOOR of its scale (issue 27): the model's choices cross over,
    # the factor never does.
    src, _ = source(tmp_path, "Llama", {**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0})
    written, out = extend(capsys, src, tmp_path / "d1", "--method", "dynamic_yarn")
    assert kept_line(out) == "kept from SRC (a flag overrides each): mscale=0.707, mscale_all_dim=1"
    assert written["rope_parameters"]["rope_type"] == "dynamic_yarn" and written["rope_parameters"]["factor"] == 1.0
    # a Dynamic YaRN SRC keeps its floor and its per-request scale, unless a flag gives them
    src, _ = source(tmp_path, "Llama", {"rope_type": "dynamic_yarn", "factor": 2.0, "per": "request",
                                        "original_max_position_embeddings": ORIGINAL}, name="dyarn")
    written, out = extend(capsys, src, tmp_path / "d2", "--method", "dynamic_yarn", "--max-length", 256)
    assert kept_line(out) == "kept from SRC (a flag overrides each): factor=2, per=request"
    assert (written["rope_parameters"]["factor"], written["rope_parameters"]["per"]) == (2.0, "request")
    written, out = extend(capsys, src, tmp_path / "d3", "--method", "dynamic_yarn", "--floor", 1, "--per", "step")
    assert kept_line(out) is None and written["rope_parameters"]["factor"] == 1.0
    assert "per" not in written["rope_parameters"]  # ropescale's key at its default is not written


def test_a_fixed_attention_factor_is_kept_at_its_own_scale_and_refused_at_another(tmp_path, capsys):
    src, _ = source(tmp_path, "Llama", {**YARN_4, "attention_factor": 1.3})
    written, out = extend(capsys, src, tmp_path / "same", "--method", "yarn", "--factor", 4)
    assert kept_line(out) == "kept from SRC (a flag overrides each): attention_factor=1.3"
    assert written["rope_parameters"]["attention_factor"] == 1.3
    own_rule = scaling.YaRN(factor=8.0, original_max_position=ORIGINAL).attention_factor  # 0.1 ln 8 + 1
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "yarn", "--factor", 8)
    assert (f"attention_factor: SRC's yarn fixes it at 1.3, set for its factor 4; yarn's own rule gives {own_rule:g} "
            "at factor 8. Keeping 1.3 would keep SRC's temperature on the new table: give --attention-factor auto for "
            f"that rule, or --attention-factor A to fix one (e.g. {own_rule:g})") in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "dynamic_yarn")
    assert "attention_factor: SRC's yarn fixes it at 1.3" in err
    assert "dynamic_yarn's own rule follows each length" in err
    assert not (tmp_path / "d").exists()
    written, out = extend(capsys, src, tmp_path / "auto", "--method", "yarn", "--factor", 8, "--attention-factor",
                          "auto")
    assert kept_line(out) is None and "attention_factor" not in written["rope_parameters"]
    assert scaling.from_hf(written["rope_parameters"]).attention_factor == pytest.approx(own_rule)
    written, _ = extend(capsys, src, tmp_path / "fixed", "--method", "yarn", "--factor", 8, "--attention-factor", 1.25)
    assert written["rope_parameters"]["attention_factor"] == 1.25


def test_a_kept_value_the_new_flags_contradict_is_named(tmp_path, capsys):
    src, _ = source(tmp_path, "Llama", {**YARN_4, "beta_fast": 8.0, "beta_slow": 2.0})
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "yarn", "--factor", 8, "--beta-slow", 10)
    assert "YaRN: beta_fast (8) must be greater than beta_slow (10) (the ramp runs from" in err
    assert "with SRC's beta_fast=8 kept" in err
    assert not (tmp_path / "d").exists()


# Hostile values of the variant flags (and the options they go with): refused before anything is written.
HOSTILE = [
    (["--mscale", "nan"], "argument --mscale: must be a finite number > 0, got nan"),
    (["--mscale", "inf"], "argument --mscale: must be a finite number > 0, got inf"),
    (["--mscale", "-1"], "argument --mscale: must be a finite number > 0, got -1"),
    (["--mscale", "0"], "argument --mscale: must be a finite number > 0, got 0 (transformers reads 0 as not set"),
    (["--mscale", "x"], "argument --mscale: expected a number, got 'x'"),
    (["--mscale-all-dim=-inf"], "argument --mscale-all-dim: must be a finite number > 0, got -inf"),
    (["--mscale-all-dim", "0"], "argument --mscale-all-dim: must be a finite number > 0, got 0"),
    (["--attention-factor", "0"], "argument --attention-factor: must be a finite number > 0, or auto"),
    (["--attention-factor", "nan"], "argument --attention-factor: must be a finite number > 0, or auto"),
    (["--attention-factor", "-1.5"], "argument --attention-factor: must be a finite number > 0, or auto"),
    (["--attention-factor", "Auto"], "argument --attention-factor: must be a finite number > 0, or auto (the method's "
                                     "own rule), got 'Auto'"),
    (["--beta-fast", "nan"], "YaRN: beta_fast must be a finite number, got nan"),
    # issue 55: the relation, not a bound the user never typed ("beta_fast must be a finite number > 2, got 1.0")
    (["--beta-fast", "1", "--beta-slow", "2"], "YaRN: beta_fast (1) must be greater than beta_slow (2)"),
    # issue 55: transformers reads mscale only beside mscale_all_dim: alone it was written and changed nothing
    (["--mscale", "0.707"], "--mscale: mscale 0.707 without mscale_all_dim changes nothing: transformers' YaRN reads "
                            "mscale only beside mscale_all_dim"),
    (["--mscale", "0.707", "--attention-factor", "1.2"], "--mscale: mscale 0.707 without mscale_all_dim changes "
                                                         "nothing"),
    (["--beta-slow", "inf"], "YaRN: beta_slow must be a finite number > 0, got inf"),
    (["--beta-slow", "-1"], "YaRN: beta_slow must be a finite number > 0, got -1.0"),
    (["--beta-slow", "0"], "YaRN: beta_slow must be a finite number > 0, got 0.0"),
    (["--truncate=no"], "argument --truncate/--no-truncate: ignored explicit argument 'no'"),
    # a flag of a method --method is not
    (["--method", "llama3", "--mscale", "1"], "--mscale belongs to --method dynamic_yarn, yarn: --method llama3 has "
                                              "none"),
    (["--method", "linear", "--no-truncate"], "--truncate belongs to --method dynamic_yarn, yarn: --method linear has "
                                              "none"),
    (["--method", "ntk", "--attention-factor", "1.2"], "--attention-factor belongs to --method dynamic_yarn, longrope, "
                                                       "yarn: --method ntk has none"),
    (["--method", "llama3", "--beta-fast", "16"], "--beta-fast belongs to --method dynamic_yarn, yarn"),
]


@pytest.mark.parametrize("options, message", HOSTILE, ids=[" ".join(o) for o, _ in HOSTILE])
def test_hostile_variant_flags_are_refused_before_anything_is_written(tmp_path, capsys, options, message):
    src, _ = source(tmp_path)
    method = [] if "--method" in options else ["--method", "yarn"]
    err = usage_error(capsys, "extend", src, tmp_path / "dst", *method, "--factor", "4", *options)
    assert message in err
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------------------------------------
# Every attention, over SRC's own table or --method's

SE = dict(attention="self_extend", window=4, group=3)  # G does not divide W: the group boundary shows
DCA = dict(attention="dual_chunk", chunk_size=12, local_size=4)  # chunks of 8: every region by 17 tokens

# name: (options, the method hf.patch is given (None: the model's own table), hf.patch's attention arguments, the
# summary line: the vLLM plugin's startup line)
ATTENTIONS = {
    "rerope": (["--method", "rerope", "--window", 8], None, dict(attention="rerope", window=8),
               "ReRoPE window 8"),
    "leaky_logn_rerope": (["--attention", "rerope", "--window", 8, "--leaky-k", 4, "--logn", "--original-max-position",
                           ORIGINAL], None, dict(attention="rerope", window=8, leaky_k=4.0, logn_length=ORIGINAL),
                          "Leaky ReRoPE window 8, leaky_k 4, log-n past 16"),
    "self_extend": (["--attention", "self_extend", "--window", 4, "--group", 3], None, SE,
                    "Self-Extend window 4, group 3"),
    "dual_chunk": (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4], None, DCA,
                   "Dual Chunk Attention chunk_size 12, local_size 4, temperature none"),
    "dual_chunk_temperature": (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4,
                                "--temperature-length", 8], None, dict(DCA, original_max_position_embeddings=8),
                               "Dual Chunk Attention chunk_size 12, local_size 4, temperature qwen's at length 8"),
    # ChunkLlama's own rule: L0 the model's max_position_embeddings (64) unless given
    "dual_chunk_chunkllama": (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4, "--dca-temperature",
                               "chunkllama"], None, dict(DCA, temperature="chunkllama"),
                              "Dual Chunk Attention chunk_size 12, local_size 4, temperature chunkllama's at length "
                              "64"),
    "dual_chunk_chunkllama_length": (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4,
                                      "--dca-temperature", "chunkllama", "--temperature-length", 8], None,
                                     dict(DCA, temperature="chunkllama", original_max_position_embeddings=8),
                                     "Dual Chunk Attention chunk_size 12, local_size 4, temperature chunkllama's at "
                                     "length 8"),
    "string": (["--attention", "string", "--shifted-offset", 5, "--local-value", 2], None,
               dict(attention="string", shifted_offset=5, local_value=2),
               "STRING shifted_offset 5, local_value 2, attention factor 1.0693 on q and k"),
    # its authors' local value 128 by default, S where S is smaller
    "string_default_local_value": (["--attention", "string", "--shifted-offset", 200], None,
                                   dict(attention="string", shifted_offset=200),
                                   "STRING shifted_offset 200, local_value 128, attention factor 1.0693 on q "
                                   "and k"),
    "self_extend_over_yarn": (["--method", "yarn", "--factor", 4, "--original-max-position", ORIGINAL, "--attention",
                               "self_extend", "--window", 4, "--group", 3],
                              scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), SE,
                              "Self-Extend window 4, group 3"),
}
WRITTEN_KEYS = ("rope_parameters", "max_position_embeddings", "ropescale", "dual_chunk_attention_config",
                "model_max_length")


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_each_attention_reloads_as_hf_patch_on_the_same_weights(tmp_path, capsys, name):
    options, method, arguments, summary = ATTENTIONS[name]
    src, _ = source(tmp_path)
    written, out = extend(capsys, src, tmp_path / "dst", *options)
    assert f"  {summary} (import ropescale.hf" in out
    patched = hf.patch(load(src), method, **arguments)
    patched.save_pretrained(tmp_path / "patched")
    want = json.loads((tmp_path / "patched" / "config.json").read_text())
    for key in WRITTEN_KEYS:
        assert written.get(key) == want.get(key), key
    reloaded = hf.patch(load(tmp_path / "dst"))
    torch.testing.assert_close(logits(reloaded), logits(patched), atol=1e-6, rtol=0)
    # a raw-key attention: not the model's own attention past its window
    assert not torch.allclose(logits(reloaded), logits(load(src)), atol=1e-4, rtol=0)


def test_an_attention_is_served_to_max_length_and_keeps_srcs_variant_keys(tmp_path, capsys):
    # gpt-oss-style YaRN (truncate false): Self-Extend over a new factor keeps it; --max-length is the served length.
    src, _ = source(tmp_path, "Llama", {**YARN_4, "truncate": False})
    written, out = extend(capsys, src, tmp_path / "dst", "--method", "yarn", "--factor", 8, "--attention",
                          "self_extend", "--window", 4, "--group", 3, "--max-length", 1000)
    assert kept_line(out) == "kept from SRC (a flag overrides each): truncate=False"
    assert written["rope_parameters"]["rope_type"] == "self_extend_yarn"
    assert written["rope_parameters"]["truncate"] is False and written["ropescale"]["group"] == 3
    assert config_lib.vllm_max_model_len(written["rope_parameters"], written["max_position_embeddings"],
                                         written["model_max_length"]) == 1000
    # over SRC's own table (YaRN x4, truncate false): the attention alone changes
    written, _ = extend(capsys, src, tmp_path / "own", "--attention", "self_extend", "--window", 4, "--group", 3)
    assert written["rope_parameters"] == {**YARN_4, "truncate": False, "rope_type": "self_extend_yarn",
                                          "rope_theta": 10000.0}


ATTENTION_REFUSALS = [
    ([], "give --method M (a scaling method), --attention A (an attention over SRC's own table), or both"),
    (["--group", 2], "--group belongs to Self-Extend attention (--attention self_extend --window W --group G)"),
    (["--chunk-size", 12, "--local-size", 4], "--chunk-size belongs to Dual Chunk Attention (--attention dual_chunk "
                                              "--chunk-size C --local-size S [--temperature-length L0] "
                                              "[--dca-temperature {qwen,chunkllama}])"),
    (["--attention", "rerope"], "--attention rerope needs --window: --window W [--leaky-k K] [--logn]"),
    (["--attention", "self_extend", "--window", 4], "--attention self_extend needs --group: --window W --group G"),
    (["--attention", "dual_chunk", "--chunk-size", 12], "--attention dual_chunk needs --local-size"),
    (["--attention", "self_extend", "--window", 4, "--group", 2, "--leaky-k", 4],
     "--leaky-k belongs to ReRoPE attention (--attention rerope --window W [--leaky-k K] [--logn]), not to "
     "Self-Extend attention, which takes --window W --group G"),
    (["--attention", "self_extend", "--window", 4, "--group", 2, "--logn"], "--logn belongs to ReRoPE attention"),
    (["--window", 4, "--group", 2], "--group belongs to Self-Extend attention (--attention self_extend --window W "
                                    "--group G), not to ReRoPE attention"),
    (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4, "--window", 4],
     "--window belongs to ReRoPE attention (--attention rerope --window W [--leaky-k K] [--logn]) or Self-Extend "
     "attention (--attention self_extend --window W --group G), not to Dual Chunk Attention"),
    (["--attention", "rerope", "--window", 4, "--temperature-length", 16],
     "--temperature-length belongs to Dual Chunk Attention"),
    (["--attention", "dual_chunk", "--chunk-size", 4, "--local-size", 4],
     "--attention dual_chunk: attention='dual_chunk' needs local_size, an integer with 0 <= local_size < chunk_size "
     "(4), got 4"),
    (["--method", "rerope", "--attention", "self_extend", "--window", 4, "--group", 2],
     "--method rerope is ReRoPE attention over SRC's own table; for Self-Extend attention over it leave --method out"),
    (["--attention", "self_extend", "--window", 4, "--group", 2, "--factor", 2],
     "--attention self_extend without --method keeps SRC's own table: --factor belong to a table method "
     "(Self-Extend attention over one: --method M --attention self_extend)"),
    (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4, "--mscale", 1],
     "--attention dual_chunk without --method keeps SRC's own table: --mscale belong to a table method"),
    # DCA takes plain RoPE's table (config._check_dual_chunk_table)
    (["--method", "yarn", "--factor", 4, "--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4],
     "--attention dual_chunk: Dual Chunk Attention over a scaled table (YaRN)"),
    (["--attention", "self_extend", "--window", 4, "--group", 2, "--target", "vllm"],
     "Self-Extend attention needs ropescale's plugin: leave --target out"),
    (["--attention", "sliding", "--window", 4], "argument --attention: must be one of rerope, self_extend, dual_chunk, "
                                                "string, got 'sliding'"),
    (["--attention", "string"], "--attention string needs --shifted-offset: --shifted-offset S [--local-value W]"),
    (["--attention", "string", "--shifted-offset", 4, "--local-value", 5],
     "--attention string: attention='string' needs local_value (W: where the shifted distances start), an integer "
     "with 0 <= local_value <= shifted_offset"),
    # issue 55: W = S (the default W = min(128, S) for S <= 128) moves no distance: plain RoPE with STRING's factor
    (["--attention", "string", "--shifted-offset", 6],
     "--attention string: attention='string': local_value (6) equals shifted_offset (6), so no distance moves (d - S + "
     "W = d): that is plain RoPE attention with STRING's attention factor, not STRING (local_value defaults to "
     "min(128, shifted_offset)"),
    (["--attention", "string", "--shifted-offset", 200, "--local-value", 200, "--max-length", 1000],
     "local_value (200) equals shifted_offset (200), so no distance moves"),
    (["--attention", "string", "--shifted-offset", 4, "--window", 4],
     "--window belongs to ReRoPE attention (--attention rerope --window W [--leaky-k K] [--logn]) or Self-Extend"),
    (["--attention", "rerope", "--window", 4, "--local-value", 2], "--local-value belongs to STRING attention"),
    (["--attention", "string", "--shifted-offset", 4, "--local-value", 2, "--target", "vllm"],
     "STRING attention needs ropescale's plugin: leave --target out"),
    (["--attention", "rerope", "--window", 4, "--target", "sglang"],
     "--target sglang writes a table its stock engine serves with no plugin; ReRoPE attention needs ropescale's "
     "plugin: leave --target out"),
    (["--attention", "self_extend", "--window", 4, "--group", 0], "argument --group: must be > 0, got 0"),
    (["--attention", "dual_chunk", "--chunk-size", 0, "--local-size", 0], "argument --chunk-size: must be > 0, got 0"),
    (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", -1], "argument --local-size: must be >= 0"),
    (["--attention", "dual_chunk", "--chunk-size", 12, "--local-size", 4, "--temperature-length", "x"],
     "argument --temperature-length: expected an integer, got 'x'"),
]


@pytest.mark.parametrize("options, message", ATTENTION_REFUSALS,
                         ids=[" ".join(map(str, o)) or "nothing" for o, _ in ATTENTION_REFUSALS])
def test_bad_attention_combinations_are_refused(tmp_path, capsys, options, message):
    src, _ = source(tmp_path)
    err = usage_error(capsys, "extend", src, tmp_path / "dst", *options)
    assert message in err
    assert not (tmp_path / "dst").exists()


def test_dual_chunk_over_a_scaled_own_table_is_refused(tmp_path, capsys):
    src, _ = source(tmp_path, "Llama", YARN_4)
    err = usage_error(capsys, "extend", src, tmp_path / "dst", "--attention", "dual_chunk", "--chunk-size", 12,
                      "--local-size", 4)
    assert "--attention dual_chunk: Dual Chunk Attention over a scaled table (YaRN)" in err
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------------------------------------
# What serving a written checkpoint does with a request that states no length, and settings that make an attention
# another method wherever it is served (issue 42's serving audit)


def generation_config(path):
    return json.loads((path / "generation_config.json").read_text())


def test_a_per_request_checkpoint_gets_a_planning_budget_for_requests_without_max_tokens(tmp_path, capsys):
    """vLLM's chat endpoint (and transformers' generate) take generation_config.json's max_new_tokens as the length of
    a request that does not set one; without it vLLM plans a chat request at max_model_len, scaling even a short
    question. extend writes it for a per-request checkpoint: --max-new-tokens N, else SRC's own, else L/4 (a prompt
    up to 3L/4 then runs the native model); other methods get none and refuse the flag."""
    src, _ = source(tmp_path)
    argv = ["--method", "dynamic_yarn", "--per", "request", "--original-max-position", ORIGINAL, "--max-length", 256]
    _, out = extend(capsys, src, tmp_path / "default", *argv)
    assert generation_config(tmp_path / "default")["max_new_tokens"] == ORIGINAL // 4
    assert f"is planned at prompt + {ORIGINAL // 4} and stops there (finish_reason 'length')" in out
    # the rest of SRC's generation config is kept
    assert {k: v for k, v in generation_config(tmp_path / "default").items() if k != "max_new_tokens"} == \
        generation_config(src)
    extend(capsys, src, tmp_path / "given", *argv, "--max-new-tokens", 7)
    assert generation_config(tmp_path / "given")["max_new_tokens"] == 7
    extend(capsys, tmp_path / "given", tmp_path / "kept", *argv)  # SRC's own budget is kept
    assert generation_config(tmp_path / "kept")["max_new_tokens"] == 7
    # what transformers' generate then does with a request that states no length: P + 7, the native model
    model = hf.patch(load(tmp_path / "given"))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids(20), do_sample=False, pad_token_id=0)
    assert out.shape[1] == 27
    err = usage_error(capsys, "extend", src, tmp_path / "static", "--method", "yarn", "--factor", 4,
                      "--max-new-tokens", 7)
    assert "--max-new-tokens is the planning budget of a per='request' checkpoint" in err
    _, out = extend(capsys, src, tmp_path / "per_step", "--method", "dynamic_yarn", "--max-length", 256)
    assert generation_config(tmp_path / "per_step") == generation_config(src) and "planned at" not in out


@pytest.mark.parametrize("window,group,expected", [
    (4, 3, None),
    (64, 3, "Self-Extend with window 64 and group 3, served up to 64 tokens, is plain RoPE attention there"),
    (4, 200, "Self-Extend with window 4 and group 200, served up to 200 tokens, is ReRoPE with window 4 there"),
    (4, 1, "Self-Extend with window 4 and group 1 is plain RoPE attention at every length"),
])
def test_a_self_extend_that_is_another_method_wherever_it_is_served_is_warned_about(tmp_path, capsys, window, group,
                                                                                      expected):
    """Self-Extend whose window reaches past every length the checkpoint is served to is RoPE attention there, and
    one whose group does is ReRoPE: extend and hf.patch say so (the written checkpoint is served to 64 tokens, its
    max_position_embeddings, or to --max-length)."""
    src, _ = source(tmp_path)
    length = ["--max-length", 200] if group == 200 else []
    argv = ["extend", str(src), str(tmp_path / "dst"), "--attention", "self_extend", "--window", str(window),
            "--group", str(group), *map(str, length)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.patch(load(src), attention="self_extend", window=window, group=group)
    patch_warnings = [str(w.message) for w in caught if "Self-Extend" in str(w.message)]
    if expected is None:
        assert "Self-Extend" not in err and patch_warnings == [], (err, patch_warnings)
        return
    assert f"warning: {expected}" in err, err
    if group != 200:  # hf.patch writes no served length: the checkpoint is served to its 64
        assert len(patch_warnings) == 1 and patch_warnings[0].startswith(f"patch: {expected}"), patch_warnings


# ---------------------------------------------------------------------------------------------
# gpt-oss: stock vLLM's model builds YaRN from factor, original length and betas whatever rope_type says

GPT_OSS_SRC = {**YARN_4, "original_max_position_embeddings": 32, "truncate": False, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("options, warned", [
    (["--method", "yarn", "--factor", 8], False),  # what stock vLLM builds: served exactly
    (["--method", "dynamic_yarn", "--per", "request", "--max-length", 256], True),  # silently plain YaRN there
    (["--method", "resonance_yarn", "--factor", 8], True),
    (["--method", "linear", "--factor", 8], False),  # no betas: stock vLLM's load fails (KeyError), not silent
])
def test_gpt_oss_tables_stock_vllm_would_read_as_yarn_are_warned_about(tmp_path, capsys, options, warned):
    src, _ = source(tmp_path, "gpt-oss", GPT_OSS_SRC)
    assert cli.main(["extend", str(src), str(tmp_path / "dst"), *map(str, options)]) == 0
    captured = capsys.readouterr()
    written = json.loads((tmp_path / "dst" / "config.json").read_text())["rope_parameters"]
    assert ("stock vLLM's gpt-oss model builds YaRN" in captured.err) == warned, (written, captured.err)
    if warned:
        assert f"rope_type '{written['rope_type']}'" in captured.err and "plugin" in captured.err


def test_a_yarn_attention_factor_gets_sglangs_copy_and_target_sglang_writes_a_longrope(tmp_path, capsys):
    """Stock SGLang 0.5 drops YaRN's attention_factor (issue 56): extend writes SGLang's own key beside it (stock
    SGLang then serves the table exactly: nothing to warn about), and ``--target sglang`` writes the same table as a
    longrope (equal factors, the factor in short/long_mscale), which transformers reads as the same model."""
    src, _ = source(tmp_path)
    options = ("--method", "yarn", "--factor", 4, "--original-max-position", ORIGINAL, "--attention-factor", 1.0)
    assert cli.main(["extend", str(src), str(tmp_path / "yarn"), *map(str, options)]) == 0
    assert "stock SGLang" not in capsys.readouterr().err
    yarn = json.loads((tmp_path / "yarn" / "config.json").read_text())
    assert yarn["rope_parameters"]["attn_factor"] == pytest.approx(1.0 / (0.1 * math.log(4.0) + 1.0), rel=1e-12)
    assert cli.main(["extend", str(src), str(tmp_path / "longrope"), *map(str, options), "--target", "sglang"]) == 0
    assert "stock SGLang" not in capsys.readouterr().err
    longrope = json.loads((tmp_path / "longrope" / "config.json").read_text())
    params = longrope["rope_parameters"]
    assert (yarn["rope_parameters"]["rope_type"], params["rope_type"]) == ("yarn", "longrope")
    assert params["short_factor"] == params["long_factor"] and params["short_mscale"] == params["long_mscale"] == 1.0
    want, got = logits(hf.patch(load(tmp_path / "yarn"))), logits(load(tmp_path / "longrope"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_longrope_export_for_stock_vllm_is_refused(tmp_path, capsys):
    src, _ = source(tmp_path, "gpt-oss", GPT_OSS_SRC)
    err = usage_error(capsys, "extend", src, tmp_path / "dst", "--method", "yarn", "--factor", 8, "--target", "vllm")
    assert "builds YaRN whatever rope_type says" in err and "--method yarn (no --target)" in err
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------------------------------------
# issue 55: the length a new table is set for, STRING's no-op settings, what hf.patch would refuse on the reload, and
# DST written whole or not at all

def served(written):
    return config_lib.vllm_max_model_len(written["rope_parameters"], written["max_position_embeddings"],
                                         written.get("model_max_length"))


# SRC scaled x4 (original 16, max_position_embeddings 64): --method M --factor s is set for s x 16, as from the
# unscaled model of length 16, never for s x 64 (vLLM multiplied SRC's extended length by the new factor).
SCALED_SOURCES = {
    "Llama YaRN x4": ("Llama", YARN_4),
    "DeepSeek-V3-like YaRN x4": ("DeepSeek-V3", {**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("options, length", [(["--method", "linear", "--factor", 4], 64),
                                             (["--method", "linear", "--factor", 8], 128),
                                             (["--method", "ntk", "--factor", 2], 32)],
                         ids=["linear4", "linear8", "ntk2"])
@pytest.mark.parametrize("name", sorted(SCALED_SOURCES))
def test_a_table_over_a_scaled_src_is_set_for_s_times_srcs_original_length(tmp_path, capsys, name, options, length):
    family, rope = SCALED_SOURCES[name]
    src, _ = source(tmp_path, family, rope)
    written, out = extend(capsys, src, tmp_path / "dst", *options)
    assert served(written) == length, written
    assert f"vLLM serves it up to {length} tokens" in out
    # the same config as the command writes from the unscaled model of length 16
    plain = build(family, None, max_position_embeddings=ORIGINAL)
    plain.save_pretrained(tmp_path / "plain")
    want, _ = extend(capsys, tmp_path / "plain", tmp_path / "from_plain", *options)
    for key in ("rope_parameters", "max_position_embeddings"):
        assert written[key] == want[key], key


def test_an_ntk_src_keeps_its_original_length_for_the_next_method(tmp_path, capsys):
    # NTK-aware is written as default RoPE with ceil(s x L) as max_position_embeddings: L is found back from it
    build("Llama", None, max_position_embeddings=ORIGINAL).save_pretrained(tmp_path / "plain")
    ntk, _ = extend(capsys, tmp_path / "plain", tmp_path / "ntk", "--method", "ntk", "--factor", 3)
    assert ntk["max_position_embeddings"] == 3 * ORIGINAL
    written, _ = extend(capsys, tmp_path / "ntk", tmp_path / "linear", "--method", "linear", "--factor", 2)
    assert served(written) == 2 * ORIGINAL
    written, _ = extend(capsys, tmp_path / "ntk", tmp_path / "yarn", "--method", "yarn", "--factor", 2)
    assert written["rope_parameters"]["original_max_position_embeddings"] == ORIGINAL and served(written) == 32


def test_string_past_every_served_length_is_warned_about(tmp_path, capsys):
    """STRING whose shifted offset S reaches past the length it is served to shifts no distance there: plain RoPE
    attention with STRING's factor. extend and hf.patch say so, as for Self-Extend's window."""
    src, _ = source(tmp_path)
    expected = ("STRING with shifted_offset 200, served up to 64 tokens, is plain RoPE attention (times STRING's "
                "attention factor) there")
    assert cli.main(["extend", str(src), str(tmp_path / "dst"), "--attention", "string", "--shifted-offset",
                     "200"]) == 0
    assert f"warning: {expected}" in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.patch(load(src), attention="string", shifted_offset=200)
    assert [str(w.message) for w in caught if "STRING" in str(w.message)] == [f"patch: {expected}: every distance is "
                                                                               "below the shifted offset (its authors "
                                                                               "take S = 0.33 of the length the model "
                                                                               "is served to)"]
    # served past S: no warning
    assert cli.main(["extend", str(src), str(tmp_path / "long"), "--attention", "string", "--shifted-offset",
                     "200", "--max-length", "1000"]) == 0
    assert "STRING" not in capsys.readouterr().err


def test_string_whose_local_value_is_its_offset_is_refused_on_every_path(tmp_path):
    from ropescale import config as config

    for arguments in (dict(shifted_offset=6), dict(shifted_offset=300, local_value=300)):
        with pytest.raises(ValueError, match=r"equals shifted_offset .* so no distance moves"):
            hf.patch(build("Llama"), attention="string", **arguments)
        with pytest.raises(ValueError, match="so no distance moves"):
            config.check_attention("string", arguments)
    assert config.check_attention("string", dict(shifted_offset=300)) == dict(shifted_offset=300, local_value=128)


def test_a_src_mscale_completed_by_srcs_mscale_all_dim_is_written(tmp_path, capsys):
    # --mscale alone is refused where nothing completes it (HOSTILE); over a DeepSeek-style SRC, its mscale_all_dim
    # does, and the pair is read
    src, _ = source(tmp_path, "DeepSeek-V3", {**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0})
    written, out = extend(capsys, src, tmp_path / "dst", "--method", "yarn", "--factor", 8, "--mscale", 0.5)
    assert kept_line(out) == "kept from SRC (a flag overrides each): mscale_all_dim=1"
    params = written["rope_parameters"]
    assert (params["mscale"], params["mscale_all_dim"]) == (0.5, 1.0)


@pytest.mark.parametrize("options, refusal", [
    (["--method", "dynamic_yarn", "--per", "request", "--max-length", 256], "per-request methods (DynamicYaRN(per='"
                                                                            "request')) cannot patch DeepSeek-V3"),
    (["--method", "dynamic_yarn", "--max-length", 256], "pre-RoPE methods (dynamic methods, ReRoPE) cannot patch "
                                                        "DeepSeek-V3"),
    (["--attention", "rerope", "--window", 8], "pre-RoPE methods (dynamic methods, ReRoPE) cannot patch DeepSeek-V3"),
])
def test_what_hf_patch_refuses_on_the_reload_is_refused_before_it_is_written(tmp_path, capsys, options, refusal):
    # issue 55: DeepSeek-V3 --method dynamic_yarn --per request was written (exit 0), and hf.patch refused the reload
    from ropescale.hf import architectures

    src, _ = source(tmp_path, "DeepSeek-V3", YARN_4)
    err = usage_error(capsys, "extend", src, tmp_path / "dst", *options)
    arch = architectures.find(load(src).config)
    reason = arch.per_request if "per-request" in refusal else arch.pre_rope
    assert f"SRC: {refusal}: {reason}" in " ".join(err.split()), err
    assert not (tmp_path / "dst").exists()


def test_an_interrupted_or_failed_copy_leaves_nothing_and_the_rerun_works(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the copy of the weights, or a full disk there, left DST with a truncated weights file and no
    config.json, and the rerun refused (DST exists). DST is written in a temporary folder beside it, renamed at the
    end: nothing is left behind."""
    import errno
    import shutil

    from ropescale.cli import cmd_extend

    src, _ = source(tmp_path)
    (src / "tokenizer.json").write_text("{}")
    real = cmd_extend._place
    argv = ["extend", str(src), str(tmp_path / "dst"), "--method", "yarn", "--factor", "4"]

    def failing(error):
        def place(source, target):
            if not source.name.endswith(".safetensors"):
                return real(source, target)
            with open(source, "rb") as f, open(target, "wb") as out:  # a truncated copy, then the failure
                out.write(f.read(100))
            raise error
        return place

    for error, code in ((KeyboardInterrupt(), 130), (OSError(errno.ENOSPC, "No space left on device"), 1)):
        monkeypatch.setattr(cmd_extend, "_place", failing(error))
        assert cli.main(argv) == code
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if code == 1:
            assert f"writing {tmp_path / 'dst'} failed, nothing written: [Errno 28] No space left on device" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], list(tmp_path.iterdir())
    monkeypatch.setattr(cmd_extend, "_place", real)
    assert cli.main(argv) == 0
    assert (tmp_path / "dst" / "config.json").is_file()
    assert os.path.samefile(src / "model.safetensors", tmp_path / "dst" / "model.safetensors")
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == "{}"
    # the weights are copied where a link cannot be made (another file system): the same end
    monkeypatch.setattr(cmd_extend.os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))
    assert cli.main([*argv[:2], str(tmp_path / "copied"), *argv[3:]]) == 0
    assert (tmp_path / "copied" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert "copied 3 file(s)" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "copied")


def test_a_dst_that_cannot_be_made_is_a_usage_error_before_the_work(tmp_path, capsys, monkeypatch):
    src, _ = source(tmp_path)
    err = usage_error(capsys, "extend", src, tmp_path / "missing" / "dst", "--method", "yarn", "--factor", 4)
    assert f"DST: the folder {tmp_path / 'missing'} does not exist" in err
    (tmp_path / "file").write_text("")
    err = usage_error(capsys, "extend", src, tmp_path / "file" / "dst", "--method", "yarn", "--factor", 4)
    assert f"DST: {tmp_path / 'file'} is not a folder" in err
    # a read-only folder (os.access answers for it: root may write anywhere, so this test cannot chmod it)
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(tmp_path / "ro")
                        else real(path, mode, **kw))
    err = usage_error(capsys, "extend", src, tmp_path / "ro" / "dst", "--method", "yarn", "--factor", 4,
                      "--dry-run")
    assert f"DST: the folder {tmp_path / 'ro'} is not writable" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro", "src"]


@pytest.mark.parametrize("family", ["SmolLM3", "Llama 4 (text)"])
def test_a_family_with_nope_layers_is_extended_on_its_rope_layers_only(tmp_path, capsys, family):
    """SmolLM3 (its 3B checkpoint ships YaRN x2) and Llama 4 mix NoPE layers (no_rope_layers 0) with rope layers:
    extend --method yarn --factor 2 writes the table once, the NoPE list as it was, and the reload through plain
    transformers is the family's own model of YaRN x2 (its NoPE layers, Llama 4's attention temperature included,
    the model's own); a pre-RoPE method Llama 4's chunked rope layers cannot take is refused before it is written."""
    src, model = source(tmp_path, family)
    written, _ = extend(capsys, src, tmp_path / "dst", "--method", "yarn", "--factor", 2, "--original-max-position",
                        ORIGINAL)
    assert written["no_rope_layers"] == model.config.no_rope_layers and 0 in written["no_rope_layers"]
    want = build(family, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL})
    want.load_state_dict(model.state_dict())
    reloaded = load(tmp_path / "dst")
    torch.testing.assert_close(logits(reloaded), logits(want), atol=1e-6, rtol=0)
    assert not torch.allclose(logits(reloaded), logits(model), atol=1e-4, rtol=0)
    if family == "Llama 4 (text)":
        from ropescale.hf import architectures

        err = usage_error(capsys, "extend", src, tmp_path / "dyn", "--method", "dynamic_yarn", "--max-length", 64)
        assert (f"SRC: pre-RoPE methods (dynamic methods, ReRoPE) cannot patch Llama 4 (text): {architectures.CHUNKED}"
                in " ".join(err.split())), err
        assert not (tmp_path / "dyn").exists()


@pytest.mark.parametrize("family,extended,kept", [("Gemma 3", "full_attention", "sliding_attention"),
                                                  ("DeepSeek-V4", "compress", "main")])
def test_a_per_layer_type_config_is_extended_in_the_types_hf_patch_extends(tmp_path, capsys, family, extended, kept):
    """Gemma 3 and DeepSeek-V4 key rope_parameters by layer type (V4 by the rope its layers take: ``main`` on its
    sliding layers at theta 1e4, ``compress`` on its compressed layers and their compressors at 160000): extend
    writes the method into the types hf.patch extends (their own base and partial rotary kept), leaves the sliding
    layers' table as it was, and the reload through plain transformers is the family's own model of the method. Before,
    extend refused such a config. A pre-RoPE method there is refused before anything is written."""
    src, model = source(tmp_path, family)
    written, out = extend(capsys, src, tmp_path / "dst", "--method", "yarn", "--factor", 4, "--original-max-position",
                          ORIGINAL)
    params = written["rope_parameters"]
    assert params[kept] == model.config.rope_parameters[kept]
    assert params[extended]["rope_type"] == "yarn" and params[extended]["factor"] == 4.0
    assert params[extended]["rope_theta"] == model.config.rope_parameters[extended]["rope_theta"]
    assert f"in layer types {extended} (the others keep their own)" in out
    want = build(family, YARN_4)
    want.load_state_dict(model.state_dict())
    reloaded = load(tmp_path / "dst")
    torch.testing.assert_close(logits(reloaded), logits(want), atol=1e-6, rtol=0)
    assert not torch.allclose(logits(reloaded), logits(model), atol=1e-4, rtol=0)
    err = usage_error(capsys, "extend", src, tmp_path / "dyn", "--method", "dynamic_yarn", "--max-length", 64)
    assert ("pre-RoPE" in err and not (tmp_path / "dyn").exists()), err
