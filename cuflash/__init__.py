"""cuflash: exact FlashAttention for NumPy and CuPy arrays, without PyTorch.

NumPy inputs run the tiled algorithm on the CPU; CuPy (and other DLPack GPU) inputs run CUDA
kernels compiled at run time with NVRTC.  ``cuflash.reference`` holds the float64 oracle.
"""

from .api import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    attention_vjp,
    merge_states,
    softmax,
)
from .kvcache import attention_with_kvcache
from ._guard import InvalidIndexError, NotAvailableOnGPU, release_graph_memory, synchronize
from .dropout import dropout_mask
from . import reference  # noqa: E402  (the float64 oracle, documented as cuflash.reference)

__version__ = "0.1.0"


def __getattr__(name):
    """``cuflash.parallel`` (multi-GPU attention) on first use, as ``from cuflash import parallel``."""
    if name == "parallel":
        import importlib

        return importlib.import_module(".parallel", __name__)
    raise AttributeError(f"module 'cuflash' has no attribute {name!r}")

__all__ = [
    "attention",
    "attention_backward",
    "attention_vjp",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "merge_states",
    "softmax",
    "dropout_mask",
    "synchronize",
    "release_graph_memory",
    "InvalidIndexError",
    "NotAvailableOnGPU",
    "__version__",
]
