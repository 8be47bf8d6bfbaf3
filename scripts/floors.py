#!/usr/bin/env python3
"""How far the channels-last training ops from DRAM are above the floor of their two
passes on this machine, beside issue 7's targets.

Channels-last training cannot be one pass: every pixel's output needs the statistics
(or gradient sums) of all pixels, and a tensor far larger than the L3 is gone from the
caches by the time they are known. So the op reads its inputs twice:

    forward training  >= a read of x        + forward inference  (reads x, writes y)
    backward training >= a read of dy and x + backward inference (reads dy, x, writes dx)

This script measures both sides in one process per round, rounds interleaved: fusedbn's
ops and their copies with `fusedbn bench --json`, and the read with the C model
scripts/models/read_pass.c (two threads, one sequential stream each: the fastest a
statistics pass can read here). The floor is (read ms + inference-op ms) ÷ the copy's
ms of the training op; its inference op is fusedbn's own, which is itself timed against
a copy. Where the floor is above the target, no two-pass kernel meets that target on
this machine against this copy; whatever is between the op and its floor is the
kernels' to win.

    python3 scripts/floors.py                          # 3 rounds, the targets' shapes
    python3 scripts/floors.py --rounds 5 --isa avx2 --dtype bf16

Needs gcc (for the model) and target/release/fusedbn (or --bin); standard library only.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from targets import supported_isas

TARGET = {"forward_training": 1.3, "backward_training": 1.5}
PAIR = {"forward_training": "forward_inference", "backward_training": "backward_inference"}
READS = {"forward_training": 1, "backward_training": 2}  # inputs the first pass reads
SIZE = {"f32": 4, "bf16": 2, "f16": 2}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/release/fusedbn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isa", default="avx512,avx2")
    ap.add_argument("--dtype", default="f32,bf16,f16")
    ap.add_argument("--shape", action="append", help="N,H,W,C (repeatable)")
    ap.add_argument("--min-time", default="0.25")
    args = ap.parse_args()
    shapes = args.shape or ["64,56,56,256", "64,112,112,64"]
    here = os.path.dirname(os.path.abspath(__file__))
    model = os.path.join("/tmp", f"fusedbn_read_pass_{os.getuid()}")
    subprocess.run(["gcc", "-O2", "-mavx2", "-pthread", "-o", model,
                    os.path.join(here, "models", "read_pass.c")], check=True)
    isas = supported_isas(args.bin, args.isa.split(","))
    if not isas:
        sys.exit("floors.py: none of --isa runs on this CPU")
    ops = list(TARGET) + list(PAIR.values())
    cells = {}  # (shape, dtype, isa, op) -> [(ms, copy_ms)]
    reads = {}  # bytes -> [ms]
    for r in range(args.rounds):
        for shape in shapes:
            elems = 1
            for d in shape.split(","):
                elems *= int(d)
            for dtype in args.dtype.split(","):
                for k in sorted(set(READS.values())):
                    b = k * elems * SIZE[dtype]
                    out = subprocess.run([model, str(b), "5"], capture_output=True, text=True,
                                         check=True).stdout
                    reads.setdefault(b, []).append(float(out))
                cmd = [args.bin, "bench", "--shape", shape, "--format", "NHWC", "--op",
                       ",".join(ops), "--dtype", dtype, "--isa", ",".join(isas),
                       "--min-time", args.min_time, "--json"]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                for line in out.splitlines():
                    j = json.loads(line)
                    key = (shape, dtype, j["isa"], j["op"])
                    cells.setdefault(key, []).append((j["median_ms"], j["copy_ms"]))
        print(f"floors.py: round {r + 1} of {args.rounds} done", file=sys.stderr)
    med = statistics.median
    print("| op | shape (NHWC) | dtype | isa | op ms | copy ms | op ÷ copy | read ms "
          "| inference op ms | floor ÷ copy | target |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    below = 0
    for op in TARGET:
        for shape in shapes:
            elems = 1
            for d in shape.split(","):
                elems *= int(d)
            for dtype in args.dtype.split(","):
                for isa in isas:
                    runs = cells.get((shape, dtype, isa, op))
                    inf = cells.get((shape, dtype, isa, PAIR[op]))
                    if not runs or not inf:
                        continue
                    ms, copy = med(m for m, _ in runs), med(c for _, c in runs)
                    rd = med(reads[READS[op] * elems * SIZE[dtype]])
                    inf_ms = med(m for m, _ in inf)
                    floor = (rd + inf_ms) / copy
                    mark = " (above target)" if floor > TARGET[op] else ""
                    below += floor > TARGET[op]
                    print(f"| {op} | {shape.replace(',', 'x')} | {dtype} | {isa} | {ms:.2f} "
                          f"| {copy:.2f} | {ms / copy:.2f} | {rd:.2f} | {inf_ms:.2f} "
                          f"| {floor:.2f}{mark} | {TARGET[op]} |")
    print(f"\nCells whose two-pass floor is above the target: {below}")


if __name__ == "__main__":
    main()
