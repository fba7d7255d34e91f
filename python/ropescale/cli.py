"""The ``ropescale`` command (``python -m ropescale``): look at what a RoPE scaling method does.

    ropescale demo                          train short (32), test long (128): the methods side by side
    ropescale table --method yarn --factor 16 --plot wavelengths.png
    ropescale base-bound 4096 32768 --dim 128
    ropescale decay --base 10000 --dim 128 --plot decay.png
    ropescale gap --train-length 64 --test-length 256 --dim 64 --plot gap.png
    ropescale posgen semi_recursive --n 4 --length 24
    ropescale eval perplexity MODEL_DIR --text book.txt --max-length 4096

Every command takes ``--json`` for machine output; bad arguments print a usage error and exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from . import scaling

# Method names accepted by --method: transformers' rope types plus ropescale's resonance ones.
METHOD_CHOICES = sorted(scaling.METHODS) + ["resonance", "resonance_yarn"]


class UsageError(Exception):
    """A bad argument found after parsing (reported like argparse's own errors: usage, exit 2)."""


# ---------------------------------------------------------------------------------------------
# Argument types and shared options


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _even_dim(text: str) -> int:
    value = _positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"rotary dim must be even, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _png(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is written as PNG: the file name must end in .png, got {text!r}")
    return text


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")


def _add_plot(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", type=_png, metavar="FILE.png", help=f"also write {what} as a PNG")


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_method(p: argparse.ArgumentParser, default: str, factor: float | None) -> None:
    g = p.add_argument_group("method")
    g.add_argument("--method", default=default, choices=METHOD_CHOICES, help=f"scaling method (default {default})")
    g.add_argument("--factor", type=_positive_float, default=factor, help=f"scale factor s (default {factor})")
    g.add_argument("--original-max-position", type=_positive_int, default=4096,
                   help="pre-training context L (default 4096)")
    g.add_argument("--beta-fast", type=_positive_float, default=32.0, help="YaRN beta_fast (default 32)")
    g.add_argument("--beta-slow", type=_positive_float, default=1.0, help="YaRN beta_slow (default 1)")
    g.add_argument("--seq-len", type=_positive_int, default=None, help="current length (dynamic methods)")
    g.add_argument("--resonance", action="store_true", help="round wavelengths to integers (Resonance RoPE)")


def _method(args, name: str | None = None) -> scaling.RopeScaling:
    """The scaling method the options describe (``name`` overrides ``--method``)."""
    name = name or args.method
    params: dict[str, Any] = {"rope_type": name, "original_max_position_embeddings": args.original_max_position}
    if args.factor is not None:
        params["factor"] = args.factor
    if name in ("yarn", "resonance_yarn", "dynamic_yarn"):
        params.update(beta_fast=args.beta_fast, beta_slow=args.beta_slow)
    if name == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if name == "longrope":
        raise UsageError("longrope needs per-dimension factor lists: use ropescale.scaling.LongRoPE from Python")
    if args.factor is None and name in ("linear", "ntk", "dynamic", "yarn", "resonance_yarn", "llama3"):
        raise UsageError(f"--method {name} needs --factor")
    try:
        method = scaling.from_hf(params, max_position_embeddings=args.original_max_position)
    except ValueError as err:
        raise UsageError(str(err).replace("from_hf: ", f"--method {name}: ")) from None
    if args.resonance and not method.resonance:
        method = type(method)(**{**method.__dict__, "resonance": True})
    return method


def _method_label(args, name: str | None = None) -> str:
    name = name or args.method
    return name + (" + resonance" if args.resonance and not name.startswith("resonance") else "")


def _dump(obj: Any) -> None:
    json.dump(_json_safe(obj), sys.stdout, indent=1)
    print()


def _json_safe(obj: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _progress(iterable, quiet: bool, **kwargs):
    if quiet or not sys.stderr.isatty():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


def _show_progress(args) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


# ---------------------------------------------------------------------------------------------
# table


def _method_table(method: scaling.RopeScaling, dim: int, base: float, seq_len: int | None) -> list[dict]:
    plain = scaling.Default().inv_freq(dim, base)
    table = method.inv_freq(dim, base, seq_len=seq_len)
    scales = [t / s if s > 0 else math.inf for t, s in zip(plain.tolist(), table.tolist())]
    top = max(scales)
    rows = []
    for i, (theta, scaled) in enumerate(zip(plain.tolist(), table.tolist())):
        scale = scales[i]
        # What the method does to this pair: keep it (extrapolate), divide it by the full factor
        # (interpolate), or something in between.
        regime = "keep" if abs(scale - 1) < 1e-6 else "interpolate" if abs(scale - top) < 1e-6 * top else "blend"
        rows.append({
            "regime": regime,
            "pair": i,
            "inv_freq": scaled,
            "wavelength": 2 * math.pi / scaled if scaled > 0 else math.inf,
            "scale": theta / scaled if scaled > 0 else math.inf,  # how much this pair is interpolated
        })
    return rows


def _print_table(name: str, method: scaling.RopeScaling, dim: int, base: float, seq_len, as_json: bool) -> None:
    rows = _method_table(method, dim, base, seq_len)
    factor = method.attention_factor_for(seq_len)
    if as_json:
        _dump({"method": name, "dim": dim, "base": base, "attention_factor": factor, "rows": rows})
        return
    print(f"{name}: rotary dim {dim}, base {base:g}, attention factor {factor:.6f}")
    print(f"{'pair':>4} {'regime':>11} {'inv_freq':>13} {'wavelength':>13} {'scale':>9}")
    for r in rows:
        print(f"{r['pair']:>4} {r['regime']:>11} {r['inv_freq']:>13.6e} {r['wavelength']:>13.2f} {r['scale']:>9.4f}")


def _cmd_table(args) -> int:
    method = _method(args)
    compare = {name: _method(args, name) for name in args.compare or []}
    _print_table(_method_label(args), method, args.dim, args.base, args.seq_len, args.json)
    if args.plot:
        from . import plots

        tables = {"default (RoPE)": scaling.Default().inv_freq(args.dim, args.base)}
        tables[_method_label(args)] = method.inv_freq(args.dim, args.base, seq_len=args.seq_len)
        for name, other in compare.items():
            tables[_method_label(args, name)] = other.inv_freq(args.dim, args.base, seq_len=args.seq_len)
        plots.wavelengths(tables, args.plot, original_max_position=args.original_max_position)
        _note(args, f"wrote {args.plot}")
    return 0


def _note(args, message: str) -> None:
    # Notes go to stderr when stdout carries JSON.
    print(message, file=sys.stderr if args.json else sys.stdout)


# ---------------------------------------------------------------------------------------------
# base-bound, decay, gap


def _cmd_base_bound(args) -> int:
    from . import ops

    bounds = []
    for length in _progress(args.context_length, args.quiet or len(args.context_length) == 1, desc="base bound"):
        bounds.append({"context_length": length, "base_lower_bound": ops.base_lower_bound(length, args.dim)})
    if args.json:
        _dump({"dim": args.dim, "bounds": bounds})
        return 0
    print(f"Smallest RoPE base with B_m >= 0 for every m <= L (Men et al.), rotary dim {args.dim}:")
    print(f"{'context L':>12} {'base lower bound':>18}")
    for b in bounds:
        print(f"{b['context_length']:>12} {b['base_lower_bound']:>18.4g}")
    return 0


def _cmd_decay(args) -> int:
    from . import ops

    method = _method(args)
    inv_freq = method.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=_float64())
    curve = ops.similarity_decay(inv_freq, args.max_distance)
    effective = ops.effective_context_length(inv_freq, args.max_distance)
    first_negative = effective + 1 if effective < args.max_distance else None
    label = _method_label(args)
    if args.json:
        _dump({
            "method": label, "dim": args.dim, "base": args.base, "max_distance": args.max_distance,
            "effective_context_length": effective, "first_negative": first_negative,
            "curve": curve.tolist(),
        })
    else:
        print(f"Similarity decay B_m = sum_i cos(m theta_i): {label}, rotary dim {args.dim}, base {args.base:g}")
        if first_negative is None:
            print(f"B_m >= 0 for every m <= {args.max_distance}: effective context >= {effective} (raise --max-distance)")
        else:
            print(f"effective context length: {effective} (first negative B_m at m = {first_negative})")
        marks = sorted({0, 1, *[2**p for p in range(1, 64) if 2**p <= args.max_distance], args.max_distance,
                        *([first_negative] if first_negative is not None else [])})
        print(f"{'m':>10} {'B_m':>10}")
        for m in marks:
            print(f"{m:>10} {float(curve[m]):>10.4f}" + ("   <- first negative" if m == first_negative else ""))
    if args.plot:
        from . import plots

        plots.decay(curve, args.plot, first_negative,
                    title=f"Similarity decay: {label}, dim {args.dim}, base {args.base:g}")
        _note(args, f"wrote {args.plot}")
    return 0


def _float64():
    import torch

    return torch.float64


def _cmd_gap(args) -> int:
    from . import ops

    if args.test_length <= args.train_length:
        raise UsageError(f"--test-length ({args.test_length}) must be > --train-length ({args.train_length})")
    method = _method(args)
    plain = type(method)(**{**method.__dict__, "resonance": False})
    rounded = type(method)(**{**method.__dict__, "resonance": True})
    table = plain.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=_float64())
    table_r = rounded.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=_float64())
    gap = ops.feature_gap(table, args.train_length, args.test_length)
    gap_r = ops.feature_gap(table_r, args.train_length, args.test_length)
    pairs = []
    for i in range(len(table)):
        wavelength = 2 * math.pi / float(table[i])
        pairs.append({
            "pair": i,
            "wavelength": wavelength,
            "resonance_wavelength": 2 * math.pi / float(table_r[i]),
            "pre_critical": wavelength < args.train_length,
            "gap": float(gap[i]),
            "resonance_gap": float(gap_r[i]),
        })
    pre = [p for p in pairs if p["pre_critical"]]
    summary = {
        "max_pre_critical_gap": max((p["gap"] for p in pre), default=0.0),
        "max_pre_critical_resonance_gap": max((p["resonance_gap"] for p in pre), default=0.0),
    }
    name = {"resonance": "default", "resonance_yarn": "yarn"}.get(args.method, args.method)
    if args.json:
        _dump({"method": name, "dim": args.dim, "base": args.base, "train_length": args.train_length,
               "test_length": args.test_length, "pairs": pairs, **summary})
    else:
        print(f"Resonance feature gap (Wang et al.): {name}, rotary dim {args.dim}, base {args.base:g}, "
              f"trained at {args.train_length}, tested up to {args.test_length}")
        print(f"{'pair':>4} {'wavelength':>11} {'rounded':>8} {'pre-critical':>12} {'gap':>9} {'resonance gap':>13}")
        for p in pairs:
            print(f"{p['pair']:>4} {p['wavelength']:>11.2f} {p['resonance_wavelength']:>8.0f} "
                  f"{'yes' if p['pre_critical'] else 'no':>12} {p['gap']:>9.4f} {p['resonance_gap']:>13.2e}")
        print(f"largest pre-critical gap: {summary['max_pre_critical_gap']:.4f} -> "
              f"{summary['max_pre_critical_resonance_gap']:.2e} with Resonance")
    if args.plot:
        from . import plots

        critical = next((p["pair"] for p in pairs if not p["pre_critical"]), None)
        label = "RoPE" if name == "default" else name
        plots.feature_gap({label: gap, f"Resonance {label}": gap_r}, args.plot, critical_index=critical)
        _note(args, f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
# posgen, demo, eval


def _cmd_posgen(args) -> int:
    from . import posgen

    if args.length < args.j + args.k:
        raise UsageError(f"--length ({args.length}) must be >= j + k = {args.j + args.k}")
    space = args.modulus ** (args.j + args.k)
    if args.n > space:
        raise UsageError(f"--n ({args.n}) is more than the {space} distinct prefixes of j + k tokens")
    data = posgen.generate(args.task, args.n, args.length, args.j, args.k, args.modulus, args.seed)
    if args.out:
        import torch

        torch.save(data, args.out)
        _note(args, f"wrote {args.out} ({args.n} x {args.length} int64)")
    if args.json:
        _dump({"task": args.task, "j": args.j, "k": args.k, "modulus": args.modulus, "seed": args.seed,
               "sequences": data.tolist()})
        return 0
    width = len(str(args.modulus - 1))
    print(f"PosGen {args.task}: j={args.j}, k={args.k}, h = sum mod {args.modulus}, seed {args.seed} "
          f"(the first {args.j + args.k} tokens of each row are free)")
    for row in data.tolist():
        free, rest = row[: args.j + args.k], row[args.j + args.k :]
        print(" ".join(f"{t:>{width}}" for t in free) + " | " + " ".join(f"{t:>{width}}" for t in rest))
    return 0


def _cmd_demo(args) -> int:
    from . import demo

    if args.test_length is not None and args.test_length <= args.train_length:
        raise UsageError(f"--test-length ({args.test_length}) must be > --train-length ({args.train_length})")
    report = demo.run(
        task=args.task, train_length=args.train_length, test_length=args.test_length, steps=args.steps,
        seed=args.seed, threads=args.threads, plot=args.plot, progress=_show_progress(args),
        log=None if args.json else print,
    )
    if args.json:
        _dump(report)
    return 0


def _load_model(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import hf

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.method is not None:
        args.original_max_position = args.original_max_position or model.config.max_position_embeddings
        method = _method(args)
        try:
            hf.patch(model, method)
        except TypeError as err:  # a model family ropescale does not patch
            raise UsageError(f"--method {args.method}: {err}") from None
    return model, tokenizer


def _cmd_eval_passkey(args) -> int:
    from . import evaluate

    model, tokenizer = _load_model(args)
    results = []
    for length in args.context_length:
        result = evaluate.passkey_retrieval(model, tokenizer, length, trials=args.trials, seed=args.seed,
                                            progress=_show_progress(args))
        results.append(result)
        if not args.json:
            print(f"passkey retrieval at {length} tokens: {100 * result.accuracy:.1f}% of {args.trials} trials")
    if args.json:
        _dump({"model": args.model, "method": args.method, "results": [
            {"context_length": r.context_length, "accuracy": r.accuracy,
             "trials": [t.__dict__ for t in r.trials]} for r in results]})
    return 0


def _cmd_eval_perplexity(args) -> int:
    from . import evaluate

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"--text: cannot read {args.text}: {err.strerror}") from None
    model, tokenizer = _load_model(args)
    result = evaluate.perplexity(model, text, tokenizer, max_length=args.max_length, stride=args.stride,
                                 progress=_show_progress(args))
    if args.json:
        _dump({"model": args.model, "method": args.method, "max_length": args.max_length, "stride": args.stride,
               "perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens, "windows": result.windows})
    else:
        print(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats/token over {result.tokens} tokens, "
              f"{result.windows} windows, stride {args.stride})")
    return 0


# ---------------------------------------------------------------------------------------------
# parser


def _sub(sub, name: str, help: str, description: str, examples: list[str]) -> argparse.ArgumentParser:
    return sub.add_parser(
        name, help=help, description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    from .posgen import TASKS

    parser = argparse.ArgumentParser(
        prog="ropescale", description="RoPE context extension: inspect and evaluate methods.",
        epilog="Run `ropescale COMMAND --help` for a command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # The same handful of wavelengths for several methods is the picture --plot draws.
    table = _sub(sub, "table", "inv_freq, wavelength and scale per dimension for a method",
                 "Print a method's inv_freq table: per pair, the inverse frequency, its wavelength, and how "
                 "much the method interpolates it (scale = theta_default / theta_method).",
                 ["ropescale table --method yarn --factor 16 --original-max-position 4096",
                  "ropescale table --method yarn --factor 16 --resonance --json",
                  "ropescale table --method yarn --factor 16 --compare linear ntk llama3 --plot wavelengths.png"])
    table.add_argument("--dim", type=_even_dim, default=128, help="rotary dim (default 128)")
    table.add_argument("--base", type=_positive_float, default=1e4, help="RoPE base (default 10000)")
    _add_method(table, default="yarn", factor=16.0)
    table.add_argument("--compare", nargs="+", choices=METHOD_CHOICES, metavar="METHOD",
                       help="more methods for the --plot (same options)")
    _add_json(table)
    _add_plot(table, "wavelength per dimension (default RoPE, the method, --compare methods)")
    table.set_defaults(func=_cmd_table)

    bound = _sub(sub, "base-bound", "the smallest RoPE base for a context length (Men et al.)",
                 "The lower bound of the RoPE base for a context length L: the smallest base whose "
                 "similarity decay B_m stays >= 0 for all m <= L (Men et al., 'Base of RoPE Bounds Context "
                 "Length', Table 2). Lengths above ~100k take a while.",
                 ["ropescale base-bound 4096", "ropescale base-bound 1024 4096 32768 --dim 128 --json"])
    bound.add_argument("context_length", type=_positive_int, nargs="+", metavar="L", help="context length(s)")
    bound.add_argument("--dim", type=_even_dim, default=128, help="rotary dim (default 128)")
    _add_json(bound)
    _add_quiet(bound)
    bound.set_defaults(func=_cmd_base_bound)

    decay = _sub(sub, "decay", "the similarity-decay curve B_m and the effective context of a config",
                 "B_m = sum_i cos(m theta_i) over relative distances m (Men et al.): a key similar to the "
                 "query gets more attention than a random one only while B_m >= 0, so the first negative "
                 "distance bounds the context the config can use.",
                 ["ropescale decay --dim 128 --base 10000",
                  "ropescale decay --dim 128 --base 500000 --max-distance 65536 --plot decay.png",
                  "ropescale decay --method yarn --factor 4 --original-max-position 4096 --json"])
    decay.add_argument("--dim", type=_even_dim, default=128, help="rotary dim (default 128)")
    decay.add_argument("--base", type=_positive_float, default=1e4, help="RoPE base (default 10000)")
    decay.add_argument("--max-distance", type=_positive_int, default=16384, help="largest m (default 16384)")
    _add_method(decay, default="default", factor=None)
    _add_json(decay)
    _add_plot(decay, "the curve with the first negative distance marked")
    decay.set_defaults(func=_cmd_decay)

    gap = _sub(sub, "gap", "Resonance feature gap per dimension",
               "The feature gap of each rotary pair (Wang et al.): the largest distance from a feature at a "
               "test position in [train, test) to the nearest one seen in training. Resonance RoPE rounds "
               "wavelengths to integers, which makes it 0 for every pre-critical pair (wavelength < train).",
               ["ropescale gap --dim 64 --train-length 64 --test-length 256",
                "ropescale gap --method yarn --factor 4 --original-max-position 64 --train-length 64 "
                "--test-length 256 --plot gap.png"])
    gap.add_argument("--dim", type=_even_dim, default=64, help="rotary dim (default 64)")
    gap.add_argument("--base", type=_positive_float, default=1e4, help="RoPE base (default 10000)")
    gap.add_argument("--train-length", type=_positive_int, default=64, help="training length (default 64)")
    gap.add_argument("--test-length", type=_positive_int, default=256, help="test length (default 256)")
    _add_method(gap, default="default", factor=None)
    _add_json(gap)
    _add_plot(gap, "the gap per dimension with and without Resonance")
    gap.set_defaults(func=_cmd_gap)

    pg = _sub(sub, "posgen", "PosGen sequences (recursive, CoT, semi-recursive)",
              "Generate PosGen sequences (Resonance RoPE's synthetic benchmark): j + k free tokens, then "
              "every token is h(...) of earlier ones, h = sum mod MODULUS.",
              ["ropescale posgen recursive --n 3 --length 16",
               "ropescale posgen semi_recursive --n 1000 --length 256 --seed 1 --out test.pt",
               "ropescale posgen cot --j 2 --k 2 --modulus 7 --json"])
    pg.add_argument("task", choices=TASKS)
    pg.add_argument("--n", type=_positive_int, default=4, help="number of sequences (default 4)")
    pg.add_argument("--length", type=_positive_int, default=32, help="tokens per sequence (default 32)")
    pg.add_argument("--j", type=_positive_int, default=1, help="far arguments of h (default 1)")
    pg.add_argument("--k", type=_positive_int, default=3, help="near arguments of h (default 3)")
    pg.add_argument("--modulus", type=_positive_int, default=17, help="h = sum mod this; vocabulary size (default 17)")
    pg.add_argument("--seed", type=_non_negative_int, default=0)
    pg.add_argument("--out", metavar="FILE.pt", help="also torch.save the LongTensor [n, length]")
    _add_json(pg)
    pg.set_defaults(func=_cmd_posgen)

    dm = _sub(sub, "demo", "train short, test long: RoPE, Resonance, YaRN, ReRoPE side by side (~1 min, CPU)",
              "Train a tiny Llama on PosGen at a short length with RoPE and with Resonance RoPE, then test "
              "at 4x the length with RoPE, Resonance RoPE, YaRN and Resonance YaRN (YaRN put in at test "
              "time, as in the Resonance RoPE paper), and the RoPE model with ReRoPE and Dynamic-YaRN. "
              "Prints a table and writes accuracy by position as a PNG. No downloads.",
              ["ropescale demo", "ropescale demo --task recursive --plot recursive.png",
               "ropescale demo --steps 200 --json"])
    dm.add_argument("--task", choices=TASKS, default="cot", help="PosGen task (default cot)")
    dm.add_argument("--train-length", type=_positive_int, default=32, help="training length (default 32)")
    dm.add_argument("--test-length", type=_positive_int, default=None, help="test length (default 4x training)")
    dm.add_argument("--steps", type=_positive_int, default=600, help="training steps per model (default 600)")
    dm.add_argument("--seed", type=_non_negative_int, default=0)
    dm.add_argument("--threads", type=_positive_int, default=1,
                    help="torch threads (default 1: fastest for a model this small on a busy machine)")
    dm.add_argument("--plot", type=_png, metavar="FILE.png", default="ropescale_demo.png",
                    help="accuracy by position (default ropescale_demo.png)")
    _add_json(dm)
    _add_quiet(dm)
    dm.set_defaults(func=_cmd_demo)

    examples = {
        "passkey": "ropescale eval passkey ./my-llama --context-length 4096 8192 --trials 20",
        "perplexity": "ropescale eval perplexity ./my-llama --text book.txt --max-length 8192 "
                      "--method yarn --factor 2 --original-max-position 4096",
    }
    ev = _sub(sub, "eval", "passkey retrieval or sliding-window perplexity of a causal LM",
              "Evaluate a transformers causal LM (a local directory or a hub name) as in the YaRN paper, "
              "optionally with a scaling method put in first (--method).", list(examples.values()))
    ev_sub = ev.add_subparsers(dest="evaluator", required=True, metavar="EVALUATOR")
    for name, help_text in (("passkey", "5-digit passkey at uniformly random depths (YaRN paper)"),
                            ("perplexity", "sliding-window perplexity, stride 256 (Press et al.)")):
        e = _sub(ev_sub, name, help_text, help_text, [examples[name]])
        e.add_argument("model", help="model directory or hub name")
        e.add_argument("--tokenizer", help="tokenizer (default: the model's)")
        e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
        e.add_argument("--device", help="cpu or cuda (default: cuda when available)")
        g = e.add_argument_group("method (optional)")
        g.add_argument("--method", choices=METHOD_CHOICES, default=None, help="scaling method to put in")
        g.add_argument("--factor", type=_positive_float, default=None, help="scale factor s")
        g.add_argument("--original-max-position", type=_positive_int, default=None,
                       help="pre-training context (default: the model's max_position_embeddings)")
        g.add_argument("--beta-fast", type=_positive_float, default=32.0)
        g.add_argument("--beta-slow", type=_positive_float, default=1.0)
        g.add_argument("--resonance", action="store_true")
        e.set_defaults(seq_len=None)
        _add_json(e)
        _add_quiet(e)
        if name == "passkey":
            e.add_argument("--context-length", type=_positive_int, nargs="+", required=True, metavar="N",
                           help="prompt + answer length(s) in tokens")
            e.add_argument("--trials", type=_positive_int, default=10, help="prompts per length (default 10)")
            e.add_argument("--seed", type=_non_negative_int, default=0)
            e.set_defaults(func=_cmd_eval_passkey)
        else:
            e.add_argument("--text", required=True, help="a UTF-8 text file")
            e.add_argument("--max-length", type=_positive_int, default=None,
                           help="window length (default: the model's max_position_embeddings)")
            e.add_argument("--stride", type=_positive_int, default=256, help="window stride (default 256)")
            e.set_defaults(func=_cmd_eval_perplexity)
    return parser


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The deepest subcommand parser named in ``argv`` (for usage errors found after parsing)."""
    current = parser
    for word in argv:
        actions = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if actions and word in actions[0].choices:
            current = actions[0].choices[word]
    return current


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:
        _subparser(parser, argv).error(str(err))  # prints usage, exits 2
    except BrokenPipeError:  # `ropescale ... | head`: the reader left; exit quietly (Python docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
