"""The state of a patch (``ropescale.hf.patch``'s docstring says what it does): the bottom of ``ropescale.hf``.

:class:`PatchState` is what ``patch`` attaches to a model (``model._ropescale_patch``) and to its rotary, attention
and base modules: the serving plan (``serving.PreRopePlan``, the one place of the method and of its attention
side's settings: every setting the plan holds is read through it, never copied here), the modules patched, what
``unpatch`` puts back, an open request's planned lengths and tables, and the current forward's step. The paths
above it read and write it: the rotary module's forward and the rotated-at-write tables (``ropescale.hf.rotary``),
the raw-key cache and attention (``ropescale.hf.pre_rope``), each request's planned lengths
(``ropescale.hf.requests``), the base model's hooks (``ropescale.hf.hooks``); the API (``patch``, ``unpatch``,
``request``: ``ropescale.hf.patch``) makes and removes it. It imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .. import scaling as scaling_lib, serving
from . import architectures


@dataclasses.dataclass
class PatchState:
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
        sources = {layer_type_of(m): m.layer_idx for m in extended if getattr(m, "store_full_length_kv", False)}
        self.kv_sources = {m.layer_idx: sources[layer_type_of(m)] for m in extended
                           if getattr(m, "is_kv_shared_layer", False)}
        self.extended_layers = [m.layer_idx for m in extended if m.layer_idx not in self.kv_sources]

    @property
    def method(self) -> scaling_lib.RopeScaling:
        return self.plan.method

    @property
    def rotary_dim(self) -> int:
        return self.plan.rotary_dim

    @property
    def interleaved(self) -> bool:
        """The family's pair layout at attention time: ``(2i, 2i+1)`` (GLM, Llama 4) rather than ``(i, i + D/2)``
        (``Architecture.interleaved``, which ``patch`` gives the plan)."""
        return self.plan.interleaved

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
        return self.layer_types is None or layer_type_of(module) in self.layer_types

    def request(self, max_new_tokens: int) -> Request:
        """The context of one request per row that may generate ``max_new_tokens`` (:func:`request`)."""
        return Request(self, max_new_tokens)

    def table(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """inv_freq on ``device`` and the attention factor for this length (the serving core's table cache)."""
        return self.tables.table(seq_len, device)


def layer_type_of(module: nn.Module) -> str | None:
    """The layer type of an attention module as its config's ``rope_parameters`` key it: the rope it takes
    (DeepSeek-V4's ``rope_layer_type``, ``main`` or ``compress``), else its own ``layer_type`` or its config's
    ``layer_types`` entry; None for a config with one rope for every layer."""
    layer_type = getattr(module, "rope_layer_type", None) or getattr(module, "layer_type", None)
    if layer_type is None:
        layer_types = getattr(module.config, "layer_types", None)
        layer_type = layer_types[module.layer_idx] if layer_types else None
    return layer_type


class Request:
    """The context :func:`request` returns (``PatchState.request``)."""

    def __init__(self, state: PatchState, max_new_tokens: int | None, bounded: bool = False) -> None:
        # None: generate's, set once transformers has resolved it (prepare_generated_length). bounded: generate's
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
