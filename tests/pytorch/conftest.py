import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    from transformer_engine.pytorch.fp8 import FP8GlobalState
    FP8GlobalState.reset()
    yield
    FP8GlobalState.reset()
