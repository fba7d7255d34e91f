"""PosGen: the synthetic train-short-test-long benchmark of Resonance RoPE (Wang et al.).

Every sequence starts with ``j + k`` free tokens drawn uniformly from ``0 .. modulus - 1``; every
later token is a fixed function ``h`` of ``j + k`` earlier ones, so every position is equally
hard and the only thing that changes past the training length is the position itself:

- ``recursive``:      ``x_l = h(x_{l-(j+k)}, ..., x_{l-1})``
- ``cot``:            ``x_l = h(x_0, ..., x_{j-1}, x_{l-k}, ..., x_{l-1})``
- ``semi_recursive``: ``x_l = h(x_p, ..., x_{p+j-1}, x_{l-k}, ..., x_{l-1})`` with
  ``p = (l - (j+k)) // 2``: the far pointer advances one token every two steps (the authors'
  code; the formula printed in the paper would index before 0 at ``l = j+k``).

``h`` defaults to the sum mod ``modulus`` (17 in the paper). The vocabulary is ``0 .. modulus-1``
and nothing else: sequences have a fixed length, so no special token is needed.

A sequence is fully determined by its first ``j + k`` tokens, so ``splits`` draws distinct
prefixes for train, validation and test: no sequence (and no prefix) is shared between splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["TASKS", "sum_mod", "generate", "sequences_from_prefixes", "far_pointer", "Splits", "splits"]

TASKS = ("recursive", "cot", "semi_recursive")

#: ``h`` maps the ``[n, j + k]`` arguments (in the order of the rules above) to ``[n]`` tokens.
HFunction = Callable[[torch.Tensor], torch.Tensor]

# Prefix spaces up to this size are sampled exactly without replacement (randperm of the codes);
# larger ones by rejection of duplicates, which almost never happen there.
_EXACT_PREFIX_SPACE = 1 << 22


def sum_mod(modulus: int) -> HFunction:
    """The paper's ``h``: the sum of the arguments mod ``modulus``."""

    def h(args: torch.Tensor) -> torch.Tensor:
        return args.sum(dim=-1) % modulus

    return h


def far_pointer(l: int, j: int = 1, k: int = 3) -> int:
    """First index of the ``j`` far arguments of the semi-recursive rule at position ``l >= j + k``."""
    return (l - (j + k)) // 2


def _check(task: str, length: int, j: int, k: int, modulus: int, where: str) -> None:
    if task not in TASKS:
        raise ValueError(f"{where}: task must be one of {TASKS}, got {task!r}")
    if j < 1 or k < 1:
        raise ValueError(f"{where}: j and k must be >= 1, got j={j}, k={k}")
    if modulus < 2:
        raise ValueError(f"{where}: modulus must be >= 2, got {modulus}")
    if length < j + k:
        raise ValueError(f"{where}: length must be >= j + k = {j + k}, got {length}")


def sequences_from_prefixes(
    task: str,
    prefixes: torch.Tensor,
    length: int,
    j: int = 1,
    k: int = 3,
    modulus: int = 17,
    h: HFunction | None = None,
) -> torch.Tensor:
    """Extend ``[n, j + k]`` prefixes to ``[n, length]`` sequences by the task's rule."""
    _check(task, length, j, k, modulus, "sequences_from_prefixes")
    if prefixes.dim() != 2 or prefixes.shape[1] != j + k:
        raise ValueError(f"sequences_from_prefixes: prefixes must be [n, j + k = {j + k}], got {list(prefixes.shape)}")
    h = h or sum_mod(modulus)
    n = prefixes.shape[0]
    x = torch.empty(n, length, dtype=torch.long)
    x[:, : j + k] = prefixes
    for l in range(j + k, length):
        if task == "recursive":
            args = x[:, l - (j + k) : l]
        else:
            p = 0 if task == "cot" else far_pointer(l, j, k)
            args = torch.cat([x[:, p : p + j], x[:, l - k : l]], dim=1)
        x[:, l] = h(args)
    if n and (x.min() < 0 or x.max() >= modulus):
        raise ValueError(f"sequences_from_prefixes: h returned tokens outside 0..{modulus - 1}")
    return x


def _distinct_prefixes(count: int, width: int, modulus: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct rows of ``width`` tokens, uniformly at random without replacement."""
    space = modulus**width
    if count > space:
        raise ValueError(
            f"posgen: {count} sequences need distinct first j + k = {width} tokens, "
            f"but only {modulus}^{width} = {space} prefixes exist"
        )
    if space <= _EXACT_PREFIX_SPACE:
        codes = torch.randperm(space, generator=generator)[:count]
        digits = modulus ** torch.arange(width - 1, -1, -1)
        return (codes[:, None] // digits) % modulus
    seen: set[tuple[int, ...]] = set()
    rows: list[list[int]] = []
    while len(rows) < count:
        for row in torch.randint(modulus, (count - len(rows), width), generator=generator).tolist():
            if tuple(row) not in seen:
                seen.add(tuple(row))
                rows.append(row)
    return torch.tensor(rows, dtype=torch.long).reshape(count, width)


def generate(
    task: str,
    n: int,
    length: int,
    j: int = 1,
    k: int = 3,
    modulus: int = 17,
    seed: int = 0,
    *,
    h: HFunction | None = None,
) -> torch.Tensor:
    """``n`` PosGen sequences of ``length`` tokens as a LongTensor ``[n, length]``, with distinct
    random prefixes (the same ``seed`` gives the same data)."""
    _check(task, length, j, k, modulus, "generate")
    if n < 0:
        raise ValueError(f"generate: n must be >= 0, got {n}")
    generator = torch.Generator().manual_seed(seed)
    prefixes = _distinct_prefixes(n, j + k, modulus, generator)
    return sequences_from_prefixes(task, prefixes, length, j, k, modulus, h)


@dataclass(frozen=True)
class Splits:
    """Train sequences at the training length; validation and test at the test length."""

    train: torch.Tensor
    validation: torch.Tensor
    test: torch.Tensor
    task: str
    j: int
    k: int
    modulus: int

    @property
    def train_length(self) -> int:
        return self.train.shape[1]

    @property
    def test_length(self) -> int:
        return self.test.shape[1]


def splits(
    task: str,
    n_train: int = 10_000,
    n_validation: int = 1_000,
    n_test: int = 1_000,
    train_length: int = 64,
    test_length: int = 256,
    j: int = 1,
    k: int = 3,
    modulus: int = 17,
    seed: int = 0,
    *,
    h: HFunction | None = None,
) -> Splits:
    """The paper's three splits (defaults: 10,000 x 64 / 1,000 x 256 / 1,000 x 256), drawn from one
    set of distinct prefixes so no two sequences, within or across splits, share their first
    ``j + k`` tokens."""
    _check(task, train_length, j, k, modulus, "splits")
    if test_length < train_length:
        raise ValueError(f"splits: test_length must be >= train_length = {train_length}, got {test_length}")
    if min(n_train, n_validation, n_test) < 0:
        raise ValueError("splits: split sizes must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    prefixes = _distinct_prefixes(n_train + n_validation + n_test, j + k, modulus, generator)
    parts = prefixes.split([n_train, n_validation, n_test])
    lengths = (train_length, test_length, test_length)
    train, validation, test = (
        sequences_from_prefixes(task, p, n, j, k, modulus, h) for p, n in zip(parts, lengths)
    )
    return Splits(train, validation, test, task, j, k, modulus)
