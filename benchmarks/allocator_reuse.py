#!/usr/bin/env python
"""Does glibc's malloc reuse the memory of a freed large torch tensor? Page faults and resident set.

    python benchmarks/allocator_reuse.py --mb 256 --rounds 8

Each setting runs in a fresh interpreter: --rounds times, allocate a float32 tensor of --mb MiB, fill it, free
it; prints the minor page faults of each round (a page the kernel had to map and zero), the resident set at the
end and the MALLOC_ variables the interpreter saw. Settings: glibc as it is (a block above its mmap threshold,
which rises with the blocks freed to at most 32 MiB, is mmap'd and munmap'd: above 32 MiB every round faults in
fresh pages), and glibc told through its environment to keep freed memory (MALLOC_MMAP_MAX_=0,
MALLOC_TRIM_THRESHOLD_ 64 GiB, MALLOC_TOP_PAD_ 1 GiB: no mmap, no trimming), the tuning that cut a transformers
step's page faults (docs/performance.md, "Page faults and the C allocator"). Reports, changes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30), "MALLOC_TOP_PAD_": str(2**30)}
CHILD = """
import json, os, resource, sys, torch
faults = []
for _ in range({rounds}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty({numel}, dtype=torch.float32)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
rss = int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
seen = sorted(f"{{k}}={{v}}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
print(json.dumps({{"faults": faults, "rss_mb": rss, "malloc_environment": seen}}))
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="the tensor's size in MiB")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.mb < 1 or args.rounds < 1:
        print("error: --mb and --rounds must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    code = CHILD.format(rounds=args.rounds, numel=args.mb * 2**20 // 4)
    out = {}
    for name, extra in (("glibc as it is", {}), ("glibc keeping freed memory", KEEP)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        proc = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True)
        out[name] = json.loads(proc.stdout)
        seen = " ".join(out[name]["malloc_environment"]) or "none"
        print(f"{name}: page faults per round {out[name]['faults']}, resident set {out[name]['rss_mb']} MiB; "
              f"malloc environment: {seen}")
    return out


if __name__ == "__main__":
    main()
