"""The ``ropescale`` command: values against the ops, the --json schemas, PNGs written at the expected
size, --help with examples for every command, and usage errors (exit 2) for bad arguments."""

import copy
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ropescale import cli, ops, posgen, scaling
from support import ROOT

PYTHON_DIR = str(ROOT / "python")


# Tiny models: one intra-op thread (conftest.py's one_thread fixture).
pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def run_json(capsys, *argv):
    return json.loads(run(capsys, *argv, "--json"))


def usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "usage: ropescale" in err
    return err


def png_size(path):
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_png(path, size=(960, 540)):
    assert png_size(path) == size
    import matplotlib.image

    image = matplotlib.image.imread(path)  # decodes the whole file
    assert image.shape[:2] == (size[1], size[0])
    assert float(image[..., :3].std()) > 0.05  # something is drawn


# ---------------------------------------------------------------------------------------------
# table


def test_table_json_values(capsys):
    out = run_json(capsys, "table", "--method", "yarn", "--factor", "4", "--original-max-position", "64",
                   "--dim", "64", "--base", "10000")
    assert set(out) == {"method", "dim", "base", "attention_factor", "rows"}
    assert out["method"] == "yarn" and out["dim"] == 64 and out["base"] == 10000.0
    assert out["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)
    expected = ops.yarn_inv_freq(64, 1e4, 4.0, 64)
    default = ops.default_inv_freq(64, 1e4)
    assert len(out["rows"]) == 32
    for i, row in enumerate(out["rows"]):
        assert set(row) == {"regime", "pair", "inv_freq", "wavelength", "scale"} and row["pair"] == i
        assert row["inv_freq"] == pytest.approx(float(expected[i]), rel=1e-6)
        assert row["wavelength"] == pytest.approx(2 * math.pi / float(expected[i]), rel=1e-6)
        assert row["scale"] == pytest.approx(float(default[i] / expected[i]), rel=1e-5)
        assert row["regime"] in ("keep", "blend", "interpolate")
    assert out["rows"][-1]["regime"] == "interpolate" and out["rows"][-1]["scale"] == pytest.approx(4.0)


def test_table_resonance_and_text(capsys):
    out = run_json(capsys, "table", "--method", "resonance_yarn", "--factor", "8", "--dim", "32")
    wl = [r["wavelength"] for r in out["rows"]]
    assert all(abs(w - round(w)) < 1e-6 * w + 1e-4 for w in wl)  # float32 table
    assert wl == pytest.approx([float(2 * math.pi / t) for t in scaling.YaRN(factor=8.0, resonance=True).inv_freq(32, 1e4)])
    text = run(capsys, "table", "--method", "linear", "--factor", "2", "--dim", "8", "--resonance")
    assert text.splitlines()[0].startswith("linear + resonance: rotary dim 8, base 10000")
    assert len(text.splitlines()) == 2 + 4


def test_table_plot(capsys, tmp_path):
    path = tmp_path / "wl.png"
    out = run(capsys, "table", "--method", "yarn", "--factor", "16", "--compare", "linear", "ntk", "resonance",
              "--plot", str(path))
    assert f"wrote {path}" in out
    assert_png(path)


# ---------------------------------------------------------------------------------------------
# base-bound, decay, gap


def test_base_bound(capsys):
    out = run_json(capsys, "base-bound", "1024", "4096", "--dim", "128")
    assert out["dim"] == 128
    assert [b["context_length"] for b in out["bounds"]] == [1024, 4096]
    for b in out["bounds"]:
        assert b["base_lower_bound"] == pytest.approx(ops.base_lower_bound(b["context_length"], 128))
    # Men et al., Table 2: 4.3e3 for 1k, 2.7e4 for 4k.
    assert out["bounds"][0]["base_lower_bound"] == pytest.approx(4.3e3, rel=0.05)
    assert out["bounds"][1]["base_lower_bound"] == pytest.approx(2.7e4, rel=0.05)
    text = run(capsys, "base-bound", "1024", "--dim", "64")
    assert f"{ops.base_lower_bound(1024, 64):.4g}" in text


def test_decay(capsys, tmp_path):
    out = run_json(capsys, "decay", "--dim", "128", "--base", "10000", "--max-distance", "4000")
    inv_freq = ops.default_inv_freq(128, 1e4, dtype=torch.float64)
    effective = ops.effective_context_length(inv_freq, 4000)
    assert out["effective_context_length"] == effective < 4000
    assert out["first_negative"] == effective + 1
    curve = torch.tensor(out["curve"], dtype=torch.float64)
    torch.testing.assert_close(curve, ops.similarity_decay(inv_freq, 4000))
    assert curve[0] == 64 and (curve[: effective + 1] >= 0).all() and curve[effective + 1] < 0
    path = tmp_path / "decay.png"
    text = run(capsys, "decay", "--dim", "128", "--max-distance", "4000", "--plot", str(path))
    assert f"effective context length: {effective} (first negative B_m at m = {effective + 1})" in text
    assert_png(path)


def test_decay_never_negative_in_range(capsys):
    out = run_json(capsys, "decay", "--dim", "128", "--base", "500000", "--max-distance", "1000")
    assert out["first_negative"] is None and out["effective_context_length"] == 1000


def test_decay_of_a_scaled_method(capsys):
    out = run_json(capsys, "decay", "--method", "linear", "--factor", "4", "--dim", "64", "--max-distance", "5000")
    plain = run_json(capsys, "decay", "--dim", "64", "--max-distance", "5000")
    # Position interpolation stretches every wavelength by 4, so the curve is the plain one at m/4.
    assert out["effective_context_length"] in range(4 * plain["effective_context_length"],
                                                    4 * plain["effective_context_length"] + 4)


def test_gap(capsys, tmp_path):
    out = run_json(capsys, "gap", "--dim", "64", "--train-length", "64", "--test-length", "256")
    assert set(out) >= {"pairs", "max_pre_critical_gap", "max_pre_critical_resonance_gap", "train_length"}
    table = ops.default_inv_freq(64, 1e4, dtype=torch.float64)
    gap = ops.feature_gap(table, 64, 256)
    pre = [p for p in out["pairs"] if p["pre_critical"]]
    assert len(out["pairs"]) == 32 and 0 < len(pre) < 32
    for p in out["pairs"]:
        assert p["gap"] == pytest.approx(float(gap[p["pair"]]))
        assert p["pre_critical"] == (p["wavelength"] < 64)
        assert p["resonance_wavelength"] == pytest.approx(round(p["wavelength"]), rel=1e-12)
    # Theorem 1: rounding closes the gap of every pre-critical pair.
    assert out["max_pre_critical_gap"] > 0.01
    assert out["max_pre_critical_resonance_gap"] < 1e-6
    path = tmp_path / "gap.png"
    run(capsys, "gap", "--method", "yarn", "--factor", "4", "--original-max-position", "64", "--plot", str(path))
    assert_png(path)


# ---------------------------------------------------------------------------------------------
# posgen


def test_posgen(capsys, tmp_path):
    out = run_json(capsys, "posgen", "semi_recursive", "--n", "5", "--length", "20", "--seed", "3")
    assert out["sequences"] == posgen.generate("semi_recursive", 5, 20, seed=3).tolist()
    assert (out["task"], out["j"], out["k"], out["modulus"]) == ("semi_recursive", 1, 3, 17)
    path = tmp_path / "d.pt"
    text = run(capsys, "posgen", "cot", "--n", "3", "--length", "12", "--j", "2", "--k", "2", "--modulus", "7",
               "--out", str(path))
    saved = torch.load(path)
    assert torch.equal(saved, posgen.generate("cot", 3, 12, j=2, k=2, modulus=7))
    lines = text.splitlines()
    assert len(lines) == 1 + 1 + 3  # "wrote", header, rows
    assert lines[0].startswith("wrote") and lines[1].startswith("PosGen cot: j=2, k=2, h = sum mod 7")
    assert lines[2].split("|")[0].split() == [str(t) for t in saved[0, :4].tolist()]
    assert lines[2].split("|")[1].split() == [str(t) for t in saved[0, 4:].tolist()]


# ---------------------------------------------------------------------------------------------
# demo and eval (small settings; the full demo is run by hand and by CI's demo job)


def test_demo_small(capsys, tmp_path):
    path = tmp_path / "demo.png"
    out = run_json(capsys, "demo", "--task", "recursive", "--train-length", "12", "--steps", "20",
                   "--plot", str(path), "--quiet")
    assert (out["task"], out["train_length"], out["test_length"], out["steps"]) == ("recursive", 12, 48, 20)
    names = [r["method"] for r in out["results"]]
    assert names[:4] == ["RoPE", "Resonance RoPE", "YaRN (s=4)", "Resonance YaRN (s=4)"]
    assert len(names) == 6 and names[4] == "ReRoPE (w=6)" and names[5] == "Dynamic-YaRN"
    for r in out["results"]:
        assert 0 <= r["id_accuracy"] <= 1 and 0 <= r["ood_accuracy"] <= 1
        assert len(r["accuracy_by_position"]) == 48 and r["accuracy_by_position"][0] is None
    assert_png(path)


def test_demo_text(capsys, tmp_path):
    text = run(capsys, "demo", "--train-length", "8", "--test-length", "24", "--steps", "5",
               "--plot", str(tmp_path / "d.png"), "--quiet")
    assert "trained at length 8" in text and "tested at 24" in text
    for name in ("RoPE", "Resonance RoPE", "YaRN (s=3)", "Resonance YaRN (s=3)", "ReRoPE", "Dynamic-YaRN"):
        assert name in text
    assert "raise --steps" in text  # 5 steps cannot learn anything, and the demo says so


@pytest.fixture
def small_sampling_data(monkeypatch):
    """The demo's position sampling on 200 training and 20 test sequences (the CLI takes neither)."""
    from ropescale import tstl

    real = tstl.run_position_sampling

    def small(*args, **kwargs):
        return real(*args, **{**kwargs, "n_train": 200, "n_test": 20})

    monkeypatch.setattr(tstl, "run_position_sampling", small)


@pytest.mark.usefixtures("small_sampling_data")
def test_demo_position_sampling(capsys, tmp_path):
    # --position-sampling: 8 models (RoPE and YaRN x trained at W, W + PoSE, W + CREAM, trained at 4W), the table
    # computed from them, the PNG (CREAM at 4W needs an even W >= 34: a head and a tail of 16 and a middle).
    path = tmp_path / "sampling.png"
    out = run_json(capsys, "demo", "--position-sampling", "--train-length", "36", "--steps", "2", "--plot", str(path),
                   "--quiet")
    assert (out["train_length"], out["test_length"], out["steps"]) == (36, 144, 2)
    assert [(r["table_name"], r["label"]) for r in out["results"]] == [
        (t, label) for t in ("RoPE", "YaRN (s=4)")
        for label in ("trained at W", "W + PoSE", "W + CREAM", "trained at 4W")]
    for r in out["results"]:
        assert len(r["accuracy_by_position"]) == 144 and r["accuracy_by_position"][0] is None
        assert r["ood_accuracy"] == pytest.approx(sum(r["accuracy_by_position"][36:]) / 108)
    ood = {(r["table"], r["training"]): r["ood_accuracy"] for r in out["results"]}
    for row in out["table"]:
        if row["training"] in ("pose", "cream"):
            gap = ood[row["table"], "long"] - ood[row["table"], "short"]
            assert row["recovered"] == (pytest.approx((ood[row["table"], row["training"]] - ood[row["table"], "short"])
                                                      / gap) if gap >= 0.02 else None)
    assert_png(path)


@pytest.mark.usefixtures("small_sampling_data")
def test_demo_position_sampling_text_and_errors(capsys, tmp_path):
    text = run(capsys, "demo", "--position-sampling", "--train-length", "36", "--steps", "1", "--plot",
               str(tmp_path / "s.png"), "--quiet")
    assert "trained at W = 36" in text and "recovered = (OOD(sampled) - OOD(trained at W))" in text
    assert "W + PoSE" in text and "W + CREAM" in text and "raise --steps" in text
    assert "CREAM: a window of 32 leaves no middle" in usage_error(capsys, "demo", "--position-sampling",
                                                                    "--train-length", "32")
    assert "--test-length (30) must be > --train-length (48)" in usage_error(capsys, "demo", "--position-sampling",
                                                                              "--test-length", "30")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from support.tiny_lm import char_tokenizer, tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), max_position=200)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_eval_perplexity(capsys, tmp_path, saved_model):
    from ropescale import evaluate

    path, model, tokenizer = saved_model
    text_file = tmp_path / "t.txt"
    text = "The quick brown fox jumps over the lazy dog. " * 12
    text_file.write_text(text)
    out = run_json(capsys, "eval", "perplexity", str(path), "--text", str(text_file), "--max-length", "150",
                   "--stride", "100", "--device", "cpu")
    expected = evaluate.perplexity(model, text, tokenizer, max_length=150, stride=100)
    assert out["perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)
    assert out["tokens"] == expected.tokens and out["windows"] == expected.windows == 5
    assert {"nll", "max_length", "stride", "model", "method"} <= set(out)
    yarn = run_json(capsys, "eval", "perplexity", str(path), "--text", str(text_file), "--max-length", "150",
                    "--stride", "100", "--device", "cpu", "--method", "yarn", "--factor", "4",
                    "--original-max-position", "50")
    assert yarn["method"] == "yarn" and yarn["perplexity"] != pytest.approx(out["perplexity"], rel=1e-6)


def test_eval_dynamic_method(capsys, tmp_path, saved_model):
    path, model, tokenizer = saved_model
    text_file = tmp_path / "t.txt"
    text_file.write_text("abc " * 100)
    argv = ["eval", "perplexity", str(path), "--text", str(text_file), "--max-length", "150", "--stride", "100",
            "--device", "cpu", "--method", "dynamic_yarn", "--original-max-position", "50"]
    out = run_json(capsys, *argv)
    plain = run_json(capsys, *argv[:-4])
    assert out["tokens"] == plain["tokens"] == 399
    assert out["perplexity"] != pytest.approx(plain["perplexity"], rel=1e-6)  # windows past 50 are rescaled


def test_eval_passkey(capsys, saved_model):
    path, _, _ = saved_model
    out = run_json(capsys, "eval", "passkey", str(path), "--context-length", "300", "400", "--trials", "2",
                   "--device", "cpu", "--quiet")
    assert [r["context_length"] for r in out["results"]] == [300, 400]
    for r in out["results"]:
        assert len(r["trials"]) == 2 and r["accuracy"] in (0.0, 0.5, 1.0)
        assert set(r["trials"][0]) == {"key", "depth", "prompt_tokens", "answer", "correct"}


def _perplexity_direct(model, text, tokenizer, *patch_args, **patch_kwargs):
    from ropescale import evaluate, hf

    hf.patch(model, *patch_args, **patch_kwargs)
    try:
        return evaluate.perplexity(model, text, tokenizer, max_length=150, stride=100).perplexity
    finally:
        hf.unpatch(model)


@pytest.mark.parametrize("options,patch_args,patch_kwargs,described", [
    (["--method", "rerope", "--window", "16"], (None,), dict(attention="rerope", window=16),
     {"method": "default", "attention": "rerope", "window": 16, "leaky_k": 0.0, "logn_length": 0, "logn": False}),
    (["--method", "rerope", "--window", "16", "--leaky-k", "8", "--logn"], (None,),
     dict(attention="rerope", window=16, leaky_k=8.0, logn_length=50),
     {"method": "default", "window": 16, "leaky_k": 8.0, "logn_length": 50, "logn": True}),
    # --factor defaults to the evaluated length over the trained length: 150 / 50
    (["--method", "yarn"], (scaling.YaRN(factor=3.0, original_max_position=50),), {},
     {"method": "yarn", "factor": 3.0}),
    (["--method", "yarn", "--window", "16"], (scaling.YaRN(factor=3.0, original_max_position=50),),
     dict(attention="rerope", window=16), {"method": "yarn", "factor": 3.0, "window": 16}),
    # the other raw-key attentions (issue 44: eval takes every attention)
    (["--attention", "string", "--shifted-offset", "40", "--local-value", "8"], (None,),
     dict(attention="string", shifted_offset=40, local_value=8),
     {"attention": "string", "shifted_offset": 40, "local_value": 8}),
    (["--attention", "self_extend", "--window", "16", "--group", "3"], (None,),
     dict(attention="self_extend", window=16, group=3), {"attention": "self_extend", "window": 16, "group": 3}),
])
def test_eval_perplexity_method_and_window(capsys, tmp_path, saved_model, options, patch_args, patch_kwargs,
                                            described):
    path, model, tokenizer = saved_model
    text_file = tmp_path / "t.txt"
    text = "The quick brown fox jumps over the lazy dog. " * 8
    text_file.write_text(text)
    out = run_json(capsys, "eval", "perplexity", str(path), "--text", str(text_file), "--max-length", "150",
                   "--stride", "100", "--device", "cpu", "--original-max-position", "50", *options)
    assert out["perplexity"] == pytest.approx(_perplexity_direct(model, text, tokenizer, *patch_args,
                                                                 **patch_kwargs), rel=1e-6)
    assert described.items() <= out.items() and out["original_max_position"] == 50
    plain = run_json(capsys, "eval", "perplexity", str(path), "--text", str(text_file), "--max-length", "150",
                     "--stride", "100", "--device", "cpu")
    assert plain["method"] is None and out["perplexity"] != pytest.approx(plain["perplexity"], rel=1e-6)


def test_eval_loads_a_gguf_file_or_folder(capsys, tmp_path, monkeypatch, saved_model):
    # The real GGUF checkpoint is loaded in test_real_model.py; here the command's plumbing: the path it
    # passes, the dtype/device, and the patch applied to what the loader returned.
    from ropescale import realmodel

    _, model, tokenizer = saved_model
    calls = []

    def fake_load(path=None, *, dtype, device, progress):
        calls.append((path, dtype, device, progress))
        return copy.deepcopy(model), tokenizer

    monkeypatch.setattr(realmodel, "load_gguf", fake_load)
    (tmp_path / "m.gguf").write_bytes(b"")
    for gguf in ([str(tmp_path / "m.gguf")], [str(tmp_path)], []):
        out = run_json(capsys, "eval", "passkey", "--gguf", *gguf, "--context-length", "300", "--trials", "1",
                       "--device", "cpu", "--method", "rerope", "--window", "32")
        assert out["method"] == "default" and out["window"] == 32 and len(out["results"]) == 1
    assert calls == [(str(tmp_path / "m.gguf"), torch.float32, "cpu", False),
                     (str(tmp_path), torch.float32, "cpu", False), (None, torch.float32, "cpu", False)]
    assert out["model"].startswith("SmolLM2-135M-Instruct")


# ---------------------------------------------------------------------------------------------
# help and usage errors


COMMANDS = ["table", "base-bound", "decay", "gap", "posgen", "demo", "eval", "eval passkey", "eval perplexity"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples(capsys, command):
    with pytest.raises(SystemExit) as exc:
        cli.main(command.split() + ["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "ropescale " + command.split()[0] in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("table", "base-bound", "decay", "gap", "posgen", "demo", "eval"):
        assert command in out


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["table", "--method", "rope9"], "argument --method: invalid choice: 'rope9'"),
    (["table", "--dim", "7"], "argument --dim: rotary dim must be even, got 7"),
    (["table", "--factor", "-2"], "argument --factor: must be a finite number > 0, got -2"),
    (["table", "--plot", "out.jpg"], "the file name must end in .png"),
    # LongRoPE's per-pair factor lists come from Python (scaling.LongRoPE): the CLI does not offer it (16.15).
    (["table", "--method", "longrope"], "argument --method: invalid choice: 'longrope'"),
    # issue 16.11: values the ops or the methods refuse were tracebacks.
    (["table", "--factor", "0.5"], "argument --factor: the scale factor s must be >= 1"),
    (["table", "--base", "1"], "argument --base: the RoPE base must be > 1, got 1"),
    (["decay", "--max-distance", "1000000000000"], "argument --max-distance: must be at most 16777216"),
    (["base-bound", "1000", "--dim", "2"], "base_lower_bound: no base up to 1e15 supports this context"),
    (["table", "--method", "ntk", "--factor", "2", "--dim", "2"], "ntk_inv_freq: dim must be > 2"),
    (["table", "--seq-len", "99999999999999999999999"], "argument --seq-len: must be at most 2^62"),
    # issue 55: the relation, with both values
    (["table", "--beta-fast", "1", "--beta-slow", "2"], "YaRN: beta_fast (1) must be greater than beta_slow (2)"),
    # The range of a value only a method reads is its dataclass's to check (issue 28): that message, as a usage error.
    (["table", "--beta-slow", "-1"], "YaRN: beta_slow must be a finite number > 0, got -1.0"),
    (["table", "--beta-fast", "x"], "argument --beta-fast: expected a number, got 'x'"),
    (["decay", "--method", "llama3", "--factor", "2", "--original-max-position", "0"],
     "argument --original-max-position: must be > 0, got 0"),
    (["posgen", "cot", "--modulus", "1000", "--n", "1000000", "--length", "1000000"], "is more than 134217728 tokens"),
    (["demo", "--threads", "100000"], "--threads (100000) must be at most the"),
    (["demo", "--train-length", "1", "--steps", "1"], "splits: length must be >= j + k = 4, got 1"),
    (["demo", "--output", "o", "--plot", "p.png"], "give --output DIR or --plot FILE.png, not both"),
    (["eval", "passkey", "/nonexistent/model", "--context-length", "64"],
     "MODEL: /nonexistent/model is not a local model directory"),
    # issue 16.6: --seq-len on a method whose table ignores it
    (["table", "--method", "yarn", "--seq-len", "5"], "--seq-len applies to the dynamic methods"),
    (["base-bound"], "the following arguments are required: L"),
    (["base-bound", "0"], "argument L: must be > 0, got 0"),
    (["decay", "--method", "linear"], "--method linear needs --factor"),
    (["gap", "--method", "resonance_yarn"], "--method resonance_yarn needs --factor"),
    (["decay", "--max-distance", "ten"], "argument --max-distance: expected an integer, got 'ten'"),
    (["gap", "--train-length", "64", "--test-length", "64"], "--test-length (64) must be > --train-length (64)"),
    (["posgen", "fibonacci"], "argument task: invalid choice: 'fibonacci'"),
    (["posgen", "cot", "--length", "3"], "--length (3) must be >= j + k = 4"),
    (["posgen", "cot", "--modulus", "2", "--j", "1", "--k", "1", "--n", "5"], "more than the 4 distinct prefixes"),
    (["demo", "--test-length", "16"], "--test-length (16) must be > --train-length (32)"),
    (["demo", "--steps", "0"], "argument --steps: must be > 0, got 0"),
    (["eval"], "the following arguments are required: EVALUATOR"),
    (["eval", "passkey", "some-model"], "the following arguments are required: --context-length"),
    (["eval", "perplexity", "some-model", "--text", "/nonexistent/file.txt"], "--text: cannot read"),
    (["eval", "passkey", "--context-length", "64"], "give a model directory (or hub name), or --gguf FILE"),
    (["eval", "passkey", "some-model", "--gguf", "--context-length", "64"], "not both"),
    (["eval", "passkey", "--gguf", "/nonexistent/m.gguf", "--context-length", "64"],
     "--gguf: /nonexistent/m.gguf: no such GGUF file or folder"),
    (["eval", "passkey", "--gguf", "README.md", "--context-length", "64"], "not a GGUF file"),
    (["eval", "passkey", "m", "--context-length", "64", "--leaky-k", "1"], "argument --leaky-k: must be > 1"),
    (["eval", "passkey", "m", "--context-length", "64", "--window", "0"], "argument --window: must be > 0, got 0"),
    (["eval", "passkey", "m", "--context-length", "64", "--method", "rerope"], "--method rerope needs --window W"),
    # as extend says it: the model's own table takes none of a table method's options
    (["eval", "passkey", "m", "--context-length", "64", "--method", "rerope", "--window", "8", "--floor", "2"],
     "--method rerope keeps the model's own table: --floor belong to a table method"),
    (["eval", "perplexity", "m", "--text", "t", "--logn"], "--leaky-k and --logn belong to ReRoPE: add --window W"),
])
def test_bad_arguments_exit_2_with_usage(capsys, argv, message):
    err = usage_error(capsys, *argv)
    assert message in err


def test_eval_usage_errors_found_after_loading(capsys, tmp_path, saved_model):
    # issue 16.11: a model whose max_position_embeddings (200) is below the default stride 256 was a
    # traceback; passkey at a length that cannot hold the prompt too.
    path, _, _ = saved_model
    text_file = tmp_path / "t.txt"
    text_file.write_text("abc " * 100)
    err = usage_error(capsys, "eval", "perplexity", str(path), "--text", str(text_file), "--device", "cpu")
    assert "--stride (256) must be <= the window (the model's max_position_embeddings: 200)" in err
    err = usage_error(capsys, "eval", "passkey", str(path), "--context-length", "20", "--device", "cpu")
    assert "context_length 20 cannot hold even the empty prompt" in err


def test_every_usage_error_is_one_line_after_the_usage(capsys):
    err = usage_error(capsys, "table", "--beta-fast", "1", "--beta-slow", "2")
    assert err.strip().splitlines()[-1].startswith("ropescale table: error: ") and "Traceback" not in err


def test_table_of_a_dynamic_method_follows_seq_len(capsys):
    # issue 16.6: --seq-len was ignored (s = 16, the table's default factor, for every length).
    for seq_len, scale in ((128, 2.0), (512, 8.0), (32, 1.0)):
        out = run_json(capsys, "table", "--method", "dynamic_yarn", "--original-max-position", "64", "--dim", "16",
                       "--seq-len", str(seq_len))
        assert out["seq_len"] == seq_len and out["rows"][-1]["scale"] == pytest.approx(scale, rel=1e-5)
        assert out["attention_factor"] == pytest.approx(scaling.DynamicYaRN(original_max_position=64)
                                                        .attention_factor_for(seq_len))
    text = run(capsys, "table", "--method", "dynamic_yarn", "--original-max-position", "64", "--dim", "16",
               "--seq-len", "512")
    assert text.splitlines()[0].startswith("dynamic_yarn, at length 512 (s = 8): rotary dim 16")
    fixed = run_json(capsys, "table", "--method", "dynamic_yarn", "--floor", "16", "--dim", "16",
                     "--original-max-position", "64", "--seq-len", "128")
    assert fixed["rows"][-1]["scale"] == pytest.approx(16.0, rel=1e-5)  # an explicit floor holds at every length


# Every --method name `table` takes, the options it is given, and the scaling method they describe.
METHOD_NAMES = {
    "default": ([], scaling.Default()),
    "resonance": ([], scaling.Default(resonance=True)),
    "linear": (["--factor", "2"], scaling.Linear(factor=2.0)),
    # no flag for partial_rotary_factor: the command line's proportional rotates every pair
    "proportional": (["--factor", "2"], scaling.Proportional(factor=2.0)),
    "ntk": (["--factor", "2", "--resonance"], scaling.NTK(factor=2.0, resonance=True)),
    "ntk_alpha": (["--alpha", "1000"], scaling.NTKAlpha(alpha=1000.0)),
    "dynamic": (["--factor", "2", "--seq-len", "9000"], scaling.DynamicNTK(factor=2.0, original_max_position=4096)),
    "dynamic_ntk": (["--factor", "3", "--seq-len", "9000", "--original-max-position", "1000"],
                    scaling.DynamicNTK(factor=3.0, original_max_position=1000)),
    "yarn": (["--factor", "2", "--original-max-position", "64", "--beta-fast", "16", "--beta-slow", "2"],
             scaling.YaRN(factor=2.0, original_max_position=64, beta_fast=16.0, beta_slow=2.0)),
    "resonance_yarn": ([], scaling.YaRN(factor=16.0, resonance=True)),  # table's default factor
    "dynamic_yarn": (["--floor", "2", "--seq-len", "9000", "--beta-fast", "8"],
                     scaling.DynamicYaRN(factor=2.0, beta_fast=8.0)),
    "llama3": (["--factor", "2", "--original-max-position", "64"],
               scaling.Llama3(factor=2.0, original_max_position=64)),
    "yarn_log": (["--factor", "2", "--original-max-position", "64", "--beta-fast", "8",
                  "--extrapolation-factor", "0.5"],
                 scaling.YaRNLog(factor=2.0, original_max_position=64, beta_fast=8.0, extrapolation_factor=0.5)),
    "theta_scale": (["--factor", "2", "--original-max-position", "64", "--resonance"],
                    scaling.ThetaScale(factor=2.0, original_max_position=64, resonance=True)),
}


def test_every_method_name_is_covered():
    table = next(a for a in cli._subparser(cli.build_parser(), ["table"])._actions if a.dest == "method")
    assert sorted(table.choices) == sorted(METHOD_NAMES)


@pytest.mark.parametrize("name", sorted(METHOD_NAMES))
def test_each_method_name_builds_its_scaling_method(capsys, name):
    options, method = METHOD_NAMES[name]
    out = run_json(capsys, "table", "--method", name, "--dim", "16", *options)
    seq_len = out.get("seq_len")
    assert [r["inv_freq"] for r in out["rows"]] == pytest.approx(method.inv_freq(16, 1e4, seq_len).tolist(), rel=1e-6)
    assert out["attention_factor"] == pytest.approx(method.attention_factor_for(seq_len))


@pytest.mark.parametrize("command", [["table"], ["decay"], ["gap"], ["eval", "passkey"], ["eval", "perplexity"],
                                     ["extend"]])
def test_method_options_are_the_same_in_every_command(command):
    # issue 28: declared once (cli/methods.py); a command picks the ones it takes and says its own defaults.
    parser = cli._subparser(cli.build_parser(), command)
    assert parser.prog == "ropescale " + " ".join(command)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    taken = [flag for flag in cli.methods.OPTIONS if flag in actions]
    assert {"--method", "--factor", "--floor", "--beta-fast", "--original-max-position", "--resonance"} <= set(taken)
    for flag in taken:
        option = cli.methods.OPTIONS[flag]
        assert actions[flag].type is option.type and actions[flag].help.startswith(option.help), flag


def test_dynamic_yarn_takes_a_floor_never_a_factor(capsys, tmp_path):
    # issue 27: `--factor 8` (help: "scale factor s") was dynamic_yarn's FLOOR, s >= 8 at every length: short
    # requests were no longer native. The floor has its own name; --factor is refused with the pointer.
    err = usage_error(capsys, "table", "--method", "dynamic_yarn", "--factor", "8", "--seq-len", "32")
    assert "--method dynamic_yarn takes no --factor" in err and "the FLOOR F at every length" in err
    assert "For a floor, --floor 8" in err
    err = usage_error(capsys, "table", "--method", "yarn", "--factor", "8", "--floor", "2")
    assert "--floor is dynamic_yarn's" in err
    out = run_json(capsys, "table", "--method", "dynamic_yarn", "--original-max-position", "64", "--dim", "16",
                   "--seq-len", "32")
    assert out["rows"][-1]["scale"] == pytest.approx(1.0, rel=1e-5)  # native below L
    # The other names of Dynamic NTK, and --compare (where --factor is the main method's, never a floor).
    named = run_json(capsys, "table", "--method", "dynamic_ntk", "--factor", "2", "--dim", "16", "--seq-len", "9000")
    plain = run_json(capsys, "table", "--method", "dynamic", "--factor", "2", "--dim", "16", "--seq-len", "9000")
    assert named.pop("method") == "dynamic_ntk" and plain.pop("method") == "dynamic" and named == plain
    run(capsys, "table", "--method", "yarn", "--factor", "8", "--original-max-position", "64", "--dim", "16",
        "--compare", "dynamic_yarn", "--plot", str(tmp_path / "w.png"))
    for command in (["table"], ["eval", "passkey"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert "applied at EVERY length" in help_text and "not for dynamic_yarn (see --floor)" in help_text


def test_eval_says_when_the_method_is_factor_one(capsys, tmp_path, saved_model):
    # issue 16.6: yarn below the trained length silently became s = 1.
    path, _, _ = saved_model
    text_file = tmp_path / "t.txt"
    text_file.write_text("abc " * 40)
    argv = ["eval", "perplexity", str(path), "--text", str(text_file), "--max-length", "100", "--stride", "50",
            "--device", "cpu", "--method", "yarn"]
    text = run(capsys, *argv)
    assert "note: --method yarn at 100 tokens, within the trained length 200: factor s = 1" in text
    out = run_json(capsys, *argv)
    assert out["factor"] == 1.0 and "factor s = 1" in out["note"]
    longer = run_json(capsys, *argv[:-1], "yarn", "--original-max-position", "50")
    assert longer["factor"] == 2.0 and "note" not in longer


def test_demo_writes_its_png_into_its_own_folder_never_the_current_one(capsys, tmp_path, monkeypatch):
    # issue 16.15: the PNG landed in the current directory (a checkout's root, untracked).
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert Path(cli.DEMO_OUTPUT).parent == Path(__import__("tempfile").gettempdir())
    # The default folder itself is the user's (the README's first command put its picture there): this test's
    # default is a folder of its own (issue 42; conftest checks the real one is left alone).
    from ropescale.cli import cmd_demo

    monkeypatch.setattr(cmd_demo, "DEMO_OUTPUT", str(tmp_path / "ropescale-demo"))
    text = run(capsys, "demo", "--train-length", "8", "--test-length", "16", "--steps", "2", "--quiet")
    default = tmp_path / "ropescale-demo" / "ropescale_demo.png"
    assert f"wrote {default}" in text and default.is_file()
    text = run(capsys, "demo", "--train-length", "8", "--test-length", "16", "--steps", "2", "--quiet",
               "--output", str(tmp_path / "out"))
    assert f"wrote {tmp_path / 'out' / 'ropescale_demo.png'}" in text
    assert list(cwd.iterdir()) == []


def _waits_on_a_running_thread(pid: int) -> bool:
    states = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states[int(tid)] = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended
            pass
    return states.get(pid) == "S" and any(state == "R" for tid, state in states.items() if tid != pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread states from /proc")
def test_ctrl_c_ends_a_long_native_command_within_a_second():
    # issue 16.9: base-bound 1000000 (~100 s in one native call) ignored SIGINT for 30 s.
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # SIGINT back to its default in the child, whatever the test runner's shell did with it.
    proc = subprocess.Popen([sys.executable, "-m", "ropescale", "base-bound", "1000000"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # 2 s, and past the imports (slow on a loaded machine): the main thread waits while another
        # thread runs the native loop (Linux /proc; one thread's state is the letter after its name).
        # (At most 15 s: a CLI that runs the loop on its main thread never shows that state.)
        started, running = time.monotonic(), 0
        while (running < 3 or time.monotonic() - started < 2.0) and time.monotonic() - started < 15:
            assert proc.poll() is None, proc.communicate()
            running = running + 1 if _waits_on_a_running_thread(proc.pid) else 0
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=5)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted"]
    assert elapsed < 1.0, f"exited {elapsed:.2f} s after SIGINT"


def test_python_dash_m_and_console_entry():
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ok = subprocess.run([sys.executable, "-m", "ropescale", "base-bound", "1024", "--dim", "64", "--json"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["bounds"][0]["context_length"] == 1024
    bad = subprocess.run([sys.executable, "-m", "ropescale", "table", "--dim", "odd"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "usage: ropescale table" in bad.stderr


def test_version(capsys):
    # issue 55: `ropescale --version` was not an option
    import ropescale

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"ropescale {ropescale.__version__}\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{ropescale.__version__}"\n' in pyproject  # one version, said the same in both places


@pytest.mark.parametrize("argv, message", [
    (["--position-sampling", "--train-length", "32"], "CREAM: a window of 32 leaves no middle"),
    (["--train-length", "1", "--steps", "1"], "splits: length must be >= j + k = 4, got 1"),
])
def test_a_refused_demo_makes_no_folder(capsys, tmp_path, monkeypatch, argv, message):
    # issue 55: the default output folder (or --output's) was made before the run refused its settings
    from ropescale.cli import cmd_demo

    monkeypatch.setattr(cmd_demo, "DEMO_OUTPUT", str(tmp_path / "default" / "ropescale-demo"))
    assert message in usage_error(capsys, "demo", *argv)
    assert message in usage_error(capsys, "demo", *argv, "--output", str(tmp_path / "out" / "deeper"))
    assert list(tmp_path.iterdir()) == []
    # a folder that cannot be made is said before the run
    (tmp_path / "file").write_text("")
    err = usage_error(capsys, "demo", "--output", str(tmp_path / "file" / "out"))
    assert f"--output: {tmp_path / 'file'} is a file, so {tmp_path / 'file' / 'out'} cannot be made" in err
    err = usage_error(capsys, "demo", "--plot", str(tmp_path / "missing" / "demo.png"))
    assert f"--plot: the folder {tmp_path / 'missing'} does not exist" in err
