"""The SASS of a kernel variant as the GPU machine builds it: NVRTC with CuPy's flags, no GPU needed.

    python scripts/nvrtc_sass.py VARIANT [--nvrtc LIBNVRTC] [--nvdisasm NVDISASM] [--out FILE]

VARIANT is a name of cuflash._kernels.all_variants() (e.g. cuflash_fwd_sm90_bf16_d128_bm128_bn128_st2).
CuPy compiles with the variant's options followed by its own `-arch=sm_XX -ftz=true
--device-as-default-execution-space` (cupy/cuda/compiler.py); this script passes the same, asks
ptxas for its resource report and prints it, then disassembles the cubin with nvdisasm (the
`nvidia-cuda-nvdisasm` wheel) into --out.  nvcc builds differ: in session 21 nvcc 13.0 put the
Hopper forward's wgmma descriptors on the uniform datapath where NVRTC 13.0 did not
(docs/perf-notes.md h13), so SASS studies use this.  --nvrtc picks the library: the GPU machine's
NVRTC version is the one to match (`pip download nvidia-cuda-nvrtc==13.0.*`, unzipped; its
directory must also be on LD_LIBRARY_PATH for libnvrtc-builtins).
"""

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuflash import _kernels  # noqa: E402

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")  # an address comment: one instruction


def build(lib: ctypes.CDLL, source: str, options: list) -> tuple:
    """(cubin bytes, log) of one NVRTC compilation; raises RuntimeError with the log on failure."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc:
        raise RuntimeError(f"NVRTC error {rc}:\n{text}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant")
    ap.add_argument("--nvrtc", default="libnvrtc.so.13", help="libnvrtc to load [default: the loader's]")
    ap.add_argument("--nvdisasm", default="nvdisasm", help="nvdisasm executable [default: on PATH]")
    ap.add_argument("--out", help="write the disassembly here [default: VARIANT.sass]")
    args = ap.parse_args()
    found = [v for v in _kernels.all_variants() if v.name == args.variant]
    if not found:
        sys.exit(f"no variant named {args.variant!r} (see cuflash._kernels.all_variants())")
    v = found[0]
    arch = f"-arch=sm_{(v.arch or '90').rstrip('a')}"  # (CuPy's own -arch follows the variant's)
    options = [*v.options(), arch, *_kernels.CUPY_NVRTC_FLAGS, "--ptxas-options=-v"]
    cubin, log = build(ctypes.CDLL(args.nvrtc), _kernels.read_source(v.filename), options)
    for line in log.splitlines():
        if re.search(r"registers|spill|C7514", line):
            print(line.strip())
    out = Path(args.out or f"{args.variant}.sass")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([args.nvdisasm, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    out.write_text(sass)
    count = sum(1 for line in sass.splitlines() if INSTRUCTION.match(line))
    print(f"{out}: {count} instructions")


if __name__ == "__main__":
    main()
