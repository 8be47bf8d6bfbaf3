#!/usr/bin/env python3
"""Golden fixtures from real TensorFlow for the Ex ops, the second-order gradients and
the Keras-style layer.

Usage (from the repository root; see tests/fixtures_ex/README.md and
tests/fixtures_keras/README.md):

    python3 -m venv .venv-tf
    .venv-tf/bin/pip install -r scripts/requirements-fixtures.txt
    .venv-tf/bin/pip install --no-deps tf-keras==2.21.0
    .venv-tf/bin/python scripts/gen_fixtures_ex.py \
        [--out-ex tests/fixtures_ex] [--out-keras tests/fixtures_keras]

Writes
  * ``tests/fixtures_ex/<case>/``: FusedBatchNormEx, FusedBatchNormGradEx and
    FusedBatchNormGradGrad{,V2,V3} cases in the format of tests/fixtures (case.json +
    inputs/*.npy + expected/*.npy);
  * ``tests/fixtures_keras/<case>/``: multi-step runs of Keras 2's (tf_keras)
    ``BatchNormalization(fused=True)`` layer.

TF only has ``_FusedBatchNormEx`` / ``_FusedBatchNormGradEx`` on GPU, so the Ex expected
values are TF's CPU FusedBatchNormV3 composed with TF ops (``act(bn(x) + side)``) and, for
the gradient, ``tf.GradientTape`` through that composite. Second-order expected values are
``tf.GradientTape`` through TF's first-order raw grad op (i.e. TF's registered gradient of
FusedBatchNormGrad{,V2,V3}). Each case's ``note`` says exactly how it was made.

The output directories' case subdirectories are removed and rewritten on every run; the
result is a pure function of this script, the seeds and the TF build.
"""

import argparse
import json
import os
import shutil
import sys

# Must be set before TensorFlow is imported: use the plain Eigen CPU kernels, not oneDNN.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gen_fixtures as G  # noqa: E402  (imports TF with the settings above)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gen_fixtures import (  # noqa: E402
    DTYPES, F32, FWD_OUTPUTS, GRAD_OPS, GRADV3_OUTPUTS, case_rng, channel_axis,
    make_params, make_pop_stats, make_x, run_op, shape_in_format, to_cl_perm,
    from_cl_perm, transpose,
)

EX_FWD_OP = "FusedBatchNormEx"
EX_GRAD_OP = "FusedBatchNormGradEx"
EX_FWD_INPUTS = ["x", "scale", "offset", "mean", "variance", "side_input"]
EX_FWD_OUTPUTS = FWD_OUTPUTS + ["reserve_space_3"]
EX_GRAD_INPUTS = ["y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2",
                  "reserve_space_3", "offset", "y"]
EX_GRAD_OUTPUTS = GRADV3_OUTPUTS + ["side_input_backprop"]

GG_OPS = {"V1": "FusedBatchNormGradGrad", "V2": "FusedBatchNormGradGradV2",
          "V3": "FusedBatchNormGradGradV3"}
GG_OUTPUTS = ["grad_y_backprop", "grad_x", "grad_scale"]
GG_EXTRA_INPUTS = ["grad_x_backprop", "grad_scale_backprop", "grad_offset_backprop"]

# Things TF refused, and the fallback used (printed at the end).
FALLBACKS = []


def tfc(a):
    return tf.constant(a)


def act_fn(act):
    return tf.nn.relu if act == "Relu" else tf.identity


def v3_attrs(eps, fmt, is_training, factor=None):
    a = {"epsilon": eps, "data_format": fmt, "is_training": is_training}
    if factor is not None:
        a["exponential_avg_factor"] = factor
    return a


def write_ex_case(out_dir, name, op, attrs, inputs, input_order, outputs, output_names,
                  expected_names, note):
    G.write_case(out_dir, name, op, attrs, inputs, input_order, outputs, output_names,
                 expected_names, note)


# ----------------------------------------------------------------------------- Ex forward

def exfwd_case(out_dir, name, fmt, dt, mode, act, side, cl_shape, eps=1e-3, factor=None,
               extra_note=""):
    """mode: 'train' (factor 1, empty mean/variance), 'train_avg' (factor 0.5 unless
    given, real mean/variance), 'infer'."""
    assert not (mode != "infer" and side and act == "Identity"), "SPEC section 4 rule 8"
    rng = case_rng(name)
    dtype = DTYPES[dt]
    shape = shape_in_format(cl_shape, fmt)
    c = shape[channel_axis(fmt)]
    x = make_x(rng, shape, fmt, dtype)
    scale, offset = make_params(rng, c)
    is_training = mode != "infer"
    if mode == "train":
        factor = 1.0 if factor is None else factor
        mean = np.zeros([0], F32)
        var = np.zeros([0], F32)
    else:
        if factor is None:
            factor = 0.5 if mode == "train_avg" else 1.0
        mean, var = make_pop_stats(rng, c)
    side_in = (rng.standard_normal(shape) * 1.5).astype(F32).astype(dtype) if side else None
    attrs = {"epsilon": eps, "data_format": fmt, "is_training": is_training,
             "exponential_avg_factor": factor, "activation_mode": act}
    base_in = {"x": x, "scale": scale, "offset": offset, "mean": mean, "variance": var}
    notes = [f"{EX_FWD_OP} (TF's _FusedBatchNormEx, GPU-only in TF) "
             f"{'training' if is_training else 'inference'} {fmt} {dt} x{list(x.shape)} "
             f"exponential_avg_factor={factor} activation_mode={act} "
             f"side_input={'yes' if side else 'no'}."]
    # Statistics and reserve spaces: TF's FusedBatchNormV3 fed exactly these inputs (x in T).
    outs_t, fb = run_op("FusedBatchNormV3", base_in, v3_attrs(eps, fmt, is_training, factor),
                        {"x"}, {0})
    assert fb is None, fb
    # y: V3 on x widened to f32 (y stays f32), + side_input in f32, act in f32, one rounding.
    if dtype is F32:
        y_bn = outs_t[0]
        notes.append("Expected y = act(FusedBatchNormV3(x,...).y + side_input) with TF ops "
                     "(tf.add, tf.nn.relu) in f32. batch_mean/batch_variance/reserve_space_1/2 "
                     "are that FusedBatchNormV3 call's outputs.")
    else:
        in32 = dict(base_in)
        in32["x"] = x.astype(F32)
        outs_32, _ = run_op("FusedBatchNormV3", in32, v3_attrs(eps, fmt, is_training, factor),
                            {"x"}, {0})
        y_bn = outs_32[0]
        d = max(float(np.max(np.abs(outs_32[i].astype(np.float64) - outs_t[i])))
                if outs_t[i].size else 0.0 for i in (1, 2, 3, 4)) if is_training else 0.0
        notes.append(f"Half type: expected y = cast_T(act_f32(FusedBatchNormV3(x widened to "
                     f"f32).y + f32(side_input))), i.e. bn, add and activation in f32 and ONE "
                     f"rounding to {dt} at the end (SPEC section 1: y is rounded to T once). "
                     f"batch_mean/batch_variance/reserve_space_1/2 are FusedBatchNormV3's "
                     f"outputs with x fed in {dt} (max |diff| vs the f32-widened run: "
                     f"{d:.3g}).")
    pre = tfc(y_bn)
    if side:
        pre = tf.add(pre, tfc(side_in.astype(F32)))
    y = act_fn(act)(pre).numpy().astype(dtype)
    inputs = dict(base_in)
    order = list(EX_FWD_INPUTS[:5])
    if side:
        inputs["side_input"] = side_in
        order.append("side_input")
    outs = [y] + outs_t[1:]
    expected = ["y", "batch_mean", "batch_variance"]
    if is_training:
        expected += ["reserve_space_1", "reserve_space_2"]
    if mode == "train":
        notes.append("mean/variance fed as empty [0] f32 (ignored when factor == 1).")
    if not is_training:
        notes.append("reserve_space_1/2 not compared: TF leaves them unwritten in inference "
                     "(SPEC decision: copies of mean/variance).")
    notes.append(f"reserve_space_3 not compared (TF gave shape {list(outs_t[5].shape)}; "
                 "SPEC decision: empty [0]).")
    if act == "Relu":
        notes.append(f"{int(np.sum(y.astype(F32) == 0))} of {y.size} y elements are 0 "
                     "after Relu.")
    if extra_note:
        notes.append(extra_note)
    write_ex_case(out_dir, name, EX_FWD_OP, attrs, inputs, order, outs, EX_FWD_OUTPUTS,
                  expected, " ".join(notes))


# ----------------------------------------------------------------------------- Ex gradient

def exgrad_case(out_dir, name, fmt, dt, mode, act, side, cl_shape, eps=1e-3,
                relu_zero=False, extra_note=""):
    """Expected values: tf.GradientTape through act(FusedBatchNormV3(x, scale, offset).y +
    side) w.r.t. x, scale, offset, side with upstream y_backprop (in f32 for half types)."""
    assert not (mode != "infer" and side and act == "Identity"), "SPEC section 4 rule 8"
    rng = case_rng(name)
    dtype = DTYPES[dt]
    shape = shape_in_format(cl_shape, fmt)
    c = shape[channel_axis(fmt)]
    is_training = mode == "train"
    x = make_x(rng, shape, fmt, dtype)
    dy = rng.standard_normal(shape).astype(F32).astype(dtype)
    scale, offset = make_params(rng, c)
    if is_training:
        mean = np.zeros([0], F32)
        var = np.zeros([0], F32)
    else:
        mean, var = make_pop_stats(rng, c)
    side_in = (rng.standard_normal(shape) * 1.5).astype(F32).astype(dtype) if side else None
    notes = [f"{EX_GRAD_OP} (TF's _FusedBatchNormGradEx, GPU-only in TF) "
             f"{'training' if is_training else 'inference'} {fmt} {dt} x{list(x.shape)} "
             f"activation_mode={act}; forward had side_input={'yes' if side else 'no'}."]
    x32 = x.astype(F32)
    if relu_zero:
        # side = -bn(x): the pre-activation is exactly 0 wherever chosen.
        bn = tf.raw_ops.FusedBatchNormV3(x=x32, scale=scale, offset=offset, mean=mean,
                                         variance=var, **v3_attrs(eps, fmt, is_training))[0]
        bn = bn.numpy()
        sel = rng.uniform(size=shape) < 0.5
        side_in = np.where(sel, -bn, (rng.standard_normal(shape) * 1.5).astype(F32)).astype(F32)
    side32 = side_in.astype(F32) if side_in is not None else np.zeros(shape, F32)
    tx, ts, to, tside = tfc(x32), tfc(scale), tfc(offset), tfc(side32)
    with tf.GradientTape() as tape:
        tape.watch([tx, ts, to, tside])
        fo = tf.raw_ops.FusedBatchNormV3(x=tx, scale=ts, offset=to, mean=tfc(mean),
                                         variance=tfc(var), **v3_attrs(eps, fmt, is_training))
        pre = tf.add(fo[0], tside)
        yv = act_fn(act)(pre)
    gx, gs, go, gside = tape.gradient(yv, [tx, ts, to, tside], output_gradients=tfc(dy.astype(F32)))
    y32 = yv.numpy()
    y_t = y32.astype(dtype)
    if act == "Relu":
        # The mask the op will see is y_t > 0 (y in T); the tape masked with y32 > 0.
        assert np.array_equal(y32 > 0, y_t.astype(F32) > 0), "mask changes on rounding y to T"
        if relu_zero:
            pre_np = pre.numpy()
            nz = int(np.sum(pre_np == 0))
            gside_np = gside.numpy()
            assert nz > 0 and np.all(gside_np[pre_np == 0] == 0)
            notes.append(f"side_input = -FusedBatchNormV3(x).y (f32) at ~half the elements, so "
                         f"the pre-activation is exactly 0.0 at {nz} of {pre_np.size} elements: "
                         "TF's tape (ReluGrad, which masks by relu output > 0) gives gradient 0 "
                         "there, i.e. y == 0 means masked.")
    if is_training:
        rs1, rs2 = fo[3].numpy(), fo[4].numpy()
        notes.append("reserve_space_1/2 are FusedBatchNormV3's training outputs on x "
                     f"{'(widened to f32) ' if dtype is not F32 else ''}(batch mean, biased "
                     "variance); the tape's gradient (TF's registered FusedBatchNormV3 "
                     "gradient = FusedBatchNormGradV3 training) differentiates through the "
                     "batch statistics.")
    else:
        rs1, rs2 = mean, var
        notes.append("reserve_space_1/2 are the population mean/variance fed to the forward "
                     "(SPEC: inference gradient reads them as mean/variance; TF's own V3 "
                     "leaves rs1/rs2 unwritten in inference). The tape used TF's inference "
                     "gradient of FusedBatchNormV3 (which itself transposes NCHW/NCDHW to "
                     "channels-last).")
    rs3 = fo[5].numpy()
    notes.append(f"reserve_space_3 is FusedBatchNormV3's output as given (shape "
                 f"{list(rs3.shape)}).")
    if act == "Relu" and not relu_zero:
        notes.append(f"{int(np.sum(y32 <= 0))} of {y32.size} y elements are 0 (masked).")
    inputs = {"y_backprop": dy, "x": x, "scale": scale, "reserve_space_1": rs1,
              "reserve_space_2": rs2, "reserve_space_3": rs3, "offset": offset, "y": y_t}
    x_bp = gx.numpy().astype(dtype)
    side_bp = gside.numpy().astype(dtype)
    outs = [x_bp, gs.numpy(), go.numpy(), np.zeros([0], F32), np.zeros([0], F32), side_bp]
    if dtype is not F32:
        notes.append(f"Half type: tape in f32 on the T values widened; x_backprop and "
                     f"side_input_backprop rounded to {dt} once; the y input is the f32 "
                     f"forward y rounded to {dt} (mask y > 0 unchanged by the rounding).")
    notes.append("side_input_backprop = tape gradient w.r.t. the side input (zeros added "
                 "when the forward had none) = dy masked by y > 0 for Relu, dy for Identity. "
                 "reserve_space_4/5 not compared (SPEC: empty [0]).")
    if extra_note:
        notes.append(extra_note)
    attrs = {"epsilon": eps, "data_format": fmt, "is_training": is_training,
             "activation_mode": act}
    expected = ["x_backprop", "scale_backprop", "offset_backprop", "side_input_backprop"]
    write_ex_case(out_dir, name, EX_GRAD_OP, attrs, inputs, EX_GRAD_INPUTS, outs,
                  EX_GRAD_OUTPUTS, expected, " ".join(notes))


# ----------------------------------------------------------------------------- second order

def _gg_tape(op, dy, x, scale, rs1, rs2, rs3, A, a, b, eps, fmt, is_training):
    tdy, tx, ts = tfc(dy), tfc(x), tfc(scale)
    kw = {"reserve_space_1": tfc(rs1), "reserve_space_2": tfc(rs2)}
    if rs3 is not None:
        kw["reserve_space_3"] = tfc(rs3)
    with tf.GradientTape() as tape:
        tape.watch([tdy, tx, ts])
        o = getattr(tf.raw_ops, op)(y_backprop=tdy, x=tx, scale=ts, epsilon=eps,
                                    data_format=fmt, is_training=is_training, **kw)
    g = tape.gradient(list(o[:3]), [tdy, tx, ts],
                      output_gradients=[tfc(A), tfc(a), tfc(b)])
    return [t.numpy() for t in g]


def gg_case(out_dir, name, ver, fmt, dt, mode, cl_shape, eps=1e-3, fake_rs=False,
            extra_note=""):
    op = GG_OPS[ver]
    gop = GRAD_OPS[ver]
    fop = G.FWD_OPS[ver]
    rng = case_rng(name)
    dtype = DTYPES[dt]
    shape = shape_in_format(cl_shape, fmt)
    c = shape[channel_axis(fmt)]
    is_training = mode == "train"
    x = make_x(rng, shape, fmt, dtype)
    dy = rng.standard_normal(shape).astype(F32).astype(dtype)
    scale = rng.uniform(0.5, 1.5, c).astype(F32)
    A = rng.standard_normal(shape).astype(F32).astype(dtype)
    a = rng.standard_normal(c).astype(F32)
    b = rng.standard_normal(c).astype(F32)
    notes = [f"{op} = gradient of {gop} {'training' if is_training else 'inference'} {fmt} "
             f"{dt} x{list(x.shape)}. Expected values: tf.GradientTape through "
             f"tf.raw_ops.{gop} w.r.t. (y_backprop, x, scale) with output_gradients "
             "(grad_x_backprop, grad_scale_backprop, grad_offset_backprop), i.e. TF's "
             f"registered gradient of {gop} (python _BatchNormGrad composite"
             f"{', mean/variance recomputed from x' if is_training else ''})."]
    offset0 = np.zeros(c, F32)
    if is_training:
        fwd_in = {"x": x, "scale": scale, "offset": offset0,
                  "mean": np.zeros([0], F32), "variance": np.zeros([0], F32)}
    else:
        pm, pv = make_pop_stats(rng, c)
        fwd_in = {"x": x, "scale": scale, "offset": offset0, "mean": pm, "variance": pv}
    fwd_outs, _ = run_op(fop, fwd_in, v3_attrs(eps, fmt, is_training), {"x"}, {0})
    if is_training:
        rs1, rs2 = fwd_outs[3], fwd_outs[4]
        if fake_rs:
            rs1 = (rs1 + rng.uniform(0.5, 1.0, c)).astype(F32)
            rs2 = (rs2 * rng.uniform(1.5, 2.5, c)).astype(F32)
            notes.append("reserve_space_1/2 deliberately NOT the batch statistics (batch "
                         "mean + U(0.5,1), biased variance * U(1.5,2.5)): in training TF's "
                         "second-order gradient ignores them and recomputes mean/variance "
                         "from x.")
        else:
            notes.append(f"reserve_space_1/2 are TF's {fop} training outputs on the same x "
                         "(not used by TF's second-order gradient in training, which "
                         "recomputes them from x).")
    else:
        rs1, rs2 = pm, pv
        notes.append("reserve_space_1/2 are a made-up population mean/variance.")
    rs3 = fwd_outs[5] if ver == "V3" else None
    perm = to_cl_perm(fmt)
    run_fmt = fmt
    if not is_training and perm is not None:
        try:
            _gg_tape(gop, dy, x, scale, rs1, rs2, rs3, A, a, b, eps, fmt, is_training)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
            # TF's first-order CPU kernel only takes channels-last in inference.
            msg = str(e).strip().splitlines()[0]
            msg = msg.split("}}", 1)[-1].strip().split(" [Op:")[0].strip()
            run_fmt = G.CHANNELS_LAST[fmt]
            FALLBACKS.append((gop, fmt, "is_training=False", msg))
            notes.append(f"TF's CPU {gop} rejected data_format={fmt} with is_training=False "
                         f"({msg}), so the tape ran on the {run_fmt}-transposed y_backprop/x/"
                         "grad_x_backprop and grad_y_backprop/grad_x were transposed back.")
    tr = (lambda t: transpose(t, perm)) if run_fmt != fmt else (lambda t: t)
    inv = (lambda t: transpose(t, from_cl_perm(fmt))) if run_fmt != fmt else (lambda t: t)
    try:
        g = _gg_tape(gop, tr(dy), tr(x), scale, rs1, rs2, rs3, tr(A), a, b, eps, run_fmt,
                     is_training)
        if dtype is not F32:
            notes.append(f"Half type: TF's registered second-order gradient itself widens "
                         f"y_backprop/x to f32, computes in f32 and rounds grad_y_backprop/"
                         f"grad_x to {dt} once (TF ran natively on the {dt} tensors).")
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        if dtype is F32:
            raise
        FALLBACKS.append((op, fmt, dt, str(e).splitlines()[0][:120]))
        g = _gg_tape(gop, tr(dy).astype(F32), tr(x).astype(F32), scale, rs1, rs2, rs3,
                     tr(A).astype(F32), a, b, eps, run_fmt, is_training)
        g[0], g[1] = g[0].astype(dtype), g[1].astype(dtype)
        notes.append(f"TF refused the {dt} second-order gradient; tape ran in f32 on the "
                     f"widened tensors and grad_y_backprop/grad_x were rounded to {dt} once.")
    g[0], g[1] = inv(g[0]), inv(g[1])
    if is_training and x.size == c:
        # M = 1: the exact answer is grad_y_backprop = grad_offset_backprop, grad_x = 0,
        # grad_scale = 0; TF's composite leaves a rounding residue amplified by r.
        bshape = [1] * len(shape)
        bshape[channel_axis(fmt)] = c
        dev = float(np.max(np.abs(g[0].astype(np.float64) - b.reshape(bshape))))
        notes.append(f"M = 1: exactly, grad_y_backprop = grad_offset_backprop and grad_x = "
                     f"grad_scale = 0; TF's composite gives grad_y_backprop off by up to "
                     f"{dev:.2g} (f32 rounding residue times scale*rsqrt(epsilon)).")
    assert g[0].dtype == dtype and g[1].dtype == dtype and g[2].dtype == F32
    assert g[2].shape == (c,), g[2].shape
    inputs = {"y_backprop": dy, "x": x, "scale": scale, "reserve_space_1": rs1,
              "reserve_space_2": rs2, "grad_x_backprop": A, "grad_scale_backprop": a,
              "grad_offset_backprop": b}
    order = ["y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2"]
    if ver == "V3":
        inputs["reserve_space_3"] = rs3
        order.append("reserve_space_3")
        notes.append(f"reserve_space_3 is TF's {fop} output as given (shape "
                     f"{list(rs3.shape)}).")
    order += GG_EXTRA_INPUTS
    if extra_note:
        notes.append(extra_note)
    attrs = {"epsilon": eps, "data_format": fmt, "is_training": is_training}
    write_ex_case(out_dir, name, op, attrs, inputs, order, g, GG_OUTPUTS, GG_OUTPUTS,
                  " ".join(notes))


# ----------------------------------------------------------------------------- Keras layer

KERAS_CASES = []


def keras_case(out_dir, name, fmt, momentum, center, scale, cl_shape, trainings,
               epsilon=1e-3):
    import tf_keras
    rng = case_rng("keras/" + name)
    shape = shape_in_format(cl_shape, fmt)
    axis = -1 if fmt == "NHWC" else 1
    c = shape[channel_axis(fmt)]
    layer = tf_keras.layers.BatchNormalization(axis=axis, momentum=momentum, epsilon=epsilon,
                                               center=center, scale=scale, fused=True)
    layer.build(shape)
    assert layer.fused and layer._data_format == fmt, (layer.fused, layer._data_format)
    init = {
        "gamma": rng.uniform(0.5, 1.5, c).astype(F32) if scale else None,
        "beta": rng.standard_normal(c).astype(F32) if center else None,
        "moving_mean": rng.standard_normal(c).astype(F32),
        "moving_variance": rng.uniform(0.5, 2.0, c).astype(F32),
    }
    layer.set_weights([init[k] for k in ("gamma", "beta", "moving_mean", "moving_variance")
                       if init[k] is not None])
    d = os.path.join(out_dir, name)
    os.makedirs(d)

    def save(fname, arr):
        np.save(os.path.join(d, fname), arr, allow_pickle=False)
        return fname

    initial = {}
    for k, v in init.items():
        initial[k] = save(f"init_{k}.npy", v) if v is not None else None
    steps = []
    ax = channel_axis(fmt)
    for i, training in enumerate(trainings):
        bshape = [1] * len(shape)
        bshape[ax] = c
        # Per-channel mean/std drift between steps so the moving stats move.
        chm = rng.uniform(-2, 2, c).reshape(bshape) + 0.3 * i
        chs = rng.uniform(0.5, 2.0, c).reshape(bshape)
        x = (rng.standard_normal(shape) * chs + chm).astype(F32)
        dy = rng.standard_normal(shape).astype(F32)
        tx = tfc(x)
        watched = [tx] + ([layer.gamma] if scale else []) + ([layer.beta] if center else [])
        with tf.GradientTape() as tape:
            tape.watch(tx)
            y = layer(tx, training=training)
        grads = tape.gradient(y, watched, output_gradients=tfc(dy))
        dx = grads[0].numpy()
        dgamma = grads[1].numpy() if scale else None
        dbeta = grads[1 + int(scale)].numpy() if center else None
        st = {"training": bool(training),
              "x": save(f"step{i}_x.npy", x),
              "dy": save(f"step{i}_dy.npy", dy),
              "y": save(f"step{i}_y.npy", y.numpy()),
              "dx": save(f"step{i}_dx.npy", dx),
              "dgamma": save(f"step{i}_dgamma.npy", dgamma) if scale else None,
              "dbeta": save(f"step{i}_dbeta.npy", dbeta) if center else None,
              "moving_mean": save(f"step{i}_moving_mean.npy", layer.moving_mean.numpy()),
              "moving_variance": save(f"step{i}_moving_variance.npy",
                                      layer.moving_variance.numpy())}
        steps.append(st)
    case = {"axis": axis, "data_format": fmt, "momentum": momentum, "epsilon": epsilon,
            "center": center, "scale": scale, "steps": steps, "initial": initial,
            "tf_version": tf.__version__, "keras": f"tf_keras {tf_keras.__version__}",
            "note": (f"tf_keras.layers.BatchNormalization(axis={axis}, momentum={momentum}, "
                     f"epsilon={epsilon}, center={center}, scale={scale}, fused=True), eager. "
                     f"Training calls run FusedBatchNormV3(is_training=True, "
                     f"exponential_avg_factor=1-momentum={1 - momentum:.6g}, mean/variance = "
                     "moving stats) and assign its batch_mean/batch_variance outputs (Bessel-"
                     "corrected variance) to the moving stats; inference calls run "
                     "FusedBatchNormV3(is_training=False) with the moving stats and leave "
                     "them unchanged. moving_mean/moving_variance are the values AFTER the "
                     "step. dx/dgamma/dbeta: tf.GradientTape with output_gradients=dy. "
                     "gamma/beta/moving stats were set to the 'initial' values with "
                     "set_weights before step 0; gamma (beta) is absent and the layer uses "
                     "1 (0) when scale (center) is false.")}
    with open(os.path.join(d, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
        f.write("\n")
    KERAS_CASES.append(name)


def check_keras_uses_fused_v3():
    """Trace the layer once and confirm the graph contains FusedBatchNormV3."""
    import tf_keras
    layer = tf_keras.layers.BatchNormalization(fused=True)
    layer.build((2, 3, 3, 4))

    @tf.function
    def f(x):
        return layer(x, training=True)

    g = f.get_concrete_function(tf.TensorSpec((2, 3, 3, 4), tf.float32)).graph
    types = {op.type for op in g.get_operations()}
    assert "FusedBatchNormV3" in types, sorted(types)


# ----------------------------------------------------------------------------- case list

SHAPES4 = [(2, 3, 4, 17), (3, 2, 5, 1), (2, 5, 3, 3), (1, 4, 5, 2), (4, 3, 3, 6), (2, 2, 3, 8),
           (1, 1, 1, 5), (3, 3, 2, 4)]
SHAPES5 = [(2, 2, 3, 2, 5), (1, 3, 2, 3, 1), (2, 2, 2, 2, 17), (3, 2, 2, 3, 3),
           (1, 1, 1, 1, 4), (2, 3, 1, 2, 6)]
EPSILONS = [1e-3, 1e-4, 1e-5, 0.01]
FORMATS = ["NHWC", "NCHW", "NDHWC", "NCDHW"]
DTS = ["f32", "f16", "bf16"]


def generate_ex(out_dir):
    counters = {}

    def pick(key, lst):
        counters[key] = counters.get(key, -1) + 1
        return lst[counters[key] % len(lst)]

    def shp(fmt, key):
        return pick(key + str(len(fmt)), SHAPES5 if len(fmt) == 5 else SHAPES4)

    # --- Ex forward: every valid (mode, act, side) x every format; dtype round-robin.
    combos = [("train", "Identity", False), ("train", "Relu", False), ("train", "Relu", True),
              ("train_avg", "Identity", False), ("train_avg", "Relu", False),
              ("train_avg", "Relu", True),
              ("infer", "Identity", False), ("infer", "Relu", False),
              ("infer", "Identity", True), ("infer", "Relu", True)]
    for mode, act, side in combos:
        for fmt in FORMATS:
            dt = pick("fdt", DTS)
            s = shp(fmt, "f")
            eps = pick("feps", EPSILONS)
            name = (f"exfwd_{mode}_{act.lower()}{'_side' if side else ''}_{fmt.lower()}_{dt}"
                    f"_c{s[-1]}")
            exfwd_case(out_dir, name, fmt, dt, mode, act, side, s, eps=eps)
    # Inference ignores the factor.
    exfwd_case(out_dir, "exfwd_infer_relu_side_nhwc_f32_factor05", "NHWC", "f32", "infer",
               "Relu", True, (2, 3, 3, 5), factor=0.5,
               extra_note="Inference with exponential_avg_factor 0.5 (ignored).")

    # --- Ex gradient.
    gcombos = [("train", "Identity", False), ("train", "Relu", False), ("train", "Relu", True),
               ("infer", "Identity", False), ("infer", "Relu", False),
               ("infer", "Identity", True), ("infer", "Relu", True)]
    for mode, act, side in gcombos:
        for fmt in FORMATS:
            dt = pick("gdt", DTS)
            s = shp(fmt, "g")
            eps = pick("geps", EPSILONS)
            name = (f"exgrad_{mode}_{act.lower()}{'_side' if side else ''}_{fmt.lower()}_{dt}"
                    f"_c{s[-1]}")
            exgrad_case(out_dir, name, fmt, dt, mode, act, side, s, eps=eps)
    exgrad_case(out_dir, "exgrad_train_relu_zero_nhwc_f32_c4", "NHWC", "f32", "train", "Relu",
                True, (2, 3, 3, 4), relu_zero=True)
    exgrad_case(out_dir, "exgrad_infer_relu_zero_nchw_f32_c3", "NCHW", "f32", "infer", "Relu",
                True, (2, 3, 4, 3), relu_zero=True)

    # --- Second order.
    for ver, fmts in (("V1", ["NHWC", "NCHW"]), ("V2", ["NHWC", "NCHW"]),
                      ("V3", FORMATS)):
        for fmt in fmts:
            for mode in ("train", "infer"):
                s = shp(fmt, "gg")
                eps = pick("ggeps", EPSILONS)
                name = f"gg{ver[1]}_{mode}_{fmt.lower()}_f32_c{s[-1]}"
                gg_case(out_dir, name, ver, fmt, "f32", mode, s, eps=eps)
    for ver, fmt, dt, mode, s in (("V2", "NHWC", "f16", "train", (2, 3, 4, 5)),
                                  ("V2", "NCHW", "bf16", "infer", (2, 3, 2, 4)),
                                  ("V3", "NCHW", "f16", "train", (2, 2, 3, 6)),
                                  ("V3", "NDHWC", "bf16", "train", (2, 2, 2, 3, 3)),
                                  ("V3", "NCDHW", "f16", "infer", (1, 2, 3, 2, 5)),
                                  ("V2", "NHWC", "bf16", "train", (3, 2, 2, 7))):
        gg_case(out_dir, f"gg{ver[1]}_{mode}_{fmt.lower()}_{dt}_c{s[-1]}", ver, fmt, dt, mode,
                s, eps=1e-3)
    gg_case(out_dir, "gg3_train_nhwc_f32_c3_fakers", "V3", "NHWC", "f32", "train",
            (2, 3, 3, 3), fake_rs=True)
    gg_case(out_dir, "gg1_train_nchw_f32_m1", "V1", "NCHW", "f32", "train", (1, 1, 1, 3),
            extra_note="M = 1: variance 0.")
    gg_case(out_dir, "gg3_train_ncdhw_f32_c1_small", "V3", "NCDHW", "f32", "train",
            (2, 1, 2, 3, 1), extra_note="C = 1 channels-first: TF's composite squeezes "
                                        "scale_backprop to a scalar internally; "
                                        "grad_scale still [1].")


def generate_keras(out_dir):
    pattern_a = [True, True, False, True, False]
    pattern_b = [True, False, True, True, True, False]
    cases = [
        ("nhwc_m099_cs", "NHWC", 0.99, True, True, (4, 5, 5, 3), pattern_a),
        ("nhwc_m09_cs", "NHWC", 0.9, True, True, (2, 3, 4, 6), pattern_b),
        ("nhwc_m09_c", "NHWC", 0.9, True, False, (4, 5, 5, 3), pattern_a),
        ("nhwc_m099_s", "NHWC", 0.99, False, True, (2, 3, 4, 6), pattern_b),
        ("nhwc_m09_none", "NHWC", 0.9, False, False, (2, 3, 4, 6), pattern_a),
        ("nchw_m099_cs", "NCHW", 0.99, True, True, (4, 5, 5, 3), pattern_b),
        ("nchw_m09_cs", "NCHW", 0.9, True, True, (2, 3, 4, 6), pattern_a),
        ("nchw_m09_c", "NCHW", 0.9, True, False, (2, 3, 4, 6), pattern_b),
        ("nchw_m099_s", "NCHW", 0.99, False, True, (4, 5, 5, 3), pattern_a),
        ("nchw_m09_none", "NCHW", 0.9, False, False, (4, 5, 5, 3), pattern_b),
    ]
    for name, fmt, mom, center, scale, s, pat in cases:
        keras_case(out_dir, name, fmt, mom, center, scale, s, pat)


def clean(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for entry in sorted(os.listdir(out_dir)):
        p = os.path.join(out_dir, entry)
        if os.path.isdir(p) and os.path.exists(os.path.join(p, "case.json")):
            shutil.rmtree(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out-ex", default=os.path.join(here, "..", "tests", "fixtures_ex"))
    ap.add_argument("--out-keras", default=os.path.join(here, "..", "tests", "fixtures_keras"))
    ap.add_argument("--skip-keras", action="store_true",
                    help="do not (re)generate the Keras fixtures (needs tf_keras)")
    args = ap.parse_args()
    out_ex = os.path.normpath(args.out_ex)
    clean(out_ex)
    generate_ex(out_ex)
    counts = {}
    for n in G.CASES:
        with open(os.path.join(out_ex, n, "case.json")) as f:
            op = json.load(f)["op"]
        counts[op] = counts.get(op, 0) + 1
    print(f"TensorFlow {tf.__version__}: wrote {len(G.CASES)} cases to {out_ex}")
    for op, n in sorted(counts.items()):
        print(f"  {op}: {n}")
    if not args.skip_keras:
        out_k = os.path.normpath(args.out_keras)
        check_keras_uses_fused_v3()
        clean(out_k)
        generate_keras(out_k)
        print(f"wrote {len(KERAS_CASES)} Keras cases to {out_k}")
    if G.REJECTIONS or FALLBACKS:
        print("Combinations TF rejected (handled as the case notes say):")
        for r in sorted(set(map(str, G.REJECTIONS + FALLBACKS))):
            print("  " + r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
