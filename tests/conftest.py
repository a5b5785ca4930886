import os

# Kernels run on CPU under the Triton interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="skipped: needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
