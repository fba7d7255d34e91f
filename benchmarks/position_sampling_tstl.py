"""Position sampling on PosGen: train at a window W with PoSE's or CREAM's positions reaching 4W, test at 4W, beside
training at W and at 4W without sampling, for RoPE and for YaRN (issue 46, part 2; ``ropescale.tstl``).

    python benchmarks/position_sampling_tstl.py                     # CPU: cot, W = 48 -> 192, 600 steps, 3 seeds
    python benchmarks/position_sampling_tstl.py --seeds 5 --tasks cot recursive --markdown --plot sampling.png
    python benchmarks/position_sampling_tstl.py --from-results      # the table of what --results holds; no training

Per task and seed, 8 models (tiny Llama, ``ropescale.tstl.TINY``), each from the same initialisation and the same
batches of the same sequences (generated at 4W): per table (RoPE; YaRN with factor 4 and original length W, in
training and in test), trained on the sequences' first W tokens, on W tokens sampled by PoSE and by CREAM with
their position ids (``ropescale.training``; the loss on the tokens the sample defines, see ``ropescale.tstl``), and
on the whole 4W; every model is tested at 4W with its own table. Every cell is appended to --results as it ends (one
JSON line) and skipped on the next run with the same settings, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_cell, read_cells  # noqa: E402
from ropescale import posgen, tstl  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "position_sampling_tstl.jsonl"
SETTINGS = ("window", "target", "steps", "batch_size", "lr", "n_train", "n_test", "sigma")


def done_cells(path: Path, settings: dict) -> dict:
    """The cells of ``path`` measured with ``settings``, by (task, seed, table, training)."""
    return read_cells(path, key=lambda row: (row["task"], row["seed"], row["table"], row["training"]),
                      keep=lambda row: all(row.get(k) == v for k, v in settings.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=posgen.TASKS, default=["cot"], help="default: cot")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--window", type=int, default=48, help="W, the training window (default 48)")
    parser.add_argument("--factor", type=int, default=4, help="target = factor x W, and YaRN's s (default 4)")
    parser.add_argument("--steps", type=int, default=600, help="training steps per model (default 600)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--n-train", type=int, default=10_000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--sigma", type=float, default=3.0, help="CREAM's sigma (default 3, the authors')")
    parser.add_argument("--samplers", nargs="+", default=list(tstl.SAMPLERS), help="default: pose cream")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"JSONL of cells (default {RESULTS})")
    parser.add_argument("--from-results", action="store_true", help="print the table of --results; train nothing")
    parser.add_argument("--plot", metavar="FILE.png", help="accuracy by position, seed mean, first task")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    target = args.factor * args.window
    settings = dict(window=args.window, target=target, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                    n_train=args.n_train, n_test=args.n_test, sigma=args.sigma)
    seeds = list(range(args.seeds))
    cells = tstl.sampling_cells(samplers=args.samplers)  # unknown sampler names fail here, before any training
    for name in args.samplers:
        tstl.make_sampler(name, args.window, target, args.sigma)
    done = done_cells(args.results, settings)
    wanted = [(task, seed, c.table, c.training) for task in args.tasks for seed in seeds for c in cells]
    print(f"PosGen {' '.join(args.tasks)}: W = {args.window} -> {target}; tiny Llama ({tstl.TINY.layers} layers, "
          f"d_model {tstl.TINY.hidden_size}), {args.steps} steps x batch {args.batch_size}, lr {args.lr:g}; "
          f"{args.n_train} train / {args.n_test} test sequences; seeds {seeds}; "
          f"{sum(k in done for k in wanted)}/{len(wanted)} cells already in {args.results}", flush=True)

    started, started_cpu = time.perf_counter(), time.process_time()
    if not args.from_results:
        torch.set_num_threads(args.threads)
        config = tstl.TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr)
        progress = not args.quiet and sys.stderr.isatty()
        for task in args.tasks:
            for seed in seeds:
                if all((task, seed, c.table, c.training) in done for c in cells):
                    continue
                clock = [time.perf_counter()]

                def save(result: tstl.SamplingResult, task=task, seed=seed, clock=clock) -> None:
                    now = time.perf_counter()
                    row = {**result.as_dict(), **settings, "cell_seconds": now - clock[0]}
                    clock[0] = now
                    append_cell(args.results, row)
                    done[(task, seed, result.table, result.training)] = row
                    print(f"  {task} seed {seed} {row['table_name']:<10} {row['label']:<14} in-dist. "
                          f"{100 * row['id_accuracy']:5.1f}%  OOD {100 * row['ood_accuracy']:5.1f}%  "
                          f"({row['cell_seconds']:.0f} s)", flush=True)

                tstl.run_position_sampling(
                    task, args.window, target, samplers=args.samplers, train_config=config, seed=seed,
                    n_train=args.n_train, n_test=args.n_test, sigma=args.sigma, progress=progress,
                    skip=lambda c, task=task, seed=seed: (task, seed, c.table, c.training) in done, on_result=save)
    rows = [done[k] for k in wanted if k in done]
    if not rows:
        print("no results yet")
        return 1
    cell_seconds = sum(r.get("cell_seconds", 0.0) for r in rows)
    print(f"\n{len(rows)}/{len(wanted)} cells; this run {(time.perf_counter() - started) / 60:.1f} min wall, "
          f"{(time.process_time() - started_cpu) / 60:.1f} min CPU; all cells {cell_seconds / 60:.1f} min wall\n")
    table = tstl.summarize_sampling(rows)
    print(tstl.format_sampling_table(table))
    if args.markdown:
        print("\n" + tstl.format_sampling_table(table, markdown=True))
    if args.plot:
        from ropescale import plots

        curves = {}
        for row in table:
            if row["task"] != args.tasks[0]:
                continue
            accs = [torch.tensor([float("nan") if v is None else v for v in r["accuracy_by_position"]])
                    for r in rows if (r["task"], r["table"], r["training"]) == (row["task"], row["table"],
                                                                               row["training"])]
            curves[f"{row['table_name']}, {row['label']}"] = torch.stack(accs).mean(0)
        plots.accuracy_by_position(curves, args.plot, args.window, first_position=4, smooth=4,
                                   title=f"PosGen {args.tasks[0]}: trained at W = {args.window} (plain, PoSE, CREAM) "
                                         f"or at {target}, tested at {target}; mean of {len(seeds)} seed(s)")
        print(f"wrote {args.plot}")
    return 0 if len(rows) == len(wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
