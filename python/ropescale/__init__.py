"""ropescale: RoPE context extension for PyTorch (YaRN, Resonance, Dynamic scaling, ReRoPE).

Importing the package loads the native library, which registers every op as
``torch.ops.ropescale.*``; ``ropescale.ops`` holds the typed Python wrappers.
"""

from __future__ import annotations

import torch  # noqa: F401  (libtorch must be loaded before the extension)

# First: refuses a native library built against another torch, before _C loads it.
from ._build_check import SUPPORTED_TORCH, torch_mismatch as _torch_mismatch  # noqa: F401
from . import _C, cache, ops, scaling  # noqa: F401
from . import reference  # ROPESCALE_KERNELS=reference: plain-PyTorch kernels registered over the native ones
from . import sharding  # noqa: F401  (DTensor sharding rules, registered once torch.distributed.tensor is imported)

__version__ = "0.1.0"


def build_info() -> dict:
    """What the native library was built with: torch version, whether the CUDA kernels are in it,
    and the CUDA archs; and which kernels the ops run: ``"kernels": "native"``, or ``"reference"``
    under ``ROPESCALE_KERNELS=reference`` (plain PyTorch, see ``ropescale.reference``)."""
    return {**_C.build_info(), "kernels": reference.KERNELS}
