"""Peak memory and time of one training step (forward + backward) of a ReRoPE-patched Llama against
the same model with plain SDPA attention (unpatched transformers), printed as ratios.

    python benchmarks/bench_rerope_train.py                      # CPU, 2k / 4k / 8k tokens
    python benchmarks/bench_rerope_train.py --lengths 2048 4096 --composite-max 4096
    python benchmarks/bench_rerope_train.py --device cuda --autocast bf16 --lengths 8192 16384

Model: 2 layers, d_model 512, 8 heads of 64, GQA 8/4, vocab 1000, batch 1; ReRoPE window 512 (Leaky,
k = 16: both rotations of each side run). Rows: ``sdpa`` is the unpatched model (transformers' SDPA,
``is_causal``: PyTorch's flash kernel); ``rerope`` the patched model on its training path
(``ops.rerope_attention_train``); ``composite`` the patched model on the path it took before issue 26
(``ops.rerope_attention_composite``: an [L, L + 1] mask and head dim D + 2), up to ``--composite-max``
tokens.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the step, less what was allocated
before it. On CPU the peak resident set size of the step, in a fresh process per row with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB (so every large tensor is its own mapping, returned to
the system when freed, and RSS follows the live tensor bytes), after one untimed step: the kernel's
peak counter (VmHWM) is reset before the measured step (``/proc/self/clear_refs``) and the RSS
before it is subtracted. Time: one more process with the default allocator (a fixed mmap threshold
page-faults every large allocation) holding every row's model, one untimed step each, then
``--repeats`` rounds of one step per row in turn: each row's median, and the median of the
per-round ratios (robust to a shared machine's load drifting between rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name, median_time  # noqa: E402

warnings.filterwarnings("ignore")

WINDOW = 512
LEAKY_K = 16.0


def model_for(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).train()


def _status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def build(row: str, length: int, device: str, autocast: str):
    """The row's model and its training step."""
    from ropescale import hf, ops

    model = model_for(device)
    if row != "sdpa":
        hf.patch(model, None, attention="rerope", window=WINDOW, leaky_k=LEAKY_K)
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[autocast]
    train = ops.rerope_attention_train

    def step():
        ops.rerope_attention_train = ops.rerope_attention_composite if row == "composite" else train
        try:
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
        finally:
            ops.rerope_attention_train = train
        model.zero_grad(set_to_none=True)

    return step


def peak(row: str, length: int, device: str, autocast: str) -> int:
    """Peak memory (bytes) of one step after an untimed one, in this process."""
    step = build(row, length, device, autocast)
    step()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    before = _status("VmRSS:")
    step()
    return _status("VmHWM:") - before


def times(rows, length: int, device: str, autocast: str, repeats: int) -> dict:
    """{row: median seconds}, and {"ratio_<row>": median of the per-round ratios to sdpa}."""
    steps = {row: build(row, length, device, autocast) for row in rows}
    for step in steps.values():
        step()
    samples = {row: [] for row in rows}
    for _ in range(repeats):
        for row, step in steps.items():
            samples[row].append(median_time(step, repeats=1, warmup=0, device=device))
    result = {row: statistics.median(t) for row, t in samples.items()}
    for row in rows:
        result["ratio_" + row] = statistics.median(t / s for t, s in zip(samples[row], samples["sdpa"]))
    return result


def _subprocess(args_list, env=None):
    done = subprocess.run([sys.executable, __file__, *args_list], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_length(length, rows, args) -> dict:
    """{row: {"peak": bytes or None}, "times": {...} or None}."""
    if args.device == "cuda":
        result = {}
        for row in rows:
            try:
                result[row] = {"peak": peak(row, length, "cuda", args.autocast)}
            except torch.OutOfMemoryError:
                result[row] = {"peak": None}
            torch.cuda.empty_cache()
        fits = [row for row in rows if result[row]["peak"] is not None]
        result["times"] = times(fits, length, "cuda", args.autocast, args.repeats)
        return result
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    result = {row: {"peak": _subprocess(["--one-peak", row, str(length), "--autocast", args.autocast], env)}
              for row in rows}
    result["times"] = _subprocess(["--one-time", ",".join(rows), str(length), "--autocast", args.autocast,
                                   "--repeats", str(args.repeats)])
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--autocast", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--composite-max", type=int, default=8192,
                        help="longest length the old composite path is run at")
    parser.add_argument("--one-peak", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--one-time", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_peak:
        print(json.dumps(peak(args.one_peak[0], int(args.one_peak[1]), "cpu", args.autocast)))
        return
    if args.one_time:
        print(json.dumps(times(args.one_time[0].split(","), int(args.one_time[1]), "cpu", args.autocast,
                               args.repeats)))
        return
    print(f"# ReRoPE training step (fwd + bwd), {device_name(args.device)}, torch {torch.__version__}, "
          f"{args.autocast}, window {WINDOW}, leaky_k {LEAKY_K:g}, {args.repeats} rounds")
    print("| tokens | sdpa peak MiB | rerope peak MiB (x sdpa) | composite peak MiB (x sdpa) | sdpa s | "
          "rerope s (x sdpa) | composite s (x sdpa) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for length in args.lengths:
        rows = ["sdpa", "rerope"] + (["composite"] if length <= args.composite_max else [])
        r = measure_length(length, rows, args)
        t = r["times"] or {}

        def mem(row):
            if row not in r:
                return "not run"
            if r[row]["peak"] is None:
                return "failed (out of memory?)"
            value = f"{r[row]['peak'] / 2**20:.0f}"
            return value if row == "sdpa" else f"{value} ({r[row]['peak'] / r['sdpa']['peak']:.2f}x)"

        def sec(row):
            if row not in t:
                return "not run"
            return f"{t[row]:.2f}" if row == "sdpa" else f"{t[row]:.2f} ({t['ratio_' + row]:.2f}x)"

        print(f"| {length} | {mem('sdpa')} | {mem('rerope')} | {mem('composite')} | {sec('sdpa')} | {sec('rerope')} | "
              f"{sec('composite')} |", flush=True)


if __name__ == "__main__":
    main()
