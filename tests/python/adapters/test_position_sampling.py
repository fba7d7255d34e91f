"""``ropescale.training``: PoSE and CREAM position sampling (issue 46, part 1).

The must-hold: for fixed seeds the samplers give the authors' sequences. The yardsticks below follow the authors'
code draw for draw (dwzhu-pku/PoSE ``train_preprocess_function_pose``; bigai-nlco/CREAM ``CREAM``), on the global
``random`` and ``numpy.random`` generators they seed, one text (PoSE) or one batch (CREAM) at a time; the samplers
run on their own generators with the same seeds. Then the invariants, the collator, and a patched model taking the
sampled positions in training (float32 and autocast).
"""

import math
import random

import numpy as np
import pytest
import torch

from ropescale import hf, scaling
from ropescale.training import CREAM, PoSE, PositionSamplingCollator, sample_positions
from support import tiny_lm
from support.training import WithPositions, assert_autocast_as_close_as_native, loss_and_grads


def pose_as_the_code_draws(ids, window, target):
    """dwzhu-pku/PoSE's rule for one text, on the global ``random``: (tokens, positions)."""
    chunk = min(len(ids), window)
    r1 = random.randint(1, (chunk + 1) // 2)
    r2 = random.randint(chunk, len(ids))
    l2 = r2 - (chunk - r1)
    tokens = ids[:r1] + ids[l2:r2]
    positions = torch.arange(len(tokens))
    skip = random.randint(0, target - len(tokens))
    positions[r1:] += skip
    return tokens, positions.tolist()


def cream_as_the_code_draws(texts, window, target, sigma=3.0):
    """bigai-nlco/CREAM's rule for one batch, on the global ``random`` and ``numpy.random``: [(tokens, positions)]."""
    k = target // window
    head = tail = window // 3 if random.randint(0, 1) == 0 else 4 * k
    middle = window - head - tail
    first, last = torch.arange(0, head), torch.arange(k * window - tail, k * window)
    x = np.linspace(2, k * 2, 1000)
    cdf = 0.5 * (1 + np.vectorize(math.erf)((x - (1 + k)) / (sigma * np.sqrt(2))))
    out = []
    for ids in texts:
        f = np.interp(np.random.rand(), cdf, x).astype(int)
        assert 2 <= f <= 2 * k
        end = random.randint(int(head + (middle - 1) * (f / 2)), int((f / 2) * window - tail - 1))
        second = torch.arange(end - (middle - 1), end + 1)
        picked = (torch.arange(len(ids) - tail - (middle - 1) - 1, len(ids) - tail) if end >= len(ids) else second)
        index = torch.cat([first, picked, torch.arange(len(ids) - tail, len(ids))])
        out.append((torch.tensor(ids)[index].tolist(), torch.cat([first, second, last]).tolist()))
    return out


def text(length, seed=0):
    return [int(t) for t in torch.randint(0, 50_000, (length,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("window, target, lengths", [(16, 64, (80, 64, 17)), (32, 256, (160, 300)),
                                                     (7, 50, (7, 9)), (100, 100, (300,)), (64, 1024, (320,)),
                                                     (16, 64, (1, 2, 40, 1))])  # 1 token: one chunk, at 0
@pytest.mark.parametrize("seed", range(5))
def test_pose_gives_the_authors_sequences(window, target, lengths, seed):
    texts = [text(n, seed=i) for i, n in enumerate(lengths)]
    random.seed(seed)
    want = [pose_as_the_code_draws(t, window, target) for t in texts]
    got = PoSE(window, target).sample([len(t) for t in texts], random.Random(seed))
    assert [([t[i] for i in idx], pos) for t, (idx, pos) in zip(texts, got)] == want


@pytest.mark.parametrize("window, target, lengths", [(48, 192, (192, 150, 500)), (96, 768, (96, 800, 400)),
                                                     (60, 240, (60,) * 4), (300, 1200, (1200, 700))])
@pytest.mark.parametrize("seed", range(5))
def test_cream_gives_the_authors_sequences(window, target, lengths, seed):
    texts = [text(n, seed=i) for i, n in enumerate(lengths)]
    random.seed(seed)
    np.random.seed(seed)
    want = cream_as_the_code_draws(texts, window, target)
    got = CREAM(window, target).sample([len(t) for t in texts], random.Random(seed), np.random.RandomState(seed))
    assert [([t[i] for i in idx], pos) for t, (idx, pos) in zip(texts, got)] == want


@pytest.mark.parametrize("sampler", [PoSE(32, 256), CREAM(96, 768), CREAM(96, 768, sigma=0.5)])
def test_every_sample_is_a_window_of_increasing_positions_below_the_target(sampler):
    rng, np_rng = random.Random(1), np.random.RandomState(1)
    reach = 0
    for _ in range(200):
        lengths = [sampler.window * 3, sampler.window + 5]
        for length, (indices, positions) in zip(lengths, sampler.sample(lengths, rng, np_rng)):
            assert len(indices) == len(positions) == sampler.window
            assert all(b > a for a, b in zip(positions, positions[1:])) and 0 <= positions[0]
            assert positions[-1] < sampler.target and all(0 <= i < length for i in indices)
            if isinstance(sampler, PoSE):  # tokens stay in the text's order
                assert all(b > a for a, b in zip(indices, indices[1:]))
            else:  # each segment in order; the code's middle may end inside the tail's tokens (docstring)
                assert indices[-1] == length - 1 and all(
                    b == a + 1 for a, b in zip(indices[-8:], indices[-7:]))
            reach = max(reach, positions[-1])
    assert reach >= sampler.target * 3 // 4  # the long positions are seen


def test_cream_is_a_truncated_gaussian_around_its_mean():
    """The middle's factor: mean 1 + k, clamped to [2, 2k]; a narrow sigma concentrates it there."""
    narrow = CREAM(120, 1200, sigma=0.5)
    x, cdf = narrow._factor_table()
    draws = np.array([int(np.interp(u, cdf, x)) for u in np.random.RandomState(0).rand(5000)])
    assert set(draws) <= set(range(2, 21)) and abs(np.median(draws) - 10) <= 1  # floor of N(11, 0.5)


BAD = [
    (lambda: PoSE(0, 64), "window must be an integer >= 1"),
    (lambda: PoSE(64, 32), "target (32) must be >= window (64)"),
    (lambda: PoSE(16.0, 64), "window must be an integer"),
    (lambda: CREAM(48, 64), "at least twice the window"),
    (lambda: CREAM(48, 192, sigma=math.nan), "sigma must be a finite number > 0"),
    (lambda: CREAM(49, 196), "the window must be even"),
    (lambda: CREAM(24, 480), "leaves no middle"),
    (lambda: PoSE(16, 64).sample([0], random.Random(0)), "a text of 0 tokens has nothing to sample"),
    (lambda: CREAM(48, 192).sample([40], random.Random(0), np.random.RandomState(0)), "shorter than the window"),
    (lambda: CREAM(48, 192).sample([100], random.Random(0)), "np_rng"),
    (lambda: PositionSamplingCollator("pose"), "must be PoSE or CREAM"),
    (lambda: PositionSamplingCollator(PoSE(16, 64), pad_token_id=-1), "pad_token_id must be a token id"),
    (lambda: PositionSamplingCollator(PoSE(16, 64))([]), "PositionSamplingCollator: an empty batch"),
    (lambda: sample_positions([], PoSE(16, 64), random.Random(0)), "sample_positions: an empty batch"),
    # longer than the authors' texts (PoSE: 5 x window; CREAM: target // window x window): refused, naming the fixes
    (lambda: PositionSamplingCollator(PoSE(16, 64))([{"input_ids": text(81)}]),
     "text 0 has 81 tokens, more than PoSE's texts (80: 5 x window"),
    (lambda: sample_positions([text(48), text(200)], CREAM(48, 192), random.Random(0), np.random.RandomState(0)),
     "text 1 has 200 tokens, more than CREAM's texts (192: target // window x window"),
    (lambda: PositionSamplingCollator(PoSE(16, 64))([{"input_ids": text(81)}]), "or pass truncate=True"),
    (lambda: PositionSamplingCollator(PoSE(16, 64))([{"input_ids": text(20), "labels": text(19)}]),
     "feature 0's labels (19) and input_ids (20) differ in length"),
    (lambda: PositionSamplingCollator(PoSE(16, 64))([{"input_ids": text(20), "attention_mask": [1] * 18 + [0, 0]}]),
     "feature 0's attention_mask has zeros"),
]


@pytest.mark.parametrize("make, message", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_the_collator_pads_as_the_authors_collator():
    collator = PositionSamplingCollator(PoSE(16, 64), pad_token_id=7, seed=3)
    batch = collator([{"input_ids": text(40)}, {"input_ids": text(10, seed=1)}])
    assert batch["input_ids"].shape == batch["position_ids"].shape == batch["labels"].shape == (2, 16)
    assert (batch["input_ids"][1, 10:] == 7).all() and (batch["labels"][1, 10:] == -100).all()
    assert (batch["position_ids"][1, 10:] == 0).all() and batch["attention_mask"][1].sum() == 10
    # the same seed gives the same batches; the generators move on between calls
    again = PositionSamplingCollator(PoSE(16, 64), pad_token_id=7, seed=3)
    assert torch.equal(again([{"input_ids": text(40)}, {"input_ids": text(10, seed=1)}])["position_ids"],
                       batch["position_ids"])
    assert not torch.equal(collator([{"input_ids": text(40)}, {"input_ids": text(10, seed=1)}])["position_ids"],
                           batch["position_ids"])


def test_the_collator_keeps_a_features_own_labels():
    """A prompt masked with -100 in the feature's labels stays masked: the labels are sampled with the tokens'
    indices (PoSE and CREAM); a feature without labels is scored on its tokens (the authors' labels = input_ids)."""
    for sampler in (PoSE(16, 64), CREAM(48, 192)):
        ids = text(sampler.text_length)
        labels = [-100] * 30 + [t + 1 for t in ids[30:]]
        batch = PositionSamplingCollator(sampler, seed=2)([{"input_ids": ids, "labels": labels},
                                                           {"input_ids": ids}])
        indices, _ = sampler.sample([len(ids)] * 2, random.Random(2), np.random.RandomState(2))[0]
        assert batch["input_ids"][0].tolist() == [ids[i] for i in indices]
        assert batch["labels"][0].tolist() == [labels[i] for i in indices]
        assert (batch["labels"][0] == -100).sum() == sum(i < 30 for i in indices) > 0
        assert torch.equal(batch["labels"][1], batch["input_ids"][1])


def test_truncate_cuts_each_text_to_the_authors_length():
    """truncate=True: a text longer than the sampler's text_length is sampled as its first text_length tokens (a
    tokenizer's truncation), labels alike; the same draws as the text truncated beforehand."""
    long, cut = text(500), text(500)[:80]
    got = PositionSamplingCollator(PoSE(16, 64), seed=4, truncate=True)([{"input_ids": long, "labels": long}])
    want = PositionSamplingCollator(PoSE(16, 64), seed=4)([{"input_ids": cut}])
    for key in want:
        assert torch.equal(got[key], want[key]), key
    got = sample_positions([text(300)], CREAM(48, 192), random.Random(1), np.random.RandomState(1), truncate=True)
    want = sample_positions([text(300)[:192]], CREAM(48, 192), random.Random(1), np.random.RandomState(1))
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["position_ids"], want["position_ids"])


def test_a_tokenizer_without_a_pad_token_pads_and_no_real_token_sees_it():
    """pad_token_id=None (Llama's and Mistral's tokenizers: docs/finetune.md's own line) pads with id 0. Padding is after the
    text, masked and unscored, so the loss and the real tokens' logits are those of any other pad id and of each
    row alone: no real token reads the padding's id."""
    features = [{"input_ids": text(40)}, {"input_ids": text(9, seed=1)}, {"input_ids": text(1, seed=2)}]
    batch = PositionSamplingCollator(PoSE(16, 64), pad_token_id=None, seed=6)(features)
    other = PositionSamplingCollator(PoSE(16, 64), pad_token_id=201, seed=6)(features)
    mask = batch["attention_mask"].bool()
    assert (batch["input_ids"][~mask] == 0).all() and (other["input_ids"][~mask] == 201).all()
    assert mask.sum(-1).tolist() == [16, 9, 1] and (batch["labels"][~mask] == -100).all()
    model = hf.patch(tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2), YARN)
    with torch.no_grad():
        results = []
        for b in (batch, other):
            b = {**b, "input_ids": b["input_ids"] % 256, "labels": b["labels"].where(b["labels"] < 0,
                                                                                     b["labels"] % 256)}
            results.append(model(**b, use_cache=False))
        alone = [model(batch["input_ids"][r:r + 1, :n] % 256, position_ids=batch["position_ids"][r:r + 1, :n]).logits
                 for r, n in enumerate(mask.sum(-1).tolist())]
    torch.testing.assert_close(results[0].loss, results[1].loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0].logits[mask], results[1].logits[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0].logits[mask], torch.cat([a[0] for a in alone]), rtol=1e-5, atol=1e-5)


YARN = scaling.YaRN(factor=4.0, original_max_position=32)


def test_a_patched_model_trains_on_the_sampled_positions():
    """hf.patch's rotation reads the sampled position ids: the logits are those of transformers' own YaRN at the
    same positions, unchanged by a shift of every position (RoPE is relative), changed by the skip."""
    batch = sample_positions([text(96, seed=s) for s in range(2)], PoSE(32, 128), random.Random(0))
    x, positions = batch["input_ids"] % 256, batch["position_ids"]
    assert (positions[:, -1] >= 32).all()
    native = tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0})
    patched = hf.patch(tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2), YARN)
    with torch.no_grad():
        want = native(x, position_ids=positions).logits
        got = patched(x, position_ids=positions).logits
        shifted = patched(x, position_ids=positions + 7).logits
        contiguous = patched(x, position_ids=torch.arange(32).expand(2, -1)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shifted, got, rtol=1e-4, atol=1e-4)
    assert (contiguous - got).abs().max() > 1e-2
    for dtype in (torch.bfloat16, torch.float16):
        assert_autocast_as_close_as_native(WithPositions(patched, positions), WithPositions(native, positions), x,
                                           dtype)
    lp, grads = loss_and_grads(WithPositions(patched, positions), x)
    assert torch.isfinite(lp).all() and torch.isfinite(grads).all() and grads.abs().sum() > 0


def test_a_dynamic_method_takes_the_length_the_sampled_positions_reach():
    """Dynamic NTK on PoSE positions: each row's table is that of its largest position + 1, as transformers' own
    ``dynamic`` computes it (not the window's: the row is then native RoPE)."""
    batch = sample_positions([text(96, seed=s) for s in range(2)], PoSE(32, 128), random.Random(2))
    x, positions = batch["input_ids"] % 256, batch["position_ids"]
    native = tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2,
                                rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    patched = hf.patch(tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2),
                       scaling.DynamicNTK(factor=4.0, original_max_position=32))
    plain = tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2)
    with torch.no_grad():
        for row in range(2):  # one row at a time: transformers' dynamic takes the batch's largest position
            want = native(x[row:row + 1], position_ids=positions[row:row + 1]).logits
            got = patched(x[row:row + 1], position_ids=positions[row:row + 1]).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (plain(x[row:row + 1], position_ids=positions[row:row + 1]).logits - got).abs().max() > 1e-3


@pytest.mark.parametrize("sampler", [PoSE(32, 128), CREAM(32, 96)], ids=["PoSE", "CREAM"])
def test_rerope_training_takes_the_sampled_positions(monkeypatch, sampler):
    """ReRoPE's training path (raw keys, distances clipped at the window) on PoSE / CREAM positions: the distances are
    the sampled ones (a shift of every position changes nothing; the skip changes the far pairs), a step under
    autocast is as close to float32 as transformers' own model is, and the sampled positions run the fused path
    (rerope_train's gapped layout, never the composite), whose float32 step is the composite's."""
    batch = sample_positions([text(96, seed=s) for s in range(2)], sampler, random.Random(3), np.random.RandomState(3))
    x, positions = batch["input_ids"] % 256, batch["position_ids"]
    model = tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2)
    hf.patch(model, scaling.Default(), attention="rerope", window=8, leaky_k=4.0)
    model.train()
    with torch.no_grad():
        got = model(x, position_ids=positions).logits
        shifted = model(x, position_ids=positions + 5).logits
        contiguous = model(x, position_ids=torch.arange(32).expand(2, -1)).logits
    torch.testing.assert_close(shifted, got, rtol=1e-4, atol=1e-4)
    assert (contiguous - got).abs().max() > 1e-3
    # the fused path takes the sampled positions (gaps: an expanded layout, rerope_train_layout.Gaps); the composite
    # (an L x L mask) is never called, and its step is the fused one's
    from ropescale import ops, rerope_train

    assert rerope_train.training_layout(positions, positions) is False
    assert rerope_train.training_layout(positions, positions, window=8) is False
    assert rerope_train.training_layout(positions[:, :8], positions[:, :8]) is False  # consecutive (seed 3)
    assert not (positions.diff(dim=-1) == 1).all()  # gaps
    composite_step = None
    with monkeypatch.context() as patch:
        patch.setattr(ops, "rerope_attention_train", ops.rerope_attention_composite)
        composite_step = loss_and_grads(WithPositions(model, positions), x)

    def composite(*args, **kwargs):
        raise AssertionError("rerope_attention_train took the composite")

    monkeypatch.setattr(rerope_train, "rerope_attention_composite", composite)
    step = loss_and_grads(WithPositions(model, positions), x)
    for got, want in zip(step, composite_step):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    native = tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2).train()
    for dtype in (torch.bfloat16, torch.float16):
        assert_autocast_as_close_as_native(WithPositions(model, positions), WithPositions(native, positions), x, dtype,
                                           step=step)


def test_rerope_training_on_a_padded_collator_batch_runs_fused(monkeypatch):
    """A text shorter than the window: the collator pads it (position ids 0, labels -100, attention mask 0). The
    padding queries are set aside too (their outputs reach no real token), so the batch keeps the fused path and
    its loss and gradients are the composite's."""
    from ropescale import ops, rerope_train

    collator = PositionSamplingCollator(PoSE(32, 128), seed=5)
    batch = collator([{"input_ids": text(96, seed=0)}, {"input_ids": text(20, seed=1)}])
    assert (batch["attention_mask"] == 0).any() and (batch["position_ids"][1, 20:] == 0).all()
    batch["input_ids"] = batch["input_ids"] % 256
    batch["labels"] = torch.where(batch["labels"] < 0, batch["labels"], batch["labels"] % 256)
    model = tiny_lm.tiny_llama(256, max_position=32, layers=2, initializer_range=0.2)
    hf.patch(model, scaling.Default(), attention="rerope", window=8)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    with monkeypatch.context() as patch:
        patch.setattr(ops, "rerope_attention_train", ops.rerope_attention_composite)
        composite_loss, composite_grads = step()

    def composite(*args, **kwargs):
        raise AssertionError("rerope_attention_train took the composite")

    monkeypatch.setattr(rerope_train, "rerope_attention_composite", composite)
    loss, grads = step()
    torch.testing.assert_close(loss, composite_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, composite_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
