"""A clean install the way README says, into fresh virtual environments (slow: two venvs, one build).

venv A holds only torch (the CPU-only 2.13.0 on this machine's disk: it also exercises the
CPU-torch build path where nvcc is present), numpy, tqdm and the build backend; then
`pip install --no-build-isolation .`, an op call, the `ropescale` command, and `pip wheel`. venv B
holds the same torch and installs that wheel. Neither install may replace the venv's torch.
And `scripts/gpu_check.sh` on a machine without a GPU: builds, says so, exits 0.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import ROOT

pytestmark = pytest.mark.slow

TORCH = os.environ.get("ROPESCALE_INSTALL_TEST_TORCH", "2.13.0")
CHECK = ("import json, ropescale, torch; print('CHECK', json.dumps([torch.__version__, "
         "list(torch.ops.ropescale.yarn_inv_freq(128, 1e4, 4., 4096).shape), ropescale.build_info()]))")


def _check(python, cwd):
    """Imports the installed ropescale outside the source tree and calls an op: (torch, shape, build_info)."""
    (line,) = [x for x in _run(python, "-c", CHECK, cwd=cwd).splitlines() if x.startswith("CHECK ")]
    return json.loads(line.removeprefix("CHECK "))


def _run(*command, cwd=ROOT, **kwargs):
    """stdout and stderr together (pip -v puts the build's output on stderr)."""
    result = subprocess.run([str(c) for c in command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {result.returncode}:\n{result.stdout[-8000:]}")
    return result.stdout


def _fresh_venv(path: Path, *packages: str) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    _run(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    result = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"torch=={TORCH}",
                             *packages], capture_output=True, text=True)
    if result.returncode != 0:
        message = f"pip could not install torch=={TORCH} into a fresh venv:\n{result.stderr[-3000:]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)  # a machine without that torch on disk or a network: CI has it
    return python


@pytest.fixture(scope="module")
def work_dir():
    # A fixed place (not tmp) so ccache finds the same paths on the next run; emptied every time.
    path = ROOT / "build" / "install-test"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def test_clean_install_and_wheel_keep_the_users_torch(work_dir):
    python = _fresh_venv(work_dir / "venv-a", "numpy", "tqdm", "scikit-build-core")
    torch_before = _run(python, "-c", "import torch; print(torch.__version__)").strip().splitlines()[-1]
    env = {**os.environ, "CCACHE_BASEDIR": str(ROOT), "ROPESCALE_CUDA": "AUTO"}
    build = work_dir / "build"
    log = _run(python, "-m", "pip", "install", "-v", "--no-build-isolation", "-C", f"build-dir={build}", ".", env=env)
    if "+cpu" in torch_before and shutil.which("nvcc"):
        assert "is a CPU-only build: building the CPU kernels only" in log
    # Outside the source tree, so the installed package is the one imported.
    running, shape, info = _check(python, work_dir)
    assert running == torch_before, "installing ropescale changed the venv's torch"
    assert shape == [64] and info["torch_version"] == torch_before
    assert "usage: ropescale" in _run(work_dir / "venv-a" / "bin" / "ropescale", "--help", cwd=work_dir)

    wheels = work_dir / "wheels"
    _run(python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-C", f"build-dir={build}", "-w", wheels,
         ".", env=env)
    (wheel,) = wheels.glob("ropescale-*.whl")
    # The wheel, with its dependencies, into the same venv once ropescale and its other dependencies
    # are gone from it (a second fresh venv would install torch again: minutes on 2 cores): pip
    # brings numpy and tqdm back, and the requirement admits the venv's torch, so pip keeps it.
    _run(python, "-m", "pip", "uninstall", "-y", "-q", "ropescale", "numpy", "tqdm")
    assert "No module named 'ropescale'" in subprocess.run(
        [python, "-c", "import ropescale"], cwd=work_dir, capture_output=True, text=True).stderr
    _run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel)
    running, shape, info = _check(python, work_dir)
    assert running == torch_before, "installing the wheel changed the venv's torch"
    assert shape == [64] and info["torch_version"] == torch_before
    assert "usage: ropescale" in _run(work_dir / "venv-a" / "bin" / "ropescale", "--help", cwd=work_dir)


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
