"""The ``ropescale`` entry of a checkpoint's config: its keys, the attention side it holds (ReRoPE, Self-Extend, Dual
Chunk Attention, STRING) and its checks (:func:`check_attention`, :func:`checked_entry`, Qwen's
``dual_chunk_attention_config``: :func:`checked_dual_chunk`). :mod:`ropescale.config` is the public path of these
names."""

from __future__ import annotations

import difflib
import numbers
from typing import Any, Mapping

from . import attentions, scaling

#: The config entry holding what ``rope_parameters`` cannot say.
CONFIG_KEY = "ropescale"
#: The attentions a config (and ``hf.patch``) may ask for: plain attention, and the raw-key methods declared in
#: ``ropescale.attentions`` (ReRoPE, Self-Extend, Dual Chunk Attention, STRING), each marked on the rope type.
ATTENTIONS = attentions.NAMES
#: The entry's keys of each attention besides ``attention`` (and ``method``), from its declaration.
ATTENTION_PARAMETERS = {name: attentions.RAW_KEY[name].entry_keys if name in attentions.RAW_KEY else ()
                        for name in ATTENTIONS}
ATTENTION_KEYS = ("attention", *dict.fromkeys(key for keys in ATTENTION_PARAMETERS.values() for key in keys))
#: Each raw-key attention as messages name it.
ATTENTION_NAMES = {name: attention.title for name, attention in attentions.RAW_KEY.items()}
STRING_ATTENTION_FACTOR = attentions.STRING_ATTENTION_FACTOR
DUAL_CHUNK_TEMPERATURES = attentions.DUAL_CHUNK_TEMPERATURES
#: Qwen's config key for Dual Chunk Attention (Qwen2.5-1M, Qwen3-2507), read as Qwen's engine (vLLM) reads it:
#: ``chunk_size`` and ``local_size`` (vLLM's defaults when absent), ``original_max_position_embeddings`` (the
#: attention temperature's length L0, 0: none) and vLLM's sparse approximation (``sparse_attention_*``).
DUAL_CHUNK_KEY = "dual_chunk_attention_config"
DUAL_CHUNK_DEFAULTS = {"chunk_size": 8192, "local_size": 1024, "original_max_position_embeddings": 0}
DUAL_CHUNK_KEYS = ("chunk_size", "local_size", "original_max_position_embeddings", "sparse_attention_config",
                   "sparse_attention_enabled", "sparse_attention_threshold", "sparse_attention_last_q")
#: The key in the entry holding the method when ``rope_parameters`` is written for stock engines.
METHOD_KEY = "method"


def attention_entry(attention: str, parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``ropescale`` entry's attention side from checked ``parameters`` (None for plain attention): the
    declaration's entry keys (``attentions.Attention.entry``)."""
    return attentions.RAW_KEY[attention].entry(parameters) if attention in attentions.RAW_KEY else None


def _integer(value: Any, least: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _given(key: str, value: Any) -> bool:
    """Whether a parameter was given: None never is, nor a value its declaration reads as off (ReRoPE's 0s)."""
    declared = [p for attention in attentions.RAW_KEY.values() for p in attention.parameters if p.key == key]
    if not declared:
        raise ValueError(f"no attention takes a parameter {key!r}")
    return declared[0].given(value)


def check_attention(attention: Any, parameters: Mapping[str, Any] | None = None, *,
                    max_position_embeddings: int | None = None) -> dict[str, Any]:
    """The attention side, checked in one place for every path that takes it: ``hf.patch``'s arguments, and a
    checkpoint's entry (and Qwen's ``dual_chunk_attention_config``) as ``hf.patch``, transformers' model build and
    the vLLM plugin (at engine start) read it. ``parameters``: by key (None: not given); the values each takes
    and their defaults are declared in ``ropescale.attentions`` (``max_position_embeddings``: the model's, which a
    default may read). A parameter of another attention is refused. Returns every parameter's value (none for
    plain attention); raises ValueError, which each caller prefixes with its own name."""
    if not isinstance(attention, str) or attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTIONS))}, got {attention!r}")
    parameters = dict(parameters or {})
    takes = attentions.takes(attention)
    foreign = [key for key, value in parameters.items() if key not in takes and _given(key, value)]
    if foreign:
        owners = [name for name in attentions.RAW_KEY if any(key in attentions.takes(name) for key in foreign)]
        raise ValueError(f"{', '.join(foreign)} {'applies' if len(foreign) == 1 else 'apply'} to attention="
                         f"{' or '.join(repr(a) for a in owners)} only; attention={attention!r} takes "
                         f"{', '.join(takes) or 'no parameters'}")
    if attention not in attentions.RAW_KEY:
        return {}
    return attentions.RAW_KEY[attention].checked(parameters, max_position_embeddings)


def checked_dual_chunk(dual_chunk: Any) -> dict[str, int] | None:
    """Qwen's ``dual_chunk_attention_config`` as vLLM, the engine Qwen validated its models with, reads it, checked:
    ``{"chunk_size", "local_size", "original_max_position_embeddings"}`` with vLLM's defaults (None when there is
    none). A key it has no reader for is refused by name (a misspelling would silently take a default). vLLM's
    sparse approximation (``sparse_attention_enabled``; on by default where ``sparse_attention_config`` is given)
    is accepted, with a warning once: ropescale computes dense DCA, which the sparse kernel approximates past its
    threshold (Qwen2.5-1M's checkpoints enable it)."""
    if dual_chunk is None:
        return None
    if not isinstance(dual_chunk, Mapping):
        raise ValueError(f"{DUAL_CHUNK_KEY} must be a dict with keys {list(DUAL_CHUNK_KEYS)}, got {dual_chunk!r}")
    for key in dual_chunk:
        if key not in DUAL_CHUNK_KEYS:
            close = difflib.get_close_matches(str(key), DUAL_CHUNK_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{DUAL_CHUNK_KEY} has no key {key!r}{hint}; it reads {list(DUAL_CHUNK_KEYS)}")
    values = {key: dual_chunk.get(key, default) for key, default in DUAL_CHUNK_DEFAULTS.items()}
    try:
        check_attention("dual_chunk", values)
        if values["original_max_position_embeddings"] is None:
            raise ValueError("original_max_position_embeddings (Dual Chunk Attention's temperature length L0; 0: "
                             "none) must be an integer >= 0, got None")
    except ValueError as err:
        raise ValueError(f"{DUAL_CHUNK_KEY}: {err}") from None
    enabled = dual_chunk.get("sparse_attention_enabled", dual_chunk.get("sparse_attention_config") is not None)
    if not isinstance(enabled, bool):
        raise ValueError(f"{DUAL_CHUNK_KEY}: sparse_attention_enabled must be true or false, got {enabled!r}")
    for key, least in (("sparse_attention_threshold", 0), ("sparse_attention_last_q", 1)):
        if key in dual_chunk and not _integer(dual_chunk[key], least):
            raise ValueError(f"{DUAL_CHUNK_KEY}: {key} must be an integer >= {least}, got {dual_chunk[key]!r}")
    if enabled:
        threshold = dual_chunk.get("sparse_attention_threshold", 32768)
        message = (f"ropescale: {DUAL_CHUNK_KEY} enables vLLM's sparse attention (sparse_attention_enabled): "
                   "ropescale computes dense Dual Chunk Attention, which vLLM's sparse kernel (vertical-and-slash) "
                   f"approximates for prompts past sparse_attention_threshold ({threshold} tokens); there the outputs "
                   "differ from vLLM's by that approximation")
        scaling.warn_once(message, stacklevel=3)
    return values

def _marker_error(rope_type: str, marker: str) -> ValueError:
    if marker == "rerope":
        return ValueError(f"rope_type {rope_type!r} marks ReRoPE attention but the config has no {CONFIG_KEY!r} entry "
                          "with its window; pass attention='rerope', window=...")
    needs = " and ".join(ATTENTION_PARAMETERS[marker])
    return ValueError(f"rope_type {rope_type!r} marks {ATTENTION_NAMES[marker]} but the config has no "
                      f"{CONFIG_KEY!r} entry with its {needs}; pass attention={marker!r} and {needs}")


def entry_parameters(entry: Mapping[str, Any], dual_chunk: Any) -> dict[str, Any]:
    """The attention's parameters an entry gives (every entry key, so that another attention's is refused), with Dual
    Chunk Attention's read from Qwen's ``dual_chunk_attention_config`` where the entry has none (its L0 always)."""
    values = {key: entry.get(key) for key in ATTENTION_KEYS[1:]}
    if entry.get("attention") == "dual_chunk":
        qwen = checked_dual_chunk(dual_chunk) or {}
        for key in ("chunk_size", "local_size"):
            values[key] = qwen.get(key) if values[key] is None else values[key]
        values["original_max_position_embeddings"] = qwen.get("original_max_position_embeddings", 0)
    return values


def checked_entry(entry: Any, rope_type: str, marker: str | bool | None,
                  dual_chunk: Any = None) -> dict[str, Any] | None:
    """The ``ropescale`` entry, checked (None when there is none). ``marker``: the rope type's attention marker
    (True: ReRoPE's); ``dual_chunk``: the config's ``dual_chunk_attention_config`` (Dual Chunk Attention's
    parameters are read from it where the entry has none)."""
    marker = "rerope" if marker is True else (marker or None)
    if entry is None:
        if marker and not (marker == "dual_chunk" and dual_chunk is not None):
            raise _marker_error(rope_type, marker)
        return None
    if (not isinstance(entry, Mapping) or set(entry) - {*ATTENTION_KEYS, METHOD_KEY}
            or entry.get("attention", "sdpa") not in ATTENTIONS
            or (METHOD_KEY in entry and not isinstance(entry[METHOD_KEY], Mapping))):
        unknown = sorted(map(str, set(entry) - {*ATTENTION_KEYS, METHOD_KEY})) if isinstance(entry, Mapping) else []
        close = difflib.get_close_matches(unknown[0], (*ATTENTION_KEYS, METHOD_KEY), n=1) if unknown else []
        raise ValueError(
            f"config.{CONFIG_KEY} must be a dict with keys {ATTENTION_KEYS} (attention one of {ATTENTIONS}) and "
            f"optionally {METHOD_KEY!r} (a rope_parameters dict), got {entry!r}"
            + (f": no key {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "") if unknown else ""))
    if "attention" in entry:
        attention = entry["attention"]
        check_attention(attention, entry_parameters(entry, dual_chunk))
        extra = sorted(set(entry) - {"attention", METHOD_KEY, *ATTENTION_PARAMETERS[attention]})
        if extra:
            raise ValueError(f"config.{CONFIG_KEY}: attention {attention!r} takes "
                             f"{', '.join(ATTENTION_PARAMETERS[attention])}, not {', '.join(extra)}")
    return dict(entry)
