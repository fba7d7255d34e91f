"""One chunked-prefill call of ``rerope_attention_paged`` at long context, against SDPA on the same data.

    python benchmarks/bench_chunked_prefill.py                   # CUDA when present: 32k and 96k context
    python benchmarks/bench_chunked_prefill.py --device cpu --contexts 4096 --chunk 256 --q-heads 8 --kv-heads 2

What vLLM asks of the op at every layer while it prefills a long prompt in chunks: one request whose
``--chunk`` newest tokens are the queries, against every key before them (``--contexts``) and their own,
read through a paged cache of raw keys (``--block-size`` slots per page, pages shuffled), GQA
(``--q-heads`` over ``--kv-heads``), ``--dtype``. The op gets the workspace the vLLM backend reserves
(``max_num_batched_tokens`` = the chunk, 4x as many pre-rotated keys): past that, a request's key tiles are
rotated inside the tensor-core kernel (issue 26: no fp32 SIMT cliff at long context). Rows:

  rerope        ReRoPE with window ``--window`` (one static table)
  leaky         Leaky ReRoPE (k = 16): both sides of every key rotated
  dynamic_yarn  Dynamic-YaRN s = context / 8k: the request's own table, every key rotated
  sdpa          what a user would pick without ropescale: ``scaled_dot_product_attention`` of the chunk
                over contiguous, already-rotated keys and values (no paging, no ReRoPE rule, no mask:
                all keys visible, the work of a causal prefill chunk plus a chunk-sized triangle)

Per row: ms per call, microseconds per query token, and "x sdpa" (the row's time over SDPA's). CUDA
times come from CUDA events around ``--calls`` calls after 3 warm-up calls; CPU from the wall clock.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name  # noqa: E402

from ropescale import ops, scaling  # noqa: E402

NO_WINDOW = 2**31 - 1  # a window no distance reaches: plain RoPE attention (the dynamic methods)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_chunked_prefill.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="cuda (default when present) or cpu")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 98304],
                        help="keys before the chunk (default 32768 98304)")
    parser.add_argument("--chunk", type=int, default=2048, help="query tokens per call (default 2048)")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads (default 32: Llama-3-8B)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="default bf16")
    parser.add_argument("--block-size", type=int, default=16, help="slots per page (default 16: vLLM CUDA)")
    parser.add_argument("--window", type=int, default=2048, help="ReRoPE window (default 2048)")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per row (default 10)")
    args = parser.parse_args(argv)
    if min(args.contexts + [args.chunk, args.window, args.calls, args.block_size]) <= 0:
        parser.error("--contexts, --chunk, --window, --calls and --block-size must be > 0")
    if args.q_heads % args.kv_heads:
        parser.error("--q-heads must be a multiple of --kv-heads")
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA GPU here")
    return args


def timed(fn, calls: int, device: str) -> float:
    """Seconds per call."""
    for _ in range(3):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def one_context(args, context: int) -> list[tuple[str, float]]:
    device, dtype, d = args.device, DTYPES[args.dtype], args.head_dim
    g = torch.Generator().manual_seed(0)
    seq_len, chunk = context + args.chunk, args.chunk
    pages = -(-seq_len // args.block_size)
    key_cache = torch.randn(pages, args.kv_heads, args.block_size, d, generator=g).to(device, dtype)
    value_cache = torch.randn(pages, args.kv_heads, args.block_size, d, generator=g).to(device, dtype)
    block_table = torch.randperm(pages, generator=g).to(device, torch.int32)[None]
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    q = torch.randn(chunk, args.q_heads, d, generator=g).to(device, dtype)
    tokens = chunk
    workspace_bytes = ops.rerope_paged_workspace_bytes(tokens, args.kv_heads, d, dtype, max_keys=4 * tokens)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
    original = 8192
    static = scaling.YaRN(factor=max(1.0, seq_len / original), original_max_position=original)
    dynamic = scaling.DynamicYaRN(original_max_position=original)
    static_table = static.inv_freq(d, 1e4).to(device)
    dynamic_table = dynamic.inv_freq(d, 1e4, seq_len=seq_len).to(device)[None]
    dynamic_factor = torch.tensor([dynamic.attention_factor_for(seq_len) ** 2], device=device)

    def paged(table, window, leaky_k=0.0, factors=None):
        return lambda: ops.rerope_attention_paged(q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                                  table, window, leaky_k=leaky_k, scale_factors=factors,
                                                  workspace=workspace)

    # SDPA's operands: the same keys and values, contiguous and already rotated, [1, H, L, D].
    order = block_table[0].long()
    k = key_cache[order].transpose(0, 1).reshape(args.kv_heads, -1, d)[:, :seq_len][None]
    v = value_cache[order].transpose(0, 1).reshape(args.kv_heads, -1, d)[:, :seq_len][None]
    positions = torch.arange(seq_len, device=device)[None]
    k = ops.apply_rotary_pos(k.contiguous(), positions, static_table)
    q_sdpa = q.transpose(0, 1)[None].contiguous()

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=args.q_heads != args.kv_heads)

    rows = [("sdpa", sdpa), ("rerope", paged(static_table, args.window)),
            ("leaky", paged(static_table, args.window, leaky_k=16.0)),
            ("dynamic_yarn", paged(dynamic_table, NO_WINDOW, factors=dynamic_factor))]
    return [(name, timed(fn, args.calls, device)) for name, fn in rows]


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"{device_name(args.device)}; torch {torch.__version__}; {args.dtype}; chunk {args.chunk} queries, "
          f"Hq {args.q_heads} / Hkv {args.kv_heads}, D {args.head_dim}, pages of {args.block_size}, "
          f"window {args.window}")
    print(f"{'context':>8} {'row':<13} {'ms/call':>10} {'us/token':>10} {'x sdpa':>8}")
    for context in args.contexts:
        rows = one_context(args, context)
        base = rows[0][1]
        for name, seconds in rows:
            print(f"{context:>8} {name:<13} {seconds * 1e3:>10.3f} {seconds * 1e6 / args.chunk:>10.2f} "
                  f"{seconds / base:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
