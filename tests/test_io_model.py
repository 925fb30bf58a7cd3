"""The I/O model behind ``cuflash io``: textbook sizes and the FlashAttention paper's counts."""

import math

import pytest

from cuflash._io_model import ITEMSIZE, format_bytes, io_model, why_fast

KiB, MiB, GiB = 2**10, 2**20, 2**30


def test_textbook_sizes_at_8192_by_128_fp16():
    m = io_model(seqlen_q=8192, headdim=128, dtype="float16")
    assert m.q_bytes == m.k_bytes == m.v_bytes == m.o_bytes == 2 * MiB  # one N×d matrix
    assert m.qkvo_bytes == 8 * MiB
    assert m.score_bytes_per_head == m.score_bytes == 128 * MiB
    assert m.score_over_matrix == 64 == 8192 / 128  # N/d


def test_score_matrix_at_32768_is_2_gib():
    m = io_model(seqlen_q=32768, headdim=128, dtype="float16")
    assert m.score_bytes == 2 * GiB
    assert m.q_bytes == 8 * MiB


def test_defaults_match_the_cli_defaults():
    m = io_model()
    assert (m.batch, m.nheads, m.seqlen_q, m.seqlen_k, m.headdim, m.dtype) == (1, 1, 8192, 8192, 128, "float16")
    assert (m.block_m, m.block_n, m.sram_bytes) == (128, 64, 228 * KiB)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_sizes_scale_with_batch_heads_and_itemsize(dtype):
    one = io_model(seqlen_q=512, headdim=64, dtype=dtype)
    many = io_model(batch=3, nheads=5, seqlen_q=512, headdim=64, dtype=dtype)
    e = ITEMSIZE[dtype]
    assert one.q_bytes == 512 * 64 * e
    assert one.score_bytes == 512 * 512 * e
    for field in ("q_bytes", "k_bytes", "v_bytes", "o_bytes", "lse_bytes", "score_bytes",
                  "standard_hbm_bytes", "tiled_hbm_bytes", "kernel_hbm_bytes"):
        assert getattr(many, field) == 15 * getattr(one, field), field
    assert many.score_bytes_per_head == one.score_bytes_per_head
    assert many.tile_bytes == one.tile_bytes  # a tile is per (batch, head) block


def test_different_query_and_key_lengths():
    m = io_model(seqlen_q=1000, seqlen_k=3000, headdim=64, headdim_v=32, dtype="float32")
    assert m.q_bytes == 1000 * 64 * 4
    assert m.k_bytes == 3000 * 64 * 4
    assert m.v_bytes == 3000 * 32 * 4
    assert m.o_bytes == 1000 * 32 * 4
    assert m.score_bytes == 1000 * 3000 * 4


def test_standard_attention_traffic_is_algorithm_0():
    # Read Q, K; write S; read S; write P; read P and V; write O: (2Nd + 4N² + 2Nd) elements.
    n, d, e = 8192, 128, 2
    m = io_model(seqlen_q=n, headdim=d, dtype="float16")
    assert [label for label, _ in m.standard_steps] == [
        "read Q, K", "write S", "read S", "write P", "read P, V", "write O"
    ]
    assert m.standard_hbm_bytes == (4 * n * d + 4 * n * n) * e == 520 * MiB


def test_tiled_traffic_follows_theorem_2():
    # M = 228 KiB of fp16 = 116736 elements; B_r = ceil(M / 4d) = 228 query rows per block;
    # T_r = ceil(8192 / 228) = 36 blocks; K and V (2 MiB each) are read once per block.
    m = io_model(seqlen_q=8192, headdim=128, dtype="float16", sram_bytes=228 * KiB)
    assert m.sram_elems == 116736
    assert m.block_rows == 228 == math.ceil(116736 / (4 * 128))
    assert m.query_blocks == 36
    lse = 8192 * 4
    assert m.tiled_hbm_bytes == 2 * MiB + 36 * 4 * MiB + 2 * MiB + lse
    assert dict(m.tiled_steps)["read K, V 36 times"] == 144 * MiB
    # With the kernel's own query block (block_m = 128): 64 passes over K and V.
    assert m.kernel_query_blocks == 64
    assert m.kernel_hbm_bytes == 2 * MiB + 64 * 4 * MiB + 2 * MiB + lse
    assert m.hbm_ratio == pytest.approx(520 * MiB / m.tiled_hbm_bytes)
    assert m.tiled_hbm_bytes < m.standard_hbm_bytes


def test_tiled_traffic_scales_as_n2_d2_over_m():
    def kv_traffic(**kw):
        m = io_model(dtype="float16", **kw)
        return m.tiled_hbm_bytes - m.q_bytes - m.o_bytes - m.lse_bytes

    base = kv_traffic(seqlen_q=8192, headdim=64, sram_bytes=64 * KiB)
    # Exact factors when the block counts divide evenly.
    assert kv_traffic(seqlen_q=16384, headdim=64, sram_bytes=64 * KiB) == 4 * base  # N²
    assert kv_traffic(seqlen_q=8192, headdim=128, sram_bytes=64 * KiB) == 4 * base  # d²
    assert kv_traffic(seqlen_q=8192, headdim=64, sram_bytes=128 * KiB) * 2 == base  # 1/M
    # Standard attention's score traffic grows as N² whatever M is.
    s = io_model(seqlen_q=8192, headdim=64).standard_hbm_bytes
    assert io_model(seqlen_q=8192, headdim=64, sram_bytes=1024 * KiB).standard_hbm_bytes == s


def test_paper_regime_saves_most_for_small_head_dims():
    # GPT-2 medium-like (N = 1024, d = 64): the paper reports ~9x fewer HBM accesses (Fig. 2).
    m = io_model(seqlen_q=1024, headdim=64, dtype="float16")
    assert 5 < m.hbm_ratio < 12


def test_tile_working_set():
    m = io_model(headdim=128, dtype="float16", block_m=128, block_n=64)
    assert m.tile_q_bytes == 128 * 128 * 2 == 32 * KiB
    assert m.tile_k_bytes == m.tile_v_bytes == 64 * 128 * 2 == 16 * KiB
    assert m.tile_s_bytes == 128 * 64 * 4 == 32 * KiB  # scores in fp32
    assert m.tile_o_bytes == 128 * 128 * 4 == 64 * KiB  # fp32 accumulator
    assert m.tile_stats_bytes == 2 * 128 * 4  # running max and sum per row
    assert m.tile_bytes == 161 * KiB
    assert m.tile_fits
    assert not io_model(headdim=256, block_m=256, block_n=128).tile_fits


def test_tile_working_set_independent_of_sequence_length():
    assert io_model(seqlen_q=128).tile_bytes == io_model(seqlen_q=1 << 20).tile_bytes


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"seqlen_q": 0}, ValueError),
        ({"batch": -1}, ValueError),
        ({"headdim": 1.5}, TypeError),
        ({"block_m": True}, TypeError),
        ({"dtype": "int8"}, ValueError),
        ({"sram_bytes": 0}, ValueError),
    ],
)
def test_bad_arguments(kwargs, exc):
    name = next(iter(kwargs))
    with pytest.raises(exc, match=name if name != "dtype" else "dtype"):
        io_model(**kwargs)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (2 * MiB, "2 MiB"), (128 * MiB, "128 MiB"),
     (2 * GiB, "2 GiB"), (520 * MiB, "520 MiB"), (3 * 2**40, "3 TiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_why_fast_quotes_the_model():
    m = io_model()
    line = why_fast(m)
    assert line.startswith("Why it is fast")
    for value in (m.score_bytes, m.standard_hbm_bytes, m.tiled_hbm_bytes):
        assert format_bytes(value) in line


def test_why_tiling_loses_names_the_cause():
    """Fresh-user report (session 38): `cuflash io --dtype fp32 --sram-kib 1` printed "standard /
    tiled 0.0x" and blamed a small score matrix, whereas 1 KiB of on-chip memory holds one query
    row a block and K and V are re-read per row."""
    from cuflash._io_model import ratio

    m = io_model(dtype="float32", sram_bytes=1024)
    assert m.hbm_ratio < 0.05 and ratio(m.hbm_ratio) == f"{m.hbm_ratio:.3g}x" != "0.0x"
    line = why_fast(m)
    assert "holds only 1 query row a block" in line and "score matrix is small" not in line
    assert ratio(3.46) == "3.5x" and ratio(20000.0) == "2e+04x"


def test_attention_flops_convention():
    from cuflash._io_model import attention_flops

    assert attention_flops(1, 16, 4096, 4096, 128, causal=False) == 4 * 16 * 4096**2 * 128
    assert attention_flops(1, 16, 4096, 4096, 128, causal=True) == 2 * 16 * 4096**2 * 128
    assert attention_flops(2, 1, 10, 20, 8, causal=False, backward=True) == 2.5 * 4 * 2 * 10 * 20 * 8
