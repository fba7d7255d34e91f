"""Pre-RoPE checkpoints (ReRoPE, Leaky ReRoPE, log-n, Dynamic-YaRN) served by vLLM over its paged cache of raw
keys through ropescale's attention backend (docs/DESIGN.md "Engines", ``ropescale.vllm.attention``).

Runs on the vLLM leg (as test_vllm.py); skips elsewhere. Cheapest first:

1. no engine: the backend registration and selection, the refusals (pass-through rotary in front of a stock
   backend, context parallelism, unsupported layer options), the per-request tables (equal to ``hf.patch``'s,
   one computation per distinct length per step), and one layer's write + attention over a hand-made page
   table against ``rerope_attention`` on the dense keys;
2. engines (slow; each start costs ~25 s here, so several runs per engine): greedy tokens and prompt logprobs
   against transformers + ropescale for each method; chunked prefill with a token budget smaller than the
   prompt; 16 concurrent requests of mixed lengths, each equal to its solo run; shared prefixes through
   vLLM's prefix cache; compiled mode; tensor parallelism (TP=2) where the machine runs it.

Prompt lengths stay under 256 tokens: the checks are about positions relative to the window (16) and the
original length (64), which short prompts cross many times, and every engine step runs 2 layers x all
requests on 2 shared CPU cores (before the native paged kernel lands, through the plain-PyTorch form).
"""

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from vllm_testing import HEAD, ORIGINAL, assert_same, require_vllm, tiny_llama  # noqa: E402

require_vllm()

from transformers import AutoModelForCausalLM  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum, _ATTN_OVERRIDES  # noqa: E402

from ropescale import config as config_lib, hf, ops, scaling  # noqa: E402
from ropescale.vllm import attention, rotary  # noqa: E402

SERVED = 256  # the length the engines serve (VLLM_ALLOW_LONG_MAX_MODEL_LEN: ReRoPE's point is to go past L)
WINDOW = 16

# name: (method, patch keyword arguments)
CHECKPOINTS = {
    "rerope": (scaling.Default(), dict(attention="rerope", window=WINDOW)),
    "leaky_logn": (scaling.Default(), dict(attention="rerope", window=WINDOW, leaky_k=2.0, logn_length=ORIGINAL)),
    "rerope_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), dict(attention="rerope", window=WINDOW)),
    "dynamic_yarn": (scaling.DynamicYaRN(original_max_position=ORIGINAL), {}),
    "dynamic_ntk": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL), {}),
    "resonance_dynamic": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL, resonance=True), {}),
}


def patched(name, seed=0):
    method, kwargs = CHECKPOINTS[name]
    return hf.patch(tiny_llama(seed), method, **kwargs)


@pytest.fixture(autouse=True)
def isolated():
    """A default engine config; vLLM's backend overrides and the plugin's recorded plan restored after."""
    saved = dict(_ATTN_OVERRIDES)
    attention._plan.clear()
    with set_current_vllm_config(VllmConfig()):
        yield
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)
    attention._plan.clear()


def model_get_rope(monkeypatch, config, vllm_config=None):
    """get_rope as a model build calls it (no engine): the plugin reads the checkpoint from the engine config."""
    model_config = types.SimpleNamespace(hf_config=config, max_model_len=SERVED)
    monkeypatch.setattr(rotary, "_model_config", lambda: model_config)
    if vllm_config is not None:
        monkeypatch.setattr("vllm.config.get_current_vllm_config", lambda: vllm_config)
    return rotary.get_rope(HEAD, config.max_position_embeddings, True, dict(config.rope_parameters), torch.float32)


# ---------------------------------------------------------------------------------------------
# 1. No engine


def test_backends_are_registered_over_cpu_attn_and_in_the_custom_slot():
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    attention.register_backends()
    cpu = AttentionBackendEnum.CPU_ATTN.get_class()
    assert cpu is attention.RopescaleCPUAttentionBackend and cpu.get_name() == "CPU_ATTN"
    assert AttentionBackendEnum.CUSTOM.get_class() is attention.PreRopeAttentionBackend


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_pre_rope_checkpoints_get_a_pass_through_rotary_only_with_ropescales_backend(monkeypatch, name):
    config = patched(name).config
    # Without the override (a stock CPU_ATTN would attend the raw keys un-rotated): refused.
    with pytest.raises(NotImplementedError, match="only ropescale's attention backend reads correctly; the backend "
                                                  "that would run is vllm.v1.attention.backends.cpu_attn"):
        model_get_rope(monkeypatch, config)
    attention.register_backends()
    layer = model_get_rope(monkeypatch, config)
    assert isinstance(layer, attention.PreRopeRotary)
    q, k = torch.randn(5, 2 * HEAD), torch.randn(5, HEAD)
    got_q, got_k = layer(torch.arange(5), q, k)
    assert got_q is q and got_k is k  # raw keys go to the cache
    parsed = config_lib.read_config(config)
    assert attention.current_plan() == attention.PreRopePlan.of(parsed, HEAD, True)


def test_context_parallelism_is_refused(monkeypatch):
    attention.register_backends()
    config = patched("rerope").config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(**{name: 2}), cache_config=None)
        with pytest.raises(NotImplementedError, match=f"{name}=2 shards the cache by token"):
            model_get_rope(monkeypatch, config, vllm_config)


def test_dynamic_methods_warn_about_prefix_caching(monkeypatch):
    attention.register_backends()
    warnings = []
    monkeypatch.setattr(attention.logger, "warning", lambda *args: warnings.append(args[0] % args[1:]))
    monkeypatch.setattr(attention, "_warned", set())
    model_get_rope(monkeypatch, patched("rerope").config)  # ReRoPE with a static table: exact with it
    assert warnings == []
    attention._plan.clear()  # another model
    model_get_rope(monkeypatch, patched("dynamic_yarn").config)
    assert len(warnings) == 1 and "enable_prefix_caching=False" in warnings[0], warnings


def test_unsupported_layer_options_are_refused():
    for options, what in ((dict(sliding_window=32), "sliding_window"), (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
                          (dict(logits_soft_cap=30.0), "logits_soft_cap")):
        with pytest.raises(NotImplementedError, match=f"pre-RoPE attention does not support {what}"):
            attention.PreRopeLayer(2, 1, HEAD, HEAD ** -0.5, **options)


@pytest.mark.parametrize("name", ["dynamic_yarn", "dynamic_ntk", "resonance_dynamic", "rerope_yarn"])
def test_step_tables_are_hf_patchs_tables_once_per_length(name):
    model = patched(name)
    state = model._ropescale_patch
    plan = attention.PreRopePlan.of(config_lib.read_config(model.config), HEAD, True)
    cache = attention.TableCache(plan)
    lengths = [200, 7, 64, 65, 200, 130, 7]
    tables = cache.step(lengths)
    if not plan.length_dependent:  # ReRoPE over YaRN: one static table, its attention factor in the scale
        inv_freq, factor = state.table(None, torch.device("cpu"))
        assert torch.equal(tables.inv_freq, inv_freq) and tables.scale_factors is None
        assert tables.scale_factor == factor * factor != 1.0
        return
    assert tables.inv_freq.shape == (len(lengths), HEAD // 2) and tables.scale_factor == 1.0
    for r, n in enumerate(lengths):
        inv_freq, factor = state.table(n, torch.device("cpu"))  # what transformers + hf.patch rotate with
        assert torch.equal(tables.inv_freq[r], inv_freq), n
        assert tables.scale_factors[r].item() == pytest.approx(factor * factor, rel=1e-7)
    assert cache.computed == len(set(lengths))  # each distinct length once
    assert cache.step(lengths) is tables  # every later layer of the step: no work
    cache.step(lengths[:3] + [201])
    assert cache.computed == len(set(lengths)) + 1  # the next step (one request grew): one new table


def reference_attention(plan, q, k, v, q_pos, k_pos, scale, table, factor):
    """One request through rerope_attention on dense keys (what hf.patch runs)."""
    out, _ = ops.rerope_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                  q_pos[None], k_pos[None], table, plan.window, leaky_k=plan.leaky_k,
                                  scale=scale * factor * factor, logn_length=plan.logn_length)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("name", ["leaky_logn", "dynamic_yarn"])
def test_layer_writes_raw_pages_and_attends_through_the_block_table(name):
    """Two requests (a chunk of a long prefill and a decode) over scattered pages of one vLLM-shaped cache."""
    model = patched(name)
    plan = attention.PreRopePlan.of(config_lib.read_config(model.config), HEAD, True)
    attention._plan.update(plan=plan)
    layer = attention.PreRopeLayer(2, 1, HEAD, HEAD ** -0.5)
    block_size, blocks = 32, 12
    kv_cache = torch.full((blocks, 1, block_size, 2 * HEAD), float("nan"))  # unwritten slots: never read
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [150, 41], [30, 1]
    pages = [[7, 2, 9, 0, 11], [4, 8]]
    keys = [torch.randn(n, 1, HEAD, generator=g) for n in seq_lens]
    values = [torch.randn(n, 1, HEAD, generator=g) for n in seq_lens]
    slots = [torch.tensor([pages[r][j // block_size] * block_size + j % block_size for j in range(n)])
             for r, n in enumerate(seq_lens)]
    # Earlier steps wrote the cached part; this step writes the new tokens (plus a padded slot, -1).
    for r, n in enumerate(seq_lens):
        layer.write(keys[r][: n - q_lens[r]], values[r][: n - q_lens[r]], kv_cache, slots[r][: n - q_lens[r]])
    new_k = torch.cat([keys[r][n - q_lens[r]:] for r, n in enumerate(seq_lens)] + [torch.randn(1, 1, HEAD)])
    new_v = torch.cat([values[r][n - q_lens[r]:] for r, n in enumerate(seq_lens)] + [torch.randn(1, 1, HEAD)])
    new_slots = torch.cat([slots[r][n - q_lens[r]:] for r, n in enumerate(seq_lens)] + [torch.tensor([-1])])
    layer.write(new_k, new_v, kv_cache, new_slots)
    queries = torch.randn(sum(q_lens) + 2, 2, HEAD, generator=g)  # 2 padded rows past num_actual_tokens
    block_table = torch.zeros(3, 8, dtype=torch.int32)  # one more row than requests, as vLLM's buffers
    for r, p in enumerate(pages):
        block_table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
    metadata = types.SimpleNamespace(
        num_actual_tokens=sum(q_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, q_lens[0], sum(q_lens), sum(q_lens)], dtype=torch.int32),
        block_table=block_table, rope_tables=attention.TableCache(plan).step(seq_lens))
    output = torch.zeros_like(queries)
    layer.attend(queries, kv_cache, metadata, output)
    state = model._ropescale_patch
    begin = 0
    for r, n in enumerate(seq_lens):
        table, factor = state.table(n if plan.length_dependent else None, torch.device("cpu"))
        k_pos = torch.arange(n)
        want = reference_attention(plan, queries[begin: begin + q_lens[r]], keys[r], values[r], k_pos[n - q_lens[r]:],
                                   k_pos, HEAD ** -0.5, table, factor)
        torch.testing.assert_close(output[begin: begin + q_lens[r]], want, atol=2e-6, rtol=0)
        begin += q_lens[r]
    assert torch.equal(output[begin:], torch.zeros(2, 2, HEAD))  # padded rows untouched


def test_cpu_impl_routes_only_pre_rope_models_to_ropescale(monkeypatch):
    def impl_for(config):
        model_config = types.SimpleNamespace(hf_config=config, dtype=torch.float32)
        vllm_config = types.SimpleNamespace(model_config=model_config,
                                            parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
        monkeypatch.setattr("vllm.config.get_current_vllm_config_or_none", lambda: vllm_config)
        monkeypatch.setattr("vllm.v1.attention.backends.cpu_attn.get_current_vllm_config", lambda: vllm_config)
        return attention.RopescaleCPUAttentionImpl(2, HEAD, HEAD ** -0.5, 1, None, None, "auto")

    assert impl_for(tiny_llama().config).pre_rope is None  # vLLM's own CPU attention, unchanged
    assert impl_for(hf.patch(tiny_llama(), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)).config
                    ).pre_rope is None
    assert isinstance(impl_for(patched("rerope").config).pre_rope, attention.PreRopeLayer)
    assert isinstance(impl_for(patched("dynamic_yarn").config).pre_rope, attention.PreRopeLayer)


# ---------------------------------------------------------------------------------------------
# 2. Engines


ENGINE = textwrap.dedent("""
    # Serves tiny checkpoints with vLLM, one engine per entry of job["engines"] (one process, engines in turn);
    # each engine runs its batches (one llm.generate call each) and prints one JSON line per batch.
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        job = json.loads(sys.argv[1])
        params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], prompt_logprobs=0, logprobs=0,
                                ignore_eos=True, detokenize=False)
        for engine in job["engines"]:
            start = time.perf_counter()
            try:
                llm = LLM(model=engine["path"], dtype=engine.get("dtype", "float32"), skip_tokenizer_init=True, seed=0,
                          max_model_len=job["max_model_len"], **engine["options"])
            except Exception as err:  # noqa: BLE001 (the error is the result)
                print("RESULT " + json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
                continue
            started = time.perf_counter()
            for batch in engine["batches"]:
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
                result = []
                for out in outs:
                    logprobs = [None if d is None else d[t].logprob
                                for d, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
                    result.append({"tokens": list(out.outputs[0].token_ids), "prompt_logprobs": logprobs})
                print("RESULT " + json.dumps(result), flush=True)
            print(f"TIMING {engine['path']}: start {started - start:.1f} s, runs {time.perf_counter() - started:.1f} s",
                  flush=True)
            del llm

    if __name__ == "__main__":
        main()
""")
NEW_TOKENS = 8


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


def serve(tmp_path, engines, env=None):
    """Run ``engines`` ([{"path", "options", "batches"}]) in one subprocess; returns (results per engine, log)."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    job = {"engines": engines, "new_tokens": NEW_TOKENS, "max_model_len": SERVED}
    environ = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", **(env or {})}
    result = subprocess.run([sys.executable, str(script), json.dumps(job)], cwd=tmp_path, env=environ,
                            capture_output=True, text=True, timeout=1500)
    lines = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    out, i = [], 0
    for engine in engines:
        if i < len(lines) and isinstance(lines[i], dict):
            out.append(lines[i])
            i += 1
            continue
        out.append(lines[i: i + len(engine["batches"])])
        i += len(engine["batches"])
    return out, result.stdout + result.stderr


def reference(path, batch):
    """transformers + ropescale (``hf.patch`` on the reload) on the saved checkpoint, one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.patch(model)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: exactly NEW_TOKENS tokens
    out = []
    for prompt in batch:
        x = torch.tensor([prompt])
        with torch.no_grad():
            logprobs = model(x).logits[0].double().log_softmax(-1)
            tokens = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):]
        out.append({"tokens": tokens.tolist(),
                    "prompt_logprobs": [None] + logprobs[:-1].gather(-1, x[0, 1:, None])[:, 0].tolist()})
    return out


LONG = [SERVED - NEW_TOKENS - 3, 37]  # past L (64) and many windows; and a short one
MIXED = [8, 240, 17, 130, 64, 65, 200, 33, 96, 150, 12, 180, 71, 110, 48, 221]  # 16 requests


@pytest.mark.slow
def test_engines_serve_pre_rope_checkpoints_as_transformers_does(tmp_path):
    paths = {}
    for name in ("rerope", "leaky_logn", "dynamic_yarn"):
        paths[name] = tmp_path / name
        patched(name).save_pretrained(paths[name])
    long, mixed = random_prompts(LONG, 1), random_prompts(MIXED, 2)
    prefix = random_prompts([150], 3)[0]
    shared = [prefix + tail for tail in random_prompts([5, 40, 1, 70], 4)]  # one hits 150 cached tokens + 1
    engines = [
        # ReRoPE with a token budget of 48 < the prompt: chunk boundaries every 48 tokens, each one inside the
        # window of the queries after it; vLLM's prefix cache on (its default). Batches: the long prompts;
        # 16 mixed-length requests together, then each alone; prompts sharing a 150-token prefix, twice.
        {"path": str(paths["rerope"]), "options": dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=48),
         "batches": [long, mixed, *[[p] for p in mixed], shared, shared]},
        # Compiled mode (vLLM traces the model, the pass-through rotary included; attention stays an opaque op).
        {"path": str(paths["leaky_logn"]), "options": dict(enforce_eager=False, max_num_seqs=4), "batches": [long]},
        # Dynamic-YaRN: each request's table at its own length; no chunking, no prefix cache (both would
        # rotate a prompt's chunks under earlier scales, which transformers' one-pass prefill does not).
        {"path": str(paths["dynamic_yarn"]),
         "options": dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=4096, enable_prefix_caching=False),
         "batches": [long, mixed, *[[p] for p in mixed]]},
    ]
    results, log = serve(tmp_path, engines)
    assert all(isinstance(r, list) and len(r) == len(e["batches"]) for r, e in zip(results, engines)), log[-6000:]
    print("\n".join(line for line in log.splitlines() if line.startswith("TIMING")))
    assert log.count("served pre-RoPE: raw keys in vLLM's paged cache") >= len(engines), log[-3000:]
    rerope, leaky_logn, dynamic = results

    assert_same(rerope[0], reference(paths["rerope"], long), "ReRoPE, chunked prefill (48-token budget)")
    solo = [run[0] for run in rerope[2: 2 + len(mixed)]]
    assert_same(rerope[1], solo, "ReRoPE: 16 concurrent requests vs each alone", atol=2e-6)
    assert_same(solo, reference(paths["rerope"], mixed), "ReRoPE, mixed lengths")
    shared_ref = reference(paths["rerope"], shared)
    assert_same(rerope[-2], shared_ref, "ReRoPE, shared prefixes")
    assert_same(rerope[-1], shared_ref, "ReRoPE, shared prefixes from vLLM's prefix cache")
    assert_same(leaky_logn[0], reference(paths["leaky_logn"], long), "Leaky ReRoPE with log-n, compiled mode")
    assert_same(dynamic[0], reference(paths["dynamic_yarn"], long), "Dynamic-YaRN")
    solo = [run[0] for run in dynamic[2:]]
    assert_same(dynamic[1], solo, "Dynamic-YaRN: 16 concurrent requests vs each alone", atol=2e-6)
    assert_same(solo, reference(paths["dynamic_yarn"], mixed), "Dynamic-YaRN, mixed lengths")


@pytest.mark.slow
def test_tensor_parallel_engine(tmp_path):
    path = tmp_path / "rerope"
    patched("rerope").save_pretrained(path)
    long = random_prompts(LONG, 1)
    engines = [{"path": str(path), "options": dict(enforce_eager=True, max_num_seqs=4, tensor_parallel_size=2),
                "batches": [long]}]
    # vLLM's CPU workers each bind their threads to a NUMA node unless told which cores to use; a machine
    # with one node (CI's 2 cores) refuses TP=2 ("Not enough allowed NUMA nodes"): one core per rank.
    results, log = serve(tmp_path, engines, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert isinstance(results[0], list), results[0] if results else log[-6000:]
    assert log.count("served pre-RoPE: raw keys in vLLM's paged cache") == 2, log[-3000:]  # one line per rank
    assert_same(results[0][0], reference(path, long), "ReRoPE, TP=2")


@pytest.mark.cuda
def test_cuda_engines_serve_pre_rope_checkpoints_with_the_custom_backend_and_cuda_graphs(tmp_path):
    """What a GPU user runs first (issue 26): ``--attention-backend CUSTOM`` with CUDA graphs on (vLLM's
    default compiled mode: full graphs for decode batches, which the CUDA builder declares, piecewise for
    the rest), a ReRoPE checkpoint with chunked prefill and the prefix cache, and a Dynamic-YaRN one with
    each request's table at its own length: the same tokens and prompt logprobs as transformers + ropescale.
    float32 on the GPU (the SIMT kernels; TF32 stays off in vLLM), so within 1e-4 of the CPU reference."""
    import importlib.metadata

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not any(e.name == "ropescale" for e in importlib.metadata.entry_points(group="vllm.general_plugins")):
        pytest.skip("ropescale is not pip-installed here (an in-place build): vLLM's processes find the plugin "
                    "through its vllm.general_plugins entry point")
    paths = {}
    for name in ("rerope", "dynamic_yarn"):
        paths[name] = tmp_path / name
        patched(name).save_pretrained(paths[name])
    long, mixed = random_prompts(LONG, 1), random_prompts(MIXED[:8], 2)
    graphs = dict(attention_backend="CUSTOM", enforce_eager=False, gpu_memory_utilization=0.3,
                  compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    engines = [
        {"path": str(paths["rerope"]), "options": dict(graphs, max_num_seqs=8, max_num_batched_tokens=48),
         "batches": [long, mixed]},
        {"path": str(paths["dynamic_yarn"]),
         "options": dict(graphs, max_num_seqs=8, max_num_batched_tokens=4096, enable_prefix_caching=False),
         "batches": [long, mixed]},
    ]
    results, log = serve(tmp_path, engines)
    assert all(isinstance(r, list) and len(r) == 2 for r in results), log[-6000:]
    assert log.count("served pre-RoPE: raw keys in vLLM's paged cache") >= len(engines), log[-3000:]
    for name, (served_long, served_mixed) in zip(paths, results):
        assert_same(served_long, reference(paths[name], long), f"{name} on CUDA, CUSTOM backend, graphs", atol=1e-4)
        assert_same(served_mixed, reference(paths[name], mixed), f"{name} on CUDA, 8 mixed requests", atol=1e-4)
