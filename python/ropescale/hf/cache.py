"""``PreRopeCache``: a transformers ``Cache`` that stores keys BEFORE rotation, with their positions.

Dynamic scaling changes the rotation of every earlier token when the length grows, so a cache of
rotated keys goes stale (YaRN paper, section 3.4; transformers issue 25104). ReRoPE rotates keys by
a distance that depends on the query. Both need the un-rotated keys; a model patched by
``ropescale.hf.patch`` rotates them at attention time.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PreRopeLayer(DynamicLayer):
    """One layer: un-rotated keys and values ``[B, Hkv, S, D]`` and int64 positions ``[B, S]``."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.positions = torch.empty(key_states.shape[0], 0, dtype=torch.int64, device=key_states.device)

    def update(self, key_states, value_states, cache_kwargs=None, *args, **kwargs):
        positions = (cache_kwargs or {}).get("positions")
        if positions is None:
            raise RuntimeError(
                "PreRopeCache stores un-rotated keys with their positions: use it with a model patched by "
                "ropescale.hf.patch (the unpatched attention would cache rotated keys)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = positions.to(device=key_states.device, dtype=torch.int64).expand(key_states.shape[0], -1)
        self.positions = torch.cat([self.positions, positions], dim=-1)
        return super().update(key_states, value_states)

    def reset(self):
        super().reset()
        self.positions = None

    def crop(self, tokens_to_remove):
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.is_initialized:
            self.positions = self.positions[..., :tokens_to_remove]

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        if self.get_seq_length() > 0:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        if self.get_seq_length() > 0:
            self.positions = self.positions[indices, ...]

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        if self.get_seq_length() > 0:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))


class PreRopeCache(Cache):
    """A growing KV cache of un-rotated keys and their positions; no arguments needed.

    Works with ``model.generate(..., past_key_values=PreRopeCache())``, batch generation with left
    padding, and ``model(..., past_key_values=cache)`` on a model patched by ``ropescale.hf.patch``.
    """

    def __init__(self):
        super().__init__(layer_class_to_replicate=PreRopeLayer)

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Positions ``[B, S]`` (int64) of the cached keys of one layer."""
        return self.layers[layer_idx].positions
