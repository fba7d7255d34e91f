"""A per-request method's requests, and each row's length (``ropescale.hf.patch``'s docstring says the rule).

- ``generate`` of a model patched with a ``per="request"`` method: the call is one request per row, its budget read
  where transformers resolves it (``_prepare_generated_length``); :func:`request` states it around a manual loop;
- :func:`_planned_lengths`: each row's planned length (prompt + budget), fixed at the request's first forward and
  kept with the request (or, outside ``generate`` and :func:`request`, with the cache), a step past it refused;
- each row's length (largest position + 1) and the rows grouped by it, for the tables that follow the length.

Reading a length off the data is a graph break under ``torch.compile`` (:data:`_DATA_DEPENDENT` says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .patch import _PatchState


# ---------------------------------------------------------------------------------------------
# Each row's length


# A length-dependent table is picked by the current length, read off the data: a graph break under
# torch.compile (which works), an error under fullgraph=True, with this message.
_DATA_DEPENDENT = (
    "ropescale: a length-dependent table (per-step Dynamic-YaRN and Dynamic-NTK, LongRoPE; a per-request method's "
    "at a request's first forward and at every forward outside generate) is chosen from each row's length, a value "
    "read off the data, so the patched model cannot be captured as one graph there: compile with "
    "torch.compile(model) (fullgraph=False: the graph breaks there, the rest is compiled; a per-request method's "
    "generate decode steps compile whole), or patch a static method (e.g. scaling.YaRN with a fixed factor) for "
    "fullgraph=True")


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


# ---------------------------------------------------------------------------------------------
# Requests: generate's, hf.request's, and their planned lengths


# transformers' GenerationMixin resolves how long a generate call may run here (max_new_tokens, max_length, the
# generation config, their defaults): ropescale reads the result rather than re-deriving the rule.
_GENERATED_LENGTH = "_prepare_generated_length"


def _generate(self, *args, **kwargs):
    """``generate`` of a per-request model: the call is one request per row; its budget arrives from
    :func:`_prepare_generated_length` before the first forward."""
    with _Request(self._ropescale_patch, None, bounded=True):
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

    def __init__(self, state: "_PatchState", max_new_tokens: int | None, bounded: bool = False) -> None:
        # None: generate's, set once transformers has resolved it (_prepare_generated_length). bounded: generate's
        # (transformers stops each row at its planned length, so no step after the first needs checking)
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 0):
            raise ValueError(f"request: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        self.state, self.max_new_tokens, self.bounded = state, max_new_tokens, bounded

    def __enter__(self):
        if self.state.in_request:
            raise RuntimeError("request: a request of this model is already open (generate or request)")
        self._open(True, self.max_new_tokens, self.bounded)
        return self

    def __exit__(self, *exc):
        self._open(False, None, False)

    def _open(self, open_: bool, new_tokens: int | None, bounded: bool) -> None:
        state = self.state
        state.in_request, state.new_tokens, state.request_bounded = open_, new_tokens, bounded
        state.planned, state.request_rows = None, None


_PLANNED = "_ropescale_planned"  # a cache's per-request planned lengths, fixed at its first forward


@torch.compiler.disable(reason=_DATA_DEPENDENT)
def _planned_lengths(state: _PatchState, positions: torch.Tensor, cache) -> torch.Tensor:
    """Each row's planned length under a per-request method (``ropescale.hf.patch``'s docstring): fixed at the
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


def _start_request_step(state: _PatchState, cache) -> None:
    """A per-request forward outside ``generate`` and :func:`request`: it continues ``cache``'s request (the planned
    lengths its first forward fixed, kept with it); an emptied cache starts a new one."""
    if cache is not None and cache.get_seq_length(state.extended_layers[0]) == 0:
        vars(cache).pop(_PLANNED, None)
    state.step_cache = cache


def _end_request_step(state: _PatchState, output) -> None:
    """After a per-request forward outside a request that was given no cache: the cache the model made for it
    keeps the planned lengths it fixed (the next forward given that cache continues the request)."""
    if state.in_request or state.step_cache is not None:
        return
    cache = getattr(output, "past_key_values", None)
    if cache is not None and getattr(cache, _PLANNED, None) is None:
        setattr(cache, _PLANNED, state.step_planned)
