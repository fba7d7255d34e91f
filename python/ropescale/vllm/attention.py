"""Pre-RoPE models in vLLM: a pass-through rotary and an attention backend over vLLM's paged cache of RAW keys.

ReRoPE, Leaky ReRoPE, log-n and the dynamic methods (Dynamic NTK, Dynamic YaRN, Resonance on them) rotate at
attention time: ReRoPE clips the relative position at its window, a dynamic table changes with each
request's length. So the keys vLLM caches must be the un-rotated ones (docs/DESIGN.md, "Engines"):

- :func:`pass_through` is what ``get_rope`` (``rotary.py``) gives the layers of such a checkpoint: it leaves
  q and k as they are, so vLLM's paged cache holds raw keys (one cache, no second copy). It is built only
  when ropescale's backend is the one that will run (:func:`check_backend`): raw keys never meet a stock
  backend, which would attend them un-rotated without a word;
- the backend, registered over the platform's (``register_backend``: ``CPU_ATTN`` on CPU, which the CPU
  platform always picks, and ``CUSTOM`` on CUDA, picked with ``--attention-backend CUSTOM``), runs the
  layers of a pre-RoPE model with ``ops.rerope_cache_write_`` (raw K/V into the pages) and
  ``ops.rerope_attention_paged`` (prefill, chunked prefill and decode rows in one call); on CPU every other
  model's layers go to vLLM's own implementation unchanged;
- the metadata builder computes, once per step, the table and attention factor each query row takes (what
  ``hf.patch``'s ``state.table(seq_len)`` gives transformers: see below), cached by length: a step computes
  each distinct length once, every layer reuses it. Lengths are read from vLLM's host copy (no host sync), and
  every tensor the forward reads stays at one address across steps (the tables in the builder's own
  buffers), so the CUDA backend declares full CUDA graphs for decode batches.

The cache of a layer is vLLM's ``[num_blocks, Hkv, block_size, 2*D]`` (the KV spec's page). This backend owns
what a page holds: per (block, head), ``block_size`` raw keys then ``block_size`` raw values, so
``kv_cache.view(num_blocks, Hkv, 2*block_size, D)`` splits into the op's ``key_cache`` / ``value_cache``
``[num_blocks, Hkv, block_size, D]``.

A length-dependent method (the dynamic ones, a LongRoPE with distinct factors) computes every row as
``hf.patch`` does in transformers, however vLLM schedules the request (:func:`cut_segments`): each prompt row
under the table of the whole prompt (one forward over the prompt), each later row under the table of its own
length (one forward per generated token; the keys' rotation is redone at every step, values and deeper layers'
keys stay as computed). So a request served beside others, with its prompt chunked by the token budget or
recomputed after a preemption, equals the request served alone; and vLLM's prefix cache reuses a page only for
a prompt computed under the same table (:func:`install_block_hash_key`). A ``per="request"`` method takes one table
per request, at its prompt + ``max_tokens`` (:func:`step_request_lens`), for every row and step: the static model
of the request's scale, whose pages are shared only between requests of the same scale (the block hash carries
it). Under asynchronous speculative decoding
a decode row's length is vLLM's host-side upper bound (the length if every draft is accepted).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheLayout

from .. import attentions, config as config_lib, ops, serving
from . import engine
from ..serving import (NO_WINDOW, PreRopePlan, RequestRotaryTables, Segments, StepTables, TableCache,  # noqa: F401
                       cut_segments, needs_pre_rope)

logger = logging.getLogger("vllm.ropescale")

__all__ = ["PreRopePlan", "PreRopeRotary", "StepTables", "TableCache", "host_seq_lens", "pass_through",
           "check_backend", "register_backends", "RopescaleCPUAttentionBackend", "PreRopeAttentionBackend"]

#: Where ``register_backends`` puts each backend (class paths, as vLLM resolves them).
CPU_BACKEND = f"{__name__}.RopescaleCPUAttentionBackend"
CUDA_BACKEND = f"{__name__}.PreRopeAttentionBackend"


# The plan of the pre-RoPE model this process serves, recorded by get_rope at model build (vLLM builds one
# model per worker process) with the id of the engine config it was built under, read by the attention
# layers and the metadata builder.
_plan: dict[str, object] = {}


_warned: set[str] = set()  # one-time log lines, per process


def current_plan() -> PreRopePlan | None:
    return _plan.get("plan")  # type: ignore[return-value]


def _record(plan: PreRopePlan, vllm_config) -> None:
    if _plan.get("config") == id(vllm_config) and _plan.get("plan") != plan:
        raise NotImplementedError(f"ropescale.vllm: the layers of one model ask for two pre-RoPE plans, "
                                  f"{_plan['plan']} and {plan}; ropescale serves one per model")
    _plan.update(config=id(vllm_config), plan=plan)


class PreRopeRotary(torch.nn.Module):
    """A rotary layer that rotates nothing: vLLM caches raw keys and ropescale's backend rotates (same
    contract as vLLM's rotary: ``forward(positions, query, key) -> (query, key)``; nothing to trace)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool,
                 plan: PreRopePlan) -> None:
        super().__init__()
        self.head_size, self.rotary_dim, self.max_position_embeddings = head_size, rotary_dim, max_position
        self.is_neox_style, self.plan = is_neox_style, plan

    def forward(self, positions, query, key=None):
        return query, key

    forward_native = forward_cpu = forward_cuda = forward

    def extra_repr(self) -> str:
        return f"pass-through (rotated by ropescale's attention backend), plan={self.plan}"


def check_backend(vllm_config, what: str) -> None:
    """Raise unless the attention backend that will run this model is ropescale's, and the parallel layout
    keeps "cache slot j holds position j"."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise NotImplementedError(
                f"ropescale.vllm: {what} is served over a cache where slot j holds position j; {name}="
                f"{getattr(parallel, name)} shards the cache by token and breaks that: serve it without context "
                "parallelism (tensor parallelism works)")
    if current_platform.is_cpu():
        selected, path, wanted = AttentionBackendEnum.CPU_ATTN, None, CPU_BACKEND
    else:
        selected, path, wanted = vllm_config.attention_config.backend, None, CUDA_BACKEND
    try:
        path = selected.get_path() if selected is not None else None
    except ValueError:  # CUSTOM selected but nothing registered there
        path = None
    if path != wanted:
        hint = ("on CPU the plugin overrides CPU_ATTN: something replaced that override" if current_platform.is_cpu()
                else "select it with `--attention-backend CUSTOM` (LLM(..., attention_backend='CUSTOM'))")
        raise NotImplementedError(
            f"ropescale.vllm: {what} keeps keys un-rotated in vLLM's cache, which only ropescale's attention "
            f"backend reads correctly; the backend that would run is "
            f"{path or (selected.name if selected is not None else 'vLLM automatic choice')}: {hint}")


def _max_model_len(vllm_config) -> int | None:
    value = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_temperature(plan: PreRopePlan, vllm_config) -> None:
    """Refuse the configurations where DCA's temperature cannot be served exactly: it needs each row's position,
    read from vLLM's host lengths, which under asynchronous speculative decoding are an upper bound (the length if
    every draft is accepted), so a rejected draft would shift the next rows' factors."""
    if not plan.temperature_length:
        return
    speculative = getattr(vllm_config, "speculative_config", None)
    asynchronous = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
    if speculative is not None and asynchronous:
        raise NotImplementedError(
            f"ropescale.vllm: Dual Chunk Attention's temperature (original_max_position_embeddings = "
            f"{plan.temperature_length}, served up to {_max_model_len(vllm_config)} tokens) takes each row's position "
            "from vLLM's host lengths, which asynchronous scheduling with speculative decoding only bounds: serve it "
            "without speculative decoding, with --no-async-scheduling, or with max_model_len <= "
            f"{plan.temperature_length} (no temperature there)")


def pass_through(head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool,
                 parsed: config_lib.RopeConfig, vllm_config) -> PreRopeRotary:
    """``get_rope``'s answer for a pre-RoPE checkpoint (refused unless ropescale's backend will run)."""
    what = config_lib.ATTENTION_NAMES.get(parsed.attention) or f"a dynamic method ({type(parsed.method).__name__})"
    # DCA's temperature is 1 at every length an engine serving at most L0 tokens reaches: then not served at all.
    plan = PreRopePlan.of(parsed, rotary_dim, is_neox_style).served_within(_max_model_len(vllm_config))
    check_backend(vllm_config, what)
    check_temperature(plan, vllm_config)
    _record(plan, vllm_config)
    if plan.prompt_dependent:
        install_prompt_lengths()
    if "active" not in _warned:
        _warned.add("active")
        default = unset_max_tokens_default(vllm_config) if plan.per_request else None
        logger.info("ropescale: %s served pre-RoPE: raw keys in vLLM's paged cache, rotated by ropescale's "
                    "attention backend; %s", what, describe_plan(plan, default))
        length = _max_model_len(vllm_config)
        reduced = plan.self_extend_reduces_within(length)
        if reduced is not None:
            logger.warning("ropescale: %s (max_model_len %s)", reduced, length)
        if plan.per_request and default is None:
            logger.warning(
                "ropescale: per='request': a chat request without max_tokens is planned at max_model_len (%s "
                "tokens), so even a short question runs the model scaled for that length; give the checkpoint a "
                "planning budget (generation_config.json max_new_tokens: `ropescale extend --max-new-tokens N`, or "
                "--override-generation-config '{\"max_new_tokens\": N}'), or send max_tokens", length)
    return PreRopeRotary(head_size, rotary_dim, max_position, is_neox_style, plan)


def unset_max_tokens_default(vllm_config) -> int | None:
    """What vLLM's chat endpoint gives a request that sets neither max_tokens nor max_completion_tokens: the
    model's generation config ``max_new_tokens`` (with ``--override-generation-config`` applied; none under
    ``--generation-config vllm``), or None: then ``max_model_len`` less the prompt."""
    model_config = getattr(vllm_config, "model_config", None)
    try:
        value = model_config.get_diff_sampling_param().get("max_tokens")
    except Exception:  # noqa: BLE001 (an unreadable generation config reads as none, as vLLM's own falls back)
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def describe_plan(plan: PreRopePlan, unset_max_tokens: int | None = None) -> str:
    """What the engine does with each request under ``plan``, for the startup line: the attention's settings,
    and for a length-dependent table which length each row's table is for (under ``per="request"``: the rule a
    request without max_tokens is planned by, ``unset_max_tokens`` the chat default :func:`unset_max_tokens_default`
    read)."""
    method = type(plan.method).__name__ + (" with Resonance" if plan.method.resonance else "")
    original = getattr(plan.method, "original_max_position", None)
    parts = [attentions.RAW_KEY[plan.attention].describe(plan)] if plan.window != NO_WINDOW else []
    if plan.per_request:
        parts.append(
            f"{method} per='request': each request runs, for its whole life, the static table of its planned length "
            f"prompt + max_tokens (the native model when that fits {original or 'the original length'}); a request "
            "without max_tokens gets vLLM's default: 16 offline (SamplingParams()) and on /v1/completions, on "
            "/v1/chat/completions " + (f"the generation config's max_new_tokens, {unset_max_tokens} (it stops there: "
                                       "finish_reason 'length')" if unset_max_tokens is not None
                                       else "max_model_len less the prompt (planned at max_model_len)"))
    elif plan.length_dependent:
        parts.append(f"{method} per step: each row takes the table of its own length (the whole prompt's for a "
                     f"prompt row, its position + 1 after it; native up to {original or 'the original length'})")
    else:
        parts.append(f"table {method}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Per-request tables, once per step


def host_seq_lens(common: CommonAttentionMetadata) -> list[int]:
    """Each request's length (computed + scheduled tokens) read on the host: vLLM's host copy
    ``seq_lens_cpu_upper_bound`` (exact outside asynchronous speculative decoding, where a decode row's is
    the length if every draft was accepted), not the device ``seq_lens`` (a host sync per step), which is read
    only where vLLM gives no host copy (vLLM 0.32 and 0.33 always do), with a warning."""
    bound = getattr(common, "seq_lens_cpu_upper_bound", None)
    if bound is not None:
        return bound.tolist()
    if common.seq_lens.device.type == "cpu":
        return common.seq_lens.tolist()
    if "host_sync" not in _warned:
        _warned.add("host_sync")
        logger.warning("ropescale: this vLLM gives attention metadata builders no host copy of seq_lens "
                       "(CommonAttentionMetadata.seq_lens_cpu_upper_bound is None): the per-request tables of a "
                       "dynamic method read the device's, a host sync every step")
    return common.seq_lens.tolist()


class _StepTablesOwner:
    """What both metadata builders share: this builder's :class:`TableCache` (its buffers are this builder's:
    vLLM keeps one builder per micro-batch so that persistent buffers are not shared), made for the plan
    get_rope recorded, and each step's tables from host-side lengths."""

    def _init_tables(self, vllm_config, device) -> None:
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self._table_rows = int(getattr(scheduler, "max_num_seqs", 0) or 0)
        self._token_rows = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
        self._table_device = torch.device(device)
        self._table_cache: TableCache | None = None
        self._temperature: torch.Tensor | None = None  # DCA's per-row temperature, at one address (CUDA graphs)

    def step_tables(self, common: CommonAttentionMetadata) -> StepTables | None:
        plan = current_plan()
        if plan is None:
            return None
        cache = self._table_cache
        if cache is None or cache.plan != plan:
            cache = self._table_cache = TableCache(plan, self._table_device, self._table_rows)
        if not plan.prompt_dependent:
            return cache.step([])
        seq_lens = host_seq_lens(common)
        starts = common.query_start_loc_cpu[: len(seq_lens) + 1].tolist()
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        prompt_lens = step_prompt_lens(len(seq_lens))
        if not plan.length_dependent:
            tables = cache.step([])
        else:
            request_lens = step_request_lens(len(seq_lens)) if plan.per_request else None
            tables = cache.step(seq_lens, query_lens, prompt_lens, request_lens)
        if plan.temperature_length:
            tables = dataclasses.replace(tables, temperature=self._step_temperature(plan, seq_lens, query_lens,
                                                                                    prompt_lens))
        return tables

    def _step_temperature(self, plan: PreRopePlan, seq_lens, query_lens, prompt_lens) -> torch.Tensor:
        """DCA's temperature of this step's rows (:meth:`PreRopePlan.temperature_factors`) in this builder's buffer
        (``max_num_batched_tokens`` rows, grown outside any graph if a step has more; rows past the step keep
        whatever they held: their slots are padding)."""
        if prompt_lens is None:
            raise RuntimeError("ropescale.vllm: Dual Chunk Attention's temperature needs each request's prompt length, "
                               "which this vLLM's model runner did not give (ropescale reads it from the V1 runner: "
                               "unset VLLM_USE_V2_MODEL_RUNNER)")
        host = plan.temperature_factors(seq_lens, query_lens, prompt_lens)
        rows = max(self._token_rows, host.shape[0], 1)
        if self._temperature is None or self._temperature.shape[0] < host.shape[0]:
            self._temperature = torch.ones(rows, dtype=torch.float32, device=self._table_device)
        if host.shape[0]:
            if self._table_device.type != "cpu":  # an asynchronous copy needs a page-locked source
                host = host.pin_memory()
            self._temperature[: host.shape[0]].copy_(host, non_blocking=True)
        return self._temperature


# Each request's prompt length in this step's batch order, recorded by the model runner's hook
# (install_prompt_lengths) while it builds the step's attention metadata: vLLM's CommonAttentionMetadata does not
# carry it, and a chunk of a prompt needs the table of the whole prompt.
_prompt_lens: dict[str, object] = {}


def _wrap_vllm(module_name: str, owner_name: str | None, attribute: str, wrapper_of) -> bool:
    """Replace ``attribute`` of vLLM's module ``module_name`` (or of its class ``owner_name``) with
    ``wrapper_of(stock)``, once per process (a marked wrapper is left alone). False where this vLLM lacks it."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    owner = getattr(module, owner_name, None) if owner_name else module
    stock = getattr(owner, attribute, None)
    if stock is None:
        return False
    if getattr(stock, "_ropescale", False):
        return True
    wrapper = wrapper_of(stock)
    wrapper._ropescale = True
    wrapper.__wrapped__ = stock
    setattr(owner, attribute, wrapper)
    return True


# The per-request rotation tables of the model this process serves (rotated at write: serving.rotated_at_write), one
# per rotary dim, made by get_rope (rotary.py) and written once per step by the model runner's hook below.
_request_rotary: dict[tuple, RequestRotaryTables] = {}


def request_rotary_tables(plan: PreRopePlan, vllm_config) -> RequestRotaryTables:
    """The process's :class:`RequestRotaryTables` for ``plan`` (one per rotary dim and interleaving), sized for the
    engine's largest step and on its device; installs the step hook that writes them."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    tokens = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
    requests = int(getattr(scheduler, "max_num_seqs", 0) or 0)
    device = torch.device(vllm_config.device_config.device) if getattr(vllm_config, "device_config", None) else "cpu"
    key = (id(vllm_config), plan)
    if key not in _request_rotary:
        if any(k[0] != id(vllm_config) for k in _request_rotary):  # a new engine in this process: a new model
            _request_rotary.clear()
        _request_rotary[key] = RequestRotaryTables(plan, device, max(tokens, 1), max(requests, 1))
        install_prompt_lengths()
    return _request_rotary[key]


def update_request_rotary(runner, num_reqs: int) -> None:
    """Write this step's per-request rotation (each token's request, each request's table) for the step whose
    attention metadata ``runner`` is building: requests in the runner's batch order, their tokens at
    ``query_start_loc``, their planned lengths from :func:`step_request_lens`."""
    if not _request_rotary or num_reqs is None:
        return
    count = int(num_reqs)
    starts = getattr(getattr(runner, "query_start_loc", None), "np", None)
    request_lens = step_request_lens(count)
    if starts is None or request_lens is None:
        raise RuntimeError("ropescale.vllm: a per='request' table needs each request's planned length and tokens, "
                           "which this vLLM's model runner did not give (ropescale reads them from the V1 runner: "
                           "unset VLLM_USE_V2_MODEL_RUNNER)")
    bounds = [int(n) for n in starts[: count + 1]]
    query_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    for tables in _request_rotary.values():
        tables.update(request_lens, query_lens)


def install_prompt_lengths() -> bool:
    """Wrap vLLM's ``GPUModelRunner._build_attention_metadata`` (the CPU runner inherits it; every step calls it
    before the model runs) so that the metadata builders of this step can read each request's prompt length
    (``input_batch.num_prompt_tokens``), and the per-request rotation tables are written for the step
    (:func:`update_request_rotary`). Idempotent; False where this vLLM has no such method (the builders then fall
    back to each request's current length)."""
    def wrapper_of(stock):
        def _build_attention_metadata(self, *args, **kwargs):
            batch = getattr(self, "input_batch", None)
            _prompt_lens["tensor"] = getattr(batch, "num_prompt_tokens_cpu_tensor", None)
            _prompt_lens["runner"] = self
            try:
                update_request_rotary(self, kwargs.get("num_reqs", args[1] if len(args) > 1 else None))
                return stock(self, *args, **kwargs)
            finally:
                _prompt_lens["tensor"] = _prompt_lens["runner"] = None
        return _build_attention_metadata

    return _wrap_vllm("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_build_attention_metadata", wrapper_of)


def prefer_v1_model_runner() -> bool:
    """Make vLLM pick its V1 model runner for a length-dependent pre-RoPE model (``VllmConfig``'s list of what
    the V2 runner does not support gets one more entry for it): the prompt lengths the per-row tables need come
    from the V1 runner (:func:`install_prompt_lengths`). Other models are unaffected, and an explicit
    ``VLLM_USE_V2_MODEL_RUNNER=1`` still wins (the builders then warn and fall back). Idempotent."""
    def wrapper_of(stock):
        def _get_v2_model_runner_unsupported_features(self) -> list[str]:
            unsupported = stock(self)
            plan = served_plan(self)
            if plan is not None and plan.prompt_dependent:
                what = (f"per-row tables of {type(plan.method).__name__}" if plan.length_dependent
                        else "Dual Chunk Attention temperature")
                unsupported.append(f"ropescale's {what} (they need each step's prompt lengths, which ropescale "
                                   "reads from the V1 runner)")
            return unsupported
        return _get_v2_model_runner_unsupported_features

    return _wrap_vllm("vllm.config", "VllmConfig", "_get_v2_model_runner_unsupported_features", wrapper_of)


def step_prompt_lens(count: int) -> list[int] | None:
    """The prompt lengths of this step's first ``count`` requests, or None (with a warning, once) when the model
    runner did not record them."""
    tensor = _prompt_lens.get("tensor")
    if tensor is not None and tensor.shape[0] >= count:
        return tensor[:count].tolist()
    if "prompt_lens" not in _warned:
        _warned.add("prompt_lens")
        logger.warning("ropescale: this vLLM's model runner did not give the step's prompt lengths: a dynamic "
                       "method's prompt chunks take the table of their own length, not the whole prompt's (a long "
                       "prompt split by the token budget then differs from its one-pass run)")
    return None


def step_request_lens(count: int) -> list[int] | None:
    """The planned length (prompt + ``max_tokens``, the most it may generate: vLLM sets an unset one to what
    ``max_model_len`` allows; a pooling request generates 1, as vLLM's ``Request`` counts it) of this step's first
    ``count`` requests, from the model runner recorded by :func:`install_prompt_lengths`; None without it."""
    runner = _prompt_lens.get("runner")
    batch = getattr(runner, "input_batch", None)
    tensor = _prompt_lens.get("tensor")
    if batch is None or tensor is None or tensor.shape[0] < count:
        return None
    prompts, req_ids = tensor[:count].tolist(), list(batch.req_ids[:count])
    req_ids += [None] * (count - len(req_ids))  # a dummy or padded request (profiling, graph capture): any table
    lens = []
    for req_id, prompt in zip(req_ids, prompts):
        params = getattr(runner.requests.get(req_id), "sampling_params", None) if req_id is not None else None
        lens.append(request_length(prompt, getattr(params, "max_tokens", None) if params is not None else 1))
    return lens


def request_length(prompt_len: int, max_tokens: int | None) -> int:
    """A request's planned length: its prompt and the most tokens it may generate (the engine core's
    ``Request.max_tokens`` and the worker's ``sampling_params.max_tokens`` are the same number)."""
    return int(prompt_len) + int(max_tokens if max_tokens is not None else 1)


# ---------------------------------------------------------------------------------------------
# One layer's pre-RoPE attention


def split_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``[num_blocks, Hkv, block_size, 2*D]`` cache as ``(key_cache, value_cache)``, each
    ``[num_blocks, Hkv, block_size, D]`` with its last two dims contiguous (keys then values per page)."""
    num_blocks, kv_heads, block_size, both = kv_cache.shape
    pages = kv_cache.view(num_blocks, kv_heads, 2 * block_size, both // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


# The CUDA tensor-core prefill's scratch (rerope_attention_paged's workspace), one per process, device and
# size: every layer runs on the same stream, one after another, so they share it. It is reserved when the model
# is built, so vLLM's memory profiling (whose profile run skips attention) counts it before sizing the KV
# cache; without it the op would allocate up to ~256 MiB on each prefill step, past what vLLM measured.
_workspaces: dict[tuple, torch.Tensor] = {}


def reserve_workspace(vllm_config, num_kv_heads: int, head_size: int) -> torch.Tensor | None:
    """The shared workspace for this engine's largest step (``max_num_batched_tokens`` query rows), with room
    to pre-rotate 4x as many keys per step (a request past that rotates its key tiles inside the tensor-core
    kernel instead); None where the op needs none (float32, head sizes without a tensor-core kernel)."""
    model_config = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if model_config is None or scheduler is None:
        return None
    tokens = int(scheduler.max_num_batched_tokens)
    size = ops.rerope_paged_workspace_bytes(tokens, num_kv_heads, head_size, model_config.dtype, max_keys=4 * tokens)
    if size == 0:
        return None
    device = torch.device(vllm_config.device_config.device)
    key = (device, size)
    if key not in _workspaces:
        _workspaces[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return _workspaces[key]


def layer_metadata(layer):
    """This step's attention metadata of ``layer`` (vLLM's ``Attention``, by its ``layer_name``) from vLLM's forward
    context, as vLLM's own ``get_attention_context`` finds it; None outside a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # speculative decoding: [0] is the base model's
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = metadata.get(getattr(layer, "layer_name", None))
    return metadata


class PreRopeLayer:
    """The pre-RoPE side of one attention layer: raw K/V into the pages, ReRoPE / dynamic attention out."""

    workspace: torch.Tensor | None = None  # the CUDA backend's reserved scratch (reserve_workspace)

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, *, sliding_window=None,
                 alibi_slopes=None, logits_soft_cap=None, kv_cache_dtype: str = "auto",
                 attn_type: str = AttentionType.DECODER, sinks=None) -> None:
        refused = [name for name, unsupported in (
            ("sliding_window", sliding_window not in (None, -1)), ("alibi_slopes", alibi_slopes is not None),
            ("logits_soft_cap", logits_soft_cap not in (None, 0, 0.0)), ("sinks", sinks is not None),
            (f"kv_cache_dtype={kv_cache_dtype!r}", kv_cache_dtype != "auto"),
            (f"attn_type={attn_type!r}", attn_type != AttentionType.DECODER)) if unsupported]
        if refused:
            raise NotImplementedError(f"ropescale.vllm: pre-RoPE attention does not support {', '.join(refused)}")
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale

    @staticmethod
    def plan() -> PreRopePlan:
        plan = current_plan()
        if plan is None:
            raise RuntimeError("ropescale.vllm: a pre-RoPE attention layer ran but get_rope recorded no plan "
                               "(the model's rotary layers were not built by ropescale's get_rope)")
        return plan

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              metadata=None):
        """The step's raw keys and values into their slots; under DCA's temperature each key times its token's
        factor, from ``metadata`` (the step's: its tables hold the factors). vLLM gives none to a dummy run (profiling,
        warm-up, piecewise graph capture), whose slots it fills with -1: nothing is written there."""
        key_cache, value_cache = split_pages(kv_cache)
        n = slot_mapping.shape[0]
        key = key[:n]
        plan = current_plan()
        if plan is not None and plan.temperature_length and n and metadata is not None:
            tables = getattr(metadata, "rope_tables", None)
            if tables is None or tables.temperature is None:
                raise RuntimeError("ropescale.vllm: a Dual Chunk Attention layer writes keys without the step's "
                                   "temperature (its attention metadata carries no rope tables)")
            key = serving.times_rows(key, tables.temperature, n)
        ops.rerope_cache_write_(key_cache, value_cache, key, value[:n], slot_mapping.to(torch.int64))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata, output: torch.Tensor) -> torch.Tensor:
        plan = self.plan()
        tables = metadata.rope_tables
        if tables is None:
            raise RuntimeError("ropescale.vllm: a pre-RoPE attention layer got metadata without this step's "
                               "tables (its metadata builder saw no recorded plan)")
        key_cache, value_cache = split_pages(kv_cache)
        n = metadata.num_actual_tokens
        requests = metadata.seq_lens.shape[0]
        block_table, seq_lens = metadata.block_table[:requests], metadata.seq_lens
        query_start_loc = metadata.query_start_loc[: requests + 1]
        if tables.segments is not None:  # requests cut where their rows take different tables (cut_segments)
            block_table = block_table.index_select(0, tables.segments.request)
            seq_lens, query_start_loc = tables.segments.seq_lens, tables.segments.query_start_loc
        # The attention factor on the rotated dims only (transformers' rule): on a partial-rotary head it is folded
        # into a copy of the query, elsewhere it scales the whole score in the op (serving.PreRopePlan).
        q = query[:n]
        if tables.temperature is not None:  # DCA's temperature on the query (its keys took theirs when written)
            q = serving.times_rows(q, tables.temperature, n)
        q, scale, scale_factors = plan.attention_arguments(q, self.head_size, self.scale,
                                                           tables.scale_factor, tables.scale_factors, query_start_loc)
        out, _lse = ops.rerope_attention_paged(
            q, key_cache, value_cache, block_table, seq_lens,
            query_start_loc, tables.inv_freq, plan.window, leaky_k=plan.leaky_k,
            scale=scale, scale_factors=scale_factors,
            logn_length=plan.logn_length, interleaved=plan.interleaved, workspace=self.workspace,
            **plan.method_arguments())
        output[:n].copy_(out)
        return output


def served_plan(vllm_config) -> PreRopePlan | None:
    """The plan of the model ``vllm_config`` serves (its config, read as get_rope reads it): a pre-RoPE one, or a
    per-request table rotated at write (``plan.rotated_at_write``); None for any other model."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        return None
    entry = getattr(hf_config, config_lib.CONFIG_KEY, None)
    layer_params = params.values() if config_lib.per_layer_type(hf_config) else (params,)
    if getattr(hf_config, config_lib.DUAL_CHUNK_KEY, None) is None and \
            not any(serving.ropescale_rotary(p, entry) for p in layer_params):
        # get_rope's rule: a model ropescale did not write (a stock `dynamic` config, say) is vLLM's alone, its
        # rotary and its attention
        return None
    try:
        plan = PreRopePlan.of_config(hf_config)
    except (ValueError, TypeError, AttributeError):
        return None  # not ropescale's to judge: get_rope reports it
    if plan is None:
        return None
    _check_layers_reached(plan, vllm_config, hf_config)
    return plan.served_within(_max_model_len(vllm_config))


def _check_layers_reached(plan: PreRopePlan, vllm_config, hf_config) -> None:
    """A per-request or pre-RoPE plan works through ropescale's get_rope (and, pre-RoPE, its backend, which serves
    every attention layer of the model): refused by name where those do not reach exactly the layers that rotate,
    which would serve the model silently wrong. vLLM's Transformers modeling backend (SmolLM3 in vLLM 0.32) runs
    the model's own transformers rotary, never get_rope: a per-request SmolLM3 was served 0.14 nats off. A model
    with NoPE layers (``no_rope_layers``: 0) would have them rotated by the pre-RoPE backend."""
    model_config = getattr(vllm_config, "model_config", None)
    what = (f"{type(plan.method).__name__}" + (" per request" if plan.rotated_at_write else " (pre-RoPE: raw keys "
                                                                                          "rotated at attention time)"))
    try:
        transformers_backend = bool(model_config.using_transformers_backend())
    except (AttributeError, TypeError):
        transformers_backend = False
    if transformers_backend:
        raise NotImplementedError(
            f"ropescale.vllm: {what} is not served by vLLM's Transformers modeling backend, which vLLM uses for this "
            f"model ({model_config.architecture}): its rope is the model's own transformers code, which ropescale's "
            "get_rope never reaches, so each request would get another table without a word. Serve a static table "
            "(YaRN), or use transformers + ropescale.hf")
    if not plan.rotated_at_write and 0 in (getattr(hf_config, "no_rope_layers", None) or ()):
        raise NotImplementedError(
            f"ropescale.vllm: {what} on a model with NoPE layers (no_rope_layers) is not served by vLLM: ropescale's "
            "pre-RoPE backend serves every attention layer of the model and would rotate the NoPE layers' keys. "
            "Serve a static or per-request table, or use transformers + ropescale.hf")


def _serving_pre_rope() -> bool:
    """Whether the model this process builds is a pre-RoPE one (raw keys; a per-request table rotated at write is
    served by vLLM's own attention)."""
    from vllm.config import get_current_vllm_config_or_none

    plan = served_plan(get_current_vllm_config_or_none())
    return plan is not None and not plan.rotated_at_write


# What vLLM's Qwen-family attention layers pass an impl when the config has Qwen's dual_chunk_attention_config (for
# vLLM's own DCA backend): get_rope already read it into the plan.
_DUAL_CHUNK_LAYER_ARGUMENTS = ("layer_idx", "dual_chunk_attention_config")


def _impl_options(args, kwargs) -> dict:
    names = ("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window", "kv_cache_dtype",
             "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name", "sinks")
    options = dict(zip(names, args))
    options.update(kwargs)
    return options


def _pre_rope_layer(options: dict) -> PreRopeLayer:
    if options.get("kv_sharing_target_layer_name") is not None:
        raise NotImplementedError("ropescale.vllm: pre-RoPE attention does not support KV sharing across layers")
    return PreRopeLayer(options["num_heads"], options.get("num_kv_heads") or options["num_heads"],
                        options["head_size"], float(options["scale"]),
                        sliding_window=options.get("sliding_window"), alibi_slopes=options.get("alibi_slopes"),
                        logits_soft_cap=options.get("logits_soft_cap"),
                        kv_cache_dtype=options.get("kv_cache_dtype", "auto"),
                        attn_type=options.get("attn_type", AttentionType.DECODER), sinks=options.get("sinks"))


# ---------------------------------------------------------------------------------------------
# CPU: over CPU_ATTN; pre-RoPE models take ropescale's path, every other model vLLM's own


@dataclasses.dataclass
class RopescaleCPUAttentionMetadata(CPUAttentionMetadata):
    rope_tables: StepTables | None = None


class RopescaleCPUAttentionMetadataBuilder(_StepTablesOwner, CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata, plus this step's per-request tables when a pre-RoPE model is served."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_tables(vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tables = self.step_tables(common_attn_metadata)
        if tables is None:
            return metadata
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(CPUAttentionMetadata)}
        return RopescaleCPUAttentionMetadata(**fields, rope_tables=tables)


class RopescaleCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, or ropescale's pre-RoPE attention for the layers of a pre-RoPE model."""

    @engine.reported
    def __init__(self, *args, **kwargs) -> None:
        pre_rope = _serving_pre_rope()
        if pre_rope:  # vLLM's Qwen models pass DCA's config to the layer (for its DUAL_CHUNK backend): read already
            for name in _DUAL_CHUNK_LAYER_ARGUMENTS:
                kwargs.pop(name, None)
        super().__init__(*args, **kwargs)
        self.pre_rope = _pre_rope_layer(_impl_options(args, kwargs)) if pre_rope else None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.pre_rope is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ropescale.vllm: pre-RoPE attention does not fuse output quantization")
        if attn_metadata is None:  # warm-up
            return output
        return self.pre_rope.attend(query, kv_cache, attn_metadata, output)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.pre_rope is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.pre_rope.write(key, value, kv_cache, slot_mapping, layer_metadata(layer))


class RopescaleCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with ropescale's pre-RoPE path (the name stays ``CPU_ATTN``: vLLM's CPU code keys on it)."""

    @staticmethod
    def get_impl_cls():
        return RopescaleCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RopescaleCPUAttentionMetadataBuilder


# ---------------------------------------------------------------------------------------------
# CUDA (and any other platform): the CUSTOM slot, pre-RoPE models only


@dataclasses.dataclass
class PreRopeMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    rope_tables: StepTables | None = None


class PreRopeMetadataBuilder(_StepTablesOwner, AttentionMetadataBuilder[PreRopeMetadata]):
    """vLLM's metadata as the op takes it, plus this step's tables; no host sync, nothing the forward reads at
    an address that changes between steps: full CUDA graphs for uniform batches (decode, and speculative
    decoding's verification rows), the level vLLM calls ``UNIFORM_BATCH``.

    Not ``ALWAYS`` (full graphs for batches with prefill rows too): the op sizes its launch from shapes and reads
    every length on the device, and vLLM pads a mixed batch's requests to the captured count, so it may qualify;
    but nothing here has run on a GPU, and graphs pay on decode (prefill is compute-bound): mixed batches stay
    piecewise until ``scripts/gpu_check.sh`` shows a captured mixed batch equal to an eager one."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # A per-step method cuts a request with several rows past its prompt (speculative tokens) into one segment
        # per row, fresh tensors each step: full graphs for single-token decode batches only. A per-request method
        # never cuts (one table per request): uniform batches, as a static table.
        plan = served_plan(vllm_config)
        if plan is not None and plan.length_dependent and not plan.per_request:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_tables(vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PreRopeMetadata:
        m = common_attn_metadata
        return PreRopeMetadata(m.num_actual_tokens, m.query_start_loc, m.seq_lens, m.block_table_tensor,
                               m.slot_mapping, self.step_tables(m))


class PreRopeAttentionImpl(AttentionImpl[PreRopeMetadata]):
    @engine.reported
    def __init__(self, *args, **kwargs) -> None:
        options = _impl_options(args, kwargs)
        if not _serving_pre_rope():
            raise NotImplementedError(
                "ropescale.vllm: the CUSTOM attention backend is ropescale's pre-RoPE backend (ReRoPE, dynamic "
                "methods); this model is not one: serve it without --attention-backend CUSTOM")
        self.pre_rope = _pre_rope_layer(options)
        self.num_heads, self.head_size, self.scale = options["num_heads"], options["head_size"], float(options["scale"])
        self.num_kv_heads = options.get("num_kv_heads") or self.num_heads
        # Built with the model, inside what vLLM's memory profiling counts (see reserve_workspace).
        from vllm.config import get_current_vllm_config_or_none

        self.pre_rope.workspace = reserve_workspace(get_current_vllm_config_or_none(), self.num_kv_heads,
                                                    self.head_size)
        self.kv_cache_dtype = options.get("kv_cache_dtype", "auto")
        self.attn_type = options.get("attn_type", AttentionType.DECODER)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ropescale.vllm: pre-RoPE attention does not fuse output quantization")
        if attn_metadata is None:
            return output
        return self.pre_rope.attend(query, kv_cache, attn_metadata, output)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.pre_rope.write(key, value, kv_cache, slot_mapping, layer_metadata(layer))


class PreRopeAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update = False
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return PreRopeAttentionImpl

    @staticmethod
    def get_builder_cls():
        return PreRopeMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # [blocks, heads, slots, 2*D] per layer: what split_pages reads


# ---------------------------------------------------------------------------------------------
# Prefix caching: the prompt's table in the block hash (engine core process)


# The engine's config (recorded when the engine core sizes its KV cache, before any request), the plan it
# serves and a tag per prompt length.
_engine: dict[str, object] = {}


def install_block_hash_key() -> bool:
    """Make vLLM's block hashes of a length-dependent pre-RoPE model carry the table of the request's prompt
    (:func:`prompt_table_tag`, on the first block: hashes chain, so every block of the request carries it): the
    pages of a prompt hold values and deeper layers' keys computed under the table of the whole prompt
    (:func:`cut_segments`), so a page is reused only by a prompt whose table is the same, where the result equals a
    cold run. Other models' hashes are unchanged. Idempotent; False where this vLLM lacks either hook."""
    def keys_wrapper(stock):
        def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
            keys, next_mm_idx = stock(request, start_token_idx, end_token_idx, start_mm_idx)
            if start_token_idx == 0:
                tag = prompt_table_tag(request.num_prompt_tokens, max_new_tokens=request.max_tokens)
                if tag is not None:
                    keys = (*(keys or ()), ("ropescale_table", tag))
            return keys, next_mm_idx
        return generate_block_hash_extra_keys

    def init_wrapper(stock):
        def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
            _engine.clear()
            _engine["config"] = vllm_config
            return stock(self, vllm_config, *args, **kwargs)
        return _initialize_kv_caches

    # the hasher looks the function up in its module at each call; the engine core records its config before
    # it sizes the KV cache (no request yet)
    keys = _wrap_vllm("vllm.v1.core.kv_cache_utils", None, "generate_block_hash_extra_keys", keys_wrapper)
    return keys and _wrap_vllm("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches", init_wrapper)


def prompt_table_tag(prompt_len: int, vllm_config=None, max_new_tokens: int = 0) -> str | None:
    """A digest of the table (and attention factor) a prompt of ``prompt_len`` tokens, in a request that may
    generate ``max_new_tokens`` (a per-request method's scale depends on both), is computed under, for the model of
    ``vllm_config`` (default: the engine's); None when that model's table does not depend on the length."""
    config = vllm_config if vllm_config is not None else _engine.get("config")
    if config is None:
        return None
    if _engine.get("plan_of") is not config:
        plan = served_plan(config)
        _engine.update(plan_of=config, tables=TableCache(plan) if plan is not None else None, tags=OrderedDict())
    tables: TableCache | None = _engine["tables"]  # type: ignore[assignment]
    if tables is None or not tables.plan.prompt_dependent:
        return None
    plan = tables.plan
    tags: OrderedDict = _engine["tags"]  # type: ignore[assignment]
    length = plan.table_length(prompt_len, max_new_tokens)
    key = (length, prompt_len if plan.temperature_length else None)
    if key in tags:
        return tags[key]
    parts = [tables.prompt_digest(prompt_len, max_new_tokens)] if plan.length_dependent else []
    if plan.temperature_length:
        # DCA's temperature: every prompt token's query and key take m(P) (rows past the prompt their own length's,
        # whatever P): the prompt's pages equal a cold run's under the same float32 m(P); m(P) = 1 within L0.
        factor = plan.temperature_factors([prompt_len], [1], [prompt_len])
        if factor.numel() and float(factor[0]) != 1.0:
            parts.append(f"dca_temperature={float(factor[0])!r}")
    tag = tags[key] = "/".join(parts) or None
    if len(tags) > 65536:
        tags.popitem(last=False)
    return tag


def register_backends() -> None:
    """Put ropescale's backends in vLLM's registry (this process): over ``CPU_ATTN`` (the CPU platform's
    only choice; ordinary models still get vLLM's implementation) and in the ``CUSTOM`` slot."""
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
