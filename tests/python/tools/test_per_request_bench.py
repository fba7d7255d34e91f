"""benchmarks/per_request.py end to end, on a tiny Llama and a character tokenizer (the real checkpoint takes
minutes at these lengths; real_model.py's own test covers it), with synthetic "novels" in place of the Austen
package: the tables' shape, the `=` it may print, per request equal to per step on one forward (the identity
the `=` rests on), and static YaRN s=4 differing from native on short windows."""

from __future__ import annotations

import importlib.util
import json
import random
import sys

import pytest

pytest.importorskip("transformers")

from support import ROOT  # noqa: E402
from support.tiny_lm import char_tokenizer, tiny_llama  # noqa: E402

from ropescale import realmodel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = ["512", "1024"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("per_request_bench", ROOT / "benchmarks" / "per_request.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def fake_books():
    """Six 'novels' of random words, one line each, keyed by title as real_model.austen_books keys them."""
    rng = random.Random(0)
    words = "the of and to a in was her it he that she not be his had as with for you at".split()
    titles = ["PRIDE AND PREJUDICE", "EMMA", "PERSUASION", "MANSFIELD PARK", "NORTHANGER ABBEY",
              "SENSE AND SENSIBILITY"]
    return {t: [t.title()] + [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400)] for t in titles}


@pytest.fixture
def tiny(bench, monkeypatch):
    tokenizer = char_tokenizer()
    # sharper attention than the default init (weights x 4), so the rotary tables show in the loss
    model = tiny_llama(len(tokenizer), max_position=bench.TRAINED, layers=2, attn_implementation="sdpa")
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    monkeypatch.setattr(realmodel, "load_gguf", lambda path=None, **kw: (model, tokenizer))
    monkeypatch.setattr(bench.real_model, "austen_books", fake_books)
    return model, tokenizer


def test_per_request_script_end_to_end(bench, tiny, capsys, tmp_path):
    out_json = tmp_path / "r.json"
    assert bench.main(["--lengths", *LENGTHS, "--windows", "6", "--trials", "1", "--threads", "1",
                       "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    names = [m.name for m in bench.METHODS.values()]
    short = [line for line in out.splitlines() if line.startswith("| ") and line.count("|") == 7]
    assert short[0].startswith("| method | windows | mean loss | difference from native | 95% CI |")
    assert [line.split(" | ")[0][2:] for line in short[1:]] == names
    grids = [line for line in out.splitlines() if line.startswith("| ") and line.count("|") == len(LENGTHS) + 2]
    # perplexity then passkey: a header and a line per row each
    assert len(grids) == 2 * (1 + len(names)) and grids[0] == grids[len(names) + 1] == "| method | 512 | 1k |"
    def cells(line):
        name, *values = line.strip("| ").split(" | ")
        return name, values

    ppl, passkey = dict(map(cells, grids[1:len(names) + 1])), dict(map(cells, grids[len(names) + 2:]))
    assert list(ppl) == list(passkey) == names
    # `=` only on per request's row (per step's forward, copied): perplexity at every length, passkey up to L
    for grid in (ppl, passkey):
        marked = {name: all(v.endswith("=") for v in values)
                  for name, values in grid.items() if any("=" in v for v in values)}
        assert marked == {"Dynamic-YaRN per request": True}
        assert grid["Dynamic-YaRN per request"] == [v + "=" for v in grid["native"]]  # 512 and 1k: within L

    saved = json.loads(out_json.read_text())
    loss, summary = saved["short"]["loss"], {s["method"]: s for s in saved["short"]["summary"]}
    assert len(saved["short"]["windows"]) == 6 and all(512 <= w["length"] <= 2048 for w in saved["short"]["windows"])
    assert {w["book"] for w in saved["short"]["windows"]} == {"PRIDE AND PREJUDICE", "EMMA", "PERSUASION"}
    # one forward is a whole request with N = 0 within L: per request IS the native model, window by window
    assert loss["Dynamic-YaRN per request"] == loss["native"]
    # below L the dynamic rows and ReRoPE (every distance < w) are native up to float noise: measured, not assumed
    for name in names[2:]:
        assert summary[name]["largest"] < 1e-4, (name, summary[name])
    assert summary["native"]["difference"] == 0.0 and summary["native"]["half_ci"] == 0.0
    # static YaRN s=4 is not native at short prompts
    yarn = summary["YaRN s=4"]
    assert abs(yarn["difference"]) > 100 * max(summary[name]["largest"] for name in names[2:])
    cells = {(c["method"], c["length"]): c for c in saved["long"]}
    assert len(cells) == len(names) * len(LENGTHS)
    assert all(len(c["passkey_trials"]) == 1 and c["passkey"] in (0.0, 1.0) for c in cells.values())


def test_per_request_perplexity_is_per_steps_forward(bench, tiny):
    # What the `=` copies: run the forwards (reuse=False): per request is native's to the bit within L = 8192 (the
    # model's own rotary), per step's past it, where the table is YaRN's at s = 9000 / 8192.
    model, tokenizer = tiny
    cells = bench.long_cells(model, tokenizer, ["native", "dynamic_step", "dynamic_request"], [1024, 9000], trials=0,
                             reuse=False)
    # and the passkey up to L: both rows run the same tables at every step, the same answers
    small = bench.long_cells(model, tokenizer, ["dynamic_step", "dynamic_request"], [1024], trials=1, reuse=False)
    assert small[0].passkey_trials == small[1].passkey_trials and small[1].passkey_same_as is None
    native = [c.perplexity for c in cells if c.method == "native"]
    step = [c.perplexity for c in cells if c.method == "Dynamic-YaRN per step"]
    request = [c.perplexity for c in cells if c.method == "Dynamic-YaRN per request"]
    # (past L both take YaRN's table at s = 9000 / 8192; per request forms its cos/sin per row, per step per group:
    # the same values up to the last bits of float64 rounding)
    assert request[0] == native[0] and request[1] == pytest.approx(step[1], rel=1e-9)
    assert all(c.perplexity_same_as is None for c in cells)
    assert step[0] == pytest.approx(native[0], rel=1e-5) and step[1] != pytest.approx(native[1], rel=1e-4)


def test_budget_options_run_fewer_cells_and_say_so(bench, tiny, capsys, tmp_path):
    out_json = tmp_path / "r.json"
    assert bench.main(["--lengths", *LENGTHS, "--windows", "5", "--short-lengths", "512", "700", "--check-windows", "2",
                       "--trials", "1", "--passkey-lengths", "1024", "--passkey-methods", "yarn4", "--threads", "1",
                       "--json", str(out_json)]) == 0
    saved = json.loads(out_json.read_text())
    counts = {s["method"]: s["windows"] for s in saved["short"]["summary"]}
    assert counts == {"native": 5, "YaRN s=4": 5, **{bench.METHODS[k].name: 2 for k in bench.NATIVE_WHEN_SHORT}}
    assert all(512 <= w["length"] <= 700 for w in saved["short"]["windows"])
    ran = {(c["method"], c["length"]) for c in saved["long"] if c["passkey"] is not None}
    assert ran == {("YaRN s=4", 1024)}
    assert "| native | - | - |" in capsys.readouterr().out  # its passkey row: not run, and said so
    with pytest.raises(SystemExit):  # those rows are native only while every window is within w and L
        bench.main(["--lengths", "512", "--windows", "2", "--short-lengths", "512", "4096", "--check-windows", "1"])
