"""transformer_engine: FP8 / BF16 building blocks for transformer models.

The compiled core is libtransformer_engine.so (C API nvte_*), reached from Python
through the framework-neutral module transformer_engine._nvte. Framework adapters
live in transformer_engine.pytorch, transformer_engine.jax and transformer_engine.paddle.
"""
import os as _os
import sysconfig as _sysconfig
from pathlib import Path as _Path


def _point_at_pip_cublaslt():
    """The CUDA backend opens cuBLASLt at run time. When the pip wheel nvidia-cublas is
    installed (PyTorch's CUDA builds bring it), use that copy, the one PyTorch loads too."""
    if "NVTE_CUBLASLT_PATH" in _os.environ:
        return
    for base in {_sysconfig.get_paths()["purelib"], _sysconfig.get_paths()["platlib"]}:
        cand = _Path(base) / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13"
        if cand.exists():
            _os.environ["NVTE_CUBLASLT_PATH"] = str(cand)
            return


_point_at_pip_cublaslt()


def _point_at_pip_cudnn():
    """Fused attention opens cuDNN at run time: a copy already in the process (PyTorch's) wins;
    otherwise the nvidia-cudnn-cu13 wheel's, when installed."""
    if "NVTE_CUDNN_PATH" in _os.environ:
        return
    for base in {_sysconfig.get_paths()["purelib"], _sysconfig.get_paths()["platlib"]}:
        cand = _Path(base) / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
        if cand.exists():
            _os.environ["NVTE_CUDNN_PATH"] = str(cand)
            return


_point_at_pip_cudnn()

from . import _nvte  # noqa: E402,F401  (loads libtransformer_engine.so)

__version__ = "0.1.0"

if _nvte.get_version() != _nvte.VERSION:
    raise ImportError(
        f"libtransformer_engine.so reports version {_nvte.get_version()} but the Python module was "
        f"built against {_nvte.VERSION}; reinstall transformer_engine"
    )


def get_include() -> str:
    """Directory holding transformer_engine/*.h for C/C++ callers."""
    return str(_Path(__file__).parent / "include")


def get_library_dir() -> str:
    """Directory holding libtransformer_engine.so."""
    return str(_Path(__file__).parent)
