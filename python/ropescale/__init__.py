import torch
from . import _C  # noqa: F401  registers torch.ops.ropescale
print(_C.build_info())
