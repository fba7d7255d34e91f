"""``ropescale verify`` (issue 45, part 3): what a target declares, the known ways of getting it wrong, the verdict
that names the one an engine is nearest, and transformers as an engine (vLLM: engines/test_vllm_verify.py, llama.cpp:
engines/test_llamacpp_engine.py).

The verdict logic is tested against a fake engine that IS one of the wrong formulas (ropescale's own forward under
it): verify must name each, and pass the declared one. The real transformers runs: a checkpoint ropescale wrote
(exact), and a GGUF with a YaRN table (transformers' GGUF loader reads no rope scaling for llama: ignored)."""

import importlib.util
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from ropescale import cli, scaling, verify
from support import planted
from support.planted import verify_planted
from support.vllm_testing import saved_llama

transformers = pytest.importorskip("transformers")

ORIGINAL = 64
YARN = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    return saved_llama(tmp_path_factory.mktemp("verify") / "yarn", YARN)


def fake_engine(monkeypatch, runs, *, nan_from=None, noise=0.0, plans=0, says=None, short=False):
    """Replaces the engine's process by ropescale's own forward under ``runs`` (a Hypothesis-like object with
    method, attention, parameters): an engine that computes exactly that formula. ``plans``: the tokens it asks for
    past the prompt (a per-request method's table is the one of prompt + plans); ``says``: the planned length it
    answers (default: the one it used)."""
    def probe(engine, target, tokens, length, timeout):
        model = verify.reference_model(target)
        prompt = len(tokens) - short  # short: vLLM's probe, a forward of all but the last token
        lp = verify.reference_logprobs(model, runs, tokens, prompt + plans, prompt)
        lp = lp + noise * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        if nan_from is not None:
            lp[nan_from:] = math.nan
        return {"logprobs": lp.tolist(), "version": "fake", "max_length": None, "notes": [],
                "planned": prompt + plans if says is None else says, "prompt": prompt, "dtype": "float32"}

    monkeypatch.setattr(verify, "_run_probe", probe)


def test_every_engine_has_a_probe():
    from ropescale import _verify_probe

    assert set(_verify_probe.PROBES) == set(verify.ENGINES)


def test_declared_reads_what_ropescale_wrote(yarn_checkpoint):
    d = verify.declared(yarn_checkpoint)
    assert d.method == YARN and d.original == ORIGINAL and d.served == 4 * ORIGINAL and d.rotary_dim == 64
    assert d.vocab_size == 256 and "ropescale's entry" in d.source


def test_hypotheses_are_every_key_an_engine_may_not_read():
    method = scaling.YaRN(factor=4.0, original_max_position=4096, beta_fast=16.0, beta_slow=2.0, truncate=False,
                          mscale=0.707, mscale_all_dim=1.0, resonance=True)
    d = verify.Declared(method, 10000.0, 128, 4096, 16384, "test", vocab_size=256, config_length=16384)
    hs, same = verify.hypotheses(d, 8192)
    assert not same
    named = {h.key for h in hs for h in (h, *h.alternatives)}
    assert {None, "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim", "original_max_position_embeddings",
            "attention factor", "resonance"} <= named, named
    assert hs[0].kind == "declared" and hs[1].kind == "ignored"
    # issue 59: the required keys with an engine's value too (Llama 3's at Meta's), LongRoPE's short table
    llama3 = scaling.Llama3(factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position=64)
    d = verify.Declared(llama3, 10000.0, 64, 64, 512, "test", vocab_size=256, config_length=512)
    assert {"low_freq_factor", "high_freq_factor"} <= {h.key for h in verify.hypotheses(d, 128)[0]}
    longrope = scaling.LongRoPE(short_factor=(1.0,) * 32, long_factor=(2.0,) * 32, original_max_position=64,
                                factor=4.0)
    d = verify.Declared(longrope, 10000.0, 64, 64, 256, "test", vocab_size=256, config_length=256)
    short = next(h for h in verify.hypotheses(d, 32)[0] if h.key == "short_factor")
    assert short.method.short_factor == longrope.long_factor
    # a dynamic method: also its table fixed at the served length
    dyn = verify.Declared(scaling.DynamicNTK(factor=4.0, original_max_position=ORIGINAL), 10000.0, 64, ORIGINAL,
                          4 * ORIGINAL, "test", vocab_size=256, config_length=ORIGINAL)
    assert "fixed" in {h.kind for h in verify.hypotheses(dyn, 2 * ORIGINAL)[0]}


@pytest.mark.parametrize("planted", ["declared", "ignored", "original_max_position_embeddings", "attention factor"])
def test_the_verdict_names_the_formula_the_engine_runs(yarn_checkpoint, monkeypatch, planted):
    d = verify.declared(yarn_checkpoint)
    hs, _ = verify.hypotheses(d, 2 * ORIGINAL)
    runs = next(h for h in hs if h.kind == planted or h.key == planted)
    fake_engine(monkeypatch, runs)
    report = verify.verify(yarn_checkpoint, "transformers")
    check = report.checks[-1]
    want = {"declared": "exact", "ignored": "ignored"}.get(planted, "different")
    assert check.verdict == want, report.text()
    assert report.exit_code == (0 if planted == "declared" else 1)
    if want == "different":
        assert planted in check.detail, check.detail


def test_an_engine_no_formula_explains_is_unexplained(yarn_checkpoint, monkeypatch):
    d = verify.declared(yarn_checkpoint)
    fake_engine(monkeypatch, verify.hypotheses(d, 2 * ORIGINAL)[0][0], noise=0.5)
    report = verify.verify(yarn_checkpoint, "transformers")
    assert report.checks[-1].verdict == "unexplained" and report.exit_code == 1, report.text()


@pytest.mark.parametrize("noise", [2e-4, 2e-5])
def test_exact_only_within_the_bound(yarn_checkpoint, monkeypatch, noise):
    """An engine nearest the declared method, far nearer than any other formula, but farther from it than the
    bound (float32 noise: 1e-5 nats): not exact (issue 59; the rule "clearly nearest" called it exact). The report
    prints the distance and the bound of every check."""
    d = verify.declared(yarn_checkpoint)
    fake_engine(monkeypatch, verify.hypotheses(d, 2 * ORIGINAL)[0][0], noise=noise)
    report = verify.verify(yarn_checkpoint, "transformers")
    check = report.checks[-1]
    assert check.distance > check.bound == verify.BOUNDS["transformers", "float32"], report.text()
    assert check.verdict == "unexplained" and report.exit_code == 1, report.text()
    assert f"[distance {check.distance:.3g}, bound 1e-05]" in report.text()
    assert "[distance 0, bound 0]" not in report.text()  # the transformers engine bounds no length: none printed


def test_every_exact_verdict_is_within_the_bound(yarn_checkpoint, monkeypatch):
    d = verify.declared(yarn_checkpoint)
    fake_engine(monkeypatch, verify.hypotheses(d, 2 * ORIGINAL)[0][0])
    check = verify.verify(yarn_checkpoint, "transformers").checks[-1]
    assert check.verdict == "exact" and check.distance <= check.bound <= 1e-5, check


@pytest.fixture(scope="module")
def per_request_checkpoint(tmp_path_factory):
    from ropescale import hf
    from support.vllm_testing import served_llama

    model = served_llama()
    hf.patch(model, scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
    model.config.model_max_length = 4 * ORIGINAL
    path = tmp_path_factory.mktemp("verify-per-request") / "dyn"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("length", [None, 4 * ORIGINAL])
def test_a_per_request_reference_plans_the_probes_own_length(per_request_checkpoint, monkeypatch, length):
    """A per-request method's table is the one of the request's planned length, prompt + the tokens it asks for: an
    engine that plans the probe at its length + 1 (vLLM's prompt + max_tokens) is exact when it says so (issue 59: the
    reference planned the prompt alone, 0.0151 nats from such an engine, and the verdict still read "exact"), and
    one that says it planned the prompt alone is not (at the default length and at the served length)."""
    d = verify.declared(per_request_checkpoint)
    declared = verify.hypotheses(d, 2 * ORIGINAL)[0][0]
    fake_engine(monkeypatch, declared, plans=1)
    report = verify.verify(per_request_checkpoint, "transformers", length=length)
    assert report.checks[-1].verdict == "exact" and report.distances["declared"] < 1e-5, report.text()
    assert "the engine planned the request at" in report.text()
    fake_engine(monkeypatch, declared, plans=1, says=report.length)
    report = verify.verify(per_request_checkpoint, "transformers", length=length)
    assert report.checks[-1].verdict == "unexplained" and report.distances["declared"] > 1e-3, report.text()


def test_log_probabilities_that_stop_being_finite_are_a_length_not_served(yarn_checkpoint, monkeypatch):
    d = verify.declared(yarn_checkpoint)
    fake_engine(monkeypatch, verify.hypotheses(d, 2 * ORIGINAL)[0][1], nan_from=ORIGINAL)
    report = verify.verify(yarn_checkpoint, "transformers")
    served, scaled = report.checks
    assert served.verdict == "short" and f"past length {ORIGINAL}" in served.detail, report.text()
    assert scaled.verdict == "ignored", report.text()  # judged on the finite positions


def test_transformers_applies_a_checkpoint_ropescale_wrote(yarn_checkpoint, capsys, monkeypatch):
    """README's form, a path relative to the working directory: the engine's process (which runs in a folder of its
    own) probes the user's checkpoint (it once took the name for a hub repository id: refused, exit 1)."""
    monkeypatch.chdir(yarn_checkpoint.parent)
    assert cli.main(["verify", f"./{yarn_checkpoint.name}", "--engine", "transformers", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in out["checks"]] == ["exact", "exact"], out
    others = [v for k, v in out["distances"].items() if k != "declared"]
    assert out["distances"]["declared"] < 1e-5 and min(others) > 1e-2, out["distances"]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_every_engines_process_gets_absolute_paths(engine, yarn_checkpoint, tmp_path, monkeypatch):
    """Relative TARGET and --declared-by (from the working directory): the job the engine's process reads names
    them absolutely (it runs in a folder of its own). No engine starts: the process is replaced by one that records
    its job and refuses."""
    monkeypatch.setattr(verify, "installed", lambda module: True)
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00")  # only its magic is read before the engine's process
    (tmp_path / "yarn").symlink_to(yarn_checkpoint)
    monkeypatch.chdir(tmp_path)
    jobs = []

    def run(argv, cwd, **kwargs):
        jobs.append(json.loads(Path(argv[-1]).read_text()))
        assert Path(cwd).resolve() != tmp_path.resolve()
        return subprocess.CompletedProcess(argv, 0, 'PROBE {"error": "no engine in this test"}\n', "")

    monkeypatch.setattr(verify.subprocess, "run", run)
    target, declared_by = ("yarn", None) if engine != "llama.cpp" else ("model.gguf", "./yarn")
    report = verify.verify(target, engine, declared_by=declared_by)
    assert report.checks[-1].verdict == "refused" and report.target == target, report.text()
    assert [job["target"] for job in jobs] == [str(tmp_path / target)]
    assert "yarn/config.json" in report.declared  # --declared-by read from the working directory


def test_transformers_ignores_the_rope_scaling_of_a_llama_gguf(tmp_path):
    pytest.importorskip("gguf")
    from ropescale import llamacpp, realmodel
    from support import gguf_llama

    try:
        tokenizer = realmodel.smollm2_gguf()
    except realmodel.RealModelUnavailable as err:
        pytest.skip(str(err))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=gguf_llama.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=ORIGINAL, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    src = gguf_llama.write(model, tmp_path / "tiny.gguf", tokenizer)
    dst = llamacpp.extend(src, tmp_path / "yarn.gguf", YARN).path
    report = verify.verify(dst, "transformers")
    assert report.checks[-1].verdict == "ignored", report.text()
    assert "ropescale.method" in report.declared


def test_bad_targets_and_engines_are_refused_before_any_engine_runs(tmp_path, yarn_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(verify, "_run_probe", lambda *a: pytest.fail("an engine ran"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00")
    rows = [
        (tmp_path / "missing", "transformers", "no such file or directory"),
        ("meta-llama/Llama-3.1-8B", "transformers", "never a hub repository id"),
        (tmp_path / "empty", "transformers", "needs a config.json"),
        (tmp_path / "notes.txt", "transformers", "not a GGUF file"),
        (yarn_checkpoint, "llama.cpp", "convert_hf_to_gguf.py"),
        (tmp_path / "trunc.gguf", "vllm", "vLLM serves the transformers directory"),
        (tmp_path / "trunc.gguf", "sglang", "SGLang serves the transformers directory"),
        (yarn_checkpoint, "sgl", "unknown engine 'sgl'"),
    ]
    if importlib.util.find_spec("gguf") is not None:
        rows.append((tmp_path / "trunc.gguf", "transformers", "not a GGUF file the gguf package can read"))
    for target, engine, message in rows:
        with pytest.raises(ValueError, match=re.escape(message)):
            verify.verify(target, engine)
    # the arguments are checked before the engine's package: the same answer with and without it installed
    with pytest.raises(ValueError, match="hf_overrides .* are vLLM's and SGLang's .*: transformers takes none"):
        verify.verify(yarn_checkpoint, "transformers", hf_overrides={"rope_theta": 1e5})
    with pytest.raises(ValueError, match="hf_overrides text_config: SGLang sets a config key to the value given"):
        verify.verify(yarn_checkpoint, "sglang", hf_overrides={"text_config": {"rope_theta": 1e5}})
    monkeypatch.setattr(verify, "installed", lambda module: module not in ("vllm", "sglang"))
    with pytest.raises(ValueError, match="needs the vllm package"):
        verify.verify(yarn_checkpoint, "vllm")
    with pytest.raises(ValueError, match=re.escape("needs the sglang package: pip install sglang (ropescale's plugin "
                                                   "loads with it; CPU: scripts/setup_sglang.sh)")):
        verify.verify(yarn_checkpoint, "sglang", hf_overrides={"rope_parameters": {"rope_type": "default"}})
    with pytest.raises(ValueError, match="at least 2 tokens"):
        verify.verify(yarn_checkpoint, "transformers", length=1)
    with pytest.raises(ValueError, match="declared_by .*missing: no such file"):
        verify.verify(yarn_checkpoint, "transformers", declared_by=tmp_path / "missing")
    # a probe longer than the served length (256): refused before any allocation (it was the allocator's error)
    for length in (4 * ORIGINAL + 1, 10**12):
        with pytest.raises(ValueError, match=f"--length {length}: the probe runs {length} tokens through the model"
                                             f".* served to {4 * ORIGINAL} tokens .*at most {4 * ORIGINAL} tokens"):
            verify.verify(yarn_checkpoint, "transformers", length=length)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["verify", str(yarn_checkpoint), "--engine", "transformers", "--length", str(10**12)])
    assert exit_.value.code == 2 and f"at most {4 * ORIGINAL} tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["verify", str(yarn_checkpoint), "--engine", "sgl"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_an_engine_that_refuses_crashes_or_hangs_is_reported_not_raised(yarn_checkpoint, monkeypatch):
    monkeypatch.setattr(verify, "_run_probe",
                        lambda *a: {"error": "ValueError: Unknown RoPE scaling type resonance_yarn"})
    report = verify.verify(yarn_checkpoint, "transformers")
    assert report.checks[-1].verdict == "refused" and "resonance_yarn" in report.checks[-1].detail
    assert report.exit_code == 1
    monkeypatch.undo()
    # the real probe, its process killed by the timeout: no verdict on the engine
    report = verify.verify(yarn_checkpoint, "transformers", timeout=0.01)
    assert report.checks[-1].verdict == "inconclusive" and "no answer in 0.01 s" in report.checks[-1].detail


def test_plain_rope_declared_still_has_a_formula_to_tell_it_from(tmp_path, monkeypatch):
    """With nothing scaled, "ignored" is the declaration itself: a scaled table is the yardstick, so an engine that
    scales anyway is named, and one that does not passes."""
    path = saved_llama(tmp_path / "plain", rope_type="default")
    d = verify.declared(path)
    hs, _ = verify.hypotheses(d, 2 * ORIGINAL)
    assert [h.kind for h in hs] == ["declared", "parameter"]
    for runs, want in ((hs[0], "exact"), (hs[1], "different")):
        fake_engine(monkeypatch, runs)
        assert verify.verify(path, "transformers").checks[-1].verdict == want
        monkeypatch.undo()


def test_plain_transformers_refuses_ropescales_own_types_by_name(tmp_path):
    path = saved_llama(tmp_path / "ryarn", scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, resonance=True))
    check = verify.verify(path, "transformers").checks[-1]
    assert check.verdict == "refused" and "'resonance_yarn'" in check.detail and "import ropescale.hf" in check.detail


def test_a_probe_that_cannot_tell_the_formulas_apart_gives_no_verdict(yarn_checkpoint, monkeypatch):
    """With every other formula merged into the declared one (here: all of them, by a tolerance no difference
    passes), an engine is never called exact: there is nothing to tell it from."""
    d = verify.declared(yarn_checkpoint)
    fake_engine(monkeypatch, verify.hypotheses(d, 2 * ORIGINAL)[0][1])  # an engine running plain RoPE
    monkeypatch.setattr(verify, "SAME", math.inf)
    check = verify.verify(yarn_checkpoint, "transformers").checks[-1]
    assert check.verdict == "inconclusive" and "--length" in check.detail


def test_a_raw_key_attention_ignored_is_named(tmp_path, monkeypatch):
    """A ReRoPE checkpoint: the declared hypothesis attends with ReRoPE, "plain RoPE" with the model's SDPA (an
    engine that ignores the attention); each fake engine is named (the plain one was once merged into the declared:
    the reference patched with attention=None kept the checkpoint's ReRoPE)."""
    from support.vllm_testing import served_llama
    from ropescale import hf

    model = served_llama()
    hf.patch(model, scaling.Default(), attention="rerope", window=16)
    model.config.model_max_length = 4 * ORIGINAL  # served past the probe's length
    model.save_pretrained(tmp_path / "rerope")
    path = tmp_path / "rerope"
    d = verify.declared(path)
    assert d.attention == "rerope" and d.parameters["window"] == 16
    hs, same = verify.hypotheses(d, 3 * ORIGINAL)
    assert [h.kind for h in hs] == ["declared", "ignored"] and not same
    for runs, want in ((hs[0], "exact"), (hs[1], "ignored")):
        fake_engine(monkeypatch, runs)
        assert verify.verify(path, "transformers", length=3 * ORIGINAL).checks[-1].verdict == want
        monkeypatch.undo()


# DeepSeek-V3 (MLA): the model sets its softmax scale from rope_parameters' mscale_all_dim when it is built, so
# ropescale's reference of each formula is the model built from a config holding it (``hf.patch`` takes only the
# config's own method there). Its checkpoints as shipped: YaRN with the mscale pair.
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                 "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory):
    from ropescale import tiny_models as families

    path = tmp_path_factory.mktemp("verify-deepseek") / "deepseek"
    families.build("DeepSeek-V3", DEEPSEEK_YARN).save_pretrained(path)
    return path


def test_transformers_applies_a_deepseek_v3_checkpoint(deepseek_checkpoint, capsys):
    """verify gives a verdict on DeepSeek-V3 (it once stopped with exit 2: "takes only the method its config
    holds ... ropescale extend"), with its rope keys: the mscale pair, the rope head (qk_rope_head_dim)."""
    d = verify.declared(deepseek_checkpoint)
    assert d.rotary_dim == 8 and d.method.mscale == 0.707 and d.method.mscale_all_dim == 1.0
    assert cli.main(["verify", str(deepseek_checkpoint), "--engine", "transformers", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in out["checks"]] == ["exact", "exact"], out
    assert {"mscale_all_dim=None", "mscale=None", "attention factor=1.0"} <= set(out["distances"]), out["distances"]
    assert out["distances"]["declared"] < 1e-5 < 1e-3 < min(v for k, v in out["distances"].items() if k != "declared")


def test_a_deepseek_formula_is_transformers_own_model_of_it(deepseek_checkpoint):
    """The reference of a wrong formula (mscale_all_dim not read) is transformers' own DeepSeek-V3 built with that
    config: its MLA softmax scale too, not only its cos/sin."""
    from ropescale import _verify_probe
    from ropescale import tiny_models as families

    d = verify.declared(deepseek_checkpoint)
    hs, _ = verify.hypotheses(d, 32)
    h = next(h for h in hs if h.key == "mscale_all_dim")
    model = verify.reference_model(deepseek_checkpoint)
    tokens = verify.probe_tokens(d.vocab_size, 32)
    own = families.build("DeepSeek-V3", {k: v for k, v in DEEPSEEK_YARN.items() if k != "mscale_all_dim"})
    own.load_state_dict(model.state_dict())
    want = torch.tensor(_verify_probe.transformers_logprobs(own, tokens), dtype=torch.float64)
    got = verify.reference_logprobs(model, h, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - verify.reference_logprobs(model, hs[0], tokens)).abs().max() > 1e-3  # the formula matters


@pytest.mark.parametrize("planted", ["ignored", "mscale_all_dim", "attention factor"])
def test_the_verdict_names_the_formula_a_deepseek_engine_runs(deepseek_checkpoint, monkeypatch, planted):
    d = verify.declared(deepseek_checkpoint)
    runs = next(h for h in verify.hypotheses(d, 32)[0] if h.kind == planted or h.key == planted)
    fake_engine(monkeypatch, runs)
    check = verify.verify(deepseek_checkpoint, "transformers").checks[-1]
    assert check.verdict == ("ignored" if planted == "ignored" else "different"), check.detail
    assert planted in check.detail or planted == "ignored", check.detail


# Issue 60: a rope scaling written where the engine does not look. verify reads the raw config.json (a GGUF's raw
# keys) beside the engine's parsed config and names each rope-like key the engine did not take: "rope keys" ignored.
PLANTED_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
PLANTED = {  # name: (edit of a plain tiny Llama's config.json, the key the report names)
    "misspelled": (lambda c: c.update(rope_scalings=dict(PLANTED_YARN)), "rope_scalings"),
    # transformers 5 lets rope_scaling win: the plain rope_parameters beside it is the key not taken
    "beside": (lambda c: c.update(rope_scaling=dict(PLANTED_YARN)), "rope_parameters"),
    "text_config": (lambda c: c.update(text_config={"rope_scaling": dict(PLANTED_YARN)}), "text_config.rope_scaling"),
    # transformers 5 reads rope_theta inside rope_parameters only: a top-level one beside it is dropped
    "no_longer_read": (lambda c: c.update(rope_theta=500000.0), "rope_theta"),
}


def planted_llama(folder, *edits):
    path = saved_llama(folder, rope_type="default")
    config = json.loads((path / "config.json").read_text())
    for edit in edits:
        edit(config)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def parsed_view(path):
    from ropescale import _verify_probe

    return _verify_probe.config_view(transformers.AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_rope_key_transformers_does_not_take_is_named(tmp_path, case):
    from ropescale import _verify_keys

    edit, key = PLANTED[case]
    path = planted_llama(tmp_path / case, edit)
    unread = _verify_keys.unread(path, "transformers", parsed_view(path))
    assert [u.key for u in unread] == [key] and unread[0].where == "config.json", [u.text() for u in unread]


def test_a_rope_scaling_outside_a_multimodal_models_text_config_is_named(tmp_path):
    """Gemma 3 (vision-language): its language model's rope is text_config's; a rope_scaling on the outer config is
    read by no one."""
    from ropescale import _verify_keys

    path = tmp_path / "gemma3"
    path.mkdir()
    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "rope_theta": 1000000.0,
                                                      "rope_local_base_freq": 10000.0},
              "vision_config": {"model_type": "siglip_vision_model"}}
    (path / "config.json").write_text(json.dumps(config))
    assert _verify_keys.unread(path, "transformers", parsed_view(path)) == []  # as shipped: every key taken
    config["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    (path / "config.json").write_text(json.dumps(config))
    assert [u.key for u in _verify_keys.unread(path, "transformers", parsed_view(path))] == ["rope_scaling"]
    config["text_config"]["rope_scaling"] = config.pop("rope_scaling")  # where Gemma 3's own checkpoints put it
    (path / "config.json").write_text(json.dumps(config))
    assert _verify_keys.unread(path, "transformers", parsed_view(path)) == []


def test_overrides_the_engine_does_not_take_are_named():
    """vLLM's hf_overrides, held against what the engine parsed (here a Llama config with the overrides applied as
    vLLM applies a dict one: set on the config)."""
    from ropescale import _verify_keys

    config = transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.rope_scalings = dict(PLANTED_YARN)  # stored, read by no one
    from ropescale import _verify_probe

    view = _verify_probe.config_view(config)
    unread = _verify_keys.unread_config({"rope_scalings": dict(PLANTED_YARN), "rope_parameters": dict(
        rope_type="default", rope_theta=10000.0)}, view, "hf_overrides")
    assert [(u.key, u.where) for u in unread] == [("rope_scalings", "hf_overrides")], [u.text() for u in unread]


def test_an_engines_own_name_of_the_rope_type_is_taken():
    """vLLM's DeepSeek-V3 model writes its YaRN rotary's name into its parsed config (rope_type deepseek_yarn): the
    config's yarn is taken (it was named as not taken on vLLM); another type in the engine is still named."""
    from ropescale import _verify_keys, _verify_probe

    raw = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
    for engine_type, named in (("deepseek_yarn", []), ("deepseek_llama_scaling", []), ("linear", ["rope_parameters"])):
        config = transformers.LlamaConfig(rope_parameters=dict(raw))
        config.rope_parameters = {**raw, "rope_type": engine_type}  # as vLLM's model rewrites it
        unread = _verify_keys.unread_config({"rope_parameters": dict(raw)}, _verify_probe.config_view(config))
        assert [u.key for u in unread] == named, (engine_type, [u.text() for u in unread])


def test_deepseek_v4s_legacy_rope_head_dim_is_taken_where_it_is_the_rope_dim_the_engine_runs():
    """DeepSeek-V4's config class takes ``qk_rope_head_dim`` as a legacy alias only (its partial_rotary_factor is
    derived from it, and it writes it back): every V4 checkpoint transformers saves has it, and verify named it not
    taken. Taken where it is head_dim x the partial_rotary_factor the engine runs; another value is still named."""
    from ropescale import _verify_keys, _verify_probe, tiny_models as families

    model = families.build("DeepSeek-V4")
    raw = json.loads(model.config.to_json_string())
    view = _verify_probe.config_view(model.config)
    assert raw["qk_rope_head_dim"] == 16 and _verify_keys.unread_config(raw, view) == []
    unread = _verify_keys.unread_config({**raw, "qk_rope_head_dim": 8}, view)
    assert [u.key for u in unread] == ["qk_rope_head_dim"], [u.text() for u in unread]


def test_a_rope_scaling_transformers_does_not_read_never_exits_0(tmp_path, capsys):
    """The issue's case: YaRN x4 under a misspelled key, no ropescale record. Declared and engine both read plain RoPE
    (the same config class): the probe alone called it exact, exit 0. With a dropped top-level rope_theta: both named."""
    cases = ["misspelled", "no_longer_read"]  # (beside: the yarn rope_scaling taken would hold rope_scalings' value)
    path = planted_llama(tmp_path / "planted", *(PLANTED[c][0] for c in cases))
    assert cli.main(["verify", str(path), "--engine", "transformers", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["verdict"]) for c in out["checks"]] == [
        ("served length", "exact"), ("scaling", "exact"), ("rope keys", "ignored")], json.dumps(out, indent=1)
    for case in cases:
        assert f"{PLANTED[case][1]} (config.json)" in out["checks"][-1]["detail"], out["checks"][-1]["detail"]
    # a text_config on a Llama: transformers refuses the model (its config is a dict there); the key is named too
    report = verify.verify(planted_llama(tmp_path / "text", PLANTED["text_config"][0]), "transformers")
    assert [c.verdict for c in report.checks] == ["refused", "ignored"], report.text()
    assert "text_config.rope_scaling (config.json)" in report.checks[-1].detail and report.exit_code == 1


def test_a_clean_checkpoint_has_no_unread_rope_key(yarn_checkpoint):
    from ropescale import _verify_keys

    assert _verify_keys.unread(yarn_checkpoint, "transformers", parsed_view(yarn_checkpoint)) == []


def tiny_gguf(path, **keys):
    """A GGUF of a llama's keys only (no tensors): what the raw-key scan reads."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(4 * ORIGINAL)
    writer.add_embedding_length(64)
    writer.add_head_count(1)
    writer.add_rope_dimension_count(64)
    writer.add_rope_freq_base(10000.0)
    for key, value in keys.items():
        kind = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.UINT32,
                bool: gguf.GGUFValueType.BOOL}[type(value)]
        writer.add_key_value(key, value, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_rope_keys_an_engine_does_not_read_are_named(tmp_path):
    """llama.cpp reads {arch}.rope.* under LLM_KV's names (LLAMA_CPP_KEYS); transformers' GGUF loader the keys of its
    GGUF_CONFIG_MAPPING (no rope scaling for llama). A misspelled key, one under another architecture: named."""
    from ropescale import _verify_keys

    clean = tiny_gguf(tmp_path / "clean.gguf", **{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                                 "llama.rope.scaling.original_context_length": ORIGINAL})
    assert _verify_keys.unread_gguf(clean, "llama.cpp") == []
    # transformers reads no rope scaling from a llama GGUF: each scaling key is named, rope.freq_base is read
    assert {u.key for u in _verify_keys.unread_gguf(clean, "transformers")} == {
        "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.scaling.original_context_length"}
    planted = tiny_gguf(tmp_path / "planted.gguf", **{"llama.rope.scaling.type": "yarn",
                                                     "llama.rope.scaling.factors": 4.0,
                                                     "qwen2.rope.scaling.factor": 4.0,
                                                     "llama.rope.scaling.attn_factor": 1.0})  # neutral: not named
    unread = {u.key: u for u in _verify_keys.unread_gguf(planted, "llama.cpp")}
    assert set(unread) == {"llama.rope.scaling.factors", "qwen2.rope.scaling.factor"}, [u.text() for u in unread.values()]
    assert "did you mean llama.rope.scaling.factor" in unread["llama.rope.scaling.factors"].why
    assert "architecture 'llama'" in unread["qwen2.rope.scaling.factor"].why
# Issue 59, planted engines: transformers itself (the engine's own process, plain transformers) with its YaRN made
# to drop one key of rope_parameters (a sitecustomize on the process's path wraps ROPE_INIT_FUNCTIONS["yarn"]): the
# verdict names that key. A key without a default in transformers (original_max_position_embeddings) takes the one
# an engine falls back to, max_position_embeddings.
PLANT = planted.TRANSFORMERS_DROPS_ONE_KEY
EVERY_KEY = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, beta_fast=4.0, beta_slow=2.0, truncate=False,
                         mscale=0.707, mscale_all_dim=1.0)
FACTOR_KEY = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, attention_factor_override=1.3)


@pytest.fixture(scope="module")
def planted_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify-planted")
    return folder, {"every": saved_llama(folder / "every", EVERY_KEY), "factor": saved_llama(folder / "factor",
                                                                                            FACTOR_KEY)}


@pytest.mark.parametrize("key", [None, "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim",
                                 "original_max_position_embeddings", "attention_factor"])
def test_a_planted_transformers_that_drops_one_key_is_named(planted_checkpoints, monkeypatch, key):
    folder, paths = planted_checkpoints
    path = paths["factor" if key == "attention_factor" else "every"]
    report, checks = verify_planted(path, "transformers", folder / "site", PLANT, key, monkeypatch)
    check = checks["scaling"]
    if key is None:
        assert check.verdict == "exact" and check.distance <= check.bound, report.text()
        assert "rope keys" not in checks, report.text()
        return
    assert check.verdict == "different" and report.exit_code == 1, report.text()
    assert check.distance >= 1e-4, report.text()  # the key matters on this model
    assert f"{key} " in check.detail, check.detail
    # This plant also drops the key from the config the engine parsed, so the raw-key scan (issue 60) sees it too.
    if "rope keys" in checks:
        assert checks["rope keys"].verdict == "ignored" and key in checks["rope keys"].detail, report.text()


def test_a_per_step_reference_runs_the_engines_own_forward(tmp_path, monkeypatch):
    """vLLM's probe is a forward of all but the last token (its prompt fits max_model_len): a per-step dynamic
    table is the one of that length, and so is the reference's (it was 0.0091 nats off: the table of the whole
    probe)."""
    path = saved_llama(tmp_path / "dynamic", rope_type="dynamic", factor=4.0)
    d = verify.declared(path)
    fake_engine(monkeypatch, verify.hypotheses(d, 2 * ORIGINAL)[0][0], short=True, plans=1)
    report = verify.verify(path, "transformers", length=2 * ORIGINAL)
    assert report.checks[-1].verdict == "exact" and report.distances["declared"] < 1e-5, report.text()


@pytest.mark.parametrize("engine_runs", ["declared", "partial_rotary_factor"])
def test_a_partial_rotary_factor_the_engine_ignores_is_named(tmp_path, monkeypatch, engine_runs):
    """Issue 59: a config's partial_rotary_factor (GLM-4's 0.5, a layout key beside the method's) is a hypothesis
    too: the engine's rotary over the whole head dim, the reference a model built from a config with the key at 1.0
    on the same weights. transformers itself is exact; an engine that reads the table but not the key is named."""
    from ropescale import tiny_models as families

    path = tmp_path / "glm"
    families.build("GLM-4", {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": families.ORIGINAL}).save_pretrained(path)
    d = verify.declared(path)
    assert d.partial_rotary_factor == 0.5 and d.rotary_dim == 8
    if engine_runs != "declared":
        hs, _ = verify.hypotheses(d, 2 * families.ORIGINAL)
        fake_engine(monkeypatch, next(h for h in hs if h.key == engine_runs))
    report = verify.verify(path, "transformers")
    print(report.text())
    check = report.checks[-1]
    if engine_runs == "declared":
        assert check.verdict == "exact" and check.distance <= check.bound, report.text()
        return
    assert check.verdict == "different" and check.distance >= 1e-4, report.text()
    assert "partial_rotary_factor 1.0 in the engine, 0.5 declared" in check.detail, check.detail


def test_proportionals_own_keys_are_hypotheses_and_its_partial_factor_no_layout_one():
    """proportional's factor and partial_rotary_factor are the method's own keys: each ignored is a hypothesis (its
    table over the whole head dim already: no layout hypothesis beside them)."""
    d = verify.Declared(scaling.Proportional(factor=2.0, partial_rotary_factor=0.5), 10000.0, 64, 64, 128, "test",
                        vocab_size=256, config_length=128)
    hs, same = verify.hypotheses(d, 128)
    assert [(h.key, h.declared_value, h.engine_value, h.layout) for h in hs[2:]] == [
        ("factor", 2.0, 1.0, ()), ("partial_rotary_factor", 0.5, 1.0, ())] and not same


def test_a_proportional_checkpoint_gets_a_verdict_and_the_formulas_it_cannot_run_are_noted(tmp_path):
    """A proportional table (Gemma 4's) over half the head on a Llama: the plain-RoPE hypothesis is a table half the
    head wide, which the model cannot run (verify crashed with the attention's shape error); such a formula is no
    engine's reading either, so it is noted and left out, and the verdict stands on the rest (factor ignored: 0.84
    nats away, checked)."""
    path = saved_llama(tmp_path / "proportional", scaling.Proportional(factor=2.0, partial_rotary_factor=0.5))
    report = verify.verify(path, "transformers")
    print(report.text())
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()
    assert any(n.startswith("not checked, this model cannot run them: plain RoPE") for n in report.notes), report.text()
    assert report.distances["factor=1.0"] > 1e-2, report.text()


def test_a_vision_language_checkpoint_is_verified_on_its_text_models_rope(tmp_path, capsys):
    """Qwen2.5-VL (vLLM serves the vision-language model, not a text-only class): verify read the top-level config
    (AttributeError: no hidden_size, a traceback) and loaded it as a causal LM (refused). Its text model's YaRN on
    mRoPE sections is read and probed: exact on transformers."""
    from ropescale import tiny_models as families

    path = tmp_path / "qwen25vl"
    families.build_served("Qwen2.5-VL (text)", {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": families.ORIGINAL}
                           ).save_pretrained(path)
    assert cli.main(["verify", str(path), "--engine", "transformers", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["verdict"]) for c in out["checks"]] == [("served length", "exact"), ("scaling", "exact")], \
        json.dumps(out, indent=1)
    assert "trained to 16, served to 64" in out["declared"]


def test_ropescales_record_in_a_text_config_is_not_a_rope_key_the_engine_left():
    """A vision-language checkpoint ropescale wrote keeps its record in ``text_config.ropescale``: the declaration,
    checked by the probe, not a key any engine reads (it was named "not taken" on vLLM, which refused the model)."""
    from ropescale import _verify_keys, _verify_probe, hf, scaling, tiny_models as families

    model = families.build_served("Qwen2.5-VL (text)")
    hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=families.ORIGINAL))
    raw = json.loads(model.config.to_json_string())
    assert "ropescale" in raw["text_config"]
    assert _verify_keys.unread_config(raw, _verify_probe.config_view(model.config)) == []
