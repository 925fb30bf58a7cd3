"""Time the first call of each public GPU function in a fresh process, with CuPy's kernel cache
empty (cold: the kernels compile) and then filled by that run (warm: they load from disk).

    python scripts/first_call.py [--repeat 1] [--markdown FILE]

Each cell is one new Python process: `import cuflash` plus the first call, synchronised, then the
second call of the same shapes for comparison.  The GPU must be idle.  Used for the README's
"first call" paragraph (issue 20).
"""
import json
import os
import subprocess
import sys
import tempfile

import click

CALLS = {
    "attention": "cuflash.attention(q, k, v, causal=True)",
    "attention_backward": "cuflash.attention_backward(do, q, k, v, o, lse, causal=True)",
    "attention_varlen": "cuflash.attention_varlen(qv, qv, qv, cu, cu, 512, 512, causal=True)",
    "attention_with_kvcache": "cuflash.attention_with_kvcache(q1, kc, kc, cache_seqlens=lens)",
}

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy as cp, numpy as np
import cuflash
cp.cuda.runtime.free(cp.cuda.runtime.malloc(1))   # start the CUDA context outside the timing
t_import = time.perf_counter() - t0
rng = cp.random.default_rng(0)
q = rng.standard_normal((2, 1024, 16, 128), dtype=cp.float32).astype(cp.float16)
k, v = q.copy(), q.copy()
if {backward}:
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    do = cp.ones_like(o)
qv = rng.standard_normal((1024, 16, 128), dtype=cp.float32).astype(cp.float16)
cu = cp.asarray([0, 512, 1024], dtype=cp.int32)
q1 = q[:, :1]
kc = q
lens = cp.asarray([700, 1000], dtype=cp.int32)
cp.cuda.Device().synchronize()
t = time.perf_counter(); {call}; cp.cuda.Device().synchronize(); first = time.perf_counter() - t
t = time.perf_counter(); {call}; cp.cuda.Device().synchronize(); second = time.perf_counter() - t
print(json.dumps(dict(import_s=t_import, first_s=first, second_s=second)))
"""


def run_child(name, cache_dir):
    code = CHILD.format(call=CALLS[name], backward=name == "attention_backward")
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise click.ClickException(f"{name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--markdown", type=click.Path(dir_okay=False), help="Also write the table here.")
def main(markdown):
    """First-call times (cold and warm kernel cache) of the four public GPU entry points."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from cuflash import _arrays

    if not _arrays.gpu_available():  # (else each child process fails with CuPy's traceback)
        raise click.ClickException(f"first-call times need a GPU; {_arrays.no_gpu_reason()} (see `cuflash info`)")
    rows = ["| function (fp16, d128, causal) | first call, empty cache (s) | first call, cache on disk (s) "
            "| second call (ms) | import + CUDA context (s) |", "|---|---|---|---|---|"]
    for name in CALLS:
        with tempfile.TemporaryDirectory() as cache:
            cold = run_child(name, cache)
            warm = run_child(name, cache)
        rows.append(f"| {name} | {cold['first_s']:.2f} | {warm['first_s']:.3f} | "
                    f"{1e3 * warm['second_s']:.2f} | {cold['import_s']:.2f} |")
        click.echo(rows[-1])
    text = "\n".join(rows)
    click.echo(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
