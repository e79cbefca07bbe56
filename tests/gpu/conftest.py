"""GPU kernel tests: run on CUDA (the H200), skipped elsewhere. With HYLO_TRITON_INTERPRET=1 and TRITON_INTERPRET=1
they run the same kernels on CPU tensors through Triton's interpreter (slow; for development)."""

import pytest
import torch

from hylo.ops.triton_utils import HAS_TRITON, INTERPRET


def _device():
    if HAS_TRITON and torch.cuda.is_available():
        return torch.device("cuda")
    if HAS_TRITON and INTERPRET:
        return torch.device("cpu")
    return None


DEVICE = _device()


def pytest_collection_modifyitems(config, items):
    if DEVICE is None:
        skip = pytest.mark.skip(reason="needs CUDA and Triton (or the Triton interpreter)")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture
def dev():
    return DEVICE
