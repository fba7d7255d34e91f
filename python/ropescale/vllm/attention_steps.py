"""Each step's per-request tables in vLLM: the lengths read on the host (:func:`host_seq_lens`), each request's
prompt and planned length recorded by a hook on vLLM's model runner (:func:`install_prompt_lengths`), the tables the
metadata builders hand the layers (:class:`StepTablesOwner`) and the per-request rotation tables rotated at write
(:func:`request_rotary_tables`). :mod:`ropescale.vllm.attention` is the public path of these names."""

from __future__ import annotations

import dataclasses
import logging

import torch

from vllm.v1.attention.backend import CommonAttentionMetadata

from ..serving import PreRopePlan, RequestRotaryTables, StepTables, TableCache
from .attention_plan import current_plan, served_plan

logger = logging.getLogger("vllm.ropescale")

_warned: set[str] = set()  # one-time log lines, per process


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


class StepTablesOwner:
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
PROMPT_LENS: dict[str, object] = {}


def wrap_vllm(module_name: str, owner_name: str | None, attribute: str, wrapper_of) -> bool:
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
            PROMPT_LENS["tensor"] = getattr(batch, "num_prompt_tokens_cpu_tensor", None)
            PROMPT_LENS["runner"] = self
            try:
                update_request_rotary(self, kwargs.get("num_reqs", args[1] if len(args) > 1 else None))
                return stock(self, *args, **kwargs)
            finally:
                PROMPT_LENS["tensor"] = PROMPT_LENS["runner"] = None
        return _build_attention_metadata

    return wrap_vllm("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_build_attention_metadata", wrapper_of)


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

    return wrap_vllm("vllm.config", "VllmConfig", "_get_v2_model_runner_unsupported_features", wrapper_of)


def step_prompt_lens(count: int) -> list[int] | None:
    """The prompt lengths of this step's first ``count`` requests, or None (with a warning, once) when the model
    runner did not record them."""
    tensor = PROMPT_LENS.get("tensor")
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
    runner = PROMPT_LENS.get("runner")
    batch = getattr(runner, "input_batch", None)
    tensor = PROMPT_LENS.get("tensor")
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
