"""One decode call of ``rerope_attention_paged`` (CPU) on an engine's shapes, against SDPA on the same data.

    python benchmarks/bench_paged_decode.py                       # SmolLM2's shapes, 8 x 4k and 1 x 16k
    python benchmarks/bench_paged_decode.py --requests 8 --length 16384 --threads 2

What vLLM's decode step asks of the op at every layer: one query per request (``--requests`` of them,
each ``--length`` tokens long), keys and values read through a paged cache (``--block-size`` slots per
page, pages in shuffled order), GQA (``--q-heads`` over ``--kv-heads``), float32. Rows:

  rerope        ReRoPE with window ``--window`` (one static table): the window's keys rotated, the others
                read as stored;
  leaky_rerope  Leaky ReRoPE, window ``--window``, k = (length - w) / (8192 - w): far keys rotated at j / k;
  self_extend   Self-Extend, neighbour window ``--window``, group G = ceil((length - w) / (8192 - w)) (as
                benchmarks/real_model.py): far keys rotated at floor(j / G);
  dual_chunk    Dual Chunk Attention, chunk_size 6144, local_size 512 (ChunkLlama's defaults for 8k): every
                key rotated at j mod 6144;
  dynamic_yarn  Dynamic-YaRN s=2 over an 8k original length: each request's own table, every key rotated;
  sdpa          what a user would pick without ropescale: ``scaled_dot_product_attention`` over contiguous,
                already-rotated keys and values ([R, H, L, D], ``enable_gqa``), no paging, no ReRoPE rule.

Each row is the mean of ``--calls`` calls after 3 warm-up calls. As in an engine step, call i reads layer
i mod ``--layers``'s own cache (random keys and values; 30 layers: SmolLM2's) with the same positions and
tables every call (so the op's remembered key cos/sin hit after the first call): the caches together are
far larger than the CPU's last-level cache, so each call reads its layer from memory as a served model
does (``--layers 1`` times a cache that stays in cache). "x sdpa" is the row's time over SDPA's (1.0: as
fast). Timings on a shared CPU are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ropescale import ops, scaling

sys.path.insert(0, str(Path(__file__).parent))
from common import DCA_CHUNK, DCA_LOCAL, TRAINED, WINDOW, leaky_k_for, self_extend_group_for  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_paged_decode.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 1], help="requests per call (default 8 1)")
    parser.add_argument("--length", type=int, nargs="+", default=[4096, 16384],
                        help="tokens per request, paired with --requests (default 4096 16384)")
    parser.add_argument("--q-heads", type=int, default=9, help="query heads (default 9: SmolLM2-135M)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (default 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    parser.add_argument("--block-size", type=int, default=128, help="slots per page (default 128: vLLM CPU)")
    parser.add_argument("--window", type=int, default=WINDOW, help=f"ReRoPE window (default {WINDOW})")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per row (default 60)")
    parser.add_argument("--layers", type=int, default=30,
                        help="layers' caches the calls cycle through (default 30; 1: one cache, warm in cache)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if len(args.requests) != len(args.length):
        parser.error("--requests and --length take the same number of values")
    if min(args.requests + args.length) <= 0 or min(args.window, args.calls, args.layers) <= 0:
        parser.error("--requests, --length, --window, --calls and --layers must be > 0")
    if args.q_heads % args.kv_heads:
        parser.error("--q-heads must be a multiple of --kv-heads")
    return args


def timed(fn, calls: int, layers: int) -> float:
    """Mean seconds of fn(layer) over ``calls`` calls, call i on layer i mod ``layers``, after 3 warm-up calls."""
    for i in range(3):
        fn(i % layers)
    start = time.perf_counter()
    for i in range(calls):
        fn(i % layers)
    return (time.perf_counter() - start) / calls


def case_rows(requests: int, length: int, args) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    hq, hkv, dim, block = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    pages = -(-length // block)
    num_blocks = requests * pages + 1
    caches = [(torch.randn(num_blocks, hkv, block, dim, generator=g), torch.randn(num_blocks, hkv, block, dim, generator=g))
              for _ in range(args.layers)]
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: requests * pages] + 1).int().view(requests, pages)
    seq_lens = torch.full((requests,), length, dtype=torch.int32)
    starts = torch.arange(requests + 1, dtype=torch.int32)
    q = torch.randn(requests, hq, dim, generator=g)
    static = scaling.Default().inv_freq(dim, 1e5)
    dynamic = scaling.DynamicYaRN(factor=2.0, original_max_position=TRAINED)
    tables = torch.stack([dynamic.inv_freq(dim, 1e5, seq_len=length)] * requests).float()
    factors = torch.full((requests,), float(dynamic.attention_factor_for(length)) ** 2)
    no_window = 2**31 - 1
    # SDPA's operands: the same keys and values, contiguous per request and head.
    rows = block_table.long()

    def dense(cache):
        return cache[rows].permute(0, 2, 1, 3, 4).reshape(requests, hkv, pages * block, dim)[:, :, :length].contiguous()

    dense_caches = [(dense(k), dense(v)) for k, v in caches]
    q4 = q[:, :, None]

    def paged(table, window, **kw):
        return lambda layer: ops.rerope_attention_paged(q, *caches[layer], block_table, seq_lens, starts, table, window,
                                                        **kw)

    calls = {
        "rerope": paged(static, args.window),
        "leaky_rerope": paged(static, args.window, leaky_k=leaky_k_for(length, args.window)),
        "self_extend": paged(static, args.window, group=self_extend_group_for(length, args.window)),
        "dual_chunk": paged(static, DCA_LOCAL, chunk_size=DCA_CHUNK),
        "dynamic_yarn": paged(tables, no_window, scale_factors=factors),
        "sdpa": lambda layer: torch.nn.functional.scaled_dot_product_attention(q4, *dense_caches[layer],
                                                                               enable_gqa=True),
    }
    return {name: timed(fn, args.calls, args.layers) for name, fn in calls.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads; Hq {args.q_heads}, Hkv {args.kv_heads}, D {args.head_dim}, "
          f"block {args.block_size}, float32, one query per request, {args.layers} layers' caches")
    print(f"{'requests x length':>18} {'row':>13} {'ms/call':>9} {'x sdpa':>7}")
    for requests, length in zip(args.requests, args.length):
        rows = case_rows(requests, length, args)
        for name, seconds in rows.items():
            print(f"{f'{requests} x {length}':>18} {name:>13} {seconds * 1e3:9.3f} {seconds / rows['sdpa']:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
