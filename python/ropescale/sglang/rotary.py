"""ropescale's rotary layer for SGLang and the ``get_rope`` hook that hands it out.

SGLang's rotary contract (``sglang/srt/layers/rotary_embedding/base.py``): ``forward(positions int64 [T], query
[T, Hq*D], key [T, Hkv*D]) -> (query, key)`` over ``cos_sin_cache`` ``[rows, rotary_dim]`` (``[cos | sin]``,
half-width per pair); the model runner grows every rotary's cache to the served length with
``_ensure_cos_sin_cache_length``, which the base class fills with the DEFAULT table: ropescale's layer grows its own.
The rotation itself is SGLang's (``forward_native``/``forward_cpu``/``forward_cuda`` over the cache), so a static
table costs what SGLang's own does.
"""

from __future__ import annotations

import contextvars
from typing import Any, Mapping

import torch

from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

from .. import config as config_lib, serving

__all__ = ["PassThroughRotary", "RequestRotaryEmbedding", "RopescaleRotaryEmbedding", "context_length", "get_rope", "initialize_model",
           "raw_key_plan", "refusal", "request_cache_key", "serves_raw_keys", "step_query_lens", "step_tables"]

# The model SGLang is building (its ModelConfig), set by :func:`initialize_model` around the model's constructor.
_building: contextvars.ContextVar[Any] = contextvars.ContextVar("ropescale_sglang_model", default=None)
_layers: dict[tuple, RotaryEmbedding] = {}
# The per-request rotation of each per-request plan built in this process (a model SGLang's scheduler serves): every
# step's tables are written by :func:`step_tables`, each request's radix-cache key by :func:`request_cache_key`.
_request_tables: dict[serving.PreRopePlan, serving.RequestRotaryTables] = {}
_served_length: dict[str, int] = {}
#: The prompt length of each request of the step being built (ForwardBatch.init_new's hook, this process).
step_prompt_lens: list[int] = []
# The raw-key plan of the model this process serves (one per model), recorded when SGLang builds it.
_raw_key_plan: dict[str, serving.PreRopePlan] = {}


class RopescaleRotaryEmbedding(serving.StaticTableRotary, RotaryEmbedding):
    """A ropescale method's static table (ropescale's float32 inv_freq, angles in double, the attention factor on
    cos and sin: what ``hf.patch`` feeds transformers) in SGLang's rotary layer, ``rows`` positions long."""

    def _ensure_cos_sin_cache_length(self, needed_max_pos: int) -> None:
        rows = int(self.cos_sin_cache.shape[0])
        if needed_max_pos < rows:
            return
        self.max_position_embeddings = int(needed_max_pos) + 1
        cache = self._compute_cos_sin_cache()
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device, dtype=self.cos_sin_cache.dtype)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, method={self.method}"


class RequestRotaryEmbedding(RotaryEmbedding):
    """A ``per="request"`` table rotated at write (``serving.rotated_at_write``): every token's q and k turned with
    the table and attention factor of its request (``serving.rotate_per_request`` over the step's
    :class:`~ropescale.serving.RequestRotaryTables`, written before the step by :func:`step_tables`), so SGLang caches
    rotated keys and its own attention backends serve the request as the static model of its scale. A request that
    fits the trained length takes the native table with angles formed as SGLang forms them (the native model)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, method, tables: serving.RequestRotaryTables) -> None:
        self.method, self.request_tables = method, tables
        super().__init__(head_size, rotary_dim, max_position, base, is_neox_style, dtype)

    def _rotate(self, positions, query, key, offsets, fused_set_kv_buffer_arg, in_place: bool):
        if offsets is not None or fused_set_kv_buffer_arg is not None:
            raise NotImplementedError("ropescale.sglang: a per-request table takes no position offsets or fused KV "
                                      "write (the model called its rotary with them)")
        return serving.rotate_per_request(self.request_tables, positions, query, key, self.head_size,
                                          not self.is_neox_style, in_place)

    def forward_native(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        return self._rotate(positions, query, key, offsets, fused_set_kv_buffer_arg, in_place=False)

    def forward_cpu(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        return self._rotate(positions, query, key, offsets, fused_set_kv_buffer_arg, in_place=True)

    forward_cuda = forward_cpu

    def _ensure_cos_sin_cache_length(self, needed_max_pos: int) -> None:
        pass  # the rotation reads the request's tables, not cos_sin_cache

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, method={self.method}, a table per request"


def _planned_length(req) -> int:
    """A request's planned length: its prompt and the tokens it may generate (its ``max_new_tokens``; without one,
    SGLang generates to the context length)."""
    prompt = len(req.origin_input_ids)
    budget = getattr(req.sampling_params, "max_new_tokens", None)
    if budget is None:
        return max(prompt, _served_length.get("context", prompt))
    return prompt + int(budget)


def step_query_lens(forward_batch, requests: int, what: str) -> list[int]:
    """Each request's query rows in an SGLang step (one in a decode step; its extend length in a prefill or mixed
    one), in the step's order."""
    if forward_batch.forward_mode.is_decode():
        return [1] * requests
    if forward_batch.extend_seq_lens_cpu is not None:
        return [int(n) for n in forward_batch.extend_seq_lens_cpu]
    raise NotImplementedError(f"ropescale.sglang: {what} in an SGLang step of mode {forward_batch.forward_mode}")


def step_tables(forward_batch, cls, batch, *args, **kwargs):
    """AFTER hook of SGLang's ``ForwardBatch.init_new``: each request's prompt length on the step's ForwardBatch (for
    the raw-key backend), and the step's per-request tables (each token's request, each request's table at its
    planned length), written in place before the step runs."""
    if batch is None or not getattr(batch, "reqs", None):
        return forward_batch
    if serves_raw_keys():
        # each request's prompt length, for the raw-key backend's length-dependent tables and DCA's temperature (the
        # step's ForwardBatch is not the object the backend later gets: a module-level record, read in the same step)
        step_prompt_lens[:] = [len(req.origin_input_ids) for req in batch.reqs]
    if not _request_tables or forward_batch.forward_mode.is_idle():
        return forward_batch
    requests = [_planned_length(req) for req in batch.reqs]
    query_lens = step_query_lens(forward_batch, len(requests), "a per-request table")
    for tables in _request_tables.values():
        tables.update(requests, query_lens)
    return forward_batch


def request_cache_key(result, req, *args, **kwargs):
    """AFTER hook of SGLang's ``Req.__init__``: the request's scale joins its radix-cache key (``extra_key``), so a
    request reads only keys rotated with its own table: the native table's requests share one key, each other
    table length has its own. Under a prompt-dependent raw-key plan (a per-step table, DCA's temperature) the
    prompt's length joins it (SGLang also merges a running request's prefix into an equal one already cached)."""
    for plan, tables in _request_tables.items():
        planned = _planned_length(req)
        scale = "native" if tables.is_native(planned) else str(plan.table_length(planned, 0))
        req.extra_key = f"{req.extra_key or ''}|ropescale:{scale}"
    if serves_raw_keys():
        if raw_key_plan().prompt_dependent:
            # A length-dependent table or DCA's temperature: a layer's raw keys past the first follow the prompt's
            # length (its rows' tables, its keys' temperature), so only a prompt of the same length may read them.
            req.extra_key = f"{req.extra_key or ''}|ropescale:prompt {len(req.origin_input_ids)}"
    return result


def _request_rotary(head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool, dtype: torch.dtype,
                    parsed: config_lib.RopeConfig, model_config) -> RotaryEmbedding:
    plan = serving.PreRopePlan.of(parsed, rotary_dim, is_neox_style)
    context = int(getattr(model_config, "context_len", 0) or max_position)
    _served_length["context"] = context
    if plan not in _request_tables:
        tokens, requests = context, 4096
        try:  # the largest step SGLang schedules
            from sglang.srt.runtime_context import get_schedule

            schedule = get_schedule()
            tokens = max(tokens, int(schedule.max_prefill_tokens or 0), int(schedule.chunked_prefill_size or 0))
            requests = int(schedule.max_running_requests or requests)
        except Exception:  # noqa: BLE001 (an SGLang without it: the context length bounds a prefill here)
            pass
        device = "cuda" if torch.cuda.is_available() else "cpu"
        _request_tables[plan] = serving.RequestRotaryTables(plan, device, tokens, requests)
    key = (head_size, rotary_dim, max_position, bool(is_neox_style), parsed, dtype, "request")
    if key not in _layers:
        _layers[key] = RequestRotaryEmbedding(head_size, rotary_dim, max_position, parsed.base, is_neox_style, dtype,
                                              parsed.method, _request_tables[plan])
    return _layers[key]


def raw_key_plan() -> serving.PreRopePlan | None:
    """The plan of the raw-key model this process built (its rotary passes raw keys to ropescale's attention
    backend), or None."""
    return _raw_key_plan.get("plan")


def serves_raw_keys() -> bool:
    return raw_key_plan() is not None


def initialize_model(original, model_config, *args, **kwargs):
    """AROUND hook of SGLang's ``_initialize_model``: the model's constructor runs knowing its ModelConfig."""
    token = _building.set(model_config)
    try:
        return original(model_config, *args, **kwargs)
    finally:
        _building.reset(token)


def context_length(original, config):
    """AROUND hook of SGLang's ``get_context_length`` (the length it serves a model to): for a checkpoint ropescale
    wrote, the length ropescale wrote it for (``config.max_model_len_of``). SGLang multiplies
    ``max_position_embeddings`` by ``factor`` only without ``original_max_position_embeddings``, where vLLM does for
    every type but ``yarn``, ``llama3`` and ``longrope``, and ropescale writes its own types' length for vLLM's
    rule: a Resonance-YaRN x4 trained to L would be served to L, not 4L. Every other config is SGLang's."""
    params = getattr(config, "rope_parameters", None)
    entry = getattr(config, config_lib.CONFIG_KEY, None)
    per_layer = config_lib.per_layer_type(config)
    if not isinstance(params, Mapping) or not (entry is not None or (
            not per_layer and serving.written_by_ropescale(params, entry))):
        return original(config)
    return config_lib.max_model_len_of(config)


def refusal(parsed: config_lib.RopeConfig, multimodal: bool) -> str | None:
    """Why ropescale's SGLang plugin does not serve a checkpoint's method, and what does, or None when it does: every
    method on a one-stream rope; none on a multimodal rope (``mrope_section``: three position streams)."""
    if not multimodal:
        return None
    name = type(parsed.method).__name__ + (" with Resonance" if parsed.method.resonance else "")
    if parsed.raw_keys:
        name += f" with {config_lib.ATTENTION_NAMES[parsed.attention]}"
    elif serving.rotated_at_write(parsed):
        name += " (per='request')"
    elif serving.needs_pre_rope(parsed):
        name += " (per step)"
    return (f"ropescale.sglang: {name} on a multimodal rope (mrope_section) is not served by SGLang: the plugin's "
            "rotary and attention turn each token at one position, a multimodal rope at three. Serve it with "
            "transformers + ropescale.hf (vLLM + ropescale's plugin serves a static or per-request table there)")


class PassThroughRotary(RotaryEmbedding):
    """A pre-RoPE model's rotary: q and k unchanged (the attention rotates them), so SGLang caches raw keys."""

    def __init__(self, head_size: int, rotary_dim: int, base: float, is_neox_style: bool, dtype: torch.dtype,
                 plan: serving.PreRopePlan) -> None:
        self.plan = plan
        super().__init__(head_size, rotary_dim, 1, base, is_neox_style, dtype)

    def _pass(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        if fused_set_kv_buffer_arg is not None:
            raise NotImplementedError("ropescale.sglang: a pre-RoPE model's rotary takes no fused KV write")
        return query, key

    forward_native = forward_cpu = forward_cuda = _pass

    def _ensure_cos_sin_cache_length(self, needed_max_pos: int) -> None:
        pass  # no table here: the attention rotates

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, pass-through ({self.plan})"


def get_rope(original, head_size: int, rotary_dim: int, max_position: int, base, is_neox_style: bool = True,
             rope_scaling: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None,
             partial_rotary_factor: float = 1.0, dual_chunk_attention_config: Mapping[str, Any] | None = None
             ) -> RotaryEmbedding:
    """AROUND hook of SGLang's ``get_rope``: for the layers of a checkpoint ropescale wrote, ropescale's rotary (a
    static table, a table per request) or a pass-through (a raw-key method: ropescale's attention backend rotates),
    or a refusal naming the method; SGLang's own for every other layer."""
    model_config = _building.get()
    hf_config = getattr(model_config, "hf_config", None)
    entry = getattr(hf_config, config_lib.CONFIG_KEY, None)
    params = dict(rope_scaling or {})

    def stock():
        return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                        partial_rotary_factor, dual_chunk_attention_config)

    ours = serving.written_by_ropescale(params, entry)
    if not ours:
        return stock()
    if config_lib.per_layer_type(hf_config) and not serving.extended_layer_type(params, hf_config, entry,
                                                                                 max_position, "SGLang"):
        return stock()  # a layer type ropescale left as it was (a sliding layer's table)
    if partial_rotary_factor < 1.0:  # as SGLang's get_rope narrows it
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    dual_chunk = dual_chunk_attention_config
    if dual_chunk is None:
        dual_chunk = getattr(hf_config, config_lib.DUAL_CHUNK_KEY, None)
    try:
        parsed = config_lib.read(params, max_position, entry, rotary_dim, dual_chunk)
    except ValueError as err:
        raise ValueError(f"ropescale.sglang: {err}") from None
    reason = refusal(parsed, "mrope_section" in params)
    if reason is not None:
        raise NotImplementedError(reason)
    dtype = dtype or torch.get_default_dtype()
    if serving.rotated_at_write(parsed):
        return _request_rotary(head_size, rotary_dim, max_position, is_neox_style, dtype, parsed, model_config)
    if serving.needs_pre_rope(parsed):  # raw keys in SGLang's pool, ropescale's attention backend
        served = int(getattr(model_config, "context_len", 0) or 0) or None
        plan = serving.PreRopePlan.of(parsed, rotary_dim, is_neox_style).served_within(served)
        recorded = _raw_key_plan.setdefault("plan", plan)
        if recorded != plan:
            raise NotImplementedError(f"ropescale.sglang: one raw-key plan per model; this model's layers ask for "
                                      f"{recorded} and {plan}")
        return PassThroughRotary(head_size, rotary_dim, parsed.base, is_neox_style, dtype, plan)
    # Every position SGLang may serve (its context length); the model runner grows it further where it needs.
    rows = max(int(max_position), int(getattr(model_config, "context_len", 0) or 0))
    key = (head_size, rotary_dim, rows, bool(is_neox_style), parsed, dtype)
    if key not in _layers:
        _layers[key] = RopescaleRotaryEmbedding(head_size, rotary_dim, rows, parsed.base, is_neox_style, dtype,
                                                parsed.method)
    return _layers[key]


