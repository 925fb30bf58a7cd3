"""Validate the arguments of every public function once, before any work starts.

Each check raises ``ValueError`` (shapes, values) or ``TypeError`` (dtypes, array kinds) with a
message that names the argument, what was expected and what was given.  Defaults (the softmax
scale, how ``causal`` folds into the window) are decided here and nowhere else: the CPU path and
the GPU kernels receive an :class:`AttnProblem` whose fields no longer need interpretation.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
CAUSAL_MODES = (False, True, "bottom_right", "top_left")
_UNBOUNDED_WINDOW = 2**31 - 1
SOFTCAP_RANGE = (1e-30, 1e30)  # float32 must hold softcap and scores / softcap
FLOAT32_MAX = float(np.finfo(np.float32).max)
LAYOUTS = ("bshd", "bhsd")


@dataclass(frozen=True)
class AttnProblem:
    """One attention problem in the canonical (batch, seqlen, heads, headdim) view.

    ``window_left``/``window_right`` already include ``causal`` (causal means right = 0), and -1
    means unbounded.  Key j is visible from query i iff ``j < sk`` and
    ``i + offset - window_left <= j <= i + offset + window_right`` where ``sk`` is the sequence's
    valid key length and ``offset = sk - sq`` (bottom-right) or 0 (``top_left``).
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_q: int
    nheads_k: int
    headdim_qk: int
    headdim_v: int
    dtype: np.dtype
    softmax_scale: float
    window_left: int
    window_right: int
    top_left: bool
    softcap: float
    alibi_slopes: Any  # None or (batch, nheads_q) float32 (float64: NumPy or float64 q), same array kind as q
    seqlens_k: Any  # None or (batch,) integer array, same array kind as q
    bias: Any = None  # None or a float array broadcastable to (batch, nheads_q, seqlen_q, seqlen_k)
    mask: Any = None  # None or a bool array broadcastable likewise (True = attend)
    dropout: Any = None  # None or (dropout_p, seed, offset, first batch index), dropout_p > 0 (cuflash/dropout.py)
    dropout_seed_array: Any = None  # a GPU (2,) int64 (seed, offset) the kernels read (seed and offset above 0)
    precision: str = "ieee"  # or "tf32": float32 products on TF32 operands (cuflash/_precision.py)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA/MQA)."""
        return self.nheads_q // self.nheads_k

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.seqlen_q == 0 or self.nheads_q == 0


def dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def is_float_dtype(dtype) -> bool:
    """float16, bfloat16, float32 or float64 (ml_dtypes' bfloat16 has numpy kind 'V', not 'f')."""
    return np.dtype(dtype).name in FLOAT_DTYPES


def check_qkv(q, k, v, *, packed: bool = False, names=("q", "k", "v"), unbatched: bool = False):
    """Check array kinds, dtypes and ranks of q, k, v (called ``names`` in messages); return the dtype."""
    arrays = tuple(zip(names, (q, k, v)))
    for name, x in arrays:
        _arrays.check_array(x, name)
    if not (_arrays.same_kind(q, k) and _arrays.same_kind(q, v)):
        raise TypeError(
            f"{', '.join(names)} must all be NumPy arrays or all be GPU arrays; got {type(q).__name__}, "
            f"{type(k).__name__}, {type(v).__name__}"
        )
    if len({dtype_name(x) for x in (q, k, v)}) != 1:
        raise TypeError(
            f"{', '.join(names)} must share one dtype, one of {', '.join(FLOAT_DTYPES)}; got "
            + ", ".join(f"{n} {dtype_name(x)}" for n, x in arrays)
            + " (cast them to one with .astype; a Python list is taken as float64)"
        )
    dt = dtype_name(q)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{names[0]} has dtype {dt}; expected one of {', '.join(FLOAT_DTYPES)} (cast it, e.g. "
                        f"{names[0]}.astype(numpy.float32))")
    rank = 3 if packed else 4
    what = "(total_tokens, nheads, headdim)" if packed else "(batch, seqlen, nheads, headdim)"
    if unbatched:  # the entry points that also take one sequence (their 3-D inputs never get here)
        what += ", or 3 (seqlen, nheads, headdim) for one unbatched sequence"
    for name, x in arrays:
        if x.ndim != rank:
            hint = f"; for a single head pass {name}[:, None, :], a (seqlen, 1, headdim) view" if x.ndim == 2 else ""
            raise ValueError(f"{name} must have {rank} dimensions {what}{hint}; got shape {tuple(x.shape)}")
    return q.dtype


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be 'bshd' or 'bhsd'; got {type(layout).__name__} {layout!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bshd' or 'bhsd'; got {layout!r}")
    return layout


def to_bshd(x, layout: str):
    """A (batch, seqlen, heads, dim) view of x (no copy)."""
    return x if layout == "bshd" else x.swapaxes(1, 2)


def _check_int(value, name: str, *, minimum: int | None = None) -> int:
    if not _arrays.is_integer(value):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def normalize_mask_options(causal, window_size) -> tuple[int, int, bool]:
    """Fold ``causal`` into the window: return (window_left, window_right, top_left)."""
    if isinstance(causal, np.bool_):
        causal = bool(causal)
    if not isinstance(causal, (bool, str)):  # 1, None, ...: a flag of the wrong type
        raise TypeError(f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}")
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}")
    if window_size is None:  # (JAX's local_window_size=None: no window)
        window_size = (-1, -1)
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be a pair (left, right) or None; got {window_size!r}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) or None; got {window_size!r}")
    left = _check_int(window_size[0], "window_size[0]", minimum=-1)
    right = _check_int(window_size[1], "window_size[1]", minimum=-1)
    # No sequence is 2^31 tokens long: a wider window is the same as no bound (and kernels use
    # 32-bit positions).
    left, right = (-1 if w >= _UNBOUNDED_WINDOW else w for w in (left, right))
    if causal is not False:
        right = 0 if right == -1 else min(right, 0)
    return left, right, causal == "top_left"


def check_scalar(value, name: str, default=None) -> float:
    if value is None:
        return default
    if not _arrays.is_real(value):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # a Python int past float64's range
        raise ValueError(f"{name} must be finite; got an integer of {int(value).bit_length()} bits") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value


def debug_checks_enabled() -> bool:
    return os.environ.get("CUFLASH_DEBUG", "0") not in ("", "0")


def check_index_array(x, name: str, *, like, length: int | None = None, ndim: int = 1):
    """Integer index array (int32 or int64) moved to the same side (CPU/GPU) as the data.

    Returns ``(array, host)``: ``host`` holds the values as NumPy when they are known without a
    device-to-host copy (a NumPy input, read before it is moved to the GPU) or when
    ``CUFLASH_DEBUG=1``; otherwise None, and value checks are skipped.
    """
    _arrays.refuse_masked(x, name)
    if isinstance(x, (list, tuple)):  # Python integers, as NumPy index arrays
        given = x
        try:
            x = np.asarray(x) if len(x) else np.zeros((0,) * ndim, dtype=np.int64)
        except ValueError as exc:  # ragged nesting
            raise TypeError(f"{name} must be an integer array (or a list of ints); got a ragged list ({exc})") from exc
        items = np.asarray(given, dtype=object).ravel().tolist() if x.dtype.kind in "Ouf" else ()
        # (ints past int64: NumPy picks object, float64 or uint64)
        if x.dtype == object or (items and all(isinstance(v, int) for v in items)):
            raise TypeError(f"{name} must be an integer array (or a list of ints, each within int64); got a list of "
                            f"{sorted({type(v).__name__ for v in items})}")
    if not _arrays.is_array(x):
        raise TypeError(f"{name} must be an integer array (or a list of ints); got {type(x).__name__}")
    kind = np.dtype(x.dtype)
    if kind.kind != "i" or kind.itemsize not in (4, 8):
        raise TypeError(f"{name} must have dtype int32 or int64; got {kind.name}")
    if not kind.isnative:  # e.g. big-endian '>i8' from a file: same values, native order
        x = x.astype(kind.newbyteorder("="))
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s); got shape {tuple(x.shape)}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} must have length {length}; got {x.shape[0]}")
    if not _arrays.is_gpu(like) and _arrays.is_gpu(x):
        raise TypeError(f"{name} is a GPU array but q is a NumPy array; pass a NumPy array")
    host = np.asarray(x) if not _arrays.is_gpu(x) else (_arrays.to_numpy(x) if debug_checks_enabled() else None)
    if _arrays.is_gpu(like) and not _arrays.is_gpu(x):
        x = _arrays.to_device_like(x, like)
    return x, host


def make_problem(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    seqlens_k=None,
    layout="bshd",
) -> AttnProblem:
    """Check a padded-batch call and return its :class:`AttnProblem` (shapes in bshd order)."""
    check_qkv(q, k, v, unbatched=True)
    check_layout(layout)
    qb, kb, vb = (to_bshd(x, layout) for x in (q, k, v))
    batch, seqlen_q, nheads_q, headdim_qk = qb.shape
    _, seqlen_k, nheads_k, _ = kb.shape
    headdim_v = vb.shape[3]
    if kb.shape[0] != batch or vb.shape[0] != batch:
        raise ValueError(f"q, k, v must share the batch size; got {batch}, {kb.shape[0]}, {vb.shape[0]}")
    if kb.shape[3] != headdim_qk:
        raise ValueError(f"k has head dim {kb.shape[3]}; it must equal q's head dim {headdim_qk}")
    if vb.shape[1] != seqlen_k or vb.shape[2] != nheads_k:
        raise ValueError(
            f"v must have k's seqlen and heads ({seqlen_k}, {nheads_k}); got ({vb.shape[1]}, {vb.shape[2]})"
        )
    return finish_problem(
        q, batch, seqlen_q, seqlen_k, nheads_q, nheads_k, headdim_qk, headdim_v,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, seqlens_k=seqlens_k,
    )


def finish_problem(
    q, batch, seqlen_q, seqlen_k, nheads_q, nheads_k, headdim_qk, headdim_v,
    *, softmax_scale, causal, window_size, softcap, alibi_slopes, seqlens_k, k_name="k", packed=False,
) -> AttnProblem:
    """Checks shared by the padded and the variable-length entry points (``k_name``: what the
    caller calls the keys, for messages)."""
    if nheads_k == 0 and nheads_q != 0:
        raise ValueError(f"{k_name} has 0 heads; q's {nheads_q} heads must be a multiple of it")
    if nheads_k and nheads_q % nheads_k != 0:
        hint = ("axis 1 of packed (total_tokens, nheads, headdim)" if packed else
                "axis 2 of (batch, seqlen, nheads, headdim); arrays in (batch, nheads, seqlen, headdim) order, as "
                "torch's, need layout='bhsd'" if k_name == "k" else
                f"axis 2 of (batch, seqlen, nheads, headdim) for q and of (batch, capacity, nheads, headdim) for "
                f"{k_name}; either in (batch, nheads, seqlen, headdim) order needs .swapaxes(1, 2)")
        heads = lambda n: f"{n} head" + "s" * (n != 1)  # noqa: E731
        raise ValueError(f"{k_name} has {heads(nheads_k)}; q's {heads(nheads_q)} must be a multiple of it ({hint})")
    if headdim_qk == 0 or headdim_v == 0:
        raise ValueError(f"head dims must be >= 1; got q/k {headdim_qk}, v {headdim_v}")
    left, right, top_left = normalize_mask_options(causal, window_size)
    scale = check_scalar(softmax_scale, "softmax_scale", default=1.0 / math.sqrt(headdim_qk))
    formed_in = "float64" if np.dtype(q.dtype) == np.float64 else "float32"  # the dtype scores are formed in
    if abs(scale) > float(np.finfo(formed_in).max):
        raise ValueError(f"softmax_scale must lie within {formed_in}'s range (|scale| <= {np.finfo(formed_in).max:.4g}), "
                         f"the dtype the scores of {np.dtype(q.dtype).name} inputs are formed in; got {scale}")
    cap = check_scalar(softcap, "softcap", default=0.0)
    if cap < 0 or (cap > 0 and not SOFTCAP_RANGE[0] <= cap <= SOFTCAP_RANGE[1]):
        raise ValueError(
            f"softcap must be 0 (disabled) or lie in [{SOFTCAP_RANGE[0]:g}, {SOFTCAP_RANGE[1]:g}]; got {cap}"
        )
    slopes = None
    if alibi_slopes is not None:
        slopes = check_alibi_slopes(alibi_slopes, q, batch, nheads_q, max_distance=max(seqlen_q, seqlen_k, 1) - 1)
    if seqlens_k is not None:
        seqlens_k, values = check_index_array(seqlens_k, "seqlens_k", like=q, length=batch)
        if values is not None and values.size and (values.min() < 0 or values.max() > seqlen_k):
            raise ValueError(
                f"seqlens_k values must lie in [0, {seqlen_k}] (k's seqlen); got min {values.min()}, "
                f"max {values.max()}"
            )
    return AttnProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, nheads_k=nheads_k,
        headdim_qk=headdim_qk, headdim_v=headdim_v, dtype=np.dtype(q.dtype), softmax_scale=scale,
        window_left=left, window_right=right, top_left=top_left, softcap=cap,
        alibi_slopes=slopes, seqlens_k=seqlens_k,
    )


def check_modifiers(q, p: AttnProblem, bias, mask, dropout_p, dropout_seed) -> AttnProblem:
    """``p`` with an additive bias, a boolean mask and dropout, after checking them (names in
    messages as the API spells them)."""
    full = (p.batch, p.nheads_q, p.seqlen_q, p.seqlen_k)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        _arrays.refuse_masked(x, name)
        if not _arrays.is_array(x):
            raise TypeError(f"{name} must be an array (NumPy, or CuPy with GPU inputs); got {type(x).__name__}")
        if not _arrays.same_kind(x, q):
            raise TypeError(f"{name} must be the same kind of array as q (NumPy or GPU)")
        kind = np.dtype(x.dtype)
        if name == "bias" and not is_float_dtype(kind):
            raise TypeError(f"bias must be a float array (float16, bfloat16, float32 or float64); got dtype "
                            f"{kind.name}" + (" (a boolean mask goes to mask=)" if kind == np.bool_ else ""))
        if name == "mask" and kind != np.bool_:
            raise TypeError(f"mask must be a bool array (True = attend); got dtype {kind.name}"
                            + (" (an additive float mask goes to bias=)" if is_float_dtype(kind)
                               else " (a 0/1 mask: pass mask.astype(bool))" if kind.kind in "iu" else ""))
        try:
            if x.ndim > 4 or np.broadcast_shapes(tuple(x.shape), full) != full:
                raise ValueError
        except ValueError:
            hint = (f"; a (batch, seqlen_k) key-padding {name} goes in as {name}[:, None, None, :]"
                    if tuple(x.shape) == (p.batch, p.seqlen_k) else "")
            raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to (batch, nheads, seqlen_q, "
                             f"seqlen_k) = {full}{hint}") from None
        _refuse_ambiguous_leading_axis(name, x, p)
        if name == "bias":
            _check_bias_range(x, p.dtype)
    dropout = None
    from .dropout import check_dropout_p, device_seed, seed_and_offset

    rate = check_dropout_p(dropout_p)
    seed_array = device_seed(dropout_seed)  # (checked without reading it)
    if seed_array is not None and not _arrays.is_gpu(q):
        raise TypeError("dropout_seed is a GPU array: it needs GPU inputs (q, k, v); pass an int or a (seed, offset) "
                        "pair for NumPy inputs")
    if rate > 0:
        if dropout_seed is None:
            raise ValueError("dropout_p > 0 needs a dropout_seed (an int or a (seed, offset) pair): the backward "
                             "pass regenerates the same mask from it")
        dropout = (rate, 0, 0, 0) if seed_array is not None else (rate, *seed_and_offset(dropout_seed), 0)
    elif dropout_seed is not None and seed_array is None:
        seed_and_offset(dropout_seed)  # still a valid seed
    if bias is None and mask is None and dropout is None:
        return p
    return dataclasses.replace(p, bias=bias, mask=mask, dropout=dropout,
                               dropout_seed_array=seed_array if dropout is not None else None)


def _refuse_ambiguous_leading_axis(name, x, p: AttnProblem) -> None:
    """A 2-D or 3-D bias or mask whose first axis has batch's size where batch's size is also that
    of the axis NumPy's broadcasting lines it up with (seqlen_q for 2-D, nheads for 3-D): a
    (batch, seqlen_k) key-padding mask would otherwise be taken as (seqlen_q, seqlen_k) when
    batch == seqlen_q, silently, while any other batch gets an error.  Four axes say which."""
    if x.ndim not in (2, 3) or x.shape[0] != p.batch or p.batch < 2:
        return
    axis, spelled = ("seqlen_q", f"{name}[None, None]") if x.ndim == 2 else ("nheads", f"{name}[None]")
    as_batch = f"{name}[:, None, None, :]" if x.ndim == 2 else f"{name}[:, None]"
    rest = "seqlen_k" if x.ndim == 2 else "seqlen_q, seqlen_k"
    raise ValueError(f"{name} of shape {tuple(x.shape)} is ambiguous here: its first axis could be batch or {axis} "
                     f"(both {p.batch}), and NumPy's broadcasting would read it as {axis}; give the four axes: "
                     f"{spelled} for ({axis}, {rest}), {as_batch} for (batch, {rest})")


def _check_bias_range(bias, dtype) -> None:
    """A NumPy float64 bias added to float32 scores (every input dtype but float64) must not hold
    finite values past float32's largest: they would become +inf there and the row NaN.  Values
    below float32's range become -inf, which masks as the caller means (a GPU bias is not read
    back: that would synchronise)."""
    if not isinstance(bias, np.ndarray) or np.dtype(dtype) == np.float64 or np.dtype(bias.dtype) != np.float64:
        return
    finite = bias[np.isfinite(bias)]
    if finite.size and finite.max() > FLOAT32_MAX:
        raise ValueError(f"bias holds finite values above float32's range (max {finite.max():.4g}); the scores of "
                         f"{np.dtype(dtype).name} inputs are float32, where they would become +inf and their rows "
                         f"NaN: clip the bias, or use float64 inputs")


def with_precision(q, p: AttnProblem, precision) -> AttnProblem:
    """``p`` with the checked ``precision=`` option (cuflash/_precision.py)."""
    from ._precision import check_precision

    checked = check_precision(precision, dtype_name(q))
    return p if checked == p.precision else dataclasses.replace(p, precision=checked)


def check_alibi_slopes(alibi_slopes, q, batch: int, nheads_q: int, max_distance: int):
    """ALiBi slopes of shape (nheads,) or (batch, nheads) -> (batch, nheads): float32 for the
    16-bit and float32 GPU kernels, float64 for the float64 ones and the NumPy path (which casts them to its accumulation dtype, so
    float32 and float64 inputs keep the slopes' precision over long distances).  NumPy slopes
    times ``max_distance`` (max(Sq, Sk) - 1, a bound on |i + offset - j| under either causal
    alignment) must stay within float32's range, float64's for float64 inputs."""
    _arrays.refuse_masked(alibi_slopes, "alibi_slopes")
    if not _arrays.is_array(alibi_slopes):
        raise TypeError(f"alibi_slopes must be an array; got {type(alibi_slopes).__name__}")
    if not is_float_dtype(alibi_slopes.dtype):
        raise TypeError(f"alibi_slopes must be a float array; got dtype {np.dtype(alibi_slopes.dtype).name}")
    shape = tuple(alibi_slopes.shape)
    if shape not in ((nheads_q,), (batch, nheads_q)):
        raise ValueError(f"alibi_slopes must have shape ({nheads_q},) or ({batch}, {nheads_q}); got {shape}")
    # float64 inputs use the slopes as float64 on both paths; the others as float32 on the GPU (and
    # the NumPy path checks the same, so that both paths take the same calls)
    used = np.float64 if dtype_name(q) == "float64" else np.float32
    if isinstance(alibi_slopes, np.ndarray):  # device slopes are not read back (that would synchronise)
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.isfinite(alibi_slopes.astype(used)).all()
        if not finite:
            raise ValueError(f"alibi_slopes must be finite within {np.dtype(used).name}'s range (they are used as "
                             f"{np.dtype(used).name})")
        largest = float(np.abs(alibi_slopes).max()) if alibi_slopes.size else 0.0
        if largest * max_distance > float(np.finfo(used).max):  # the bias slope * distance is formed in that dtype
            raise ValueError(f"alibi_slopes times the largest query-key distance ({max_distance}) must stay within "
                             f"{np.dtype(used).name}'s range; got max |slope| = {largest:.4g}")
    # float32 for the 16-bit and float32 kernels; float64 on the NumPy path and for the float64 kernels
    wide = isinstance(q, np.ndarray) or np.dtype(q.dtype) == np.float64
    slopes = _arrays.to_device_like(alibi_slopes, q).astype(np.float64 if wide else np.float32)
    xp = _arrays.module_of(q)
    return xp.ascontiguousarray(xp.broadcast_to(slopes, (batch, nheads_q)))


def check_out(out, name: str, shape: tuple, dtype, like):
    """A caller-supplied output buffer must match exactly."""
    if out is None:
        return None
    _arrays.check_array(out, name)
    if not _arrays.same_kind(out, like):
        raise TypeError(f"{name} must be the same kind of array as q ({type(like).__name__}); got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(out.shape)}")
    if dtype_name(out) != np.dtype(dtype).name:  # by name, as check_qkv: byte order is free
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}; got {dtype_name(out)}")
    return out


def check_output_buffer(out, name: str, shape: tuple, dtype, like, inputs=()):
    """An array the call will write: as :func:`check_out`, plus writable and apart from the inputs."""
    out = check_out(out, name, shape, dtype, like)
    if out is None:
        return None
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError(f"{name} is read-only; pass a writable array")
    if out.size > 1 and not elements_apart(out):
        raise ValueError(f"{name} has elements that share memory (a zero or overlapping stride); pass a buffer "
                         "whose elements are distinct")
    for input_name, x in inputs:
        if x is not None and x.size and out.size and _arrays.same_kind(out, x) and shares_memory(out, x):
            raise ValueError(f"{name} overlaps {input_name}; the output must not share memory with the inputs")
    return out


def elements_apart(x) -> bool:
    """Whether no two elements of ``x`` share memory: with the axes sorted by |stride|, each stride
    spans the whole extent of the axes below it (sufficient; every layout NumPy or CuPy makes
    without as_strided passes)."""
    dims = sorted((abs(st), n) for st, n in zip(x.strides, x.shape) if n > 1)
    extent = x.itemsize
    for stride, n in dims:
        if stride < extent:
            return False
        extent = stride * n
    return True


def shares_memory(a, b) -> bool:
    """Whether ``a`` and ``b`` share an element: the bounds test, then (NumPy) the exact test, so
    that interleaved views of one buffer (FlashAttention's packed qkv / dqkv) count as apart."""
    xp = _arrays.module_of(a)
    if not xp.may_share_memory(a, b):
        return False
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        return True  # CuPy arrays: the bounds test alone
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except getattr(np, "exceptions", np).TooHardError:  # NumPy < 1.25: np.TooHardError
        return True


def check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Check packed (total, heads, dim) inputs; return (batch, cu_q, cu_k, max_q, max_k)."""
    check_qkv(q, k, v, packed=True)
    cu_q, host_q = check_index_array(cu_seqlens_q, "cu_seqlens_q", like=q)
    cu_k, host_k = check_index_array(cu_seqlens_k, "cu_seqlens_k", like=q)
    if cu_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have at least one entry (batch + 1 offsets)")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
            f"{cu_q.shape[0]} and {cu_k.shape[0]}"
        )
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"v must have k's tokens and heads {tuple(k.shape[:2])}; got {tuple(v.shape[:2])}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has head dim {k.shape[2]}; it must equal q's head dim {q.shape[2]}")
    for name, x in (("q", q), ("k", k)):
        if x.shape[0] >= 2**31:  # the kernels keep packed row offsets in 32 bits
            raise ValueError(f"{name} has {x.shape[0]} packed rows; at most 2**31 - 1 are supported")
    batch = cu_q.shape[0] - 1
    # max_seqlen_* = None needs the offsets on the host (one small copy, the caller's choice):
    # then they are checked there too, before anything runs.
    if host_q is None and max_seqlen_q is None:
        host_q = _arrays.to_numpy(cu_q)
    if host_k is None and max_seqlen_k is None:
        host_k = _arrays.to_numpy(cu_k)
    for name, values, total in (("cu_seqlens_q", host_q, q.shape[0]), ("cu_seqlens_k", host_k, k.shape[0])):
        if values is None:
            continue
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0; got {values[0]}")
        down = np.flatnonzero(values[1:] < values[:-1])  # (compared, not subtracted: no wrap-around)
        if down.size:
            i = int(down[0]) + 1
            raise ValueError(f"{name} must be non-decreasing; entry {i} = {values[i]} is below entry {i - 1} = "
                             f"{values[i - 1]}")
        if values[-1] > total:
            raise ValueError(f"{name}[-1] = {values[-1]} exceeds the {total} packed tokens")
    # A sequence is never longer than the packed total: larger values are a bound, kept in range.
    max_q = min(_max_seqlen(host_q, max_seqlen_q, "max_seqlen_q"), q.shape[0])
    max_k = min(_max_seqlen(host_k, max_seqlen_k, "max_seqlen_k"), k.shape[0])
    return batch, cu_q, cu_k, max_q, max_k


def _max_seqlen(values, given, name):
    if given is None:  # values: on the host (check_varlen copied GPU offsets)
        return int(np.diff(values).max()) if values.size > 1 else 0
    given = _check_int(given, name, minimum=0)
    if values is not None and values.size > 1 and int(np.diff(values).max()) > given:
        raise ValueError(f"{name} = {given} is smaller than the longest sequence {int(np.diff(values).max())}")
    return given
