"""What a patch writes into ``model.config``, so that ``save_pretrained`` saves the model it trained.

``ropescale.hf.patch`` records (and ``unpatch`` takes back, exactly) what ``ropescale.config.write``
gives for the method (the format is described there): ``rope_parameters`` for stock engines
(NTK-aware as ``default`` with the scaled ``rope_theta``, Dynamic NTK as ``dynamic_ntk``, ropescale's
registered types where transformers has none), ``max_position_embeddings`` so that transformers and
vLLM derive the length the method was set for, and the ``ropescale`` entry (the ReRoPE attention side,
the NTK-aware method). ``rope_theta`` and ``partial_rotary_factor`` are kept. A pre-RoPE checkpoint
(dynamic method, ReRoPE) may also carry the length it is served to, apart from its table, as
``model_max_length`` (``record(..., max_length=N)``, ``ropescale extend --max-length N``).

The attention marker on the rope type (``rerope_yarn``, ``self_extend``, ``dual_chunk``, ...) exists so that a
ReRoPE, Self-Extend or DCA checkpoint cannot load as a plain-attention model without notice. Dual Chunk Attention
is also written as Qwen's ``dual_chunk_attention_config`` (a Qwen checkpoint, which has that key and no marker, is
read as DCA). ``hf.patch(model)`` with no arguments on a reloaded
model reads all of it back (``ropescale.config.read_config``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from .. import config as config_lib, scaling
from ..config import ATTENTION_KEYS, CONFIG_KEY, METHOD_KEY, attention_entry, table_parameters

# Every config attribute a patch may write: unpatch puts back exactly what was there (or nothing).
_RECORDED = ("rope_parameters", "max_position_embeddings", "original_max_position_embeddings", CONFIG_KEY,
             config_lib.SERVED_LENGTH_KEY, "llama_4_scaling", config_lib.DUAL_CHUNK_KEY)
_ABSENT = object()


def snapshot(config) -> dict[str, Any]:
    """The attributes a patch may change, deep-copied (absent ones remembered as absent)."""
    return {name: copy.deepcopy(config.__dict__[name]) if name in config.__dict__ else _ABSENT for name in _RECORDED}


def restore(config, saved: dict[str, Any]) -> None:
    for name, value in saved.items():
        if value is _ABSENT:
            if name in config.__dict__:
                delattr(config, name)
        else:
            setattr(config, name, copy.deepcopy(value))


def saved_attention(config, layer_type: str | None = None) -> dict[str, Any] | None:
    """The attention side recorded in ``config`` (None when there is none), checked. ``layer_type``: the
    extended layer type of a per-layer-type config."""
    params = config_lib.layer_type_parameters(config, layer_type)
    try:
        parsed = config_lib.read(params, getattr(config, "max_position_embeddings", None),
                                 getattr(config, CONFIG_KEY, None), None,
                                 getattr(config, config_lib.DUAL_CHUNK_KEY, None))
    except ValueError as err:
        raise ValueError(f"patch: {err}") from None
    return None if parsed.attention == "sdpa" else {"attention": parsed.attention, **parsed.parameters}


def record(config, method: scaling.RopeScaling | None, attention: str = "sdpa",
           parameters: Mapping[str, Any] | None = None, target: str = "any", max_length: int | None = None,
           layer_types: tuple[str, ...] | None = None) -> None:
    """Write a patch into ``config``. ``method=None`` keeps the config's own table (only the ReRoPE
    marker follows ``attention``). ``target="vllm"`` or ``"sglang"`` (``config.STOCK_TARGETS``) writes a static table
    as a ``longrope`` that that engine serves exactly with no plugin (``ropescale.config.write_longrope``).

    ``max_length``: the length a pre-RoPE checkpoint (dynamic method, ReRoPE) may be served to, written as
    ``model_max_length`` so that vLLM derives it as ``max_model_len`` (``ropescale.config``); the table keeps
    the original length. Refused for a static table (set for its own length: ``factor x original``).
    Without it, a new method drops a served length the config had (the method's own length holds), and
    ``method=None`` keeps it while the checkpoint stays pre-RoPE.

    ``layer_types``: a per-layer-type config (Gemma 3) gets the method in those layer types' parameters only
    (they must share their base and rotary dim); the others keep theirs, and so the config says which layers
    the method extends.

    ``parameters``: the attention's, checked (``config.check_attention``), recorded in the entry under the marked
    rope type; Dual Chunk Attention's also as Qwen's ``dual_chunk_attention_config``, which any other attention
    removes (the config would read as DCA)."""
    layer_type = layer_types[0] if layer_types else None
    old = dict(config_lib.layer_type_parameters(config, layer_type))
    marker = None if attention == "sdpa" else attention
    parameters = dict(parameters or {})
    length, original = config.max_position_embeddings, None
    if attention == "dual_chunk":
        config_lib.check_dual_chunk_table(
            method if method is not None else config_lib.read(table_parameters(old)[0], length).method)
    dual_chunk = config_lib.dual_chunk_entry(attention, parameters)
    if method is None:
        params, _ = table_parameters(old)
        params["rope_type"] = scaling.RopeType.join(params["rope_type"], marker)
        entry = attention_entry(attention, parameters)
        saved_method = (getattr(config, CONFIG_KEY, None) or {}).get(METHOD_KEY)
        if saved_method is not None:  # the table is the recorded NTK-aware one: keep what names it
            entry = {**(entry or {}), METHOD_KEY: saved_method}
    else:
        base, rotary_dim = config_lib.base_of(config, layer_type), config_lib.rotary_dim_of(config, old, layer_type)
        # A method with no original length of its own (linear, ntk) is set from the model's, never from the length a
        # scaled config already carries (vLLM would multiply SRC's extension by the new factor).
        trained = original_length(config, layer_type)
        if target in config_lib.STOCK_TARGETS and attention == "sdpa":
            written = config_lib.write_longrope(method, base, rotary_dim, trained)
            if "partial_rotary_factor" in old:
                written.rope_parameters["partial_rotary_factor"] = old["partial_rotary_factor"]
        else:
            written = config_lib.write(
                method, base, rotary_dim, trained, attention=attention, parameters=parameters,
                partial_rotary_factor=old.get("partial_rotary_factor"))
        params, entry, length = written.rope_parameters, written.entry, written.max_position_embeddings
        params.update({key: old[key] for key in scaling.LAYOUT_KEYS if key in old and key not in params})
        original = getattr(method, "original_max_position", None)
    served = _served_length(config, params, entry, length, method is None, max_length, dual_chunk)
    config.max_position_embeddings = length
    if "original_max_position_embeddings" in config.__dict__ and original is not None:
        # Phi-3-style configs keep it outside rope_parameters, and transformers prefers that copy.
        config.original_max_position_embeddings = int(original)
    if served is None:
        if config_lib.SERVED_LENGTH_KEY in config.__dict__:
            delattr(config, config_lib.SERVED_LENGTH_KEY)
    else:
        setattr(config, config_lib.SERVED_LENGTH_KEY, served)
    if layer_types:
        config.rope_parameters = {**config.rope_parameters, **{t: copy.deepcopy(params) for t in layer_types}}
    else:
        config.rope_parameters = params
    if "llama_4_scaling_beta" in params and "original_max_position_embeddings" in params:
        # Ministral 3's query temperature, 1 + beta ln(1 + floor(p / original)), as vLLM's Mistral reads it: its
        # conversion of a transformers config leaves it out, and vLLM served the model without it (0.07 nats off).
        config.llama_4_scaling = {"original_max_position_embeddings": params["original_max_position_embeddings"],
                                  "beta": params["llama_4_scaling_beta"]}
    if entry is None:
        if CONFIG_KEY in config.__dict__:
            delattr(config, CONFIG_KEY)
    else:
        setattr(config, CONFIG_KEY, entry)
    if dual_chunk is None:
        if config_lib.DUAL_CHUNK_KEY in config.__dict__:
            delattr(config, config_lib.DUAL_CHUNK_KEY)
    else:  # Qwen's own keys kept (vLLM's sparse settings), ropescale's values over them
        previous = config.__dict__.get(config_lib.DUAL_CHUNK_KEY)
        setattr(config, config_lib.DUAL_CHUNK_KEY, {**(previous if isinstance(previous, dict) else {}), **dual_chunk})


def original_length(config, layer_type: str | None = None) -> int:
    """The length the model of ``config`` was trained to (its ORIGINAL length), whatever method the config holds:
    what a new method with no original length of its own (linear, ntk) is set from, and ``extend``'s default
    ``--original-max-position``. A scaled config's ``max_position_embeddings`` is the length its method was set for,
    not this one: the method's own original length (YaRN, Llama 3, LongRoPE, the dynamic methods; transformers has
    copied a Phi-3-style top-level ``original_max_position_embeddings`` into their rope parameters), else the length
    the config's ``max_position_embeddings`` was written from (``config.write``: NTK-aware as ``default`` carries
    ``ceil(s x L)``; linear, whose length vLLM multiplies by its factor, ``L``). A config ropescale cannot read: its
    ``original_max_position_embeddings``, else its ``max_position_embeddings``."""
    length = int(config.max_position_embeddings)
    params = config_lib.layer_type_parameters(config, layer_type)
    try:
        method = config_lib.read_config(config, layer_type).method
    except ValueError:
        own = params.get("original_max_position_embeddings") if isinstance(params, Mapping) else None
        return own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else length
    own = getattr(method, "original_max_position", None)
    if own is not None:
        return int(own)
    factor = float(getattr(method, "factor", None) or 1.0)
    if config_lib.vllm_length_factor(table_parameters(params)[0]) != 1.0 or factor <= 1.0:
        return length  # vLLM multiplies it by the written factor: the original length itself
    # written as ceil(s x L): L is the largest integer with s x L <= length (float noise rounded away first)
    return max(1, int(math.floor(round(length / factor, 6))))


def _served_length(config, params, entry, length: int, keep: bool, max_length: int | None,
                   dual_chunk=None) -> int | float | None:
    """The ``model_max_length`` to write with ``params``/``entry`` (None: none), see :func:`record`. Raises,
    before anything is written, when ``max_length`` is asked of a static table."""
    current = config.__dict__.get(config_lib.SERVED_LENGTH_KEY)
    if max_length is None and not (keep and current is not None):
        return None
    length_free = config_lib.read(params, length, entry, None, dual_chunk).length_free
    if max_length is None:
        return current if length_free else None
    if not length_free:
        raise ValueError(
            f"max_length {max_length}: a served length apart from the table is for pre-RoPE checkpoints (dynamic "
            f"methods, ReRoPE attention); rope_type {params.get('rope_type')!r} is a static table, set for "
            f"{config_lib.vllm_max_model_len(params, length)} tokens (its factor sets the length)")
    return config_lib.served_length_value(max_length, params)
