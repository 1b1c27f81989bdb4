"""Start one process per rank of a worker script and collect what each saved (the multi-rank tests:
context parallelism, FP8 amax reduction). Each worker gets argv: rank, size, init file (a
torch.distributed file store), output file, device type, then the test's own arguments, and
saves its results with torch.save to the output file."""
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(worker, size, device_type, args=(), env=None, timeout=600, grace=30):
    """The ranks' saved results, in rank order. When a rank fails, the others (which may wait in a
    collective for it) get `grace` seconds and are then killed, so that a failure is reported
    instead of a hang."""
    with tempfile.TemporaryDirectory() as d:
        outs = [os.path.join(d, f"rank{r}.pt") for r in range(size)]
        logs = [open(os.path.join(d, f"rank{r}.log"), "w+b") for r in range(size)]
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, worker), str(r), str(size),
                                   os.path.join(d, "store"), outs[r], device_type, *map(str, args)],
                                  env=dict(os.environ) if env is None else env,
                                  stdout=logs[r], stderr=subprocess.STDOUT) for r in range(size)]
        start, failed = time.monotonic(), None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed is None and any(p.returncode not in (None, 0) for p in procs):
                failed = now
            if now - start > timeout or (failed is not None and now - failed > grace):
                for p in procs:
                    p.kill()
                break
            time.sleep(0.1)
        texts = []
        for p, f in zip(procs, logs):
            p.wait()
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        assert not bad, "\n".join(f"rank {r} of {size} failed (exit {procs[r].returncode}):\n{texts[r][-4000:]}"
                                   for r in bad)
        return [torch.load(o) for o in outs]


def init_rank():
    """In a worker: join the process group its argv names (gloo on the CPU; NCCL with GPU `rank`
    under "cuda") -> (rank, size, output file, device, a group of all ranks, the test's own argv)."""
    import torch.distributed as dist
    rank, size, init_file, out_file, device = sys.argv[1:6]
    rank, size = int(rank), int(size)
    torch.set_num_threads(1)
    on_cuda = device == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=size)
    group = dist.new_group(list(range(size)))
    dev = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    return rank, size, out_file, dev, group, sys.argv[6:]
