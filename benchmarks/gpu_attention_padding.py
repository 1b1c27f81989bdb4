"""Fused attention with padding masks (per-sequence lengths from cu_seqlens), BF16 and FP8, forward
and forward + backward: b=4, 32 heads, head dim 128, max length 2048, BSHD; and the same
sequences packed as THD (BF16). What it isolates is
the library's own work around cuDNN's graph for padded batches (zeroing the rows outside the
lengths), so the same calls without padding (no_mask at the full length) are timed alongside as
the floor. PyTorch's SDPA has no per-sequence lengths in its flash / cuDNN backends, so there is
no torch row; to compare two builds of the library, run this once per build (alternating) with
--json and compare the files (the kernels are cuDNN's in both).

  python benchmarks/gpu_attention_padding.py [--json out.json]"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_attention import OursFp8, handle  # noqa: E402
from gpu_harness import Report, time_alternating_ms  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
B, H, D, S = 4, 32, 128, 2048
TIMING = dict(rounds=3, iters=15, warmup=3, inner=4)


class Padded:
    """One BF16 configuration (buffers allocated once); lens None: no padding mask; thd: the same
    sequences packed as THD tensors [sum(lens), h, d] (layout thd_thd_thd, no gaps)."""

    def __init__(self, mask, lens, thd=False):
        dev = "cuda"
        shape = (sum(lens), H, D) if thd else (B, S, H, D)
        mk = lambda: torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        self.q, self.k, self.v, self.do = mk(), mk(), mk(), mk()
        self.o = torch.empty_like(self.q)
        self.dq, self.dk, self.dv = (torch.empty_like(self.q) for _ in range(3))
        self.sc = dict(max_seqlen_q=S, max_seqlen_kv=S, attn_scale=1.0 / math.sqrt(D), dropout=0.0,
                       qkv_layout=L.NVTE_THD_THD_THD if thd else L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS, attn_mask_type=mask,
                       softmax_type=ST.NVTE_VANILLA_SOFTMAX, window_size_left=-1, window_size_right=-1,
                       bottom_right_diagonal=False)
        self.H = [handle(x) for x in (self.q, self.k, self.v)]
        sc = self.sc
        wf = nvte.fused_attn_fwd_workspace_size(*self.H, None, S, S, True, False, 0.0, sc["qkv_layout"],
                                                sc["bias_type"], mask, sc["softmax_type"])
        wb = nvte.fused_attn_bwd_workspace_size(*self.H, None, S, S, 0.0, sc["qkv_layout"], sc["bias_type"], mask,
                                                sc["softmax_type"])
        self.ws = torch.empty(max(wf, wb, 1), dtype=torch.uint8, device=dev)
        self.rng = torch.zeros(2, dtype=torch.int64, device=dev)
        cu = None
        if lens is not None:
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        self.cu = handle_i32(cu) if cu is not None else None
        self.kw = dict(Bias=None, SoftmaxOffset=None, S=None, cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
                       rng_state=handle(self.rng), is_training=True, return_max_logit=False, cuda_graph=False,
                       workspace=handle(self.ws), stream=torch.cuda.current_stream().cuda_stream, **sc)
        self.ot = handle(self.o)
        described = nvte.fused_attn_fwd(*self.H, O=self.ot, aux=[], **self.kw)
        dt = {nvte.DType.kFloat32: torch.float32, nvte.DType.kInt64: torch.int64}
        self.aux_bufs = [torch.zeros(shape, dtype=dt[d], device=dev) for shape, d in described]
        self.aux = [handle(a) for a in self.aux_bufs]
        self.G = [handle(x) for x in (self.dq, self.dk, self.dv)]
        self.dot = handle(self.do)

    def fwd(self):
        nvte.fused_attn_fwd(*self.H, O=self.ot, aux=self.aux, **self.kw)

    def bwd(self):
        nvte.fused_attn_bwd(*self.H, self.ot, self.dot, None, None, self.aux, *self.G, None, None, self.cu, self.cu,
                            None, None, deterministic=False, cuda_graph=False, workspace=self.kw["workspace"],
                            stream=self.kw["stream"], **self.sc)

    def fwd_bwd(self):
        self.fwd()
        self.bwd()


class PaddedFp8(OursFp8):
    def fwd_bwd(self):
        self.fwd()
        nvte.fused_attn_bwd(*self.H, self.oin, self.dot, self.S, self.dP, self.aux, *self.G, None, None,
                            self.kw["cu_seqlens_q"], self.kw["cu_seqlens_kv"], None, None, deterministic=False,
                            cuda_graph=False, workspace=self.kw["workspace"], stream=self.kw["stream"], **self.sc)


def handle_i32(x):
    t = nvte.Tensor()
    t.set_param(nvte.Param.kRowwiseData, x.data_ptr(), list(x.shape), nvte.DType.kInt32)
    t._refs = x
    return t


def check_padded_rows_zero(p, lens):
    """The rows past each length must be zero in O and in the gradients (what the timed work is for)."""
    p.fwd_bwd()
    torch.cuda.synchronize()
    if p.q.dim() == 3:  # THD: packed, no rows to check
        return
    for name, x in (("o", p.o), ("dq", p.dq), ("dk", p.dk), ("dv", p.dv)):
        for b, n in enumerate(lens):
            tail = x[b, n:]
            assert tail.numel() == 0 or not tail.view(torch.uint8).any(), f"{name}: rows past length {n} not zero"


def bench_case(report, out, name, mask, lens, thd=False):
    p = Padded(mask, lens, thd)
    if lens is not None:
        check_padded_rows_zero(p, lens)
    fwd, fb = time_alternating_ms([lambda: p.fwd(), lambda: p.fwd_bwd()], **TIMING)
    report.add("attention_padding", f"bf16 b={B} h={H} d={D} s={S} {name}", fwd_ms=fwd, fwd_bwd_ms=fb)
    out["bf16 " + name] = dict(fwd_ms=fwd, fwd_bwd_ms=fb)
    if mask == M.NVTE_PADDING_CAUSAL_MASK and not thd:  # (FP8 THD: not on the GPU, cuDNN's FP8 backward)
        f = PaddedFp8(p)
        f.fwd_bwd()
        torch.cuda.synchronize()
        fwd8, fb8 = time_alternating_ms([lambda: f.fwd(), lambda: f.fwd_bwd()], **TIMING)
        report.add("attention_padding", f"fp8 b={B} h={H} d={D} s={S} {name}", fwd_ms=fwd8, fwd_bwd_ms=fb8)
        out["fp8 " + name] = dict(fwd_ms=fwd8, fwd_bwd_ms=fb8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write {case: {metric: value}} here")
    args = ap.parse_args()
    report = Report()
    ragged = [2048, 1536, 1024, 512]
    cases = [("no_mask (full lengths, floor)", M.NVTE_NO_MASK, None),
             ("padding, lengths all 2048", M.NVTE_PADDING_MASK, [S] * B),
             ("padding, lengths 2048/1536/1024/512", M.NVTE_PADDING_MASK, ragged),
             ("padding_causal, lengths 2048/1536/1024/512", M.NVTE_PADDING_CAUSAL_MASK, ragged)]
    out = {}
    for name, mask, lens in cases:
        bench_case(report, out, name, mask, lens)
        torch.cuda.empty_cache()
    for name, mask in (("thd, padding", M.NVTE_PADDING_MASK), ("thd, padding_causal", M.NVTE_PADDING_CAUSAL_MASK)):
        bench_case(report, out, f"{name}, lengths 2048/1536/1024/512 packed", mask, ragged, thd=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
