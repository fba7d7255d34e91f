"""Issue 29 in vLLM: a ``per="request"`` Dynamic-YaRN checkpoint served over the raw-key pages, each request under
the static YaRN model of ``s = max(1, (P + N) / L)`` (N: its ``max_tokens``) for its whole life.

Runs on the vLLM leg (as test_vllm_paged.py); skips elsewhere. Without an engine: the planned lengths the builders
read from the V1 runner, and the block hash (a request's pages are shared only with requests of the same scale).
With engines (slow: one subprocess, four engines):

- a request with P + N <= L gives the prompt logprobs of the unscaled model served by the same engine (1e-6);
- a longer one equals transformers + ``hf.patch`` with the static ``YaRN(factor=s)`` table (1e-5);
- the same requests with chunked prefill and prefix caching on, and with both off: identical;
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
from support.vllm_testing import (ORIGINAL, assert_same, request_block_hasher, require_vllm,  # noqa: E402
                                  served_llama, transformers_request)

require_vllm()

from ropescale import hf, scaling, serving  # noqa: E402
from ropescale.vllm import attention  # noqa: E402

SERVED = 256
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
    attention._prompt_lens.update(tensor=torch.tensor([10, 20, 30, 0]), runner=runner)
    try:
        assert attention.step_request_lens(3) == [17, 21, 130]
        assert attention.step_request_lens(2) == [17, 21]
        assert attention.step_request_lens(4) == [17, 21, 130, 1]  # a padded request (graph capture): any table
        assert attention.step_request_lens(5) is None  # more requests than the step has lengths for: none
    finally:
        attention._prompt_lens.update(tensor=None, runner=None)
    assert attention.step_request_lens(1) is None


def test_block_hashes_carry_the_requests_scale(monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = request_block_hasher(monkeypatch)
    model = hf.patch(served_llama(), METHOD)
    attention._engine["config"] = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=model.config))

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
