"""Paged batches in vLLM's form for the paged attention op, built once for every test that needs one
(test_rerope_paged on the CPU, test_cuda_kernels on CUDA, short and long sequences alike), and their float64
reference: each request's dense keys through the two-matrix reference of support/attention.py."""

import math

import torch

from support.attention import reference

NOT_WRITTEN = float("nan")  # cache slots no request owns: any read of them would show in the output


def make_paged(requests, q_heads, kv_heads, dim, block_size, dtype=torch.float32, seed=0, q_layout="contiguous",
               index_dtype=torch.int64, table_pages=0):
    """A batch in vLLM's form: requests [(q_len, seq_len)], pages handed out in shuffled order from a cache
    with spare pages, every slot no request owns NaN (the spare pages, the tail of each request's last page),
    block-table entries past a request's pages garbage (never read).

    - ``q_layout``: "contiguous", "strided" (a view of a wider buffer: q sliced out of a fused qkv projection)
      or "head_major" (the [T, Hq, D] view of [Hq, T, D] storage);
    - ``index_dtype``: the dtype of seq_lens and query_start_loc (int64 as torch.tensor makes them, which the op
      takes; int32 as vLLM passes them); the block table is int32;
    - ``table_pages``: block-table rows at least this wide (a table sized for a long max_model_len).

    Each request's keys and values are written page by page in one indexing step, so long sequences are cheap.
    Returns (q [T, Hq, D], key_cache, value_cache, block_table, seq_lens, query_start_loc) and the dense
    per-request keys/values [(k [Hkv, seq, D], v)]."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-seq // block_size) for _, seq in requests]
    max_blocks = max(max(pages + [1]) + 1, table_pages)
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    key_cache = torch.full((num_blocks, kv_heads, block_size, dim), NOT_WRITTEN, dtype=dtype)
    value_cache = torch.full_like(key_cache, NOT_WRITTEN)
    block_table = torch.full((len(requests), max_blocks), 10**6, dtype=torch.int32)
    dense = []
    for r, (_, seq) in enumerate(requests):
        k = torch.randn(kv_heads, seq, dim, generator=g).to(dtype)
        v = torch.randn(kv_heads, seq, dim, generator=g).to(dtype)
        dense.append((k, v))
        if not pages[r]:
            continue
        mine = [order.pop() for _ in range(pages[r])]
        block_table[r, : pages[r]] = torch.tensor(mine, dtype=torch.int32)
        for cache, rows in ((key_cache, k), (value_cache, v)):
            padded = torch.full((kv_heads, pages[r] * block_size, dim), NOT_WRITTEN, dtype=dtype)
            padded[:, :seq] = rows
            cache[mine] = padded.view(kv_heads, pages[r], block_size, dim).transpose(0, 1)
    total = sum(q_len for q_len, _ in requests)
    q = torch.randn(total, q_heads, dim, generator=g).to(dtype)
    if q_layout == "strided":  # a view of a wider buffer (q sliced out of a fused qkv projection)
        buffer = torch.randn(total, q_heads, dim + 6, generator=g).to(dtype)
        buffer[..., 3 : 3 + dim] = q
        q = buffer[..., 3 : 3 + dim]
    elif q_layout == "head_major":
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    starts = torch.tensor([0] + [q_len for q_len, _ in requests]).cumsum(0).to(index_dtype)
    seq_lens = torch.tensor([seq for _, seq in requests]).to(index_dtype)
    return (q, key_cache, value_cache, block_table, seq_lens, starts), dense


def reference_paged(q, dense, requests, inv_freq, window, leaky_k=0.0, scale=None, scale_factors=None,
                    logn_length=0, interleaved=False, factors=None):
    """(out [T, Hq, D], lse [T, Hq]) in float64, one dense reference call per request. ``scale_factors`` [R]
    multiply each request's whole score (the op's argument); ``factors`` [R] are attention factors as
    transformers applies them (support.attention.reference's ``factor``: the rotated dims only)."""
    total, q_heads, dim = q.shape
    out = torch.zeros(total, q_heads, dim, dtype=torch.float64)
    lse = torch.full((total, q_heads), -math.inf, dtype=torch.float64)
    start = 0
    for r, ((q_len, seq), (k, v)) in enumerate(zip(requests, dense)):
        if q_len:
            kp = torch.arange(seq)[None]
            table = inv_freq if inv_freq.dim() == 1 else inv_freq[r]
            base_scale = 1 / math.sqrt(dim) if scale is None else scale
            factor = 1.0 if scale_factors is None else float(scale_factors[r])
            o, l = reference(q[start : start + q_len].transpose(0, 1)[None], k[None], v[None], kp[:, seq - q_len :],
                             kp, table, window, leaky_k, base_scale * factor, logn_length, True, interleaved,
                             1.0 if factors is None else float(factors[r]))
            out[start : start + q_len] = o[0].transpose(0, 1)
            lse[start : start + q_len] = l[0].transpose(0, 1)
        start += q_len
    return out, lse
