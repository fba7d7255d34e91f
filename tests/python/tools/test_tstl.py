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
