"""Between a model config and a ``ropescale.scaling`` method: the one parser every engine adapter
(``ropescale.hf``, ``ropescale.vllm``) reads a checkpoint with, and the writer ``hf.patch`` records with.

A checkpoint says what it is in two places (docs/DESIGN.md, "Checkpoints"):

- ``rope_parameters``, written for STOCK engines, so that each of them is exact or refuses loudly:
  a type transformers and vLLM read the same way (``default``, ``linear``, ``yarn``, ``llama3``,
  ``longrope``) or one of ropescale's own (``resonance*``, ``dynamic_yarn``, ``dynamic_ntk``,
  ``rerope*``), which a stock engine refuses ("Unknown RoPE scaling type"). Two methods are written
  under another name than their ``scaling`` type:

  * NTK-aware as ``default`` with the scaled base ``rope_theta = b * s^(d/(d-2))``: the same table in
    every engine (vLLM's own ``ntk`` is another formula, transformers has none);
  * Dynamic NTK as ``dynamic_ntk``: stock vLLM serves transformers' ``dynamic`` as plain RoPE with a
    table shorter than the length it allows (NaN logprobs past it, no error).

- the ``ropescale`` entry::

      "ropescale": {"attention": "rerope", "window": 512, "leaky_k": 0.0, "logn_length": 0,
                    "method": {"rope_type": "ntk", "factor": 4.0, "rope_theta": 10000.0}}

  the attention side (ReRoPE: ``leaky_k=0`` is plain ReRoPE, ``logn_length=0`` no log-n scaling; Self-Extend:
  ``{"attention": "self_extend", "window": W, "group": G}``; Dual Chunk Attention: ``{"attention": "dual_chunk",
  "chunk_size": C, "local_size": S}`` with Qwen's top-level ``dual_chunk_attention_config`` (which alone, as Qwen's
  checkpoints have it, also reads as DCA); each marked on the rope type, ``<marker>_<table>``, so that stock engines
  refuse it; :func:`check_attention` checks every path's values),
  and the method in ropescale's own format under ``method`` wherever ``rope_parameters`` does not name
  it (NTK-aware) or names a stock type (``linear``, ``yarn``, ``llama3``, ``longrope``): it marks the
  checkpoint as ropescale's, so ``ropescale.vllm`` serves it with ropescale's table (vLLM's own tables
  take float32 angles, 5e-4 off at 12k; its LongRoPE takes the long factors at every length past the
  original one) while a stock engine serves the stock type. A config whose ``rope_parameters`` no
  longer hold every field of the recorded method is refused.

``max_position_embeddings`` is written so that transformers and vLLM derive the length the method was
set for: vLLM multiplies it by ``rope_parameters["factor"]`` for every type but ``yarn``, ``llama3`` and
``longrope`` (``vllm/config/model.py``), so those three get ``factor * original`` and the others the
length divided by their written factor.

A pre-RoPE checkpoint (a dynamic method, ReRoPE attention) has no length of its own: its table follows
each request's length, and ``max_position_embeddings`` stays the ORIGINAL length (transformers' dynamic
rule and ``DynamicNTK`` read it as such). The length it may be served to is written apart, as
``model_max_length``, which vLLM takes in place of ``max_position_embeddings`` before it multiplies by
``factor`` (:func:`served_length_value`); nothing in transformers reads it. Only such checkpoints carry
one: their rope types are ropescale's, which a stock engine refuses, so no engine's table ends before it.

Old checkpoints (ropescale's former ``ntk``, transformers' ``dynamic``) still read.

By role: the ``ropescale`` entry's keys, its attention side and their checks are in :mod:`ropescale.config_entry`
(re-exported here, their documented home).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from . import scaling
from .config_entry import (ATTENTION_KEYS, ATTENTION_NAMES, ATTENTION_PARAMETERS, ATTENTIONS,  # noqa: F401
                           CONFIG_KEY, DUAL_CHUNK_DEFAULTS, DUAL_CHUNK_KEY, DUAL_CHUNK_KEYS, DUAL_CHUNK_TEMPERATURES,
                           METHOD_KEY, STRING_ATTENTION_FACTOR, attention_entry, check_attention, checked_dual_chunk,
                           checked_entry, entry_parameters)

__all__ = [
    "CONFIG_KEY", "ATTENTIONS", "ATTENTION_KEYS", "ATTENTION_NAMES", "ATTENTION_PARAMETERS", "DUAL_CHUNK_KEY",
    "METHOD_KEY", "SERVED_LENGTH_KEY", "RopeConfig", "Written", "read", "read_config",
    "write", "base_of", "table_parameters", "vllm_max_model_len", "max_model_len_of", "served_length_value",
    "rotary_dim",
]

#: Where stock SGLang (0.5) reads YaRN's attention factor: a factor on its own (``0.1 ln s + 1``, or the mscale pair's
#: ratio), never transformers' ``attention_factor``. :func:`write` puts the copy that makes SGLang's product the
#: attention factor beside it; :func:`table_parameters` takes it off again, checked (vLLM 0.32 reads neither it nor
#: SGLang's: it reads ``attention_factor``).
SGLANG_YARN_KEY = "attn_factor"


def sglang_yarn_default(params: Mapping[str, Any]) -> float:
    """The attention factor stock SGLang's YaRN forms from a ``yarn`` table's keys before ``attn_factor``."""
    factor = float(params.get("factor", 1.0) or 1.0)

    def mscale_of(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if params.get("mscale") is not None and params.get("mscale_all_dim") is not None:
        return mscale_of(float(params["mscale"])) / mscale_of(float(params["mscale_all_dim"]))
    return mscale_of(1.0)


def table_parameters(rope_parameters: Mapping[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """``rope_parameters`` with the attention marker taken off the type, and the marker (None when there was none:
    ``scaling.RopeType.MARKERS``, each the attention it marks); a ``yarn`` table's SGLang copy of its attention factor
    (:data:`SGLANG_YARN_KEY`) taken off, refused where it and ``attention_factor`` give engines different factors."""
    params = dict(rope_parameters or {})
    parsed = scaling.RopeType.parse(params.get("rope_type") or params.get("type") or "default")
    params["rope_type"] = parsed.table
    params.pop("type", None)
    if parsed.table == scaling.YaRN.rope_type and SGLANG_YARN_KEY in params:
        copy, meant = params.pop(SGLANG_YARN_KEY), params.get("attention_factor")
        try:
            served = sglang_yarn_default(params) * float(copy)
        except (TypeError, ValueError):
            served = math.nan
        if meant is None or not abs(served - float(meant)) <= 1e-9 * abs(float(meant)):
            raise ValueError(f"yarn's {SGLANG_YARN_KEY} ({copy!r}, SGLang's key: its attention factor {served:.6g}) "
                             f"does not match attention_factor ({meant!r}, transformers' and vLLM's): the engines "
                             "would serve different models (the config was edited by hand)")
    return params, parsed.marker


@dataclass(frozen=True)
class RopeConfig:
    """What a checkpoint asks for: the method, the base its table takes, and the attention side."""

    method: scaling.RopeScaling
    base: float
    attention: str = "sdpa"
    # The attention's parameters, checked and complete (``attentions.Attention.checked``: hf.patch's keywords)
    parameters: Mapping[str, Any] = field(default_factory=dict, hash=False)
    recorded: bool = False  # the method came from the entry: ropescale wrote this checkpoint

    @property
    def raw_keys(self) -> bool:
        """Whether the attention rotates raw keys at attention time (ReRoPE, Self-Extend, DCA)."""
        return self.attention != "sdpa"

    @property
    def per_length(self) -> bool:
        """Whether each sequence takes the table of its own length: the dynamic methods, and a LongRoPE
        with distinct short and long factors that ropescale recorded (a third-party one, e.g. Phi-3, is
        left to the engine's own rule)."""
        return self.method.dynamic or (self.recorded and self.method.length_dependent)

    @property
    def length_free(self) -> bool:
        """Whether no table of this checkpoint ends at a length: a dynamic method or ReRoPE attention, whose
        rope types stock engines refuse. Only such a checkpoint carries a served length apart
        (``SERVED_LENGTH_KEY``); a static table is set for its own length."""
        return self.method.dynamic or self.raw_keys


@dataclass(frozen=True)
class Written:
    """What a config carries for a method: see the module docstring."""

    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    entry: dict[str, Any] | None
    dual_chunk: dict[str, Any] | None = None  # Qwen's dual_chunk_attention_config (Dual Chunk Attention only)


# (``RopeScaling.stock_parameters`` gives the method's rope_parameters for stock engines and, where they serve
# its type with their own code, the method for the entry: it marks the checkpoint as ropescale's, so
# ropescale.vllm serves it with ropescale's table (angles in double: vLLM's float32 angles are 5e-4 off at 12k)
# and, for a LongRoPE with distinct short and long factors, each request with its own length's table, as
# hf.patch does (stock vLLM takes the long factors at every length once max_model_len passes the original one).)


def _stock_length_is_scaled(rope_type: Any) -> bool:
    """Whether stock engines take a config's ``max_position_embeddings`` as the scaled length for this exact
    rope type (vLLM multiplies every other type's by ``factor``, a prefixed one's too)."""
    parsed = scaling.RopeType.parse(rope_type)
    return parsed.is_stock and parsed.method.stock_length_is_scaled


def _written_length(method: scaling.RopeScaling, rope_type: str, factor: float | None, current: int) -> int:
    original = int(getattr(method, "original_max_position", None) or current)
    # The length the method was set for: ceil of the product, minus float noise (1.5 * 4096 is 6144).
    scaled = int(math.ceil(round(max(1.0, float(getattr(method, "factor", None) or 1.0)) * original, 6)))
    if _stock_length_is_scaled(rope_type) or factor is None:
        return scaled
    return original  # vLLM multiplies it by the written factor, the method's own


#: The config key vLLM takes as the model's length in place of ``max_position_embeddings`` (before it multiplies
#: by ``factor``): the served length of a pre-RoPE checkpoint.
SERVED_LENGTH_KEY = "model_max_length"


def vllm_length_factor(rope_parameters: Mapping[str, Any] | None) -> float:
    """What vLLM multiplies a config's length by to derive ``max_model_len``: ``factor`` for every rope type
    but ``yarn``, ``llama3`` and ``longrope`` (whose ``max_position_embeddings`` is already the scaled length)."""
    params = rope_parameters or {}
    if _stock_length_is_scaled(params.get("rope_type", params.get("type", "default"))):
        return 1.0
    factor = params.get("factor")
    return 1.0 if factor is None else float(factor)


def vllm_max_model_len(rope_parameters: Mapping[str, Any] | None, max_position_embeddings: int,
                       model_max_length: float | None = None) -> int:
    """The ``max_model_len`` vLLM derives from a config (``vllm/config/model.py``, 0.32): ``model_max_length``
    when the config has one, else ``max_position_embeddings``, times :func:`vllm_length_factor`."""
    length = max_position_embeddings if model_max_length is None else model_max_length
    return int(length * vllm_length_factor(rope_parameters))


def max_model_len_of(config, layer_type: str | None = None) -> int:
    """:func:`vllm_max_model_len` of a transformers-style config (its rope parameters, of ``layer_type``'s layers where
    given, its ``max_position_embeddings`` and served length): the longest a checkpoint of it is served to."""
    return vllm_max_model_len(layer_type_parameters(config, layer_type), config.max_position_embeddings,
                              getattr(config, SERVED_LENGTH_KEY, None))


def served_length_value(length: int, rope_parameters: Mapping[str, Any] | None) -> int | float:
    """The ``model_max_length`` from which vLLM derives ``max_model_len == length``: ``length / factor``, an
    integer where that divides (else the float just large enough that vLLM's float product, truncated, is
    ``length``)."""
    length = int(length)
    if length < 1:
        raise ValueError(f"the served length must be an integer >= 1, got {length}")
    factor = vllm_length_factor(rope_parameters)
    value: int | float = length / factor
    if float(value).is_integer() and int(int(value) * factor) == length:
        return int(value)
    while int(value * factor) < length:
        value = math.nextafter(value, math.inf)
    if int(value * factor) != length:
        raise ValueError(f"no model_max_length gives vLLM max_model_len {length} with factor {factor}")
    return value


def write(method: scaling.RopeScaling, base: float, rotary_dim: int, max_position_embeddings: int, *,
          attention: str = "sdpa", parameters: Mapping[str, Any] | None = None,
          partial_rotary_factor: float | None = None) -> Written:
    """The config fields for ``method`` on a model with RoPE base ``base``, rotary dim ``rotary_dim`` and
    (original) ``max_position_embeddings``, with the attention side given (``parameters``: its checked values,
    ``check_attention``). ``partial_rotary_factor``: the
    model's, kept in the written parameters (refused where the method carries its own and it differs).
    Dual Chunk Attention also gets Qwen's ``dual_chunk_attention_config`` (``Written.dual_chunk``)."""
    if attention == "dual_chunk":
        check_dual_chunk_table(method)
    params, entry_method = method.stock_parameters(base, rotary_dim)
    if partial_rotary_factor is not None:
        own = params.get("partial_rotary_factor")  # a method's own parameter (proportional): never overwritten
        if own is not None and float(own) != float(partial_rotary_factor):
            raise ValueError(f"{type(method).__name__} has partial_rotary_factor {own}, the model "
                             f"{partial_rotary_factor}: the written config would change one of them")
        params["partial_rotary_factor"] = partial_rotary_factor
    if params["rope_type"] == scaling.YaRN.rope_type and params.get("attention_factor") is not None:  # stock SGLang reads only this
        params[SGLANG_YARN_KEY] = float(params["attention_factor"]) / sglang_yarn_default(params)
    params["rope_type"] = scaling.RopeType.join(params["rope_type"], None if attention == "sdpa" else attention)
    length = _written_length(method, params["rope_type"], params.get("factor"), int(max_position_embeddings))
    entry = attention_entry(attention, parameters or {})
    if entry_method is not None:
        entry = {**(entry or {}), METHOD_KEY: entry_method}
    return Written(params, length, entry, dual_chunk_entry(attention, parameters or {}))


def dual_chunk_entry(attention: str, parameters: Mapping[str, Any]) -> dict[str, int] | None:
    """Qwen's ``dual_chunk_attention_config`` for Dual Chunk Attention (None for any other attention)."""
    if attention != "dual_chunk":
        return None
    return {key: int(parameters[key]) for key in DUAL_CHUNK_DEFAULTS}


#: The engines ``checkpoint.record(target=...)`` and ``ropescale extend --target`` write for: stock builds (no plugin)
#: that serve a ``longrope`` with equal short and long factors exactly (vLLM 0.32, SGLang 0.5: the factors' table,
#: the attention factor read from ``short_mscale``/``long_mscale``).
STOCK_TARGETS = ("vllm", "sglang")


def stock_sglang_misreads(rope_parameters: Mapping[str, Any] | None,
                          max_position_embeddings: int | None = None) -> str | None:
    """Why stock SGLang (0.5, no plugin) would serve this rope other than as transformers does, silently, or None:
    its YaRN takes the attention factor from ``factor`` (and ``mscale``/``mscale_all_dim`` when both are set) times
    ``attn_factor``, never from ``attention_factor`` (ropescale writes the ``attn_factor`` that makes them agree:
    :func:`write`); its ``proportional`` (Gemma 4) ignores ``factor``. A type it does not know, it refuses.
    ``rope_parameters`` of one layer type (a per-layer-type config: each in turn)."""
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == scaling.Proportional.rope_type and float(params.get("factor", 1.0) or 1.0) != 1.0:
        return (f"stock SGLang ignores the proportional rope's factor ({params['factor']}): without ropescale's "
                "plugin it serves the table at factor 1")
    if rope_type != scaling.YaRN.rope_type:
        return None
    copy = params.pop(SGLANG_YARN_KEY, 1.0)
    try:
        method = scaling.from_hf(params, max_position_embeddings)
        served = sglang_yarn_default(params) * float(copy)
    except (ValueError, TypeError, KeyError):
        return None  # not a table transformers reads either: refused everywhere
    meant = float(method.attention_factor)
    if abs(served - meant) <= 1e-6 * abs(meant):
        return None
    return (f"stock SGLang drops YaRN's attention_factor: without ropescale's plugin it serves this table with "
            f"attention factor {served:.6g}, not {meant:.6g} (it reads {SGLANG_YARN_KEY}, which ropescale writes "
            "beside attention_factor: rewrite the config with `ropescale extend`, or `--target sglang`)")


def write_longrope(method: scaling.RopeScaling, base: float, rotary_dim: int, max_position_embeddings: int) -> Written:
    """``method``'s static table as a ``longrope`` with ``short_factor == long_factor`` (``theta_i /
    inv_freq_i``, in float64) and its attention factor in every field an engine reads it from
    (``attention_factor``: transformers; ``short_mscale``/``long_mscale``: vLLM, which ignores the other):
    a checkpoint that stock transformers and stock vLLM serve exactly, no plugin needed. (ropescale
    reads it back as that LongRoPE, the same table.) ``ropescale extend --target vllm`` writes it."""
    if method.dynamic:
        raise ValueError(f"write_longrope: {type(method).__name__} is dynamic (its table changes with the length); "
                         "only a static table can be written as longrope")
    if method.length_dependent:
        raise ValueError(f"write_longrope: this {type(method).__name__} has a table that differs between lengths "
                         "(distinct short and long factors); write it as it is")
    default = scaling.Default().inv_freq(rotary_dim, base, dtype=torch.float64)
    table = method.inv_freq(rotary_dim, base, seq_len=None, dtype=torch.float64)
    if bool((table == 0).any()):
        raise ValueError(f"write_longrope: this {type(method).__name__} leaves pairs unrotated (frequency 0), which no "
                         "longrope factor gives; write it as it is")
    factors = (default / table).tolist()
    original = int(getattr(method, "original_max_position", None) or max_position_embeddings)
    length = _written_length(method, "longrope", None, int(max_position_embeddings))
    attention = float(method.attention_factor)
    params = {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
              "original_max_position_embeddings": original, "factor": length / original,
              "attention_factor": attention, "short_mscale": attention, "long_mscale": attention,
              "rope_theta": float(base)}
    return Written(params, length, None)


def check_dual_chunk_table(method: scaling.RopeScaling, rope_type: str | None = None) -> None:
    """DCA takes plain RoPE's table: vLLM builds it from ``rope_theta`` alone (``get_rope`` takes
    ``DualChunkRotaryEmbedding`` before it reads the rope type), ropescale from the rope type; a scaled one is
    refused rather than one of them picked."""
    if not method.is_plain:
        name = type(method).__name__ + (" with Resonance" if method.resonance else "") + (
            f", rope_type {rope_type!r}" if rope_type else "")
        raise ValueError(f"Dual Chunk Attention over a scaled table ({name}): vLLM builds DCA's table from rope_theta "
                         "alone, ropescale from the rope type, so the two would differ; refused rather than pick one "
                         "(use DCA over default RoPE, with a larger rope_theta if wanted, or the method without DCA)")


def _same_parameters(expected: Mapping[str, Any], written: Mapping[str, Any]) -> bool:
    """Whether ``written`` holds every field of ``expected`` (numbers to 1e-12): a stock engine reads
    ``rope_parameters``, ropescale the entry, so an edit of one alone would split them silently."""
    def same(a, b):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return math.isclose(float(a), float(b), rel_tol=1e-12)
        return a == b
    return all(key in written and same(value, written[key]) for key, value in expected.items())


def read(rope_parameters: Mapping[str, Any] | None, max_position_embeddings: int | None, entry: Any = None,
         rotary_dim: int | None = None, dual_chunk: Any = None) -> RopeConfig:
    """The method a config asks for (``rope_parameters``, ``max_position_embeddings``, the ``ropescale`` entry and
    Qwen's ``dual_chunk_attention_config``, as a checkpoint stores them). ``rotary_dim`` is needed only to check an
    NTK-aware entry. A ``dual_chunk_attention_config`` with no entry (a Qwen checkpoint) is Dual Chunk Attention."""
    params, marker = table_parameters(rope_parameters)
    rope_type = scaling.RopeType.join(params["rope_type"], marker)
    entry = checked_entry(entry, rope_type, marker, dual_chunk)
    qwen = checked_dual_chunk(dual_chunk)
    attention = dict(entry or {})
    method_params = attention.pop(METHOD_KEY, None)
    if method_params is not None:
        method_params = dict(method_params)
        base = float(method_params.pop("rope_theta", params.get("rope_theta", 10000.0)))
        method = scaling.from_hf(method_params, max_position_embeddings)
        if rotary_dim is not None:
            expected, _ = method.stock_parameters(base, rotary_dim)
            if not _same_parameters(expected, {**params, "rope_theta": params.get("rope_theta", 10000.0)}):
                raise ValueError(
                    f"config.{CONFIG_KEY}.{METHOD_KEY} ({dict(entry[METHOD_KEY])}) does not match rope_parameters "
                    f"({dict(rope_parameters or {})}), which should be {expected}: the config was edited by hand")
    else:
        base = float(params.pop("rope_theta", 10000.0))
        if params["rope_type"] == scaling.LongRoPE.rope_type:  # vLLM's copies of the attention factor (write_longrope)
            for key in ("short_mscale", "long_mscale"):
                value = params.pop(key, None)
                if value is not None and value != params.get("attention_factor"):
                    raise ValueError(f"longrope's {key} ({value}) differs from its attention_factor "
                                     f"({params.get('attention_factor')}): transformers and vLLM would disagree")
        method = scaling.from_hf(params, max_position_embeddings)
    recorded = method_params is not None
    kind = attention.get("attention", "dual_chunk" if qwen is not None else "sdpa")
    if qwen is not None and kind != "dual_chunk":
        raise ValueError(f"the config has {DUAL_CHUNK_KEY} (Dual Chunk Attention) and config.{CONFIG_KEY} asks for "
                         f"attention {kind!r}: one of them was edited by hand")
    if marker != (None if kind == "sdpa" else kind) and not (kind == "dual_chunk" and marker is None
                                                              and "attention" not in attention):
        if marker is None:
            raise ValueError(f"config.{CONFIG_KEY} asks for {ATTENTION_NAMES[kind]} but rope_type "
                             f"{params['rope_type']!r} has no {kind!r} marker")
        raise ValueError(f"rope_type {rope_type!r} marks {ATTENTION_NAMES[marker]} but the config asks for "
                         f"attention {kind!r} (config.{CONFIG_KEY} = {entry!r})")
    if kind == "dual_chunk":
        check_dual_chunk_table(method, rope_type)
        if qwen is not None:
            for key in ("chunk_size", "local_size"):
                value = attention.get(key)
                if value is not None and value != qwen[key]:
                    raise ValueError(f"config.{CONFIG_KEY}.{key} ({value}) differs from {DUAL_CHUNK_KEY}'s "
                                     f"({qwen[key]}{' by default' if key not in dual_chunk else ''}): the config "
                                     "was edited by hand")
    if kind == "sdpa":
        return RopeConfig(method, base, recorded=recorded)
    return RopeConfig(method, base, kind, check_attention(kind, entry_parameters({"attention": kind, **attention},
                                                                                 dual_chunk)), recorded)


def layer_type_parameters(config, layer_type: str | None = None) -> Mapping[str, Any]:
    """The ``rope_parameters`` of one layer type (a per-layer-type config such as Gemma 3's keys them by
    ``config.layer_types``), or the config's one dict when ``layer_type`` is None."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is None:
        return params
    if layer_type not in params or not isinstance(params[layer_type], Mapping):
        raise ValueError(f"rope_parameters has no entry for layer type {layer_type!r} (it has {sorted(params)})")
    return params[layer_type]


def per_layer_type(config) -> bool:
    """Whether ``config.rope_parameters`` is keyed by layer type (Gemma 3: ``{"full_attention": {...},
    "sliding_attention": {...}}``; DeepSeek-V4 by the rope its layers take, ``{"main": {...}, "compress": {...}}``)
    rather than one dict for every layer: a dict of dicts (no rope key holds a dict)."""
    params = getattr(config, "rope_parameters", None)
    return (isinstance(params, Mapping) and bool(params)
            and all(isinstance(value, Mapping) for value in params.values()))


def base_of(config, layer_type: str | None = None) -> float:
    """The RoPE base of a transformers-style config (of one layer type's parameters, for a per-layer-type
    config) before any method: ``rope_theta``, or the base an NTK-aware method recorded in the ``ropescale``
    entry scaled it from."""
    entry = getattr(config, CONFIG_KEY, None)
    recorded = entry.get(METHOD_KEY) if isinstance(entry, Mapping) else None
    if isinstance(recorded, Mapping) and "rope_theta" in recorded:
        return float(recorded["rope_theta"])
    return float(layer_type_parameters(config, layer_type).get("rope_theta", 10000.0))


def rotary_dim(head_dim: int, rope_parameters: Mapping[str, Any] | None) -> int:
    """The rotary dim (``inv_freq``'s ``dim``) of heads of ``head_dim`` features under ``rope_parameters``: what the
    method of its rope type declares (``scaling.RopeScaling.rotary_dim_for``): ``head_dim * partial_rotary_factor``,
    or the whole head for a table that spans it (``proportional``). A type no method has: transformers' rule."""
    params, _ = table_parameters(rope_parameters)
    method = scaling.RopeType.parse(params["rope_type"]).method or scaling.Default
    return method.rotary_dim_for(head_dim, params.get("partial_rotary_factor", 1.0))


def mrope_pair_streams(rope_parameters: Mapping[str, Any] | None, pairs: int) -> list[int] | None:
    """Under a multimodal rope (``mrope_section``: pairs per position stream, time, height, width), the stream each
    of the ``pairs`` rotary pairs turns with: Qwen3-VL's ``mrope_interleaved`` pattern (pair j takes height where
    j % 3 == 1 and j < 3 x its section, width where j % 3 == 2 and j < 3 x its section, time elsewhere), else
    Qwen2-VL's contiguous sections. None for a rope with one position per token."""
    section = (rope_parameters or {}).get("mrope_section")
    if not section:
        return None
    section = [int(n) for n in section]
    if len(section) != 3 or min(section) < 0:
        raise ValueError(f"mrope_section must be 3 counts of rotary pairs (time, height, width), got {section}")
    if (rope_parameters or {}).get("mrope_interleaved"):
        streams = [0] * pairs
        for stream in (1, 2):
            for j in range(stream, min(3 * section[stream], pairs), 3):
                streams[j] = stream
        return streams
    if sum(section) != pairs:
        raise ValueError(f"mrope_section {section} has {sum(section)} rotary pairs, the head {pairs}")
    return [stream for stream, n in enumerate(section) for _ in range(n)]


def rotary_dim_of(config, rope_parameters: Mapping[str, Any] | None = None, layer_type: str | None = None) -> int:
    """The rotary dim of a transformers-style config (:func:`rotary_dim` of its head dim, of ``layer_type``'s
    layers where given: :func:`head_dim_of`)."""
    rope_parameters = rope_parameters if rope_parameters is not None else config.rope_parameters
    return rotary_dim(head_dim_of(config, layer_type), rope_parameters)


def head_dim_of(config, layer_type: str | None = None) -> int:
    """The attention head dim of a transformers-style config (``head_dim``, else hidden size / heads). A config
    with per-layer overrides (transformers' ``per_layer_config``: Gemma 4's full-attention layers have a head dim
    of their own) gives ``layer_type``'s (every layer of a type shares it; transformers raises where they differ,
    and reading the global ``head_dim`` of such a config raises)."""
    if layer_type is not None and getattr(config, "is_heterogeneous", False):
        config = config.per_layer_config[layer_type]
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def read_config(config, layer_type: str | None = None) -> RopeConfig:
    """:func:`read` on a transformers-style config object (``rope_parameters``, of ``layer_type`` for a
    per-layer-type config, ``max_position_embeddings`` and the ``ropescale`` attribute)."""
    params = layer_type_parameters(config, layer_type) if layer_type is not None else getattr(config, "rope_parameters", None)
    return read(params, getattr(config, "max_position_embeddings", None), getattr(config, CONFIG_KEY, None),
                rotary_dim_of(config, params or {}, layer_type), getattr(config, DUAL_CHUNK_KEY, None))
