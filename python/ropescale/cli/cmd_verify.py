"""``verify``: does an engine apply the rope scaling a checkpoint or GGUF declares? (``ropescale.verify``)"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from .common import add_json, add_quiet, dump, positive_int, positive_float, show_progress, subcommand

_DESCRIPTION = (
    "Reads what TARGET (a transformers checkpoint directory or a GGUF file) declares (the scaling method, its table "
    "and attention factor, the length it is served to), runs ENGINE on a synthetic prompt past the original length "
    "in the engine's own process, and compares the engine's prompt log-probabilities with ropescale's forward of the "
    "same weights under the declared method and under each known way of getting it wrong: the scaling ignored, a "
    "key the engine does not read (its default instead), the attention factor (mscale) lost, Resonance's rounding "
    "dropped, a dynamic scale fixed at one length, a raw-key attention ignored.",
    "Per check (served length, scaling), with its distance and the bound of an exact verdict (the engine's own "
    "float32 noise: 1e-5 nats, more where the float32 reference is noisier): exact (within the bound); different "
    "(the parameter, the engine's and the declared value, the size of the difference in nats); ignored; "
    "unexplained (no known formula within the bound of the engine, with the size); short (not served past length "
    "N, or not finite past it); refused (the engine said so); inconclusive (no answer, or nothing to tell apart); "
    "and, when TARGET (or --hf-overrides) holds a rope-like key the engine did not take (a misspelled key, one at a "
    "place the engine does not read, one its version no longer reads), rope keys: ignored, naming each. Exit 0 when "
    "every check is exact, 1 otherwise, 2 for a bad argument.",
    "Each engine is imported only when asked for: transformers (plain, as from_pretrained loads the target), vllm "
    "(with the plugins vLLM loads: ROPESCALE_VLLM=0 checks stock vLLM), sglang (with the plugins SGLang loads: "
    "ROPESCALE_SGLANG=0 checks stock SGLang; its CPU engine where there is no GPU), llama.cpp (llama-cpp-python, a "
    "GGUF).",
    "--matrix runs the conformance matrix instead of one TARGET: a tiny model per family x rope key that engines read "
    "differently (ropescale.matrix.ROWS), verified on every engine installed here, stock and with ropescale's plugin "
    "(ropescale.matrix.COLUMNS). Each cell is written to --results as it ends and skipped when the file already holds "
    "it, so a stopped run resumes, and running the same command in another environment (vLLM's, SGLang's) fills in "
    "its columns. The llama.cpp columns run the GGUF llama.cpp's own converter makes of the row's checkpoint, and the "
    "one `ropescale extend DIR DST.gguf` writes; they need llama-cpp-python, sentencepiece and the converter "
    "(LLAMA_CPP_CONVERTER=PATH/convert_hf_to_gguf.py: scripts/test_llamacpp.sh unpacks one). --markdown and "
    "--readme render the table and its headline from the file alone. Exit 1 when a cell "
    "of a column with ropescale's plugin is a silent divergence (each must be exact or refused), else 0.",
)


def add_parser(sub) -> None:
    from .. import verify

    p = subcommand(sub, "verify", "check that an engine applies the rope scaling a model declares",
                   "\n\n".join(textwrap.fill(t, 108) for t in _DESCRIPTION),
                   ["ropescale verify ./llama-yarn --engine vllm",
                    "ROPESCALE_VLLM=0 ropescale verify ./llama-yarn --engine vllm   # stock vLLM",
                    "ROPESCALE_SGLANG=0 ropescale verify ./llama-yarn --engine sglang   # stock SGLang",
                    "ropescale verify model-yarn4.gguf --engine llama.cpp",
                    "ropescale verify converted.gguf --engine llama.cpp --declared-by ./llama-yarn"
                    "   # a GGUF another tool made from ./llama-yarn",
                    "ropescale verify ./llama-yarn --engine transformers --length 16384 --json",
                    "ropescale verify --matrix --results matrix.jsonl --markdown MATRIX.md   # every engine here",
                    "LLAMA_CPP_CONVERTER=llama.cpp/convert_hf_to_gguf.py ropescale verify --matrix --engine llama.cpp "
                    "--results matrix.jsonl   # llama.cpp's columns"])
    p.add_argument("target", metavar="TARGET", nargs="?",
                   help="a local transformers checkpoint directory, or a GGUF file (a hub repository id is not looked "
                        "up); none with --matrix")
    p.add_argument("--engine", choices=list(verify.ENGINES),
                   help="the engine to probe (required with TARGET; with --matrix, only this engine's columns)")
    matrix = p.add_argument_group("the conformance matrix")
    matrix.add_argument("--matrix", action="store_true",
                        help="run the conformance matrix (every row x every column whose engine is installed here)")
    matrix.add_argument("--results", type=Path, default=Path("ropescale-matrix.jsonl"), metavar="FILE",
                        help="the cells, one JSON line each, written as each ends (the file replaced whole), read to "
                             "resume (default ropescale-matrix.jsonl)")
    matrix.add_argument("--work", type=Path, metavar="DIR",
                        help="where the rows' tiny checkpoints are built (default: a temporary folder)")
    matrix.add_argument("--rows", metavar="TEXT", nargs="+",
                        help="only the rows whose name, family or key contains one of these")
    matrix.add_argument("--rerun", action="store_true",
                        help="run the selected cells again even where --results holds them (an engine upgraded)")
    matrix.add_argument("--markdown", type=Path, metavar="FILE", help="write the table (from --results) to FILE")
    matrix.add_argument("--readme", type=Path, metavar="FILE",
                        help="replace the matrix block of FILE (a README) with the headline")
    p.add_argument("--declared-by", metavar="DIR", type=Path,
                   help="hold the engine to this checkpoint's declaration and weights (TARGET was made from it by "
                        "another tool: a GGUF llama.cpp's convert_hf_to_gguf.py wrote from a directory ropescale "
                        "extended)")
    p.add_argument("--length", type=positive_int, metavar="N",
                   help="the probe's prompt length, at most the served length (default: twice the original length, or "
                        "the served length where that is shorter)")
    p.add_argument("--hf-overrides", metavar="JSON", type=_json_object,
                   help="vLLM's hf_overrides (SGLang's --json-model-override-args), passed to the engine as `vllm "
                        "serve --hf-overrides` takes them and written into the declaration; a rope key the engine does "
                        "not take is named")
    p.add_argument("--timeout", type=positive_float, default=1800.0, metavar="S",
                   help="seconds the engine may take (default 1800)")
    add_json(p)
    add_quiet(p, "no progress lines")
    p.set_defaults(func=_cmd_verify)


def _json_object(text: str) -> dict:
    import argparse
    import json

    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text}")
    return value


def _cmd_verify(args) -> int:
    from .. import verify

    if args.matrix:
        return _cmd_matrix(args)
    if args.target is None or args.engine is None:
        raise ValueError("verify needs TARGET and --engine (or --matrix)")
    say = (lambda message: print(f"... {message}", file=sys.stderr, flush=True)) if show_progress(args) else None
    report = verify.verify(args.target, args.engine, length=args.length, timeout=args.timeout,
                           declared_by=args.declared_by, progress=say, hf_overrides=args.hf_overrides)
    if args.json:
        dump(report.to_json())
    else:
        print(report.text())
    return report.exit_code


def _cmd_matrix(args) -> int:
    import dataclasses
    import tempfile

    from .. import matrix

    if args.target is not None:
        raise ValueError(f"--matrix builds its own models: no TARGET ({args.target})")
    rows = [r for r in matrix.ROWS if not args.rows or any(t.lower() in f"{r.name} {r.family} {r.key}".lower()
                                                           for t in args.rows)]
    if not rows:
        raise ValueError(f"--rows {' '.join(args.rows)}: no row matches; the rows: "
                         + "; ".join(f"{r.family}: {r.name}" for r in matrix.ROWS))
    columns = [c for c in matrix.COLUMNS if args.engine in (None, c.engine)]
    here = [c.name for c in columns if matrix.installed(c)]
    if args.engine is not None and not here:  # asked for one engine's columns: say what it lacks, run nothing
        raise ValueError(f"--matrix --engine {args.engine}: its columns do not run here, it needs "
                         f"{matrix.missing(columns[0])}")
    for path, what in ((args.markdown, "--markdown"), (args.readme, "--readme")):
        if path is not None and not path.parent.is_dir():
            raise ValueError(f"{what} {path}: its folder does not exist")
    matrix.load(args.results)  # a file that is not the matrix's: refused before any run
    if args.readme is not None:
        matrix.readme_parts(args.readme)
    say = (lambda message: print(f"... {message}", file=sys.stderr, flush=True)) if show_progress(args) else None
    if say:
        say(f"columns installed here: {', '.join(here) or 'none'}; {len(rows)} rows; cells in {args.results}")
    with tempfile.TemporaryDirectory(prefix="ropescale-matrix-") as scratch:
        ran = matrix.run(args.results, args.work or Path(scratch), rows, columns, timeout=args.timeout, progress=say,
                         rerun=args.rerun)
    cells = matrix.load(args.results)
    table = matrix.markdown(cells, rows, columns)
    if args.markdown is not None:
        matrix.write_markdown(args.markdown, cells)
    if args.readme is not None:
        matrix.write_readme(args.readme, cells)
    if args.json:
        dump({"ran": len(ran), "cells": [dataclasses.asdict(c) for c in cells.values()]})
    else:
        print(table)
        print(matrix.headline(cells, rows, columns))
    return 1 if matrix.silent_cells(cells, rows, [c for c in columns if c.ropescale_written]) else 0
