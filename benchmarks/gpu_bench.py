"""All GPU benchmarks in one process: each module benchmarks/gpu_<group>.py exposes
run(report); results print as they come and are saved to <out>/bench.md."""
import argparse
import datetime
import importlib
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_harness import Report, copy_bandwidth_gbs  # noqa: E402

GROUPS = ["gpu_gemm", "gpu_cast", "gpu_norm", "gpu_activation", "gpu_attention", "gpu_rope", "gpu_attn_merge",
          "gpu_batched_gemm"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--only", nargs="*", default=None)
    a = p.parse_args()
    report = Report()
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth_gbs()
    report.add("device", dev, copy_GBps=bw)
    failed = []
    for name in GROUPS:
        if a.only and name not in a.only:
            continue
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            print(f"[{name}] not present: {e}")
            continue
        try:
            mod.run(report)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    md = f"## {datetime.date.today()} — {dev}\n\ncopy bandwidth {bw:.0f} GB/s\n" + report.markdown()
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write(md)
    print(md)
    if failed:
        raise SystemExit(f"benchmark groups failed: {failed}")


if __name__ == "__main__":
    main()
