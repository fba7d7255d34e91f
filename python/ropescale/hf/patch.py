"""``patch(model, scaling)``: one line turns a transformers model into YaRN, Resonance, Dynamic or ReRoPE.

The families it knows, and what each one's layers can take, are declared in ``ropescale.hf.architectures``.
It works through transformers' own extension points (no re-implemented attention forward); what changes,
per model instance, undone by ``unpatch``: the rotary module's forward (``ropescale.hf.rotary``), the attention
implementation (``AttentionInterface``: ``config._attn_implementation`` X becomes ``ropescale_X``, which calls X
unchanged unless the forward serves raw keys: ``ropescale.hf.pre_rope``), two hooks on the base model (this
module: which path a forward takes, and its cache), and for a per-request method ``generate``
(``ropescale.hf.requests``). A per-layer-type config (Gemma 3) extends the layer types named (its full-attention
layers by default); the other layers keep their own rope, untouched. A method is served on one of two paths, by
what its keys need:

- ROTATED AT WRITE (the static methods, and a dynamic method with ``per="request"`` and plain attention:
  ``_PatchState.rotated_at_write``): the rotary module returns cos/sin of ropescale's tables times the attention
  factor, so the model's own attention rotates q and k, its own cache (``DynamicCache``, ``StaticCache``, sliding
  window layers) keeps the rotated keys, and its own attention implementation (``sdpa``, ``eager``,
  ``flex_attention``, ``flash_attention_*``; sinks, soft-capping) serves them unchanged.

  * a static method: one table (in transformers' Llama layout ropescale computes cos/sin, angles in double
    precision, accurate at long positions; other layouts (multimodal sections, half width) run the model's own
    forward with ropescale's table in its buffers); a LongRoPE with distinct factors gives each row the table of
    its own length;
  * ``per="request"``: each row takes, in every layer and step, the table (and attention factor) of its request's
    planned length, fixed at its first forward: the prompt (the row's largest position + 1) plus the tokens it may
    generate (``generate``'s ``max_new_tokens``, or its ``max_length`` less the input; a manual loop states it with
    :func:`request`; a forward outside both is a whole request). So a request runs the static model of its scale
    from first token to last (the whole model exact), a request that fits the trained length runs the native model,
    and a batched row equals its solo run. The rotary module computes each row's cos/sin in the family's layout
    (Llama's, a multimodal rope's streams, gpt-oss's half width) from the request's per-row tables, computed once
    per request; a ``generate`` call's later steps read them with tensor ops only, so a compiled decode step (a
    ``StaticCache`` under ``torch.compile``, ``fullgraph=True`` included) does not break its graph. A step past the
    planned length is refused (outside ``generate``, which never goes past it).

- RAW KEYS (``ropescale.hf.pre_rope``: the per-step dynamic methods, whose table follows each step's length;
  ``attention="rerope"``, ``"self_extend"``, ``"dual_chunk"``; any method given a ``PreRopeCache``): the rotary
  module returns the identity rotation, so the model's own attention forward caches raw keys, and the base model's
  pre-hook makes the cache's layers of extended attention layers :class:`PreRopeLayer` (keys with their positions;
  transformers' ``DynamicCache``, what ``generate`` and ``use_cache=True`` make, is converted while empty, so a
  patched model needs no special cache argument). ``ropescale_X`` then

  * rotates q and every cached key at attention time with the table for the current length (largest position
    + 1), which keeps every key's ROTATION exact at every decoding step when the table changes (the whole
    model is exact for one layer only: deeper layers' cached keys and values were computed under an earlier
    scale), then calls X (sinks, soft-capping and the rest of X's arguments pass through); ReRoPE runs
    ``rerope_attention`` on the un-rotated q/k, and so do Self-Extend (its ``group``) and Dual Chunk Attention
    (its ``chunk_size``; the temperature of Qwen's ``original_max_position_embeddings`` on q and on each key,
    from the row's prompt length, which the cache keeps; DCA refuses gradients: no training path). In a batch
    each row gets the table of ITS OWN length (a per-request method under a raw-key attention: its planned
    length's): rows are grouped by length and each group is rotated with its table, so a short prompt batched
    with a long one (left padding) gets the same scale as alone;
  * ReRoPE reads padding from the attention mask of every mask format transformers builds for
    ``eager``, ``sdpa``, ``flex_attention`` (a BlockMask) and ``flash_attention_*`` (the 2-D mask);
    other implementations (paged, custom ones) are refused with a clear error.

Length-dependent tables pick the table from a length read off the data (each step's: per-step dynamic methods,
LongRoPE; a request's first forward, and each step outside ``generate``: per-request methods):
``torch.compile(model)`` breaks the graph there and works; ``fullgraph=True`` fails with ropescale's message saying
so (use a static method such as ``scaling.YaRN`` for a full graph; a per-request method's ``generate`` decode steps
compile whole).

What is recorded (in ``model.config``, so ``save_pretrained`` writes it; see ``ropescale.hf.checkpoint``):
the method as ``rope_parameters`` (of the extended layer types, for a per-layer-type config),
``max_position_embeddings`` for it, and for ReRoPE the attention side. ``unpatch`` restores the config
exactly; ``patch(model)`` on a reloaded model re-applies it.

Patching a model twice raises an error; ``unpatch`` first to change the method.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import warnings
from typing import Any, Mapping

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .. import config as config_lib, scaling as scaling_lib, serving, sharding
from . import architectures, checkpoint
from .cache import PreRopeCache, PreRopeLayer
# request (public), REROPE_IMPLEMENTATIONS and the raw-key attention stay importable from here
from .pre_rope import (REROPE_IMPLEMENTATIONS, _base_implementation, _check_rerope_implementation,  # noqa: F401
                       _pre_rope_attention, _pre_rope_layers, _rerope, _wrap_implementations)
from .requests import (_GENERATED_LENGTH, _PREFILL, _Request, _end_request_step, _generate, _prefill,
                       _prepare_generated_length, _start_request_step, request)
from .rotary import _own_layout_rotary_forward, _rotary_forward, _set_rotary_buffers

#: The families ``patch`` knows (``ropescale.hf.architectures``), by name.
SUPPORTED_ARCHITECTURES = tuple(arch.name for arch in architectures.ARCHITECTURES)


@dataclasses.dataclass
class _PatchState:
    # the one place of the method and its attention side's settings (read through ``plan``, never copied here)
    plan: serving.PreRopePlan
    # whether the user's attention is a raw-key op: the plan alone cannot tell plain attention (NO_WINDOW) from
    # ReRoPE with a window of NO_WINDOW
    raw_keys: bool
    architecture: architectures.Architecture
    rotary_modules: list[nn.Module]
    attention_modules: list[nn.Module]
    base_model: nn.Module
    layer_types: tuple[str, ...] | None = None  # the extended layer types of a per-layer-type config
    config: Any = None
    # a multimodal rope's stream per rotary pair (config.mrope_pair_streams); positions are then [B, T, streams]
    pair_streams: list[int] | None = None
    stream_masks: dict = dataclasses.field(default_factory=dict)  # device: [streams, pairs], 1 where a pair turns
    saved_config: dict = dataclasses.field(default_factory=dict)  # what unpatch puts back
    saved_buffers: list = dataclasses.field(default_factory=list)  # (module, name, value) unpatch puts back
    saved_implementations: list = dataclasses.field(default_factory=list)  # (config, X) unpatch puts back
    hooks: list = dataclasses.field(default_factory=list)
    tables: serving.TableCache = dataclasses.field(init=False)  # the plan's tables by length
    # per="request": whether a ``generate`` / ``request`` is open, the tokens each of its rows may generate (a
    # generate call's arrives when transformers has resolved its length), the planned lengths its first forward fixed
    in_request: bool = False
    new_tokens: int | None = None
    planned: torch.Tensor | None = None
    # a ``generate`` call's request: transformers stops every row at its planned length, so once the first forward
    # fixed the planned lengths the steps need no check (and a compiled decode step reads only tensors)
    request_bounded: bool = False
    # rotated at write: the request's per-row tables, fixed with its planned lengths (planned [B], inv_freq [B, P],
    # attention factor [B]; float64, or float32 for a family whose own rotary forward computes in float32; whether
    # the row's table is the model's own, native [B])
    request_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # this forward (set by the base model's pre-hook and the rotary module, cleared after it): whether it runs
    # pre-RoPE, its cache, its positions and (per request) its planned lengths
    step_pre_rope: bool = False
    step_cache: Any = None
    step_positions: torch.Tensor | None = None
    step_planned: torch.Tensor | None = None

    def __post_init__(self):
        self.tables = serving.TableCache(self.plan)
        self.step_pre_rope = self.pre_rope
        # A KV-shared layer (Gemma 4's last num_kv_shared_layers) has no cache of its own: it attends the keys that
        # its source layer (the last earlier layer of its type: kv_sharing_modes "store") cached, at their positions.
        extended = [m for m in self.attention_modules if self.extends(m)]
        sources = {_layer_type(m): m.layer_idx for m in extended if getattr(m, "store_full_length_kv", False)}
        self.kv_sources = {m.layer_idx: sources[_layer_type(m)] for m in extended
                           if getattr(m, "is_kv_shared_layer", False)}
        self.extended_layers = [m.layer_idx for m in extended if m.layer_idx not in self.kv_sources]

    @property
    def method(self) -> scaling_lib.RopeScaling:
        return self.plan.method

    @property
    def rotary_dim(self) -> int:
        return self.plan.rotary_dim

    @property
    def attention(self) -> str:
        """The attention ``patch`` took: ``sdpa`` (plain attention; the plan's op name is then ``rerope``, with
        NO_WINDOW), ``rerope``, ``self_extend`` or ``dual_chunk``."""
        return self.plan.attention if self.raw_keys else "sdpa"

    @property
    def window(self) -> int | None:
        """The raw-key op's window (ReRoPE's, Self-Extend's W, DCA's local size S); None for plain attention."""
        return self.plan.window if self.raw_keys else None

    @property
    def rotated_at_write(self) -> bool:
        """A ``per="request"`` method with plain attention: each request keeps one table, so its keys are rotated
        when written (by the model's own rotary application, with cos/sin of each row's table) and the model's own
        cache and attention implementation serve them (``serving.PreRopePlan.rotated_at_write``)."""
        return self.plan.rotated_at_write

    @property
    def pre_rope(self) -> bool:
        """Keys cached raw and rotated at attention time: ReRoPE, Self-Extend, DCA, and the per-step dynamic
        methods (whose scale follows each step's length). A LongRoPE and a per-request method (rotated at write)
        keep transformers' rotated-key cache."""
        return self.raw_keys or (self.method.dynamic and not self.rotated_at_write)

    @property
    def length_dependent(self) -> bool:
        return self.plan.length_dependent

    @property
    def per_request(self) -> bool:
        return self.plan.per_request

    def extends(self, module: nn.Module) -> bool:
        """Whether the method applies to this attention module (every layer, or its layer type's), never to a NoPE
        layer (``Architecture.rope_layers``: SmolLM3's and Llama 4's ``no_rope_layers``), which has no rotation to
        extend: its attention (raw-key rotation, ReRoPE) and cache stay the model's own."""
        rope_layers = self.architecture.rope_layers
        if rope_layers is not None and not getattr(self.config, rope_layers)[module.layer_idx]:
            return False
        return self.layer_types is None or _layer_type(module) in self.layer_types

    def request(self, max_new_tokens: int) -> "_Request":
        """The context of one request per row that may generate ``max_new_tokens`` (:func:`request`)."""
        return _Request(self, max_new_tokens)

    def table(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """inv_freq on ``device`` and the attention factor for this length (the serving core's table cache)."""
        return self.tables.table(seq_len, device)


def _as_method(scaling, config, layer_type: str | None) -> scaling_lib.RopeScaling:
    if scaling is None:
        return config_lib.read_config(config, layer_type).method
    if isinstance(scaling, scaling_lib.RopeScaling):
        return scaling
    if isinstance(scaling, Mapping):
        return scaling_lib.from_hf(scaling, config.max_position_embeddings)
    raise TypeError(f"patch: scaling must be a ropescale.scaling method, a rope_parameters dict or None, got {type(scaling).__name__}")


def _layer_type(module: nn.Module) -> str | None:
    layer_type = getattr(module, "layer_type", None)
    if layer_type is None:
        layer_types = getattr(module.config, "layer_types", None)
        layer_type = layer_types[module.layer_idx] if layer_types else None
    return layer_type


def _find_modules(model: nn.Module):
    """The text config, its family, its rotary modules, attention modules and base model (the rotary's owner)."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    architecture = architectures.find(config)
    if architecture is None:
        raise TypeError(
            f"patch: unsupported model ({type(model).__name__}, model_type "
            f"{getattr(config, 'model_type', None)!r}); ropescale patches {architectures.names()} models")
    rotary = [m for m in model.modules()
              if type(m).__name__.endswith("RotaryEmbedding") and getattr(m, "config", None) is config]
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")
                 and getattr(m, "config", None) is config and hasattr(m, "layer_idx")]
    owners = [m for m in model.modules() if any(child is rotary[0] for child in m.children())] if rotary else []
    if not attention or len(rotary) != 1 or not owners:
        raise TypeError(f"patch: {type(model).__name__} ({architecture.name}) has {len(rotary)} text rotary modules "
                        f"and {len(attention)} attention modules; ropescale expects one rotary module that its base "
                        "model calls, and attention layers")
    return config, architecture, rotary, attention, owners[0]


def _extended_layer_types(config, layer_types) -> tuple[str, ...] | None:
    """The layer types a per-layer-type config extends (None: a config with one rope for every layer)."""
    if not config_lib.per_layer_type(config):
        if layer_types is not None:
            raise ValueError(f"patch: layer_types={layer_types!r} is for configs whose rope_parameters are per layer "
                             "type (Gemma 3); this model has one rope for every layer")
        return None
    known = tuple(config.rope_parameters)
    if layer_types is None:  # the layers that see past the sliding window: Gemma 3's global layers
        layer_types = tuple(t for t in known if t != "sliding_attention")
    if isinstance(layer_types, str):
        layer_types = (layer_types,)
    layer_types = tuple(layer_types)
    unknown = [t for t in layer_types if t not in known]
    if not layer_types or unknown:
        raise ValueError(f"patch: layer_types must name some of this config's layer types {list(known)}, "
                         f"got {list(layer_types)}")
    tables = {(config.rope_parameters[t].get("rope_theta"), config.rope_parameters[t].get("partial_rotary_factor"),
               config_lib.head_dim_of(config, t)) for t in layer_types}
    if len(tables) > 1:
        raise ValueError(f"patch: the layer types {list(layer_types)} have different rope_theta, "
                         "partial_rotary_factor or head dim; patch them one type at a time")
    return layer_types


def patch(
    model: nn.Module,
    scaling: scaling_lib.RopeScaling | Mapping[str, Any] | None = None,
    *,
    attention: str | None = None,
    window: int | None = None,
    leaky_k: float | None = None,
    logn_length: int | None = None,
    layer_types: tuple[str, ...] | str | None = None,
    group: int | None = None,
    chunk_size: int | None = None,
    local_size: int | None = None,
    original_max_position_embeddings: int | None = None,
    temperature: str | None = None,
    shifted_offset: int | None = None,
    local_value: int | None = None,
) -> nn.Module:
    """Swap ropescale's frequencies and kernels into a transformers model of a family ropescale knows
    (``ropescale.hf.architectures``), and record the method in ``model.config`` (``save_pretrained`` then
    writes it).

    ``scaling``: a ``ropescale.scaling`` method, a transformers-style ``rope_parameters`` dict, or None
    to keep the model's own rope settings. ``attention="rerope"`` needs ``window`` (and optionally
    ``leaky_k`` for Leaky ReRoPE and ``logn_length`` for log-n query scaling). ``attention="self_extend"``
    (Self-Extend) needs ``window`` (the neighbour window W) and ``group`` (the group size G);
    ``attention="dual_chunk"`` (Dual Chunk Attention, Qwen's parameters) needs ``chunk_size`` and ``local_size``,
    and optionally ``original_max_position_embeddings`` (L0: the attention temperature ``max(1, 0.1 ln(len/L0) + 1)``
    on query and key, ``len`` the larger of the prompt's length and the token's position + 1; 0, the default: none)
    and ``temperature``, the rule by its source: ``"qwen"`` (the default, the formula above: Qwen's checkpoints as
    vLLM serves them) or ``"chunkllama"`` (ChunkLlama's own Llama patch: ``max(1, 0.05 ln(len/L0) + 1)``, L0 by
    default the model's ``max_position_embeddings``).
    DCA runs over default RoPE only and has no training path (refused when gradients are wanted).
    ``attention="string"`` (STRING, An et al. 2025) needs ``shifted_offset`` S (distances from S on are shifted
    down by ``S - local_value``; its authors take 0.25 to 0.4 of the trained length) and takes ``local_value`` W
    (``0 <= W <= S``; default 128, theirs, or S where S is smaller), with its code's attention factor
    ``0.1 ln 2 + 1`` on cos and sin.
    ``attention=None`` (the default) takes the attention side the config records (a reloaded ReRoPE,
    Self-Extend or DCA checkpoint; a Qwen config's ``dual_chunk_attention_config``), else "sdpa";
    so ``patch(model)`` on a reloaded checkpoint re-applies what was saved. ``layer_types``: for a config
    whose rope parameters are per layer type (Gemma 3), the types the method extends (default: all but
    ``sliding_attention``). Returns the model.
    """
    if getattr(model, "_ropescale_patch", None) is not None:
        raise RuntimeError("patch: this model is already patched by ropescale; call ropescale.hf.unpatch(model) first")
    config, architecture, rotary_modules, attention_modules, base_model = _find_modules(model)
    layer_types = _extended_layer_types(config, layer_types)
    layer_type = layer_types[0] if layer_types else None
    given = {"window": window, "leaky_k": leaky_k, "logn_length": logn_length, "group": group,
             "chunk_size": chunk_size, "local_size": local_size,
             "original_max_position_embeddings": original_max_position_embeddings, "temperature": temperature,
             "shifted_offset": shifted_offset, "local_value": local_value}
    if attention is None:  # the saved attention, with any parameter given here in place of its saved value
        saved = checkpoint.saved_attention(config, layer_type) or {"attention": "sdpa"}
        attention = saved.pop("attention")
        given = {key: saved.get(key) if value is None else value for key, value in given.items()}
    try:  # the same check, and message, as a checkpoint's entry gets at load and at vLLM engine start
        parameters = config_lib.check_attention(attention, given,
                                                max_position_embeddings=config.max_position_embeddings)
    except ValueError as err:
        raise ValueError(f"patch: {err}") from None
    if attention != "sdpa":
        _check_rerope_implementation(config, attention)

    params = config_lib.layer_type_parameters(config, layer_type)
    method = _as_method(scaling, config, layer_type)
    raw_keys = attention != "sdpa"
    plan = serving.PreRopePlan.for_attention(
        method, config_lib.base_of(config, layer_type),
        method.rotary_dim_for(config_lib.head_dim_of(config, layer_type), params.get("partial_rotary_factor", 1.0)),
        attention, parameters)
    state = _PatchState(
        plan=plan,
        raw_keys=raw_keys,
        architecture=architecture,
        rotary_modules=rotary_modules,
        attention_modules=attention_modules,
        base_model=base_model,
        layer_types=layer_types,
        config=config,
    )
    state.pair_streams = config_lib.mrope_pair_streams(params, state.rotary_dim // 2)
    _check_layers(state, scaling)
    state.saved_config = checkpoint.snapshot(config)
    try:
        checkpoint.record(config, None if scaling is None else state.method, attention, parameters,
                          layer_types=layer_types)
    except ValueError as err:
        checkpoint.restore(config, state.saved_config)
        raise ValueError(f"patch: {architecture.name}: {err}") from None
    _check_written_config(state)
    reduced = plan.self_extend_reduces_within(config_lib.max_model_len_of(config, layer_type))
    if reduced is not None:  # a setting that makes the written checkpoint another method wherever it is served
        warnings.warn(f"patch: {reduced}", stacklevel=2)
    for module in rotary_modules:
        if architecture.cat_layout:
            module.forward = types.MethodType(_rotary_forward, module)
        else:
            _set_rotary_buffers(state, module)
            # the identity in its own layout for a pre-RoPE forward; each row's table for a per-request method
            if architecture.pre_rope is None or state.rotated_at_write:
                module.forward = types.MethodType(_own_layout_rotary_forward, module)
        module._ropescale_patch = state
    for module in attention_modules:
        module._ropescale_patch = state
    _wrap_implementations(state)
    base_model._ropescale_patch = state
    state.hooks = [base_model.register_forward_pre_hook(_base_model_pre_hook, with_kwargs=True),
                   base_model.register_forward_hook(_base_model_hook, always_call=True)]
    if state.per_request and hasattr(model, "generate"):
        if not hasattr(model, _GENERATED_LENGTH):
            raise TypeError(f"patch: per='request' reads generate's length from {_GENERATED_LENGTH}, which this "
                            f"transformers' {type(model).__name__} lacks")
        model.generate = types.MethodType(_generate, model)
        setattr(model, _GENERATED_LENGTH, types.MethodType(_prepare_generated_length, model))
        if hasattr(model, _PREFILL):  # a continued cache of another table is prefilled again (else refused)
            setattr(model, _PREFILL, types.MethodType(_prefill, model))
    model._ropescale_patch = state
    return model


def _check_written_config(state: _PatchState) -> None:
    """The config the patch wrote, validated by the family's own config class (Phi-3's takes ``default`` and
    ``longrope`` only; transformers' ``longrope`` validator reads the global ``head_dim``, which a config with
    per-layer head dims (Gemma 4) refuses to give, a RuntimeError): a method it refuses would save a checkpoint
    that never reloads. Refused, config restored."""
    params = config_lib.layer_type_parameters(state.config, state.layer_types[0]) if state.layer_types else {}
    if params.get("rope_type") == "yarn" and params.get("truncate", True) is False:
        checkpoint.restore(state.config, state.saved_config)
        raise ValueError(f"patch: {state.architecture.name}: transformers' yarn reads truncate from the top level of "
                         "rope_parameters, which a per-layer-type config keys by layer type, so transformers' own model "
                         "(and a reload of the checkpoint) would run truncate=True: use YaRN with truncate=True here")
    validate = getattr(state.config, "validate_rope", None)
    if validate is None:
        return
    try:
        validate()
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        checkpoint.restore(state.config, state.saved_config)
        raise ValueError(f"patch: {state.architecture.name}'s config class ({type(state.config).__name__}) refuses "
                         f"the rope_parameters this method writes, so its checkpoint would not reload: {err}") from None


def _check_layers(state: _PatchState, scaling) -> None:
    """What the family's layers cannot take, refused before the model is touched, naming the layer kind."""
    arch, name = state.architecture, state.architecture.name
    if scaling is not None and arch.fixed_method:
        raise ValueError(f"patch: {name} takes only the method its config holds (patch(model)): {arch.fixed_method}")
    if not state.extended_layers:
        raise ValueError(f"patch: no attention layer of this {name} model rotates ({arch.rope_layers} is all 0: NoPE "
                         "layers only), so there is no rope to extend")
    refusal = arch.method_refusal(type(state.method).__name__, state.pre_rope, state.rotated_at_write)
    if refusal:
        raise ValueError(f"patch: {refusal}")
    if state.raw_keys:
        what = config_lib.ATTENTION_NAMES[state.attention]
        if arch.rerope:
            raise ValueError(f"patch: {what} cannot patch {name}: {arch.rerope}")
        if getattr(state.config, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"patch: {what} cannot patch this {name} model: {architectures.SOFTCAP}")
        if any(getattr(m, "is_causal", True) is False for m in state.attention_modules if state.extends(m)):
            raise ValueError(f"patch: {what} cannot patch this {name} model: {architectures.BIDIRECTIONAL}")
    if state.attention == "dual_chunk":
        try:
            config_lib._check_dual_chunk_table(state.method)
        except ValueError as err:
            raise ValueError(f"patch: {err}") from None
    layer_type = state.layer_types[0] if state.layer_types else None
    head_dim = config_lib.head_dim_of(state.config, layer_type)
    if arch.narrow_table and state.rotary_dim != head_dim:
        partial = config_lib.layer_type_parameters(state.config, layer_type).get("partial_rotary_factor")
        raise ValueError(f"patch: {type(state.method).__name__} under partial_rotary_factor {partial} makes a table for "
                         f"{state.rotary_dim} of the {head_dim} features of {name}'s heads (layer type {layer_type}): "
                         f"{arch.narrow_table}")
    if state.pre_rope:
        sliding = sorted({str(_layer_type(m)) for m in state.attention_modules
                          if state.extends(m) and _sliding_window(m)})
        if sliding:
            kind = "every layer" if sliding == ["None"] else f"layer type {', '.join(sliding)}"
            raise ValueError(f"patch: pre-RoPE methods (dynamic methods, ReRoPE) cannot patch {name}'s sliding-window "
                             f"layers ({kind}): {architectures.SHARED_SLIDING}")
    params = config_lib.layer_type_parameters(state.config, state.layer_types[0] if state.layer_types else None)
    if "llama_4_scaling_beta" in params and getattr(state.method, "original_max_position", None) is None:
        raise ValueError(f"patch: {name}'s query temperature (llama_4_scaling_beta) reads "
                         "original_max_position_embeddings from rope_parameters, which "
                         f"{type(state.method).__name__} has none of: use a method with an original length (YaRN, "
                         "Llama 3, LongRoPE, Dynamic YaRN)")
    if not arch.cat_layout and state.length_dependent and not state.pre_rope and not state.rotated_at_write:
        raise ValueError(f"patch: {type(state.method).__name__} switches its table with the length; {name}'s rope "
                         "layout takes one fixed table (use a static method such as scaling.YaRN)")


def _sliding_window(module):
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the model's own rotary and attention forwards and its config exactly (a
    ``save_pretrained`` after it writes the config the model had before ``patch``)."""
    state = getattr(model, "_ropescale_patch", None)
    if state is None:
        raise RuntimeError("unpatch: this model is not patched by ropescale")
    for module in state.rotary_modules + state.attention_modules + [state.base_model]:
        if "forward" in vars(module):
            del module.forward  # the class's forward shows through again
        vars(module).pop("_ropescale_patch", None)
    for module, name, value in state.saved_buffers:
        setattr(module, name, value)
    for config, implementation in state.saved_implementations:
        config._attn_implementation_internal = implementation
    for hook in state.hooks:
        hook.remove()
    for name in ("generate", _GENERATED_LENGTH, _PREFILL):
        if name in vars(model):
            delattr(model, name)
    checkpoint.restore(state.config, state.saved_config)
    model._ropescale_patch = None
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_ropescale_patch", None) is not None


# ---------------------------------------------------------------------------------------------
# The base model's hooks: which path a forward takes, and its cache


def _base_model_pre_hook(module, args, kwargs):
    """Before the base model runs: whether this forward is pre-RoPE (the method, or a ``PreRopeCache`` given),
    the cache it will use (pre-RoPE: made here as the model would, so that its layers can hold raw keys; a
    per-request forward outside ``generate`` and ``request``: the cache whose request it continues), and the
    attention implementation still wrapped (the user may have changed it since ``patch``)."""
    state: _PatchState = module._ropescale_patch
    _wrap_implementations(state)
    bound = _bound_arguments(module, args, kwargs)
    if sharding.context_parallel_active():
        _check_context_parallel(state, bound)
    if not torch.compiler.is_compiling():  # compiled: no data-dependent read (docstring below)
        _check_position_jumps(state, module, kwargs, bound)
    cache = bound.get("past_key_values")
    if isinstance(cache, PreRopeCache) and state.architecture.pre_rope:
        raise ValueError(f"ropescale: a PreRopeCache (raw keys, rotated at attention time) cannot serve "
                         f"{state.architecture.name}: {state.architecture.pre_rope}")
    state.step_pre_rope = state.pre_rope or isinstance(cache, PreRopeCache)
    state.step_cache, state.step_positions, state.step_planned = None, None, None
    if not state.step_pre_rope:
        if state.rotated_at_write:
            _start_request_step(state, cache)
        return args, kwargs
    if cache is None and _uses_cache(module, bound.get("use_cache")):
        cache = DynamicCache(config=state.config)
        kwargs["past_key_values"] = cache
        if "past_key_values" in bound.get("_positional", ()):
            raise RuntimeError("ropescale: pass past_key_values by keyword to a pre-RoPE patched model")
    if cache is not None:
        _pre_rope_layers(state, cache)
    state.step_cache = cache
    return args, kwargs


def _check_position_jumps(state: _PatchState, module, kwargs, bound) -> None:
    """Position ids that jump, in a forward with neither an attention mask nor a cache (a training forward):
    transformers takes every place where consecutive positions differ by other than 1 for the start of another
    packed sequence (``masking_utils.find_packed_sequence_indices``) and masks each row into those sequences.

    - Rows that restart (packed sequences, each from 0) keep that, except where ropescale cannot follow it: its
      raw-key attentions read padding from the attention mask, not the packed sequences, and a table of each
      row's length (dynamic, per request) would be the row's, not each sequence's; both refused by name.
    - Rows that jump forward (PoSE's and CREAM's skips: ``ropescale.training``) would be cut at each skip,
      silently: a patched model reads them as ONE sequence, as the samplers mean (an all-ones attention mask,
      which transformers' SDPA path drops for ``is_causal``). Rows that do both are refused.

    One host sync; not under ``torch.compile`` (a compiled step would break its graph here), where transformers'
    reading stands: pass the attention mask with sampled positions (``ropescale.training``'s collator does)."""
    positions = bound.get("position_ids")
    if (positions is None or positions.ndim != 2 or positions.shape[-1] < 2 or bound.get("attention_mask") is not None
            or bound.get("past_key_values") is not None or _uses_cache(module, bound.get("use_cache"))):
        return
    steps = positions.diff(dim=-1)
    jumps, restarts = torch.stack(((steps > 1).any(), (steps < 1).any())).tolist()
    if restarts:
        if jumps:
            raise ValueError(
                "ropescale: position_ids that both jump forward (a sampled sequence's skips: PoSE, CREAM) and "
                "restart (packed sequences), with no attention mask: transformers would read every jump as the start "
                "of another packed sequence and cut the sampled one there. Give each sampled sequence a row of its "
                "own (with the attention_mask ropescale.training's collator returns)")
        if state.raw_keys:
            raise NotImplementedError(
                f"ropescale: {config_lib.ATTENTION_NAMES[state.attention]} on packed sequences (position_ids that "
                "restart within a row): it reads padding from the attention mask, not transformers' packed-sequence "
                "mask, so each sequence would attend to the others. Give each sequence a row of its own (padded, "
                "with an attention_mask)")
        if state.length_dependent or state.per_request:
            raise NotImplementedError(
                f"ropescale: {type(state.method).__name__} on packed sequences (position_ids that restart within a "
                "row): its table follows the row's length, not each packed sequence's. Give each sequence a row of "
                "its own (padded, with an attention_mask), or train with a static method")
        return
    if not jumps:
        return
    if "attention_mask" in bound.get("_positional", ()):
        raise RuntimeError("ropescale: pass attention_mask by keyword to a patched model given position ids with "
                           "gaps (ropescale supplies the all-ones mask that keeps them one sequence)")
    inputs = bound.get("input_ids")
    if inputs is None:
        inputs = bound.get("inputs_embeds")
    if inputs is not None:  # neither: the model's own error says so
        kwargs["attention_mask"] = torch.ones(inputs.shape[:2], dtype=torch.long, device=positions.device)


def _check_context_parallel(state: _PatchState, bound: dict) -> None:
    """Under PyTorch's context parallelism each rank holds a slice of the sequence (its tokens and, given by the
    user, their position ids), and only ``F.scaled_dot_product_attention`` becomes ring attention (every query
    against every rank's keys). What a slice would compute silently wrong is refused here, by name: a forward
    without position ids (transformers counts each slice from 0), a table that depends on the sequence's length
    (each rank sees its own slice's largest position), an attention other than SDPA (ropescale's raw-key ops, or
    another implementation, would attend to the rank's own keys only)."""
    method = type(state.method).__name__
    if bound.get("position_ids") is None:
        raise ValueError(
            "ropescale: under context parallelism pass position_ids, sharded with the batch (context_parallel(mesh, "
            "buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1])): without them transformers counts "
            "every rank's slice of the sequence from position 0")
    if state.raw_keys:
        raise NotImplementedError(
            f"ropescale: {config_lib.ATTENTION_NAMES[state.attention]} under context parallelism: PyTorch's ring "
            "attention replaces F.scaled_dot_product_attention only, so each rank would attend to its own slice of "
            "the keys. Train it on one sequence per device (its training path needs no L x L memory: "
            "ropescale.rerope_train)")
    if state.length_dependent or state.per_request:
        what = "per request" if state.per_request else "per length"
        raise NotImplementedError(
            f"ropescale: {method} ({what}) under context parallelism: its table follows each sequence's length (its "
            "largest position + 1), which a rank holding a slice of the sequence does not see. Train with the "
            "static table of the training length instead (a dynamic method at length L is its static method at "
            "factor L / original_max_position)")
    implementations = {_base_implementation(m.config) for m in state.attention_modules if state.extends(m)}
    if implementations - {"sdpa"}:
        raise NotImplementedError(
            f"ropescale: attn_implementation {', '.join(sorted(implementations))} under context parallelism: "
            "PyTorch's ring attention replaces F.scaled_dot_product_attention only, so any other implementation "
            "attends to each rank's own slice of the keys: load the model with attn_implementation='sdpa'")


def _base_model_hook(module, args, output):
    """After the base model (or its error): a per-request forward's planned lengths kept with the cache the model
    made (outside a request), the pre-RoPE layers' pending positions cleared, the step's state reset."""
    state: _PatchState = module._ropescale_patch
    if state.step_planned is not None and not state.step_pre_rope:
        _end_request_step(state, output)
    if state.step_cache is not None:
        for layer in state.step_cache.layers:
            if isinstance(layer, PreRopeLayer):
                layer.pending_positions = None
    # the rotation this forward used stays the default one for a recomputation (gradient checkpointing)
    state.step_pre_rope, state.step_cache, state.step_positions, state.step_planned = state.pre_rope, None, None, None


def _bound_arguments(module, args, kwargs) -> dict:
    """The base model's arguments by name (positional ones included, named in ``_positional``)."""
    if not args:
        return kwargs
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    bound = dict(kwargs)
    bound.update(zip(names, args))
    bound["_positional"] = tuple(names[:len(args)])
    return bound


def _uses_cache(module, use_cache) -> bool:
    """Whether the base model will make a cache (transformers' ``merge_with_config_defaults`` rule)."""
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", None)
    if use_cache and getattr(module, "gradient_checkpointing", False) and module.training:
        use_cache = False
    return bool(use_cache)
