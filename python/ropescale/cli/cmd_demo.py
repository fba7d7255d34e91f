"""``demo``: train short, test long; RoPE, Resonance, YaRN and ReRoPE side by side on PosGen (ropescale.demo)."""

from __future__ import annotations

import os
import tempfile

from .. import files
from .common import (UsageError, add_json, add_quiet, dump, non_negative_int, png, positive_int, show_progress,
                     subcommand)

# Where `ropescale demo` writes its PNG unless told otherwise.
DEMO_OUTPUT = os.path.join(tempfile.gettempdir(), "ropescale-demo")


def add_parser(sub) -> None:
    """Adds ``demo`` to the ``ropescale`` command's subparsers."""
    from ..posgen import TASKS

    dm = subcommand(sub, "demo", "train short, test long: RoPE, Resonance, YaRN, ReRoPE side by side (~1 min, CPU)",
                    "Train a tiny Llama on PosGen at a short length with RoPE and with Resonance RoPE, then test "
                    "at 4x the length with RoPE, Resonance RoPE, YaRN and Resonance YaRN (YaRN put in at test "
                    "time, as in the Resonance RoPE paper), and the RoPE model with ReRoPE and Dynamic-YaRN. "
                    "Prints a table and writes accuracy by position as a PNG. No downloads. With "
                    "--position-sampling: models trained at W with PoSE's and CREAM's positions reaching 4W, beside "
                    "models trained at W and at 4W, RoPE and YaRN, all tested at 4W (about 3 min on one core).",
                    ["ropescale demo", "ropescale demo --task recursive --plot recursive.png",
                     "ropescale demo --output out/",
                     "ropescale demo --steps 200 --json",
                     "ropescale demo --position-sampling --plot sampling.png"])
    dm.add_argument("--task", choices=TASKS, default="cot", help="PosGen task (default cot)")
    dm.add_argument("--train-length", type=positive_int, default=None,
                    help="training length (default 32; 48 with --position-sampling)")
    dm.add_argument("--test-length", type=positive_int, default=None, help="test length (default 4x training)")
    dm.add_argument("--steps", type=positive_int, default=None,
                    help="training steps per model (default 600; 300 with --position-sampling)")
    dm.add_argument("--position-sampling", action="store_true",
                    help="instead: train at the training length W with PoSE and with CREAM positions reaching the "
                         "test length, beside training at W and at the test length, RoPE and YaRN (8 models, "
                         "about 3 min on one core)")
    dm.add_argument("--seed", type=non_negative_int, default=0)
    dm.add_argument("--threads", type=positive_int, default=1,
                    help="torch threads (default 1: fastest for a model this small on a busy machine)")
    dm.add_argument("--output", metavar="DIR", default=None,
                    help=f"folder for the PNG (default {DEMO_OUTPUT}; created, when the PNG is written, if missing)")
    dm.add_argument("--plot", type=png, metavar="FILE.png", default=None,
                    help="the PNG of accuracy by position (default DIR/ropescale_demo.png; "
                         "DIR/ropescale_demo_position_sampling.png with --position-sampling)")
    add_json(dm)
    add_quiet(dm)
    dm.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from .. import demo

    sampling = args.position_sampling
    if args.train_length is None:
        args.train_length = demo.SAMPLING_WINDOW if sampling else 32
    if args.steps is None:
        args.steps = demo.SAMPLING_STEPS if sampling else 600
    if args.test_length is not None and args.test_length <= args.train_length:
        raise UsageError(f"--test-length ({args.test_length}) must be > --train-length ({args.train_length})")
    if args.threads > (os.cpu_count() or 1):
        raise UsageError(f"--threads ({args.threads}) must be at most the {os.cpu_count()} CPUs of this machine")
    if args.plot is not None and args.output is not None:
        raise UsageError("give --output DIR or --plot FILE.png, not both")
    plot = args.plot
    try:  # checked now, made only when the plot is written (demo.run): a refused run leaves no folder behind
        if plot is None:
            # Never the current directory (a repository checkout, say): a folder of its own, printed.
            folder = files.check_writable_directory(args.output or DEMO_OUTPUT, "--output")
            plot = os.path.join(folder, "ropescale_demo_position_sampling.png" if sampling else "ropescale_demo.png")
        else:
            files.check_writable_file(plot, "--plot")
    except ValueError as err:
        raise UsageError(str(err)) from None
    report = (demo.run_position_sampling if sampling else demo.run)(
        task=args.task, train_length=args.train_length, test_length=args.test_length, steps=args.steps,
        seed=args.seed, threads=args.threads, plot=plot, progress=show_progress(args),
        log=None if args.json else print,
    )
    if args.json:
        dump(report)
    return 0
