"""ropescale.evaluate: passkey retrieval scored right on a model whose behaviour is known, and
sliding-window perplexity equal to a direct per-token computation."""

import math
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from ropescale import evaluate  # noqa: E402
from support import TESTS  # noqa: E402
from support.tiny_lm import PasskeyStub, char_tokenizer, tiny_llama  # noqa: E402


# Tiny models: one intra-op thread (conftest.py's one_thread fixture).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), max_position=1024)


TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
    "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we "
    "had everything before us, we had nothing before us, we were all going direct to Heaven, we were "
    "all going direct the other way - in short, the period was so far like the present period, that "
    "some of its noisiest authorities insisted on its being received, for good or for evil, in the "
    "superlative degree of comparison only. There were a king with a large jaw and a queen with a plain "
    "face, on the throne of England."
)


# ---------------------------------------------------------------------------------------------
# Perplexity


class PositionBigram(torch.nn.Module):
    """A causal LM whose logits at window position i are ``emb[x_i] + pos[i]``: the score of every
    token depends on where its window starts, so the window arithmetic shows in the result."""

    def __init__(self, vocab, max_length, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("emb", torch.randn(vocab, vocab, generator=g))
        self.register_buffer("pos", torch.randn(max_length, vocab, generator=g))

    def forward(self, input_ids, **kwargs):
        return types.SimpleNamespace(logits=self.emb[input_ids] + self.pos[: input_ids.shape[1]])


def windows_of(n, max_length, stride):
    """(begin, end) of every window of the sliding-window method, from its definition."""
    out, begin = [], 0
    while True:
        out.append((begin, min(begin + max_length, n)))
        if begin + max_length >= n:
            return out
        begin += stride


def scoring_window(t, windows):
    """Begin of the window that scores token t: the first whose end passes t; None if t would be its
    first token (no context)."""
    begin = next(b for b, e in windows if e > t)
    return None if t == begin else begin


@pytest.mark.parametrize("max_length,stride", [(300, 256), (256, 256), (512, 256), (1000, 256), (97, 33)])
def test_perplexity_equals_direct_computation(max_length, stride):
    # Closed form per token: logits emb[x_{t-1}] + pos[t-1-begin] for the window that scores t.
    vocab, n = 23, 900
    ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(1))
    lm = PositionBigram(vocab, max_length)
    windows = windows_of(n, max_length, stride)
    total, count = 0.0, 0
    for t in range(1, n):
        begin = scoring_window(t, windows)
        if begin is None:
            continue
        logits = (lm.emb[ids[t - 1]] + lm.pos[t - 1 - begin]).double()
        total += float(-torch.log_softmax(logits, -1)[ids[t]])
        count += 1
    result = evaluate.perplexity(lm, ids, max_length=max_length, stride=stride)
    assert result.windows == len(windows)
    assert result.tokens == count
    assert count == n - 1 - (len(windows) - 1 if stride == max_length else 0)
    assert result.nll == pytest.approx(total / count, rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-12)


def test_perplexity_per_token_on_a_real_model(model, tokenizer):
    # Stride 256 on a short text, a transformers model: each token's nll against the model run on
    # exactly that token's context (checked at the window edges and a spread of other tokens).
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    max_length, stride = 300, 256
    result = evaluate.perplexity(model, TEXT, tokenizer, max_length=max_length, stride=stride)
    windows = windows_of(len(ids), max_length, stride)
    assert len(windows) == 3 and result.tokens == len(ids) - 1
    checked = sorted({1, 2, 255, 256, 299, 300, 301, 511, 512, 555, 556, len(ids) - 1, *range(10, len(ids), 61)})
    with torch.no_grad():
        for t in checked:
            begin = scoring_window(t, windows)
            logits = model(input_ids=ids[begin:t][None]).logits[0, -1].double()
            expected = float(-torch.log_softmax(logits, -1)[ids[t]])
            assert float(result.token_nll[t]) == pytest.approx(expected, rel=1e-4, abs=1e-5), t
    assert math.isnan(float(result.token_nll[0]))
    assert result.nll == pytest.approx(float(result.token_nll[1:].mean()), rel=1e-12)


def test_perplexity_in_one_window_is_transformers_loss(model, tokenizer):
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss
    result = evaluate.perplexity(model, ids, max_length=len(ids) + 5, stride=256)
    assert result.windows == 1
    assert result.perplexity == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_perplexity_context_matters(model, tokenizer):
    # Less context can only be scored differently: guards against a window slicing that ignores it.
    a = evaluate.perplexity(model, TEXT, tokenizer, max_length=300, stride=256).nll
    b = evaluate.perplexity(model, TEXT, tokenizer, max_length=256, stride=256).nll
    assert a != b


def test_perplexity_default_length_is_the_models(model, tokenizer):
    short = tiny_llama(len(tokenizer), max_position=300)
    assert evaluate.perplexity(short, TEXT, tokenizer).nll == pytest.approx(
        evaluate.perplexity(short, TEXT, tokenizer, max_length=300).nll
    )


def test_perplexity_in_small_loss_chunks_is_the_same(model, tokenizer, monkeypatch):
    # Any chunking of the loss (here 7 positions at a time) scores every token alike.
    whole = evaluate.perplexity(model, TEXT, tokenizer, max_length=300, stride=256)
    monkeypatch.setattr(evaluate, "_LOSS_CHUNK_BYTES", 8 * len(tokenizer) * 7)
    chunked = evaluate.perplexity(model, TEXT, tokenizer, max_length=300, stride=256)
    # (float32 head outputs: a matrix multiply of other sizes rounds differently, ~1e-8)
    torch.testing.assert_close(chunked.token_nll, whole.token_nll, rtol=1e-6, atol=0, equal_nan=True)


MEMORY_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from support.tiny_lm import tiny_llama
    from ropescale import evaluate
    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    torch.set_num_threads(1)
    model = tiny_llama(50_000, max_position=8192)
    model.config._attn_implementation = "sdpa"  # the model's attention in O(L) memory: the loss is measured
    ids = torch.randint(50_000, ({length},), generator=torch.Generator().manual_seed(0))
    def extra_peak_mib(run):
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS (Linux >= 4.0)
            f.write("5")
        rss_before = status_kib("VmRSS")
        run()
        return (status_kib("VmHWM") - rss_before) / 1024
    with torch.no_grad():  # the model's own forward (its attention's memory is not the loss's)
        forward = extra_peak_mib(lambda: model.model(input_ids=ids[None], use_cache=False))
    result = []
    scoring = extra_peak_mib(lambda: result.append(evaluate.perplexity(model, ids, max_length={length},
                                                                       stride={stride})))
    assert result[0].tokens == {length} - 1
    print(forward, scoring)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_perplexity_peak_memory_is_one_loss_chunk_not_vocabulary_times_window():
    # issue 16.10: 8k tokens x 50k vocabulary of float32 logits is 1.6 GB, and the old path kept a
    # float64 copy and its log-softmax too (~8 GB). One loss chunk is 64 MiB of float64 logits.
    script = MEMORY_SCRIPT.format(tests=str(TESTS), length=8192, stride=4096)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(evaluate.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    forward, scoring = map(float, result.stdout.strip().splitlines()[-1].split())
    print(f"perplexity at 8k, vocabulary 50k: extra peak RSS {scoring:.0f} MiB, the bare forward's {forward:.0f} MiB")
    assert scoring - forward < 256, f"scoring peaks {scoring - forward:.0f} MiB above the model's forward"


def test_passkey_prompt_forward_computes_one_position_of_logits(model, tokenizer):
    # issue 16.10: the prompt's forward kept prompt x vocabulary logits to read the last row.
    positions = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: positions.append(out.shape[-2]))
    try:
        evaluate.passkey_retrieval(model, tokenizer, context_length=300, trials=1, max_new_tokens=3)
    finally:
        handle.remove()
    assert positions == [1, 1, 1]


def test_perplexity_bad_input(model, tokenizer):
    with pytest.raises(ValueError, match="perplexity: stride \\(300\\) must be <= max_length \\(256\\)"):
        evaluate.perplexity(model, TEXT, tokenizer, max_length=256, stride=300)
    with pytest.raises(ValueError, match="perplexity: a tokenizer is needed"):
        evaluate.perplexity(model, TEXT)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        evaluate.perplexity(model, [5], max_length=10, stride=5)
    with pytest.raises(ValueError, match="stride >= 1"):
        evaluate.perplexity(model, TEXT, tokenizer, max_length=10, stride=0)


# ---------------------------------------------------------------------------------------------
# Passkey retrieval


def test_passkey_prompt_layout():
    prompt = evaluate.passkey_prompt(6, 2, 12345)
    before, after = prompt.split("The pass key is 12345. Remember it. 12345 is the pass key.")
    assert before.count(evaluate.PASSKEY_FILLER) == 2 and after.count(evaluate.PASSKEY_FILLER) == 4
    assert prompt.startswith(evaluate.PASSKEY_TASK) and prompt.endswith(evaluate.PASSKEY_QUESTION)
    with pytest.raises(ValueError, match="n_before must be in \\[0, n_filler = 6\\]"):
        evaluate.passkey_prompt(6, 7, 12345)


def test_passkey_with_a_perfect_copier_is_1(tokenizer):
    stub = PasskeyStub(tokenizer)
    result = evaluate.passkey_retrieval(stub, tokenizer, context_length=1500, trials=12, seed=1)
    assert result.accuracy == 1.0
    for trial in result.trials:
        assert 10_000 <= trial.key <= 99_999  # 5 digits
        assert trial.answer.strip().startswith(str(trial.key))
        assert trial.prompt_tokens <= 1500 - 10


def test_passkey_with_a_model_that_never_sees_the_key_is_0(tokenizer):
    stub = PasskeyStub(tokenizer, window=5)
    result = evaluate.passkey_retrieval(stub, tokenizer, context_length=800, trials=8, seed=2)
    assert result.accuracy == 0.0 and not any(stub.visible)


def test_passkey_accuracy_is_the_fraction_of_keys_in_view(tokenizer):
    # A copier that sees only its last 700 tokens: it finds the keys at shallow depths, not the deep
    # ones. The evaluator must score exactly the trials the stub could answer.
    stub = PasskeyStub(tokenizer, window=700)
    result = evaluate.passkey_retrieval(stub, tokenizer, context_length=1500, trials=40, seed=3)
    assert len(stub.visible) == 40
    assert result.accuracy == sum(stub.visible) / 40
    assert 0 < result.accuracy < 1
    assert [t.correct for t in result.trials] == stub.visible
    # A visible key sits late in the prompt: depths of correct trials exceed those of missed ones.
    hit = [t.depth for t in result.trials if t.correct]
    miss = [t.depth for t in result.trials if not t.correct]
    assert min(hit) > max(miss)


def test_passkey_depths_are_uniform_and_seeded(tokenizer):
    a = evaluate.passkey_prompts(tokenizer, context_length=3000, trials=400, seed=4)
    depths = [d for _, _, d in a]
    assert min(depths) == 0.0 and max(depths) == 1.0
    assert abs(sum(depths) / len(depths) - 0.5) < 0.05
    assert 0.4 < sum(d < 0.5 for d in depths) / len(depths) < 0.6
    # Each prompt holds its key at the depth it reports.
    for prompt, key, depth in a[:20]:
        before = prompt.split(f"The pass key is {key}.")[0]
        n_before = before.count(evaluate.PASSKEY_FILLER)
        n_filler = prompt.count(evaluate.PASSKEY_FILLER)
        assert depth == n_before / n_filler and prompt.count(str(key)) == 2
    assert a == evaluate.passkey_prompts(tokenizer, context_length=3000, trials=400, seed=4)
    assert a != evaluate.passkey_prompts(tokenizer, context_length=3000, trials=400, seed=5)
    assert len({key for _, key, _ in a}) > 350
    # passkey_retrieval asks these very prompts.
    stub = PasskeyStub(tokenizer)
    result = evaluate.passkey_retrieval(stub, tokenizer, context_length=3000, trials=3, seed=4)
    assert [(t.key, t.depth) for t in result.trials] == [(key, depth) for _, key, depth in a[:3]]


def test_passkey_prompt_fills_the_context(tokenizer):
    stub = PasskeyStub(tokenizer)
    result = evaluate.passkey_retrieval(stub, tokenizer, context_length=1000, trials=3, seed=5, max_new_tokens=8)
    block = len(tokenizer(" " + evaluate.PASSKEY_FILLER)["input_ids"])
    for trial in result.trials:
        # As many filler blocks as fit: one more would overflow the budget.
        assert 1000 - 8 - block - 5 < trial.prompt_tokens <= 1000 - 8


def test_greedy_generation_matches_transformers_generate(model, tokenizer):
    # The evaluator's own greedy loop (with the model's KV cache) against model.generate.
    ids = torch.tensor(tokenizer(evaluate.passkey_prompt(3, 1, 54321))["input_ids"])
    ours = evaluate.greedy_tokens(model, ids, max_new_tokens=12, eos_token_id=None)
    with torch.no_grad():
        theirs = model.generate(ids[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(ids):]
    assert ours == theirs.tolist()


def test_passkey_on_a_real_model_runs(model, tokenizer):
    result = evaluate.passkey_retrieval(model, tokenizer, context_length=400, trials=2, seed=0)
    assert len(result.trials) == 2 and result.accuracy in (0.0, 0.5, 1.0)
    assert all(re.fullmatch(r"\d{5}", str(t.key)) for t in result.trials)


def test_passkey_bad_input(tokenizer):
    stub = PasskeyStub(tokenizer)
    with pytest.raises(ValueError, match="passkey_retrieval: context_length 100 cannot hold even the empty prompt"):
        evaluate.passkey_retrieval(stub, tokenizer, context_length=100)
    with pytest.raises(ValueError, match="context_length must be > max_new_tokens"):
        evaluate.passkey_retrieval(stub, tokenizer, context_length=5)
    with pytest.raises(ValueError, match="trials must be >= 1"):
        evaluate.passkey_retrieval(stub, tokenizer, context_length=1000, trials=0)


# ---------------------------------------------------------------------------------------------
# The command's model argument, one check for every evaluator


@pytest.fixture(scope="module")
def model_without_tokenizer(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("no_tokenizer")
    tiny_llama(len(tokenizer), max_position=64).save_pretrained(path)
    return path


EVALUATORS = {"passkey": ["--context-length", "200"], "perplexity": ["--text", "book.txt"],
              "ruler": ["--lengths", "1000", "--tasks", "fwe"]}


@pytest.mark.parametrize("evaluator", sorted(EVALUATORS))
def test_eval_model_argument_errors_say_what_is_needed_before_any_loading(evaluator, capsys, tmp_path, monkeypatch,
                                                                          model_without_tokenizer):
    from ropescale import cli
    from ropescale.cli import cmd_eval

    monkeypatch.setattr(cmd_eval, "_load_model", lambda args: pytest.fail("a model was loaded"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "weights.gguf").write_text("")

    def error(*argv):
        with pytest.raises(SystemExit) as exc:
            cli.main(["eval", evaluator, *argv, *EVALUATORS[evaluator]])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"usage: ropescale eval {evaluator}" in err and "Traceback" not in err
        return err.strip().splitlines()[-1]

    assert "no model to evaluate: give a model directory (or hub name), or --gguf FILE" in error()
    assert "not both" in error("some/model", "--gguf")
    # a path that is no local directory: said so, no hub lookup (a hub name has no "./", and models/ is a folder)
    for missing in ("./models/nothere", "models/nothere", str(tmp_path / "nothere"), "~/nothere-ropescale"):
        assert f"MODEL: {missing} is not a local model directory" in error(missing)
    assert "weights.gguf is a file, not a model directory (a GGUF file: --gguf FILE)" in error("weights.gguf")
    # a model directory without its tokenizer: said before the weights load
    message = error(str(model_without_tokenizer))
    assert f"{model_without_tokenizer} has no tokenizer files (tokenizer.json / tokenizer.model / ...)" in message
    assert "--tokenizer" in message
    assert "--tokenizer: ./nothere is not a local model directory" in error(str(model_without_tokenizer),
                                                                            "--tokenizer", "./nothere")
