"""ropescale's SGLang plugin and ``ropescale verify --engine sglang`` against SGLang itself (issue 56), on the SGLang
leg (``scripts/test_sglang.sh``: SGLang 0.5's CPU engine, torch_native attention, float32). Each case is what a user
runs: ``verify`` starts SGLang in a process of its own (``sglang.Engine``, the plugins SGLang loads from the entry
point; ``ROPESCALE_SGLANG=0`` is stock SGLang) and holds its prompt log-probabilities to ropescale's float64 forward
of the same weights. One engine start per case (about 30-50 s on 2 cores)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.sglang_testing import require_sglang
from support.vllm_testing import ORIGINAL, saved_llama, served_llama

require_sglang()

from ropescale import config as config_lib, hf, scaling, verify  # noqa: E402
from ropescale.hf import checkpoint  # noqa: E402

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang")


def _checkpoint(path: Path, method, target: str = "any", **config) -> Path:
    """The tiny Llama with ``method`` written into its config (``checkpoint.record``: what hf.patch and extend write),
    saved to ``path`` once per module."""
    if not path.exists():
        model = served_llama()
        checkpoint.record(model.config, method, target=target)
        for key, value in config.items():
            setattr(model.config, key, value)
        model.save_pretrained(path)
    return path


def _verify(path, monkeypatch, plugin: str, **kwargs):
    monkeypatch.setenv("ROPESCALE_SGLANG", plugin)
    report = verify.verify(path, "sglang", **kwargs)
    print(report.text())
    assert ("plugin loaded" if plugin == "1" else "plugin not loaded") in " ".join(report.notes) \
        or any(c.verdict == "refused" for c in report.checks), report.text()
    return report


def _without_sglangs_copy(path: Path, dst: Path) -> Path:
    """``path`` with its yarn's ``attn_factor`` removed: a config as another tool writes it (transformers'
    ``attention_factor`` alone)."""
    if not dst.exists():
        shutil.copytree(path, dst)
        config = json.loads((dst / "config.json").read_text())
        del config["rope_parameters"][config_lib.SGLANG_YARN_KEY]
        config.pop(config_lib.CONFIG_KEY, None)  # not ropescale's any more
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("plugin", ["1", "0"])
def test_a_yarn_attention_factor_is_exact_in_sglang_with_and_without_the_plugin(folder, monkeypatch, plugin):
    """Stock SGLang 0.5 builds YaRN's attention factor from ``factor`` times ``attn_factor`` and never reads
    ``attention_factor``: ropescale writes SGLang's copy beside it, so the checkpoint is exact in stock SGLang too."""
    method = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, attention_factor_override=1.0)
    path = _checkpoint(folder / "yarn-attention-factor", method)
    assert json.loads((path / "config.json").read_text())["rope_parameters"][config_lib.SGLANG_YARN_KEY] < 1.0
    report = _verify(path, monkeypatch, plugin)
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


def test_stock_sglang_drops_an_attention_factor_written_without_its_copy_and_verify_names_it(folder, monkeypatch):
    """The same table as another tool writes it (``attention_factor`` alone): stock SGLang serves it with its own
    factor, silently; verify names the dropped key (and the plugin leaves a config ropescale did not write to
    SGLang)."""
    method = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, attention_factor_override=1.0)
    path = _without_sglangs_copy(_checkpoint(folder / "yarn-attention-factor", method), folder / "yarn-af-dropped")
    assert config_lib.stock_sglang_misreads(json.loads((path / "config.json").read_text())["rope_parameters"])
    report = _verify(path, monkeypatch, "0")
    served, scaled = report.checks[:2]
    assert scaled.verdict == "different" and "attention_factor" in scaled.detail, report.text()
    assert report.exit_code == 1


@pytest.mark.parametrize("plugin", ["1", "0"])
def test_a_resonance_yarn_checkpoint_is_exact_with_the_plugin_and_refused_by_stock_sglang(folder, monkeypatch, plugin):
    path = _checkpoint(folder / "resonance-yarn", scaling.YaRN(factor=4.0, original_max_position=ORIGINAL,
                                                              resonance=True))
    report = _verify(path, monkeypatch, plugin)
    if plugin == "1":
        assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()
    else:
        assert report.checks[-1].verdict == "refused" and "resonance_yarn" in report.checks[-1].detail, report.text()


def test_an_ntk_aware_checkpoint_is_exact_with_the_plugin(folder, monkeypatch):
    """NTK-aware, written as ``default`` with the scaled base and the method in the ropescale entry."""
    path = _checkpoint(folder / "ntk", scaling.NTK(factor=4.0))
    report = _verify(path, monkeypatch, "1")
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


def test_target_sglang_is_exact_in_stock_sglang(folder, monkeypatch):
    """``extend --target sglang``: the YaRN table with attention factor 1.0 as a longrope (short == long factors),
    which stock SGLang serves exactly."""
    method = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, attention_factor_override=1.0)
    path = _checkpoint(folder / "target-sglang", method, target="sglang")
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "longrope"
    report = _verify(path, monkeypatch, "0")
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


def _per_request_checkpoint(folder: Path) -> Path:
    path = folder / "per-request"
    if not path.exists():
        model = served_llama()
        hf.patch(model, scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
        model.config.model_max_length = 4 * ORIGINAL
        model.save_pretrained(path)
    return path


def test_a_per_request_checkpoint_is_exact_with_verify(folder, monkeypatch):
    """verify's probe plans its own length (prompt + the one token asked for): the static model of that scale."""
    report = _verify(_per_request_checkpoint(folder), monkeypatch, "1")
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


def _static_model(length: int):
    """The static model of the scale a request of ``length`` planned tokens gets (native within the original)."""
    model = served_llama().eval()
    if length <= ORIGINAL:
        return model
    return hf.patch(model, scaling.YaRN(factor=length / ORIGINAL, original_max_position=ORIGINAL))


def test_each_request_is_the_static_model_of_its_scale_however_sglang_schedules_it(folder):
    """Per-request Dynamic YaRN: in one batch (32-token chunked prefill) a native request (prompt + budget within
    the original length) and two long ones of different budgets; then the long prompt again with a third budget
    (another scale: it must not read the first's cached keys) and with the first's (the same scale: it reads them).
    Each equals transformers + ropescale's static model of its planned length (prompt + max_new_tokens)."""
    import torch

    path = _per_request_checkpoint(folder)
    native = [(11 * i + 5) % 256 for i in range(40)]
    long = [(7 * i + 3) % 256 for i in range(150)]
    longer = long[:128] + [(13 * i + 1) % 256 for i in range(30)]
    batches = [[native, long, longer], [long, long]]
    budgets = [[10, 20, 60], [50, 20]]
    starts = [0, 128]  # (SGLang reads a cached prefix only past logprob_start_len)
    served = _serve(path, batches, 4 * ORIGINAL, starts=starts, budgets=budgets, chunked_prefill_size=32)
    worst = {}
    for prompts, plans, start, answers in zip(batches, budgets, starts, served):
        for prompt, budget, answer in zip(prompts, plans, answers):
            planned = len(prompt) + budget
            with torch.no_grad():
                x = torch.tensor([prompt])
                want = _static_model(planned)(x).logits[0].double().log_softmax(-1)[:-1]
                want = want.gather(-1, x[0, 1:, None])[:, 0]
            got = torch.tensor(answer["logprobs"][1:], dtype=torch.float64)
            assert len(got) == len(prompt) - start - 1
            worst[planned] = max(worst.get(planned, 0.0), (got - want[start:]).abs().max().item())
    cached = [a["cached"] for a in served[1]]
    print(f"max |delta log p| by planned length {worst}; cached tokens of the repeats {cached}")
    assert all(v < 1e-5 for v in worst.values()), worst
    # the repeat at a new scale read nothing; at the first's scale, its prefix
    assert cached[0] == 0 and cached[1] >= 128, cached


def _probe(path: Path, plugin: str, tokens: list[int], monkeypatch) -> list[float]:
    """The engine's answer to verify's probe (its own process, as ``verify`` runs it)."""
    monkeypatch.setenv("ROPESCALE_SGLANG", plugin)
    answer = verify._run_probe("sglang", path, tokens, len(tokens), 900.0)
    assert "error" not in answer, answer
    assert ("plugin loaded" if plugin == "1" else "plugin not loaded") in " ".join(answer["notes"]), answer["notes"]
    return answer["logprobs"]


def test_a_model_ropescale_did_not_write_is_served_bit_for_bit_as_without_the_plugin(folder, monkeypatch):
    """Stock YaRN with no ropescale entry (and so every other layer the plugin leaves to SGLang): the same
    log-probabilities, bit for bit, with and without the plugin."""
    path = saved_llama(folder / "third-party-yarn", rope_type="yarn", factor=4.0,
                       original_max_position_embeddings=ORIGINAL, max_position_embeddings=4 * ORIGINAL)
    tokens = [(7 * i + 3) % 256 for i in range(3 * ORIGINAL)]
    assert _probe(path, "1", tokens, monkeypatch) == _probe(path, "0", tokens, monkeypatch)


def _serve(path: Path, batches: list[list[list[int]]], context_length: int, plugin: str = "1", starts=None,
           budgets=None, **engine) -> list:
    """``support/sglang_serve.py``: SGLang's prompt log-probabilities of each batch, one engine for all."""
    job = path.parent / f"serve-{path.name}.json"
    job.write_text(json.dumps({"target": str(path), "context_length": context_length, "engine": engine,
                               "batches": batches, "starts": starts, "budgets": budgets}))
    script = Path(__file__).parents[1] / "support" / "sglang_serve.py"
    run = subprocess.run([sys.executable, str(script), str(job)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "ROPESCALE_SGLANG": plugin}, cwd=path.parent)
    line = next((l for l in run.stdout.splitlines() if l.startswith("SERVED ")), None)
    assert line is not None, (run.stdout + run.stderr)[-4000:]
    return json.loads(line[len("SERVED "):])


def test_a_static_table_under_load_chunked_prefill_and_the_radix_cache_equals_transformers(folder):
    """With the plugin, a batch of mixed requests (three lengths past the original, one sharing a prefix with
    another), prefilled in chunks of 32 tokens, then the shared-prefix request again alone (its prefix now in the
    radix cache): every prompt log-probability equals transformers + ropescale (float32) within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM

    method = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, attention_factor_override=1.0)
    path = _checkpoint(folder / "yarn-attention-factor", method)
    long = [(7 * i + 3) % 256 for i in range(3 * ORIGINAL)]
    short = [(11 * i + 5) % 256 for i in range(ORIGINAL + 19)]
    shared = long[:2 * ORIGINAL] + [(13 * i + 1) % 256 for i in range(37)]
    batches, starts = [[long, short, shared], [shared]], [0, 2 * ORIGINAL]
    served = _serve(path, batches, 4 * ORIGINAL, starts=starts, chunked_prefill_size=32)
    model = hf.patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
    worst = 0.0
    for prompts, start, answers in zip(batches, starts, served):
        for prompt, answer in zip(prompts, answers):
            with torch.no_grad():
                x = torch.tensor([prompt])
                want = model(x).logits[0].double().log_softmax(-1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
            got = torch.tensor(answer["logprobs"][1:], dtype=torch.float64)
            assert len(got) == len(prompt) - start - 1
            worst = max(worst, (got - want[start:]).abs().max().item())
    cached = served[1][0]["cached"]
    print(f"max |delta log p| {worst:.3g}; cached tokens of the repeated request: {cached}")
    assert worst < 1e-5 and cached >= ORIGINAL  # the repeat read its prefix from the radix cache


# ---------------------------------------------------------------------------------------------
# Raw keys in SGLang's pool, ropescale's attention backend (ReRoPE, Self-Extend, DCA, per-step dynamic tables)

RAW_KEY = {
    "rerope": (scaling.Default(), {"attention": "rerope", "window": 16}),
    "leaky_rerope_logn": (scaling.Default(), {"attention": "rerope", "window": 16, "leaky_k": 8.0,
                                              "logn_length": ORIGINAL}),
    "self_extend": (scaling.Default(), {"attention": "self_extend", "window": 16, "group": 3}),
    "dual_chunk": (scaling.Default(), {"attention": "dual_chunk", "chunk_size": 48, "local_size": 8,
                                       "original_max_position_embeddings": 32}),
    "dynamic_yarn": (scaling.DynamicYaRN(original_max_position=ORIGINAL), {}),
}


def _raw_key_checkpoint(folder: Path, name: str) -> Path:
    path = folder / f"raw-{name}"
    if not path.exists():
        method, arguments = RAW_KEY[name]
        model = served_llama()
        hf.patch(model, method, **arguments)
        model.config.model_max_length = 4 * ORIGINAL
        model.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", list(RAW_KEY))
def test_a_raw_key_checkpoint_is_exact_with_the_plugin(folder, monkeypatch, name):
    """SGLang caches raw keys (the plugin's pass-through rotary) and ropescale's backend attends: verify's probe of
    three times the original length is ropescale's forward."""
    report = _verify(_raw_key_checkpoint(folder, name), monkeypatch, "1", length=3 * ORIGINAL)
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


def test_a_raw_key_checkpoint_is_refused_by_stock_sglang(folder, monkeypatch):
    report = _verify(_raw_key_checkpoint(folder, "rerope"), monkeypatch, "0", length=3 * ORIGINAL)
    assert report.checks[-1].verdict == "refused" and "rerope" in report.checks[-1].detail, report.text()


@pytest.mark.parametrize("name", ["rerope", "dual_chunk", "dynamic_yarn"])
def test_raw_keys_under_load_chunked_prefill_the_radix_cache_and_decode_equal_transformers(folder, name):
    """The two prompt-dependent rules (DCA's temperature, a per-step table: each row takes its request's prompt
    length): a mixed batch prefilled in chunks of 32, 8 greedy tokens each (decode steps), then a repeat reading its
    prefix from the radix cache. Every prompt log-probability, generated token and its log-probability equals
    transformers + ropescale's (float32) within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM

    path = _raw_key_checkpoint(folder, name)
    long = [(7 * i + 3) % 256 for i in range(150)]
    short = [(11 * i + 5) % 256 for i in range(ORIGINAL + 19)]
    shared = long[:2 * ORIGINAL] + [(13 * i + 1) % 256 for i in range(37)]
    batches, starts, new = [[long, short, shared], [shared]], [0, 2 * ORIGINAL], 8
    served = _serve(path, batches, 4 * ORIGINAL, starts=starts, budgets=[[new] * 3, [new]], chunked_prefill_size=32)
    model = hf.patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
    model.generation_config.eos_token_id = None
    worst = 0.0
    for prompts, start, answers in zip(batches, starts, served):
        for prompt, answer in zip(prompts, answers):
            x = torch.tensor([prompt])
            with torch.no_grad():
                want = model(x).logits[0].double().log_softmax(-1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
                generated = model.generate(x, max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True,
                                           return_dict_in_generate=True)
            tokens = generated.sequences[0, len(prompt):].tolist()
            assert answer["tokens"] == tokens, (name, answer["tokens"], tokens)
            token_logprobs = [step[0].double().log_softmax(-1)[t].item() for step, t in zip(generated.logits, tokens)]
            got = torch.tensor(answer["logprobs"][1:], dtype=torch.float64)
            worst = max(worst, (got - want[start:]).abs().max().item(),
                        max(abs(a - b) for a, b in zip(answer["token_logprobs"], token_logprobs)))
    cached = served[1][0]["cached"]
    print(f"{name}: max |delta log p| {worst:.3g}; cached tokens of the repeat {cached}")
    assert worst < 1e-5 and cached >= ORIGINAL


def test_the_plugin_refuses_only_a_multimodal_rope_and_names_the_method():
    """No engine: ``refusal`` on what each kind of checkpoint reads as (static, per request, per step, raw keys)."""
    from ropescale.sglang import rotary

    cases = {
        "YaRN": config_lib.write(scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), 1e4, 64, ORIGINAL),
        "DynamicYaRN (per='request')": config_lib.write(
            scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"), 1e4, 64, ORIGINAL),
        "DynamicYaRN (per step)": config_lib.write(scaling.DynamicYaRN(original_max_position=ORIGINAL), 1e4, 64,
                                                    ORIGINAL),
        "Default with ReRoPE attention": config_lib.write(
            scaling.Default(), 1e4, 64, ORIGINAL, attention="rerope",
            parameters=config_lib.check_attention("rerope", {"window": 16})),
    }
    for name, written in cases.items():
        parsed = config_lib.read(written.rope_parameters, written.max_position_embeddings, written.entry, 64)
        assert rotary.refusal(parsed, multimodal=False) is None
        reason = rotary.refusal(parsed, multimodal=True)
        assert reason.startswith(f"ropescale.sglang: {name} on a multimodal rope (mrope_section) is not served"), reason
