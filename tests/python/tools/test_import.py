"""Importing ropescale: the torch it was built against, the instruction set its CPU kernels use, the
`ropescale` command."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ropescale
from ropescale import _build_config, _torch_mismatch


def test_build_config_matches_the_running_torch():
    # The generated file and the library agree with each other and with the torch running them.
    assert _build_config.TORCH_VERSION == ropescale.build_info()["torch_version"]
    assert _build_config.TORCH_VERSION.split("+")[0].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert bool(_build_config.TORCH_CUDA) == (torch.version.cuda is not None)


@pytest.mark.parametrize("built, built_cuda, running, running_cuda", [
    ("2.14.1", "13.0", "2.14.0", "12.8"),      # patch releases and CUDA minor versions share the ABI
    ("2.13.0+cpu", "", "2.13.0", None),
    ("2.11.0+cu130", "13.0", "2.11.0", "13.0"),
])
def test_compatible_torch_is_accepted(built, built_cuda, running, running_cuda):
    assert _torch_mismatch(built, built_cuda, running, running_cuda) is None


@pytest.mark.parametrize("built, built_cuda, running, running_cuda, says", [
    ("2.14.1", "13.0", "2.13.0+cpu", None, "built against torch 2.14.1 (CUDA 13.0), but this Python runs torch 2.13.0+cpu (CPU-only)"),
    ("2.13.0+cpu", "", "2.14.1", "13.0", "torch 2.13.0+cpu (CPU-only)"),
    ("2.13.0", "", "2.13.0", "13.0", "runs torch 2.13.0 (CUDA 13.0)"),
    ("2.11.0", "13.0", "3.11.0", "13.0", "runs torch 3.11.0"),
])
def test_mismatched_torch_is_refused_with_the_rebuild_command(built, built_cuda, running, running_cuda, says):
    message = _torch_mismatch(built, built_cuda, running, running_cuda)
    assert message is not None and says in message
    assert "pip install --no-build-isolation" in message and ropescale.SUPPORTED_TORCH in message


def test_import_refuses_a_library_built_for_another_torch(tmp_path):
    # A copy of the package whose build record names another torch: import fails before _C loads.
    package = tmp_path / "ropescale"
    shutil.copytree(Path(ropescale.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_build_config.py").write_text('TORCH_VERSION = "1.13.1"\nTORCH_CUDA = ""\n')
    result = subprocess.run([sys.executable, "-c", "import ropescale"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert result.returncode != 0
    assert "ImportError: ropescale's native library was built against torch 1.13.1 (CPU-only)" in result.stderr
    assert "_C" not in result.stderr.split("ImportError")[0].split("\n")[-2]  # raised by the check, not the loader


def _cpu_has_avx512() -> bool:
    return bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())


@pytest.mark.skipif(_cpu_has_avx512(), reason="this CPU has AVX-512: nothing to cap")
def test_forced_avx512_on_a_cpu_without_it_runs_a_variant_the_cpu_has():
    # ATEN_CPU_CAPABILITY=avx512 makes torch report AVX512 without asking the CPU; ropescale's own
    # kernel choice is capped at what cpuinfo reports, so its ops never raise SIGILL.
    script = ("import torch, ropescale; print(torch.backends.cpu.get_cpu_capability(), ropescale._C.rotary_cpu_isa())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx512",
           "PYTHONPATH": str(Path(ropescale.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    torch_says, ropescale_runs = result.stdout.split()
    assert torch_says == "AVX512"
    assert ropescale_runs == ("AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT")


def test_console_script_runs():
    # setup.sh and pip both put a `ropescale` command beside the interpreter.
    command = Path(sys.executable).parent / "ropescale"
    if not command.exists():
        pytest.fail(f"no `ropescale` command beside {sys.executable}: setup.sh / pip install should write it")
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, check=True)
    assert "usage: ropescale" in result.stdout and "table" in result.stdout


# The ops with a CUDA kernel: the rotary ops and the ReRoPE attention ops (DESIGN.md, "Public surface").
_CUDA_OPS = {name for name in ropescale.ops.__all__ if name.startswith("apply_rotary")} | {
    "rerope_attention", "rerope_attention_paged", "rerope_attention_paged.workspace", "rerope_cache_write_"}


def test_every_gpu_op_has_a_cuda_kernel_in_every_build():
    # A build without CUDA kernels still registers the CUDA key of these ops (with an error that says how
    # to rebuild): a GPU user never meets the dispatcher's "Could not run ... from the 'CUDA' backend".
    assert {"apply_rotary", "apply_rotary_qk_", "apply_rotary_pos_qk"} <= _CUDA_OPS
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("ropescale::")
                  and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")}
    assert registered == _CUDA_OPS


@pytest.mark.skipif(ropescale.build_info()["cuda"], reason="this build has CUDA kernels: the CUDA key runs them")
def test_a_build_without_cuda_kernels_says_how_to_rebuild_on_cuda_tensors():
    # The CUDA kernel of a CPU-only build, reached through the dispatcher as a CUDA tensor would reach it.
    x, cos = torch.randn(1, 1, 2, 4), torch.randn(2, 4)
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match=r"apply_rotary: this ropescale library was built without CUDA kernels"
                                           r".*ROPESCALE_CUDA=ON pip install --no-build-isolation"):
        torch.ops.ropescale.apply_rotary.default.redispatch(cuda, x, cos, cos)
