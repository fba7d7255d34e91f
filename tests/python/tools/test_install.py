"""`scripts/gpu_check.sh` on a machine without a GPU: builds, says so, exits 0 (slow: a build of its own).

The clean install README gives (a fresh venv, `pip install --no-build-isolation .`, the op and the `ropescale`
command outside the tree, `pip wheel`, torch kept) is checked where a venv is built from nothing anyway: the
compat leg (scripts/test_torch_compat.sh), which builds the same CPU-only torch 2.13.0 install; its own build
here cost one more cold build in CI. That ropescale runs with its requirements only is
tests/python/tools/test_import.py's.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from support import ROOT

pytestmark = pytest.mark.slow


def _run(*command, cwd=ROOT, **kwargs):
    """stdout and stderr together."""
    result = subprocess.run([str(c) for c in command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {result.returncode}:\n{result.stdout[-8000:]}")
    return result.stdout


def test_gpu_check_without_a_gpu_builds_says_so_and_exits_0(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: scripts/gpu_check.sh measures it instead (run it by hand)")
    # On a copy of the tracked tree: the script builds in place.
    copy = ROOT / "build" / "gpu-check-tree"
    shutil.rmtree(copy, ignore_errors=True)
    files = _run("git", "ls-files", "-co", "--exclude-standard").splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    # GPU_CHECK_SECONDS=0: no wall-clock budget (a loaded machine builds slowly; the result is what is tested)
    env = {**os.environ, "PYTHON": sys.executable, "CCACHE_BASEDIR": str(copy), "JOBS": "2", "PYTHONPATH": "",
           "GPU_CHECK_SECONDS": "0"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", tmp_path / "report"], cwd=copy, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no GPU" in result.stdout
    report = (tmp_path / "report" / "gpu_report.md").read_text()
    assert "no GPU" in report and f"torch {torch.__version__}" in report
    assert "- build (-j2): ok" in report and "- import: ok" in report
    shutil.rmtree(copy, ignore_errors=True)
