"""The float32 (TF32, 3xTF32) and float64 tensor-core building blocks of kernels/mma.cuh (issue 24's
kernels, docs/perf-notes.md f0): one warp multiplies a 16 x 8 by an 8 x 8 matrix through the
fragment layouts the header documents, against NumPy in float64.  The compile check runs wherever
NVRTC is installed; the products need a GPU of compute capability 8.0 or newer."""

import numpy as np
import pytest

from cuflash import _kernels
from cuflash._precision import tf32_round

from .conftest import requires_gpu
from .test_compile import _nvrtc_or_skip

# One warp: lane l holds the fragments of g = l / 4, t = l % 4 as mma.cuh lays them out; the 16 x 8
# result goes back through the C layout (rows g, g + 8; columns 2 t, 2 t + 1).
CHECK_KERNEL = r'''
extern "C" __global__ void mma_tf32_check(const float* A, const float* B, float* D, int split) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;  // A (16 x 8) and B (8 x 8) row-major
    const float af[4] = {A[g * 8 + t], A[(g + 8) * 8 + t], A[g * 8 + t + 4], A[(g + 8) * 8 + t + 4]};
    const float bf[2] = {B[t * 8 + g], B[(t + 4) * 8 + g]};
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    u32 ah[4], al[4], bh[2], bl[2];
    for (int i = 0; i < 4; ++i) split ? split_tf32(af[i], ah[i], al[i]) : void(ah[i] = to_tf32(af[i]));
    for (int i = 0; i < 2; ++i) split ? split_tf32(bf[i], bh[i], bl[i]) : void(bh[i] = to_tf32(bf[i]));
    if (split) {  // 3xTF32: the small terms first
        mma_16x8x8_tf32(d, al, bh[0], bh[1]);
        mma_16x8x8_tf32(d, ah, bl[0], bl[1]);
    }
    mma_16x8x8_tf32(d, ah, bh[0], bh[1]);
    for (int e = 0; e < 4; ++e) D[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = d[e];
}

extern "C" __global__ void mma_f64_check(const double* A, const double* B, double* D, int shape) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;  // A (16 x 8) and B (8 x 8) row-major
    double d[4] = {0.0, 0.0, 0.0, 0.0};  // the 16 x 8 C fragment: rows g (d0, d1) and g + 8 (d2, d3)
    if (shape == 0) {  // m8n8k4 (sm_80+): two tiles stacked
        for (int k0 = 0; k0 < 8; k0 += 4)
            for (int half = 0; half < 2; ++half)
                mma_8x8x4_f64(d[2 * half], d[2 * half + 1], A[(g + 8 * half) * 8 + k0 + t], B[(k0 + t) * 8 + g]);
    }
#if __CUDA_ARCH__ >= 900
    if (shape == 4)  // m16n8k4 (sm_90+)
        for (int k0 = 0; k0 < 8; k0 += 4) mma_16x8x4_f64(d, A[g * 8 + k0 + t], A[(g + 8) * 8 + k0 + t], B[(k0 + t) * 8 + g]);
    if (shape == 8) {  // m16n8k8 (sm_90+)
        const double a[4] = {A[g * 8 + t], A[(g + 8) * 8 + t], A[g * 8 + t + 4], A[(g + 8) * 8 + t + 4]};
        mma_16x8x8_f64(d, a, B[t * 8 + g], B[(t + 4) * 8 + g]);
    }
#endif
    for (int e = 0; e < 4; ++e) D[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = d[e];
}

extern "C" __global__ void exp2_prob_check(const double* x, double* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = acc::exp2_prob(x[i]);
}
'''


def _source():
    return _kernels.read_source("mma.cuh") + CHECK_KERNEL


def test_check_kernels_compile_for_sm80_and_sm90():
    _nvrtc_or_skip()
    from cupy.cuda import nvrtc

    for arch in ("80", "90"):
        prog = nvrtc.createProgram(_source(), "mma_check.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["--std=c++17", f"-arch=sm_{arch}", "-ftz=true"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
        finally:
            nvrtc.destroyProgram(prog)


@pytest.fixture(scope="module")
def module():
    import cupy as cp

    return cp.RawModule(code=_source(), options=("--std=c++17",))


def _tf32_product(module, seed, split):
    """(a, b, the check kernel's a @ b) in float32, single TF32 products or 3xTF32 (split)."""
    import cupy as cp

    a, b = (x.astype(np.float32) for x in _operands(seed))
    out = cp.empty((16, 8), dtype=cp.float32)
    module.get_function("mma_tf32_check")((1,), (32,), (cp.asarray(a), cp.asarray(b), out, np.int32(split)))
    return a, b, out.get()


def _operands(seed):
    rng = np.random.default_rng(seed)
    # values of mixed sizes, so that TF32's 10-bit mantissa loses bits a float32 product keeps
    a = rng.standard_normal((16, 8)) * np.exp2(rng.integers(-6, 6, (16, 8)))
    b = rng.standard_normal((8, 8)) * np.exp2(rng.integers(-6, 6, (8, 8)))
    return a, b


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tf32_products_round_their_operands(module, seed):
    a, b, out = _tf32_product(module, seed, split=0)
    want = tf32_round(a).astype(np.float64) @ tf32_round(b).astype(np.float64)
    scale = np.abs(tf32_round(a)).astype(np.float64) @ np.abs(tf32_round(b)).astype(np.float64)
    err = np.abs(out.astype(np.float64) - want)
    # the TF32 products exact, the sums in float32 (the tensor cores may truncate them: 2^-23 a step)
    assert (err <= 8 * 2.0**-23 * scale).all(), err.max()
    # and far from float32's own product: TF32 keeps 11 of its 24 bits
    assert np.abs(out - a.astype(np.float64) @ b).max() > 2.0**-20 * scale.max()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_3xtf32_products_keep_float32_accuracy(module, seed):
    a, b, out = _tf32_product(module, seed, split=1)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    naive = (a @ b).astype(np.float64)  # float32 products and sums (NumPy)
    err, naive_err = np.abs(out - exact), np.abs(naive - exact)
    # 3xTF32 drops lo * lo (2^-22 of a product) and sums in float32 (truncated: 2^-23 a step)
    assert (err <= 2 * naive_err + (2.0**-22 + 8 * 2.0**-23) * scale).all(), (err.max(), naive_err.max())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("shape", [0, 4, 8], ids=["m8n8k4", "m16n8k4", "m16n8k8"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float64_products(module, seed, shape):
    """sm_80's m8n8k4 pairs and sm_90's 16-row shapes (warp_gemm.cuh's CUFLASH_F64_MMA)."""
    import cupy as cp

    if shape and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("m16n8k4/m16n8k8 .f64 need sm_90")
    a, b = _operands(seed)
    out = cp.full((16, 8), np.nan, dtype=cp.float64)
    module.get_function("mma_f64_check")((1,), (32,), (cp.asarray(a), cp.asarray(b), out, np.int32(shape)))
    exact = a @ b
    scale = np.abs(a) @ np.abs(b)
    assert (np.abs(out.get() - exact) <= 8 * 2.0**-53 * scale).all()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("form", [1, 2], ids=["horner", "estrin"])
def test_exp2_prob_in_double(form):
    """acc::exp2_prob (the float64 softmax's 2^x, perf-notes f19) in both polynomial forms
    (CUFLASH_F64_EXP2): within 3 ulps of NumPy's exp2 from -1020 (exclusive) to 1020, exactly 1 at 0,
    0 from -1020 down and at -inf, NaN for NaN (a payload in the low word only too), +inf past 1020."""
    import cupy as cp

    module = cp.RawModule(code=_source(), options=("--std=c++17", f"-DCUFLASH_F64_EXP2={form}"))
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-1019.0, 10.0, 200000), rng.uniform(-1.0, 1.0, 100000),
                        rng.uniform(-1019.9999, -1019.5, 1000), rng.uniform(10.0, 1019.9999, 1000),  # (n = -1020; large x)
                        np.arange(-1019, 11, dtype=np.float64), np.arange(-40, 41) / 8 + 2.0**-40,
                        [0.0, -0.0, 0.5, -0.5, 1e-300, -1e-300]])
    nan_low = np.array([0x7FF0000000000001], dtype=np.uint64).view(np.float64)[0]  # a NaN whose payload is in the low word only
    special = np.array([-1020.0, -1020.5, -1021.0, -1e6, -np.inf, np.nan, nan_low, 1021.0, np.inf])
    y = cp.full(x.size + special.size, 7.0)
    module.get_function("exp2_prob_check")((-(-y.size // 256),), (256,), (cp.asarray(np.concatenate([x, special])), y, np.int32(y.size)))
    y = y.get()
    want = np.exp2(x)
    ulps = np.abs(y[: x.size] - want) / np.spacing(want)
    # (The polynomial is within 2.23e-16 of 2^f; against the exact 2^x Horner's rounding stays within 2.4
    # ulps and Estrin's three roundings near 1 within ~3.4, and on these samples against NumPy's exp2 they
    # reach 2.0 and 3.0: an exact-FMA emulation, review of session 32.)
    assert ulps.max() <= 3, (float(ulps.max()), x[np.argmax(ulps)])
    assert y[x.size - 6] == 1.0 and y[x.size - 5] == 1.0
    tail = y[x.size:]
    assert (tail[:5] == 0).all() and np.isnan(tail[5:7]).all() and (tail[7:] == np.inf).all(), tail
