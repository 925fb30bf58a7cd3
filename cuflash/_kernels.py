"""Find, specialise, compile and cache the CUDA kernels.

Each ``.cu`` file in ``kernels/`` compiles on its own (its ``#ifndef`` defaults); a *variant* is
that file plus ``-D`` options that fix the element type, head-dim bucket, tile shape and feature
switches, and an ``extern "C"`` kernel name that spells all of them
(``cuflash_fwd_bf16_d128_bm128_bn64_w8_softcap``).  The name is the cache key and the profiler
label.  Local ``#include "x.cuh"`` lines are inlined here so that CuPy's on-disk cache, which
hashes only the source text and options, sees every header change.

Block sizes come from one table, :func:`fwd_tile`; tuning changes data there, not kernel code.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ._params import PARAMS_SIZE

HEADDIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPE_TAGS = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
# The attention kernels' tag where it is not the C type (mma.cuh's Elem: float64 is f64_t, the FP64
# tensor-core form of flash_fwd.cu, float32 f32_t its TF32 one).
ATTENTION_TAGS = {"float32": "f32_t", "float64": "f64_t"}
# Bytes per element of the dtypes whose kernels are not 16-bit (shared-memory sizes, chunk counts).
WIDE_ITEMSIZE = {"float32": 4, "float64": 8}


def attention_tag(dtype: str) -> str:
    """CUFLASH_DTYPE of the attention kernels (flash_fwd.cu, flash_bwd.cu, bwd_dsum.cu) for ``dtype``."""
    return ATTENTION_TAGS.get(dtype, DTYPE_TAGS[dtype])
# Forward head-dim buckets the float64 kernel serves (issue 24): all; past d128 it splits O's columns
# over two warps (a d256 double accumulator would be 256 registers a thread: TileConfig.col_split).
F64_FWD_MAX_HEADDIM = 256
# Backward head-dim buckets the float64 / float32 kernels serve: all.  The dK and dV accumulators of
# a dK/dV warp are 2 · D/2 values a thread (256 registers for float64 at d128, for float32 at d256),
# so past d64 / d128 warps split the columns (bwd_variant's col_split).
F64_BWD_MAX_HEADDIM = 256
F32_BWD_MAX_HEADDIM = 256
DEFAULT_SMEM_LIMIT = 227 * 1024  # H100/H200 opt-in limit; A100 has 163 KB, sm_86/89 99 KB
STATIC_SMEM_RESERVE = 512  # bytes the kernels' static shared memory (seqinfo.cuh's flags, page slots) may take


def kernel_dir() -> Path:
    """The folder holding the .cu sources: inside the installed package, or the checkout's kernels/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "flash_fwd.cu").is_file():
            return candidate
    raise FileNotFoundError(f"cuflash kernel sources not found next to {here}")


@functools.lru_cache(maxsize=None)
def read_source(filename: str) -> str:
    """Source text of one kernel file with its local includes inlined (each header once)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        lines = []
        for line in (kernel_dir() / name).read_text().splitlines():
            m = re.match(r'\s*#include\s+"([^"]+)"', line)
            if m:
                if m.group(1) not in seen:
                    seen.add(m.group(1))
                    lines.append(expand(m.group(1)))
            elif line.strip() != "#pragma once":
                lines.append(line)
        return "\n".join(lines)

    return expand(filename)


@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of a kernel file."""

    filename: str
    name: str
    defines: tuple  # ((macro, value), ...)
    threads: int  # a block's threads (the grids' tiles are counted from them)
    smem_bytes: int = 0
    arch: str = ""  # "90a": needs Hopper's arch-specific instructions (wgmma); "" = any sm_80+
    # ((entry suffix, threads), ...): kernels of the module launched with other block sizes (the
    # Hopper backward's producer form: _dkdv_dq with its producer warpgroup beside the consumers)
    entry_threads: tuple = ()

    def threads_of(self, suffix: str = "") -> int:
        """The threads a block of the module's kernel ``<name><suffix>`` is launched with."""
        return dict(self.entry_threads).get(suffix, self.threads)

    def options(self) -> tuple:
        defs = [f"-D{k}={v}" for k, v in self.defines]
        # CuPy appends its own -arch=sm_90 on Hopper; NVRTC >= 12.9 then builds sm_90a (docs: cupy.md).
        arch = (f"-arch=sm_{self.arch}",) if self.arch else ()
        return ("--std=c++17", f"-DCUFLASH_PARAMS_SIZE={PARAMS_SIZE}", f"-DCUFLASH_KERNEL_NAME={self.name}", *defs, *arch)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per thread block
    block_n: int  # keys per inner-loop tile
    warps: int  # query rows per warp = block_m / warps (16 or 32; col_split warps share them); split-KV: warps splitting each tile's keys
    min_blocks: int = 1  # blocks per SM the register allocation must allow
    q_in_regs: bool = True  # keep Q fragments in registers (else re-read from shared memory)
    row_pad: int = 8  # elements of padding per shared-memory row: 16 or 32 bytes (kernels/flash_fwd.cu)
    itemsize: int = 2  # bytes per element: 2, or 4/8 (float32/float64)
    col_split: int = 1  # warps sharing each 16-row slab, each with its share of O's columns (float64 past d128)
    tf32_chains: tuple = (3, 3)  # float32 3xTF32 steps of S and of P V: 3 products in one accumulator chain, or 2 chains (warp_gemm.cuh)
    share_s: bool = False  # col_split 2: each warp of a slab forms half of S's keys, swapped through shared memory (flash_fwd.cu)

    def smem_bytes(self, headdim: int) -> int:
        # Q (block_m rows) + K and V (block_n rows each), rows padded by row_pad elements (float64's
        # V rows by 16 bytes: flash_fwd.cu's kStrideV).
        # share_s: S itself, block_m x block_n elements.
        v_pad = 16 // self.itemsize if self.itemsize == 8 else self.row_pad
        rows = (self.block_m + self.block_n) * (headdim + self.row_pad) + self.block_n * (headdim + v_pad)
        return (rows + self.share_s * self.block_m * self.block_n) * self.itemsize


def headdim_bucket(headdim: int) -> int:
    for b in HEADDIM_BUCKETS:
        if headdim <= b:
            return b
    raise ValueError(f"head dim {headdim} is larger than the largest supported, {HEADDIM_BUCKETS[-1]}")


def fwd_tile(headdim: int, smem_limit: int = DEFAULT_SMEM_LIMIT, dtype: str = "float16") -> TileConfig:
    """Forward block sizes per head-dim bucket.

    Measured on the H200 with scripts/tune_fwd.py (bf16, seqlen 4k; see docs/perf-notes.md):
    d64 128x64, 8 warps, 2 blocks/SM: 185 TF/s; d128 64x128, 4 warps, 2 blocks/SM: 197;
    d256 128x64, 8 warps, Q re-read from shared memory: 194.  float64: Q read from shared memory
    (its fragments would take 2·D/4 registers), Q and K rows padded by 32 bytes (V's by 16); to d64 64 rows x 32 keys
    (23 TF/s, seqlen 4k, session 24), to d128 128 x 16 with 8 warps (23 non-causal, 21 causal; 64 x
    32 spilled 224 bytes: 14), 64 x 16 where 169 KB do not fit (the A100: 163), 32 x 16 on GPUs of
    99 KB (sm_86/89); past d128 two warps share each 16-row slab (col_split, each with half of O's
    columns, and since session 29 each forming half of S, share_s): 64 x 32 with 8 warps where it
    fits (d160/d192: 31/33 TF/s against 64 x 16's 24/26), else 64 x 16.  float32 likewise: 64 x 32
    to d160 and at d224 (3xTF32, seqlen 4k, session 23: d128 39 TF/s non-causal, 36 causal, 64 x 64 32 and 25
    spilling 32 bytes; session 28, d64: 50 against 64 x 64's 45), at d192 and d256 64 x 32 with 8 warps, O's
    columns over two and S shared (d256 43 against 64 x 16's 38 with it, 27 before it; d192 40/38
    non-causal/causal against 4 warps' 39/35, session 31), smaller where shared memory is short.  float64's V rows are padded by 16 bytes (TileConfig.smem_bytes).
    float32's 3xTF32 steps run as two chains of products (tf32_chains, S's and P V's) where that
    measured faster (session 29, seqlen 4k, one A/B of every form): S and P V at d128 (+10 %) and
    d256 (64 x 32: (2, 3) spilled 72 bytes), S alone at d160 (+9 %); at d64 and d96 either was
    0-9 % slower, and three chains stay; d192's column split takes (2, 2) (session 31: (2, 3) spilled).
    """
    limit = smem_limit - STATIC_SMEM_RESERVE  # the dynamic bytes must leave room for the static ones
    if dtype in WIDE_ITEMSIZE:  # 4-element row pad: the operands' loads spread over the banks
        item = WIDE_ITEMSIZE[dtype]
        # Column splits: float64 past d128 (its O: D/2 doubles a thread without one), float32 at d256
        # (O's 128 registers left one 4-warp block an SM: 23 TF/s against 27 with 8 warps, session 28)
        # and d192 (S shared, (2, 2) chains: 40 / 38 TF/s non-causal / causal against 39 / 35, session 31).
        split = 2 if (item == 8 and headdim > 128) or headdim > 224 or (item == 4 and 160 < headdim <= 192) else 1
        if split == 2:  # (32 keys where they fit: float64 d160/d192 31/33 TF/s against 16 keys' 24/26, float32 d256 43 against 38, session 29)
            shapes = ((64, 32, 8), (64, 16, 8), (32, 16, 4), (16, 16, 2))
        elif item == 8:  # (past d64 the 32-key tiles spill 224 bytes: 14 TF/s against 16 keys' 21-23, session 24)
            shapes = ((64, 32, 4), (32, 16, 2)) if headdim <= 64 else ((128, 16, 8), (64, 16, 4), (32, 16, 2))
        else:  # (d64: 32 keys 47-50 TF/s against 64 keys' 42-45, which spilled 88 bytes; session 28)
            shapes = ((64, 32, 4), (32, 32, 2))
        chains = {128: (2, 2), 160: (2, 3), 192: (2, 2), 256: (2, 2)}.get(headdim, (3, 3)) if item == 4 else (3, 3)
        # A column split's warps share S (f13) where its bytes fit beside the shape; else (float64 d256
        # with 99 KB) each forms all of it.  (A larger shape without it before a smaller one with it.)
        tiles = [TileConfig(bm, bn, w, q_in_regs=False, row_pad=4, itemsize=item, col_split=split, tf32_chains=chains,
                            share_s=share) for bm, bn, w in shapes for share in ((True, False) if split == 2 else (False,))]
        # (their static shared memory: seqinfo.cuh's 256 bytes and the paged caches' page slots, 16 a key)
        return next((t for t in tiles if t.smem_bytes(headdim) + 256 + 16 * t.block_n <= smem_limit), tiles[-1])
    if headdim <= 64:
        cfg = TileConfig(128, 64, 8, min_blocks=2)
    elif headdim <= 128:
        cfg = TileConfig(64, 128, 4, min_blocks=2)
    else:
        cfg = TileConfig(128, 64, 8, q_in_regs=False)
    if cfg.smem_bytes(headdim) > limit:
        cfg = TileConfig(64, 64, 4, q_in_regs=headdim <= 128)
    if cfg.smem_bytes(headdim) > limit:
        cfg = TileConfig(64, 32, 4, q_in_regs=headdim <= 128)
    return cfg


def decode_tile(headdim: int) -> TileConfig:
    """Split-KV (decode) block sizes, for contiguous and paged caches alike: 16 query rows,
    since decoding has few rows (GQA heads packed in); warps that split the keys of each tile
    (16 or 32 each) with Q read from shared memory, so that registers allow four blocks per SM;
    rows padded by 32 bytes, which keeps the K/V copies' sector requests whole
    (docs/perf-notes.md, d5 and d7)."""
    block_n = 128 if headdim <= 64 else 64 if headdim <= 128 else 32
    return TileConfig(16, block_n, min(4, block_n // 16), min_blocks=4, q_in_regs=False, row_pad=16)


# CUFLASH_MODS of the forward kernels: 0 none, 1 bias and mask, 2 those and dropout (a switch of its
# own: its generator's registers made the bias/mask kernels spill, perf-notes m1).
_MODS_SUFFIX = {0: "", 1: "_mods", 2: "_modsdrop"}


def _mods_form(dtype: str, mods: int) -> int:
    """The CUFLASH_MODS a call's ``mods`` runs: float32/float64 have one modifier form, 2, which
    skips the dropout generator at run time for calls without dropout (ScoreMods::dropout_on), so
    that their variants, already multiplied by precision and dQ scheme, do not double again."""
    return 2 if mods and dtype in WIDE_ITEMSIZE else mods


def _score_form(dtype: str, mods: int, softcap: bool, alibi: bool) -> tuple:
    """(name part, defines) of a variant's softcap and ALiBi.  The float32/float64 modifier form
    with either is one ``_switched`` variant built with both, which the call's values switch on and
    off (CUFLASH_SCORE_SWITCHES, seqinfo.cuh: a softcap of 0 and null slopes are off): one build of
    CI's compile check (for two architectures) instead of three.  Every other variant, and that
    form without either, has them on or off at compile time: the switches' per-score branches
    cost bias calls 6-34 % (perf-notes f10)."""
    if mods and dtype in WIDE_ITEMSIZE and (softcap or alibi):
        return "_switched", (("CUFLASH_SOFTCAP", 1), ("CUFLASH_ALIBI", 1), ("CUFLASH_SCORE_SWITCHES", 1))
    return "_softcap" * softcap + "_alibi" * alibi, (("CUFLASH_SOFTCAP", int(softcap)), ("CUFLASH_ALIBI", int(alibi)))


def _raw_applies(raw: bool, mods: int, softcap: bool, alibi: bool) -> bool:
    """CUFLASH_MODS_RAW: a forward with modifiers but no bias keeps raw q.k scores (the plain
    kernels' one FFMA per exponential; softmax_tile.cuh), where softcap and ALiBi do not change them
    (perf-notes m4: a run-time branch between the two forms cost 9-16 %, so it is a variant)."""
    return bool(raw and mods and not softcap and not alibi)


@functools.lru_cache(maxsize=None)
def _f64_exp2(dtype: str, headdim: int, *, backward: bool) -> tuple:
    """The define of float64's exp2 form (CUFLASH_F64_EXP2, kernels/mma.cuh), none for other dtypes.
    Measured (perf-notes f20, session 32): the forward by CUDA's exp2 (0) at d64, where the polynomial
    measured 0.92x by Horner and 0.95x by Estrin, and by Horner (1) past it, 1.03-1.06x (d256 1.00);
    the backward's P by Estrin (2), 1.01-1.11x Horner's."""
    if dtype != "float64":
        return ()
    return (("CUFLASH_F64_EXP2", 2 if backward else 0 if headdim <= 64 else 1),)


def fwd_variant(dtype: str, headdim: int, *, softcap: bool, alibi: bool, splitkv: bool = False, mods: int = 0,
                smem_limit: int = DEFAULT_SMEM_LIMIT, tf32: bool = False) -> Variant:
    """The forward kernel for q/k/v of ``dtype`` whose head dims fit bucket ``headdim``.

    ``splitkv`` selects the decode variant (split key range merged by the last block of each
    row group, paged K/V, GQA packing); ``mods`` 1 the additive bias and boolean mask of the score
    pipeline (softmax_tile.cuh, ScoreMods), 2 those and dropout (float32/float64: 2 for both,
    :func:`_mods_form`).  ``tf32`` (float32): single TF32
    products (precision="tf32") instead of 3xTF32.  (No raw-score form: only the
    Hopper forward has _raw variants, sm90_fwd_variant, so that CI's compile check of every variant
    stays within its time; each sm_80-family variant builds for two architectures.)
    """
    d = headdim_bucket(headdim)
    mods = _mods_form(dtype, mods)
    score_name, score_defines = _score_form(dtype, mods, softcap, alibi)
    t = decode_tile(d) if splitkv else fwd_tile(d, smem_limit, dtype)
    name = f"cuflash_fwd_{_SHORT[dtype]}_d{d}_bm{t.block_m}_bn{t.block_n}_w{t.warps}_mb{t.min_blocks}"
    name += "_qsmem" * (not t.q_in_regs) + score_name + "_splitkv" * splitkv + _MODS_SUFFIX[mods]
    name += "_tf32" * tf32 + f"_cs{t.col_split}" * (t.col_split > 1)
    chains = (3, 3) if tf32 else t.tf32_chains  # (single TF32 products have no chains)
    name += "_ch{}{}".format(*chains) * (chains != (3, 3)) + "_sh" * t.share_s
    defines = (
        ("CUFLASH_DTYPE", attention_tag(dtype)), ("CUFLASH_HEADDIM", d), ("CUFLASH_BLOCK_M", t.block_m),
        ("CUFLASH_BLOCK_N", t.block_n), ("CUFLASH_WARPS", t.warps), ("CUFLASH_MIN_BLOCKS", t.min_blocks),
        ("CUFLASH_Q_IN_REGS", int(t.q_in_regs)), *score_defines,
        ("CUFLASH_SPLITKV", int(splitkv)), ("CUFLASH_ROW_PAD", t.row_pad), ("CUFLASH_MODS", mods),
        ("CUFLASH_TF32_TERMS", 1 if tf32 else 3), ("CUFLASH_SLAB_WARPS", t.col_split),
        ("CUFLASH_TF32_CHAINS_ABT", chains[0]), ("CUFLASH_TF32_CHAINS_CB", chains[1]), ("CUFLASH_SHARE_S", int(t.share_s)),
    ) + _f64_exp2(dtype, d, backward=False)
    return Variant("flash_fwd.cu", name, defines, 32 * t.warps, t.smem_bytes(d))


def sm90_applies(compute_capability: str, nvrtc_version) -> bool:
    """Whether the wgmma (sm_90a) kernels can run: compute capability exactly 9.0 (sm_90a code
    runs on no other GPU) and an NVRTC of 12.9 or newer (older ones reject CuPy's second -arch)."""
    return compute_capability == "90" and nvrtc_version is not None and tuple(nvrtc_version) >= (12, 9)


def sm90_disabled() -> bool:
    """CUFLASH_DISABLE_SM90 set (to anything but 0): use the sm_80 kernels on Hopper too."""
    return os.environ.get("CUFLASH_DISABLE_SM90", "") not in ("", "0")


# Hopper forward (flash_fwd_sm90.cu, warp-specialised; issue 21): head-dim bucket -> (keys per
# tile, stages of the K and V rings, consumer warpgroups of 64 query rows), one block per SM.
# Keys per tile: any multiple of 16 with a wgmma shape in wgmma.cuh (64, 80, 96, 128, 176: FA3
# uses 176 at d128 and 80 at d256); three consumers (192 query rows) as FA3 at d64 fit from 160
# registers per thread.  `scripts/tune_fwd.py --sm90 BNxSTAGESxCONSUMERS` compares others.
# Measured: docs/perf-notes.md, h7 and h15 (d256: 80 keys 4-12 % over 64 since the uniform
# descriptors; its K/V ring then fills shared memory, so O is staged in sQ).
SM90_FWD_TILES = {64: (128, 2, 2), 128: (128, 2, 2), 192: (96, 2, 2), 256: (80, 2, 2)}
# Keys per tile where a score modifier (softcap, ALiBi, bias, masks, dropout) takes registers:
# d256's 80-key tile then spills 44-240 bytes (NVRTC 13.0), its 64-key tile none.
SM90_FWD_MODS_BLOCK_N = {256: 64}
# Tiles for rows of SM90_FWD_LONG_ROWS queries or more, without score modifiers: d64's three
# consumers (192 rows, FA3's d64 shape) gain 3-7 % at 16k rows, tie at 2k-4k and lose 7-9 % at 1k
# (docs/perf-notes.md h15), where the 128-row tile wastes less of the last block.
SM90_FWD_LONG_TILES = {64: (96, 2, 3)}
SM90_FWD_LONG_ROWS = 8192
# Head dims up to 32 (MiniLM's) keep the sm_80 forward until a measurement says the 64 tile,
# half of it zeros, is faster.
SM90_FWD_MIN_HEADDIM = 33


@functools.lru_cache(maxsize=None)
def sm90_fwd_variant(dtype: str, headdim: int, *, softcap: bool, alibi: bool, overlap: bool = True,
                     mods: int = 0, raw: bool = False, long_rows: bool = False) -> Variant | None:
    """The warp-specialised wgmma forward (TMA producer warp, consumer warpgroups taking turns;
    with ``overlap`` the next tile's S is issued with the current P V) for ``headdim``: the
    smallest entry of SM90_FWD_TILES that holds it (the copy engine fills the columns past the
    arrays' head dims with zeros, so 96 runs the 128 kernel), or None below
    SM90_FWD_MIN_HEADDIM, where flash_fwd.cu serves.  ``long_rows`` (max_seqlen_q of at least
    SM90_FWD_LONG_ROWS) takes the bucket's SM90_FWD_LONG_TILES entry where it has one."""
    d = min((t for t in SM90_FWD_TILES if t >= headdim), default=None)
    if headdim < SM90_FWD_MIN_HEADDIM or d is None:
        return None
    plain = not (mods or softcap or alibi)
    block_n, stages, consumers = SM90_FWD_LONG_TILES[d] if long_rows and plain and d in SM90_FWD_LONG_TILES else SM90_FWD_TILES[d]
    if not plain:
        block_n = min(block_n, SM90_FWD_MODS_BLOCK_N.get(d, block_n))
    block_m = 64 * consumers
    # Q, the K and V stages, 1 KB for the alignment; and O's staging buffer where it fits (else O
    # is staged in sQ, which the next tile's Q then waits for).
    smem = (block_m + 2 * stages * block_n) * d * 2 + 1024
    separate_o = smem + block_m * d * 2 + STATIC_SMEM_RESERVE <= DEFAULT_SMEM_LIMIT
    smem += block_m * d * 2 * separate_o
    raw = _raw_applies(raw, mods, softcap, alibi)
    name = (f"cuflash_fwd_sm90_{_SHORT[dtype]}_d{d}_bm{block_m}_bn{block_n}_st{stages}" + "_softcap" * softcap
            + "_alibi" * alibi + "_nooverlap" * (not overlap) + _MODS_SUFFIX[mods] + "_raw" * raw)
    defines = (
        ("CUFLASH_DTYPE", DTYPE_TAGS[dtype]), ("CUFLASH_HEADDIM", d), ("CUFLASH_BLOCK_N", block_n),
        ("CUFLASH_STAGES", stages), ("CUFLASH_CONSUMERS", consumers), ("CUFLASH_SOFTCAP", int(softcap)),
        ("CUFLASH_ALIBI", int(alibi)), ("CUFLASH_BLOCK_M", block_m), ("CUFLASH_OVERLAP", int(overlap)),
        ("CUFLASH_SEPARATE_O", int(separate_o)), ("CUFLASH_MODS", mods), ("CUFLASH_MODS_RAW", int(raw)),
    )
    return Variant("flash_fwd_sm90.cu", name, defines, 128 * (1 + consumers), smem, arch="90a")


def sm90_persistent() -> bool:
    """The Hopper forward's grid: one block per SM, each taking its next tile from a counter (the
    tile's loads then overlap the previous tile's last product and epilogue), unless
    CUFLASH_SM90_PERSISTENT=0 asks for one block per tile (the A/B switch of docs/perf-notes.md
    h10 and h11, not a setting for users)."""
    return os.environ.get("CUFLASH_SM90_PERSISTENT", "") != "0"


def sm90_overlap() -> bool:
    """CUFLASH_SM90_OVERLAP=0 runs the Hopper forward without its intra-warpgroup overlap (each
    product waited for at once): the ablation of docs/perf-notes.md h7, not a setting for users."""
    return os.environ.get("CUFLASH_SM90_OVERLAP", "") != "0"


def sm90_ordered_dq() -> bool:
    """CUFLASH_SM90_ORDERED_DQ=1 runs ``deterministic=True`` at head dims up to 64 on the Hopper
    backward's one-pass kernel with dQ's additions in a fixed order too (flash_bwd_sm90.cu's
    kDqOrdered, docs/perf-notes.md b16), as every larger head dim does, instead of the _dq + _dkdv
    pair, which is faster there (b16's measurement): the switch for measuring that form at d64, not
    a setting for users."""
    return os.environ.get("CUFLASH_SM90_ORDERED_DQ", "") not in ("", "0")


# Hopper backward (flash_bwd_sm90.cu): head-dim bucket -> (rows of the inner-loop tiles, warpgroups
# of 64 rows, blocks per SM the registers must allow).  The bucket 96 runs the 128 kernel (zero-padded
# columns).  Head dim 256 (and the buckets 160-224,
# zero-padded to it): the two warpgroups of a _dkdv_dq block share 64 key rows and split the
# columns of dK and dV, which do not fit in one warpgroup's registers (CUFLASH_COL_SPLIT,
# perf-notes b5).  Measured: docs/perf-notes.md, h2.
SM90_BWD_TILES = {64: (64, 1, 3), 128: (64, 2, 1), 256: (64, 2, 1)}
# ... with a producer warpgroup (flash_bwd_sm90.cu's CUFLASH_PRODUCER; sm90_bwd_variant says where):
# d64's 128 keys a block, each consumer adding its keys' part of the whole dQ tile
SM90_BWD_PRODUCER_TILES = {64: (64, 2, 1), 128: (64, 2, 1)}


@functools.lru_cache(maxsize=None)
def sm90_bwd_variant(dtype: str, headdim: int, *, softcap: bool, alibi: bool,
                     deterministic: bool = False, mods: int = 0, ordered: bool = False) -> Variant | None:
    """The wgmma backward kernels for ``headdim``'s bucket: ``<name>_dkdv_dq`` +
    ``<name>_dq_convert`` (fp32 dQ added by the copy engine), or with ``deterministic`` ``<name>_dq`` +
    ``<name>_dkdv`` (a module of their own, so a first call compiles only what it launches; the
    D pre-pass is :func:`dsum_variant`), or None where only flash_bwd.cu serves.  With
    ``deterministic`` above the bucket 64, and at 64 too with ``ordered`` (:func:`sm90_ordered_dq`):
    ``_dkdv_dq`` + ``_dq_convert`` with dQ's additions in a fixed order (CUFLASH_DQ_ORDER, names
    ending ``_ord``)."""
    d = headdim_bucket(headdim)
    if d > 128:
        d = 256  # (the columns past the head dim are zero in the tiles)
    elif d > 64:
        d = 128  # (65-96 too: padded, it ran 2x the sm_80 kernel's 137-140 TF/s, perf-notes b6)
    # deterministic=True: dQ's additions in a fixed order above the bucket 64 (b16, H200, bf16/fp16:
    # 0.90-1.00 of the default at d96/d128 where _dq + _dkdv ran 0.74-0.78, 0.68-0.77 at d192/d256
    # where flash_bwd.cu ran 0.22-0.46); at 64 the pair (0.79-0.87; the ordered form 0.79-0.82)
    ordered = deterministic and (ordered or d > 64)
    split = deterministic and not ordered  # (_dq + _dkdv)
    if d not in SM90_BWD_TILES:
        return None
    # _dkdv_dq with a producer warpgroup (Q/dO copies and the dQ reductions off the consumers,
    # perf-notes b13, b15): one block an SM, 384 threads; not with bias/mask/dropout, whose
    # consumers spilled 464-1204 bytes at its 240 registers (d128; 140-348 at 255 without it)
    producer = d in SM90_BWD_PRODUCER_TILES and not split and not mods
    inner, wgs, min_blocks = (SM90_BWD_PRODUCER_TILES if producer else SM90_BWD_TILES)[d]
    if mods:  # (bias/mask/dropout at d64: three blocks' 168 registers spilled 64-152 bytes, two blocks' 255 none)
        min_blocks = min(min_blocks, 2)
    col_split = d > 128
    name = (f"cuflash_bwd_sm90_{_SHORT[dtype]}_d{d}_wg{wgs}_in{inner}_mb{min_blocks}" + "_softcap" * softcap
            + "_alibi" * alibi + "_det" * split + _MODS_SUFFIX[mods] + "_p" * producer + "_ord" * ordered)
    defines = (
        ("CUFLASH_DTYPE", DTYPE_TAGS[dtype]), ("CUFLASH_HEADDIM", d), ("CUFLASH_INNER", inner),
        ("CUFLASH_WARPGROUPS", wgs), ("CUFLASH_MIN_BLOCKS", min_blocks), ("CUFLASH_SOFTCAP", int(softcap)),
        ("CUFLASH_ALIBI", int(alibi)), ("CUFLASH_DETERMINISTIC", int(split)), ("CUFLASH_DQ_ORDER", int(ordered)),
        ("CUFLASH_COL_SPLIT", int(col_split)), ("CUFLASH_MODS", mods), ("CUFLASH_PRODUCER", int(producer)),
    )
    # The largest kernel: 64 * wgs outer rows (Q and dO in _dq, K and V in _dkdv; 64 with the
    # column split), two stages of two inner tiles, LSE and D of the _dkdv stages, the dS tile of
    # _dkdv_dq (two with the producer), its fp32 dQ panels (a warpgroup's share of the columns, or at
    # least 64 of them: d64 with two warpgroups; not with the column split: staged in the Q and dO
    # tiles; there the Pᵀ tile instead), 1 KB for the 1024-byte alignment.
    outer = 64 if col_split else 64 * wgs
    smem = ((2 * outer + 4 * inner) * d * 2 + 4 * inner * 4 + (1 + col_split + producer) * outer * inner * 2 + 1024
            + (not split and not col_split) * wgs * inner * max(64, d // wgs) * 4)
    # (the producer warpgroup comes first in _dkdv_dq's block: CUFLASH_PRODUCER; _dq_convert has none)
    return Variant("flash_bwd_sm90.cu", name, defines, 128 * wgs, smem, arch="90a",
                   entry_threads=(("_dkdv_dq", 128 * wgs + 128),) if producer else ())


def dq_accum_copies(variant: Variant) -> int:
    """Copies of dq_accum a backward variant adds dQ into (sm90_bwd_epilogue.cuh's dq_accum_copies):
    2 for the Hopper kernel whose two consumers each form a whole dQ tile over their own keys (d64's
    producer form) with dQ's additions ordered, one copy per consumer, summed by _dq_convert; else 1."""
    defs = dict(variant.defines)
    ordered, split = defs.get("CUFLASH_DQ_ORDER", 0), defs.get("CUFLASH_COL_SPLIT", 0)
    wgs = defs.get("CUFLASH_WARPGROUPS", 1)
    return 2 if variant.filename == "flash_bwd_sm90.cu" and ordered and not split and defs["CUFLASH_HEADDIM"] // wgs < 64 else 1


def bwd_warps(headdim: int, smem_limit: int = DEFAULT_SMEM_LIMIT) -> int:
    """Warps of the backward kernels; each owns 16 query rows (dq) or key rows (dkdv)."""
    for warps in (4, 2):
        if bwd_smem_bytes(headdim, warps) + STATIC_SMEM_RESERVE <= smem_limit:
            return warps
    return 1


def bwd_smem_bytes(headdim: int, warps: int, itemsize: int = 2, query_rows: int = 0) -> int:
    # Four (16 warps, headdim) tiles padded by 16 bytes (by 4 elements for float32/float64: their
    # 32- and 64-bit loads), plus LSE and D of one query tile (float64's in float64); ``query_rows``
    # (the atomic-dQ dK/dV kernel's CUFLASH_QUERY_TILE) rows of Q and dO instead of 16 warps.
    rows = 16 * warps
    queries = query_rows or rows
    pad = 8 if itemsize == 2 else 4
    return 2 * (rows + queries) * (headdim + pad) * itemsize + 2 * queries * max(4, itemsize)


def wide_bwd_schemes(dtype: str, headdim: int, smem_limit: int = DEFAULT_SMEM_LIMIT) -> tuple:
    """The dQ schemes of the float32/float64 backward at this head dim: (True,) the ordered dQ
    kernel only, or (True, False) with the atomic one, where its dS tile fits ``smem_limit``."""
    atomic = bwd_variant(dtype, headdim, softcap=False, alibi=False, smem_limit=smem_limit, deterministic=False)
    return (True, False) if atomic.smem_bytes + STATIC_SMEM_RESERVE <= smem_limit else (True,)


@functools.lru_cache(maxsize=None)
def wide_bwd_max_headdim(dtype: str, smem_limit: int = DEFAULT_SMEM_LIMIT) -> int:
    """The largest head-dim bucket of the float32/float64 backward whose variant fits ``smem_limit``
    bytes of shared memory a block (float64 stops at d192 on 99 KB GPUs, sm_86/89: a d224 slab
    takes 116 KB)."""
    top = F64_BWD_MAX_HEADDIM if dtype == "float64" else F32_BWD_MAX_HEADDIM
    return max(d for d in HEADDIM_BUCKETS if d <= top and bwd_variant(
        dtype, d, softcap=False, alibi=False, smem_limit=smem_limit).smem_bytes + STATIC_SMEM_RESERVE <= smem_limit)


@functools.lru_cache(maxsize=None)
def dsum_variant(dtype: str) -> Variant:
    """The backward's pre-pass D = rowsum(dO * O) (kernels/bwd_dsum.cu), for every backward kernel."""
    return Variant("bwd_dsum.cu", f"cuflash_bwd_dsum_{_SHORT[dtype]}", (("CUFLASH_DTYPE", attention_tag(dtype)),),
                   256)


@functools.lru_cache(maxsize=None)
def bwd_variant(dtype: str, headdim: int, *, softcap: bool, alibi: bool, mods: int = 0,
                smem_limit: int = DEFAULT_SMEM_LIMIT, tf32: bool = False, deterministic: bool = True,
                split_s: bool = True) -> Variant:
    """The backward kernels (``<name>_dq``, ``<name>_dkdv``) for one problem kind; ``mods`` as
    :func:`fwd_variant`'s (1 bias and mask, with the bias gradient; 2 and dropout; float32/float64
    one form, :func:`_mods_form`); ``tf32``
    (float32) single TF32 products instead of 3xTF32; ``deterministic=False`` (float32/float64
    only) ``<name>_dkdv_dq`` + ``<name>_dq_convert`` instead: dQ added atomically to a dq_accum in
    the dtype, one dS tile (query tile x (kT + 4)) more of shared memory.  float32/float64 run two 16-row slabs (32-row
    tiles; one where shared memory is short, or past 8 warps: their accumulators take 2-4 times the
    registers of the 16-bit ones), each slab one warp, or several that split the output's columns
    (col_split; each recomputes the slab's S and dP, or with atomic dQ forms them over its own columns
    and the slab sums them through shared memory, ``_ss``, where that buffer fits: ``split_s``).  With
    atomic dQ and no column split, 64 keys of 4 warps share 32-query tiles where 4 warps fit
    (``_q32``); float64 d128 and d192 with atomic dQ, 8 warps in slabs of 2 or 4 share 16-query
    tiles (``_q16``).  (perf-notes f9, f14.)"""
    d = headdim_bucket(headdim)
    mods = _mods_form(dtype, mods)
    score_name, score_defines = _score_form(dtype, mods, softcap, alibi)
    itemsize = WIDE_ITEMSIZE.get(dtype, 2)

    def ds_tile(rows, keys=None):  # atomic dQ: the (query rows, keys + 4) dS tile of flash_bwd.cu's _dkdv_dq
        return 0 if deterministic else rows * ((keys or rows) + 4) * itemsize

    def parts(warps, rows, keys):  # atomic dQ with a column split: the warps' partial S/dP tiles and P^T (CUFLASH_SPLIT_S)
        return (warps * 2 * 16 * rows + rows * (keys + 4)) * itemsize if split_s else 0

    # float64 past d64 and float32 past d128: several warps per 16-row slab, each with its share of
    # the output's columns (flash_bwd.cu's kColSplit: dK and dV would not fit in registers), each
    # recomputing the slab's S and dP.  float64 d128 in 2 warps spills 620 bytes and in 4 16, yet 2
    # ran faster (8 against 7 TF/s, seqlen 4k, session 24); float32 d256 in 2 spilled 476 bytes and
    # ran 4 TF/s, in 4 68 bytes and 5.  A warp's columns are whole 8-column tiles: float64 d192
    # and d256 in 8 warps (24 and 32 columns each, no spill), d160 and d224 in 4 (spilling 200-520 bytes).
    if itemsize == 8:
        col_split = 1 if d <= 64 else 2 if d <= 128 else 8 if d % 64 == 0 else 4
    else:
        col_split = 1 if itemsize == 2 or d <= 128 else 4
    # Atomic dQ with a column split: each warp of a slab forms S and dP over its own columns and
    # the slab sums them through shared memory (flash_bwd.cu's sum_over_slab_warps, perf-notes f9),
    # where that buffer fits; else each warp forms them whole.  Not at float64 d96, where the buffer
    # halves the blocks an SM (2 -> 1 on the H200: 0.91x, session 26; float64 d128-d256 1.25-1.88x,
    # float32 d160-d256 1.9-3.3x).
    # float64 with atomic dQ and the slab-summed S/dP, a column split of 2 or 4 and head dims whose dQ
    # columns make whole 8-column tiles over 8 warps: 8 warps, 8 / col_split slabs of keys sharing
    # 16-query tiles, where that fits (perf-notes f14): d128 (1.30x against 2 slabs of 16 keys sharing
    # 32-query tiles) and d192, whose split drops from 8 to 4 for it (1.76x; d256's form does not fit).
    def q16_fits(cs):
        return (split_s and not deterministic and itemsize == 8 and cs in (2, 4) and d % 64 == 0
                and bwd_smem_bytes(d, 8 // cs, itemsize, query_rows=16) + ds_tile(16, 16 * (8 // cs))
                + parts(8, 16, 16 * (8 // cs)) + STATIC_SMEM_RESERVE <= smem_limit)
    if col_split == 8 and q16_fits(4):
        col_split = 4
    q16 = q16_fits(col_split)
    split_s = split_s and not deterministic and col_split > 1 and (q16 or not (itemsize == 8 and d <= 96))
    query_tile = 0  # (0: the dK/dV kernel's query tile is its key rows)
    if itemsize == 2:
        warps = bwd_warps(d, smem_limit)
    elif not deterministic and itemsize == 4 and d == 128 and (
            2 * (bwd_smem_bytes(d, 4, itemsize, query_rows=32) + ds_tile(32, 64) + STATIC_SMEM_RESERVE) <= smem_limit):
        # atomic dQ: 64 keys of 4 warps sharing 32-query tiles (flash_bwd.cu's BwdShape::kQT), at float32
        # d128 (1.41x on the H200, session 26; float32 d64 0.87x and d96 0.95x, float64 d64 0.98x: off there)
        # where two such blocks share an SM (8 warps; with one, the 2-warp form's 2-3 blocks hold as many)
        warps, query_tile = 4, 32
    elif q16:
        # e.g. float64 d128: 4 slabs of 2 warps, 64 keys sharing 16-query tiles (211 KB).  The 2-slab
        # form's one 177 KB block left each scheduler a single warp (ncu: 85 % of the issue slots
        # empty, 45 % of the stalls on fixed-latency dependencies); this one has two, half the Q/dO
        # copies and dQ atomics a key, and 16 x 16 S/dP tiles a warp.
        warps, query_tile = 8, 16
    else:  # 2 slabs of 16 rows, 1 where shared memory is short (99 KB GPUs)
        two = col_split <= 4 and (bwd_smem_bytes(d, 2, itemsize) + ds_tile(32) + parts(2 * col_split, 32, 32)
                                   + STATIC_SMEM_RESERVE <= smem_limit)  # (8 warps at most: 255 registers)
        warps = col_split * (2 if two else 1)
    name = f"cuflash_bwd_{_SHORT[dtype]}_d{d}_w{warps}" + score_name + _MODS_SUFFIX[mods]
    name += ("_tf32" * tf32 + f"_cs{col_split}" * (col_split > 1) + f"_q{query_tile}" * bool(query_tile) + "_ss" * split_s
             + "_adq" * (not deterministic))
    defines = (
        ("CUFLASH_DTYPE", attention_tag(dtype)), ("CUFLASH_HEADDIM", d), ("CUFLASH_WARPS", warps),
        *score_defines, ("CUFLASH_MODS", mods),
        ("CUFLASH_TF32_TERMS", 1 if tf32 else 3), ("CUFLASH_SLAB_WARPS", col_split),
    ) + _f64_exp2(dtype, d, backward=True)
    slabs = warps // col_split
    smem = bwd_smem_bytes(d, slabs, itemsize, query_rows=query_tile)
    if not deterministic:
        assert itemsize > 2, "atomic dQ in flash_bwd.cu: float32/float64 (16-bit: flash_bwd_sm90.cu)"
        defines += (("CUFLASH_DETERMINISTIC", 0),) + ((("CUFLASH_QUERY_TILE", query_tile),) if query_tile else ())
        defines += (("CUFLASH_SPLIT_S", 1),) if split_s else ()
        smem += ds_tile(query_tile or 16 * slabs, 16 * slabs) + parts(warps, query_tile or 16 * slabs, 16 * slabs)
    if split_s and smem + STATIC_SMEM_RESERVE > smem_limit:
        return bwd_variant(dtype, headdim, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit, tf32=tf32,
                           deterministic=deterministic, split_s=False)
    return Variant("flash_bwd.cu", name, defines, 32 * warps, smem)


@functools.lru_cache(maxsize=None)
def softmax_variant(dtype: str) -> Variant:
    return Variant("softmax.cu", f"cuflash_softmax_{_SHORT[dtype]}", (("CUFLASH_DTYPE", DTYPE_TAGS[dtype]),), 256)


@functools.lru_cache(maxsize=None)
def varlen_tail_variant() -> Variant:
    """The packed rows no well-formed sequence owns (any dtype: FlashParams::elem_bytes): ``cuflash_varlen_tail``
    (out = 0 and lse = -inf past cu_seqlens_q[-1], NaN where the offsets are malformed or a
    sequence outgrows max_seqlen_q or its keys max_seqlen_k) and ``..._grads`` (NaN in dq, dk, dv:
    the backward's); both publish the first bad entry of each cu_seqlens for the attention kernels
    launched after them, and with max_seqlen_* = 0 the forward's runs alone as the offsets' check."""
    return Variant("varlen_tail.cu", "cuflash_varlen_tail", (), 256)


@functools.lru_cache(maxsize=None)
def mask_tiles_variant() -> Variant:
    """The tile map of a boolean mask (kernels/mask_tiles.cu), launched before the attention
    kernel that takes the mask, for that kernel's tile sizes (run-time values)."""
    return Variant("mask_tiles.cu", "cuflash_mask_tiles", (), 128)


@functools.lru_cache(maxsize=None)
def kv_append_variant() -> Variant:
    """The checked KV-cache append (any element size of 2, 4 or 8 bytes)."""
    return Variant("kv_append.cu", "cuflash_kv_append", (), 256)


@functools.lru_cache(maxsize=None)
def tma_copy_variant(headdim: int = 128, rows: int = 64, stages: int = 2) -> Variant:
    """The check of the Hopper producer/consumer pieces (kernels/tma_copy.cu; not attention):
    tiles copied through a ring of shared-memory stages by the bulk tensor copy engine."""
    name = f"cuflash_tma_copy_d{headdim}_r{rows}_s{stages}"
    defines = (("CUFLASH_HEADDIM", headdim), ("CUFLASH_TILE_ROWS", rows), ("CUFLASH_STAGES", stages))
    return Variant("tma_copy.cu", name, defines, 256, stages * rows * headdim * 2 + 1024, arch="90a")


@functools.lru_cache(maxsize=None)
def read_bandwidth_variant() -> Variant:
    """The decode benchmark's reference: a kernel that only reads two buffers (not attention)."""
    return Variant("read_bandwidth.cu", "cuflash_read_bandwidth", (), 1024)


def all_variants(smem_limit: int = DEFAULT_SMEM_LIMIT) -> list[Variant]:
    """Every variant the dispatcher can ask for on a GPU with this shared-memory limit."""
    out = []
    for dtype in ("float16", "bfloat16"):
        for d in HEADDIM_BUCKETS:
            for softcap in (False, True):
                for alibi in (False, True):
                    for mods in (0, 1, 2):  # (bias/mask/dropout: the overlapped Hopper kernel only)
                        out.append(fwd_variant(dtype, d, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit))
                        out.append(fwd_variant(dtype, d, softcap=softcap, alibi=alibi, splitkv=True, mods=mods,
                                               smem_limit=smem_limit))
                        if mods and d in SM90_FWD_TILES:  # (and the raw-score form where it applies)
                            out += [sm90_fwd_variant(dtype, d, softcap=softcap, alibi=alibi, mods=mods, raw=raw)
                                    for raw in ((False, True) if _raw_applies(True, mods, softcap, alibi) else (False,))]
                    out += [bwd_variant(dtype, d, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit)
                            for mods in (0, 1, 2)]
                    long_forms = (False, True) if d in SM90_FWD_LONG_TILES and not (softcap or alibi) else (False,)
                    hopper = [sm90_fwd_variant(dtype, d, softcap=softcap, alibi=alibi, overlap=overlap, long_rows=long_rows)
                              for overlap in (True, False) for long_rows in long_forms
                              if d in SM90_FWD_TILES]  # (other buckets run these)
                    hopper += [sm90_bwd_variant(dtype, d, softcap=softcap, alibi=alibi, deterministic=det, mods=mods,
                                                ordered=ordered)
                               for det, ordered in ((False, False), (True, False), (True, True)) for mods in (0, 1, 2)
                               if d in SM90_BWD_TILES  # (96 runs the 128 kernel, 160-224 the 256 one)
                               and (d == 64 or not (det and not ordered))]  # (ordered above 64 either way)
                    out += [v for v in hopper if v is not None]
        out.append(dsum_variant(dtype))
    # float32/float64: four score forms without modifiers; one modifier form (_mods_form) without
    # softcap and ALiBi and one with them switched at run time (_score_form) (issue 24)
    wide = [(softcap, alibi, mods) for mods in (0, 2) for softcap in (False, True) for alibi in (False, True)
            if not mods or softcap == alibi]
    out += [fwd_variant("float64", d, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit)
            for d in HEADDIM_BUCKETS for softcap, alibi, mods in wide]
    out += [fwd_variant("float32", d, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit, tf32=tf32)
            for d in HEADDIM_BUCKETS for softcap, alibi, mods in wide for tf32 in (False, True)]
    out += [bwd_variant("float64", d, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit, deterministic=det)
            for d in HEADDIM_BUCKETS if d <= wide_bwd_max_headdim("float64", smem_limit) for softcap, alibi, mods in wide
            for det in wide_bwd_schemes("float64", d, smem_limit)]
    out += [bwd_variant("float32", d, softcap=softcap, alibi=alibi, mods=mods, smem_limit=smem_limit, tf32=tf32,
                        deterministic=det)
            for d in HEADDIM_BUCKETS if d <= wide_bwd_max_headdim("float32", smem_limit)
            for softcap, alibi, mods in wide for tf32 in (False, True) for det in wide_bwd_schemes("float32", d, smem_limit)]
    out += [dsum_variant(dtype) for dtype in ("float32", "float64")]
    out += [softmax_variant(dt) for dt in DTYPE_TAGS] + [varlen_tail_variant(), kv_append_variant(), mask_tiles_variant(), read_bandwidth_variant(),
            tma_copy_variant()]
    return out


# ---------------------------------------------------------------------------------------------
# Run-time compilation (needs CuPy and a GPU) and compile-only checks (CuPy's NVRTC, no GPU).

_functions: dict = {}


def get_function(variant: Variant, device_id: int, suffix: str = ""):
    """Kernel ``variant.name + suffix`` on one device, compiled once and cached (also on disk by CuPy)."""
    key = (variant.name + suffix, device_id)
    fn = _functions.get(key)
    if fn is None:
        import cupy

        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(code=read_source(variant.filename), options=variant.options())
            fn = module.get_function(variant.name + suffix)
            if variant.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = variant.smem_bytes
            # Ask for the largest shared-memory carveout so several blocks fit on one SM.
            fn.preferred_shared_memory_carveout = 100
        _functions[key] = fn
    return fn


def prefetch(functions, device_id: int) -> None:
    """Compile, at the same time, the modules of the ``(variant, suffix)`` pairs a call is about
    to launch that are not compiled yet: NVRTC releases the GIL, so a backward's two modules
    (the D pre-pass and the main kernels) build side by side.  Each module once (its first
    suffix); CuPy keeps compiled modules, so the other suffixes are then lookups."""
    todo = {}
    for variant, suffix in functions:
        if (variant.name + suffix, device_id) not in _functions:
            todo.setdefault(variant, suffix)
    if len(todo) < 2:
        return  # nothing to overlap: get_function compiles it on first use
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(todo)) as pool:
        list(pool.map(lambda item: get_function(item[0], device_id, item[1]), todo.items()))


# What CuPy's RawModule adds to every NVRTC build after the caller's options and its -arch
# (cupy/cuda/compiler.py): builds here match the GPU's (scripts/nvrtc_sass.py too).
CUPY_NVRTC_FLAGS = ("-ftz=true", "--device-as-default-execution-space")


def compile_for_arch(variant: Variant, arch: str, *, log: list | None = None) -> bytes:
    """Compile ``variant`` to a cubin for ``arch`` (e.g. "80", "90"; Hopper-only variants always
    build for "90a") with NVRTC; no GPU needed.  With ``log`` (a list), ptxas runs verbose and
    the compiler log is appended to it (registers, spills, and ptxas's performance notes such as
    C7514, wgmma serialised).

    Raises ``RuntimeError`` with the compiler log on failure.
    """
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(read_source(variant.filename), f"{variant.name}.cu", [], [])
    try:
        arch = variant.arch or arch
        opts = [o for o in variant.options() if not o.startswith("-arch=")]
        opts += [f"-arch=sm_{arch}", *CUPY_NVRTC_FLAGS]
        opts += ["--ptxas-options=-v"] if log is not None else []
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{variant.name} (sm_{arch}) failed to compile:\n{nvrtc.getProgramLog(prog)}") from exc
        if log is not None:
            log.append(nvrtc.getProgramLog(prog))
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
