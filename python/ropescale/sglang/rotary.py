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

__all__ = ["RopescaleRotaryEmbedding", "context_length", "get_rope", "initialize_model", "refusal"]

# The model SGLang is building (its ModelConfig), set by :func:`initialize_model` around the model's constructor.
_building: contextvars.ContextVar[Any] = contextvars.ContextVar("ropescale_sglang_model", default=None)
_layers: dict[tuple, RotaryEmbedding] = {}


class RopescaleRotaryEmbedding(RotaryEmbedding):
    """A ropescale method's static table (ropescale's float32 inv_freq, angles in double, the attention factor on
    cos and sin: what ``hf.patch`` feeds transformers) in SGLang's rotary layer, ``rows`` positions long."""

    def __init__(self, head_size: int, rotary_dim: int, rows: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, method) -> None:
        self.method = method
        super().__init__(head_size, rotary_dim, rows, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return serving.cos_sin_cache(self.method, self.rotary_dim, self.base, self.max_position_embeddings)

    def _ensure_cos_sin_cache_length(self, needed_max_pos: int) -> None:
        rows = int(self.cos_sin_cache.shape[0])
        if needed_max_pos < rows:
            return
        self.max_position_embeddings = int(needed_max_pos) + 1
        cache = self._compute_cos_sin_cache()
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device, dtype=self.cos_sin_cache.dtype)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, method={self.method}"


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
    """Why ropescale's SGLang plugin does not serve a checkpoint's method (and what does), or None when it does: a
    static table on a one-stream rope. Engine-neutral words: the same checkpoint's other engines are named."""
    name = type(parsed.method).__name__ + (" with Resonance" if parsed.method.resonance else "")
    if parsed.raw_keys:
        what = f"{name} with {config_lib.ATTENTION_NAMES[parsed.attention]}"
        why = "it attends over raw (unrotated) keys, which needs ropescale's attention backend"
    elif serving.rotated_at_write(parsed):
        what = f"{name} (per='request')"
        why = "each request takes the table of its planned length, which needs each request's table in the rotary"
    elif serving.needs_pre_rope(parsed):
        what = f"{name} (its table changes with each step's length)"
        why = "each step's table needs raw keys and ropescale's attention backend"
    elif multimodal:
        what, why = f"{name} on a multimodal rope (mrope_section)", "the plugin serves a one-stream rope only"
    else:
        return None
    return (f"ropescale.sglang: {what} is not served by SGLang yet: {why}. Serve it with vLLM + ropescale's plugin or "
            f"transformers + ropescale.hf, or write a static table for SGLang (`ropescale extend SRC DST --method "
            f"yarn ...`)")


def get_rope(original, head_size: int, rotary_dim: int, max_position: int, base, is_neox_style: bool = True,
             rope_scaling: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None,
             partial_rotary_factor: float = 1.0, dual_chunk_attention_config: Mapping[str, Any] | None = None
             ) -> RotaryEmbedding:
    """AROUND hook of SGLang's ``get_rope``: ropescale's rotary for the layers of a checkpoint ropescale wrote (a
    static table), a refusal naming the method for those it does not serve, SGLang's own for every other layer."""
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
    # Every position SGLang may serve (its context length); the model runner grows it further where it needs.
    rows = max(int(max_position), int(getattr(model_config, "context_len", 0) or 0))
    key = (head_size, rotary_dim, rows, bool(is_neox_style), parsed, dtype)
    if key not in _layers:
        _layers[key] = RopescaleRotaryEmbedding(head_size, rotary_dim, rows, parsed.base, is_neox_style, dtype,
                                                parsed.method)
    return _layers[key]


