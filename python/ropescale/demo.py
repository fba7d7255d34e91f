"""``ropescale demo``: the train-short-test-long story in about a minute on a CPU, no downloads.

A tiny Llama learns a PosGen task at a short length with RoPE and with Resonance RoPE; both are then
tested at 4x the length with their own table and with YaRN's put in at test time (the Resonance RoPE
paper's protocol), and the RoPE model also with ReRoPE and Dynamic-YaRN put in at test time.

:func:`run_position_sampling` (``ropescale demo --position-sampling``) is the position-sampling demonstration
(issue 46): a model trained at a window W with PoSE's or CREAM's sampled positions reaching 4W, tested at 4W, beside
models trained at W and at 4W without sampling, with RoPE and with YaRN's table (``tstl.run_position_sampling``).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Callable

import torch

from . import posgen, tstl

__all__ = ["run", "run_position_sampling", "SAMPLING_WINDOW", "SAMPLING_STEPS"]

#: --position-sampling's default window: the smallest multiple of 16 CREAM takes at a target of 4W (its head and
#: tail are 4 x 4 = 16 tokens each, and it needs a middle).
SAMPLING_WINDOW = 48
#: --position-sampling's default steps per model (8 models, one of them at 4W).
SAMPLING_STEPS = 300


@contextlib.contextmanager
def _threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _make_folder(plot: str) -> None:
    """The plot's folder, made when the plot is written (after training): a run refused before it (a usage error,
    Ctrl-C) leaves no folder behind."""
    Path(plot).absolute().parent.mkdir(parents=True, exist_ok=True)


def _report(task, train_length, test_length, steps, seed, elapsed, plot, **results) -> dict:
    """The JSON-ready dict both demos return: the settings, then their results."""
    return {"task": task, "train_length": train_length, "test_length": test_length, "steps": steps, "seed": seed,
            "seconds": elapsed, "plot": plot, **results}


def run(
    task: str = "cot",
    train_length: int = 32,
    test_length: int | None = None,
    steps: int = 600,
    seed: int = 0,
    threads: int = 1,
    plot: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = print,
    n_train: int = 10_000,
    n_test: int = 500,
) -> dict:
    """Run the demo; ``log`` receives the human-readable lines (None: silent); ``plot``: a PNG path for
    accuracy by position (None: no figure). Returns the results as a JSON-ready dict."""
    say = log or (lambda _line: None)
    started = time.perf_counter()
    test_length = test_length or 4 * train_length
    factor = test_length / train_length
    with _threads(threads):
        data = posgen.splits(task, n_train, 0, n_test, train_length, test_length, seed=seed)
        methods = tstl.paper_methods(train_length, factor=factor) + tstl.inference_methods(train_length)
        say(f"PosGen {task} (j=1, k=3, h = sum mod 17): tiny Llama ({tstl.TINY.layers} layers, "
            f"d={tstl.TINY.hidden_size}) trained at length {train_length} with RoPE and with Resonance RoPE "
            f"({steps} steps each), tested at {test_length}.")
        results = tstl.run_task(data, methods, tstl.TINY, tstl.TrainConfig(steps=steps), seed=seed,
                                progress=progress)
    elapsed = time.perf_counter() - started

    trained_with = {m.name: ("Resonance RoPE" if m.train.resonance else "RoPE") for m in methods}
    header = f"{'method':<24} {'trained with':<15} {'in-dist. acc':>12} {'OOD acc':>9} {'paper OOD':>10}"
    say("")
    say(header)
    say("-" * len(header))
    for r in results:
        paper = tstl.paper_ood(task, r.method)
        say(f"{r.method:<24} {trained_with[r.method]:<15} {100 * r.id_accuracy:>11.1f}% "
            f"{100 * r.ood_accuracy:>8.1f}% " + (f"{paper:>9.2f}%" if paper is not None else ""))
    say(f"\nin-distribution: positions {data.j + data.k}..{train_length - 1}; OOD: positions "
        f"{train_length}..{test_length - 1} (teacher-forced next-token accuracy, {n_test} test sequences).\n"
        "paper OOD: Resonance RoPE's Table 1 (T5-small widths, trained at 64 for 150 epochs, tested at 256).")
    rope = next(r for r in results if r.method == "RoPE")
    if rope.id_accuracy < 0.95:
        say(f"note: the RoPE model reached only {100 * rope.id_accuracy:.1f}% in distribution; "
            "raise --steps for a meaningful comparison.")
    if plot:
        from . import plots

        _make_folder(plot)
        curves = {r.method: r.accuracy for r in results}
        plots.accuracy_by_position(
            curves, plot, train_length, first_position=data.j + data.k,
            title=f"PosGen {task}: trained at {train_length}, tested at {test_length}",
        )
        say(f"wrote {plot}")
    say(f"done in {elapsed:.0f} s")
    return _report(task, train_length, test_length, steps, seed, elapsed, plot, results=[
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.as_dict().items()} for r in results])


def run_position_sampling(
    task: str = "cot",
    train_length: int = SAMPLING_WINDOW,
    test_length: int | None = None,
    steps: int = SAMPLING_STEPS,
    seed: int = 0,
    threads: int = 1,
    plot: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = print,
    n_train: int = 10_000,
    n_test: int = 500,
) -> dict:
    """The position-sampling demonstration for one seed (``tstl.run_position_sampling``): RoPE and YaRN, each
    trained at ``train_length`` (W), at W with PoSE and with CREAM to ``test_length`` (default 4W), and at
    ``test_length``; all tested at ``test_length``. ``log`` receives the table; ``plot`` a PNG path for accuracy
    by position. Returns the results as a JSON-ready dict."""
    say = log or (lambda _line: None)
    started = time.perf_counter()
    test_length = test_length or 4 * train_length
    with _threads(threads):
        cells = tstl.sampling_cells()
        say(f"PosGen {task} (j=1, k=3, h = sum mod 17): tiny Llama ({tstl.TINY.layers} layers, "
            f"d={tstl.TINY.hidden_size}), RoPE and YaRN (s={test_length / train_length:g}, original length "
            f"{train_length}); per table, trained at W = {train_length}, at W with PoSE and with CREAM positions "
            f"to {test_length}, and at {test_length} ({len(cells)} models, {steps} steps each); tested at "
            f"{test_length}.")
        results = tstl.run_position_sampling(task, train_length, test_length, train_config=tstl.TrainConfig(steps=steps),
                                             seed=seed, n_train=n_train, n_test=n_test, progress=progress)
    elapsed = time.perf_counter() - started
    rows = tstl.summarize_sampling(results)
    say("")
    say(tstl.format_sampling_table(rows))
    short = [r for r in results if r.training == "short"]
    if any(r.id_accuracy < 0.95 for r in short):
        worst = min(r.id_accuracy for r in short)
        say(f"note: a model trained at W reached only {100 * worst:.1f}% in distribution; raise --steps for a "
            "meaningful comparison.")
    if plot:
        from . import plots

        _make_folder(plot)
        curves = {f"{tstl.sampling_table_for(r.table, train_length, test_length)[0]}, "
                  f"{tstl.SamplingCell(r.table, r.training).label(train_length, test_length)}": r.accuracy
                  for r in results}
        plots.accuracy_by_position(
            curves, plot, train_length, first_position=4, smooth=4,
            title=f"PosGen {task}: trained at W = {train_length} (plain, PoSE, CREAM) or at {test_length}, "
                  f"tested at {test_length}",
        )
        say(f"wrote {plot}")
    say(f"done in {elapsed:.0f} s")
    return _report(task, train_length, test_length, steps, seed, elapsed, plot, table=[dict(row) for row in rows],
                   results=[r.as_dict() for r in results])
