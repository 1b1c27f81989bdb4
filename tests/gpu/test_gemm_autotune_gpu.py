"""NVTE_GEMM_AUTOTUNE (timing cuBLASLt's candidates on a shape's first calls) and
NVTE_GEMM_AUTOTUNE_CACHE (the choices in a file) on the CUDA GEMM."""
import os

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, assert_bits_equal, sync
from gemm_gpu_util import (DEV, Operand, acc_tol, check_close, gen, product_ref, run_repeatedly, workspace)


@pytest.mark.parametrize("kind", ["bfloat16", "e4m3"])
def test_autotune_decides_and_keeps_the_result(kind, monkeypatch, capfd):
    """NVTE_GEMM_AUTOTUNE=1: a plan's first calls time cuBLASLt's candidates and the fastest is
    kept, logged with NVTE_GEMM_AUTOTUNE_LOG=1. At this shape (the benchmark's Linear M=8192
    N=4096 K=4096, 8 candidates on the H100) every call's output is bit-identical to the
    heuristic's first choice (the default, checked against the CPU above)."""
    g = torch.Generator(device=DEV)
    g.manual_seed(42)
    n, m, k = 8192, 4096, 4096
    if kind == "e4m3":
        a8 = (torch.randn(m, k, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
        b8 = (torch.randn(n, k, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
        si = torch.tensor([0.5], device=DEV)
        ta, tb = T(a8, dtype=DT.kFloat8E4M3, scale_inv=si), T(b8, dtype=DT.kFloat8E4M3, scale_inv=si)
    else:
        ta = T(torch.randn(m, k, device=DEV, generator=g, dtype=torch.bfloat16))
        tb = T(torch.randn(n, k, device=DEV, generator=g, dtype=torch.bfloat16))
    ws = workspace()
    ref = torch.empty(n, m, dtype=torch.bfloat16, device=DEV)
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE", raising=False)  # the default: the heuristic's choice
    nvte.gemm(ta.t, tb.t, T(ref).t, transa=True, transb=False, workspace=ws.t)
    sync()
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    outs = [torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(8)]
    it = iter(range(1 << 30))

    def call():
        i = next(it)
        nvte.gemm(ta.t, tb.t, T(outs[i % 8]).t, transa=True, transb=False, workspace=ws.t)
        if i % 8 == 7:  # every output of the batch (different candidates) is the reference
            sync()
            for o in outs:
                assert_bits_equal(o, ref)

    run_repeatedly(8 * 8, call)  # 8 candidates x 5 samples, plus the calls after the choice
    log = capfd.readouterr().err
    assert "[nvte gemm autotune]" in log and f"m={m} n={n} k={k}" in log, log
    assert_bits_equal(outs[-1], ref)


def test_autotune_under_graph_capture(monkeypatch):
    """NVTE_GEMM_AUTOTUNE=1, a plan first used inside a CUDA graph capture: the capture neither
    times nor fails and records the heuristic's first choice, so replays (before and after the
    later eager calls have tuned) give the default path's bits; the tuned eager calls agree with
    the CPU backend (their algorithm may round differently at this size)."""
    g = gen(43)
    n, m, k = 2048, 1536, 1024
    a = Operand((m, k), "bfloat16", g)
    b = Operand((n, k), "bfloat16", g)
    ws = workspace()
    ref = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    nvte.gemm(a.tg.t, b.tg.t, T(ref).t, transa=True, transb=False, workspace=ws.t)  # default: first choice
    cpu = torch.full((n, m), float("nan"), dtype=torch.bfloat16)
    nvte.gemm(a.tc.t, b.tc.t, T(cpu).t, transa=True, transb=False)
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    d = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            nvte.gemm(a.tg.t, b.tg.t, T(d).t, transa=True, transb=False, workspace=ws.t,
                      stream=side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    sync()
    assert_bits_equal(d, ref)
    eager = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    run_repeatedly(48, lambda: nvte.gemm(a.tg.t, b.tg.t, T(eager).t, transa=True, transb=False, workspace=ws.t))
    _, S = product_ref(a, b, True, False)
    check_close(eager, cpu, acc_tol(S, k), torch.bfloat16)
    d.fill_(float("nan"))
    graph.replay()
    sync()
    assert_bits_equal(d, ref)


_CACHE_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join({root!r}, "tests", "gpu"))
from gpu_util import DT, T
from transformer_engine import _nvte as nvte
g = torch.Generator(device="cuda"); g.manual_seed(44)
a = torch.randn(4096, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
b = torch.randn(8192, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
d = torch.empty(8192, 4096, dtype=torch.bfloat16, device="cuda")
ws = T(torch.empty(nvte.gemm_workspace_size(nvte.Backend.CUDA), dtype=torch.uint8, device="cuda"))
nvte.gemm(T(a).t, T(b).t, T(d).t, transa=True, transb=False, workspace=ws.t)
torch.cuda.synchronize()
"""


def test_autotune_cache_file(tmp_path, monkeypatch, capfd):
    """NVTE_GEMM_AUTOTUNE_CACHE: a tuning process appends its choice to the file; a later process
    with the file (and tuning off) runs that choice from its first call."""
    import subprocess
    import sys
    cache = tmp_path / "gemm_tune.txt"
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_CACHE", str(cache))
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    g = torch.Generator(device=DEV)
    g.manual_seed(44)
    a = torch.randn(4096, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    b = torch.randn(8192, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    d = torch.empty(8192, 4096, dtype=torch.bfloat16, device=DEV)
    ws = workspace()
    run_repeatedly(64, lambda: nvte.gemm(T(a).t, T(b).t, T(d).t, transa=True, transb=False, workspace=ws.t))
    assert "[nvte gemm autotune]" in capfd.readouterr().err
    lines = cache.read_text().splitlines()
    assert len(lines) == 1 and " -> " in lines[0], lines
    chosen = int(lines[0].split(" -> ")[1].split()[0])
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run([sys.executable, "-c", _CACHE_CHILD.format(root=root)], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    assert f"from NVTE_GEMM_AUTOTUNE_CACHE -> #{chosen}" in child.stderr, child.stderr
    assert cache.read_text().splitlines() == lines  # reading does not write
