"""Dropout on the attention probabilities, drawn from a counter-based generator.

The keep-mask is a pure function of the seed and of the element's position, so that the backward
pass regenerates it instead of storing it (FlashAttention, Dao et al. 2022, §3.1 and Algorithm 4)
and so that the NumPy path and the GPU kernels draw exactly the same mask.  The generator is
Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).

For element (b, h, i, j) of a (batch, nheads, seqlen_q, seqlen_k) probability matrix and a
``dropout_seed`` of (seed, offset):

    key     = (seed mod 2^32, (seed >> 32) + (offset >> 32) mod 2^32)
    counter = (j & ~9, i & ~8, b * nheads + h, offset mod 2^32)
    n       = 4 ((i >> 3) & 1) + 2 ((j >> 3) & 1) + (j & 1)
    draw    = 16-bit half (n & 1) of word n >> 1 of philox4x32_10(counter, key)
    keep    = draw < round((1 - dropout_p) * 2^16)

(for a packed batch: b is the sequence, i and j the positions within it).  Kept probabilities
are scaled by 1 / (1 - dropout_p).  One call of the generator draws eight elements: rows i, i + 8
and keys j, j + 1, j + 8, j + 9, the ones a GPU thread holds of two 8-key fragments of a score
tile, so that the kernels call it once per eight probabilities (FlashAttention 2 draws 8-bit
numbers; 16 bits keep dropout_p to 1/65536).
"""

from __future__ import annotations

import math
import os

import numpy as np

from . import _arrays

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key, xp=np):
    """Philox4x32 with 10 rounds, elementwise over arrays.

    Parameters
    ----------
    counter : sequence of 4 uint32-valued arrays (broadcastable to one shape)
    key : sequence of 2 uint32-valued arrays or ints
    xp : numpy or cupy

    Returns
    -------
    tuple of 4 uint32 arrays: the generator's output words for each counter.

    Notes
    -----
    Salmon et al. 2011, the Philox4x32 bijection: per round,
    ``(c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))`` and the
    key is bumped by the Weyl constants between rounds.
    """
    c0, c1, c2, c3 = (xp.asarray(c, dtype=xp.uint64) & _MASK32 for c in counter)
    k0, k1 = (xp.asarray(k, dtype=xp.uint64) & _MASK32 for k in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        p0, p1 = c0 * _M0, c2 * _M1  # 64-bit products of 32-bit values: exact in uint64
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
    return tuple(c.astype(xp.uint32) for c in (c0, c1, c2, c3))


def keep_threshold(dropout_p: float) -> int:
    """16-bit draws below this keep their element: round((1 - p) 2^16), in [0, 2^16]."""
    return int(round((1.0 - float(dropout_p)) * 2.0**16))


def device_seed(dropout_seed, name: str = "dropout_seed"):
    """The seed when it is a GPU array (checked: a contiguous int64 or uint64 array of shape (2,),
    (seed, offset), whose 64 bits the kernels read as unsigned on the device, so that the replays
    of a captured graph see the values written there since), else None."""
    if not _arrays.is_gpu(dropout_seed):
        return None
    if np.dtype(dropout_seed.dtype).name not in ("int64", "uint64"):
        raise TypeError(f"{name} as a GPU array must be int64 or uint64 (seed, offset); got {dropout_seed.dtype}")
    if tuple(dropout_seed.shape) != (2,) or not dropout_seed.flags.c_contiguous or dropout_seed.data.ptr % 8:
        raise ValueError(f"{name} as a GPU array must be a contiguous array of shape (2,) (seed, offset); got shape "
                         f"{tuple(dropout_seed.shape)}" + ("" if dropout_seed.flags.c_contiguous else ", not contiguous")
                         + (", not 8-byte aligned" if dropout_seed.data.ptr % 8 else ""))
    return dropout_seed


def seed_and_offset(dropout_seed, name: str = "dropout_seed"):
    """(seed, offset) as Python ints from an int, an (int, int) pair or an integer array of shape
    (2,) or () (a GPU array is read to the host here, its 64 bits as unsigned, as the kernels
    read them)."""
    if device_seed(dropout_seed, name) is not None:
        return tuple(int(x) & (2**64 - 1) for x in dropout_seed.get().astype(np.uint64))
    if isinstance(dropout_seed, np.ndarray):
        if dropout_seed.dtype.kind not in "iu":
            raise TypeError(f"{name} as an array must hold integers, (seed, offset) of shape (2,) or a seed of "
                            f"shape (); got {dropout_seed.dtype.name}")
        if dropout_seed.shape not in ((2,), ()):
            raise ValueError(f"{name} as an array must have shape (2,) (seed, offset) or () (a seed); got "
                             f"{dropout_seed.shape}")
        dropout_seed = tuple(int(x) for x in dropout_seed) if dropout_seed.ndim else int(dropout_seed)
    if _arrays.is_integer(dropout_seed):
        seed, offset = int(dropout_seed), 0
    elif isinstance(dropout_seed, (tuple, list)) and len(dropout_seed) == 2 and all(
            _arrays.is_integer(x) for x in dropout_seed):
        seed, offset = (int(x) for x in dropout_seed)
    else:
        raise TypeError(f"{name} must be an int or a (seed, offset) pair of ints; got {dropout_seed!r}")
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"{name}'s seed and offset must lie in [0, 2**64); got {seed}, {offset}")
    return seed, offset


def keep_mask_block(seed: int, offset: int, dropout_p: float, bh, i, j, xp=np):
    """Keep-mask of the elements at (b * nheads + h, i, j), given as broadcastable integer
    arrays: True where the element is kept."""
    key = (seed & _MASK32, ((seed >> 32) + (offset >> 32)) & _MASK32)
    i, j = xp.asarray(i, dtype=xp.uint64), xp.asarray(j, dtype=xp.uint64)
    words = philox4x32_10((j & ~xp.uint64(9), i & ~xp.uint64(8), bh, offset & _MASK32), key, xp)
    n = ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1)
    w = n >> 1
    word = xp.where(w == 0, words[0], xp.where(w == 1, words[1], xp.where(w == 2, words[2], words[3]))).astype(xp.uint64)
    return ((word >> (16 * (n & 1))) & 0xFFFF) < keep_threshold(dropout_p)


_DRAW_CHUNK = 1 << 20  # elements of the keep-mask drawn at a time by dropout_mask


def _memory_of(xp):
    """Bytes of physical memory (NumPy) or free memory of the current GPU (CuPy); None if unknown."""
    try:
        if xp is np:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return xp.cuda.runtime.memGetInfo()[0]
    except (AttributeError, ValueError, OSError):
        return None


def dropout_mask(dropout_seed, shape, dropout_p, *, like=None):
    """The keep-mask cuflash's dropout uses, as a boolean array.

    Parameters
    ----------
    dropout_seed : int, (int, int), or an integer array of shape (2,)
        The seed, or a (seed, offset) pair, as passed to :func:`cuflash.attention`; each in
        [0, 2**64) (a GPU array is read here, its entries as unsigned 64-bit values).
    shape : tuple of 4 ints
        (batch, nheads, seqlen_q, seqlen_k) of the attention probabilities.
    dropout_p : float
        Dropout probability in [0, 1 - 2**-10] (the rates cuflash.attention accepts).
    like : array, optional
        A CuPy array puts the result on its GPU (computed there); otherwise NumPy.

    Returns
    -------
    keep : bool array of ``shape``
        True where a probability is kept (and scaled by 1 / (1 - dropout_p)).

    Raises
    ------
    TypeError
        A seed that is neither an int nor a pair of ints; ``like`` not an array.
    ValueError
        A shape that is not 4 non-negative ints, or of more elements than an array can hold,
        ``dropout_p`` outside [0, 1 - 2**-10], a seed or offset outside [0, 2**64).
        Also a mask (one byte an element) larger than the machine's memory (the GPU's free
        memory with a CuPy ``like``).
    MemoryError
        The mask does not fit in the memory left.  It is drawn in pieces of about a million
        elements, so the mask itself is all the memory it needs (NumPy draws about five million
        elements a second on one core).

    Notes
    -----
    Philox4x32-10 (Salmon et al. 2011) on the counter (j & ~9, i & ~8, b * nheads + h, offset),
    16 bits per element, as the module docstring spells out: the mask depends on nothing but the seed and the position,
    so the backward pass regenerates it (FlashAttention, Dao et al. 2022, §3.1).

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> keep = cuflash.dropout_mask(1234, (2, 4, 64, 64), 0.1)
    >>> keep.shape, keep.dtype, bool(0.85 < keep.mean() < 0.95)
    ((2, 4, 64, 64), dtype('bool'), True)
    >>> bool((keep == cuflash.dropout_mask((1234, 0), (2, 4, 64, 64), 0.1)).all())
    True
    """
    seed, offset = seed_and_offset(dropout_seed)
    p = check_dropout_p(dropout_p)
    dims = list(shape) if isinstance(shape, (tuple, list, np.ndarray)) else None
    if not (dims is not None and len(dims) == 4
            and all(_arrays.is_integer(n) and n >= 0 for n in dims)):
        raise ValueError(f"shape must be 4 non-negative ints (batch, nheads, seqlen_q, seqlen_k), the shape of the "
                         f"attention probabilities (not of q); got {shape!r}")
    shape = tuple(int(n) for n in dims)
    if like is not None and not (isinstance(like, np.ndarray) or _arrays.is_gpu(like)):
        raise TypeError(f"like must be a NumPy or CuPy array (a CuPy one puts the mask on its GPU), or None; "
                        f"got {type(like).__name__}")
    xp = _arrays.module_of(like) if like is not None else np
    batch, heads, sq, sk = shape
    elements, memory = math.prod(shape), _memory_of(xp)  # (a bool mask: one byte an element)
    if memory is not None and elements > memory:
        raise ValueError(f"shape {shape} asks for a keep-mask of {elements / 2**30:.3g} GiB (one byte an element), "
                         f"more than the {memory / 2**30:.3g} GiB of {'memory' if xp is np else 'free GPU memory'} here")
    try:
        keep = xp.empty(shape, dtype=bool)
    except ValueError as e:  # (NumPy: "array is too big")
        raise ValueError(f"shape {shape} has {elements} elements, more than an array can hold ({e})") from None
    except MemoryError as e:
        raise MemoryError(f"a keep-mask of shape {shape} needs {elements / 2**30:.1f} GiB, which could not be "
                          f"allocated ({type(e).__name__})") from None
    if keep.size == 0:
        return keep
    # Drawn in pieces of about _DRAW_CHUNK elements (the draw's temporaries take ~80 bytes an
    # element): row r of the (batch * nheads * seqlen_q, seqlen_k) view is query r % sq of pair r // sq.
    flat, rows = keep.reshape(-1, sk), batch * heads * sq
    step_r, step_c = max(1, _DRAW_CHUNK // sk), min(sk, _DRAW_CHUNK)
    for r0 in range(0, rows, step_r):
        r = xp.arange(r0, min(rows, r0 + step_r), dtype=xp.uint64)[:, None]
        bh, i = r // xp.uint64(sq), r % xp.uint64(sq)
        for c0 in range(0, sk, step_c):
            j = xp.arange(c0, min(sk, c0 + step_c), dtype=xp.uint64)[None, :]
            flat[r0:r0 + step_r, c0:c0 + step_c] = keep_mask_block(seed, offset, p, bh, i, j, xp)
    return keep


MAX_DROPOUT_P = 1.0 - 2.0**-10  # the keep rate's rounding (keep_threshold) is up to 2^-17 / (1 - p) relative: 0.8 % here


def check_dropout_p(dropout_p) -> float:
    """dropout_p as a float in [0, MAX_DROPOUT_P], else the ValueError/TypeError naming it."""
    if not _arrays.is_real(dropout_p):
        raise TypeError(f"dropout_p must be a float in [0, 1 - 2**-10]; got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p <= MAX_DROPOUT_P:  # (NaN too)
        why = (": an element is kept where its 16-bit draw is below round((1 - p) 2^16), a keep rate that may be off "
               "1 - p by up to 2^-17 / (1 - p) of it, more than 0.8 % above the bound (below 1 - p = 2**-17 it keeps none)"
               if MAX_DROPOUT_P < p < 1.0 else "")
        raise ValueError(f"dropout_p must lie in [0, 1 - 2**-10 = {MAX_DROPOUT_P:.6f}]; got {p}{why}")
    return p
