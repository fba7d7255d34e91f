"""ropescale.tstl: a RoPE-trained model tested with YaRN's table is transformers' own YaRN model,
per-position accuracy, a model that really learns PosGen, one training per table, every method run."""

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from ropescale import hf, posgen, scaling, tstl  # noqa: E402


# Tiny models: one intra-op thread (conftest.py's one_thread fixture).
pytestmark = pytest.mark.usefixtures("one_thread")


def llama(rope_parameters, seed=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(vocab_size=31, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                             rope_parameters={**rope_parameters, "rope_theta": 10000.0}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention, so the rope differences show in the logits
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(3.0)
    return model


def test_test_time_yarn_is_transformers_yarn():
    # What the YaRN rows do: a model built for RoPE, patched with YaRN's table at test time, is the
    # model transformers builds for that YaRN config, logit for logit.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    native = llama(yarn)
    ours = llama({"rope_type": "default"})
    ours.load_state_dict(native.state_dict())
    x = torch.randint(31, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = ours(x).logits
        hf.patch(ours, scaling.YaRN(factor=4.0, original_max_position=32))
        after = ours(x).logits
        expected = native(x).logits
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    assert (before - expected).abs().max() > 1e-2  # the table really changed the model


def test_position_accuracy_counts_argmax_hits():
    model = llama({"rope_type": "default"}, seed=3)
    data = torch.randint(31, (37, 20), generator=torch.Generator().manual_seed(1))
    acc = tstl.position_accuracy(model, data, batch_size=10)
    assert acc.shape == (20,) and acc.dtype == torch.float64 and math.isnan(acc[0])
    with torch.no_grad():
        for l in (1, 7, 19):
            hits = sum(int(model(data[i : i + 1, :l]).logits[0, -1].argmax() == data[i, l]) for i in range(37))
            assert acc[l] == pytest.approx(hits / 37)


def test_a_tiny_model_learns_posgen():
    # x_l = x_{l-3} + x_{l-2} + x_{l-1} mod 7: chance is 1/7; a working loop gets far past it.
    data = posgen.splits("recursive", 300, 0, 20, train_length=16, test_length=32, j=1, k=2, modulus=7, seed=0)
    torch.manual_seed(0)
    model = tstl.build_model(7, tstl.TINY, 16, seed=0)
    before = tstl.position_accuracy(model, data.test)
    loss = tstl.train(model, data.train, 3, tstl.TrainConfig(steps=120, lr=3e-3), seed=0)
    after = tstl.position_accuracy(model, data.test)
    assert loss < 1.0
    assert float(after[3:16].mean()) > 0.8 > float(before[3:16].mean()) + 0.4


def test_run_task_trains_once_per_table_and_scores_the_right_positions(monkeypatch):
    calls = []
    real_train = tstl.train

    def counting_train(model, sequences, first_target, config, seed=0, progress=False, desc=""):
        calls.append((model._ropescale_patch.method, first_target, sequences.shape))
        return real_train(model, sequences, first_target, config, seed, progress, desc)

    monkeypatch.setattr(tstl, "train", counting_train)
    data = posgen.splits("cot", 50, 0, 10, train_length=12, test_length=48, seed=0)
    methods = tstl.paper_methods(12) + tstl.inference_methods(12)
    results = tstl.run_task(data, methods, tstl.TINY, tstl.TrainConfig(steps=3), seed=0)
    # RoPE and Resonance RoPE; the YaRN, ReRoPE and Dynamic-YaRN rows reuse those models.
    assert [c[0] for c in calls] == [scaling.Default(), scaling.Default(resonance=True)]
    assert all(c[1] == 4 and c[2] == (50, 12) for c in calls)
    assert [r.method for r in results] == [m.name for m in methods]
    for r in results:
        assert r.accuracy.shape == (48,)
        assert r.id_accuracy == pytest.approx(float(r.accuracy[4:12].mean()))
        assert r.ood_accuracy == pytest.approx(float(r.accuracy[12:].mean()))


def test_run_task_tests_each_method_with_its_own_table_and_attention(monkeypatch):
    seen = []
    real = tstl.position_accuracy

    def recording(model, sequences, batch_size=250, incremental=False):
        state = model._ropescale_patch
        seen.append((state.method, state.attention, state.window, incremental))
        return real(model, sequences, batch_size, incremental)

    monkeypatch.setattr(tstl, "position_accuracy", recording)
    data = posgen.splits("recursive", 30, 0, 6, train_length=12, test_length=48, seed=0)
    methods = tstl.paper_methods(12) + tstl.inference_methods(12, rerope_window=5)
    tstl.run_task(data, methods, tstl.TINY, tstl.TrainConfig(steps=2), seed=0)
    assert seen == [(m.test, m.attention, m.window, m.test.dynamic) for m in methods]
    assert seen[4] == (scaling.Default(), "rerope", 5, False)
    assert seen[5] == (scaling.DynamicYaRN(original_max_position=12), "sdpa", None, True)


def test_incremental_accuracy():
    # Token by token through the pre-RoPE cache: a static table scores as the full forward does, and
    # Dynamic-YaRN is plain RoPE up to the original length, then not.
    data = posgen.splits("cot", 300, 0, 40, train_length=16, test_length=64, seed=0)
    model = tstl.build_model(17, tstl.TINY, 16, seed=0)
    hf.patch(model, scaling.Default())
    tstl.train(model, data.train, 4, tstl.TrainConfig(steps=60, lr=3e-3), seed=0)
    full = tstl.position_accuracy(model, data.test)
    torch.testing.assert_close(tstl.position_accuracy(model, data.test, batch_size=16, incremental=True), full,
                               atol=1 / 40 + 1e-9, rtol=0, equal_nan=True)  # at most one argmax flip per position
    hf.unpatch(model)
    hf.patch(model, scaling.DynamicYaRN(original_max_position=16))
    dynamic = tstl.position_accuracy(model, data.test, incremental=True)
    whole = tstl.position_accuracy(model, data.test)  # the table for length 63 at every position
    torch.testing.assert_close(dynamic[1:17], full[1:17], atol=1 / 40 + 1e-9, rtol=0)
    assert (whole[1:17] - full[1:17]).abs().max() > 0.05


def test_paper_methods_tables():
    rope, res, yarn, res_yarn = tstl.paper_methods(64, factor=4.0)
    assert (rope.name, res.name, yarn.name, res_yarn.name) == (
        "RoPE", "Resonance RoPE", "YaRN (s=4)", "Resonance YaRN (s=4)")
    assert rope.train == rope.test == yarn.train == scaling.Default()
    assert res.train == res.test == res_yarn.train == scaling.Default(resonance=True)
    assert yarn.test == scaling.YaRN(factor=4.0, original_max_position=64)
    assert res_yarn.test == scaling.YaRN(factor=4.0, original_max_position=64, resonance=True)
    assert tstl.paper_ood("cot", yarn.name) == 98.71 and tstl.paper_ood("cot", "ReRoPE") is None


def test_inference_methods():
    rerope, dynamic = tstl.inference_methods(32)
    assert (rerope.name, rerope.attention, rerope.window, rerope.train) == ("ReRoPE (w=16)", "rerope", 16, scaling.Default())
    assert dynamic.test == scaling.DynamicYaRN(original_max_position=32) and dynamic.train == scaling.Default()


def test_benchmark_script_runs_end_to_end(capsys, tmp_path):
    import importlib.util
    import json
    from support import ROOT

    path = ROOT / "benchmarks" / "posgen_tstl.py"
    spec = importlib.util.spec_from_file_location("posgen_tstl_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = tmp_path / "r.json"
    code = bench.main(["--tasks", "cot", "--seeds", "2", "--steps", "4", "--n-test", "20", "--train-length", "12",
                       "--markdown", "--json", str(result), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    # 4 steps learn nothing: the in-distribution gate withholds the OOD figures, and says why.
    assert "cot: OOD withheld: the RoPE model reached only" in out
    assert "| cot | YaRN (s=4) |" in out
    saved = json.loads(result.read_text())
    assert len(saved["runs"]) == 2 * 6 and {r["seed"] for r in saved["runs"]} == {0, 1}
    assert all(len(r["accuracy_by_position"]) == 48 for r in saved["runs"])
    assert [row["method"] for row in saved["table"]][:4] == ["RoPE", "Resonance RoPE", "YaRN (s=4)",
                                                              "Resonance YaRN (s=4)"]
    assert all(row["gate"] is False for row in saved["table"])
    # A saved run re-renders to the same table without training.
    assert bench.main(["--from-json", str(result), "--markdown"]) == 0
    again = capsys.readouterr().out
    table_lines = [line for line in out.splitlines() if line.startswith("| cot")]
    assert table_lines and table_lines == [line for line in again.splitlines() if line.startswith("| cot")]


# ---------------------------------------------------------------------------------------------
# Position sampling (issue 46, part 2): train at W with PoSE / CREAM positions to 4W, test at 4W


def _rule_holds(task, ids, pos, labels, j=1, k=3, modulus=17):
    """Every scored token of a sampled row is the rule applied to the row's tokens at the positions the rule names."""
    at = {int(p): int(t) for p, t in zip(pos, ids)}
    checked = 0
    for r in range(len(ids)):
        if labels[r] != -100:
            deps = tstl.dependencies(task, int(pos[r]), j, k)
            assert sum(at[q] for q in deps) % modulus == int(ids[r])
            checked += 1
    return checked


@pytest.mark.parametrize("task", posgen.TASKS)
@pytest.mark.parametrize("name, window, target", [("pose", 12, 48), ("cream", 36, 144)])
def test_sampled_targets_are_defined_by_the_sample(task, name, window, target):
    import random

    import numpy as np

    x = posgen.generate(task, 16, target, seed=3)
    sampler = tstl.make_sampler(name, window, target)
    batch = tstl.sampled_batch(x, sampler, task, 1, 3, random.Random(0), np.random.RandomState(0))
    assert batch["input_ids"].shape == batch["position_ids"].shape == (16, window)
    assert int(batch["position_ids"].max()) >= window  # the positions reach past the window
    scored = sum(_rule_holds(task, *row) for row in zip(batch["input_ids"], batch["position_ids"], batch["labels"]))
    assert scored > (16 * window // 4 if task != "semi_recursive" or name == "cream" else 0)


def test_defined_targets_by_hand():
    # two chunks: 0..5 at their own positions, 20..24 at 30..34 (a PoSE skip of 10)
    indices, positions = [0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24], [0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 34]
    F, T = False, True
    # CoT reads x_0 (at position 0 in both) and the last 3: the chunk's 4th token on is defined
    assert tstl.defined_targets("cot", indices, positions) == [F, F, F, F, T, T, F, F, F, T, T]
    # recursive reads the last 4
    assert tstl.defined_targets("recursive", indices, positions) == [F, F, F, F, T, T, F, F, F, F, T]
    # semi-recursive's far token is x_8 for x_20..21, but position 30's is position 13: nothing past the skip
    assert tstl.defined_targets("semi_recursive", indices, positions) == [F, F, F, F, T, T, F, F, F, F, F]
    # with no skip (positions = indices) the far tokens must be in the sample: x_20's far token x_8 is not
    assert tstl.defined_targets("semi_recursive", list(range(12)), list(range(12))) == [F] * 4 + [T] * 8
    assert tstl.dependencies("semi_recursive", 20) == [8, 17, 18, 19]


@pytest.mark.parametrize("name, window, target", [("pose", 12, 48), ("cream", 36, 144)])
def test_sampled_training_feeds_the_sampled_positions(name, window, target):
    # A spy on the forward: the sampled training passes position_ids, window - 1 tokens long (as train() feeds a
    # window-long sequence), reaching past the window; the loss is on the defined targets only.
    data = posgen.splits("cot", 40, 0, 0, target, target, seed=0)
    model = tstl.build_model(17, tstl.TINY, window, seed=0)
    hf.patch(model, scaling.Default())
    seen = []

    def spy(module, args, kwargs):
        seen.append((kwargs["input_ids"].clone(), kwargs.get("position_ids")))

    model.register_forward_pre_hook(spy, with_kwargs=True)
    config = tstl.TrainConfig(steps=3, batch_size=4)
    loss, scored = tstl.train_sampled(model, data.train, tstl.make_sampler(name, window, target), "cot", 1, 3,
                                      config, seed=0)
    assert len(seen) == 3 and math.isfinite(loss) and 0.5 < scored < 1
    for ids, pos in seen:
        assert ids.shape == pos.shape == (4, window - 1)
        assert bool((pos[:, 1:] > pos[:, :-1]).all()) and int(pos.max()) < target
    assert max(int(pos.max()) for _, pos in seen) >= window
    # the plain row: no position ids, the first window tokens
    seen.clear()
    tstl.train(model, data.train[:, :window], 4, config, seed=0)
    assert all(pos is None and ids.shape == (4, window - 1) for ids, pos in seen)


def _cell(task, seed, table, training, ood, id_=0.97, window=48, target=192, scored=None):
    return {"task": task, "seed": seed, "table": table, "training": training, "window": window, "target": target,
            "first_target": 4, "table_name": tstl.sampling_table_for(table, window, target)[0],
            "label": tstl.SamplingCell(table, training).label(window, target), "id_accuracy": id_,
            "ood_accuracy": ood, "scored_fraction": scored}


def test_summary_computes_recovered_fraction_from_the_measured_accuracies():
    cells = []
    # RoPE: seed means short 0.6, pose 0.8, cream 0.7, long 1.0 -> recovered 50% and 25%
    for seed, (short, pose, cream, long) in enumerate([(0.5, 0.9, 0.7, 1.0), (0.7, 0.7, 0.7, 1.0)]):
        cells += [_cell("cot", seed, "rope", "short", short), _cell("cot", seed, "rope", "pose", pose, scored=0.8),
                  _cell("cot", seed, "rope", "cream", cream, scored=0.7), _cell("cot", seed, "rope", "long", long)]
    # YaRN: trained at W is already within a point of trained at 4W: no fraction
    for seed in (0, 1):
        cells += [_cell("cot", seed, "yarn", "long", 0.995), _cell("cot", seed, "yarn", "short", 0.99),
                  _cell("cot", seed, "yarn", "pose", 0.98, scored=0.8)]
    rows = tstl.summarize_sampling(cells)
    by = {(r["table"], r["training"]): r for r in rows}
    assert [(r["table"], r["training"]) for r in rows] == [
        ("rope", "short"), ("rope", "pose"), ("rope", "cream"), ("rope", "long"),
        ("yarn", "short"), ("yarn", "pose"), ("yarn", "long")]
    assert by["rope", "pose"]["recovered"] == pytest.approx((0.8 - 0.6) / (1.0 - 0.6))
    assert by["rope", "cream"]["recovered"] == pytest.approx((0.7 - 0.6) / (1.0 - 0.6))
    assert by["rope", "pose"]["ood"] == pytest.approx((0.8, math.sqrt(0.02)))
    assert by["rope", "pose"]["wins"] == (1, 2) and by["rope", "cream"]["wins"] == (1, 2)
    assert by["rope", "short"]["recovered"] is None and by["rope", "long"]["recovered"] is None
    assert by["yarn", "pose"]["recovered"] is None and by["yarn", "pose"]["gap"] == pytest.approx(0.005)
    text = tstl.format_sampling_table(rows)
    assert "recovered = (OOD(sampled) - OOD(trained at W)) / (OOD(trained at 4W) - OOD(trained at W))" in text
    md = tstl.format_sampling_table(rows, markdown=True)
    assert "| cot | RoPE | W + PoSE | 97.0 ± 0.0 | 80.0 ± 14.1 | 50% | 1/2 | 80% |" in md
    assert "| cot | RoPE | W + CREAM | 97.0 ± 0.0 | 70.0 ± 0.0 | 25% | 1/2 | 70% |" in md
    assert "| cot | YaRN (s=4) | W + PoSE | 97.0 ± 0.0 | 98.0 ± 0.0 | n/a (gap +0.5 pts) | 0/2 | 80% |" in md
    assert "| cot | RoPE | trained at 4W | 97.0 ± 0.0 | 100.0 ± 0.0 | (reference) |  |  |" in md


def test_position_sampling_bad_inputs_fail_before_training(monkeypatch):
    monkeypatch.setattr(tstl, "train", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(ValueError, match=r"target \(32\) must be > window \(48\)"):
        tstl.run_position_sampling("cot", 48, 32)
    with pytest.raises(ValueError, match="unknown position sampler 'yarn': choose one of pose, cream"):
        tstl.run_position_sampling("cot", 48, samplers=("pose", "yarn"))
    with pytest.raises(ValueError, match="unknown table 'ntk'"):
        tstl.run_position_sampling("cot", 48, tables=("ntk",))
    with pytest.raises(ValueError, match="CREAM: a window of 32 leaves no middle"):
        tstl.run_position_sampling("cot", 32)
    with pytest.raises(ValueError, match="unknown position sampler 'Self-Extend'"):
        tstl.make_sampler("Self-Extend", 48, 192)
    with pytest.raises(ValueError, match=r"target \(40\) must be > window \(48\)"):
        tstl.make_sampler("pose", 48, 40)


def test_run_position_sampling_rows(monkeypatch):
    data_seen = []
    real = tstl.run_sampling_cell

    def recording(data, cell, window, *args):
        data_seen.append((cell, data.train.shape, data.test.shape))
        return real(data, cell, window, *args)

    monkeypatch.setattr(tstl, "run_sampling_cell", recording)
    got = []
    results = tstl.run_position_sampling("recursive", 8, samplers=("pose",), train_config=tstl.TrainConfig(steps=2),
                                         n_train=20, n_test=5, skip=lambda c: c == tstl.SamplingCell("yarn", "long"),
                                         on_result=got.append)
    assert [(r.table, r.training) for r in results] == [
        ("rope", "short"), ("rope", "pose"), ("rope", "long"), ("yarn", "short"), ("yarn", "pose")]
    assert got == results and all(shape == (20, 32) and test == (5, 32) for _, shape, test in data_seen)
    for r in results:
        assert r.accuracy.shape == (32,) and r.window == 8 and r.target == 32
        assert r.ood_accuracy == pytest.approx(float(r.accuracy[8:].mean()))
        assert r.id_accuracy == pytest.approx(float(r.accuracy[4:8].mean()))
        assert r.scored_fraction == pytest.approx({"short": 4 / 7, "long": 28 / 31}.get(r.training, r.scored_fraction))
        assert 0 < r.scored_fraction < 1
    assert results[3].as_dict()["table_name"] == "YaRN (s=4)" and results[1].as_dict()["label"] == "W + PoSE"


def _load_sampling_bench():
    import importlib.util
    from support import ROOT

    spec = importlib.util.spec_from_file_location("position_sampling_bench",
                                                  ROOT / "benchmarks" / "position_sampling_tstl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_sampling_benchmark_resumes_from_a_partial_results_file(capsys, tmp_path, monkeypatch):
    import json

    bench = _load_sampling_bench()
    results = tmp_path / "cells.jsonl"
    argv = ["--window", "8", "--samplers", "pose", "--steps", "2", "--n-train", "20", "--n-test", "5", "--seeds",
            "1", "--results", str(results), "--quiet", "--markdown"]
    assert bench.main(argv) == 0
    lines = results.read_text().splitlines()
    assert len(lines) == 6 and {json.loads(x)["training"] for x in lines} == {"short", "pose", "long"}
    first = capsys.readouterr().out
    # interrupted after two cells, the third half written
    results.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    ran = []
    real = tstl.run_sampling_cell
    monkeypatch.setattr(tstl, "run_sampling_cell", lambda data, cell, *a: ran.append(cell) or real(data, cell, *a))
    assert bench.main(argv) == 0
    assert [(c.table, c.training) for c in ran] == [("rope", "long"), ("yarn", "short"), ("yarn", "pose"),
                                                    ("yarn", "long")]
    rows = [json.loads(x) for x in results.read_text().splitlines() if x.startswith("{") and x.endswith("}")]
    assert len(rows) == 6 and rows[:2] == [json.loads(x) for x in lines[:2]]
    out = capsys.readouterr().out
    assert "6/6 cells" in out and "| recursive |" not in out and "| cot | RoPE | W + PoSE |" in out
    # the two cells kept from the first run print as they did
    keep = [line for line in first.splitlines() if line.startswith("| cot | RoPE | trained at W |")]
    assert keep and keep == [line for line in out.splitlines() if line.startswith("| cot | RoPE | trained at W |")]
    # other settings do not mix with these cells; --from-results trains nothing
    ran.clear()
    assert bench.main(argv[:-2] + ["--from-results", "--steps", "3"]) == 1 and not ran
    assert "no results yet" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown position sampler 'posse'"):
        bench.main(["--samplers", "posse", "--results", str(results)])
