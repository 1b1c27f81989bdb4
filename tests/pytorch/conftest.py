import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")


def pytest_addoption(parser):
    parser.addoption("--nvte-device", default=None, choices=("cpu", "cuda"),
                     help="device of the device-agnostic PyTorch adapter tests (same as NVTE_TEST_DEVICE)")


def pytest_configure(config):
    d = config.getoption("--nvte-device", default=None)
    if d:
        os.environ["NVTE_TEST_DEVICE"] = d
    if os.environ.get("NVTE_TEST_DEVICE", "cpu").startswith("cuda") and not torch.cuda.is_available():
        pytest.exit("NVTE_TEST_DEVICE=cuda but torch.cuda.is_available() is False", returncode=4)


def pytest_report_header(config):
    return f"NVTE_TEST_DEVICE={os.environ.get('NVTE_TEST_DEVICE', 'cpu')} (device of the device-agnostic tests)"


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    from transformer_engine.pytorch.fp8 import FP8GlobalState
    FP8GlobalState.reset()
    yield
    FP8GlobalState.reset()
