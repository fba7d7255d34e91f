"""The ``ropescale`` command (``python -m ropescale``): look at what a RoPE scaling method does.

    ropescale demo                          train short (32), test long (128): the methods side by side
    ropescale table --method yarn --factor 16 --plot wavelengths.png
    ropescale base-bound 4096 32768 --dim 128
    ropescale decay --base 10000 --dim 128 --plot decay.png
    ropescale gap --train-length 64 --test-length 256 --dim 64 --plot gap.png
    ropescale posgen semi_recursive --n 4 --length 24
    ropescale eval perplexity MODEL_DIR --text book.txt --max-length 4096
    ropescale verify MODEL_DIR --engine vllm    does vLLM apply the scaling the config declares?

Every command takes ``--json`` for machine output; bad arguments print a usage error and exit 2 (a
value the ops or the scaling methods refuse, too: ``main`` turns their ValueError into one); Ctrl-C
ends any command within a second with exit 130 (native calls run in a worker thread the main thread
waits on, so the interrupt is never stuck behind them).

One module per command group, each adding its own subcommands (``add_parser``): ``cmd_inspect`` (table,
base-bound, decay, gap), ``cmd_posgen``, ``cmd_demo``, ``cmd_extend``, ``cmd_verify``, ``cmd_eval`` (and ``ropescale.check``
for ``check``); ``methods`` declares the scaling-method options they share and builds the method from them;
``common`` holds argument types, output helpers and the usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from . import cmd_demo, cmd_eval, cmd_extend, cmd_inspect, cmd_posgen, cmd_verify
from .cmd_demo import DEMO_OUTPUT
from .common import Interrupted, UsageError, first_line

__all__ = ["main", "build_parser", "UsageError", "DEMO_OUTPUT"]


def build_parser() -> argparse.ArgumentParser:
    from .. import check  # `ropescale check`: every op on this machine's devices (check.py)

    parser = argparse.ArgumentParser(
        prog="ropescale", description="RoPE context extension: inspect and evaluate methods.",
        epilog="Run `ropescale COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print ropescale's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each module adds its own subcommands; this order is the one --help lists them in.
    for commands in (cmd_inspect, cmd_posgen, cmd_demo, cmd_extend, cmd_verify, check, cmd_eval):
        commands.add_parser(sub)
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
            raise UsageError(first_line(err)) from None
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
