"""Issues 29 and 43 in vLLM: a ``per="request"`` Dynamic-YaRN checkpoint served by vLLM's own attention backend, its
keys rotated when written with their request's table (ropescale's RequestRotaryEmbedding), each request under the
static YaRN model of ``s = max(1, (P + N) / L)`` (N: its ``max_tokens``) for its whole life.

Runs on the vLLM leg (as test_vllm_paged.py); skips elsewhere. Without an engine: the planned lengths read from the
V1 runner, the block hash (a request's pages are shared only with requests of the same scale), and the rotary layer
on CPU tensors (eager, compiled, a capture step's padded dummy requests).
With engines (slow: one subprocess, four engines):

- a request with P + N <= L gives the prompt logprobs of the unscaled model served by the same engine (1e-6);
- a longer one equals transformers + ``hf.patch`` with the static ``YaRN(factor=s)`` table (1e-5);
- the same requests with chunked prefill and prefix caching on, and with both off: identical; in compiled mode too;
- two requests that share a 150-token prefix but not their scale share no page; with the same scale they do;
- a KV cache too small for the batch (preemption, then recompute): every request keeps its scale;
- a request that states no length (no SamplingParams: vLLM's defaults from the generation config) is planned with
  the budget ``ropescale extend --per request`` writes there: the native model's output, stopped at the budget; the
  engine logs that rule, and warns for a checkpoint without a budget (vLLM's chat endpoint plans such a request at
  max_model_len).
"""

import json
import types

import pytest
import torch

from support.vllm_engine import run_engines  # noqa: E402
from support.vllm_testing import (HEAD, ORIGINAL, assert_same, request_block_hasher, require_vllm,  # noqa: E402
                                  served_llama, transformers_request)

require_vllm()

from ropescale import hf, ops, scaling, serving  # noqa: E402
from ropescale.vllm import attention, attention_prefix_cache, attention_steps  # noqa: E402

SERVED = 256
BASE = served_llama().config.rope_parameters["rope_theta"]
METHOD = scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")

# (prompt length, max_tokens): P + N <= L = 64 (native), then past it (s = (P + N) / 64 up to 3.3)
SHORT = [(10, 8), (30, 20), (50, 14), (56, 8)]
LONG = [(40, 60), (57, 8), (100, 8), (130, 40), (180, 16), (200, 12)]


def prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------
# No engine


def test_builders_read_each_requests_planned_length_from_the_v1_runner():
    """prompt + max_tokens per request in the batch's order; a pooling request counts 1 (vLLM's Request does)."""
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=["a", "b", "c"]),
        requests={"a": types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_tokens=7)),
                  "b": types.SimpleNamespace(sampling_params=None),
                  "c": types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_tokens=100))})
    attention_steps.PROMPT_LENS.update(tensor=torch.tensor([10, 20, 30, 0]), runner=runner)
    try:
        assert attention.step_request_lens(3) == [17, 21, 130]
        assert attention.step_request_lens(2) == [17, 21]
        assert attention.step_request_lens(4) == [17, 21, 130, 1]  # a padded request (graph capture): any table
        assert attention.step_request_lens(5) is None  # more requests than the step has lengths for: none
    finally:
        attention_steps.PROMPT_LENS.update(tensor=None, runner=None)
    assert attention.step_request_lens(1) is None


def test_block_hashes_carry_the_requests_scale(monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = request_block_hasher(monkeypatch)
    model = hf.patch(served_llama(), METHOD)
    attention_prefix_cache.ENGINE["config"] = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=model.config))

    def hashes(prompt, max_tokens):
        return Request("r", prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=hasher).block_hashes

    tokens = prompts([200], 0)[0]
    # within L whatever the budget: the native table, shared
    assert hashes(tokens[:40], 8) == hashes(tokens[:40], 24)
    # the same prompt with another scale shares no block; the same scale (P + N equal) shares all
    assert all(a != b for a, b in zip(hashes(tokens[:150], 8), hashes(tokens[:150], 9)))
    assert hashes(tokens[:150], 8) == hashes(tokens[:150], 8)
    assert hashes(tokens[:150], 10)[:9] == hashes(tokens[:152], 8)[:9]  # 160 both: the prefix's blocks are shared


# ---------------------------------------------------------------------------------------------
# The rotary layer (rotated at write), on CPU tensors: what vLLM's model runs, eager and compiled


def fake_runner(prompt_lens, max_tokens, query_lens):
    """What update_request_rotary reads from vLLM's V1 model runner while it builds a step's metadata."""
    req_ids = [f"r{i}" for i in range(len(max_tokens))]
    starts = torch.cumsum(torch.tensor([0, *query_lens]), 0).numpy()
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=req_ids),
        requests={r: types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_tokens=n))
                  for r, n in zip(req_ids, max_tokens)},
        query_start_loc=types.SimpleNamespace(np=starts))
    attention_steps.PROMPT_LENS.update(tensor=torch.tensor(prompt_lens), runner=runner)
    return runner


def request_layer():
    """get_rope's layer for the per-request checkpoint, built under a vLLM config as at model build."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from ropescale import config as config_lib
    from ropescale.vllm import rotary

    config = hf.patch(served_llama(), METHOD).config
    vllm_config = VllmConfig()
    vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.scheduler_config.max_num_seqs = 64, 8
    with set_current_vllm_config(vllm_config):
        layer = rotary.get_rope(HEAD, ORIGINAL, True, config.rope_parameters, torch.float32)
    assert isinstance(layer, rotary.RequestRotaryEmbedding), layer
    assert serving.rotated_at_write(config_lib.read_config(config))
    return layer


def static_rotation(length, positions, q, k):
    """q and k ``[T, H*D]`` turned by the static model of a request of ``length`` planned tokens: past L, YaRN(s)'s
    float32 table and attention factor through ``apply_rotary_pos`` (what hf.patch computes); within L, the native
    model as vLLM serves it (its own rotary: float32 angles)."""
    if length <= ORIGINAL:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        with set_current_vllm_config(VllmConfig()):
            native = RotaryEmbedding(HEAD, HEAD, ORIGINAL, BASE, True, torch.float32)
        return RotaryEmbedding.forward_static(positions, q, k, HEAD, HEAD, native.cos_sin_cache, True)
    method = scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL)
    inv_freq, factor = method.inv_freq(HEAD, BASE), method.attention_factor
    turned = [ops.apply_rotary_pos(x.view(len(positions), -1, HEAD).transpose(0, 1)[None], positions, inv_freq,
                                   factor)[0].transpose(0, 1).reshape(x.shape) for x in (q, k)]
    return turned[0], turned[1]


def test_rotary_layer_turns_each_token_with_its_requests_static_table_eager_and_compiled():
    """A step of 3 requests (a prefill chunk, a decode row, a short request that fits L: native): each token's q and
    k equal the static YaRN(s) model's rotation of its request bit for bit, and the short request's vLLM's own native
    rotation (within the rotation's float32 rounding: ropescale's accurate angles were 2.4e-4 rad away at 8k); the in-place forward (eager
    vLLM) equals the functional one (compiled vLLM), and a compiled forward reads the NEXT step's tables from the
    same buffers (nothing specialised to a step; the graph reads no host value)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: F401  (the hook's target exists)

    layer = request_layer()
    gen = torch.Generator().manual_seed(0)
    steps = [([150, 200, 20], [40, 16, 8], [7, 1, 5]),   # planned 190, 216, 28
             ([150, 200, 20, 90], [40, 16, 8, 100], [1, 1, 1, 9]),
             ([150, 200], [40, 16], [2, 3])]
    compiled = torch.compile(layer.forward_native, fullgraph=True, dynamic=True)
    try:
        for prompt_lens, max_tokens, query_lens in steps:
            runner = fake_runner(prompt_lens, max_tokens, query_lens)
            attention.update_request_rotary(runner, len(prompt_lens))
            tokens = sum(query_lens)
            positions = torch.cat([torch.arange(p - q, p) if q < p else torch.arange(q)
                                   for p, q in zip(prompt_lens, query_lens)])
            qkv = torch.randn(tokens, 4 * HEAD, generator=gen)
            q, k = qkv[:, : 2 * HEAD], qkv[:, 2 * HEAD: 3 * HEAD]  # vLLM's views of one fused row
            want_q, want_k = q.clone(), k.clone()
            start = 0
            for p, n, rows in zip(prompt_lens, max_tokens, query_lens):
                sl = slice(start, start + rows)
                want_q[sl], want_k[sl] = static_rotation(p + n, positions[sl], q[sl], k[sl])
                start += rows
            got_q, got_k = compiled(positions, q.clone(), k.clone())
            scaled = torch.cat([torch.full((rows,), p + n > ORIGINAL)
                                for p, n, rows in zip(prompt_lens, max_tokens, query_lens)])
            # the scaled requests: the same kernel math as the static model's, bit for bit; the native ones: vLLM's
            # own rotation (its float32 table), within float32 rounding of the rotation's arithmetic
            assert torch.equal(got_q[scaled], want_q[scaled]) and torch.equal(got_k[scaled], want_k[scaled])
            torch.testing.assert_close(got_q, want_q, atol=2e-6, rtol=0)
            torch.testing.assert_close(got_k, want_k, atol=2e-6, rtol=0)
            eager_q, eager_k = q.clone(), k.clone()
            layer.forward_cpu(positions, eager_q, eager_k)
            assert torch.equal(eager_q, got_q) and torch.equal(eager_k, got_k)
            cuda_q, cuda_k = q.clone(), k.clone()  # forward_cuda's code, on CPU tensors
            layer.forward_cuda(positions, cuda_q, cuda_k)
            assert torch.equal(cuda_q, got_q) and torch.equal(cuda_k, got_k)
            v_before = qkv[:, 3 * HEAD:].clone()
            layer.forward_cpu(positions, q, k)  # in place on the fused row: v untouched
            assert torch.equal(qkv[:, 3 * HEAD:], v_before)
    finally:
        attention_steps.PROMPT_LENS.update(tensor=None, runner=None)


def test_a_graph_capture_step_of_padded_dummy_requests_gets_valid_tables():
    """vLLM's capture (``_dummy_run``: ``num_reqs`` padded dummy requests with no ids, ``for_cudagraph_capture``)
    and a step whose padded tokens run past the real ones: every token's row is a valid table (the op's CPU check
    would refuse another), and the buffers keep their addresses."""
    layer = request_layer()
    tables = layer.request_tables
    addresses = [t.data_ptr() for t in (tables.request_index, tables.inv_freq, tables.attention_factors)]
    runner = fake_runner([1, 1, 1, 1], [], [1, 1, 1, 1])
    runner.input_batch.req_ids = []  # dummy requests
    try:
        attention.update_request_rotary(runner, 4)
        positions = torch.zeros(6, dtype=torch.int64)  # 2 padded tokens past the step
        q, k = torch.randn(6, 2 * HEAD), torch.randn(6, HEAD)
        layer.forward_cpu(positions, q, k)
        with pytest.raises(RuntimeError, match="larger than the per-request rotation's buffers"):
            attention.update_request_rotary(fake_runner([1] * 9, [1] * 9, [1] * 9), 9)
    finally:
        attention_steps.PROMPT_LENS.update(tensor=None, runner=None)
    assert [t.data_ptr() for t in (tables.request_index, tables.inv_freq, tables.attention_factors)] == addresses


# ---------------------------------------------------------------------------------------------
# Engines


def params(max_tokens, prompt_logprobs=True):
    return dict(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False,
                **({"prompt_logprobs": 0} if prompt_logprobs else {}))


def batch(requests, seed, prompt_logprobs=True):
    return {"prompts": prompts([p for p, _ in requests], seed),
            "params_each": [params(n, prompt_logprobs) for _, n in requests]}


def reference(model_for, batch_):
    """transformers + hf.patch, each request alone, with the static table its scale gives."""
    return [transformers_request(model_for(len(prompt) + each["max_tokens"]), prompt, each["max_tokens"])
            for prompt, each in zip(batch_["prompts"], batch_["params_each"])]


def static_model(length):
    """The static model of the scale a request of ``length`` planned tokens gets (native within L)."""
    model = served_llama().eval()
    if length <= ORIGINAL:
        return model
    return hf.patch(model, scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL))


BUDGET = 12  # the planning budget extend writes (generation_config.json max_new_tokens)


def budgeted(tmp_path, native):
    """``ropescale extend --per request --max-new-tokens BUDGET`` of the native checkpoint, whose generation config
    asks for greedy decoding (vLLM's defaults then are greedy, BUDGET tokens)."""
    from ropescale import cli

    generation = json.loads((native / "generation_config.json").read_text())
    (native / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}))
    path = tmp_path / "budgeted"
    assert cli.main(["extend", str(native), str(path), "--method", "dynamic_yarn", "--per", "request",
                     "--original-max-position", str(ORIGINAL), "--max-length", str(SERVED),
                     "--max-new-tokens", str(BUDGET)]) == 0
    assert json.loads((path / "generation_config.json").read_text())["max_new_tokens"] == BUDGET
    return path


@pytest.mark.slow
def test_each_request_is_the_static_model_of_its_scale_however_vllm_schedules_it(tmp_path):
    per_request, native = tmp_path / "per_request", tmp_path / "native"
    hf.patch(served_llama(), METHOD).save_pretrained(per_request)
    served_llama().save_pretrained(native)
    unstated = {"prompts": prompts([10, 30, 44], 5), "params": None}  # P + 12 <= 64: native
    mixed = batch(SHORT + LONG, 1)
    short = {"prompts": mixed["prompts"][:len(SHORT)], "params_each": mixed["params_each"][:len(SHORT)]}
    prefix = prompts([150], 2)[0]
    tails = prompts([6, 6], 3)
    shared = {"prompts": [prefix + tails[0]], "params_each": [params(8, False)]}  # 164: s = 2.56
    shared_same = {"prompts": [prefix + tails[1]], "params_each": [params(8, False)]}  # the same scale: shares
    shared_other = {"prompts": [prefix + tails[1]], "params_each": [params(30, False)]}  # 186: another scale
    crossing = batch([(28, 8), (29, 40), (60, 8), (61, 30), (92, 8), (124, 8), (125, 20), (156, 8)], 4)
    load = dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=48, max_model_len=SERVED)
    whole = dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=SERVED, enable_prefix_caching=False,
                 max_model_len=SERVED)
    engines = [
        {"id": "chunked", "path": str(per_request), "options": load,
         "batches": [mixed, shared, shared_same, shared_other]},
        {"id": "whole", "path": str(per_request), "options": whole, "batches": [mixed]},
        # vLLM's compiled mode (torch.compile of the model: the rotary's functional op traced, its tables read from
        # the fixed buffers the runner's hook writes each step)
        {"id": "compiled", "path": str(per_request), "options": dict(load, enforce_eager=False), "batches": [mixed]},
        {"id": "native", "path": str(native), "options": load, "batches": [short, unstated]},
        {"id": "budgeted", "path": str(budgeted(tmp_path, native)), "options": load, "batches": [unstated]},
        # 10 pages of 32 tokens: vLLM preempts and recomputes (the engine core in this process counts it)
        {"id": "preempted", "path": str(per_request), "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
         "options": dict(load, num_gpu_blocks_override=10, block_size=32), "batches": [crossing]},
    ]
    results, log = run_engines(tmp_path, engines, {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                   "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, timeout=1500)
    by_id = {r["id"]: r for r in results}
    assert all("batches" in by_id.get(e["id"], {}) for e in engines), log[-6000:]
    chunked, whole_run = by_id["chunked"]["batches"], by_id["whole"]["batches"]
    # chunked prefill and prefix caching on, and both off: the same results
    assert_same(chunked[0], whole_run[0], "chunked + prefix caching vs whole prompts, no prefix caching", atol=1e-6)
    assert_same(by_id["compiled"]["batches"][0], reference(static_model, mixed), "compiled mode vs static YaRN")
    # a request that fits L: the native model served by the same engine
    assert_same(chunked[0][:len(SHORT)], by_id["native"]["batches"][0], "short requests vs native", atol=1e-6)
    # every request: transformers with the static table of its scale
    assert_same(chunked[0], reference(static_model, mixed), "per-request vs static YaRN at its scale")
    # pages: the same scale shares the prefix's first 128-token page, another scale shares none
    assert [r[0]["cached"] for r in chunked[1:]] == [0, 128, 0], [r[0]["cached"] for r in chunked[1:]]
    assert_same(chunked[3], reference(static_model, shared_other), "the other scale, after the shared prefix")
    # preemption and recompute keep each request's scale
    assert by_id["preempted"]["preemptions"] > 0, by_id["preempted"]
    assert_same(by_id["preempted"]["batches"][0], reference(static_model, crossing), "preempted")
    # no stated length: planned with the budget (native here), stopped there; the rule logged, its absence warned
    # (the native checkpoint has no budget: vLLM's offline default, 16 tokens, of which the first BUDGET compare)
    unplanned = [r["tokens"] for r in by_id["budgeted"]["batches"][0]]
    native_unplanned = [r["tokens"] for r in by_id["native"]["batches"][1]]
    assert unplanned == [tokens[:BUDGET] for tokens in native_unplanned], (unplanned, native_unplanned)
    assert BUDGET in map(len, unplanned) and all(len(t) <= BUDGET for t in unplanned)
    assert f"on /v1/chat/completions the generation config's max_new_tokens, {BUDGET}" in log, log[-6000:]
    assert "a chat request without max_tokens is planned at max_model_len (256 tokens)" in log


def test_cuda_builder_declares_full_graphs_for_uniform_batches():
    """A per-request method never cuts a request into segments (one table per request, in the builder's persistent
    buffers): CUDA graphs for uniform batches (speculative verification included), as a static table's."""
    from vllm.v1.attention.backend import AttentionCGSupport

    def config_of(method):
        model = hf.patch(served_llama(), method)
        return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=model.config))

    support = attention.PreRopeMetadataBuilder.get_cudagraph_support
    assert support(config_of(METHOD), None) == AttentionCGSupport.UNIFORM_BATCH
    per_step = scaling.DynamicYaRN(original_max_position=ORIGINAL)
    assert support(config_of(per_step), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


FP8_NEEDS = "vLLM 0.32's CPU attention takes an fp8 KV cache on x86 CPUs with AVX-512 or AMX only"


@pytest.mark.slow
@pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()), reason=FP8_NEEDS)
def test_an_fp8_kv_cache_serves_per_request_as_it_serves_the_static_model(tmp_path):
    """``kv_cache_dtype="fp8"`` (refused by the pre-RoPE backend; vLLM's own takes it): three requests planned at 160
    tokens (s = 2.5) against transformers' float32 static YaRN(2.5). The precision rule: within twice what vLLM's
    fp8 cache costs the static YaRN(2.5) checkpoint served by the same engine on the same requests, plus 1e-5."""
    per_request, static = tmp_path / "per_request", tmp_path / "static"
    hf.patch(served_llama(), METHOD).save_pretrained(per_request)
    static_model(160).save_pretrained(static)
    requests = batch([(100, 60), (130, 30), (152, 8)], 6)
    options = dict(enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=SERVED, max_model_len=SERVED,
                   kv_cache_dtype="fp8")
    engines = [{"id": "per_request", "path": str(per_request), "options": options, "batches": [requests]},
               {"id": "static", "path": str(static), "options": options, "batches": [requests]}]
    results, log = run_engines(tmp_path, engines, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, timeout=900)
    by_id = {r["id"]: r for r in results}
    assert all("batches" in by_id.get(e["id"], {}) for e in engines), log[-6000:]
    expected = reference(static_model, requests)

    def worst(served):
        return max(max(abs(a - b) for a, b in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]))
                   for got, want in zip(served, expected))

    fp8_error = worst(by_id["static"]["batches"][0])
    assert fp8_error > 1e-4, "the fp8 cache made no difference: is it in use?"
    error = worst(by_id["per_request"]["batches"][0])
    assert error <= 2 * fp8_error + 1e-5, (error, fp8_error)
