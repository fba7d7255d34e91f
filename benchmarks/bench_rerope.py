"""ReRoPE attention, the fused op against what a user would run instead, in one run: on the CPU
(the default) or on a CUDA GPU (`--device cuda`, the mode scripts/gpu_check.sh runs).

CPU mode:

Prefill (causal, 1k/4k/16k tokens) and decode steps (one query against 4k/16k/64k pre-RoPE caches),
B = 1, 8 heads, D = 128, float32, window 512 (Su's default), each timed as the median of several
calls after a warm-up, with the extra peak RSS of its own process:

* ``fused``     ropescale.ops.rerope_attention (the op under test);
* ``sdpa``      torch SDPA causal attention on already-rotated q/k: ordinary RoPE attention, the floor
                (decode: one query against a cache of rotated keys);
* ``naive``     Su's reference formulation: two full score matrices (ropescale.rerope.rerope_attention_naive);
* ``composite`` two SDPA calls merged by log-sum-exp (ropescale.ops.rerope_attention_composite);
* ``paged16``, ``paged128`` ropescale.ops.rerope_attention_paged on the same problem as one request whose
                keys and values lie in pages of 16 / 128 slots (vLLM's cache, pages in reverse order):
                what the engine form costs over the dense op (the "paged / fused" lines).

Each (case, method) runs in a fresh subprocess so that peak memory is its own. Methods whose
score matrices would not fit (naive at 16k: 2 x 8 GiB) are reported as skipped.

    python benchmarks/bench_rerope.py                 # everything (a few minutes on 2 cores)
    python benchmarks/bench_rerope.py --prefill 1024 4096 --decode 16384
    python benchmarks/bench_rerope.py --prefill --decode 16384 --dtype bfloat16 --kv-heads 2 --methods fused sdpa

CUDA mode (`--device cuda`), issue 13's measurement; its defaults are the issue's shape: bf16,
B = 1, 32 q heads, GQA 32/8 (8 k/v heads), D = 128, window 2048; prefill at 4k/16k/32k tokens and
decode steps (one query token) against 4k/16k/64k pre-RoPE caches. All in this process, timed with
CUDA events (median of 5 prefill / 20 decode calls after 2 warm-ups); peak memory is
torch.cuda.max_memory_allocated above the inputs (after reset_peak_memory_stats):

* ``fused``     ropescale.ops.rerope_attention (bf16/fp16 prefill on the tensor-core kernel;
                decode on the split-K kernel);
* ``sdpa``      SDPA on rotated q/k (causal for prefill) forced to the flash backend with GQA, or with
                the k/v heads repeated beforehand if flash refuses GQA; if flash refuses the case at
                all (float32), the default backend, and the row says so: the floor the ratios divide by;
* ``composite`` ropescale.ops.rerope_attention_composite (two masked SDPA calls merged by lse);
                "out of memory" rows where its masks or SDPA backend do not fit;
* ``naive``     only where its score matrices fit in half the GPU's memory (4k), else skipped;
* ``paged16``   ropescale.ops.rerope_attention_paged on the same problem as one request in pages of 16 slots
                (vLLM's CUDA default): its prefill rows on the tensor-core kernel through the paged pre-pass
                (bf16/fp16), its decode rows on the split-K kernel; ``paged128`` on request (--methods).

Prefill rows print achieved TFLOP/s. ``fused`` (and ``paged16``/``paged128`` at bf16/fp16: the same
tensor-core body) is credited with the tiles its kernel computes
(computed_tile_flops): every query block x key block tile at positions 0..L-1 that
rerope_classify_tile does not skip, whole, at 4 D FLOPs per (query, key) pair (q.k and p.v), plus
2 D per pair on band tiles (their second, far-side q.k). The tile is the warp's 16 queries x 64 keys
of rerope_attention_tc.cuh for bf16/fp16 (32 x 32 blocks of the SIMT kernel for float32). The
others are credited with causal attention's useful 4 D L (L + 1) / 2 FLOPs per head. Decode rows
print GB/s (the cache's K and V, read once). "x sdpa" is time / SDPA's time. The table is markdown;
a line per prefill length after it gives the fused tile census.

    python benchmarks/bench_rerope.py --device cuda                 # issue 13 (what gpu_check.sh runs)
    python benchmarks/bench_rerope.py --device cuda --prefill 4096 --decode --methods fused sdpa
    python benchmarks/bench_rerope.py --device cuda --heads 32 --kv-heads 32 --window 512 --dtype float16

Without a CUDA GPU, --device cuda exits with status 2 and a one-line error; a method that fails
prints a FAILED row and the run exits 1.
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
METHODS = ("fused", "sdpa", "naive", "composite", "paged16", "paged128")
PAGED_METHODS = {"paged16": 16, "paged128": 128}  # method -> block_size
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


def make_case(kind: str, length: int, heads: int, kv_heads: int, dtype, device="cpu"):
    """The inputs of one case, seed 0: q, k, v, q_pos, k_pos, and for decode the pre-RoPE cache whose
    views k and v are (as decoding holds them: views of a growing buffer; keep it alive)."""
    import torch

    from ropescale.cache import PreRopeCache

    torch.manual_seed(0)
    q_len = length if kind == "prefill" else 1
    q = torch.randn(1, heads, q_len, DIM, device=device).to(dtype)
    k = torch.randn(1, kv_heads, length, DIM, device=device).to(dtype)
    v = torch.randn(1, kv_heads, length, DIM, device=device).to(dtype)
    k_pos = torch.arange(length, device=device)[None]
    q_pos = k_pos[:, -q_len:]
    cache = None
    if kind == "decode":
        cache = PreRopeCache(capacity=length + 1)
        k, v, k_pos = cache.append(k, v, k_pos)
    return q, k, v, q_pos, k_pos, cache


def paged_case(q, k, v, block_size: int):
    """The case (batch 1, positions 0..L-1) as rerope_attention_paged takes it: q [Lq, H, D] and one
    request whose keys/values lie in pages of block_size slots, handed out in reverse order."""
    import torch

    _, kv_heads, length, dim = k.shape
    pages = -(-length // block_size)
    order = torch.arange(pages - 1, -1, -1, device=k.device)

    def to_pages(x):
        padded = x.new_zeros(kv_heads, pages * block_size, dim)
        padded[:, :length] = x[0]
        cache = torch.empty(pages, kv_heads, block_size, dim, dtype=x.dtype, device=x.device)
        cache[order] = padded.view(kv_heads, pages, block_size, dim).transpose(0, 1)
        return cache

    meta = dict(device=k.device, dtype=torch.int32)
    return (q[0].transpose(0, 1).contiguous(), to_pages(k), to_pages(v), order[None].to(torch.int32),
            torch.tensor([length], **meta), torch.tensor([0, q.shape[2]], **meta))


def rerope_runs(q, k, v, q_pos, k_pos, inv_freq, window, methods=METHODS) -> dict:
    """The ReRoPE methods on one case, as calls (the sdpa floor is built by each mode); the paged ones'
    inputs are built only when asked for."""
    from ropescale import ops
    from ropescale.rerope import rerope_attention_naive

    runs = {
        "fused": lambda: ops.rerope_attention(q, k, v, q_pos, k_pos, inv_freq, window),
        "naive": lambda: rerope_attention_naive(q, k, v, q_pos, k_pos, inv_freq, window),
        "composite": lambda: ops.rerope_attention_composite(q, k, v, q_pos, k_pos, inv_freq, window),
    }
    for method, block_size in PAGED_METHODS.items():
        if method in methods:
            paged = paged_case(q, k, v, block_size)
            runs[method] = lambda paged=paged: ops.rerope_attention_paged(*paged, inv_freq, window)
    return runs


def worker(kind: str, method: str, length: int, repeats: int, dtype_name: str, kv_heads: int) -> dict:
    """Times one method in this process; returns median seconds and extra peak RSS (MiB)."""
    import torch
    import torch.nn.functional as F

    from ropescale import ops
    from ropescale.rerope import rotate

    inv_freq = ops.default_inv_freq(DIM, BASE)
    q, k, v, q_pos, k_pos, cache = make_case(kind, length, HEADS, kv_heads, getattr(torch, dtype_name))
    if method == "sdpa":
        q_rot, k_rot = rotate(q, q_pos, inv_freq), rotate(k, k_pos, inv_freq)  # a rotated-key cache

        def run():
            return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=kind == "prefill",
                                                  enable_gqa=kv_heads != HEADS)
    else:
        run = rerope_runs(q, k, v, q_pos, k_pos, inv_freq, WINDOW, (method,))[method]

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


def score_matrix_gib(kind: str, length: int, heads: int = HEADS) -> float:
    """GiB of one float32 score matrix (all heads) of the case."""
    q_len = length if kind == "prefill" else 1
    return heads * q_len * length * 4 / 2**30


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


# ---- CUDA mode

CUDA_DEFAULTS = dict(prefill=[4096, 16384, 32768], decode=[4096, 16384, 65536], dtype="bfloat16", heads=32,
                     kv_heads=8, window=2048)
# The fused prefill's unit of work (query rows x keys) on CUDA, from the kernels' constants:
# rerope_attention_tc.cuh (bf16/fp16, D in 64/80/96/128): a CTA holds kBlockM = 16 * kWarps = 64
# queries and walks key tiles of kBlockN = 64, but each warp classifies the tile against its own
# 16 queries (rerope_classify_tile) and computes or skips the whole 16 x 64 tile accordingly;
# rerope_attention.cuh (the SIMT kernel: float32, other head dims) classifies per block of
# kRows = kWarps * 8 = 32 queries (heads_per_block = 1 in prefill) and key tiles of kBlockK = 32.
TC_BLOCK_M, TC_BLOCK_N = 16, 64
SIMT_BLOCK_M, SIMT_BLOCK_N = 32, 32
PREFILL_REPEATS, DECODE_REPEATS, WARMUP = 5, 20, 2


def fused_tile_shape(dtype_name: str, dim: int = DIM) -> tuple[int, int]:
    """(block_m, block_n) of the CUDA kernel the fused prefill runs for this dtype and head dim."""
    if dtype_name in ("bfloat16", "float16") and dim in (64, 80, 96, 128):
        return TC_BLOCK_M, TC_BLOCK_N
    return SIMT_BLOCK_M, SIMT_BLOCK_N


def tile_census(length: int, window: int, block_m: int = TC_BLOCK_M, block_n: int = TC_BLOCK_N) -> dict:
    """Counts of the (query block x key block) tiles of a causal prefill at positions 0..length-1,
    classified as rerope_classify_tile (rerope_math.h) does: skip when every key is after every
    query; near when every visible distance (query - key) is < window; far when every one is
    >= window (distances clamped at 0 by the causal mask); band otherwise."""
    counts = dict(skip=0, near=0, far=0, band=0)
    for r0 in range(0, length, block_m):
        r1 = min(length, r0 + block_m) - 1  # the last real query: rows past the end do not bound the tile
        for c0 in range(0, length, block_n):
            c1 = min(length, c0 + block_n) - 1
            max_dist, min_dist = r1 - c0, max(r0 - c1, 0)
            if max_dist < 0:
                kind = "skip"
            elif max_dist < window:
                kind = "near"
            elif min_dist >= window:
                kind = "far"
            else:
                kind = "band"
            counts[kind] += 1
    return counts


def computed_tile_flops(length: int, dim: int, heads: int, window: int, block_m: int = TC_BLOCK_M,
                        block_n: int = TC_BLOCK_N) -> int:
    """FLOPs of the tiles the fused CUDA prefill computes (causal, positions 0..length-1, one
    batch row, `heads` q heads): every non-skipped tile is computed whole (block_m x block_n pairs,
    zero-padded past the end), 4 * dim FLOPs per pair (q.k and p.v, 2 FLOPs per multiply-add),
    plus 2 * dim per pair on band tiles (their second, far-side q.k product); skipped tiles
    count nothing. Defaults: the tensor-core kernel's 16 x 64 warp tile (TC_BLOCK_M, TC_BLOCK_N)."""
    c = tile_census(length, window, block_m, block_n)
    pairs = block_m * block_n
    return heads * pairs * dim * (4 * (c["near"] + c["far"] + c["band"]) + 2 * c["band"])


def causal_flops(length: int, dim: int, heads: int) -> int:
    """Useful FLOPs of causal attention (what SDPA's flash path is credited with, and composite and
    naive too): 4 * dim per visible (query, key) pair, L (L + 1) / 2 pairs per head."""
    return 4 * dim * heads * length * (length + 1) // 2


def _cell(text, width: int, right: bool = True) -> str:
    return f"{text:>{width}}" if right else f"{text:<{width}}"


CUDA_COLUMNS = (("case", 12, False), ("method", 30, False), ("ms", 9, True), ("x sdpa", 7, True),
                ("TFLOP/s", 8, True), ("GB/s", 6, True), ("peak GiB", 8, True))


def _row(*cells) -> str:
    return "| " + " | ".join(_cell(c, w, r) for c, (_, w, r) in zip(cells, CUDA_COLUMNS)) + " |"


def cuda_main(args) -> int:
    """Issue 13's measurement on a CUDA GPU, in this process; returns the exit status."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        print("bench_rerope: --device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}); run the CPU mode without --device", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))  # as the workers
    import torch.nn.functional as F

    import ropescale
    from ropescale import ops
    from ropescale.rerope import rotate

    if not ropescale.build_info().get("cuda"):
        print("bench_rerope: --device cuda: this ropescale build has no CUDA kernels (build_info()['cuda'] is "
              "False); rebuild with CUDA", file=sys.stderr)
        return 2
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # a torch without the context manager: SDPA picks its backend
        SDPBackend = sdpa_kernel = None

    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    heads, kv_heads, window, dim = args.heads, args.kv_heads, args.window, DIM
    group = heads // kv_heads
    block_m, block_n = fused_tile_shape(args.dtype, dim)
    props = torch.cuda.get_device_properties(device)
    total_gib = props.total_memory / 2**30
    print(f"{props.name} (sm_{props.major}{props.minor}, {total_gib:.0f} GiB), torch {torch.__version__}; "
          f"B=1, {heads} q heads, {kv_heads} k/v heads, D={dim}, {args.dtype}, window {window}; CUDA-event medians "
          f"of {PREFILL_REPEATS} (prefill) / {DECODE_REPEATS} (decode) calls after {WARMUP} warm-ups; peak: "
          "torch.cuda.max_memory_allocated above the inputs\n")
    inv_freq = ops.default_inv_freq(dim, BASE).to(device)

    def timed(fn, repeats):
        for _ in range(WARMUP):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def pick_sdpa(q, k, v, causal):
        """SDPA on the flash backend when it takes the case (GQA natively, else with the k/v heads
        repeated once, outside the timing); otherwise the default backend, said in the label."""
        tries = [("flash", lambda: (k, v, group > 1))]
        if group > 1:
            tries.append(("flash, k/v heads repeated",
                          lambda: (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False)))
        for label, inputs in tries if sdpa_kernel is not None else []:
            kk, vv, gqa = inputs()

            def run(kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)
            try:
                with warnings.catch_warnings():  # the reasons flash declines, as warnings
                    warnings.simplefilter("ignore")
                    run()
                torch.cuda.synchronize()
                return run, label
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError:
                continue
        why = "no sdpa_kernel in this torch" if sdpa_kernel is None else "flash refused the case"

        def run_default():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
        return run_default, f"default backend: {why}"

    failed = False
    print(_row(*(name for name, _, _ in CUDA_COLUMNS)))
    print("|" + "|".join("-" * (w + 1) + (":" if r else "-") for _, w, r in CUDA_COLUMNS) + "|")
    notes = []
    with torch.inference_mode():
        for kind, lengths in (("prefill", args.prefill), ("decode", args.decode)):
            for length in lengths:
                q, k, v, q_pos, k_pos, cache = make_case(kind, length, heads, kv_heads, dtype, device)
                q_rot, k_rot = rotate(q, q_pos, inv_freq), rotate(k, k_pos, inv_freq)  # a rotated-key cache
                sdpa_run, sdpa_label = pick_sdpa(q_rot, k_rot, v, kind == "prefill")
                runs = {**rerope_runs(q, k, v, q_pos, k_pos, inv_freq, window, args.methods), "sdpa": sdpa_run}
                results = {}
                for method in [m for m in METHODS if m in args.methods or m == "sdpa"]:
                    # naive: two f32 score matrices, their selection and the probabilities (~5 of them)
                    if method == "naive" and 5 * score_matrix_gib(kind, length, heads) > total_gib / 2:
                        results[method] = "skipped: the score matrices do not fit"
                        continue
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    try:
                        seconds = timed(runs[method], PREFILL_REPEATS if kind == "prefill" else DECODE_REPEATS)
                        results[method] = (seconds, (torch.cuda.max_memory_allocated() - base) / 2**30)
                    except torch.cuda.OutOfMemoryError:
                        results[method] = "out of memory"
                    except Exception as error:  # noqa: BLE001 - a row says it, the exit status too
                        results[method] = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
                        failed = True
                    torch.cuda.empty_cache()
                sdpa_seconds = results["sdpa"][0] if isinstance(results["sdpa"], tuple) else None
                case = f"{kind} {length // 1024}k" if length % 1024 == 0 else f"{kind} {length}"
                for method, r in results.items():
                    label = f"sdpa ({sdpa_label})" if method == "sdpa" else method
                    if not isinstance(r, tuple):
                        print(_row(case, label, r, "", "", "", ""))
                        continue
                    seconds, peak = r
                    tflops = gbs = ""
                    if kind == "prefill":
                        tiles_of_fused = method == "fused" or (method in PAGED_METHODS and args.dtype != "float32")
                        flops = (computed_tile_flops(length, dim, heads, window, block_m, block_n) if tiles_of_fused
                                 else causal_flops(length, dim, heads))
                        tflops = f"{flops / seconds / 1e12:.1f}"
                    else:  # the K and V of the cache, read once
                        gbs = f"{2 * kv_heads * length * dim * q.element_size() / seconds / 1e9:.0f}"
                    ratio = f"{seconds / sdpa_seconds:.2f}" if sdpa_seconds else ""
                    ms = seconds * 1e3
                    print(_row(case, label, f"{ms:.3f}" if ms >= 1 else f"{ms:.4f}", ratio, tflops, gbs,
                               f"{peak:.2f}"))
                if kind == "prefill" and "fused" in results:
                    c = tile_census(length, window, block_m, block_n)
                    fused = computed_tile_flops(length, dim, heads, window, block_m, block_n)
                    notes.append(f"prefill {length}: fused {block_m}x{block_n} tiles near {c['near']}, far {c['far']}, "
                                 f"band {c['band']}, skipped {c['skip']}; FLOPs counted "
                                 f"{fused / 1e12:.2f} T = {fused / causal_flops(length, dim, heads):.2f} x causal")
                del q, k, v, q_pos, k_pos, q_rot, k_rot, cache, runs, sdpa_run, results
                torch.cuda.empty_cache()
    print("\nTFLOP/s: fused counts the tiles its kernel computes (4 D per pair, 6 D on band tiles); the others "
          "count causal attention's useful 4 D L (L + 1) / 2 per head. GB/s: K and V of the cache read once.")
    for note in notes:
        print(note)
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default): one subprocess per case, peak RSS; cuda: issue 13's GPU shape")
    parser.add_argument("--prefill", type=int, nargs="*", default=None,
                        help="prefill lengths (default cpu 1024 4096 16384, cuda 4096 16384 32768; none: skip)")
    parser.add_argument("--decode", type=int, nargs="*", default=None,
                        help="cache lengths of the decode steps (default cpu 4096 16384 65536, cuda the same; "
                             "none: skip)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="q, k, v and cache dtype (default cpu float32, the CPU targets; cuda bfloat16)")
    parser.add_argument("--heads", type=int, default=None,
                        help=f"q heads, --device cuda only (default {CUDA_DEFAULTS['heads']}; the CPU mode measures "
                             f"{HEADS})")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help=f"k/v heads; fewer than the q heads is GQA (default cpu {HEADS}, cuda "
                             f"{CUDA_DEFAULTS['kv_heads']})")
    parser.add_argument("--window", type=int, default=None,
                        help=f"ReRoPE window, --device cuda only (default {CUDA_DEFAULTS['window']}; the CPU mode "
                             f"measures {WINDOW})")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                        help="methods to time (sdpa is always timed: the ratios are against it; default all, "
                             "cuda: all but paged128)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, method, length, repeats, dtype, kv_heads = args.worker
        print(json.dumps(worker(kind, method, int(length), int(repeats), dtype, int(kv_heads))))
        return
    defaults = CUDA_DEFAULTS if args.device == "cuda" else dict(
        prefill=[1024, 4096, 16384], decode=[4096, 16384, 65536], dtype="float32", heads=HEADS, kv_heads=HEADS,
        window=WINDOW)
    defaults["methods"] = [m for m in METHODS if args.device == "cpu" or m != "paged128"]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.window <= 0:
        parser.error(f"--window must be positive, got {args.window}")
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        parser.error(f"--kv-heads must divide the {args.heads} q heads, got {args.kv_heads}")
    if args.device == "cuda":
        sys.exit(cuda_main(args))
    if args.heads != HEADS or args.window != WINDOW:
        parser.error(f"the CPU mode measures {HEADS} q heads and window {WINDOW} (its RESULTS rows); "
                     "--heads/--window are for --device cuda")
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
    for (kind, length), r in summary.items():
        for method, block_size in PAGED_METHODS.items():
            if r.get(method):
                print(f"  {kind} {length // 1024}k: paged (block_size {block_size}) / fused = "
                      f"{r[method]['seconds'] / r['fused']['seconds']:.2f}")


if __name__ == "__main__":
    main()
