"""A NumPy model of the GPU kernels' rounding in the backward, and what it would take to meet
the exactness rule on rows that see few keys (attention_backward's docstring quotes it).

The model follows kernels/softmax_tile.cuh for the forward (unnormalised P rounded to the input
dtype before P V, out = round(O / l)) and flash_bwd*.cu for the backward (D = rowsum(dO ∘ out)
from the rounded out, P = exp2(fma(qk, scale·log2 e, −LSE₂)), P and dS rounded to the input
dtype before dV = Pᵀ dO, dK = dSᵀ Q, dQ = dS K; fp32 accumulation, modelled as float64 rounded
to fp32).  It runs the problems of scripts/backward_short_rows.py (whose GPU counts it
reproduces) with the kernels' numerics ("cur") and with candidate changes, alone and combined:
  a: D = rowsum(P ∘ dP) from the recomputed P;   A: D from the unrounded fp32 forward output;
  b: P unrounded in dV (a hi + lo split);        c: dS unrounded in dK and dQ (hi + lo).
Usage: python scripts/backward_rounding_model.py [main|big]   (big: more keys and query rows)
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cuflash import reference as R  # noqa: E402
from tests.test_cpu import make_qkv, rand  # noqa: E402

f32, f64 = np.float32, np.float64
LOG2E = 1.4426950408889634
MASKS = {"full": {}, "causal": dict(causal=True), "window(1,0)": dict(window_size=(1, 0))}


def rT(x, T):  # round fp32/fp64 values to T, back to fp32
    return x.astype(T).astype(f32)


def split(x, T):  # hi + lo parts in T (as fp32 values)
    hi = rT(x, T)
    lo = rT((x - hi).astype(f32), T)
    return hi, lo


def mm(a, b):  # products of fp32-held values, accumulated in float64 then rounded to fp32
    return (a.astype(f64) @ b.astype(f64)).astype(f32)


def emulate(q, k, v, dout, opts, fixes="", fwd="kernel"):
    T = q.dtype
    hm = lambda x: x.swapaxes(1, 2).astype(f32)  # bshd -> bhsd, fp32
    Q, K, V, dO = hm(q), hm(k), hm(v), hm(dout)
    sq, sk, d = Q.shape[2], K.shape[2], Q.shape[3]
    scale = 1.0 / np.sqrt(d)
    keep = R.visible_mask(sq, sk, **opts)[None, None]
    S = mm(Q, K.swapaxes(-1, -2))
    # forward
    keepx = keep & np.ones(S.shape, bool)
    if fwd == "brief":  # as the brief: normalised fp32 P, out = round_T(sum P v)
        s64 = np.where(keepx, S.astype(f64) * scale, -np.inf)
        m = s64.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        tot = np.exp(s64 - m).sum(-1, keepdims=True)
        with np.errstate(divide="ignore"):
            lse = np.where(tot > 0, m + np.log(tot), -np.inf).astype(f32)  # (..., 1)
        empty = ~np.isfinite(lse)
        lse_safe = np.where(empty, f32(0), lse)
        Pf = np.where(keepx & ~empty, np.exp(S * f32(scale) - lse_safe), f32(0)).astype(f32)
        O32 = mm(Pf, V)
    else:  # as kernels/softmax_tile.cuh + online_softmax.cuh: P~ = 2^(fma(s, c, -m)) packed to T for P~V
        c = f32(f32(scale) * f32(LOG2E))
        Sm = np.where(keepx, S, -np.inf).astype(f32)
        m = (Sm.max(-1, keepdims=True) * c).astype(f32)
        m_use = np.where(np.isfinite(m), m, f32(0)).astype(f32)
        with np.errstate(invalid="ignore"):
            arg = (Sm.astype(f64) * f64(c) - f64(m_use)).astype(f32)
        Pt = np.where(keepx, np.exp2(arg.astype(f64)).astype(f32), f32(0))
        l = Pt.astype(f64).sum(-1, keepdims=True).astype(f32)
        empty = ~(l > 0)
        with np.errstate(divide="ignore"):
            lse = np.where(empty, -np.inf, (f64(m) + np.log2(np.where(empty, 1, l).astype(f64))).astype(f32) * f32(0.6931471805599453)).astype(f32)
            inv_l = np.where(empty, f32(0), (1.0 / np.where(empty, 1, l).astype(f64)).astype(f32)).astype(f32)
        Oacc = mm(rT(Pt, T), V)
        O32 = (Oacc * inv_l).astype(f32)
        lse_safe = np.where(empty, f32(0), lse)
    O = rT(O32, T)
    # backward
    lse2 = (lse_safe * f32(LOG2E)).astype(f32)
    arg = (S.astype(f64) * f64(f32(f32(scale) * f32(LOG2E))) - f64(lse2)).astype(f32)  # fmaf
    P = np.where(keep & ~empty, np.exp2(arg.astype(f64)).astype(f32), f32(0)).astype(f32)
    dP = mm(dO, V.swapaxes(-1, -2))
    if "A" in fixes:  # D from the unrounded fp32 forward output
        D = (dO.astype(f64) * O32.astype(f64)).sum(-1, keepdims=True).astype(f32)
    elif "a" in fixes:
        D = (P.astype(f64) * dP.astype(f64)).astype(f32).astype(f64).sum(-1, keepdims=True).astype(f32)
    else:
        D = (dO.astype(f64) * O.astype(f64)).sum(-1, keepdims=True).astype(f32)
    dS = (P * (dP - D)).astype(f32)
    if "b" in fixes:
        hi, lo = split(P, T)
        dV = (hi.astype(f64).swapaxes(-1, -2) @ dO + lo.astype(f64).swapaxes(-1, -2) @ dO).astype(f32)
    else:
        dV = mm(rT(P, T).swapaxes(-1, -2), dO)
    if "c" in fixes:
        hi, lo = split(dS, T)
        dKs = (hi.astype(f64).swapaxes(-1, -2) @ Q + lo.astype(f64).swapaxes(-1, -2) @ Q).astype(f32)
        dQs = (hi.astype(f64) @ K + lo.astype(f64) @ K).astype(f32)
    else:
        dSr = rT(dS, T)
        dKs, dQs = mm(dSr.swapaxes(-1, -2), Q), mm(dSr, K)
    dK = (dKs * f32(scale)).astype(f32)
    dQ = (dQs * f32(scale)).astype(f32)
    back = lambda x: x.astype(T).swapaxes(1, 2)
    return back(dQ), back(dK), back(dV)


def run(label, sq, klo, khi, fix_sets, dims=(4, 64, 128), draws=60, fwd="kernel"):
    print(f"\n=== [{fwd} forward] {label}: {sq} query rows, keys {klo}-{khi}, {draws} draws/kind (rng 5) ===")
    print(f"{'kind':<26}" + "".join(f"| {('cur' if not f else f):<18}" for f in fix_sets))
    print(f"{'':<26}" + "".join(f"| {'any dq dk dv  max':<18}" for f in fix_sets))
    totals = {f: [0, 0, 0, 0, 0.0] for f in fix_sets}
    for d in dims:
        for dtype in (np.float16, ml_dtypes.bfloat16):
            for mname, opts in MASKS.items():
                rng = np.random.default_rng(5)
                stats = {f: [0, 0, 0, 0, 0.0] for f in fix_sets}
                for _ in range(draws):
                    q, k, v = make_qkv(rng, dtype, 1, sq, int(rng.integers(klo, khi + 1)), 2, 2, d)
                    dout = rand(rng, q.shape[:3] + v.shape[3:], dtype)
                    refs = R.attention_backward_ref(dout, q, k, v, **opts)
                    naives = R.naive_attention_backward(dout, q, k, v, **opts)
                    for f in fix_sets:
                        gs = emulate(q, k, v, dout, opts, f, fwd)
                        rs = [R.max_error_ratio(g, r, n) for g, r, n in zip(gs, refs, naives)]
                        st = stats[f]
                        st[0] += max(rs) > 1
                        for i in range(3):
                            st[1 + i] += rs[i] > 1
                        st[4] = max(st[4], max(rs))
                row = f"d{d:<3} {np.dtype(dtype).name:<8} {mname:<12}"
                for f in fix_sets:
                    st = stats[f]
                    row += f"| {st[0]:2d} {st[1]:2d} {st[2]:2d} {st[3]:2d} {st[4]:5.2f} "
                    tt = totals[f]
                    for i in range(4):
                        tt[i] += st[i]
                    tt[4] = max(tt[4], st[4])
                print(row, flush=True)
    row = f"{'TOTAL':<26}"
    for f in fix_sets:
        tt = totals[f]
        row += f"| {tt[0]:3d}{tt[1]:3d}{tt[2]:3d}{tt[3]:3d} {tt[4]:5.2f}"
    print(row, flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "main"
    t0 = time.time()
    ALL = ["", "a", "b", "c", "ab", "ac", "bc", "abc"]
    if mode == "main":
        run("probe problems", 4, 1, 9, ALL, fwd="brief")
        run("probe problems", 4, 1, 9, ALL, fwd="kernel")
        run("probe problems (A = D from fp32 forward out)", 4, 1, 9, ["A", "Ab", "Ac", "Abc"], fwd="kernel")
    else:
        for fwd in ("kernel", "brief"):
            run("4 rows, 10-64 keys", 4, 10, 64, ["", "a", "ac", "abc"], fwd=fwd)
            run("4 rows, 65-200 keys", 4, 65, 200, ["", "a", "ac", "abc"], fwd=fwd)
            run("64 rows, 1-9 keys", 64, 1, 9, ["", "a", "ac", "abc"], fwd=fwd)
    print(f"\n[{time.time() - t0:.0f} s]")
