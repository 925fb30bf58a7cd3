"""Array kinds: NumPy on the CPU path, CuPy on the GPU path, other GPU arrays through DLPack.

CuPy is imported lazily so that ``import cuflash`` works on machines without it.  Foreign GPU
arrays (JAX, PyTorch, Numba) are taken zero-copy through ``__dlpack__`` or
``__cuda_array_interface__`` without importing their library; results come back as CuPy arrays.
Foreign CPU arrays that speak DLPack (a CPU PyTorch tensor or JAX array) are taken zero-copy by
``numpy.from_dlpack`` and run on the CPU path, with NumPy results.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=None)
def cupy_module():
    """The cupy module, or None when it is not installed or cannot load."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return None
    return cupy


def gpu_available() -> bool:
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def no_gpu_reason() -> str:
    """Why :func:`gpu_available` is False, for error messages: CuPy missing, or no GPU it sees."""
    if cupy_module() is None:
        return "CuPy is not installed (in a cuflash checkout: pip install -e '.[cuda13]', or '.[cuda12]' for a CUDA 12 driver)"
    return "no GPU visible to CuPy"


def is_integer(x) -> bool:
    """Whether x is a Python or NumPy integer; a bool is not one (True as a length, an axis or a rank
    is a mistake to report, not the number 1)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    """Whether x is a Python or NumPy integer or float, bools excluded (as in is_integer)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def is_gpu(x) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def is_array(x) -> bool:
    return isinstance(x, np.ndarray) or is_gpu(x)


_DLPACK_CPU = 1  # kDLCPU, the device type __dlpack_device__ reports for host memory


def _dlpack_on_cpu(x) -> bool:
    try:
        return int(x.__dlpack_device__()[0]) == _DLPACK_CPU
    except Exception:  # no __dlpack_device__, or one that fails: not known to be on the CPU
        return False


def refuse_masked(x, name: str) -> None:
    """A NumPy masked array is refused wherever an array is taken: its mask would be silently ignored."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array, whose mask cuflash would ignore; pass {name}.filled(value) "
                        f"or {name}.data")


def as_array(x, name: str, *, written: str | None = None):
    """Return x as a NumPy or CuPy array; foreign arrays are wrapped zero-copy, lists, tuples and
    scalars become NumPy arrays (the CPU path), as NumPy functions take them.  ``written``: why x
    is written in place (for the message); a list, tuple or scalar, which would be copied and the
    writes lost, is then a TypeError.

    NumPy subclasses (np.matrix, np.memmap, ...) become plain ndarray views of the same memory,
    since their overridden methods (np.matrix's reductions) do not follow ndarray's signatures;
    a masked array is refused, as its mask would be silently ignored."""
    if isinstance(x, np.ndarray) and type(x) is not np.ndarray:
        refuse_masked(x, name)
        return x.view(np.ndarray)
    if is_array(x):
        return x
    if hasattr(x, "__dlpack__") and _dlpack_on_cpu(x):
        try:
            return np.from_dlpack(x)
        except Exception as exc:  # whatever the exporter raises, named as this argument's problem
            # (NumPy's DLPack has no bfloat16: JAX's CPU bfloat16 arrays still convert through
            # __array__, as ml_dtypes arrays; a copy, so not where the call writes)
            if written is None and hasattr(x, "__array__"):
                try:
                    return np.asarray(x)
                except Exception:  # noqa: BLE001 - the DLPack error below says more
                    pass
            raise TypeError(f"{name} ({type(x).__name__}) is a CPU array NumPy cannot take through DLPack: {exc}; "
                            f"pass np.asarray({name})" + (f" (and write back: {written})" if written else "")) from exc
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        cp = cupy_module()
        if cp is None:
            raise TypeError(f"{name} is a GPU array ({type(x).__name__}) but CuPy is not installed: in a cuflash "
                            "checkout, pip install -e '.[cuda13]' (or '.[cuda12]', the extra of your CUDA), or pass "
                            "NumPy arrays")
        failure = (TypeError, BufferError, RuntimeError, ValueError)  # CuPy's CUDA errors are RuntimeErrors
        try:
            if hasattr(x, "__cuda_array_interface__") and not hasattr(x, "__dlpack__"):
                return cp.asarray(x)
            return cp.from_dlpack(x)
        except failure as exc:
            error = exc
        if hasattr(x, "__cuda_array_interface__") and hasattr(x, "__dlpack__"):
            try:  # DLPack refused: the CUDA array interface may still do
                return cp.asarray(x)
            except failure as exc:
                error = exc
        raise TypeError(f"{name} ({type(x).__name__}) could not be taken as a GPU array: {error}") from error
    if isinstance(x, (list, tuple, np.number)) or is_real(x):
        if written is not None:
            raise TypeError(f"{name} must be a writable array (NumPy, or CuPy with GPU inputs) {written}; got "
                            f"{type(x).__name__}")
        return _from_array_like(x, name)
    raise TypeError(f"{name} must be a NumPy or CuPy array, a DLPack GPU array, or a list, tuple or number that NumPy "
                    f"takes as an array (the CPU path); got {type(x).__name__}")


def _from_array_like(x, name: str):
    """A list, tuple or scalar as NumPy would take it (the CPU path): integers become float64, as
    NumPy's floating-point functions make them; anything that is not a rectangular array of
    numbers is a TypeError naming the argument."""
    try:
        a = np.asarray(x)
    except ValueError as exc:  # ragged nesting
        raise TypeError(f"{name} ({type(x).__name__}) is not a rectangular array of numbers: {exc}") from exc
    if a.dtype.kind in "iu":
        return a.astype(np.float64)
    if a.dtype.kind not in "f":
        raise TypeError(f"{name} ({type(x).__name__}) holds {a.dtype.name} values; expected numbers")
    return a


def check_array(x, name: str) -> None:
    refuse_masked(x, name)
    if not is_array(x):
        raise TypeError(f"{name} must be a NumPy or CuPy array; got {type(x).__name__}")


def same_kind(a, b) -> bool:
    return is_gpu(a) == is_gpu(b)


def module_of(x):
    """numpy or cupy, whichever owns x."""
    return cupy_module() if is_gpu(x) else np


def to_numpy(x):
    return x.get() if is_gpu(x) else np.asarray(x)


def to_device_like(x, like):
    """x on the same side (host/device) as ``like``."""
    if is_gpu(like):
        cp = cupy_module()
        with cp.cuda.Device(like.device.id):
            return cp.asarray(x)
    return to_numpy(x)
