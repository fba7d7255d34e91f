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

import itertools
import json
import os
import types

import pytest
import torch

from support.vllm_engine import run_engines  # noqa: E402
from support.vllm_testing import (HEAD, ORIGINAL, assert_same, plugin_isolated, request_block_hasher,  # noqa: E402
                                  require_vllm, served_llama, transformers_request)

require_vllm()

from transformers import AutoModelForCausalLM  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from ropescale import config as config_lib, hf, ops, scaling, serving  # noqa: E402
from ropescale.vllm import attention, attention_plan, attention_prefix_cache, rotary  # noqa: E402

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
    # distinct short and long factors: each request's table at its own length, as the dynamic methods
    "longrope": (scaling.LongRoPE(short_factor=tuple(1.0 + 0.02 * i for i in range(HEAD // 2)),
                                  long_factor=tuple(1.0 + 0.25 * i for i in range(HEAD // 2)),
                                  original_max_position=ORIGINAL, factor=4.0), {}),
}


def patched(name, seed=0):
    method, kwargs = CHECKPOINTS[name]
    return hf.patch(served_llama(seed), method, **kwargs)


@pytest.fixture(autouse=True)
def isolated():
    with plugin_isolated():
        yield


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


def test_rows_take_the_table_of_the_whole_prompt_then_their_own_length():
    # (request, rows, seq_len, table_len) per segment; requests: (seq_len, query rows, prompt length)
    steps = [
        ([(48, 48, 300)], [(0, 48, 48, 300)]),  # the first chunk of a 300-token prompt: the whole prompt's table
        ([(300, 12, 300)], [(0, 12, 300, 300)]),  # its last chunk
        ([(301, 1, 300), (40, 40, 40)], [(0, 1, 301, 301), (1, 40, 40, 40)]),  # a decode row beside a prompt
        # a recompute after preemption (prompt 100, 4 generated tokens in one chunk): prompt rows, then each
        # generated row at its own length, as their decode steps computed them
        ([(104, 104, 100)], [(0, 100, 100, 100), (0, 1, 101, 101), (0, 1, 102, 102), (0, 1, 103, 103),
                             (0, 1, 104, 104)]),
        ([(96, 6, 92)], [(0, 2, 92, 92), (0, 1, 93, 93), (0, 1, 94, 94), (0, 1, 95, 95), (0, 1, 96, 96)]),
        ([(80, 3, 70)], [(0, 1, 78, 78), (0, 1, 79, 79), (0, 1, 80, 80)]),  # speculative rows past the prompt
        ([(0, 0, 0)], [(0, 0, 0, 1)]),  # a padded request
    ]
    for requests, want in steps:
        seq_lens, query_lens, prompt_lens = map(list, zip(*requests))
        assert attention.cut_segments(seq_lens, query_lens, prompt_lens) == want, requests
    # without prompt lengths (a vLLM whose runner gives none): each request at its current length
    assert attention.cut_segments([48, 301], [48, 1]) == [(0, 48, 48, 48), (1, 1, 301, 301)]


def vllm_config_of(model):
    return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=model.config))


def test_block_hashes_carry_the_prompts_table_for_length_dependent_methods(monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = request_block_hasher(monkeypatch)

    def hashes(model, prompt):
        attention_prefix_cache.ENGINE.clear()
        attention_prefix_cache.ENGINE["config"] = vllm_config_of(model) if model is not None else None
        return Request("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher).block_hashes

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 256, (200,), generator=g).tolist()
    dynamic, rerope = patched("dynamic_yarn"), patched("rerope")
    stock = hashes(None, tokens[:48])
    # ReRoPE's table is static: the stock hashes. Prompts within the original length (64) share the native table,
    # so their common blocks share hashes; past it, each length's scale is in every block's hash.
    assert hashes(rerope, tokens[:48]) == stock
    assert hashes(dynamic, tokens[:48])[:3] == hashes(dynamic, tokens[:64])[:3] != stock
    long_120, long_121 = hashes(dynamic, tokens[:120]), hashes(dynamic, tokens[:121])
    assert all(a != b for a, b in zip(long_120, long_121)) and len(long_120) == 7
    assert hashes(dynamic, tokens[:120]) == long_120
    assert attention.prompt_table_tag(10, vllm_config_of(dynamic)) == attention.prompt_table_tag(
        64, vllm_config_of(dynamic)) != attention.prompt_table_tag(65, vllm_config_of(dynamic))
    assert attention.prompt_table_tag(500, vllm_config_of(rerope)) is None


def test_length_dependent_models_ask_vllm_for_its_v1_model_runner(monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "_get_v2_model_runner_unsupported_features", lambda self: ["stock reason"])
    assert attention.prefer_v1_model_runner() and attention.prefer_v1_model_runner()  # idempotent
    unsupported = VllmConfig._get_v2_model_runner_unsupported_features
    assert unsupported(vllm_config_of(patched("rerope"))) == ["stock reason"]  # a static table: V2 is fine
    reasons = unsupported(vllm_config_of(patched("dynamic_yarn")))
    assert reasons[0] == "stock reason" and "per-row tables of DynamicYaRN" in reasons[1], reasons


def test_cuda_builder_declares_graphs_per_plan():
    from vllm.v1.attention.backend import AttentionCGSupport

    support = attention.PreRopeMetadataBuilder.get_cudagraph_support
    assert support(vllm_config_of(patched("rerope")), None) == AttentionCGSupport.UNIFORM_BATCH
    assert support(vllm_config_of(patched("dynamic_yarn")), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


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


def attend_step(layer, plan, kv_cache, queries, pages, seq_lens, q_lens, prompt_lens, width):
    """One step of ``layer.attend`` as vLLM's metadata gives it (a block table one row wider than the requests, as
    vLLM's buffers, ``width`` pages per row): (output, the step's tables)."""
    block_table = torch.zeros(len(pages) + 1, width, dtype=torch.int32)
    for r, p in enumerate(pages):
        block_table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
    starts = [0, *itertools.accumulate(q_lens)]
    tables = attention.TableCache(plan).step(seq_lens, q_lens, prompt_lens)
    metadata = types.SimpleNamespace(
        num_actual_tokens=sum(q_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts + [sum(q_lens)], dtype=torch.int32),
        block_table=block_table, rope_tables=tables)
    output = torch.zeros_like(queries)
    layer.attend(queries, kv_cache, metadata, output)
    return output, tables


@pytest.mark.parametrize("name", ["leaky_logn", "dynamic_yarn"])
def test_layer_writes_raw_pages_and_attends_through_the_block_table(name):
    """Two requests (a chunk of a long prefill and a decode) over scattered pages of one vLLM-shaped cache."""
    model = patched(name)
    plan = attention.PreRopePlan.of(config_lib.read_config(model.config), HEAD, True)
    attention_plan.RECORDED_PLAN.update(plan=plan)
    layer = attention.PreRopeLayer(2, 1, HEAD, HEAD ** -0.5)
    block_size, blocks = 32, 12
    kv_cache = torch.full((blocks, 1, block_size, 2 * HEAD), float("nan"))  # unwritten slots: never read
    g = torch.Generator().manual_seed(0)
    # a chunk of a 200-token prompt; a decode row; a recompute that crosses its prompt's end (84 of 90)
    seq_lens, q_lens, prompt_lens = [150, 41, 90], [30, 1, 12], [200, 20, 84]
    pages = [[7, 2, 9, 0, 11], [4, 8], [1, 3, 5]]
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
    output, tables = attend_step(layer, plan, kv_cache, queries, pages, seq_lens, q_lens, prompt_lens, width=8)
    assert (tables.segments is not None) == plan.length_dependent  # the recompute is cut into segments
    state = model._ropescale_patch
    # Each row on its own, as transformers + hf.patch compute it: a prompt row under the whole prompt's table,
    # a later row under its own length's, over the keys up to it.
    for r, n in enumerate(seq_lens):
        for i in range(q_lens[r]):
            position = n - q_lens[r] + i
            length = max(prompt_lens[r], position + 1)
            table, factor = state.table(length if plan.length_dependent else None, torch.device("cpu"))
            k_pos = torch.arange(position + 1)
            row = sum(q_lens[:r]) + i
            want = reference_attention(plan, queries[row: row + 1], keys[r][: position + 1],
                                       values[r][: position + 1], k_pos[-1:], k_pos, HEAD ** -0.5, table, factor)
            torch.testing.assert_close(output[row: row + 1], want, atol=2e-6, rtol=0, msg=f"request {r}, row {i}")
    assert torch.equal(output[sum(q_lens):], torch.zeros(2, 2, HEAD))  # padded rows untouched


def test_cpu_impl_routes_only_pre_rope_models_to_ropescale(monkeypatch):
    def impl_for(config):
        model_config = types.SimpleNamespace(hf_config=config, dtype=torch.float32)
        vllm_config = types.SimpleNamespace(model_config=model_config,
                                            parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
        monkeypatch.setattr("vllm.config.get_current_vllm_config_or_none", lambda: vllm_config)
        monkeypatch.setattr("vllm.v1.attention.backends.cpu_attn.get_current_vllm_config", lambda: vllm_config)
        return attention.RopescaleCPUAttentionImpl(2, HEAD, HEAD ** -0.5, 1, None, None, "auto")

    assert impl_for(served_llama().config).pre_rope is None  # vLLM's own CPU attention, unchanged
    assert impl_for(hf.patch(served_llama(), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)).config
                    ).pre_rope is None
    assert isinstance(impl_for(patched("rerope").config).pre_rope, attention.PreRopeLayer)
    assert isinstance(impl_for(patched("dynamic_yarn").config).pre_rope, attention.PreRopeLayer)


# ---------------------------------------------------------------------------------------------
# 2. Engines


NEW_TOKENS = 8


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


def serve(tmp_path, engines, env=None):
    """Run ``engines`` ([{"path", "options", "batches", "cached" (the batches that read vLLM's prefix cache),
    "env", "bad_entry"}]) in one subprocess (support.vllm_engine.run_engines), each served at SERVED tokens;
    returns (per engine its error ({"error"}) or its batches' results, the log, per engine the count of vLLM's
    preemptions (None where it did not run))."""
    params = dict(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=0, logprobs=0, ignore_eos=True,
                  detokenize=False)
    # vLLM never reads the prefix cache for a request that asks for prompt logprobs: "cached" batches ask for the
    # generated tokens' logprobs only
    cached_params = dict(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True, detokenize=False)
    ids = [f"{i} {os.path.basename(engine['path'])}" for i, engine in enumerate(engines)]  # position, checkpoint
    job = [{"id": ids[i], "path": engine["path"], "env": engine.get("env", {}),
            "bad_entry": engine.get("bad_entry", False),
            "options": dict(max_model_len=SERVED, disable_log_stats=False, **engine["options"]),
            "batches": [{"prompts": batch, "params": cached_params if k in engine.get("cached", ()) else params}
                        for k, batch in enumerate(engine["batches"])]}
           for i, engine in enumerate(engines)]
    results, log = run_engines(tmp_path, job, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
                                               **(env or {})}, timeout=1500)
    by_id = {r["id"]: r for r in results}
    out = [by_id.get(i, {"batches": []}) for i in ids]
    return [{"error": r["error"]} if "error" in r else r["batches"] for r in out], log, \
        [r.get("preemptions") for r in out]


def reference(path, batch):
    """transformers + ropescale (``hf.patch`` on the reload) on the saved checkpoint, one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.patch(model)
    return [transformers_request(model, prompt, NEW_TOKENS) for prompt in batch]


LONG = [SERVED - NEW_TOKENS - 3, 37]  # past L (64) and many windows; and a short one
MIXED = [8, 240, 17, 130, 64, 65, 200, 33, 96, 150, 12, 180, 71, 110, 48, 221]  # 16 requests


@pytest.mark.slow
def test_engines_serve_every_request_as_it_is_served_alone(tmp_path):
    """Issue 27: every pre-RoPE method under load (16 concurrent requests of mixed lengths, each prompt past the
    48-token budget chunked and batched with others, vLLM's prefix cache on), each request equal to transformers +
    hf.patch running it alone (one forward over the prompt, one per generated token); prompts that share a
    150-token prefix, twice (the second time from the prefix cache where the prompt's table is the same); a KV
    cache too small for the batch (preemption, then recompute); an invalid entry refused at engine start."""
    names = ("rerope", "leaky_logn", "dynamic_yarn", "dynamic_ntk", "longrope")
    paths = {}
    for name in names:
        paths[name] = tmp_path / name
        patched(name).save_pretrained(paths[name])
    bad = tmp_path / "bad_window"
    patched("rerope").save_pretrained(bad)
    config = json.loads((bad / "config.json").read_text())
    config["ropescale"]["window"] = 0
    (bad / "config.json").write_text(json.dumps(config))
    batches = {"long": random_prompts(LONG, 1), "mixed": random_prompts(MIXED, 2)}
    prefix = random_prompts([150], 3)[0]
    batches["shared"] = [prefix + tail for tail in random_prompts([5, 40, 1, 70], 4)]
    # the same prompts, then others with the same 150-token prefix, reading vLLM's prefix cache
    batches["shared_cached"] = batches["shared"]
    batches["other_cached"] = [prefix + tail for tail in random_prompts([9, 33, 2], 6)]
    # each crosses a 32-token page during its 8 generated tokens: with 10 pages for 1,000 prompt tokens, vLLM
    # preempts running requests and later recomputes their prompt and generated tokens in one prefill
    batches.update({f"alone{i}": [prompt] for i, prompt in enumerate(batches["mixed"])})
    batches["crossing"] = random_prompts([28, 29, 30, 60, 61, 62, 92, 93, 124, 125, 126, 156], 5)
    load = dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=48)  # chunks every 48 tokens
    runs = [  # (checkpoint, engine options, batches)
        ("rerope", load, ("long", "mixed", "shared", "shared_cached", "other_cached")),
        # compiled mode (vLLM traces the model, the pass-through rotary included; attention stays an opaque op)
        ("leaky_logn", dict(enforce_eager=False, max_num_seqs=4), ("long",)),
        ("dynamic_yarn", load, ("long", "mixed", "shared", "shared_cached", "other_cached")),
        ("dynamic_ntk", load, ("mixed", "shared")),
        ("longrope", load, ("mixed", "shared", *(f"alone{i}" for i in range(len(MIXED))))),
        # 10 pages of 32 tokens (the engine core in this process, so that the test counts vLLM's preemptions)
        ("dynamic_yarn", dict(load, num_gpu_blocks_override=10, block_size=32), ("crossing",)),
    ]
    engines = [{"path": str(paths[name]), "options": options, "batches": [batches[b] for b in names_],
                "cached": [k for k, b in enumerate(names_) if b.endswith("_cached")]} for name, options, names_ in runs]
    engines[-1]["env"] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    engines.append({"path": str(bad), "options": load, "batches": [batches["long"]], "bad_entry": True})
    results, log, preemptions = serve(tmp_path, engines)
    assert all(isinstance(r, list) and len(r) == len(e["batches"]) for r, e in zip(results, engines[:-1])), \
        log[-6000:]
    assert log.count("served pre-RoPE: raw keys in vLLM's paged cache") >= len(runs), log[-3000:]
    expected = {}
    for (name, _, batch_names), served in zip(runs, results):
        for k, (run, batch) in enumerate(zip(served, batch_names)):
            if batch.startswith("alone"):
                continue
            if (name, batch) not in expected:
                expected[name, batch] = reference(paths[name], batches[batch])
            want = expected[name, batch]
            if name == "longrope" and batch == "mixed":
                # KNOWN DIFFERENCE (not batching's): hf.patch runs LongRoPE with transformers' rotated-key cache (a
                # prompt within L keeps its short-factor keys when decoding passes L), the plugin pre-RoPE (every
                # key re-rotated with the long factors there): a request crossing L while decoding differs from
                # transformers. Those are held to vLLM serving them alone; the others to transformers.
                crossing = [i for i, n in enumerate(MIXED) if n <= ORIGINAL < n + NEW_TOKENS - 1]
                assert crossing == [MIXED.index(ORIGINAL)]
                alone = [r[0] for r in served[2:]]
                assert_same(run, alone, "longrope under load vs each request alone")
                want = [alone[i] if i in crossing else w for i, w in enumerate(want)]
            assert_same(run, want, f"{name}, batch {k} ({batch})")
    # Prefix cache reads (128-token pages): the same prompts again hit their first page; other prompts with the
    # same 150-token prefix hit it under ReRoPE (a static table) and not under Dynamic-YaRN (past the original
    # length each prompt length has its own table, so its own pages).
    cached = {runs[i][0]: [[r["cached"] for r in run] for run in results[i][3:5]] for i in (0, 2)}
    assert cached == {"rerope": [[128] * 4, [128] * 3], "dynamic_yarn": [[128] * 4, [0] * 3]}, cached
    assert preemptions[len(runs) - 1] > 0, preemptions  # the small cache did preempt
    # an invalid entry: refused at engine start (the model build), with hf.patch's message
    assert isinstance(results[-1], dict) and "engine started" not in results[-1]["error"], results[-1]
    assert "attention='rerope' needs window, an integer > 0, got 0" in log, log[-3000:]


@pytest.mark.slow
def test_tensor_parallel_engine(tmp_path):
    """TP=2: Dynamic-YaRN under load (16 concurrent requests, chunked every 48 tokens) equal to each request alone."""
    path = tmp_path / "dynamic_yarn"
    patched("dynamic_yarn").save_pretrained(path)
    mixed = random_prompts(MIXED, 2)
    engines = [{"path": str(path), "options": dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=48,
                                                   tensor_parallel_size=2),
                "batches": [mixed]}]
    # vLLM's CPU workers each bind their threads to a NUMA node unless told which cores to use; a machine
    # with one node (CI's 2 cores) refuses TP=2 ("Not enough allowed NUMA nodes"): one core per rank.
    results, log, _ = serve(tmp_path, engines, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert isinstance(results[0], list), results[0] if results else log[-6000:]
    assert log.count("served pre-RoPE: raw keys in vLLM's paged cache") == 2, log[-3000:]  # one line per rank
    assert_same(results[0][0], reference(path, mixed), "Dynamic-YaRN under load, TP=2")


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
    results, log, _ = serve(tmp_path, engines)
    assert all(isinstance(r, list) and len(r) == 2 for r in results), log[-6000:]
    assert log.count("served pre-RoPE: raw keys in vLLM's paged cache") >= len(engines), log[-3000:]
    for name, (served_long, served_mixed) in zip(paths, results):
        assert_same(served_long, reference(paths[name], long), f"{name} on CUDA, CUSTOM backend, graphs", atol=1e-4)
        assert_same(served_mixed, reference(paths[name], mixed), f"{name} on CUDA, 8 mixed requests", atol=1e-4)


# Partial-rotary heads (Phi-3: 24 of 32 dims rotated, half-split; GLM-4: 16 of 32, pairs (2i, 2i+1)) under a table
# whose attention factor m is not 1: transformers puts m on cos and sin (the rotated dims of q and k only), the
# paged op scales whole scores, so the layer folds m^2 into the query's rotated dims (PreRopePlan.attention_arguments).
# Served before with the factor on the whole score, Phi-3's LongRoPE was 0.13 nats off transformers and GLM-4's 0.27.
PARTIAL = {  # name: (method, rotary dim of a 32-dim head, interleaved, window)
    "phi3_longrope": (scaling.LongRoPE(short_factor=tuple(1.0 + 0.02 * i for i in range(12)),
                                       long_factor=tuple(1.0 + 0.25 * i for i in range(12)),
                                       original_max_position=16, factor=4.0), 24, False, serving.NO_WINDOW),
    "glm_dynamic_yarn": (scaling.DynamicYaRN(original_max_position=16), 16, True, serving.NO_WINDOW),
    "glm_rerope_yarn": (scaling.YaRN(factor=4.0, original_max_position=16), 16, True, 6),
}


def test_pre_rope_partial_rotary_with_an_attention_factor_gets_the_pass_through():
    """get_rope's pass-through is given to a partial-rotary head whatever its attention factor (it was refused
    while the op's whole-score factor was all the backend had)."""
    attention.register_backends()
    vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace())
    params = {**scaling.DynamicYaRN(original_max_position=16).to_hf(base=10000.0), "partial_rotary_factor": 0.75}
    parsed = config_lib.read(params, 64, None, 24)
    layer = attention.pass_through(32, 24, 64, True, parsed, vllm_config)
    assert isinstance(layer, attention.PreRopeRotary) and layer.rotary_dim == 24
    assert attention.current_plan() == serving.PreRopePlan.of(parsed, 24, True)
    assert attention.current_plan().attention_factor_varies


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_layer_on_a_partial_rotary_head_puts_the_attention_factor_on_the_rotated_dims(name):
    """One layer's write + attention over scattered pages (a chunk of a long prefill, a decode row, a recompute
    crossing its prompt's end: segments with different factors), every row equal to the float64 reference of
    transformers' rule: its table and factor m at its length, m on the rotated dims of q and k only."""
    from support.attention import reference

    method, rotary_dim, interleaved, window = PARTIAL[name]
    head = 32
    plan = serving.PreRopePlan(method, 10000.0, rotary_dim, window, interleaved=interleaved)
    attention_plan.RECORDED_PLAN.update(plan=plan)
    layer = attention.PreRopeLayer(2, 1, head, head ** -0.5)
    block_size, blocks = 16, 24
    kv_cache = torch.full((blocks, 1, block_size, 2 * head), float("nan"))
    g = torch.Generator().manual_seed(3)
    seq_lens, q_lens, prompt_lens = [150, 41, 90], [30, 1, 12], [200, 20, 84]
    pages = [[7, 2, 9, 0, 11, 13, 15, 17, 19, 21], [4, 8, 23], [1, 3, 5, 6, 10, 12]]
    keys = [torch.randn(n, 1, head, generator=g) for n in seq_lens]
    values = [torch.randn(n, 1, head, generator=g) for n in seq_lens]
    for r, n in enumerate(seq_lens):
        slots = torch.tensor([pages[r][j // block_size] * block_size + j % block_size for j in range(n)])
        layer.write(keys[r], values[r], kv_cache, slots)
    queries = torch.randn(sum(q_lens) + 2, 2, head, generator=g)  # 2 padded rows past num_actual_tokens
    output, tables = attend_step(layer, plan, kv_cache, queries, pages, seq_lens, q_lens, prompt_lens, width=12)
    cache = attention.TableCache(plan)  # the reference's tables, each length's own
    factors = set()
    for r, n in enumerate(seq_lens):
        for i in range(q_lens[r]):
            position = n - q_lens[r] + i
            table, factor = cache.table(max(prompt_lens[r], position + 1))
            factors.add(round(factor, 6))
            row = sum(q_lens[:r]) + i
            k_pos = torch.arange(position + 1)[None]
            want, _ = reference(queries[row: row + 1].transpose(0, 1)[None], keys[r][: position + 1].transpose(0, 1)[None],
                                values[r][: position + 1].transpose(0, 1)[None], k_pos[:, -1:], k_pos, table.double(),
                                window, scale=head ** -0.5, interleaved=interleaved, factor=factor)
            torch.testing.assert_close(output[row: row + 1].double(), want[0].transpose(0, 1), atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"request {r}, row {i}: {m}")
    assert min(abs(f - 1.0) for f in factors) > 0.05  # the test can fail: every row's factor matters
    assert torch.equal(output[sum(q_lens):], torch.zeros(2, 2, head))  # padded rows untouched


def test_a_per_layer_type_checkpoint_takes_ropescales_table_on_its_extended_layer_types_only(tmp_path, monkeypatch):
    """Gemma 3 patched with YaRN on its full layers: the plugin gives those layers ropescale's table and its sliding
    layers vLLM's own (each layer's get_rope call carries its type's parameters, the model one entry); a pre-RoPE
    method on some layer types, and parameters no type of which matches the entry, are refused by name."""
    from transformers import Gemma3TextConfig

    def config_with(method):
        config = Gemma3TextConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  max_position_embeddings=64, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])
        hf.checkpoint.record(config, method, layer_types=("full_attention",))
        monkeypatch.setattr(rotary, "_model_config", lambda: types.SimpleNamespace(hf_config=config, max_model_len=64))
        return config

    config = config_with(scaling.YaRN(factor=4.0, original_max_position=16))
    full = rotary.get_rope(32, 64, True, dict(config.rope_parameters["full_attention"]), torch.float32)
    sliding = rotary.get_rope(32, 64, True, dict(config.rope_parameters["sliding_attention"]), torch.float32)
    assert isinstance(full, rotary.RopescaleRotaryEmbedding) and isinstance(full.method, scaling.YaRN)
    assert not isinstance(sliding, rotary.RopescaleRotaryEmbedding)
    config.rope_parameters["full_attention"]["factor"] = 8.0  # edited by hand: no type matches the entry
    with pytest.raises(ValueError, match="no layer type's rope_parameters match"):
        rotary.get_rope(32, 64, True, dict(config.rope_parameters["full_attention"]), torch.float32)
    # Gemma 4: the full layers' own head dim (64, the sliding layers' 32); NTK-aware's written base depends on the
    # rotary dim, so each type's parameters are read at their own (a sliding layer's call must not refuse the model).
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                              max_position_embeddings=64, sliding_window=8, vocab_size_per_layer_input=101,
                              hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    hf.checkpoint.record(config, scaling.NTK(factor=4.0), layer_types=("full_attention",))
    monkeypatch.setattr(rotary, "_model_config", lambda: types.SimpleNamespace(hf_config=config, max_model_len=64))
    sliding = rotary.get_rope(32, 64, True, dict(config.rope_parameters["sliding_attention"]), torch.float32)
    full = rotary.get_rope(64, 64, True, dict(config.rope_parameters["full_attention"]), torch.float32)
    assert not isinstance(sliding, rotary.RopescaleRotaryEmbedding)
    assert isinstance(full, rotary.RopescaleRotaryEmbedding) and isinstance(full.method, scaling.NTK)
    config = config_with(scaling.DynamicYaRN(original_max_position=16))
    with pytest.raises(NotImplementedError, match="pre-RoPE method .* per-layer-type config \\(Gemma 3, Gemma 4\\)"):
        rotary.get_rope(32, 64, True, dict(config.rope_parameters["full_attention"]), torch.float32)
