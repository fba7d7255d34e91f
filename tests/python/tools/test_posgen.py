"""ropescale.posgen: every token obeys its task's rule (checked by plain-Python rules written from
PAPERS.md, not the generator's code), splits share no prefix, the same seed gives the same data."""

import pytest
import torch

from ropescale import posgen


def rule_arguments(task, x, l, j, k):
    """The arguments of h at position l, straight from the paper's formulas (plain lists)."""
    if task == "recursive":
        return x[l - (j + k) : l]
    if task == "cot":
        return x[0:j] + x[l - k : l]
    p = (l - (j + k)) // 2  # semi-recursive far pointer (the authors' code)
    return x[p : p + j] + x[l - k : l]


def authors_semi_recursive(prefix, length, j, k, modulus):
    """The authors' semi-recursive generator as they wrote it: a far pointer that advances after every
    second appended token. A second, independent formulation of the same rule."""
    seq, pointer = list(prefix), 0
    while len(seq) < length:
        seq.append((sum(seq[pointer : pointer + j]) + sum(seq[-k:])) % modulus)
        if len(seq) < length:
            seq.append((sum(seq[pointer : pointer + j]) + sum(seq[-k:])) % modulus)
            pointer += 1
    return seq


CONFIGS = [(1, 3, 17), (2, 2, 7), (1, 1, 5), (3, 2, 11)]


@pytest.mark.parametrize("task", posgen.TASKS)
@pytest.mark.parametrize("j,k,modulus", CONFIGS)
def test_every_position_obeys_the_rule(task, j, k, modulus):
    length, n = 57, min(40, modulus ** (j + k))
    data = posgen.generate(task, n, length, j=j, k=k, modulus=modulus, seed=3)
    assert data.shape == (n, length) and data.dtype == torch.long
    assert int(data.min()) >= 0 and int(data.max()) < modulus
    for row in data.tolist():
        for l in range(j + k, length):
            assert row[l] == sum(rule_arguments(task, row, l, j, k)) % modulus, (task, l)


@pytest.mark.parametrize("j,k,modulus", CONFIGS)
def test_semi_recursive_matches_the_authors_pointer_walk(j, k, modulus):
    data = posgen.generate("semi_recursive", min(20, modulus ** (j + k)), 64, j=j, k=k, modulus=modulus, seed=1)
    for row in data.tolist():
        assert row == authors_semi_recursive(row[: j + k], 64, j, k, modulus)


def test_far_pointer_advances_every_two_steps():
    assert [posgen.far_pointer(l, 1, 3) for l in range(4, 12)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert posgen.far_pointer(4 + 2 * 100, 1, 3) == 100


def test_tasks_differ_from_each_other():
    a, b, c = (posgen.generate(t, 8, 40, seed=0) for t in posgen.TASKS)
    assert torch.equal(a[:, :4], b[:, :4]) and torch.equal(a[:, :4], c[:, :4])  # same prefixes per seed
    assert not torch.equal(a, b) and not torch.equal(b, c) and not torch.equal(a, c)


def test_custom_h():
    def h(args):  # not symmetric, so argument order matters
        return (3 * args[:, 0] + args[:, -1] + 1) % 13

    j, k = 2, 3
    data = posgen.generate("cot", 10, 30, j=j, k=k, modulus=13, seed=5, h=h)
    for row in data.tolist():
        for l in range(j + k, 30):
            args = rule_arguments("cot", row, l, j, k)
            assert row[l] == (3 * args[0] + args[-1] + 1) % 13


def test_same_seed_same_data_other_seed_other_data():
    for task in posgen.TASKS:
        assert torch.equal(posgen.generate(task, 50, 32, seed=7), posgen.generate(task, 50, 32, seed=7))
        assert not torch.equal(posgen.generate(task, 50, 32, seed=7), posgen.generate(task, 50, 32, seed=8))
    s1 = posgen.splits("cot", 200, 30, 30, 16, 64, seed=11)
    s2 = posgen.splits("cot", 200, 30, 30, 16, 64, seed=11)
    for name in ("train", "validation", "test"):
        assert torch.equal(getattr(s1, name), getattr(s2, name))


def test_prefixes_are_distinct_and_cover_the_vocabulary():
    data = posgen.generate("recursive", 2000, 8, seed=0)
    prefixes = {tuple(r) for r in data[:, :4].tolist()}
    assert len(prefixes) == 2000
    assert set(data[:, :4].flatten().tolist()) == set(range(17))
    # Uniform prefixes: each token value is about 1/17 of the free tokens.
    counts = torch.bincount(data[:, :4].flatten(), minlength=17).double() / (4 * 2000)
    assert float((counts - 1 / 17).abs().max()) < 0.02


def test_the_whole_prefix_space_can_be_used():
    data = posgen.generate("recursive", 3**3, 6, j=1, k=2, modulus=3, seed=0)
    assert len({tuple(r) for r in data[:, :3].tolist()}) == 27


def test_large_prefix_spaces_use_rejection_and_stay_distinct():
    # 17^12 prefixes: too many to enumerate, so the generator draws and rejects duplicates.
    data = posgen.generate("cot", 500, 20, j=4, k=8, seed=2)
    assert len({tuple(r) for r in data[:, :12].tolist()}) == 500
    assert torch.equal(data, posgen.generate("cot", 500, 20, j=4, k=8, seed=2))


@pytest.mark.parametrize("task", posgen.TASKS)
def test_splits_share_no_prefix(task):
    s = posgen.splits(task, 3000, 400, 400, train_length=16, test_length=64, seed=4)
    assert s.train.shape == (3000, 16) and s.validation.shape == (400, 64) and s.test.shape == (400, 64)
    assert (s.train_length, s.test_length) == (16, 64)
    parts = [{tuple(r) for r in t[:, :4].tolist()} for t in (s.train, s.validation, s.test)]
    assert [len(p) for p in parts] == [3000, 400, 400]  # distinct within each split too
    assert not parts[0] & parts[1] and not parts[0] & parts[2] and not parts[1] & parts[2]
    for t in (s.train, s.validation, s.test):
        for row in t[:20].tolist():
            for l in range(4, len(row)):
                assert row[l] == sum(rule_arguments(task, row, l, 1, 3)) % 17


def test_paper_sized_splits():
    s = posgen.splits("semi_recursive")
    assert s.train.shape == (10_000, 64) and s.validation.shape == (1_000, 256) and s.test.shape == (1_000, 256)


def test_bad_input():
    with pytest.raises(ValueError, match="generate: task must be one of"):
        posgen.generate("fibonacci", 2, 10)
    with pytest.raises(ValueError, match="generate: j and k must be >= 1"):
        posgen.generate("cot", 2, 10, j=0)
    with pytest.raises(ValueError, match="generate: length must be >= j \\+ k = 4, got 3"):
        posgen.generate("cot", 2, 3)
    with pytest.raises(ValueError, match="generate: modulus must be >= 2"):
        posgen.generate("cot", 2, 10, modulus=1)
    with pytest.raises(ValueError, match="generate: n must be >= 0"):
        posgen.generate("cot", -1, 10)
    with pytest.raises(ValueError, match="only 3\\^2 = 9 prefixes exist"):
        posgen.generate("cot", 10, 10, j=1, k=1, modulus=3)
    with pytest.raises(ValueError, match="splits: test_length must be >= train_length"):
        posgen.splits("cot", 10, 10, 10, train_length=64, test_length=32)
    with pytest.raises(ValueError, match="prefixes must be \\[n, j \\+ k = 4\\]"):
        posgen.sequences_from_prefixes("cot", torch.zeros(3, 2, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="h returned tokens outside 0..16"):
        posgen.generate("cot", 3, 10, h=lambda args: args.sum(-1) + 100)
