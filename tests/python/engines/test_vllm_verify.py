"""``ropescale verify --engine vllm`` against vLLM itself (issue 45, part 3), on the vLLM leg: a checkpoint ropescale
wrote is applied exactly, with the plugin and by stock vLLM (ROPESCALE_VLLM=0); the mismatches vLLM 0.32 really has
are named: a LongRoPE ``attention_factor`` it does not read (its own rule instead: a wrong mscale), and the stock
``dynamic`` type, which it serves as plain RoPE up to ``max_position_embeddings`` and as NaN past it while deriving
a max_model_len ``factor`` times longer (the plugin serves that one exactly)."""

import pytest

from support.planted import verify_planted
from support.vllm_testing import HEAD, ORIGINAL, require_vllm, saved_llama

require_vllm()

from ropescale import scaling, verify  # noqa: E402

SHORT = [1.0 + 0.02 * i for i in range(HEAD // 2)]
LONG = [1.0 + 0.25 * i for i in range(HEAD // 2)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-verify")


@pytest.mark.parametrize("plugin", ["1", "0"])
def test_vllm_applies_a_yarn_checkpoint_ropescale_wrote(folder, monkeypatch, plugin):
    path = folder / "yarn"
    if not path.exists():
        saved_llama(path, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    monkeypatch.setenv("ROPESCALE_VLLM", plugin)
    report = verify.verify(path, "vllm")
    print(report.text())
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()
    assert ("plugin loaded" if plugin == "1" else "plugin not loaded") in " ".join(report.notes)
    assert report.distances["declared"] < 1e-5 < 1e-2 < min(v for k, v in report.distances.items() if k != "declared")


def test_vllm_does_not_read_a_longrope_attention_factor(folder):
    path = saved_llama(folder / "longrope", rope_type="longrope", short_factor=SHORT, long_factor=LONG, factor=4.0,
                       original_max_position_embeddings=ORIGINAL, attention_factor=1.0,
                       max_position_embeddings=4 * ORIGINAL)
    report = verify.verify(path, "vllm")
    print(report.text())
    served, scaled = report.checks
    assert served.verdict == "exact" and scaled.verdict == "different", report.text()
    assert "attention_factor not read by the engine" in scaled.detail and "1.0 declared" in scaled.detail


@pytest.mark.parametrize("plugin", ["0", "1"])
def test_a_stock_dynamic_config_is_plain_rope_then_nan_in_vllm_and_exact_with_the_plugin(folder, monkeypatch, plugin):
    """vLLM 0.32's DynamicNTKScalingRotaryEmbedding takes max_position_embeddings as both the trained and the
    served length: its base stays the model's and its table ends there (NaN past it). The plugin serves the type
    as transformers does (``RopeScaling.vllm_stock_wrong``), per step over raw keys."""
    path = folder / "dynamic"
    if not path.exists():
        saved_llama(path, rope_type="dynamic", factor=4.0)
    monkeypatch.setenv("ROPESCALE_VLLM", plugin)
    report = verify.verify(path, "vllm")
    print(report.text())
    served, scaled = report.checks
    if plugin == "0":
        assert served.verdict == "short" and f"past length {ORIGINAL}" in served.detail, report.text()
        assert scaled.verdict == "ignored", report.text()
    else:
        assert served.verdict == scaled.verdict == "exact", report.text()


@pytest.mark.parametrize("plugin", ["1", "0"])
def test_vllm_serves_a_rerope_checkpoint_with_the_plugin_and_refuses_it_without(folder, monkeypatch, plugin):
    from ropescale import hf
    from support.vllm_testing import served_llama

    path = folder / "rerope"
    if not path.exists():
        model = served_llama()
        hf.patch(model, scaling.Default(), attention="rerope", window=16)
        model.config.model_max_length = 4 * ORIGINAL
        model.save_pretrained(path)
    monkeypatch.setenv("ROPESCALE_VLLM", plugin)
    report = verify.verify(path, "vllm", length=3 * ORIGINAL)
    print(report.text())
    if plugin == "1":
        assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()
    else:
        assert report.checks[-1].verdict == "refused" and "rerope" in report.checks[-1].detail, report.text()


def test_vllm_gives_a_deepseek_v3_checkpoint_a_verdict(folder):
    """DeepSeek-V3 (MLA, YaRN with the mscale pair): verify runs it (it once stopped before the engine, exit 2: the
    reference could not patch the family) and vLLM answers every position (on a CPU with AMX through CPU_MLA: the
    AMX_MLA backend vLLM picks refuses float32). No "exact" is asked: vLLM 0.32's CPU DeepSeek-V3 is 0.13 nats from
    transformers' on the unpatched model (test_vllm_architectures.NOT_COMPARABLE), beyond the formulas' separation."""
    from ropescale import tiny_models as families

    path = folder / "deepseek"
    families.build_served("DeepSeek-V3", {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": families.ORIGINAL}).save_pretrained(path)
    report = verify.verify(path, "vllm")
    print(report.text())
    served, scaled = report.checks
    assert served.verdict == "exact", report.text()
    assert scaled.verdict not in ("refused", "short") and "no answer" not in scaled.detail, report.text()
    assert len(report.distances) > 2 and all(v < 1.0 for v in report.distances.values()), report.text()


@pytest.mark.parametrize("plugin", ["1", "0"])
def test_a_llama4_checkpoint_ropescale_wrote_gets_its_nope_temperature_with_the_plugin(folder, monkeypatch, plugin):
    """Llama 4 with attn_temperature_tuning on (transformers runs it on its NoPE layers) served at max_model_len 64:
    vLLM 0.32 reads the switch from the generation config only, which its loader drops, and turns it on only past
    32768, so the conformance matrix found the plugin column silently 0.027 nats off. With the plugin, a checkpoint
    ropescale wrote gets the config's switch: exact; stock vLLM is still off, and verify says so."""
    from ropescale import hf, tiny_models as families

    path = folder / "llama4"
    if not path.exists():
        model = families.build_served("Llama 4 (text)")
        hf.patch(model, scaling.Llama3(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position=families.ORIGINAL))
        model.save_pretrained(path)
    monkeypatch.setenv("ROPESCALE_VLLM", plugin)
    report = verify.verify(path, "vllm")
    print(report.text())
    scaled = report.checks[1]
    if plugin == "1":
        assert scaled.verdict == "exact", report.text()
    else:
        assert scaled.verdict != "exact" and report.distances["declared"] > 1e-3, report.text()


def test_vllm_names_a_rope_key_and_an_override_it_does_not_take(folder):
    """Issue 60 on vLLM: a YaRN x4 under a misspelled key in config.json and a top-level rope_theta beside
    rope_parameters (vLLM reads the config through transformers 5: neither taken), and an hf_overrides key vLLM
    stores on the config but never reads. Each named, exit 1 (the probe alone: plain RoPE declared, plain RoPE run,
    exact). One engine start."""
    import json

    path = saved_llama(folder / "planted", rope_type="default", max_position_embeddings=4 * ORIGINAL)
    config = json.loads((path / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
    config.update(rope_scalings=yarn, rope_theta=500000.0)
    (path / "config.json").write_text(json.dumps(config))
    # (length below the served 256: vLLM refuses a prompt of max_model_len tokens plus the one it generates)
    report = verify.verify(path, "vllm", hf_overrides={"rope_scalinq": yarn}, length=2 * ORIGINAL)
    print(report.text())
    assert [(c.name, c.verdict) for c in report.checks] == [
        ("served length", "exact"), ("scaling", "exact"), ("rope keys", "ignored")], report.text()
    for named in ("rope_scalings (config.json)", "rope_theta (config.json)", "rope_scalinq (hf_overrides)"):
        assert named in report.checks[-1].detail, report.text()
    assert report.exit_code == 1
@pytest.mark.parametrize("length", [None, 4 * ORIGINAL])
def test_vllm_probes_fit_the_served_length_and_a_per_request_table_is_the_probes_own(folder, length):
    """Issue 59: a per-request Dynamic-YaRN checkpoint served by the plugin is exact at the default probe length and
    at the served length. The probe once asked vLLM for a token past a prompt as long as max_model_len (refused at the
    served length), and the reference planned the prompt alone while vLLM planned prompt + 1 (0.0151 nats, read as
    "exact")."""
    from ropescale import hf
    from support.vllm_testing import served_llama

    path = folder / "per-request"
    if not path.exists():
        model = served_llama()
        hf.patch(model, scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request"))
        model.config.model_max_length = 4 * ORIGINAL
        model.save_pretrained(path)
    report = verify.verify(path, "vllm", length=length)
    print(report.text())
    assert report.length == (length or 2 * ORIGINAL)
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()
    assert report.checks[-1].distance <= report.checks[-1].bound <= 1e-5, report.text()


def test_stock_vllm_is_exact_on_a_yarn_checkpoint_at_its_served_length(folder, monkeypatch):
    path = folder / "yarn"
    if not path.exists():
        saved_llama(path, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    monkeypatch.setenv("ROPESCALE_VLLM", "0")
    report = verify.verify(path, "vllm", length=4 * ORIGINAL)
    print(report.text())
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


# Issue 59, planted engines: stock vLLM (ROPESCALE_VLLM=0) with its YaRN rotary made to drop one key it reads. The
# sitecustomize on the probe's PYTHONPATH (a Python process runs it at start: the probe's, and any process vLLM would
# spawn) wraps YaRNScalingRotaryEmbedding.__init__ once vLLM's module defines it (a sys.meta_path finder: vLLM is not
# imported early) and records each rotary it built in ROPESCALE_TEST_PLANTED, so the test sees it ran where the model
# was built. original_max_position_embeddings takes the value an engine falls back to, max_position_embeddings.
PLANT = '''
import importlib.abc
import json
import os
import sys

KEY, LOG = os.environ["ROPESCALE_TEST_DROP"], os.environ["ROPESCALE_TEST_PLANTED"]
MODULE = "vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope"


def plant(cls):
    init = cls.__init__

    def dropped(self, head_size, rotary_dim, max_position, base, neox, factor, dtype, **keys):
        if KEY == "original_max_position_embeddings":
            from vllm.config import get_current_vllm_config

            max_position = get_current_vllm_config().model_config.hf_config.max_position_embeddings
        else:
            keys.pop(KEY, None)
        with open(LOG, "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "dropped": KEY, "original": max_position, "keys": sorted(keys)})
                      + "\\n")
        init(self, head_size, rotary_dim, max_position, base, neox, factor, dtype, **keys)

    cls.__init__ = dropped


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            plant(module.YaRNScalingRotaryEmbedding)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Finder())
'''
PLANTED_YARN = scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, beta_fast=4.0, beta_slow=2.0, truncate=False,
                            mscale=0.707, mscale_all_dim=1.0)


@pytest.mark.parametrize("key", [None, "beta_fast", "truncate", "mscale", "original_max_position_embeddings"])
def test_a_planted_stock_vllm_that_drops_one_yarn_key_is_named(folder, monkeypatch, key):
    """Each key vLLM 0.32's YaRN reads, dropped by its rotary: ``different`` naming it (distance >= 1e-4 nats); the
    unplanted stock vLLM: ``exact``. One checkpoint (every key away from its default: beta_fast 4, beta_slow 2,
    truncate False, the mscale pair 0.707 / 1.0), one engine start per key. Not run here, to keep the leg short:
    beta_slow (the same ramp as beta_fast), mscale_all_dim (the same mscale rule as mscale) and attention_factor
    (vLLM's first mscale rule: tools/test_verify.py plants it in transformers)."""
    import json

    path = folder / "planted-yarn"
    if not path.exists():
        saved_llama(path, PLANTED_YARN)
    monkeypatch.setenv("ROPESCALE_VLLM", "0")
    log = folder / f"planted-{key}.log"
    report, checks = verify_planted(path, "vllm", folder / "site", PLANT, key, monkeypatch,
                                    ROPESCALE_TEST_PLANTED=str(log))
    check = checks["scaling"]
    assert "plugin not loaded" in " ".join(report.notes), report.text()
    if key is None:
        assert check.verdict == "exact" and check.distance <= check.bound <= 1e-5, report.text()
        return
    built = [json.loads(line) for line in log.read_text().splitlines()]  # the plant ran where the rotary was built
    assert built and all(b["dropped"] == key and key not in b["keys"] for b in built), built
    assert check.verdict == "different" and report.exit_code == 1, report.text()
    assert check.distance >= 1e-4, report.text()  # the key matters on this model
    assert f"{key} " in check.detail, check.detail
    assert "rope keys" not in checks, report.text()  # the parsed config holds the key: only the rotary dropped it
