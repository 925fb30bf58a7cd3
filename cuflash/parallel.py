"""Attention over several devices: ring (context-parallel) attention and sharded-cache decoding.

Each rank holds a slice of the sequence.  In ring attention (Liu et al., "Ring Attention with
Blockwise Transformers", 2023; Brandon et al., "Striped Attention", 2023, for the causal balance)
the key/value slices travel around a ring of ranks while each rank attends its queries to the
slice it holds; the partial results are merged exactly through their log-sum-exp
(:func:`cuflash.merge_states`, the Flash-Decoding merge), so the result equals attention over the
whole sequence up to rounding.  The backward pass sends each key/value slice around the ring
with its dK/dV accumulators, and each rank's gradient of a slice uses the merged ``out`` and
``lse`` of its queries (FlashAttention-2's recomputation with the global statistics).

Transport is whatever implements the small :class:`Communicator` interface: :class:`NcclComm`
over ``cupy.cuda.nccl`` for one process per GPU, or :func:`run_local`'s in-process
communicators (threads, NumPy or CuPy arrays) for tests and examples.

Causal balance: with ``scheme="zigzag"`` the sequence is cut into 2·world chunks and rank r holds
chunks r and 2·world−1−r (:func:`shard`), so every rank does the same causal work; every pair of
chunks is then full, diagonal (plain causal) or skipped.
"""

from __future__ import annotations

import ast
import queue
import threading
from typing import Protocol

import numpy as np

from . import _arrays
from . import _validate as V
from .api import attention, lse_dtype, merge_states

DEFAULT_TIMEOUT = 300.0  # seconds a collective may take before it raises naming the rank
SCHEMES = ("zigzag", "contiguous")


class Communicator(Protocol):
    """What the ring needs from a transport: the rank, the world size, a simultaneous
    send-to-one / receive-from-another of a tuple of arrays, started before the step's
    attention and finished after it (``start_sendrecv(...).wait()``; ``sendrecv`` is the two at
    once, and a communicator with only ``sendrecv`` exchanges after the step, without overlap),
    and an all-gather of small Python objects (option checks) or arrays."""

    rank: int
    size: int

    def start_sendrecv(self, arrays: tuple, dest: int, source: int) -> "Exchange": ...  # (optional)

    def sendrecv(self, arrays: tuple, dest: int, source: int) -> tuple: ...

    def allgather(self, obj) -> list: ...


class Exchange(Protocol):
    """A send/receive under way (:meth:`Communicator.start_sendrecv`)."""

    def wait(self) -> tuple:
        """The received arrays, usable on the current stream (raises CollectiveTimeout)."""
        ...


class _Done:
    """An exchange whose result is at hand (or is fetched by ``fetch`` when waited for)."""

    def __init__(self, fetch):
        self._fetch = fetch

    def wait(self):
        return self._fetch()


def _start_sendrecv(comm, arrays, dest, source):
    """``comm.start_sendrecv``, or for a communicator with only ``sendrecv`` (the interface
    :func:`_check_ring` asks for) the whole exchange when waited for: the same order on every
    rank, no overlap."""
    start = getattr(comm, "start_sendrecv", None)
    return start(arrays, dest, source) if start is not None else _Done(lambda: comm.sendrecv(arrays, dest, source))


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the communicator's timeout (a peer died or hangs)."""


def _check_timeout(timeout) -> float:
    """A communicator's timeout: seconds, a finite real number > 0 (NaN would wait forever)."""
    if timeout is None:
        raise TypeError("timeout must be a number of seconds > 0; got None")
    seconds = V.check_scalar(timeout, "timeout")
    if seconds <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0; got {timeout!r}")
    return seconds


# --- in-process communicators (tests, examples, one GPU) ---------------------------------------


MAX_LOCAL_WORLD = 256  # run_local's ranks: one thread each (an allgather fills world² mailboxes)


class _Hub:
    """Mailboxes between the ranks of one process: a queue per (source, destination, kind)."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self._boxes, self._lock = {}, threading.Lock()  # made as first used: world² of them would not fit
        self.failed = threading.Event()  # a rank raised: the others stop waiting

    def box(self, source, dest, kind) -> queue.Queue:
        for name, r in (("source", source), ("dest", dest)):
            if not _arrays.is_integer(r) or not 0 <= r < self.size:
                raise ValueError(f"{name} must be a rank in [0, {self.size}); got {r!r}")
        key = (int(source), int(dest), kind)
        box = self._boxes.get(key)
        if box is None:
            with self._lock:
                box = self._boxes.setdefault(key, queue.Queue())
        return box

    def get(self, source, dest, kind):
        box, waited = self.box(source, dest, kind), 0.0
        while True:
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                waited += 0.05
                if self.failed.is_set():
                    raise CollectiveTimeout(f"rank {dest}: rank {source} failed; giving up the {kind} exchange")
                if waited >= self.timeout:
                    raise CollectiveTimeout(f"rank {dest}: nothing from rank {source} within {self.timeout:g} s "
                                            f"({kind} exchange)") from None


def _ready(obj):
    """``obj`` with an event recorded on the current CuPy stream when it holds GPU arrays, so
    that a rank on another stream waits for the kernels that produced them (see _use)."""
    items = obj if isinstance(obj, tuple) else (obj,)
    if any(_arrays.is_gpu(x) for x in items):
        event = _arrays.cupy_module().cuda.Event(disable_timing=True)
        event.record()
        return obj, event
    return obj, None


def _use(message):
    obj, event = message
    if event is not None:
        _arrays.cupy_module().cuda.get_current_stream().wait_event(event)
    return obj


class LocalComm:
    """One rank of an in-process group (see :func:`run_local`); arrays are passed by reference
    (GPU arrays with an event, so ranks may run on different streams)."""

    def __init__(self, hub: _Hub, rank: int):
        self._hub, self.rank, self.size = hub, rank, hub.size

    def start_sendrecv(self, arrays, dest, source):
        self._hub.box(self.rank, dest, "p2p").put(_ready(arrays))  # sent at once; received when waited for
        return _Done(lambda: _use(self._hub.get(source, self.rank, "p2p")))

    def sendrecv(self, arrays, dest, source):
        return self.start_sendrecv(arrays, dest, source).wait()

    def allgather(self, obj):
        message = _ready(obj)
        for d in range(self.size):
            self._hub.box(self.rank, d, "all").put(message)
        return [_use(self._hub.get(s, self.rank, "all")) for s in range(self.size)]


def run_local(world: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world`` ranks, one thread each, with in-process
    communicators; return their results in rank order.

    Parameters
    ----------
    world : int
        Number of ranks, 1 to MAX_LOCAL_WORLD (256): one thread each.
    fn : callable
        Called as ``fn(comm, *args, **kwargs)``; ``comm.rank`` tells it which rank it is.
    timeout : float
        Seconds any exchange may wait for a peer.

    Returns
    -------
    list
        What ``fn`` returned on each rank.

    Raises
    ------
    TypeError, ValueError
        ``world`` not an integer in [1, MAX_LOCAL_WORLD], ``timeout`` not a finite number of seconds > 0.
    Exception
        The first exception a rank raised (the other ranks stop waiting for it).

    Notes
    -----
    For tests and examples of :func:`ring_attention` without NCCL (which refuses two ranks on one
    GPU); the arrays never leave the process (Liu et al. 2023's ring of FlashAttention calls,
    with its ranks as threads).
    """
    if not _arrays.is_integer(world):
        raise TypeError(f"world must be an integer >= 1; got {world!r}")
    if not 1 <= world <= MAX_LOCAL_WORLD:
        raise ValueError(f"world must be an integer in [1, {MAX_LOCAL_WORLD}] (one thread per rank); got {world!r}; "
                         "for more ranks run one process per rank with NcclComm")
    hub = _Hub(int(world), _check_timeout(timeout))
    results, errors = [None] * world, [None] * world

    def run(rank):
        try:
            results[rank] = fn(LocalComm(hub, rank), *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors[rank] = exc
            hub.failed.set()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, CollectiveTimeout)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class NcclComm:
    """A :class:`Communicator` over ``cupy.cuda.nccl`` (one process per GPU).

    Parameters
    ----------
    nccl_comm : cupy.cuda.nccl.NcclCommunicator
        Made by the caller, e.g. after exchanging ``cupy.cuda.nccl.get_unique_id()`` through
        ``cupyx.distributed``'s TCP store or ``mpi4py``.
    rank, size : int
    stream : cupy.cuda.Stream, optional
        Stream of the transfers (default: one of the communicator's own, so that a ring step's
        transfer runs while its attention does on the current stream).
    timeout : float
        Seconds a transfer may take before it raises naming the rank (the stream is polled); a
        finite number > 0.

    Notes
    -----
    Tensors are sent with ``ncclSend``/``ncclRecv`` inside one NCCL group per exchange, the
    transport of ring attention (Liu et al. 2023).  Run with NVLink multicast off
    (``NCCL_NVLS_ENABLE=0``) where the machine's notes ask for it.
    """

    def __init__(self, nccl_comm, rank: int, size: int, stream=None, timeout: float = DEFAULT_TIMEOUT):
        self.comm, self.rank, self.size, self.stream = nccl_comm, rank, size, stream
        self.timeout = _check_timeout(timeout)

    def _stream(self):
        cp = _arrays.cupy_module()
        if self.stream is None:
            self.stream = cp.cuda.Stream(non_blocking=True)
        return self.stream

    def _wait(self, stream, what):
        """Poll ``stream`` (a stream or an event) until it is done, at most the timeout."""
        import time

        start = time.monotonic()
        while not stream.done:
            if time.monotonic() - start > self.timeout:
                raise CollectiveTimeout(f"rank {self.rank}: {what} did not complete within {self.timeout:g} s")
            time.sleep(1e-4)

    def start_sendrecv(self, arrays, dest, source):
        """Start the exchange on the communicator's stream, after the work queued so far on the
        current stream (which produced ``arrays`` and last read the buffers this exchange may
        reuse); :meth:`wait` (host) polls it with the timeout and makes the current stream wait
        for it, so the kernels queued in between run beside the transfer."""
        cp = _arrays.cupy_module()
        from cupy.cuda import nccl

        compute, stream = cp.cuda.get_current_stream(), self._stream()
        queued = compute.record()
        stream.wait_event(queued)
        with stream:  # the buffers belong to the transfer's stream (CuPy's pool is per stream)
            sent = tuple(cp.ascontiguousarray(a) for a in arrays)
            received = tuple(cp.empty_like(a) for a in sent)  # every rank's slices share shapes
            nccl.groupStart()
            for a, r in zip(sent, received):
                self.comm.send(a.data.ptr, a.size * a.itemsize, nccl.NCCL_UINT8, dest, stream.ptr)
                self.comm.recv(r.data.ptr, r.size * r.itemsize, nccl.NCCL_UINT8, source, stream.ptr)
            nccl.groupEnd()
            done = stream.record()

        def finish():
            self._wait(done, f"the exchange with ranks {dest} and {source}")
            compute.wait_event(done)
            _ = sent  # (the copies sent stay alive until the transfer has read them)
            return received

        return _Done(finish)

    def sendrecv(self, arrays, dest, source):
        return self.start_sendrecv(arrays, dest, source).wait()

    def allgather(self, obj):
        cp = _arrays.cupy_module()
        from cupy.cuda import nccl

        if _arrays.is_gpu(obj):
            stream = self._stream()
            x = cp.ascontiguousarray(obj)
            stream.wait_event(cp.cuda.get_current_stream().record())  # x is made on the current stream
            out = cp.empty((self.size,) + x.shape, dtype=x.dtype)
            self.comm.allGather(x.data.ptr, out.data.ptr, x.size * x.itemsize, nccl.NCCL_UINT8, stream.ptr)
            self._wait(stream, "an all-gather")
            return list(out)
        # Python literals (ints, strings, tuples of them: the checks' option tuples) by their repr,
        # read back as the objects, as LocalComm returns them
        data = np.frombuffer(repr(obj).encode(), dtype=np.uint8)
        size = self.allgather(cp.asarray(np.array([data.size], np.int64)))
        width = int(max(int(s.get()[0]) for s in size))
        padded = np.zeros(width, np.uint8)
        padded[:data.size] = data
        parts = self.allgather(cp.asarray(padded))
        return [ast.literal_eval(bytes(p.get()[:int(n.get()[0])]).decode()) for p, n in zip(parts, size)]


# --- sharding ----------------------------------------------------------------------------------


def _check_scheme(scheme):
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}; got {scheme!r}")


def _check_axis(x, axis, name: str = "x") -> int:
    """``axis`` as a non-negative axis of ``x`` (an array), or a TypeError/ValueError naming it."""
    if not _arrays.is_array(x):
        raise TypeError(f"{name} must be a NumPy or CuPy array; got {type(x).__name__}")
    axis = V._check_int(axis, "axis")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for {name} of shape {tuple(x.shape)}")
    return axis % x.ndim


def _chunk_ids(rank: int, world: int, scheme: str) -> list:
    """Global chunk numbers a rank holds, in local order (all chunks of one size)."""
    return [rank] if scheme == "contiguous" else [rank, 2 * world - 1 - rank]


def shard(x, rank: int, world: int, *, scheme: str = "zigzag", axis: int = 1):
    """The slice of a whole sequence that ``rank`` holds.

    Parameters
    ----------
    x : array
        The whole sequence along ``axis`` (default 1: (batch, seqlen, nheads, headdim)).
    rank, world : int
        This rank and the number of ranks.
    scheme : {"zigzag", "contiguous"}
        "contiguous": rank r holds the r-th of ``world`` equal pieces; "zigzag": the sequence is
        cut into 2·world pieces and rank r holds pieces r and 2·world−1−r, concatenated (every
        rank then does the same causal work).
    axis : int
        The sequence axis.

    Returns
    -------
    array
        A view (contiguous scheme) or a concatenation (zigzag) along ``axis``.

    Raises
    ------
    TypeError
        ``x`` not an array; ``rank``, ``world`` or ``axis`` not an int.
    ValueError
        A length not divisible by ``world`` (contiguous) or 2·world (zigzag), a bad rank, world,
        axis or scheme.

    Notes
    -----
    Zig-zag sharding balances causal ring attention (Brandon et al., "Striped Attention", 2023;
    the zig-zag form of Zhu's ring attention over FlashAttention kernels).
    """
    _check_scheme(scheme)
    rank, world = V._check_int(rank, "rank"), V._check_int(world, "world", minimum=1)
    axis = _check_axis(x, axis)
    if not (0 <= rank < world):
        raise ValueError(f"rank must lie in [0, {world}); got {rank}")
    xp = _arrays.module_of(x)
    n = x.shape[axis]
    pieces = world if scheme == "contiguous" else 2 * world
    if n % pieces:
        raise ValueError(f"a sequence of {n} positions does not cut into {pieces} equal pieces ({scheme} over "
                         f"{world} ranks)")
    size = n // pieces
    parts = [xp.take(x, xp.arange(c * size, (c + 1) * size), axis=axis) for c in _chunk_ids(rank, world, scheme)]
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=axis)


def unshard(shards, *, scheme: str = "zigzag", axis: int = 1):
    """The whole sequence from every rank's shard (in rank order): the inverse of :func:`shard`.

    Parameters
    ----------
    shards : sequence of arrays
        ``shard(x, r, world)`` for r = 0 .. world-1.
    scheme : {"zigzag", "contiguous"}
    axis : int

    Returns
    -------
    array

    Raises
    ------
    TypeError
        ``shards`` not a sequence of arrays; ``axis`` not an int.
    ValueError
        No shards, shards of different ranks, shapes, dtypes or array kinds, a zig-zag shard of
        odd length, a bad axis or scheme.

    Notes
    -----
    See :func:`shard` (Brandon et al. 2023; ring attention over FlashAttention kernels).
    """
    _check_scheme(scheme)
    if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__") or _arrays.is_array(shards):
        raise TypeError(f"shards must be a list or tuple of arrays, one per rank; got {type(shards).__name__}")
    world = len(shards)
    if world == 0:
        raise ValueError("shards is empty: pass every rank's shard, in rank order")
    axis = _check_axis(shards[0], axis, "shards[0]")
    for i, x in enumerate(shards[1:], 1):
        if not _arrays.is_array(x) or x.ndim != shards[0].ndim:
            raise ValueError(f"shards[{i}] must be an array of {shards[0].ndim} dimensions as shards[0]; got "
                             f"{type(x).__name__} {getattr(x, 'shape', '')}")
    xp = _arrays.module_of(shards[0])
    n = shards[0].shape[axis]
    if any(s.shape[axis] != n for s in shards):
        raise ValueError(f"shards must all have {n} positions along axis {axis}; got {[s.shape[axis] for s in shards]}")
    for i, x in enumerate(shards[1:], 1):  # (concatenate's own error names no argument; it would upcast dtypes)
        if x.shape != shards[0].shape or x.dtype != shards[0].dtype or not _arrays.same_kind(x, shards[0]):
            raise ValueError(f"shards[{i}] ({type(x).__name__} {tuple(x.shape)} {x.dtype}) differs from shards[0] "
                             f"({type(shards[0]).__name__} {tuple(shards[0].shape)} {shards[0].dtype}); every rank's "
                             "shard has the same shape, dtype and array kind")
    if scheme == "contiguous":
        return xp.concatenate(list(shards), axis=axis)
    if n % 2:
        raise ValueError(f"zig-zag shards hold two equal pieces; got a length of {n}")
    half = n // 2
    pieces = [None] * (2 * world)
    for r, s in enumerate(shards):
        first, second = _chunk_ids(r, world, scheme)
        pieces[first] = xp.take(s, xp.arange(half), axis=axis)
        pieces[second] = xp.take(s, xp.arange(half, n), axis=axis)
    return xp.concatenate(pieces, axis=axis)


# --- ring attention ----------------------------------------------------------------------------


def _pair(cq: int, ck: int, causal: bool):
    """How query chunk cq sees key chunk ck: "full", "diag" (causal within the chunk) or None."""
    if not causal or ck < cq:
        return "full"
    return "diag" if ck == cq else None


def _local_chunks(x, rank, world, scheme, axis=1):
    """(global chunk number, slice) of a local shard."""
    ids = _chunk_ids(rank, world, scheme)
    size = x.shape[axis] // len(ids)
    return [(c, slice(i * size, (i + 1) * size)) for i, c in enumerate(ids)]


def _check_ring(comm, q, k, v, scheme, options):
    """The checks of :func:`cuflash.attention` on this rank's shards and options (``causal`` a bool
    here), the ring's own, and that every rank was called alike; returns ``causal``."""
    _check_scheme(scheme)
    _check_comm(comm, ("sendrecv", "allgather"))
    causal = options["causal"]
    if not isinstance(causal, (bool, np.bool_)):  # (the whole sequence's diagonal: no alignment to choose)
        raise TypeError(f"causal must be a bool; got {causal!r}")
    options = dict(options, causal=bool(causal))
    V.check_qkv(q, k, v)
    V.make_problem(q, k, v, **options)  # (v's length and heads, the scale, softcap: as attention checks them)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention over one sequence: q and k must have the same local "
                         f"length; got {q.shape[1]} and {k.shape[1]}")
    if scheme == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"zig-zag shards hold two equal pieces; got a local length of {q.shape[1]}")
    mine = repr((scheme, tuple(q.shape), tuple(k.shape), tuple(v.shape), sorted(_plain(options).items())))
    _called_alike(comm, mine, "shapes or options")
    return options["causal"]


def _check_comm(comm, methods):
    """``comm`` has the communicator's rank, size and ``methods``, with 0 <= rank < size."""
    missing = [m for m in ("rank", "size", *methods) if not hasattr(comm, m)]
    if missing:
        raise TypeError(f"comm must be a cuflash.parallel communicator (rank, size, {', '.join(methods)}); "
                        f"{type(comm).__name__} has no {', '.join(missing)}")
    rank, size = comm.rank, comm.size
    for name, x in (("rank", rank), ("size", size)):
        if not _arrays.is_integer(x):
            raise TypeError(f"comm.{name} must be an integer; got {x!r}")
    if not 0 <= rank < size:
        raise ValueError(f"comm.rank must lie in [0, comm.size) with comm.size >= 1; got rank {rank}, size {size}")


def _plain(x):
    """Options with NumPy scalars as Python numbers (so that 0.5 and np.float64(0.5) compare alike
    in _called_alike's repr), through dicts, tuples and lists."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_plain(v) for v in x)
    return x.item() if isinstance(x, np.generic) else x


def _called_alike(comm, mine: str, what: str, extra=None) -> list:
    """Every rank's ``extra``, gathered with ``mine`` (the repr of this rank's shapes and options),
    after checking that every rank passed the same ``mine``: else a ValueError naming the first
    rank that did not (``what`` says what it compares)."""
    everyone = comm.allgather((extra, mine))
    bad = next((r for r, (_, o) in enumerate(everyone) if o != mine), None)
    if bad is not None:
        raise ValueError(f"rank {comm.rank}: rank {bad} called with other {what} ({everyone[bad][1]}) than this "
                         f"rank ({mine})")
    return [e for e, _ in everyone]


def ring_attention(q, k, v, comm, *, causal=False, softmax_scale=None, softcap=0.0, scheme="zigzag",
                   return_lse=False):
    """Attention over a sequence split across ranks, each holding its shard of q, k and v.

    Parameters
    ----------
    q : array of shape (batch, seqlen_local, nheads, headdim)
        This rank's queries (``shard(q_whole, rank, world, scheme=scheme)``).
    k, v : arrays of shape (batch, seqlen_local, nheads_k, headdim[_v])
        This rank's keys and values, the same positions as q (GQA allowed).
    comm : Communicator
        :class:`NcclComm`, or a :func:`run_local` communicator.
    causal : bool
        Causal over the whole sequence (positions from the shard scheme).
    softmax_scale, softcap
        As in :func:`cuflash.attention`.
    scheme : {"zigzag", "contiguous"}
        How the sequence was sharded (:func:`shard`).
    return_lse : bool
        Also return the LSE of the local rows, (batch, nheads, seqlen_local).

    Returns
    -------
    out : array like q (the local rows of attention over the whole sequence)
    lse : float32 array (float64 for float64 inputs), only with ``return_lse``

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention`; q and k of different local lengths, an odd zig-zag
        length, ranks called with different shapes or options.
    CollectiveTimeout
        A peer did not answer within the communicator's timeout.

    Notes
    -----
    Ring attention (Liu et al. 2023): world steps; at each the rank passes the key/value shard it
    holds on (the transfer started first, on the communicator's stream) and attends its query
    chunks to it meanwhile (one FlashAttention call per chunk pair: full, diagonal-causal or
    skipped); partial (out, lse) are merged in float32 (float64 for float64 inputs) through
    :func:`cuflash.merge_states`, the merge of Flash-Decoding.
    """
    q, k, v = (_arrays.as_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    options = dict(causal=causal, softmax_scale=softmax_scale, softcap=softcap)
    return_lse = V.check_bool(return_lse, "return_lse")
    causal = _check_ring(comm, q, k, v, scheme, options)
    rank, world = comm.rank, comm.size
    acc = np.float64 if np.dtype(q.dtype) == np.float64 else np.float32
    q_chunks = _local_chunks(q, rank, world, scheme)
    state = {c: None for c, _ in q_chunks}
    block, owner = (k, v), rank
    for step in range(world):
        # The shard goes on to the next rank while this rank attends to it (Liu et al. 2023).
        exchange = _start_sendrecv(comm, block, (rank + 1) % world, (rank - 1) % world) if step < world - 1 else None
        for ck, ks in _local_chunks(block[0], owner, world, scheme):
            for cq, qs in q_chunks:
                mode = _pair(cq, ck, causal)
                if mode is None:
                    continue
                o, lse = attention(q[:, qs], block[0][:, ks], block[1][:, ks], causal=mode == "diag",
                                   softmax_scale=softmax_scale, softcap=softcap, return_lse=True)
                o = o.astype(acc)
                state[cq] = (o, lse) if state[cq] is None else merge_states(*state[cq], o, lse)
        if exchange is not None:
            block = exchange.wait()
            owner = (owner - 1) % world
    xp = _arrays.module_of(q)
    out = xp.concatenate([state[c][0] for c, _ in q_chunks], axis=1).astype(q.dtype)
    lse = xp.concatenate([state[c][1] for c, _ in q_chunks], axis=2)
    return (out, lse) if return_lse else out


def _block_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, softcap):
    """Gradients of one key block from the rows' global out and lse (as the GPU kernels use them)."""
    p = V.make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal, softcap=softcap)
    xp = _arrays.module_of(q)
    grads = [xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v)]
    if _arrays.is_gpu(q):
        from . import _gpu

        _gpu.backward(p, dout, q, k, v, out, lse, *grads, deterministic=True, call="ring_attention_backward")
    else:
        from . import _cpu

        _cpu.backward(p, dout, q, k, v, out, lse, *grads, given_stats=True)
    return grads


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False, softmax_scale=None, softcap=0.0,
                            scheme="zigzag"):
    """Gradients of :func:`ring_attention` for this rank's shard.

    Parameters
    ----------
    dout : array like out
        Gradient of the loss with respect to this rank's ``out``.
    q, k, v : arrays
        This rank's shards, as given to :func:`ring_attention`.
    out, lse : arrays
        This rank's :func:`ring_attention` results (``return_lse=True``).
    comm : Communicator
    causal, softmax_scale, softcap, scheme
        As given to :func:`ring_attention`.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k, v (this rank's shard)

    Raises
    ------
    TypeError, ValueError, CollectiveTimeout
        As :func:`ring_attention`.

    Notes
    -----
    Each key/value shard travels around the ring, and its dK/dV sums (float32, float64 for
    float64 inputs) one step behind it, coming back to the owner; each rank forms the gradient of
    its queries against the shard it holds from the merged ``out`` and ``lse`` while the shard
    moves on, and adds it to the sums from the ranks before (FlashAttention-2, Dao 2024,
    Algorithm 2, with the global statistics; the transfers overlap the work as in ring
    attention, Liu et al. 2023).
    """
    dout, q, k, v, out, lse = (_arrays.as_array(x, n) for x, n in zip(
        (dout, q, k, v, out, lse), ("dout", "q", "k", "v", "out", "lse")))
    options = dict(causal=causal, softmax_scale=softmax_scale, softcap=softcap)
    causal = _check_ring(comm, q, k, v, scheme, options)
    o_shape = tuple(q.shape[:3]) + (v.shape[3],)
    for name, x in (("dout", dout), ("out", out)):  # (as attention_backward checks them)
        V.check_out(x, name, o_shape, q.dtype, q)
    V.check_out(lse, "lse", (q.shape[0], q.shape[2], q.shape[1]), lse_dtype(q.dtype), q)
    rank, world = comm.rank, comm.size
    xp = _arrays.module_of(q)
    acc = np.float64 if np.dtype(q.dtype) == np.float64 else np.float32
    dq = xp.zeros(q.shape, dtype=acc)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    (bk, bv), owner = (k, v), rank
    q_chunks = _local_chunks(q, rank, world, scheme)
    sums = None  # the exchange bringing the dK/dV sums of the shard held now, from the ranks before
    for step in range(world):
        # K and V go on while this rank's part of their gradients is formed; the sums of the
        # shard held before go on while this step's part is (two transfers in flight).
        kv = _start_sendrecv(comm, (bk, bv), nxt, prev) if step < world - 1 else None
        dk_part, dv_part = xp.zeros(bk.shape, dtype=acc), xp.zeros(bv.shape, dtype=acc)
        for ck, ks in _local_chunks(bk, owner, world, scheme):
            for cq, qs in q_chunks:
                mode = _pair(cq, ck, causal)
                if mode is None:
                    continue
                g = _block_backward(dout[:, qs], q[:, qs], bk[:, ks], bv[:, ks], out[:, qs], lse[:, :, qs],
                                    causal=mode == "diag", softmax_scale=softmax_scale, softcap=softcap)
                dq[:, qs] += g[0].astype(acc)
                dk_part[:, ks] += g[1].astype(acc)
                dv_part[:, ks] += g[2].astype(acc)
        if sums is not None:
            dk_before, dv_before = sums.wait()
            dk_part, dv_part = dk_before + dk_part, dv_before + dv_part
        sums = _start_sendrecv(comm, (dk_part, dv_part), nxt, prev)  # world sends: each shard's sums come home
        if kv is not None:
            (bk, bv), owner = kv.wait(), (owner - 1) % world
    dk, dv = sums.wait()
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# --- decoding against a cache sharded over ranks ------------------------------------------------


def decode_with_sharded_cache(q, k_cache, v_cache, cache_seqlens, comm, k=None, v=None, *, softmax_scale=None,
                              softcap=0.0, return_lse=False):
    """Decode-style attention against a KV cache whose positions are split across ranks.

    Rank r holds positions ``[start_r, start_r + capacity_r)`` of every sequence, ``start_r``
    being the capacities of the ranks before it (gathered once per call).  Each rank attends
    its part, one all-gather of the partial ``(out, lse)`` and a merge give every rank the
    whole result; new tokens are written by the rank that owns their positions.

    Parameters
    ----------
    q : array of shape (batch, seqlen_q, nheads, headdim)
        The same queries on every rank; they see every valid key (no causal mask).
    k_cache, v_cache : arrays of shape (batch, capacity_r, nheads_k, headdim[_v])
        This rank's positions of each sequence's cache.
    cache_seqlens : int or int array of shape (batch,)
        Valid length of each whole sequence before the new tokens (the same on every rank).
        NumPy (or an int) when appending.
    comm : Communicator
    k, v : arrays of shape (batch, seqlen_new, nheads_k, headdim[_v]), optional
        New tokens, written at positions ``cache_seqlens[b] + t`` by their owners.
    softmax_scale, softcap
        As in :func:`cuflash.attention`.
    return_lse : bool

    Returns
    -------
    out : array of shape (batch, seqlen_q, nheads, headdim_v)
    lse : float32 array (batch, nheads, seqlen_q), only with ``return_lse``

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention_with_kvcache` (every check before a token is written);
        appending with GPU ``cache_seqlens`` (their owners must be known on the host); lengths
        plus new tokens past the whole capacity; ranks called with other shapes, lengths or
        options.
    CollectiveTimeout
        A peer did not answer within the communicator's timeout.

    Notes
    -----
    The split-KV merge of Flash-Decoding (Dao et al. 2023), with the splits on different
    devices: lse = log Σ_r exp(lse_r), out = Σ_r exp(lse_r − lse) out_r (:func:`cuflash.merge_states`).
    """
    from .kvcache import (attention_with_kvcache, check_cache_pair, check_cache_seqlens, check_cache_writes,
                          check_new_tokens)

    appending = k is not None or v is not None
    written = "when k and v are appended: new tokens are written into it in place" if appending else None
    q = _arrays.as_array(q, "q")
    k_cache, v_cache = (_arrays.as_array(x, n, written=written) for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    V.check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    if _arrays.is_gpu(q):  # a dtype without a GPU kernel: refused before this rank's cache is written
        from . import _gpu

        _gpu._check_gpu_dtype(q, None)
    _check_comm(comm, ("allgather",))
    return_lse = V.check_bool(return_lse, "return_lse")
    xp = _arrays.module_of(q)
    batch, seqlen_q, nheads_q, headdim = q.shape
    if k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} sequences; q has {batch}")
    check_cache_pair(k_cache, v_cache, headdim)
    # the scale, softcap and the heads' grouping, as attention_with_kvcache checks them, before any write
    V.finish_problem(q, batch, seqlen_q, k_cache.shape[1], nheads_q, k_cache.shape[2], headdim, v_cache.shape[3],
                     softmax_scale=softmax_scale, causal=False, window_size=(-1, -1), softcap=softcap,
                     alibi_slopes=None, seqlens_k=None)
    cache_seqlens, host = check_cache_seqlens(cache_seqlens, q, batch)
    new = 0
    if appending:
        if k is None or v is None:
            raise ValueError("k and v must be given together (new tokens to append) or both omitted")
        if host is None:
            raise ValueError("appending to a sharded cache needs cache_seqlens on the host (a NumPy array or an int): "
                             "each rank must know which new tokens it owns")
        k, v, new = check_new_tokens(q, k, v, k_cache, v_cache)
        check_cache_writes(q, k, v, k_cache, v_cache)
    # Every rank's capacity (its start), and that the ranks were called alike: the same shapes but
    # the capacity, lengths (where on the host), new tokens and options.
    mine = repr((tuple(q.shape), str(q.dtype), tuple(k_cache.shape[2:]), tuple(v_cache.shape[2:]),
                 None if host is None else host.tolist(), new, *_plain((softmax_scale, softcap)), return_lse))
    caps = [int(c) for c in _called_alike(comm, mine, "shapes, lengths or options", int(k_cache.shape[1]))]
    start, cap, total = sum(caps[:comm.rank]), caps[comm.rank], sum(caps)
    if host is not None and host.size and (int(host.min()) < 0 or int(host.max()) > total):
        raise ValueError(f"cache_seqlens values must lie in [0, {total}] (the whole cache capacity, ranks' capacities "
                         f"{caps}); got min {int(host.min())}, max {int(host.max())}")
    lengths = cache_seqlens.astype(np.int64)
    if appending:
        if host.size and int(host.max()) + new > total:
            raise ValueError(f"cache_seqlens + {new} new tokens exceed the whole cache capacity {total} "
                             f"(ranks' capacities {caps}); got max length {int(host.max()) + new}")
        pos = host.astype(np.int64)[:, None] + np.arange(new)[None, :] - start  # (batch, new) local positions
        b_idx, t_idx = np.nonzero((pos >= 0) & (pos < cap))
        if b_idx.size:
            rows, slots, toks = (xp.asarray(x) for x in (b_idx, pos[b_idx, t_idx], t_idx))
            k_cache[rows, slots] = k[rows, toks]
            v_cache[rows, slots] = v[rows, toks]
        lengths = lengths + new
    # This rank's part of each length; a GPU length outside [0, total] (not read back: that would
    # synchronise) becomes one past this rank's capacity, which the kernel's device-side check
    # reports (cuflash.synchronize raises InvalidIndexError) instead of a clipped, plausible result.
    local = xp.clip(lengths - start, 0, cap)
    if host is None:
        local = xp.where((lengths < 0) | (lengths > total), cap + 1, local)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=local, softmax_scale=softmax_scale,
                                      softcap=softcap, return_lse=True)
    acc = np.float64 if np.dtype(q.dtype) == np.float64 else np.float32
    outs, lses = comm.allgather(out.astype(acc)), comm.allgather(lse)
    out, lse = merge_states(xp.stack(outs), xp.stack(lses))
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
