"""``patch(model, scaling)``: one line turns a transformers model into YaRN, Resonance, Dynamic or ReRoPE.

The families it knows, and what each one's layers can take, are declared in ``ropescale.hf.architectures``.
It works through transformers' own extension points (no re-implemented attention forward); what changes,
per model instance, undone by ``unpatch``:

- the rotary module: for a static method, cos/sin from ropescale's table times the method's attention factor
  (in transformers' Llama layout ropescale computes them, angles in double precision, accurate at long
  positions; other layouts (multimodal sections, half width) run the model's own forward with ropescale's
  table in its buffers); for a pre-RoPE method, the identity rotation, so the model's own attention forward
  caches raw keys. A per-layer-type config (Gemma 3) extends the layer types named (its full-attention layers by
  default); the other layers keep their own rope, untouched;
- the attention implementation (``AttentionInterface``): ``config._attn_implementation`` X becomes
  ``ropescale_X``, which calls X unchanged for a static method and, for a pre-RoPE method (dynamic methods,
  a ``PreRopeCache``, ``attention="rerope"``, ``"self_extend"``, ``"dual_chunk"``):

  * rotates q and every cached key at attention time with the table for the current length (largest position
    + 1), which keeps every key's ROTATION exact at every decoding step when the table changes (the whole
    model is exact for one layer only: deeper layers' cached keys and values were computed under an earlier
    scale), then calls X (sinks, soft-capping and the rest of X's arguments pass through); ReRoPE runs
    ``rerope_attention`` on the un-rotated q/k, and so do Self-Extend (its ``group``) and Dual Chunk Attention
    (its ``chunk_size``; the temperature of Qwen's ``original_max_position_embeddings`` on q and on each key,
    from the row's prompt length, which the cache keeps; DCA refuses gradients: no training path). In a batch
    each row gets the table of ITS OWN length: rows
    are grouped by length and each group is rotated with its table, so a short prompt batched with a long one
    (left padding) gets the same scale as alone;
  * a dynamic method with ``per="request"``: each row takes, in every layer and step, the table of its
    request's planned length, fixed at its first forward: the prompt (the row's largest position + 1) plus
    the tokens it may generate (``generate``'s ``max_new_tokens``, or its ``max_length`` less the input; a
    manual loop states it with :class:`request`; a forward outside both is a whole request). So a request
    runs the static model of its scale from first token to last (the whole model exact), a request that
    fits the trained length runs the native model, and a batched row equals its solo run;
  * ReRoPE reads padding from the attention mask of every mask format transformers builds for
    ``eager``, ``sdpa``, ``flex_attention`` (a BlockMask) and ``flash_attention_*`` (the 2-D mask);
    other implementations (paged, custom ones) are refused with a clear error;
  * length-dependent tables (dynamic methods) pick the table from the current length, a value read
    off the data: ``torch.compile(model)`` breaks the graph there and works; ``fullgraph=True`` fails
    with ropescale's message saying so (use a static method such as ``scaling.YaRN`` for a full graph);
- the base model's forward (a pre-hook): for a pre-RoPE method the cache's layers of extended attention layers
  become :class:`PreRopeLayer` (keys with their positions); transformers' ``DynamicCache`` (what ``generate``
  and ``use_cache=True`` make) is converted while empty, so a patched model needs no special cache argument.

What is recorded (in ``model.config``, so ``save_pretrained`` writes it; see ``ropescale.hf.checkpoint``):
the method as ``rope_parameters`` (of the extended layer types, for a per-layer-type config),
``max_position_embeddings`` for it, and for ReRoPE the attention side. ``unpatch`` restores the config
exactly; ``patch(model)`` on a reloaded model re-applies it.

Patching a model twice raises an error; ``unpatch`` first to change the method.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import warnings
from typing import Any, Mapping

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from torch.nn.attention.flex_attention import BlockMask
from transformers.cache_utils import DynamicCache, DynamicLayer

from .. import config as config_lib, ops, scaling as scaling_lib, serving
from . import architectures, checkpoint
from .cache import PreRopeCache, PreRopeLayer

#: The families ``patch`` knows (``ropescale.hf.architectures``), by name.
SUPPORTED_ARCHITECTURES = tuple(arch.name for arch in architectures.ARCHITECTURES)

# rerope_attention never attends a key at a negative position: how padding keys are masked out.
_PADDING_POSITION = -1

# The attention implementations whose mask ReRoPE reads padding from (see ``_padding_keys``): the
# 4-D masks of eager and sdpa, flex's BlockMask, and the 2-D padding mask flash attention gets.
REROPE_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                          "flash_attention_4")

# ``config._attn_implementation`` X of a patched model is ``ropescale_X`` (registered on first use).
_WRAPPED = "ropescale_"

# The raw-key attentions by name, for messages.


@dataclasses.dataclass
class _PatchState:
    method: scaling_lib.RopeScaling
    attention: str
    window: int | None
    leaky_k: float
    logn_length: int
    rotary_dim: int
    base: float
    architecture: architectures.Architecture
    rotary_modules: list[nn.Module]
    attention_modules: list[nn.Module]
    base_model: nn.Module
    layer_types: tuple[str, ...] | None = None  # the extended layer types of a per-layer-type config
    group: int | None = None  # Self-Extend's group size G (its neighbour window W is ``window``)
    chunk_size: int | None = None  # Dual Chunk Attention's C (its local size S is ``window``)
    temperature_length: int = 0  # DCA's temperature length L0 (Qwen's original_max_position_embeddings; 0: none)
    temperature: str = "qwen"  # DCA's temperature rule (config.DUAL_CHUNK_TEMPERATURES)
    config: Any = None
    # a multimodal rope's stream per rotary pair (config.mrope_pair_streams); positions are then [B, T, streams]
    pair_streams: list[int] | None = None
    stream_masks: dict = dataclasses.field(default_factory=dict)  # device: [streams, pairs], 1 where a pair turns
    saved_config: dict = dataclasses.field(default_factory=dict)  # what unpatch puts back
    saved_buffers: list = dataclasses.field(default_factory=list)  # (module, name, value) unpatch puts back
    saved_implementations: list = dataclasses.field(default_factory=list)  # (config, X) unpatch puts back
    hooks: list = dataclasses.field(default_factory=list)
    tables: serving.TableCache | None = None
    # per="request": whether a ``generate`` / ``request`` is open, the tokens each of its rows may generate (a
    # generate call's arrives when transformers has resolved its length), the planned lengths its first forward fixed
    in_request: bool = False
    new_tokens: int | None = None
    planned: torch.Tensor | None = None
    # this forward (set by the base model's pre-hook and the rotary module, cleared after it): whether it runs
    # pre-RoPE, its cache, its positions and (per request) its planned lengths
    step_pre_rope: bool = False
    step_cache: Any = None
    step_positions: torch.Tensor | None = None
    step_planned: torch.Tensor | None = None

    def __post_init__(self):
        window = self.window if self.raw_keys else serving.NO_WINDOW
        self.tables = serving.TableCache(serving.PreRopePlan(
            self.method, self.base, self.rotary_dim, window, self.leaky_k, self.logn_length,
            group=int(self.group or 0), chunk_size=int(self.chunk_size or 0),
            temperature_length=int(self.temperature_length or 0), temperature=self.temperature))
        self.step_pre_rope = self.pre_rope
        # A KV-shared layer (Gemma 4's last num_kv_shared_layers) has no cache of its own: it attends the keys that
        # its source layer (the last earlier layer of its type: kv_sharing_modes "store") cached, at their positions.
        extended = [m for m in self.attention_modules if self.extends(m)]
        sources = {_layer_type(m): m.layer_idx for m in extended if getattr(m, "store_full_length_kv", False)}
        self.kv_sources = {m.layer_idx: sources[_layer_type(m)] for m in extended
                           if getattr(m, "is_kv_shared_layer", False)}
        self.extended_layers = [m.layer_idx for m in extended if m.layer_idx not in self.kv_sources]

    @property
    def raw_keys(self) -> bool:
        """Whether the attention runs ropescale's raw-key op (ReRoPE, Self-Extend, Dual Chunk Attention)."""
        return self.attention != "sdpa"

    @property
    def pre_rope(self) -> bool:
        """Keys cached raw and rotated at attention time: ReRoPE, Self-Extend, DCA, and the dynamic methods (whose
        scale follows the length). A LongRoPE keeps transformers' rotated-key cache."""
        return self.raw_keys or self.method.dynamic

    @property
    def length_dependent(self) -> bool:
        return self.method.length_dependent

    @property
    def per_request(self) -> bool:
        return self.tables.plan.per_request

    def extends(self, module: nn.Module) -> bool:
        """Whether the method applies to this attention module (every layer, or its layer type's)."""
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
    if attention is None:
        saved = checkpoint.saved_attention(config, layer_type) or {"attention": "sdpa"}
        attention = saved["attention"]
        if attention == "rerope":
            window = saved.get("window") if window is None else window
            leaky_k = saved.get("leaky_k", 0.0) if leaky_k is None else leaky_k
            logn_length = saved.get("logn_length", 0) if logn_length is None else logn_length
        elif attention == "self_extend":
            window = saved["window"] if window is None else window
            group = saved["group"] if group is None else group
        elif attention == "dual_chunk":
            chunk_size = saved["chunk_size"] if chunk_size is None else chunk_size
            local_size = saved["local_size"] if local_size is None else local_size
            if original_max_position_embeddings is None:
                original_max_position_embeddings = saved["original_max_position_embeddings"]
            temperature = saved["temperature"] if temperature is None else temperature
    if attention == "dual_chunk":
        original_max_position_embeddings = config_lib.temperature_length_for(
            temperature, original_max_position_embeddings, config.max_position_embeddings)
    _check_attention_arguments(attention, window, leaky_k, logn_length, group, chunk_size, local_size,
                               original_max_position_embeddings, temperature)
    if attention != "sdpa":
        _check_rerope_implementation(config, attention)
    if attention == "dual_chunk":
        window = local_size  # the op's window is Qwen's local size S

    params = config_lib.layer_type_parameters(config, layer_type)
    method = _as_method(scaling, config, layer_type)
    state = _PatchState(
        method=method,
        attention=attention,
        window=window,
        leaky_k=float(leaky_k or 0.0),
        logn_length=int(logn_length or 0),
        rotary_dim=method.rotary_dim_for(config_lib.head_dim_of(config, layer_type),
                                         params.get("partial_rotary_factor", 1.0)),
        base=config_lib.base_of(config, layer_type),
        architecture=architecture,
        rotary_modules=rotary_modules,
        attention_modules=attention_modules,
        base_model=base_model,
        layer_types=layer_types,
        config=config,
        group=group,
        chunk_size=chunk_size,
        temperature_length=int(original_max_position_embeddings or 0),
        temperature=temperature or "qwen",
    )
    state.pair_streams = config_lib.mrope_pair_streams(params, state.rotary_dim // 2)
    _check_layers(state, scaling)
    state.saved_config = checkpoint.snapshot(config)
    try:
        checkpoint.record(config, None if scaling is None else state.method, attention,
                          None if attention == "dual_chunk" else window, state.leaky_k, state.logn_length,
                          layer_types=layer_types, group=group, chunk_size=chunk_size, local_size=local_size,
                          temperature_length=state.temperature_length, temperature=temperature)
    except ValueError as err:
        checkpoint.restore(config, state.saved_config)
        raise ValueError(f"patch: {architecture.name}: {err}") from None
    _check_written_config(state)
    reduced = state.tables.plan.self_extend_reduces_within(config_lib.max_model_len_of(config, layer_type))
    if reduced is not None:  # a setting that makes the written checkpoint another method wherever it is served
        warnings.warn(f"patch: {reduced}", stacklevel=2)
    for module in rotary_modules:
        if architecture.cat_layout:
            module.forward = types.MethodType(_rotary_forward, module)
        else:
            _set_rotary_buffers(state, module)
            if architecture.pre_rope is None:  # the identity in its own layout, for a pre-RoPE forward
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
    if state.pre_rope and arch.pre_rope:
        raise ValueError(f"patch: pre-RoPE methods (dynamic methods, ReRoPE) cannot patch {name}: {arch.pre_rope}")
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
    if not arch.cat_layout and state.length_dependent and not state.pre_rope:
        raise ValueError(f"patch: {type(state.method).__name__} switches its table with the length; {name}'s rope "
                         "layout takes one fixed table (use a static method such as scaling.YaRN)")


# transformers' GenerationMixin resolves how long a generate call may run here (max_new_tokens, max_length, the
# generation config, their defaults): ropescale reads the result rather than re-deriving the rule.
_GENERATED_LENGTH = "_prepare_generated_length"


def _generate(self, *args, **kwargs):
    """``generate`` of a per-request model: the call is one request per row; its budget arrives from
    :func:`_prepare_generated_length` before the first forward."""
    with _Request(self._ropescale_patch, None):
        return type(self).generate(self, *args, **kwargs)


def _prepare_generated_length(self, generation_config, *args, **kwargs):
    """transformers' own, then each row's budget: ``max_length`` less the input's (padded) length."""
    config = getattr(type(self), _GENERATED_LENGTH)(self, generation_config, *args, **kwargs)
    input_length = kwargs.get("input_ids_length")
    state: _PatchState = self._ropescale_patch
    if state.in_request and input_length is not None and config.max_length is not None:
        state.new_tokens = max(int(config.max_length) - int(input_length), 0)
    return config


def request(model: nn.Module, max_new_tokens: int) -> "_Request":
    """``with ropescale.hf.request(model, max_new_tokens=N):`` the forwards inside are ONE request per row (a
    manual decoding loop: the prompt, then a step per token), which may generate up to ``N`` tokens: a model
    patched with a ``per="request"`` method gives each row, at every step, the table of its planned length
    (its prompt, the largest position + 1 of its first forward, plus ``N``). ``generate`` does this itself.
    A step past the planned length is an error, never a silently different scale. Other patches ignore it."""
    state = getattr(model, "_ropescale_patch", None)
    if state is None:
        raise RuntimeError("request: this model is not patched by ropescale")
    if max_new_tokens is None:
        raise ValueError("request: max_new_tokens must be an integer >= 0, got None")
    return state.request(max_new_tokens)


class _Request:
    """The context :func:`request` returns (``_PatchState.request``)."""

    def __init__(self, state: "_PatchState", max_new_tokens: int | None) -> None:
        # None: generate's, set once transformers has resolved it (_prepare_generated_length)
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 0):
            raise ValueError(f"request: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        self.state, self.max_new_tokens = state, max_new_tokens

    def __enter__(self):
        if self.state.in_request:
            raise RuntimeError("request: a request of this model is already open (generate or request)")
        self.state.in_request, self.state.new_tokens, self.state.planned = True, self.max_new_tokens, None
        return self

    def __exit__(self, *exc):
        self.state.in_request, self.state.new_tokens, self.state.planned = False, None, None


def _check_attention_arguments(attention, window, leaky_k, logn_length, group=None, chunk_size=None,
                               local_size=None, temperature_length=None, temperature=None) -> None:
    """The attention side of a patch, checked before the model is touched (``config.check_attention``: the
    same check, and message, as a checkpoint's entry gets at load and at vLLM engine start)."""
    try:
        config_lib.check_attention(attention, window, leaky_k, logn_length, group=group, chunk_size=chunk_size,
                                   local_size=local_size, temperature_length=temperature_length,
                                   temperature=temperature)
    except ValueError as err:
        raise ValueError(f"patch: {err}") from None


def _base_implementation(config) -> str:
    """The attention implementation the model runs (``X`` of a patched model's ``ropescale_X``)."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return implementation[len(_WRAPPED):] if implementation.startswith(_WRAPPED) else implementation


def _check_rerope_implementation(config, attention: str = "rerope") -> None:
    implementation = _base_implementation(config)
    if implementation not in REROPE_IMPLEMENTATIONS:
        raise ValueError(
            f"patch: {config_lib.ATTENTION_NAMES[attention]} reads padding from the attention mask, and ropescale "
            "knows the masks of "
            f"attn_implementation {', '.join(REROPE_IMPLEMENTATIONS)}; this model uses {implementation!r}: "
            "load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


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
    for name in ("generate", _GENERATED_LENGTH):
        if name in vars(model):
            delattr(model, name)
    checkpoint.restore(state.config, state.saved_config)
    model._ropescale_patch = None
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_ropescale_patch", None) is not None


# ---------------------------------------------------------------------------------------------
# The patched forwards


# A length-dependent table is picked by the current length, read off the data: a graph break under
# torch.compile (which works), an error under fullgraph=True, with this message.
_DATA_DEPENDENT = (
    "ropescale: a length-dependent table (Dynamic-YaRN, Dynamic-NTK, LongRoPE under the pre-RoPE cache) is "
    "chosen from each row's current length, a value read off the data, so the patched model cannot be "
    "captured as one graph: compile with torch.compile(model) (fullgraph=False: the graph breaks there, "
    "the rest is compiled), or patch a static method (e.g. scaling.YaRN with a fixed factor) for fullgraph=True")


@torch.compiler.disable(reason=_DATA_DEPENDENT)
def _row_groups(positions: torch.Tensor, lengths: torch.Tensor | None = None) -> list[tuple[torch.Tensor | None, int]]:
    """``[(rows, seq_len)]``: the batch rows grouped by their own length (largest position + 1, or ``lengths``
    where given: a per-request method's planned lengths), with ``rows=None`` for "every row" (all rows share one
    length, the common case: no gather needed)."""
    if lengths is None:
        lengths = positions.amax(dim=-1) + 1
    distinct = torch.unique(lengths).tolist()
    if len(distinct) == 1:
        return [(None, int(distinct[0]))]
    return [(torch.nonzero(lengths == n)[:, 0], int(n)) for n in distinct]


def _groups(state: _PatchState, positions: torch.Tensor, planned: torch.Tensor | None = None):
    if not state.length_dependent:
        return [(None, None)]
    return _row_groups(positions, planned)


_PLANNED = "_ropescale_planned"  # a cache's per-request planned lengths, fixed at its first forward


@torch.compiler.disable(reason=_DATA_DEPENDENT)
def _planned_lengths(state: _PatchState, positions: torch.Tensor, cache) -> torch.Tensor:
    """Each row's planned length under a per-request method (see the module's docstring): fixed at the
    request's first forward (inside ``generate`` / :class:`request`: that call's; else the cache's, or the
    forward itself without a cache) as the row's length then (its largest position + 1: this forward's
    positions are the latest) plus the tokens it may generate."""
    current = positions.amax(dim=-1) + 1
    if state.in_request:
        if state.new_tokens is None:
            raise RuntimeError("ropescale: per='request' could not read this generate call's length from "
                               f"transformers ({_GENERATED_LENGTH} was not called before the first forward): wrap "
                               "the call in `with ropescale.hf.request(model, max_new_tokens=N):` instead")
        planned = state.planned
        if planned is None or planned.shape[0] != current.shape[0]:
            planned = state.planned = current + state.new_tokens
    elif cache is not None:
        planned = getattr(cache, _PLANNED, None)
        if planned is None or planned.shape[0] != current.shape[0]:
            planned = current
            setattr(cache, _PLANNED, planned)
    else:
        planned = current
    if bool((current > planned).any()):
        row = int(torch.nonzero(current > planned)[0, 0])
        raise ValueError(
            f"ropescale: {type(state.method).__name__}(per='request') fixes each request's scale at its first "
            f"forward, for its prompt plus the tokens it may generate; row {row} is now at length {int(current[row])}, "
            f"past its planned {int(planned[row])}. Generate with max_new_tokens (generate does the rest), or wrap a "
            "manual decoding loop in `with ropescale.hf.request(model, max_new_tokens=N):`")
    return planned


@torch.no_grad()
def _rotary_forward(self, x, position_ids, layer_type=None):
    """cos/sin in transformers' Llama layout: for a static method, of ropescale's table (each row with the table
    of its own length when the table depends on it); for a pre-RoPE forward, the identity (the attention
    function rotates). A layer type the patch does not extend gets the model's own."""
    state: _PatchState = self._ropescale_patch
    if state.layer_types is not None and layer_type not in state.layer_types:
        return type(self).forward(self, x, position_ids, layer_type)
    if state.step_pre_rope:
        _start_pre_rope_step(state, position_ids, x.shape[0])
        ones = torch.ones(*position_ids.shape, state.rotary_dim, dtype=x.dtype, device=x.device)
        return ones, torch.zeros_like(ones)
    groups = _groups(state, position_ids)
    if groups[0][0] is not None:  # rows of different lengths: per-row angles and factors
        angles = position_ids.new_empty(*position_ids.shape, state.rotary_dim // 2, dtype=torch.float64)
        factors = angles.new_empty(position_ids.shape[0], 1, 1)
    for rows, seq_len in groups:
        inv_freq, factor = state.table(seq_len, x.device)
        # Angles in double: a float32 product is already ~1e-2 rad off at position 1e6.
        group = (position_ids if rows is None else position_ids[rows]).to(torch.float64)[..., None]
        group_angles = group * inv_freq.to(torch.float64)
        if rows is None:
            angles, factors = group_angles, factor
        else:
            angles[rows], factors[rows] = group_angles, factor
    emb = torch.cat((angles, angles), dim=-1)
    cos = (emb.cos() * factors).to(x.dtype)
    sin = (emb.sin() * factors).to(x.dtype)
    return cos, sin


def _set_rotary_buffers(state: _PatchState, module: nn.Module) -> None:
    """A rotary module of another layout keeps its forward and runs it on ropescale's (static) table: its
    ``inv_freq`` and ``attention_scaling`` (per extended layer type), its ``rope_type`` made ``default`` so
    that transformers' dynamic update leaves them alone. ``unpatch`` puts all back."""
    inv_freq, factor = state.table(None, torch.device("cpu"))
    prefixes = [f"{t}_" for t in state.layer_types] if state.layer_types else [""]
    for prefix in prefixes:
        for name in (f"{prefix}inv_freq", f"{prefix}original_inv_freq"):
            old = getattr(module, name, None)
            if old is None:
                continue
            if old.shape != inv_freq.shape:
                raise ValueError(f"patch: {state.architecture.name}'s rotary table {name} has {old.shape[-1]} "
                                 f"frequencies, ropescale's method {inv_freq.shape[-1]}")
            state.saved_buffers.append((module, name, old))
            setattr(module, name, inv_freq.to(device=old.device, dtype=old.dtype))
        name = f"{prefix}attention_scaling"
        state.saved_buffers.append((module, name, getattr(module, name)))
        setattr(module, name, factor)
    rope_type = module.rope_type
    state.saved_buffers.append((module, "rope_type", rope_type))
    module.rope_type = ({t: ("default" if t in state.layer_types else v) for t, v in rope_type.items()}
                        if isinstance(rope_type, dict) else "default")


def _own_layout_rotary_forward(self, x, position_ids, *args, **kwargs):
    """A rotary module of another layout that takes pre-RoPE methods (multimodal sections): its own forward on
    ropescale's static table (``_set_rotary_buffers``), or for a pre-RoPE forward the identity in its own output
    layout (the attention function rotates, each pair at its stream's position)."""
    state: _PatchState = self._ropescale_patch
    cos, sin = type(self).forward(self, x, position_ids, *args, **kwargs)
    if not state.step_pre_rope:
        return cos, sin
    _start_pre_rope_step(state, position_ids, x.shape[0])
    return torch.ones_like(cos), torch.zeros_like(sin)


# ---------------------------------------------------------------------------------------------
# A pre-RoPE forward: the base model's hooks, the cache, the attention function


def _base_model_pre_hook(module, args, kwargs):
    """Before the base model runs: whether this forward is pre-RoPE (the method, or a ``PreRopeCache`` given),
    the cache it will use (made here as the model would, so that its layers can hold raw keys), and the
    attention implementation still wrapped (the user may have changed it since ``patch``)."""
    state: _PatchState = module._ropescale_patch
    _wrap_implementations(state)
    bound = _bound_arguments(module, args, kwargs)
    cache = bound.get("past_key_values")
    if isinstance(cache, PreRopeCache) and state.architecture.pre_rope:
        raise ValueError(f"ropescale: a PreRopeCache (raw keys, rotated at attention time) cannot serve "
                         f"{state.architecture.name}: {state.architecture.pre_rope}")
    state.step_pre_rope = state.pre_rope or isinstance(cache, PreRopeCache)
    state.step_cache, state.step_positions, state.step_planned = None, None, None
    if not state.step_pre_rope:
        return None
    if cache is None and _uses_cache(module, bound.get("use_cache")):
        cache = DynamicCache(config=state.config)
        kwargs["past_key_values"] = cache
        if "past_key_values" in bound.get("_positional", ()):
            raise RuntimeError("ropescale: pass past_key_values by keyword to a pre-RoPE patched model")
    if cache is not None:
        _pre_rope_layers(state, cache)
    state.step_cache = cache
    return args, kwargs


def _base_model_hook(module, args, output):
    state: _PatchState = module._ropescale_patch
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


def _pre_rope_layers(state: _PatchState, cache) -> None:
    """The layers of ``cache`` of extended attention layers as pre-RoPE layers. transformers' ``DynamicCache``
    (made by ``generate``, by ``use_cache=True`` and by this hook) is converted while its layers are empty; a
    layer already holding rotated keys cannot be."""
    layers = cache.layers
    for idx in state.extended_layers:
        while len(layers) <= idx and getattr(cache, "layer_class_to_replicate", None) in (DynamicLayer, PreRopeLayer):
            layers.append(cache.layer_class_to_replicate())
        if idx < len(layers) and type(layers[idx]) is DynamicLayer and not layers[idx].is_initialized:
            layers[idx] = PreRopeLayer()
        if idx >= len(layers) or not isinstance(layers[idx], PreRopeLayer):
            raise TypeError(
                "ropescale: this patch caches keys before rotation, but the cache given holds rotated keys "
                f"({type(cache).__name__}); pass past_key_values=ropescale.hf.PreRopeCache()")


def _start_pre_rope_step(state: _PatchState, position_ids: torch.Tensor, batch: int) -> None:
    """The rotary module's part of a pre-RoPE forward (it sees the positions first, before any layer caches a
    key): the positions each pre-RoPE cache layer stores, and a per-request method's planned lengths."""
    if state.step_positions is not None:  # a per-layer-type rotary module runs once per type
        return
    if state.pair_streams is not None:  # [streams, B, T] (or [B, T]: every stream at the text position)
        streams = position_ids if position_ids.dim() == 3 else position_ids[None].expand(3, -1, -1)
        position_ids = streams.permute(1, 2, 0)
    positions = _batch_positions(position_ids, batch)
    state.step_positions = positions
    cache = state.step_cache
    if cache is not None:
        for layer in cache.layers:
            if isinstance(layer, PreRopeLayer):
                layer.pending_positions = positions
    if cache is not None and state.temperature_length and cache.get_seq_length(state.extended_layers[0]) == 0:
        vars(cache).pop(_PROMPT, None)  # a new request in this cache: DCA's prompt lengths are this forward's
    if state.per_request:  # before the cache takes this step's keys: a refused step leaves it as it was
        if cache is not None and cache.get_seq_length(state.extended_layers[0]) == 0:
            vars(cache).pop(_PLANNED, None)  # a new request in this cache
        state.step_planned = _planned_lengths(state, _token_positions(positions), cache)


def _batch_positions(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """int64 positions ``[batch, T]`` (``[batch, T, streams]`` under a multimodal rope) from ``[T]``, ``[1, T]``
    or ``[batch, T]`` (and their stream forms)."""
    positions = positions.to(torch.int64)
    if positions.dim() == 1:
        positions = positions[None]
    return positions.expand(batch, *positions.shape[1:])


def _token_positions(positions: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each token's position for lengths (a multimodal rope's largest stream, as transformers' dynamic
    update takes the largest position id)."""
    return positions.amax(dim=-1) if positions.dim() == 3 else positions


def _wrap_implementations(state: _PatchState) -> None:
    """Every attention config's implementation X as ``ropescale_X`` (registered on first use, with X's mask)."""
    configs = {id(m.config): m.config for m in state.attention_modules}
    for config in configs.values():
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        if implementation.startswith(_WRAPPED):
            continue
        if state.raw_keys:  # at patch and at every forward: the implementation can change after patch
            _check_rerope_implementation(config, state.attention)
        name = _WRAPPED + implementation
        if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
            AttentionInterface.register(name, _attention_function(implementation))
            if implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
                AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
        # unpatch restores the implementation the user chose last (set_attn_implementation after patch included)
        state.saved_implementations = [(c, i) for c, i in state.saved_implementations if c is not config]
        state.saved_implementations.append((config, config._attn_implementation_internal))
        config._attn_implementation_internal = name


def _attention_function(implementation: str):
    """``ropescale_<implementation>``: the model's own ``implementation``, after ropescale's rotation (or
    ReRoPE) in a pre-RoPE forward of an extended layer."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if implementation == "eager":
            function = sys.modules[type(module).__module__].eager_attention_forward
        else:
            function = ALL_ATTENTION_FUNCTIONS[implementation]
        state: _PatchState | None = getattr(module, "_ropescale_patch", None)
        if state is None or not state.step_pre_rope or not state.extends(module):
            return function(module, query, key, value, attention_mask, **kwargs)
        return _pre_rope_attention(state, function, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"ropescale_{implementation}"
    return attention


def _pre_rope_attention(state: _PatchState, function, module, query, key, value, attention_mask, **kwargs):
    # The model's identity rotation multiplied q and k by cos/sin of the hidden states' dtype: under autocast a
    # bf16 projection came back float32, exactly (x * 1 - y * 0). They go on in the projection's dtype, as v.
    query, key = query.to(value.dtype), key.to(value.dtype)
    # A multimodal rope's layers get the text positions: the streams are the rotary module's (step_positions).
    positions = kwargs.get("position_ids") if state.pair_streams is None else None
    if positions is None:
        positions = state.step_positions
    if positions is None:
        raise RuntimeError("ropescale: pre-RoPE attention needs the positions of the step (call the model, not its "
                           "layers)")
    # A KV-shared layer may run the last queries only (Gemma 4 slices them to generate's logits_to_keep) while its
    # keys, those of its source layer, are the whole step's.
    key_positions = _batch_positions(positions, query.shape[0])
    positions = key_positions[:, -query.shape[-2]:]
    cache = state.step_cache
    layer_idx = state.kv_sources.get(module.layer_idx, module.layer_idx)
    if cache is not None and layer_idx < len(cache.layers):
        key_positions = cache.layers[layer_idx].positions
    if key_positions.shape[1] != key.shape[-2]:
        raise RuntimeError(f"ropescale: layer {module.layer_idx} attends {key.shape[-2]} keys but knows the positions "
                           f"of {key_positions.shape[1]}: its cache was not made by this patched model's forward")
    planned = state.step_planned if state.per_request else None
    if state.per_request and planned is None:
        planned = _planned_lengths(state, _token_positions(positions), None)
    groups = _groups(state, _token_positions(key_positions), planned)
    if state.raw_keys:
        return _rerope(module, state, groups, query, key, value, positions, key_positions, attention_mask,
                       kwargs), None
    query, key = _rotate_groups(state, groups, query, key, positions, key_positions)
    return function(module, query, key, value, attention_mask, **kwargs)


def _sliding_window(module):
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def _rotate_groups(state, groups, query, key, positions, key_positions):
    """q and k rotated, each group of rows with the table (and attention factor) of its own length, in the
    family's pair layout."""
    if groups[0][0] is None:
        inv_freq, factor = state.table(groups[0][1], query.device)
        return _rotate(state, query, positions, inv_freq, factor), _rotate(state, key, key_positions, inv_freq, factor)
    rotated_q, rotated_k = torch.empty_like(query), torch.empty_like(key)
    for rows, seq_len in groups:
        inv_freq, factor = state.table(seq_len, query.device)
        rotated_q[rows] = _rotate(state, query[rows], positions[rows], inv_freq, factor)
        rotated_k[rows] = _rotate(state, key[rows], key_positions[rows], inv_freq, factor)
    return rotated_q, rotated_k


def _rotate(state, x, positions, inv_freq, factor):
    """``x`` ``[B, H, T, D]`` rotated at ``positions`` in the family's pair layout. Under a multimodal rope each
    pair turns at its own stream's position: rotations of disjoint pairs commute, so one rotation per stream with
    the other pairs' frequencies zero (an identity on them), the attention factor in the last one only (it scales
    a zero-frequency pair too), so that every pair takes it once."""
    interleaved = state.architecture.interleaved
    if state.pair_streams is None:
        return ops.apply_rotary_pos(x, positions, inv_freq, factor, interleaved)
    masks = state.stream_masks.get(inv_freq.device)
    if masks is None:  # once per device, not per layer and step
        streams = torch.tensor(state.pair_streams)
        masks = torch.stack([streams == s for s in range(3)]).to(inv_freq.device)  # time, height, width
        state.stream_masks[inv_freq.device] = masks
    last = positions.shape[-1] - 1
    for stream in range(last + 1):
        x = ops.apply_rotary_pos(x, positions[..., stream], inv_freq * masks[stream],
                                 factor if stream == last else 1.0, interleaved)
    return x


def _padding_keys(attention_mask, batch: int, query_length: int, key_length: int):
    """[B, K] True where a key is padding, or None when no key is, read off the mask the model built
    for its attention implementation (the last query row of a causal mask sees every non-padding key):
    eager/sdpa: a 4-D bool or additive float mask; flex_attention: a BlockMask (its mask_mod evaluated
    on the last query row); flash_attention_*: the 2-D padding mask (1 = token), or None."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, BlockMask):
        q_len, kv_len = attention_mask.seq_lengths
        device = attention_mask.kv_num_blocks.device
        visible = attention_mask.mask_mod(
            torch.arange(batch, device=device)[:, None], torch.zeros(1, 1, dtype=torch.long, device=device),
            torch.full((1, 1), q_len - 1, dtype=torch.long, device=device),
            torch.arange(kv_len, device=device)[None, :])
        return ~visible.expand(batch, kv_len)[:, -key_length:]
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 4:
        last_row = attention_mask[:, 0, -1, -key_length:]
        return ~last_row if last_row.dtype == torch.bool else last_row < torch.finfo(last_row.dtype).min / 2
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        return attention_mask[:, -key_length:] == 0
    raise TypeError(f"ropescale: ReRoPE cannot read padding from an attention mask of type "
                    f"{type(attention_mask).__name__}; use attn_implementation='sdpa'")


_PROMPT = "_ropescale_prompt"  # a cache's prompt lengths per row (DCA's temperature), fixed at its first forward


def _dual_chunk_temperature(state, cache, positions, key_positions):
    """Dual Chunk Attention's temperature (L0 = ``state.temperature_length`` > 0), as vLLM applies it: the query of
    a token at position ``i`` times ``m(max(P, i + 1))`` and the key at ``j`` times ``m(max(P, j + 1))``, ``m`` the
    plan's rule (``serving.dual_chunk_temperature``: Qwen's ``max(1, 0.1 ln(len / L0) + 1)`` or ChunkLlama's 0.05),
    ``P`` the row's prompt length: the length of its first forward into an empty cache (every key of that forward,
    padding masked; without a cache, the forward's own). ``(q_factors [B, Lq], k_factors [B, Lk])`` float64, or
    None when every factor is 1 (every length within L0)."""
    prompt = getattr(cache, _PROMPT, None) if cache is not None else None
    if prompt is None or prompt.shape[0] != key_positions.shape[0]:
        prompt = key_positions.amax(dim=-1) + 1  # padding keys are at a negative position
        if cache is not None:
            setattr(cache, _PROMPT, prompt)
    def m(positions):
        return state.tables.plan.temperature_at(torch.maximum(prompt[:, None], positions + 1))

    q_factors, k_factors = m(positions), m(key_positions)
    if not bool((q_factors != 1).any() | (k_factors != 1).any()):
        return None
    return q_factors, k_factors


def _times_rows(x, factors):
    """``x`` ``[B, H, T, D]`` times ``factors`` ``[B, T]``, formed in float32 (float64 for float64) and rounded once
    to x's dtype (vLLM multiplies its keys in place, in their dtype)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(compute) * factors.to(device=x.device, dtype=compute)[:, None, :, None]).to(x.dtype)


def _rerope(module, state, groups, query, key, value, positions, key_positions, attention_mask, kwargs):
    what = config_lib.ATTENTION_NAMES[state.attention]
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        raise ValueError(f"ropescale: {what} cannot run layer {module.layer_idx}: its attention has sinks or "
                         "soft-capped logits")
    softmax_scale = kwargs.get("scaling")
    softmax_scale = module.scaling if softmax_scale is None else softmax_scale
    pad = _padding_keys(attention_mask, query.shape[0], query.shape[-2], key.shape[-2])
    if pad is not None and bool(pad.any()):
        key_positions = torch.where(pad, torch.full_like(key_positions, _PADDING_POSITION), key_positions)
    # The fused op has no backward: when gradients are wanted (fine-tuning), the training path computes
    # the same attention differentiably from PyTorch's fused attention kernels (no L x L tensor).
    wants_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if wants_grad and state.attention == "dual_chunk":
        raise ValueError("ropescale: Dual Chunk Attention has no training path (ops.rerope_attention_train takes "
                         "ReRoPE and Self-Extend): run the model under torch.no_grad() (generate does), or fine-tune "
                         "with attention='self_extend' or 'rerope'")
    # The fused op takes float32/fp16/bf16; a float64 model (numerics checks) runs the float64 composite, which
    # computes the same attention in plain PyTorch (differentiable; Lq x Lk masks, fine at a check's sizes).
    if query.dtype == torch.float64:
        attention = ops.rerope_attention_composite
    else:
        attention = ops.rerope_attention_train if wants_grad else ops.rerope_attention
    plan = state.tables.plan
    method_arguments = plan.method_arguments()  # Self-Extend's group, DCA's chunk size
    if plan.temperature_length:
        factors = _dual_chunk_temperature(state, state.step_cache, positions, key_positions)
        if factors is not None:
            query, key = _times_rows(query, factors[0]), _times_rows(key, factors[1])

    def attend(q, k, v, q_pos, k_pos, seq_len):
        inv_freq, factor = state.table(seq_len, q.device)
        # The attention factor multiplies cos and sin of both q and k: factor^2 on the rotated dims' part of every
        # score (the whole score on a fully rotated head; folded into q on a partial-rotary one).
        q, scale, _ = plan.attention_arguments(q, q.shape[-1], softmax_scale, factor * factor)
        out, _lse = attention(
            q, k, v, q_pos, k_pos, inv_freq, state.window,
            leaky_k=state.leaky_k, scale=scale, logn_length=state.logn_length,
            interleaved=state.architecture.interleaved, **method_arguments,
        )
        return out

    if groups[0][0] is None:
        out = attend(query, key, value, positions, key_positions, groups[0][1])
    else:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        for rows, seq_len in groups:
            out[rows] = attend(query[rows], key[rows], value[rows], positions[rows], key_positions[rows], seq_len)
    return out.transpose(1, 2)
