"""benchmarks/host_overhead.py runs on the CPU (in a subprocess: it sets NVTE_FUSED_ATTN and may
stub the library for the whole process) and prints one row per module."""
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "host_overhead.py")


@pytest.mark.parametrize("extra", [[], ["--stub-library"]])
def test_host_overhead_benchmark_tiny_cpu(extra):
    res = subprocess.run([sys.executable, BENCH, "--calls", "2", "--modules", "Linear", "DotProductAttention",
                          *extra], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines() if line.strip()}
    for name in ("Linear", "DotProductAttention"):
        assert len(rows[name]) == 4 and all(float(v) > 0 for v in rows[name]), res.stdout
    assert "fp8_autocast region" in res.stdout
