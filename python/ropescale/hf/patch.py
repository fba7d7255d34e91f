"""``patch(model, scaling)``: one line turns a Llama-family model into YaRN, Resonance, Dynamic or ReRoPE.

What changes (per model instance, undone by ``unpatch``):
- the rotary module's forward: cos/sin from ropescale's table for the method, with angles computed
  in double precision (accurate at long positions), times the method's attention factor;
- every attention module's forward:
  * static methods with ``attention="sdpa"``: q and k rotated by the fused ``apply_rotary_qk`` kernel,
    then the model's own attention function (SDPA, eager, ...) and cache, as before;
  * dynamic methods (Dynamic NTK, Dynamic YaRN), a ``PreRopeCache``, or ``attention="rerope"``: keys are
    cached BEFORE rotation with their positions, and rotated at attention time with the table for the
    current length (largest position + 1), which keeps every key's ROTATION exact at every decoding
    step when the table changes (the whole model is exact for one layer only: deeper layers' cached
    keys and values were computed under an earlier scale); ReRoPE runs ``rerope_attention`` on the
    un-rotated q/k. In a batch each row gets the table of ITS OWN length (its largest position + 1):
    rows are grouped by length and each group is rotated with its table, so a short prompt batched
    with a long one (left padding) gets the same scale as alone.
  * a dynamic method with ``per="request"``: each row takes, in every layer and step, the table of its
    request's planned length, fixed at its first forward: the prompt (the row's largest position + 1) plus
    the tokens it may generate (``generate``'s ``max_new_tokens``, or its ``max_length`` less the input; a
    manual loop states it with :class:`request`; a forward outside both is a whole request). So a request
    runs the static model of its scale from first token to last (the whole model exact), a request that
    fits the trained length runs the native model, and a batched row equals its solo run.
  * ReRoPE reads padding from the attention mask of every mask format transformers builds for
    ``eager``, ``sdpa``, ``flex_attention`` (a BlockMask) and ``flash_attention_*`` (the 2-D mask);
    other implementations (paged, custom ones) are refused with a clear error.
  * length-dependent tables (dynamic methods) pick the table from the current length, a value read
    off the data: ``torch.compile(model)`` breaks the graph there and works; ``fullgraph=True`` fails
    with ropescale's message saying so (use a static method such as ``scaling.YaRN`` for a full graph).

What is recorded (in ``model.config``, so ``save_pretrained`` writes it; see ``ropescale.hf.checkpoint``):
the method as ``rope_parameters``, ``max_position_embeddings`` for it, and for ReRoPE the attention
side. ``unpatch`` restores the config exactly; ``patch(model)`` on a reloaded model re-applies it.

Patching a model twice raises an error; ``unpatch`` first to change the method.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from torch.nn.attention.flex_attention import BlockMask
from transformers.cache_utils import DynamicLayer

from .. import config as config_lib, ops, scaling as scaling_lib, serving
from . import checkpoint
from .cache import PreRopeCache, PreRopeLayer
from .rope_types import rotary_dim_of

# Attention classes whose forward ropescale re-implements (they share one code path: projections,
# optional per-head q/k RMSNorm (Qwen3), rotation, cache, attention function, o_proj).
SUPPORTED_ATTENTION = {
    "LlamaAttention": "Llama",
    "MistralAttention": "Mistral",
    "Qwen2Attention": "Qwen2",
    "Qwen3Attention": "Qwen3",
}

# rerope_attention never attends a key at a negative position: how padding keys are masked out.
_PADDING_POSITION = -1

# The attention implementations whose mask ReRoPE reads padding from (see ``_padding_keys``): the
# 4-D masks of eager and sdpa, flex's BlockMask, and the 2-D padding mask flash attention gets.
REROPE_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                          "flash_attention_4")


@dataclasses.dataclass
class _PatchState:
    method: scaling_lib.RopeScaling
    attention: str
    window: int | None
    leaky_k: float
    logn_length: int
    rotary_dim: int
    base: float
    rotary_modules: list[nn.Module]
    attention_modules: list[nn.Module]
    config: Any = None
    saved_config: dict = dataclasses.field(default_factory=dict)  # what unpatch puts back
    tables: serving.TableCache | None = None
    # per="request": whether a ``generate`` / ``request`` is open, the tokens each of its rows may generate (a
    # generate call's arrives when transformers has resolved its length), the planned lengths its first forward fixed
    in_request: bool = False
    new_tokens: int | None = None
    planned: torch.Tensor | None = None

    def __post_init__(self):
        window = self.window if self.attention == "rerope" else serving.NO_WINDOW
        self.tables = serving.TableCache(serving.PreRopePlan(self.method, self.base, self.rotary_dim, window,
                                                             self.leaky_k, self.logn_length))

    @property
    def pre_rope(self) -> bool:
        """Keys cached raw and rotated at attention time: ReRoPE, and the dynamic methods (whose scale follows the
        length). A LongRoPE keeps transformers' rotated-key cache."""
        return self.attention == "rerope" or self.method.dynamic

    @property
    def length_dependent(self) -> bool:
        return self.method.length_dependent

    @property
    def per_request(self) -> bool:
        return self.tables.plan.per_request

    def request(self, max_new_tokens: int) -> "_Request":
        """The context of one request per row that may generate ``max_new_tokens`` (:func:`request`)."""
        return _Request(self, max_new_tokens)

    def table(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """inv_freq on ``device`` and the attention factor for this length (the serving core's table cache)."""
        return self.tables.table(seq_len, device)


def _as_method(scaling, config) -> scaling_lib.RopeScaling:
    if scaling is None:
        return config_lib.read_config(config).method
    if isinstance(scaling, scaling_lib.RopeScaling):
        return scaling
    if isinstance(scaling, Mapping):
        return scaling_lib.from_hf(scaling, config.max_position_embeddings)
    raise TypeError(f"patch: scaling must be a ropescale.scaling method, a rope_parameters dict or None, got {type(scaling).__name__}")


def _find_modules(model: nn.Module):
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj")]
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    unsupported = sorted({type(m).__name__ for m in attention} - set(SUPPORTED_ATTENTION))
    if unsupported or not attention or not rotary:
        found = ", ".join(unsupported) or type(model).__name__
        raise TypeError(
            f"patch: unsupported model ({found}); ropescale patches {', '.join(SUPPORTED_ATTENTION.values())} models"
        )
    return rotary, attention


def patch(
    model: nn.Module,
    scaling: scaling_lib.RopeScaling | Mapping[str, Any] | None = None,
    *,
    attention: str | None = None,
    window: int | None = None,
    leaky_k: float | None = None,
    logn_length: int | None = None,
) -> nn.Module:
    """Swap ropescale's frequencies and kernels into a transformers Llama/Mistral/Qwen2/Qwen3 model,
    and record the method in ``model.config`` (``save_pretrained`` then writes it).

    ``scaling``: a ``ropescale.scaling`` method, a transformers-style ``rope_parameters`` dict, or None
    to keep the model's own rope settings. ``attention="rerope"`` needs ``window`` (and optionally
    ``leaky_k`` for Leaky ReRoPE and ``logn_length`` for log-n query scaling). ``attention=None`` (the
    default) takes the attention side the config records (a reloaded ReRoPE checkpoint), else "sdpa";
    so ``patch(model)`` on a reloaded checkpoint re-applies what was saved. Returns the model.
    """
    if getattr(model, "_ropescale_patch", None) is not None:
        raise RuntimeError("patch: this model is already patched by ropescale; call ropescale.hf.unpatch(model) first")
    rotary_modules, attention_modules = _find_modules(model)
    config = attention_modules[0].config
    if attention is None:
        saved = checkpoint.saved_attention(config) or {"attention": "sdpa"}
        attention = saved["attention"]
        if attention == "rerope":
            window = saved.get("window") if window is None else window
            leaky_k = saved.get("leaky_k", 0.0) if leaky_k is None else leaky_k
            logn_length = saved.get("logn_length", 0) if logn_length is None else logn_length
    _check_attention_arguments(attention, window, leaky_k, logn_length)
    if attention == "rerope":
        _check_rerope_implementation(config)

    params = config.rope_parameters
    state = _PatchState(
        method=_as_method(scaling, config),
        attention=attention,
        window=window,
        leaky_k=float(leaky_k or 0.0),
        logn_length=int(logn_length or 0),
        rotary_dim=rotary_dim_of(config, params),
        base=config_lib.base_of(config),
        rotary_modules=rotary_modules,
        attention_modules=attention_modules,
        config=config,
    )
    if state.pre_rope and any(_sliding_window(m) for m in attention_modules):
        raise ValueError("patch: pre-RoPE attention (dynamic methods, ReRoPE) does not support sliding-window layers")
    state.saved_config = checkpoint.snapshot(config)
    checkpoint.record(config, None if scaling is None else state.method, attention, window, state.leaky_k,
                      state.logn_length)
    for module in rotary_modules:
        module.forward = types.MethodType(_rotary_forward, module)
        module._ropescale_patch = state
    for module in attention_modules:
        module.forward = types.MethodType(_attention_forward, module)
        module._ropescale_patch = state
    if state.per_request and hasattr(model, "generate"):
        if not hasattr(model, _GENERATED_LENGTH):
            raise TypeError(f"patch: per='request' reads generate's length from {_GENERATED_LENGTH}, which this "
                            f"transformers' {type(model).__name__} lacks")
        model.generate = types.MethodType(_generate, model)
        setattr(model, _GENERATED_LENGTH, types.MethodType(_prepare_generated_length, model))
    model._ropescale_patch = state
    return model


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


def _check_attention_arguments(attention, window, leaky_k, logn_length) -> None:
    """The attention side of a patch, checked before the model is touched (``config.check_attention``: the
    same check, and message, as a checkpoint's entry gets at load and at vLLM engine start)."""
    try:
        config_lib.check_attention(attention, window, leaky_k, logn_length)
    except ValueError as err:
        raise ValueError(f"patch: {err}") from None


def _check_rerope_implementation(config) -> None:
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in REROPE_IMPLEMENTATIONS:
        raise ValueError(
            f"patch: ReRoPE attention reads padding from the attention mask, and ropescale knows the masks of "
            f"attn_implementation {', '.join(REROPE_IMPLEMENTATIONS)}; this model uses {implementation!r}: "
            "load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the model's own rotary and attention forwards and its config exactly (a
    ``save_pretrained`` after it writes the config the model had before ``patch``)."""
    state = getattr(model, "_ropescale_patch", None)
    if state is None:
        raise RuntimeError("unpatch: this model is not patched by ropescale")
    for module in state.rotary_modules + state.attention_modules:
        del module.forward  # the class's forward shows through again
        del module._ropescale_patch
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
def _planned_lengths(state: _PatchState, positions: torch.Tensor, cache, first_layer: bool) -> torch.Tensor:
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
    if first_layer and bool((current > planned).any()):
        row = int(torch.nonzero(current > planned)[0, 0])
        raise ValueError(
            f"ropescale: {type(state.method).__name__}(per='request') fixes each request's scale at its first "
            f"forward, for its prompt plus the tokens it may generate; row {row} is now at length {int(current[row])}, "
            f"past its planned {int(planned[row])}. Generate with max_new_tokens (generate does the rest), or wrap a "
            "manual decoding loop in `with ropescale.hf.request(model, max_new_tokens=N):`")
    return planned


@torch.no_grad()
def _rotary_forward(self, x, position_ids, layer_type=None):
    """cos/sin in transformers' full-width layout for the patched method's table (each row with the
    table of its own length when the table depends on it)."""
    state: _PatchState = self._ropescale_patch
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


def _sliding_window(module):
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def _project(module, hidden_states):
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_proj(hidden_states).view(shape)
    key = module.k_proj(hidden_states).view(shape)
    if hasattr(module, "q_norm"):  # Qwen3: per-head RMSNorm before rotation
        query, key = module.q_norm(query), module.k_norm(key)
    value = module.v_proj(hidden_states).view(shape)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    state: _PatchState = self._ropescale_patch
    input_shape = hidden_states.shape[:-1]
    query, key, value = _project(self, hidden_states)
    pre_rope = state.pre_rope or isinstance(past_key_values, PreRopeCache)

    if not pre_rope:
        cos, sin = position_embeddings
        query, key = ops.apply_rotary_qk(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = _model_attention(self, query, key, value, attention_mask, **kwargs)
    else:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise RuntimeError("ropescale: pre-RoPE attention needs position_ids from the model")
        positions = positions.to(torch.int64).expand(query.shape[0], -1)
        key_positions = positions
        planned = None
        if state.per_request:  # before the cache takes this step's keys: a refused step leaves it as it was
            if past_key_values is not None and self.layer_idx == 0 and past_key_values.get_seq_length() == 0:
                vars(past_key_values).pop(_PLANNED, None)  # a new request in this cache
            planned = _planned_lengths(state, positions, past_key_values, self.layer_idx == 0)
        if past_key_values is not None:
            layer = _pre_rope_layer(past_key_values, self.layer_idx)
            key, value = past_key_values.update(key, value, self.layer_idx, {"positions": positions})
            key_positions = layer.positions
        groups = _groups(state, key_positions, planned)
        if state.attention == "rerope":
            out = _rerope(self, state, groups, query, key, value, positions, key_positions, attention_mask)
            weights = None
        else:
            query, key = _rotate_groups(state, groups, query, key, positions, key_positions)
            out, weights = _model_attention(self, query, key, value, attention_mask, **kwargs)

    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _rotate_groups(state, groups, query, key, positions, key_positions):
    """q and k rotated, each group of rows with the table (and attention factor) of its own length."""
    if groups[0][0] is None:
        inv_freq, factor = state.table(groups[0][1], query.device)
        return (ops.apply_rotary_pos(query, positions, inv_freq, factor),
                ops.apply_rotary_pos(key, key_positions, inv_freq, factor))
    rotated_q, rotated_k = torch.empty_like(query), torch.empty_like(key)
    for rows, seq_len in groups:
        inv_freq, factor = state.table(seq_len, query.device)
        rotated_q[rows] = ops.apply_rotary_pos(query[rows], positions[rows], inv_freq, factor)
        rotated_k[rows] = ops.apply_rotary_pos(key[rows], key_positions[rows], inv_freq, factor)
    return rotated_q, rotated_k


def _pre_rope_layer(cache, layer_idx) -> PreRopeLayer:
    """The cache layer for ``layer_idx`` as a pre-RoPE layer. transformers creates a DynamicCache when
    none is passed (``use_cache=True``, ``generate()``): its still-empty dynamic layers are swapped for
    pre-RoPE ones, so a patched model needs no special cache argument. A layer already holding rotated
    keys cannot be converted."""
    layers = cache.layers
    if layer_idx >= len(layers) and getattr(cache, "layer_class_to_replicate", None) in (DynamicLayer, PreRopeLayer):
        while len(layers) <= layer_idx:
            layers.append(PreRopeLayer())
    elif type(layers[layer_idx]) is DynamicLayer and not layers[layer_idx].is_initialized:
        layers[layer_idx] = PreRopeLayer()
    if layer_idx >= len(layers) or not isinstance(layers[layer_idx], PreRopeLayer):
        raise TypeError(
            "ropescale: this patch caches keys before rotation, but the cache given holds rotated keys "
            f"({type(cache).__name__}); pass past_key_values=ropescale.hf.PreRopeCache()"
        )
    return layers[layer_idx]


def _model_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention function (sdpa, eager, flash, ...), called as its forward does."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    return interface(
        module, query, key, value, attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        sliding_window=_sliding_window(module),
        **kwargs,
    )


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


def _rerope(module, state, groups, query, key, value, positions, key_positions, attention_mask):
    _check_rerope_implementation(module.config)  # the implementation can change after patching
    pad = _padding_keys(attention_mask, query.shape[0], query.shape[-2], key.shape[-2])
    if pad is not None and bool(pad.any()):
        key_positions = torch.where(pad, torch.full_like(key_positions, _PADDING_POSITION), key_positions)
    # The fused op has no backward: when gradients are wanted (fine-tuning), the training path computes
    # the same attention differentiably from PyTorch's fused attention kernels (no L x L tensor).
    wants_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    attention = ops.rerope_attention_train if wants_grad else ops.rerope_attention

    def attend(q, k, v, q_pos, k_pos, seq_len):
        inv_freq, factor = state.table(seq_len, q.device)
        # The attention factor multiplies cos and sin of both q and k: factor^2 on every score.
        out, _lse = attention(
            q, k, v, q_pos, k_pos, inv_freq, state.window,
            leaky_k=state.leaky_k, scale=module.scaling * factor * factor, logn_length=state.logn_length,
        )
        return out

    if groups[0][0] is None:
        out = attend(query, key, value, positions, key_positions, groups[0][1])
    else:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        for rows, seq_len in groups:
            out[rows] = attend(query[rows], key[rows], value[rows], positions[rows], key_positions[rows], seq_len)
    return out.transpose(1, 2)
