"""Shared fixtures: every test body that takes ``xp`` runs on NumPy (CPU path) and CuPy (GPU)."""

import zlib

import numpy as np
import pytest

from cuflash import _arrays

GPU_SKIP_REASON = (
    "no CUDA GPU visible to CuPy (CuPy not installed or no device): GPU tests run on the device "
    "machine through scripts/gpu_check.sh"
)
HAS_GPU = _arrays.gpu_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason=GPU_SKIP_REASON)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=[pytest.mark.gpu, requires_gpu])])
def xp(request):
    """The array module under test: numpy runs the CPU path, cupy the CUDA kernels."""
    if request.param == "numpy":
        return np
    return _arrays.cupy_module()


@pytest.fixture
def rng(request):
    """Fresh random data per test, but reproducible from the test's name."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
