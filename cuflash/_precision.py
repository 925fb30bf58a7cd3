"""The ``precision=`` option of the attention functions (issue 24) and TF32 rounding.

``None``, ``"ieee"`` and ``"highest"`` (JAX's name) all mean IEEE float32 products for float32
inputs, as CuPy's own float32 matmul without TF32; ``"tf32"`` means single TF32 products (operands
rounded to a 10-bit mantissa, float32 accumulation), faster on the tensor cores with the error of a
TF32 matmul.  float16/bfloat16 inputs take only ``None``; float64 inputs take no ``"tf32"``.  On
the NumPy path ``"tf32"`` rounds the operands of every product to TF32 (:func:`tf32_round`), so
that the CPU and GPU paths agree.
"""

from __future__ import annotations

import numpy as np

PRECISIONS = (None, "ieee", "highest", "tf32")


def check_precision(precision, dtype_name: str, name: str = "precision") -> str:
    """The normalised precision, ``"ieee"`` or ``"tf32"``, for inputs of ``dtype_name``.

    Raises ``TypeError`` for a value that is neither None nor a string, ``ValueError`` for an
    unknown string or one the dtype does not take.
    """
    if precision is not None and not isinstance(precision, str):
        raise TypeError(f"{name} must be None or one of 'ieee', 'highest', 'tf32'; got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be None, 'ieee', 'highest' or 'tf32'; got {precision!r}")
    if precision is not None and dtype_name in ("float16", "bfloat16"):
        raise ValueError(f"{name} applies to float32 (and float64) inputs; {dtype_name} inputs take only "
                         f"precision=None (their products are exact in float32 accumulation)")
    if precision == "tf32" and dtype_name != "float32":
        raise ValueError(f"{name}='tf32' applies to float32 inputs; {dtype_name} inputs compute in {dtype_name}: "
                         f"pass precision=None (or 'ieee'), or cast the inputs to float32 for TF32 products")
    return "tf32" if precision == "tf32" else "ieee"


def tf32_round(x) -> np.ndarray:
    """``x`` as float32 rounded to TF32: 10 mantissa bits, to nearest with ties away from zero
    (PTX ``cvt.rna.tf32.f32``, what the tensor cores see of a float32 operand in TF32 mode);
    NaN stays NaN, a value rounded past float32's range becomes infinite."""
    a = np.asarray(x, dtype=np.float32)
    rounded = ((a.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isnan(a), a, rounded)


def operand_rounding(checked: str):
    """What the operands of every product go through for a checked precision (see
    :func:`check_precision`): :func:`tf32_round` (kept in the operand's dtype) for ``"tf32"``,
    else nothing.  Shared by the NumPy path and the naive oracle."""
    if checked != "tf32":
        return lambda x: x
    return lambda x: tf32_round(x).astype(x.dtype)
