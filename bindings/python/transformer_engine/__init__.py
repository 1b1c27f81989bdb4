"""transformer_engine: FP8 / BF16 building blocks for transformer models.

The compiled core is libtransformer_engine.so (C API nvte_*), reached from Python
through the framework-neutral module transformer_engine._nvte. Framework adapters
live in transformer_engine.pytorch, transformer_engine.jax and transformer_engine.paddle.
"""
from pathlib import Path as _Path

from . import _nvte  # noqa: F401  (loads libtransformer_engine.so)

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
