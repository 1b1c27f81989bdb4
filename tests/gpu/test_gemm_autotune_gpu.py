"""GEMM autotuning on the CUDA backend (timing cuBLASLt's candidates on a shape's first calls,
each checked bit for bit against the heuristic's first choice; NVTE_GEMM_AUTOTUNE: default large
shapes, 1 every shape, 0 none) and NVTE_GEMM_AUTOTUNE_CACHE (the choices in a file)."""
import os

import pytest
import torch

from transformer_engine import _nvte as nvte

from gpu_util import DT, T, assert_bits_equal, sync
from gemm_gpu_util import (DEV, Operand, ab_shapes, acc_tol, check_close, gen, product_ref, run_repeatedly,
                           uniform, workspace)


def _tn_operands(kind, m, n, k, g):
    """(A [m, k], B [n, k] handles of a TN GEMM, their float64 values): bf16, or E4M3 with scale_inv 0.5."""
    if kind == "e4m3":
        a8 = (torch.randn(m, k, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
        b8 = (torch.randn(n, k, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
        si = torch.tensor([0.5], device=DEV)
        return (T(a8, dtype=DT.kFloat8E4M3, scale_inv=si), T(b8, dtype=DT.kFloat8E4M3, scale_inv=si),
                *(x.view(torch.float8_e4m3fn).double() * 0.5 for x in (a8, b8)))
    a, b = (torch.randn(r, k, device=DEV, generator=g, dtype=torch.bfloat16) for r in (m, n))
    return T(a), T(b), a.double(), b.double()


@pytest.mark.parametrize("kind", ["bfloat16", "e4m3"])
def test_autotune_decides_and_keeps_the_result(kind, monkeypatch, capfd):
    """Default mode at a large shape (the benchmark's Linear M=8192 N=4096 K=4096, above the
    size threshold): the plan's first calls time cuBLASLt's candidates and a choice is logged
    with NVTE_GEMM_AUTOTUNE_LOG=1; every call's output, during and after tuning, is
    bit-identical to NVTE_GEMM_AUTOTUNE=0 (the heuristic's first choice)."""
    g = torch.Generator(device=DEV)
    g.manual_seed(42)
    n, m, k = 8192, 4096, 4096
    ta, tb, _, _ = _tn_operands(kind, m, n, k, g)
    ws = workspace()
    ref = torch.empty(n, m, dtype=torch.bfloat16, device=DEV)
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "0")
    nvte.gemm(ta.t, tb.t, T(ref).t, transa=True, transb=False, workspace=ws.t)
    sync()
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE")
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

    run_repeatedly(8 * 10, call)  # 16 warm-up calls, 7 candidates x 5 timed calls, calls after the choice
    log = capfd.readouterr().err
    print(log)
    assert "[nvte gemm autotune]" in log and f"m={m} n={n} k={k}" in log, log
    assert_bits_equal(outs[-1], ref)


# Small and odd shapes with every epilogue that writes more than D: candidates here may round
# differently from the first choice (seen on the H100), which the check must catch.
_EPILOGUE_CASES = [
    # (n, m, k, transa, transb, what)
    (96, 64, 4096, True, False, "plain"),
    (256, 1536, 2048, True, False, "plain"),
    (512, 2048, 8192, True, False, "plain"),
    (1000, 776, 3000, False, False, "plain"),
    (128, 1024, 4096, True, False, "gelu_aux_bias"),
    (128, 1024, 4096, False, False, "dgelu_bgrad"),
    (1024, 768, 4096, False, True, "bgradb"),
]


@pytest.mark.parametrize("case", _EPILOGUE_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[5]}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_autotune_every_call_matches_the_first_choice(case, dtype, monkeypatch, capfd):
    """NVTE_GEMM_AUTOTUNE=1 (every shape): 80 calls, covering the warm-up, the tuning and the calls
    after the choice; each call's D, GELU aux and bias gradient are bit-identical to those of
    NVTE_GEMM_AUTOTUNE=0. The log names the candidates the check dropped ("differs")."""
    n, m, k, transa, transb, what = case
    torch_dt = getattr(torch, dtype)
    g = gen(45, n, m, k)
    sa, sb = ab_shapes(n, m, k, transa, transb)
    a, b = Operand(sa, dtype, g), Operand(sb, dtype, g)
    bias = uniform((m,), g, -1.0, 1.0).to(torch_dt).to(DEV) if what == "gelu_aux_bias" else None
    pre_in = uniform((n, m), g, -3.0, 3.0).to(torch_dt).to(DEV) if what == "dgelu_bgrad" else None
    dbias_len = m if what == "dgelu_bgrad" else n if what == "bgradb" else 0
    ws = workspace()

    def run_once():
        d = torch.full((n, m), float("nan"), dtype=torch_dt, device=DEV)
        aux = pre_in if pre_in is not None else (
            torch.full((n, m), float("nan"), dtype=torch_dt, device=DEV) if what == "gelu_aux_bias" else None)
        db = torch.full((dbias_len,), float("nan"), dtype=torch_dt, device=DEV) if dbias_len else None
        bias_arg = T(bias).t if bias is not None else (T(db).t if db is not None else None)
        nvte.gemm(a.tg.t, b.tg.t, T(d).t, bias=bias_arg, pre_gelu_out=T(aux).t if aux is not None else None,
                  transa=transa, transb=transb, grad=what in ("dgelu_bgrad", "bgradb"), workspace=ws.t)
        return [x for x in (d, aux if what == "gelu_aux_bias" else None, db) if x is not None]

    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "0")
    ref = run_once()
    sync()
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "1")
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    got = []
    run_repeatedly(80, lambda: got.append(run_once()))
    for outs in got:
        for o, r in zip(outs, ref):
            assert_bits_equal(o, r)
    print(capfd.readouterr().err)


@pytest.mark.parametrize("kind", ["bfloat16", "e4m3"])
def test_autotune_accumulating_call_keeps_one_accumulation_per_call(kind, monkeypatch, capfd):
    """An accumulating call (beta = 1, C = D: a wgrad GEMM adding into a float32 main_grad) at a
    large shape is tuned on a scratch D: the plan logs a choice, and after every call D holds
    exactly one more product, bit-identical to the same calls with NVTE_GEMM_AUTOTUNE=0 (a timed
    run that wrote D in place would add the product again)."""
    g = torch.Generator(device=DEV)
    g.manual_seed(47)
    n, m, k = 4096, 4096, 8192
    ta, tb, a64, b64 = _tn_operands(kind, m, n, k, g)
    ws = workspace()
    start = torch.randn(n, m, device=DEV, generator=g)
    calls = 8 * 10  # 16 warm-up calls, 7 candidates x 5 timed calls, calls after the choice

    def run():
        d = start.clone()
        td = T(d)
        for i in range(calls):
            nvte.gemm(ta.t, tb.t, td.t, transa=True, transb=False, workspace=ws.t, accumulate=True)
            if i % 8 == 7:
                sync()
                snaps.append(d.clone())
        sync()
        return d

    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "0")
    snaps = []
    ref_final = run()
    ref_snaps, snaps = snaps, []
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE")
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    got_final = run()
    log = capfd.readouterr().err
    print(log)
    assert "[nvte gemm autotune]" in log and f"m={m} n={n} k={k}" in log, log
    assert len(snaps) == len(ref_snaps) == calls // 8
    for r, s_ in zip(ref_snaps, snaps):
        assert_bits_equal(s_, r)
    assert_bits_equal(got_final, ref_final)
    # and each call added the product once: the untuned calls against float32 sums of the product
    # the accumulating plan computes (one call into zeros, same plan), start + p + p + ... (one
    # extra product would be off by |p|, about 100 here); then that product against float64
    # (loosely: FP8's fast accumulation over k = 8192 is ~1% off)
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "0")
    p = torch.zeros_like(start)
    nvte.gemm(ta.t, tb.t, T(p).t, transa=True, transb=False, workspace=ws.t, accumulate=True)
    sync()
    want = start.clone()
    for _ in range(calls):
        want += p
    err = (ref_final - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    p64 = b64 @ a64.T
    assert (p.double() - p64).abs().max().item() <= (2e-2 if kind == "e4m3" else 1e-4) * p64.abs().max().item()


def test_autotune_leaves_small_and_fp8_output_calls_alone(monkeypatch, capfd):
    """Default mode: a small shape (below the threshold) and an FP8-output call are not tuned
    (nothing logged)."""
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE", raising=False)
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE_LOG", "1")
    g = torch.Generator(device=DEV)
    g.manual_seed(46)
    ws = workspace()
    small_a = torch.randn(1024, 1024, device=DEV, generator=g, dtype=torch.bfloat16)
    small_d = torch.empty(1024, 1024, device=DEV, dtype=torch.bfloat16)
    big_a = torch.randn(4096, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    big_b = torch.randn(8192, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    big_d = torch.zeros(8192, 4096, device=DEV, dtype=torch.bfloat16)
    a8 = big_a.to(torch.float8_e4m3fn).view(torch.uint8)
    b8 = big_b.to(torch.float8_e4m3fn).view(torch.uint8)
    si = torch.tensor([1.0], device=DEV)
    d8 = torch.empty(8192, 4096, device=DEV, dtype=torch.uint8)
    scale, amax, d8_si = (torch.ones(1, device=DEV), torch.zeros(1, device=DEV), torch.ones(1, device=DEV))
    td8 = T(d8, dtype=DT.kFloat8E4M3, scale=scale, amax=amax, scale_inv=d8_si)

    def calls():
        nvte.gemm(T(small_a).t, T(small_a).t, T(small_d).t, transa=True, transb=False, workspace=ws.t)
        nvte.gemm(T(a8, dtype=DT.kFloat8E4M3, scale_inv=si).t, T(b8, dtype=DT.kFloat8E4M3, scale_inv=si).t,
                  td8.t, transa=True, transb=False, workspace=ws.t)

    run_repeatedly(64, calls)
    assert "[nvte gemm autotune]" not in capfd.readouterr().err


def test_autotune_under_graph_capture(monkeypatch):
    """NVTE_GEMM_AUTOTUNE=1, a plan first used inside a CUDA graph capture: the capture neither
    times nor fails and records the heuristic's first choice, so replays (before and after the
    later eager calls have tuned) give the first choice's bits, as do the tuned eager calls
    (checked candidates only), which also agree with the CPU backend."""
    g = gen(43)
    n, m, k = 2048, 1536, 1024
    a = Operand((m, k), "bfloat16", g)
    b = Operand((n, k), "bfloat16", g)
    ws = workspace()
    ref = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    monkeypatch.setenv("NVTE_GEMM_AUTOTUNE", "0")
    nvte.gemm(a.tg.t, b.tg.t, T(ref).t, transa=True, transb=False, workspace=ws.t)  # the first choice
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
    run_repeatedly(72, lambda: nvte.gemm(a.tg.t, b.tg.t, T(eager).t, transa=True, transb=False, workspace=ws.t))
    assert_bits_equal(eager, ref)
    _, S = product_ref(a, b, True, False)
    check_close(eager, cpu, acc_tol(S, k), torch.bfloat16)
    d.fill_(float("nan"))
    graph.replay()
    sync()
    assert_bits_equal(d, ref)


# A GEMM in a fresh process (settings read at load: the cache file, cuBLASLt's log level):
# argv m n k seed calls; D [n, m] = B [n, k] A [m, k]^T, bf16.
_GEMM_CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join({root!r}, "tests", "gpu"))
from gpu_util import T
from transformer_engine import _nvte as nvte
m, n, k, seed, calls = map(int, sys.argv[1:6])
g = torch.Generator(device="cuda"); g.manual_seed(seed)
a = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
b = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
d = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
ws = T(torch.empty(nvte.gemm_workspace_size(nvte.Backend.CUDA), dtype=torch.uint8, device="cuda"))
for _ in range(calls):
    nvte.gemm(T(a).t, T(b).t, T(d).t, transa=True, transb=False, workspace=ws.t)
torch.cuda.synchronize()
"""


def _run_gemm_child(m, n, k, seed, calls, env=None):
    """_GEMM_CHILD in a new interpreter (env None: this process's environment)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", _GEMM_CHILD.format(root=root), *map(str, (m, n, k, seed, calls))],
                          env=env, capture_output=True, text=True, timeout=300)


def test_autotune_cache_file(tmp_path, monkeypatch, capfd):
    """NVTE_GEMM_AUTOTUNE_CACHE: a tuning process appends its choice to the file; a later process
    with the file (and tuning off) runs that choice from its first call."""
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
    run_repeatedly(80, lambda: nvte.gemm(T(a).t, T(b).t, T(d).t, transa=True, transb=False, workspace=ws.t))
    assert "[nvte gemm autotune]" in capfd.readouterr().err
    lines = cache.read_text().splitlines()
    assert len(lines) == 1 and " -> " in lines[0], lines
    chosen = int(lines[0].split(" -> ")[1].split()[0])
    monkeypatch.delenv("NVTE_GEMM_AUTOTUNE")
    child = _run_gemm_child(4096, 8192, 4096, 44, 1)
    assert child.returncode == 0, child.stderr
    assert f"from NVTE_GEMM_AUTOTUNE_CACHE -> #{chosen}" in child.stderr, child.stderr
    assert cache.read_text().splitlines() == lines  # reading does not write


def test_autotune_warmup_calls_run_untimed(tmp_path):
    """A tuned plan's first 16 calls run the first choice once each, untimed (a shape that does
    not recur never pays a timed call's extra runs); its 17th call is the first timed one, which
    runs a candidate and the first choice twice each. Counted in cuBLASLt's own trace of its
    matmul calls (CUBLASLT_LOG_LEVEL=2), in a child process (the log level is read at load)."""
    counts = {}
    for calls in (16, 17):
        log = tmp_path / f"lt_{calls}.log"
        env = dict(os.environ, NVTE_GEMM_AUTOTUNE="1", CUBLASLT_LOG_LEVEL="2", CUBLASLT_LOG_FILE=str(log))
        env.pop("NVTE_GEMM_AUTOTUNE_CACHE", None)
        child = _run_gemm_child(2048, 4096, 1024, 47, calls, env)
        assert child.returncode == 0, child.stderr
        counts[calls] = sum("[cublasLtMatmul]" in line for line in log.read_text().splitlines())
    assert counts == {16: 16, 17: 16 + 2 * 2}, counts
