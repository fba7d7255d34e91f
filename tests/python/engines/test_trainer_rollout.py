"""Issue 46, part 4: the trainer and the rollout engine agree. RL fine-tuning (TRL, OpenRLHF, verl) trains the policy
in transformers and samples its rollouts from vLLM: with different RoPE scaling on the two sides the policy's
log-probabilities disagree silently (the importance ratio is off from the first token past the original length).

Runs on the vLLM leg (as test_vllm.py); skips elsewhere. ONE engine process (support/vllm_engine.py, the engine core
in-process): a checkpoint per method, every static method ropescale registers (``support.methods.registered``, each
also with Resonance) and a per-request Dynamic-YaRN, each sampling seeded rollouts (temperature 1, ``logprobs`` and
``prompt_logprobs``) that run past the original length (L = 64) to 136 and 174 tokens. On the very tokens sampled:

- the trainer (``hf.patch``, ``model.train()``, dropout 0 as the config has it, float32) gives every token's log p
  within 1e-5 + 1e-6 |log p| of vLLM's (``assert_same``'s bound for float32 logits: the two sides rotate with the same
  tables, bit for bit (test_vllm.py), so only float32 accumulation order differs; each side is ~1e-5 from float64);
- the trainer under ``torch.autocast("cpu", dtype=torch.bfloat16)``: its error against the float64 model is within
  twice what stock transformers' own rope (the same checkpoint's type loaded without ropescale; for a ropescale type,
  the stock type it extends; for the per-request method, stock YaRN at the request's scale) makes in bf16 autocast
  on the same tokens, in max |d log p| and in RMS; and so is its distance to vLLM's log-probs;
- per-request YaRN: a rollout that stopped before its budget is scored exactly only when the trainer states the
  budget (``hf.request(model, max_new_tokens=budget - generated)``); a plain forward plans the shorter length;
- the negative controls: a trainer patched with YaRN(4) scoring the rollouts of the unscaled checkpoint, or of
  YaRN at another factor (the per-request engine's), is far outside both bounds;
- examples/rl_rollout.py runs its loop (2 iterations) end to end.
"""

import dataclasses
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from support import ROOT
from support.methods import instance, registered
from support.vllm_engine import run_engines  # noqa: E402
from support.vllm_testing import HEAD, ORIGINAL, require_vllm, served_llama  # noqa: E402

require_vllm()

from transformers import AutoModelForCausalLM  # noqa: E402

from ropescale import hf, scaling  # noqa: E402
from support.rollout import (assert_bf16_as_close_as_stock, errors, one_torch_thread, token_logprobs,  # noqa: E402,F401
                             trainer)

SERVED = 4 * ORIGINAL
NEW_TOKENS = 16
PROMPTS = (120, 158)  # + NEW_TOKENS: 136 and 174 tokens, past L = 64

# Every static method ropescale registers, each with and without Resonance (Resonance-YaRN among them), set for 4L.
STATIC = {}
for _name, _cls in registered(dynamic=False).items():
    _method = instance(_cls, pairs=HEAD // 2, original=ORIGINAL, factor=4.0)
    STATIC[_name] = _method
    STATIC[f"resonance_{_name}"] = dataclasses.replace(_method, resonance=True)
PER_REQUEST = "per_request_yarn"
METHODS = {**STATIC, PER_REQUEST: scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")}
# The per-request engine's requests: (prompt, budget); a request within L runs the native model
PER_REQUEST_LENGTHS = ((40, 16), (120, NEW_TOKENS), (158, NEW_TOKENS))


def prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


def rollout_batch(name):
    requests = PER_REQUEST_LENGTHS if name == PER_REQUEST else [(p, NEW_TOKENS) for p in PROMPTS]
    return {"prompts": prompts([p for p, _ in requests]),
            "params_each": [dict(temperature=1.0, seed=100 + i, max_tokens=n, logprobs=0, prompt_logprobs=0,
                                 ignore_eos=True, detokenize=False) for i, (_, n) in enumerate(requests)]}


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """({name: (the checkpoint, the served requests)}, the engine process's log): one process, an engine per
    checkpoint (in-process: a further LLM() costs seconds, not a vLLM import)."""
    root = tmp_path_factory.mktemp("trainer-rollout")
    start = time.perf_counter()
    paths = {}
    for name, method in METHODS.items():
        model = hf.patch(served_llama(), method)
        if name == "default":
            # plain RoPE: hf.patch keeps the trained length (64), where vLLM's own table ends (NaN past it, even
            # with VLLM_ALLOW_LONG_MAX_MODEL_LEN); a config declaring the served length gets the whole table
            model.config.max_position_embeddings = SERVED
        model.save_pretrained(paths.setdefault(name, root / name))
    options = dict(enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=SERVED)
    engines = [{"id": name, "path": str(path), "options": options, "batches": [rollout_batch(name)]}
               for name, path in paths.items()]
    results, log = run_engines(root, engines, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                               "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, timeout=900)
    by_id = {r["id"]: r for r in results}
    assert all("batches" in by_id.get(name, {}) for name in METHODS), log[-6000:]
    print(f"engines: {len(engines)} in {time.perf_counter() - start:.1f} s")
    return {name: (paths[name], by_id[name]["batches"][0]) for name in METHODS}, log


def rollout(name, served):
    """[(tokens [1, P + N], vLLM's log p of tokens 1.. as float64)] of the engine's requests."""
    out = []
    for prompt, request in zip(rollout_batch(name)["prompts"], served):
        assert request["prompt_logprobs"][0] is None and len(request["tokens"]) == len(request["logprobs"])
        tokens = torch.tensor([prompt + request["tokens"]])
        logprobs = torch.tensor(request["prompt_logprobs"][1:] + request["logprobs"], dtype=torch.float64)
        out.append((tokens, logprobs))
    return out


def stock_counterpart(name, rollouts_, length, dtype, tmp_path):
    """Stock transformers' own rope on the same weights: the checkpoint's type loaded without ropescale; for a
    ropescale type (resonance_*), the stock type it extends; for the per-request method, YaRN at the scale of a
    request of ``length`` tokens."""
    if name == PER_REQUEST:
        path = tmp_path / f"stock_{length}"
        if not path.exists():
            static = (scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL) if length > ORIGINAL
                      else scaling.Default())
            hf.patch(served_llama(), static).save_pretrained(path)
    else:
        path = rollouts_[name.removeprefix("resonance_")][0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).train()
    assert not hf.is_patched(model)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_the_trainer_in_training_mode_gives_vllms_rollout_logprobs(rollouts, name):
    """float32: every sampled and prompt token's log p, the trainer's against vLLM's."""
    served, log = rollouts
    assert "vLLM 0.32.0 plugin active" in log
    model = trainer(METHODS[name])
    for i, (tokens, vllm_lp) in enumerate(rollout(name, served[name][1])):
        got = token_logprobs(model, tokens)
        print(f"{name}, {tokens.shape[1]} tokens: float32 trainer vs vLLM max |d log p| "
              f"{(got - vllm_lp).abs().max():.2e}")
        torch.testing.assert_close(got, vllm_lp, atol=1e-5, rtol=1e-6, msg=lambda m: f"{name}, request {i}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_the_trainer_under_bf16_autocast_is_as_close_as_stock_transformers(rollouts, name, tmp_path):
    served, _ = rollouts
    model, exact = trainer(METHODS[name]), trainer(METHODS[name], torch.float64)
    for tokens, vllm_lp in rollout(name, served[name][1]):
        length = tokens.shape[1]
        reference = token_logprobs(exact, tokens)
        stock_bf16 = token_logprobs(stock_counterpart(name, served, length, torch.float32, tmp_path), tokens,
                                    torch.bfloat16)
        stock_exact = token_logprobs(stock_counterpart(name, served, length, torch.float64, tmp_path), tokens)
        assert_bf16_as_close_as_stock(f"{name}, {length} tokens", token_logprobs(model, tokens, torch.bfloat16),
                                      reference, stock_bf16, stock_exact, vllm_lp, "vLLM")


@pytest.mark.slow
def test_a_per_request_rollout_stopped_early_is_scored_exactly_when_the_trainer_states_the_budget(rollouts):
    """vLLM plans a per-request rollout at prompt + max_tokens, whether or not it stops early (EOS): the trainer
    scores the shorter sequence with the same scale only under ``hf.request(model, max_new_tokens=budget - n)``."""
    served, _ = rollouts
    model = trainer(METHODS[PER_REQUEST])
    (tokens, vllm_lp), budget = rollout(PER_REQUEST, served[PER_REQUEST][1])[2], PER_REQUEST_LENGTHS[2][1]
    kept = 6  # the rollout as if it had stopped after 6 of its 16 tokens
    prefix = tokens[:, : PER_REQUEST_LENGTHS[2][0] + kept]
    want = vllm_lp[: prefix.shape[1] - 1]  # causal: the first tokens' log p do not depend on the later ones
    with hf.request(model, max_new_tokens=budget - kept):
        stated = token_logprobs(model, prefix)
    plain = token_logprobs(model, prefix)
    print(f"stopped early: stated budget max |d log p| {(stated - want).abs().max():.2e}, plain forward "
          f"{(plain - want).abs().max():.2e}")
    torch.testing.assert_close(stated, want, atol=1e-5, rtol=1e-6)
    assert (plain - want).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["default", PER_REQUEST])
def test_negative_control_a_yarn_trainer_against_another_scaling_in_vllm_is_far_outside_the_bounds(rollouts, engine):
    """The trainer patched with YaRN(4) scoring rollouts vLLM sampled with plain RoPE (``default``), or with YaRN at
    another factor (the per-request engine's 136- and 174-token requests: s = 2.1 and 2.7): every bound above fails
    by orders of magnitude."""
    served, _ = rollouts
    model, exact = trainer(STATIC["yarn"]), trainer(STATIC["yarn"], torch.float64)
    for tokens, vllm_lp in rollout(engine, served[engine][1]):
        if tokens.shape[1] <= ORIGINAL:
            continue  # (the per-request engine's native request)
        diff = (token_logprobs(model, tokens) - vllm_lp).abs()
        bf16 = errors(token_logprobs(model, tokens, torch.bfloat16), token_logprobs(exact, tokens))
        print(f"control ({engine} in vLLM), {tokens.shape[1]} tokens: YaRN(4) trainer vs vLLM max |d log p| "
              f"{diff.max():.3f} rms {diff.pow(2).mean().sqrt():.3f} (the trainer's own bf16 error: max "
              f"{bf16[0]:.3f} rms {bf16[1]:.4f})")
        assert diff.max() > 1e4 * 1e-5 and diff.max() > 4 * bf16[0] and diff.pow(2).mean().sqrt() > 4 * bf16[1]


@pytest.mark.slow
def test_the_rl_rollout_example_agrees_at_every_iteration(tmp_path):
    """examples/rl_rollout.py, 2 iterations of 2 rollouts: vLLM samples from the saved policy, the trainer's
    log-probs agree with vLLM's (float32: within the bound above), a policy-gradient step, saved, reloaded."""
    import json

    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "examples/rl_rollout.py"), "--iterations", "2", "--rollouts",
                             "2", "--new-tokens", "8", "--output-dir", str(tmp_path)],
                            env=dict(os.environ, OMP_NUM_THREADS="2", VLLM_LOGGING_LEVEL="INFO"),
                            capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    print(f"examples/rl_rollout.py: {time.perf_counter() - start:.1f} s")
    assert result.returncode == 0, out[-6000:]
    assert "vLLM 0.32.0 plugin active" in out, out[-6000:]
    differences = [float(d) for d in re.findall(r"max \|difference\| (\S+)", result.stdout)]
    assert len(differences) == 2 and max(differences) < 1e-5, result.stdout
    assert "the trainer and vLLM agreed at every iteration" in result.stdout
    for step in (1, 2):  # each step's policy saved with YaRN recorded, and the next engine loaded it
        config = json.loads((tmp_path / f"policy-{step}" / "config.json").read_text())
        assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 4.0
