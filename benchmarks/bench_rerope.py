"""ReRoPE attention on the CPU: the fused op against what a user would run instead, in one run.

Prefill (causal, 1k/4k/16k tokens) and decode steps (one query against 4k/16k/64k pre-RoPE caches),
B = 1, 8 heads, D = 128, float32, window 512 (Su's default), each timed as the median of several
calls after a warm-up, with the extra peak RSS of its own process:

* ``fused``     ropescale.ops.rerope_attention (the op under test);
* ``sdpa``      torch SDPA causal attention on already-rotated q/k: ordinary RoPE attention, the floor
                (decode: one query against a cache of rotated keys);
* ``naive``     Su's reference formulation: two full score matrices (ropescale.rerope.rerope_attention_naive);
* ``composite`` two SDPA calls merged by log-sum-exp (ropescale.ops.rerope_attention_composite).

Each (case, method) runs in a fresh subprocess so that peak memory is its own. Methods whose
score matrices would not fit (naive at 16k: 2 x 8 GiB) are reported as skipped.

    python benchmarks/bench_rerope.py                 # everything (a few minutes on 2 cores)
    python benchmarks/bench_rerope.py --prefill 1024 4096 --decode 16384
    python benchmarks/bench_rerope.py --prefill --decode 16384 --dtype bfloat16 --kv-heads 2 --methods fused sdpa
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HEADS, DIM, WINDOW, BASE = 8, 128, 512, 10000.0
METHODS = ("fused", "sdpa", "naive", "composite")
MEMORY_LIMIT_GIB = 6.0  # skip a method whose score matrices alone would need more


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(kind: str, method: str, length: int, repeats: int, dtype_name: str, kv_heads: int) -> dict:
    """Times one method in this process; returns median seconds and extra peak RSS (MiB)."""
    import torch
    import torch.nn.functional as F

    from ropescale import ops
    from ropescale.cache import PreRopeCache
    from ropescale.rerope import rerope_attention_naive, rotate

    torch.manual_seed(0)
    inv_freq = ops.default_inv_freq(DIM, BASE)
    q_len = length if kind == "prefill" else 1
    dtype = getattr(torch, dtype_name)
    q = torch.randn(1, HEADS, q_len, DIM).to(dtype)
    k = torch.randn(1, kv_heads, length, DIM).to(dtype)
    v = torch.randn(1, kv_heads, length, DIM).to(dtype)
    k_pos = torch.arange(length)[None]
    q_pos = k_pos[:, -q_len:]
    if kind == "decode":  # the pre-RoPE cache as decoding holds it (views of a growing buffer)
        cache = PreRopeCache(capacity=length + 1)
        k, v, k_pos = cache.append(k, v, k_pos)

    if method == "fused":
        def run():
            return ops.rerope_attention(q, k, v, q_pos, k_pos, inv_freq, WINDOW)
    elif method == "sdpa":
        q_rot, k_rot = rotate(q, q_pos, inv_freq), rotate(k, k_pos, inv_freq)  # a rotated-key cache

        def run():
            return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=kind == "prefill",
                                                  enable_gqa=kv_heads != HEADS)
    elif method == "naive":
        def run():
            return rerope_attention_naive(q, k, v, q_pos, k_pos, inv_freq, WINDOW)
    elif method == "composite":
        def run():
            return ops.rerope_attention_composite(q, k, v, q_pos, k_pos, inv_freq, WINDOW)
    else:
        raise ValueError(method)

    # Warm the BLAS kernels on a small problem so that the first timed call is not a JIT.
    ops.rerope_attention(q[:, :, -1:], k[:, :, :64], v[:, :, :64], q_pos[:, -1:], k_pos[:, :64], inv_freq, WINDOW)
    # Peak over the timed calls only (without the reset, building the inputs would count).
    _reset_peak_rss()
    before = _rss_bytes()
    with torch.inference_mode():
        if repeats > 1:  # a full-size warm-up, except for the longest cases (timed once)
            run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    peak = _peak_rss_bytes()
    return {"seconds": statistics.median(times), "extra_peak_mib": (peak - before) / 2**20}


def score_matrix_gib(kind: str, length: int) -> float:
    q_len = length if kind == "prefill" else 1
    return HEADS * q_len * length * 4 / 2**30


def run_case(kind: str, method: str, length: int, repeats: int, dtype: str, kv_heads: int) -> dict | None:
    if method == "naive" and 3 * score_matrix_gib(kind, length) > MEMORY_LIMIT_GIB:
        return None
    if method == "composite" and kind == "prefill" and 6 * length * length / 2**30 > MEMORY_LIMIT_GIB:
        return None  # its boolean + additive masks
    cmd = [sys.executable, __file__, "--worker", kind, method, str(length), str(repeats), dtype, str(kv_heads)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"), env.get("PYTHONPATH", "")])
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} {method} {length} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 16384],
                        help="prefill lengths (default 1024 4096 16384; none: skip prefill)")
    parser.add_argument("--decode", type=int, nargs="*", default=[4096, 16384, 65536],
                        help="cache lengths of the decode steps (default 4096 16384 65536; none: skip decode)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="q, k, v and cache dtype (default float32, the issue's targets)")
    parser.add_argument("--kv-heads", type=int, default=HEADS,
                        help=f"k/v heads; fewer than the {HEADS} q heads is GQA (default {HEADS})")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="methods to time (sdpa is always timed: the ratios are against it)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, method, length, repeats, dtype, kv_heads = args.worker
        print(json.dumps(worker(kind, method, int(length), int(repeats), dtype, int(kv_heads))))
        return
    if args.kv_heads < 1 or HEADS % args.kv_heads:
        parser.error(f"--kv-heads must divide the {HEADS} q heads, got {args.kv_heads}")
    methods = [m for m in METHODS if m in args.methods or m == "sdpa"]

    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"B=1, {HEADS} q heads, {args.kv_heads} k/v heads, D={DIM}, {args.dtype}, window {WINDOW}; "
          "median of N calls")
    header = f"{'case':<16}{'method':<11}{'ms':>10}{'x sdpa':>9}{'naive/x':>9}{'peak MiB':>10}"
    summary = {}
    for kind, lengths in (("prefill", args.prefill), ("decode", args.decode)):
        print("\n" + header)
        for length in lengths:
            repeats = 3 if kind == "prefill" and length <= 4096 else (1 if kind == "prefill" else 21)
            results = {m: run_case(kind, m, length, repeats, args.dtype, args.kv_heads) for m in methods}
            sdpa, naive = results["sdpa"]["seconds"], results.get("naive") and results["naive"]["seconds"]
            for method, r in results.items():
                case = f"{kind} {length // 1024}k"
                if r is None:
                    print(f"{case:<16}{method:<11}{'skipped: the score matrices do not fit':>40}")
                    continue
                vs_naive = f"{naive / r['seconds']:.1f}" if naive else "-"
                print(f"{case:<16}{method:<11}{r['seconds'] * 1e3:>10.1f}{r['seconds'] / sdpa:>9.2f}"
                      f"{vs_naive:>9}{r['extra_peak_mib']:>10.0f}")
            summary[(kind, length)] = results
    if args.dtype != "float32" or args.kv_heads != HEADS or "fused" not in methods:
        return  # the targets are for float32, 8 k/v heads
    print("\ntargets:")
    if ("prefill", 4096) in summary:
        r = summary[("prefill", 4096)]
        ratio = r["fused"]["seconds"] / r["sdpa"]["seconds"]
        print(f"  prefill 4k: fused / sdpa = {ratio:.2f} (target <= 1.6): {'met' if ratio <= 1.6 else 'MISSED'}")
        if r.get("naive"):
            speedup = r["naive"]["seconds"] / r["fused"]["seconds"]
            print(f"  prefill 4k: naive / fused = {speedup:.1f} (target >= 5): {'met' if speedup >= 5 else 'MISSED'}")
    if ("decode", 16384) in summary:
        r = summary[("decode", 16384)]
        ratio = r["fused"]["seconds"] / r["sdpa"]["seconds"]
        print(f"  decode 16k: fused / sdpa = {ratio:.2f} (target <= 1.5): {'met' if ratio <= 1.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
