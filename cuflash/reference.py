"""The float64 oracle: attention written as plainly as possible, in NumPy.

Everything here materialises the full score matrix ``(batch, nheads, seqlen_q, seqlen_k)`` in
float64 and follows ``docs/conventions.md`` line by line.  It deliberately shares no code with the
rest of cuflash (not even argument validation), so that a bug in the tiled paths cannot hide in
the code that checks them.

Contents
--------
attention_ref, attention_backward_ref
    Padded-batch forward and backward, with every option plus an additive ``bias``, a boolean
    ``mask``, dropout given its keep-mask, and the gradient through the LSE (``dlse``).
attention_varlen_ref, attention_varlen_backward_ref
    Packed variable-length batches, one sequence at a time.
naive_attention, naive_attention_backward
    ``softmax(QKᵀ)V`` computed plainly in the input dtype (rounded after every stage).  Its error
    against the oracle sets the scale of the exactness rule.
max_error_ratio, assert_exact
    The exactness rule: ``max|actual − ref| ≤ 2 · max|naive − ref| + 1e-5``.
visible_mask, online_softmax_trace
    Small teaching helpers: which keys a query sees, and the online softmax step by step.
"""

from __future__ import annotations

import math

import numpy as np

from ._arrays import is_integer
from ._precision import check_precision, operand_rounding

__all__ = [
    "attention_ref",
    "attention_backward_ref",
    "attention_varlen_ref",
    "attention_varlen_backward_ref",
    "naive_attention",
    "naive_attention_backward",
    "max_error_ratio",
    "assert_exact",
    "visible_mask",
    "online_softmax_trace",
]

ABS_FLOOR = 1e-5  # the "+ 1e-5" of the exactness rule


# ---------------------------------------------------------------------------------------------
# Inputs and options
# ---------------------------------------------------------------------------------------------


def _host(x):
    """x as a NumPy array; CuPy (and anything else with ``.get()``) is copied to the host."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x)


def _f64(x):
    x = _host(x)
    if np.iscomplexobj(x):  # (astype would drop the imaginary part with a warning only)
        raise TypeError(f"the reference takes real arrays; got dtype {x.dtype}")
    return x.astype(np.float64)


def _count(x, name: str) -> int:
    """An integer >= 0 (a length)."""
    if not is_integer(x):
        raise TypeError(f"{name} must be an integer >= 0; got {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be an integer >= 0; got {x!r}")
    return int(x)


def _one_result(x, name):
    """x, unless it is a tuple or list of results (``attention_ref`` returns ``(out, lse)``)."""
    if isinstance(x, (tuple, list)):
        raise TypeError(f"{name} is a {type(x).__name__} of {len(x)} items, not one array: the _ref functions "
                        f"return (out, lse) (and the backward ones (dq, dk, dv)); pass one of them, e.g. "
                        f"attention_ref(...)[0]")
    return x


def _compute_dtype(dtype):
    """The "plain" arithmetic of an input dtype: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype).name == "float64" else np.dtype(np.float32)  # any byte order


class _Options:
    """The attention options, normalised once (causal folded into the window, defaults decided)."""

    def __init__(self, headdim, nheads_q, nheads_k, batch, *, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, bias=None, mask=None,
                 seqlens_k=None, dropout_p=0.0, dropout_keep=None):
        if nheads_k == 0 and nheads_q != 0:
            raise ValueError(f"k has 0 heads; q's {nheads_q} heads must be a multiple of it")
        if nheads_k and nheads_q % nheads_k:
            raise ValueError(f"k has {nheads_k} heads; q's {nheads_q} heads must be a multiple of it")
        self.group = nheads_q // nheads_k if nheads_k else 1
        self.nheads_k = nheads_k
        if softmax_scale is None:
            if headdim == 0:
                raise ValueError("head dim 0 has no default softmax_scale (1/sqrt(0))")
            softmax_scale = 1.0 / math.sqrt(headdim)
        self.scale = float(softmax_scale)
        if not math.isfinite(self.scale):
            raise ValueError(f"softmax_scale must be finite; got {softmax_scale!r}")
        if isinstance(causal, (bool, np.bool_)):
            is_causal, self.top_left = bool(causal), False
        elif isinstance(causal, str) and causal in ("bottom_right", "top_left"):
            is_causal, self.top_left = True, causal == "top_left"
        else:
            raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}")
        if window_size is not None and len(window_size) != 2:
            raise ValueError(f"window_size must be two integers (left, right), -1 for unbounded; got {window_size!r}")
        if window_size is not None and any(
                not is_integer(w) for w in window_size):
            raise TypeError(f"window_size must be two integers (left, right), -1 for unbounded; got {window_size!r}")
        left, right = (-1, -1) if window_size is None else (int(w) for w in window_size)
        if left < -1 or right < -1:
            raise ValueError(f"window_size entries must be >= -1; got {window_size!r}")
        # a bound past any sequence is no bound (and would overflow NumPy's int64 positions)
        left, right = (-1 if w >= 2**62 else w for w in (left, right))
        if is_causal:  # causal is the window's right edge at the diagonal
            right = 0 if right == -1 else min(right, 0)
        self.left, self.right = left, right
        self.softcap = float(softcap)
        if self.softcap < 0:
            raise ValueError(f"softcap must be >= 0; got {softcap}")
        self.slopes = None
        if alibi_slopes is not None:
            # (H,) or (B, H) -> (B, H, 1, 1), to broadcast over the (Sq, Sk) score plane.
            slopes = _f64(alibi_slopes)
            self.slopes = np.broadcast_to(slopes, (batch, nheads_q))[:, :, None, None]
        self.bias = None if bias is None else _f64(bias)
        self.mask = None if mask is None else _host(mask).astype(bool)
        self.seqlens_k = None if seqlens_k is None else _host(seqlens_k).astype(np.int64)
        # Dropout: the weights P become P * keep / (1 - p) after the row statistics.
        self.dropout_p = float(dropout_p)
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"dropout_p must lie in [0, 1); got {dropout_p}")
        if self.dropout_p > 0 and dropout_keep is None:
            raise ValueError("dropout_p > 0 needs dropout_keep, the keep-mask (cuflash.dropout_mask gives it)")
        self.keep = None if dropout_keep is None else _host(dropout_keep).astype(bool)

    def dropped(self, probs):
        """P with dropout applied (P itself without dropout)."""
        if self.keep is None:
            return probs
        return np.where(self.keep, probs / (1.0 - self.dropout_p), 0.0)


def _heads_major(x, layout):
    """(B, S, H, D) in ``layout`` order <-> (B, H, S, D), the order the matmuls below use."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd'; got {layout!r}")
    return x.swapaxes(1, 2) if layout == "bshd" else x


def _offsets_and_visibility(batch, seqlen_q, seqlen_k, opts):
    """Per batch entry: the diagonal offset ``off`` (B,) and the visibility mask (B, 1, Sq, Sk)."""
    sk = np.full(batch, seqlen_k, dtype=np.int64) if opts.seqlens_k is None else opts.seqlens_k
    off = np.zeros(batch, dtype=np.int64) if opts.top_left else sk - seqlen_q
    i = np.arange(seqlen_q)[None, :, None]
    j = np.arange(seqlen_k)[None, None, :]
    diag = i + off[:, None, None]  # (B, Sq, 1): the key on query i's diagonal
    keep = j < sk[:, None, None]
    if opts.left != -1:
        keep = keep & (j >= diag - opts.left)
    if opts.right != -1:
        keep = keep & (j <= diag + opts.right)
    return off, keep[:, None]


def visible_mask(seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1), valid_k=None):
    """Which keys each query sees, as a boolean (seqlen_q, seqlen_k) matrix.

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    causal : bool or {"bottom_right", "top_left"}
    window_size : (int, int) or None
        Inclusive (left, right) around the diagonal ``j = i + valid_k - seqlen_q``; -1 unbounded
        (None: both).
    valid_k : int, optional
        Valid key length (keys at or past it are hidden); default seqlen_k.

    Returns
    -------
    numpy.ndarray of bool, shape (seqlen_q, seqlen_k)
        True where query i sees key j.

    Examples
    --------
    >>> visible_mask(2, 5, causal=True).astype(int)
    array([[1, 1, 1, 1, 0],
           [1, 1, 1, 1, 1]])
    """
    seqlen_q, seqlen_k = _count(seqlen_q, "seqlen_q"), _count(seqlen_k, "seqlen_k")
    if valid_k is not None and _count(valid_k, "valid_k") > seqlen_k:
        raise ValueError(f"valid_k must lie in [0, seqlen_k = {seqlen_k}]; got {valid_k}")
    seqlens = None if valid_k is None else np.array([valid_k])
    opts = _Options(1, 1, 1, 1, causal=causal, window_size=window_size, seqlens_k=seqlens)
    return np.broadcast_to(_offsets_and_visibility(1, seqlen_q, seqlen_k, opts)[1][0, 0], (seqlen_q, seqlen_k)).copy()


# ---------------------------------------------------------------------------------------------
# The score pipeline and the softmax, shared by the oracle (float64) and the naive path
# ---------------------------------------------------------------------------------------------


def _scores(q, k, opts, round_to=None):
    """Final scores (B, Hq, Sq, Sk) and tanh(s_raw/cap) (or None), in the order of the contract.

    ``q`` is (B, Hq, Sq, D) and ``k`` is (B, Hkv, Sk, D), already in the compute dtype.
    ``round_to`` (the naive path) rounds to the input dtype after every stage.
    """
    rnd = (lambda x: x) if round_to is None else (lambda x: x.astype(round_to).astype(x.dtype))
    batch, _, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    s = rnd(opts.scale * (q @ _repeat_heads(k, opts).swapaxes(-1, -2)))
    tanh = None
    if opts.softcap > 0:
        tanh = np.tanh(s / opts.softcap)
        s = rnd(opts.softcap * tanh)
    off, keep = _offsets_and_visibility(batch, seqlen_q, seqlen_k, opts)
    if opts.slopes is not None:
        i = np.arange(seqlen_q)[None, None, :, None]
        j = np.arange(seqlen_k)[None, None, None, :]
        dist = np.abs(i + off[:, None, None, None] - j)
        s = rnd(s - (opts.slopes * dist).astype(s.dtype))
    if opts.bias is not None:
        s = rnd(s + opts.bias.astype(s.dtype))
    if opts.mask is not None:
        keep = keep & opts.mask
    return np.where(keep, s, -np.inf), tanh


def _softmax_rows(s):
    """Softmax over the last axis and the natural-log LSE; rows of all -inf give 0 and -inf, rows
    with a NaN or +inf score NaN weights and a NaN LSE (docs/conventions.md)."""
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(m == -np.inf, 0.0, m)  # an empty row: avoid (-inf) - (-inf) = NaN
    with np.errstate(invalid="ignore"):  # +inf - +inf: NaN on purpose
        e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    empty = total == 0  # (a NaN total is not empty: its LSE stays NaN)
    safe_total = np.where(empty, 1.0, total)
    lse = np.where(empty, -np.inf, m + np.log(safe_total))[..., 0]
    return e / safe_total, lse


def _reduce_to_shape(g, shape):
    """Sum a (B, H, Sq, Sk) gradient down to the shape a broadcast input had."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead > 0 else g
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and g.shape[a] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


def _repeat_heads(x, opts):
    """(B, Hkv, S, D) -> (B, Hq, S, D): query head h reads key/value head h // group.

    ``np.repeat`` (h0 h0 h1 h1), not ``np.tile`` (h0 h1 h0 h1).
    """
    return np.repeat(x, opts.group, axis=1)


def _sum_groups(x, opts):
    """(B, Hq, S, D) -> (B, Hkv, S, D): the gradient of :func:`_repeat_heads`."""
    b, h, s, d = x.shape
    if opts.group == 0:  # q has no heads (k some): no query reads k or v
        return np.zeros((b, opts.nheads_k, s, d), x.dtype)
    return x.reshape(b, h // opts.group, opts.group, s, d).sum(axis=2)


def _prepare(q, k, v, layout, options, convert=_f64):
    """Inputs as (B, H, S, D) arrays (``convert``-ed) plus the normalised options."""
    q, k, v = (convert(x) for x in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D; got shapes {q.shape}, {k.shape}, {v.shape}")
    q, k, v = (_heads_major(x, layout) for x in (q, k, v))
    opts = _Options(q.shape[3], q.shape[1], k.shape[1], q.shape[0], **options)
    sk = opts.seqlens_k
    if sk is not None and (sk.shape != (q.shape[0],) or np.any(sk < 0) or np.any(sk > k.shape[2])):
        raise ValueError(f"seqlens_k must have shape ({q.shape[0]},) and values in [0, {k.shape[2]}]; "
                         f"got {sk.tolist()}")
    if sk is not None:  # keys past seqlens_k are never read: padding there (even NaN) changes nothing
        unread = np.arange(k.shape[2])[None, None, :, None] >= sk[:, None, None, None]
        k, v = (np.where(unread, x.dtype.type(0), x) for x in (k, v))
    return q, k, v, opts


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, bias=None, mask=None, seqlens_k=None, layout="bshd",
                  return_probs=False, dropout_p=0.0, dropout_keep=None):
    """Exact attention in float64 with the full score matrix: the oracle for every test.

    Parameters
    ----------
    q : array of shape (batch, seqlen_q, nheads, headdim)
        Any float dtype (float16, ``ml_dtypes.bfloat16``, float32, float64), NumPy or CuPy;
        ``layout="bhsd"`` takes (batch, nheads, seqlen_q, headdim).
    k : array of shape (batch, seqlen_k, nheads_k, headdim)
        Query head h uses key head ``h // (nheads // nheads_k)``.
    v : array of shape (batch, seqlen_k, nheads_k, headdim_v)
    softmax_scale : float, optional
        None means ``1/sqrt(headdim)``; 0.0 is literal.
    causal : bool or {"bottom_right", "top_left"}
        True is bottom-right aligned (``j <= i + Sk - Sq``); "top_left" is ``j <= i``.
    window_size : (int, int) or None
        Inclusive (left, right) around the same diagonal; -1 unbounded (None: both).  Causal
        sets right to 0.
    softcap : float
        When > 0: ``s = softcap * tanh(s / softcap)``.
    alibi_slopes : array of shape (nheads,) or (batch, nheads), optional
        Adds ``-slope * |i + off - j|``, ``off`` being the causal diagonal offset.
    bias : array broadcastable to (batch, nheads, seqlen_q, seqlen_k), optional
        Additive bias, after ALiBi and before masking (may hold -inf).
    mask : bool array broadcastable to (batch, nheads, seqlen_q, seqlen_k), optional
        True keeps a key, False masks it to -inf.
    seqlens_k : int array of shape (batch,), optional
        Valid key length per batch entry; it is Sk in the causal and window rules.
    layout : {"bshd", "bhsd"}
    return_probs : bool
        Also return the attention weights.
    dropout_p : float
        Dropout probability in [0, 1), applied to the weights after the row statistics with
        scaling 1 / (1 - p); needs ``dropout_keep``.
    dropout_keep : bool array broadcastable to (batch, nheads, seqlen_q, seqlen_k), optional
        The keep-mask (True = kept), e.g. from ``cuflash.dropout_mask``.

    Returns
    -------
    out : float64 array of shape (batch, seqlen_q, nheads, headdim_v) (in ``layout`` order)
        0 on rows that see no key.
    lse : float64 array of shape (batch, nheads, seqlen_q)
        Natural-log logsumexp of the final scores over visible keys; -inf on empty rows.  It
        does not depend on dropout.
    probs : float64 array of shape (batch, nheads, seqlen_q, seqlen_k)
        Only with ``return_probs``: the weights before dropout.

    Raises
    ------
    ValueError
        nheads not a multiple of nheads_k, negative softcap, a bad causal/window/layout value,
        headdim 0 with the default scale.

    Notes
    -----
    Score pipeline of ``docs/conventions.md``: scale·q·k → softcap → ALiBi → bias → masks (−inf) →
    softmax (Vaswani et al. 2017, eq. 1; softcap as in Gemma 2; ALiBi, Press et al. 2022).
    """
    q, k, v, opts = _prepare(q, k, v, layout, dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, seqlens_k=seqlens_k, dropout_p=dropout_p,
        dropout_keep=dropout_keep))
    s, _ = _scores(q, k, opts)
    probs, lse = _softmax_rows(s)
    out = _heads_major(opts.dropped(probs) @ _repeat_heads(v, opts), layout)
    return (out, lse, probs) if return_probs else (out, lse)


def attention_backward_ref(dout, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, bias=None, mask=None, seqlens_k=None,
                           layout="bshd", dropout_p=0.0, dropout_keep=None, dlse=None):
    """Gradients of :func:`attention_ref` in float64, through the full probability matrix.

    Parameters
    ----------
    dout : array of shape (batch, seqlen_q, nheads, headdim_v) (``layout`` order)
        Gradient of the loss with respect to the output.
    q, k, v, options
        As in :func:`attention_ref` (``dropout_p`` and ``dropout_keep`` included).
    dlse : array of shape (batch, nheads, seqlen_q), optional
        Gradient of the loss with respect to the LSE; without it the LSE is not differentiated.
        Entries of rows that see no key are ignored.

    Returns
    -------
    dq, dk, dv : float64 arrays with the shapes of q, k, v
        dk, dv sum over the query heads of each group.  Rows that see no key give dq = 0 and add
        nothing to dk, dv.
    dbias : float64 array of bias's shape
        Only when ``bias`` is given: the gradient summed over its broadcast axes.

    Raises
    ------
    ValueError
        As :func:`attention_ref`.

    Notes
    -----
    With P the weights, Z = keep / (1 − p) the dropout factor (1 without dropout) and S the final
    scores: dV = (P ∘ Z)ᵀ dO, dP = (dO Vᵀ) ∘ Z, dS = P ∘ (dP − rowsum(P ∘ dP) + dlse); through the
    softcap dS_raw = dS ∘ (1 − tanh²(s_raw/cap)); dQ = scale · dS_raw K, dK = scale · dS_rawᵀ Q
    (FlashAttention-2, Dao 2024, §2.2; dropout as in FlashAttention, Dao et al. 2022,
    Algorithm 4; d lse_i / d s_ij = P_ij).
    """
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                   seqlens_k=seqlens_k, dropout_p=dropout_p, dropout_keep=dropout_keep)
    q, k, v, opts = _prepare(q, k, v, layout, options)
    dout = _heads_major(_f64(dout), layout)
    s, tanh = _scores(q, k, opts)
    probs, lse = _softmax_rows(s)
    dv = opts.dropped(probs).swapaxes(-1, -2) @ dout
    dp = dout @ _repeat_heads(v, opts).swapaxes(-1, -2)
    if opts.keep is not None:
        dp = np.where(opts.keep, dp / (1.0 - opts.dropout_p), 0.0)
    ds = probs * (dp - (probs * dp).sum(axis=-1, keepdims=True))  # masked entries: P = 0
    if dlse is not None:
        ds = ds + probs * np.where(np.isneginf(lse), 0.0, _f64(dlse))[..., None]  # empty rows: ignored
    dbias = None if opts.bias is None else _reduce_to_shape(ds, opts.bias.shape)
    if tanh is not None:
        ds = ds * (1.0 - tanh**2)
    dq = opts.scale * (ds @ _repeat_heads(k, opts))
    dk = opts.scale * (ds.swapaxes(-1, -2) @ q)
    grads = tuple(_heads_major(g, layout)
                  for g in (dq, _sum_groups(dk, opts), _sum_groups(dv, opts)))
    return grads if dbias is None else grads + (dbias,)


# ---------------------------------------------------------------------------------------------
# Variable-length (packed) batches
# ---------------------------------------------------------------------------------------------


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cu_q, cu_k = _host(cu_seqlens_q).astype(np.int64), _host(cu_seqlens_k).astype(np.int64)
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1 or cu_q.size < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be 1-D of equal length >= 1; got "
                         f"{cu_q.shape} and {cu_k.shape}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu[0] != 0 or (np.diff(cu) < 0).any():
            raise ValueError(f"{name} must start at 0 and never decrease; got {cu.tolist()}")
    return [(b, cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]) for b in range(cu_q.size - 1)]


def _sequence_options(options, b):
    """Options for sequence b alone: a (batch, H) ALiBi table contributes its row b."""
    slopes = options.get("alibi_slopes")
    if slopes is not None:
        slopes = _f64(slopes)
        options = dict(options, alibi_slopes=slopes[b] if slopes.ndim == 2 else slopes)
    return options


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """:func:`attention_ref` on a packed batch, one sequence at a time.

    Parameters
    ----------
    q : array of shape (total_q, nheads, headdim)
    k : array of shape (total_k, nheads_k, headdim)
    v : array of shape (total_k, nheads_k, headdim_v)
    cu_seqlens_q, cu_seqlens_k : int arrays of shape (batch + 1,)
        Sequence b owns rows ``cu[b]:cu[b+1]``; each has its own Sq, Sk for causal and window.
    **options
        softmax_scale, causal, window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads)).

    Returns
    -------
    out : float64 array of shape (total_q, nheads, headdim_v)
        Rows outside every sequence are 0.
    lse : float64 array of shape (nheads, total_q)
        -inf on empty rows and rows outside every sequence.

    Raises
    ------
    ValueError
        As :func:`attention_ref`; offsets arrays of different lengths.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, l_ = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                             **_sequence_options(options, b))
        out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
    return out, lse


def attention_varlen_backward_ref(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Gradients of :func:`attention_varlen_ref`, one sequence at a time.

    Parameters
    ----------
    dout : array of shape (total_q, nheads, headdim_v)
    q, k, v, cu_seqlens_q, cu_seqlens_k, **options
        As in :func:`attention_varlen_ref`.

    Returns
    -------
    dq, dk, dv : float64 arrays with the shapes of q, k, v
        Zero outside every sequence.

    Raises
    ------
    ValueError
        As :func:`attention_varlen_ref`.
    """
    dout, q, k, v = _f64(dout), _f64(q), _f64(k), _f64(v)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        g = attention_backward_ref(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1],
                                   v[None, k0:k1], **_sequence_options(options, b))
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Naive attention in the input dtype: the error scale of the exactness rule
# ---------------------------------------------------------------------------------------------


def _naive_setup(q, k, v, layout, options, precision=None):
    dtype = np.dtype(_host(q).dtype)
    acc = _compute_dtype(dtype)
    # Every product's operands rounded for "tf32"; values cuflash refuses for this dtype are refused here too.
    op = operand_rounding(check_precision(precision, dtype.name))
    q, k, v, opts = _prepare(q, k, v, layout, options, convert=lambda x: op(_host(x).astype(acc)))
    s, tanh = _scores(q, k, opts, round_to=dtype)
    # Softmax in the compute dtype (as torch does for fp16), then rounded to the input dtype.
    with np.errstate(over="ignore"):
        probs, lse = _softmax_rows(s)
    probs = probs.astype(dtype).astype(acc)
    return q, k, v, opts, dtype, acc, s, tanh, probs, lse, op


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, bias=None, mask=None, seqlens_k=None, layout="bshd",
                    return_lse=False, dropout_p=0.0, dropout_keep=None, precision=None):
    """``softmax(scale · QKᵀ) V`` computed plainly in the input dtype, stage by stage.

    Each stage (the scores and every score modifier, the softmax, P·V) is computed in float32
    (float64 for float64 inputs) and rounded to the input dtype, as an unfused same-dtype
    implementation would.  Its error against :func:`attention_ref` is the scale of the
    exactness rule (``docs/conventions.md``).

    Parameters
    ----------
    q, k, v, options
        As in :func:`attention_ref`.
    return_lse : bool
        Also return the LSE computed from the rounded scores.
    precision : {None, "ieee", "highest", "tf32"}
        "tf32" (float32 inputs): the operands of both products (q, k, P, v) rounded to TF32,
        as a TF32 matmul sees them (the error scale of cuflash's ``precision="tf32"``).

    Returns
    -------
    out : array of q's dtype, shape (batch, seqlen_q, nheads, headdim_v) (``layout`` order)
    lse : float32 array (float64 for float64 inputs) of shape (batch, nheads, seqlen_q)
        Only with ``return_lse``.

    Raises
    ------
    ValueError
        As :func:`attention_ref`.
    """
    q, k, v, opts, dtype, acc, s, tanh, probs, lse, op = _naive_setup(q, k, v, layout, dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, seqlens_k=seqlens_k, dropout_p=dropout_p,
        dropout_keep=dropout_keep), precision)
    dropped = opts.dropped(probs).astype(dtype).astype(acc) if opts.keep is not None else probs
    out = _heads_major((op(dropped) @ _repeat_heads(v, opts)).astype(dtype), layout)
    return (out, lse.astype(acc)) if return_lse else out


def naive_attention_backward(dout, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, bias=None, mask=None, seqlens_k=None,
                             layout="bshd", dropout_p=0.0, dropout_keep=None, dlse=None, precision=None):
    """Gradients of :func:`naive_attention`, each stage rounded to the input dtype.

    Parameters
    ----------
    dout : array of shape (batch, seqlen_q, nheads, headdim_v), q's dtype
    q, k, v, options
        As in :func:`attention_ref`.
    precision : {None, "ieee", "highest", "tf32"}
        "tf32": the operands of every product (q, k, v, dout, P, dS) rounded to TF32.

    Returns
    -------
    dq, dk, dv : arrays of the input dtype with the shapes of q, k, v
    dbias : array of the input dtype with bias's shape
        Only when ``bias`` is given (dS summed over its broadcast axes).

    Raises
    ------
    ValueError
        As :func:`attention_ref`.

    Notes
    -----
    Stages: dV = (P ∘ Z)ᵀ dO; dP = (dO Vᵀ) ∘ Z (Z the dropout factor, 1 without);
    dS = P ∘ (dP − rowsum(P ∘ dP) + dlse); the softcap factor 1 − tanh²; dQ = scale · dS K;
    dK = scale · dSᵀ Q.  Each one is rounded.
    """
    q, k, v, opts, dtype, acc, s, tanh, probs, lse, op = _naive_setup(q, k, v, layout, dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, seqlens_k=seqlens_k, dropout_p=dropout_p,
        dropout_keep=dropout_keep), precision)
    rnd = lambda x: x.astype(dtype).astype(acc)  # noqa: E731
    dout = op(_heads_major(_host(dout).astype(acc), layout))
    dv = op(rnd(opts.dropped(probs)) if opts.keep is not None else probs).swapaxes(-1, -2) @ dout
    dp = rnd(dout @ _repeat_heads(v, opts).swapaxes(-1, -2))
    if opts.keep is not None:
        dp = rnd(opts.dropped(dp))
    ds = probs * (dp - (probs * dp).sum(axis=-1, keepdims=True))
    if dlse is not None:
        ds = ds + probs * np.where(np.isneginf(lse), 0.0, _host(dlse).astype(acc))[..., None]
    ds = rnd(ds)
    dbias = None if opts.bias is None else _reduce_to_shape(ds, opts.bias.shape)
    if tanh is not None:
        ds = rnd(ds * (1.0 - tanh**2))
    ds = op(ds)
    dq = opts.scale * (ds @ _repeat_heads(k, opts))
    dk = opts.scale * (ds.swapaxes(-1, -2) @ q)
    grads = tuple(_heads_major(g.astype(dtype), layout)
                  for g in (dq, _sum_groups(dk, opts), _sum_groups(dv, opts)))
    return grads if dbias is None else grads + (dbias.astype(dtype),)


# ---------------------------------------------------------------------------------------------
# The exactness rule
# ---------------------------------------------------------------------------------------------


def _abs_errors(x, ref):
    """|x − ref| elementwise, with equal infinities (−inf LSE of empty rows) counted as 0."""
    with np.errstate(invalid="ignore"):
        return np.where(x == ref, 0.0, np.abs(x - ref))


def max_error_ratio(actual, ref64, naive) -> float:
    """``max|actual − ref| / (2 · max|naive − ref| + 1e-5)``; the exactness rule passes iff <= 1.

    Parameters
    ----------
    actual : array
        The result under test (any float dtype, NumPy or CuPy).
    ref64 : array
        The float64 oracle (:func:`attention_ref` and friends).
    naive : array
        The same quantity from :func:`naive_attention` (same-dtype plain computation).

    Returns
    -------
    float
        0 for empty arrays; ``inf`` when ``actual`` has a NaN, or an infinity that ``ref64`` does
        not have at the same place.  Equal infinities (LSE −inf of empty rows) count as error 0.
        Non-finite naive errors are ignored, which can only make the rule stricter.

    Raises
    ------
    ValueError
        The three shapes differ.
    TypeError
        One of them is a tuple or list, such as the ``(out, lse)`` pair the ``_ref`` functions
        return: pass ``attention_ref(...)[0]`` for the output.
    """
    a, r, n = (_f64(_one_result(x, name)) for x, name in ((actual, "actual"), (ref64, "ref64"), (naive, "naive")))
    if not (a.shape == r.shape == n.shape):
        raise ValueError(f"shapes differ: actual {a.shape}, ref {r.shape}, naive {n.shape}")
    if a.size == 0:
        return 0.0
    err = _abs_errors(a, r)
    if not np.all(np.isfinite(err)):  # NaN, or an inf the reference does not have
        return math.inf
    naive_err = _abs_errors(n, r)
    naive_err = np.where(np.isfinite(naive_err), naive_err, 0.0)
    return float(err.max() / (2.0 * naive_err.max() + ABS_FLOOR))


def assert_exact(actual, ref64, naive, name="result"):
    """Raise AssertionError unless ``actual`` meets the exactness rule (:func:`max_error_ratio` <= 1).

    Parameters
    ----------
    actual, ref64, naive : arrays
        As in :func:`max_error_ratio`.
    name : str
        What is compared (e.g. "out", "lse", "dq"), for the message.

    Raises
    ------
    AssertionError
        With the ratio, the largest error, the allowed error and where it occurs.
    ValueError, TypeError
        As :func:`max_error_ratio`: shapes that differ, a tuple such as ``attention_ref``'s
        ``(out, lse)`` in place of one array.
    """
    ratio = max_error_ratio(actual, ref64, naive)
    if ratio <= 1.0:
        return
    a, r, n = _f64(actual), _f64(ref64), _f64(naive)
    err = _abs_errors(a, r)
    err = np.where(np.isnan(err), np.inf, err)
    where = np.unravel_index(int(np.argmax(err)), err.shape)
    naive_err = _abs_errors(n, r)
    allowed = 2.0 * np.where(np.isfinite(naive_err), naive_err, 0.0).max() + ABS_FLOOR
    raise AssertionError(
        f"{name}: error ratio {ratio:.3g} > 1; max |actual - ref| = {err.max():.3g} at index "
        f"{tuple(int(i) for i in where)} (actual {float(a[where])!r}, ref {float(r[where])!r}); allowed "
        f"{allowed:.3g} = 2 * max naive error + {ABS_FLOOR:g}; "
        f"NaN count {int(np.isnan(a).sum())}, shape {a.shape}"
    )


# ---------------------------------------------------------------------------------------------
# Teaching helper
# ---------------------------------------------------------------------------------------------


def online_softmax_trace(row, block):
    """Stream a 1-D row block by block the way the online softmax does, recording each step.

    Parameters
    ----------
    row : 1-D float array
    block : int
        Block length (>= 1); the last block may be shorter.

    Returns
    -------
    steps : list of (running_max, running_sum)
        After each block: ``m = max(m_old, max(block))`` and
        ``l = l_old · exp(m_old − m) + Σ exp(block − m)``.
    weights : float64 array of the row's shape
        ``exp(row − m) / l`` with the final m and l, equal to the plain softmax.

    Raises
    ------
    ValueError
        ``block`` < 1 or ``row`` not 1-D.

    Notes
    -----
    Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018), Algorithm 3.

    Examples
    --------
    >>> steps, w = online_softmax_trace([1.4, 3.9, 0.7, 2.2, 4.6, 1.1, 3.1, 0.3], 4)
    >>> [(round(m, 4), round(l, 4)) for m, l in steps]
    [(3.9, 1.3055), (4.6, 1.9152)]
    """
    row = _f64(row)
    if row.ndim != 1 or int(block) < 1:
        raise ValueError(f"row must be 1-D and block >= 1; got shape {row.shape}, block {block}")
    m, total, steps = -math.inf, 0.0, []
    for start in range(0, row.size, int(block)):
        chunk = row[start:start + int(block)]
        m_new = max(m, float(chunk.max()))
        shift = 0.0 if m_new == -math.inf else m_new  # all -inf so far: nothing to rescale
        total = total * math.exp(m - shift) + float(np.exp(chunk - shift).sum())
        m = m_new
        steps.append((m, total))
    shift = 0.0 if m == -math.inf else m
    weights = np.exp(row - shift) / total if total > 0 else np.zeros_like(row)
    return steps, weights
