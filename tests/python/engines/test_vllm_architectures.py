"""Every family of ``ropescale.hf.architectures`` served by vLLM's CPU backend, stock and with the plugin
(docs/DESIGN.md "Model families"): a checkpoint ``hf.patch`` wrote is served as transformers + ropescale computes
it (greedy tokens, prompt logprobs within 1e-5 in float32) or refused at engine start with an error naming why,
never served silently wrong.

Runs on the vLLM leg (scripts/test_torch_compat.sh); skips elsewhere. Two processes (stock vLLM, vLLM + plugin:
the plugin is registered once per process), each serving every checkpoint in turn; the tiny models of
``support.families`` at head dim 32 (vLLM's CPU attention takes no less). Llama, Mistral, Qwen2 and Qwen3 are
served method by method in test_vllm.py and test_vllm_paged.py; here each family's own layout is the point:
partial rotary, per-layer-type parameters, sinks with ``truncate=False`` YaRN, MLA's mscale, multimodal sections,
Ministral 3's query temperature.
"""

import importlib.util
import json

import pytest
import torch

from support.families import ORIGINAL, build_served
from support.vllm_engine import run_engines
from support.vllm_testing import assert_same, require_vllm

require_vllm()

import transformers  # noqa: E402

from ropescale import hf, scaling  # noqa: E402
from ropescale.hf import architectures  # noqa: E402

ARCHS = {arch.name: arch for arch in architectures.ARCHITECTURES}
COVERED_ELSEWHERE = ("Llama", "Mistral", "Qwen2", "Qwen3")  # test_vllm.py, test_vllm_paged.py
FAMILIES = sorted(name for name in ARCHS if name not in COVERED_ELSEWHERE)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
NEW_TOKENS = 4
# Families vLLM 0.32 cannot run on this leg at all, and why (no engine is started for them).
NOT_RUN = {name: "vLLM's Qwen2-VL family modules import torchvision, which has no build for torch 2.13.0+cpu on "
                 "PyPI (its wheel is built for CUDA torch and fails to register its ops on the CPU torch)"
           for name in ("Qwen2.5-VL (text)", "Qwen3-VL (text)") if importlib.util.find_spec("torchvision") is None}
# Families vLLM serves, but not as transformers computes them even unpatched: ropescale's rope cannot be judged there.
NOT_COMPARABLE = {
    "DeepSeek-V3": "vLLM 0.32's CPU DeepSeek-V3 (MLA kernel, grouped routing) is 0.13 nats from transformers' on the "
                   "unpatched tiny model with the default rope, so an exact rope is not visible in its logprobs",
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
PLUGIN_REFUSES_PRE_ROPE = {"Gemma 3": "a pre-RoPE method (dynamic, ReRoPE) on some layer types of a per-layer-type "
                                      "config (Gemma 3) is not served by vLLM"}


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
    """Per-request Dynamic YaRN: vLLM must cache raw keys and rotate each request at its own scale."""
    return hf.patch(build_served(name), scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))


# The pre-RoPE families (their attention takes pre-RoPE methods) whose config takes the method's type.
PRE_ROPE = [name for name in FAMILIES if ARCHS[name].pre_rope is None and name != "Phi-3 / Phi-4-mini"]
SERVED = [name for name in FAMILIES if name not in NOT_RUN]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for name in SERVED:
        static_checkpoint(name).save_pretrained(paths.setdefault(("static", name), root / f"static-{len(paths)}"))
    for name in PRE_ROPE:
        pre_rope_checkpoint(name).save_pretrained(paths.setdefault(("pre_rope", name), root / f"pre-{len(paths)}"))
    return paths


def prompts():
    """A prompt past the original length (to the served length but for the new tokens) and a short one, batched."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 101, (n,), generator=g).tolist() for n in (64 - NEW_TOKENS - 2, 11)]


def serve(tmp_path, checkpoints, keys, env):
    params = dict(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    # A pre-RoPE checkpoint keeps its original length as max_position_embeddings: served past it on purpose.
    engines = [{"id": "/".join(key), "path": str(checkpoints[key]),
                "options": dict(enforce_eager=True, max_num_seqs=2, max_model_len=64),
                "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if key[0] == "pre_rope" else {},
                "batches": [{"prompts": prompts(), "params": params}]} for key in keys]
    environ = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    results, log = run_engines(tmp_path, engines, environ, timeout=1800)
    assert [r["id"] for r in results] == [e["id"] for e in engines], log[-5000:]
    return {r["id"]: r for r in results}, log


@pytest.fixture(scope="module")
def stock(tmp_path_factory, checkpoints):
    return serve(tmp_path_factory.mktemp("stock"), checkpoints, [("static", name) for name in SERVED],
                 {"ROPESCALE_VLLM": "0"})


@pytest.fixture(scope="module")
def plugin(tmp_path_factory, checkpoints):
    keys = [*(("static", name) for name in SERVED), *(("pre_rope", name) for name in PRE_ROPE)]
    # Refusals last: an engine refused while its model is built leaves vLLM's process state half set up.
    keys.sort(key=lambda key: key[0] == "pre_rope" and key[1] in PLUGIN_REFUSES_PRE_ROPE)
    return serve(tmp_path_factory.mktemp("plugin"), checkpoints, keys, {})


def reference(path):
    """transformers + ropescale on the saved checkpoint (plain transformers' reload, then ``hf.patch``): each
    prompt one request that may generate NEW_TOKENS (``hf.request``: a per-request method's scale), greedy
    through the model's own cache."""
    config = json.loads((path / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(path, dtype=torch.float32).eval()
    hf.patch(model)
    out = []
    for prompt in prompts():
        with torch.no_grad(), hf.request(model, max_new_tokens=NEW_TOKENS):
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
@pytest.mark.parametrize("name", PRE_ROPE)
def test_plugin_serves_each_familys_per_request_dynamic_yarn_or_refuses_it(plugin, checkpoints, name):
    results, log = plugin
    result = results[f"pre_rope/{name}"]
    if name in PLUGIN_REFUSES_PRE_ROPE:
        assert PLUGIN_REFUSES_PRE_ROPE[name] in result.get("error", ""), result
        return
    assert_same(outputs(result, log), reference(checkpoints[("pre_rope", name)]), f"{name} pre-RoPE, vLLM + plugin")
