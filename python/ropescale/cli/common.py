"""What every ``ropescale`` command shares: argument types, the --json/--plot/--quiet options, JSON output,
progress bars, native calls Ctrl-C can interrupt, and the usage error."""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from typing import Any, Callable

# Integers the native ops take are int64; lengths beyond this are refused as arguments.
MAX_INT = 2**62


class UsageError(Exception):
    """A bad argument found after parsing (reported like argparse's own errors: usage, exit 2)."""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name where it has none): what a usage error shows."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class Interrupted(Exception):
    """Ctrl-C while a native call ran (its worker thread cannot be stopped: the process exits)."""


# ---------------------------------------------------------------------------------------------
# Argument types


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most 2^62, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most 2^62, got {value}")
    return value


def even_dim(text: str) -> int:
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"rotary dim must be even, got {value}")
    return value


def number(text: str) -> float:
    """Any float; the range is the reader's to check (a scaling method's dataclass, say)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def base(text: str) -> float:
    value = positive_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"the RoPE base must be > 1, got {text}")
    return value


def png(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is written as PNG: the file name must end in .png, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------------
# Subcommands and the options most of them take


def subcommand(sub, name: str, help: str, description: str, examples: list[str]) -> argparse.ArgumentParser:
    """A subcommand whose --help keeps the description's line breaks and ends with examples."""
    return sub.add_parser(
        name, help=help, description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")


def add_plot(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", type=png, metavar="FILE.png", help=f"also write {what} as a PNG")


def add_quiet(p: argparse.ArgumentParser, help: str = "no progress bars") -> None:
    p.add_argument("--quiet", action="store_true", help=help)


# ---------------------------------------------------------------------------------------------
# Output


def dump(obj: Any) -> None:
    json.dump(json_safe(obj), sys.stdout, indent=1)
    print()


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def note(args, message: str) -> None:
    # Notes go to stderr when stdout carries JSON.
    print(message, file=sys.stderr if args.json else sys.stdout)


def progress(iterable, quiet: bool, **kwargs):
    if quiet or not sys.stderr.isatty():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


def show_progress(args) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def native(desc: str, fn: Callable, *args, quiet: bool = False):
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


def float64():
    """torch.float64, importing torch only when a command needs it."""
    import torch

    return torch.float64
