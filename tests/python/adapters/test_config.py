"""ropescale.config: the one parser between a config and a method (docs/DESIGN.md, "Checkpoints").
What each method is written as, read back as itself; old checkpoints (``ntk``, transformers' ``dynamic``)
still read; a config edited out of step with its ``ropescale`` entry is refused."""

import math

import pytest
import torch

from ropescale import config, scaling

DIM = 16
L = 16
LONG = tuple(1.0 + 0.5 * i for i in range(DIM // 2))

# method: (rope_type written, max_position_embeddings written for a model of max_position_embeddings 64)
WRITTEN = [
    (scaling.Default(), "default", 64),
    (scaling.Linear(factor=4.0), "linear", 64),  # vLLM multiplies by factor
    (scaling.NTK(factor=4.0), "default", 256),  # the scaled base; vLLM sees no factor
    (scaling.DynamicNTK(factor=2.0, original_max_position=L), "dynamic_ntk", L),
    (scaling.YaRN(factor=4.0, original_max_position=L), "yarn", 4 * L),  # vLLM takes it as it is
    (scaling.DynamicYaRN(factor=2.0, original_max_position=L), "dynamic_yarn", L),
    (scaling.Llama3(factor=8.0, original_max_position=L), "llama3", 8 * L),
    (scaling.LongRoPE(short_factor=LONG, long_factor=LONG, original_max_position=L, factor=4.0), "longrope", 4 * L),
    (scaling.Default(resonance=True), "resonance", 64),
    (scaling.NTK(factor=4.0, resonance=True), "resonance_ntk", 64),
    (scaling.YaRN(factor=4.0, original_max_position=L, resonance=True), "resonance_yarn", L),
    (scaling.Llama3(factor=8.0, original_max_position=L, resonance=True), "resonance_llama3", L),
    (scaling.Proportional(factor=4.0, partial_rotary_factor=0.5), "proportional", 64),  # vLLM multiplies by factor
    (scaling.Proportional(factor=4.0, partial_rotary_factor=0.5, resonance=True), "resonance_proportional", 64),
]


@pytest.mark.parametrize("method, rope_type, length", WRITTEN, ids=lambda v: str(v) if isinstance(v, int) else None)
def test_each_method_is_written_for_stock_engines_and_read_back(method, rope_type, length):
    written = config.write(method, 1e4, DIM, 64)
    assert written.rope_parameters["rope_type"] == rope_type
    assert written.max_position_embeddings == length
    back = config.read(written.rope_parameters, written.max_position_embeddings, written.entry, DIM)
    assert back == config.RopeConfig(method, 1e4, recorded=written.entry is not None)


def test_ntk_is_default_with_the_scaled_base_and_the_same_table():
    method = scaling.NTK(factor=4.0)
    written = config.write(method, 1e4, DIM, 64)
    assert written.entry == {"method": {"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4}}
    stock = scaling.Default().inv_freq(DIM, written.rope_parameters["rope_theta"], dtype=torch.float64)
    torch.testing.assert_close(stock, method.inv_freq(DIM, 1e4, dtype=torch.float64), rtol=1e-15, atol=0)


def test_rerope_keeps_both_the_attention_side_and_the_ntk_method():
    parameters = config.check_attention("rerope", {"window": 8, "leaky_k": 2.0})
    written = config.write(scaling.NTK(factor=2.0), 1e4, DIM, 64, attention="rerope", parameters=parameters)
    assert written.rope_parameters["rope_type"] == "rerope"
    assert written.entry == {"attention": "rerope", "window": 8, "leaky_k": 2.0, "logn_length": 0,
                             "method": {"rope_type": "ntk", "factor": 2.0, "rope_theta": 1e4}}
    back = config.read(written.rope_parameters, written.max_position_embeddings, written.entry, DIM)
    assert back == config.RopeConfig(scaling.NTK(factor=2.0), 1e4, "rerope",
                                     {"window": 8, "leaky_k": 2.0, "logn_length": 0}, recorded=True)


def test_longrope_with_distinct_factors_is_recorded_so_ropescale_serves_it_per_length():
    # Stock vLLM takes the long factors at every length past the original one; transformers picks by length.
    # The entry marks the checkpoint as ropescale's, so ropescale.vllm serves it per request (pre-RoPE).
    short = tuple(1.0 + 0.1 * i for i in range(DIM // 2))
    method = scaling.LongRoPE(short_factor=short, long_factor=LONG, original_max_position=L, factor=4.0)
    written = config.write(method, 1e4, DIM, 64)
    assert written.rope_parameters["rope_type"] == "longrope" and written.max_position_embeddings == 4 * L
    assert written.entry == {"method": written.rope_parameters}
    back = config.read(written.rope_parameters, written.max_position_embeddings, written.entry, DIM)
    assert back == config.RopeConfig(method, 1e4, recorded=True) and back.per_length
    # The same longrope without the entry (a third-party checkpoint, e.g. Phi-3): the engine's own rule.
    third_party = config.read(written.rope_parameters, written.max_position_embeddings, None, DIM)
    assert third_party.method == method and not third_party.per_length
    # One table (short == long): recorded (ropescale's table in the plugin) but one table at every length.
    one_table = config.write(scaling.LongRoPE(short_factor=LONG, long_factor=LONG, original_max_position=L,
                                              factor=4.0), 1e4, DIM, 64)
    assert not config.read(one_table.rope_parameters, 4 * L, one_table.entry, DIM).per_length
    # `extend --target vllm` (write_longrope) writes no entry: stock vLLM serves it alike, with or without the plugin.
    assert config.write_longrope(scaling.YaRN(factor=4.0, original_max_position=L), 1e4, DIM, 64).entry is None


@pytest.mark.parametrize("method", [m for m, rope_type, _ in WRITTEN if rope_type in ("linear", "yarn", "llama3",
                                                                                     "longrope")], ids=repr)
def test_stock_types_are_recorded_so_the_vllm_plugin_serves_ropescales_table(method):
    # vLLM's own tables take float32 angles (5e-4 off at 12k on SmolLM2's YaRN): the entry tells ropescale.vllm
    # that ropescale wrote this checkpoint, while stock engines read the stock type as before.
    written = config.write(method, 1e4, DIM, 64)
    assert written.entry == {"method": written.rope_parameters}
    assert config.read(written.rope_parameters, written.max_position_embeddings, written.entry, DIM).recorded
    # Editing a field of rope_parameters alone would split stock engines from ropescale: refused.
    for key, value in written.rope_parameters.items():
        if key == "rope_type":
            continue
        edited = {**written.rope_parameters,
                  key: [v * 2 for v in value] if isinstance(value, list) else (not value) if isinstance(value, bool)
                  else value * 2}
        with pytest.raises(ValueError, match=r"does not match rope_parameters .* edited by hand"):
            config.read(edited, written.max_position_embeddings, written.entry, DIM)


def test_old_checkpoints_still_read():
    # ropescale's former static NTK type, and transformers' dynamic (original length = max_position_embeddings)
    assert config.read({"rope_type": "ntk", "factor": 4.0, "rope_theta": 5e5}, 64) == config.RopeConfig(
        scaling.NTK(factor=4.0), 5e5)
    assert config.read({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, 32).method == scaling.DynamicNTK(
        factor=2.0, original_max_position=32)


def test_old_ntk_checkpoint_loads_in_transformers_as_ntk():
    transformers = pytest.importorskip("transformers")
    import ropescale.hf  # noqa: F401  (registers ropescale's rope types)

    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=DIM, max_position_embeddings=64,
        rope_parameters={"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4})
    model = transformers.LlamaForCausalLM(cfg)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, scaling.NTK(factor=4.0).inv_freq(DIM, 1e4))


def test_an_edited_config_is_refused():
    written = config.write(scaling.NTK(factor=4.0), 1e4, DIM, 64)
    edited = {**written.rope_parameters, "rope_theta": 2e4}
    with pytest.raises(ValueError, match=r"config.ropescale.method .* does not match rope_parameters .* edited by hand"):
        config.read(edited, 256, written.entry, DIM)
    with pytest.raises(ValueError, match="config.ropescale must be a dict with keys"):
        config.read({"rope_type": "default"}, 64, {"attention": "flash"})
    with pytest.raises(ValueError, match="marks ReRoPE attention but the config has no 'ropescale' entry"):
        config.read({"rope_type": "rerope_yarn", "factor": 4.0, "original_max_position_embeddings": L}, 64)
    with pytest.raises(ValueError, match="asks for ReRoPE attention but rope_type 'default' has no 'rerope' marker"):
        config.read({"rope_type": "default"}, 64, {"attention": "rerope", "window": 8})


EXPORTABLE = [
    scaling.Linear(factor=4.0),
    scaling.NTK(factor=4.0),
    scaling.YaRN(factor=4.0, original_max_position=L, beta_fast=16.0, mscale=0.707, mscale_all_dim=1.0),
    scaling.YaRN(factor=4.0, original_max_position=L, resonance=True),
    scaling.Llama3(factor=8.0, original_max_position=L, resonance=True),
    scaling.Default(resonance=True),
    scaling.Proportional(factor=4.0, partial_rotary_factor=1.0),  # every pair rotated: linear
]


@pytest.mark.parametrize("method", EXPORTABLE, ids=lambda m: type(m).__name__ + ("+resonance" if m.resonance else ""))
def test_longrope_export_is_the_same_table_in_stock_transformers(method):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    written = config.write_longrope(method, 1e4, DIM, 64)
    assert written.rope_parameters["short_factor"] == written.rope_parameters["long_factor"]
    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=DIM, max_position_embeddings=written.max_position_embeddings,
        rope_parameters=dict(written.rope_parameters))
    for seq_len in (1, written.max_position_embeddings):  # transformers' short and long tables
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
        torch.testing.assert_close(inv_freq, method.inv_freq(DIM, 1e4), rtol=1e-6, atol=0)
        assert factor == pytest.approx(method.attention_factor, rel=1e-12)
    back = config.read(written.rope_parameters, written.max_position_embeddings, None, DIM).method
    torch.testing.assert_close(back.inv_freq(DIM, 1e4), method.inv_freq(DIM, 1e4), rtol=1e-6, atol=0)
    assert back.attention_factor == pytest.approx(method.attention_factor, rel=1e-12)


def test_longrope_export_refuses_dynamic_tables():
    with pytest.raises(ValueError, match="write_longrope: DynamicYaRN is dynamic"):
        config.write_longrope(scaling.DynamicYaRN(original_max_position=L), 1e4, DIM, 64)


def test_longrope_export_refuses_unrotated_pairs():
    # proportional below partial_rotary_factor 1 leaves pairs at frequency 0: no longrope factor gives that
    with pytest.raises(ValueError, match="write_longrope: this Proportional leaves pairs unrotated"):
        config.write_longrope(scaling.Proportional(factor=4.0, partial_rotary_factor=0.5), 1e4, DIM, 64)


def test_a_method_that_owns_partial_rotary_factor_keeps_it():
    # The model's partial_rotary_factor is written beside every other method; proportional carries its own, which
    # a different model value would overwrite: refused. The same value, or none, writes the method's.
    method = scaling.Proportional(factor=2.0, partial_rotary_factor=0.25)
    for model_value in (None, 0.25):
        written = config.write(method, 1e6, DIM, 64, partial_rotary_factor=model_value)
        assert written.rope_parameters["partial_rotary_factor"] == 0.25
        assert config.read(written.rope_parameters, 64, written.entry, DIM).method == method
    with pytest.raises(ValueError, match="Proportional has partial_rotary_factor 0.25, the model 0.5"):
        config.write(method, 1e6, DIM, 64, partial_rotary_factor=0.5)
    assert config.write(scaling.Linear(factor=2.0), 1e4, DIM, 64,
                        partial_rotary_factor=0.5).rope_parameters["partial_rotary_factor"] == 0.5


def test_extend_target_vllm_writes_the_longrope_export(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import json

    from ropescale import cli

    transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=DIM, max_position_embeddings=L,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}).save_pretrained(tmp_path / "src")
    assert cli.main(["extend", str(tmp_path / "src"), str(tmp_path / "dst"), "--method", "yarn", "--factor", "4",
                     "--resonance", "--target", "vllm", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = config.write_longrope(scaling.YaRN(factor=4.0, original_max_position=L, resonance=True), 1e4, DIM, L)
    assert printed["rope_parameters"] == want.rope_parameters
    assert printed["max_position_embeddings"] == 4 * L
    with pytest.raises(SystemExit):
        cli.main(["extend", str(tmp_path / "src"), str(tmp_path / "d2"), "--method", "dynamic_yarn", "--target", "vllm"])
    assert "--target vllm: write_longrope: DynamicYaRN is dynamic" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The served length of a pre-RoPE checkpoint (issue 27): model_max_length, apart from the table


@pytest.mark.parametrize("params", [
    {"rope_type": "dynamic_yarn", "factor": 1.0}, {"rope_type": "rerope"}, {"rope_type": "rerope_yarn", "factor": 4.0},
    {"rope_type": "dynamic_ntk", "factor": 3.0}, {"rope_type": "dynamic_ntk", "factor": 2.7},
    {"rope_type": "resonance_dynamic", "factor": 1.1}, {"rope_type": "yarn", "factor": 4.0},
], ids=lambda p: f"{p['rope_type']}x{p.get('factor', 1)}")
@pytest.mark.parametrize("length", [1000, 4096, 32768, 131071])
def test_the_served_length_is_what_vllm_derives(params, length):
    value = config.served_length_value(length, params)
    assert isinstance(value, int) or not float(value).is_integer()
    # vLLM's own arithmetic (vllm/config/model.py): the config's length, times factor unless yarn/llama3/longrope,
    # truncated to an integer.
    factor = 1.0 if params["rope_type"] == "yarn" else params.get("factor", 1.0)
    assert int(value * factor) == length == config.vllm_max_model_len(params, 64, value)
    assert config.vllm_max_model_len(params, 64) == int(64 * factor)  # without it: max_position_embeddings


def test_only_a_length_free_checkpoint_takes_a_served_length():
    assert config.read({"rope_type": "dynamic_yarn", "original_max_position_embeddings": L}, L).length_free
    assert config.read({"rope_type": "dynamic_ntk", "factor": 2.0}, L).length_free
    assert config.read({"rope_type": "rerope_yarn", "factor": 4.0, "original_max_position_embeddings": L}, L,
                       {"attention": "rerope", "window": 4}).length_free
    # a LongRoPE with distinct factors is served per length by the plugin, but stock vLLM serves it with a table
    # that ends at max_position_embeddings: not length-free
    for params in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L},
                   {"rope_type": "longrope", "short_factor": list(LONG), "long_factor": [2 * f for f in LONG],
                    "factor": 4.0, "original_max_position_embeddings": L}):
        assert not config.read(params, 4 * L, {"method": dict(params)}).length_free


@pytest.mark.parametrize("params, ours", [
    ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}, True),  # vLLM 0.32 serves it wrong
    ({"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 1e4}, False),  # HunYuan's NTK-alpha: vLLM's is right
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, False),  # vLLM's own is right
    ({"rope_type": "ntk", "factor": 4.0}, False),  # vLLM owns the name
    ({"rope_type": "dynamic_ntk", "factor": 4.0}, True),  # ropescale's type
])
def test_the_vllm_plugin_takes_the_stock_types_vllm_serves_wrong(params, ours):
    from ropescale import serving

    assert serving.ropescale_rotary(params, None) is ours
    assert bool(scaling.DynamicNTK.vllm_stock_wrong) and not scaling.YaRN.vllm_stock_wrong
    # the SGLang plugin takes only what ropescale wrote: a third-party config is SGLang's, bit for bit
    assert serving.written_by_ropescale(params, None) is (params["rope_type"] == "dynamic_ntk")
    assert serving.written_by_ropescale({"rope_type": "yarn", "factor": 4.0}, {"method": {"rope_type": "yarn"}})


YARN_4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("params, served", [
    (YARN_4, None),  # its own factor is transformers' 0.1 ln 4 + 1
    ({**YARN_4, "attention_factor": 0.1 * math.log(4.0) + 1.0}, None),  # the same value, written out
    ({**YARN_4, "attention_factor": 1.0}, 1.13863),  # dropped: SGLang serves 0.1 ln 4 + 1
    ({**YARN_4, "mscale": 0.707, "mscale_all_dim": 0.707}, None),  # both read alike (ratio 1)
    ({**YARN_4, "mscale": 1.0, "mscale_all_dim": 0.0}, None),  # SGLang's ratio (1.139 / 1); transformers' 0.1 ln s + 1
    ({**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.0}, 0.964327),  # SGLang's ratio
    ({**YARN_4, "attn_factor": 2.0}, 2.27726),  # SGLang multiplies its own factor by it; transformers reads neither
    # what ropescale writes: SGLang's attn_factor beside attention_factor, so that stock SGLang's product is it
    ({**YARN_4, "attention_factor": 1.0, "attn_factor": 1.0 / (0.1 * math.log(4.0) + 1.0)}, None),
    ({**YARN_4, "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.0,
      "attn_factor": (0.1 * math.log(4.0) + 1.0) / (0.0707 * math.log(4.0) + 1.0)}, None),
    ({"rope_type": "proportional", "factor": 2.0}, "factor"),  # Gemma 4's factor ignored
    ({"rope_type": "proportional", "factor": 1.0}, None),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "attention_factor": 1.0}, None),
    ({"rope_type": "resonance_yarn", "factor": 4.0}, None),  # unknown to SGLang: refused, loud
    ({"rope_type": "yarn", "factor": "x"}, None),  # not a table transformers reads either
    ({}, None),
    (None, None),
])
def test_stock_sglang_misreads_names_what_stock_sglang_serves_silently_wrong(params, served):
    """Issue 56: ``extend`` warns with it where it writes such a table (stock SGLang, no plugin, would serve another
    model); every other table stock SGLang serves as written or refuses."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ropescale's own notes on a YaRN mscale without its pair
        message = config.stock_sglang_misreads(params, 256)
    if served is None:
        assert message is None, message
    elif served == "factor":
        assert "stock SGLang ignores the proportional rope's factor (2.0)" in message, message
    else:
        assert f"serves this table with attention factor {served:g}" in message, message


@pytest.mark.parametrize("method", [
    scaling.YaRN(factor=4.0, original_max_position=64, attention_factor_override=1.0),
    scaling.YaRN(factor=8.0, original_max_position=64, mscale=0.707, mscale_all_dim=1.0, attention_factor_override=1.3),
    scaling.YaRN(factor=4.0, original_max_position=64),  # no attention_factor written: no copy either
])
def test_a_yarn_attention_factor_is_written_with_sglangs_copy_and_read_back_checked(method):
    """Stock SGLang 0.5 reads YaRN's attention factor as its own default times ``attn_factor`` (issue 56): ropescale
    writes the copy beside transformers' ``attention_factor`` (so every engine serves the same table), reads it back
    off, and refuses a config where the two disagree (edited by hand)."""
    written = config.write(method, 1e4, 64, 64)
    params = written.rope_parameters
    assert (config.SGLANG_YARN_KEY in params) is ("attention_factor" in params)
    assert config.stock_sglang_misreads(params) is None
    parsed = config.read(params, written.max_position_embeddings, written.entry, 64)
    assert parsed.method == method
    if "attention_factor" in params:
        assert config.sglang_yarn_default(params) * params[config.SGLANG_YARN_KEY] == pytest.approx(
            params["attention_factor"], rel=1e-12)
        edited = {**params, config.SGLANG_YARN_KEY: 1.0}
        with pytest.raises(ValueError, match="yarn's attn_factor .* does not match attention_factor .* the engines "
                                             "would serve different models"):
            config.read(edited, written.max_position_embeddings, written.entry, 64)
        assert "stock SGLang drops YaRN's attention_factor" in config.stock_sglang_misreads(
            {k: v for k, v in params.items() if k != config.SGLANG_YARN_KEY})
