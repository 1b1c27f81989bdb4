"""Fused attention (nvte_fused_attn_fwd + _bwd, cuDNN through this library) against PyTorch's
scaled_dot_product_attention with its flash and cuDNN backends, forward + backward, in one
process: batch 4, 32 heads, head dim 128, BF16, sequence 2048 and 8192, causal and not.

Ours: BSHD tensors, workspace and aux buffers allocated once, calls back to back. PyTorch: the
same BSHD storage viewed as [b, h, s, d], sdpa forward then autograd backward with a given dO
(its autograd bookkeeping is part of its time, as in training). TFLOP/s counts 4 b h s^2 d for
the forward (half when causal) and 2.5x that for the backward."""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, time_ms  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
B, H, D = 4, 32, 128


def handle(x, dtype=None):
    t = nvte.Tensor()
    nv = dtype if dtype is not None else {torch.bfloat16: nvte.DType.kBFloat16, torch.float32: nvte.DType.kFloat32,
                                          torch.int64: nvte.DType.kInt64, torch.uint8: nvte.DType.kByte}[x.dtype]
    t.set_param(nvte.Param.kRowwiseData, x.data_ptr(), list(x.shape), nv)
    t._refs = x
    return t


class Ours:
    def __init__(self, s, causal):
        dev = "cuda"
        mk = lambda: torch.randn(B, s, H, D, device=dev, dtype=torch.bfloat16)
        self.q, self.k, self.v, self.do = mk(), mk(), mk(), mk()
        self.o = torch.empty_like(self.q)
        self.dq, self.dk, self.dv = (torch.empty_like(self.q) for _ in range(3))
        self.sc = dict(max_seqlen_q=s, max_seqlen_kv=s, attn_scale=1.0 / math.sqrt(D), dropout=0.0,
                       qkv_layout=L.NVTE_BSHD_BSHD_BSHD, bias_type=BT.NVTE_NO_BIAS,
                       attn_mask_type=M.NVTE_CAUSAL_MASK if causal else M.NVTE_NO_MASK,
                       softmax_type=ST.NVTE_VANILLA_SOFTMAX, window_size_left=-1, window_size_right=-1,
                       bottom_right_diagonal=False)
        self.H = [handle(x) for x in (self.q, self.k, self.v)]
        sc = self.sc
        wf = nvte.fused_attn_fwd_workspace_size(*self.H, None, s, s, True, False, 0.0, sc["qkv_layout"],
                                                sc["bias_type"], sc["attn_mask_type"], sc["softmax_type"])
        wb = nvte.fused_attn_bwd_workspace_size(*self.H, None, s, s, 0.0, sc["qkv_layout"], sc["bias_type"],
                                                sc["attn_mask_type"], sc["softmax_type"])
        self.ws = torch.empty(max(wf, wb, 1), dtype=torch.uint8, device=dev)
        self.rng = torch.zeros(2, dtype=torch.int64, device=dev)
        self.kw = dict(Bias=None, SoftmaxOffset=None, S=None, cu_seqlens_q=None, cu_seqlens_kv=None,
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

    def fwd_bwd(self):
        self.fwd()
        sc = self.sc
        nvte.fused_attn_bwd(*self.H, self.ot, self.dot, None, None, self.aux, *self.G, None, None, None, None,
                            None, None, deterministic=False, cuda_graph=False, workspace=self.kw["workspace"],
                            stream=self.kw["stream"], **sc)


def torch_fwd_bwd(o, causal, backend):
    from torch.nn.attention import sdpa_kernel

    q, k, v = (x.detach().transpose(1, 2).requires_grad_(True) for x in (o.q, o.k, o.v))
    do = o.do.transpose(1, 2)

    def step():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(do)
        q.grad = k.grad = v.grad = None
    return step


def run(report):
    from torch.nn.attention import SDPBackend

    for s in (2048, 8192):
        for causal in (False, True):
            o = Ours(s, causal)
            flops_f = 4.0 * B * H * s * s * D * (0.5 if causal else 1.0)
            flops = flops_f * 3.5
            # Correctness against PyTorch's math (float32) on the same inputs, forward only.
            o.fwd()
            torch.cuda.synchronize()
            with torch.no_grad():
                ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (o.q, o.k, o.v)),
                                                     is_causal=causal).transpose(1, 2)
            err = ((o.o.float() - ref).abs().max() / ref.abs().max()).item()
            t_ours = time_ms(lambda: o.fwd_bwd(), iters=15, warmup=3, inner=4)
            row = dict(ours_ms=t_ours, ours_TFLOPs=flops / t_ours / 1e9, max_rel_err_fwd=err)
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    t = time_ms(torch_fwd_bwd(o, causal, be), iters=15, warmup=3, inner=4)
                    row[f"torch_{name}_ms"] = t
                    row[f"ratio_vs_{name}"] = t / t_ours
                except Exception as e:  # a backend PyTorch cannot run here
                    print(f"[attention] torch {name} backend failed: {e}")
                    row[f"torch_{name}_ms"] = float("nan")
                    row[f"ratio_vs_{name}"] = float("nan")
            report.add("attention", f"bf16 fwd+bwd b={B} h={H} d={D} s={s} {'causal' if causal else 'no_mask'}",
                       **row)
            del o
            torch.cuda.empty_cache()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    rep = Report()
    run(rep)
    md = rep.markdown()
    print(md)
    with open(os.path.join(a.out, "bench_attention.md"), "w") as f:
        f.write(md)
