"""Inference attention over a K/V cache, forward only, BF16, in one process: this library's paged
cache (NVTE_Paged_KV_BSHD_BSHD_BSHD, pages in shuffled order), its contiguous BSHD cache with the
padding mask, and its THD queries over the contiguous cache (thd_bshd_bshd), against PyTorch's
scaled_dot_product_attention (flash and cuDNN backends) on the contiguous cache. All sequences
have the full cache length here (torch's fused backends take no per-sequence lengths), so every
variant reads the same keys; b=16, 32 query heads over 8 K/V heads, head dim 128, cache 4096
tokens, page 64. Rows: the decode step (1 new token per sequence; memory-bound: GB/s counts the
K and V bytes read) and a chunk of 128 new tokens (bottom-right causal); THD queries over the
contiguous and over the paged cache (TE's inference layouts). Timed alternately
(gpu_harness.time_alternating_ms). --json FILE: the times for run_on_device.sh's ab step."""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, time_alternating_ms  # noqa: E402

from transformer_engine import _nvte as nvte  # noqa: E402

L, M, BT, ST = nvte.NVTE_QKV_Layout, nvte.NVTE_Mask_Type, nvte.NVTE_Bias_Type, nvte.NVTE_Softmax_Type
B, HQ, HKV, D, SKV, PAGE = 16, 32, 8, 128, 4096, 64


def handle(x):
    t = nvte.Tensor()
    nv = {torch.bfloat16: nvte.DType.kBFloat16, torch.int32: nvte.DType.kInt32}[x.dtype]
    t.set_param(nvte.Param.kRowwiseData, x.data_ptr(), list(x.shape), nv)
    t._refs = x
    return t


class Ours:
    """One forward configuration of the library, buffers allocated once."""

    def __init__(self, layout, q, k, v, sq, mask, tables=None):
        cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda") * sq
        cu_kv = torch.arange(B + 1, dtype=torch.int32, device="cuda") * SKV
        self.H = [handle(x) for x in (q, k, v)]
        self.o = torch.empty(q.shape[:-1] + (D,), dtype=torch.bfloat16, device="cuda")
        self.ot = handle(self.o)
        sc = dict(max_seqlen_q=sq, max_seqlen_kv=SKV, attn_scale=1.0 / math.sqrt(D), dropout=0.0,
                  qkv_layout=layout, bias_type=BT.NVTE_NO_BIAS, attn_mask_type=mask,
                  softmax_type=ST.NVTE_VANILLA_SOFTMAX, window_size_left=-1, window_size_right=-1,
                  bottom_right_diagonal=False)
        ws = nvte.fused_attn_fwd_workspace_size(*self.H, None, sq, SKV, False, False, 0.0, layout, BT.NVTE_NO_BIAS,
                                                mask, ST.NVTE_VANILLA_SOFTMAX)
        self.ws = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
        wst = nvte.Tensor()
        wst.set_param(nvte.Param.kRowwiseData, self.ws.data_ptr(), [self.ws.numel()], nvte.DType.kByte)
        self.keep = [cu_q, cu_kv, tables, wst]
        self.kw = dict(Bias=None, SoftmaxOffset=None, S=None, cu_seqlens_q=handle(cu_q), cu_seqlens_kv=handle(cu_kv),
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                       page_table_k=handle(tables[0]) if tables else None,
                       page_table_v=handle(tables[1]) if tables else None, rng_state=None, is_training=False,
                       return_max_logit=False, cuda_graph=False, workspace=wst, **sc)

    def __call__(self):
        nvte.fused_attn_fwd(*self.H, O=self.ot, aux=None, **self.kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="also write {case: {metric: value}} here (run_on_device.sh's ab step)")
    args = ap.parse_args()
    rep = Report()
    group = "attention over a K/V cache (forward, BF16)"
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B, SKV, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(B, SKV, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    per = SKV // PAGE
    perm = torch.randperm(B * per, generator=torch.Generator().manual_seed(1))
    kc = torch.empty(B * per, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.empty_like(kc)
    kc[perm] = k.view(B * per, PAGE, HKV, D)  # chunk c of the contiguous cache goes to page perm[c]
    vc[perm] = v.view(B * per, PAGE, HKV, D)
    table = perm.view(B, per).to(torch.int32).cuda()
    kv_bytes = 2 * B * SKV * HKV * D * 2
    for sq in (1, 128):
        q = torch.randn(B, sq, HQ, D, generator=g, device="cuda").to(torch.bfloat16)
        mask = M.NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK
        paged = Ours(L.NVTE_Paged_KV_BSHD_BSHD_BSHD, q, kc, vc, sq, mask, (table, table))
        contig = Ours(L.NVTE_BSHD_BSHD_BSHD, q, k, v, sq, mask)
        thd = Ours(L.NVTE_THD_BSHD_BSHD, q.reshape(B * sq, HQ, D), k, v, sq, mask)
        paged_thd = Ours(L.NVTE_Paged_KV_THD_BSHD_BSHD, q.reshape(B * sq, HQ, D), kc, vc, sq, mask, (table, table))
        paged(), contig(), thd(), paged_thd()
        torch.cuda.synchronize()
        for other in (contig, thd, paged_thd):  # same keys through another layout: bfloat16-close (a wrong page: O(1))
            torch.testing.assert_close(other.o.reshape(paged.o.shape), paged.o, rtol=2e-2, atol=2e-2)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        causal = sq > 1  # torch's is_causal is top-left: give the chunk an explicit bottom-right mask
        attn_mask = (torch.ones(sq, SKV, dtype=torch.bool, device="cuda").tril(SKV - sq) if causal else None)

        def torch_sdpa(backend):
            def run():
                with torch.nn.attention.sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, enable_gqa=True)
            return run

        fns = [(lambda f: lambda: f())(f) for f in (paged, contig, thd, paged_thd)]  # argument-free (the timer
        # passes an index to functions that take one)
        names = ["ours paged (page 64)", "ours contiguous bshd", "ours thd queries, bshd cache",
                 "ours thd queries, paged cache"]
        backends = [("torch flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                    ("torch cuDNN", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                    ("torch efficient", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)]
        for name, be in backends:
            try:
                torch_sdpa(be)()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"sq={sq}: {name} unavailable: {str(e).splitlines()[0][:120]}")
                continue
            fns.append(torch_sdpa(be))
            names.append(name)
        ms = time_alternating_ms(fns)
        for name, t in zip(names, ms):
            rep.add(group, f"sq={sq} skv={SKV} b={B} {name}", ms=t, kv_GBps=kv_bytes / t / 1e6,
                    speed_vs_paged=ms[0] / t)
    print(rep.markdown())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({case: {"ms": m["ms"]} for _, case, m in rep.rows}, fh, indent=1)


if __name__ == "__main__":
    main()
