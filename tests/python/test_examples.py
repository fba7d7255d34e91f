"""The examples run end to end on the CPU in one command (tiny models, a few steps)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
