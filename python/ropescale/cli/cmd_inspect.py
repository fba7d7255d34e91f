"""``table``, ``base-bound``, ``decay``, ``gap``: what a RoPE configuration does, computed from its frequencies
alone (no model)."""

from __future__ import annotations

import argparse
import dataclasses
import math

from .. import scaling
from . import methods
from .common import (UsageError, add_json, add_plot, add_quiet, base, dump, even_dim, float64, native, note,
                     positive_int, progress, subcommand)

# decay keeps one float64 per distance (and prints or dumps them): 16M distances is 128 MiB.
_MAX_DECAY_DISTANCE = 2**24

# The method options of table, decay and gap: one frequency table, at --seq-len for the dynamic methods.
_TABLE_OPTIONS = methods.MethodOptions(
    flags=("--method", "--factor", "--alpha", "--floor", "--original-max-position", "--beta-fast", "--beta-slow", "--seq-len",
           "--extrapolation-factor", "--resonance"),
    method="default", notes={"--floor": ": its scale then follows --seq-len"})


def _decay_distance(text: str) -> int:
    value = positive_int(text)
    if value > _MAX_DECAY_DISTANCE:
        raise argparse.ArgumentTypeError(
            f"must be at most {_MAX_DECAY_DISTANCE} (the curve keeps one value per distance), got {value}")
    return value


def add_parser(sub) -> None:
    """Adds ``table``, ``base-bound``, ``decay`` and ``gap`` to the ``ropescale`` command's subparsers."""
    # The same handful of wavelengths for several methods is the picture --plot draws.
    table = subcommand(sub, "table", "inv_freq, wavelength and scale per dimension for a method",
                       "Print a method's inv_freq table: per pair, the inverse frequency, its wavelength, and how "
                       "much the method interpolates it (scale = theta_default / theta_method).",
                       ["ropescale table --method yarn --factor 16 --original-max-position 4096",
                        "ropescale table --method yarn --factor 16 --resonance --json",
                        "ropescale table --method yarn --factor 16 --compare linear ntk llama3 --plot wavelengths.png"])
    table.add_argument("--dim", type=even_dim, default=128, help="rotary dim (default 128)")
    table.add_argument("--base", type=base, default=1e4, help="RoPE base (default 10000)")
    taken = dataclasses.replace(_TABLE_OPTIONS, method="yarn", factor=16.0)
    methods.add_options(table, taken)
    table.add_argument("--compare", nargs="+", choices=methods.names(taken), metavar="METHOD",
                       help="more methods for the --plot (same options)")
    add_json(table)
    add_plot(table, "wavelength per dimension (default RoPE, the method, --compare methods)")
    table.set_defaults(func=_cmd_table)

    bound = subcommand(sub, "base-bound", "the smallest RoPE base for a context length (Men et al.)",
                       "The lower bound of the RoPE base for a context length L: the smallest base whose "
                       "similarity decay B_m stays >= 0 for all m <= L (Men et al., 'Base of RoPE Bounds Context "
                       "Length', Table 2). Lengths above ~100k take a while.",
                       ["ropescale base-bound 4096", "ropescale base-bound 1024 4096 32768 --dim 128 --json"])
    bound.add_argument("context_length", type=positive_int, nargs="+", metavar="L", help="context length(s)")
    bound.add_argument("--dim", type=even_dim, default=128, help="rotary dim (default 128)")
    add_json(bound)
    add_quiet(bound)
    bound.set_defaults(func=_cmd_base_bound)

    decay = subcommand(sub, "decay", "the similarity-decay curve B_m and the effective context of a config",
                       "B_m = sum_i cos(m theta_i) over relative distances m (Men et al.): a key similar to the "
                       "query gets more attention than a random one only while B_m >= 0, so the first negative "
                       "distance bounds the context the config can use.",
                       ["ropescale decay --dim 128 --base 10000",
                        "ropescale decay --dim 128 --base 500000 --max-distance 65536 --plot decay.png",
                        "ropescale decay --method yarn --factor 4 --original-max-position 4096 --json"])
    decay.add_argument("--dim", type=even_dim, default=128, help="rotary dim (default 128)")
    decay.add_argument("--base", type=base, default=1e4, help="RoPE base (default 10000)")
    decay.add_argument("--max-distance", type=_decay_distance, default=16384,
                       help=f"largest m (default 16384, at most {_MAX_DECAY_DISTANCE})")
    methods.add_options(decay, _TABLE_OPTIONS)
    add_json(decay)
    add_plot(decay, "the curve with the first negative distance marked")
    decay.set_defaults(func=_cmd_decay)

    gap = subcommand(sub, "gap", "Resonance feature gap per dimension",
                     "The feature gap of each rotary pair (Wang et al.): the largest distance from a feature at a "
                     "test position in [train, test) to the nearest one seen in training. Resonance RoPE rounds "
                     "wavelengths to integers, which makes it 0 for every pre-critical pair (wavelength < train).",
                     ["ropescale gap --dim 64 --train-length 64 --test-length 256",
                      "ropescale gap --method yarn --factor 4 --original-max-position 64 --train-length 64 "
                      "--test-length 256 --plot gap.png"])
    gap.add_argument("--dim", type=even_dim, default=64, help="rotary dim (default 64)")
    gap.add_argument("--base", type=base, default=1e4, help="RoPE base (default 10000)")
    gap.add_argument("--train-length", type=positive_int, default=64, help="training length (default 64)")
    gap.add_argument("--test-length", type=positive_int, default=256, help="test length (default 256)")
    methods.add_options(gap, _TABLE_OPTIONS)
    add_json(gap)
    add_plot(gap, "the gap per dimension with and without Resonance")
    gap.set_defaults(func=_cmd_gap)


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
        dump({"method": name, "dim": dim, "base": base, **dynamic, "attention_factor": factor, "rows": rows})
        return
    at = ""
    if method.dynamic:
        at = f", at length {seq_len}" if seq_len is not None else ", at its own scale (no --seq-len)"
        if method.scale_at(seq_len) is not None:
            at += f" (s = {method.scale_at(seq_len):g})"
    print(f"{name}{at}: rotary dim {dim}, base {base:g}, attention factor {factor:.6f}")
    print(f"{'pair':>4} {'regime':>11} {'inv_freq':>13} {'wavelength':>13} {'scale':>9}")
    for r in rows:
        print(f"{r['pair']:>4} {r['regime']:>11} {r['inv_freq']:>13.6e} {r['wavelength']:>13.2f} {r['scale']:>9.4f}")


def _cmd_table(args) -> int:
    method = methods.build(args)
    compare = {name: methods.build(args, name) for name in args.compare or []}
    methods.check_seq_len(args, method, *compare.values())
    _print_table(methods.label(args), method, args.dim, args.base, args.seq_len, args.json)
    if args.plot:
        from .. import plots

        tables = {"default (RoPE)": scaling.Default().inv_freq(args.dim, args.base)}
        tables[methods.label(args)] = method.inv_freq(args.dim, args.base, seq_len=args.seq_len)
        for name, other in compare.items():
            tables[methods.label(args, name)] = other.inv_freq(args.dim, args.base, seq_len=args.seq_len)
        plots.wavelengths(tables, args.plot, original_max_position=args.original_max_position)
        note(args, f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
# base-bound, decay, gap


def _cmd_base_bound(args) -> int:
    from .. import ops

    bounds = []
    for length in progress(args.context_length, args.quiet or len(args.context_length) == 1, desc="base bound"):
        bounds.append({"context_length": length,
                       "base_lower_bound": native(f"base bound for {length}", ops.base_lower_bound, length, args.dim,
                                                  quiet=args.quiet)})
    if args.json:
        dump({"dim": args.dim, "bounds": bounds})
        return 0
    print(f"Smallest RoPE base with B_m >= 0 for every m <= L (Men et al.), rotary dim {args.dim}:")
    print(f"{'context L':>12} {'base lower bound':>18}")
    for b in bounds:
        print(f"{b['context_length']:>12} {b['base_lower_bound']:>18.4g}")
    return 0


def _cmd_decay(args) -> int:
    from .. import ops

    method = methods.build(args)
    methods.check_seq_len(args, method)
    inv_freq = method.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=float64())
    curve = native("decay", ops.similarity_decay, inv_freq, args.max_distance)
    effective = native("decay", ops.effective_context_length, inv_freq, args.max_distance)
    first_negative = effective + 1 if effective < args.max_distance else None
    label = methods.label(args)
    if args.json:
        dump({
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
        note(args, f"wrote {args.plot}")
    return 0


def _cmd_gap(args) -> int:
    from .. import ops

    if args.test_length <= args.train_length:
        raise UsageError(f"--test-length ({args.test_length}) must be > --train-length ({args.train_length})")
    method = methods.build(args)
    methods.check_seq_len(args, method)
    plain = dataclasses.replace(method, resonance=False)
    rounded = dataclasses.replace(method, resonance=True)
    table = plain.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=float64())
    table_r = rounded.inv_freq(args.dim, args.base, seq_len=args.seq_len, dtype=float64())
    gap = native("gap", ops.feature_gap, table, args.train_length, args.test_length)
    gap_r = native("gap (Resonance)", ops.feature_gap, table_r, args.train_length, args.test_length)
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
    name = methods.without_resonance(args.method)
    if args.json:
        dump({"method": name, "dim": args.dim, "base": args.base, "train_length": args.train_length,
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
        label = "RoPE" if name == scaling.Default.rope_type else name
        plots.feature_gap({label: gap, f"Resonance {label}": gap_r}, args.plot, critical_index=critical)
        note(args, f"wrote {args.plot}")
    return 0
