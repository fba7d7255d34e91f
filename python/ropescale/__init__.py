"""ropescale: RoPE context extension for PyTorch (YaRN, Resonance, Dynamic scaling, ReRoPE).

Importing the package loads the native library, which registers every op as
``torch.ops.ropescale.*``; ``ropescale.ops`` holds the typed Python wrappers.
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from . import _C, cache, ops, scaling  # noqa: F401

__version__ = "0.1.0"


def build_info() -> dict:
    """What the native library was built with: torch version, whether the CUDA kernels are in it,
    and the CUDA archs."""
    return dict(_C.build_info())
