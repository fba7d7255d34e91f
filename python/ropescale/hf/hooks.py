"""The base model's two hooks (``ropescale.hf.patch``'s docstring): before each forward, which path it takes
(rotated at write, or raw keys: ``ropescale.hf.pre_rope``), its cache and the refusals of what it would compute
wrong (position ids that jump, context parallelism); after it, the step's state reset.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache

from .. import config as config_lib, sharding
from .cache import PreRopeCache, PreRopeLayer
from .pre_rope import base_implementation, pre_rope_layers, wrap_implementations
from .requests import end_request_step, start_request_step
from .state import PatchState


def base_model_pre_hook(module, args, kwargs):
    """Before the base model runs: whether this forward is pre-RoPE (the method, or a ``PreRopeCache`` given),
    the cache it will use (pre-RoPE: made here as the model would, so that its layers can hold raw keys; a
    per-request forward outside ``generate`` and ``request``: the cache whose request it continues), and the
    attention implementation still wrapped (the user may have changed it since ``patch``)."""
    state: PatchState = module._ropescale_patch
    wrap_implementations(state)
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
            start_request_step(state, cache)
        return args, kwargs
    if cache is None and _uses_cache(module, bound.get("use_cache")):
        cache = DynamicCache(config=state.config)
        kwargs["past_key_values"] = cache
        if "past_key_values" in bound.get("_positional", ()):
            raise RuntimeError("ropescale: pass past_key_values by keyword to a pre-RoPE patched model")
    if cache is not None:
        pre_rope_layers(state, cache)
    state.step_cache = cache
    return args, kwargs


def _check_position_jumps(state: PatchState, module, kwargs, bound) -> None:
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


def _check_context_parallel(state: PatchState, bound: dict) -> None:
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
    implementations = {base_implementation(m.config) for m in state.attention_modules if state.extends(m)}
    if implementations - {"sdpa"}:
        raise NotImplementedError(
            f"ropescale: attn_implementation {', '.join(sorted(implementations))} under context parallelism: "
            "PyTorch's ring attention replaces F.scaled_dot_product_attention only, so any other implementation "
            "attends to each rank's own slice of the keys: load the model with attn_implementation='sdpa'")


def base_model_hook(module, args, output):
    """After the base model (or its error): a per-request forward's planned lengths kept with the cache the model
    made (outside a request), the pre-RoPE layers' pending positions cleared, the step's state reset."""
    state: PatchState = module._ropescale_patch
    if state.step_planned is not None and not state.step_pre_rope:
        end_request_step(state, output)
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
