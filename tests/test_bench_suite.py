"""Pieces of `cuflash bench` that need no GPU: the standard-attention backward of the paper suite,
its table, the plot, and the command's refusal without a GPU."""

import importlib.util

import numpy as np
import pytest
from click.testing import CliRunner

from cuflash import _arrays, _demo, reference
from cuflash.cli import main


@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_and_backward_match_reference(rng, causal):
    q, k, v, dout = (rng.standard_normal((2, 33, 3, 16)).astype(np.float32) for _ in range(4))
    out = _demo.plain_attention(np, q, k, v, causal)
    np.testing.assert_allclose(out, reference.attention_ref(q, k, v, causal=causal)[0], atol=1e-5)
    grads = _demo.plain_attention_backward(np, q, k, v, dout, causal)
    for g, r in zip(grads, reference.attention_backward_ref(dout, q, k, v, causal=causal)):
        np.testing.assert_allclose(g, r, atol=1e-4)


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_paper_table_and_plot(tmp_path):
    from cuflash import bench

    rows = {"standard": dict(gflops=824.6, hbm_gb=12.3, ms=20.0), "flash": dict(gflops=824.6, hbm_gb=2.1, ms=4.0)}
    md = bench.paper_markdown(rows, {"gpu": "X", "date": "2026-11-29"})
    assert "| runtime (ms) | 41.7 | 7.3 | 20.0 | 4.0 |" in md and "| speed-up | | 5.7x | | 5.0x |" in md
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the plot extra) is not installed")
    sweep = [dict(dtype="bf16", headdim=64, seqlen=512, batch=32, nheads=32, causal=False, cuflash=200.0, **{"torch-flash": 250.0})]
    bench.plot(sweep, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_paper_model_counts():
    from cuflash import bench

    flops, io = bench.paper_model("fp16")
    assert flops == 3.5 * 4 * 64 * 16 * 1024 * 1024 * 64  # forward + backward (2.5x) of GPT-2 medium
    # Forward model: standard attention writes and re-reads the 64*16*1024^2 score and probability
    # matrices (fp16); cuflash streams K and V once per query block of 128 rows.
    scores = 64 * 16 * 1024 * 1024 * 2
    assert io.standard_hbm_bytes > 4 * scores > 3 * io.kernel_hbm_bytes


@pytest.mark.skipif(_arrays.gpu_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_is_a_clear_error():
    result = CliRunner().invoke(main, ["bench", "--suite", "paper"])
    assert result.exit_code == 1
    assert "no GPU visible" in result.output or "CuPy is not installed" in result.output


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_sweep_driver_with_and_without_progress_bar(monkeypatch, capsys):
    """The sweep loop, its JSON lines, the progress bar and the table (the timing is faked)."""
    import click

    from cuflash import bench

    def fake(dtype_name, headdim, seqlen, causal, peers):
        return dict(dtype=dtype_name, headdim=headdim, seqlen=seqlen, batch=1, nheads=1, causal=causal, cuflash=100.0)

    monkeypatch.setattr(bench, "bench_config", fake)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "X", "cc": "90", "date": "d", "cuflash": "0",
                                                      "cupy": "0", "nvrtc": "0"})
    monkeypatch.setattr(bench, "matmul_tflops", lambda dtype_name: 500.0)  # the fp16 GEMM ceiling
    argv = ["--no-peers", "--dtypes", "bf16", "--headdims", "64,128", "--seqlens", "512", "--causal", "true"]
    bench.main(argv)
    out = capsys.readouterr().out
    assert out.count('"cuflash": 100.0') == 2 and "| bf16 | 128 | True | 512 | 100 | 0.20 |" in out
    assert "cupy.matmul 8192³: fp16 500.0 TF/s" in out and "| of GEMM |" in out
    bench.main(argv, progress=lambda items, label: click.progressbar(items, label=label))
    out = capsys.readouterr().out
    assert '"cuflash": 100.0' not in out and "| bf16 | 64 | True | 512 | 100 |" in out


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_decode_table_gives_cuflash_against_the_read_only_kernel_and_cudnn():
    from cuflash import bench

    rows = [dict(heads="gqa", batch=8, kv_len=4096, kv_mb=134.2, cuflash=3.2, **{"read-only": 4.0, "torch-cudnn": 2.5}),
            dict(heads="mha", batch=1, kv_len=16384, kv_mb=268.4, cuflash=3.8)]
    md = bench.decode_markdown(rows, {"gpu": "X", "date": "2026-12-01"}).splitlines()
    assert md[2] == "| heads (q/kv) | batch | kv len | KV MB | cuflash | read-only | torch-cudnn | cuflash / read-only | cuflash / torch-cudnn |"
    assert md[4] == "| 32/8 | 8 | 4096 | 134 | 3.20 | 4.00 | 2.50 | 0.80 | 1.28 |"
    assert md[5] == "| 32/32 | 1 | 16384 | 268 | 3.80 | – | – | – | – |"


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_modifiers_table_gives_the_cost_of_each_modifier_and_the_best_peer():
    from cuflash import bench

    rows = [dict(case="bias", seqlen=4096, causal=False, batch=4, nheads=16, cuflash=300.0, **{"cuflash-plain": 500.0},
                 **{"torch-cudnn": 400.0, "jax-cudnn": 200.0}),
            dict(dtype="fp16", headdim=64, case="dropout", seqlen=16384, causal=True, batch=1, nheads=16, cuflash=450.0,
                 **{"cuflash-plain": 500.0}),
            dict(dtype="bf16", headdim=64, case="bias", seqlen=16384, causal=False, batch=1, nheads=32, cuflash=None,
                 cuflash_error="OutOfMemoryError: ...", **{"cuflash-plain": None})]
    md = bench.modifiers_markdown(rows, {"gpu": "X", "date": "2026-12-02"}, backward=True).splitlines()
    assert md[0].startswith("Bias, key-padding mask, dropout (backward)")
    assert md[2] == ("| dtype | hdim | case | seqlen | causal | cuflash | cuflash without it | torch-cudnn | jax-cudnn | "
                     "cuflash / without | cuflash / best peer |")
    assert md[4] == "| bf16 | 128 | bias | 4096 | False | 300 | 500 | 400 | 200 | 0.60 | 0.75 |"
    assert md[5] == "| fp16 | 64 | dropout | 16384 | True | 450 | 500 | – | – | 0.90 | – |"
    assert md[6] == "| bf16 | 64 | bias | 16384 | False | – | – | – | – | – | – |"  # inputs that did not fit


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_table_reads_each_row_against_its_dtypes_gemm():
    """The "of GEMM" column divides by cupy.matmul's rate in the row's dtype: float64 rows by
    float64's (issue 24's 60 % target), float32 by float32's, 16-bit rows by fp16's."""
    from cuflash import bench

    env = {"gpu": "X", "cc": "90", "date": "d", "cuflash": "0", "cupy": "0", "nvrtc": "0",
           "matmul": {"fp16": 800.0, "fp32": 50.0, "fp64": 64.0}}
    rows = [dict(dtype=d, headdim=64, seqlen=16384, causal=False, cuflash=c)
            for d, c in (("fp64", 38.4), ("fp32", 40.0), ("bf16", 400.0))]
    table = bench.to_markdown(rows, env)
    assert "| fp64 | 64 | False | 16384 | 38 | 0.60 |" in table
    assert "| fp32 | 64 | False | 16384 | 40 | 0.80 |" in table
    assert "| bf16 | 64 | False | 16384 | 400 | 0.50 |" in table


@pytest.mark.skipif(_arrays.cupy_module() is None, reason="cuflash.bench imports CuPy")
def test_backward_table_puts_deterministic_beside_the_default():
    """`--backward --deterministic` rows carry cuflash-det (deterministic=True): its column and the
    det / default ratio (issue 22 asks for those rows beside the default)."""
    from cuflash import bench

    env = {"gpu": "X", "cc": "90", "date": "d", "cuflash": "0", "cupy": "0", "nvrtc": "0"}
    rows = [dict(dtype="bf16", headdim=128, seqlen=4096, causal=False, cuflash=400.0, **{"cuflash-det": 360.0,
                                                                                         "torch-cudnn": 500.0}),
            dict(dtype="bf16", headdim=256, seqlen=4096, causal=True, cuflash=300.0, **{"cuflash-det": None,
                                                                                        "torch-cudnn": 300.0})]
    lines = bench.to_markdown(rows, env).splitlines()
    assert lines[2] == "| dtype | hdim | causal | seqlen | cuflash | cuflash-det | torch-cudnn | cuflash / torch-cudnn | det / default |"
    assert lines[4] == "| bf16 | 128 | False | 4096 | 400 | 360 | 500 | 0.80 | 0.90 |"
    assert lines[5] == "| bf16 | 256 | True | 4096 | 300 | – | 300 | 1.00 | – |"  # (a row without it)
