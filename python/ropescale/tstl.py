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
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from . import hf, posgen, scaling

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
        batch = sequences[torch.randint(sequences.shape[0], (config.batch_size,), generator=generator)].to(device)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, first_target - 1 :].flatten(0, 1).float(), batch[:, first_target:].flatten()
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return float(loss.detach())


@torch.no_grad()
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
