"""``ropescale check``: every op on every device of this machine against float64 references.

Each device runs in a subprocess of its own (a kernel that crashes or traps takes only its own
process down): each CPU instruction-set variant of the native kernels this CPU can run
(``ATEN_CPU_CAPABILITY=default|avx2|avx512``, as torch picks its own kernels), then each CUDA GPU.
Every op runs on a compact grid (float32, float16, bfloat16; odd sizes, partial rotary, GQA,
interleaved pairs, in-place forms; ReRoPE prefill with padding and decode against a strided cache;
on CUDA the tensor-core-sized prefill and head dim 256) and is judged as the tests judge it: the
error against a float64 reference may be at most twice what plain PyTorch gets in that dtype on the
same inputs (the eager rotation formula; SDPA for attention), plus a floor for exact cases.

The worker side (:func:`_worker`) prints one JSON line per result; :func:`run` starts the workers,
prints the table and returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TextIO

import torch
import torch.nn.functional as F

from . import _C, __version__, build_info, ops
from ._composite import cos_sin, full_width, rotate_with_tables
from .rerope import rerope_attention_naive, rerope_attention_paged_composite, rerope_cache_write_composite, rotate

_ROW_PREFIX = "ropescale-check-row "
_DEVICE_PREFIX = "ropescale-check-device "
CPU_VARIANTS = ("default", "avx2", "avx512")
# Below this, an error is rounding of a zero (plain PyTorch may be exact where the op is within eps).
_ROTARY_FLOOR = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
# ReRoPE in float32: the tests' bound (SDPA's own float32 error is ~1e-7, below the float32
# summation-order differences of a blocked kernel).
_ATTENTION_FLOOR = {"float32": 1e-5, "float16": 0.0, "bfloat16": 0.0}
# A ReRoPE window past every distance of the grid: plain RoPE attention (the largest the op takes).
_NO_WINDOW = 2**31 - 1
ERROR_FACTOR = 2.0  # flash-attention's rule: twice PyTorch's own error in the dtype
WORKER_TIMEOUT_S = 300


@dataclass
class Row:
    op: str
    device: str
    dtype: str
    shape: str
    error: float
    allowed: float
    time_ms: float
    ok: bool
    note: str = ""


# ---------------------------------------------------------------------------------------------
# Worker: the grid on one device.


def _max_error(got, reference) -> float:
    if got.numel() == 0:
        return 0.0
    return (got.double().cpu() - reference.cpu()).abs().max().item()


def _timed(fn: Callable, device) -> tuple[object, float]:
    """fn's result and its best time in ms over three runs after a warm-up (synchronised on CUDA)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    result = fn()
    sync()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return result, best * 1e3


def _rotary_rows(device, label: str) -> list[Row]:
    """Every rotary op, float32/float16/bfloat16, on q [2, 8, 37, 88] (transformers' transposed layout)
    and k [2, 2, 37, 88] (GQA): 80 of 88 features rotated (40 pairs: vector bodies and remainders),
    full-width tables (per batch row) and half-width ones (one row for the batch), interleaved pairs
    (with half-width tables, the layout they take), conjugate, int32 and int64 positions to 2^20; for
    float16/bfloat16, also float32 tables (autocast's), judged against PyTorch's promoted float32 math."""

    def eager(x, cos, sin, interleaved, conjugate):
        """What plain PyTorch gets: transformers' formula in x's dtype, for full-width [T, S, R] tables."""
        return rotate_with_tables(x, cos[:, None], sin[:, None], interleaved, conjugate=conjugate, compute=x.dtype)

    def expected(x, cos, sin, interleaved, conjugate):
        """The float64 reference for full-width [T, S, R] tables."""
        return rotate_with_tables(x.double().cpu(), cos.double().cpu()[:, None], sin.double().cpu()[:, None],
                                  interleaved, conjugate=conjugate)

    def position_tables(positions, inv_freq, scale, interleaved, dtype):
        """Full-width [T, S, R] cos/sin from float64 angles, in ``dtype``: the reference (float64), or
        the tables plain PyTorch would be given at best (correctly rounded; a float32 angle, as
        transformers forms it, is off by up to 2^20 * 2^-24 rad here and would loosen the bound to
        nothing)."""
        cos, sin = cos_sin(positions[None] if positions.dim() == 1 else positions, inv_freq, scale, dtype)
        return full_width(cos, interleaved), full_width(sin, interleaved)

    rows = []
    batch, q_heads, k_heads, seq, head_dim, rotary_dim = 2, 8, 2, 37, 88, 80
    inv_freq = ops.default_inv_freq(rotary_dim, 10000.0).to(device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, seq, q_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
        k = torch.randn(batch, k_heads, seq, head_dim, generator=gen).to(device, dtype)
        cos = (torch.rand(batch, seq, rotary_dim, generator=gen) * 2 - 1).to(device, dtype)
        sin = (torch.rand(batch, seq, rotary_dim, generator=gen) * 2 - 1).to(device, dtype)
        half_cos = (torch.rand(1, seq, rotary_dim // 2, generator=gen) * 2 - 1).to(device, dtype)
        half_sin = (torch.rand(1, seq, rotary_dim // 2, generator=gen) * 2 - 1).to(device, dtype)
        positions = torch.randint(0, 1 << 20, (batch, seq), generator=gen).to(device)
        positions32 = torch.randint(0, 1 << 20, (seq,), generator=gen, dtype=torch.int32).to(device)

        def in_place(fn, *operands):
            def call():
                copies = [t.clone() for t in operands]
                fn(*copies)
                return copies
            return call

        # (op, shape label, call returning the outputs, operands, full-width tables, interleaved, conjugate)
        cases = [
            ("apply_rotary", lambda: [ops.apply_rotary(q, cos, sin)], (q,), (cos, sin), False, False),
            ("apply_rotary_", in_place(lambda x: ops.apply_rotary_(x, half_cos, half_sin, True, half_width=True), q),
             (q,), (full_width(half_cos, True), full_width(half_sin, True)), True, False),
            ("apply_rotary_qk", lambda: list(ops.apply_rotary_qk(q, k, cos, sin, conjugate=True)),
             (q, k), (cos, sin), False, True),
            ("apply_rotary_qk_", in_place(lambda a, b: ops.apply_rotary_qk_(a, b, half_cos, half_sin, True,
                                                                            half_width=True), q, k),
             (q, k), (full_width(half_cos, True), full_width(half_sin, True)), True, False),
            ("apply_rotary_pos", lambda: [ops.apply_rotary_pos(q, positions, inv_freq, 1.3)], (q,),
             (positions, 1.3), False, False),
            ("apply_rotary_pos_", in_place(lambda x: ops.apply_rotary_pos_(x, positions32, inv_freq, 1.0, True), q),
             (q,), (positions32, 1.0), True, False),
            ("apply_rotary_pos_qk", lambda: list(ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 0.9, True,
                                                                         conjugate=True)),
             (q, k), (positions, 0.9), True, True),
            ("apply_rotary_pos_qk_", in_place(lambda a, b: ops.apply_rotary_pos_qk_(a, b, positions, inv_freq, 1.1),
                                              q, k),
             (q, k), (positions, 1.1), False, False),
        ]
        # an engine's packed tokens [T, H, D] (row 0 of q and k, strided views), 3 requests of 3 tables and factors
        packed_q, packed_k = q[0].transpose(0, 1), k[0].transpose(0, 1)
        request_index = (torch.arange(seq) * 3 // seq).to(device, torch.int32)
        request_tables = torch.stack([inv_freq, inv_freq / 2.5, inv_freq / 7.0])
        request_factors = torch.tensor([1.0, 1.09, 1.19], device=device)
        per_request = (positions[0], request_index, request_tables, request_factors)

        def unpacked(outputs):
            return [y.transpose(0, 1)[None] for y in outputs if y is not None]

        cases += [
            ("apply_rotary_per_request", lambda: unpacked(ops.apply_rotary_per_request(packed_q, packed_k, *per_request,
                                                                                       True)),
             (q[:1], k[:1]), per_request, True, False),
            ("apply_rotary_per_request_", in_place(lambda a, b: ops.apply_rotary_per_request_(
                a[0].transpose(0, 1), b[0].transpose(0, 1), *per_request), q[:1], k[:1]),
             (q[:1], k[:1]), per_request, False, False),
        ]
        if dtype != torch.float32:
            # what autocast hands over: float32 tables (entries the dtype cannot hold), half q and k
            cos32 = (torch.rand(batch, seq, rotary_dim, generator=gen) * 2 - 1).to(device)
            sin32 = (torch.rand(batch, seq, rotary_dim, generator=gen) * 2 - 1).to(device)
            cases.append(("apply_rotary_qk (float32 tables)", lambda: list(ops.apply_rotary_qk(q, k, cos32, sin32)),
                          (q, k), (cos32, sin32), False, False))
        for op, call, operands, tables, interleaved, conjugate in cases:
            shape = " ".join("x".join(map(str, t.shape)) for t in operands)
            try:
                outputs, ms = _timed(call, device)
            except Exception as error:  # noqa: BLE001  (reported as a failing row)
                rows.append(Row(op, label, str(dtype)[6:], shape, math.nan, math.nan, math.nan, False,
                                f"raised {type(error).__name__}: {error}".splitlines()[0][:200]))
                continue
            if op.startswith("apply_rotary_per_request"):
                ref_tables = _request_tables(*tables, interleaved, torch.float64)
                plain_tables = _request_tables(*tables, interleaved, dtype)
            elif op.startswith("apply_rotary_pos"):
                ref_tables = position_tables(tables[0].cpu(), inv_freq.cpu(), tables[1], interleaved, torch.float64)
                plain_tables = position_tables(tables[0], inv_freq, tables[1], interleaved, dtype)
            else:
                ref_tables, plain_tables = tables, tables
            error = plain_error = 0.0
            for x, y in zip(operands, outputs):
                ref = expected(x, *ref_tables, interleaved, conjugate)
                plain = eager(x, *plain_tables, interleaved, conjugate)
                if "float32 tables" in op:  # PyTorch promotes to float32, then the dtype
                    plain = eager(x.float(), *plain_tables, interleaved, conjugate).to(dtype)
                error = max(error, _max_error(y, ref))
                plain_error = max(plain_error, _max_error(plain, ref))
            allowed = ERROR_FACTOR * plain_error + _ROTARY_FLOOR[str(dtype)[6:]]
            rows.append(Row(op, label, str(dtype)[6:], shape, error, allowed, ms, error <= allowed))
    return rows


def _request_tables(positions, request_index, inv_freq, factors, interleaved, dtype):
    """Full-width ``[1, T, R]`` cos/sin of each token with its request's table and factor, from float64 angles, in
    ``dtype`` (the reference in float64; the correctly rounded tables plain PyTorch would be given at best)."""
    rows = request_index.long().cpu()
    angles = positions.cpu().double()[:, None] * inv_freq.cpu().double()[rows]
    factor = factors.cpu().double()[rows][:, None]
    cos, sin = (angles.cos() * factor).to(positions.device, dtype), (angles.sin() * factor).to(positions.device, dtype)
    return full_width(cos, interleaved)[None], full_width(sin, interleaved)[None]


def _attention_cases(cuda: bool) -> list[tuple]:
    """The problems of _attention_rows: (name, batch, q heads, kv heads, q_len, k_len, head dim, rotary dim,
    left padding of row 1 (batch > 1 only), window, leaky_k, logn_length, interleaved, dtypes, a view of a
    longer cache); on CUDA also the tensor-core prefill's shape and a head dim past it."""
    all_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    cases = [
        ("prefill", 2, 4, 2, 77, 77, 64, 64, 5, 16, 0.0, 0, False, all_dtypes, False),
        ("decode", 2, 32, 4, 1, 300, 64, 48, 7, 64, 16.0, 128, True, all_dtypes, True),
    ]
    if cuda:
        half = (torch.float16, torch.bfloat16)
        cases += [
            ("tensor-core prefill", 1, 8, 2, 257, 257, 128, 128, 0, 100, 0.0, 0, False, half, False),
            ("prefill D=256", 1, 4, 1, 130, 130, 256, 256, 0, 32, 8.0, 0, False, half, False),
        ]
    return cases


def _attention_rows(device, label: str, cases: list[tuple] | None = None) -> list[Row]:
    """rerope_attention against the float64 two-matrix form, out and lse each judged against SDPA's
    own error in the dtype on the plain-attention problem with the same inputs (RoPE-rotated q and k
    rounded to the dtype, the same visibility), on problems of at least 64 rows (``cases``: the device's
    own, _attention_cases)."""
    rows = []
    if cases is None:
        cases = _attention_cases(device.type == "cuda")
    for name, batch, q_heads, kv_heads, q_len, k_len, dim, rotary_dim, pad, window, leaky_k, logn_length, \
            interleaved, dtypes, cache_view in cases:
        inv_freq = ops.default_inv_freq(rotary_dim, 10000.0)
        gen = torch.Generator().manual_seed(1)
        q64 = torch.randn(batch, q_heads, q_len, dim, generator=gen, dtype=torch.float64)
        k64 = torch.randn(batch, kv_heads, k_len, dim, generator=gen, dtype=torch.float64)
        v64 = torch.randn(batch, kv_heads, k_len, dim, generator=gen, dtype=torch.float64)
        kp = torch.arange(k_len).repeat(batch, 1)
        if batch > 1:  # row 1 left-padded
            kp[1, :pad] = -1
            kp[1, pad:] = torch.arange(k_len - pad)
        qp = kp[:, k_len - q_len:].clone()
        shape = f"q {batch}x{q_heads}x{q_len}x{dim} kv {kv_heads}x{k_len}"
        for dtype in dtypes:
            q, k, v = (t.to(dtype) for t in (q64, k64, v64))
            kw = dict(leaky_k=leaky_k, logn_length=logn_length, interleaved=interleaved)
            ref_out, ref_lse = rerope_attention_naive(q.double(), k.double(), v.double(), qp, kp, inv_freq.double(),
                                                      window, **kw)
            plain_errors = _plain_attention_error(q, k, v, qp, kp, inv_freq, device, logn_length, interleaved)
            seen = torch.isfinite(ref_lse)

            args = [t.to(device) for t in (q, k, v, qp, kp, inv_freq)]
            if cache_view:  # k and v read in place from a cache with spare capacity
                for i in (1, 2):
                    buffer = torch.zeros(batch, kv_heads, k_len + 9, dim, dtype=dtype, device=device)
                    buffer[:, :, 3:3 + k_len] = args[i]
                    args[i] = buffer[:, :, 3:3 + k_len]
            floor = _ATTENTION_FLOOR[str(dtype)[6:]]
            try:
                (out, lse), ms = _timed(lambda: ops.rerope_attention(*args, window, **kw), device)
            except Exception as error:  # noqa: BLE001
                rows.append(Row("rerope_attention", label, str(dtype)[6:], f"{name}: {shape}", math.nan, math.nan,
                                math.nan, False, f"raised {type(error).__name__}: {error}".splitlines()[0][:200]))
                continue
            out, lse = out.cpu(), lse.cpu()
            # Rows with no visible key: zeros and -inf exactly (decided by the mask).
            masked_ok = torch.equal(torch.isinf(lse), ~seen) and not out[~seen].any()
            for what, got, ref, plain_error in (("out", out, ref_out, plain_errors[0]),
                                                ("lse", lse, ref_lse, plain_errors[1])):
                error = (got.double() - ref).abs()[seen].max().item()
                if math.isnan(error):
                    error = math.inf
                allowed = ERROR_FACTOR * plain_error + floor
                ok = error <= allowed and masked_ok
                note = "" if masked_ok else "rows without a visible key are not zeros / -inf"
                rows.append(Row(f"rerope_attention ({what})", label, str(dtype)[6:], f"{name}: {shape}", error,
                                allowed, ms if what == "out" else math.nan, ok, note))
    return rows


def _plain_attention_error(q, k, v, qp, kp, inv_freq, device, logn_length, interleaved) -> tuple[float, float]:
    """PyTorch's own error in q's dtype on the plain-attention problem with these inputs (RoPE-rotated q
    and k rounded to the dtype, the same visibility): SDPA's out and a logsumexp over its scores, against
    float64, over the rows that see a key: (out error, lse error)."""
    dtype, group, dim = q.dtype, q.shape[1] // k.shape[1], q.shape[-1]
    factor = torch.where((qp + 1 > logn_length) & (logn_length > 0),
                         (qp + 1).double().log() / math.log(max(logn_length, 2)), 1.0)
    q_rot = rotate(q.double() * factor[:, None, :, None], qp, inv_freq, interleaved).to(dtype)
    k_rot = rotate(k.double(), kp, inv_freq, interleaved).to(dtype)
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0) & (kp[:, None, :] <= qp[:, :, None])
    ref_out, ref_lse = rerope_attention_naive(q.double(), k.double(), v.double(), qp, kp, inv_freq.double(),
                                              _NO_WINDOW, logn_length=logn_length, interleaved=interleaved)
    scale = 1 / math.sqrt(dim)

    def sdpa():
        return F.scaled_dot_product_attention(
            q_rot.to(device), k_rot.repeat_interleave(group, 1).to(device), v.repeat_interleave(group, 1).to(device),
            attn_mask=visible[:, None].to(device), scale=scale).cpu()

    try:
        out = sdpa()
    except RuntimeError:
        # torch's CPU flash kernel may refuse a capability forced below the CPU's own (most likely the
        # "pack_vnni2 is only supported when avx512 is supported" that killed the default and avx2 workers
        # of torch 2.11 on an AMX machine); its math backend is PyTorch's own attention in the dtype too.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            out = sdpa()
    scores = (q_rot.float() @ k_rot.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~visible[:, None], -math.inf), dim=-1)
    seen = torch.isfinite(ref_lse)
    return ((out.double() - ref_out).abs()[seen].max().item(), (lse.double() - ref_lse).abs()[seen].max().item())


def _paged_rows(device, label: str) -> list[Row]:
    """rerope_cache_write_ filling shuffled 16-key pages (exact against indexing), then rerope_attention_paged
    over one mixed batch (a decode row against 300 keys, a chunked prefill of 40 rows over 150 keys, a
    prefill of 77) against the float64 plain-PyTorch form, judged as rerope_attention is: against SDPA's
    own error in the dtype on each request's plain problem."""
    q_heads, kv_heads, dim, block_size, window = 8, 2, 64, 16, 32
    seq_lens, q_lens = [300, 150, 77], [1, 40, 77]
    pages = [-(-n // block_size) for n in seq_lens]
    gen = torch.Generator().manual_seed(2)
    order = torch.randperm(sum(pages) + 3, generator=gen)  # 3 pages nobody reads
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    slots = []
    for r, n in enumerate(seq_lens):
        block_table[r, :pages[r]] = order[sum(pages[:r]):sum(pages[:r + 1])]
        j = torch.arange(n)
        slots.append(block_table[r, j // block_size].long() * block_size + j % block_size)
    slot_mapping = torch.cat(slots)
    query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    inv_freq = ops.default_inv_freq(dim, 10000.0)
    q64 = torch.randn(sum(q_lens), q_heads, dim, generator=gen, dtype=torch.float64)
    k64 = torch.randn(sum(seq_lens), kv_heads, dim, generator=gen, dtype=torch.float64)
    v64 = torch.randn(sum(seq_lens), kv_heads, dim, generator=gen, dtype=torch.float64)
    shape = f"{len(seq_lens)} requests, q {tuple(q_lens)}, keys {tuple(seq_lens)}, {q_heads}/{kv_heads} heads, D {dim}"
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype)[6:]
        q, k, v = (t.to(dtype) for t in (q64, k64, v64))
        cache_shape = (len(order), kv_heads, block_size, dim)
        want_k, want_v = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
        rerope_cache_write_composite(want_k, want_v, k, v, slot_mapping)
        key_cache, value_cache = (torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(2))
        try:
            _, write_ms = _timed(lambda: ops.rerope_cache_write_(key_cache, value_cache, k.to(device), v.to(device),
                                                                 slot_mapping.to(device)), device)
            metadata = [t.to(device) for t in (block_table, seq_lens_t, query_start_loc, inv_freq)]
            # The default overload (the op's own workspace) and the .workspace one with an engine's reservation
            # that pre-rotates no keys (max_keys=0): on CUDA every tensor-core request rotates its key tiles in
            # the kernel, the path past the pre-pass budget.
            workspace = torch.empty(ops.rerope_paged_workspace_bytes(sum(q_lens), kv_heads, dim, dtype, max_keys=0),
                                    dtype=torch.uint8, device=device)
            results = {}
            for op, extra in (("rerope_attention_paged", {}), ("rerope_attention_paged.workspace",
                                                               {"workspace": workspace})):
                results[op] = _timed(lambda: ops.rerope_attention_paged(q.to(device), key_cache, value_cache,
                                                                         *metadata, window, **extra), device)
        except Exception as error:  # noqa: BLE001
            note = f"raised {type(error).__name__}: {error}".splitlines()[0][:200]
            rows += [Row(op, label, name, shape, math.nan, math.nan, math.nan, False, note)
                     for op in ("rerope_cache_write_", "rerope_attention_paged", "rerope_attention_paged.workspace")]
            continue
        write_error = max(_max_error(key_cache, want_k.double()), _max_error(value_cache, want_v.double()))
        rows.append(Row("rerope_cache_write_", label, name, shape, write_error, 0.0, write_ms, write_error == 0.0))
        ref_out, ref_lse = rerope_attention_paged_composite(q.double(), want_k.double(), want_v.double(), block_table,
                                                           seq_lens_t, query_start_loc, inv_freq.double(), window)
        plain = [0.0, 0.0]
        for r, (n, m) in enumerate(zip(seq_lens, q_lens)):
            rows_r = slice(int(query_start_loc[r]), int(query_start_loc[r + 1]))
            kp = torch.arange(n)[None]
            keys = slice(sum(seq_lens[:r]), sum(seq_lens[:r + 1]))
            errors = _plain_attention_error(q[rows_r].transpose(0, 1)[None], k[keys].transpose(0, 1)[None],
                                            v[keys].transpose(0, 1)[None], kp[:, n - m:], kp, inv_freq, device, 0,
                                            False)
            plain = [max(a, b) for a, b in zip(plain, errors)]
        floor = _ATTENTION_FLOOR[name]
        for op, ((out, lse), ms) in results.items():
            for what, got, ref, plain_error in (("out", out, ref_out, plain[0]), ("lse", lse, ref_lse, plain[1])):
                error = _max_error(got, ref)
                error = math.inf if math.isnan(error) else error
                allowed = ERROR_FACTOR * plain_error + floor
                rows.append(Row(f"{op} ({what})", label, name, shape, error, allowed,
                                ms if what == "out" else math.nan, error <= allowed))
    return rows


def _worker(device_name: str, threads: int) -> None:
    """Runs the grid on one device with ``threads`` CPU threads; prints the device's label, then one
    JSON line per result."""
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        props = torch.cuda.get_device_properties(device)
        label = f"{device} {props.name} sm_{props.major}{props.minor}"
    else:
        label = f"cpu {_C.rotary_cpu_isa()}"
    print(_DEVICE_PREFIX + json.dumps(label), flush=True)
    for rows in (_rotary_rows, _attention_rows, _paged_rows):
        for row in rows(device, label):
            print(_ROW_PREFIX + json.dumps(asdict(row)), flush=True)


# ---------------------------------------------------------------------------------------------
# The command: one worker per device, one table.


def _cpu_variants() -> list[str | None]:
    """The ATEN_CPU_CAPABILITY values this CPU can run (forcing one it lacks dies with SIGILL);
    None: the one default run where the native library has no x86 variants."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [None]
    return [isa for isa in CPU_VARIANTS if isa == "default" or getattr(torch.cpu, f"_is_{isa}_supported", lambda: False)()]


class _Worker:
    """One device's grid in a subprocess of its own (started at once; :meth:`rows` waits for it)."""

    def __init__(self, device: str, isa: str | None, threads: int):
        env = dict(os.environ)
        package_parent = str(Path(__file__).absolute().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        if isa is not None:
            env["ATEN_CPU_CAPABILITY"] = isa
        self.label = device if isa is None else f"cpu (ATEN_CPU_CAPABILITY={isa})"
        code = f"from ropescale.check import _worker; _worker({device!r}, {threads})"
        self.process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)

    def rows(self, deadline: float) -> list[Row]:
        try:
            stdout, stderr = self.process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            status = self.process.returncode
        except subprocess.TimeoutExpired:
            self.process.kill()
            stdout, _ = self.process.communicate()
            stderr, status = f"no answer after {WORKER_TIMEOUT_S} s", None
        rows = []
        for line in stdout.splitlines():
            if line.startswith(_DEVICE_PREFIX):
                self.label = json.loads(line[len(_DEVICE_PREFIX):])
            elif line.startswith(_ROW_PREFIX):
                rows.append(Row(**json.loads(line[len(_ROW_PREFIX):])))
        if status != 0:
            what = "timed out" if status is None else (f"died of signal {-status}" if status < 0 else f"exited {status}")
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            rows.append(Row("(the check itself)", self.label, "", "", math.nan, math.nan, math.nan, False,
                            (f"the worker {what} after {len(rows)} results" + (f": {last}" if last else ""))[:300]))
        return rows


def _format(value: float, digits: int = 2) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}e}"


def _table(rows: list[Row]) -> str:
    header = ("op", "device", "dtype", "shape", "error", "allowed", "ms", "")
    lines = [(r.op, r.device, r.dtype, r.shape, _format(r.error), _format(r.allowed),
              "" if math.isnan(r.time_ms) else f"{r.time_ms:.3f}",
              ("ok" if r.ok else "FAIL") + (f"  {r.note}" if r.note else "")) for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def run(devices: str = "all", as_json: bool = False, stream: TextIO | None = None) -> int:
    """Checks every op on the devices asked for ("cpu", "cuda" or "all"); prints the table (or
    JSON) to ``stream``; returns 0 when every result is within its bound, 1 otherwise."""
    stream = stream or sys.stdout
    info = build_info()
    start = time.perf_counter()
    runs: list[tuple[str, str | None]] = []
    notes = []
    if devices in ("cpu", "all"):
        runs += [("cpu", isa) for isa in _cpu_variants()]
    if devices in ("cuda", "all"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and not info["cuda"] and info["kernels"] == "native":
            notes.append(f"{count} CUDA GPU(s) present, but this ropescale was built without CUDA kernels: "
                         "rebuild with nvcc found (ROPESCALE_CUDA=ON), or run with ROPESCALE_KERNELS=reference")
        elif count:
            runs += [(f"cuda:{i}", None) for i in range(count)]
        elif devices == "cuda":
            notes.append("no CUDA GPU here (torch.cuda.is_available() is False)")
    # All at once (each pays for its own torch import); the CPU threads shared out between them.
    threads = max(1, (os.cpu_count() or 1) // max(1, len(runs)))
    workers = [_Worker(device, isa, threads) for device, isa in runs]
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    rows: list[Row] = []
    for worker in workers:
        rows += worker.rows(deadline)
    labels = [worker.label for worker in workers]
    failed = [r for r in rows if not r.ok]
    seconds = time.perf_counter() - start
    if as_json:
        json.dump({"ok": not failed and bool(rows), "build_info": info, "torch": torch.__version__,
                   "devices": labels, "notes": notes, "seconds": seconds, "rows": [asdict(r) for r in rows]},
                  stream, indent=1, default=str)
        stream.write("\n")
    else:
        kernels = ("reference (ROPESCALE_KERNELS=reference: plain PyTorch implementations)"
                   if info["kernels"] == "reference" else "native")
        print(f"ropescale {__version__}, torch {torch.__version__}, kernels: {kernels}; "
              f"{threads} CPU thread(s) per device run", file=stream)
        print(_table(rows), file=stream)
        for note in notes:
            print(f"note: {note}", file=stream)
        print(f"{len(rows) - len(failed)} of {len(rows)} results within bounds on {len(labels)} device run(s) "
              f"in {seconds:.1f} s.", file=stream)
        if failed:
            print(_failure_report(failed, info, labels), file=stream)
        elif not rows:
            print("Nothing was checked.", file=stream)
    return 1 if failed or not rows else 0


def _failure_report(failed: list[Row], info: dict, labels: list[str]) -> str:
    failed_ops = sorted({r.op for r in failed})
    workaround = ("Run with ROPESCALE_KERNELS=reference to route every op to its plain PyTorch "
                  "implementation (same results, slower) until it is fixed."
                  if info["kernels"] == "native" else
                  "These are the plain PyTorch implementations (ROPESCALE_KERNELS=reference): the problem is "
                  "in PyTorch or in this machine, not in ropescale's kernels.")
    return "\n".join([
        f"FAILED: {len(failed)} result(s) outside their bounds: {', '.join(failed_ops)}.",
        workaround,
        "Please report it to the ropescale project with this whole output, or at least:",
        f"  ropescale.build_info(): {info}",
        f"  torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}, "
        f"{platform.platform()}",
        f"  devices: {'; '.join(labels)}",
        "  the failing rows:",
        *("    " + line for line in _table(failed).splitlines()),
    ])


# ---------------------------------------------------------------------------------------------
# The subcommand (hooked into ropescale.cli).

DESCRIPTION = """\
Check that ropescale computes the right thing on this machine, in under a minute.

Every op runs on every device here: each instruction-set variant of the CPU kernels this CPU can
run (default, AVX2, AVX-512: one process each, as ATEN_CPU_CAPABILITY picks them) and each CUDA GPU,
in float32, float16 and bfloat16, on small problems chosen to reach the awkward parts (odd sizes,
partial rotary, GQA, interleaved pairs, in-place forms, ReRoPE prefill with padding and decode
against a cache; on a GPU also the tensor-core prefill and head dim 256). Each result is compared
with a float64 reference: 'error' is the largest absolute difference, 'allowed' is twice what plain
PyTorch gets in that dtype on the same inputs (the eager rotation formula; SDPA for attention),
plus a floor for results PyTorch gets exactly; 'ms' is the op's best time of three runs (the
device runs go at the same time, each with its share of the CPU threads: a rough figure, not a
benchmark).

Exit status 0: every result is within bounds. 1: some are not; the last lines say which and what
to report. Until a fix, ROPESCALE_KERNELS=reference (set before Python starts) routes every op to
its plain PyTorch implementation on the same device: slower, never stuck. `ropescale check` with
that variable set checks those implementations (the table says 'kernels: reference')."""


def add_parser(sub) -> None:
    """Adds ``check`` to the ``ropescale`` command's subparsers."""
    p = sub.add_parser(
        "check", help="check every op on this machine's CPU and GPUs against float64 references (< 1 min)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  ropescale check\n  ropescale check --devices cuda\n"
               "  ROPESCALE_KERNELS=reference ropescale check\n  ropescale check --json > check.json",
    )
    p.add_argument("--devices", choices=("all", "cpu", "cuda"), default="all",
                   help="which devices to check (default all: the CPU variants, then each CUDA GPU)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    p.set_defaults(func=lambda args: run(args.devices, args.json))
