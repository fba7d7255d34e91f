"""The pre-RoPE KV cache: keys stored BEFORE rotation, with their positions.

ReRoPE rotates every cached key by its distance to the current query (exactly inside the window,
clipped outside it), and Dynamic NTK / Dynamic YaRN change every key's rotation when the length
grows, so a cache of rotated keys is wrong for both. :class:`PreRopeCache` keeps the raw keys and
the positions they were seen at; attention rotates at attention time
(:func:`ropescale.ops.rerope_attention`).
"""

from __future__ import annotations

import torch

__all__ = ["PreRopeCache"]


class PreRopeCache:
    """Un-rotated keys and values of one attention layer, with their positions.

    ``append(k, v, positions)`` adds ``T`` tokens (``k``, ``v``: ``[B, Hkv, T, D]``, positions
    integer ``[B, T]``; a negative position marks a padding slot that attention ignores) and
    returns the views of everything cached so far. The views (:attr:`keys`, :attr:`values`
    ``[B, Hkv, L, D]``, :attr:`positions` int64 ``[B, L]``) are slices of buffers that grow by
    doubling, so a decoding step copies only its own tokens and the kernels read the cache in place.
    """

    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"PreRopeCache: capacity must be >= 1, got {capacity}")
        self._initial_capacity = capacity
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def keys(self) -> torch.Tensor:
        """Un-rotated keys ``[B, Hkv, L, D]`` (a view)."""
        self._require_data()
        return self._keys[:, :, : self._length]

    @property
    def values(self) -> torch.Tensor:
        """Values ``[B, Hkv, L, D]`` (a view)."""
        self._require_data()
        return self._values[:, :, : self._length]

    @property
    def positions(self) -> torch.Tensor:
        """Positions of the cached tokens, int64 ``[B, L]`` (a view)."""
        self._require_data()
        return self._positions[:, : self._length]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Caches ``T`` more tokens; returns ``(keys, values, positions)`` of the whole cache."""
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"PreRopeCache.append: k and v must be [B, Hkv, T, D] of one shape, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise ValueError(f"PreRopeCache.append: positions must be an integer tensor, got {positions.dtype}")
        batch, heads, tokens, dim = k.shape
        if tuple(positions.shape) != (batch, tokens):
            raise ValueError(f"PreRopeCache.append: positions must be [B, T] = [{batch}, {tokens}], got "
                             f"{tuple(positions.shape)}")
        if self._keys is None:
            self._allocate(k, v, max(self._initial_capacity, tokens))
        elif (batch, heads, dim) != (self._keys.shape[0], self._keys.shape[1], self._keys.shape[3]) or (
            k.dtype, v.dtype, k.device) != (self._keys.dtype, self._values.dtype, self._keys.device):
            raise ValueError(
                f"PreRopeCache.append: got k {tuple(k.shape)} {k.dtype} on {k.device}, but the cache holds "
                f"{tuple(self._keys.shape[:2])} x D={self._keys.shape[3]} {self._keys.dtype} on {self._keys.device}")
        end = self._length + tokens
        if end > self._keys.shape[2]:
            self._grow(max(end, 2 * self._keys.shape[2]))
        self._keys[:, :, self._length : end] = k
        self._values[:, :, self._length : end] = v
        self._positions[:, self._length : end] = positions
        self._length = end
        return self.keys, self.values, self.positions

    def reset(self) -> None:
        """Forgets every token (the buffers are kept for reuse)."""
        self._length = 0

    def _allocate(self, k, v, capacity):
        batch, heads, _, dim = k.shape
        self._keys = k.new_empty(batch, heads, capacity, dim)
        self._values = v.new_empty(batch, heads, capacity, dim)
        self._positions = torch.empty(batch, capacity, dtype=torch.int64, device=k.device)

    def _grow(self, capacity):
        keys, values, positions = self._keys, self._values, self._positions
        self._allocate(keys, values, capacity)
        self._keys[:, :, : self._length] = keys[:, :, : self._length]
        self._values[:, :, : self._length] = values[:, :, : self._length]
        self._positions[:, : self._length] = positions[:, : self._length]

    def _require_data(self):
        if self._keys is None:
            raise RuntimeError("PreRopeCache: the cache is empty (nothing appended yet)")
