"""ropescale.tstl and _apply_rope: tables written into a transformers model (parity with transformers'
own YaRN), per-position accuracy, a model that really learns PosGen, one training per table."""

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from ropescale import posgen, scaling, tstl  # noqa: E402
from ropescale._apply_rope import apply_scaling  # noqa: E402


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


def test_apply_scaling_matches_transformers_yarn():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    native = llama(yarn)
    ours = llama({"rope_type": "default"})
    ours.load_state_dict(native.state_dict())
    x = torch.randint(31, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = ours(x).logits
        apply_scaling(ours, scaling.YaRN(factor=4.0, original_max_position=32))
        after = ours(x).logits
        expected = native(x).logits
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    assert (before - expected).abs().max() > 1e-2  # the table really changed the model
    rotary = ours.model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    torch.testing.assert_close(rotary.original_inv_freq, rotary.inv_freq)


def test_apply_scaling_writes_resonance_table_and_back():
    model = llama({"rope_type": "default"})
    default = model.model.rotary_emb.inv_freq.clone()
    apply_scaling(model, scaling.Default(resonance=True))
    table = model.model.rotary_emb.inv_freq
    torch.testing.assert_close(table, scaling.Default(resonance=True).inv_freq(16, 10000.0))
    wavelengths = 2 * math.pi / table.double()
    torch.testing.assert_close(wavelengths, wavelengths.round(), rtol=1e-6, atol=1e-4)
    apply_scaling(model, scaling.Default())
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, default)


def test_apply_scaling_bad_input():
    with pytest.raises(ValueError, match="apply_scaling: DynamicYaRN is dynamic and needs ropescale.hf.patch"):
        apply_scaling(llama({"rope_type": "default"}), scaling.DynamicYaRN(original_max_position=32))
    with pytest.raises(ValueError, match="apply_scaling: Linear has no rotary embedding module"):
        mod = torch.nn.Linear(2, 2)
        mod.config = llama({"rope_type": "default"}).config
        apply_scaling(mod, scaling.Default())


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
        calls.append((model.model.rotary_emb.inv_freq.clone(), first_target, sequences.shape))
        return real_train(model, sequences, first_target, config, seed, progress, desc)

    monkeypatch.setattr(tstl, "train", counting_train)
    data = posgen.splits("cot", 50, 0, 10, train_length=12, test_length=48, seed=0)
    methods = tstl.paper_methods(12)
    results = tstl.run_task(data, methods, tstl.TINY, tstl.TrainConfig(steps=3), seed=0, extra_methods="reason")
    assert len(calls) == 2  # RoPE and Resonance RoPE; the YaRN rows reuse those models
    torch.testing.assert_close(calls[0][0], scaling.Default().inv_freq(32, 1e4))
    torch.testing.assert_close(calls[1][0], scaling.Default(resonance=True).inv_freq(32, 1e4))
    assert all(c[1] == 4 and c[2] == (50, 12) for c in calls)
    assert [r.method for r in results] == [m.name for m in methods] + ["ReRoPE", "Dynamic-YaRN"]
    for r in results[:4]:
        assert r.accuracy.shape == (48,)
        assert r.id_accuracy == pytest.approx(float(r.accuracy[4:12].mean()))
        assert r.ood_accuracy == pytest.approx(float(r.accuracy[12:].mean()))
    assert results[4].accuracy is None and results[4].note == "reason" and math.isnan(results[4].ood_accuracy)


def test_paper_methods_tables():
    rope, res, yarn, res_yarn = tstl.paper_methods(64, factor=4.0)
    assert (rope.name, res.name, yarn.name, res_yarn.name) == (
        "RoPE", "Resonance RoPE", "YaRN (s=4)", "Resonance YaRN (s=4)")
    assert rope.train == rope.test == yarn.train == scaling.Default()
    assert res.train == res.test == res_yarn.train == scaling.Default(resonance=True)
    assert yarn.test == scaling.YaRN(factor=4.0, original_max_position=64)
    assert res_yarn.test == scaling.YaRN(factor=4.0, original_max_position=64, resonance=True)
    assert tstl.paper_ood("cot", yarn.name) == 98.71 and tstl.paper_ood("cot", "ReRoPE") is None


def test_inference_time_methods_run_or_say_why():
    extra = tstl.hf_methods(12)
    if not (hasattr(torch.ops.ropescale, "rerope_attention") and hasattr(torch.ops.ropescale, "apply_rotary_pos")):
        assert isinstance(extra, str) and extra.startswith("needs")
        return
    # With the ops built in, the rows really run on the RoPE model through ropescale.hf.
    data = posgen.splits("cot", 30, 0, 6, train_length=12, test_length=48, seed=0)
    results = tstl.run_task(data, tstl.paper_methods(12)[:1], tstl.TINY, tstl.TrainConfig(steps=3), extra_methods=extra)
    assert [r.method for r in results][1:] == [m.name for m in extra]
    assert all(r.accuracy is not None and r.accuracy.shape == (48,) for r in results)


def test_benchmark_script_runs_end_to_end(capsys, tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "posgen_tstl.py"
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
    assert [row["method"] for row in saved["table"]][:4] == ["RoPE", "Resonance RoPE", "YaRN (s=4)",
                                                              "Resonance YaRN (s=4)"]
    assert all(row["gate"] is False for row in saved["table"])
    # A saved run re-renders to the same table without training.
    assert bench.main(["--from-json", str(result), "--markdown"]) == 0
    again = capsys.readouterr().out
    table_lines = [line for line in out.splitlines() if line.startswith("| cot")]
    assert table_lines and table_lines == [line for line in again.splitlines() if line.startswith("| cot")]
