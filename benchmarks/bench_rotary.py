"""The fused q/k rotation against what a user would run instead, measured in the same run.

    python benchmarks/bench_rotary.py            # 1, 512, 4096 and 16384 tokens (CPU: a few minutes)
    python benchmarks/bench_rotary.py --quick    # 1, 512 and 4096 tokens, fewer repeats (CI size)

CPU (always): Llama-2-7B (32 q / 32 kv heads) and Llama-3-8B (32 / 8, GQA) shapes, head_dim 128,
batch 1, fp32 and bf16, q/k in the layout LlamaAttention hands them over (the [B, H, S, D] view of
[B, S, H, D]), cos/sin from transformers' LlamaRotaryEmbedding. Per row:
  * hf:       transformers' eager ``apply_rotary_pos_emb(q, k, cos, sin)``
  * rs:       ``ropescale.ops.apply_rotary_qk(q, k, cos, sin)``: same inputs, same result
  * copy:     the copy floor, ``q.clone(); k.clone()`` (forward+backward: two copies of each, one for
              the outputs and one for the gradients)
  * hf+emb / rs_pos (forward): the whole step from position ids: transformers' rotary module
              then apply_rotary_pos_emb, against ``apply_rotary_pos_qk(q, k, positions, inv_freq)``
and the ratios hf/rs (speedup) and rs/copy (distance from the floor). Medians of interleaved
rounds (the candidates of a row take turns, so load changes on a shared machine hit all alike).

GPU (when one is present): the same table with times in microseconds and GB/s, the device's copy
bandwidth measured in the same run, and FlashInfer's own RoPE benchmark shape (Llama-3-8B heads,
bf16, batch 2, in place) compared with the figures FlashInfer and vLLM published for it.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name  # noqa: E402

from ropescale import ops  # noqa: E402

warnings.filterwarnings("ignore")

# name: (q heads, kv heads, head_dim, rope base)
SHAPES = {"llama2-7b": (32, 32, 128, 10000.0), "llama3-8b": (32, 8, 128, 500000.0)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# FlashInfer's benchmarks/bench_rope.py: Llama-3-8B heads (32 q, 8 kv, head_dim 128, rotary 128),
# bf16, base 5e5, NeoX layout, in place, batch 2 x seq_len tokens, L2 flushed between runs. Median
# latency in ms on an H100 NVL, as posted in https://github.com/flashinfer-ai/flashinfer/pull/2109
# (comment of 2025-12-11, "before this PR" table; vLLM = its rotary_embedding CUDA op).
PUBLISHED_MS = {  # seq_len: (FlashInfer, vLLM)
    1024: (0.018560, 0.032960),
    4096: (0.059904, 0.114464),
    16384: (0.224192, 0.436064),
}
PUBLISHED_DEVICE = "NVIDIA H100 NVL"


def llama_rotary(head_dim: int, base: float):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=head_dim * 32, num_attention_heads=32, head_dim=head_dim,
                         max_position_embeddings=1 << 20, rope_parameters={"rope_type": "default", "rope_theta": base})
    return LlamaRotaryEmbedding(config)


def make_inputs(shape: str, tokens: int, dtype: torch.dtype, device: str, batch: int = 1):
    heads_q, heads_k, head_dim, base = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, tokens, heads_q, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, heads_k, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    rotary = llama_rotary(head_dim, base).to(device)
    positions = torch.arange(tokens, device=device)[None].expand(batch, tokens)
    cos, sin = rotary(q, positions)
    return q, k, cos, sin, positions, rotary


def timed(fns: dict, device: str, budget_s: float, min_rounds: int, max_rounds: int) -> dict:
    """Median seconds of each fn(). The candidates run in interleaved rounds, so a change in the
    machine's load during the measurement hits all of them alike (this CPU is shared); as many
    rounds as fit in the budget. Cheap calls get an untimed warm-up; expensive ones pay the same
    page faults on every call, warm or not."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once(fn):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    first = {name: once(fn) for name, fn in fns.items()}
    times = {name: [] if t < 0.1 else [t] for name, t in first.items()}
    rounds = int(min(max_rounds, max(min_rounds, budget_s / max(sum(first.values()), 1e-9))))
    for _ in range(rounds - min(len(v) for v in times.values())):
        for name, fn in fns.items():
            times[name].append(once(fn))
    return {name: statistics.median(v) for name, v in times.items()}


def candidates(q, k, cos, sin, positions, rotary, backward: bool):
    """name -> callable, for one configuration."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq, scale = rotary.inv_freq, rotary.attention_scaling
    if not backward:
        return {
            "hf": lambda: apply_rotary_pos_emb(q, k, cos, sin),
            "rs": lambda: ops.apply_rotary_qk(q, k, cos, sin),
            "copy": lambda: (q.clone(), k.clone()),
            "hf+emb": lambda: apply_rotary_pos_emb(q, k, *rotary(q, positions)),
            "rs_pos": lambda: ops.apply_rotary_pos_qk(q, k, positions, inv_freq, scale),
        }
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
    grad_q, grad_k = torch.ones_like(q), torch.ones_like(k)

    def fwd_bwd(fn):
        def run():
            out_q, out_k = fn()
            torch.autograd.backward((out_q, out_k), (grad_q, grad_k))
            qg.grad = kg.grad = None
        return run

    return {
        "hf": fwd_bwd(lambda: apply_rotary_pos_emb(qg, kg, cos, sin)),
        "rs": fwd_bwd(lambda: ops.apply_rotary_qk(qg, kg, cos, sin)),
        "copy": lambda: (q.clone(), k.clone(), grad_q.clone(), grad_k.clone()),
    }


def moved_bytes(q, k, backward: bool) -> int:
    """Bytes read and written by the rotation (q and k in, q and k out; twice with the backward)."""
    one_pass = 2 * (q.numel() + k.numel()) * q.element_size()
    return one_pass * (2 if backward else 1)


def run_table(device: str, token_counts, budget_s: float, min_repeats: int, max_repeats: int):
    rows = []
    unit, scale = ("ms", 1e3) if device == "cpu" else ("us", 1e6)
    header = (f"{'shape':<10} {'tokens':>6} {'dtype':<5} {'pass':<7} {'hf':>9} {'rs':>9} {'copy':>9} "
              f"{'hf/rs':>6} {'rs/copy':>7} {'hf+emb':>9} {'rs_pos':>9} {'(hf+emb)/rs_pos':>15}")
    if device == "cuda":
        header += f" {'rs GB/s':>8} {'copy GB/s':>9}"
    print(f"times in {unit}, medians; hf/rs > 1: ropescale faster; rs/copy: 1 is the copy floor")
    print(header)
    for shape in SHAPES:
        for tokens in token_counts:
            for dtype_name, dtype in DTYPES.items():
                for backward in (False, True):
                    q, k, cos, sin, positions, rotary = make_inputs(shape, tokens, dtype, device)
                    fns = candidates(q, k, cos, sin, positions, rotary, backward)
                    if device == "cpu":  # fewer rounds where one round takes seconds
                        t = timed(fns, device, budget_s, min_repeats if tokens <= 4096 else 3, max_repeats)
                    else:  # CUDA events, L2 flushed: what the kernels cost, not the Python around them
                        t = {name: gpu_event_time(fn, iters=50) for name, fn in fns.items()}
                    row = dict(shape=shape, tokens=tokens, dtype=dtype_name, backward=backward, **t)
                    rows.append(row)
                    line = (f"{shape:<10} {tokens:>6} {dtype_name:<5} {'fwd+bwd' if backward else 'fwd':<7} "
                            f"{t['hf'] * scale:>9.3f} {t['rs'] * scale:>9.3f} {t['copy'] * scale:>9.3f} "
                            f"{t['hf'] / t['rs']:>6.2f} {t['rs'] / t['copy']:>7.2f} ")
                    if "rs_pos" in t:  # forward only
                        line += f"{t['hf+emb'] * scale:>9.3f} {t['rs_pos'] * scale:>9.3f} {t['hf+emb'] / t['rs_pos']:>15.2f}"
                    else:
                        line += f"{'':>9} {'':>9} {'':>15}"
                    if device == "cuda":
                        nbytes = moved_bytes(q, k, backward)
                        line += f" {nbytes / t['rs'] / 1e9:>8.0f} {nbytes / t['copy'] / 1e9:>9.0f}"
                    print(line, flush=True)
                    del q, k, cos, sin
    return rows


def check_targets(rows):
    """The issue's targets at 4096 tokens, forward: >= 3x transformers eager, <= 2x the copy floor."""
    print("\ntargets at 4096 tokens, forward (>= 3x faster than transformers eager, within 2x of the copy floor):")
    for row in rows:
        if row["tokens"] == 4096 and not row["backward"]:
            speedup, floor = row["hf"] / row["rs"], row["rs"] / row["copy"]
            verdict = "met" if speedup >= 3 and floor <= 2 else "NOT met"
            print(f"  {row['shape']:<10} {row['dtype']}: {speedup:.2f}x faster, {floor:.2f}x the copy floor -> {verdict}")


def gpu_event_time(fn, iters: int = 100) -> float:
    """Median seconds of fn() by CUDA events, with L2 flushed before each run (as FlashInfer does)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_published_comparison():
    """FlashInfer's bench_rope.py configuration on this GPU, against the published figures."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * big.numel() / gpu_event_time(lambda: big.clone(), iters=20) / 1e9
    del big
    print(f"\nFlashInfer's RoPE benchmark shape (Llama-3-8B heads, bf16, batch 2, in place), this device's "
          f"copy bandwidth {copy_bw:.0f} GB/s (1 GiB clone, read + write)")
    print(f"published: {PUBLISHED_DEVICE}; their GB/s = the same bytes over their median latency")
    print(f"{'seq_len':>7} {'rs us':>8} {'rs GB/s':>8} {'of copy':>7} {'FI GB/s':>8} {'vLLM GB/s':>9} "
          f"{'rs/FI':>6} {'rs/vLLM':>7}")
    for seq_len, (fi_ms, vllm_ms) in PUBLISHED_MS.items():
        q, k, _, _, positions, rotary = make_inputs("llama3-8b", seq_len, torch.bfloat16, "cuda", batch=2)
        nbytes = moved_bytes(q, k, backward=False)
        t = gpu_event_time(lambda: ops.apply_rotary_pos_qk_(q, k, positions, rotary.inv_freq))
        rs_bw, fi_bw, vllm_bw = nbytes / t / 1e9, nbytes / (fi_ms * 1e-3) / 1e9, nbytes / (vllm_ms * 1e-3) / 1e9
        print(f"{seq_len:>7} {t * 1e6:>8.1f} {rs_bw:>8.0f} {rs_bw / copy_bw:>7.2f} {fi_bw:>8.0f} {vllm_bw:>9.0f} "
              f"{rs_bw / fi_bw:>6.2f} {rs_bw / vllm_bw:>7.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1, 512 and 4096 tokens, fewer repeats")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                        help="cpu, cuda, or all available (default)")
    args = parser.parse_args()

    token_counts = (1, 512, 4096) if args.quick else (1, 512, 4096, 16384)
    budget_s, min_repeats, max_repeats = (0.5, 3, 10) if args.quick else (3.0, 5, 30)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        if args.device == "cuda":
            sys.exit("bench_rotary: --device cuda but no GPU is available")
        devices.remove("cuda")

    print(f"bench_rotary.py{' --quick' if args.quick else ''}, {datetime.date.today()}, torch {torch.__version__}")
    for device in devices:
        print(f"\n== {device_name(device)}")
        rows = run_table(device, token_counts, budget_s, min_repeats, max_repeats)
        if device == "cpu":
            check_targets(rows)
        else:
            run_published_comparison()


if __name__ == "__main__":
    main()
