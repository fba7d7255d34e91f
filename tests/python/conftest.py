import pytest
import torch

import ropescale  # noqa: F401  (registers torch.ops.ropescale)


def pytest_collection_modifyitems(config, items):
    # Tests marked `cuda` skip cleanly on machines without a GPU (every CI machine).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
