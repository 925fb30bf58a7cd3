"""Shared fixtures: every test body that takes ``xp`` runs on NumPy (CPU path) and CuPy (GPU)."""

import zlib

import numpy as np
import pytest

from cuflash import _arrays

HAS_GPU = _arrays.gpu_available()
GPU_SKIP_REASON = (
    "no CUDA GPU: CuPy is not installed" if _arrays.cupy_module() is None
    else "no CUDA GPU: CuPy found no device (see `cuflash info`); scripts/gpu_check.sh runs these on a GPU"
)
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason=GPU_SKIP_REASON)


def modifier_arguments(q, k, dropout_p, seed, opts):
    """(reference options, GPU call options) for a padded-batch call with bias/mask/dropout:
    the reference gets the keep-mask cuflash.dropout_mask draws for ``seed``, the call the seed;
    NumPy arrays among ``opts`` go to the GPU."""
    import cuflash

    b, sq, h, _ = q.shape
    keep = cuflash.dropout_mask(seed, (b, h, sq, k.shape[1]), dropout_p) if dropout_p else None
    cp = _arrays.cupy_module()
    run = {n: cp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    if dropout_p:
        run.update(dropout_p=dropout_p, dropout_seed=seed)
    return dict(opts, dropout_p=dropout_p, dropout_keep=keep), run


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


@pytest.fixture
def kernels_run(monkeypatch):
    """The names of the kernel variants a test launches, in order (so that a test can check which
    kernel ran: a feature the GPU lacks would otherwise be a skip, not a failure)."""
    from cuflash import _fastpath, _kernels

    seen = []
    get_function = _kernels.get_function
    monkeypatch.setattr(_kernels, "get_function", lambda variant, *a, **kw: seen.append(variant.name) or get_function(variant, *a, **kw))
    _fastpath.PLANS.clear()  # (a replayed launch compiles nothing)
    yield seen
    _fastpath.PLANS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A GPU run of a shared test body that needs a feature the CUDA path lacks is a skip, not a pass.

    Only the dedicated exception counts (raised before any launch); any other error still fails.
    """
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and call.excinfo is not None and HAS_GPU:
        from cuflash._gpu import NotAvailableOnGPU

        if call.excinfo.errisinstance(NotAvailableOnGPU):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: not on the GPU yet: {call.excinfo.value}")
