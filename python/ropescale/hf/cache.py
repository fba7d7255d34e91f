"""``PreRopeCache``: a transformers ``Cache`` that stores keys BEFORE rotation, with their positions.

Dynamic scaling changes the rotation of every earlier token when the length grows, so a cache of
rotated keys goes stale (YaRN paper, section 3.4; transformers issue 25104). ReRoPE rotates keys by
a distance that depends on the query. Both need the un-rotated keys; a model patched by
``ropescale.hf.patch`` rotates them at attention time.

Each layer keeps its tokens in a :class:`ropescale.cache.PreRopeCache` (buffers that grow by
doubling), so a decoding step under ``torch.no_grad()`` (as in ``generate()``) copies only its own
tokens, where transformers' ``DynamicLayer`` concatenates, copying the whole cache every step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..cache import PreRopeCache as _TokenStore

# Tokens a layer's buffers hold at first (or the prompt's length, if longer); they double when full.
_INITIAL_CAPACITY = 256


class PreRopeLayer(DynamicLayer):
    """One layer: un-rotated keys and values ``[B, Hkv, S, D]`` and int64 positions ``[B, S]`` (``[B, S, 3]`` under
    a multimodal rope: a position per stream).

    ``keys``, ``values`` and ``positions`` are read-only views of the layer's
    :class:`ropescale.cache.PreRopeCache` (None before the first update); every method transformers
    calls on a ``DynamicLayer`` (``update``, ``crop``, ``reorder_cache``, ``batch_select_indices``,
    ``batch_repeat_interleave``, ``reset``, ``offload``/``prefetch``, ...) changes the three together.
    """

    def __init__(self, **kwargs):
        self._store: _TokenStore | None = None
        # the positions of the step a patched model is running (set by its rotary module before any layer caches
        # a key), for an ``update`` that passes none: the model's own attention forward
        self.pending_positions: torch.Tensor | None = None
        super().__init__(**kwargs)

    # CacheLayerMixin.__init__ sets keys/values to None; nothing else may assign them.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._store is None else self._store.keys

    @keys.setter
    def keys(self, value):
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._store is None else self._store.values

    @values.setter
    def values(self, value):
        self._refuse_assignment("values", value)

    @property
    def positions(self) -> torch.Tensor | None:
        """int64 ``[B, S]``: the position each cached key was seen at."""
        return None if self._store is None else self._store.positions

    def _refuse_assignment(self, name, value):
        if value is None and self._store is None:
            return
        raise AttributeError(
            f"PreRopeLayer.{name} is a view of the layer's pre-RoPE cache and cannot be assigned; change the "
            "layer through update, crop, reorder_cache, batch_select_indices, batch_repeat_interleave or reset")

    def lazy_initialization(self, key_states, value_states, streams: tuple[int, ...] = ()):
        """``streams``: the position streams per token of a multimodal rope (``(3,)``), none for one position."""
        self.dtype, self.device = key_states.dtype, key_states.device
        batch = key_states.shape[0]
        self._store = _TokenStore(capacity=max(_INITIAL_CAPACITY, key_states.shape[-2]))
        self._store.append(key_states[:, :, :0], value_states[:, :, :0],
                           torch.empty(batch, 0, *streams, dtype=torch.int64, device=key_states.device))
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None, *args, **kwargs):
        positions = (cache_kwargs or {}).get("positions")
        if positions is None:
            positions = self.pending_positions
        if positions is None:
            raise RuntimeError(
                "PreRopeCache stores un-rotated keys with their positions: use it with a model patched by "
                "ropescale.hf.patch (the unpatched attention would cache rotated keys)"
            )
        positions = positions.to(device=key_states.device, dtype=torch.int64)
        if positions.dim() == 1:
            positions = positions[None]
        positions = positions.expand(key_states.shape[0], *positions.shape[1:])
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states, tuple(positions.shape[2:]))
        keys, values, _ = self._store.append(key_states, value_states, positions)
        return keys, values

    def get_seq_length(self) -> int:
        return 0 if self._store is None else len(self._store)

    def reset(self):
        """Drops the tokens and the buffers, as ``DynamicLayer.reset`` does."""
        self._store = None
        self.is_initialized = False

    def crop(self, tokens_to_remove):
        if tokens_to_remove > 0:  # DynamicLayer's rule and message
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._store.crop(max(0, len(self._store) + int(tokens_to_remove)))

    def batch_repeat_interleave(self, repeats):
        if self.is_initialized:
            self._store.repeat_interleave(repeats)

    def batch_select_indices(self, indices):
        if self.is_initialized:
            # Anything ``keys[indices, ...]`` accepts (a slice, a list, negative or boolean indices) as rows.
            rows = torch.arange(self._store.keys.shape[0], device=self._store.keys.device)[indices]
            self._store.index_select(rows)

    def reorder_cache(self, beam_idx):
        if self.is_initialized:
            self._store.index_select(beam_idx)

    def offload(self):
        if self.is_initialized:
            self._store.to("cpu", non_blocking=True)

    def prefetch(self):
        if self.is_initialized and self._store.keys.device != self.device:
            self._store.to(self.device, non_blocking=True)


class PreRopeCache(Cache):
    """A growing KV cache of un-rotated keys and their positions; no arguments needed.

    Works with ``model.generate(..., past_key_values=PreRopeCache())``, batch generation with left
    padding, beam search, and ``model(..., past_key_values=cache)`` on a model patched by
    ``ropescale.hf.patch``.
    """

    def __init__(self):
        super().__init__(layer_class_to_replicate=PreRopeLayer)

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Positions ``[B, S]`` (int64) of the cached keys of one layer."""
        return self.layers[layer_idx].positions
