"""GPU tests: every test here carries the `gpu` marker and is skipped (with the reason)
when no CUDA device or no CUDA backend is available. They compare the CUDA backend with
the CPU backend (the oracle) on the same inputs."""
import pytest

collect_ignore = []


def _gpu_skip_reason():
    try:
        import torch
    except ImportError:
        return "needs torch to allocate CUDA memory"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from transformer_engine import _nvte

    if not _nvte.cuda_backend_available():
        return "needs the CUDA backend (library built without it)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
