"""What a patch writes into ``model.config``, so that ``save_pretrained`` saves the model it trained.

``ropescale.hf.patch`` records (and ``unpatch`` takes back, exactly) three things:

- ``rope_parameters``: the method in transformers' own format where transformers has the type
  (``linear``, ``dynamic``, ``yarn``, ``llama3``, ``longrope``), ropescale's registered types
  otherwise (see ``ropescale.hf.rope_types``); ``rope_theta`` and ``partial_rotary_factor`` kept;
- ``max_position_embeddings`` as transformers and vLLM read it for that type:
  ``factor * original_max_position_embeddings`` for the types that carry an original length
  (``yarn``, ``dynamic_yarn``, ``llama3``, ``longrope``, with or without Resonance); the original
  length itself for ``dynamic`` (transformers' dynamic NTK reads it there); unchanged for
  ``linear``, ``ntk`` and plain RoPE (vLLM multiplies it by ``factor`` for those);
- the attention side, for ReRoPE only, in one config entry ``ropescale``::

      "ropescale": {"attention": "rerope", "window": 512, "leaky_k": 0.0, "logn_length": 0}

  (``leaky_k=0``: plain ReRoPE; ``logn_length=0``: no log-n scaling) together with the ``rerope``
  marker on the rope type (``rerope_yarn``, ...), so that a ReRoPE checkpoint cannot load as a
  plain-attention model without notice.

``hf.patch(model)`` with no arguments on a reloaded model reads all of it back.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from .. import scaling
from .rope_types import join_rope_type, table_parameters

#: The config entry holding the attention side of a patch.
CONFIG_KEY = "ropescale"
ATTENTION_KEYS = ("attention", "window", "leaky_k", "logn_length")

# Every config attribute a patch may write: unpatch puts back exactly what was there (or nothing).
_RECORDED = ("rope_parameters", "max_position_embeddings", "original_max_position_embeddings", CONFIG_KEY)
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


def max_position_embeddings_for(method: scaling.RopeScaling, current: int) -> int:
    """``max_position_embeddings`` for a config carrying ``method`` (see the module docstring)."""
    if isinstance(method, scaling.DynamicNTK):
        return int(method.original_max_position)
    if isinstance(method, (scaling.YaRN, scaling.Llama3, scaling.LongRoPE)):
        factor = max(1.0, float(method.factor or 1.0))
        # ceil of the product, minus float noise (1.5 * 4096 is 6144, not 6145)
        return int(math.ceil(round(factor * method.original_max_position, 6)))
    return int(current)


def rope_parameters_for(method: scaling.RopeScaling, base: float, old: dict[str, Any] | None = None,
                        rerope: bool = False) -> dict[str, Any]:
    """``method`` as ``rope_parameters`` (``partial_rotary_factor`` kept from ``old``)."""
    params = method.to_hf(base=base)
    if old and "partial_rotary_factor" in old:
        params["partial_rotary_factor"] = old["partial_rotary_factor"]
    params["rope_type"] = join_rope_type(rerope, params["rope_type"])
    return params


def attention_entry(attention: str, window: int | None, leaky_k: float, logn_length: int) -> dict[str, Any] | None:
    if attention != "rerope":
        return None
    return {"attention": "rerope", "window": int(window), "leaky_k": float(leaky_k), "logn_length": int(logn_length)}


def saved_attention(config) -> dict[str, Any] | None:
    """The attention side recorded in ``config`` (None when there is none), checked."""
    entry = getattr(config, CONFIG_KEY, None)
    if entry is None:
        _, rerope = table_parameters(getattr(config, "rope_parameters", None))
        if rerope:
            raise ValueError(
                f"patch: rope_type {config.rope_parameters['rope_type']!r} marks ReRoPE attention but the config "
                f"has no {CONFIG_KEY!r} entry with its window; pass attention='rerope', window=...")
        return None
    if not isinstance(entry, dict) or entry.get("attention") not in ("sdpa", "rerope") or set(entry) - set(ATTENTION_KEYS):
        raise ValueError(
            f"patch: config.{CONFIG_KEY} must be a dict with keys {ATTENTION_KEYS} and attention 'sdpa' or "
            f"'rerope', got {entry!r}")
    return entry


def record(config, method: scaling.RopeScaling | None, attention: str = "sdpa", window: int | None = None,
           leaky_k: float = 0.0, logn_length: int = 0) -> None:
    """Write a patch into ``config``. ``method=None`` keeps the config's own table (only the ReRoPE
    marker follows ``attention``)."""
    old = dict(config.rope_parameters)
    rerope = attention == "rerope"
    if method is None:
        params, _ = table_parameters(old)
        params["rope_type"] = join_rope_type(rerope, params["rope_type"])
    else:
        params = rope_parameters_for(method, old["rope_theta"], old, rerope)
        config.max_position_embeddings = max_position_embeddings_for(method, config.max_position_embeddings)
        original = getattr(method, "original_max_position", None)
        if "original_max_position_embeddings" in config.__dict__ and original is not None:
            # Phi-3-style configs keep it outside rope_parameters, and transformers prefers that copy.
            config.original_max_position_embeddings = int(original)
    config.rope_parameters = params
    entry = attention_entry(attention, window, leaky_k, logn_length)
    if entry is None:
        if CONFIG_KEY in config.__dict__:
            delattr(config, CONFIG_KEY)
    else:
        setattr(config, CONFIG_KEY, entry)
