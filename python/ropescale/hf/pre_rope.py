"""The raw-key path: keys cached before rotation, and attention over them (``ropescale.hf.patch``'s docstring).

The per-step dynamic methods (whose table follows each step's length), ReRoPE, Self-Extend and Dual Chunk
Attention, and any method given a ``PreRopeCache``: the rotary module returns the identity, the cache's layers of
extended attention layers are :class:`PreRopeLayer` (raw keys with their positions), and the attention
implementation X, wrapped as ``ropescale_X`` (:func:`wrap_implementations`), rotates q and every cached key at
attention time with the table of each row's length (:func:`_rotate_groups`), then calls X; or runs ropescale's
raw-key op (:func:`_rerope`: ReRoPE, Self-Extend, DCA with its temperature, :func:`_dual_chunk_temperature`).
``ropescale_X`` calls X unchanged on every other forward (rotated at write).
"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .. import config as config_lib, ops
from .cache import PreRopeLayer
from .requests import PLANNED, batch_positions, length_groups, planned_lengths, token_positions
from .state import PatchState

# rerope_attention never attends a key at a negative position: how padding keys are masked out.
_PADDING_POSITION = -1


# The attention implementations whose mask ReRoPE reads padding from (see ``_padding_keys``): the
# 4-D masks of eager and sdpa, flex's BlockMask, and the 2-D padding mask flash attention gets.
REROPE_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                          "flash_attention_4")


# ``config._attn_implementation`` X of a patched model is ``ropescale_X`` (registered on first use).
_WRAPPED = "ropescale_"


# ---------------------------------------------------------------------------------------------
# The attention implementation: ropescale_X


def base_implementation(config) -> str:
    """The attention implementation the model runs (``X`` of a patched model's ``ropescale_X``)."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return implementation[len(_WRAPPED):] if implementation.startswith(_WRAPPED) else implementation


def check_rerope_implementation(config, attention: str = "rerope") -> None:
    implementation = base_implementation(config)
    if implementation not in REROPE_IMPLEMENTATIONS:
        raise ValueError(
            f"patch: {config_lib.ATTENTION_NAMES[attention]} reads padding from the attention mask, and ropescale "
            "knows the masks of "
            f"attn_implementation {', '.join(REROPE_IMPLEMENTATIONS)}; this model uses {implementation!r}: "
            "load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


def wrap_implementations(state: PatchState) -> None:
    """Every attention config's implementation X as ``ropescale_X`` (registered on first use, with X's mask)."""
    configs = {id(m.config): m.config for m in state.attention_modules}
    for config in configs.values():
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        if implementation.startswith(_WRAPPED):
            continue
        if state.raw_keys:  # at patch and at every forward: the implementation can change after patch
            check_rerope_implementation(config, state.attention)
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
        state: PatchState | None = getattr(module, "_ropescale_patch", None)
        if state is None or not state.step_pre_rope or not state.extends(module):
            return function(module, query, key, value, attention_mask, **kwargs)
        return _pre_rope_attention(state, function, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"ropescale_{implementation}"
    return attention


# ---------------------------------------------------------------------------------------------
# The cache's raw-key layers, and the step's positions


def pre_rope_layers(state: PatchState, cache) -> None:
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


def start_pre_rope_step(state: PatchState, position_ids: torch.Tensor, batch: int) -> None:
    """The rotary module's part of a pre-RoPE forward (it sees the positions first, before any layer caches a
    key): the positions each pre-RoPE cache layer stores, and a per-request method's planned lengths."""
    if state.step_positions is not None:  # a per-layer-type rotary module runs once per type
        return
    if state.pair_streams is not None:  # [streams, B, T] (or [B, T]: every stream at the text position)
        streams = position_ids if position_ids.dim() == 3 else position_ids[None].expand(3, -1, -1)
        position_ids = streams.permute(1, 2, 0)
    positions = batch_positions(position_ids, batch)
    state.step_positions = positions
    cache = state.step_cache
    if cache is not None:
        for layer in cache.layers:
            if isinstance(layer, PreRopeLayer):
                layer.pending_positions = positions
    if cache is not None and state.plan.temperature_length and cache.get_seq_length(state.extended_layers[0]) == 0:
        vars(cache).pop(_PROMPT, None)  # a new request in this cache: DCA's prompt lengths are this forward's
    if state.per_request:  # before the cache takes this step's keys: a refused step leaves it as it was
        if cache is not None and cache.get_seq_length(state.extended_layers[0]) == 0:
            vars(cache).pop(PLANNED, None)  # a new request in this cache
        state.step_planned = planned_lengths(state, token_positions(positions), cache)


# ---------------------------------------------------------------------------------------------
# Attention over raw keys


def _pre_rope_attention(state: PatchState, function, module, query, key, value, attention_mask, **kwargs):
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
    key_positions = batch_positions(positions, query.shape[0])
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
        planned = planned_lengths(state, token_positions(positions), None)
    groups = length_groups(state, token_positions(key_positions), planned)
    if state.raw_keys:
        return _rerope(module, state, groups, query, key, value, positions, key_positions, attention_mask,
                       kwargs), None
    query, key = _rotate_groups(state, groups, query, key, positions, key_positions)
    return function(module, query, key, value, attention_mask, **kwargs)


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
    interleaved = state.interleaved
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
    """Dual Chunk Attention's temperature (L0 = the plan's ``temperature_length`` > 0), as vLLM applies it: the query of
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
        return state.plan.temperature_at(torch.maximum(prompt[:, None], positions + 1))

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
    # The fused op has no backward: when gradients are wanted (fine-tuning), the training path computes
    # the same attention differentiably from PyTorch's fused attention kernels (no L x L tensor).
    wants_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    pad = _padding_keys(attention_mask, query.shape[0], query.shape[-2], key.shape[-2])
    if pad is not None and bool(pad.any()):
        key_positions = torch.where(pad, torch.full_like(key_positions, _PADDING_POSITION), key_positions)
        if wants_grad and positions.shape == pad.shape:
            # A training forward's padding queries too (a collator pads position ids with 0, which breaks the
            # increasing positions the training path's fused layout takes): their outputs reach no real token
            # (their keys are padding), so the loss and its gradients stay those of the real tokens.
            positions = torch.where(pad, torch.full_like(positions, _PADDING_POSITION), positions)
    if wants_grad and state.attention == "dual_chunk":
        raise ValueError("ropescale: Dual Chunk Attention has no training path (ops.rerope_attention_train takes "
                         "ReRoPE, Self-Extend and STRING): run the model under torch.no_grad() (generate does), or "
                         "fine-tune with attention='self_extend', 'string' or 'rerope'")
    # The fused op takes float32/fp16/bf16; a float64 model (numerics checks) runs the float64 composite, which
    # computes the same attention in plain PyTorch (differentiable; Lq x Lk masks, fine at a check's sizes).
    if query.dtype == torch.float64:
        attention = ops.rerope_attention_composite
    else:
        attention = ops.rerope_attention_train if wants_grad else ops.rerope_attention
    plan = state.plan
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
            leaky_k=plan.leaky_k, scale=scale, logn_length=plan.logn_length,
            interleaved=state.interleaved, **method_arguments,
        )
        return out

    if groups[0][0] is None:
        out = attend(query, key, value, positions, key_positions, groups[0][1])
    else:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        for rows, seq_len in groups:
            out[rows] = attend(query[rows], key[rows], value[rows], positions[rows], key_positions[rows], seq_len)
    return out.transpose(1, 2)
