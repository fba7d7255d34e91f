"""ropescale.hf: patched Llama-family models against native transformers, the pre-RoPE cache,
dynamic methods, ReRoPE, training, torch.compile, DDP, and the rope types registered in transformers."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from ropescale import hf, ops, scaling  # noqa: E402
from support import TESTS  # noqa: E402
from support.tiny_lm import FAMILIES, STATIC, VOCAB, ids, tiny  # noqa: E402

warnings.filterwarnings("ignore", message=".*rope.*")


# ---------------------------------------------------------------------------------------------
# static methods: patched == native


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method", sorted(STATIC))
def test_static_patched_equals_native(family, method):
    params = STATIC[method]
    native = tiny(family, params)
    patched = hf.patch(tiny(family), params)  # same weights (same seed), plain rope config, patched
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(patched(x).logits, native(x).logits, atol=1e-5, rtol=0)
        # with a cache: prefill, then token by token
        c_native, c_patched = DynamicCache(config=native.config), DynamicCache(config=patched.config)
        a = native(x[:, :30], past_key_values=c_native).logits
        b = patched(x[:, :30], past_key_values=c_patched).logits
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        for t in range(30, 40):
            a = native(x[:, t:t + 1], past_key_values=c_native).logits
            b = patched(x[:, t:t + 1], past_key_values=c_patched).logits
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ("yarn", "llama3", "default"))
def test_static_generate_identical_tokens(method):
    native = tiny("llama", STATIC[method])
    patched = hf.patch(tiny("llama"), STATIC[method])
    x = ids(length=12)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(x, **kw), native.generate(x, **kw))


def test_static_patch_with_pre_rope_cache_matches_native():
    native = tiny("llama", STATIC["yarn"])
    patched = hf.patch(tiny("llama"), STATIC["yarn"])
    x = ids(length=12)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(x, past_key_values=hf.PreRopeCache(), **kw), native.generate(x, **kw))


# ---------------------------------------------------------------------------------------------
# dynamic methods: the pre-RoPE cache rotates every key with the current table


def _incremental_vs_recompute(model, x, prefill, cache_factory):
    worst = 0.0
    with torch.no_grad():
        cache = cache_factory()
        model(x[:, :prefill], past_key_values=cache)
        for t in range(prefill, x.shape[1]):
            step = model(x[:, t:t + 1], past_key_values=cache).logits[:, 0]
            full = model(x[:, :t + 1], use_cache=False).logits[:, -1]
            worst = max(worst, (step - full).abs().max().item())
    return worst


@pytest.mark.parametrize("method,native_params", [
    (scaling.DynamicNTK(factor=2.0, original_max_position=16), {"rope_type": "dynamic", "factor": 2.0}),
    (scaling.DynamicYaRN(original_max_position=16),
     {"rope_type": "dynamic_yarn", "original_max_position_embeddings": 16}),
])
def test_dynamic_with_pre_rope_cache_equals_recompute(method, native_params):
    # One layer: each step's attention sees every key rotated by the current table, exactly as a
    # full recomputation does. (With several layers, earlier tokens' deeper hidden states were computed
    # under an earlier scale: no KV cache avoids that; see the next test.)
    x = ids(length=48)
    patched = hf.patch(tiny("llama", layers=1, mpe=16), method)
    assert _incremental_vs_recompute(patched, x, 8, hf.PreRopeCache) < 1e-5
    # transformers' native dynamic path caches rotated keys: stale once the table changes.
    native = tiny("llama", native_params, layers=1, mpe=16)
    native_error = _incremental_vs_recompute(native, x, 8, lambda: DynamicCache(config=native.config))
    print(f"native dynamic cache error {native_error:.3g}")
    assert native_error > 1e-3


def test_dynamic_multilayer_pre_rope_cache_beats_native_cache():
    x = ids(length=48)
    patched = hf.patch(tiny("llama", layers=3, mpe=16), scaling.DynamicYaRN(original_max_position=16))
    native = tiny("llama", {"rope_type": "dynamic_yarn", "original_max_position_embeddings": 16}, layers=3, mpe=16)
    ours = _incremental_vs_recompute(patched, x, 8, hf.PreRopeCache)
    theirs = _incremental_vs_recompute(native, x, 8, lambda: DynamicCache(config=native.config))
    print(f"3 layers: pre-RoPE cache error {ours:.3g}, native cache error {theirs:.3g}")
    assert ours < theirs / 3


DYNAMIC_IN_A_BATCH = {
    "dynamic_yarn": (scaling.DynamicYaRN(original_max_position=16), {}),
    "dynamic_ntk": (scaling.DynamicNTK(factor=2.0, original_max_position=16), {}),
    "rerope_dynamic_yarn": (scaling.DynamicYaRN(original_max_position=16), {"attention": "rerope", "window": 6}),
}


@pytest.mark.parametrize("case", sorted(DYNAMIC_IN_A_BATCH))
def test_dynamic_batch_rows_get_the_scale_of_their_own_length(case):
    # issue 16.7: a 9-token prompt batched (left padding) with a 40-token one got the 40-token scale.
    method, attention = DYNAMIC_IN_A_BATCH[case]
    model = hf.patch(tiny("llama", layers=2, mpe=16), method, **attention)
    long, short = ids(1, 40, seed=5), ids(1, 9, seed=6)
    batch, mask = long.repeat(2, 1), torch.ones(2, 40, dtype=torch.long)
    batch[1, :31], mask[1, :31] = 0, 0
    batch[1, 31:] = short[0]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    both = model.generate(batch, attention_mask=mask, **kw)
    # (an explicit mask: generate would take the prompt's own 0 tokens for padding)
    alone = model.generate(short, attention_mask=torch.ones_like(short), **kw)
    assert torch.equal(both.sequences[1, 40:], alone.sequences[0, 9:])
    torch.testing.assert_close(torch.stack(both.logits)[:, 1], torch.stack(alone.logits)[:, 0], atol=1e-4, rtol=0)
    alone_long = model.generate(long, attention_mask=torch.ones_like(long), **kw)
    torch.testing.assert_close(torch.stack(both.logits)[:, 0], torch.stack(alone_long.logits)[:, 0], atol=1e-4, rtol=0)


def test_dynamic_patch_compiles_with_graph_breaks_and_says_why_fullgraph_cannot():
    # issue 16.14: fullgraph=True died on a data-dependent shape deep in the patch.
    model = hf.patch(tiny("llama", layers=1, mpe=16), scaling.DynamicYaRN(original_max_position=16))
    x = ids(length=24)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x, use_cache=False).logits
        compiled = torch.compile(model, backend="eager")(x, use_cache=False).logits
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="ropescale: a length-dependent table.*fullgraph=False"):
            torch.compile(model, backend="eager", fullgraph=True)(x, use_cache=False)
    torch._dynamo.reset()


def test_dynamic_patch_works_with_generate_default_cache():
    # generate() makes its own DynamicCache: a patched model converts its empty layers to pre-RoPE ones.
    model = hf.patch(tiny("llama", layers=1, mpe=16), scaling.DynamicNTK(factor=2.0, original_max_position=16))
    out = model.generate(ids(length=8), max_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for t in range(8, 32):
            assert model(out[:, :t], use_cache=False).logits[:, -1].argmax(-1).tolist() == out[:, t].tolist()


def test_rotated_cache_is_rejected_by_pre_rope_patch():
    model = hf.patch(tiny("llama"), scaling.DynamicNTK(factor=2.0, original_max_position=16))
    cache = DynamicCache(config=model.config)
    unpatched = tiny("llama")
    with torch.no_grad():
        unpatched(ids(length=4), past_key_values=cache)  # now holds rotated keys
        with pytest.raises(TypeError, match="holds rotated keys"):
            model(ids(length=1), past_key_values=cache)


def test_pre_rope_cache_needs_a_patched_model():
    with pytest.raises(RuntimeError, match="patched by ropescale.hf.patch"):
        with torch.no_grad():
            tiny("llama")(ids(length=4), past_key_values=hf.PreRopeCache())


# ---------------------------------------------------------------------------------------------
# ReRoPE


@pytest.mark.parametrize("family", ("llama", "qwen3"))
@pytest.mark.parametrize("leaky_k,logn", ((0.0, 0), (16.0, 0), (0.0, 16)))
def test_rerope_incremental_equals_full_forward(family, leaky_k, logn):
    model = hf.patch(tiny(family), None, attention="rerope", window=8, leaky_k=leaky_k, logn_length=logn)
    x = ids(length=40)
    with torch.no_grad():
        cache = hf.PreRopeCache()
        full = model(x, use_cache=False).logits
        torch.testing.assert_close(model(x[:, :10], past_key_values=cache).logits, full[:, :10], atol=1e-5, rtol=0)
        for t in range(10, 40):
            step = model(x[:, t:t + 1], past_key_values=cache).logits[:, 0]
            torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=0)


def test_rerope_with_large_window_is_plain_rope():
    plain = tiny("llama")
    rerope = hf.patch(tiny("llama"), None, attention="rerope", window=64)
    x = ids(length=40)
    with torch.no_grad():
        torch.testing.assert_close(rerope(x).logits, plain(x).logits, atol=1e-5, rtol=0)


def test_rerope_batch_generation_with_left_padding():
    model = hf.patch(tiny("llama"), None, attention="rerope", window=4)
    a, b = ids(1, 12, seed=3), ids(1, 7, seed=4)
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 5:], mask[1, 5:] = b[0], 1
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(batch, attention_mask=mask, past_key_values=hf.PreRopeCache(), **kw)
    alone_a = model.generate(a, past_key_values=hf.PreRopeCache(), **kw)
    alone_b = model.generate(b, past_key_values=hf.PreRopeCache(), **kw)
    assert torch.equal(out[0, 12:], alone_a[0, 12:])
    assert torch.equal(out[1, 12:], alone_b[0, 7:])


# Every mask format transformers builds. ReRoPE never calls the implementation's kernel (it runs
# rerope_attention), only the mask transformers makes for it, so setting the config's implementation
# tests flash's 2-D mask without the flash-attn package.
@pytest.mark.parametrize("implementation", ("eager", "sdpa", "flex_attention", "flash_attention_2"))
def test_rerope_left_padding_under_every_attention_implementation(implementation):
    # issue 16.1: flex (a BlockMask) and flash (a 2-D mask) were read as "no padding": 0.54 off.
    model = tiny("llama", layers=1)
    model.config._attn_implementation = implementation
    hf.patch(model, None, attention="rerope", window=4)
    long, short = ids(1, 12, seed=3), ids(1, 7, seed=4)
    batch, mask = torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 5:], mask[1, 5:] = short[0], 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        both = model(batch, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(both[1, 5:], model(short).logits[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(both[0], model(long).logits[0], atol=1e-5, rtol=0)


def test_rerope_refuses_an_attention_implementation_whose_mask_it_cannot_read():
    model = tiny("llama", layers=1)
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="ReRoPE attention reads padding from the attention mask.*'paged|sdpa'"):
        hf.patch(model, None, attention="rerope", window=4)
    assert not hf.is_patched(model)
    model.config._attn_implementation = "sdpa"
    hf.patch(model, None, attention="rerope", window=4)
    model.config._attn_implementation = "paged|sdpa"  # changed after patching: refused at the forward
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"), torch.no_grad():
        model(ids(1, 5))


# ---------------------------------------------------------------------------------------------
# the pre-RoPE cache's layers: buffers that grow by doubling, transformers' layer API


def test_pre_rope_cache_decode_step_copies_only_its_tokens(bytes_written):
    model = hf.patch(tiny("llama", layers=2, mpe=16), scaling.DynamicNTK(factor=2.0, original_max_position=16))
    x = ids(length=60)
    cache = hf.PreRopeCache()
    with torch.no_grad():
        model(x[:, :40], past_key_values=cache)
        pointers = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr())
                    for layer in cache.layers]
        for t in range(40, 60):
            model(x[:, t:t + 1], past_key_values=cache)
        # The buffers (capacity 256) were written in place: no step reallocated them.
        assert [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr())
                for layer in cache.layers] == pointers
        assert cache.get_seq_length() == 60 and cache.layers[0].keys.shape == (2, 2, 60, 16)
        # One step through transformers' Cache.update writes the step's k, v and positions, not the cache.
        k, v, p = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), torch.tensor([[60]])
        with bytes_written:
            keys, values = cache.update(k, v, 0, {"positions": p})
    step = 2 * k.numel() * k.element_size() + 2 * 8
    assert step <= bytes_written.total <= step + 2 * 8, bytes_written.ops  # (+ positions cast to int64)
    assert bytes_written.total < keys.numel() * keys.element_size() / 10
    assert keys.data_ptr() == pointers[0][0] and torch.equal(keys[:, :, -1:], k) and torch.equal(values[:, :, -1:], v)
    assert cache.positions(0)[:, -1].tolist() == [60, 60]


def _filled_hf_cache(batch=3, length=9, layers=2, seed=0):
    """A hf.PreRopeCache filled through Cache.update, and per layer the same (keys, values, positions) as tensors."""
    g = torch.Generator().manual_seed(seed)
    cache, expected = hf.PreRopeCache(), []
    for layer in range(layers):
        k, v = torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)
        p = torch.randint(0, 50, (batch, length), generator=g)
        with torch.no_grad():
            cache.update(k[:, :, :5], v[:, :, :5], layer, {"positions": p[:, :5]})  # prefill, then decode steps
            for t in range(5, length):
                cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], layer, {"positions": p[:, t:t + 1]})
        expected.append((k, v, p))
    return cache, expected


def _assert_cache_holds(cache, expected):
    for i, (layer, (k, v, p)) in enumerate(zip(cache.layers, expected)):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v), i
        assert torch.equal(layer.positions, p) and torch.equal(cache.positions(i), p), i
        assert layer.get_seq_length() == k.shape[2] == cache.get_seq_length(i)
        assert cache.get_mask_sizes(1, i) == (k.shape[2] + 1, 0)


def _then_one_more_token(cache, expected, seed=5):
    """Appends one token to every layer; returns the expected tensors after it."""
    after = []
    for i, (k, v, p) in enumerate(expected):
        g = torch.Generator().manual_seed(seed + i)
        nk, nv = torch.randn(k.shape[0], 2, 1, 4, generator=g), torch.randn(k.shape[0], 2, 1, 4, generator=g)
        np_ = torch.full((k.shape[0], 1), 99)
        with torch.no_grad():
            keys, values = cache.update(nk, nv, i, {"positions": np_})
        assert torch.equal(keys, torch.cat((k, nk), 2)) and torch.equal(values, torch.cat((v, nv), 2))
        after.append((torch.cat((k, nk), 2), torch.cat((v, nv), 2), torch.cat((p, np_), 1)))
    return after


@pytest.mark.parametrize("op,apply", [
    ("crop(-3)", lambda t: t[..., :-3, :] if t.dim() == 4 else t[:, :-3]),
    ("crop(-20)", lambda t: t[..., :0, :] if t.dim() == 4 else t[:, :0]),
    ("crop(0)", lambda t: t),
    ("batch_select_indices(tensor)", lambda t: t[torch.tensor([2, 0])]),
    ("batch_select_indices(list)", lambda t: t[[1, 1, -1]]),
    ("batch_select_indices(mask)", lambda t: t[torch.tensor([True, False, True])]),
    ("batch_select_indices(slice)", lambda t: t[1:]),
    ("batch_repeat_interleave", lambda t: t.repeat_interleave(3, dim=0)),
    ("reorder_cache", lambda t: t.index_select(0, torch.tensor([1, 1, 0]))),
])
def test_pre_rope_cache_layer_ops_keep_keys_values_positions_together(op, apply):
    cache, expected = _filled_hf_cache()
    _assert_cache_holds(cache, expected)
    {
        "crop(-3)": lambda: cache.crop(-3),
        "crop(-20)": lambda: cache.crop(-20),
        "crop(0)": lambda: cache.crop(0),
        "batch_select_indices(tensor)": lambda: cache.batch_select_indices(torch.tensor([2, 0])),
        "batch_select_indices(list)": lambda: cache.batch_select_indices([1, 1, -1]),
        "batch_select_indices(mask)": lambda: cache.batch_select_indices(torch.tensor([True, False, True])),
        "batch_select_indices(slice)": lambda: cache.batch_select_indices(slice(1, None)),
        "batch_repeat_interleave": lambda: cache.batch_repeat_interleave(3),
        "reorder_cache": lambda: cache.reorder_cache(torch.tensor([1, 1, 0])),
    }[op]()
    expected = [tuple(apply(t) for t in layer) for layer in expected]
    _assert_cache_holds(cache, expected)
    _assert_cache_holds(cache, _then_one_more_token(cache, expected))  # and decoding goes on from there


def test_pre_rope_cache_layer_api_edges():
    cache, expected = _filled_hf_cache()
    layer = cache.layers[0]
    with pytest.raises(ValueError, match="positive value"):  # DynamicLayer's rule
        cache.crop(2)
    with pytest.raises(AttributeError, match="cannot be assigned"):
        layer.keys = torch.zeros(3, 2, 9, 4)
    with pytest.raises(AttributeError):
        layer.positions = torch.zeros(3, 9, dtype=torch.long)
    with pytest.raises(IndexError):
        cache.reorder_cache(torch.tensor([0, 3]))
    _assert_cache_holds(cache, expected)  # refused calls change nothing
    assert [k.shape for k, _ in ((layer.keys, layer.values) for layer in cache.layers)] == [(3, 2, 9, 4)] * 2
    layer.offload(), layer.prefetch()  # same device: nothing moves
    _assert_cache_holds(cache, expected)
    cache.reset()
    assert layer.keys is None and layer.values is None and layer.positions is None
    assert not layer.is_initialized and cache.get_seq_length() == 0 and cache.get_mask_sizes(4, 0) == (4, 0)
    cache.crop(-1), cache.batch_repeat_interleave(2), cache.batch_select_indices([0]), cache.reorder_cache(
        torch.tensor([0]))  # no-ops on an empty layer, as for DynamicLayer
    # A reset layer starts over with any batch size; early initialization gives [B, H, 0, D] views.
    layer.lazy_initialization(torch.zeros(4, 2, 0, 4), torch.zeros(4, 2, 0, 4))
    assert layer.keys.shape == (4, 2, 0, 4) and layer.positions.shape == (4, 0) and layer.get_seq_length() == 0
    with torch.no_grad():
        keys, _ = cache.update(torch.ones(4, 2, 3, 4), torch.ones(4, 2, 3, 4), 0, {"positions": torch.arange(3)[None]})
    assert keys.shape == (4, 2, 3, 4) and cache.positions(0).tolist() == [[0, 1, 2]] * 4


def test_pre_rope_cache_gradients_through_cached_steps():
    # With grad mode on the cache updates out of place, so a backward through several cached steps
    # (keys saved for backward at each) equals the one through a full forward (static YaRN: the
    # cached steps compute the same logits).
    torch.manual_seed(0)
    stepped, full = (hf.patch(tiny("llama"), STATIC["yarn"]).train() for _ in range(2))
    x = ids(length=24)
    cache = hf.PreRopeCache()
    logits = [stepped(x[:, :16], past_key_values=cache).logits]
    for t in range(16, 24):
        logits.append(stepped(x[:, t:t + 1], past_key_values=cache).logits)
    weights = torch.randn(2, 24, VOCAB)
    (torch.cat(logits, 1) * weights).sum().backward()
    (full(x, use_cache=False).logits * weights).sum().backward()
    for (name, a), (_, b) in zip(full.named_parameters(), stepped.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_beam_search_with_pre_rope_cache():
    # Beam search reorders the cache every step (reorder_cache); the tokens equal the native model's
    # (static YaRN) and a dynamic model's without a cache (one layer: the cache is then exact).
    native = tiny("llama", STATIC["yarn"])
    patched = hf.patch(tiny("llama"), STATIC["yarn"])
    x = ids(length=12)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, num_beams=3)
    assert torch.equal(patched.generate(x, past_key_values=hf.PreRopeCache(), **kw), native.generate(x, **kw))
    dynamic = hf.patch(tiny("llama", layers=1, mpe=16), scaling.DynamicNTK(factor=2.0, original_max_position=16))
    kw.update(max_new_tokens=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(dynamic.generate(ids(length=8), past_key_values=hf.PreRopeCache(), **kw),
                           dynamic.generate(ids(length=8), use_cache=False, **kw))


@pytest.mark.cuda
def test_pre_rope_cache_layer_offload_and_prefetch_cuda():
    cache, expected = _filled_hf_cache()
    moved = hf.PreRopeCache()
    for i, (k, v, p) in enumerate(expected):
        with torch.no_grad():
            moved.update(k.cuda(), v.cuda(), i, {"positions": p.cuda()})
    layer = moved.layers[0]
    layer.offload()
    torch.cuda.synchronize()
    assert layer.keys.device.type == layer.values.device.type == layer.positions.device.type == "cpu"
    _assert_cache_holds(moved, expected)
    layer.prefetch()
    torch.cuda.synchronize()
    assert layer.keys.is_cuda and layer.values.is_cuda and layer.positions.is_cuda
    assert torch.equal(layer.keys.cpu(), expected[0][0]) and torch.equal(layer.positions.cpu(), expected[0][2])


# ---------------------------------------------------------------------------------------------
# rope types registered in transformers


def test_resonance_yarn_config_loads_and_runs_patched_or_not():
    params = {"rope_type": "resonance_yarn", "factor": 8.0, "original_max_position_embeddings": 16}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=1, num_attention_heads=4, head_dim=16,
                                      rope_parameters=params)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    expected = scaling.YaRN(factor=8.0, original_max_position=16, resonance=True).inv_freq(16, 10000.0)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)
    x = ids(length=20)
    with torch.no_grad():
        unpatched = model(x).logits
        hf.patch(model)  # keeps the config's own method
        torch.testing.assert_close(model(x).logits, unpatched, atol=1e-5, rtol=0)


def test_bad_rope_parameters_get_ropescale_errors_at_load():
    # transformers wraps the validator's ValueError in its config-validation error, message kept.
    with pytest.raises(Exception, match=r"YaRN: beta_fast \(1\) must be greater than beta_slow \(2\)"):
        tiny("llama", {"rope_type": "resonance_yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                       "beta_fast": 1.0, "beta_slow": 2.0})


# ---------------------------------------------------------------------------------------------
# training, compile, patch/unpatch contract


def test_yarn_gradients_equal_native():
    native = tiny("llama", STATIC["yarn"]).train()
    patched = hf.patch(tiny("llama"), STATIC["yarn"]).train()
    x = ids(length=24)
    for model in (native, patched):
        model(x, labels=x).loss.backward()
    for (name, a), (_, b) in zip(native.named_parameters(), patched.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("leaky_k", [0.0, 16.0])
def test_rerope_training_gradients_equal_naive_reference(monkeypatch, leaky_k):
    """A patched ReRoPE model trains (the fused op has no backward; the patch takes the training path,
    ``ops.rerope_attention_train``, when gradients are wanted): its gradients equal those of the same
    model whose attention is Su's plain-PyTorch two-matrix form."""
    from ropescale import rerope

    x = ids(length=24)
    grads = []
    for attention in ("train", "naive"):
        if attention == "naive":
            monkeypatch.setattr(ops, "rerope_attention_train", rerope.rerope_attention_naive)
        model = hf.patch(tiny("llama"), None, attention="rerope", window=8, leaky_k=leaky_k).train()
        model(x, labels=x).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # inference still takes the fused op, which has no backward
        model(x)


def test_torch_compile_of_patched_model_matches_eager():
    model = hf.patch(tiny("llama"), STATIC["yarn"])
    x = ids(length=24)
    with torch.no_grad():
        eager = model(x, use_cache=False).logits
        compiled = torch.compile(model)(x, use_cache=False).logits
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)


def test_unpatch_restores_exactly_and_patch_twice_is_an_error():
    plain = tiny("llama")
    model = tiny("llama")
    x = ids()
    hf.patch(model, STATIC["yarn"])
    with pytest.raises(RuntimeError, match="already patched"):
        hf.patch(model, STATIC["linear"])
    hf.unpatch(model)
    assert not hf.is_patched(model)
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain(x).logits)
    with pytest.raises(RuntimeError, match="not patched"):
        hf.unpatch(model)


def test_unsupported_model_gets_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TypeError, match=r"model_type .gpt2.\); ropescale patches Llama, Mistral, .*Gemma 3"):
        hf.patch(model)


def test_bad_patch_arguments():
    with pytest.raises(ValueError, match="needs window, an integer > 0, got 0"):
        hf.patch(tiny("llama"), attention="rerope", window=0)
    with pytest.raises(ValueError, match="leaky_k must be 0 .* or a finite number >= 1, got 0.5"):
        hf.patch(tiny("llama"), attention="rerope", window=4, leaky_k=0.5)
    with pytest.raises(ValueError, match="attention must be one of 'sdpa', 'rerope', 'self_extend', 'dual_chunk', 'string', got 'flash'"):
        hf.patch(tiny("llama"), attention="flash")
    with pytest.raises(ValueError, match="window applies to attention='rerope' or 'self_extend' only; "
                                         "attention='sdpa' takes no parameters"):
        hf.patch(tiny("llama"), window=4)
    with pytest.raises(TypeError, match="scaling must be"):
        hf.patch(tiny("llama"), scaling=3)


@pytest.mark.parametrize("scaling_arg,attention,message", [
    # issue 16.12: these were accepted, written into the config, and failed at the first forward.
    (scaling.Default(), {"attention": "rerope", "window": 2.5}, "window, an integer > 0, got 2.5"),
    (scaling.Default(), {"attention": "rerope", "window": True}, "window, an integer > 0, got True"),
    (scaling.Default(), {"attention": "rerope", "window": 4, "logn_length": 1}, "logn_length must be 0 .* got 1"),
    (scaling.Default(), {"attention": "rerope", "window": 4, "logn_length": -3}, "logn_length must be 0 .* got -3"),
    (scaling.Default(), {"attention": "rerope", "window": 4, "leaky_k": float("inf")}, "leaky_k must be .* got inf"),
    (scaling.Default(), {"attention": "rerope", "window": 4, "leaky_k": float("nan")}, "leaky_k must be .* got nan"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 16}, {},
     "YaRN: factor must be a finite number >= 1, got 0.5"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 16}, {}, "rope_type 'yarn' needs factor"),
    ({"rope_type": "yarn", "fator": 4, "original_max_position_embeddings": 16}, {},
     "no parameter 'fator' \\(did you mean 'factor'\\?\\)"),
    ({"rope_type": "dynamic_yarn", "original_max_position_embeddings": 0}, {},
     "DynamicYaRN: original_max_position must be an integer >= 1, got 0"),
])
def test_bad_patch_settings_are_refused_before_the_model_is_touched(scaling_arg, attention, message):
    model = tiny("llama", layers=1)
    before = model.config.to_dict()
    with pytest.raises(ValueError, match=message):
        hf.patch(model, scaling_arg, **attention)
    assert not hf.is_patched(model) and model.config.to_dict() == before


DDP_SCRIPT = textwrap.dedent("""
    import gc, os, sys, warnings
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    warnings.filterwarnings("ignore")
    from support.tiny_lm import tiny, ids, STATIC
    from ropescale import hf
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf.patch(tiny("llama"), STATIC["yarn"]).train()
    x = ids(batch=4, length=16)
    if world > 1:
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        x = x[rank * 2:(rank + 1) * 2]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x, labels=x).loss.backward()
    opt.step()
    module = model.module if world > 1 else model
    if rank == 0:
        torch.save({{k: v.detach() for k, v in module.state_dict().items()}}, {out!r} + str(world))
    if world > 1:
        # Free DDP (its reducer's gloo work holds Python callbacks) before the group and the
        # interpreter go: a gloo thread that reaches for the GIL during interpreter shutdown is
        # killed by a forced unwind, which aborts the process (seen about 1 run in 6).
        del model, module, opt
        gc.collect()
        dist.destroy_process_group()
""")


def test_ddp_two_processes_match_single_process(tmp_path):
    script = tmp_path / "ddp_step.py"
    out = str(tmp_path / "params")
    script.write_text(DDP_SCRIPT.format(tests=str(TESTS), out=out))
    python_dir = os.path.dirname(os.path.dirname(ops.__file__))  # the tree's python/, or site-packages
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", PYTHONPATH=python_dir)
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), WORLD_SIZE="2"))
             for r in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    subprocess.run([sys.executable, str(script)], env=dict(env, RANK="0", WORLD_SIZE="1"), check=True, timeout=300)
    # Mean of the two half-batch losses' gradients == the full batch's (equal halves), so the
    # parameters after one SGD step agree.
    two, one = torch.load(out + "2"), torch.load(out + "1")
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=1e-5, msg=key)
