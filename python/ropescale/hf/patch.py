"""``patch(model, scaling)``: one line turns a transformers model into YaRN, Resonance, Dynamic or ReRoPE.

The families it knows, and what each one's layers can take, are declared in ``ropescale.hf.architectures``.
It works through transformers' own extension points (no re-implemented attention forward); what changes,
per model instance, undone by ``unpatch``: the rotary module's forward (``ropescale.hf.rotary``), the attention
implementation (``AttentionInterface``: ``config._attn_implementation`` X becomes ``ropescale_X``, which calls X
unchanged unless the forward serves raw keys: ``ropescale.hf.pre_rope``), two hooks on the base model
(``ropescale.hf.hooks``: which path a forward takes, and its cache), and for a per-request method ``generate``
(``ropescale.hf.requests``). What a patch holds is its state (``ropescale.hf.state``, at the bottom: every other
module reads it, it imports none of them); this module is the API on top (``patch``, ``unpatch``, ``is_patched``,
``request``). A per-layer-type config (Gemma 3) extends the layer types named (its full-attention layers by
default); the other layers keep their own rope, untouched. A method is served on one of two paths, by what its keys
need:

- ROTATED AT WRITE (the static methods, and a dynamic method with ``per="request"`` and plain attention:
  ``PatchState.rotated_at_write``): the rotary module returns cos/sin of ropescale's tables times the attention
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

import types
import warnings
from typing import Any, Mapping

from torch import nn

from .. import config as config_lib, scaling as scaling_lib, serving
from . import architectures, checkpoint
from .hooks import base_model_hook, base_model_pre_hook
# REROPE_IMPLEMENTATIONS (the attention implementations ReRoPE reads masks of) stays importable from here
from .pre_rope import REROPE_IMPLEMENTATIONS, check_rerope_implementation, wrap_implementations  # noqa: F401
from .requests import GENERATED_LENGTH, PREFILL, generate, prefill, prepare_generated_length
from .rotary import own_layout_rotary_forward, rotary_forward, set_rotary_buffers
from .state import PatchState, Request, layer_type_of

#: The families ``patch`` knows (``ropescale.hf.architectures``), by name.
SUPPORTED_ARCHITECTURES = tuple(arch.name for arch in architectures.ARCHITECTURES)


def _as_method(scaling, config, layer_type: str | None) -> scaling_lib.RopeScaling:
    if scaling is None:
        return config_lib.read_config(config, layer_type).method
    if isinstance(scaling, scaling_lib.RopeScaling):
        return scaling
    if isinstance(scaling, Mapping):
        return scaling_lib.from_hf(scaling, config.max_position_embeddings)
    raise TypeError(f"patch: scaling must be a ropescale.scaling method, a rope_parameters dict or None, got {type(scaling).__name__}")


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
    # the base model: the owner of a rotary module that holds the attention layers (DeepSeek-V4's compressors own
    # rotary modules of their own, each of which ``patch`` sets too)
    owners = [m for m in model.modules() if any(child is r for child in m.children() for r in rotary)
              and any(a is attention[0] for a in m.modules())] if rotary and attention else []
    if not attention or not rotary or (architecture.cat_layout and len(rotary) != 1) or len(owners) != 1:
        raise TypeError(f"patch: {type(model).__name__} ({architecture.name}) has {len(rotary)} text rotary modules "
                        f"and {len(attention)} attention modules; ropescale expects one rotary module that its base "
                        "model calls, and attention layers")
    return config, architecture, rotary, attention, owners[0]


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
    whose rope parameters are per layer type (Gemma 3; DeepSeek-V4's ``main`` and ``compress``), the types the
    method extends (default: all but the sliding layers', ``sliding_attention`` or V4's ``main``). Returns the model.
    """
    if getattr(model, "_ropescale_patch", None) is not None:
        raise RuntimeError("patch: this model is already patched by ropescale; call ropescale.hf.unpatch(model) first")
    config, architecture, rotary_modules, attention_modules, base_model = _find_modules(model)
    try:
        layer_types = architecture.extended_layer_types(config, layer_types)
    except ValueError as err:
        raise ValueError(f"patch: {err}") from None
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
        check_rerope_implementation(config, attention)

    params = config_lib.layer_type_parameters(config, layer_type)
    method = _as_method(scaling, config, layer_type)
    raw_keys = attention != "sdpa"
    plan = serving.PreRopePlan.for_attention(
        method, config_lib.base_of(config, layer_type),
        method.rotary_dim_for(config_lib.head_dim_of(config, layer_type), params.get("partial_rotary_factor", 1.0)),
        attention, parameters, interleaved=architecture.interleaved)
    state = PatchState(
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
            module.forward = types.MethodType(rotary_forward, module)
        else:
            set_rotary_buffers(state, module)
            # the identity in its own layout for a pre-RoPE forward; each row's table for a per-request method
            if architecture.pre_rope is None or state.rotated_at_write:
                module.forward = types.MethodType(own_layout_rotary_forward, module)
        module._ropescale_patch = state
    for module in attention_modules:
        module._ropescale_patch = state
    wrap_implementations(state)
    base_model._ropescale_patch = state
    state.hooks = [base_model.register_forward_pre_hook(base_model_pre_hook, with_kwargs=True),
                   base_model.register_forward_hook(base_model_hook, always_call=True)]
    if state.per_request and hasattr(model, "generate"):
        if not hasattr(model, GENERATED_LENGTH):
            raise TypeError(f"patch: per='request' reads generate's length from {GENERATED_LENGTH}, which this "
                            f"transformers' {type(model).__name__} lacks")
        model.generate = types.MethodType(generate, model)
        setattr(model, GENERATED_LENGTH, types.MethodType(prepare_generated_length, model))
        if hasattr(model, PREFILL):  # a continued cache of another table is prefilled again (else refused)
            setattr(model, PREFILL, types.MethodType(prefill, model))
    model._ropescale_patch = state
    return model


def _check_written_config(state: PatchState) -> None:
    """The config the patch wrote, validated by the family's own config class (Phi-3's takes ``default`` and
    ``longrope`` only; transformers' ``longrope`` validator reads the global ``head_dim``, which a config with
    per-layer head dims (Gemma 4) refuses to give, a RuntimeError): a method it refuses would save a checkpoint
    that never reloads. Refused, config restored."""
    params = config_lib.layer_type_parameters(state.config, state.layer_types[0]) if state.layer_types else {}
    if params.get("rope_type") == scaling_lib.YaRN.rope_type and params.get("truncate", True) is False:
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


def _check_layers(state: PatchState, scaling) -> None:
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
            config_lib.check_dual_chunk_table(state.method)
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
        sliding = sorted({str(layer_type_of(m)) for m in state.attention_modules
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
    for name in ("generate", GENERATED_LENGTH, PREFILL):
        if name in vars(model):
            delattr(model, name)
    checkpoint.restore(state.config, state.saved_config)
    model._ropescale_patch = None
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_ropescale_patch", None) is not None


def request(model: nn.Module, max_new_tokens: int) -> Request:
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
