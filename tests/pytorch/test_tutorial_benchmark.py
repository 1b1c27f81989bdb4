"""benchmarks/gpu_tutorial_layer.py end to end at a tiny size on the CPU: every variant it can run
here runs, and the TE layer computes what the plain PyTorch reference layer (same weights) does."""
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def test_tutorial_layer_benchmark_tiny_cpu(tmp_path):
    sys.path.insert(0, os.path.abspath(BENCH))
    try:
        import gpu_tutorial_layer as bench
    finally:
        sys.path.pop(0)
    res = bench.main(["--tiny", "--device", "cpu", "--no-compile", "--iters", "2", "--warmup", "1", "--inner", "1",
                      "--out", str(tmp_path)])
    assert set(res) == set("abcdefg")
    assert res["b"][1].startswith("skipped") and res["c"][1].startswith("skipped")
    for v in "adefg":
        ms, note, err = res[v]
        assert ms is not None and ms > 0 and note == "", (v, note)
    assert res["a"][2] == 0.0
    assert res["d"][2] < 1e-2  # bf16 layer vs bf16 reference
    for v in "efg":  # FP8 (f, g: attention too): an FP8-sized difference
        assert 1e-4 < res[v][2] < 5e-2, (v, res[v][2])
    md = (tmp_path / "tutorial_layer.md").read_text()
    assert "| (e) te.TransformerLayer FP8 DelayedScaling |" in md and "skipped (--no-compile)" in md
    with pytest.raises(SystemExit, match="unknown variant"):
        bench.main(["--tiny", "--device", "cpu", "--only", "x", "--out", str(tmp_path)])
