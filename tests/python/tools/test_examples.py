"""The examples run end to end on the CPU in one command (tiny models, a few steps)."""

import os
import re
import subprocess
import sys

from support import ROOT

ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="2")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=True).stdout


def test_finetune_loss_falls_with_resonance_yarn():
    out = run(ROOT / "examples/finetune.py", "--method", "resonance_yarn", "--factor", "4", "--steps", "30",
              "--seq-len", "128", "--original-length", "32")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, out


def test_generate_rerope_agrees_with_full_forward():
    out = run(ROOT / "examples/generate_rerope.py", "--prompt-length", "200", "--new-tokens", "8", "--window", "16")
    assert "generated 8 tokens" in out
    assert "agrees with the cached decode at the last step: True" in out


def test_rl_rollout_says_it_needs_vllm_where_vllm_is_missing():
    # examples/rl_rollout.py runs end to end on the vLLM leg (tests/python/engines/test_trainer_rollout.py); here
    # (no vLLM) its help teaches the loop and a run says clearly what is missing, with a non-zero status.
    import importlib.util

    import pytest

    assert "hf.patch" in run(ROOT / "examples/rl_rollout.py", "--help")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: the example runs (test_trainer_rollout.py)")
    result = subprocess.run([sys.executable, str(ROOT / "examples/rl_rollout.py"), "--iterations", "1"], env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "rl_rollout: vLLM is not installed" in result.stderr and "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------
# examples/finetune.py with transformers' Trainer and with PEFT LoRA: run in this process (one
# transformers import for all), saved, reloaded, compared.


def finetune(capsys, *args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_example", ROOT / "examples/finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in args])
    out = capsys.readouterr().out
    return out, {int(step): float(loss) for step, loss in re.findall(r"step +(\d+)  loss (\d+\.\d+)", out)}


TINY = ("--seq-len", "48", "--original-length", "16", "--factor", "4", "--batch", "2", "--warmup", "2",
        "--lr", "1e-2")


def assert_reload_matches_probe(out_dir):
    import torch
    from transformers import AutoModelForCausalLM

    probe = torch.load(out_dir / "probe.pt")
    model = AutoModelForCausalLM.from_pretrained(out_dir / "final").eval()
    with torch.no_grad():
        logits = model(probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)
    return model


def test_finetune_trainer_checkpoints_resume_and_reload(tmp_path, capsys, one_thread):
    import json

    import torch
    from safetensors.torch import load_file

    from ropescale import hf

    first, second = tmp_path / "run", tmp_path / "resumed"
    out, losses = finetune(capsys, "--trainer", "--method", "resonance_yarn", "--steps", "6", "--save-steps", "3",
                           "--output-dir", first, *TINY)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], out
    # Every Trainer checkpoint is a loadable patched model: its config records the method.
    for step in (3, 6):
        config = json.loads((first / f"checkpoint-{step}" / "config.json").read_text())
        assert config["rope_parameters"]["rope_type"] == "resonance_yarn"
        # The original length: vLLM multiplies it by factor (4) for resonance_yarn, deriving 64.
        assert config["max_position_embeddings"] == 16
    out, resumed = finetune(capsys, "--trainer", "--method", "resonance_yarn", "--steps", "6", "--save-steps", "3",
                            "--output-dir", second, "--resume", first / "checkpoint-3", *TINY)
    assert sorted(resumed) == [4, 5, 6], out
    assert {s: losses[s] for s in resumed} == resumed  # the same loss curve from the checkpoint on
    a, b = load_file(first / "final" / "model.safetensors"), load_file(second / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = assert_reload_matches_probe(first)  # (ropescale's type: loads after import ropescale.hf)
    hf.patch(model)  # and patching the reload re-applies the method: same logits again
    probe = torch.load(first / "probe.pt")
    with torch.no_grad():
        torch.testing.assert_close(model(probe["input_ids"]).logits, probe["logits"], atol=1e-5, rtol=0)


def test_finetune_lora_merge_keeps_the_patch_and_reloads(tmp_path, capsys, one_thread):
    import json

    out, losses = finetune(capsys, "--lora", "--trainer", "--steps", "4", "--output-dir", tmp_path, *TINY)
    assert sorted(losses) == [1, 2, 3, 4], out
    assert "LoRA merged: ropescale patch kept: True" in out
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 64
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "final" / "model.safetensors")  # plain merged weights, no adapter left
    assert "model.layers.0.self_attn.q_proj.weight" in saved and not any("lora" in k for k in saved)
    assert_reload_matches_probe(tmp_path)  # the merged weights, reloaded, give the trained LoRA model's logits


def test_finetune_fsdp_two_processes_save_the_gathered_model(tmp_path):
    """FSDP2 on two CPU processes (gloo): every rank gathers the full state dict, rank 0 writes a checkpoint
    that plain transformers reloads as the trained (sharded) model."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    args = [sys.executable, str(ROOT / "examples/finetune.py"), "--fsdp", "--steps", "3", "--output-dir", str(tmp_path),
            *TINY]
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "gathered from FSDP" in outs[0], outs[0]
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 64
    assert_reload_matches_probe(tmp_path)


# README's and the docs' python blocks run in test_doc_examples.py (every block, not two of README's).
