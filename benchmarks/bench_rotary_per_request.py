"""The rotation with a table per request against the single-table rotations an engine runs today, same run.

    python benchmarks/bench_rotary_per_request.py            # CPU (and CUDA when present), about a minute
    python benchmarks/bench_rotary_per_request.py --quick    # fewer token counts and rounds

An engine's step in vLLM's layout: q and k are views of one fused qkv row ``[T, (Hq + 2 Hkv) D]``, rotated in
place at ``positions [T]``. Per row (SmolLM2-135M's heads, 9 q / 3 kv x 64, and Llama-3-8B's, 32 / 8 x 128;
fp32 and bf16; 1 to 4096 tokens):

  * cache:   what ropescale's vLLM rotary runs for a static table today: the rows of a ``cos_sin_cache``
             ``[max_position, rotary_dim]`` at the positions, then ``apply_rotary_qk_`` (half width)
  * pos:     ``apply_rotary_pos_qk_``: one table, sin/cos computed on the fly (angle reduced in double)
  * mixed:   ``apply_rotary_per_request_``: the same tokens split over 8 requests of 8 different YaRN scales
             (1 to 16), each token with its request's table and attention factor
  * vllm:    vLLM's own rotary (``RotaryEmbedding.forward_cpu`` / ``forward_cuda``, its cos_sin_cache), when
             vLLM is installed (the torch-2.13 venv here)

and the ratios mixed/cache and mixed/pos (the issue's bound: within 1.10). Medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rotary import timed  # noqa: E402
from common import device_name  # noqa: E402

from ropescale import ops  # noqa: E402

warnings.filterwarnings("ignore")

# name: (q heads, kv heads, head_dim, rope base, original length)
SHAPES = {"smollm2-135m": (9, 3, 64, 100000.0, 8192), "llama3-8b": (32, 8, 128, 500000.0, 8192)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.5, 8.0, 16.0)  # 8 requests, 8 scales
MAX_POSITION = 131072


def tables(head_dim: int, base: float, original: int, device: str):
    """Per-request YaRN tables and factors [R, D/2], [R]; the static s=4 model's cos_sin_cache and inv_freq."""
    inv = torch.stack([ops.yarn_inv_freq(head_dim, base, s, original) for s in SCALES]).to(device)
    factors = torch.tensor([ops.yarn_attention_factor(s) if s > 1 else 1.0 for s in SCALES]).to(device)
    static = ops.yarn_inv_freq(head_dim, base, 4.0, original)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * static.double()
    factor = ops.yarn_attention_factor(4.0)
    cache = torch.cat(((angles.cos() * factor).float(), (angles.sin() * factor).float()), dim=-1).to(device)
    return inv, factors, static.to(device), factor, cache


def step_inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device: str):
    """The fused qkv row, positions continuing each request's sequence, and each token's request."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    requests = torch.arange(tokens) * len(SCALES) // tokens  # runs of tokens, one per request
    starts = torch.randint(0, 60000, (len(SCALES),), generator=gen)
    first = torch.searchsorted(requests, torch.arange(len(SCALES)))
    positions = starts[requests] + torch.arange(tokens) - first[requests]
    return qkv, positions.to(device), requests.to(torch.int32).to(device)


def vllm_rotary(head_dim: int, base: float, dtype, device: str):
    """vLLM's own default rotary of this shape (None without vLLM)."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except Exception:  # noqa: BLE001 (not installed, or not importable in this venv)
        return None
    try:
        return RotaryEmbedding(head_dim, head_dim, MAX_POSITION, base, True, dtype).to(device)
    except Exception:  # noqa: BLE001 (vLLM's layer needs its config context on some versions)
        return None


def run_table(device: str, token_counts, budget_s: float, max_rounds: int):
    rows = []
    for shape, (heads, kv_heads, head_dim, base, original) in SHAPES.items():
        inv, factors, static, factor, cache = tables(head_dim, base, original, device)
        for dtype_name, dtype in DTYPES.items():
            stock = vllm_rotary(head_dim, base, dtype, device)
            for tokens in token_counts:
                qkv, positions, requests = step_inputs(tokens, heads, kv_heads, head_dim, dtype, device)
                work = qkv.clone()
                q = work[:, : heads * head_dim].view(tokens, heads, head_dim)
                k = work[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
                q4, k4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
                long_positions = positions.long()

                def by_cache():
                    cos, sin = cache.index_select(0, long_positions).to(dtype).chunk(2, dim=-1)
                    ops.apply_rotary_qk_(q4, k4, cos, sin, half_width=True)

                fns = {"cache": by_cache,
                       "pos": lambda: ops.apply_rotary_pos_qk_(q4, k4, positions, static, factor),
                       "mixed": lambda: ops.apply_rotary_per_request_(q, k, positions, requests, inv, factors)}
                if stock is not None:
                    q_flat = work[:, : heads * head_dim]
                    k_flat = work[:, heads * head_dim: (heads + kv_heads) * head_dim]
                    forward = stock.forward_cuda if device == "cuda" else stock.forward_cpu
                    fns["vllm"] = lambda: forward(long_positions, q_flat, k_flat)
                times = timed(fns, device, budget_s, 5, max_rounds)
                rows.append((shape, dtype_name, tokens, times))
                line = "  ".join(f"{name} {t * 1e6:9.1f} us" for name, t in times.items())
                print(f"{shape:13s} {dtype_name} {tokens:5d} tokens  {line}  mixed/cache {times['mixed'] / times['cache']:.2f}"
                      f"  mixed/pos {times['mixed'] / times['pos']:.2f}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1, 8 and 512 tokens, fewer rounds")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    args = parser.parse_args()
    token_counts = (1, 8, 512) if args.quick else (1, 8, 64, 512, 4096)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    print(f"# bench_rotary_per_request {datetime.date.today()}  torch {torch.__version__}  threads "
          f"{torch.get_num_threads()}")
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            continue
        print(f"## {device_name(device)}")
        rows = run_table(device, token_counts, 0.5 if args.quick else 2.0, 50 if args.quick else 400)
        ratios = sorted(t["mixed"] / t["cache"] for *_, t in rows)
        print(f"mixed/cache over {len(rows)} rows: median {ratios[len(ratios) // 2]:.2f}, worst {ratios[-1]:.2f}")
        ratios = sorted(t["mixed"] / t["pos"] for *_, t in rows)
        print(f"mixed/pos over {len(rows)} rows: median {ratios[len(ratios) // 2]:.2f}, worst {ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
