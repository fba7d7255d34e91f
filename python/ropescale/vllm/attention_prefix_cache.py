"""Prefix caching of a length-dependent pre-RoPE model in vLLM: the prompt's table in the block hash (engine core
process; :func:`install_block_hash_key`, :func:`prompt_table_tag`). :mod:`ropescale.vllm.attention` is the public
path of these names."""

from __future__ import annotations

from collections import OrderedDict

from ..serving import TableCache
from .attention_plan import served_plan
from .attention_steps import wrap_vllm


# The engine's config (recorded when the engine core sizes its KV cache, before any request), the plan it
# serves and a tag per prompt length.
ENGINE: dict[str, object] = {}


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
            ENGINE.clear()
            ENGINE["config"] = vllm_config
            return stock(self, vllm_config, *args, **kwargs)
        return _initialize_kv_caches

    # the hasher looks the function up in its module at each call; the engine core records its config before
    # it sizes the KV cache (no request yet)
    keys = wrap_vllm("vllm.v1.core.kv_cache_utils", None, "generate_block_hash_extra_keys", keys_wrapper)
    return keys and wrap_vllm("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches", init_wrapper)


def prompt_table_tag(prompt_len: int, vllm_config=None, max_new_tokens: int = 0) -> str | None:
    """A digest of the table (and attention factor) a prompt of ``prompt_len`` tokens, in a request that may
    generate ``max_new_tokens`` (a per-request method's scale depends on both), is computed under, for the model of
    ``vllm_config`` (default: the engine's); None when that model's table does not depend on the length."""
    config = vllm_config if vllm_config is not None else ENGINE.get("config")
    if config is None:
        return None
    if ENGINE.get("plan_of") is not config:
        plan = served_plan(config)
        ENGINE.update(plan_of=config, tables=TableCache(plan) if plan is not None else None, tags=OrderedDict())
    tables: TableCache | None = ENGINE["tables"]  # type: ignore[assignment]
    if tables is None or not tables.plan.prompt_dependent:
        return None
    plan = tables.plan
    tags: OrderedDict = ENGINE["tags"]  # type: ignore[assignment]
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
