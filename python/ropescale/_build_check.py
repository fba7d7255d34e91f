"""Refuses, at import, a native library built against another torch than the one running.

The package imports this module before the native library (``_C``): C++ extensions have no stable ABI across
torch minor versions, and one built against a CUDA torch needs libtorch_cuda, so loading a mismatched library
would fail obscurely or misbehave. The library records the torch it was built against in ``_build_config.py``
(written by CMake).
"""

from __future__ import annotations

import torch

try:
    from . import _build_config
except ImportError as error:
    raise ImportError("ropescale's native library is not built (no ropescale/_build_config.py): run "
                      "`pip install --no-build-isolation .` or `./scripts/setup.sh` in the source tree") from error

# The torch versions ropescale is built and tested against (pyproject.toml and README say the same).
SUPPORTED_TORCH = ">=2.11,<2.15"


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_mismatch(built_version: str, built_cuda: str, running_version: str, running_cuda: str | None) -> str | None:
    """Why a native library built against torch `built_version` (CUDA `built_cuda`, "" for a CPU-only
    torch) cannot run under torch `running_version`, or None when it can. C++ extensions have no
    stable ABI across torch minor versions, and one built against a CUDA torch needs libtorch_cuda."""
    def describe(version, cuda):
        return f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU-only'})"

    if _major_minor(built_version) == _major_minor(running_version) and bool(built_cuda) == bool(running_cuda):
        return None
    return (f"ropescale's native library was built against {describe(built_version, built_cuda)}, but this Python "
            f"runs {describe(running_version, running_cuda)}: it would fail to load or misbehave. Rebuild it "
            f"against the torch you run (supported: torch{SUPPORTED_TORCH}): in the ropescale source tree, "
            f"`pip install --no-build-isolation --no-deps --force-reinstall .`, or `./scripts/setup.sh` in a "
            f"development checkout.")


_problem = torch_mismatch(_build_config.TORCH_VERSION, _build_config.TORCH_CUDA, torch.__version__, torch.version.cuda)
if _problem:
    raise ImportError(_problem)
