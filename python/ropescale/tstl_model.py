"""The model, training loop and accuracy of train short, test long (:mod:`ropescale.tstl`): a small transformers
Llama, AdamW with a one-cycle schedule, teacher-forced accuracy per position."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from . import hf


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

    return optimise(model, sequences, config, seed, progress, desc, step_loss)


def optimise(model, sequences, config: TrainConfig, seed: int, progress: bool, desc: str, step_loss) -> float:
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
