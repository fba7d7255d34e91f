"""A per-request method's requests, and each row's length (``ropescale.hf.patch``'s docstring says the rule).

- ``generate`` of a model patched with a ``per="request"`` method: the call is one request per row, its budget read
  where transformers resolves it (``prepare_generated_length``); ``ropescale.hf.request`` states it around a
  manual loop;
- :func:`planned_lengths`: each row's planned length (prompt + budget), fixed at the request's first forward and
  kept with the request (or, outside ``generate`` and ``ropescale.hf.request``, with the cache), a step past it
  refused;
- a request given a cache that holds tokens (a conversation's next turn): its keys were rotated with the table of the
  request that wrote them, and every later layer's keys and values of those tokens were computed under it, so it is
  continued only where the new request's table is the same (:func:`_check_continuation`); else ``generate``
  prefills the whole conversation again under the new plan (:func:`prefill`, as vLLM recomputes a continued
  conversation), and any other forward refuses by name;
- each row's length (largest position + 1) and the rows grouped by it, for the tables that follow the length.

Reading a length off the data is a graph break under ``torch.compile`` (:data:`DATA_DEPENDENT` says why).
"""

from __future__ import annotations

import torch

from .state import PatchState, Request


# ---------------------------------------------------------------------------------------------
# Each row's length


# A length-dependent table is picked by the current length, read off the data: a graph break under
# torch.compile (which works), an error under fullgraph=True, with this message.
DATA_DEPENDENT = (
    "ropescale: a length-dependent table (per-step Dynamic-YaRN and Dynamic-NTK, LongRoPE; a per-request method's "
    "at a request's first forward and at every forward outside generate) is chosen from each row's length, a value "
    "read off the data, so the patched model cannot be captured as one graph there: compile with "
    "torch.compile(model) (fullgraph=False: the graph breaks there, the rest is compiled; a per-request method's "
    "generate decode steps compile whole), or patch a static method (e.g. scaling.YaRN with a fixed factor) for "
    "fullgraph=True")


def batch_positions(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """int64 positions ``[batch, T]`` (``[batch, T, streams]`` under a multimodal rope) from ``[T]``, ``[1, T]``
    or ``[batch, T]`` (and their stream forms)."""
    positions = positions.to(torch.int64)
    if positions.dim() == 1:
        positions = positions[None]
    return positions.expand(batch, *positions.shape[1:])


def token_positions(positions: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each token's position for lengths (a multimodal rope's largest stream, as transformers' dynamic
    update takes the largest position id)."""
    return positions.amax(dim=-1) if positions.dim() == 3 else positions


@torch.compiler.disable(reason=DATA_DEPENDENT)
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


def length_groups(state: PatchState, positions: torch.Tensor, planned: torch.Tensor | None = None):
    """The rows grouped by the length whose table they take (:func:`_row_groups`), or ``[(None, None)]`` for a
    table that does not depend on the length."""
    if not state.length_dependent:
        return [(None, None)]
    return _row_groups(positions, planned)


# ---------------------------------------------------------------------------------------------
# Requests: generate's, hf.request's, and their planned lengths


# transformers' GenerationMixin resolves how long a generate call may run here (max_new_tokens, max_length, the
# generation config, their defaults): ropescale reads the result rather than re-deriving the rule.
GENERATED_LENGTH = "_prepare_generated_length"
# ... and runs a call's first forward here (with the whole input: a continued cache's tokens among them)
PREFILL = "_prefill"


def generate(self, *args, **kwargs):
    """``generate`` of a per-request model: the call is one request per row; its budget arrives from
    :func:`prepare_generated_length` before the first forward."""
    with Request(self._ropescale_patch, None, bounded=True):
        return type(self).generate(self, *args, **kwargs)


def prepare_generated_length(self, generation_config, *args, **kwargs):
    """transformers' own, then each row's budget: ``max_length`` less the input's (padded) length."""
    config = getattr(type(self), GENERATED_LENGTH)(self, generation_config, *args, **kwargs)
    input_length = kwargs.get("input_ids_length")
    state: PatchState = self._ropescale_patch
    if state.in_request and input_length is not None and config.max_length is not None:
        state.new_tokens = max(int(config.max_length) - int(input_length), 0)
    return config


PLANNED = "_ropescale_planned"  # the planned lengths of the request that wrote a cache's keys (their tables)


@torch.compiler.disable(reason=DATA_DEPENDENT)
def planned_lengths(state: PatchState, positions: torch.Tensor, cache) -> torch.Tensor:
    """Each row's planned length under a per-request method (``ropescale.hf.patch``'s docstring): fixed at the
    request's first forward (inside ``generate`` / :class:`request`: that call's; else the cache's, or the
    forward itself without a cache) as the row's length then (its largest position + 1: this forward's
    positions are the latest) plus the tokens it may generate."""
    current = positions.amax(dim=-1) + 1
    if state.in_request:
        if state.new_tokens is None:
            raise RuntimeError("ropescale: per='request' could not read this generate call's length from "
                               f"transformers ({GENERATED_LENGTH} was not called before the first forward): wrap "
                               "the call in `with ropescale.hf.request(model, max_new_tokens=N):` instead")
        planned = state.planned
        if planned is None or planned.shape[0] != current.shape[0]:
            planned = current + state.new_tokens
            if cache is not None:
                _check_continuation(state, cache, planned, positions.shape[-1])
                setattr(cache, PLANNED, planned)
            state.planned = planned
    elif cache is not None:
        planned = getattr(cache, PLANNED, None)
        if planned is None or planned.shape[0] != current.shape[0]:
            _check_continuation(state, cache, current, positions.shape[-1])
            planned = current
            setattr(cache, PLANNED, planned)
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


def start_request_step(state: PatchState, cache) -> None:
    """A per-request forward given ``cache``: outside ``generate`` and :func:`request` it continues the cache's
    request (the planned lengths its first forward fixed, kept with it); a request's first forward checks that the
    cache's keys were written with its tables (:func:`_check_continuation`). An emptied cache starts anew. Inside a
    request nothing is read here (a compiled decode step keeps its graph whole)."""
    if not state.in_request and cache is not None and cache.get_seq_length(state.extended_layers[0]) == 0:
        vars(cache).pop(PLANNED, None)
    state.step_cache = cache


def end_request_step(state: PatchState, output) -> None:
    """After a per-request forward that was given no cache: the cache the model made for it keeps the planned
    lengths it fixed (the next forward given that cache continues the request, or checks that its table is the
    same: :func:`_check_continuation`)."""
    if state.step_cache is not None:
        return
    cache = getattr(output, "past_key_values", None)
    if cache is not None and getattr(cache, PLANNED, None) is None:
        setattr(cache, PLANNED, state.step_planned)


# ---------------------------------------------------------------------------------------------
# A request that continues a cache (a conversation's next turn)


class _CacheOfAnotherTable(ValueError):
    """A request's first forward given a cache whose keys were written under another table (or an unknown one):
    raised before any layer writes, so the cache is as it was. ``generate`` prefills the whole sequence again when
    its inputs hold the cached tokens (:func:`prefill`); elsewhere it is the user's error."""

    def __init__(self, message: str, cached: int, tokens: int) -> None:
        super().__init__(message)
        self.cached, self.tokens = cached, tokens  # the cache's tokens, the refused forward's


def _same_tables(state: PatchState, written: torch.Tensor, planned: torch.Tensor) -> torch.Tensor:
    """``[B]``: whether each row's table (inv_freq and attention factor, hence also whether it is the native one) at
    its planned length is the one its cached keys were written with (two lengths within the trained length, or
    under a dynamic method's floor ``factor``, share a table)."""
    same = {}
    for old, new in dict.fromkeys(zip(written.tolist(), planned.tolist())):
        (old_freq, old_factor), (new_freq, new_factor) = (state.table(n, torch.device("cpu")) for n in (old, new))
        same[old, new] = old == new or (old_factor == new_factor and torch.equal(old_freq, new_freq))
    return torch.tensor([same[pair] for pair in zip(written.tolist(), planned.tolist())], dtype=torch.bool)


def _check_continuation(state: PatchState, cache, planned: torch.Tensor, tokens: int) -> None:
    """A request's first forward (planned lengths ``planned``, ``tokens`` new tokens) given a cache that holds tokens:
    continued where each row's table is the one the cache's keys were written with (the request that wrote them is
    this one's prefix under the same static model: exact, and nothing recomputed); else refused before any layer
    writes. Re-rotating the cached keys would not do: it redoes the first layer only (its keys are a rotation of its
    input, its values do not depend on the table), while every later layer's keys and values come from hidden states
    that attention under the old table computed."""
    cached = cache.get_seq_length(state.extended_layers[0])
    if cached == 0:
        return
    written = getattr(cache, PLANNED, None)
    method = f"{type(state.method).__name__}(per='request')"
    advice = ("Pass the whole conversation (the cached tokens and the new ones) without past_key_values, or with "
              "an emptied cache: generate does this itself when its input_ids hold the cached tokens, as vLLM "
              "recomputes a continued conversation under the new request's plan")
    if written is None or written.shape != planned.shape:
        why = ("was not written by this patched model's requests" if written is None else
               f"was written for {written.shape[0]} rows, this request has {planned.shape[0]}")
        raise _CacheOfAnotherTable(
            f"ropescale: {method}: this request continues a cache of {cached} tokens that {why}, so the table its "
            f"keys were rotated with is unknown. {advice}", cached, tokens)
    same = _same_tables(state, written.cpu(), planned.cpu())
    if bool(same.all()):
        return
    row = int(torch.nonzero(~same)[0, 0])
    old, new = int(written[row]), int(planned[row])
    raise _CacheOfAnotherTable(
        f"ropescale: {method}: this request (row {row} planned at {new} tokens) continues a cache of {cached} tokens "
        f"written by a request planned at {old}, whose table differs: its keys were rotated with that table and every "
        f"later layer's keys and values computed under it, so the continuation would be neither request's model "
        f"(re-rotating the keys redoes the first layer only). {advice}", cached, tokens)


def prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True, *args, **kwargs):
    """transformers' own prefill of a ``generate`` call; if its first forward refused the cache it was given (written
    under another table: :func:`_check_continuation`, before any layer wrote), the cache is emptied and the whole
    sequence prefilled under this request's plan, exactly the request without a cache (what vLLM does with a
    continued conversation). That needs the cached tokens among the inputs (transformers' standard multi-turn
    form ``generate(full_ids, past_key_values=cache)``); a call given only the new tokens is refused."""
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        raise ValueError(
            f"ropescale: {type(self._ropescale_patch.method).__name__}(per='request') fixes each request's table at "
            "its first forward, from the prompt it sees: with prefill_chunk_size that is the first chunk only, and "
            "the rest of the prompt would run at a table planned for a shorter request. Generate without "
            "prefill_chunk_size")
    given = dict(model_kwargs)
    try:
        return getattr(type(self), PREFILL)(self, input_ids, generation_config, model_kwargs, is_first_iteration,
                                             *args, **kwargs)
    except _CacheOfAnotherTable as refused:
        embeds = given.get("inputs_embeds")
        held = embeds.shape[1] if embeds is not None and is_first_iteration else input_ids.shape[1]
        if refused.cached + refused.tokens != held:
            raise ValueError(f"{refused} (this generate call's inputs hold {held} tokens, not the cache's "
                             f"{refused.cached} and the {refused.tokens} new ones, so it cannot)") from None
        model_kwargs.clear()
        model_kwargs.update(given)
        given["past_key_values"].reset()
        return getattr(type(self), PREFILL)(self, input_ids, generation_config, model_kwargs, is_first_iteration,
                                             *args, **kwargs)
