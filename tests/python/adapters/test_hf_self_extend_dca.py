"""Self-Extend and Dual Chunk Attention (issue 31) and STRING (issue 44) in transformers (docs/DESIGN.md,
"Self-Extend and Dual Chunk Attention", "STRING"): ``hf.patch(model, attention="self_extend" | "dual_chunk" |
"string", ...)`` and a Qwen config's
``dual_chunk_attention_config`` read by ``hf.patch(model)``. Each layer's attention output of a patched tiny model
equals the float64 reference (``support.attention``) over the keys it has seen, in prefill and at every decoding step
of ``generate`` (batched, left padding), DCA's temperature included; decoding equals a prefill of the whole sequence;
checkpoints round-trip (plain transformers refuses them); the config is checked in one place (a table of hostile
entries); Self-Extend trains under autocast as closely as transformers' own model does."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropescale import config as config_lib, hf, ops, scaling  # noqa: E402

from support.attention import reference, reference_dual_chunk, reference_self_extend, reference_string  # noqa: E402
from ropescale.tiny_models import VOCAB, build  # noqa: E402
from support.training import assert_autocast_as_close_as_native, loss_and_grads  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD = 16  # the tiny families' head dim
INV_FREQ = 1.0 / 10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)  # their default table
SE = dict(attention="self_extend", window=4, group=3)  # G does not divide W: the boundary shows
DCA = dict(attention="dual_chunk", chunk_size=12, local_size=4)  # chunks of n = 8: every region by length 17
QWEN_DCA = {"chunk_size": 12, "local_size": 4, "original_max_position_embeddings": 8}
STRING = dict(attention="string", shifted_offset=7, local_value=3)  # far pairs from length 8

def ids(batch=2, length=24, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(x, pads):
    """``x`` with row b's first ``pads[b]`` tokens padding: (input ids, attention mask)."""
    mask = torch.ones_like(x)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return x.masked_fill(mask == 0, 0), mask


# The temperature's coefficient c by source, read off each: vLLM's DCA backend (Qwen's checkpoints) scales by
# 0.1 * log(len / L0) + 1; ChunkLlama's Llama patch (chunkllama_attn_replace.py, get_mscale) by 0.05 * log(scale) + 1.
COEFFICIENTS = {"qwen": 0.1, "chunkllama": 0.05}


def temperature(lengths, original, rule="qwen"):
    """DCA's m(len) = max(1, c ln(len / L0) + 1), float64 (1 everywhere for L0 = 0)."""
    if not original:
        return torch.ones_like(lengths, dtype=torch.float64)
    return (COEFFICIENTS[rule] * torch.log(lengths.double() / original) + 1).clamp_min(1.0)


def chunkllama_mscale(seq_len, max_position_embeddings):
    """ChunkLlama's own factor on q's and k's cos/sin tables (chunkllama_attn_replace.py: ``scale = seq_len /
    max_position_embeddings``; ``get_mscale``: 1 when ``scale <= 1``, else ``0.05 * math.log(scale) + 1``)."""
    scale = seq_len / max_position_embeddings
    return 1.0 if scale <= 1 else 0.05 * math.log(scale) + 1.0


class LayerChecker:
    """Forward hooks on every attention layer of a patched model: each forward's output (a prefill, or one decoding
    step) against the float64 reference attention over every key the layer has seen so far (their hidden states
    recorded, projected again here), through the layer's own o_proj in float64. Padding keys are given position -1;
    padding query rows are not compared. DCA's temperature: query and key rows times m(max(P, p + 1)), P the row's
    prompt length (its real tokens), as vLLM computes it."""

    def __init__(self, model, attention, pads=None, original=0, inv_freq=INV_FREQ, rule="qwen", **parameters):
        self.attention, self.parameters, self.original, self.inv_freq = attention, parameters, original, inv_freq
        self.rule = rule
        self.pads, self.seen, self.errors, self.prompt = pads, {}, [], None
        self.handles = [m.register_forward_hook(self.hook, with_kwargs=True) for m in model.modules()
                        if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj")]

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def hook(self, module, args, kwargs, output):
        with torch.no_grad():
            self.check(module, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                       kwargs["position_ids"], output[0])

    def check(self, module, hidden, position_ids, out):
        batch, length = hidden.shape[:2]
        positions = position_ids.expand(batch, -1).clone()
        if module.layer_idx not in self.seen:  # the prompt: its padding keys at -1
            if self.pads is not None:
                for row, pad in enumerate(self.pads):
                    positions[row, :pad] = -1
            self.seen[module.layer_idx] = (hidden, positions)
        else:
            hidden_seen, positions_seen = self.seen[module.layer_idx]
            self.seen[module.layer_idx] = (torch.cat((hidden_seen, hidden), 1),
                                           torch.cat((positions_seen, positions), 1))
        keys_hidden, kp = self.seen[module.layer_idx]
        if self.prompt is None or kp.shape[1] == length:
            self.prompt = kp.amax(-1) + 1  # P: the first forward's real tokens
        qp = kp[:, -length:]

        def heads(proj, x):
            return proj(x).view(batch, x.shape[1], -1, HEAD).transpose(1, 2).double()

        q, k, v = heads(module.q_proj, hidden), heads(module.k_proj, keys_hidden), heads(module.v_proj, keys_hidden)
        q = q * temperature(torch.maximum(self.prompt[:, None], qp + 1), self.original, self.rule)[:, None, :, None]
        k = k * temperature(torch.maximum(self.prompt[:, None], kp + 1), self.original, self.rule)[:, None, :, None]
        if self.attention == "self_extend":
            ref, _ = reference_self_extend(q, k, v, qp, kp, self.inv_freq, scale=module.scaling, **self.parameters)
        elif self.attention == "rerope":
            ref, _ = reference(q, k, v, qp, kp, self.inv_freq, scale=module.scaling, **self.parameters)
        elif self.attention == "string":  # the authors' two passes, their attention factor on cos and sin
            ref, _ = reference_string(q, k, v, qp, kp, self.inv_freq, scale=module.scaling,
                                      attention_factor=config_lib.STRING_ATTENTION_FACTOR, **self.parameters)
        else:
            ref, _ = reference_dual_chunk(q, k, v, qp, kp, self.inv_freq, scale=module.scaling, **self.parameters)
        o_proj = module.o_proj
        ref = ref.transpose(1, 2).reshape(batch, length, -1) @ o_proj.weight.double().T
        if o_proj.bias is not None:
            ref = ref + o_proj.bias.double()
        rows = qp >= 0
        got, want = out.double()[rows], ref[rows]
        self.errors.append(((got - want).abs().max() / want.abs().max()).item())


def patched(name, attention, seed=0, **kwargs):
    model = build(name, seed=seed)
    return hf.patch(model, attention=attention, **kwargs)


# ---------------------------------------------------------------------------------------------
# Each layer against the float64 reference: prefill and every decoding step, batched with left padding


CASES = {  # name: (family, patch arguments, reference parameters, L0)
    "self_extend": ("Llama", SE, dict(window=4, group=3), 0),
    "self_extend_qwen2": ("Qwen2", dict(attention="self_extend", window=6, group=2), dict(window=6, group=2), 0),
    "dual_chunk": ("Llama", DCA, dict(chunk_size=12, local_size=4), 0),
    "dual_chunk_no_local": ("Llama", dict(attention="dual_chunk", chunk_size=6, local_size=0),
                            dict(chunk_size=6, local_size=0), 0),
    "dual_chunk_temperature": ("Llama", dict(DCA, original_max_position_embeddings=8),
                               dict(chunk_size=12, local_size=4), 8),
    "dual_chunk_chunkllama": ("Llama", dict(DCA, temperature="chunkllama", original_max_position_embeddings=8),
                              dict(chunk_size=12, local_size=4), 8),
    "string": ("Llama", STRING, dict(shifted_offset=7, local_value=3), 0),
    "string_qwen2": ("Qwen2", dict(attention="string", shifted_offset=10, local_value=0),
                     dict(shifted_offset=10, local_value=0), 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layer_equals_the_float64_reference_in_prefill_and_decode(case):
    family, arguments, parameters, original = CASES[case]
    model = patched(family, **arguments)
    pads = [0, 5]
    x, mask = left_padded(ids(length=20), pads)
    checker = LayerChecker(model, arguments["attention"], pads, original, rule=arguments.get("temperature", "qwen"),
                           **parameters)
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    checker.remove()
    assert out.shape[1] == 28
    assert len(checker.errors) == 2 * 8  # two layers, a prefill and seven decoding steps
    assert max(checker.errors) <= 1e-5, checker.errors


FLOAT64_CASES = {**CASES,  # and ReRoPE's two rules, which take the same float64 path
                 "rerope": ("Llama", dict(attention="rerope", window=5), dict(window=5), 0),
                 "leaky_rerope": ("Llama", dict(attention="rerope", window=5, leaky_k=4.0),
                                  dict(window=5, leaky_k=4.0), 0)}


@pytest.mark.parametrize("case", sorted(FLOAT64_CASES))
def test_a_float64_model_is_served_and_equals_the_float64_reference(case):
    """People check numerics in float64 (issue 42): a float64 model patched with a raw-key attention runs (the fused
    op takes float32/fp16/bf16 only: the float64 composite serves it) and every layer, prefill and each decoding
    step, equals the float64 reference to float64's precision, not float32's (over the float32 table, which
    transformers' own float64 model rotates with too: its inv_freq is computed in float32)."""
    family, arguments, parameters, original = FLOAT64_CASES[case]
    model = patched(family, **arguments).to(torch.float64)
    pads = [0, 5]
    x, mask = left_padded(ids(length=20), pads)
    checker = LayerChecker(model, arguments["attention"], pads, original, INV_FREQ.float().double(),
                           rule=arguments.get("temperature", "qwen"), **parameters)
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             pad_token_id=0)
    checker.remove()
    assert out.shape[1] == 24 and len(checker.errors) == 2 * 4
    assert max(checker.errors) <= 1e-12, checker.errors


def float32_error(arguments, seed, length=40, new=8):
    """A float32 model's logits (prefill, then each decoding step of ``generate``) against the float64 model of the
    same weights, whose raw-key attention is the float64 composite (the authors' float64 code: the test above),
    relative to the largest logit; ``arguments`` None: transformers' own model, unpatched."""
    import copy

    model = build("Llama")
    if arguments is not None:
        hf.patch(model, **arguments)
    exact = copy.deepcopy(model).to(torch.float64)
    x = ids(length=length, seed=seed)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        got = torch.cat((model(x).logits[:, :-1], torch.stack(out.logits, 1)), 1).double()
        want = exact(out.sequences).logits[:, :-1]
    return ((got - want).abs().max() / want.abs().max()).item()


def test_float32_error_is_the_plain_models_own():
    """Issue 55: STRING in float32 was said to be 3.5x the plain model's own float32 error where Self-Extend and DCA
    stay within 3x. Measured here (seeds 1-3): the plain model 5e-7 to 7e-7 of the largest logit, every method
    0.8x to 1.5x that; at the op (dense, paged, training path, AVX512/AVX2/default kernels) STRING is 1.3x to 1.5x
    plain RoPE attention, of which ~1.2x is its factor m^2 = 1.14 on every score (a sharper softmax; plain RoPE
    attention with the same factor errs as much), the rest its far side's rotation, as Self-Extend's. Each within
    2.5x the plain model's error on the same inputs: below the issue's 3.5x, with room for the other CPU kind's
    GEMMs (a max over logits is a noisy statistic; a 3e-6 relative error planted in STRING's factor gives 3.4x-4.4x)."""
    for seed in (1, 2):
        plain = float32_error(None, seed)
        assert plain < 2e-6, plain
        for arguments in (SE, DCA, STRING, dict(attention="string", shifted_offset=21, local_value=8)):
            error = float32_error(arguments, seed)
            assert error <= 2.5 * plain, (arguments, error, plain)


@pytest.mark.parametrize("case", ["self_extend", "dual_chunk", "string"])
def test_decoding_with_the_cache_equals_a_prefill_of_the_whole_sequence(case):
    """Without a temperature every token's logits depend on positions alone: generate's step logits (raw keys in
    the PreRopeCache, one query a step) equal one forward over the whole sequence, rows padded on the left too."""
    family, arguments, _, _ = CASES[case]
    model = patched(family, **arguments)
    x, mask = left_padded(ids(length=18, seed=3), [0, 4])
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        full_mask = torch.cat((mask, torch.ones(2, 10, dtype=mask.dtype)), 1)
        positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
        full = model(out.sequences, attention_mask=full_mask, position_ids=positions).logits
    steps = torch.stack(out.logits, 1)
    torch.testing.assert_close(steps, full[:, 17:-1], rtol=0, atol=2e-5)


def test_the_temperature_follows_the_prompt_not_the_whole_sequence():
    """DCA's temperature is the request's (vLLM's rule): a decoding step's query takes m(its position + 1), the
    prompt's keys m(P); a prefill of the whole sequence puts m(its length) on every token, another model. And a
    row's prompt length is its own: a padded row batched with a longer one equals it alone."""
    model = patched("Llama", **DCA, original_max_position_embeddings=8)
    x = ids(batch=1, length=16, seed=4)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        full = model(out.sequences).logits
        longer = ids(batch=1, length=20, seed=5)
        batch, mask = left_padded(torch.cat((longer, torch.cat((torch.zeros(1, 4, dtype=x.dtype), x), 1))), [0, 4])
        both = model.generate(batch, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(out.logits, 1)
    assert (steps - full[:, 15:-1]).abs().max() > 1e-3
    torch.testing.assert_close(torch.stack(both.logits, 1)[1:], steps, rtol=0, atol=2e-5)


def test_chunkllamas_own_temperature_is_offered_and_is_not_qwens():
    """ChunkLlama's rule (issue 42): its Llama patch multiplies q's and k's cos/sin by ``get_mscale(seq_len /
    max_position_embeddings)``, 0.05 ln(.) + 1 past the model's length, on every region. ``temperature="chunkllama"``
    takes L0 from the model's max_position_embeddings (64 here) and applies exactly that factor: a prefill of 150
    tokens equals the float64 reference with q and k times ChunkLlama's own mscale(150); Qwen's rule (0.1) at the
    same L0 is another model, and so is no temperature."""
    x = ids(batch=1, length=150, seed=11)
    model = patched("Llama", **DCA, temperature="chunkllama")
    assert model.config.dual_chunk_attention_config["original_max_position_embeddings"] == 64
    assert model.config.ropescale["temperature"] == "chunkllama"
    checker = LayerChecker(model, "dual_chunk", None, 64, rule="chunkllama", chunk_size=12, local_size=4)
    with torch.no_grad():
        chunkllama = model(x).logits
    checker.remove()
    assert max(checker.errors) <= 1e-5, checker.errors
    # the reference's factor is ChunkLlama's own get_mscale at the prompt's length
    assert float(temperature(torch.tensor([150]), 64, "chunkllama")) == pytest.approx(chunkllama_mscale(150, 64),
                                                                                        rel=1e-15)
    hf.unpatch(model)
    with torch.no_grad():
        qwen = hf.patch(model, **DCA, original_max_position_embeddings=64)(x).logits
        hf.unpatch(model)
        none = hf.patch(model, **DCA)(x).logits
    for other in (qwen, none):
        assert ((other - chunkllama).abs().max() / chunkllama.abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------------
# Qwen's dual_chunk_attention_config


def qwen_dca(dual_chunk=None):
    """A tiny Qwen2 whose Qwen2Config carries Qwen's dual_chunk_attention_config (and no ropescale entry)."""
    model = build("Qwen2", dual_chunk_attention_config=dict(QWEN_DCA if dual_chunk is None else dual_chunk))
    assert not hasattr(model.config, "ropescale") and model.config.rope_parameters["rope_type"] == "default"
    return model


def test_a_qwen_config_is_read_as_dual_chunk_attention():
    model = qwen_dca()
    before = model.config.to_json_string()
    hf.patch(model)
    state = model._ropescale_patch
    assert (state.attention, state.plan.chunk_size, state.window, state.plan.temperature_length) == (
        "dual_chunk", 12, 4, 8)
    assert model.config.rope_parameters["rope_type"] == "dual_chunk"
    assert model.config.ropescale == {"attention": "dual_chunk", "chunk_size": 12, "local_size": 4}
    assert model.config.dual_chunk_attention_config == QWEN_DCA
    hf.unpatch(model)
    assert model.config.to_json_string() == before
    # vLLM's defaults where Qwen's config leaves a key out
    model = qwen_dca({"original_max_position_embeddings": 4})
    hf.patch(model)
    state = model._ropescale_patch
    assert (state.plan.chunk_size, state.window, state.plan.temperature_length) == (8192, 1024, 4)


def test_a_qwen_checkpoint_runs_its_dual_chunk_attention():
    model = hf.patch(qwen_dca())
    checker = LayerChecker(model, "dual_chunk", None, 8, chunk_size=12, local_size=4)
    with torch.no_grad():
        model.generate(ids(batch=1, length=20), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    checker.remove()
    assert len(checker.errors) == 2 * 3 and max(checker.errors) <= 1e-5, checker.errors


def test_qwens_sparse_attention_is_accepted_with_a_warning(monkeypatch):
    monkeypatch.setattr(scaling, "_warned", set())
    sparse = {**QWEN_DCA, "sparse_attention_enabled": True, "sparse_attention_threshold": 32768,
              "sparse_attention_last_q": 64}
    with pytest.warns(UserWarning, match="ropescale computes dense Dual Chunk Attention, which vLLM's sparse kernel"):
        parsed = config_lib.read({"rope_type": "default"}, 64, None, None, sparse)
    assert (parsed.attention, parsed.parameters["chunk_size"], parsed.parameters["local_size"]) == ("dual_chunk", 12, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        config_lib.read({"rope_type": "default"}, 64, None, None, sparse)
    monkeypatch.setattr(scaling, "_warned", set())
    with pytest.warns(UserWarning, match="sparse_attention_enabled"):  # enabled by default with a sparse config
        config_lib.read({"rope_type": "default"}, 64, None, None, {**QWEN_DCA, "sparse_attention_config": {}})


def test_patching_other_attention_over_a_qwen_config_drops_and_unpatch_restores_it():
    model = qwen_dca()
    before = model.config.to_json_string()
    hf.patch(model, attention="self_extend", window=4, group=2)
    assert not hasattr(model.config, "dual_chunk_attention_config")  # it would read back as DCA
    assert model.config.rope_parameters["rope_type"] == "self_extend"
    hf.unpatch(model)
    assert model.config.to_json_string() == before


# ---------------------------------------------------------------------------------------------
# Checkpoints


def trained_logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Self-Extend, DCA (with its temperature) and a Qwen DCA model, each patched and saved."""
    root = tmp_path_factory.mktemp("self_extend_dca")
    out = {}
    for name, model in (("self_extend", build("Llama")), ("dual_chunk", build("Llama")), ("qwen", qwen_dca()),
                        ("chunkllama", build("Llama")), ("string", build("Llama"))):
        arguments = {"self_extend": SE, "dual_chunk": dict(DCA, original_max_position_embeddings=8), "string": STRING,
                     "chunkllama": dict(DCA, temperature="chunkllama", original_max_position_embeddings=8)
                     }.get(name, {})
        hf.patch(model, **arguments)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


WRITTEN = {
    "self_extend": ({"rope_type": "self_extend", "rope_theta": 10000.0},
                    {"attention": "self_extend", "window": 4, "group": 3}, None),
    "dual_chunk": ({"rope_type": "dual_chunk", "rope_theta": 10000.0},
                   {"attention": "dual_chunk", "chunk_size": 12, "local_size": 4}, QWEN_DCA),
    "qwen": ({"rope_type": "dual_chunk", "rope_theta": 10000.0},
             {"attention": "dual_chunk", "chunk_size": 12, "local_size": 4}, QWEN_DCA),
    "chunkllama": ({"rope_type": "dual_chunk", "rope_theta": 10000.0},
                   {"attention": "dual_chunk", "chunk_size": 12, "local_size": 4, "temperature": "chunkllama"}, QWEN_DCA),
    "string": ({"rope_type": "string", "rope_theta": 10000.0},
               {"attention": "string", "shifted_offset": 7, "local_value": 3}, None),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_checkpoint_reloads_as_the_model_it_saved(saved, name):
    path, model = saved[name]
    config = json.loads((path / "config.json").read_text())
    rope_parameters, entry, dual_chunk = WRITTEN[name]
    assert (config["rope_parameters"], config["ropescale"], config.get("dual_chunk_attention_config")) == (
        rope_parameters, entry, dual_chunk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert any("ropescale.hf.patch(model)" in str(w.message) for w in caught)  # the marked type warns
    loaded = reloaded.config.to_json_string()
    x = ids(length=22, seed=7)
    hf.patch(reloaded)
    assert reloaded.config.to_json_string() == loaded
    torch.testing.assert_close(trained_logits(reloaded, x), trained_logits(model, x), rtol=0, atol=1e-5)
    hf.unpatch(reloaded)
    assert reloaded.config.to_json_string() == loaded


PLAIN_TRANSFORMERS = textwrap.dedent("""
    import json, sys, warnings
    from transformers import AutoModelForCausalLM
    warnings.filterwarnings("ignore")
    report = {}
    for path in json.loads(sys.argv[1]):
        try:
            AutoModelForCausalLM.from_pretrained(path)
            report[path] = {"loaded": True}
        except Exception as err:  # noqa: BLE001 (the error is the result)
            report[path] = {"error": type(err).__name__, "message": str(err)}
    report["ropescale imported"] = any(name.split(".")[0] == "ropescale" for name in sys.modules)
    print(json.dumps(report))
""")


def test_plain_transformers_refuses_the_checkpoints(saved, tmp_path):
    """Without ropescale, transformers refuses the marked rope type (never serves plain RoPE silently)."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TRANSFORMERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    paths = [str(path) for path, _ in saved.values()]
    result = subprocess.run([sys.executable, str(script), json.dumps(paths)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report.pop("ropescale imported") is False
    for name, (path, _) in saved.items():
        rope_type = WRITTEN[name][0]["rope_type"]
        assert report[str(path)] == {"error": "KeyError", "message": repr(rope_type)}, name


@pytest.mark.parametrize("arguments", [SE, dict(DCA, original_max_position_embeddings=8), STRING],
                         ids=["self_extend", "dual_chunk", "string"])
def test_unpatch_restores_the_config_exactly(arguments):
    model = build("Llama")
    before = model.config.to_json_string()
    hf.patch(model, **arguments)
    assert model.config.to_json_string() != before
    hf.unpatch(model)
    assert model.config.to_json_string() == before


# ---------------------------------------------------------------------------------------------
# The config, checked in one place: hostile entries, Qwen configs and patch arguments


# (rope_parameters, ropescale entry, dual_chunk_attention_config, message)
DEFAULT, SE_TYPE, DCA_TYPE = {"rope_type": "default"}, {"rope_type": "self_extend"}, {"rope_type": "dual_chunk"}
STRING_TYPE = {"rope_type": "string"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
HOSTILE = {
    "se_window_float": (SE_TYPE, {"attention": "self_extend", "window": 4.0, "group": 2},
                        None, "attention='self_extend' needs window (the neighbour window W), an integer > 0, got 4.0"),
    "se_window_bool": (SE_TYPE, {"attention": "self_extend", "window": True, "group": 2},
                       None, "needs window (the neighbour window W), an integer > 0, got True"),
    "se_window_zero": (SE_TYPE, {"attention": "self_extend", "window": 0, "group": 2}, None, "got 0"),
    "se_group_negative": (SE_TYPE, {"attention": "self_extend", "window": 4, "group": -2},
                          None, "needs group (the group size G), an integer > 0, got -2"),
    "se_group_string": (SE_TYPE, {"attention": "self_extend", "window": 4, "group": "2"},
                        None, "needs group (the group size G), an integer > 0, got '2'"),
    "se_group_missing": (SE_TYPE, {"attention": "self_extend", "window": 4}, None, "needs group"),
    "se_leaky_k": (SE_TYPE, {"attention": "self_extend", "window": 4, "group": 2, "leaky_k": 2.0},
                   None, "leaky_k applies to attention='rerope' only; attention='self_extend' takes window, group"),
    "se_leaky_k_zero": (SE_TYPE, {"attention": "self_extend", "window": 4, "group": 2, "leaky_k": 0.0},
                        None, "attention 'self_extend' takes window, group, not leaky_k"),
    "se_misspelled": (SE_TYPE, {"attention": "self_extend", "window": 4, "groups": 2},
                      None, "no key 'groups' (did you mean 'group'?)"),
    "se_unmarked": (DEFAULT, {"attention": "self_extend", "window": 4, "group": 2},
                    None, "asks for Self-Extend attention but rope_type 'default' has no 'self_extend' marker"),
    "se_marker_without_entry": (SE_TYPE, None, None, "marks Self-Extend attention but the config has no 'ropescale'"),
    "se_marker_rerope_entry": (SE_TYPE, {"attention": "rerope", "window": 4},
                               None, "marks Self-Extend attention but the config asks for attention 'rerope'"),
    "dca_local_equals_chunk": (DEFAULT, None, {"chunk_size": 8, "local_size": 8},
                               "needs local_size, an integer with 0 <= local_size < chunk_size (8), got 8"),
    "dca_local_negative": (DEFAULT, None, {"chunk_size": 8, "local_size": -1}, "got -1"),
    "dca_chunk_float": (DEFAULT, None, {"chunk_size": 8.0, "local_size": 2},
                        "needs chunk_size, an integer > 0, got 8.0"),
    "dca_chunk_bool": (DEFAULT, None, {"chunk_size": True, "local_size": 0}, "an integer > 0, got True"),
    "dca_default_local_past_chunk": (DEFAULT, None, {"chunk_size": 512}, "< chunk_size (512), got 1024"),
    "dca_temperature_negative": (DEFAULT, None, {**QWEN_DCA, "original_max_position_embeddings": -1},
                                 "original_max_position_embeddings (Dual Chunk Attention's temperature length L0"),
    "dca_temperature_null": (DEFAULT, None, {**QWEN_DCA, "original_max_position_embeddings": None}, "got None"),
    "dca_misspelled": (DEFAULT, None, {**QWEN_DCA, "chunksize": 8},
                       "dual_chunk_attention_config has no key 'chunksize' (did you mean 'chunk_size'?)"),
    "dca_not_a_dict": (DEFAULT, None, [12, 4], "dual_chunk_attention_config must be a dict"),
    "dca_sparse_not_bool": (DEFAULT, None, {**QWEN_DCA, "sparse_attention_enabled": "yes"},
                            "sparse_attention_enabled must be true or false, got 'yes'"),
    "dca_sparse_threshold": (DEFAULT, None, {**QWEN_DCA, "sparse_attention_threshold": -5},
                             "sparse_attention_threshold must be an integer >= 0, got -5"),
    "dca_scaled_table": (YARN, None, QWEN_DCA, "Dual Chunk Attention over a scaled table (YaRN, rope_type 'yarn')"),
    "dca_ntk_entry": ({"rope_type": "default", "rope_theta": 1e4 * 4.0 ** (16 / 14)},
                      {"method": {"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4}}, QWEN_DCA,
                      "Dual Chunk Attention over a scaled table (NTK, rope_type 'default')"),
    "dca_entry_disagrees": (DCA_TYPE, {"attention": "dual_chunk", "chunk_size": 16, "local_size": 4}, QWEN_DCA,
                            "config.ropescale.chunk_size (16) differs from dual_chunk_attention_config's (12)"),
    "dca_entry_disagrees_default": (DCA_TYPE, {"attention": "dual_chunk", "chunk_size": 12, "local_size": 4},
                                    {"original_max_position_embeddings": 8},
                                    "differs from dual_chunk_attention_config's (8192 by default)"),
    "dca_entry_without_sizes": (DCA_TYPE, {"attention": "dual_chunk"}, None,
                                "needs chunk_size, an integer > 0, got None"),
    "dca_window": (DCA_TYPE, {"attention": "dual_chunk", "chunk_size": 12, "local_size": 4, "window": 4}, None,
                   "window applies to attention='rerope' or 'self_extend' only; "
                   "attention='dual_chunk' takes chunk_size"),
    "dca_with_rerope_entry": (DEFAULT, {"attention": "rerope", "window": 4}, QWEN_DCA,
                              "has dual_chunk_attention_config (Dual Chunk Attention) and config.ropescale asks for "
                              "attention 'rerope'"),
    "dca_marker_on_yarn": ({**YARN, "rope_type": "dual_chunk_yarn"}, {"attention": "dual_chunk"}, QWEN_DCA,
                           "Dual Chunk Attention over a scaled table (YaRN, rope_type 'dual_chunk_yarn')"),
    "unknown_attention": (DEFAULT, {"attention": "chunked"}, None, "config.ropescale must be a dict with keys"),
    "dca_unknown_temperature": (DCA_TYPE, {"attention": "dual_chunk", "temperature": "chunk_llama"}, QWEN_DCA,
                                "temperature (Dual Chunk Attention's temperature rule) must be one of 'qwen', "
                                "'chunkllama', got 'chunk_llama'"),
    "dca_chunkllama_without_length": (DCA_TYPE, {"attention": "dual_chunk", "temperature": "chunkllama"},
                                      {"chunk_size": 12, "local_size": 4},
                                      "temperature='chunkllama' needs its length L0"),
    "se_temperature": (SE_TYPE, {"attention": "self_extend", "window": 4, "group": 2, "temperature": "chunkllama"},
                       None, "temperature applies to attention='dual_chunk' only"),
    "string_local_past_offset": (STRING_TYPE, {"attention": "string", "shifted_offset": 8, "local_value": 9}, None,
                                 "0 <= local_value <= shifted_offset (8), got 9"),
    "string_offset_float": (STRING_TYPE, {"attention": "string", "shifted_offset": 8.5, "local_value": 2}, None,
                            "needs shifted_offset (S: distances from S on are shifted), an integer > 0, got 8.5"),
    "string_misspelled": (STRING_TYPE, {"attention": "string", "shifted_offset": 8, "local_values": 2}, None,
                          "no key 'local_values' (did you mean 'local_value'?)"),
    "string_window": (STRING_TYPE, {"attention": "string", "shifted_offset": 8, "local_value": 2, "window": 8}, None,
                      "window applies to attention='rerope' or 'self_extend' only; attention='string' takes "
                      "shifted_offset, local_value"),
    "string_unmarked": (DEFAULT, {"attention": "string", "shifted_offset": 8, "local_value": 2}, None,
                        "asks for STRING attention but rope_type 'default' has no 'string' marker"),
    "string_marker_without_entry": (STRING_TYPE, None, None, "marks STRING attention but the config has no 'ropescale'"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_config_is_refused_with_a_clear_error(case):
    rope_parameters, entry, dual_chunk, message = HOSTILE[case]
    params = {"rope_theta": 10000.0, **rope_parameters}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=re.escape(message)):
            config_lib.read(params, 64, entry, HEAD, dual_chunk)
        # hf.patch(model) on a model carrying it: the same message, prefixed
        model = build("Llama")
        model.config.rope_parameters = params
        if entry is not None:
            model.config.ropescale = entry
        if dual_chunk is not None:
            model.config.dual_chunk_attention_config = dual_chunk
        with pytest.raises(ValueError, match="^patch: .*" + re.escape(message)):
            hf.patch(model)
    assert not hf.is_patched(model)


BAD_ARGUMENTS = [
    (dict(attention="self_extend", window=4), "needs group (the group size G), an integer > 0, got None"),
    (dict(attention="self_extend", window=4, group=2.0), "needs group (the group size G), an integer > 0, got 2.0"),
    (dict(attention="self_extend", window=False, group=2), "got False"),
    (dict(attention="self_extend", window=4, group=2, leaky_k=2.0), "leaky_k applies to attention='rerope' only"),
    (dict(attention="self_extend", window=4, group=2, chunk_size=8),
     "chunk_size applies to attention='dual_chunk' only"),
    (dict(attention="dual_chunk", chunk_size=8, local_size=8), "0 <= local_size < chunk_size (8), got 8"),
    (dict(attention="dual_chunk", chunk_size=8), "needs local_size"),
    (dict(attention="dual_chunk", chunk_size=8, local_size=2, window=2), "window applies to attention="),
    (dict(attention="dual_chunk", chunk_size=8, local_size=2, original_max_position_embeddings=-3),
     "must be an integer >= 0, got -3"),
    (dict(attention="rerope", window=4, group=2), "group applies to attention='self_extend' only"),
    (dict(group=2), "group applies to attention='self_extend' only"),
    (dict(attention="dual_chunk", chunk_size=8, local_size=2,
          scaling=scaling.YaRN(factor=4.0, original_max_position=16)),
     "Dual Chunk Attention over a scaled table (YaRN)"),
    (dict(attention="chunked"), "attention must be one of 'sdpa', 'rerope', 'self_extend', 'dual_chunk', 'string', "
                                "got 'chunked'"),
    (dict(attention="string"), "needs shifted_offset (S: distances from S on are shifted), an integer > 0, got None"),
    (dict(attention="string", shifted_offset=8, local_value=9), "0 <= local_value <= shifted_offset (8), got 9"),
    (dict(attention="string", shifted_offset=8, local_value=-1), "got -1"),
    (dict(attention="string", shifted_offset=8.0), "an integer > 0, got 8.0"),
    (dict(attention="string", shifted_offset=8, window=8), "window applies to attention="),
    (dict(attention="rerope", window=4, local_value=2), "local_value applies to attention='string' only"),
    (dict(attention="dual_chunk", chunk_size=8, local_size=2, temperature="ChunkLlama"),
     "must be one of 'qwen', 'chunkllama', got 'ChunkLlama'"),
    (dict(attention="dual_chunk", chunk_size=8, local_size=2, temperature="chunkllama",
          original_max_position_embeddings=0), "temperature='chunkllama' needs its length L0"),
    (dict(attention="rerope", window=4, temperature="chunkllama"), "temperature applies to attention='dual_chunk'"),
]


@pytest.mark.parametrize("arguments,message", BAD_ARGUMENTS, ids=[str(a) for a, _ in BAD_ARGUMENTS])
def test_bad_patch_arguments_are_refused_before_the_model_is_touched(arguments, message):
    model = build("Llama")
    before = model.config.to_json_string()
    with pytest.raises(ValueError, match="^patch: .*" + re.escape(message)):
        hf.patch(model, **arguments)
    assert not hf.is_patched(model) and model.config.to_json_string() == before


def test_the_written_config_reads_back():
    for attention, arguments in (("self_extend", dict(window=4, group=3)),
                                 ("dual_chunk", dict(chunk_size=12, local_size=4, original_max_position_embeddings=8)),
                                 ("string", dict(shifted_offset=20, local_value=5))):
        parameters = config_lib.check_attention(attention, arguments)
        written = config_lib.write(scaling.Default(), 1e4, HEAD, 64, attention=attention, parameters=parameters)
        parsed = config_lib.read(written.rope_parameters, written.max_position_embeddings, written.entry, HEAD,
                                 written.dual_chunk)
        assert parsed.attention == attention and parsed.length_free
        assert parsed.parameters == parameters and arguments.items() <= parameters.items()
    # Self-Extend over a scaled table is marked on it
    written = config_lib.write(scaling.YaRN(factor=4.0, original_max_position=16), 1e4, HEAD, 16,
                               attention="self_extend", parameters={"window": 4, "group": 2})
    assert written.rope_parameters["rope_type"] == "self_extend_yarn"
    assert config_lib.read(written.rope_parameters, 16, written.entry, HEAD).method.factor == 4.0


def test_a_string_plan_is_never_served_as_another_rule():
    """STRING is ReRoPE's far rule with slope 1 from W: a plan with its W and another slope (ReRoPE clipped at W)
    would serve another model silently, so none can be built; every plan read from a STRING config has slope 1."""
    from ropescale import serving

    with pytest.raises(ValueError, match="STRING attention's rule has leaky_k 1.0, got 0.0"):
        serving.PreRopePlan(scaling.Default(), 1e4, HEAD, 7, 0.0, far_start=3, attention="string")
    with pytest.raises(ValueError, match="far_start 3 is not part of ReRoPE attention's rule"):
        serving.PreRopePlan(scaling.Default(), 1e4, HEAD, 7, 1.0, far_start=3)
    with pytest.raises(ValueError, match="group 2 is not part of STRING attention's rule"):
        serving.PreRopePlan(scaling.Default(), 1e4, HEAD, 7, 1.0, far_start=3, group=2, attention="string")
    config = patched("Llama", **STRING).config
    plan = serving.PreRopePlan.of(config_lib.read_config(config), HEAD, True)
    assert (plan.attention, plan.window, plan.leaky_k, plan.far_start) == ("string", 7, 1.0, 3)
    assert plan.method_arguments() == {"far_start": 3}


def test_rope_type_markers_parse_and_join():
    for marker in scaling.RopeType.MARKERS:
        for table in ("default", "yarn", "resonance_yarn"):
            name = scaling.RopeType.join(table, marker)
            parsed = scaling.RopeType.parse(name)
            assert (parsed.marker, parsed.table, parsed.name) == (marker, table, name)
            assert name in hf.ROPESCALE_ROPE_TYPES and not parsed.is_stock
    assert scaling.RopeType.join("yarn", True) == "rerope_yarn" and scaling.RopeType.parse("rerope").rerope


def test_dual_chunk_attention_refuses_gradients():
    model = build("Llama")
    hf.patch(model, **DCA)
    model.train()
    with pytest.raises(ValueError, match="Dual Chunk Attention has no training path"):
        model(ids(length=8), use_cache=False)


# ---------------------------------------------------------------------------------------------
# Training: Self-Extend under autocast


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_self_extend_trains_under_autocast_as_closely_as_transformers_own_model(dtype):
    """A training step of Self-Extend (ops.rerope_attention_train) under CPU autocast is as close to its float32
    step as transformers' own (plain RoPE) model of the same weights is to its own: within twice its relative
    error. Its float32 forward (the training path) equals the float64 reference, layer by layer."""
    native = build("Llama").train()
    model = hf.patch(build("Llama"), **SE).train()
    x = ids(length=32, seed=9)
    step, native_step = loss_and_grads(model, x), loss_and_grads(native, x)
    assert (step[0] - native_step[0]).abs().max() > 1e-3  # the grouped region is another model
    checker = LayerChecker(model, "self_extend", window=4, group=3)
    model(x, use_cache=False)  # gradients wanted: the training path
    checker.remove()
    assert max(checker.errors) <= 1e-5, checker.errors
    assert_autocast_as_close_as_native(model, native, x, dtype, step, native_step)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_string_trains_under_autocast_as_closely_as_transformers_own_model(dtype):
    """STRING fine-tunes through the training path (ReRoPE's far part, slope 1, from W): its float32 forward equals
    the authors' float64 two passes layer by layer, and its autocast step is as close to its float32 step as
    transformers' own model's is."""
    native = build("Llama").train()
    model = hf.patch(build("Llama"), **STRING).train()
    x = ids(length=32, seed=9)
    step, native_step = loss_and_grads(model, x), loss_and_grads(native, x)
    assert (step[0] - native_step[0]).abs().max() > 1e-3  # the shifted region and the factor: another model
    checker = LayerChecker(model, "string", shifted_offset=7, local_value=3)
    model(x, use_cache=False)  # gradients wanted: the training path
    checker.remove()
    assert max(checker.errors) <= 1e-5, checker.errors
    assert_autocast_as_close_as_native(model, native, x, dtype, step, native_step)


def test_self_extend_gradients_equal_the_float64_reference():
    """The training path's gradients (ops.rerope_attention_train with group) are those of the float64 reference."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, HEAD, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 24, HEAD, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 24, HEAD, generator=g, requires_grad=True)
    positions = torch.arange(24).repeat(2, 1)
    positions[1, :5] = -1
    out, _ = ops.rerope_attention_train(q, k, v, positions, positions, INV_FREQ.float(), 4, group=3)
    ref, _ = reference_self_extend(q, k, v, positions, positions, INV_FREQ, 4, 3)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert math.isfinite(out.sum().item())


# A new far-field rule, declared in a fresh process before ropescale.config is imported: STRING with its local value
# fixed at 0 (every far distance d counts as d - S), a rule the ops' arguments already express. Nothing else is added.
_NEW_RULE = textwrap.dedent('''
    import json, sys
    import torch
    from ropescale import attentions

    attentions.declare(attentions.Attention(
        "string_from_zero", "STRING attention from 0",
        (attentions.Parameter("shifted_offset", lambda v, _: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                              "attention='string_from_zero' needs shifted_offset, an integer > 0, got {got}",
                              flag="--shifted-offset"),),
        plan={"window": "shifted_offset", "leaky_k": attentions.Fixed(1.0), "far_start": attentions.Fixed(0)},
        describe=lambda plan: f"STRING from 0, shifted_offset {plan.window}",
        score_factor=attentions.STRING_ATTENTION_FACTOR ** 2))

    from transformers import AutoModelForCausalLM
    from ropescale import cli, config as config_lib, hf, serving
    sys.path.insert(0, sys.argv[1])
    from ropescale.tiny_models import build

    ids = torch.randint(3, 60, (2, 24), generator=torch.Generator().manual_seed(1))
    new = hf.patch(build("Llama"), attention="string_from_zero", shifted_offset=7)
    string = hf.patch(build("Llama"), attention="string", shifted_offset=7, local_value=0)
    with torch.no_grad():
        want, got = string(ids).logits, new(ids).logits
    new.save_pretrained(sys.argv[2])
    saved = json.load(open(sys.argv[2] + "/config.json"))
    reloaded = hf.patch(AutoModelForCausalLM.from_pretrained(sys.argv[2]))
    with torch.no_grad():
        again = reloaded(ids).logits
    plan = serving.PreRopePlan.of_config(reloaded.config)
    try:
        hf.patch(build("Llama"), attention="string_from_zero", shifted_offset=0)
        refused = None
    except ValueError as err:
        refused = str(err)
    out = {"same_as_string": (got - want).abs().max().item(), "reloaded": (again - got).abs().max().item(),
           "entry": saved["ropescale"], "rope_type": saved["rope_parameters"]["rope_type"],
           "plan": [plan.attention, plan.window, plan.leaky_k, plan.far_start, plan.method_arguments()],
           "score_factor": plan.score_factor, "refused": refused,
           "cli": cli.main(["extend", sys.argv[2], sys.argv[2] + "-cli", "--attention", "string_from_zero",
                            "--shifted-offset", "5", "--dry-run"])}
    print("RESULT " + json.dumps(out))
''')


def test_a_new_far_field_rule_is_one_declaration(tmp_path):
    """``attentions.declare`` is all a rule the ops' arguments express needs: hf.patch, the checkpoint, its reload,
    the serving plan, its check and the command line find it (issue 44)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    support = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _NEW_RULE, support, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out.pop("same_as_string") == 0.0 and out.pop("reloaded") == 0.0
    assert out == {"entry": {"attention": "string_from_zero", "shifted_offset": 7},
                   "rope_type": "string_from_zero", "plan": ["string_from_zero", 7, 1.0, 0, {"far_start": 0}],
                   "score_factor": config_lib.STRING_ATTENTION_FACTOR ** 2,
                   "refused": "patch: attention='string_from_zero' needs shifted_offset, an integer > 0, got 0",
                   "cli": 0}


def test_declare_refuses_a_taken_name_a_plan_without_its_parameter_and_a_late_declaration():
    import dataclasses

    from ropescale import attentions

    with pytest.raises(ValueError, match="the attention 'string' is taken"):
        attentions.declare(attentions.STRING)
    with pytest.raises(ValueError, match=r"plan fields \['far_start'\] name no parameter of it"):
        attentions.declare(dataclasses.replace(attentions.STRING, name="string2",
                                               plan={**attentions.STRING.plan, "far_start": "local_values"}))
    with pytest.raises(RuntimeError, match="before ropescale.config"):  # this process imported it
        attentions.declare(dataclasses.replace(attentions.STRING, name="string2"))
    assert "string2" not in attentions.RAW_KEY and "string2" not in config_lib.ATTENTIONS
