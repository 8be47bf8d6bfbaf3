#!/usr/bin/env python3
"""Do two fusedbn builds give the same bits? Runs every op family of `fusedbn run`
(FusedBatchNormV3 in training and inference, FusedBatchNormEx with a side input and
Relu, FusedBatchNormGradV3 in training and inference, FusedBatchNormGradEx,
FusedBatchNormGradGradV3 in training and inference) on the same generated inputs with
both binaries, in NHWC and NCHW, f32, f16 and bf16, with each ISA given, and compares
every output file byte for byte. Prints the first differences and exits 1 if any.

    scripts/same_bits.py /tmp/before/target/release/fusedbn target/release/fusedbn
    scripts/same_bits.py A B --isa avx2,avx512 --shape 2,8,8,32 --shape 4,10,10,72

How the CHANGELOG's "the bits do not change" claims for kernel changes are checked.
The inputs are written as .npy files by hand (no NumPy needed): near-zero data and data
far from zero (|mean| = 1000, std about 1), shapes with SIMD tails, C = 1, several
tiles and several tasks by default.
"""
import argparse
import os
import random
import struct
import subprocess
import sys
import tempfile

SHAPES = [
    (3, 7, 5, 256), (2, 9, 9, 512), (1, 33, 31, 128), (4, 10, 10, 72), (2, 13, 11, 96),
    (5, 8, 8, 64), (8, 28, 28, 64), (1, 3, 3, 256), (2, 11, 13, 48), (2, 8, 8, 32),
    (3, 5, 5, 1), (2, 3, 3, 67),
]


def write_npy(path, descr, shape, raw):
    dims = ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (descr, dims)
    header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + raw)


def encode(values, dtype):
    n = len(values)
    if dtype == "f32":
        return "<f4", struct.pack("<%df" % n, *values)
    if dtype == "f16":
        return "<f2", struct.pack("<%de" % n, *values)
    # bfloat16: the top half of the f32 bits (truncated: any bf16 values do here).
    bits = struct.unpack("<%dI" % n, struct.pack("<%df" % n, *values))
    return "<V2", struct.pack("<%dH" % n, *[b >> 16 for b in bits])


def make_inputs(root, shapes, dtypes):
    rnd = random.Random(11)
    cases = []
    for si, shape in enumerate(shapes):
        n, c = shape[0] * shape[1] * shape[2] * shape[3], shape[3]
        for mode in ("plain", "far"):
            data = {}
            for name in ("x", "dy", "ddx", "side", "y"):
                shift = 1000.0 if (mode == "far" and name == "x") else 0.0
                data[name] = [(rnd.random() - 0.5) * 4 + shift for _ in range(n)]
            for dtype in dtypes:
                d = os.path.join(root, "%d_%s_%s" % (si, mode, dtype))
                os.makedirs(d)
                nchw = (shape[0], shape[3], shape[1], shape[2])
                for fmt, shp in (("NHWC", shape), ("NCHW", nchw)):
                    for name, values in data.items():
                        descr, raw = encode(values, dtype)
                        write_npy(os.path.join(d, "%s_%s.npy" % (name, fmt)), descr, shp, raw)
                mean = 0.1 + (1000.0 if mode == "far" else 0.0)
                for name, v in (("scale", 1.5), ("offset", 0.25), ("mean", mean),
                                ("variance", 1.3), ("gs", 0.7), ("go", -0.3)):
                    values = [v + 0.01 * i for i in range(c)]
                    write_npy(os.path.join(d, name + ".npy"), "<f4", (c,),
                              struct.pack("<%df" % c, *values))
                write_npy(os.path.join(d, "empty.npy"), "<f4", (0,), b"")
                cases.append(d)
    return cases


def runs(d, fmt):
    """(name, op, inputs, attrs) of every run of one input set in one format."""
    i = lambda name, f: "%s=%s" % (name, os.path.join(d, f + ".npy"))  # noqa: E731
    stats = [i("scale", "scale"), i("offset", "offset"), i("mean", "mean"),
             i("variance", "variance")]
    grad = [i("y_backprop", "dy_" + fmt), i("x", "x_" + fmt), i("scale", "scale"),
            i("reserve_space_1", "mean"), i("reserve_space_2", "variance"),
            i("reserve_space_3", "empty")]
    out = [
        ("fwd", "FusedBatchNormV3", [i("x", "x_" + fmt)] + stats, ["is_training=true"]),
        ("fwdi", "FusedBatchNormV3", [i("x", "x_" + fmt)] + stats, ["is_training=false"]),
        ("fwdex", "FusedBatchNormEx", [i("x", "x_" + fmt)] + stats + [i("side_input", "side_" + fmt)],
         ["is_training=true", "activation_mode=Relu"]),
        ("bwdex", "FusedBatchNormGradEx", grad + [i("offset", "offset"), i("y", "y_" + fmt)],
         ["is_training=true", "activation_mode=Relu"]),
    ]
    for tr in ("true", "false"):
        out.append(("bwd_" + tr, "FusedBatchNormGradV3", grad, ["is_training=" + tr]))
        out.append(("so_" + tr, "FusedBatchNormGradGradV3",
                    grad + [i("grad_x_backprop", "ddx_" + fmt),
                            i("grad_scale_backprop", "gs"), i("grad_offset_backprop", "go")],
                    ["is_training=" + tr]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bin_a")
    ap.add_argument("bin_b")
    ap.add_argument("--isa", default="avx2,avx512", help="comma-separated (FUSEDBN_ISA)")
    ap.add_argument("--dtype", default="f32,f16,bf16")
    ap.add_argument("--shape", action="append", help="N,H,W,C (repeatable)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        cases = make_inputs(os.path.join(tmp, "in"), shapes, args.dtype.split(","))
        compared, differ = 0, []
        for d in cases:
            for fmt in ("NHWC", "NCHW"):
                for isa in args.isa.split(","):
                    for name, op, inputs, attrs in runs(d, fmt):
                        outs = []
                        for k, b in enumerate((args.bin_a, args.bin_b)):
                            o = os.path.join(tmp, "out%d" % k)
                            cmd = [b, "run", op, "--out", o]
                            cmd += [a for x in inputs for a in ("--input", x)]
                            attr = attrs + ["data_format=" + fmt, "epsilon=0.001"]
                            cmd += [a for x in attr for a in ("--attr", x)]
                            env = dict(os.environ, FUSEDBN_ISA=isa)
                            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                            if r.returncode != 0:
                                sys.exit("%s failed: %s\n%s" % (b, " ".join(cmd), r.stderr))
                            outs.append({f: open(os.path.join(o, f), "rb").read()
                                         for f in sorted(os.listdir(o))})
                            for f in os.listdir(o):
                                os.remove(os.path.join(o, f))
                        for f in outs[0]:
                            compared += 1
                            if outs[0][f] != outs[1].get(f):
                                differ.append("%s %s %s %s: %s" % (os.path.basename(d), fmt, isa, name, f))
        print("%d output files compared, %d differ" % (compared, len(differ)))
        for line in differ[:20]:
            print("  " + line)
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
