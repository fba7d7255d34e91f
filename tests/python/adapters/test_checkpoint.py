"""A patched model's checkpoint is the model it trained: every method x (Llama, Mistral, Qwen2, Qwen3)
is patched, trained a few steps, saved (plain and sharded safetensors) and reloaded, and the reload's
logits equal the trained model's: with plain transformers in a process that never imports ropescale
(transformers' own rope types), after ``import ropescale.hf`` (ropescale's types), after
``hf.patch(model)`` (ReRoPE). A ropescale type without ropescale fails to load, never loads as RoPE.
``unpatch`` restores the config byte for byte; ``ropescale extend`` writes such a checkpoint."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from ropescale import cli, hf, scaling  # noqa: E402
from support.tiny_lm import FAMILIES, VOCAB, ids, tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NATIVE = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ORIGINAL = 16  # the tiny models' "pre-training" length; inputs are longer
LENGTH = 48
LONG = [1.0 + 0.5 * i for i in range(8)]
SHORT = [1.0 + 0.05 * i for i in range(8)]

# name: (method or None, patch keyword arguments, rope_type written, max_position_embeddings written)
CASES = {
    "linear": (scaling.Linear(factor=4.0), {}, "linear", 64),
    # Dynamic NTK as ropescale's dynamic_ntk: stock vLLM serves transformers' dynamic as plain RoPE.
    "dynamic": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL), {}, "dynamic_ntk", ORIGINAL),
    "yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), {}, "yarn", 64),
    "yarn_betas_mscale": (scaling.YaRN(factor=8.0, original_max_position=ORIGINAL, beta_fast=16.0, beta_slow=2.0,
                                       truncate=False, mscale=0.707, mscale_all_dim=1.0), {}, "yarn", 128),
    "llama3": (scaling.Llama3(factor=8.0, original_max_position=ORIGINAL), {}, "llama3", 128),
    "longrope": (scaling.LongRoPE(short_factor=tuple(SHORT), long_factor=tuple(LONG), original_max_position=ORIGINAL,
                                  factor=4.0), {}, "longrope", 64),
    # NTK-aware as default RoPE with the scaled base (the same table in every engine), the method in the entry.
    "ntk": (scaling.NTK(factor=4.0), {}, "default", 256),
    "dynamic_yarn": (scaling.DynamicYaRN(original_max_position=ORIGINAL), {}, "dynamic_yarn", ORIGINAL),
    "resonance": (scaling.Default(resonance=True), {}, "resonance", 64),
    "resonance_linear": (scaling.Linear(factor=4.0, resonance=True), {}, "resonance_linear", 64),
    "resonance_ntk": (scaling.NTK(factor=4.0, resonance=True), {}, "resonance_ntk", 64),
    "resonance_dynamic": (scaling.DynamicNTK(factor=2.0, original_max_position=ORIGINAL, resonance=True), {},
                          "resonance_dynamic", ORIGINAL),
    # vLLM multiplies max_position_embeddings by factor for every type but yarn, llama3 and longrope.
    "resonance_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, resonance=True), {},
                       "resonance_yarn", ORIGINAL),
    "resonance_dynamic_yarn": (scaling.DynamicYaRN(factor=2.0, original_max_position=ORIGINAL, resonance=True), {},
                               "resonance_dynamic_yarn", ORIGINAL),
    "resonance_llama3": (scaling.Llama3(factor=8.0, original_max_position=ORIGINAL, resonance=True), {},
                         "resonance_llama3", ORIGINAL),
    # Resonance on LongRoPE: the rounded tables become the per-pair factors of a plain longrope.
    "resonance_longrope": (scaling.LongRoPE(short_factor=tuple(SHORT), long_factor=tuple(LONG),
                                            original_max_position=ORIGINAL, factor=4.0, resonance=True), {},
                           "longrope", 64),
    "rerope": (None, dict(attention="rerope", window=8), "rerope", 64),
    "leaky_rerope_logn_yarn": (scaling.YaRN(factor=4.0, original_max_position=ORIGINAL),
                               dict(attention="rerope", window=8, leaky_k=4.0, logn_length=ORIGINAL),
                               "rerope_yarn", ORIGINAL),
}
# Mistral and Qwen3 checkpoints are written as several safetensors shards.
SHARDED = {"mistral", "qwen3"}
SHARD_SIZE = "40KB"


def model_for(family, seed=0):
    extra = {"sliding_window": None} if family == "mistral" else {}  # pre-RoPE attention refuses sliding windows
    return tiny(family, seed=seed, **extra)


def train(model, steps=2):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = ids(length=LENGTH, seed=10 + step)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def load(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every (family, case): patched, trained, saved; with its input and the trained model's logits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (module fixtures are set up before the function-scoped one_thread)
    root = tmp_path_factory.mktemp("checkpoints")
    x = ids(length=LENGTH, seed=99)
    torch.save(x, root / "ids.pt")
    out = {}
    for family in sorted(FAMILIES):
        for name, (method, kwargs, _, _) in CASES.items():
            model = train(hf.patch(model_for(family), method, **kwargs))
            path = root / f"{family}-{name}"
            with torch.no_grad():
                logits = model(x).logits
            model.save_pretrained(path, max_shard_size=SHARD_SIZE if family in SHARDED else "1GB")
            out[family, name] = (path, logits, model)
    torch.set_num_threads(threads)
    return root, x, out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reload_gives_the_trained_model(checkpoints, family, name):
    root, x, saved = checkpoints
    path, trained_logits, trained = saved[family, name]
    method, kwargs, rope_type, mpe = CASES[name]
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == rope_type
    assert config["max_position_embeddings"] == mpe
    if name == "ntk":
        assert config["rope_parameters"]["rope_theta"] == 1e4 * 4.0 ** (16 / 14)
        assert config["ropescale"] == {"method": {"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4}}
    else:
        attention = None if not kwargs else {"attention": "rerope", "window": 8, "leaky_k": kwargs.get("leaky_k", 0.0),
                                             "logn_length": kwargs.get("logn_length", 0)}
        # A stock type (linear, yarn, llama3, longrope) is recorded: the vLLM plugin serves ropescale's table.
        table_type = config["rope_parameters"]["rope_type"].removeprefix("rerope_")
        method = {"method": {**config["rope_parameters"], "rope_type": table_type}} if table_type in (
            "linear", "yarn", "llama3", "longrope") else {}
        assert config.get("ropescale") == ({**(attention or {}), **method} or None)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert (len(shards) > 2) == (family in SHARDED), shards
    if family in SHARDED:
        assert (path / "model.safetensors.index.json").exists()

    model, messages = load(path)
    assert not hf.is_patched(model)
    loaded = model.config.to_json_string()
    with torch.no_grad():
        if kwargs:  # ReRoPE: the load warns that the attention needs the patch, and the patch restores it
            assert any("ReRoPE" in m and "ropescale.hf.patch(model)" in m for m in messages), messages
            unpatched = model(x).logits
            assert (unpatched - trained_logits).abs().max() > 1e-3  # plain attention is another model
        else:  # the unpatched reload (transformers' forward, with ropescale's table for ropescale's types)
            torch.testing.assert_close(model(x).logits, trained_logits, atol=1e-5, rtol=0)
        # hf.patch(model) with no arguments re-applies what was saved: same logits, same method, and
        # nothing in the config changes.
        hf.patch(model)
        assert model.config.to_json_string() == loaded
        torch.testing.assert_close(model(x).logits, trained_logits, atol=1e-5, rtol=0)
    ours, theirs = model._ropescale_patch, trained._ropescale_patch
    assert (ours.attention, ours.window, ours.plan.leaky_k, ours.plan.logn_length) == (
        theirs.attention, theirs.window, theirs.plan.leaky_k, theirs.plan.logn_length)
    if name == "resonance_longrope":  # the same tables, now as plain longrope factors
        for seq_len in (ORIGINAL, LENGTH):
            torch.testing.assert_close(ours.method.inv_freq(16, 1e4, seq_len=seq_len),
                                       theirs.method.inv_freq(16, 1e4, seq_len=seq_len), rtol=1e-12, atol=0)
        assert ours.method.attention_factor == theirs.method.attention_factor
    else:
        assert ours.method == theirs.method
    hf.unpatch(model)
    assert model.config.to_json_string() == loaded


PLAIN_TRANSFORMERS = textwrap.dedent("""
    # Loads every checkpoint with transformers alone: ropescale is never imported.
    import json, sys, warnings
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    jobs = json.loads(sys.argv[1])
    x = torch.load(jobs["ids"])
    report = {}
    for path in jobs["paths"]:
        try:
            model = AutoModelForCausalLM.from_pretrained(path).eval()
        except Exception as err:  # noqa: BLE001 (the error is the result)
            report[path] = {"error": type(err).__name__, "message": str(err)}
            continue
        with torch.no_grad():
            torch.save(model(x).logits, path + "/plain_logits.pt")
        report[path] = {"loaded": True}
    report["ropescale imported"] = any(name.split(".")[0] == "ropescale" for name in sys.modules)
    print(json.dumps(report))
""")


def test_plain_transformers_loads_native_types_and_refuses_ropescale_types(checkpoints, tmp_path):
    root, x, saved = checkpoints
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TRANSFORMERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    jobs = {"ids": str(root / "ids.pt"), "paths": [str(path) for path, _, _ in saved.values()]}
    result = subprocess.run([sys.executable, str(script), json.dumps(jobs)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report.pop("ropescale imported") is False
    native = refused = 0
    for (family, name), (path, trained_logits, _) in saved.items():
        rope_type = CASES[name][2]
        outcome = report[str(path)]
        if rope_type in NATIVE and not CASES[name][1]:
            assert outcome == {"loaded": True}, (family, name, outcome)
            plain = torch.load(path / "plain_logits.pt")
            torch.testing.assert_close(plain, trained_logits, atol=1e-5, rtol=0, msg=f"{family} {name}")
            native += 1
        else:  # transformers' own refusal, naming the type: never a silent default RoPE
            assert outcome == {"error": "KeyError", "message": repr(rope_type)}, (family, name, outcome)
            refused += 1
    assert native == 4 * 7 and refused == 4 * 11


# ---------------------------------------------------------------------------------------------
# unpatch: the original config, byte for byte


@pytest.mark.parametrize("name", sorted(CASES))
def test_unpatch_restores_the_config_exactly(name):
    method, kwargs, rope_type, _ = CASES[name]
    model = model_for("qwen2")
    model.config.original_max_position_embeddings = 48  # a Phi-3-style copy outside rope_parameters
    before = model.config.to_json_string()
    hf.patch(model, method, **kwargs)
    assert model.config.rope_parameters["rope_type"] == rope_type
    assert model.config.to_json_string() != before
    if method is not None and hasattr(method, "original_max_position"):
        assert model.config.original_max_position_embeddings == method.original_max_position
    hf.unpatch(model)
    assert model.config.to_json_string() == before


def test_unpatch_then_save_pretrained_writes_the_original_config_json(tmp_path):
    model = model_for("llama")
    model.save_pretrained(tmp_path / "before")
    hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), attention="rerope", window=8)
    model.save_pretrained(tmp_path / "patched")
    hf.unpatch(model)
    model.save_pretrained(tmp_path / "after")
    before = (tmp_path / "before" / "config.json").read_bytes()
    assert (tmp_path / "patched" / "config.json").read_bytes() != before
    assert (tmp_path / "after" / "config.json").read_bytes() == before


def test_patch_on_a_reload_keeps_dynamic_methods_exact_with_the_pre_rope_cache(checkpoints):
    # A reloaded dynamic checkpoint, patched with no arguments, decodes through the pre-RoPE cache
    # exactly as the trained model does (its table changes with the length).
    root, x, saved = checkpoints
    for name in ("dynamic", "dynamic_yarn", "rerope"):
        path, _, trained = saved["llama", name]
        model, _ = load(path)
        hf.patch(model)
        assert model._ropescale_patch.pre_rope
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(x[:, :20], past_key_values=hf.PreRopeCache(), **kw),
                           trained.generate(x[:, :20], past_key_values=hf.PreRopeCache(), **kw)), name


def test_explicit_arguments_override_what_the_config_records(checkpoints):
    root, x, saved = checkpoints
    path, _, _ = saved["llama", "leaky_rerope_logn_yarn"]
    model, _ = load(path)
    hf.patch(model, attention="rerope", window=4)  # the saved leaky_k and logn_length are not mixed in
    state = model._ropescale_patch
    assert (state.window, state.plan.leaky_k, state.plan.logn_length) == (4, 0.0, 0)
    recorded = {"method": {**model.config.rope_parameters, "rope_type": "yarn"}}  # the YaRN table stays recorded
    assert model.config.ropescale == {"attention": "rerope", "window": 4, "leaky_k": 0.0, "logn_length": 0, **recorded}
    hf.unpatch(model)
    hf.patch(model, attention="sdpa")  # plain attention over the saved table: the marker and attention side go
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.ropescale == recorded
    assert model._ropescale_patch.method == scaling.YaRN(factor=4.0, original_max_position=ORIGINAL)


def test_bad_recorded_attention_gets_a_clear_error():
    model = model_for("llama")
    model.config.ropescale = {"attention": "flash"}
    with pytest.raises(ValueError, match="config.ropescale must be a dict with keys"):
        hf.patch(model)
    model = model_for("llama")
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "rerope"}
    with pytest.raises(ValueError, match="marks ReRoPE attention but the config has no 'ropescale' entry"):
        hf.patch(model)
    assert not hf.is_patched(model)


# Hand-edited entries of a saved ReRoPE checkpoint (issue 27: the vLLM plugin checked only their keys, so
# `window: 0` started an engine whose first request killed it), each with the message hf.patch gives.
BAD_ENTRIES = [
    ({"window": 0}, "attention='rerope' needs window, an integer > 0, got 0"),
    ({"window": -4}, "attention='rerope' needs window, an integer > 0, got -4"),
    ({"window": 2.5}, "attention='rerope' needs window, an integer > 0, got 2.5"),
    ({"window": "16"}, "attention='rerope' needs window, an integer > 0, got '16'"),
    ({"window": None}, "attention='rerope' needs window, an integer > 0, got None"),
    ({"leaky_k": 0.5}, "leaky_k must be 0 (plain ReRoPE) or a finite number >= 1, got 0.5"),
    ({"leaky_k": float("nan")}, "leaky_k must be 0 (plain ReRoPE) or a finite number >= 1, got nan"),
    ({"leaky_k": "2"}, "leaky_k must be 0 (plain ReRoPE) or a finite number >= 1, got '2'"),
    ({"logn_length": 1}, "logn_length must be 0 (no log-n scaling) or an integer >= 2"),
    ({"logn_length": 64.0}, "logn_length must be 0 (no log-n scaling) or an integer >= 2"),
    ({"attention": "sdpa"}, "window, leaky_k, logn_length apply to attention='rerope' or 'self_extend' only; "
                            "attention='sdpa' takes no parameters"),
]


@pytest.mark.parametrize("edit,message", BAD_ENTRIES, ids=[str(e) for e, _ in BAD_ENTRIES])
def test_every_path_refuses_a_bad_entry_with_hf_patchs_message(tmp_path, edit, message):
    from ropescale import config as config_lib

    path = tmp_path / "rerope"
    hf.patch(model_for("llama"), attention="rerope", window=4, leaky_k=2.0, logn_length=16).save_pretrained(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["ropescale"].update(edit)
    config_file.write_text(json.dumps(config))
    pattern = __import__("re").escape(message)
    # transformers' model build (plain from_pretrained with ropescale's rope types registered)
    with pytest.raises(ValueError, match="^ropescale: " + pattern):
        AutoModelForCausalLM.from_pretrained(path)
    # hf.patch on a model built without the entry's check, then given the edited entry
    model = model_for("llama")
    model.config.rope_parameters = dict(config["rope_parameters"])
    model.config.ropescale = config["ropescale"]
    with pytest.raises(ValueError, match="^patch: " + pattern):
        hf.patch(model)
    assert not hf.is_patched(model)
    # what the vLLM plugin's get_rope reads at model build, before the engine takes a request
    with pytest.raises(ValueError, match="^" + pattern):
        config_lib.read(config["rope_parameters"], config["max_position_embeddings"], config["ropescale"], 16)
    # and hf.patch's own arguments, the same values
    arguments = {"attention": "rerope", "window": 4, "leaky_k": 2.0, "logn_length": 16, **edit}
    if arguments["attention"] == "sdpa":
        arguments.pop("attention")
    with pytest.raises(ValueError, match="^patch: " + pattern):
        hf.patch(model_for("llama"), attention=arguments.get("attention", "sdpa"), window=arguments["window"],
                 leaky_k=arguments["leaky_k"], logn_length=arguments["logn_length"])


# ---------------------------------------------------------------------------------------------
# ropescale extend


def source_model(tmp_path, family="llama"):
    from support.tiny_lm import char_tokenizer

    src = tmp_path / "src"
    model = model_for(family)
    model.save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    return src, model


def test_extend_writes_a_checkpoint_that_loads_as_the_patched_model(tmp_path, capsys):
    src, model = source_model(tmp_path)
    dst = tmp_path / "dst"
    assert cli.main(["extend", str(src), str(dst), "--method", "yarn", "--factor", "4",
                     "--original-max-position", str(ORIGINAL)]) == 0
    out = capsys.readouterr().out
    assert "yarn" in out and str(dst) in out
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "rope_theta": 10000.0}
    assert config["max_position_embeddings"] == 64
    # weights linked (or copied where links cannot be made), tokenizer files copied byte for byte
    for f in src.iterdir():
        if f.name == "config.json":
            continue
        assert (dst / f.name).read_bytes() == f.read_bytes(), f.name
    assert os.path.samefile(src / "model.safetensors", dst / "model.safetensors")
    assert not os.path.samefile(src / "tokenizer.json", dst / "tokenizer.json")
    reloaded, _ = load(dst)
    hf.patch(model, scaling.YaRN(factor=4.0, original_max_position=ORIGINAL))
    x = ids(length=LENGTH)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits, atol=1e-5, rtol=0)


def test_extend_resonance_and_dry_run(tmp_path, capsys):
    src, model = source_model(tmp_path, "qwen3")
    dst = tmp_path / "dst"
    assert cli.main(["extend", str(src), str(dst), "--method", "yarn", "--factor", "4", "--resonance",
                     "--original-max-position", "16", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rope_parameters"]["rope_type"] == "resonance_yarn" and printed["max_position_embeddings"] == 16
    assert not dst.exists()
    assert cli.main(["extend", str(src), str(dst), "--method", "yarn", "--factor", "4", "--resonance",
                     "--original-max-position", "16"]) == 0
    assert json.loads((dst / "config.json").read_text()) == printed
    assert "rope_type resonance_yarn, max_position_embeddings 16" in capsys.readouterr().out
    # The default original length is the model's max_position_embeddings (64 here).
    assert cli.main(["extend", str(src), str(tmp_path / "d2"), "--method", "linear", "--factor", "2", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rope_parameters"]["rope_type"] == "linear" and printed["max_position_embeddings"] == 64
    assert cli.main(["extend", str(src), str(tmp_path / "d3"), "--method", "yarn", "--factor", "2", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rope_parameters"]["original_max_position_embeddings"] == 64
    assert printed["max_position_embeddings"] == 128


def usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        cli.main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: ropescale extend" in err
    return err


def test_extend_refusals(tmp_path, capsys):
    src, _ = source_model(tmp_path)
    (tmp_path / "empty").mkdir()
    err = usage_error(capsys, "extend", tmp_path / "empty", tmp_path / "d", "--method", "yarn", "--factor", "4")
    assert "is not a transformers model directory (no config.json)" in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text('{"hello": 1}')
    err = usage_error(capsys, "extend", tmp_path / "junk", tmp_path / "d", "--method", "yarn", "--factor", "4")
    assert "is not a transformers model directory" in err
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    err = usage_error(capsys, "extend", tmp_path / "gpt2", tmp_path / "d", "--method", "yarn", "--factor", "4")
    assert "has no RoPE parameters" in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "nope", "--factor", "4")
    assert "invalid choice: 'nope'" in err
    err = usage_error(capsys, "extend", src, src, "--method", "yarn", "--factor", "4")
    assert "already exists" in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "yarn")
    assert "needs --factor" in err
    # LongRoPE's per-pair factor lists come from a file.
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "longrope", "--factor", "4")
    assert "--method longrope needs --longrope-factors FILE.json" in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "rerope")
    assert "--method rerope needs --window W" in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "rerope", "--window", "8", "--factor", "2")
    assert "--method rerope keeps SRC's own table: --factor" in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "yarn", "--factor", "4", "--window", "8",
                      "--target", "vllm")
    assert "ReRoPE attention needs ropescale's plugin" in err
    # Values the scaling method refuses never reach a config (issue 16.12).
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "yarn", "--factor", "0.5")
    assert "argument --factor: the scale factor s must be >= 1" in err
    err = usage_error(capsys, "extend", src, tmp_path / "d", "--method", "yarn", "--factor", "4",
                      "--beta-fast", "1", "--beta-slow", "2")
    assert "YaRN: beta_fast (1) must be greater than beta_slow (2)" in err
    assert not (tmp_path / "d").exists()


def logits(model, length, seed=3):
    with torch.no_grad():
        return model(ids(length=length, seed=seed)).logits


def test_extend_dynamic_yarn_serves_longer_while_short_requests_stay_native(tmp_path, capsys):
    # issue 27: `extend --method dynamic_yarn --factor 8` (help: "scale factor s") wrote a FLOOR of 8: static YaRN
    # x8 at every length up to 8x the original, short requests no longer native. The served length is its own
    # option now; the floor stays 1 unless asked for by name.
    src, model = source_model(tmp_path)
    err = usage_error(capsys, "extend", src, tmp_path / "old", "--method", "dynamic_yarn", "--factor", "4",
                      "--original-max-position", ORIGINAL)
    assert "takes no --factor" in err and "give --max-length N (the floor stays 1); for a floor, --floor 4" in err
    dst = tmp_path / "dst"
    assert cli.main(["extend", str(src), str(dst), "--method", "dynamic_yarn", "--max-length", "64",
                     "--original-max-position", str(ORIGINAL)]) == 0
    assert "model_max_length 64: vLLM serves it up to 64 tokens (max_model_len)" in capsys.readouterr().out
    config = json.loads((dst / "config.json").read_text())
    # The table keeps the original length and a floor of 1; the served length is apart, where vLLM reads it.
    assert config["rope_parameters"]["factor"] == 1.0
    assert config["rope_parameters"]["original_max_position_embeddings"] == ORIGINAL
    assert config["max_position_embeddings"] == ORIGINAL and config["model_max_length"] == 64
    from ropescale import config as config_lib

    assert config_lib.vllm_max_model_len(config["rope_parameters"], ORIGINAL, config["model_max_length"]) == 64
    for patched in (False, True):  # `import ropescale.hf` alone, and hf.patch on the reload
        reloaded, _ = load(dst)
        if patched:
            hf.patch(reloaded)
            assert reloaded._ropescale_patch.method == scaling.DynamicYaRN(original_max_position=ORIGINAL)
        # up to the original length: the model's own RoPE, exactly
        torch.testing.assert_close(logits(reloaded, ORIGINAL), logits(model, ORIGINAL), atol=1e-5, rtol=0)
        # past it: Dynamic-YaRN at that length's scale
        want = logits(hf.patch(model_for("llama"), scaling.DynamicYaRN(original_max_position=ORIGINAL)), LENGTH)
        torch.testing.assert_close(logits(reloaded, LENGTH), want, atol=1e-5, rtol=0)
    # A floor, asked for by name, holds at every length: short requests are then not native.
    assert cli.main(["extend", str(src), str(tmp_path / "floor"), "--method", "dynamic_yarn", "--floor", "4",
                     "--original-max-position", str(ORIGINAL), "--dry-run"]) == 0
    floored = json.loads(capsys.readouterr().out)
    assert floored["rope_parameters"]["factor"] == 4.0 and "model_max_length" not in floored


def extend_config(capsys, src, dst, *options):
    assert cli.main(["extend", str(src), str(dst), *map(str, options)]) == 0
    capsys.readouterr()
    return json.loads((dst / "config.json").read_text())


# What `extend` writes, against what hf.patch + save_pretrained write for the same method: (options, method,
# patch keyword arguments). Every method hf.patch can write (issue 27).
EXTEND_CASES = {
    "rerope": (["--method", "rerope", "--window", 8], None, dict(attention="rerope", window=8)),
    "leaky_logn_rerope": (["--method", "rerope", "--window", 8, "--leaky-k", 4, "--logn"], None,
                          dict(attention="rerope", window=8, leaky_k=4.0, logn_length=ORIGINAL)),
    "rerope_over_yarn": (["--method", "yarn", "--factor", 4, "--window", 8],
                         scaling.YaRN(factor=4.0, original_max_position=ORIGINAL), dict(attention="rerope", window=8)),
    "dynamic_ntk": (["--method", "dynamic_ntk", "--factor", 2],
                    scaling.DynamicNTK(factor=2.0, original_max_position=64), {}),
    "longrope": (["--method", "longrope", "--factor", 4],
                 scaling.LongRoPE(short_factor=tuple(SHORT), long_factor=tuple(LONG), original_max_position=ORIGINAL,
                                  factor=4.0), {}),
    "resonance_longrope": (["--method", "longrope", "--factor", 4, "--resonance"],
                           scaling.LongRoPE(short_factor=tuple(SHORT), long_factor=tuple(LONG),
                                            original_max_position=ORIGINAL, factor=4.0, resonance=True), {}),
    "ntk": (["--method", "ntk", "--factor", 4], scaling.NTK(factor=4.0), {}),
}


@pytest.mark.parametrize("name", sorted(EXTEND_CASES))
def test_extend_writes_what_hf_patch_writes(tmp_path, capsys, name):
    options, method, kwargs = EXTEND_CASES[name]
    src, model = source_model(tmp_path)
    (tmp_path / "factors.json").write_text(json.dumps({"rope_scaling": {"short_factor": SHORT, "long_factor": LONG}}))
    if "longrope" in name:
        options = [*options, "--longrope-factors", tmp_path / "factors.json"]
    if name != "dynamic_ntk":  # Dynamic NTK reads its original length from max_position_embeddings (64)
        options = [*options, "--original-max-position", ORIGINAL]
    written = extend_config(capsys, src, tmp_path / "dst", *options)
    hf.patch(model, method, **kwargs).save_pretrained(tmp_path / "patched")
    want = json.loads((tmp_path / "patched" / "config.json").read_text())
    for key in ("rope_parameters", "max_position_embeddings", "ropescale"):
        assert written.get(key) == want.get(key), key
    reloaded, _ = load(tmp_path / "dst")
    hf.patch(reloaded)
    torch.testing.assert_close(logits(reloaded, LENGTH), logits(model, LENGTH), atol=1e-5, rtol=0)


def test_extend_served_length_of_rerope_and_dynamic_ntk(tmp_path, capsys):
    from ropescale import config as config_lib

    src, _ = source_model(tmp_path)
    for options, factor in ((["--method", "rerope", "--window", 8], 1.0),
                            (["--method", "yarn", "--factor", 4, "--window", 8], 4.0),  # vLLM multiplies rerope_yarn
                            (["--method", "dynamic_ntk", "--factor", 3], 3.0)):
        dst = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        written = extend_config(capsys, src, dst, *options, "--max-length", 1000, "--original-max-position", ORIGINAL)
        assert written["model_max_length"] * factor == pytest.approx(1000, rel=1e-15)
        assert config_lib.vllm_max_model_len(written["rope_parameters"], written["max_position_embeddings"],
                                             written["model_max_length"]) == 1000
        # hf.patch(model) on the reload keeps it; unpatch gives the reload's config back, byte for byte
        reloaded, _ = load(dst)
        before = reloaded.config.to_json_string()
        hf.patch(reloaded)
        assert reloaded.config.to_json_string() == before
        hf.unpatch(reloaded)
        # a static method patched over it drops it (its own table ends at its own length); unpatch restores it
        hf.patch(reloaded, scaling.YaRN(factor=2.0, original_max_position=ORIGINAL))
        assert not hasattr(reloaded.config, "model_max_length")
        hf.unpatch(reloaded)
        assert reloaded.config.to_json_string() == before
    # A static table is set for one length: --max-length is refused, naming --factor.
    err = usage_error(capsys, "extend", src, tmp_path / "static", "--method", "yarn", "--factor", 4, "--max-length", 99)
    assert "--max-length is for pre-RoPE checkpoints" in err and "--factor s sets the length" in err


def test_a_served_length_set_after_hf_patch_is_saved_and_kept(tmp_path):
    # docs/checkpoints.md's Python route: hf.patch, then model_max_length from served_length_value, then save_pretrained.
    from ropescale import config as config_lib

    model = hf.patch(model_for("llama"), scaling.DynamicNTK(factor=3.0, original_max_position=64))
    model.config.model_max_length = config_lib.served_length_value(1000, model.config.rope_parameters)
    model.save_pretrained(tmp_path / "saved")
    hf.unpatch(model)
    assert not hasattr(model.config, "model_max_length")  # unpatch gives the config before the patch back
    reloaded, _ = load(tmp_path / "saved")
    config = reloaded.config
    assert config_lib.vllm_max_model_len(config.rope_parameters, config.max_position_embeddings,
                                         config.model_max_length) == 1000
    before = config.to_json_string()
    hf.patch(reloaded)
    assert reloaded.config.to_json_string() == before


def test_extend_refuses_dst_inside_src_and_names_the_dequantising_step_of_a_gguf(tmp_path, capsys, monkeypatch):
    src, model = source_model(tmp_path)
    err = usage_error(capsys, "extend", src, src / "sub" / "dst", "--method", "yarn", "--factor", 4)
    assert "is inside" in err and not (src / "sub").exists()
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "m.Q4_0.gguf").write_bytes(b"GGUF")
    err = usage_error(capsys, "extend", tmp_path / "q", tmp_path / "dst", "--method", "yarn", "--factor", 4)
    assert "is a GGUF file" in err and "realmodel.save_dequantised(" in err
    assert f"then ropescale extend {tmp_path / 'dst-src'} {tmp_path / 'dst'}" in err
    assert f"for llama.cpp, extend the GGUF itself: ropescale extend {tmp_path / 'q' / 'm.Q4_0.gguf'}" in err
    # a GGUF file itself is llama.cpp's route (test_llamacpp.py): DST a GGUF, the file one the gguf package reads
    err = usage_error(capsys, "extend", tmp_path / "q" / "m.Q4_0.gguf", tmp_path / "dst", "--method", "yarn")
    assert "a GGUF SRC writes a GGUF file: name DST *.gguf" in err
    err = usage_error(capsys, "extend", tmp_path / "q" / "m.Q4_0.gguf", tmp_path / "dst.gguf", "--method", "yarn")
    assert "is not a GGUF file the gguf package can read" in err
    # The step it names writes a directory extend takes (the GGUF reader is transformers'; faked here).
    from ropescale import realmodel
    from support.tiny_lm import char_tokenizer

    monkeypatch.setattr(realmodel, "load_gguf", lambda path, progress=False: (model, char_tokenizer()))
    realmodel.save_dequantised(tmp_path / "q" / "m.Q4_0.gguf", tmp_path / "dst-src")
    assert cli.main(["extend", str(tmp_path / "dst-src"), str(tmp_path / "dst"), "--method", "yarn",
                     "--factor", "4"]) == 0


def test_extend_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["extend", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "ropescale extend ./llama ./llama-yarn --method yarn --factor 4" in out
    assert "--dry-run" in out and "--resonance" in out and "--original-max-position" in out
    # which length is which (issue 27)
    text = " ".join(out.split())
    assert "Two lengths, not to be confused" in text and "applied at EVERY length" in text
    assert "--max-length N is then the length it may be served to" in text


@pytest.mark.parametrize("method, length", [(scaling.Linear(factor=4.0), 64), (scaling.NTK(factor=2.0), 32),
                                            (scaling.YaRN(factor=2.0, original_max_position=ORIGINAL), 32)],
                         ids=["linear", "ntk", "yarn"])
def test_a_method_patched_over_a_scaled_checkpoint_records_s_times_its_original_length(tmp_path, method, length):
    # issue 55: over a model loaded from a YaRN x4 checkpoint (original 16, max_position_embeddings 64), Linear(4)
    # recorded max_position_embeddings 64, which vLLM multiplies by 4: served to 256 with a table set for 64.
    from ropescale import config as config_lib

    tiny("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
         mpe=4 * ORIGINAL).save_pretrained(tmp_path / "yarn")
    model, _ = load(tmp_path / "yarn")
    before = model.config.to_json_string()
    hf.patch(model, method)
    assert config_lib.max_model_len_of(model.config) == length
    # what the same patch records on the unscaled model of the original length
    plain = hf.patch(tiny("llama", mpe=ORIGINAL), method)
    for key in ("rope_parameters", "max_position_embeddings"):
        assert getattr(model.config, key) == getattr(plain.config, key), key
    hf.unpatch(model)
    assert model.config.to_json_string() == before


def test_the_sglang_attn_factor_ropescale_writes_loads_without_transformers_unrecognized_key_log(tmp_path):
    """ropescale writes stock SGLang's ``attn_factor`` beside YaRN's ``attention_factor`` (issue 56); transformers
    logged "Unrecognized keys in `rope_parameters` ... {'attn_factor'}" on every load of such a checkpoint. With
    ``import ropescale.hf`` it takes the copy where the two agree; a copy that disagrees (edited by hand) is still
    logged."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    model = hf.patch(tiny("llama"), scaling.YaRN(factor=4.0, original_max_position=ORIGINAL,
                                                  attention_factor_override=1.3))
    model.save_pretrained(tmp_path / "ok")
    raw = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert "attn_factor" in raw["rope_parameters"]
    (tmp_path / "edited").mkdir()
    raw["rope_parameters"]["attn_factor"] = 1.0
    (tmp_path / "edited" / "config.json").write_text(json.dumps(raw))
    logger = hf_logging.get_logger("transformers.modeling_rope_utils")
    for folder, logged in (("ok", False), ("edited", True)):
        with CaptureLogger(logger) as captured:
            transformers.AutoConfig.from_pretrained(tmp_path / folder)
        assert ("Unrecognized keys" in captured.out) is logged, (folder, captured.out)
