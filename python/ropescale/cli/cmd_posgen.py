"""``posgen``: PosGen sequences (Resonance RoPE's synthetic benchmark)."""

from __future__ import annotations

from .common import UsageError, add_json, dump, non_negative_int, note, positive_int, subcommand

# posgen builds the whole int64 table in memory (2^27 tokens: 1 GiB).
_MAX_TOKENS = 2**27


def add_parser(sub) -> None:
    """Adds ``posgen`` to the ``ropescale`` command's subparsers."""
    from ..posgen import TASKS

    pg = subcommand(sub, "posgen", "PosGen sequences (recursive, CoT, semi-recursive)",
                    "Generate PosGen sequences (Resonance RoPE's synthetic benchmark): j + k free tokens, then "
                    "every token is h(...) of earlier ones, h = sum mod MODULUS.",
                    ["ropescale posgen recursive --n 3 --length 16",
                     "ropescale posgen semi_recursive --n 1000 --length 256 --seed 1 --out test.pt",
                     "ropescale posgen cot --j 2 --k 2 --modulus 7 --json"])
    pg.add_argument("task", choices=TASKS)
    pg.add_argument("--n", type=positive_int, default=4, help="number of sequences (default 4)")
    pg.add_argument("--length", type=positive_int, default=32, help="tokens per sequence (default 32)")
    pg.add_argument("--j", type=positive_int, default=1, help="far arguments of h (default 1)")
    pg.add_argument("--k", type=positive_int, default=3, help="near arguments of h (default 3)")
    pg.add_argument("--modulus", type=positive_int, default=17, help="h = sum mod this; vocabulary size (default 17)")
    pg.add_argument("--seed", type=non_negative_int, default=0)
    pg.add_argument("--out", metavar="FILE.pt", help="also torch.save the LongTensor [n, length]")
    add_json(pg)
    pg.set_defaults(func=_cmd_posgen)


def _cmd_posgen(args) -> int:
    from .. import posgen

    if args.length < args.j + args.k:
        raise UsageError(f"--length ({args.length}) must be >= j + k = {args.j + args.k}")
    space = args.modulus ** (args.j + args.k)
    if args.n > space:
        raise UsageError(f"--n ({args.n}) is more than the {space} distinct prefixes of j + k tokens")
    if args.n * args.length > _MAX_TOKENS:
        raise UsageError(f"--n x --length ({args.n} x {args.length}) is more than {_MAX_TOKENS} tokens")
    data = posgen.generate(args.task, args.n, args.length, args.j, args.k, args.modulus, args.seed)
    if args.out:
        import torch

        torch.save(data, args.out)
        note(args, f"wrote {args.out} ({args.n} x {args.length} int64)")
    if args.json:
        dump({"task": args.task, "j": args.j, "k": args.k, "modulus": args.modulus, "seed": args.seed,
              "sequences": data.tolist()})
        return 0
    width = len(str(args.modulus - 1))
    print(f"PosGen {args.task}: j={args.j}, k={args.k}, h = sum mod {args.modulus}, seed {args.seed} "
          f"(the first {args.j + args.k} tokens of each row are free)")
    for row in data.tolist():
        free, rest = row[: args.j + args.k], row[args.j + args.k :]
        print(" ".join(f"{t:>{width}}" for t in free) + " | " + " ".join(f"{t:>{width}}" for t in rest))
    return 0
