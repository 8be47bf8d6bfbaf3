#!/usr/bin/env python3
"""Time fusedbn beside TensorFlow (oneDNN and Eigen) and, when installed, PyTorch.

Every implementation runs the same shapes, layouts and ops on float32, on the CPU, and
each figure is given twice: the median time of one call, and that time divided by the
time to copy the same bytes *in the same process* (lower is better; 1.0 is a plain
copy). Bytes moved: forward = read x + write y, backward = read dy + read x + write dx.

How each figure is taken (the same way as `fusedbn bench`):
- inputs are built once, already on the device (tf/torch tensors), outside the timing;
- the op and its copy baseline are warmed up, then timed in *pairs*, one op call next to
  one copy (the order alternating from pair to pair), for at least --runs pairs and at
  least --min-time seconds;
- "ms" is the median op time; "/copy" is the median over pairs of op_i / copy_i, which
  cancels the machine's bandwidth drift (a shared machine's copy speed can change 2x
  between seconds);
- the Python baseline is np.copyto from one preallocated float32 array into another,
  split over the thread count (numpy releases the GIL for large copies), of half the
  bytes the op moves (a copy reads and writes: forward copies x's size, backward 1.5x);
  fusedbn's baseline is its own in-process parallel copy (see `fusedbn bench --help`).

Implementations (each in its own subprocess, one after the other, never concurrently):
- fusedbn: `target/release/fusedbn bench --json` (built with cargo if missing);
  preallocated outputs.
- TensorFlow: tf.raw_ops.FusedBatchNormV3 / FusedBatchNormGradV3 inside a tf.function
  (graph mode, as TF runs in training), once with oneDNN (TF's default on x86) and once
  with TF_ENABLE_ONEDNN_OPTS=0 (the Eigen kernels). A call is complete when .numpy() of
  its small per-channel output returns; the big output is not copied to the host. TF's
  CPU gradient in inference mode is NHWC-only: the others are reported as skipped.
- PyTorch (if `import torch` works in --torch-python, or this interpreter, or the TF
  venv): torch.nn.functional.batch_norm forward, torch.ops.aten.native_batch_norm_backward
  backward, under torch.inference_mode(); NCHW is torch.contiguous_format, NHWC is
  torch.channels_last. PyTorch allocates its outputs on every call (no out= here).

Usage (from the repository root; needs only the standard library itself, the workers
need numpy and the framework):

    .venv-tf/bin/python scripts/bench_peers.py                 # default shapes
    .venv-tf/bin/python scripts/bench_peers.py --quick         # tiny shapes, fast
    .venv-tf/bin/python scripts/bench_peers.py --shapes 16,56,56,256 --markdown
    python3 scripts/bench_peers.py --torch-python /path/to/venv-torch/bin/python

Set up the TF venv with `python3 -m venv .venv-tf && .venv-tf/bin/pip install -r
scripts/requirements-peers.txt`. Not used by CI.
"""

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUSEDBN = ROOT / "target" / "release" / "fusedbn"
TF_VENV_PYTHON = ROOT / ".venv-tf" / "bin" / "python"

DEFAULT_SHAPES = ["16,56,56,256", "16,112,112,64", "16,28,28,512"]
QUICK_SHAPES = ["2,8,8,32", "4,16,16,64"]
OPS = ["forward_training", "forward_inference", "backward_training", "backward_inference"]
LAYOUTS = ["NHWC", "NCHW"]
EPSILON = 1e-4  # fusedbn's and TensorFlow's default

IMPLS = ["fusedbn", "tf-onednn", "tf-eigen", "torch"]
TITLES = {
    "fusedbn": "fusedbn",
    "tf-onednn": "TF oneDNN",
    "tf-eigen": "TF Eigen",
    "torch": "PyTorch",
}


# ---------------------------------------------------------------------------------------
# Shared by the workers


def parse_shape(s):
    dims = [int(d) for d in s.split(",")]
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected N,H,W,C with positive numbers")
    return dims


def layout_shape(shape, layout):
    n, h, w, c = shape
    return [n, h, w, c] if layout == "NHWC" else [n, c, h, w]


def bytes_moved(op, shape):
    elems = shape[0] * shape[1] * shape[2] * shape[3]
    return (3 if op.startswith("backward") else 2) * elems * 4


class Copier:
    """The baseline: np.copyto between preallocated float32 arrays, moving `nbytes` bytes
    in all (half read, half written), split over `threads` threads."""

    def __init__(self, nbytes, threads):
        import numpy as np
        from concurrent.futures import ThreadPoolExecutor

        n = max(1, nbytes // 8)  # elements of 4 bytes, each read once and written once
        self.src = np.full(n, 1.5, dtype=np.float32)
        self.dst = np.zeros(n, dtype=np.float32)
        # Below ~1 MiB a thread hand-off costs more than it saves.
        self.parts = threads if (threads > 1 and n * 4 >= (1 << 20)) else 1
        bounds = [i * n // self.parts for i in range(self.parts + 1)]
        self.slices = [(self.dst[a:b], self.src[a:b]) for a, b in zip(bounds, bounds[1:])]
        self.pool = ThreadPoolExecutor(self.parts) if self.parts > 1 else None
        self.np = np

    def __call__(self):
        if self.pool is None:
            self.np.copyto(self.dst, self.src)
        else:
            for f in [self.pool.submit(self.np.copyto, d, s) for d, s in self.slices]:
                f.result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def quantile(s, q):
    pos = q * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure(run_op, copy, runs, min_time, warmup=3):
    """Warm-up, then op/copy pairs (alternating order); medians and pair-ratio stats."""
    clock = time.perf_counter
    t0 = clock()
    for _ in range(warmup):
        run_op()
        copy()
    # At least ~50 ms of warm-up (or what `warmup` pairs took).
    while clock() - t0 < 0.05:
        run_op()
        copy()
    ops, copies = [], []
    timed, max_pairs = 0.0, runs * 100
    gc_was = gc.isenabled()
    gc.disable()
    try:
        while len(ops) < runs or (timed < min_time and len(ops) < max_pairs):
            if len(ops) % 2 == 0:
                a = clock()
                run_op()
                b = clock()
                copy()
                c = clock()
                o, k = b - a, c - b
            else:
                a = clock()
                copy()
                b = clock()
                run_op()
                c = clock()
                k, o = b - a, c - b
            ops.append(o)
            copies.append(k)
            timed += o + k
    finally:
        if gc_was:
            gc.enable()
    ratios = sorted(o / k for o, k in zip(ops, copies))
    return {
        "ms": statistics.median(ops) * 1e3,
        "copy_ms": statistics.median(copies) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_p25": quantile(ratios, 0.25),
        "ratio_p75": quantile(ratios, 0.75),
        "pairs": len(ops),
    }


def make_inputs(shape, layout, seed=0):
    """x, dy in `layout`; per-channel scale, offset, population mean and variance."""
    import numpy as np

    rng = np.random.default_rng(seed)
    c = shape[3]
    nhwc = shape
    x = rng.standard_normal(nhwc, dtype=np.float32) * 1.5 + 0.25
    dy = rng.standard_normal(nhwc, dtype=np.float32) * 0.5 + 0.25
    if layout == "NCHW":
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        dy = np.ascontiguousarray(dy.transpose(0, 3, 1, 2))
    per_c = lambda lo, hi: rng.uniform(lo, hi, c).astype(np.float32)  # noqa: E731
    return {
        "x": x,
        "dy": dy,
        "scale": per_c(0.5, 1.5),
        "offset": per_c(-0.5, 0.5),
        "mean": per_c(0.0, 0.5),
        "variance": per_c(1.5, 3.0),
    }


def emit(row):
    print(json.dumps(row), flush=True)


def first_line(e):
    """The informative line of an exception (TF's start with boilerplate and a trace)."""
    noise = ("Graph execution error", "Detected at node", "File ", "[[", "Traceback")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    good = [ln for ln in lines if not ln.startswith(noise)]
    return ((good or lines or [type(e).__name__])[0])[:200]


def cases(args):
    for shape in args.shapes:
        for layout in args.layouts:
            for op in args.ops:
                yield shape, layout, op


# ---------------------------------------------------------------------------------------
# TensorFlow worker


def tf_worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # noqa: F401
    import tensorflow as tf

    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") not in ("0", "false", "False")
    impl = "tf-onednn" if onednn else "tf-eigen"
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    threads = args.threads or os.cpu_count()
    emit({"impl": impl, "info": f"TensorFlow {tf.__version__}, oneDNN {'on' if onednn else 'off'}"})

    def fwd(layout, training):
        @tf.function(autograph=False)
        def f(x, scale, offset, mean, variance):
            r = tf.raw_ops.FusedBatchNormV3(
                x=x,
                scale=scale,
                offset=offset,
                mean=mean,
                variance=variance,
                epsilon=EPSILON,
                exponential_avg_factor=1.0,
                data_format=layout,
                is_training=training,
            )
            return r.y, r.batch_mean, r.reserve_space_1, r.reserve_space_2, r.reserve_space_3

        return f

    def bwd(layout, training):
        @tf.function(autograph=False)
        def g(dy, x, scale, r1, r2, r3):
            r = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy,
                x=x,
                scale=scale,
                reserve_space_1=r1,
                reserve_space_2=r2,
                reserve_space_3=r3,
                epsilon=EPSILON,
                data_format=layout,
                is_training=training,
            )
            return r.x_backprop, r.scale_backprop

        return g

    for shape in args.shapes:
        for layout in args.layouts:
            ops = [op for op in args.ops]
            with tf.device("/CPU:0"):
                inp = make_inputs(shape, layout)
                t = {k: tf.constant(v) for k, v in inp.items()}
                empty = tf.constant([], dtype=tf.float32)
            copier = {}
            for op in ops:
                row = {"impl": impl, "op": op, "layout": layout, "shape": shape}
                training = op.endswith("training")
                try:
                    f = fwd(layout, training)
                    m, v = (empty, empty) if training else (t["mean"], t["variance"])
                    if op.startswith("forward"):

                        def run(f=f, m=m, v=v):
                            f(t["x"], t["scale"], t["offset"], m, v)[1].numpy()

                    else:
                        # The reserve spaces, from a forward pass in the same mode.
                        _, _, r1, r2, r3 = f(t["x"], t["scale"], t["offset"], m, v)
                        if not training:
                            r1, r2 = t["mean"], t["variance"]
                        g = bwd(layout, training)

                        def run(g=g, r1=r1, r2=r2, r3=r3):
                            g(t["dy"], t["x"], t["scale"], r1, r2, r3)[1].numpy()

                    run()  # traces the function; errors surface here
                except Exception as e:  # noqa: BLE001
                    row["skip"] = first_line(e)
                    emit(row)
                    continue
                nbytes = bytes_moved(op, shape)
                if nbytes not in copier:
                    copier[nbytes] = Copier(nbytes, threads)
                row.update(measure(run, copier[nbytes], args.runs, args.min_time))
                row["threads"] = threads
                emit(row)
            for c in copier.values():
                c.close()


# ---------------------------------------------------------------------------------------
# PyTorch worker


def torch_worker(args):
    import torch
    import torch.nn.functional as F

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    emit({"impl": "torch", "info": f"PyTorch {torch.__version__}"})
    aten = torch.ops.aten
    for shape in args.shapes:
        for layout in args.layouts:
            inp = make_inputs(shape, layout)
            with torch.inference_mode():
                if layout == "NHWC":
                    # Logical NCHW over NHWC memory: channels_last.
                    x = torch.from_numpy(inp["x"]).permute(0, 3, 1, 2)
                    dy = torch.from_numpy(inp["dy"]).permute(0, 3, 1, 2)
                    assert x.is_contiguous(memory_format=torch.channels_last)
                else:
                    x = torch.from_numpy(inp["x"])
                    dy = torch.from_numpy(inp["dy"])
                    assert x.is_contiguous()
                w = torch.from_numpy(inp["scale"])
                b = torch.from_numpy(inp["offset"])
                rm = torch.from_numpy(inp["mean"]).clone()
                rv = torch.from_numpy(inp["variance"]).clone()
            copier = {}
            for op in args.ops:
                row = {"impl": "torch", "op": op, "layout": layout, "shape": shape}
                try:
                    with torch.inference_mode():
                        if op == "forward_training":
                            # momentum 1.0: the running stats become the batch's (as
                            # TF's exponential_avg_factor=1 and fusedbn's bench).
                            def run():
                                with torch.inference_mode():
                                    F.batch_norm(x, rm, rv, w, b, True, 1.0, EPSILON)

                        elif op == "forward_inference":

                            def run():
                                with torch.inference_mode():
                                    F.batch_norm(x, rm, rv, w, b, False, 0.0, EPSILON)

                        elif op == "backward_training":
                            _, sm, si = aten.native_batch_norm(x, w, b, None, None, True, 0.0, EPSILON)

                            def run(sm=sm, si=si):
                                with torch.inference_mode():
                                    aten.native_batch_norm_backward(
                                        dy, x, w, None, None, sm, si, True, EPSILON, [True, True, True]
                                    )

                        else:

                            def run():
                                with torch.inference_mode():
                                    aten.native_batch_norm_backward(
                                        dy, x, w, rm, rv, None, None, False, EPSILON, [True, True, True]
                                    )

                        run()
                except Exception as e:  # noqa: BLE001
                    row["skip"] = first_line(e)
                    emit(row)
                    continue
                nbytes = bytes_moved(op, shape)
                if nbytes not in copier:
                    copier[nbytes] = Copier(nbytes, threads)
                row.update(measure(run, copier[nbytes], args.runs, args.min_time))
                row["threads"] = threads
                emit(row)
            for c in copier.values():
                c.close()


# ---------------------------------------------------------------------------------------
# The driver


def log(msg):
    print(f"bench_peers: {msg}", file=sys.stderr, flush=True)


def worker_cmd(python, kind, args):
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", kind]
    cmd += ["--shapes", *(",".join(map(str, s)) for s in args.shapes)]
    cmd += ["--layouts", *args.layouts, "--ops", *args.ops]
    cmd += ["--runs", str(args.runs), "--min-time", str(args.min_time)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def run_worker(cmd, env_extra=None):
    """Runs a worker; returns its JSON lines (stderr passes through, filtered)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(env_extra or {})
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    rows = []
    for line in p.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        log(f"{' '.join(cmd[:4])} ... exited {p.returncode}:\n{tail}")
    return rows


def can_import(python, module):
    try:
        p = subprocess.run(
            [str(python), "-c", f"import {module}"], capture_output=True, timeout=300, cwd=ROOT
        )
        return p.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def fusedbn_rows(args):
    if args.build or not FUSEDBN.exists():
        log("building fusedbn (cargo build --release -p fusedbn-cli)")
        subprocess.run(["cargo", "build", "--release", "-p", "fusedbn-cli"], cwd=ROOT, check=True)
    cmd = [str(FUSEDBN), "bench", "--json", "--runs", str(args.runs), "--min-time", str(args.min_time)]
    for s in args.shapes:
        cmd += ["--shape", ",".join(map(str, s))]
    for layout in args.layouts:
        cmd += ["--format", layout]
    for op in args.ops:
        cmd += ["--op", op]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.isa:
        cmd += ["--isa", args.isa]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        log(f"fusedbn bench exited {p.returncode}: {p.stderr.strip()}")
    rows, isas = [], set()
    for line in p.stdout.splitlines():
        j = json.loads(line)
        s = j["shape"]
        shape = s if j["format"] == "NHWC" else [s[0], s[2], s[3], s[1]]
        isas.add(j["isa"])
        rows.append(
            {
                "impl": "fusedbn",
                "op": j["op"],
                "layout": j["format"],
                "shape": shape,
                "ms": j["median_ms"],
                "copy_ms": j["copy_ms"],
                "ratio": j["copy_ratio"],
                "ratio_p25": j.get("copy_ratio_p25"),
                "ratio_p75": j.get("copy_ratio_p75"),
                "pairs": j.get("pairs"),
                "threads": j["threads"],
                "isa": j["isa"],
                **({} if j.get("check") == "ok" else {"note": "check FAILED"}),
            }
        )
    version = subprocess.run([str(FUSEDBN), "--version"], capture_output=True, text=True).stdout.strip()
    rows.append({"impl": "fusedbn", "info": f"{version}, isa {'/'.join(sorted(isas)) or '?'}"})
    return rows


def aggregate(raw):
    """One row per (impl, op, layout, shape): medians over the rounds, and the rounds'
    lowest and highest ratio; an `info` row per impl (the first)."""
    groups, out, seen_info = {}, [], set()
    for r in raw:
        if "info" in r:
            if r["impl"] not in seen_info:
                seen_info.add(r["impl"])
                out.append(r)
            continue
        groups.setdefault((r["impl"], r["op"], r["layout"], tuple(r["shape"])), []).append(r)
    for (impl, op, layout, shape), rs in groups.items():
        row = {"impl": impl, "op": op, "layout": layout, "shape": list(shape), "rounds": len(rs)}
        timed = [r for r in rs if "ms" in r]
        if not timed:
            row["skip"] = rs[0].get("skip", "no result")
        else:
            for k in ("ms", "copy_ms", "ratio"):
                row[k] = statistics.median(r[k] for r in timed)
            row["ratio_min"] = min(r["ratio"] for r in timed)
            row["ratio_max"] = max(r["ratio"] for r in timed)
            row["threads"] = timed[0]["threads"]
            notes = sorted({r["note"] for r in rs if r.get("note")})
            if notes:
                row["note"] = "; ".join(notes)
        out.append(row)
    return out


def shape_str(shape):
    return "x".join(map(str, shape))


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def fmt_num(v):
    """Three significant digits, no exponent (0.00312, 1.23, 12.3, 123; 1234)."""
    if v is None:
        return "-"
    if v <= 0 or v >= 100:
        return f"{v:.0f}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(v)))}f}"


def table(args, impls, rows, markdown, spread=False):
    by_key = {}
    for r in rows:
        if "op" in r:
            by_key[(r["impl"], r["op"], r["layout"], tuple(r["shape"]))] = r
    keys = [(op, layout, tuple(shape)) for shape, layout, op in cases(args)]

    def cells(impl, key):
        r = by_key.get((impl, *key))
        if r is None:
            return ["n/a", "n/a"]
        if "skip" in r:
            return ["skip", "skip"]
        mark = "!" if r.get("note") else ""
        ratio = fmt_num(r["ratio"])
        if spread and r["rounds"] > 1:
            ratio += f" ({fmt_num(r['ratio_min'])}-{fmt_num(r['ratio_max'])})"
        return [fmt_num(r["ms"]) + mark, ratio]

    head = ["op", "layout", "shape (NHWC)"]
    for impl in impls:
        head += [f"{TITLES[impl]} ms", "/copy"]
    body = [[op, layout, shape_str(shape), *sum((cells(i, (op, layout, shape)) for i in impls), [])]
            for op, layout, shape in keys]
    out = []
    if markdown:
        out.append("| " + " | ".join(h.replace("/copy", "÷copy") for h in head) + " |")
        out.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|")
        for b in body:
            out.append("| " + " | ".join(b) + " |")
    else:
        widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
        # The implementation names over their two columns.
        line = "  ".join(" " * widths[i] for i in range(3))
        for k, impl in enumerate(impls):
            w = widths[3 + 2 * k] + 2 + widths[4 + 2 * k]
            line += "  " + TITLES[impl].center(w, "-")
        out.append(line.rstrip())
        sub = [h if i < 3 else ("ms" if i % 2 == 1 else "/copy") for i, h in enumerate(head)]
        for row in [sub, *body]:
            out.append(
                "  ".join(
                    str(c).ljust(widths[i]) if i < 3 else str(c).rjust(widths[i]) for i, c in enumerate(row)
                ).rstrip()
            )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (head -50 scripts/bench_peers.py) for the method.",
    )
    ap.add_argument("--shapes", nargs="+", type=parse_shape, metavar="N,H,W,C",
                    help=f"logical shapes (default: {' '.join(DEFAULT_SHAPES)})")
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny shapes ({' '.join(QUICK_SHAPES)}) and fewer runs")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    ap.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS,
                    help="implementations to run (default: all; torch only when importable)")
    ap.add_argument("--runs", type=int, default=None, help="timed pairs per case and round, at least (default 10; 5 with --quick)")
    ap.add_argument("--min-time", type=float, default=None,
                    help="seconds of timing per case and round, at least (default 0.25; 0.05 with --quick)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run every implementation this many times, in turn, and take medians (default 3; 1 with --quick)")
    ap.add_argument("--spread", action="store_true", help="add each ratio's range over the rounds to the table")
    ap.add_argument("--threads", type=int, default=None, help="threads for every implementation (default: all cores)")
    ap.add_argument("--isa", default=None, help="fusedbn's --isa (default: its own)")
    ap.add_argument("--tf-python", default=None, help=f"Python with tensorflow (default: {TF_VENV_PYTHON} if present)")
    ap.add_argument("--torch-python", default=None,
                    help="Python with torch (default: the first of this one and --tf-python that imports it)")
    ap.add_argument("--build", action="store_true", help="run cargo build --release -p fusedbn-cli first")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--json-out", default=None, metavar="PATH", help="also write every measurement as JSON lines")
    ap.add_argument("--worker", choices=["tf", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.shapes is None:
        args.shapes = [parse_shape(s) for s in (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)]
    if args.runs is None:
        args.runs = 5 if args.quick else 10
    if args.min_time is None:
        args.min_time = 0.05 if args.quick else 0.25
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.runs < 1 or args.min_time < 0 or args.rounds < 1:
        ap.error("--runs and --rounds must be at least 1 and --min-time at least 0")

    if args.worker == "tf":
        return tf_worker(args)
    if args.worker == "torch":
        return torch_worker(args)

    start = time.time()
    tf_python = Path(args.tf_python) if args.tf_python else (TF_VENV_PYTHON if TF_VENV_PYTHON.exists() else Path(sys.executable))
    # What runs each implementation (None: skipped, with a note).
    runners, notes = {}, []
    for impl in args.impls:
        if impl == "fusedbn":
            runners[impl] = lambda: fusedbn_rows(args)
        elif impl in ("tf-onednn", "tf-eigen"):
            if not can_import(tf_python, "tensorflow"):
                notes.append(f"{TITLES[impl]}: tensorflow does not import in {tf_python}; skipped")
                continue
            env = {"TF_ENABLE_ONEDNN_OPTS": "1" if impl == "tf-onednn" else "0"}
            runners[impl] = lambda env=env: run_worker(worker_cmd(tf_python, "tf", args), env)
        elif impl == "torch":
            candidates = [args.torch_python] if args.torch_python else [sys.executable, str(tf_python)]
            python = next((p for p in dict.fromkeys(candidates) if can_import(p, "torch")), None)
            if python is None:
                notes.append(
                    "PyTorch: not importable in " + ", ".join(dict.fromkeys(candidates))
                    + "; skipped (PyPI's Linux torch wheel pulls ~3 GB of CUDA wheels; install a CPU"
                    " build into a venv and pass --torch-python)"
                )
                continue
            runners[impl] = lambda python=python: run_worker(worker_cmd(python, "torch", args))
    # Rounds: every implementation once per round, so that each sees the machine in
    # the same moods (its bandwidth changes by 2x over minutes, and a ratio to a copy
    # shifts with it); each case's figures are then the medians over the rounds.
    raw = []
    for rnd in range(args.rounds):
        for impl, run in runners.items():
            log(f"round {rnd + 1}/{args.rounds}: {TITLES[impl]} ...")
            for r in run():
                r["round"] = rnd
                raw.append(r)
    rows = aggregate(raw)
    impls = [i for i in runners if any(r["impl"] == i and "op" in r for r in rows)]

    if args.json_out:
        with open(args.json_out, "w") as f:
            for r in raw:
                f.write(json.dumps(r) + "\n")

    threads = sorted({r["threads"] for r in rows if "threads" in r})
    print(
        f"bench_peers: {cpu_name()}, {os.cpu_count()} cores, threads {'/'.join(map(str, threads))}, float32, "
        f"{args.rounds} round(s) of every implementation in turn, each case at least {args.runs} op/copy pairs "
        f"and {args.min_time} s a round"
    )
    print(
        "ms = median time of one call; /copy = median over pairs of (call time / time of an in-process copy of "
        "the same bytes, timed next to it); both then the median over the rounds" + (
            " (the rounds' range in brackets)" if args.spread else "") + "; lower is better, 1.0 = a plain copy"
    )
    print()
    print(table(args, impls, rows, args.markdown, args.spread))
    print()
    biggest = max((s for s in args.shapes), key=lambda s: s[0] * s[1] * s[2] * s[3])
    for r in rows:
        if "info" in r:
            per_round = []
            for rnd in range(args.rounds):
                copies = [x for x in raw if x["impl"] == r["impl"] and x.get("round") == rnd
                          and "copy_ms" in x and x["shape"] == biggest]
                gbps = [bytes_moved(x["op"], x["shape"]) / (x["copy_ms"] * 1e-3) / 1e9 for x in copies]
                if gbps:
                    per_round.append(f"{statistics.median(gbps):.0f}")
            bw = f"; its copy on {shape_str(biggest)}: {', '.join(per_round)} GB/s (round by round)" if per_round else ""
            print(f"- {TITLES[r['impl']]}: {r['info']}{bw}")
    for r in rows:
        if "skip" in r:
            print(f"- {TITLES[r['impl']]} skipped {r['op']} {r['layout']} {shape_str(r['shape'])}: {r['skip']}")
        if r.get("note"):
            print(f"- {TITLES[r['impl']]} {r['op']} {r['layout']} {shape_str(r['shape'])}: {r['note']}")
    for n in notes:
        print(f"- {n}")
    log(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main() or 0)
