"""Context-parallel attention (DotProductAttention with cp_group) across the GPUs of one host.

Usage: python benchmarks/gpu_context_parallel.py [n_gpus] (default: all); CP_PROFILE=1: rank 0's
kernel times of the p2p ring at s=16384 instead (torch.profiler; CP_PROFILE=fp8: the FP8 ring). Starts one process per GPU
(NCCL). Rank 0 first times DotProductAttention over the whole sequence on its own GPU (the
others wait); then every comm type (p2p, all_gather, a2a) runs with the sequence split over the
ranks in TE's load-balanced chunk order (with 4 or more GPUs also "a2a+p2p": a2a inside pairs of
consecutive ranks, the ring over the pairs). BF16, forward + backward, b=1, 32 heads (8 key/value
heads in the GQA rows), head dim 128, causal; then FP8 attention (fp8_dpa, DelayedScaling, amaxes
reduced over the CP group) with p2p (K/V travel in FP8) and a2a, their "1 GPU" column being our
FP8 attention on one GPU; a last row of packed THD sequences (THD_LENS) through the ring. Columns: ms per fwd+bwd (rank 0's median, CUDA
events), speed-up over one GPU and its efficiency (speed-up / GPUs). The "torch CP" rows: PyTorch's
experimental context_parallel around F.scaled_dot_product_attention on the same tensors (same
1-GPU baseline column: ours), where it runs."""
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = [(16384, 32), (32768, 32), (32768, 8)]  # (sequence, key/value heads)
FP8_RECIPE = None  # DelayedScaling(fp8_dpa=True), made in rank_main
B, H, D = 1, 32, 128


def want(part: str) -> bool:
    """CP_COMMS (comma-separated; default all): the rows to run, of p2p, all_gather, a2a, a2a+p2p,
    fp8, torch, thd. CP_FP8_GROUP=0: the fp8 rows without fp8_group (no amax all-reduce)."""
    sel = os.environ.get("CP_COMMS")
    return sel is None or part in sel.split(",")


def chunks_of(x, rank, size):
    parts = x.chunk(2 * size, dim=1)
    return torch.cat([parts[rank], parts[2 * size - 1 - rank]], dim=1).contiguous()


def step_fn(dpa, q, k, v, do, fp8=None):
    """One fwd+bwd; fp8: (recipe, fp8_group) to run under fp8_autocast."""
    import transformer_engine.pytorch as te

    def run(_=None):
        for t in (q, k, v):
            t.grad = None
        if fp8 is None:
            dpa(q, k, v).backward(do)
            return
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8[0], fp8_group=fp8[1]):
            o = dpa(q, k, v)
        o.backward(do)
    return run


_MESH = []


def torch_cp_ms(q, k, v, do, size, rotate):
    """PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel:
    ring attention around F.scaled_dot_product_attention, its default backend choice, causal with its
    load balancing) on the same whole-sequence tensors; rotate: its K/V exchange ("allgather" or
    "alltoall"). q, k, v, do: [b, s, h, d]."""
    import torch.nn.functional as F
    from gpu_harness import time_ms
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    if not _MESH:
        _MESH.append(init_device_mesh("cuda", (size,)))
    set_rotate_method(rotate)
    qt, kt, vt, dot = (t.reshape(B, t.shape[1], -1, D).transpose(1, 2).contiguous() for t in (q, k, v, do))
    with context_parallel(_MESH[0], buffers=[qt, kt, vt, dot], buffer_seq_dims=[2, 2, 2, 2]):
        # new leaves on the local shards (the buffers themselves are restored at exit, which a tensor
        # that requires grad does not allow)
        qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))

        def run(_=None):
            for t in (qg, kg, vg):
                t.grad = None
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dot)
        return time_ms(run, iters=10, warmup=3, inner=2)


def profile_p2p(rank, group, s=16384, g=32, fp8=False):
    """Rank 0's device time by kernel for 3 p2p fwd+bwd steps (torch.profiler), top 20; fp8: the
    FP8 ring (fp8_dpa)."""
    import transformer_engine.pytorch as te
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, s, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (H, g, g, H))
    ql, kl, vl = (chunks_of(t, rank, size=dist.get_world_size(group)).requires_grad_() for t in (q, k, v))
    dol = chunks_of(do.reshape(B, s, H * D), rank, dist.get_world_size(group))
    dpa = te.DotProductAttention(H, D, num_gqa_groups=g, attention_dropout=0.0, qkv_format="bshd",
                                 attn_mask_type="causal", cp_group=group, cp_comm_type="p2p")
    run = step_fn(dpa, ql, kl, vl, dol, (FP8_RECIPE, group) if fp8 else None)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


THD_LENS = [4096, 8192, 12288, 8192]  # packed sequences (32768 tokens), multiples of 2 cp_size


def thd_rows(rank, size, group, iters=None):
    """Packed THD sequences through the p2p ring (cu_seqlens of the whole sequences), causal."""
    from gpu_harness import time_ms
    import transformer_engine.pytorch as te
    lens = THD_LENS
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(sum(lens), n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for n in (H, H, H, H))
    do = do.reshape(sum(lens), H * D)

    def step(dpa, q_, k_, v_, do_):
        def run(_=None):
            for t in (q_, k_, v_):
                t.grad = None
            dpa(q_, k_, v_, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                max_seqlen_kv=max(lens)).backward(do_)
        return run
    full_ms = None
    if rank == 0 and iters is None:
        dpa = te.DotProductAttention(H, D, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding_causal")
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        full_ms = time_ms(step(dpa, qq, kk, vv, do), iters=10, warmup=3, inner=2)
    dist.barrier()
    idx = []
    start = 0
    for n in lens:
        c = n // (2 * size)
        for chunk in (rank, 2 * size - 1 - rank):
            idx.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
        start += n
    idx = torch.cat(idx).cuda()
    ql, kl, vl = (t[idx].contiguous().requires_grad_() for t in (q, k, v))
    dpa = te.DotProductAttention(H, D, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding_causal",
                                 cp_group=group, cp_comm_type="p2p")
    run = step(dpa, ql, kl, vl, do[idx].contiguous())
    if iters is not None:  # (profiling: just run)
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
        return []
    ms = time_ms(run, iters=10, warmup=3, inner=2)
    return [(f"thd {sum(lens)}", H, "p2p", full_ms, ms)] if rank == 0 else []


def rank_main(rank, size, init_file):
    from gpu_harness import time_ms
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    global FP8_RECIPE
    FP8_RECIPE = DelayedScaling(fp8_dpa=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=size)
    group = dist.new_group(list(range(size)))
    hier = None  # "a2a+p2p" with a2a groups of 2 consecutive ranks (4 or more GPUs, an even number)
    if size >= 4 and size % 2 == 0:
        a2a = [dist.new_group([2 * i, 2 * i + 1]) for i in range(size // 2)]
        p2p = [dist.new_group(list(range(j, size, 2))) for j in range(2)]
        hier = [a2a[rank // 2], p2p[rank % 2]]
    if os.environ.get("CP_PROFILE") == "thd":
        from torch.profiler import ProfilerActivity, profile
        thd_rows(rank, size, group)  # warm (and times) once
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            thd_rows(rank, size, group, iters=3)
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        dist.barrier()
        dist.destroy_process_group()
        return
    if os.environ.get("CP_PROFILE"):
        profile_p2p(rank, group, fp8=os.environ["CP_PROFILE"] == "fp8")
        dist.barrier()
        dist.destroy_process_group()
        return
    rows = []
    for s, g in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, s, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for n in (H, g, g, H))
        do = do.reshape(B, s, H * D)
        full_ms = None
        if rank == 0:
            dpa = te.DotProductAttention(H, D, num_gqa_groups=g, attention_dropout=0.0, qkv_format="bshd",
                                         attn_mask_type="causal")
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            full_ms = time_ms(step_fn(dpa, qq, kk, vv, do), iters=10, warmup=3, inner=2)
            del qq, kk, vv
        dist.barrier()
        ql, kl, vl = (chunks_of(t, rank, size).requires_grad_() for t in (q, k, v))
        dol = chunks_of(do, rank, size)
        for comm in [c for c in ("p2p", "all_gather", "a2a") + (("a2a+p2p",) if hier is not None else ()) if want(c)]:
            dpa = te.DotProductAttention(H, D, num_gqa_groups=g, attention_dropout=0.0, qkv_format="bshd",
                                         attn_mask_type="causal", cp_group=hier if comm == "a2a+p2p" else group,
                                         cp_global_ranks=list(range(size)), cp_comm_type=comm)
            dist.barrier()
            ms = time_ms(step_fn(dpa, ql, kl, vl, dol), iters=10, warmup=3, inner=2)
            if rank == 0:
                rows.append((s, g, comm, full_ms, ms))
        fp8_ms = None
        if rank == 0 and want("fp8"):  # FP8 attention on one GPU
            dpa = te.DotProductAttention(H, D, num_gqa_groups=g, attention_dropout=0.0, qkv_format="bshd",
                                         attn_mask_type="causal")
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            fp8_ms = time_ms(step_fn(dpa, qq, kk, vv, do, (FP8_RECIPE, None)), iters=10, warmup=3, inner=2)
            del qq, kk, vv
        for comm in ("p2p", "a2a") if want("fp8") else ():
            dpa = te.DotProductAttention(H, D, num_gqa_groups=g, attention_dropout=0.0, qkv_format="bshd",
                                         attn_mask_type="causal", cp_group=group, cp_comm_type=comm)
            dist.barrier()
            amax_group = group if os.environ.get("CP_FP8_GROUP", "1") != "0" else None
            ms = time_ms(step_fn(dpa, ql, kl, vl, dol, (FP8_RECIPE, amax_group)), iters=10, warmup=3, inner=2)
            if rank == 0:
                rows.append((s, g, f"{comm} fp8", fp8_ms, ms))
        for rotate in (("allgather", "alltoall") if g == H and want("torch") else ()):  # (GQA: torch's CP SDPA takes none)
            dist.barrier()
            try:
                ms = torch_cp_ms(q, k, v, do, size, rotate)
            except Exception as e:  # noqa: BLE001  (an experimental API: report, keep our rows)
                ms = None
                if rank == 0:
                    print(f"torch context_parallel ({rotate}) failed: {e!r}"[:400])
            if rank == 0 and ms is not None:
                rows.append((s, g, f"torch CP {rotate}", full_ms, ms))
        del q, k, v, do, ql, kl, vl, dol
        torch.cuda.empty_cache()
    if want("thd"):
        rows += thd_rows(rank, size, group)
    if rank == 0:
        print(f"| s | kv heads | comm | 1 GPU ms | {size} GPUs ms | speed-up | efficiency |")
        print("|---|---|---|---|---|---|---|")
        for s, g, comm, full_ms, ms in rows:
            print(f"| {s} | {g} | {comm} | {full_ms:.2f} | {ms:.2f} | {full_ms / ms:.2f}x | "
                  f"{full_ms / ms / size:.0%} |")
    dist.barrier()
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    size = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    if size < 2:
        print(f"gpu_context_parallel: needs 2 or more GPUs, found {torch.cuda.device_count()}; nothing run")
        return
    print(f"{torch.cuda.get_device_name(0)} x {size}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), str(size),
                                   os.path.join(d, "store")]) for r in range(size)]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"gpu_context_parallel: rank exit codes {codes}")


if __name__ == "__main__":
    main()
