"""Self-Extend and Dual Chunk Attention (issue 31) and STRING (issue 44) served by vLLM through ropescale's plugin
(docs/DESIGN.md, "Self-Extend and Dual Chunk Attention", "STRING" and "Engines"): raw keys in vLLM's paged cache, the method's region rule in
``rerope_attention_paged`` (``group`` / ``chunk_size``), DCA's attention temperature exact under chunked prefill,
batching, preemption and the prefix cache.

Runs on the vLLM leg (as test_vllm.py); skips elsewhere. Cheapest first:

1. no engine: the plugin's ``get_rope`` gives ropescale's pass-through and records the method's plan (a ropescale
   Self-Extend or DCA checkpoint, and a Qwen2 config with Qwen's ``dual_chunk_attention_config`` and no ropescale
   entry, as vLLM's Qwen2 passes it); DCA's temperature is dropped where the engine serves no length past L0 and
   refused with asynchronous speculative decoding; the block hashes carry a prompt's temperature ``m(P)``; the CUDA
   backend's builder and impl (``CUSTOM``), constructed as vLLM constructs them and run on CPU tensors, pass
   ``group`` / ``chunk_size`` to the op, put the temperature on each new key and query, and equal the float64
   references row by row (and the CPU backend bit for bit);
2. engines, two processes: with the plugin (one engine after another in one process), Self-Extend and DCA with a
   temperature on the tiny Llama, prompts past the original length (64), chunked every 48 tokens, batched, prompts
   sharing a prefix (read again from the prefix cache where the result is the same: every prompt under Self-Extend,
   only a prompt of the same length under DCA's temperature), a KV cache small enough to preempt and recompute;
   a tiny Qwen2 carrying Qwen's ``dual_chunk_attention_config``: each request's greedy tokens and logprobs equal to
   transformers + ropescale (``hf.patch``) within 1e-5 in float32. Stock vLLM (ROPESCALE_VLLM=0) refuses the
   Self-Extend and DCA checkpoints (their marked rope types).
"""

import math
import types

import pytest
import torch

from support.vllm_engine import run_engines  # noqa: E402
from support.vllm_testing import (HEAD, ORIGINAL, assert_same, plugin_isolated, request_block_hasher,  # noqa: E402
                                  require_vllm, served_llama, tiny_qwen2, transformers_request)

require_vllm()

from transformers import AutoModelForCausalLM  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import create_forward_context, override_forward_context  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

from ropescale import config as config_lib, hf, ops, serving  # noqa: E402
from ropescale.vllm import attention, attention_plan, attention_prefix_cache, attention_steps, rotary  # noqa: E402

from support.attention import reference_dual_chunk, reference_self_extend, reference_string  # noqa: E402

SERVED = 256  # the length the engines serve (VLLM_ALLOW_LONG_MAX_MODEL_LEN: past the original 64)
NEW_TOKENS = 8
SE = dict(attention="self_extend", window=16, group=5)  # G does not divide W: the region boundary shows
# chunks of n = 36 (every region from 72 tokens); the temperature past the original length
DCA = dict(attention="dual_chunk", chunk_size=48, local_size=12, original_max_position_embeddings=ORIGINAL)
QWEN_DCA = {"chunk_size": 40, "local_size": 8, "original_max_position_embeddings": 100}  # Qwen's own keys
STRING = dict(attention="string", shifted_offset=21, local_value=8)  # S = L/3 of the original 64, as its authors'


def patched(name, seed=0):
    if name == "qwen_dca":
        return tiny_qwen2_dca(seed)
    return hf.patch(served_llama(seed), **{"self_extend": SE, "dual_chunk": DCA, "string": STRING}[name])


def tiny_qwen2_dca(seed=0):
    """A tiny Qwen2 whose config carries Qwen's dual_chunk_attention_config and no ropescale entry: what
    Qwen2.5-1M's checkpoints look like."""
    model = tiny_qwen2(seed, dual_chunk_attention_config=dict(QWEN_DCA))
    assert not hasattr(model.config, config_lib.CONFIG_KEY)
    return model


@pytest.fixture(autouse=True)
def isolated():
    with plugin_isolated():
        yield
    attention_steps.PROMPT_LENS.update(runner=None, tensor=None)


def engine_config(config, max_model_len=SERVED, **fields):
    """What the plugin reads of an engine's config (no engine here)."""
    return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=config, max_model_len=max_model_len),
                                 parallel_config=types.SimpleNamespace(), **fields)


def model_get_rope(monkeypatch, config, vllm_config=None, **kwargs):
    """get_rope as a model build calls it (vLLM's Qwen2 also passes its dual_chunk_attention_config)."""
    vllm_config = vllm_config or engine_config(config)
    monkeypatch.setattr(rotary, "_model_config", lambda: vllm_config.model_config)
    monkeypatch.setattr("vllm.config.get_current_vllm_config", lambda: vllm_config)
    return rotary.get_rope(HEAD, config.max_position_embeddings, True, dict(config.rope_parameters), torch.float32,
                           **kwargs)


# ---------------------------------------------------------------------------------------------
# 1. No engine


@pytest.mark.parametrize("name", ["self_extend", "dual_chunk", "qwen_dca", "string"])
def test_get_rope_gives_the_pass_through_with_the_methods_plan(monkeypatch, name):
    config = patched(name).config
    attention.register_backends()
    kwargs = {"dual_chunk_attention_config": dict(QWEN_DCA)} if name == "qwen_dca" else {}
    layer = model_get_rope(monkeypatch, config, **kwargs)
    assert isinstance(layer, attention.PreRopeRotary)
    want = {"self_extend": dict(window=16, group=5, chunk_size=0, temperature_length=0),
            "dual_chunk": dict(window=12, group=0, chunk_size=48, temperature_length=ORIGINAL),
            "qwen_dca": dict(window=8, group=0, chunk_size=40, temperature_length=100),
            "string": dict(window=21, group=0, chunk_size=0, temperature_length=0, leaky_k=1.0, far_start=8)}[name]
    plan = attention.current_plan()
    assert {k: getattr(plan, k) for k in want} == want, plan
    assert plan.method_arguments() == {"self_extend": {"group": 5}, "string": {"far_start": 8}}.get(
        name, {"chunk_size": want["chunk_size"]})
    assert plan.prompt_dependent == (name not in ("self_extend", "string")) and not plan.length_dependent
    assert plan.score_factor == (config_lib.STRING_ATTENTION_FACTOR ** 2 if name == "string" else 1.0)
    if name == "qwen_dca":  # the config alone (a model class that does not pass it) reads the same
        attention_plan.RECORDED_PLAN.clear()
        model_get_rope(monkeypatch, config)
        assert attention.current_plan() == plan


def test_dca_temperature_is_dropped_within_its_length_and_refused_with_async_speculative_decoding(monkeypatch):
    attention.register_backends()
    config = patched("dual_chunk").config
    model_get_rope(monkeypatch, config, engine_config(config, max_model_len=ORIGINAL))
    assert attention.current_plan().temperature_length == 0  # m(len) = 1 for every len <= L0: plain DCA
    assert attention.served_plan(engine_config(config, max_model_len=ORIGINAL)).temperature_length == 0
    assert attention.served_plan(engine_config(config)).temperature_length == ORIGINAL
    speculative = engine_config(config, speculative_config=object(),
                                scheduler_config=types.SimpleNamespace(async_scheduling=True))
    with pytest.raises(NotImplementedError, match="temperature .* asynchronous scheduling with speculative decoding"):
        model_get_rope(monkeypatch, config, speculative)
    attention_plan.RECORDED_PLAN.clear()  # synchronous speculative decoding: exact host lengths
    model_get_rope(monkeypatch, config, engine_config(config, speculative_config=object(),
                                                      scheduler_config=types.SimpleNamespace(async_scheduling=False)))
    # Self-Extend has no temperature: nothing refused
    attention_plan.RECORDED_PLAN.clear()
    se = patched("self_extend").config
    model_get_rope(monkeypatch, se, engine_config(se, speculative_config=object(),
                                                  scheduler_config=types.SimpleNamespace(async_scheduling=True)))


def test_the_temperature_is_hf_patchs_per_row_rule():
    plan = serving.PreRopePlan.of(config_lib.read_config(patched("dual_chunk").config), HEAD, True)
    # (seq_len, query rows, prompt): a prompt chunk, a decode row past the prompt, a recompute crossing its end
    seq_lens, query_lens, prompt_lens = [150, 101, 90], [30, 1, 12], [200, 20, 84]
    got = plan.temperature_factors(seq_lens, query_lens, prompt_lens)
    want = []
    for n, q, p in zip(seq_lens, query_lens, prompt_lens):
        want += [max(1.0, 0.1 * torch.log(torch.tensor(max(p, i + 1) / ORIGINAL, dtype=torch.float64)).item() + 1)
                 for i in range(n - q, n)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=0, atol=0)
    # a prompt's rows share m(P) (a chunk of a longer prompt too); each row past it takes its own length's
    assert got[0] > 1.1 and got[29] == got[0] and got[31] == got[36] < got[37] < got[42]


def test_chunkllamas_temperature_reaches_the_plan_and_each_rows_factor(monkeypatch):
    """A checkpoint with ChunkLlama's temperature (``hf.patch(..., temperature="chunkllama")``: 0.05 ln(len / L0) + 1,
    L0 the model's length): get_rope's plan carries the rule, each step's row factors are ChunkLlama's (the same rows
    as Qwen's rule, another coefficient), and the prompt's block hashes carry its m(P), not Qwen's."""
    attention.register_backends()
    config = hf.patch(served_llama(), attention="dual_chunk", chunk_size=48, local_size=12,
                      temperature="chunkllama").config
    model_get_rope(monkeypatch, config)
    plan = attention.current_plan()
    assert (plan.temperature, plan.temperature_length) == ("chunkllama", ORIGINAL)
    seq_lens, query_lens, prompt_lens = [150, 101], [30, 1], [200, 20]
    want = [max(1.0, 0.05 * math.log(max(p, i + 1) / ORIGINAL) + 1)
            for n, q, p in zip(seq_lens, query_lens, prompt_lens) for i in range(n - q, n)]
    torch.testing.assert_close(plan.temperature_factors(seq_lens, query_lens, prompt_lens),
                               torch.tensor(want, dtype=torch.float32), rtol=0, atol=0)
    qwen = serving.PreRopePlan.of(config_lib.read_config(patched("dual_chunk").config), HEAD, True)
    assert (qwen.temperature_factors([150], [1], [200]) - 1).item() == pytest.approx(
        2 * (plan.temperature_factors([150], [1], [200]) - 1).item(), rel=1e-5)  # float32 factors


def test_block_hashes_carry_the_prompts_temperature(monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = request_block_hasher(monkeypatch)

    def hashes(config, prompt, max_model_len=SERVED):
        attention_prefix_cache.ENGINE.clear()
        attention_prefix_cache.ENGINE["config"] = engine_config(config, max_model_len) if config is not None else None
        return Request("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher).block_hashes

    tokens = torch.randint(2, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    dca, se = patched("dual_chunk").config, patched("self_extend").config
    stock = hashes(None, tokens[:120])
    assert hashes(se, tokens[:120]) == stock  # no temperature: positions alone
    assert hashes(dca, tokens[:48]) == hashes(None, tokens[:48])  # within L0: m(P) = 1
    assert hashes(dca, tokens[:120], max_model_len=ORIGINAL) == stock  # an engine without a temperature
    long_120, long_121 = hashes(dca, tokens[:120]), hashes(dca, tokens[:121])
    assert long_120 != stock and all(a != b for a, b in zip(long_120, long_121))
    assert hashes(dca, tokens[:120]) == long_120


def test_v1_runner_and_cuda_graphs_for_the_methods(monkeypatch):
    from vllm.config import VllmConfig as Config

    monkeypatch.setattr(Config, "_get_v2_model_runner_unsupported_features", lambda self: ["stock reason"])
    assert attention.prefer_v1_model_runner()
    unsupported = Config._get_v2_model_runner_unsupported_features
    # the V2 runner gives no prompt lengths: DCA's temperature asks for the V1 runner; Self-Extend, and DCA in an
    # engine that serves no length past L0, do not
    assert unsupported(engine_config(patched("self_extend").config)) == ["stock reason"]
    assert unsupported(engine_config(patched("dual_chunk").config, max_model_len=ORIGINAL)) == ["stock reason"]
    reasons = unsupported(engine_config(patched("dual_chunk").config))
    assert reasons[0] == "stock reason" and "Dual Chunk Attention temperature" in reasons[1], reasons
    # the temperature's per-row factors live in the builder's own buffer: full graphs for uniform batches
    support = attention.PreRopeMetadataBuilder.get_cudagraph_support
    for name in ("self_extend", "dual_chunk", "qwen_dca"):
        assert support(engine_config(patched(name).config), None) == AttentionCGSupport.UNIFORM_BATCH, name


# The CUDA backend (CUSTOM) and the CPU one, constructed as vLLM constructs them, one step on CPU tensors.
BLOCK, BLOCKS, MAX_SEQS = 16, 48, 8
Q_HEADS, KV_HEADS = 2, 1
LAYER = "model.layers.0.self_attn.attn"
# (seq_len, query rows, prompt length): a whole prompt, a chunk of a longer prompt, decode rows (one past L0's
# prompt), a recompute crossing its prompt's end
MIXED = [(40, 40, 40), (150, 30, 200), (41, 1, 40), (97, 1, 70), (90, 12, 84)]


@pytest.fixture(scope="module")
def backend_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_se_dca_backend") / "dual_chunk"
    patched("dual_chunk").save_pretrained(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        model_config = ModelConfig(model=str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=SERVED)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK),
                      scheduler_config=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=512,
                                                       max_model_len=SERVED, is_encoder_decoder=False))


def builder_of(backend, vllm_config):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    group = AttentionGroup(backend, [LAYER, "model.layers.1.self_attn.attn"], spec, 0)
    group.create_metadata_builders(vllm_config, torch.device("cpu"))
    return group.get_metadata_builder()


def impl_of(backend):
    return backend.get_impl_cls()(Q_HEADS, HEAD, HEAD ** -0.5, KV_HEADS, None, None, "auto", None, "decoder", None)


@pytest.mark.parametrize("name", ["self_extend", "dual_chunk", "string"])
def test_cuda_backend_passes_the_method_and_the_temperature_to_the_op(monkeypatch, backend_config, name):
    model = patched(name)
    plan = serving.PreRopePlan.of(config_lib.read_config(model.config), HEAD, True)
    attention_plan.RECORDED_PLAN.update(plan=plan)
    g = torch.Generator().manual_seed(1)
    count = len(MIXED)
    seq_lens = torch.tensor([n for n, _, _ in MIXED], dtype=torch.int32)
    starts = torch.tensor([0] + [q for _, q, _ in MIXED]).cumsum(0).to(torch.int32)
    attention_steps.PROMPT_LENS.update(tensor=torch.tensor([p for _, _, p in MIXED], dtype=torch.int32))
    free = (torch.randperm(BLOCKS - 1, generator=g) + 1).tolist()
    pages = [[free.pop() for _ in range(-(-n // BLOCK))] for n, _, _ in MIXED]
    block_table = torch.zeros(count, SERVED // BLOCK, dtype=torch.int32)
    for r, p in enumerate(pages):
        block_table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
    keys = [torch.randn(n, KV_HEADS, HEAD, generator=g) for n, _, _ in MIXED]
    values = [torch.randn(n, KV_HEADS, HEAD, generator=g) for n, _, _ in MIXED]
    tokens = int(starts[-1])
    query = torch.randn(tokens + 3, Q_HEADS, HEAD, generator=g)  # 3 rows past the step's tokens

    def slots(r, positions):
        return torch.tensor([pages[r][j // BLOCK] * BLOCK + j % BLOCK for j in positions], dtype=torch.int64)

    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=count,
        num_actual_tokens=tokens, max_query_len=max(q for _, q, _ in MIXED), max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.cat([slots(r, range(n - q, n)) for r, (n, q, _) in enumerate(MIXED)]), causal=True,
        seq_lens_cpu_upper_bound=seq_lens.clone())

    def factor(r, j):  # DCA's temperature of request r's token at position j (1 for Self-Extend)
        n, q, p = MIXED[r]
        return float(plan.temperature_factors([j + 1], [1], [p])[0])

    calls = []
    paged = ops.rerope_attention_paged

    def spy(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("group", "chunk_size", "far_start", "leaky_k")} | {"window": args[7]})
        return paged(*args, **kwargs)

    monkeypatch.setattr(ops, "rerope_attention_paged", spy)
    out = {}
    with set_current_vllm_config(backend_config):
        for kind, backend in (("cuda", attention.PreRopeAttentionBackend),
                              ("cpu", attention.RopescaleCPUAttentionBackend)):
            metadata = builder_of(backend, backend_config).build(0, common)
            assert (metadata.rope_tables.temperature is not None) == (name == "dual_chunk")
            impl = impl_of(backend)
            kv_cache = torch.full((BLOCKS, KV_HEADS, BLOCK, 2 * HEAD), float("nan"))
            key_cache, value_cache = attention.split_pages(kv_cache)
            for r, (n, q, _) in enumerate(MIXED):  # earlier steps' keys, as they wrote them (their own factors)
                cached = torch.stack([keys[r][j] * factor(r, j) for j in range(n - q)]) if n > q else keys[r][:0]
                ops.rerope_cache_write_(key_cache, value_cache, cached, values[r][: n - q], slots(r, range(n - q)))
            layer = types.SimpleNamespace(layer_name=LAYER)
            with override_forward_context(create_forward_context({LAYER: metadata}, backend_config)):
                impl.do_kv_cache_update(layer, torch.cat([k[n - q:] for k, (n, q, _) in zip(keys, MIXED)]),
                                        torch.cat([v[n - q:] for v, (n, q, _) in zip(values, MIXED)]), kv_cache,
                                        common.slot_mapping)
            output = torch.zeros(tokens + 3, Q_HEADS, HEAD)
            impl.forward(layer, query, None, None, kv_cache, metadata, output)
            assert torch.equal(output[tokens:], torch.zeros(3, Q_HEADS, HEAD))
            out[kind] = output[:tokens]
    want_call = {"self_extend": {"group": 5, "chunk_size": None, "far_start": None, "leaky_k": 0.0, "window": 16},
                 "dual_chunk": {"group": None, "chunk_size": 48, "far_start": None, "leaky_k": 0.0, "window": 12},
                 "string": {"group": None, "chunk_size": None, "far_start": 8, "leaky_k": 1.0, "window": 21}}[name]
    assert calls == [want_call, want_call]
    assert torch.equal(out["cuda"], out["cpu"])
    # every row against the float64 reference over its request's keys, the temperature on q and k (DCA)
    inv_freq = plan.method.inv_freq(HEAD, plan.base).double()
    errors = []
    for r, (n, q, _) in enumerate(MIXED):
        k_pos = torch.arange(n)[None]
        k = torch.stack([keys[r][j].double() * factor(r, j) for j in range(n)]).transpose(0, 1)[None]
        v = values[r].double().transpose(0, 1)[None]
        for i in range(q):
            position, row = n - q + i, int(starts[r]) + i
            qr = (query[row].double() * factor(r, position))[:, None][None]
            if name == "string":  # the authors' two passes, their attention factor on cos and sin
                want, _ = reference_string(qr, k[:, :, : position + 1], v[:, :, : position + 1],
                                           k_pos[:, position: position + 1], k_pos[:, : position + 1], inv_freq,
                                           21, 8, scale=HEAD ** -0.5,
                                           attention_factor=config_lib.STRING_ATTENTION_FACTOR)
            elif name == "self_extend":
                want, _ = reference_self_extend(qr, k[:, :, : position + 1], v[:, :, : position + 1],
                                                k_pos[:, position: position + 1], k_pos[:, : position + 1], inv_freq,
                                                window=16, group=5, scale=HEAD ** -0.5)
            else:
                want, _ = reference_dual_chunk(qr, k[:, :, : position + 1], v[:, :, : position + 1],
                                               k_pos[:, position: position + 1], k_pos[:, : position + 1], inv_freq,
                                               chunk_size=48, local_size=12, scale=HEAD ** -0.5)
            errors.append((out["cuda"][row].double() - want[0, :, 0]).abs().max().item())
    assert max(errors) < 2e-5, max(errors)


# ---------------------------------------------------------------------------------------------
# 2. Engines


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


LONG = [SERVED - NEW_TOKENS - 3, 37]  # past L (64), DCA's chunks and SE's groups; and a short one
MIXED_LENGTHS = [8, 240, 17, 130, 64, 65, 200, 96]  # one crosses L0 = 64 while decoding
PREFIX = random_prompts([150], 3)[0]
BATCHES = {
    "long": random_prompts(LONG, 1),
    "mixed": random_prompts(MIXED_LENGTHS, 2),
    "shared": [PREFIX + tail for tail in random_prompts([5, 40, 1, 70], 4)],
    # the same prompts again, other prompts of the same lengths and prefix, and of other lengths, all from the
    # prefix cache where the result is the same (asking for the generated tokens' logprobs only: vLLM reads no
    # prefix cache for a request that asks for prompt logprobs)
    "shared_cached": [PREFIX + tail for tail in random_prompts([5, 40, 1, 70], 4)],
    "same_length_cached": [PREFIX + tail for tail in random_prompts([5, 40, 1, 70], 5)],
    "other_cached": [PREFIX + tail for tail in random_prompts([9, 33, 2], 6)],
    # with 10 pages of 32 tokens for ~1,000 prompt tokens vLLM preempts, then recomputes prompt and generated tokens
    "crossing": random_prompts([28, 29, 30, 60, 61, 62, 92, 93, 124, 125, 126, 156], 5),
}
LOAD = dict(enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=48)  # chunks every 48 tokens
CACHED_BATCHES = ("shared", "shared_cached", "same_length_cached", "other_cached")
RUNS = [  # (id, checkpoint, engine options, batches); one process, engine after engine
    ("self_extend", "self_extend", LOAD, ("long", "mixed", *CACHED_BATCHES)),
    ("dual_chunk", "dual_chunk", LOAD, ("long", "mixed", *CACHED_BATCHES)),
    ("string", "string", LOAD, ("long", "mixed", *CACHED_BATCHES)),
    ("qwen_dca", "qwen_dca", LOAD, ("long", "mixed", "shared", "shared_cached")),
    ("dual_chunk/preempted", "dual_chunk", dict(LOAD, num_gpu_blocks_override=10, block_size=32), ("crossing",)),
    # compiled mode (vLLM traces the model; attention and the cache write stay opaque ops, the temperature's
    # lookup of the step's metadata in vLLM's forward context included)
    ("dual_chunk/compiled", "dual_chunk", dict(enforce_eager=False, max_num_seqs=4), ("long",)),
]
STOCK = ("qwen_dca", "self_extend", "dual_chunk", "string")  # refusals, in one process


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("se_dca_checkpoints")
    paths = {}
    for name in ("self_extend", "dual_chunk", "qwen_dca", "string"):
        paths[name] = root / name
        patched(name).save_pretrained(paths[name])
    return paths


def serve(tmp_path, runs, env):
    """``runs`` [(id, checkpoint path, options, batch names)] one after the other in ONE process (engine core in it):
    ({id: result}, the process's output)."""
    params = dict(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=0, logprobs=0, ignore_eos=True,
                  detokenize=False)
    cached_params = dict(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True, detokenize=False)
    engines = [{"id": run_id, "path": str(path), "options": dict(max_model_len=SERVED, **options),
                "batches": [{"prompts": BATCHES[b], "params": cached_params if b.endswith("_cached") else params}
                            for b in batch_names]}
               for run_id, path, options, batch_names in runs]
    environ = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    results, log = run_engines(tmp_path, engines, environ, timeout=900)
    assert [r["id"] for r in results] == [run[0] for run in runs], log[-6000:]
    return {r["id"]: r for r in results}, log


@pytest.fixture(scope="module")
def plugin_engines(tmp_path_factory, checkpoints):
    return serve(tmp_path_factory.mktemp("se_dca_plugin"),
                 [(run_id, checkpoints[name], options, batches) for run_id, name, options, batches in RUNS], {})


@pytest.fixture(scope="module")
def stock_engines(tmp_path_factory, checkpoints):
    return serve(tmp_path_factory.mktemp("se_dca_stock"),
                 [(name, checkpoints[name], dict(enforce_eager=True, max_num_seqs=2), ("long",)) for name in STOCK],
                 {"ROPESCALE_VLLM": "0"})


_references: dict = {}


def reference(path, batch_name):
    """transformers + ropescale (``hf.patch`` on the reload) on the saved checkpoint, one prompt at a time."""
    key = (str(path), batch_name)
    if key not in _references:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.patch(model)
        _references[key] = [transformers_request(model, prompt, NEW_TOKENS) for prompt in BATCHES[batch_name]]
    return _references[key]


def served(result, log):
    assert "batches" in result, f"{result.get('error')}\n{log[-6000:]}"
    return result["batches"]


@pytest.mark.slow
@pytest.mark.parametrize("run", [run[0] for run in RUNS])
def test_engine_serves_each_request_as_transformers_and_ropescale_do(plugin_engines, checkpoints, run):
    results, log = plugin_engines
    assert "plugin active" in log and "served pre-RoPE: raw keys in vLLM's paged cache" in log, log[-3000:]
    _, name, _, batch_names = next(r for r in RUNS if r[0] == run)
    batches = served(results[run], log)
    assert len(batches) == len(batch_names)
    for batch, batch_name in zip(batches, batch_names):
        assert_same(batch, reference(checkpoints[name], batch_name), f"{run}, batch {batch_name}")
    if run == "dual_chunk/preempted":
        assert results[run]["preemptions"] > 0, results[run]  # the small cache did preempt (then recompute)


@pytest.mark.slow
def test_prefix_cache_reuses_pages_only_where_the_result_is_the_same(plugin_engines):
    """128-token pages: the same prompts again hit their first page under every method; prompts with the same
    150-token prefix hit it under Self-Extend (positions alone) and, under DCA's temperature, only at the same length
    (every prompt token's query and key take m(P))."""
    results, log = plugin_engines
    cached = {}
    for run in ("self_extend", "dual_chunk", "qwen_dca", "string"):
        _, _, _, batch_names = next(r for r in RUNS if r[0] == run)
        cached[run] = {b: [r["cached"] for r in batch] for b, batch in zip(batch_names, served(results[run], log))
                       if b.endswith("_cached")}
    assert cached == {
        "self_extend": {"shared_cached": [128] * 4, "same_length_cached": [128] * 4, "other_cached": [128] * 3},
        "dual_chunk": {"shared_cached": [128] * 4, "same_length_cached": [128] * 4, "other_cached": [0] * 3},
        "qwen_dca": {"shared_cached": [128] * 4},
        "string": {"shared_cached": [128] * 4, "same_length_cached": [128] * 4, "other_cached": [128] * 3},
    }, cached


@pytest.mark.slow
@pytest.mark.parametrize("name", STOCK)
def test_stock_vllm_refuses_the_checkpoints(stock_engines, checkpoints, name):
    """Stock vLLM has neither method on its CPU backend: the marked rope types (``self_extend``, ``dual_chunk``) are
    refused by name. Qwen's unmarked dual_chunk_attention_config is vLLM's own DCA, which vLLM 0.32 cannot build on
    the CPU ("Cannot access accelerator device when none is available"; kept true here, so that a vLLM that starts
    serving it is noticed and compared)."""
    results, log = stock_engines
    assert "vLLM plugin off (ROPESCALE_VLLM=0)" in log and "plugin active" not in log, log[-3000:]
    error = results[name].get("error")
    assert error is not None, results[name]
    if name != "qwen_dca":
        rope_type = patched(name).config.rope_parameters["rope_type"]
        assert rope_type == name and f"Unknown RoPE scaling type {rope_type}" in error, error
