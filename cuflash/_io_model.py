"""How many bytes attention moves through GPU memory (HBM), standard versus tiled.

Every formula of the I/O model lives in :func:`io_model`, and nowhere else: ``cuflash io`` prints
its result and the benchmarks compare measured times against it.

The model follows Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness", NeurIPS 2022, §3.2, Theorem 2: with sequence length N, head dimension d and an
on-chip memory of M elements (d <= M <= N·d),

* standard attention (the paper's Algorithm 0) needs Θ(N·d + N²) HBM accesses: it writes the
  N×N score matrix S, reads it back, writes the probabilities P and reads them back;
* the tiled algorithm needs Θ(N²·d²/M) HBM accesses: S never leaves the chip, but K and V are
  streamed through on-chip memory once for every block of queries, and a query block holds
  Θ(M/d) rows.

We use the loop order of FlashAttention-2 (Dao 2023, §3.1): the outer loop runs over query
blocks, so Q is read once, O and the LSE are written once, and K, V are read once per query block.
The paper's Algorithm 1 swaps the loops (K, V read once, Q and O re-read once per key block);
both orders give the same Θ(N²d²/M) bound, with the roles of B_r and B_c exchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _arrays

#: Bytes per element of the dtypes the model accepts.
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

#: Default on-chip memory: shared memory per SM of an H100/H200 (228 KiB).
DEFAULT_SRAM_BYTES = 228 * 1024


@dataclass(frozen=True)
class IOModel:
    """Sizes and HBM traffic of one attention problem.  All sizes are in bytes.

    Array sizes (``q_bytes`` ... ``score_bytes``) cover the whole problem, batch × heads;
    ``*_per_head`` fields cover one (batch, head) pair.
    """

    # The problem.
    batch: int
    nheads: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    headdim_v: int
    dtype: str
    itemsize: int
    acc_itemsize: int
    block_m: int
    block_n: int
    sram_bytes: int

    # Arrays in HBM.
    q_bytes: int
    k_bytes: int
    v_bytes: int
    o_bytes: int
    lse_bytes: int
    q_bytes_per_head: int
    score_bytes_per_head: int
    score_bytes: int

    # On-chip working set of one tile (block_m query rows against block_n keys).
    tile_q_bytes: int
    tile_k_bytes: int
    tile_v_bytes: int
    tile_s_bytes: int
    tile_o_bytes: int
    tile_stats_bytes: int

    # Standard attention: (step, bytes) in the order the paper's Algorithm 0 moves them.
    standard_steps: tuple

    # Tiled attention with the block size the paper derives from M: (step, bytes).
    sram_elems: int
    block_rows: int
    query_blocks: int
    tiled_steps: tuple

    # Tiled attention with the kernel's own block_m.
    kernel_query_blocks: int
    kernel_hbm_bytes: int

    @property
    def qkvo_bytes(self) -> int:
        """Q, K, V and O together."""
        return self.q_bytes + self.k_bytes + self.v_bytes + self.o_bytes

    @property
    def score_over_matrix(self) -> float:
        """How many N×d matrices the N×N score matrix is worth: seqlen_k / headdim."""
        return self.score_bytes_per_head / self.q_bytes_per_head

    @property
    def tile_bytes(self) -> int:
        """Everything one tile keeps on chip (shared memory plus registers)."""
        return (
            self.tile_q_bytes + self.tile_k_bytes + self.tile_v_bytes
            + self.tile_s_bytes + self.tile_o_bytes + self.tile_stats_bytes
        )

    @property
    def tile_fits(self) -> bool:
        return self.tile_bytes <= self.sram_bytes

    @property
    def standard_hbm_bytes(self) -> int:
        return sum(b for _, b in self.standard_steps)

    @property
    def tiled_hbm_bytes(self) -> int:
        return sum(b for _, b in self.tiled_steps)

    @property
    def hbm_ratio(self) -> float:
        """Standard over tiled HBM traffic (the paper's block sizes)."""
        return self.standard_hbm_bytes / self.tiled_hbm_bytes if self.tiled_hbm_bytes else math.inf


def _positive(value, name: str) -> int:
    if not _arrays.is_integer(value):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return int(value)


def io_model(
    *,
    batch: int = 1,
    nheads: int = 1,
    seqlen_q: int = 8192,
    seqlen_k: int | None = None,
    headdim: int = 128,
    headdim_v: int | None = None,
    dtype: str = "float16",
    block_m: int = 128,
    block_n: int = 64,
    sram_bytes: int = DEFAULT_SRAM_BYTES,
) -> IOModel:
    """Sizes, tile working set and HBM traffic of attention with the given shapes.

    Parameters
    ----------
    batch, nheads : int
        Batch size and number of heads (every head has its own K and V here).
    seqlen_q, seqlen_k : int
        Query and key lengths; ``seqlen_k=None`` means ``seqlen_q``.
    headdim, headdim_v : int
        Head dimension of Q and K, and of V and O (``None`` means ``headdim``).
    dtype : {"float16", "bfloat16", "float32", "float64"}
        Element type of Q, K, V, O (and of S and P in standard attention).  Tiles of S and the
        O accumulator are float32 (float64 for float64), as in the kernels.
    block_m, block_n : int
        Query rows and key columns of one tile (the kernel's tile shape).
    sram_bytes : int
        On-chip memory M in bytes (shared memory per SM; 228 KiB on H100/H200).

    Returns
    -------
    IOModel

    Notes
    -----
    Dao et al. 2022 (FlashAttention), §3.2, Theorem 2, with N = seqlen, d = headdim and M the
    on-chip memory counted in elements of ``dtype``:

    * Standard attention (Algorithm 0): read Q and K, write S; read S, write P; read P and V,
      write O.  ``Θ(N·d + N²)`` bytes: ``(Nq + Nk)·d + 4·Nq·Nk + Nk·dv + Nq·dv`` elements.
    * Tiled attention: a query block holds ``B_r = min(ceil(M / (4·max(d, dv))), Nq)`` rows (the size Algorithm 1,
      line 1, gives its outer-loop blocks, B_c there; here the outer loop runs over queries, as
      in FlashAttention-2), giving ``T_r = ceil(Nq / B_r)`` query blocks.  Q is read
      once, O and the LSE (float32; float64 for float64) are written once, and K and V are read once per query block:
      ``Nq·d + Nq·dv + T_r·Nk·(d + dv)`` elements plus the LSE, i.e. ``Θ(N²·d²/M)``.
    * The same count with the kernel's ``block_m`` instead of ``B_r`` gives ``kernel_hbm_bytes``.
    * One tile keeps a block_m×d Q tile, block_n×d K tile and block_n×dv V tile in ``dtype``,
      a block_m×block_n S tile and a block_m×dv O accumulator in float32, and the running max m
      and sum l of each of its block_m rows (float32).
    """
    batch = _positive(batch, "batch")
    nheads = _positive(nheads, "nheads")
    seqlen_q = _positive(seqlen_q, "seqlen_q")
    seqlen_k = seqlen_q if seqlen_k is None else _positive(seqlen_k, "seqlen_k")
    headdim = _positive(headdim, "headdim")
    headdim_v = headdim if headdim_v is None else _positive(headdim_v, "headdim_v")
    block_m = _positive(block_m, "block_m")
    block_n = _positive(block_n, "block_n")
    sram_bytes = _positive(sram_bytes, "sram_bytes")
    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {', '.join(ITEMSIZE)}; got {dtype!r}")
    e = ITEMSIZE[dtype]  # bytes per element of Q, K, V, O, S, P in HBM
    acc = 8 if dtype == "float64" else 4  # bytes per accumulator / LSE element
    bh = batch * nheads
    nq, nk, d, dv = seqlen_q, seqlen_k, headdim, headdim_v

    # Arrays in HBM.
    q = bh * nq * d * e
    k = bh * nk * d * e
    v = bh * nk * dv * e
    o = bh * nq * dv * e
    lse = bh * nq * acc
    score_per_head = nq * nk * e

    # Standard attention, Algorithm 0: S and P each cross HBM twice.
    s = bh * nq * nk * e
    standard_steps = (
        ("read Q, K", q + k),
        ("write S", s),
        ("read S", s),
        ("write P", s),
        ("read P, V", s + v),
        ("write O", o),
    )

    # Tiled attention: K and V are read once per query block (Theorem 2).
    sram_elems = sram_bytes // e
    block_rows = max(1, min(-(-sram_elems // (4 * max(d, dv))), nq))  # no block past the sequence; integer ceil

    query_blocks = -(-nq // block_rows)
    tiled_steps = (
        ("read Q", q),
        (f"read K, V {times(query_blocks)}", query_blocks * (k + v)),
        ("write O, LSE", o + lse),
    )
    kernel_blocks = -(-nq // block_m)
    kernel_bytes = q + kernel_blocks * (k + v) + o + lse

    return IOModel(
        batch=batch, nheads=nheads, seqlen_q=nq, seqlen_k=nk, headdim=d, headdim_v=dv,
        dtype=dtype, itemsize=e, acc_itemsize=acc, block_m=block_m, block_n=block_n,
        sram_bytes=sram_bytes,
        q_bytes=q, k_bytes=k, v_bytes=v, o_bytes=o, lse_bytes=lse,
        q_bytes_per_head=nq * d * e, score_bytes_per_head=score_per_head, score_bytes=s,
        tile_q_bytes=block_m * d * e,
        tile_k_bytes=block_n * d * e,
        tile_v_bytes=block_n * dv * e,
        tile_s_bytes=block_m * block_n * acc,
        tile_o_bytes=block_m * dv * acc,
        tile_stats_bytes=2 * block_m * acc,
        standard_steps=standard_steps,
        sram_elems=sram_elems, block_rows=block_rows, query_blocks=query_blocks,
        tiled_steps=tiled_steps,
        kernel_query_blocks=kernel_blocks, kernel_hbm_bytes=kernel_bytes,
    )


def format_bytes(n: float) -> str:
    """Binary units: ``format_bytes(2**27) == '128 MiB'``; non-whole values get two decimals."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    value, unit = float(n), units[0]
    for u in units[1:]:
        if abs(value) < 1024:
            break
        value, unit = value / 1024, u
    if value == int(value):
        return f"{int(value)} {unit}"
    return f"{value:.2f} {unit}"


def times(n: int) -> str:
    """'once', 'twice', 'n times'."""
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def why_fast(m: IOModel) -> str:
    """One sentence on where the saving comes from, with this problem's numbers."""
    return (
        ("Why it is fast" if m.hbm_ratio >= 1.05 else "Why tiling does not pay at this size") +
        f": standard attention writes the {format_bytes(m.score_bytes)} score matrix "
        f"to HBM and reads it back, twice (S, then P): {format_bytes(m.standard_hbm_bytes)} moved; "
        f"the tiled algorithm keeps each score tile on chip and re-reads only K and V, once per "
        f"block of {m.block_rows} query row{'s' * (m.block_rows != 1)}: {format_bytes(m.tiled_hbm_bytes)}, "
        + ("about as much: at this size there is little score matrix to save." if 0.95 < m.hbm_ratio < 1.05 else
           f"{m.hbm_ratio:.1f}x less." if m.hbm_ratio >= 1 else
           f"{1 / m.hbm_ratio:.1f}x more: " + (
               f"on-chip memory of {m.sram_elems} elements holds only {m.block_rows} query row"
               f"{'s' * (m.block_rows != 1)} a block, so K and V are re-read {times(m.query_blocks)}."
               if m.score_bytes > m.tiled_hbm_bytes / m.query_blocks else
               "at this size the score matrix is small next to K and V re-read per block."))
    )


def ratio(r: float) -> str:
    """A ratio with one decimal from 1 to 10^4 ('1.5x', '12.0x'), else 3 significant digits
    ('0.0159x', '2e+04x'): one decimal would print 0.0x."""
    return f"{r:.1f}x" if 1 <= r < 1e4 else f"{r:.3g}x"


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, backward=False) -> float:
    """FlashAttention benchmark convention: 4·B·H·Sq·Sk·D, halved when causal, ×2.5 for the backward."""
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        f /= 2
    return f * (2.5 if backward else 1.0)
