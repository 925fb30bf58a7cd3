"""Bad GPU index values reported without a synchronisation, and memory for captured CUDA graphs.

GPU index arrays (``cu_seqlens_*``, ``seqlens_k``, ``cache_seqlens``, ``block_table``,
``cache_batch_idx``) are never copied to the host: the kernels check their values
(``kernels/metadata.cuh``), keep every access inside the arrays, give the rows of a sequence with
bad metadata NaN, and record the first violation in an *error word* of mapped host memory (one per
device, allocated once, never freed), which the host reads without waiting for the GPU.  Every
cuflash entry point first reads the words (:func:`entry`) and raises :class:`InvalidIndexError`
for a recorded violation; :func:`synchronize` waits for the current stream first, so that the
error of a call just made is raised deterministically.

A record is ``call << 40 | argument << 36 | index``: ``call`` numbers a description of the launch
(:func:`call_code`: function name and the extents the values were checked against), ``argument``
is one of ``_ARGUMENTS`` (the ``kArg*`` numbers of metadata.cuh), ``index`` the flat index of the
first bad entry.

CUDA graphs: while the current stream is capturing, every array a cuflash call allocates
(outputs, padded copies, split-KV scratch, the append's flags) is kept alive by
:func:`release_graph_memory`'s list instead of returning to CuPy's pool on return, so that a
replay of the graph never touches memory handed to someone else.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import sys
import threading

_NONE = (1 << 64) - 1  # an error word holding no record

# Argument numbers of a record (kernels/metadata.cuh, kArg*).
_CU_Q, _CU_K, _SEQLENS, _TABLE, _BATCH_IDX, _MAX_Q, _MAX_K, _APPEND = range(8)


class NotAvailableOnGPU(NotImplementedError, TypeError):
    """A feature the CUDA path does not offer yet (the NumPy path does), raised before anything is
    written; the message names it.

    A TypeError too, so that code catching the documented dtype error keeps working.
    """


class InvalidIndexError(ValueError):
    """GPU index values (``cu_seqlens_*``, ``seqlens_k``, ``cache_seqlens``, ``block_table``,
    ``cache_batch_idx``) that a kernel found invalid.

    Raised by the next cuflash call after the faulty one (or at once by
    :func:`cuflash.synchronize`), since GPU index arrays are checked on the device, without a
    copy to the host.  The faulty call returned NaN for the rows of the sequences concerned and
    wrote nothing to a KV cache for them.  A ``ValueError``, like the errors the same values give
    when they are NumPy arrays (checked on the host, before anything runs).
    """


# Descriptions of launches: number -> (function, extents), for the _MAX_CALLS described last (a
# training loop with a new total_q per step must not grow it without bound; a record whose
# description was dropped still names its argument and entry).  Numbers wrap below 2^23.
_CALLS: dict = {}
_CALL_NUMBERS: "collections.OrderedDict" = collections.OrderedDict()  # key -> number, least recent first
_MAX_CALLS = 4096
_next_number = 0
_LOCK = threading.Lock()


def call_code(function: str, **extents) -> int:
    """The number of the description of a launch by ``function`` whose index values are checked
    against ``extents`` (total_q, total_k, seqlen_k, seqlen_new, kv_rows, table_stride,
    max_seqlen_q, max_seqlen_k; those that apply)."""
    global _next_number
    key = (function, tuple(sorted(extents.items())))
    with _LOCK:
        number = _CALL_NUMBERS.get(key)
        if number is not None:
            _CALL_NUMBERS.move_to_end(key)
            return number
        number, _next_number = _next_number, (_next_number + 1) % (1 << 23)
        _CALL_NUMBERS[key] = number
        _CALLS[number] = (function, dict(extents))
        while len(_CALL_NUMBERS) > _MAX_CALLS:
            _, dropped = _CALL_NUMBERS.popitem(last=False)
            _CALLS.pop(dropped, None)
    return number


def describe(record: int, device: int) -> str:
    """The message of an error record (see the module docstring)."""
    call, arg, index = record >> 40, (record >> 36) & 15, record & ((1 << 36) - 1)
    function, x = _CALLS.get(call, ("a cuflash call", {}))
    seqlens = "cache_seqlens" if function == "attention_with_kvcache" else "seqlens_k"
    rows = f"0..{x.get('kv_rows', 0) - 1}" if x.get("kv_rows") else "the cache has none"
    if arg in (_CU_Q, _CU_K):
        name, side = ("cu_seqlens_q", "q") if arg == _CU_Q else ("cu_seqlens_k", "k")
        total = x.get("total_q" if arg == _CU_Q else "total_k", "?")
        what = (f"{name}[{index}] breaks the rules of packed offsets (start at 0, never decrease, end at most "
                f"at {side}'s {total} rows); every sequence from that entry on is affected")
    elif arg == _SEQLENS and function == "attention_with_kvcache":
        new = x.get("seqlen_new", 0)
        what = (f"cache_seqlens[{index}] is negative, or with the {new} new tokens past the cache capacity "
                f"{x.get('seqlen_k', '?')}")
    elif arg == _SEQLENS:
        what = f"{seqlens}[{index}] lies outside [0, {x.get('seqlen_k', '?')}] (k's seqlen)"
    elif arg == _TABLE:
        b, j = divmod(index, max(1, x.get("table_stride", 1)))
        what = f"block_table[{b}, {j}] is not a page of the cache ({rows})"
    elif arg == _BATCH_IDX:
        what = f"cache_batch_idx[{index}] is not a row of the cache ({rows})"
    elif arg in (_MAX_Q, _MAX_K):
        name, side = ("max_seqlen_q", "cu_seqlens_q") if arg == _MAX_Q else ("max_seqlen_k", "cu_seqlens_k")
        what = (f"sequence {index} of {side} is longer than {name} = "
                f"{x.get('max_seqlen_q' if arg == _MAX_Q else 'max_seqlen_k', '?')}; pass the longest length, or None")
    else:
        what = (f"sequence {index}'s new tokens would overwrite cache slots that another position uses (two "
                "sequences on one cache_batch_idx row, a page shared with another sequence's keys, or a page "
                "listed twice in its block_table row)")
    return (f"{function} (an earlier call, on GPU {device}) was given invalid index values: {what}.  Its "
            "output rows (and gradients) for the sequences concerned are NaN, and nothing was written to a "
            "KV cache for them.  GPU index arrays are checked on the device, so the error reaches the next "
            "cuflash call; cuflash.synchronize() raises it at once, and CUFLASH_DEBUG=1 checks the values "
            "on the host before every launch.")


# One error word per device: (host pointer, ctypes view), allocated at the device's first launch.
_WORDS: dict = {}


def error_word(device: int) -> int:
    """Address of ``device``'s error word (mapped, portable host memory: the same address on
    the device under unified addressing), allocated on first use and never freed."""
    entry_ = _WORDS.get(device)
    if entry_ is None:
        import cupy

        runtime = cupy.cuda.runtime
        with _LOCK, cupy.cuda.Device(device):
            entry_ = _WORDS.get(device)
            if entry_ is None:
                ptr = runtime.hostAlloc(8, runtime.hostAllocMapped | runtime.hostAllocPortable)
                view = ctypes.c_uint64.from_address(ptr)
                view.value = _NONE
                entry_ = _WORDS[device] = (ptr, view)
    return entry_[0]


def raise_pending() -> None:
    """Raise :class:`InvalidIndexError` for the first device whose error word holds a record,
    clearing the word (so the next call goes ahead)."""
    for device, (_, view) in _WORDS.items():
        record = view.value
        if record != _NONE:
            view.value = _NONE
            raise InvalidIndexError(describe(record, device))


def synchronize() -> None:
    """Wait for CuPy's current stream, then raise any bad GPU index values its kernels found.

    cuflash checks GPU index arrays (``cu_seqlens_*``, ``seqlens_k``, ``cache_seqlens``,
    ``block_table``, ``cache_batch_idx``) inside its kernels, without copying them to the host, and
    raises what they find from the next cuflash call.  Call this after a call to learn at once
    whether its index values were valid.  Does nothing where no cuflash kernel has run.

    Parameters
    ----------
    None

    Returns
    -------
    None

    Raises
    ------
    InvalidIndexError
        A kernel found an index value outside the rules (a ``ValueError``); the message names the
        function, the argument and the first bad entry.  The word is cleared, so the next call
        goes ahead.

    Notes
    -----
    FlashAttention's variable-length and KV-cache kernels (Dao et al.) read these arrays
    unchecked; cuflash bounds every index derived from them by the arrays' extents and reports a
    violation through a word of mapped host memory, which costs no synchronisation.
    """
    if not _WORDS:
        return
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    raise_pending()


# --- CUDA graph capture ---------------------------------------------------------------------

_KEPT: list = []  # MemoryPointers allocated by cuflash calls during stream captures
_STATE = threading.local()


_current_stream = None  # cupy.cuda.get_current_stream, once CuPy is imported


def _capturing() -> bool:
    global _current_stream
    if _current_stream is None:
        cupy = sys.modules.get("cupy")
        if cupy is None:
            return False
        _current_stream = cupy.cuda.get_current_stream
    try:
        stream = _current_stream()
        return stream.ptr != 0 and stream.is_capturing()  # the legacy default stream never captures
    except Exception:  # e.g. the legacy stream queried while another stream captures: nothing to keep
        return False


def capturing() -> bool:
    """Whether the cuflash call running on this thread was made while its stream was capturing."""
    return getattr(_STATE, "capturing", False)


def _keeping(allocate):
    def malloc(size):
        mem = allocate(size)
        with _LOCK:
            _KEPT.append(mem)
        return mem

    return malloc


def release_graph_memory() -> int:
    """Hand back to CuPy's memory pool the memory of cuflash calls captured into CUDA graphs.

    While a CuPy stream is capturing, every array a cuflash call allocates (its outputs, padded
    copies, split-KV scratch, the KV append's flags) is kept alive after the call returns, so that
    replays of the graph read and write memory that nobody else is given.

    Parameters
    ----------
    None

    Returns
    -------
    int
        The number of allocations released.

    Raises
    ------
    Nothing.

    Notes
    -----
    Call it once the graphs holding cuflash calls are destroyed, never while one may still be
    launched.  Without it the memory stays held until the process ends.  Inference stacks capture
    a decode step (Flash-Decoding, Dao et al. 2023) once and replay it many times: the scratch of
    its split-KV merge must outlive the capture.
    """
    with _LOCK:
        n = len(_KEPT)
        _KEPT.clear()
    return n


def entry(fn):
    """Decorator of every public function: raise a pending :class:`InvalidIndexError` first; while
    the current CuPy stream is capturing, keep the call's allocations for the graph."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for _, view in _WORDS.values():
            if view.value != _NONE:
                raise_pending()
        if not _capturing():
            return fn(*args, **kwargs)
        if capturing():  # a cuflash call inside another: the outer one keeps the allocations
            return fn(*args, **kwargs)
        import cupy

        _STATE.capturing = True
        try:
            with cupy.cuda.using_allocator(_keeping(cupy.cuda.get_allocator())):
                return fn(*args, **kwargs)
        finally:
            _STATE.capturing = False

    return call
