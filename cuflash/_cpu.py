"""The tiled FlashAttention algorithm in NumPy: what :func:`cuflash.attention` runs for NumPy inputs.

The code follows FlashAttention-2 (Dao, ICLR 2024) Algorithm 1 (forward) and Algorithm 2
(backward) block by block, vectorised over batch and heads:

* forward: for each block of BLOCK_M query rows, stream the key/value blocks of BLOCK_N keys
  that the causal/window band can reach; keep a running row max m, a running sum l and an
  unnormalised output O (rescaled by exp(m_old − m_new) when the max grows), and divide once at
  the end.  Only one (BLOCK_M, BLOCK_N) score tile exists at a time.
* backward: recompute each score tile from q, k and the row statistics (P = exp(S − lse); here
  exp(S − m) / l from the row max and sum it forms again, see backward), with
  D = rowsum(dO ∘ O), dS = P ∘ (dO Vᵀ − D); outer loop over key blocks (dk, dv finished per
  block), inner loop over query blocks (dq accumulated).

Tiles are converted to the accumulation dtype: float32 for 16-bit inputs, float64 otherwise.  GQA is
handled by viewing the query heads as (nheads_k, group): query head h = kv·group + g reads key
head kv = h // group, and the G query heads of a group are stacked as the rows of one matmul
against their shared key/value tile.

The API has validated everything; arrays arrive as (batch, seqlen, heads, dim) views with any
strides, and results are written into the given output arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._precision import operand_rounding

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per tile
SOFTMAX_BLOCK = 256  # elements per streamed block in softmax()


def _acc_dtype(dtype) -> np.dtype:
    """Accumulation dtype: float32 for 16-bit inputs, float64 for float32 and float64 inputs.

    float32 inputs are multiplied in float64: NumPy's float32 matmul sums in an order that depends
    on the batch shape, and on large scores (|s| ~ 50) that alone can put a tile's result a few
    ulps past the plain computation, beyond the exactness rule (found in about 1 of 1,200 random
    cases); float64 products leave only the final rounding.
    """
    wide = np.dtype(dtype).name in ("float32", "float64")  # by name: any byte order
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


class _Heads:
    """Reshapes between the caller's (B, S, Hq, d) and the tiled (B, Hkv, G, S, d) view."""

    def __init__(self, p):
        self.hkv, self.g = p.nheads_k, p.group_size

    def queries(self, x, acc):
        """(B, S, Hq, d) view -> (B, Hkv, G, S, d) contiguous copy in the accumulation dtype."""
        b, s, _, d = x.shape
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=acc).reshape(b, self.hkv, self.g, s, d)

    def keys(self, x, acc):
        """(B, S, Hkv, d) view -> (B, Hkv, S, d) contiguous copy in the accumulation dtype.

        K and V are converted once per call rather than once per tile: O(N·d) memory, like the
        inputs themselves; only the O(N²) score matrix is what tiling must avoid.
        """
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=acc)

    def rows(self, x):
        """(B, Hkv, G, m, d) -> (B, m, Hq, d), for writing into a bshd output."""
        b, _, _, m, d = x.shape
        return x.reshape(b, self.hkv * self.g, m, d).transpose(0, 2, 1, 3)


class _Band:
    """Which keys each query sees: the causal/window band and the valid key length per batch entry.

    Key j is visible from query i of batch entry b iff ``j < sk[b]`` and
    ``i + off[b] - left <= j <= i + off[b] + right`` (a bound of -1 is absent), where
    ``off[b] = sk[b] - Sq`` (bottom-right) or 0 (top-left).  ALiBi measures |i + off[b] − j|.
    """

    def __init__(self, p):
        if p.seqlens_k is None:
            sk = np.full(p.batch, p.seqlen_k, dtype=np.int64)
        else:
            sk = np.asarray(p.seqlens_k).astype(np.int64)
        self.sk = sk
        self.off = np.zeros_like(sk) if p.top_left else sk - p.seqlen_q
        self.left, self.right = p.window_left, p.window_right
        self.seqlen_q = p.seqlen_q
        self.masked = self.left != -1 or self.right != -1 or p.seqlens_k is not None

    def stored_keys(self, x):
        """The (B, Sk, Hkv, d) keys or values up to the longest valid length: rows past every sk are
        never read (a padded cache of a million rows attended to over 4 keys converts 4 of them)."""
        return x[:, :int(self.sk.max()) if self.sk.size else 0]

    def zero_invalid_keys(self, x):
        """(B, Hkv, Sk, d) keys or values with the rows past each sk zeroed (they are never
        visible, but a tile multiplies their weight 0 by whatever they hold, NaN included)."""
        if (self.sk >= x.shape[2]).all():
            return x
        valid = np.arange(x.shape[2])[None, :] < self.sk[:, None]  # (B, Sk)
        return np.where(valid[:, None, :, None], x, x.dtype.type(0))

    def key_range(self, i0, i1):
        """Keys [lo, hi) that some row in [i0, i1) of some batch entry may see."""
        lo, hi = 0, int(self.sk.max()) if self.sk.size else 0
        if self.left != -1:
            lo = max(lo, i0 + int(self.off.min()) - self.left)
        if self.right != -1:
            hi = min(hi, i1 - 1 + int(self.off.max()) + self.right + 1)
        return lo, hi

    def query_range(self, j0, j1):
        """Query rows [lo, hi) that may see some key in [j0, j1) (the transpose of key_range)."""
        lo, hi = 0, self.seqlen_q
        if self.sk.size == 0 or j0 >= self.sk.max():  # keys past every valid length
            return 0, 0
        if self.right != -1:  # j <= i + off + right  <=>  i >= j - off - right
            lo = max(lo, j0 - int(self.off.max()) - self.right)
        if self.left != -1:  # j >= i + off - left  <=>  i <= j - off + left
            hi = min(hi, j1 - 1 - int(self.off.min()) + self.left + 1)
        return lo, hi

    def keep(self, i0, i1, j0, j1):
        """Boolean visibility of the tile, shape (B, 1, 1, m, n), or None when all of it is visible."""
        if not self.masked:
            return None
        i = np.arange(i0, i1)[None, :, None]
        j = np.arange(j0, j1)[None, None, :]
        diag = i + self.off[:, None, None]  # (B, m, 1)
        keep = j < self.sk[:, None, None]
        if self.left != -1:
            keep = keep & (j >= diag - self.left)
        if self.right != -1:
            keep = keep & (j <= diag + self.right)
        return None if keep.all() else keep[:, None, None]

    def distance(self, i0, i1, j0, j1):
        """|i + off − j| for ALiBi, shape (B, 1, 1, m, n)."""
        i = np.arange(i0, i1)[None, :, None]
        j = np.arange(j0, j1)[None, None, :]
        return np.abs(i + self.off[:, None, None] - j)[:, None, None]


class _Modifiers:
    """Additive bias, boolean mask and dropout of a problem, read tile by tile: bias and mask
    through broadcast views of their own strides (a size-1 axis costs no memory), the dropout
    keep-mask drawn per tile from its seed (cuflash/dropout.py).  Tiles come out in the tiled
    (B, Hkv, G, m, n) view."""

    def __init__(self, p, acc):
        full = (p.batch, p.nheads_q, p.seqlen_q, p.seqlen_k)
        self.bias = None if p.bias is None else np.broadcast_to(p.bias, full)
        self.mask = None if p.mask is None else np.broadcast_to(p.mask, full)
        self.dropout = p.dropout
        self.acc, self.hkv, self.g = acc, p.nheads_k, p.group_size
        first = 0 if p.dropout is None else p.dropout[3]  # a packed batch's sequences run one by one
        bh = np.arange(first * p.nheads_q, (first + p.batch) * p.nheads_q, dtype=np.uint64)
        self.bh = bh.reshape(p.batch, p.nheads_k, p.group_size, 1, 1)

    def _tile(self, x, i0, i1, j0, j1, dtype):
        t = np.asarray(x[:, :, i0:i1, j0:j1], dtype=dtype)
        return t.reshape(t.shape[0], self.hkv, self.g, i1 - i0, j1 - j0)

    def add_bias(self, s, i0, i1, j0, j1):
        return s if self.bias is None else s + self._tile(self.bias, i0, i1, j0, j1, s.dtype)

    def keep(self, i0, i1, j0, j1):
        """The mask tile (True = attend), or None without a mask."""
        return None if self.mask is None else self._tile(self.mask, i0, i1, j0, j1, bool)

    def kept(self, i0, i1, j0, j1):
        """The dropout keep-mask of a tile (drawn once per tile, then applied with
        :meth:`dropped`), or None without dropout."""
        if self.dropout is None:
            return None
        from .dropout import keep_mask_block

        rate, seed, offset, _ = self.dropout
        i = np.arange(i0, i1, dtype=np.uint64)[:, None]
        j = np.arange(j0, j1, dtype=np.uint64)[None, :]
        return keep_mask_block(seed, offset, rate, self.bh, i, j)

    def dropped(self, x, kept):
        """x (P or dP of a tile) after dropout: kept entries scaled by 1 / (1 - p), the others 0."""
        if kept is None:
            return x
        return np.where(kept, x * x.dtype.type(1.0 / (1.0 - self.dropout[0])), x.dtype.type(0))


def _blocks(lo, hi, size):
    """[start, stop) pairs covering [lo, hi), aligned to multiples of size."""
    start = (max(lo, 0) // size) * size
    return [(s, min(s + size, hi)) for s in range(start, hi, size)]


def _score_tile(p, band, slopes, q_t, k_t, i0, i1, j0, j1, mods=None):
    """Final scores of one tile, (B, Hkv, G, m, n), and tanh(s_raw/cap) (None without softcap).

    The contract's pipeline: scale·q·k → softcap → ALiBi → bias → masks to −inf.
    """
    s = _group_matmul(q_t, k_t.swapaxes(-1, -2)) * _scalar(q_t, p.softmax_scale)
    tanh = None
    if p.softcap > 0:
        with np.errstate(over="ignore"):  # s / cap past the dtype's range: tanh(±inf) = ±1 is right
            tanh = np.tanh(s / _scalar(s, p.softcap))
        s = _scalar(s, p.softcap) * tanh
    if slopes is not None:
        s = s - slopes * band.distance(i0, i1, j0, j1).astype(s.dtype)
    keep = band.keep(i0, i1, j0, j1)
    if mods is not None:
        s = mods.add_bias(s, i0, i1, j0, j1)
        mask = mods.keep(i0, i1, j0, j1)
        keep = mask if keep is None else (keep if mask is None else keep & mask)
    if keep is not None:
        s = np.where(keep, s, s.dtype.type(-np.inf))
    return s, tanh


def _group_matmul(a, b):
    """a @ b for a (B, Hkv, G, m, x) and b (B, Hkv, x, y) -> (B, Hkv, G, m, y).

    The G query heads of a group share b, so they are stacked as G·m rows of one matmul per
    key/value head instead of G small ones.
    """
    bsz, h, g, m, x = a.shape
    return (a.reshape(bsz, h, g * m, x) @ b).reshape(bsz, h, g, m, b.shape[-1])


def _scalar(x, value):
    """A Python scalar as x's dtype, so float32 tiles stay float32."""
    return x.dtype.type(value)


def _slopes(p, acc):
    """ALiBi slopes (B, Hq) -> (B, Hkv, G, 1, 1) in the accumulation dtype, or None."""
    if p.alibi_slopes is None:
        return None
    slopes = np.asarray(p.alibi_slopes, dtype=acc)
    return slopes.reshape(p.batch, p.nheads_k, p.group_size, 1, 1)


def _online_step(m, l, s, acc):
    """One key tile of the online softmax: the new row max and sum, the factor that rescales
    what was accumulated under the old max, and the tile's exp(s - max)."""
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    # A row with no visible key yet has m_new = -inf; shifting by 0 instead keeps
    # exp(-inf - -inf) = NaN out (its weights stay exp(-inf) = 0).
    shift = np.where(m_new == -np.inf, acc.type(0), m_new)
    alpha = np.exp(m - shift)
    p_t = np.exp(s - shift)
    return m_new, alpha * l + p_t.sum(axis=-1, keepdims=True), alpha, p_t


def _final_lse(m, l, acc):
    """log-sum-exp of the rows from their max and sum; -inf on rows that saw no key (l = 0), NaN
    on rows whose scores were NaN or overflowed (l = NaN), so that merge_states keeps them NaN."""
    seen = l != 0
    return np.where(seen, m + np.log(np.where(seen, l, acc.type(1))), acc.type(-np.inf))


def _past_float32(o, row_lse):
    """Rows whose LSE leaves float32's range, as the GPU gives them (its scores are formed in
    float32): past +3.4e38 the scores overflowed, so out and LSE are NaN (the attention
    docstring); below -3.4e38 every score is -inf there, an empty row (0, LSE -inf).  No NumPy
    overflow warning reaches the caller."""
    big = float(np.finfo(np.float32).max)
    over, under = row_lse > big, row_lse < -big
    o = np.where(over, np.nan, np.where(under, 0.0, o))
    return o, np.where(over, np.nan, np.where(under, -np.inf, row_lse))


def _quiet(fn):
    """Run fn under np.errstate(all="ignore"): overflowing or non-finite scores are the data's
    (documented as NaN or empty rows), and no NumPy RuntimeWarning should reach the caller."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return run


@_quiet
def forward(p, q, k, v, out, lse, *, block_m=BLOCK_M, block_n=BLOCK_N):
    """Tiled forward pass (FlashAttention-2, Algorithm 1) into ``out`` and ``lse``.

    Parameters
    ----------
    p : cuflash._validate.AttnProblem
    q : (B, Sq, Hq, D) array view; k : (B, Sk, Hkv, D); v : (B, Sk, Hkv, Dv)
        float16, bfloat16, float32 or float64, any strides.
    out : (B, Sq, Hq, Dv) array view of q's dtype, written in full.
    lse : (B, Hq, Sq) float32 array (float64 for float64 inputs), written in full.
    block_m, block_n : int
        Tile sizes (query rows, keys); small values are useful in tests.
    """
    acc = _acc_dtype(p.dtype)
    heads, band, slopes, mods, rnd = _Heads(p), _Band(p), _slopes(p, acc), _modifiers(p, acc), operand_rounding(p.precision)
    k_all, v_all = (rnd(band.zero_invalid_keys(heads.keys(band.stored_keys(x), acc))) for x in (k, v))  # (B, Hkv, Sk', d)
    for i0, i1 in _blocks(0, p.seqlen_q, block_m):
        q_t = rnd(heads.queries(q[:, i0:i1], acc))  # (B, Hkv, G, m, D)
        row_shape = q_t.shape[:-1] + (1,)
        m = np.full(row_shape, -np.inf, dtype=acc)  # running row max
        l = np.zeros(row_shape, dtype=acc)  # running sum of exp(s - m)
        o = np.zeros(q_t.shape[:-1] + (p.headdim_v,), dtype=acc)  # unnormalised output
        for j0, j1 in _blocks(*band.key_range(i0, i1), block_n):
            s, _ = _score_tile(p, band, slopes, q_t, k_all[..., j0:j1, :], i0, i1, j0, j1, mods)
            m, l, alpha, p_t = _online_step(m, l, s, acc)  # p_t: (B, Hkv, G, m, n)
            if mods is not None:  # dropout acts on P after the row statistics (the LSE ignores it)
                p_t = mods.dropped(p_t, mods.kept(i0, i1, j0, j1))
            o = alpha * o + _group_matmul(rnd(p_t), v_all[..., j0:j1, :])
        empty = l == 0  # rows that saw no key: exactly 0, even where 0 * inf in V made o NaN
        row_lse = _final_lse(m, l, acc)
        o = np.where(empty, acc.type(0), o / np.where(empty, acc.type(1), l))
        if np.dtype(lse.dtype).itemsize < acc.itemsize:  # float64 sums of scores formed in float32 on the GPU
            o, row_lse = _past_float32(o, row_lse)
        out[:, i0:i1] = heads.rows(o)
        lse[:, :, i0:i1] = row_lse[..., 0].reshape(p.batch, p.nheads_q, i1 - i0)


@_quiet
def backward(p, dout, q, k, v, out, lse, dq, dk, dv, *, deterministic=False,
             block_m=BLOCK_M, block_n=BLOCK_N, dlse=None, dbias=None, given_stats=False):
    """Tiled backward pass by recomputation (FlashAttention-2, Algorithm 2) into dq, dk, dv.

    Parameters
    ----------
    p : cuflash._validate.AttnProblem
    dout, out : (B, Sq, Hq, Dv) array views; q, k, v as in :func:`forward`.
    lse : (B, Hq, Sq) array from the forward (-inf on rows that see no key).
    dq, dk, dv : array views with the shapes and dtypes of q, k, v, written in full.
    deterministic : bool
        Accepted for the API's sake: this path is always bitwise repeatable.
    block_m, block_n : int
        Tile sizes.
    dlse : (B, Hq, Sq) array, optional
        Gradient through the LSE: dS gains P · dlse (d lse_i / d s_ij = P_ij).
    dbias : array of ``p.bias``'s shape, optional
        Written in full with the bias gradient (dS summed over the bias's broadcast axes).
    given_stats : bool
        Take the LSE from ``lse`` and D from rowsum(dout ∘ out), as the GPU kernels do, instead of
        recomputing them: the gradient of one key block of a longer sequence whose ``out`` and
        ``lse`` cover every key (ring attention, cuflash.parallel).

    Notes
    -----
    Per tile P = exp(S − lse), dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D) (times 1 − tanh²
    through the softcap), dQ += scale · dS K, dK += scale · dSᵀ Q, with D = rowsum(P ∘ dP)
    (= rowsum(dO ∘ O)).  ``out`` and ``lse`` are not read: two first passes over the same tiles
    form the row max m and sum l (online, in the accumulation dtype; P = exp(S − m) / l, as
    lse = m + log l may round back to m where |m| is huge) and D from the very scores, P and dP the
    gradients use.  So P is exactly 1 and dS exactly 0 on a row that sees one key, a float32
    LSE (float32 inputs) does not shift P by |lse|·2⁻²⁴ where scores are large, and the
    output's rounding to float16/bfloat16 does not enter D.  The GPU kernels read ``out`` and
    ``lse``, as FlashAttention does.
    """
    del deterministic  # one thread, fixed loop order: always repeatable
    acc = _acc_dtype(p.dtype)
    heads, band, slopes, mods, rnd = _Heads(p), _Band(p), _slopes(p, acc), _modifiers(p, acc), operand_rounding(p.precision)
    # (B, Hkv, Sk', d): the keys up to the longest valid length; dk, dv are 0 past it
    k_all, v_all = (rnd(band.zero_invalid_keys(heads.keys(band.stored_keys(x), acc))) for x in (k, v))
    q_all, do_all = rnd(heads.queries(q, acc)), rnd(heads.queries(dout, acc))  # (B, Hkv, G, Sq, d)
    key_tiles = [(j0, j1, k_all[..., j0:j1, :], v_all[..., j0:j1, :])  # (B, Hkv, n, d) views
                 for j0, j1 in _blocks(0, k_all.shape[2], block_n)]
    dk[:, k_all.shape[2]:], dv[:, k_all.shape[2]:] = 0, 0

    def query_tiles(j0, j1, k_t):  # (i0, i1, scores, tanh) of the query tiles that see keys [j0, j1)
        for i0, i1 in _blocks(*band.query_range(j0, j1), block_m):
            yield (i0, i1, *_score_tile(p, band, slopes, q_all[..., i0:i1, :], k_t, i0, i1, j0, j1, mods))

    rows = q_all.shape[:-1] + (1,)
    # P = exp(S - shift) / norm per row: shift = lse and norm = 1 with given stats; else the row
    # max m and sum l themselves, not lse = m + log l, which rounds back to m where |m| dwarfs
    # log l (a bias of float32's lowest on a masked row: every P would be 1 instead of 1/n).
    if given_stats:
        shift = np.asarray(lse, dtype=acc).reshape(rows)
        empty, norm = shift == -np.inf, None
    else:
        m, l = np.full(rows, -np.inf, dtype=acc), np.zeros(rows, dtype=acc)
        for j0, j1, k_t, _ in key_tiles:
            for i0, i1, s, _ in query_tiles(j0, j1, k_t):
                m[..., i0:i1, :], l[..., i0:i1, :], _, _ = _online_step(m[..., i0:i1, :], l[..., i0:i1, :], s, acc)
        empty = l == 0  # rows that see no key: no part in any gradient (see _weighted), dq exactly 0
        shift, norm = np.where(empty, acc.type(-np.inf), m), np.where(empty, acc.type(1), l)
    # A row that saw no key has shift -inf; using +inf makes its P = exp(S - inf) = 0 even where
    # S = -inf (whereas -inf - -inf would be NaN).
    shift = np.where(shift == -np.inf, acc.type(np.inf), shift)
    do_all = np.where(empty, acc.type(0), do_all)

    def probs(s, i0, i1):
        e = np.exp(s - shift[..., i0:i1, :])
        return e if norm is None else e / norm[..., i0:i1, :]

    def grad_tiles(j0, j1, k_t, v_t):  # (i0, i1, P, dP, tanh, keep-mask); with dropout dP = (dO Vᵀ) ∘ Z
        for i0, i1, s, tanh in query_tiles(j0, j1, k_t):
            dp = _group_matmul(do_all[..., i0:i1, :], v_t.swapaxes(-1, -2))
            kept = None if mods is None else mods.kept(i0, i1, j0, j1)
            if kept is not None:
                dp = mods.dropped(dp, kept)
            yield i0, i1, probs(s, i0, i1), dp, tanh, kept

    dlse_all = None if dlse is None else np.asarray(dlse, dtype=acc).reshape(rows[:-1])[..., None]
    bias_grad = None if dbias is None else _BiasGrad(p, acc)

    delta = np.zeros(rows, dtype=acc)  # D, (B, Hkv, G, Sq, 1)
    if given_stats:  # D = rowsum(dO ∘ O) over every key of the row, not only this block's
        delta = np.where(empty, acc.type(0), (do_all * heads.queries(out, acc)).sum(axis=-1, keepdims=True))
    else:
        for j0, j1, k_t, v_t in key_tiles:
            for i0, i1, p_t, dp, _, _ in grad_tiles(j0, j1, k_t, v_t):
                delta[..., i0:i1, :] += _weighted(p_t, dp).sum(axis=-1, keepdims=True)
    dq_all = np.zeros_like(q_all)
    scale = acc.type(p.softmax_scale)
    for j0, j1, k_t, v_t in key_tiles:
        dk_t = np.zeros((p.batch, p.nheads_k, j1 - j0, p.headdim_qk), dtype=acc)
        dv_t = np.zeros((p.batch, p.nheads_k, j1 - j0, p.headdim_v), dtype=acc)
        for i0, i1, p_t, dp, tanh, kept in grad_tiles(j0, j1, k_t, v_t):
            q_t, do_t = q_all[..., i0:i1, :], do_all[..., i0:i1, :]
            dv_t += _sum_over_group(rnd(p_t if kept is None else mods.dropped(p_t, kept)), do_t)
            dp = dp - delta[..., i0:i1, :]
            if dlse_all is not None:
                dp = dp + dlse_all[..., i0:i1, :]
            ds = _weighted(p_t, dp)
            if bias_grad is not None:
                bias_grad.add(ds, i0, i1, j0, j1)
            if tanh is not None:
                ds *= 1 - tanh * tanh
            ds = rnd(ds)  # (the operand of the two products)
            dq_all[..., i0:i1, :] += scale * _group_matmul(ds, k_t)
            dk_t += scale * _sum_over_group(ds, q_t)
        dk[:, j0:j1] = dk_t.transpose(0, 2, 1, 3)
        dv[:, j0:j1] = dv_t.transpose(0, 2, 1, 3)
    dq[...] = heads.rows(np.where(empty, acc.type(0), dq_all))  # not 0 * inf where K is not finite
    if bias_grad is not None:
        dbias[...] = bias_grad.total.reshape(dbias.shape)


def _modifiers(p, acc):
    """The problem's bias/mask/dropout, or None when it has none (the common, fast case)."""
    return None if p.bias is None and p.mask is None and p.dropout is None else _Modifiers(p, acc)


class _BiasGrad:
    """dbias: the dS tiles (the softmax input's gradient) summed over the bias's broadcast axes."""

    def __init__(self, p, acc):
        self.p = p
        self.shape = (1,) * (4 - p.bias.ndim) + tuple(p.bias.shape)  # as a 4-D broadcast operand
        self.total = np.zeros(self.shape, dtype=acc)

    def add(self, ds, i0, i1, j0, j1):
        g = ds.reshape(self.p.batch, self.p.nheads_q, i1 - i0, j1 - j0)
        g = g.sum(axis=tuple(a for a, n in enumerate(self.shape) if n == 1 and g.shape[a] != 1), keepdims=True)
        rows = slice(i0, i1) if self.shape[2] != 1 else slice(0, 1)
        cols = slice(j0, j1) if self.shape[3] != 1 else slice(0, 1)
        self.total[:, :, rows, cols] += g


def _weighted(p_t, x):
    """p_t * x, exactly 0 where p_t is 0 (masked keys, rows that see no key): every gradient term
    there is 0, and forming it as 0 * x would turn a non-finite dO, K or V there into NaN."""
    with np.errstate(invalid="ignore"):
        return np.where(p_t == 0, p_t.dtype.type(0), p_t * x)


def _sum_over_group(a, x):
    """Σ_g a[:, :, g]ᵀ x[:, :, g]: (B, Hkv, G, m, n), (B, Hkv, G, m, d) -> (B, Hkv, n, d).

    The group and row axes are merged into one contraction, so the sum over the query heads of
    a GQA group happens inside one matmul.
    """
    b, h, g, m, n = a.shape
    a2 = a.transpose(0, 1, 4, 2, 3).reshape(b, h, n, g * m)
    return a2 @ x.reshape(b, h, g * m, x.shape[-1])


def _sequence_problem(p, b, seqlen_q, seqlen_k):
    """The padded-batch problem of sequence b alone (batch 1)."""
    slopes = None if p.alibi_slopes is None else p.alibi_slopes[b:b + 1]
    dropout = None if p.dropout is None else p.dropout[:3] + (b,)  # its keep-mask is sequence b's
    return dataclasses.replace(p, batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                               alibi_slopes=slopes, seqlens_k=None, dropout=dropout)


def _sequences(cu_q, cu_k):
    """(b, q0, q1, k0, k1) for every sequence with at least one query and one key."""
    cu_q, cu_k = np.asarray(cu_q).astype(np.int64), np.asarray(cu_k).astype(np.int64)
    for b in range(cu_q.size - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        if q1 > q0 and k1 > k0:  # otherwise the API's prefill (0, -inf, zero grads) is the answer
            yield b, q0, q1, k0, k1


def forward_varlen(p, q, k, v, out, lse, cu_q, cu_k):
    """Forward over a packed batch, sequence by sequence, into pre-filled ``out`` and ``lse``.

    Parameters
    ----------
    p : AttnProblem with batch = number of sequences and seqlen_q/k = the longest lengths.
    q : (total_q, Hq, D); k : (total_k, Hkv, D); v : (total_k, Hkv, Dv) arrays.
    out : (total_q, Hq, Dv), pre-filled with 0; lse : (Hq, total_q), pre-filled with -inf.
    cu_q, cu_k : (batch + 1,) integer offsets.
    """
    for b, q0, q1, k0, k1 in _sequences(cu_q, cu_k):
        sub = _sequence_problem(p, b, q1 - q0, k1 - k0)
        forward(sub, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                lse[None, :, q0:q1])


def backward_varlen(p, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, *, deterministic=False):
    """Backward over a packed batch, sequence by sequence, into pre-zeroed dq, dk, dv.

    Parameters
    ----------
    p, q, k, v, cu_q, cu_k
        As in :func:`forward_varlen`.
    dout, out : (total_q, Hq, Dv); lse : (Hq, total_q)
    dq, dk, dv : arrays with the shapes of q, k, v, pre-filled with 0.
    deterministic : bool
        Accepted; this path is always repeatable.
    """
    for b, q0, q1, k0, k1 in _sequences(cu_q, cu_k):
        sub = _sequence_problem(p, b, q1 - q0, k1 - k0)
        backward(sub, dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                 out[None, q0:q1], lse[None, :, q0:q1], dq[None, q0:q1], dk[None, k0:k1],
                 dv[None, k0:k1], deterministic=deterministic)


def softmax(x, axis, *, block=SOFTMAX_BLOCK):
    """Softmax along ``axis`` with one streaming pass for the normaliser (online softmax).

    Parameters
    ----------
    x : NumPy float array (float16, bfloat16, float32, float64), non-empty.
    axis : int, already normalised.
    block : int
        Elements per streamed block.

    Returns
    -------
    NumPy array of x's shape and dtype (C-contiguous); a slice of all -inf gives zeros.

    Notes
    -----
    Milakov & Gimelshein (2018): a running max m and sum l over blocks, l rescaled by
    exp(m_old − m_new) when the max grows; then one elementwise pass writes exp(x − m) / l.
    Computed in float32 (float64 for float64 input).
    """
    with np.errstate(invalid="ignore"):  # +inf inputs give NaN (inf - inf), as in SciPy; no warning
        return _softmax(x, axis, block)


def _softmax(x, axis, block):
    acc = _acc_dtype(x.dtype)
    xm = np.moveaxis(x, axis, -1)
    m = np.full(xm.shape[:-1] + (1,), -np.inf, dtype=acc)
    l = np.zeros_like(m)
    for j0, j1 in _blocks(0, xm.shape[-1], block):
        t = xm[..., j0:j1].astype(acc)
        m_new = np.maximum(m, t.max(axis=-1, keepdims=True))
        shift = np.where(m_new == -np.inf, acc.type(0), m_new)  # all -inf so far: no NaN
        with np.errstate(over="ignore"):  # as below: overflow to -inf means exp(...) = 0 exactly
            l = l * np.exp(m - shift) + np.exp(t - shift).sum(axis=-1, keepdims=True)
        m = m_new
    shift = np.where(m == -np.inf, acc.type(0), m)
    with np.errstate(over="ignore"):  # x - max overflows to -inf only where exp gives the exact 0
        y = np.exp(xm.astype(acc) - shift) / np.where(l > 0, l, acc.type(1))
    return np.ascontiguousarray(np.moveaxis(y.astype(x.dtype), -1, axis))
