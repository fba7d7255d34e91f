"""Issue 56, deliverable 4: the trainer equals the rollout on SGLang. RL frameworks (verl, slime, AReaL) sample their
rollouts from SGLang and train the policy in transformers: with different RoPE scaling on the two sides the policy's
log-probabilities disagree silently (the importance ratio is off from the first token past the original length).
The agreement test of the vLLM leg (test_trainer_rollout.py) against SGLang with ropescale's plugin.

Runs on the SGLang leg (scripts/test_sglang.sh: SGLang's CPU engine, torch_native attention, float32); skips
elsewhere. ONE engine process (support/sglang_testing.py), an engine per checkpoint: each static method below and a
per-request Dynamic-YaRN sample seeded rollouts (temperature 1, the prompt's and the sampled tokens' log-probs) that
run past the original length (L = 64) to 136 and 174 tokens (per-request: with one of 56 tokens, within L), in one
batch. On the very tokens sampled:

- the trainer (``hf.patch``, ``model.train()``, dropout 0 as the config has it, float32) gives every token's log p
  within 1e-5 + 1e-6 |log p| of SGLang's (as on the vLLM leg);
- the trainer under ``torch.autocast("cpu", dtype=torch.bfloat16)``: its error against the float64 model, and its
  distance to SGLang's log-probs, within twice what stock transformers' own rope makes in bf16 autocast on the same
  tokens (the vLLM leg's rule), in max |d log p| and in RMS;
- the negative control: the same engine with the plugin off (``ROPESCALE_SGLANG=0``: stock SGLang) on the YaRN
  checkpoint with ``attention_factor`` 1.0 drops the key: its log-probs are stock YaRN's, ~0.3 nats from the trainer's;
- per-request YaRN: each rollout planned at prompt + budget (SGLang's scheduler; transformers' plain forward of the
  whole rollout plans the same); a rollout that stopped early is scored exactly only when the trainer states the
  budget (``hf.request``);
- examples/rl_rollout.py --engine sglang runs its loop (2 iterations) end to end; --unpatched-trainer exits 1.

About 4-5 minutes on 2 cores (10 engine starts, 15-30 s each).
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from support import ROOT
from support.methods import instance
from support.sglang_testing import require_sglang, run_engines
from support.vllm_testing import HEAD, ORIGINAL, saved_llama, served_llama

require_sglang()

from transformers import AutoModelForCausalLM  # noqa: E402

from ropescale import hf, scaling  # noqa: E402
from support.rollout import (assert_bf16_as_close_as_stock, errors, one_torch_thread, token_logprobs,  # noqa: E402,F401
                             trainer)

SERVED = 4 * ORIGINAL
NEW_TOKENS = 16
PROMPTS = (120, 158)  # + NEW_TOKENS: 136 and 174 tokens, past L = 64

# yarn: attention_factor 1.0, the key stock SGLang drops; the others through the plugin's table as well
METHODS = {
    "yarn": scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, attention_factor_override=1.0),
    "resonance_yarn": scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, resonance=True),
    **{name: instance(scaling.METHODS[name], pairs=HEAD // 2, original=ORIGINAL, factor=4.0)
       for name in ("ntk", "linear", "llama3")},
}
PER_REQUEST = "per_request_yarn"
METHODS[PER_REQUEST] = scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")
PER_REQUEST_PROMPTS = (40,) + PROMPTS  # the first request (56 tokens) within L: the native model
STOCK = "stock_sglang_yarn"  # the yarn checkpoint without SGLang's attn_factor, in SGLang with the plugin off


def prompts(name, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist()
            for n in (PER_REQUEST_PROMPTS if name == PER_REQUEST else PROMPTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoints {name: path}, {job id: SGLang's result}, the engine process's log): one process, an engine per
    checkpoint (and the yarn checkpoint again with the plugin off)."""
    root = tmp_path_factory.mktemp("sglang-rollout")
    paths = {}
    for name, method in METHODS.items():
        model = hf.patch(served_llama(), method)
        if name == PER_REQUEST:
            model.config.model_max_length = SERVED  # the longest request served (as test_sglang.py's)
        model.save_pretrained(paths.setdefault(name, root / name))
    jobs = [{"id": name, "path": str(paths[name]), "prompts": prompts(name), "new_tokens": NEW_TOKENS, "seed": 0}
            for name in METHODS]
    # The yarn checkpoint as another tool writes it (attention_factor without SGLang's attn_factor, which ropescale
    # writes beside it) in stock SGLang. Stock SGLang derives 64 tokens for this config (it does not scale a length
    # given original_max_position_embeddings).
    dropped = root / "yarn-without-attn-factor"
    shutil.copytree(paths["yarn"], dropped)
    config = json.loads((dropped / "config.json").read_text())
    del config["rope_parameters"]["attn_factor"]
    (dropped / "config.json").write_text(json.dumps(config))
    jobs.append({**jobs[0], "id": STOCK, "path": str(dropped), "options": {"context_length": SERVED},
                 "env": {"ROPESCALE_SGLANG": "0", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}})
    start = time.perf_counter()
    results, log = run_engines(jobs)
    print(f"engines: {len(jobs)} in {time.perf_counter() - start:.1f} s")
    return paths, results, log


def rollout(name, result):
    """[(tokens [1, P + N], SGLang's log p of tokens 1.. as float64)] of an engine's requests."""
    assert "requests" in result, result
    return [(torch.tensor([prompt + request["tokens"]]),
             torch.tensor(request["prompt_logprobs"] + request["logprobs"], dtype=torch.float64))
            for prompt, request in zip(prompts(name), result["requests"])]


def stock_counterpart(name, length, dtype, tmp_path):
    """Stock transformers' own rope on the same weights: the checkpoint loaded without ropescale; for Resonance,
    the stock type it extends; for the per-request method, YaRN at the scale of a request of ``length`` tokens (the
    vLLM leg's rule)."""
    if name == PER_REQUEST:
        path = tmp_path / f"stock_{length}"
        method = (scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL) if length > ORIGINAL
                  else scaling.Default())
    else:
        path, method = tmp_path / f"stock_{name}", dataclasses.replace(METHODS[name], resonance=False)
    if not path.exists():
        hf.patch(served_llama(), method).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).train()
    assert not hf.is_patched(model)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_the_trainer_in_training_mode_gives_sglangs_rollout_logprobs(served, name):
    """float32: every prompt and sampled token's log p, the trainer's against SGLang's."""
    _, results, _ = served
    model = trainer(METHODS[name])
    for i, (tokens, sglang_lp) in enumerate(rollout(name, results[name])):
        got = token_logprobs(model, tokens)
        prompt = len(prompts(name)[i]) - 1
        print(f"{name}, {tokens.shape[1]} tokens: float32 trainer vs SGLang max |d log p| prompt "
              f"{(got - sglang_lp)[:prompt].abs().max():.2e}, sampled {(got - sglang_lp)[prompt:].abs().max():.2e}")
        torch.testing.assert_close(got, sglang_lp, atol=1e-5, rtol=1e-6, msg=lambda m: f"{name}, request {i}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_the_trainer_under_bf16_autocast_is_as_close_as_stock_transformers(served, name, tmp_path):
    _, results, _ = served
    model, exact = trainer(METHODS[name]), trainer(METHODS[name], torch.float64)
    for tokens, sglang_lp in rollout(name, results[name]):
        stock, stock_exact = (stock_counterpart(name, tokens.shape[1], dtype, tmp_path)
                              for dtype in (torch.float32, torch.float64))
        reference = token_logprobs(exact, tokens)
        assert_bf16_as_close_as_stock(
            f"{name}, {tokens.shape[1]} tokens", token_logprobs(model, tokens, torch.bfloat16), reference,
            token_logprobs(stock, tokens, torch.bfloat16), token_logprobs(stock_exact, tokens), sglang_lp, "SGLang")


@pytest.mark.slow
def test_negative_control_stock_sglang_drops_attention_factor_and_the_trainer_disagrees(served, tmp_path):
    """The yarn checkpoint (attention_factor 1.0) without the attn_factor ropescale writes beside it (as another tool
    writes it), in SGLang with the plugin off: stock SGLang serves YaRN with its default attention factor (the key
    dropped), so the trainer's log-probs are far outside both bounds above, and SGLang's are those of transformers'
    YaRN without the key."""
    _, results, _ = served
    dropped = AutoModelForCausalLM.from_pretrained(saved_llama(
        tmp_path / "dropped", rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
        max_position_embeddings=SERVED)).train()
    model, exact = trainer(METHODS["yarn"]), trainer(METHODS["yarn"], torch.float64)
    for tokens, sglang_lp in rollout("yarn", results[STOCK]):
        diff = (token_logprobs(model, tokens) - sglang_lp).abs()
        bf16 = errors(token_logprobs(model, tokens, torch.bfloat16), token_logprobs(exact, tokens))
        as_dropped = (token_logprobs(dropped, tokens) - sglang_lp).abs().max()
        print(f"stock SGLang (plugin off), {tokens.shape[1]} tokens: trainer vs SGLang max |d log p| {diff.max():.3f} "
              f"rms {diff.pow(2).mean().sqrt():.3f} (the trainer's own bf16 error: max {bf16[0]:.3f} rms "
              f"{bf16[1]:.4f}); transformers' YaRN without attention_factor vs SGLang {as_dropped:.1e}")
        assert diff.max() > 1e4 * 1e-5 and diff.max() > 4 * bf16[0] and diff.pow(2).mean().sqrt() > 4 * bf16[1]
        assert as_dropped < 1e-5


@pytest.mark.slow
def test_a_per_request_rollout_stopped_early_is_scored_exactly_when_the_trainer_states_the_budget(served):
    """SGLang plans a per-request rollout at prompt + max_new_tokens, whether or not it stops early (EOS): the
    trainer scores the shorter sequence with the same scale only under ``hf.request(model, max_new_tokens=budget -
    n)``."""
    _, results, _ = served
    model = trainer(METHODS[PER_REQUEST])
    tokens, sglang_lp = rollout(PER_REQUEST, results[PER_REQUEST])[2]
    kept = 6  # the rollout as if it had stopped after 6 of its 16 tokens
    prefix = tokens[:, : PER_REQUEST_PROMPTS[2] + kept]
    want = sglang_lp[: prefix.shape[1] - 1]  # causal: the first tokens' log p do not depend on the later ones
    with hf.request(model, max_new_tokens=NEW_TOKENS - kept):
        stated = token_logprobs(model, prefix)
    plain = token_logprobs(model, prefix)
    print(f"stopped early: stated budget max |d log p| {(stated - want).abs().max():.2e}, plain forward "
          f"{(plain - want).abs().max():.2e}")
    torch.testing.assert_close(stated, want, atol=1e-5, rtol=1e-6)
    assert (plain - want).abs().max() > 1e-3


def _example(tmp_path, *extra):
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "examples/rl_rollout.py"), "--engine", "sglang", "--rollouts",
                             "2", "--new-tokens", "8", "--output-dir", str(tmp_path), *extra],
                            env=dict(os.environ, OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=600)
    print(f"examples/rl_rollout.py --engine sglang {' '.join(extra)}: exit {result.returncode}, "
          f"{time.perf_counter() - start:.1f} s")
    return result


@pytest.mark.slow
def test_the_rl_rollout_example_agrees_at_every_iteration_on_sglang(tmp_path):
    """examples/rl_rollout.py --engine sglang, 2 iterations of 2 rollouts: SGLang samples from the saved policy, the
    trainer's log-probs agree with SGLang's (float32: within the bound above), a policy-gradient step, saved,
    reloaded by the next iteration's engine."""
    result = _example(tmp_path, "--iterations", "2")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "SGLang: ropescale's plugin active" in result.stdout, out[-6000:]
    differences = [float(d) for d in re.findall(r"trainer vs SGLang log-probs: max \|difference\| (\S+)",
                                                result.stdout)]
    assert len(differences) == 2 and max(differences) < 1e-5, result.stdout
    assert "the trainer and SGLang agreed at every iteration" in result.stdout
    for step in (1, 2):  # each step's policy saved with YaRN recorded, and the next engine loaded it
        config = json.loads((tmp_path / f"policy-{step}" / "config.json").read_text())
        assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 4.0


@pytest.mark.slow
def test_the_rl_rollout_example_stops_when_the_trainer_is_not_patched(tmp_path):
    result = _example(tmp_path, "--iterations", "1", "--unpatched-trainer")
    assert result.returncode == 1, (result.stdout + result.stderr)[-6000:]
    assert "the two sides do not apply the same RoPE scaling (--unpatched-trainer: stock rope in the trainer, YaRN " \
           "in SGLang)" in result.stderr, result.stderr[-3000:]
