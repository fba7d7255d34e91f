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
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from . import hf, posgen, scaling, training

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


@dataclass(frozen=True)
class ModelConfig:
    """A Llama decoder: ``heads`` heads of ``hidden_size // heads`` dims, RoPE base ``base``."""

    hidden_size: int = 64
    layers: int = 2
    heads: int = 2
    intermediate_size: int = 256
    base: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads


#: The CPU setting: 2 layers, 2 heads of 32 dims (about 100k parameters).
TINY = ModelConfig()
#: The paper's: 2 layers with T5-small widths (d_model 512, 8 heads of 64, d_ff 2048).
T5_SMALL = ModelConfig(hidden_size=512, layers=2, heads=8, intermediate_size=2048)


@dataclass(frozen=True)
class TrainConfig:
    """AdamW with a one-cycle schedule (10% warm-up, cosine decay), as the authors' code."""

    steps: int = 600
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    grad_clip: float = 1.0


def build_model(vocab_size: int, config: ModelConfig, train_length: int, seed: int = 0):
    """A transformers ``LlamaForCausalLM`` from a ``LlamaConfig`` (eager attention: fastest for tiny
    models on the CPU), initialised from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        head_dim=config.head_dim,
        max_position_embeddings=train_length,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.base)},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(llama)


def train(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    first_target: int,
    config: TrainConfig,
    seed: int = 0,
    progress: bool = False,
    desc: str = "train",
) -> float:
    """Next-token training on ``sequences`` ``[n, length]``, loss on the targets ``x_l`` with
    ``l >= first_target`` (the ``j + k`` free tokens are unpredictable). Returns the final loss."""
    device = next(model.parameters()).device

    def step_loss(rows):
        batch = rows.to(device)
        logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits[:, first_target - 1 :].flatten(0, 1).float(), batch[:, first_target:].flatten()
        )

    return _optimise(model, sequences, config, seed, progress, desc, step_loss)


def _optimise(model, sequences, config: TrainConfig, seed: int, progress: bool, desc: str, step_loss) -> float:
    """The loop :func:`train` and :func:`train_sampled` share: AdamW with the one-cycle schedule, ``config.steps``
    batches of ``sequences`` rows drawn by a generator seeded with ``seed``; ``step_loss(rows)`` is the loss on a
    batch, or None when it has nothing to learn (the schedule still steps). Returns the last loss."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=config.steps, pct_start=config.warmup_fraction
    )
    generator = torch.Generator().manual_seed(seed)
    steps = range(config.steps)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        steps = bar = tqdm(steps, desc=desc, leave=False)
    loss = torch.tensor(float("nan"))
    for _ in steps:
        rows = sequences[torch.randint(sequences.shape[0], (config.batch_size,), generator=generator)]
        step = step_loss(rows)
        if step is None:
            schedule.step()
            continue
        loss = step
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return float(loss.detach())


def position_accuracy(
    model: torch.nn.Module, sequences: torch.Tensor, batch_size: int = 250, incremental: bool = False
) -> torch.Tensor:
    """Teacher-forced accuracy per position, float64 ``[length]``: entry ``l`` is the fraction of
    sequences whose ``x_l`` is the argmax prediction from ``x_0 .. x_{l-1}`` (entry 0 is NaN).

    ``incremental`` feeds the tokens one at a time through a ``PreRopeCache``, as generation would:
    a dynamic method then predicts ``x_l`` with its table for length ``l`` (plain RoPE up to the
    original length), not with the table for the whole sequence."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = torch.zeros(sequences.shape[1] - 1, dtype=torch.float64)
    for batch in sequences.split(batch_size):
        batch = batch.to(device)
        if incremental:
            cache = hf.PreRopeCache()
            # one request per sequence (a per-request method keeps the scale of its whole length)
            request = hf.request(model, batch.shape[1] - 2) if hf.is_patched(model) else contextlib.nullcontext()
            with request:
                predicted = torch.stack([
                    model(input_ids=batch[:, l : l + 1], past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)
                    for l in range(batch.shape[1] - 1)
                ], dim=1)
        else:
            predicted = model(input_ids=batch[:, :-1]).logits.argmax(-1)
        correct += (predicted == batch[:, 1:]).sum(0).double().cpu()
    model.train(was_training)
    return torch.cat([torch.tensor([math.nan], dtype=torch.float64), correct / sequences.shape[0]])


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
    return ("Resonance " if table.resonance else "") + ("RoPE" if table.rope_type == "default" else table.rope_type)


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


def _check_window_target(window: int, target: int) -> None:
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
    _check_window_target(window, target)
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

    loss = _optimise(model, sequences, config, seed, progress, desc, step_loss)
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
    _check_window_target(window, target)
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
    _check_window_target(window, target)
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
