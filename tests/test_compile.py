"""Kernel variants compile with NVRTC for sm_80 and sm_90 (the Hopper-only wgmma variants for
sm_90a).

By default one variant per kernel source and element type (every compile-time switch on), so that the
README's test command stays short on a small machine; ``CUFLASH_COMPILE_ALL=1`` compiles every
variant the dispatcher can request (``.ci/run`` does, after the README's command).
Needs CuPy's NVRTC binding and the NVRTC library (the ``cuda12``/``cuda13`` extras), not a GPU.
"""

import dataclasses
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cuflash import _kernels
from cuflash._params import PARAMS_SIZE, FlashParams

ARCHS = ("80", "90")


def _nvrtc_or_skip():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # no CuPy, or CuPy without the NVRTC library
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the kernels, but NVRTC is unavailable: {exc}")
        pytest.skip(f"NVRTC not available ({exc}); pip install -e '.[cuda13]' (or '.[cuda12]')")


VARIANTS = _kernels.all_variants()


def _one_per_source(variants):
    """Per kernel file, element type, split-KV or not, dQ scheme, column split (float64 past d128),
    with or without modifiers and float64's exp2 form, the variant with the most switches on and the largest head dim: the
    one that exercises the most code."""
    best = {}
    for v in variants:
        d = dict(v.defines)
        key = (v.filename, d.get("CUFLASH_DTYPE"), d.get("CUFLASH_SPLITKV", 0), d.get("CUFLASH_DETERMINISTIC", 0),
               d.get("CUFLASH_DQ_ORDER", 0),
               d.get("CUFLASH_SLAB_WARPS", 1), d.get("CUFLASH_MODS", 0) > 0,  # (the kernels without modifiers too, not only the fullest form)
               d.get("CUFLASH_F64_EXP2"))  # (float64's exp2 forms each: mma.cuh)
        rank = (d.get("CUFLASH_SOFTCAP", 0) + d.get("CUFLASH_ALIBI", 0) + d.get("CUFLASH_MODS", 0), d.get("CUFLASH_HEADDIM", 0))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, v)
    return [v for _, v in best.values()]


COMPILE_ALL = os.environ.get("CUFLASH_COMPILE_ALL", "") not in ("", "0")
COMPILED = VARIANTS if COMPILE_ALL else _one_per_source(VARIANTS)
# The variants only GPUs with less shared memory a block ask for (the A100's 163 KB, sm_86/89's 99 KB):
# one per source and switch set of those (all of them would add ~900 builds to CI's compile check).
_NAMES = {v.name for v in VARIANTS}
COMPILED = COMPILED + _one_per_source([v for kb in (163, 99) for v in _kernels.all_variants(kb * 1024) if v.name not in _NAMES])
BUILDS = [(v, arch) for v in COMPILED for arch in ((v.arch,) if v.arch else ARCHS)]
# CUFLASH_COMPILE_LOG (.ci/run): a file listing the builds that passed, "name arch" a line; a
# CUFLASH_COMPILE_ALL run after the README's skips those (the same sources, the same CI run: ~150
# builds, ~2.5 minutes of CI's 2 cores).
_LOG = os.environ.get("CUFLASH_COMPILE_LOG", "")
if _LOG and COMPILE_ALL and os.path.exists(_LOG):
    with open(_LOG) as f:
        _DONE = {tuple(line.split()) for line in f if line.strip()}
    BUILDS = [(v, arch) for v, arch in BUILDS if (v.name, arch) not in _DONE]


@pytest.fixture(scope="module")
def built(request):
    """(variant name, arch) -> future of (cubin, ptxas log) for the builds this run selected, queued
    at once on one thread per core (NVRTC releases the GIL): CI's compile check of every variant
    took 1014 s for 1449 builds on two cores (session 20; one at a time: 2285 s for 1577), and each
    test still reports one build."""
    selected = [item.callspec.params for item in request.session.items
                if item.originalname == "test_variant_compiles" and hasattr(item, "callspec")]

    def build(v, a):
        log = []
        return _kernels.compile_for_arch(v, a, log=log), log

    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
        futures = {(p["variant"].name, p["arch"]): pool.submit(build, p["variant"], p["arch"]) for p in selected}
        yield futures
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize(("variant", "arch"), BUILDS, ids=lambda x: getattr(x, "name", x))
def test_variant_compiles(variant, arch, built):
    _nvrtc_or_skip()
    cubin, log = built[variant.name, arch].result()
    assert cubin[:4] == b"\x7fELF"
    assert variant.name.encode() in cubin  # the extern "C" entry point is in the binary
    # ptxas serialises every wgmma of a kernel when it cannot prove an accumulator untouched
    # between issue and wait (C7514): correct, but it undoes the overlap the Hopper kernels are
    # built for (session 14: a merged loop form did this silently).
    assert "C7514" not in log[0], log[0][log[0].find("C7514") - 20:][:400]
    if _LOG and not COMPILE_ALL:
        with open(_LOG, "a") as f:
            f.write(f"{variant.name} {arch}\n")


def test_hopper_forward_with_three_consumer_warpgroups_compiles(monkeypatch):
    """The 192-row form of the Hopper forward (FA3's d64 shape), a tile-table entry under
    measurement (docs/perf-notes.md h9): it builds for sm_90a whatever the table holds today."""
    _nvrtc_or_skip()
    monkeypatch.setitem(_kernels.SM90_FWD_TILES, 64, (96, 2, 3))
    _kernels.sm90_fwd_variant.cache_clear()
    try:
        v = _kernels.sm90_fwd_variant("bfloat16", 64, softcap=True, alibi=True)
        assert v.threads == 512 and dict(v.defines)["CUFLASH_BLOCK_M"] == 192
        log = []
        assert _kernels.compile_for_arch(v, "90a", log=log)[:4] == b"\x7fELF"
        assert "C7514" not in log[0]  # wgmma not serialised (see test_variant_compiles)
    finally:
        _kernels.sm90_fwd_variant.cache_clear()


def test_variant_names_are_unique_and_spell_the_switches():
    names = [v.name for v in VARIANTS]
    assert len(names) == len(set(names))
    v = _kernels.fwd_variant("bfloat16", 100, softcap=True, alibi=False)
    assert v.name.startswith("cuflash_fwd_bf16_d128_") and v.name.endswith("_softcap")
    assert dict(v.defines)["CUFLASH_HEADDIM"] == 128


def test_switched_modifier_variants_keep_softcap_and_alibi():
    """float32/float64 calls with a bias, mask or dropout and softcap or ALiBi run one ``_switched``
    variant built with both (perf-notes f10), on every GPU size and through the backward's fallback
    to whole S/dP tiles where the slab-summed buffer does not fit (a review found that fallback
    dropping softcap and ALiBi); without either they keep the plain modifier form."""
    wide_limits = (99 * 1024, 163 * 1024, 227 * 1024)
    for limit in wide_limits:
        for dtype in ("float32", "float64"):
            for d in _kernels.HEADDIM_BUCKETS:
                for softcap, alibi in ((True, False), (False, True), (True, True), (False, False)):
                    switched = softcap or alibi
                    kinds = [_kernels.fwd_variant(dtype, d, softcap=softcap, alibi=alibi, mods=2, smem_limit=limit)]
                    kinds += [_kernels.bwd_variant(dtype, d, softcap=softcap, alibi=alibi, mods=1, smem_limit=limit,
                                                   deterministic=det) for det in (True, False)]
                    for v in kinds:
                        defines = dict(v.defines)
                        assert ("_switched" in v.name) == switched, v.name
                        assert defines["CUFLASH_SOFTCAP"] == defines["CUFLASH_ALIBI"] == int(switched), v
                        assert defines.get("CUFLASH_SCORE_SWITCHES", 0) == int(switched), v
                        assert "_softcap" not in v.name and "_alibi" not in v.name, v.name
    # without modifiers the score forms stay variants of their own; 16-bit kernels never switch
    v = _kernels.fwd_variant("float64", 128, softcap=True, alibi=False)
    assert v.name.endswith("_softcap") and "CUFLASH_SCORE_SWITCHES" not in dict(v.defines)
    assert "CUFLASH_SCORE_SWITCHES" not in dict(_kernels.fwd_variant("float16", 128, softcap=True, alibi=True, mods=1).defines)


def test_tile_table_respects_shared_memory_limits():
    for dtype in ("float16", "float32", "float64"):
        for limit in (99 * 1024, 163 * 1024, 227 * 1024):
            for d in _kernels.HEADDIM_BUCKETS:
                assert _kernels.fwd_tile(d, limit, dtype).smem_bytes(d) + _kernels.STATIC_SMEM_RESERVE <= limit


def test_wide_backward_variants_fit_their_gpus():
    """Every float32/float64 backward variant a GPU of 99, 163 or 227 KB runs (head dims up to
    _gpu._wide_limit for that GPU) fits its shared memory in at most 8 warps, a warp's columns whole
    8-column tiles; float64 gradients stop at d192 on 99 KB GPUs (a d224 slab takes 116 KB)."""
    from cuflash import _gpu

    for limit in (99 * 1024, 163 * 1024, 227 * 1024):
        for dtype in ("float32", "float64"):
            top = _gpu._wide_limit(dtype, True, limit)
            for d in _kernels.HEADDIM_BUCKETS:
                v = _kernels.bwd_variant(dtype, d, softcap=False, alibi=False, smem_limit=limit)
                split = dict(v.defines)["CUFLASH_SLAB_WARPS"]
                fits = v.smem_bytes + _kernels.STATIC_SMEM_RESERVE <= limit and v.threads <= 256 and d % (8 * split) == 0
                assert fits == (d <= top), (limit, dtype, d, v)
    assert _gpu._wide_limit("float64", True, 99 * 1024) == 192
    assert _gpu._wide_limit("float64", True, 163 * 1024) == _gpu._wide_limit("float32", True, 99 * 1024) == 256


def test_float32_forward_tiles():
    """float32 (3xTF32) takes 64 x 32 tiles to d160 (64 keys spilled: at d128 32 -> 39 TF/s with 32,
    session 23; at d64 45 -> 50, session 28) and at d192/d256 64 x 32 with 8 warps, O's columns over two
    and S shared (d256 27 -> 43 TF/s, H200, sessions 28-29; d192 39 -> 40, causal 35 -> 38, session 31);
    its 3xTF32 steps in two chains of products for S and P V at d128, d192 and d256, for S at d160
    (session 29), and the variant's name and defines say so."""
    for d in _kernels.HEADDIM_BUCKETS:
        t = _kernels.fwd_tile(d, dtype="float32")
        expected = (64, 32, 8, 2) if d in (192, 256) else (64, 32, 4, 1)
        assert (t.block_m, t.block_n, t.warps, t.col_split) == expected, (d, t)
        chains = {128: (2, 2), 160: (2, 3), 192: (2, 2), 256: (2, 2)}.get(d, (3, 3))
        assert t.tf32_chains == chains, (d, t)
        for tf32 in (False, True):
            v = _kernels.fwd_variant("float32", d, softcap=False, alibi=False, tf32=tf32)
            used = (3, 3) if tf32 else chains
            assert (dict(v.defines)["CUFLASH_TF32_CHAINS_ABT"], dict(v.defines)["CUFLASH_TF32_CHAINS_CB"]) == used
            assert ("_ch" in v.name) == (used != (3, 3)), v.name
        assert _kernels.fwd_tile(d, dtype="float64").tf32_chains == (3, 3)


def test_float64_forward_tiles():
    """float64 takes 64 x 32 tiles to d64 and 128 x 16 (8 warps) to d128, 64 x 16 where 169 KB do not
    fit (the A100): at d128 64 x 32 spilled 224 bytes (14 against 23 TF/s, H200, session 24)."""
    tile = _kernels.fwd_tile
    assert (tile(64, dtype="float64").block_m, tile(64, dtype="float64").block_n) == (64, 32)
    for d in (96, 128):
        assert (tile(d, dtype="float64").block_m, tile(d, dtype="float64").block_n, tile(d, dtype="float64").warps) == (128, 16, 8)
    assert (tile(128, 163 * 1024, "float64").block_m, tile(128, 163 * 1024, "float64").block_n) == (64, 16)
    for d in (160, 192, 224, 256):  # past d128: 64 x 16, 8 warps, O's columns split over 2 (32 x 32 spilled 840 bytes at d256)
        t = tile(d, dtype="float64")
        assert (t.block_m, t.block_n, t.warps, t.col_split) == (64, 32 if d <= 192 else 16, 8, 2)


def test_column_split_tiles_share_s_where_it_fits():
    """A column split's warps form half of S each and swap it through shared memory (share_s: its
    block_m x block_n elements counted in smem_bytes) wherever that fits beside the tile the limit
    allows without it; the tile does not shrink for it (float64 d192 and float32 d256 at 99 KB keep
    their shapes without it, float64 d256 at 99 KB has no room)."""
    for dtype in ("float32", "float64"):
        for limit in (227 * 1024, 163 * 1024, 99 * 1024):
            for d in _kernels.HEADDIM_BUCKETS:
                t = _kernels.fwd_tile(d, limit, dtype)
                plain = dataclasses.replace(t, share_s=False)
                assert t.smem_bytes(d) == plain.smem_bytes(d) + t.share_s * t.block_m * t.block_n * t.itemsize
                fits = plain.smem_bytes(d) + t.block_m * t.block_n * t.itemsize + 256 + 16 * t.block_n <= limit
                assert t.share_s == (t.col_split == 2 and fits), (dtype, limit, d, t)
                v = _kernels.fwd_variant(dtype, d, softcap=False, alibi=False, smem_limit=limit)
                assert dict(v.defines)["CUFLASH_SHARE_S"] == int(t.share_s) and ("_sh" in v.name) == t.share_s
                assert v.smem_bytes == t.smem_bytes(d)
    tile = _kernels.fwd_tile
    assert (tile(256, 99 * 1024, "float32").block_m, tile(256, 99 * 1024, "float32").share_s) == (64, False)
    assert (tile(192, 99 * 1024, "float64").block_m, tile(192, 99 * 1024, "float64").share_s) == (32, False)
    assert (tile(256, 99 * 1024, "float64").block_m, tile(256, 99 * 1024, "float64").share_s) == (16, False)
    assert tile(256, dtype="float32").share_s and tile(160, dtype="float64").share_s


def test_wide_dtype_limits_are_checked_before_any_kernel():
    """What the float32/float64 GPU kernels cover (_gpu.check_call with p None: dtype and head dim
    alone, as attention_vjp asks first): every head dim to 256, gradients too."""
    from cuflash import _gpu

    for name in ("float32", "float64"):
        q = np.empty((1, 1, 1, 256), dtype=name)
        assert _gpu.check_call(None, q, headdim=256) == name
        assert _gpu.check_call(None, q, backward=True, headdim=256) == name


def test_headdim_bucket():
    assert [_kernels.headdim_bucket(d) for d in (1, 32, 33, 64, 111, 256)] == [32, 32, 64, 64, 128, 256]
    with pytest.raises(ValueError, match="head dim 257"):
        _kernels.headdim_bucket(257)


def test_params_struct_is_all_8_byte_fields():
    # The C side static_asserts sizeof(FlashParams) == PARAMS_SIZE (passed at compile time);
    # with only 8-byte fields, equal size and equal field order give equal layout.
    assert PARAMS_SIZE == 8 * len(FlashParams._fields_)
    src = _kernels.read_source("flash_fwd.cu")
    body = src[src.index("struct FlashParams {"): src.index("};", src.index("struct FlashParams {"))]
    c_names = []
    for line in body.splitlines()[1:]:
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            c_names += re.findall(r"(\w+)\s*(?:,|$)", decl)
    assert c_names == [name for name, _ in FlashParams._fields_]


def test_sources_are_found_and_includes_inlined():
    src = _kernels.read_source("flash_fwd.cu")
    assert '#include "' not in src
    assert src.count("struct FlashParams {") == 1
    assert (_kernels.kernel_dir() / "flash_fwd.cu").is_file()


def test_hopper_variants_cover_the_panel_buckets():
    names = [v.name for v in VARIANTS if v.arch == "90a" and "_sm90_" in v.name]  # attention kernels
    # dtypes x (forward 64/128/192/256 with and without the overlap, and with bias/mask and with
    # bias/mask/dropout (overlapped only), backward 64/128/256 with dQ added in any order, 64 with
    # _dq + _dkdv, and 64/128/256 with ordered dQ (deterministic=True above 64; at 64 under
    # CUFLASH_SM90_ORDERED_DQ), each plain, with bias/mask and with bias/mask/dropout) x (softcap,
    # alibi), and the forwards with bias/mask or bias/mask/dropout in their raw-score form (no
    # softcap, no ALiBi), and d64's long-row tile (plain, with and without the overlap)
    assert len(names) == 2 * (4 * 4 + (3 + 1 + 3) * 3) * 4 + 2 * 4 * 2 + 2 * 2
    assert _kernels.sm90_fwd_variant("bfloat16", 64, softcap=False, alibi=False, long_rows=True).name.endswith("_d64_bm192_bn96_st2")
    assert "_bm128_" in _kernels.sm90_fwd_variant("bfloat16", 64, softcap=True, alibi=False, long_rows=True).name
    assert "_bn64_" in _kernels.sm90_fwd_variant("bfloat16", 256, softcap=False, alibi=False, mods=1).name
    assert "_bn80_" in _kernels.sm90_fwd_variant("bfloat16", 256, softcap=False, alibi=False).name
    v = _kernels.sm90_bwd_variant("bfloat16", 200, softcap=False, alibi=False)
    assert v.name.startswith("cuflash_bwd_sm90_bf16_d256_") and dict(v.defines)["CUFLASH_COL_SPLIT"] == 1
    for d, ordered in ((72, False), (128, False), (200, False), (64, True)):  # deterministic: ordered dQ above 64
        assert _kernels.sm90_bwd_variant("bfloat16", d, softcap=False, alibi=False, deterministic=True,
                                         ordered=ordered).name.endswith("_ord")
    assert _kernels.sm90_bwd_variant("bfloat16", 64, softcap=False, alibi=False, deterministic=True).name.endswith("_det")
    for d in (72, 96):  # the bucket 96 runs the 128 kernel, its columns past the head dim zero
        assert _kernels.sm90_bwd_variant("bfloat16", d, softcap=False, alibi=False).name.startswith("cuflash_bwd_sm90_bf16_d128_")
    assert _kernels.sm90_bwd_variant("bfloat16", 32, softcap=False, alibi=False) is None  # MiniLM's: flash_bwd.cu
    assert _kernels.sm90_fwd_variant("bfloat16", 32, softcap=False, alibi=False) is None  # MiniLM's: sm_80
    assert _kernels.sm90_fwd_variant("bfloat16", 96, softcap=False, alibi=False).name.startswith("cuflash_fwd_sm90_bf16_d128_")
    assert _kernels.sm90_fwd_variant("bfloat16", 200, softcap=False, alibi=False).name.startswith("cuflash_fwd_sm90_bf16_d256_")
    v = _kernels.sm90_fwd_variant("float16", 111, softcap=False, alibi=True)
    assert v.name.startswith("cuflash_fwd_sm90_fp16_d128_") and "-arch=sm_90a" in v.options()


def test_generated_wgmma_header_is_current():
    script = Path(__file__).resolve().parent.parent / "scripts" / "gen_wgmma.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sm90_applies_only_to_compute_capability_9_0_with_nvrtc_12_9(monkeypatch):
    assert _kernels.sm90_applies("90", (12, 9)) and _kernels.sm90_applies("90", (13, 0))
    assert not _kernels.sm90_applies("90", (12, 8))  # NVRTC rejects CuPy's second -arch
    assert not any(_kernels.sm90_applies(cc, (13, 0)) for cc in ("80", "89", "100", "120"))
    assert not _kernels.sm90_applies("90", None)
    monkeypatch.setenv("CUFLASH_DISABLE_SM90", "1")
    assert _kernels.sm90_disabled()
    monkeypatch.setenv("CUFLASH_DISABLE_SM90", "0")
    assert not _kernels.sm90_disabled()



def test_prefetch_compiles_a_calls_modules_side_by_side(monkeypatch):
    """Issue 20: a backward's first call compiles its D pre-pass and its main module at the same
    time (NVRTC releases the GIL); modules already compiled, and a lone module, are left to
    get_function."""
    import threading
    import time

    calls, lock = [], threading.Lock()

    def fake_get_function(variant, device_id, suffix=""):
        with lock:
            calls.append((variant.name, suffix, threading.get_ident()))
        time.sleep(0.3)

    monkeypatch.setattr(_kernels, "get_function", fake_get_function)
    monkeypatch.setattr(_kernels, "_functions", {(_kernels.softmax_variant("float16").name, 0): object()})
    dsum = _kernels.dsum_variant("bfloat16")
    main = _kernels.bwd_variant("bfloat16", 128, softcap=False, alibi=False)
    start = time.perf_counter()
    _kernels.prefetch([(dsum, ""), (main, "_dq"), (main, "_dkdv"), (_kernels.softmax_variant("float16"), "")], 0)
    assert time.perf_counter() - start < 0.55  # two 0.3 s compiles overlapped
    assert sorted((n, s) for n, s, _ in calls) == sorted([(dsum.name, ""), (main.name, "_dq")])
    assert len({t for *_, t in calls}) == 2
    calls.clear()
    _kernels.prefetch([(dsum, "")], 0)
    assert calls == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_module_holds_only_the_kernels_its_scheme_launches(deterministic, dtype):
    """Issue 20: the atomic-dQ and the deterministic Hopper backward are modules of their own, so
    that a first call compiles two kernels, not four; the float32/float64 ones (flash_bwd.cu) too."""
    _nvrtc_or_skip()
    if dtype == "bfloat16":  # (d64: above it deterministic=True is the one-pass kernel, dQ ordered)
        v = _kernels.sm90_bwd_variant(dtype, 64, softcap=False, alibi=False, deterministic=deterministic)
    else:
        v = _kernels.bwd_variant(dtype, 64, softcap=False, alibi=False, deterministic=deterministic)
    cubin = _kernels.compile_for_arch(v, "90")
    entries = {s: (v.name + s).encode() + b"\0" in cubin for s in ("_dq", "_dkdv", "_dkdv_dq", "_dq_convert")}
    want = {"_dq", "_dkdv"} if deterministic else {"_dkdv_dq", "_dq_convert"}
    assert {s for s, found in entries.items() if found} == want


def test_backward_grids_match_the_kernels_tiles():
    """_gpu.bwd_tiles, the rows per block of both backward grids, against each kernel's own tile:
    flash_bwd.cu's kT = 16 warps / CUFLASH_SLAB_WARPS, the Hopper kernels' 64 per warpgroup (64
    keys at d256, whose warpgroups split the columns).  (A division by the Hopper kernels'
    CUFLASH_COL_SPLIT 0 once broke every Hopper backward here.)"""
    from cuflash import _gpu

    for d in (64, 128):
        v = _kernels.sm90_bwd_variant("bfloat16", d, softcap=False, alibi=False)
        assert _gpu.bwd_tiles(v) == (v.threads // 2, v.threads // 2)
    v = _kernels.sm90_bwd_variant("bfloat16", 256, softcap=False, alibi=False)
    assert _gpu.bwd_tiles(v) == (v.threads // 2, 64)
    v = _kernels.bwd_variant("float16", 64, softcap=False, alibi=False)
    assert _gpu.bwd_tiles(v) == (16 * dict(v.defines)["CUFLASH_WARPS"],) * 2
    cases = [("float64", 64, 227, 32), ("float64", 128, 227, 32), ("float64", 128, 99, 16), ("float32", 128, 227, 32),
             ("float32", 256, 227, 32), ("float32", 256, 99, 16)]
    for dtype, d, smem_kb, rows in cases:
        v = _kernels.bwd_variant(dtype, d, softcap=False, alibi=False, smem_limit=smem_kb * 1024)
        assert _gpu.bwd_tiles(v) == (rows, rows), (v.name, _gpu.bwd_tiles(v))
    # The atomic-dQ dK/dV kernels of 64 keys sharing query tiles (BwdShape::kQT): float32 d128's 32-query
    # tiles, float64 d128's 16-query tiles (4 slabs of 2 warps); dQ's grid and the mask's tile map by the
    # query tile, the dK/dV grid by 64 keys; the smaller forms where they do not fit, and at the head
    # dims where they measured slower or whose dQ columns do not split into 8-column tiles over 8 warps.
    cases = [("float32", 64, 227, (32, 32)), ("float32", 128, 227, (32, 64)), ("float32", 128, 163, (32, 32)),
             ("float32", 128, 99, (32, 32)), ("float64", 64, 227, (32, 32)), ("float64", 128, 227, (16, 64)),
             ("float64", 128, 163, (16, 16)), ("float64", 96, 227, (32, 32)), ("float64", 160, 227, (16, 16))]
    for dtype, d, smem_kb, tiles in cases:
        v = _kernels.bwd_variant(dtype, d, softcap=False, alibi=False, smem_limit=smem_kb * 1024, deterministic=False)
        assert _gpu.bwd_tiles(v) == tiles, (v.name, _gpu.bwd_tiles(v))
        assert (f"_q{tiles[0]}_" in v.name) == (tiles[0] < tiles[1]), v.name


@pytest.mark.parametrize("smem_kb", [227, 163, 99])
def test_float64_exp2_form_per_variant(smem_kb):
    """float64's exp2 form (CUFLASH_F64_EXP2, mma.cuh; perf-notes f20): the forward CUDA's exp2 (0) to
    head dim 64 and the Horner polynomial (1) past it, the backward Estrin's (2); no other kernel
    carries the define (every form passes the accuracy tests: only this pins which one runs)."""
    for v in _kernels.all_variants(smem_kb * 1024):
        d = dict(v.defines)
        if d.get("CUFLASH_DTYPE") != _kernels.attention_tag("float64") or v.filename not in ("flash_fwd.cu", "flash_bwd.cu"):
            assert "CUFLASH_F64_EXP2" not in d, v.name
        elif v.filename == "flash_bwd.cu":
            assert d["CUFLASH_F64_EXP2"] == 2, v.name
        else:
            assert d["CUFLASH_F64_EXP2"] == (0 if d["CUFLASH_HEADDIM"] <= 64 else 1), v.name


def test_sm90_backward_producer_form_where_chosen():
    """The Hopper dK/dV kernel's producer form (flash_bwd_sm90.cu's CUFLASH_PRODUCER: a third
    warpgroup copies Q/dO and adds dQ, perf-notes b13/b15) serves d64 and d128 (and the buckets padded
    to them) without deterministic and without bias/mask/dropout; its two consumer warpgroups are what
    the grids count (Variant.threads 256, 128 keys a block); _dkdv_dq launches with the producer's 128
    more (Variant.threads_of).  deterministic=True takes it too above d64 (dQ ordered, _p_ord); the
    d64 deterministic, modifier and d256 forms keep their tiles."""
    from cuflash import _gpu

    for dtype in ("bfloat16", "float16"):
        for d in (40, 64, 96, 128):
            v = _kernels.sm90_bwd_variant(dtype, d, softcap=d == 96, alibi=d == 40)
            defs = dict(v.defines)
            assert defs["CUFLASH_PRODUCER"] == 1 and defs["CUFLASH_WARPGROUPS"] == 2, v.name
            assert v.threads == 256 and _gpu.bwd_tiles(v) == (128, 128) and v.name.endswith("_p"), v.name
            assert (v.threads_of("_dkdv_dq"), v.threads_of("_dq_convert")) == (384, 256), v.name
            det = _kernels.sm90_bwd_variant(dtype, d, softcap=False, alibi=False, deterministic=True)
            assert dict(det.defines)["CUFLASH_PRODUCER"] == (d > 64) and det.name.endswith("_p_ord" if d > 64 else "_det")
            for other in (dict(deterministic=True), dict(mods=1), dict(mods=2)):
                if other.get("deterministic") and d > 64:
                    continue
                w = _kernels.sm90_bwd_variant(dtype, d, softcap=False, alibi=False, **other)
                assert dict(w.defines)["CUFLASH_PRODUCER"] == 0 and not w.name.endswith("_p"), w.name
                assert all(w.threads_of(suffix) == w.threads for suffix in ("_dkdv_dq", "_dq", "_dkdv")), w.name
        w = _kernels.sm90_bwd_variant(dtype, 256, softcap=False, alibi=False)
        assert dict(w.defines)["CUFLASH_PRODUCER"] == 0 and dict(w.defines)["CUFLASH_COL_SPLIT"] == 1
        # d64's producer form: three blocks of one warpgroup before (perf-notes b15); deterministic keeps them
        assert dict(_kernels.sm90_bwd_variant(dtype, 64, softcap=False, alibi=False, deterministic=True).defines)[
            "CUFLASH_MIN_BLOCKS"] == 3


def test_sm90_backward_ordered_dq_form(monkeypatch):
    """deterministic=True with ordered dQ additions (flash_bwd_sm90.cu's kDqOrdered; above the head-dim
    bucket 64, and at 64 too under CUFLASH_SM90_ORDERED_DQ=1): the default form's kernels and tiles
    (producer form included) at every head-dim bucket, d256 too, with CUFLASH_DQ_ORDER; a one-axis
    grid of key blocks x pairs in sections of as many pairs as one wave of resident blocks holds
    whole; without the switch d64 keeps _dq + _dkdv."""
    from cuflash import _gpu

    for dtype in ("bfloat16", "float16"):
        for d in (40, 64, 96, 128, 160, 256):
            for mods in (0, 1, 2):
                base = _kernels.sm90_bwd_variant(dtype, d, softcap=False, alibi=True, mods=mods)
                v = _kernels.sm90_bwd_variant(dtype, d, softcap=False, alibi=True, mods=mods, deterministic=True,
                                              ordered=True)
                defs, base_defs = dict(v.defines), dict(base.defines)
                assert v.name == base.name + "_ord" and defs.pop("CUFLASH_DQ_ORDER") == 1, v.name
                assert base_defs.pop("CUFLASH_DQ_ORDER") == 0 and defs == base_defs, v.name
                assert (v.threads, v.smem_bytes, _gpu.bwd_tiles(v)) == (base.threads, base.smem_bytes, _gpu.bwd_tiles(base))
                assert v in _kernels.all_variants()
    monkeypatch.setattr(_gpu, "_sm_resources", lambda device: (132, 233472))
    p = _kernels.sm90_bwd_variant("bfloat16", 128, softcap=False, alibi=False, deterministic=True, ordered=True)
    assert _gpu._ordered_bwd_grid(0, p, 40, 32) == (4, (1280, 1, 1))  # the pairs a wave of 132 blocks holds
    assert _gpu._ordered_bwd_grid(0, p, 40, 128) == (1, (5120, 1, 1))
    assert _gpu._ordered_bwd_grid(0, p, 3, 300) == (1, (900, 1, 1))  # (at least one pair)
    assert _gpu._ordered_bwd_grid(0, p, 4, 8) == (4, (32, 1, 1))  # (no more sections than pairs)
    m = _kernels.sm90_bwd_variant("bfloat16", 64, softcap=False, alibi=False, mods=1, deterministic=True, ordered=True)
    assert _gpu._ordered_bwd_grid(0, m, 100, 8)[0] == 33  # two blocks an SM: 264 resident
    # d64's producer form ordered: a dq_accum copy per consumer (sm90_bwd_epilogue.cuh's dq_accum_copies)
    for d, mods, copies in ((64, 0, 2), (64, 1, 1), (128, 0, 1), (256, 0, 1)):
        for det, ordered in ((False, False), (True, False), (True, True)):
            v = _kernels.sm90_bwd_variant("bfloat16", d, softcap=False, alibi=False, mods=mods, deterministic=det,
                                          ordered=ordered)
            want = copies if v.name.endswith("_ord") else 1
            assert _kernels.dq_accum_copies(v) == want, v.name
    assert _kernels.dq_accum_copies(_kernels.bwd_variant("bfloat16", 64, softcap=False, alibi=False)) == 1
    monkeypatch.delenv("CUFLASH_SM90_ORDERED_DQ", raising=False)
    assert not _kernels.sm90_ordered_dq()
    monkeypatch.setenv("CUFLASH_SM90_ORDERED_DQ", "1")
    assert _kernels.sm90_ordered_dq()


def test_sm90_backward_blocks_per_sm_fit_in_shared_memory():
    """Every Hopper backward variant's dynamic shared memory (with the fp32 dQ tile the atomic form
    stages, flash_bwd_sm90.cu's sdQ), its static bytes and the driver's 1 KB a block leave room for the
    CUFLASH_MIN_BLOCKS blocks per SM its registers were capped for, on a 228 KB SM (H100/H200): d64's
    three blocks had 2.6 KB to spare when the dQ tile came (session 33)."""
    from cuflash import _gpu

    smem_per_sm = 233472
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            for softcap, alibi, mods in ((False, False, 0), (True, True, 0), (False, False, 1), (False, False, 2)):
                for deterministic, ordered in ((False, False), (True, False), (True, True)):
                    v = _kernels.sm90_bwd_variant(dtype, d, softcap=softcap, alibi=alibi, mods=mods,
                                                  deterministic=deterministic, ordered=ordered)
                    if v is None:
                        continue
                    blocks = dict(v.defines)["CUFLASH_MIN_BLOCKS"]
                    per_block = v.smem_bytes + _kernels.STATIC_SMEM_RESERVE + _gpu.RESERVED_SMEM_PER_BLOCK
                    assert blocks * per_block <= smem_per_sm, (v.name, blocks, per_block)
                    assert v.smem_bytes + _kernels.STATIC_SMEM_RESERVE <= _kernels.DEFAULT_SMEM_LIMIT, v.name
