#!/usr/bin/env python3
"""Generate golden fixtures for fusedbn from real TensorFlow (CPU, Eigen kernels).

Usage (from the repository root):

    python3 -m venv .venv-tf
    .venv-tf/bin/pip install -r scripts/requirements-fixtures.txt
    .venv-tf/bin/python scripts/gen_fixtures.py [--out tests/fixtures]

Every case is written to ``<out>/<case_name>/`` as ``case.json`` plus
``inputs/<name>.npy`` and ``expected/<name>.npy``; see tests/fixtures/README.md for
the format.  The output directory's case subdirectories are removed and rewritten on
every run, so the result is a pure function of this script, the seed and the TF build.
"""

import argparse
import json
import os
import shutil
import sys
import zlib

# Must be set before TensorFlow is imported: use the plain Eigen CPU kernels, not oneDNN.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

F32 = np.float32
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

FWD_OUTPUTS = ["y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2"]
FWD_INPUTS = ["x", "scale", "offset", "mean", "variance"]
GRAD_INPUTS = ["y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2"]
GRAD_OUTPUTS = ["x_backprop", "scale_backprop", "offset_backprop", "reserve_space_3", "reserve_space_4"]
GRADV3_OUTPUTS = ["x_backprop", "scale_backprop", "offset_backprop", "reserve_space_4", "reserve_space_5"]

FWD_OPS = {"V1": "FusedBatchNorm", "V2": "FusedBatchNormV2", "V3": "FusedBatchNormV3"}
GRAD_OPS = {"V1": "FusedBatchNormGrad", "V2": "FusedBatchNormGradV2", "V3": "FusedBatchNormGradV3"}

CHANNELS_LAST = {"NHWC": "NHWC", "NCHW": "NHWC", "NDHWC": "NDHWC", "NCDHW": "NDHWC"}

# Log of combinations TF's CPU kernel rejected and that were computed through the
# channels-last equivalent instead (printed at the end).
REJECTIONS = []


# ----------------------------------------------------------------------------- helpers

def channel_axis(fmt):
    return 1 if fmt in ("NCHW", "NCDHW") else len(fmt) - 1


def to_cl_perm(fmt):
    """Permutation taking a tensor in `fmt` to its channels-last equivalent."""
    if fmt in ("NHWC", "NDHWC"):
        return None
    rank = len(fmt)
    return [0] + list(range(2, rank)) + [1]


def from_cl_perm(fmt):
    p = to_cl_perm(fmt)
    return None if p is None else list(np.argsort(p))


def shape_in_format(cl_shape, fmt):
    """cl_shape is (N, spatial..., C); return the shape laid out in `fmt`."""
    cl_shape = tuple(cl_shape)
    assert len(cl_shape) == len(fmt), (cl_shape, fmt)
    if fmt in ("NHWC", "NDHWC"):
        return cl_shape
    return (cl_shape[0], cl_shape[-1]) + cl_shape[1:-1]


def case_rng(name):
    return np.random.default_rng(20240611 + zlib.crc32(name.encode()))


def make_x(rng, shape, fmt, dtype, mean=3.0, std=2.0):
    """Normal data with per-channel mean offsets, generated in f32 then cast to dtype."""
    ax = channel_axis(fmt)
    c = shape[ax]
    bshape = [1] * len(shape)
    bshape[ax] = c
    ch_mean = (mean + rng.uniform(-2.0, 2.0, c) * (std if abs(mean) < 100 else 0.0)).reshape(bshape)
    ch_std = (std * rng.uniform(0.5, 1.5, c)).reshape(bshape)
    x = rng.standard_normal(shape) * ch_std + ch_mean
    return x.astype(F32).astype(dtype)


def make_params(rng, c):
    scale = rng.uniform(0.5, 1.5, c).astype(F32)
    offset = rng.standard_normal(c).astype(F32)
    return scale, offset


def make_pop_stats(rng, c, mean=3.0, std=2.0):
    pm = (mean + rng.standard_normal(c) * (std if abs(mean) < 100 else 1.0)).astype(F32)
    pv = (std * std * rng.uniform(0.3, 2.0, c)).astype(F32)
    return pm, pv


def to_np(t):
    return np.asarray(t.numpy())


def call_raw(op, inputs, attrs):
    fn = getattr(tf.raw_ops, op)
    kw = dict(inputs)
    kw.update(attrs)
    return [to_np(t) for t in fn(**kw)]


def transpose(a, perm):
    return a if perm is None else np.ascontiguousarray(np.transpose(a, perm))


def run_op(op, inputs, attrs, data_names, outputs_with_data):
    """Run `op`; if TF's CPU kernel rejects the data format, run it on the
    channels-last transposed tensors and transpose the data outputs back.
    Returns (outputs, fallback_note_or_None)."""
    try:
        return call_raw(op, inputs, attrs), None
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        fmt = attrs["data_format"]
        if fmt == CHANNELS_LAST[fmt]:
            raise
        msg = str(e).strip().splitlines()[0]
        if msg.startswith("{{"):
            msg = msg.split("}}", 1)[-1].strip()
        msg = msg.split(" [Op:")[0].strip()
    perm = to_cl_perm(fmt)
    inv = from_cl_perm(fmt)
    cl_inputs = {k: (transpose(v, perm) if k in data_names else v) for k, v in inputs.items()}
    cl_attrs = dict(attrs)
    cl_attrs["data_format"] = CHANNELS_LAST[fmt]
    outs = call_raw(op, cl_inputs, cl_attrs)
    outs = [transpose(o, inv) if i in outputs_with_data else o for i, o in enumerate(outs)]
    REJECTIONS.append((op, fmt, attrs.get("is_training"), msg))
    note = (f"TF's CPU kernel rejected data_format={fmt} for this op/mode ({msg}); "
            f"computed via TF with data_format={CHANNELS_LAST[fmt]} on transposed tensors "
            f"and transposed the data outputs back.")
    return outs, note


# ----------------------------------------------------------------------------- writing

CASES = []


def write_case(out_dir, name, op, attrs, inputs, input_order, outputs, output_names,
               expected_names, note):
    assert name not in CASES, name
    CASES.append(name)
    d = os.path.join(out_dir, name)
    os.makedirs(os.path.join(d, "inputs"))
    os.makedirs(os.path.join(d, "expected"))
    for k in input_order:
        np.save(os.path.join(d, "inputs", k + ".npy"), inputs[k], allow_pickle=False)
    outmap = dict(zip(output_names, outputs))
    for k in expected_names:
        np.save(os.path.join(d, "expected", k + ".npy"), outmap[k], allow_pickle=False)
    # JSON has no NaN or infinity: a non-finite attribute is written as the string
    # the library's attribute parser takes ("NaN", "inf", "-inf").
    attrs = {k: (repr(v).replace("nan", "NaN") if isinstance(v, float) and not np.isfinite(v) else v)
             for k, v in attrs.items()}
    case = {
        "op": op,
        "attrs": attrs,
        "inputs": list(input_order),
        "outputs": list(output_names),
        "expected": list(expected_names),
        "tf_version": tf.__version__,
        "note": note,
    }
    with open(os.path.join(d, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
        f.write("\n")


def fwd_case(out_dir, name, ver, fmt, dt, mode, cl_shape, eps=1e-3, factor=None,
             xmean=3.0, xstd=2.0, x_override=None, params_override=None, stats_override=None,
             extra_note=""):
    """mode: 'train' (factor 1, empty mean/variance), 'train_avg' (factor != 1, real
    mean/variance), 'infer' (given population mean/variance)."""
    op = FWD_OPS[ver]
    rng = case_rng(name)
    dtype = DTYPES[dt]
    shape = shape_in_format(cl_shape, fmt)
    c = shape[channel_axis(fmt)]
    x = x_override.astype(dtype) if x_override is not None else make_x(rng, shape, fmt, dtype, xmean, xstd)
    scale, offset = params_override if params_override is not None else make_params(rng, c)
    if mode == "train":
        factor = 1.0 if factor is None else factor
        mean = np.zeros([0], F32)
        var = np.zeros([0], F32)
    else:
        if factor is None:
            factor = 0.5 if mode == "train_avg" else 1.0
        mean, var = stats_override if stats_override is not None else make_pop_stats(rng, c, xmean, xstd)
    is_training = mode != "infer"
    attrs = {"epsilon": eps, "data_format": fmt, "is_training": is_training,
             "exponential_avg_factor": factor}
    inputs = {"x": x, "scale": scale, "offset": offset, "mean": mean, "variance": var}
    tf_attrs = dict(attrs)
    outs, fb = run_op(op, inputs, tf_attrs, {"x"}, {0})
    names = FWD_OUTPUTS + (["reserve_space_3"] if ver == "V3" else [])
    empty = x.size == 0
    expected = ["y", "batch_mean", "batch_variance"]
    if is_training and not empty:
        expected += ["reserve_space_1", "reserve_space_2"]
    notes = [f"{op} {'training' if is_training else 'inference'} {fmt} {dt} x{list(x.shape)}"
             f" exponential_avg_factor={factor}."]
    if mode == "train":
        notes.append("mean/variance fed as empty [0] f32 (ignored by TF when factor == 1).")
    if not is_training:
        notes.append("reserve_space_1/2 not compared: TF leaves them unwritten in inference "
                     "(SPEC decision: copies of mean/variance).")
    if empty:
        notes.append("Empty x: reserve_space_1/2 not compared (TF leaves them uninitialised; "
                     "SPEC decision: NaN).")
    if ver == "V3":
        notes.append(f"reserve_space_3 not compared (TF gave shape {list(outs[5].shape)}; SPEC "
                     "decision: empty [0]).")
    if fb:
        notes.append(fb)
    if extra_note:
        notes.append(extra_note)
    write_case(out_dir, name, op, attrs, inputs, FWD_INPUTS, outs, names, expected, " ".join(notes))
    return outs


def grad_case(out_dir, name, ver, fmt, dt, mode, cl_shape, eps=1e-3, xmean=3.0, xstd=2.0,
              x_override=None, dy_override=None, scale_override=None, rs_override=None,
              extra_note=""):
    """mode: 'train' (reserve spaces from TF's forward op in training on the same x) or
    'infer' (made-up population mean/variance)."""
    op = GRAD_OPS[ver]
    fop = FWD_OPS[ver]
    rng = case_rng(name)
    dtype = DTYPES[dt]
    shape = shape_in_format(cl_shape, fmt)
    c = shape[channel_axis(fmt)]
    x = x_override.astype(dtype) if x_override is not None else make_x(rng, shape, fmt, dtype, xmean, xstd)
    dy = (dy_override if dy_override is not None else rng.standard_normal(shape)).astype(F32).astype(dtype)
    scale = scale_override if scale_override is not None else rng.uniform(0.5, 1.5, c).astype(F32)
    is_training = mode == "train"
    notes = [f"{op} {'training' if is_training else 'inference'} {fmt} {dt} x{list(x.shape)}."]
    # Forward run (same x, same mode) for the reserve spaces.
    offset0 = np.zeros(c, F32)
    if is_training:
        fwd_in = {"x": x, "scale": scale, "offset": offset0,
                  "mean": np.zeros([0], F32), "variance": np.zeros([0], F32)}
    else:
        pm, pv = rs_override if rs_override is not None else make_pop_stats(rng, c, xmean, xstd)
        fwd_in = {"x": x, "scale": scale, "offset": offset0, "mean": pm, "variance": pv}
    fwd_attrs = {"epsilon": eps, "data_format": fmt, "is_training": is_training}
    fwd_outs, _ = run_op(fop, fwd_in, fwd_attrs, {"x"}, {0})
    if is_training:
        if rs_override is not None:
            rs1, rs2 = rs_override
            notes.append("reserve_space_1/2 are given values (not from the forward op).")
        else:
            rs1, rs2 = fwd_outs[3], fwd_outs[4]
            notes.append(f"reserve_space_1/2 are TF's {fop} training outputs on the same x "
                         f"(epsilon {eps}).")
    else:
        rs1, rs2 = pm, pv
        notes.append("reserve_space_1/2 are a made-up population mean/variance.")
    inputs = {"y_backprop": dy, "x": x, "scale": scale, "reserve_space_1": rs1,
              "reserve_space_2": rs2}
    order = list(GRAD_INPUTS)
    if ver == "V3":
        inputs["reserve_space_3"] = fwd_outs[5]
        order.append("reserve_space_3")
        notes.append(f"reserve_space_3 is TF's {fop} output as given (shape "
                     f"{list(fwd_outs[5].shape)}).")
    attrs = {"epsilon": eps, "data_format": fmt, "is_training": is_training}
    outs, fb = run_op(op, inputs, attrs, {"x", "y_backprop"}, {0})
    names = GRADV3_OUTPUTS if ver == "V3" else GRAD_OUTPUTS
    expected = ["x_backprop", "scale_backprop", "offset_backprop"]
    notes.append(f"Placeholder outputs {names[3]}/{names[4]} not compared (TF shapes "
                 f"{list(outs[3].shape)} and {list(outs[4].shape)}; SPEC: empty [0]).")
    if fb:
        notes.append(fb)
    if extra_note:
        notes.append(extra_note)
    write_case(out_dir, name, op, attrs, inputs, order, outs, names, expected, " ".join(notes))
    return outs


# ----------------------------------------------------------------------------- case list

SHAPES4 = [(3, 5, 7, 19), (2, 9, 11, 3), (2, 4, 4, 17), (1, 6, 5, 33), (4, 3, 3, 1),
           (2, 7, 3, 8), (5, 2, 3, 6), (2, 5, 5, 2)]
SHAPES5 = [(2, 3, 4, 5, 6), (1, 3, 3, 5, 17), (2, 2, 3, 2, 19), (3, 2, 2, 2, 1),
           (1, 4, 5, 3, 7), (2, 3, 2, 3, 4)]
EPSILONS = [1e-3, 1e-4, 1e-5, 0.01]


def generate(out_dir):
    counters = {}

    def pick(lst):
        # Round-robin over each list independently, so shapes and epsilons vary.
        k = id(lst)
        counters[k] = counters.get(k, -1) + 1
        return lst[counters[k] % len(lst)]

    # --- Forward: every op x format x dtype x mode.
    for ver, fmts in (("V1", ["NHWC", "NCHW"]), ("V2", ["NHWC", "NCHW"]),
                      ("V3", ["NHWC", "NCHW", "NDHWC", "NCDHW"])):
        dts = ["f32"] if ver == "V1" else ["f32", "f16", "bf16"]
        for fmt in fmts:
            for dt in dts:
                for mode in ("train", "train_avg", "infer"):
                    shp = pick(SHAPES5 if len(fmt) == 5 else SHAPES4)
                    eps = pick(EPSILONS)
                    c = shp[-1]
                    name = f"{ver.lower()}_fwd_{mode}_{fmt.lower()}_{dt}_c{c}"
                    fwd_case(out_dir, name, ver, fmt, dt, mode, shp, eps=eps)

    # --- Gradient: every op x format x dtype x mode.
    for ver, fmts in (("V1", ["NHWC", "NCHW"]), ("V2", ["NHWC", "NCHW"]),
                      ("V3", ["NHWC", "NCHW", "NDHWC", "NCDHW"])):
        dts = ["f32"] if ver == "V1" else ["f32", "f16", "bf16"]
        for fmt in fmts:
            for dt in dts:
                for mode in ("train", "infer"):
                    shp = pick(SHAPES5 if len(fmt) == 5 else SHAPES4)
                    eps = pick(EPSILONS)
                    c = shp[-1]
                    name = f"{ver.lower()}_grad_{mode}_{fmt.lower()}_{dt}_c{c}"
                    grad_case(out_dir, name, ver, fmt, dt, mode, shp, eps=eps)

    # --- Special shapes and values.
    # M = 1 (one element per channel): variance 0, Bessel adj = 1.
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_m1", "V3", "NHWC", "f32", "train", (1, 1, 1, 5),
             extra_note="M = 1: biased variance 0, no Bessel correction.")
    fwd_case(out_dir, "v1_fwd_train_avg_nchw_f32_m1", "V1", "NCHW", "f32", "train_avg", (1, 1, 1, 3),
             factor=0.25, extra_note="M = 1 with exponential_avg_factor 0.25.")
    fwd_case(out_dir, "v2_fwd_train_nhwc_f16_m1", "V2", "NHWC", "f16", "train", (1, 1, 1, 4),
             extra_note="M = 1.")
    grad_case(out_dir, "v3_grad_train_nhwc_f32_m1", "V3", "NHWC", "f32", "train", (1, 1, 1, 5),
              extra_note="M = 1: x_backprop is ~0.")
    grad_case(out_dir, "v1_grad_train_nchw_f32_m1", "V1", "NCHW", "f32", "train", (1, 1, 1, 3),
              extra_note="M = 1.")
    # C = 1 in a 5-D layout and in bf16.
    fwd_case(out_dir, "v3_fwd_train_ncdhw_bf16_c1_2x3x2x5", "V3", "NCDHW", "bf16", "train", (2, 3, 2, 5, 1))
    grad_case(out_dir, "v3_grad_train_nchw_f16_c1_3x4x5", "V3", "NCHW", "f16", "train", (3, 4, 5, 1))
    # Larger cases.
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_large_c32", "V3", "NHWC", "f32", "train",
             (4, 16, 16, 32), eps=1e-3)
    grad_case(out_dir, "v3_grad_train_nchw_f32_large_c19", "V3", "NCHW", "f32", "train",
              (8, 9, 9, 19), eps=1e-3)
    # |mean| / std ~ 1e3.
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_mean1000", "V3", "NHWC", "f32", "train",
             (4, 7, 9, 3), xmean=1000.0, xstd=1.0,
             extra_note="x ~ N(1000, ~1) per channel: |mean|/std ~ 1e3.")
    fwd_case(out_dir, "v3_fwd_train_avg_nchw_f32_mean1000", "V3", "NCHW", "f32", "train_avg",
             (2, 9, 11, 5), xmean=1000.0, xstd=1.0, factor=0.1,
             extra_note="x ~ N(1000, ~1) per channel: |mean|/std ~ 1e3.")
    grad_case(out_dir, "v3_grad_train_nhwc_f32_mean1000", "V3", "NHWC", "f32", "train",
              (4, 7, 9, 3), xmean=1000.0, xstd=1.0,
              extra_note="x ~ N(1000, ~1) per channel: |mean|/std ~ 1e3.")
    # Inference with factor != 1 (factor must be ignored).
    fwd_case(out_dir, "v3_fwd_infer_nhwc_f32_factor05", "V3", "NHWC", "f32", "infer",
             (2, 3, 5, 7), factor=0.5, extra_note="Inference ignores exponential_avg_factor.")
    # Default epsilon (1e-4) with 5-D training-average.
    fwd_case(out_dir, "v3_fwd_train_avg_ndhwc_f16_c33", "V3", "NDHWC", "f16", "train_avg",
             (1, 2, 3, 4, 33), eps=1e-4, factor=0.9)

    # --- Empty x.
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_empty", "V3", "NHWC", "f32", "train", (0, 2, 2, 3))
    fwd_case(out_dir, "v3_fwd_train_nchw_f32_empty", "V3", "NCHW", "f32", "train", (0, 2, 2, 3))
    fwd_case(out_dir, "v3_fwd_train_avg_nhwc_f32_empty", "V3", "NHWC", "f32", "train_avg",
             (0, 2, 2, 3), extra_note="Empty x with factor 0.5: batch_mean/variance still NaN.")
    fwd_case(out_dir, "v1_fwd_train_nhwc_f32_empty", "V1", "NHWC", "f32", "train", (0, 2, 2, 3))
    fwd_case(out_dir, "v2_fwd_train_nchw_f16_empty", "V2", "NCHW", "f16", "train", (0, 2, 2, 3))
    fwd_case(out_dir, "v3_fwd_infer_nhwc_f32_empty", "V3", "NHWC", "f32", "infer", (0, 2, 2, 3),
             extra_note="Empty x in inference: TF returns NaN batch_mean/batch_variance here "
                        "too, not copies of the mean/variance inputs.")
    fwd_case(out_dir, "v3_fwd_train_ndhwc_f32_empty", "V3", "NDHWC", "f32", "train", (0, 2, 2, 2, 3))
    for ver in ("V1", "V2", "V3"):
        rs = (np.array([0.5, -1.0, 2.0], F32), np.array([1.0, 2.0, 0.25], F32))
        grad_case(out_dir, f"{ver.lower()}_grad_train_nhwc_f32_empty", ver, "NHWC", "f32", "train",
                  (0, 2, 2, 3), rs_override=rs,
                  extra_note="Empty x: reserve_space_1/2 given finite values (TF's forward "
                             "leaves them uninitialised for empty x).")
    grad_case(out_dir, "v3_grad_train_nchw_f32_empty", "V3", "NCHW", "f32", "train",
              (0, 2, 2, 3),
              rs_override=(np.array([0.5, -1.0, 2.0], F32), np.array([1.0, 2.0, 0.25], F32)),
              extra_note="Empty x: reserve_space_1/2 given finite values.")
    grad_case(out_dir, "v3_grad_train_nhwc_f32_empty_nanrs", "V3", "NHWC", "f32", "train",
              (0, 2, 2, 3), rs_override=(np.full(3, np.nan, F32), np.full(3, np.nan, F32)),
              extra_note="Empty x with NaN reserve spaces (what SPEC's forward produces for "
                         "empty x): TF still returns zero scale/offset_backprop.")
    grad_case(out_dir, "v2_grad_infer_nhwc_f16_empty", "V2", "NHWC", "f16", "infer", (0, 3, 2, 4))

    # --- SPEC section 8 reference values (TF kernel-test data).
    xr = np.array([5, 7, 9, 11, 13, 15, 5, 7, 9, 11, 13, 15], F32)
    xr = xr.reshape(2, 6).T.reshape(1, 1, 6, 2)
    fwd_case(out_dir, "v1_fwd_train_nhwc_f32_tfref", "V1", "NHWC", "f32", "train", (1, 1, 6, 2),
             x_override=xr,
             params_override=(np.array([4, 4], F32), np.array([2, 2], F32)),
             extra_note="SPEC section 8 reference: y ~ [-3.86, -1.51, 0.83, 3.17, 5.51, 7.86], "
                        "mean 10, var 14.")
    fwd_case(out_dir, "v3_fwd_train_avg_nhwc_f32_tfref", "V3", "NHWC", "f32", "train_avg",
             (1, 1, 6, 2), x_override=xr, factor=0.5,
             params_override=(np.array([4, 4], F32), np.array([2, 2], F32)),
             stats_override=(np.array([6, 6], F32), np.array([16, 16], F32)),
             extra_note="SPEC section 8 reference: batch_mean 8, batch_variance 15.")
    grad_case(out_dir, "v1_grad_train_nhwc_f32_tfref", "V1", "NHWC", "f32", "train", (1, 1, 6, 1),
              x_override=np.array([1, 7, 4, -3, -11, 13], F32).reshape(1, 1, 6, 1),
              dy_override=np.array([2, 9, -4, 5, 8, 7], F32).reshape(1, 1, 6, 1),
              scale_override=np.array([4], F32),
              rs_override=(np.array([1.833], F32), np.array([57.472], F32)),
              extra_note="SPEC section 8 reference: x_backprop ~ [-1.34, 2.47, -4.44, 0.17, "
                         "1.60, 1.53], scale_backprop ~ -1.6488, offset_backprop 27. With the "
                         "rounded reserve spaces 1.833/57.472 given here TF's scale_backprop is "
                         "-1.64765; -1.6488 needs the exact statistics (see the _exactrs case).")
    grad_case(out_dir, "v1_grad_train_nhwc_f32_tfref_exactrs", "V1", "NHWC", "f32", "train",
              (1, 1, 6, 1),
              x_override=np.array([1, 7, 4, -3, -11, 13], F32).reshape(1, 1, 6, 1),
              dy_override=np.array([2, 9, -4, 5, 8, 7], F32).reshape(1, 1, 6, 1),
              scale_override=np.array([4], F32),
              extra_note="SPEC section 8 gradient data with the reserve spaces from TF's forward "
                         "(mean 11/6, biased variance 57.4722): scale_backprop ~ -1.6488.")


def generate_hostile_attrs(out_dir):
    """Attributes TensorFlow's CPU kernels accept without a check: a negative, zero, NaN
    or infinite epsilon and an exponential_avg_factor outside [0, 1] or NaN. TF computes
    with them (NaN where variance + epsilon < 0, infinity where it is 0); so must we."""
    nan, inf = float("nan"), float("inf")
    # Population statistics whose variance + epsilon (-0.5) is -0.4, -0.1, 0.1, 1.5 and 0.
    mixed = (np.array([3, 2, 4, 3, 1], F32), np.array([0.1, 0.4, 0.6, 2, 0.5], F32))
    mixed_note = "epsilon -0.5 in inference: variance + epsilon -0.4, -0.1, 0.1, 1.5 and 0"
    # std 0.3-0.9 a channel: variance + epsilon below 0 in some channels, above in others.
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_epsneg", "V3", "NHWC", "f32", "train",
             (2, 5, 3, 7), eps=-0.5, xstd=0.6,
             extra_note="epsilon -0.5: y NaN in the channels whose variance is below 0.5.")
    fwd_case(out_dir, "v3_fwd_infer_nchw_f32_epsneg", "V3", "NCHW", "f32", "infer",
             (2, 4, 3, 5), eps=-0.5,
             stats_override=mixed, extra_note=mixed_note + " (y infinite there).")
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_epsnan", "V3", "NHWC", "f32", "train",
             (2, 3, 4, 5), eps=nan, extra_note="epsilon NaN: y NaN, the statistics finite.")
    fwd_case(out_dir, "v3_fwd_infer_nhwc_bf16_epsinf", "V3", "NHWC", "bf16", "infer",
             (2, 3, 4, 6), eps=inf, extra_note="epsilon infinite: y equals offset.")
    xc = np.random.default_rng(7).standard_normal((2, 3, 4, 4)).astype(F32)
    xc[..., 2] = 2.5
    fwd_case(out_dir, "v3_fwd_train_nhwc_f32_eps0_const", "V3", "NHWC", "f32", "train",
             (2, 3, 4, 4), eps=0.0, x_override=xc,
             extra_note="epsilon 0 and a constant channel 2: variance 0, (x - mean) · ∞ = NaN there.")
    fwd_case(out_dir, "v3_fwd_train_avg_nhwc_f32_factor2", "V3", "NHWC", "f32", "train_avg",
             (2, 3, 4, 5), factor=2.0, extra_note="exponential_avg_factor 2: running statistics "
                                                   "extrapolated past the batch's.")
    fwd_case(out_dir, "v3_fwd_train_avg_nchw_f16_factorneg", "V3", "NCHW", "f16", "train_avg",
             (2, 3, 4, 5), factor=-1.0, extra_note="exponential_avg_factor -1.")
    fwd_case(out_dir, "v3_fwd_train_avg_nhwc_f32_factornan", "V3", "NHWC", "f32", "train_avg",
             (2, 3, 4, 5), factor=nan, extra_note="exponential_avg_factor NaN: NaN running "
                                                  "statistics, y from the batch's.")
    grad_case(out_dir, "v3_grad_train_nhwc_f32_epsneg", "V3", "NHWC", "f32", "train",
              (2, 5, 3, 7), eps=-0.5, xstd=0.6,
              extra_note="epsilon -0.5: NaN where the batch variance is below 0.5.")
    grad_case(out_dir, "v3_grad_infer_nchw_bf16_epsneg", "V3", "NCHW", "bf16", "infer",
              (2, 4, 3, 5), eps=-0.5,
              rs_override=mixed, extra_note=mixed_note + ".")
    grad_case(out_dir, "v3_grad_infer_nhwc_f32_epsnan", "V3", "NHWC", "f32", "infer",
              (2, 3, 4, 5), eps=nan, extra_note="epsilon NaN.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures"))
    args = ap.parse_args()
    out_dir = os.path.normpath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    # Remove previously generated case directories (anything with a case.json).
    for entry in sorted(os.listdir(out_dir)):
        p = os.path.join(out_dir, entry)
        if os.path.isdir(p) and os.path.exists(os.path.join(p, "case.json")):
            shutil.rmtree(p)
    generate(out_dir)
    generate_hostile_attrs(out_dir)
    print(f"TensorFlow {tf.__version__}: wrote {len(CASES)} cases to {out_dir}")
    if REJECTIONS:
        print("Combinations rejected by TF's CPU kernel (computed channels-last instead):")
        for op, fmt, tr, msg in sorted(set(REJECTIONS)):
            print(f"  {op} data_format={fmt} is_training={tr}: {msg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
