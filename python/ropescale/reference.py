"""Plain-PyTorch kernels for the ops, taken instead of the native ones with ``ROPESCALE_KERNELS=reference``.

A way around a native kernel that misbehaves on some machine (``ropescale check`` says which): set
the variable before ``import ropescale`` and every kernel op runs as PyTorch code on the same device:

* the rotary family (``apply_rotary``, ``apply_rotary_qk``, ``apply_rotary_pos``,
  ``apply_rotary_pos_qk``, ``apply_rotary_per_request`` and their in-place twins): the definition, with
  float32 math for half types (float64 for float64 inputs) and the angles of the positions ops formed in
  float64;
* ``rerope_attention``: :func:`ropescale.rerope.rerope_attention_composite` (two SDPA calls; every method of the
  family: ReRoPE, Leaky, Self-Extend, Dual Chunk Attention).
* ``rerope_attention_paged`` / ``rerope_cache_write_``: :func:`ropescale.rerope.rerope_attention_paged_composite`
  (the pages of each request gathered, then the composite) / :func:`ropescale.rerope.rerope_cache_write_composite`.

The math (the rotation, the composites) is ``ropescale._composite``'s; this module adds the ops' contracts
around it (dtypes, in-place checks, empty inputs) and the switch.

They are registered over the native CPU and CUDA kernels of ``torch.ops.ropescale.*``, so
``torch.ops.ropescale.X``, ``ropescale.ops.X``, autograd, the fake kernels, ``torch.compile`` and
``opcheck`` all keep working; ``ropescale.build_info()["kernels"]`` says ``"reference"``. The
frequency-table ops have no device kernels (float64 scalar code on the CPU) and are not routed.

Inputs are checked by the ops' own checks (``torch.ops.ropescale._check_rotary``,
``_check_rotary_pos``, ``_check_rerope_attention``: the C++ functions the native kernels and their
Meta kernels call), so a bad argument gives the native op's error; the in-place ops' checks on
memory shared between operands, which the native kernels make in place, are made here with their
messages.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import _C  # noqa: F401  (the library whose CPU and CUDA kernels these replace)
from ._composite import (cos_sin, rerope_attention_composite, rerope_attention_paged_composite,
                         rerope_cache_write_composite, rotate_with_tables)

ENV = "ROPESCALE_KERNELS"
CHOICES = ("native", "reference")


def _requested() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "native"
    if value not in CHOICES:
        raise ImportError(
            f"{ENV}={os.environ[ENV]!r} is not a kernel choice: use {ENV}=native (the default, the compiled "
            f"kernels) or {ENV}=reference (plain PyTorch implementations, a way around a misbehaving kernel)"
        )
    return value


KERNELS = _requested()

_ROTARY_TABLE_OPS = ("apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_")
_ROTARY_POSITION_OPS = ("apply_rotary_pos", "apply_rotary_pos_", "apply_rotary_pos_qk", "apply_rotary_pos_qk_")
_ROTARY_PER_REQUEST_OPS = ("apply_rotary_per_request", "apply_rotary_per_request_")
ROUTED_OPS = _ROTARY_TABLE_OPS + _ROTARY_POSITION_OPS + _ROTARY_PER_REQUEST_OPS + ("rerope_attention", "rerope_attention_paged",
                                                          "rerope_attention_paged.workspace", "rerope_cache_write_")

_R = torch.ops.ropescale


# ---------------------------------------------------------------------------------------------
# Checks


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides, smallest first, are those of a contiguous tensor."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ATen's get_overlap_status is Full or Partial: two dense tensors of one storage whose byte
    ranges meet (a pair it cannot decide, non-dense, counts as not sharing, as in the native op)."""
    if a is b:
        return True
    if a.numel() == 0 or b.numel() == 0 or not (_dense(a) and _dense(b)):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_begin, b_begin = a.data_ptr(), b.data_ptr()
    return a_begin < b_begin + b.numel() * b.element_size() and b_begin < a_begin + a.numel() * a.element_size()


def _check_writable(op: str, written: dict[str, torch.Tensor], read: dict[str, torch.Tensor]) -> None:
    """The native op's checks on the tensors an in-place op writes (csrc/rotary.cpp)."""
    for name, x in written.items():
        if any(stride == 0 and size > 1 for stride, size in zip(x.stride(), x.shape)):
            raise RuntimeError(
                f"{op}: {name} has elements that share memory (an expanded tensor?), so it cannot be written in place"
            )
        for other_name, other in read.items():
            if _shares_memory(x, other):
                raise RuntimeError(f"{op}: {name} is written in place but shares memory with {other_name}")
    names = list(written)
    if len(names) == 2 and _shares_memory(written[names[0]], written[names[1]]):
        raise RuntimeError(f"{op}: {names[0]} is written in place but shares memory with {names[1]}")


# ---------------------------------------------------------------------------------------------
# Rotation


def _rotary(op: str, q, k, cos, sin, interleaved: bool, half_width: bool, conjugate: bool, in_place: bool,
            read: dict):
    """q (and k, when not None) rotated by tables broadcast over heads, ``[T, 1, S, width]`` (T = 1 or B), full or
    half width; ``read``: the tables as the op was given them, which an in-place op must not overlap. In place:
    the rotated features written into the operands (the features past rotary_dim untouched); otherwise new
    tensors in the operands' layout (as the native op's empty_like)."""
    operands = {"x": q} if k is None else {"q": q, "k": k}
    if in_place:
        _check_writable(op, operands, read)
    rotary_dim = 2 * cos.shape[-1] if half_width else cos.shape[-1]
    outs = []
    for x in operands.values():
        rotated = rotate_with_tables(x, cos, sin, interleaved, half_width=half_width, conjugate=conjugate)
        out, width = (x, rotary_dim) if in_place else (torch.empty_like(x), x.shape[-1])
        out[..., :width].copy_(rotated[..., :width])
        outs.append(out)
    if in_place:
        return None
    return outs[0] if k is None else tuple(outs)


def _table_rotary(op: str, q, k, cos, sin, interleaved, half_width, conjugate, in_place: bool):
    _R._check_rotary(op, q, k, cos, sin, interleaved, half_width)
    by_batch = [(t[None] if t.dim() == 2 else t)[:, None] for t in (cos, sin)]  # [T, 1, S, width]
    return _rotary(op, q, k, *by_batch, interleaved, half_width, conjugate, in_place, {"cos": cos, "sin": sin})


def _position_rotary(op: str, q, k, positions, inv_freq, scale, interleaved, conjugate, in_place: bool):
    _R._check_rotary_pos(op, q, k, positions, inv_freq, scale)
    cos, sin = cos_sin(positions[None] if positions.dim() == 1 else positions, inv_freq, scale)  # [T, S, P]
    return _rotary(op, q, k, cos[:, None], sin[:, None], interleaved, True, conjugate, in_place,
                   {"positions": positions, "inv_freq": inv_freq})


def _per_request_rotary(op: str, q, k, positions, request_index, inv_freq, attention_factors, interleaved,
                        in_place: bool, native_angles=None):
    """Packed tokens ``[T, H, D]``, each rotated by its request's row of inv_freq and factor: the position rotation
    with per-token tables ``[1, T, P]`` (heads on dim 1 as the 4-D ops have them)."""
    _R._check_rotary_per_request(op, q, k, positions, request_index, inv_freq, attention_factors, native_angles)
    rows = request_index.long()
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64).index_select(0, rows)
    if native_angles is not None:  # those requests' angles as an engine's native table forms them: a float32 product
        native = (positions.to(torch.float32)[:, None] * inv_freq.index_select(0, rows)).to(torch.float64)
        angles = torch.where(native_angles.index_select(0, rows)[:, None], native, angles)
    factors = attention_factors.to(torch.float64).index_select(0, rows)[:, None]
    cos, sin = angles.cos() * factors, angles.sin() * factors  # as _position_rotary's cos_sin with scale=factor
    read = {"positions": positions, "inv_freq": inv_freq, "request_index": request_index,
            "attention_factors": attention_factors}
    views = [x.transpose(0, 1)[None] for x in (q, k)]
    out = _rotary(op, *views, cos[None, None], sin[None, None], interleaved, True, False, in_place, read)
    if in_place:
        return None
    return tuple(o[0].transpose(0, 1) for o in out)


def apply_rotary_per_request(q, k, positions, request_index, inv_freq, attention_factors, interleaved=False,
                             native_angles=None):
    return _per_request_rotary("apply_rotary_per_request", q, k, positions, request_index, inv_freq,
                               attention_factors, interleaved, False, native_angles)


def apply_rotary_per_request_(q, k, positions, request_index, inv_freq, attention_factors, interleaved=False,
                              native_angles=None):
    _per_request_rotary("apply_rotary_per_request_", q, k, positions, request_index, inv_freq, attention_factors,
                        interleaved, True, native_angles)


def apply_rotary(x, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    return _table_rotary("apply_rotary", x, None, cos, sin, interleaved, half_width, conjugate, False)


def apply_rotary_(x, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    _table_rotary("apply_rotary_", x, None, cos, sin, interleaved, half_width, conjugate, True)


def apply_rotary_qk(q, k, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    return _table_rotary("apply_rotary_qk", q, k, cos, sin, interleaved, half_width, conjugate, False)


def apply_rotary_qk_(q, k, cos, sin, interleaved=False, *, half_width=False, conjugate=False):
    _table_rotary("apply_rotary_qk_", q, k, cos, sin, interleaved, half_width, conjugate, True)


def apply_rotary_pos(x, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    return _position_rotary("apply_rotary_pos", x, None, positions, inv_freq, scale, interleaved, conjugate, False)


def apply_rotary_pos_(x, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    _position_rotary("apply_rotary_pos_", x, None, positions, inv_freq, scale, interleaved, conjugate, True)


def apply_rotary_pos_qk(q, k, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    return _position_rotary("apply_rotary_pos_qk", q, k, positions, inv_freq, scale, interleaved, conjugate, False)


def apply_rotary_pos_qk_(q, k, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    _position_rotary("apply_rotary_pos_qk_", q, k, positions, inv_freq, scale, interleaved, conjugate, True)


# ---------------------------------------------------------------------------------------------
# ReRoPE attention


def rerope_attention(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k=0.0, scale=-1.0, logn_length=0,
                     causal=True, interleaved=False, *, group=0, chunk_size=0, far_start=-1):
    _R._check_rerope_attention(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                               allow_float64=False, group=group, chunk_size=chunk_size, far_start=far_start,
                               causal=causal)
    batch, q_heads, q_len, head_dim = q.shape
    if q.numel() == 0 or k.shape[2] == 0:  # as the native op: no key gives zeros and lse = -inf
        return (q.new_zeros(batch, q_heads, q_len, head_dim),
                q.new_full((batch, q_heads, q_len), float("-inf"), dtype=torch.float32))
    # float32 math for half types, as the native kernels accumulate: the composite run in fp16/bf16
    # would round its softmax denominators to the dtype (lse off by ~2^-8). inv_freq in float32 as
    # the native op reads it; out in q's dtype, contiguous; lse float32.
    out, lse = rerope_attention_composite(q.float(), k.float(), v.float(), q_positions, k_positions,
                                          inv_freq.float(), window, leaky_k, scale, logn_length, causal, interleaved,
                                          group=group, chunk_size=chunk_size, far_start=far_start)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def rerope_attention_paged_workspace(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq,
                                     window, leaky_k=0.0, scale=-1.0, scale_factors=None, logn_length=0,
                                     interleaved=False, *, group=0, chunk_size=0, far_start=-1, workspace):
    return rerope_attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                                  leaky_k, scale, scale_factors, logn_length, interleaved, workspace=workspace,
                                  group=group, chunk_size=chunk_size, far_start=far_start)


def rerope_attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                           leaky_k=0.0, scale=-1.0, scale_factors=None, logn_length=0, interleaved=False,
                           workspace=None, *, group=0, chunk_size=0, far_start=-1):
    _R._check_rerope_attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq,
                                     window, leaky_k, scale, scale_factors, logn_length, allow_float64=False,
                                     workspace=workspace, group=group, chunk_size=chunk_size, far_start=far_start)
    # float32 math for half types, as the native kernels accumulate (see rerope_attention above).
    out, lse = rerope_attention_paged_composite(
        q.float(), key_cache.float(), value_cache.float(), block_table, seq_lens, query_start_loc, inv_freq.float(),
        window, leaky_k, scale, None if scale_factors is None else scale_factors.float(), logn_length, interleaved,
        group=group, chunk_size=chunk_size, far_start=far_start)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def rerope_cache_write_(key_cache, value_cache, key, value, slot_mapping):
    rerope_cache_write_composite(key_cache, value_cache, key, value, slot_mapping)


# ---------------------------------------------------------------------------------------------
# Registration


_library = None


def _register() -> None:
    """Registers the functions above over the native CPU and CUDA kernels (those the library has:
    CUDA only in a build with the CUDA kernels)."""
    global _library
    _library = torch.library.Library("ropescale", "IMPL")
    for name in ROUTED_OPS:
        for key in ("CPU", "CUDA"):
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"ropescale::{name}", key):
                with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point here
                    warnings.simplefilter("ignore")
                    _library.impl(name, globals()[name.replace(".", "_")], key)


if KERNELS == "reference":
    _register()
