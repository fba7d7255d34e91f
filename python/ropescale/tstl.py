"""Train short, test long: PosGen on a small transformers Llama, one method per RoPE table.

This is the experiment of Resonance RoPE's section 6.1, as the authors' code runs it: a model is
trained at ``train_length`` with one table (RoPE or Resonance RoPE) and evaluated at
``test_length`` with a possibly different one; YaRN and Resonance YaRN are the YaRN tables put
in at evaluation time on the RoPE and Resonance RoPE models (no training with YaRN); ReRoPE and
Dynamic-YaRN are put in at evaluation time on the RoPE model. Every table and attention goes into the
transformers model through ``ropescale.hf.patch``.

Accuracy is teacher-forced next-token accuracy per position ``l`` (predicting ``x_l`` from
``x_0 .. x_{l-1}``): in-distribution over ``j + k <= l < train_length``, out-of-distribution
(OOD, the paper's metric) over ``train_length <= l < test_length``.

:func:`run_position_sampling` is the position-sampling demonstration (issue 46): a model trained at a window W
with PoSE's or CREAM's sampled positions (``ropescale.training``) reaching ``T = 4W``, tested at T, beside models
trained at W and at T without sampling, with RoPE and with YaRN's table (factor T / W, original length W) in
training and test; :func:`summarize_sampling` and :func:`format_sampling_table` make its table. How the samplers
apply to PosGen (sequences generated at T, the loss on the tokens the sample defines) is the comment above
:data:`SAMPLERS`.

By role: the model, its training loop and its accuracy in :mod:`ropescale.tstl_model`, position sampling's pieces
and its summary table in :mod:`ropescale.tstl_sampling` (their public names re-exported here); the paper's
methods, the runners (:func:`run_task`, :func:`run_sampling_cell`, :func:`run_position_sampling`) here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import hf, posgen, scaling
from .tstl_model import T5_SMALL, TINY, ModelConfig, TrainConfig, build_model, position_accuracy, train
from .tstl_sampling import (SAMPLERS, SAMPLING_TABLES, SamplingCell, SamplingResult, check_window_target,
                            defined_targets, dependencies, format_sampling_table, make_sampler, sampled_batch,
                            sampling_cells, sampling_table_for, summarize_sampling, train_sampled)

__all__ = [
    "Method",
    "paper_methods",
    "ModelConfig",
    "TrainConfig",
    "TINY",
    "T5_SMALL",
    "build_model",
    "train",
    "position_accuracy",
    "MethodResult",
    "run_task",
    "inference_methods",
    "PAPER_TABLE1",
    "paper_ood",
    "SAMPLERS",
    "SAMPLING_TABLES",
    "make_sampler",
    "dependencies",
    "defined_targets",
    "sampled_batch",
    "train_sampled",
    "SamplingCell",
    "SamplingResult",
    "sampling_cells",
    "sampling_table_for",
    "run_sampling_cell",
    "run_position_sampling",
    "summarize_sampling",
    "format_sampling_table",
]

#: Resonance RoPE, Table 1: OOD accuracy (%) of a 2-layer T5-small-width model trained at 64 and
#: tested on positions 65..256, mean of 5 seeds.
PAPER_TABLE1 = {
    "recursive": {"RoPE": 65.29, "Resonance RoPE": 62.64, "YaRN": 95.93, "Resonance YaRN": 98.30},
    "cot": {"RoPE": 69.56, "Resonance RoPE": 75.25, "YaRN": 98.71, "Resonance YaRN": 99.58},
    "semi_recursive": {"RoPE": 17.96, "Resonance RoPE": 29.78, "YaRN": 33.70, "Resonance YaRN": 48.46},
}


def paper_ood(task: str, method_name: str) -> float | None:
    """The paper's Table 1 figure for a method named as ``paper_methods`` names it (None if absent)."""
    return PAPER_TABLE1.get(task, {}).get(method_name.split(" (")[0])


@dataclass(frozen=True)
class Method:
    """A row of the table: the table the model is trained with, and the table and attention
    (``ropescale.hf.patch`` arguments) it is tested with."""

    name: str
    train: scaling.RopeScaling
    test: scaling.RopeScaling
    attention: str = "sdpa"
    window: int | None = None


def paper_methods(train_length: int, factor: float = 4.0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> list[Method]:
    """RoPE, Resonance RoPE, YaRN and Resonance YaRN as in Table 1 (YaRN at test time, scale ``factor``,
    original length ``train_length``)."""
    rope, resonance = scaling.Default(), scaling.Default(resonance=True)

    def yarn(res: bool) -> scaling.YaRN:
        return scaling.YaRN(factor=factor, original_max_position=train_length, beta_fast=beta_fast,
                            beta_slow=beta_slow, resonance=res)

    s = f"{factor:g}"
    return [
        Method("RoPE", rope, rope),
        Method("Resonance RoPE", resonance, resonance),
        Method(f"YaRN (s={s})", rope, yarn(False)),
        Method(f"Resonance YaRN (s={s})", resonance, yarn(True)),
    ]


def inference_methods(train_length: int, rerope_window: int | None = None) -> list[Method]:
    """ReRoPE (window ``train_length // 2`` unless given; Su's best is 1/4 to 1/2 of the training
    length) and Dynamic-YaRN, put in at test time on the RoPE model."""
    window = rerope_window or max(1, train_length // 2)
    rope = scaling.Default()
    return [
        Method(f"ReRoPE (w={window})", rope, rope, attention="rerope", window=window),
        Method("Dynamic-YaRN", rope, scaling.DynamicYaRN(original_max_position=train_length)),
    ]



@dataclass
class MethodResult:
    method: str
    task: str
    seed: int
    train_length: int
    accuracy: torch.Tensor  #: per position, as ``position_accuracy`` returns it
    first_target: int
    train_seconds: float = 0.0

    @property
    def id_accuracy(self) -> float:
        return float(self.accuracy[self.first_target : self.train_length].mean())

    @property
    def ood_accuracy(self) -> float:
        return float(self.accuracy[self.train_length :].mean())

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "task": self.task,
            "seed": self.seed,
            "id_accuracy": self.id_accuracy,
            "ood_accuracy": self.ood_accuracy,
            "train_seconds": self.train_seconds,
            "accuracy_by_position": self.accuracy.tolist(),
        }


def run_task(
    data: posgen.Splits,
    methods: Sequence[Method],
    model_config: ModelConfig = TINY,
    train_config: TrainConfig = TrainConfig(),
    seed: int = 0,
    progress: bool = False,
    device: str | torch.device = "cpu",
) -> list[MethodResult]:
    """Train one model per distinct training table in ``methods`` on ``data.train`` (same seed, so
    the same initialisation and batches for every table), then test every method on ``data.test``."""
    first_target = data.j + data.k
    results: list[MethodResult] = []
    trained: dict[scaling.RopeScaling, tuple[torch.nn.Module, float]] = {}
    for method in methods:
        if method.train not in trained:
            model = build_model(data.modulus, model_config, data.train_length, seed).to(device)
            hf.patch(model, method.train)
            start = time.perf_counter()
            train(model, data.train, first_target, train_config, seed, progress,
                  desc=f"{data.task} seed {seed} {_train_name(method.train)}")
            trained[method.train] = (model, time.perf_counter() - start)
        model, seconds = trained[method.train]
        hf.unpatch(model)
        hf.patch(model, method.test, attention=method.attention, window=method.window)
        try:
            accuracy = position_accuracy(model, data.test, incremental=method.test.dynamic)
        finally:
            hf.unpatch(model)
            hf.patch(model, method.train)
        results.append(MethodResult(method.name, data.task, seed, data.train_length, accuracy, first_target, seconds))
    return results


def _train_name(table: scaling.RopeScaling) -> str:
    return ("Resonance " if table.resonance else "") + ("RoPE" if table.rope_type == scaling.Default.rope_type else table.rope_type)



def run_sampling_cell(
    data: posgen.Splits,
    cell: SamplingCell,
    window: int,
    model_config: ModelConfig = TINY,
    train_config: TrainConfig = TrainConfig(),
    seed: int = 0,
    sigma: float = 3.0,
    progress: bool = False,
    device: str | torch.device = "cpu",
) -> SamplingResult:
    """Train and test one cell. ``data``'s training and test sequences are ``target`` long; every cell builds the
    same initial model (``seed``), ``hf.patch``-es it with its table, trains, and is tested on ``data.test``."""
    target = data.train_length
    check_window_target(window, target)
    if data.test_length != target:
        raise ValueError(f"run_sampling_cell: the test sequences ({data.test_length}) must be as long as the training "
                         f"ones ({target})")
    name, table = sampling_table_for(cell.table, window, target)
    first_target = data.j + data.k
    model = build_model(data.modulus, model_config, window, seed).to(device)
    hf.patch(model, table)
    desc = f"{data.task} seed {seed} {name} {cell.label(window, target)}"
    scored = None
    start = time.perf_counter()
    if cell.training in ("short", "long"):
        length = window if cell.training == "short" else target
        train(model, data.train[:, :length], first_target, train_config, seed, progress, desc=desc)
        scored = (length - first_target) / (length - 1)  # train's loss: the targets past the free tokens
    else:
        sampler = make_sampler(cell.training, window, target, sigma)
        _, scored = train_sampled(model, data.train, sampler, data.task, data.j, data.k, train_config, seed,
                                  progress, desc=desc)
    seconds = time.perf_counter() - start
    accuracy = position_accuracy(model, data.test)
    return SamplingResult(cell.table, cell.training, data.task, seed, window, target, accuracy, first_target,
                          seconds, scored)


def run_position_sampling(
    task: str = "cot",
    window: int = 48,
    target: int | None = None,
    tables: Sequence[str] = SAMPLING_TABLES,
    samplers: Sequence[str] = SAMPLERS,
    model_config: ModelConfig = TINY,
    train_config: TrainConfig = TrainConfig(),
    seed: int = 0,
    n_train: int = 10_000,
    n_test: int = 500,
    sigma: float = 3.0,
    progress: bool = False,
    device: str | torch.device = "cpu",
    skip: Callable[[SamplingCell], bool] | None = None,
    on_result: Callable[[SamplingResult], None] | None = None,
) -> list[SamplingResult]:
    """The demonstration for one task and seed: per table (RoPE, YaRN), a model trained at ``window``, one per
    sampler trained at ``window`` with positions sampled to ``target`` (default ``4 * window``), and one trained
    at ``target``; each tested at ``target``. The sequences are generated at ``target`` (see the comment above
    :data:`SAMPLERS`). ``skip(cell)`` true leaves a cell out (a resumed run); ``on_result`` sees each result as
    it ends. The samplers and tables are checked before anything trains."""
    target = 4 * window if target is None else target
    check_window_target(window, target)
    cells = sampling_cells(tables, samplers)
    for name in dict.fromkeys(c.training for c in cells if c.training in SAMPLERS):
        make_sampler(name, window, target, sigma)  # CREAM's window constraints, before any training
    data = posgen.splits(task, n_train, 0, n_test, target, target, seed=seed)
    if window <= data.j + data.k:
        raise ValueError(f"position sampling: window ({window}) must be > j + k = {data.j + data.k}")
    results = []
    for cell in cells:
        if skip is not None and skip(cell):
            continue
        result = run_sampling_cell(data, cell, window, model_config, train_config, seed, sigma, progress, device)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
