"""The ``ropescale`` command (``python -m ropescale``)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from . import scaling


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
        json.dump({"method": name, "dim": dim, "base": base, "attention_factor": factor, "rows": rows},
                  sys.stdout, indent=1)
        print()
        return
    print(f"{name}: rotary dim {dim}, base {base:g}, attention factor {factor:.6f}")
    print(f"{'pair':>4} {'regime':>11} {'inv_freq':>13} {'wavelength':>13} {'scale':>9}")
    for r in rows:
        print(f"{r['pair']:>4} {r['regime']:>11} {r['inv_freq']:>13.6e} {r['wavelength']:>13.2f} {r['scale']:>9.4f}")


def _cmd_table(args) -> int:
    params = {"rope_type": args.method, "factor": args.factor,
              "original_max_position_embeddings": args.original_max_position}
    if args.method == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    method = scaling.from_hf(params, max_position_embeddings=args.original_max_position)
    if args.resonance:
        method = type(method)(**{**method.__dict__, "resonance": True})
    _print_table(args.method + (" + resonance" if args.resonance else ""), method, args.dim, args.base,
                 args.seq_len, args.json)
    return 0


def _cmd_demo(args) -> int:
    print("YaRN x16 for Llama-2's head (head dim 128, base 10000, original context 4096):\n")
    _print_table("yarn", scaling.YaRN(factor=16.0, original_max_position=4096), 128, 1e4, None, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ropescale", description="RoPE context extension: inspect and evaluate methods.")
    sub = parser.add_subparsers(dest="command", required=True)

    table = sub.add_parser("table", help="inv_freq, wavelength and scale per dimension for a method",
                           description="Print a method's inv_freq table.",
                           epilog="example: ropescale table --method yarn --factor 16 --original-max-position 4096")
    table.add_argument("--method", default="yarn", choices=sorted(scaling.METHODS))
    table.add_argument("--dim", type=int, default=128, help="rotary dim (default 128)")
    table.add_argument("--base", type=float, default=1e4, help="RoPE base (default 10000)")
    table.add_argument("--factor", type=float, default=16.0, help="scale factor s (default 16)")
    table.add_argument("--original-max-position", type=int, default=4096, help="pre-training context L")
    table.add_argument("--seq-len", type=int, default=None, help="current length (dynamic methods)")
    table.add_argument("--resonance", action="store_true", help="round wavelengths (Resonance RoPE)")
    table.add_argument("--json", action="store_true", help="machine-readable output")
    table.set_defaults(func=_cmd_table)

    demo = sub.add_parser("demo", help="the main demo")
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
