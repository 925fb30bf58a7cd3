"""Public functions: exact attention computed the FlashAttention way, on NumPy or CuPy arrays.

Every function validates its arguments once (``_validate``), then runs the tiled algorithm on the
CPU (``_cpu``, NumPy inputs) or the CUDA kernels (``_gpu``, CuPy and other GPU arrays).  The
shared parameter descriptions are written once below and substituted into each docstring.
"""

from __future__ import annotations

import inspect

import numpy as np

try:
    from numpy.lib.array_utils import normalize_axis_index
except ImportError:  # NumPy < 2
    from numpy.core.multiarray import normalize_axis_index

from . import _arrays, _cpu, _guard, dropout
from . import _validate as V

_OPTIONS_DOC = """\
    softmax_scale : float, optional
        Multiplies q·k before the softmax.  None (default) means ``1/sqrt(headdim_qk)``; 0.0 is
        taken literally (uniform weights).  Scores are formed in float32 (float64 for float64
        inputs): a scale that takes ``|scale · q·k|`` past float32's 3.4e38 overflows them (NaN
        or empty rows), which only the data can reveal, so it is not checked.
    causal : bool or {"bottom_right", "top_left"}, default False
        True (= "bottom_right", FlashAttention >= 2.1) lets query i see key j iff
        ``j <= i + Sk - Sq``; "top_left" (torch/JAX) iff ``j <= i``.  With Sq == Sk they agree.
        Rows that see no key return 0 with LSE -inf.
    window_size : (int, int) or None, default (-1, -1)
        Inclusive local window (left, right) around the same diagonal:
        key j is visible iff ``i + off - left <= j <= i + off + right`` with ``off = Sk - Sq``
        (``0`` for "top_left"); -1 means unbounded, and None is (-1, -1) (JAX's
        ``local_window_size=None``).  ``causal`` sets right to 0.
    softcap : float, default 0.0
        When > 0, scores become ``softcap * tanh(s / softcap)`` before ALiBi and masking
        (Gemma-2 style).
    alibi_slopes : float array of shape (nheads,) or (batch, nheads), optional
        ALiBi: adds ``-slope[h] * |i + off - j|`` to the scores (Press et al. 2022).
    seqlens_k : int32/int64 array (or list of ints) of shape (batch,), optional
        Valid key length of each batch entry of padded k, v; keys past it are never read and
        Sk in the causal and window rules is that length."""

_MODIFIERS_DOC = """    bias : float array broadcastable to (batch, nheads, seqlen_q, seqlen_k), optional
        Additive score bias (float16, bfloat16, float32 or float64), added after ALiBi and before
        the masks; e.g. (1, 1, Sq, Sk), (batch, 1, 1, Sk) key padding, (1, nheads, Sq, Sk).  Read
        through its strides, never materialised (a float64 bias on the GPU is read as a float32
        copy of its own size, except by the float64 kernels, which read it as it is).  Scores are
        float32 for every input dtype but float64: there a float64 bias above float32's range is a
        ValueError, and one below it (< -3.4e38) becomes -inf and masks the key (a row whose every
        key has such a bias gives 0 and LSE -inf, where exact arithmetic would only shift the row).  The backward needs the forward's bias (and mask, and dropout
        arguments) again: nothing checks that they are the same.  A 2-D or 3-D bias (or mask)
        whose first axis has batch's size (> 1) where seqlen_q (2-D) or nheads (3-D) has it too
        is a ValueError: NumPy would read that axis as seqlen_q or nheads, and a (batch, Sk)
        key-padding array meant otherwise would change the result silently; give four axes.
    mask : bool array broadcastable likewise, optional
        True = attend (the torch/JAX meaning); masked scores are -inf.  Key padding: shape
        (batch, 1, 1, Sk), e.g. ``valid[:, None, None, :]`` from a (batch, Sk) array (unlike
        ``seqlens_k`` it does not move a causal or window diagonal).  Rows with no True entry
        give output 0, LSE -inf and zero gradients.  On the GPU a small kernel first maps the
        mask per tile of the attention kernel: tiles where it is all False are skipped, tiles
        where it is all True read no mask (a key-padding mask then runs near the speed of
        ``seqlens_k``).
    dropout_p : float in [0, 1 - 2^-10], default 0.0
        Dropout on the attention probabilities after the row statistics, kept values scaled by
        1 / (1 - dropout_p); the LSE does not depend on it.  0.0 is exactly no dropout.  An
        element is kept when its 16-bit draw is below round((1 - dropout_p) 2^16), so the keep
        rate is 1 - dropout_p to within 2^-17 (FlashAttention 2 draws 8 bits): up to 0.8 % of
        1 - dropout_p at 1 - 2^-10, the largest rate accepted.
    dropout_seed : int, (int, int) or integer array of shape (2,), optional
        Seed, or (seed, offset), of the keep-mask, a pure function of the seed and of the
        element's (batch, head, query, key) position (:func:`cuflash.dropout_mask`, Philox4x32-10;
        the GPU kernels draw the same mask); required with ``dropout_p > 0``, and the same value
        must go to the backward.  With GPU inputs it may be a contiguous CuPy int64 (or uint64)
        array of shape (2,), read by the kernels on the device (its 64 bits as unsigned; never
        copied to the host), so that a captured CUDA graph replays with the values written there
        since; the array must then live as long as the graph."""

_METHOD_DOC = """\
    Tiled exact attention with an online softmax (Dao et al., "FlashAttention", NeurIPS 2022, §3.1;
    Dao, "FlashAttention-2", ICLR 2024, §3): the score matrix is never stored, only the output and
    the per-row log-sum-exp."""


# Packed batches and KV caches carry their key lengths elsewhere: their docstrings omit seqlens_k.
_VARLEN_OPTIONS_DOC = _OPTIONS_DOC[: _OPTIONS_DOC.index("    seqlens_k :")].rstrip("\n")


_PRECISION_DOC = """    precision : {None, "ieee", "highest", "tf32"}, optional
        Products of float32 inputs: None, "ieee" or "highest" (JAX's name) in IEEE float32 (as
        CuPy's float32 matmul without TF32); "tf32" on operands rounded to TF32 (10-bit mantissa,
        float32 accumulation; the error of a TF32 matmul; the NumPy path rounds likewise; an
        operand within 2^-11 of float32's largest value rounds to infinity, as on the tensor cores).
        float16/bfloat16 inputs take only None, float64 inputs no "tf32".  On the GPU, float32
        (TF32 tensor cores; None: 3xTF32 split products, Henry et al. 2019, "Leveraging the
        bfloat16 artificial intelligence datatype", adapted to TF32) and float64 (FP64 tensor
        cores) run :func:`attention`, :func:`attention_varlen`, their gradients and
        :func:`attention_with_kvcache`, bias, mask and dropout included; what those kernels lack
        yet (float64 gradients past head dim 192 on
        GPUs with 99 KB of shared memory a block) raises ``cuflash.NotAvailableOnGPU`` (a
        NotImplementedError and a TypeError) naming it."""


def _doc(fn):
    takes_seqlens_k = "seqlens_k" in inspect.signature(fn).parameters
    options = _OPTIONS_DOC if takes_seqlens_k else _VARLEN_OPTIONS_DOC
    if "bias" in inspect.signature(fn).parameters:
        options += "\n" + _MODIFIERS_DOC
    elif "dropout_p" in inspect.signature(fn).parameters:  # varlen: dropout only
        options += "\n" + _MODIFIERS_DOC[_MODIFIERS_DOC.index("    dropout_p :"):]
    if "precision" in inspect.signature(fn).parameters:
        options += "\n" + _PRECISION_DOC
    fn.__doc__ = fn.__doc__.replace("{options}", options).replace("{method}", _METHOD_DOC)
    return fn


def _run(gpu_name: str, cpu_fn, *args, **kwargs):
    """Dispatch to the GPU implementation for GPU arrays, else to the CPU path."""
    if any(_arrays.is_gpu(a) for a in args if a is not None):
        from . import _gpu

        return getattr(_gpu, gpu_name)(*args, **kwargs)
    return cpu_fn(*args, **kwargs)


def lse_dtype(dtype) -> np.dtype:
    """LSE is float32, or float64 for float64 inputs."""
    return np.dtype(np.float64) if np.dtype(dtype).name == "float64" else np.dtype(np.float32)  # any byte order


@_guard.entry
@_doc
def attention(
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
    bias=None,
    mask=None,
    dropout_p=0.0,
    dropout_seed=None,
    precision=None,
    return_lse=False,
    out=None,
    layout="bshd",
):
    """Exact softmax attention ``softmax(scale · q kᵀ) v``, computed tile by tile.

    Parameters
    ----------
    q : array of shape (batch, seqlen_q, nheads, headdim_qk)
        Queries; ``layout="bhsd"`` takes (batch, nheads, seqlen_q, headdim_qk).  float16,
        bfloat16 (``ml_dtypes.bfloat16``), float32 or float64.  NumPy arrays run on the CPU,
        CuPy arrays (and DLPack GPU arrays) on their GPU, on CuPy's current stream; lists,
        tuples and scalars are taken as NumPy takes them (integers as float64).  Unbatched
        (seqlen_q, nheads, headdim_qk) inputs (``"bhsd"``: (nheads, seqlen_q, headdim_qk)),
        with k, v (and out) likewise 3-D, run as one sequence: out has q's shape and the LSE
        is (nheads, seqlen_q), as in ``jax.nn.dot_product_attention``.
    k : array of shape (batch, seqlen_k, nheads_k, headdim_qk)
        Keys; nheads must be a multiple of nheads_k (GQA/MQA: query head h uses key head
        ``h // (nheads // nheads_k)``).
    v : array of shape (batch, seqlen_k, nheads_k, headdim_v)
        Values, same dtype as q.
{options}
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of the final scores over visible keys.
    out : array of shape (batch, seqlen_q, nheads, headdim_v), optional
        Preallocated output (q's dtype and array kind, shape in ``layout`` order), writable and
        sharing no memory with q, k, v.
    layout : {"bshd", "bhsd"}, default "bshd"
        Axis order of q, k, v and out.

    Returns
    -------
    out : array of shape (batch, seqlen_q, nheads, headdim_v)
        q's dtype and layout; accumulated in float32 (float64 for float64 inputs, and on the CPU
        path for float32 ones).  The accumulator holds sums of weights times v before the division by
        the row sum (FlashAttention's online softmax), so v values near the accumulator's
        largest (3.4e38 in float32, e.g. bfloat16 v ~ 1e38) can overflow it: NaN or inf rows
        where the exact result is finite.
    lse : array of shape (batch, nheads, seqlen_q), float32 (float64 for float64 inputs)
        Only when ``return_lse``; -inf on rows that see no key (their ``out`` is exactly 0), NaN
        on a row whose scores are NaN or overflow.

    Raises
    ------
    TypeError
        Arrays of mixed kinds or dtypes, unsupported dtypes, non-integer index arrays, a
        non-bool ``return_lse``, a ``causal`` that is neither a bool nor a string, a
        ``window_size`` that is neither a tuple, a list nor None, or has non-integer entries.  On GPU arrays, float32 and float64 with an option their
        kernels lack yet (float64 gradients past head
        dim 192 on GPUs with 99 KB of shared memory a block, sm_86/89) raise
        ``cuflash.NotAvailableOnGPU`` (a NotImplementedError and a TypeError) naming it.
    ValueError
        Inconsistent shapes, nheads not a multiple of nheads_k, a ``window_size`` of other than
        two entries or with an entry below -1, softcap outside
        0 or [1e-30, 1e30], seqlens_k outside [0, seqlen_k] (NumPy ``seqlens_k``), an ``out``
        that is read-only or overlaps q, k, v, bias, mask or seqlens_k.
    InvalidIndexError
        A ``ValueError``: a GPU ``seqlens_k`` entry outside [0, seqlen_k].  GPU index values are
        checked by the kernels, without a copy to the host: the call returns NaN for the rows
        (and LSE) of those batch entries, and the error is raised by the next cuflash call, or
        at once by :func:`cuflash.synchronize` (docs/conventions.md, "Index arrays").

    Notes
    -----
{method}

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 5, 2, 8)).astype(np.float32) for _ in range(3))
    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 8), (1, 2, 5))
    """
    fast_key = None
    if _arrays.is_gpu(q):  # warm calls replay an earlier launch (cuflash._fastpath)
        from . import _fastpath

        if (alibi_slopes is None and bias is None and mask is None and type(dropout_p) is float and dropout_p == 0.0
                and dropout_seed is None and precision is None):
            fast_key = _fastpath.signature("attention", (q, k, v, seqlens_k, out),
                                           (softmax_scale, causal, window_size, softcap, return_lse, layout))
        plan = _fastpath.lookup(fast_key)
        result = plan.run((q, k, v, seqlens_k), out, need_lse=bool(return_lse)) if plan is not None else None
        if result is not None:
            return result if return_lse else result[0]

    q, k, v = (_arrays.as_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim == 3:  # unbatched: one sequence, run as a batch of one
        if out is not None:
            _arrays.check_array(out, "out")
        _check_unbatched(layout, k=k, v=v, out=out)
        _check_unbatched_buffers(out=(out, q.shape[:-1] + v.shape[-1:]))
        res = attention(q[None], k[None], v[None], softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k,
                        bias=bias, mask=mask, dropout_p=dropout_p, dropout_seed=dropout_seed, precision=precision,
                        return_lse=return_lse, out=None if out is None else out[None], layout=layout)
        res_out, lse = res if isinstance(res, tuple) else (res, None)
        res_out = out if out is not None else res_out[0]
        return (res_out, lse[0]) if lse is not None else res_out
    p = V.make_problem(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, layout=layout,
    )
    p = V.check_modifiers(q, p, bias, mask, dropout_p, dropout_seed)
    p = V.with_precision(q, p, precision)
    if _arrays.is_gpu(q):  # a dtype without a GPU kernel for this call: refused before any write
        from . import _gpu

        _gpu.check_call(p, q)
    xp = _arrays.module_of(q)
    out_shape = (p.batch, p.seqlen_q, p.nheads_q, p.headdim_v)
    if layout == "bhsd":
        out_shape = (p.batch, p.nheads_q, p.seqlen_q, p.headdim_v)
    return_lse = V.check_bool(return_lse, "return_lse")
    inputs = (("q", q), ("k", k), ("v", v)) + tuple((n, x) for n, x in (("bias", p.bias), ("mask", p.mask),
                                                                        ("seqlens_k", _given_array(seqlens_k)))
                                                 if x is not None)
    out = V.check_output_buffer(out, "out", out_shape, q.dtype, q, inputs)
    out_given = out is not None
    if out is None:
        out = xp.empty(out_shape, dtype=q.dtype)
    lse = xp.empty((p.batch, p.nheads_q, p.seqlen_q), dtype=lse_dtype(q.dtype))
    if p.is_empty:
        pass  # nothing to compute: out and lse have no elements
    elif p.seqlen_k == 0:  # no keys: every row is empty (0 and -inf), no kernel launch
        out[...] = 0
        lse[...] = -np.inf
    else:
        qb, kb, vb, ob = (V.to_bshd(x, layout) for x in (q, k, v, out))
        if fast_key is None:
            _run("forward", _cpu.forward, p, qb, kb, vb, ob, lse)
        else:
            from . import _fastpath, _gpu

            record = []
            _gpu.forward(p, qb, kb, vb, ob, lse, record=record)
            if record:
                _fastpath.remember(fast_key, record[0], ("q", "k", "v", "seqlens_k"), (q, k, v, seqlens_k), out,
                                   out_given, lse.shape)
    return (out, lse) if return_lse else out


def _require_lse(lse) -> None:
    """The backward's lse, missing: say where it comes from."""
    if lse is None:
        raise TypeError("lse is None: the backward needs the forward's log-sum-exp; call the forward with "
                        "return_lse=True and pass its (out, lse)")


@_guard.entry
@_doc
def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    seqlens_k=None,
    bias=None,
    mask=None,
    dropout_p=0.0,
    dropout_seed=None,
    precision=None,
    layout="bshd",
    deterministic=False,
    dq=None,
    dk=None,
    dv=None,
    dlse=None,
    return_dbias=False,
):
    """Gradients of :func:`attention` by recomputation from ``out`` and ``lse``.

    Parameters
    ----------
    dout : array of shape (batch, seqlen_q, nheads, headdim_v)
        Gradient of the loss with respect to ``out``; any strides (even all zero).  Unbatched
        calls (3-D q, k, v, as in :func:`attention`) take 3-D dout and out, an LSE of shape
        (nheads, seqlen_q), and return 3-D gradients.
    q, k, v : arrays
        The forward inputs (shapes as in :func:`attention`).
    out : array of shape (batch, seqlen_q, nheads, headdim_v)
        The forward output.
    lse : array of shape (batch, nheads, seqlen_q)
        The forward log-sum-exp (``return_lse=True``).  The GPU kernels read ``out`` (for
        D = rowsum(dO ∘ O)) and ``lse``; the NumPy path recomputes the LSE and D from its own
        score tiles at its accumulation precision (float32 for 16-bit inputs, float64
        otherwise), which keeps float16/bfloat16 gradients on short rows and float32 gradients
        with large scores within the exactness rule, and gives dq = dk = 0 exactly on rows that
        see one key (at about 1.7 times the time of a NumPy backward that reads them).
        On the GPU, D from the rounded ``out``, and P and dS rounded to the input dtype before
        their products (as in FlashAttention-2), put dq, dk or dv past that rule on some
        problems whose rows see only a few keys: on an H200, 0–12 of 60 random 4-query problems
        with 1–9 keys per head dim (4, 64, 128), dtype and mask (full, causal, window (1, 0)),
        with errors of up to 2.9 times the bound (scripts/backward_short_rows.py measures it);
        problems of the sizes in the test suite meet it.  A NumPy model of the kernels' rounding
        (scripts/backward_rounding_model.py) reproduces these counts and needs all three of
        D = rowsum(P ∘ dP) from the recomputed P, P unrounded in dV and dS unrounded in dK and
        dQ to meet the rule on them: about twice the work of this backward.
{options}
    layout : {"bshd", "bhsd"}, default "bshd"
        Axis order of dout, q, k, v, out and of the gradients, as in :func:`attention`.
    deterministic : bool, default False
        Bitwise-repeatable gradients.  By default the Hopper backward (head dims 33–256 on
        compute capability 9.0) forms dQ inside the dK/dV kernel and adds it to an
        fp32 buffer of B·H·Sq·D floats with the copy engine's bulk reductions, and the
        float32/float64 backward on any GPU with atomics (a buffer in the input's dtype), so dq
        may differ in the last bits from run to run; ``True`` makes the Hopper kernel add dQ's
        parts to each query tile in a fixed order above head dim 64 (the key blocks in turn, as
        FlashAttention-3's deterministic mode; on an H200 0–10 % slower at 65–128, 23–32 % at
        129–256) and computes dQ in a kernel of its own elsewhere (no atomics, no buffer; 13–21 %
        slower at 33–64, see BENCHMARKS.md session 37; float32/float64 slower still: S and dP are
        formed twice).  The CPU path and the other GPU kernels are always repeatable;
        the GPU's ``dbias`` too, by summing a full-size float32 dS (float64 for float64 inputs) over the
        bias's broadcast axes afterwards (4 or 8 bytes per score; without ``deterministic`` atomics sum
        them in place).
    dq, dk, dv : arrays, optional
        Preallocated gradients (shapes and dtypes of q, k, v), writable and sharing no memory
        with the inputs or each other.
    dlse : array of lse's shape, optional
        Gradient of a loss through the returned LSE (dS gains P · dlse, since d lse_i / d s_ij
        = P_ij); without it the LSE is not differentiated.  float32 (float64 for float64 inputs),
        the same kind of array as q.
    return_dbias : bool, default False
        Also return ``dbias`` (needs ``bias``).

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k, v
        dk and dv sum over the query heads that share a key/value head.  Rows that see no key
        have dq = 0 and contribute nothing to dk, dv.
    dbias : array with bias's shape and dtype
        Only with ``return_dbias``: dS summed over the axes where bias has size 1 (accumulated
        in float32, float64 for float32/float64 inputs on the NumPy path; on the GPU in float32,
        float64 for float64 inputs, with atomics unless ``deterministic``).  On the GPU, bias, mask and dropout run the
        CUFLASH_MODS forms of the backward kernels (Hopper's, and kernels/flash_bwd.cu elsewhere).  They
        form P from the saved LSE, so a row whose every visible score is of magnitude beyond
        ~1e7 (a bias near float32's lowest on all its keys) gets P = 1 per key instead of 1/n
        (its LSE has lost ln n); its gradients are then wrong unless that row's dout and dlse
        are 0, as for padding rows (the NumPy path recomputes the row's max and sum).

    Raises
    ------
    TypeError, ValueError
        As :func:`attention`; also when dout, out, lse do not match the problem.
    InvalidIndexError
        As :func:`attention`: a GPU ``seqlens_k`` entry outside [0, seqlen_k] gives NaN
        gradients for that batch entry, and the error is raised by the next cuflash call.

    Notes
    -----
{method}
    Backward: D = rowsum(dO ∘ O), P = exp(S - lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D),
    dQ = scale · dS K, dK = scale · dSᵀ Q (FlashAttention-2, Algorithm 2), with the softcap
    derivative ``1 - tanh²`` applied to dS.  With dropout the keep-mask Z (scaled by 1/(1 - p)) is
    regenerated from the seed, not stored: dV = (P ∘ Z)ᵀ dO, dS = P ∘ (dP ∘ Z - D) (FlashAttention,
    Dao et al. 2022, Algorithm 4); dbias = dS before the softcap derivative; dlse enters as
    D - dlse.
    """
    _require_lse(lse)
    dout, q, k, v, out, lse = (
        _arrays.as_array(x, n)
        for x, n in zip((dout, q, k, v, out, lse), ("dout", "q", "k", "v", "out", "lse"))
    )
    if q.ndim == 3:  # unbatched: one sequence, run as a batch of one
        for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
            if x is not None:
                _arrays.check_array(x, name)
        _check_unbatched(layout, k=k, v=v, dout=dout, out=out, dq=dq, dk=dk, dv=dv)
        if lse.ndim != 2:
            raise ValueError(f"lse of an unbatched call must have shape (nheads, seqlen_q); got {tuple(lse.shape)}")
        o_shape = q.shape[:-1] + v.shape[-1:]
        lse_shape = (q.shape[0], q.shape[1]) if layout == "bhsd" else (q.shape[1], q.shape[0])
        dlse = None if dlse is None else _arrays.as_array(dlse, "dlse")
        _check_unbatched_buffers(dout=(dout, o_shape), out=(out, o_shape), lse=(lse, lse_shape), dq=(dq, q.shape),
                                 dk=(dk, k.shape), dv=(dv, v.shape), dlse=(dlse, lse_shape))
        lift = [None if x is None else x[None] for x in (dq, dk, dv)]
        grads = attention_backward(dout[None], q[None], k[None], v[None], out[None], lse[None],
                                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k,
                                   bias=bias, mask=mask, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                   precision=precision, layout=layout,
                                   deterministic=deterministic, dq=lift[0], dk=lift[1], dv=lift[2],
                                   dlse=None if dlse is None else dlse[None],
                                   return_dbias=return_dbias)
        return tuple(given if given is not None else g[0] for given, g in zip((dq, dk, dv), grads)) + tuple(grads[3:])
    p = V.make_problem(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, layout=layout,
    )
    p = V.check_modifiers(q, p, bias, mask, dropout_p, dropout_seed)
    p = V.with_precision(q, p, precision)
    deterministic = V.check_bool(deterministic, "deterministic")
    return_dbias = V.check_bool(return_dbias, "return_dbias")
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    if dlse is not None:
        dlse = _arrays.as_array(dlse, "dlse")
        V.check_out(dlse, "dlse", (p.batch, p.nheads_q, p.seqlen_q), lse_dtype(q.dtype), q)
    o_shape = tuple(V.to_bshd(q, layout).shape[:3]) + (p.headdim_v,)
    if layout == "bhsd":
        o_shape = (o_shape[0], o_shape[2], o_shape[1], o_shape[3])
    if _arrays.is_gpu(q):  # a dtype without GPU gradients for this call: refused before any write
        from . import _gpu

        _gpu.check_call(p, q, backward=True)
    for name, x in (("dout", dout), ("out", out)):
        V.check_out(x, name, o_shape, q.dtype, q)
    V.check_out(lse, "lse", (p.batch, p.nheads_q, p.seqlen_q), lse_dtype(q.dtype), q)
    xp = _arrays.module_of(q)
    grads = []
    inputs = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("bias", bias),
              ("mask", mask), ("dlse", dlse), ("seqlens_k", _given_array(seqlens_k)))
    inputs = tuple((name, x) for name, x in inputs if x is not None)
    for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        given = V.check_output_buffer(given, name, like.shape, like.dtype, q, inputs)
        inputs += ((name, given),)
        grads.append(xp.empty(like.shape, dtype=like.dtype) if given is None else given)
    dbias = xp.zeros(bias.shape, dtype=bias.dtype) if return_dbias else None
    if p.is_empty or p.seqlen_k == 0 or p.nheads_k == 0:
        for g in grads:
            g[...] = 0
        return tuple(grads) + ((dbias,) if return_dbias else ())
    views = [V.to_bshd(x, layout) for x in (dout, q, k, v, out)]
    gviews = [V.to_bshd(g, layout) for g in grads]
    _run("backward", _cpu.backward, p, *views, lse, *gviews, deterministic=deterministic, dlse=dlse, dbias=dbias)
    return tuple(grads) + ((dbias,) if return_dbias else ())


@_guard.entry
def attention_vjp(q, k, v, *, return_lse=False, **options):
    """Forward pass plus a closure for its vector-Jacobian product.

    Parameters
    ----------
    q, k, v : arrays
        As in :func:`attention`.
    return_lse : bool, default False
        Return ``(out, lse)`` as the forward result, and let ``vjp`` take ``dlse``.
    **options
        Any keyword of :func:`attention` except ``out``; ``deterministic`` is passed on to the
        backward.

    Returns
    -------
    out : array, or (out, lse) with ``return_lse``
        As :func:`attention`.
    vjp : callable
        ``vjp(dout, dlse=None) -> (dq, dk, dv)``, plus ``dbias`` when a ``bias`` was given,
        computed by :func:`attention_backward` from the saved ``out`` and ``lse`` (no score
        matrix is kept: FlashAttention-2, Dao 2024, Algorithm 2).  It holds q, k, v and array
        options (e.g. ``alibi_slopes``) by reference, not as copies: changing them in place
        before calling ``vjp`` changes the gradients.  So are the ``out`` and ``lse`` it
        returns, which the GPU backward reads (D = rowsum(dout * out), as FlashAttention's
        does): ``out += residual`` before ``vjp`` changes the GPU gradients, while
        ``y = out + residual`` (a new array) does not.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention`.
    """
    if "out" in options:
        raise TypeError("attention_vjp does not take 'out'")
    if _arrays.is_gpu(q):  # a dtype without GPU gradients: refused now, not after the forward
        from . import _gpu

        _gpu.check_call(None, q, backward=True, headdim=max(q.shape[-1], getattr(v, "shape", q.shape)[-1]))
    return_lse = V.check_bool(return_lse, "return_lse")
    deterministic = V.check_bool(options.pop("deterministic", False), "deterministic")
    out, lse = attention(q, k, v, return_lse=True, **options)
    seed = options.get("dropout_seed")  # the keep-mask of this forward, even if the array advances later:
    if _arrays.is_gpu(seed):  # a copy in stream order (no host read), on the seed's own device
        with seed.device:
            options["dropout_seed"] = seed.copy()
    elif seed is not None:  # (seed, offset) as ints, whichever form attention took
        options["dropout_seed"] = dropout.seed_and_offset(seed)
    with_bias = options.get("bias") is not None

    def vjp(dout, dlse=None):
        if dlse is not None and not return_lse:
            raise ValueError("dlse needs attention_vjp(..., return_lse=True): this forward returned no LSE")
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, dlse=dlse,
                                  return_dbias=with_bias, **options)

    return ((out, lse) if return_lse else out), vjp


@_guard.entry
@_doc
def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_seed=None,
    precision=None,
    return_lse=False,
    out=None,
):
    """Attention over a packed batch of variable-length sequences.

    Parameters
    ----------
    q : array of shape (total_q, nheads, headdim_qk)
        Queries of all sequences, concatenated along the first axis.
    k : array of shape (total_k, nheads_k, headdim_qk)
    v : array of shape (total_k, nheads_k, headdim_v)
    cu_seqlens_q, cu_seqlens_k : int32/int64 arrays (or lists of ints) of shape (batch + 1,)
        Offsets of each sequence in q and in k/v: sequence b owns rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.  Zero-length sequences are allowed.
    max_seqlen_q, max_seqlen_k : int, optional
        Longest sequence; computed from the offsets when None (a small device-to-host copy for
        GPU offsets, which are then checked on the host too; pass both values when capturing a
        CUDA graph).  Given values are checked against NumPy offsets; against GPU offsets by the
        kernels: a sequence longer than the value gets NaN rows (InvalidIndexError, below).
        With both given (and no ALiBi), warm GPU calls replay the first call's launch
        (``cuflash._fastpath``).
{options}
    return_lse : bool, default False
        Also return the log-sum-exp, shape (nheads, total_q).
    out : array of shape (total_q, nheads, headdim_v), optional
        Preallocated output (q's dtype and array kind), writable and sharing no memory with q,
        k, v, written in full (see Returns).

    Returns
    -------
    out : array of shape (total_q, nheads, headdim_v)
        Rows past ``cu_seqlens_q[-1]`` belong to no sequence and are set to 0.
    lse : array of shape (nheads, total_q), float32 (float64 for float64 inputs)
        Only when ``return_lse``; -inf on empty rows and rows past ``cu_seqlens_q[-1]``.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention`; offsets that do not start at 0, decrease or pass the number of
        packed tokens, checked on the host for NumPy offsets (and GPU offsets copied there by
        ``max_seqlen_*=None``, or with ``CUFLASH_DEBUG=1``); more than 2**31 - 1 packed rows; an
        ``out`` that overlaps q, k, v or the offsets.
    InvalidIndexError
        A ``ValueError``: GPU offsets that break those rules, or a sequence longer than
        ``max_seqlen_q``/``max_seqlen_k``, found by the kernels (no copy to the host): every
        sequence from the first bad entry on gets NaN rows and LSE (and NaN gradients in the
        backward), the others are computed normally, and the error is raised by the next
        cuflash call, or at once by :func:`cuflash.synchronize`.

    Notes
    -----
{method}
    Causal and window rules apply per sequence with that sequence's own Sq and Sk.  So do
    dropout's positions: sequence b is batch entry b, its queries and keys counted from its own
    first row, so its keep-mask is ``dropout_mask(dropout_seed, (batch, nheads, max_seqlen_q,
    max_seqlen_k), dropout_p)[b, :, :len_q, :len_k]`` (the backward draws the same).
    """
    fast_key = None
    if _arrays.is_gpu(q):  # warm calls replay an earlier launch (cuflash._fastpath)
        from . import _fastpath

        if (alibi_slopes is None and max_seqlen_q is not None and max_seqlen_k is not None
                and type(dropout_p) is float and dropout_p == 0.0 and dropout_seed is None and precision is None):
            fast_key = _fastpath.signature("varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, out),
                                           (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                            return_lse))
        plan = _fastpath.lookup(fast_key)
        result = (plan.run((q, k, v, cu_seqlens_q, cu_seqlens_k), out, need_lse=bool(return_lse))
                  if plan is not None else None)
        if result is not None:
            return result if return_lse else result[0]

    q, k, v = (_arrays.as_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p, cu_q, cu_k = _varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        causal, window_size, softcap, alibi_slopes,
    )
    p = V.check_modifiers(q, p, None, None, dropout_p, dropout_seed)
    p = V.with_precision(q, p, precision)
    if _arrays.is_gpu(q):  # a dtype without a GPU kernel for this call: refused before any write
        from . import _gpu

        _gpu.check_call(p, q, packed=True)
    xp = _arrays.module_of(q)
    out_shape = (q.shape[0], p.nheads_q, p.headdim_v)
    return_lse = V.check_bool(return_lse, "return_lse")
    out = V.check_output_buffer(out, "out", out_shape, q.dtype, q, (("q", q), ("k", k), ("v", v),
                                                                     ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)))
    out_given = out is not None
    if out is None:
        out = xp.empty(out_shape, dtype=q.dtype)
    lse = xp.empty((p.nheads_q, q.shape[0]), dtype=lse_dtype(q.dtype))
    launch = not p.is_empty and p.seqlen_k
    if not (launch and _arrays.is_gpu(q)):  # the GPU kernels write every row, those of no sequence too
        out[...] = 0
        lse[...] = -np.inf
    if not launch and _arrays.is_gpu(q) and q.shape[0] and p.nheads_q and p.batch:
        from . import _gpu  # max_seqlen_* = 0 or no keys: GPU offsets are still checked on the device

        _gpu.forward_varlen(p, q, k, v, out, lse, cu_q, cu_k)
    elif launch:
        if fast_key is None:
            _run("forward_varlen", _cpu.forward_varlen, p, q, k, v, out, lse, cu_q, cu_k)
        else:
            from . import _fastpath, _gpu

            record = []
            _gpu.forward_varlen(p, q, k, v, out, lse, cu_q, cu_k, record=record)
            if record:
                _fastpath.remember(fast_key, record[0], ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
                                   (q, k, v, cu_seqlens_q, cu_seqlens_k), out, out_given, lse.shape)
    return (out, lse) if return_lse else out


@_guard.entry
@_doc
def attention_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_seed=None,
    precision=None,
    deterministic=False,
):
    """Gradients of :func:`attention_varlen` by recomputation.

    Parameters
    ----------
    dout : array of shape (total_q, nheads, headdim_v)
    q, k, v, out : arrays
        As in :func:`attention_varlen`.
    lse : array of shape (nheads, total_q)
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As in :func:`attention_varlen`.
{options}
    deterministic : bool, default False
        Bitwise-repeatable gradients, as in :func:`attention_backward`.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k, v
        Rows outside every sequence get 0.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_varlen`.

    Notes
    -----
{method}
    """
    _require_lse(lse)
    dout, q, k, v, out, lse = (
        _arrays.as_array(x, n)
        for x, n in zip((dout, q, k, v, out, lse), ("dout", "q", "k", "v", "out", "lse"))
    )
    p, cu_q, cu_k = _varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        causal, window_size, softcap, alibi_slopes,
    )
    p = V.check_modifiers(q, p, None, None, dropout_p, dropout_seed)
    p = V.with_precision(q, p, precision)
    if _arrays.is_gpu(q):  # a dtype without GPU gradients for this call: refused before any write
        from . import _gpu

        _gpu.check_call(p, q, packed=True, backward=True)
    o_shape = (q.shape[0], p.nheads_q, p.headdim_v)
    V.check_out(dout, "dout", o_shape, q.dtype, q)
    V.check_out(out, "out", o_shape, q.dtype, q)
    V.check_out(lse, "lse", (p.nheads_q, q.shape[0]), lse_dtype(q.dtype), q)
    deterministic = V.check_bool(deterministic, "deterministic")
    xp = _arrays.module_of(q)
    grads = [xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v)]
    launch = not p.is_empty and p.nheads_k and p.seqlen_k
    if not launch and _arrays.is_gpu(q) and q.shape[0] and p.nheads_q and p.batch:
        from . import _gpu  # max_seqlen_* = 0 or no keys: zero gradients, but GPU offsets are still checked

        _gpu.backward_varlen(p, dout, q, k, v, out, lse, *grads, cu_q, cu_k, deterministic=deterministic)
    elif launch:
        _run("backward_varlen", _cpu.backward_varlen, p, dout, q, k, v, out, lse, *grads, cu_q, cu_k,
             deterministic=deterministic)
    return tuple(grads)


def _given_array(x):
    """An index argument as the caller passed it, when it is an array (its values may have been
    copied since; an output must not overwrite the caller's copy either), else None."""
    return x if _arrays.is_array(x) else None


def _check_unbatched(layout, **arrays):
    """q is 3-D (unbatched): the other arrays of the call must be too."""
    shape = "(nheads, seqlen, headdim)" if layout == "bhsd" else "(seqlen, nheads, headdim)"
    for name, x in arrays.items():
        if x is not None and getattr(x, "ndim", 3) != 3:
            raise ValueError(f"q is unbatched {shape}, so {name} must be too; got shape {tuple(x.shape)} "
                             f"(or pass q with a batch axis, q[None])")


def _check_unbatched_buffers(**buffers):
    """Output buffers of an unbatched call, checked before the batch axis is added (so that the
    message gives the shapes the caller passed): name=(array or None, expected shape)."""
    for name, (x, shape) in buffers.items():
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}")


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, softcap, alibi_slopes):
    batch, cu_q, cu_k, max_q, max_k = V.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    p = V.finish_problem(
        q, batch, max_q, max_k, q.shape[1], k.shape[1], q.shape[2], v.shape[2],
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, seqlens_k=None, packed=True,
    )
    return p, cu_q, cu_k


@_guard.entry
def merge_states(*args, layout="bshd"):
    """Combine partial attention results over disjoint key sets through their LSE.

    ``merge_states(out_a, lse_a, out_b, lse_b)`` or ``merge_states(outs, lses)`` with the parts
    stacked on a new leading axis.  The merged result equals attention over the union of the
    key sets: ``lse = logaddexp(lse_a, lse_b)`` and
    ``out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b``.

    Parameters
    ----------
    out_a, out_b : arrays of shape (batch, seqlen, nheads, headdim) or (total, nheads, headdim)
        Partial outputs (``layout="bhsd"``: (batch, nheads, seqlen, headdim)).
    lse_a, lse_b : arrays of shape (batch, nheads, seqlen) or (nheads, total)
        Their natural-log LSE, as :func:`attention` returns it.
    outs, lses : arrays with one extra leading axis (the parts)
    layout : {"bshd", "bhsd"}, default "bshd"
        Order of the 4-D outputs; 3-D outputs are the packed (total, nheads, headdim) layout.

    Returns
    -------
    out : array, the dtype and shape of one part
    lse : array, the shape of one part's LSE (float32, float64 for float64 parts)
        A part whose LSE is -inf (no key) contributes nothing, whatever its output holds; rows
        where every part is -inf merge to 0 and -inf.  LSE values must be finite or -inf (+inf
        or NaN give NaN rows).

    Raises
    ------
    ValueError
        Shapes that do not match, or a wrong number of arguments.
    TypeError
        Arguments that are not arrays, lists of arrays or nested lists of numbers (these are
        taken as NumPy takes them), mixed array kinds, integer dtypes.

    Notes
    -----
    The log-sum-exp merge used by split-KV decoding (Dao et al., "Flash-Decoding", 2023) and
    FlashInfer's cascade attention (Ye et al. 2024).

    Examples
    --------
    Attending to two halves of the keys and merging equals attending to all of them:

    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 2, 8)).astype(np.float32) for _ in range(3))
    >>> out_a, lse_a = cuflash.attention(q, k[:, :2], v[:, :2], return_lse=True)
    >>> out_b, lse_b = cuflash.attention(q, k[:, 2:], v[:, 2:], return_lse=True)
    >>> out, lse = cuflash.merge_states(out_a, lse_a, out_b, lse_b)
    >>> full, full_lse = cuflash.attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full, atol=1e-6) and np.allclose(lse, full_lse, atol=1e-6))
    True
    """
    layout = V.check_layout(layout)
    if len(args) == 4:
        outs = [_arrays.as_array(args[0], "out_a"), _arrays.as_array(args[2], "out_b")]
        lses = [_arrays.as_array(args[1], "lse_a"), _arrays.as_array(args[3], "lse_b")]
    elif len(args) == 2:
        o, l_ = _arrays.as_array(args[0], "outs"), _arrays.as_array(args[1], "lses")
        if o.ndim < 4 or l_.ndim < 3 or o.shape[0] != l_.shape[0]:
            raise ValueError(
                f"outs and lses must be stacked on a leading parts axis of equal length; got shapes "
                f"{tuple(o.shape)} and {tuple(l_.shape)}"
            )
        if o.shape[0] == 0:
            raise ValueError("outs and lses must hold at least one part; got an empty parts axis")
        outs, lses = list(o), list(l_)
    else:
        raise ValueError(f"merge_states takes (out_a, lse_a, out_b, lse_b) or (outs, lses); got {len(args)} arguments")
    ref = outs[0]
    for i, (o, l_) in enumerate(zip(outs, lses)):
        if not (_arrays.same_kind(o, ref) and _arrays.same_kind(l_, ref)):
            raise TypeError("all outputs and LSEs must be NumPy arrays, or all GPU arrays")
        if not (V.is_float_dtype(o.dtype) and V.is_float_dtype(l_.dtype)):
            raise TypeError(f"part {i}: outputs and LSEs must be floating point; got {o.dtype}, {l_.dtype}")
        if V.dtype_name(o) != V.dtype_name(ref):  # by name: byte order is free
            raise TypeError(f"part {i}: output dtype {V.dtype_name(o)} differs from {V.dtype_name(ref)}")
        if tuple(o.shape) != tuple(ref.shape):
            raise ValueError(f"part {i}: output shape {tuple(o.shape)} differs from {tuple(ref.shape)}")
        expected = _lse_shape(ref, layout)
        if tuple(l_.shape) != expected:
            raise ValueError(f"part {i}: lse must have shape {expected}; got {tuple(l_.shape)}")
    xp = _arrays.module_of(ref)
    lse_t = lse_dtype(ref.dtype)
    # Move the LSE onto the output's row axes, e.g. (B, H, S) -> (B, S, H, 1).
    rows = [_lse_as_rows(xp.asarray(l_, dtype=lse_t), ref.ndim, layout)[..., None] for l_ in lses]
    acc_t = np.float64 if lse_t == np.float64 else np.float32
    m = rows[0]
    for r in rows[1:]:
        m = xp.maximum(m, r)
    m_safe = xp.where(xp.isneginf(m), 0, m)  # all parts empty: avoid -inf - -inf = NaN
    # (invalid: a +inf LSE gives inf - inf, NaN on purpose; then 0 * NaN of empty parts, discarded)
    with np.errstate(invalid="ignore", over="ignore"):
        weights = [xp.exp(r - m_safe) for r in rows]
        total = sum(weights)
        merged = sum(xp.where(w > 0, w * o.astype(acc_t), 0) for w, o in zip(weights, outs))
    # total = 0: every part empty (0, -inf); NaN (a NaN or +inf LSE): the row stays NaN.
    safe_total = xp.where(total != 0, total, 1)
    out = (merged / safe_total).astype(ref.dtype)
    lse_rows = xp.where(total != 0, m_safe + xp.log(safe_total), -np.inf)[..., 0]
    return out, _rows_as_lse(lse_rows.astype(lse_t), ref.ndim, layout)


def _lse_shape(out, layout):
    if out.ndim == 3:
        return (out.shape[1], out.shape[0])
    if out.ndim != 4:
        raise ValueError(f"outputs must have 3 or 4 dimensions; got shape {tuple(out.shape)}")
    if layout == "bhsd":
        return tuple(out.shape[:3])
    return (out.shape[0], out.shape[2], out.shape[1])


def _lse_as_rows(lse, ndim, layout):
    if ndim == 3:
        return lse.T
    return lse if layout == "bhsd" else lse.swapaxes(1, 2)


def _rows_as_lse(rows, ndim, layout):
    return _lse_as_rows(rows, ndim, layout)


@_guard.entry
def softmax(x, axis=-1):
    """Softmax along one axis in a single streaming pass (online normaliser).

    Parameters
    ----------
    x : NumPy or CuPy float array, any shape with at least one axis (a 0-d array has no ``axis``;
        with ``axis=None`` any shape)
    axis : int, tuple of ints or None, default -1
        The axis to normalise along; several axes (a tuple), or all of them (None), are
        normalised together, as ``scipy.special.softmax`` does: they are moved last and flattened
        into one (a copy where the layout needs it).

    Returns
    -------
    array of x's shape and dtype
        ``exp(x - max) / sum(exp(x - max))`` along ``axis``; a slice of all -inf gives zeros;
        a +inf entry gives NaN there and 0 elsewhere in its slice, a NaN a slice of NaN (as
        ``scipy.special.softmax`` does).

    Raises
    ------
    TypeError
        x is not a float array; ``axis`` is not an integer, a tuple of them or None.
    ValueError
        A tuple ``axis`` that is empty or names an axis twice.
    numpy.exceptions.AxisError
        ``axis`` out of range (``numpy.AxisError`` before NumPy 1.25; both are ValueErrors).

    Notes
    -----
    Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018): a running max m and
    a running sum l, rescaled by ``exp(m_old - m_new)`` when the max grows.
    """
    x = _arrays.as_array(x, "x")
    if np.dtype(x.dtype).name not in V.FLOAT_DTYPES:
        raise TypeError(f"x must be a float array (float16, bfloat16, float32 or float64); got dtype "
                        f"{np.dtype(x.dtype).name} (cast it, e.g. x.astype(numpy.float64); a list of ints is taken "
                        "as float64)")
    if axis is None or isinstance(axis, tuple):  # several axes: moved last, flattened into one
        axes = tuple(range(x.ndim)) if axis is None else axis
        if not axes and axis is not None:
            raise ValueError("axis must name at least one axis; got ()")
        for a in axes:
            if not _arrays.is_integer(a):
                raise TypeError(f"axis must be an integer, a tuple of integers or None; got {axis!r}")
        axes = tuple(normalize_axis_index(int(a), x.ndim) for a in axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis names an axis twice; got {axis!r}")
        xp, kept = _arrays.module_of(x), x.ndim - len(axes)
        if x.size == 0:
            return xp.empty_like(x)
        moved = xp.moveaxis(x, axes, tuple(range(kept, x.ndim)))
        flat = softmax(moved.reshape(moved.shape[:kept] + (-1,)), axis=-1)
        return xp.moveaxis(flat.reshape(moved.shape), tuple(range(kept, x.ndim)), axes)
    if not _arrays.is_integer(axis):
        raise TypeError(f"axis must be an integer, a tuple of integers or None; got {axis!r}")
    if x.ndim == 0:
        raise ValueError(f"x must have at least one dimension (the softmax runs along an axis); got a scalar {x!r}")
    axis = normalize_axis_index(int(axis), x.ndim)
    if x.size == 0:
        return _arrays.module_of(x).empty_like(x)
    return _run("softmax", _cpu.softmax, x, axis)
