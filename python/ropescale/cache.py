"""The pre-RoPE KV cache: keys stored BEFORE rotation, with their positions.

ReRoPE rotates every cached key by its distance to the current query (exactly inside the window,
clipped outside it), and Dynamic NTK / Dynamic YaRN change every key's rotation when the length
grows, so a cache of rotated keys is wrong for both. :class:`PreRopeCache` keeps the raw keys and
the positions they were seen at; attention rotates at attention time
(:func:`ropescale.ops.rerope_attention`). ``ropescale.hf.PreRopeCache`` keeps one per layer.
"""

from __future__ import annotations

import torch

__all__ = ["PreRopeCache"]


def _as_int(value, what: str) -> int:
    """``value`` as a Python int (int, NumPy integer, 0-d integer tensor); bools and floats are refused."""
    if not isinstance(value, bool) and not (torch.is_tensor(value) and value.dim() != 0):
        try:
            return int(value.__index__())
        except (AttributeError, TypeError, RuntimeError):
            pass
    raise TypeError(f"{what} must be an int, got {value!r}")


class PreRopeCache:
    """Un-rotated keys and values of one attention layer, with their positions.

    ``append(k, v, positions)`` adds ``T`` tokens (``k``, ``v``: ``[B, Hkv, T, D]``, positions
    integer ``[B, T]``, or ``[B, T, S]`` for a multimodal rope's S position streams per token; a negative
    position marks a padding slot that attention ignores) and
    returns the views of everything cached so far. The views (:attr:`keys`, :attr:`values`
    ``[B, Hkv, L, D]``, :attr:`positions` int64 ``[B, L]``) are slices of buffers that grow by
    doubling, so a decoding step copies only its own tokens and the kernels read the cache in place.

    With autograd recording (``torch.is_grad_enabled()``; ``generate()`` runs under ``no_grad``)
    every update is made out of place instead, copying the buffers like ``torch.cat`` would: a view
    handed out earlier may be saved for backward, and writing into it would break the gradient.

    A view handed out keeps its values until :meth:`crop` or :meth:`reset`: the next ``append``
    writes over the tokens those dropped. The batch operations (:meth:`index_select`,
    :meth:`repeat_interleave`) copy into new buffers and leave earlier views alone.
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
    def capacity(self) -> int:
        """Tokens the buffers hold before the next ``append`` reallocates them (0 before the first)."""
        return 0 if self._keys is None else self._keys.shape[2]

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
        """Positions of the cached tokens, int64 ``[B, L]`` (``[B, L, S]`` for S streams; a view)."""
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
        streams = tuple(positions.shape[2:])
        if tuple(positions.shape[:2]) != (batch, tokens) or len(streams) > 1 or (
                self._positions is not None and streams != tuple(self._positions.shape[2:])):
            held = "" if self._positions is None else f" (the cache holds {tuple(self._positions.shape[2:])} per token)"
            raise ValueError(f"PreRopeCache.append: positions must be [B, T] = [{batch}, {tokens}] or [B, T, S], got "
                             f"{tuple(positions.shape)}{held}")
        if self._keys is None:
            self._allocate(k, v, batch, max(self._initial_capacity, tokens), streams)
        elif (batch, heads, dim) != (self._keys.shape[0], self._keys.shape[1], self._keys.shape[3]) or (
            k.dtype, v.dtype, k.device) != (self._keys.dtype, self._values.dtype, self._keys.device):
            raise ValueError(
                f"PreRopeCache.append: got k {tuple(k.shape)} {k.dtype} on {k.device}, but the cache holds "
                f"{tuple(self._keys.shape[:2])} x D={self._keys.shape[3]} {self._keys.dtype} on {self._keys.device}")
        start, end = self._length, self._length + tokens
        if end > self._keys.shape[2]:
            self._grow(max(end, 2 * self._keys.shape[2]))
        if tokens == 0:
            pass
        elif torch.is_grad_enabled():
            self._keys = torch.slice_scatter(self._keys, k, dim=2, start=start, end=end)
            self._values = torch.slice_scatter(self._values, v, dim=2, start=start, end=end)
            self._positions = torch.slice_scatter(
                self._positions, positions.to(device=self._positions.device, dtype=torch.int64), dim=1,
                start=start, end=end)
        else:
            self._keys[:, :, start:end] = k
            self._values[:, :, start:end] = v
            self._positions[:, start:end] = positions
        self._length = end
        return self.keys, self.values, self.positions

    def crop(self, length: int) -> None:
        """Keeps the first ``length`` tokens and forgets the rest (no copy; the buffers are kept)."""
        length = _as_int(length, "PreRopeCache.crop: length")
        if not 0 <= length <= self._length:
            raise ValueError(f"PreRopeCache.crop: length must be in [0, {self._length}] (the tokens cached), "
                             f"got {length}")
        self._length = length

    def index_select(self, indices: torch.Tensor) -> None:
        """Keeps batch rows ``indices`` (1-D integer tensor, each in ``[0, B)``, repeats allowed), in that order:
        the cache becomes ``keys.index_select(0, indices)`` etc. Copies the cached tokens, keeps the capacity.
        (The range check reads the indices back: on a GPU, one synchronisation.)"""
        self._require_data("index_select")
        batch = self._keys.shape[0]
        if not torch.is_tensor(indices) or indices.dim() != 1 or indices.is_floating_point() or \
                indices.is_complex() or indices.dtype == torch.bool:
            what = (f"{indices.dtype} tensor of shape {tuple(indices.shape)}" if torch.is_tensor(indices)
                    else type(indices).__name__)
            raise ValueError(f"PreRopeCache.index_select: indices must be a 1-D integer tensor, got {what}")
        indices = indices.to(device=self._keys.device, dtype=torch.int64)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= batch):
            raise IndexError(f"PreRopeCache.index_select: indices must be in [0, {batch}) (the batch size), got "
                             f"values in [{int(indices.min())}, {int(indices.max())}]")
        keys, values, positions = self.keys, self.values, self.positions
        self._allocate(keys, values, indices.numel(), self.capacity, tuple(positions.shape[2:]))
        length = self._length
        if torch.is_grad_enabled():  # out= does not record autograd; the new buffers are fresh, so this is safe
            self._keys[:, :, :length] = keys.index_select(0, indices)
            self._values[:, :, :length] = values.index_select(0, indices)
            self._positions[:, :length] = positions.index_select(0, indices)
        else:
            torch.index_select(keys, 0, indices, out=self._keys[:, :, :length])
            torch.index_select(values, 0, indices, out=self._values[:, :, :length])
            torch.index_select(positions, 0, indices, out=self._positions[:, :length])

    def repeat_interleave(self, repeats: int) -> None:
        """Repeats every batch row ``repeats`` times in place of it: ``[a, b]`` becomes ``[a, a, b, b]`` for 2,
        as ``keys.repeat_interleave(repeats, dim=0)``."""
        repeats = _as_int(repeats, "PreRopeCache.repeat_interleave: repeats")
        if repeats < 1:
            raise ValueError(f"PreRopeCache.repeat_interleave: repeats must be >= 1, got {repeats}")
        self._require_data("repeat_interleave")
        rows = torch.arange(self._keys.shape[0], device=self._keys.device)
        self.index_select(rows.repeat_interleave(repeats))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PreRopeCache":
        """Moves the buffers (whole, capacity included) to ``device``; returns the cache."""
        if self._keys is not None:
            self._keys = self._keys.to(device, non_blocking=non_blocking)
            self._values = self._values.to(device, non_blocking=non_blocking)
            self._positions = self._positions.to(device, non_blocking=non_blocking)
        return self

    def reset(self) -> None:
        """Forgets every token (the buffers are kept for reuse)."""
        self._length = 0

    def _allocate(self, k, v, batch, capacity, streams=()):
        heads, dim = k.shape[1], k.shape[3]
        self._keys = k.new_empty(batch, heads, capacity, dim)
        self._values = v.new_empty(batch, heads, capacity, dim)
        self._positions = torch.empty(batch, capacity, *streams, dtype=torch.int64, device=k.device)

    def _grow(self, capacity):
        keys, values, positions = self._keys, self._values, self._positions
        self._allocate(keys, values, keys.shape[0], capacity, tuple(positions.shape[2:]))
        self._keys[:, :, : self._length] = keys[:, :, : self._length]
        self._values[:, :, : self._length] = values[:, :, : self._length]
        self._positions[:, : self._length] = positions[:, : self._length]

    def _require_data(self, method=None):
        if self._keys is None:
            where = f"PreRopeCache.{method}" if method else "PreRopeCache"
            raise RuntimeError(f"{where}: the cache is empty (nothing appended yet)")
