"""Position sampling for train short, test long (:mod:`ropescale.tstl`, issue 46): the samplers and tables of the
rows, the targets a sample defines, training on sampled positions, the measured cells and the summary table."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from . import posgen, scaling, training
from .tstl_model import TrainConfig, optimise


# ---------------------------------------------------------------------------------------------
# Train at a short window with sampled positions, test long (issue 46, part 2)
#
# How PoSE and CREAM apply to PosGen. The samplers (ropescale.training) pick token indices of a text and give them
# position ids; they assume a text, whose tokens mean what they mean wherever they sit. A PosGen token instead is a
# rule of the tokens at fixed offsets before it (and, for CoT, of the first token; for semi-recursive, of a token
# half way back), so a sampled row is a PosGen sequence only where the rule still holds *in the positions the row
# carries*. The choice made here:
#
# - The training sequences are generated at the target length T (= 4W): the samplers draw from a T-token text, as
#   the authors' collators draw from a long document, and the same sequences (their first W tokens, the whole of
#   them, or a sample) train every row, batch for batch.
# - A sample is W tokens ``(indices, positions)``; the model gets those tokens with those ``position_ids``.
# - The loss is taken only on the *defined* targets: a token at index ``i`` given position ``P`` is scored when
#   every token the rule reads for ``x_i`` is in the sample and sits at the position the rule names for position
#   ``P`` (``dependencies(task, i)`` maps onto ``dependencies(task, P)``, term by term). Then the target is exactly
#   the rule applied to the tokens the model can see at the positions it is told, so the row is a valid PosGen
#   fragment at every scored token and nothing else is learned. For recursive and CoT the rule reads fixed offsets
#   (and position 0, which both samplers keep at 0), so all but the first j + k (CoT: k) tokens of a PoSE chunk are
#   defined, whatever skip the chunk got; CREAM's positions are the indices themselves when the text is T long, so
#   only the first tokens of its middle and tail go unscored. For semi-recursive the far token's position
#   depends on the position itself, so a PoSE chunk with a skip is mostly unscored (the check says so; the tables
#   report the fraction of targets that carried the loss).
# - Generating W tokens and only giving them sampled positions was the alternative. On a W-token text PoSE's two
#   chunks are adjacent in the text (only their positions skip) and CREAM takes its middle from just before its
#   tail whatever positions it gives it: the plain W sequence with other position ids. After the same masking that
#   trains recursive and CoT alike, but it is not what the samplers do with the long texts a user gives them.
#
# Every row is tested at T on the same test sequences with the table it was trained with (RoPE: plain; YaRN: its
# static table, factor T / W, original length W, in training and in test).
# ---------------------------------------------------------------------------------------------

#: The position samplers, by the names the demo and the benchmark take.
SAMPLERS = ("pose", "cream")
#: The tables the demonstration trains with: plain RoPE and YaRN (factor target / window, original length window).
SAMPLING_TABLES = ("rope", "yarn")
_SAMPLER_LABELS = {"pose": "PoSE", "cream": "CREAM"}


def check_window_target(window: int, target: int) -> None:
    for what, value in (("window", window), ("target", target)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"position sampling: {what} must be an integer >= 1, got {value!r}")
    if target <= window:
        raise ValueError(f"position sampling: target ({target}) must be > window ({window}): the sampled positions "
                         "reach the target, and the test's out-of-distribution positions are [window, target)")


def make_sampler(name: str, window: int, target: int, sigma: float = 3.0) -> training.PoSE | training.CREAM:
    """``training.PoSE(window, target)`` for ``"pose"``, ``training.CREAM(window, target, sigma)`` for ``"cream"``."""
    if not isinstance(name, str) or name.lower() not in SAMPLERS:
        raise ValueError(f"unknown position sampler {name!r}: choose one of {', '.join(SAMPLERS)}")
    check_window_target(window, target)
    if name.lower() == "pose":
        return training.PoSE(window, target)
    return training.CREAM(window, target, sigma)


def sampling_table_for(name: str, window: int, target: int) -> tuple[str, scaling.RopeScaling]:
    """The display name and table of ``"rope"`` (plain) or ``"yarn"`` (factor ``target / window``, original length
    ``window``)."""
    if not isinstance(name, str) or name.lower() not in SAMPLING_TABLES:
        raise ValueError(f"unknown table {name!r}: choose one of {', '.join(SAMPLING_TABLES)}")
    if name.lower() == "rope":
        return "RoPE", scaling.Default()
    factor = target / window
    return f"YaRN (s={factor:g})", scaling.YaRN(factor=factor, original_max_position=window)


def dependencies(task: str, l: int, j: int = 1, k: int = 3) -> list[int]:
    """The indices PosGen's rule reads for ``x_l`` (``l >= j + k``), in the rule's argument order."""
    if l < j + k:
        raise ValueError(f"dependencies: x_{l} is a free token (l < j + k = {j + k})")
    if task == "recursive":
        return list(range(l - (j + k), l))
    if task == "cot":
        return list(range(j)) + list(range(l - k, l))
    if task == "semi_recursive":
        p = posgen.far_pointer(l, j, k)
        return list(range(p, p + j)) + list(range(l - k, l))
    raise ValueError(f"dependencies: task must be one of {posgen.TASKS}, got {task!r}")


def defined_targets(task: str, indices: Sequence[int], positions: Sequence[int], j: int = 1, k: int = 3) -> list[bool]:
    """Per sampled token (the text's ``x_{indices[r]}`` at position ``positions[r]``): whether the rule, read at that
    position, names tokens of the sample holding exactly the tokens it reads for that index (module comment above),
    so that the token is a function of what the model sees where it is told it sits."""
    where = {int(i): int(p) for i, p in zip(indices, positions)}
    out = []
    for i, p in zip(indices, positions):
        i, p = int(i), int(p)
        out.append(i >= j + k and p >= j + k and all(
            where.get(d) == q for d, q in zip(dependencies(task, i, j, k), dependencies(task, p, j, k))))
    return out


def sampled_batch(sequences: torch.Tensor, sampler: training.PoSE | training.CREAM, task: str, j: int, k: int,
                  rng: random.Random, np_rng: np.random.RandomState) -> dict[str, torch.Tensor]:
    """One sampled batch of ``sequences`` ``[B, T]``: ``input_ids`` and ``position_ids`` ``[B, window]`` (the
    sampler's tokens and positions) and ``labels`` (the tokens, -100 where not :func:`defined_targets`)."""
    rows = sequences.tolist()
    samples = sampler.sample([len(r) for r in rows], rng, np_rng)
    ids = torch.tensor([[row[i] for i in indices] for row, (indices, _) in zip(rows, samples)], dtype=torch.long)
    pos = torch.tensor([positions for _, positions in samples], dtype=torch.long)
    keep = torch.tensor([defined_targets(task, indices, positions, j, k) for indices, positions in samples])
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(~keep, -100)}


def train_sampled(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    sampler: training.PoSE | training.CREAM,
    task: str,
    j: int,
    k: int,
    config: TrainConfig,
    seed: int = 0,
    progress: bool = False,
    desc: str = "train",
) -> tuple[float, float]:
    """:func:`train` with sampled positions: the same optimiser, schedule and batches of ``sequences`` (``[n, T]``,
    the same generator draws), each row turned into the sampler's ``window`` tokens, fed as a user would,
    ``model(input_ids=..., position_ids=...)`` (the first ``window - 1``, as :func:`train` feeds a ``window``-token
    sequence), the loss on the defined targets only. ``random.Random(seed)`` and ``numpy.random.RandomState(seed)``
    drive the sampler. Returns the final loss and the fraction of targets that carried the loss."""
    device = next(model.parameters()).device
    rng, np_rng = random.Random(seed), np.random.RandomState(seed)
    counts = [0, 0]  # targets scored, targets

    def step_loss(rows):
        batch = {name: t.to(device) for name, t in sampled_batch(rows, sampler, task, j, k, rng, np_rng).items()}
        targets = batch["labels"][:, 1:]
        counts[0] += int((targets != -100).sum())
        counts[1] += targets.numel()
        if not bool((targets != -100).any()):
            return None
        logits = model(input_ids=batch["input_ids"][:, :-1], position_ids=batch["position_ids"][:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    loss = optimise(model, sequences, config, seed, progress, desc, step_loss)
    return loss, (counts[0] / counts[1] if counts[1] else math.nan)


@dataclass(frozen=True)
class SamplingCell:
    """One row of the demonstration for one seed: a table (``"rope"``/``"yarn"``) and a training (``"short"``: at
    the window; ``"pose"``/``"cream"``: at the window with that sampler to the target; ``"long"``: at the target)."""

    table: str
    training: str

    def label(self, window: int, target: int) -> str:
        factor = f"{target / window:g}W"
        return {"short": "trained at W", "long": f"trained at {factor}"}.get(
            self.training, f"W + {_SAMPLER_LABELS.get(self.training, self.training)}")


def sampling_cells(tables: Sequence[str] = SAMPLING_TABLES, samplers: Sequence[str] = SAMPLERS) -> list[SamplingCell]:
    """Per table: trained at the window, then with each sampler, then trained at the target."""
    for name in samplers:
        if not isinstance(name, str) or name.lower() not in SAMPLERS:
            raise ValueError(f"unknown position sampler {name!r}: choose one of {', '.join(SAMPLERS)}")
    for name in tables:
        if not isinstance(name, str) or name.lower() not in SAMPLING_TABLES:
            raise ValueError(f"unknown table {name!r}: choose one of {', '.join(SAMPLING_TABLES)}")
    trainings = ["short"] + [s.lower() for s in samplers] + ["long"]
    return [SamplingCell(t.lower(), tr) for t in tables for tr in trainings]


@dataclass
class SamplingResult:
    """A measured cell: accuracy per position at the target length (as :func:`position_accuracy` returns it)."""

    table: str  #: "rope" or "yarn"
    training: str  #: "short", "pose", "cream" or "long"
    task: str
    seed: int
    window: int
    target: int
    accuracy: torch.Tensor
    first_target: int
    train_seconds: float = 0.0
    scored_fraction: float | None = None  #: the fraction of the training targets that carried the loss
    extra: dict = field(default_factory=dict)

    @property
    def id_accuracy(self) -> float:
        return float(self.accuracy[self.first_target : self.window].mean())

    @property
    def ood_accuracy(self) -> float:
        return float(self.accuracy[self.window : self.target].mean())

    def as_dict(self) -> dict:
        return {
            "task": self.task, "seed": self.seed, "table": self.table, "training": self.training,
            "table_name": sampling_table_for(self.table, self.window, self.target)[0],
            "label": SamplingCell(self.table, self.training).label(self.window, self.target),
            "window": self.window, "target": self.target, "first_target": self.first_target,
            "id_accuracy": self.id_accuracy, "ood_accuracy": self.ood_accuracy,
            "train_seconds": self.train_seconds, "scored_fraction": self.scored_fraction, **self.extra,
            "accuracy_by_position": [None if math.isnan(v) else v for v in self.accuracy.tolist()],
        }



def summarize_sampling(results: Sequence[dict | SamplingResult], min_gap: float = 0.02) -> list[dict]:
    """The table's rows from measured cells (``SamplingResult`` or its ``as_dict``): per task, table and training,
    in-distribution and OOD accuracy (mean and sample std over seeds), the fraction of targets that carried the loss,
    and for the sampled rows ``recovered = (OOD(sampled) - OOD(trained at W)) / (OOD(trained at T) - OOD(trained at
    W))`` on the seed means (None when trained at T is not ``min_gap`` above trained at W: the gap is too small to
    divide by), with ``wins``: the seeds on which the sampled row's OOD accuracy beats trained-at-W's."""
    cells = [r.as_dict() if isinstance(r, SamplingResult) else r for r in results]
    order = {"short": 0, "pose": 1, "cream": 2, "long": 3}
    groups: dict[tuple[str, str], dict[str, dict[int, dict]]] = {}
    for c in cells:
        groups.setdefault((c["task"], c["table"]), {}).setdefault(c["training"], {})[c["seed"]] = c
    rows = []
    for (task, table), by_training in groups.items():
        means = {tr: statistics.fmean(c["ood_accuracy"] for c in seeds.values()) for tr, seeds in by_training.items()}
        gap = means["long"] - means["short"] if "long" in means and "short" in means else None
        for tr in sorted(by_training, key=lambda t: (order.get(t, 1.5), t)):
            seeds = by_training[tr]
            first = next(iter(seeds.values()))
            sampled = tr not in ("short", "long")
            recovered = wins = None
            if sampled and gap is not None:
                recovered = (means[tr] - means["short"]) / gap if gap >= min_gap else None
                short = by_training["short"]
                paired = [s for s in seeds if s in short]
                wins = (sum(seeds[s]["ood_accuracy"] > short[s]["ood_accuracy"] for s in paired), len(paired))
            scored = [c["scored_fraction"] for c in seeds.values() if c.get("scored_fraction") is not None]
            rows.append(dict(
                task=task, table=table, training=tr, table_name=first["table_name"], label=first["label"],
                window=first["window"], target=first["target"], first_target=first["first_target"], n=len(seeds),
                seeds=sorted(seeds),
                id=_mean_std([c["id_accuracy"] for c in seeds.values()]),
                ood=_mean_std([c["ood_accuracy"] for c in seeds.values()]),
                scored=statistics.fmean(scored) if scored else None,
                gap=gap, recovered=recovered, wins=wins, min_gap=min_gap,
            ))
    return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def format_sampling_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The rows of :func:`summarize_sampling` as aligned text (or Markdown), with the recovered fraction defined in
    the heading."""
    if not rows:
        return "(no results)"
    window, target, min_gap = rows[0]["window"], rows[0]["target"], rows[0]["min_gap"]
    factor = f"{target / window:g}W"
    seeds = sorted({s for r in rows for s in r["seeds"]})
    heading = (
        f"W = {window}, {factor} = {target}; accuracy = teacher-forced next-token accuracy (%), mean ± std over "
        f"{len(seeds)} seed(s); in-dist. = positions [{rows[0]['first_target']}, {window}), OOD = positions "
        f"[{window}, {target}).\nrecovered = (OOD(sampled) - OOD(trained at W)) / (OOD(trained at {factor}) - "
        f"OOD(trained at W)), on the seed means, per task and table: the share of what training at {factor} gains "
        f"over training at W that sampling at W obtains (0% = no better than W, 100% = as good as {factor}); n/a "
        f"when trained at {factor} is less than {100 * min_gap:g} points above trained at W. wins = seeds where "
        f"the sampled row's OOD beats trained at W's. loss on = the share of training targets that carried the loss "
        f"(the rest are not defined by the tokens in the sample).")
    columns = ["task", "table", "training", "in-dist. %", f"OOD % [{window}, {target})", "recovered", "wins",
               "loss on"]
    lines = []
    for r in rows:
        if r["recovered"] is not None:
            recovered = f"{100 * r['recovered']:.0f}%"
        elif r["training"] in ("short", "long"):
            recovered = "(reference)"
        elif r["gap"] is not None:
            recovered = f"n/a (gap {100 * r['gap']:+.1f} pts)"
        else:
            recovered = "n/a"
        lines.append([
            r["task"], r["table_name"], r["label"], _pm(*r["id"]), _pm(*r["ood"]), recovered,
            f"{r['wins'][0]}/{r['wins'][1]}" if r["wins"] else "",
            f"{100 * r['scored']:.0f}%" if r["scored"] is not None else "",
        ])
    if markdown:
        out = [heading, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max([len(c)] + [len(line[i]) for line in lines]) for i, c in enumerate(columns)]
    out = [heading, "", "  ".join(f"{c:<{w}}" for c, w in zip(columns, widths)),
           "-" * (sum(widths) + 2 * (len(widths) - 1))]
    out += ["  ".join(f"{c:<{w}}" for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _pm(mean: float, std: float) -> str:
    return f"{100 * mean:.1f} ± {100 * std:.1f}"
