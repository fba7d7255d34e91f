"""Every family of ``ropescale.hf.architectures`` on a tiny random model built from its config class (no
downloads): ropescale's static methods equal transformers' own model of that method; pre-RoPE methods equal the
static model they must be (per-request Dynamic YaRN is the static YaRN of its scale, through the cache); ReRoPE
equals a float64 reference of the layer; a checkpoint round-trips through plain transformers + ``import
ropescale.hf``; and what a family's layers cannot take is refused naming the layer kind. The docs' family
table is these tests' result."""

import importlib
import math
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropescale import config as config_lib, hf, ops, scaling  # noqa: E402
from ropescale.hf import architectures  # noqa: E402

from support.attention import reference  # noqa: E402
from ropescale.tiny_models import COMMON, ORIGINAL, PER_LAYER_TYPE, TINY, VOCAB, build, stream_positions  # noqa: E402
from support.methods import instance, registered  # noqa: E402
from support.training import assert_autocast_as_close_as_native, loss_and_grads  # noqa: E402

LENGTH = 40
ARCHS = {arch.name: arch for arch in architectures.ARCHITECTURES}
PRE_ROPE = sorted(name for name, arch in ARCHS.items() if arch.pre_rope is None)
RE_ROPE = [name for name in PRE_ROPE if ARCHS[name].rerope is None]
# the families a per-request method (rotated at write: each row's cos/sin of its table) patches
PER_REQUEST = sorted(name for name, arch in ARCHS.items() if arch.per_request is None)
# (family, method) pairs a family's layers refuse
REFUSED = sorted([(name, "dynamic_yarn") for name, arch in ARCHS.items() if arch.pre_rope]
                 + [(name, "rerope") for name, arch in ARCHS.items() if arch.pre_rope or arch.rerope])


def test_every_family_has_a_test_config():
    assert set(TINY) == set(ARCHS)


def refused_by_transformers(name, params) -> bool:
    """Whether transformers itself refuses (or cannot run) the family with these rope parameters."""
    try:
        output(build(name, params), ids(batch=1, length=4))
    except Exception:  # noqa: BLE001 (the config class's validators raise their own error types)
        return True
    return False


def misread_by_transformers(name, params) -> bool:
    """Whether transformers' own model runs other parameters than these: its yarn reads ``truncate`` from the top
    level of rope_parameters, which a per-layer-type config keys by layer type (hf.patch refuses it there)."""
    return name in PER_LAYER_TYPE and params.get("rope_type") == "yarn" and params.get("truncate") is False


def same_weights(model, like):
    model.load_state_dict(like.state_dict())
    return model


def ids(batch=2, length=LENGTH, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def output(model, x, **kwargs):
    with torch.no_grad():
        out = model(x, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def pairs(name):
    """The rotary pairs of the family's extended layers (Gemma 4's full layers have a head dim of their own)."""
    fields = {**COMMON, **TINY[name][2]}
    dim = fields.get("qk_rope_head_dim", fields.get("global_head_dim", fields["head_dim"]))
    return int(dim * fields.get("partial_rotary_factor", 1.0)) // 2


def static_cases():
    """(family, method name, rope_parameters): every static table transformers implements, Resonance on YaRN (a
    type ``import ropescale.hf`` registers), YaRN with ``truncate=False`` and DeepSeek's mscale pair, on every
    family."""
    cases = []
    for name in sorted(TINY):
        for method, cls in sorted(registered(transformers_native=True, dynamic=False).items()):
            cases.append((name, method, instance(cls, pairs=pairs(name), original=ORIGINAL).to_hf()))
        cases.append((name, "resonance_yarn", {"rope_type": "resonance_yarn", "factor": 4.0,
                                               "original_max_position_embeddings": ORIGINAL}))
        cases.append((name, "yarn_truncate_mscale", {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                                     "original_max_position_embeddings": ORIGINAL, "mscale": 0.707,
                                                     "mscale_all_dim": 1.0}))
    return cases


@pytest.mark.parametrize("name,method,params", static_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_static_method_equals_transformers_own_model(name, method, params):
    arch = ARCHS[name]
    # Phi-3's config takes default and longrope only; Ministral 3's temperature needs an original length; Gemma 4's
    # config refuses longrope (its validator reads the global head_dim); per-layer-type configs lose yarn's truncate
    if refused_by_transformers(name, params) or misread_by_transformers(name, params):
        with pytest.raises(ValueError, match=re.escape(f"patch: {name}")):
            hf.patch(build(name), scaling.from_hf(params, 64))
        return
    native = build(name, params)
    x = ids()
    if arch.fixed_method:  # the model is built from its config: patch(model) keeps it, another method is refused
        with pytest.raises(ValueError, match=f"{name} takes only the method its config holds"):
            hf.patch(same_weights(build(name), native), scaling.from_hf(params, 64))
        model, method_to_patch = native, None
    else:
        model, method_to_patch = same_weights(build(name), native), scaling.from_hf(params, 64)
    before = output(model, x)
    method_obj = scaling.from_hf(params, 64)
    if not arch.cat_layout and method_obj.length_dependent:
        with pytest.raises(ValueError, match="switches its table with the length"):
            hf.patch(model, method_to_patch)
        return
    hf.patch(model, method_to_patch)
    torch.testing.assert_close(output(model, x), output(native, x), rtol=1e-5, atol=2e-5)
    if method_to_patch is not None and method != "default":  # the test can fail: the method changes the model
        assert (output(model, x) - before).abs().max() > 1e-4
    hf.unpatch(model)
    torch.testing.assert_close(output(model, x), before, rtol=0, atol=0)


@pytest.mark.parametrize("name", PER_REQUEST)
def test_per_request_dynamic_yarn_is_the_static_yarn_of_its_scale_through_the_cache(name):
    """A request of P + N tokens through the model's own cache (keys rotated when written) is transformers' own
    model with static YaRN at s = (P + N)/L, at every step: each row's cos/sin in the family's layout (gpt-oss's half
    width, a multimodal rope's three position streams: each pair at its own stream's), the extended layer types
    (Gemma 3: its full layers only; its sliding layers keep their rope), sinks and sliding windows (gpt-oss)."""
    prompt, new = 24, 8
    factor = (prompt + new) / ORIGINAL
    if refused_by_transformers(name, {"rope_type": "yarn", "factor": factor,
                                      "original_max_position_embeddings": ORIGINAL}):
        with pytest.raises(ValueError, match="refuses the rope_parameters this method writes"):
            hf.patch(build(name), scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
        return
    reference = build(name, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": ORIGINAL})
    model = hf.patch(same_weights(build(name), reference),
                     scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
    x = ids(batch=1, length=prompt + new)
    streams = multimodal_positions(name, prompt + new)
    at = ({} if streams is None else {"position_ids": streams})
    full = output(reference, x, **at)

    def step(start, end):  # the tokens [start, end) and their positions (every stream's, under a multimodal rope)
        return {"position_ids": streams[..., start:end]} if streams is not None else {}

    with torch.no_grad(), hf.request(model, max_new_tokens=new):
        cache = transformers.DynamicCache(config=model.config)
        out = output(model, x[:, :prompt], past_key_values=cache, **step(0, prompt))
        torch.testing.assert_close(out, full[:, :prompt], rtol=1e-5, atol=2e-5)
        for t in range(prompt, prompt + new):
            out = output(model, x[:, t:t + 1], past_key_values=cache, **step(t, t + 1))[:, 0]
            torch.testing.assert_close(out, full[:, t], rtol=1e-5, atol=2e-5)
    assert (full - output(hf.unpatch(model), x, **at)).abs().max() > 1e-3  # the scale matters at these lengths


def multimodal_positions(name, length):
    """For a multimodal-rope family, position ids ``[3, 1, length]`` whose streams differ
    (``ropescale.tiny_models.stream_positions``), else None."""
    return stream_positions(length)[:, None] if "mrope_section" in TINY[name][2] else None


def _attention_layer(model):
    """The family's first attention module of a full (not sliding) layer."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx"):
            if getattr(module, "sliding_window", None) is None:
                return module
    raise AssertionError("no full attention layer")


def _assert_rerope_layer_is_the_reference(model, name, window, length, inv_freq, factor, monkeypatch):
    """A forward of ``length`` tokens: the first full-attention layer's output equals Su's two-matrix rule in float64
    (``support.attention.reference``, the attention factor on the rotated dims) on the layer's own q, k, v as they
    reach ReRoPE, in the family's pair layout, through its o_proj."""
    layer = _attention_layer(model)
    seen = {}
    handle = layer.register_forward_hook(lambda module, args, result: seen.update(out=result[0]))
    patch_module = importlib.import_module("ropescale.hf.pre_rope")  # where the raw-key attention calls _rerope
    rerope = patch_module._rerope

    def spy(module, state, groups, query, key, value, positions, key_positions, mask, kwargs):
        if module is layer:
            seen.update(q=query, k=key, v=value, qp=positions, kp=key_positions, scale=kwargs["scaling"])
        return rerope(module, state, groups, query, key, value, positions, key_positions, mask, kwargs)

    monkeypatch.setattr(patch_module, "_rerope", spy)
    output(model, ids(batch=1, length=length))
    handle.remove()
    expected, _ = reference(seen["q"], seen["k"], seen["v"], seen["qp"], seen["kp"], inv_freq, window,
                            scale=seen["scale"], interleaved=ARCHS[name].interleaved, factor=factor)
    expected = expected.transpose(1, 2).flatten(2).float()
    torch.testing.assert_close(seen["out"], torch.nn.functional.linear(expected, layer.o_proj.weight, layer.o_proj.bias),
                               rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("name", RE_ROPE)
def test_rerope_layer_equals_float64_reference(name, monkeypatch):
    """One full-attention layer's output under ReRoPE equals Su's two-matrix rule in float64
    (``support.attention.reference``) on the layer's own q, k, v (as they reach ReRoPE), in the family's pair
    layout, through its o_proj."""
    window = 6
    if name == "Phi-3 / Phi-4-mini":  # Phi3Config takes the rope types default and longrope only
        with pytest.raises(ValueError, match="refuses the rope_parameters this method writes"):
            hf.patch(build(name), None, attention="rerope", window=window)
        return
    model = hf.patch(build(name), None, attention="rerope", window=window)
    inv_freq = ops.default_inv_freq(2 * pairs(name), 10000.0, dtype=torch.float64)
    _assert_rerope_layer_is_the_reference(model, name, window, 20, inv_freq, 1.0, monkeypatch)


@pytest.mark.parametrize("name", sorted(TINY))
def test_checkpoint_round_trips_through_plain_transformers(name, tmp_path):
    """patch, save_pretrained, reload with plain transformers + ``import ropescale.hf``, patch(model): equal."""
    arch = ARCHS[name]
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    if name == "Phi-3 / Phi-4-mini":  # its config class takes longrope only
        params = instance(registered()["longrope"], pairs=pairs(name), original=ORIGINAL).to_hf()
        model = hf.patch(build(name), scaling.from_hf(params, 64))
    elif arch.fixed_method:
        model = hf.patch(build(name, params))
    else:
        method = (scaling.DynamicYaRN(original_max_position=ORIGINAL) if arch.pre_rope is None
                  else scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
        model = hf.patch(build(name), method)
    x = ids()
    expected = output(model, x, use_cache=False)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = getattr(transformers, TINY[name][1]).from_pretrained(tmp_path).eval()
    torch.testing.assert_close(output(hf.patch(reloaded), x, use_cache=False), expected, rtol=0, atol=1e-6)
    assert reloaded.config._attn_implementation.startswith("ropescale_")
    assert "ropescale_" not in (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("name,method", REFUSED)
def test_pre_rope_methods_are_refused_naming_the_layer_kind(name, method):
    model = build(name)
    reason = ARCHS[name].pre_rope or ARCHS[name].rerope
    kwargs = ({"scaling": scaling.DynamicYaRN(original_max_position=ORIGINAL)} if method == "dynamic_yarn"
              else {"scaling": None, "attention": "rerope", "window": 8})
    with pytest.raises(ValueError, match=re.escape(f"patch: {name}") + "|" + re.escape(f"cannot patch {name}")) as err:
        hf.patch(model, **kwargs)
    assert reason in str(err.value) or ARCHS[name].fixed_method in str(err.value)
    assert not hf.is_patched(model)


def test_gemma3_extends_only_the_layer_types_named():
    """Gemma 3: the full-attention layers by default, said in the config written; a type it does not have, and
    sliding layers under a pre-RoPE method, refused."""
    model = hf.patch(build("Gemma 3"), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    params = model.config.rope_parameters
    assert params["full_attention"]["rope_type"] == "yarn" and params["sliding_attention"]["rope_type"] == "default"
    hf.unpatch(model)
    with pytest.raises(ValueError, match="layer_types must name some of this config's layer types"):
        hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), layer_types="global")
    with pytest.raises(ValueError, match="sliding-window layers"):
        hf.patch(model, scaling.DynamicYaRN(original_max_position=ORIGINAL), layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="layer_types=.* is for configs whose rope_parameters are per layer type"):
        hf.patch(build("Llama"), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), layer_types="x")


def test_deepseek_v4_takes_the_table_in_every_compress_rotary_and_leaves_its_sliding_layers_alone():
    """DeepSeek-V4 keys its rope by the rope its layers take: ``main`` (sliding layers, theta 1e4) and ``compress``
    (compressed layers, theta 160000: the model's rotary, each compressor's and the indexer's). hf.patch extends
    ``compress`` by default, in every rotary module (the compressors rotate their compressed entries with their own),
    and leaves ``main`` bit for bit; unpatch puts every module back. A checkpoint's flat YaRN (as V4's own config
    writes it: transformers nests it under ``compress`` with attention_factor 1.0, the V4 reference's) is patched as
    its own table: equal to the model. The per-layer-type check, a misnamed type, is refused."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    model = build("DeepSeek-V4")
    rotaries = [m for m in model.modules() if type(m).__name__ == "DeepseekV4RotaryEmbedding"]
    assert len(rotaries) == 4  # the model's, two compressors' and the indexer's
    main, compress = [r.main_inv_freq.clone() for r in rotaries], [r.compress_inv_freq.clone() for r in rotaries]
    x = ids(batch=1)
    before = output(model, x)
    hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    table = ops.yarn_inv_freq(16, 160000.0, 4.0, ORIGINAL, dtype=torch.float32)
    for rotary, own in zip(rotaries, main):
        assert torch.equal(rotary.compress_inv_freq, table) and torch.equal(rotary.main_inv_freq, own)
        assert rotary.compress_attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    assert model.config.rope_parameters["main"] == {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5}
    hf.unpatch(model)
    assert all(torch.equal(r.compress_inv_freq, own) for r, own in zip(rotaries, compress))
    torch.testing.assert_close(output(model, x), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer_types must name some of this config's layer types"):
        hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), layer_types="compressed")
    with pytest.raises(ValueError, match=re.escape(f"cannot patch DeepSeek-V4: {architectures.DEEPSEEK_V4}")):
        hf.patch(model, scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
    assert not hf.is_patched(model)
    # the flat form of V4's checkpoints: nested by its config class, attention factor 1.0 on the compress table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.DeepseekV4Config(**{**COMMON, **TINY["DeepSeek-V4"][2]}, rope_parameters=dict(yarn),
                                               compress_rope_theta=160000.0)
    assert config.rope_parameters["compress"]["attention_factor"] == 1.0
    native = transformers.DeepseekV4ForCausalLM(config).eval()
    patched = hf.patch(same_weights(transformers.DeepseekV4ForCausalLM(config).eval(), native))
    torch.testing.assert_close(output(patched, x), output(native, x), rtol=0, atol=1e-6)
    assert patched.model.rotary_emb.compress_attention_scaling == 1.0


def test_gemma3_rerope_with_soft_capped_logits_is_refused():
    model = build("Gemma 3", attn_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="soft-capped"):
        hf.patch(model, None, attention="rerope", window=8)


# Gemma 4's full layers as its checkpoints have them: proportional, a quarter of the pairs rotated, base 1e6.
GEMMA4_FULL = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}


def test_gemma4_full_layers_take_their_own_head_dim():
    """The extended (full-attention) layers' table is made for THEIR head dim (32: per_layer_config), not the
    config's (16, the sliding layers'): the patched model equals transformers' own, and the table has 16 pairs."""
    from ropescale import config as config_lib
    native = build("Gemma 4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    model = hf.patch(same_weights(build("Gemma 4"), native), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    assert config_lib.head_dim_of(model.config, "full_attention") == 32
    assert config_lib.head_dim_of(model.config, "sliding_attention") == 16
    assert model._ropescale_patch.rotary_dim == 32
    assert model.model.rotary_emb.full_attention_inv_freq.shape == (16,)
    x = ids()
    torch.testing.assert_close(output(model, x), output(native, x), rtol=1e-5, atol=2e-5)


def test_gemma4_proportional_layout():
    """A Gemma 4 whose full layers hold transformers' proportional (partial_rotary_factor 0.25: 4 of 16 pairs
    rotated, the rest at frequency 0): ``patch(model)`` keeps it (equal to the unpatched model); a proportional with
    a factor (interpolation of the rotated pairs) equals transformers' own model of it; a method whose table is
    narrower than the head (YaRN, Dynamic YaRN under partial_rotary_factor 0.25: transformers' own Gemma 4 fails on
    it) is refused saying why."""
    native = build("Gemma 4", GEMMA4_FULL)
    x = ids()
    before = output(native, x)
    model = hf.patch(build("Gemma 4", GEMMA4_FULL))
    torch.testing.assert_close(output(model, x), before, rtol=1e-5, atol=2e-5)
    assert model.config.rope_parameters["full_attention"] == GEMMA4_FULL
    hf.unpatch(model)
    scaled = {**GEMMA4_FULL, "factor": 4.0}
    native = build("Gemma 4", scaled)
    model = hf.patch(same_weights(build("Gemma 4", GEMMA4_FULL), native), scaling.from_hf(scaled, 64))
    torch.testing.assert_close(output(model, x), output(native, x), rtol=1e-5, atol=2e-5)
    assert (output(model, x) - before).abs().max() > 1e-3
    assert model.config.rope_parameters["full_attention"] == {**scaled, "rope_type": "proportional"}
    assert refused_by_transformers("Gemma 4", {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.25,
                                               "original_max_position_embeddings": ORIGINAL})
    for method in (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL),
                   scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")):
        model = build("Gemma 4", GEMMA4_FULL)
        with pytest.raises(ValueError, match=r"makes a table for 8 of the 32 features of Gemma 4's heads .*"
                                             r"applies cos/sin to every feature"):
            hf.patch(model, method)
        assert not hf.is_patched(model) and model.config.rope_parameters["full_attention"] == GEMMA4_FULL


def test_gemma4_rerope_on_the_proportional_table_equals_float64_reference(monkeypatch):
    """ReRoPE over Gemma 4's own proportional table (zero-frequency pairs included): one full layer equals the float64
    reference; with a window past every distance the whole model is transformers' own."""
    window = 6
    model = hf.patch(build("Gemma 4", GEMMA4_FULL), None, attention="rerope", window=window)
    inv_freq = scaling.Proportional(partial_rotary_factor=0.25).inv_freq(32, 1e6, dtype=torch.float64)
    assert int(inv_freq.count_nonzero()) == 4
    _assert_rerope_layer_is_the_reference(model, "Gemma 4", window, 20, inv_freq, 1.0, monkeypatch)
    native = build("Gemma 4", GEMMA4_FULL)
    model = hf.patch(same_weights(build("Gemma 4", GEMMA4_FULL), native), None, attention="rerope", window=1 << 20)
    x = ids(length=30)
    torch.testing.assert_close(output(model, x), output(native, x), rtol=1e-5, atol=2e-5)


def test_gemma4_kv_shared_layers_under_generate():
    """Gemma 4's KV-shared layers (2 and 3) attend the keys of layers 0 and 1; generate runs them on the last query
    only (logits_to_keep=1). Per-request Dynamic YaRN through generate is transformers' own static YaRN of its
    scale at every step: layer 3 rotates layer 1's raw keys with layer 1's cached positions."""
    prompt, new = 24, 8
    reference = build("Gemma 4", {"rope_type": "yarn", "factor": (prompt + new) / ORIGINAL,
                                  "original_max_position_embeddings": ORIGINAL})
    model = hf.patch(same_weights(build("Gemma 4"), reference),
                     scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
    assert model._ropescale_patch.kv_sources == {3: 1}
    queries = []
    handle = model.model.layers[3].self_attn.register_forward_hook(
        lambda module, args, kwargs, result: queries.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    x = ids(batch=1, length=prompt)
    settings = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = model.generate(x, **settings)
        want = reference.generate(x, **settings)
    handle.remove()
    assert queries[0] == 1  # the prompt's KV-shared layers ran its last query only
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=2e-5)


def test_gemma4_rerope_with_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match="bidirectional"):
        hf.patch(build("Gemma 4", use_bidirectional_attention="all"), None, attention="rerope", window=8)


def test_a_patched_model_whose_implementation_changes_is_wrapped_again():
    """set_attn_implementation after patch: the next forward wraps the new implementation (never a silently
    unrotated attention)."""
    model = hf.patch(build("Qwen3"), scaling.DynamicYaRN(original_max_position=ORIGINAL))
    x = ids()
    expected = output(model, x)
    model.set_attn_implementation("eager")
    torch.testing.assert_close(output(model, x), expected, rtol=1e-5, atol=2e-5)
    assert model.config._attn_implementation == "ropescale_eager"
    hf.unpatch(model)
    assert model.config._attn_implementation == "eager"


# A partial-rotary family (GLM-4: 8 of 16 dims rotated, pairs (2i, 2i+1)) under a table whose attention factor m is
# not 1: transformers puts m on cos and sin, the rotated dims of q and k only. (Phi-3's config class takes no ReRoPE
# type: test_rerope_layer_equals_float64_reference; the vLLM plugin serves its LongRoPE: test_vllm_paged.)
PARTIAL_ROTARY = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": instance(registered()["longrope"], pairs=pairs("GLM-4"), original=ORIGINAL).to_hf(),
}


@pytest.mark.parametrize("table", sorted(PARTIAL_ROTARY))
def test_rerope_on_a_partial_rotary_head_puts_the_attention_factor_on_the_rotated_dims(table, monkeypatch):
    """ReRoPE (window 6) over the config's own table: one full-attention layer's output equals the float64
    reference of transformers' rule, ``scale * (m^2 q_rot . k_rot + q_pass . k_pass)`` (m on cos and sin), in the
    family's pair layout, through its o_proj. ropescale's op scales whole scores: hf.patch folds m^2 into the
    query's rotated dims (serving.PreRopePlan.attention_arguments)."""
    window, length = 6, 20
    params = PARTIAL_ROTARY[table]
    name = "GLM-4"
    model = hf.patch(build(name, params), None, attention="rerope", window=window)
    method = scaling.from_hf(params, 64)
    factor = method.attention_factor_for(length)
    assert abs(factor - 1.0) > 0.05  # the test can fail: the factor matters
    assert pairs(name) * 2 < 16  # a partial-rotary head
    inv_freq = method.inv_freq(2 * pairs(name), 10000.0, seq_len=length, dtype=torch.float64)
    _assert_rerope_layer_is_the_reference(model, name, window, length, inv_freq, factor, monkeypatch)


@pytest.mark.parametrize("table", sorted(PARTIAL_ROTARY))
def test_rerope_past_every_distance_on_a_partial_rotary_head_is_transformers_own_model(table):
    """ReRoPE with a window past every distance is RoPE attention: the patched model (the attention factor folded
    into the query's rotated dims) equals transformers' own model of the same table, whose rotary module puts the
    factor on cos and sin, at every position of a batch."""
    params = PARTIAL_ROTARY[table]
    native = build("GLM-4", params)
    model = hf.patch(same_weights(build("GLM-4", params), native), None, attention="rerope", window=1 << 20)
    x = ids(length=30)
    torch.testing.assert_close(output(model, x), output(native, x), rtol=1e-5, atol=2e-5)


def test_ministral3_checkpoints_carry_the_query_temperature_as_vllm_reads_it(tmp_path):
    """Ministral 3: ``llama_4_scaling`` is written beside rope_parameters (vLLM's Mistral reads the temperature from
    it; from a transformers config vLLM served the model without it, 0.07 nats off), and unpatch takes it back."""
    model = hf.patch(build("Ministral 3"), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    assert model.config.llama_4_scaling == {"original_max_position_embeddings": ORIGINAL, "beta": 0.1}
    model.save_pretrained(tmp_path)
    assert '"llama_4_scaling": {' in (tmp_path / "config.json").read_text()
    hf.unpatch(model)
    assert not hasattr(model.config, "llama_4_scaling")
    assert not hasattr(hf.patch(build("Llama"), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)).config,
                       "llama_4_scaling")


def _training_case(name):
    """(transformers' own model of the method, ropescale's patched model with the same weights): Dynamic YaRN per
    step (the table of the batch's length, LENGTH / ORIGINAL) against static YaRN of that scale where the family
    takes pre-RoPE methods; else the static method itself (Phi-3: LongRoPE; DeepSeek: its config's own)."""
    yarn = {"rope_type": "yarn", "factor": LENGTH / ORIGINAL, "original_max_position_embeddings": ORIGINAL}
    if name == "Phi-3 / Phi-4-mini":
        params = instance(registered()["longrope"], pairs=pairs(name), original=ORIGINAL).to_hf()
        native = build(name, params)
        return native, hf.patch(same_weights(build(name), native), scaling.from_hf(params, 64))
    native = build(name, yarn)
    if ARCHS[name].fixed_method:
        return native, hf.patch(same_weights(build(name, yarn), native))
    method = (scaling.DynamicYaRN(original_max_position=ORIGINAL) if ARCHS[name].pre_rope is None
              else scaling.YaRN(factor=LENGTH / ORIGINAL, original_max_position=ORIGINAL))
    return native, hf.patch(same_weights(build(name), native), method)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("name", sorted(TINY))
def test_training_under_autocast_is_as_close_to_float32_as_transformers_own_model(name, dtype):
    """A training step (every token's logprob, every gradient) of the patched model under CPU autocast is as close
    to its float32 step as transformers' own model of the method is to its own: relative error within twice that
    model's (plus float32 rounding). The pre-RoPE families run ropescale's identity rotation and attention-time rotation."""
    native, patched = _training_case(name)
    native.train(), patched.train()
    x = ids(batch=2, length=LENGTH)
    step, native_step = loss_and_grads(patched, x), loss_and_grads(native, x)
    torch.testing.assert_close(step[0], native_step[0], rtol=1e-5, atol=2e-5)  # the same model in float32
    assert_autocast_as_close_as_native(patched, native, x, dtype, step, native_step)


@pytest.mark.parametrize("name", sorted(name for name, arch in ARCHS.items() if arch.pre_rope))
def test_a_pre_rope_cache_is_refused_naming_the_layer_kind(name):
    """A family whose layers cannot take raw keys, patched with a static method, given a ``PreRopeCache``: refused
    with the reason (not served with keys rotated twice, nor the cache's generic message)."""
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    model = (hf.patch(build(name, params)) if ARCHS[name].fixed_method
             else hf.patch(build(name), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)))
    with pytest.raises(ValueError, match=re.escape(f"cannot serve {name}: {ARCHS[name].pre_rope}")):
        output(model, ids(batch=1, length=8), past_key_values=hf.PreRopeCache())


# HunYuan's checkpoints (Hunyuan-7B): NTK-alpha labelled "dynamic", with YaRN's keys and factor 1.0 that no table reads.
HUNYUAN = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
           "mscale_all_dim": 1.0}


def test_hunyuan_ntk_alpha_equals_transformers_own_model_and_extends_to_a_checkpoint_plain_transformers_runs(tmp_path):
    """transformers' own HunYuan reads its checkpoints' ``dynamic`` + ``alpha`` as NTK-alpha, one table at every length
    (modeling_hunyuan_v1_dense.py, transformers 5.23). ``hf.patch(model)`` reads that config as NTK-alpha too (not
    Dynamic NTK, which past max_position_embeddings would grow its base), and ``hf.patch`` with ``NTKAlpha`` equals
    the model to 1e-6 in float32 logits, past max_position_embeddings (80 > 64 tokens); Resonance on it changes the
    model. ``ropescale extend --method ntk_alpha`` writes ``default`` with the scaled base, which plain transformers
    (no ropescale) loads and runs exactly as its own HunYuan of that alpha."""
    name, x = "HunYuan dense", ids(length=80)
    native = build(name, HUNYUAN)
    expected = output(native, x)
    own = hf.patch(same_weights(build(name, HUNYUAN), native))  # the config's own method
    torch.testing.assert_close(output(own, x), expected, rtol=0, atol=1e-6)
    patched = hf.patch(same_weights(build(name), native), scaling.NTKAlpha(alpha=1000.0))
    torch.testing.assert_close(output(patched, x), expected, rtol=0, atol=1e-6)
    assert config_lib.read_config(native.config).method == scaling.NTKAlpha(alpha=1000.0)  # not Dynamic NTK
    other = hf.patch(same_weights(build(name), native), scaling.NTKAlpha(alpha=500.0))
    assert (output(other, x) - expected).abs().max() > 1e-3  # the test can fail: alpha matters
    resonance = hf.patch(same_weights(build(name), native), scaling.NTKAlpha(alpha=1000.0, resonance=True))
    assert (output(resonance, x) - expected).abs().max() > 1e-4

    from ropescale import cli

    native.save_pretrained(tmp_path / "src")
    assert cli.main(["extend", str(tmp_path / "src"), str(tmp_path / "dst"), "--method", "ntk_alpha",
                     "--alpha", "2000"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = transformers.HunYuanDenseV1ForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert reloaded.config.rope_parameters["rope_type"] == "default"
    own_2000 = same_weights(build(name, {**HUNYUAN, "alpha": 2000.0}), native)
    torch.testing.assert_close(output(reloaded, x), output(own_2000, x), rtol=0, atol=0)
    torch.testing.assert_close(output(hf.patch(reloaded), x), output(own_2000, x), rtol=0, atol=1e-6)


# Families that mix NoPE layers (no rotation) with rope layers (config.no_rope_layers), and what each takes: a static
# method, and where the family's layers take them a per-step dynamic method and ReRoPE (raw keys, rotated at
# attention time) and a per-request method (each request's table, keys rotated when written).
NOPE = sorted(name for name, arch in ARCHS.items() if arch.rope_layers)
NOPE_METHODS = {
    "yarn": lambda: {"scaling": scaling.YaRN(factor=LENGTH / ORIGINAL, original_max_position=ORIGINAL)},
    "dynamic_yarn": lambda: {"scaling": scaling.DynamicYaRN(original_max_position=ORIGINAL)},
    "rerope": lambda: {"scaling": None, "attention": "rerope", "window": 1 << 20},
    "per_request": lambda: {"scaling": scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")},
}


def _nope_cases():
    cases = []
    for name in NOPE:
        arch = ARCHS[name]
        for method in NOPE_METHODS:
            raw_keys = method in ("dynamic_yarn", "rerope")
            if (raw_keys and (arch.pre_rope or (method == "rerope" and arch.rerope))
                    or (method == "per_request" and arch.per_request)):
                continue  # refused by name: test_pre_rope_methods_are_refused_naming_the_layer_kind
            cases.append((name, method))
    return cases


@pytest.mark.parametrize("name,method", _nope_cases())
def test_nope_layers_are_untouched_and_rope_layers_take_the_method(name, method):
    """A forward of LENGTH tokens through the patched model: each NoPE layer's attention output is the unpatched
    layer's on the same input, bit for bit (no rotation reaches it, Llama 4's attention temperature included); each
    rope layer's is transformers' own layer of the table the method gives this length (YaRN at LENGTH / ORIGINAL;
    ReRoPE with a window past every distance: the config's own table) on the same input."""
    arch = ARCHS[name]
    table = ({"rope_type": "yarn", "factor": LENGTH / ORIGINAL, "original_max_position_embeddings": ORIGINAL}
             if method != "rerope" else None)
    reference_model = build(name, table)
    model = hf.patch(same_weights(build(name), reference_model), **NOPE_METHODS[method]())
    rotates = getattr(model.config, arch.rope_layers)
    assert 0 in rotates and 1 in rotates  # the test can fail: both kinds of layer are there
    calls = {}

    def keep(module, args, kwargs, result):
        calls[module.layer_idx] = (dict(kwargs), result[0])

    layers = [layer.self_attn for layer in model.model.layers]
    handles = [m.register_forward_hook(keep, with_kwargs=True) for m in layers]
    x = ids()
    output(model, x, use_cache=False)
    for handle in handles:
        handle.remove()
    extended = model._ropescale_patch.extended_layers
    hf.unpatch(model)
    positions = torch.arange(LENGTH)[None].expand(x.shape[0], -1)
    with torch.no_grad():
        for i, module in enumerate(layers):
            kwargs, got = calls[i]
            if not rotates[i]:  # the model's own layer, unpatched
                assert torch.equal(module(**kwargs)[0], got), f"NoPE layer {i} changed"
                if getattr(module, "attn_temperature_tuning", False):  # Llama 4's temperature is in that output
                    module.attn_temperature_tuning = False
                    assert (module(**kwargs)[0] - got).abs().max() > 1e-3
                    module.attn_temperature_tuning = True
                continue
            reference_layer = reference_model.model.layers[i].self_attn
            embeddings = reference_model.model.rotary_emb(kwargs["hidden_states"], positions)
            want = reference_layer(**{**kwargs, "position_embeddings": embeddings})[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
            if method != "rerope":  # the test can fail: the method changes the rope layer
                native = module(**{**kwargs, "position_embeddings": model.model.rotary_emb(kwargs["hidden_states"],
                                                                                           positions)})[0]
                assert (native - got).abs().max() > 1e-4
    assert extended == [i for i, r in enumerate(rotates) if r]


def test_a_model_of_nope_layers_only_is_refused():
    model = build("SmolLM3", no_rope_layers=[0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"no attention layer of this SmolLM3 model rotates \(no_rope_layers is all 0"):
        hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    assert not hf.is_patched(model)
