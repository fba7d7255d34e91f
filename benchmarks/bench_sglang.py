"""A small float32 Llama served by SGLang (CPU engine): ropescale's SGLang plugin against stock SGLang, same weights.

    .venv-sglang/bin/python benchmarks/bench_sglang.py                    # issue 56's rows: 1 x 16k prompt
    .venv-sglang/bin/python benchmarks/bench_sglang.py --prompt-tokens 8192 --rounds 3
    .venv-sglang/bin/python benchmarks/bench_sglang.py --rows resonance_yarn native --markdown

Run it in the SGLang venv (scripts/setup_sglang.sh builds it: SGLang 0.5.23 on torch 2.14.1, ropescale from the
checkout with its ``sglang.srt.plugins`` entry point). Nothing is downloaded.

The model: a random Llama built from a config (--layers 6, hidden 384, 6 query heads on 2 KV heads, head dim 64,
MLP 1024, vocab 1024, float32), "trained" to --original 4096 positions, written per method with ``hf.patch`` +
``save_pretrained`` under --workdir (kept between runs):

  yarn            YaRN x4 to 16k with attention_factor 1.0 (the key stock SGLang drops, so the plugin's table
                  differs from stock's: ropescale's serves it);
  resonance_yarn  Resonance-YaRN x4 to 16k (stock SGLang refuses the type);
  per_request     Dynamic-YaRN per request (each request the table of its planned length);
  native          the config as it is: plain RoPE, max_position_embeddings 4096.

Each row serves one checkpoint with one plugin setting (ROPESCALE_SGLANG, read once per process) in its own
process: ``sglang.Engine(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
dtype="float32")`` with SGLANG_USE_CPU_ENGINE=1 and SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 for every row (the
context length is set to the prompt + decode for every row alike), chunked prefill of --chunked-prefill tokens and SGLang's radix cache
(each timed request a fresh random prompt, so nothing is read from the cache: checked), greedy with ignore_eos:

  prefill   one request of --prompt-tokens tokens, streamed: the time until its first token arrives (SGLang's
            forwards of the prompt, chunked as its scheduler does, plus one sample);
  decode    the rest of the same request's stream: tokens/s of --decode-tokens tokens at that length.
  Each the median of --repeats requests, after one short warm-up request.

Baseline ("vs"): yarn/sglang, the SAME yarn checkpoint directory served by stock SGLang (ROPESCALE_SGLANG=0): its
own YaRN rotary at the same length (its table built from ``factor``, attention_factor dropped), the same cost of a
rotation. So the ratios compare the plugin with what a user of stock SGLang would serve for a 16k YaRN model.
"prefill x" is the row's prefill time over the baseline's (<= 1 no slower), "decode x" the row's decode tokens/s
over the baseline's (>= 1 no slower). Issue 56's bar for static tables: prefill x <= 1.02, decode x >= 0.97.
native (plain RoPE served by stock SGLang past its 4096) is an optional second reference: not the same model.
per_request is the mixed workload's method: --shorts requests of --short tokens sent at once with one long request
of --prompt-tokens (each --decode-tokens + 1 asked), timed until every request has its first token and until all are
done, on per_request and on the baseline (the same workload, stock YaRN). A plugin that refuses the method at engine
start (ropescale before commit 5e76e0e, which served per-request tables in SGLang) gets its row printed as "not
served yet (refused at engine start)" with the refusal, not figures. --rounds runs every row that many times, the order reversed
each round (a shared CPU drifts over minutes), and reports the median over rounds.

Each row's result is appended to --results (JSON lines) as it ends. Timings on a shared CPU are noisy: before
each row the 1-minute load average is checked and the row waits (30 s steps, up to --max-wait) while it is above
--max-load; the load before and after each row is printed. Compare ratios within one run.
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

ORIGINAL = 4096  # the model's "training" length
FACTOR = 4.0


def _methods(original: int):
    """Checkpoints by name: (scaling method or None for the config as it is, hf.patch keyword arguments, extra
    config fields)."""
    from ropescale import scaling

    return {
        "native": (None, {}, {}),
        "yarn": (scaling.YaRN(factor=FACTOR, original_max_position=original, attention_factor_override=1.0), {}, {}),
        "resonance_yarn": (scaling.YaRN(factor=FACTOR, original_max_position=original, resonance=True), {}, {}),
        "per_request": (scaling.DynamicYaRN(factor=FACTOR, original_max_position=original, per="request"), {},
                        {"model_max_length": int(FACTOR * original)}),
    }


@dataclass(frozen=True)
class Row:
    checkpoint: str  # a key of _methods()
    baseline: str  # the row it is compared with
    env: dict = field(default_factory=dict)  # the plugin's switch for this row's process
    what: str = ""


ROWS = {
    "yarn/sglang": Row("yarn", "yarn/sglang", {"ROPESCALE_SGLANG": "0"},
                       "the yarn checkpoint on stock SGLang (plugin off): SGLang's own YaRN table and rotation"),
    "yarn/ropescale": Row("yarn", "yarn/sglang", {"ROPESCALE_SGLANG": "1"},
                          "the same checkpoint through the plugin: ropescale's table (attention_factor 1.0 honoured) "
                          "in SGLang's rotary layer"),
    "resonance_yarn": Row("resonance_yarn", "yarn/sglang", {"ROPESCALE_SGLANG": "1"},
                          "Resonance-YaRN x4: ropescale's table in SGLang's rotary layer (plugin)"),
    "per_request": Row("per_request", "yarn/sglang", {"ROPESCALE_SGLANG": "1"},
                       "Dynamic-YaRN per request: the 1 x long row and the mixed workload (or the plugin's refusal)"),
    "native": Row("native", "yarn/sglang", {"ROPESCALE_SGLANG": "0"},
                  "plain RoPE (the config as it is) on stock SGLang, past its 4096: a second reference"),
}
DEFAULT_ROWS = ("yarn/sglang", "yarn/ropescale", "resonance_yarn", "per_request")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench_sglang.py", formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__,
        epilog="rows:\n" + "\n".join(f"  {name:<16}{row.what}" for name, row in ROWS.items()))
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(DEFAULT_ROWS), metavar="ROW",
                        help=f"rows to run, each with its baseline (default: {' '.join(DEFAULT_ROWS)}; "
                             f"choices: {', '.join(ROWS)})")
    parser.add_argument("--prompt-tokens", type=_positive, default=16384 - 128 - 8,
                        help="prompt length (default %(default)s: the methods' 16k less --decode-tokens and the 8 "
                             "SGLang keeps)")
    parser.add_argument("--decode-tokens", type=_positive, default=128, help="tokens timed in decode (default 128)")
    parser.add_argument("--repeats", type=_positive, default=3, help="timed requests per row, median (default 3)")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="run the rows this many times, the order reversed each round, median over rounds "
                             "(default 1)")
    parser.add_argument("--chunked-prefill", type=_positive, default=4096,
                        help="SGLang's chunked_prefill_size (default 4096, what SGLang picks on this machine)")
    parser.add_argument("--shorts", type=_positive, default=7,
                        help="the mixed workload (per_request and its baseline): this many short requests sent with "
                             "one long one of --prompt-tokens (default 7)")
    parser.add_argument("--short", type=_positive, default=512,
                        help="the short requests' prompt length (default 512: with --decode-tokens they fit the "
                             "trained length, so per_request serves them the native table)")
    parser.add_argument("--layers", type=_positive, default=6, help="decoder layers (default 6)")
    parser.add_argument("--hidden", type=_positive, default=384, help="hidden size, a multiple of 64 (default 384)")
    parser.add_argument("--original", type=_positive, default=ORIGINAL,
                        help=f"the model's trained length; the methods extend it x{FACTOR:g} (default %(default)s)")
    parser.add_argument("--max-load", type=float, default=1.5,
                        help="wait before a row while the 1-minute load average is above this (default 1.5)")
    parser.add_argument("--max-wait", type=float, default=600,
                        help="seconds to wait for the load at most per row, then run anyway (default 600)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ropescale-bench-sglang",
                        help="where the checkpoints are kept between runs (default %(default)s)")
    parser.add_argument("--results", type=Path, default=None,
                        help="JSON-lines file each row's result is appended to as it ends (default "
                             "WORKDIR/results.jsonl)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (for RESULTS.md)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # internal: one row's engine (a JSON job)
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error(f"--hidden must be a multiple of 64 (head dim 64), got {args.hidden}")
    longest = int(FACTOR * args.original)
    if args.prompt_tokens + args.decode_tokens + 8 > longest:
        parser.error(f"--prompt-tokens + --decode-tokens + 8 must be at most {longest} (the methods' length), got "
                     f"{args.prompt_tokens + args.decode_tokens + 8}")
    rows = []
    for name in args.rows:  # each baseline first, once
        for row in (ROWS[name].baseline, name):
            if row not in rows:
                rows.append(row)
    args.rows = rows
    if args.results is None:
        args.results = args.workdir / "results.jsonl"
    return args


def checkpoints(args, names) -> dict[str, Path]:
    """The small Llama written with each method (hf.patch + save_pretrained), once per model shape."""
    shape = f"l{args.layers}-h{args.hidden}-o{args.original}"
    paths = {name: args.workdir / shape / name for name in names}
    missing = [name for name, path in paths.items() if not (path / "config.json").is_file()]
    if missing:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from ropescale import hf

        config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=1024,
                             num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                             num_key_value_heads=2, head_dim=64, max_position_embeddings=args.original,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             tie_word_embeddings=False, torch_dtype="float32")
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        methods = _methods(args.original)
        for name in missing:
            method, kwargs, extra = methods[name]
            if method is not None or kwargs:
                hf.patch(model, method, **kwargs)
            for key, value in extra.items():
                setattr(model.config, key, value)
            model.save_pretrained(paths[name])
            if method is not None or kwargs:
                hf.unpatch(model)
            for key in extra:
                if key in model.config.__dict__:
                    delattr(model.config, key)
    return paths


def serve(job) -> dict:
    """In the row's process: one engine, one request at a time, each streamed and timed."""
    import random

    import sglang

    length, tokens = job["prompt_tokens"], job["decode_tokens"]
    context = length + tokens + 8
    try:
        engine = sglang.Engine(model_path=job["path"], skip_tokenizer_init=True, dtype="float32",
                               context_length=context, random_seed=0, log_level="error", device="cpu",
                               attention_backend="torch_native", disable_cuda_graph=True, mem_fraction_static=0.05,
                               chunked_prefill_size=job["chunked_prefill"],
                               max_total_tokens=2 * context + job["shorts"] * (job["short"] + tokens + 8) + 256)
    except BaseException as err:  # noqa: BLE001 (a refusal at engine start is this row's result)
        return {"error": f"{type(err).__name__}: {err}"}
    settings = {name: getattr(engine.server_args, name, None)
                for name in ("chunked_prefill_size", "disable_radix_cache")}
    plugin = "ropescale.sglang.rotary" in sys.modules  # imported by the plugin only when it is active
    rng = random.Random(0)

    def run(prompt, new):
        """(prefill s, decode s, completion tokens, cached tokens) of one streamed request."""
        params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        start = time.perf_counter()
        first = last = None
        for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
            now = time.perf_counter()
            first = now if first is None else first
            last, meta = now, chunk["meta_info"]
        return first - start, last - first, meta["completion_tokens"], meta.get("cached_tokens", 0)

    def run_mixed(prompts, new):
        """(seconds until every request has its first token, seconds until all are done) of requests sent at once."""
        params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        start, first, done = time.perf_counter(), {}, {}
        for chunk in engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts), stream=True):
            now, index = time.perf_counter(), chunk.get("index", 0)
            first.setdefault(index, now)
            done[index] = chunk["meta_info"]["completion_tokens"]
        if sorted(done.values()) != [new] * len(prompts):
            raise RuntimeError(f"asked {new} tokens of each of {len(prompts)} requests, got {done}")
        return max(first.values()) - start, time.perf_counter() - start

    try:
        run([rng.randrange(10, 1000) for _ in range(64)], 8)  # warm-up: first calls, the decode step's shapes
        mixed = []
        for _ in range(job["repeats"] if job["mixed"] else 0):
            prompts = [[rng.randrange(10, 1000) for _ in range(job["short"])] for _ in range(job["shorts"])]
            prompts.insert(job["shorts"] // 2, [rng.randrange(10, 1000) for _ in range(length)])
            mixed.append(run_mixed(prompts, 1 + tokens))
        timings = []
        for _ in range(job["repeats"]):
            prefill, decode, done, cached = run([rng.randrange(10, 1000) for _ in range(length)], 1 + tokens)
            if done != 1 + tokens or cached:
                raise RuntimeError(f"asked {1 + tokens} tokens of a fresh prompt, got {done} with {cached} cached")
            timings.append((prefill, decode))
    finally:
        engine.shutdown()
    return {"prefill_s": statistics.median(t[0] for t in timings),
            "decode_tok_s": tokens / statistics.median(t[1] for t in timings),
            "mixed_first_s": statistics.median(m[0] for m in mixed) if mixed else None,
            "mixed_s": statistics.median(m[1] for m in mixed) if mixed else None,
            "timings": timings, "mixed_timings": mixed, "settings": settings, "plugin_loaded": plugin, "version": sglang.__version__}


def wait_for_load(args, name: str) -> float:
    """The 1-minute load average once it is at most --max-load, or after --max-wait seconds (said on stderr)."""
    waited, load = 0.0, os.getloadavg()[0]
    while load > args.max_load and waited < args.max_wait:
        print(f"{name}: load {load:.2f} > {args.max_load}, waiting 30 s", file=sys.stderr, flush=True)
        time.sleep(30)
        waited += 30
        load = os.getloadavg()[0]
    if load > args.max_load:
        print(f"{name}: load still {load:.2f} after {waited:.0f} s: running anyway", file=sys.stderr, flush=True)
    return load


def run_row(args, name: str, path: Path) -> dict:
    mixed = name == "per_request" or name == ROWS["per_request"].baseline and "per_request" in args.rows
    job = {"path": str(path), "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
           "repeats": args.repeats, "mixed": mixed, "shorts": args.shorts, "short": args.short,
           "chunked_prefill": args.chunked_prefill}
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
           **ROWS[name].env}
    load = wait_for_load(args, name)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--serve", json.dumps(job)], env=env, capture_output=True,
                         text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.exit(f"bench_sglang: row {name} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if "error" in result:  # the engine refused the checkpoint at start: its last line, which names why
        result["error"] = _refusal(result["error"], out.stderr)
    elif result["plugin_loaded"] != (ROWS[name].env.get("ROPESCALE_SGLANG") == "1"):
        sys.exit(f"bench_sglang: row {name}: ropescale's plugin {'' if result['plugin_loaded'] else 'not '}loaded")
    result.update(row=name, seconds=time.perf_counter() - start, load_before=load, load_after=os.getloadavg()[0],
                  prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, date=time.strftime("%F %T"))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def _refusal(error: str, stderr: str) -> str:
    """ropescale's refusal as the engine's child printed it, else the engine's own error line."""
    for line in reversed(stderr.splitlines()):
        if "ropescale.sglang:" in line:
            return line[line.index("ropescale.sglang:"):].strip()
    return error.strip().splitlines()[-1] if error.strip() else "the engine failed at start"


def median_of_rounds(runs: list[dict]) -> dict:
    if len(runs) == 1 or "error" in runs[0]:
        return runs[0]
    return {**runs[0], "prefill_s": statistics.median(r["prefill_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            **{key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None
               for key in ("mixed_first_s", "mixed_s")},
            "seconds": sum(r["seconds"] for r in runs), "load_after": runs[-1]["load_after"], "rounds": runs}


def table(args, measured) -> str:
    header = ["row", "vs", "prompt", "prefill s", "prefill x", "decode tok/s", "decode x", "load"]
    rows = []
    for name in args.rows:
        m, b = measured[name], measured[ROWS[name].baseline]
        loads = f"{m['load_before']:.1f}-{m['load_after']:.1f}"
        if "error" in m:
            rows.append([name, ROWS[name].baseline, str(args.prompt_tokens), "not served yet (refused at engine "
                         "start)", "-", "-", "-", loads])
            continue
        rows.append([name, ROWS[name].baseline, str(args.prompt_tokens), f"{m['prefill_s']:.2f}",
                     f"{m['prefill_s'] / b['prefill_s']:.3f}", f"{m['decode_tok_s']:.2f}",
                     f"{m['decode_tok_s'] / b['decode_tok_s']:.3f}", loads])
    mixed = [name for name in args.rows if measured[name].get("mixed_s") or name == "per_request"]
    if mixed:
        rows.append([])
        rows.append(["mixed workload", "vs", "requests", "all first s", "first x", "all done s", "done x", "load"])
        if args.markdown:
            rows.append(["---"] * len(header))
        for name in mixed:
            m, b = measured[name], measured[ROWS[name].baseline]
            loads = f"{m['load_before']:.1f}-{m['load_after']:.1f}"
            what = f"1 x {args.prompt_tokens} + {args.shorts} x {args.short}"
            if "error" in m:
                rows.append([name, ROWS[name].baseline, what, "not served yet (refused at engine start)", "-", "-",
                             "-", loads])
                continue
            rows.append([name, ROWS[name].baseline, what, f"{m['mixed_first_s']:.2f}",
                         f"{m['mixed_first_s'] / b['mixed_first_s']:.3f}", f"{m['mixed_s']:.2f}",
                         f"{m['mixed_s'] / b['mixed_s']:.3f}", loads])
    if args.markdown:
        return "\n".join("| " + " | ".join(line) + " |" if line else "" for line in [header, ["---"] * len(header),
                                                                                   *rows])
    widths = [max(len(line[i]) for line in [header, *rows] if line) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        print("RESULT " + json.dumps(serve(json.loads(args.serve))), flush=True)
        return 0
    import platform

    paths = checkpoints(args, sorted({ROWS[name].checkpoint for name in args.rows}))
    rounds: dict[str, list[dict]] = {name: [] for name in args.rows}
    for round_ in range(args.rounds):
        for name in (args.rows if round_ % 2 == 0 else args.rows[::-1]):
            if rounds[name] and "error" in rounds[name][0]:
                continue  # a refusal is the same every round
            r = run_row(args, name, paths[ROWS[name].checkpoint])
            rounds[name].append(r)
            what = r["error"] if "error" in r else \
                f"prefill {r['prefill_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s"
            print(f"{name}: {r['seconds']:.0f} s, load {r['load_before']:.2f}-{r['load_after']:.2f}; {what}"
                  + (f" (round {round_ + 1}/{args.rounds})" if args.rounds > 1 else ""), file=sys.stderr, flush=True)
    measured = {name: median_of_rounds(runs) for name, runs in rounds.items()}
    served = next(m for m in measured.values() if "error" not in m)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, head dim 64, vocab 1024, float32, trained to "
          f"{args.original}, methods x{FACTOR:g}; SGLang {served['version']} CPU engine, torch_native attention, "
          f"{served['settings']}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; 1 request of "
          f"{args.prompt_tokens} tokens, {args.decode_tokens} decoded, median of {args.repeats} x {args.rounds} "
          f"round(s); vs = the baseline (yarn/sglang: the same yarn checkpoint on stock SGLang, plugin off); x = the "
          f"row over it; load = 1-min load average before-after the row")
    print(table(args, measured))
    for name in args.rows:
        if "error" in measured[name]:
            print(f"{name}: {measured[name]['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
