// fusedbn's CUDA kernels: TensorFlow's fused batch normalization, compiled at run time by
// NVRTC once per device and element type (FBN_DTYPE: 0 = f32, 1 = f16, 2 = bf16).
//
// x is viewed as [outer, C, inner] (the CPU kernels' geometry). Two traversals:
// - "cf" (channels first, inner > 1: NCHW, NCDHW, one channel): a block works on one
//   channel and a chunk of its M elements; W elements of a vector share the channel.
// - "cl" (channels last, inner == 1: NHWC, NDHWC): a block is TX channel-vectors wide
//   and TY rows tall; a thread keeps W channels' state and walks RK rows.
// W is 16 bytes of T (vectorized) when the run (inner, or C) is a multiple of it, else 1.
//
// Reductions: each thread accumulates at most iters*UNROLL*W (cf) or iters*RK (cl)
// elements per channel in f32, around its first element (so a large mean loses nothing),
// in batches of the loads in flight (a batch's mean and M2 in two passes over registers,
// merged by Chan's formula, so a long run loses nothing either); blocks merge their
// threads' moments in f64 by Chan's formula in a fixed tree, and one warp per channel
// merges the blocks' partials in f64 in a fixed order: results depend on the problem
// alone, never on timing.

typedef unsigned long long u64;
#if FBN_DTYPE == 0
typedef float T;
#else
typedef unsigned short T;
#endif
#define VEC (16 / (int)sizeof(T))
#define THREADS 256
#define UNROLL 8
#define RK 16

__device__ __forceinline__ float widen(T v) {
#if FBN_DTYPE == 0
    return v;
#elif FBN_DTYPE == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#else
    return __uint_as_float(((unsigned)v) << 16);
#endif
}

__device__ __forceinline__ T narrow(float f) {
#if FBN_DTYPE == 0
    return f;
#elif FBN_DTYPE == 1
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

union Raw {
    uint4 u;
    T t[VEC];
};

// W raw elements as loaded (16 bytes when W == VEC), widened only when used so that
// loads in flight cost 4 registers per 16 bytes.
template <int W>
struct Packed {
    T t[W];
};
template <>
struct Packed<VEC> {
    uint4 u;
};

template <int W>
__device__ __forceinline__ Packed<W> ldraw(const T* p, bool last) {
    Packed<W> r;
    if constexpr (W == VEC) {
        if (last) {
            asm("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                : "=r"(r.u.x), "=r"(r.u.y), "=r"(r.u.z), "=r"(r.u.w) : "l"(p));
        } else {
            asm("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                : "=r"(r.u.x), "=r"(r.u.y), "=r"(r.u.z), "=r"(r.u.w) : "l"(p));
        }
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) r.t[i] = p[i];
    }
    return r;
}

template <int W>
__device__ __forceinline__ void unpack(const Packed<W>& r, float (&f)[W]) {
    if constexpr (W == VEC) {
        Raw q;
        q.u = r.u;
#pragma unroll
        for (int i = 0; i < VEC; i++) f[i] = widen(q.t[i]);
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) f[i] = widen(r.t[i]);
    }
}

template <int W>
__device__ __forceinline__ void load(const T* p, float (&f)[W], bool last) {
    unpack<W>(ldraw<W>(p, last), f);
}

// Stores W elements, streaming (the output is not read again by this op).
template <int W>
__device__ __forceinline__ void store(T* p, const float (&f)[W]) {
    if constexpr (W == VEC) {
        Raw r;
#pragma unroll
        for (int i = 0; i < VEC; i++) r.t[i] = narrow(f[i]);
        asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(r.u.x),
                     "r"(r.u.y), "r"(r.u.z), "r"(r.u.w)
                     : "memory");
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) p[i] = narrow(f[i]);
    }
}

// ---- moments: (count, mean, M2), merged by Chan, Golub and LeVeque ----

struct Mom {
    double n, mean, m2;
};

__device__ __forceinline__ Mom merge(Mom a, Mom b) {
    if (b.n == 0.0) return a;
    if (a.n == 0.0) return b;
    double n = a.n + b.n;
    double d = b.mean - a.mean;
    Mom r;
    r.n = n;
    r.mean = a.mean + d * (b.n / n);
    r.m2 = a.m2 + b.m2 + d * d * (a.n * (b.n / n));
    return r;
}

// One thread's running moments of one channel in f32, around a shift (its first value),
// fed a batch at a time: a batch's mean and M2 come from two passes over the values in
// registers, and the batch is merged by Chan's formula: one division per batch, where
// Welford's update took one per element. (Checked against the f64 reference on an H200,
// 2026-11-28; its effect on time was not isolated: README, CUDA.)
struct Acc {
    float shift, mean, m2;
    int n;
};

__device__ __forceinline__ void acc_init(Acc& a) {
    a.shift = 0.0f;
    a.mean = 0.0f;
    a.m2 = 0.0f;
    a.n = 0;
}

// Merges a batch of nb values whose shifted mean is bmean and whose M2 is bm2.
__device__ __forceinline__ void acc_merge(Acc& a, int nb, float bmean, float bm2) {
    if (nb == 0) return;
    if (a.n == 0) {
        a.n = nb;
        a.mean = bmean;
        a.m2 = bm2;
        return;
    }
    int n = a.n + nb;
    float r = (float)nb / (float)n;
    float d = bmean - a.mean;
    a.mean += d * r;
    a.m2 += bm2 + d * d * ((float)a.n * r);
    a.n = n;
}

// The mean of a batch from its shifted sum: a multiplication for a full batch (a power of
// two, the same bits as the division), a division for the last, short one.
template <int FULL>
__device__ __forceinline__ float batch_mean(float s1, int nb) {
    return nb == FULL ? s1 * (1.0f / (float)FULL) : s1 / (float)nb;
}

// Partial sums of C chains, added in a fixed order.
template <int C>
__device__ __forceinline__ float sum_chains(const float (&v)[C]) {
    static_assert(C == 1 || C == 4, "one chain or four");
    if constexpr (C == 4) {
        return (v[0] + v[1]) + (v[2] + v[3]);
    } else {
        return v[0];
    }
}

// Feeds one batch, the first kv of the N loads in raw, to the accumulators: element e of
// the batch (load e / W, lane e % W) goes to a[e % A] (A = 1: one channel, the cf walk;
// A = W: a channel per lane, the cl walk), on chain (e / A) % C of that accumulator.
// Pass one: the shifted sum, so the batch mean; pass two: M2 around shift + mean.
template <int A, int C, int W, int N>
__device__ __forceinline__ void acc_batch(Acc (&a)[A], const Packed<W> (&raw)[N], int kv) {
    static_assert(A == 1 || A == W, "one channel, or one per lane");
    if (a[0].n == 0) {
        float f[W];
        unpack<W>(raw[0], f);
#pragma unroll
        for (int j = 0; j < A; j++) a[j].shift = f[j];
    }
    float s[A][C] = {};
#pragma unroll
    for (int k = 0; k < N; k++) {
        if (k < kv) {
            float f[W];
            unpack<W>(raw[k], f);
#pragma unroll
            for (int i = 0; i < W; i++) {
                int e = k * W + i;
                s[e % A][(e / A) % C] += f[i] - a[e % A].shift;
            }
        }
    }
    int nb = kv * (W / A);
    float bm[A], ctr[A];
#pragma unroll
    for (int j = 0; j < A; j++) {
        bm[j] = batch_mean<N * W / A>(sum_chains<C>(s[j]), nb);
        ctr[j] = a[j].shift + bm[j];
    }
    float q[A][C] = {};
#pragma unroll
    for (int k = 0; k < N; k++) {
        if (k < kv) {
            float f[W];
            unpack<W>(raw[k], f);
#pragma unroll
            for (int i = 0; i < W; i++) {
                int e = k * W + i;
                float d = f[i] - ctr[e % A];
                q[e % A][(e / A) % C] = fmaf(d, d, q[e % A][(e / A) % C]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < A; j++) acc_merge(a[j], nb, bm[j], sum_chains<C>(q[j]));
}

__device__ __forceinline__ Mom acc_mom(const Acc& a) {
    Mom m;
    m.n = (double)a.n;
    m.mean = (double)a.shift + (double)a.mean;
    m.m2 = (double)a.m2;
    return m;
}

// Geometry of one launch (host-side twin: src/cuda/launch.rs).
struct Geo {
    u64 outer, C, inner;  // x = [outer, C, inner]
    u64 c0;               // first channel (cf) or channel-vector (cl) of this group
    u64 width;            // channels (cf) or channel-vectors (cl) in this group
    u64 chunks;           // blocks along the reduced axis (= partials per channel)
    u64 part_base;        // partials index of this group's first channel
    u64 iters;            // rounds of UNROLL (cf) or RK (cl) loads per thread
};

// Element offset of vector v (of W elements) of channel c in a cf tensor.
template <int W>
__device__ __forceinline__ u64 cf_offset(const Geo& g, u64 c, u64 v) {
    u64 rv = g.inner / W;
    u64 o = v / rv, i = v - o * rv;
    return (o * g.C + c) * g.inner + i * W;
}

// ---- block-level f64 merges (fixed trees) ----

__device__ __forceinline__ Mom shfl_mom(Mom m, int lane_mask) {
    Mom r;
    r.n = __shfl_xor_sync(0xffffffffu, m.n, lane_mask);
    r.mean = __shfl_xor_sync(0xffffffffu, m.mean, lane_mask);
    r.m2 = __shfl_xor_sync(0xffffffffu, m.m2, lane_mask);
    return r;
}

// Merges the moments of all THREADS threads of the block (one channel); thread 0 gets
// the result. Lower lanes are always the left operand: a fixed order.
__device__ Mom block_merge_all(Mom m) {
    __shared__ Mom sh[THREADS / 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        Mom o = shfl_mom(m, s);
        m = (lane & s) ? merge(o, m) : merge(m, o);
    }
    if (lane == 0) sh[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        m = sh[0];
        for (int w = 1; w < THREADS / 32; w++) m = merge(m, sh[w]);
    }
    __syncthreads();
    return m;
}

struct Sum2 {
    double a, b;
};

__device__ Sum2 block_sum_all(Sum2 s) {
    __shared__ Sum2 sh[THREADS / 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        s.a += __shfl_down_sync(0xffffffffu, s.a, o);
        s.b += __shfl_down_sync(0xffffffffu, s.b, o);
    }
    if (lane == 0) sh[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        s = sh[0];
        for (int w = 1; w < THREADS / 32; w++) {
            s.a += sh[w].a;
            s.b += sh[w].b;
        }
    }
    __syncthreads();
    return s;
}

// ---- forward statistics: per-block partial moments ----

template <int W>
__device__ void stats_cf(Geo g, const T* __restrict__ x, Mom* __restrict__ part) {
    u64 c = g.c0 + blockIdx.y;
    u64 mv = g.outer * (g.inner / W);
    Acc a[1];
    acc_init(a[0]);
    for (u64 it = 0; it < g.iters; it++) {
        u64 v0 = ((u64)blockIdx.x * g.iters + it) * (THREADS * UNROLL) + threadIdx.x;
        if (v0 >= mv) break;
        // The loads in flight are the batch: its first kv (all valid) of UNROLL vectors.
        u64 left = (mv - v0 + THREADS - 1) / THREADS;
        int kv = left < (u64)UNROLL ? (int)left : UNROLL;
        Packed<W> raw[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            if (k < kv) raw[k] = ldraw<W>(x + cf_offset<W>(g, c, v0 + (u64)k * THREADS), false);
        }
        // Four chains per pass: one channel's values, four additions in flight.
        acc_batch<1, 4>(a, raw, kv);
    }
    Mom m = block_merge_all(acc_mom(a[0]));
    if (threadIdx.x == 0) part[(g.part_base + blockIdx.y) * g.chunks + blockIdx.x] = m;
}

template <int W>
__device__ void stats_cl(Geo g, const T* __restrict__ x, Mom* __restrict__ part) {
    __shared__ Mom sh[THREADS];
    int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    u64 j = g.c0 + (u64)blockIdx.y * TX + tx;  // channel-vector
    bool active = j < g.c0 + g.width;
    Acc a[W];
#pragma unroll
    for (int i = 0; i < W; i++) acc_init(a[i]);
    for (u64 it = 0; it < g.iters; it++) {
        u64 r0 = ((u64)blockIdx.x * g.iters + it) * TY * RK + ty;
        // Two halves of RK / 2 loads in flight, each a batch of rows for the W channels:
        // the accumulators stay in registers.
#pragma unroll
        for (int h = 0; h < RK; h += RK / 2) {
            u64 rh = r0 + (u64)h * TY;
            int kv = 0;
            if (active && rh < g.outer) {
                u64 left = (g.outer - rh + TY - 1) / TY;
                kv = left < (u64)(RK / 2) ? (int)left : RK / 2;
            }
            if (kv == 0) continue;
            Packed<W> raw[RK / 2];
#pragma unroll
            for (int k = 0; k < RK / 2; k++) {
                if (k < kv) raw[k] = ldraw<W>(x + (rh + (u64)k * TY) * g.C + j * W, false);
            }
            // One chain per channel: the W channels' additions are in flight together.
            acc_batch<W, 1>(a, raw, kv);
        }
    }
    int t = ty * TX + tx;
#pragma unroll
    for (int i = 0; i < W; i++) {
        sh[t] = acc_mom(a[i]);
        __syncthreads();
        for (int s = 1; s < TY; s <<= 1) {
            if ((ty & (2 * s - 1)) == 0 && ty + s < TY) sh[t] = merge(sh[t], sh[t + s * TX]);
            __syncthreads();
        }
        if (ty == 0 && active) {
            u64 ch = (j - g.c0) * W + i;  // channel within the group
            part[(g.part_base + ch) * g.chunks + blockIdx.x] = sh[tx];
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_stats_cf_v(Geo g, const T* x, Mom* part) {
    stats_cf<VEC>(g, x, part);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_stats_cf_s(Geo g, const T* x, Mom* part) {
    stats_cf<1>(g, x, part);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_stats_cl_v(Geo g, const T* x, Mom* part) {
    stats_cl<VEC>(g, x, part);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_stats_cl_s(Geo g, const T* x, Mom* part) {
    stats_cl<1>(g, x, part);
}

// ---- forward finalize: one warp per channel ----
// Writes saved mean/variance (reserve_space_1/2), updates the running statistics
// (TensorFlow's batch_mean/batch_variance) and the apply coefficients [shift, a, b].
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_fwd_finalize(
    u64 chans, u64 chunks, u64 c_first, const Mom* __restrict__ part, const float* scale,
    const float* offset, float* saved_mean, float* saved_var, float* run_mean, float* run_var,
    float factor, float eps, float* coef) {
    u64 w = ((u64)blockIdx.x * THREADS + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= chans) return;
    const Mom* p = part + (c_first + w) * chunks;
    Mom m = {0.0, 0.0, 0.0};
    for (u64 i = lane; i < chunks; i += 32) m = merge(m, p[i]);
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        Mom o = shfl_mom(m, s);
        m = (lane & s) ? merge(o, m) : merge(m, o);
    }
    if (lane != 0) return;
    u64 c = c_first + w;
    double var = m.m2 / m.n;
    saved_mean[c] = (float)m.mean;
    saved_var[c] = (float)var;
    if (run_mean) {
        double adj = m.n / fmax(m.n - 1.0, 1.0);
        double f = (double)factor;
        double bm = m.mean, bv = adj * var;
        if (factor != 1.0f) {
            bm = (1.0 - f) * (double)run_mean[c] + f * bm;
            bv = (1.0 - f) * (double)run_var[c] + f * bv;
        }
        run_mean[c] = (float)bm;
        run_var[c] = (float)bv;
    }
    coef[3 * c] = (float)m.mean;
    coef[3 * c + 1] = (float)((double)scale[c] / sqrt(var + (double)eps));
    coef[3 * c + 2] = offset[c];
}

// ---- forward apply: y = act((x - shift) * a + b + side) ----
// Coefficients from `coef` ([shift, a, b] per channel), or, when coef is null
// (inference), computed here from mean/var/scale/offset as the CPU op does.

struct ApplyArgs {
    const float* coef;
    const float* mean;
    const float* var;
    const float* scale;
    const float* offset;
    float eps;
    int relu;
    int last;  // x is not read again: stream it
};

__device__ __forceinline__ void coeffs(const ApplyArgs& a, u64 c, float& s, float& m, float& b) {
    if (a.coef) {
        s = a.coef[3 * c];
        m = a.coef[3 * c + 1];
        b = a.coef[3 * c + 2];
    } else {
        s = a.mean[c];
        m = (float)((double)a.scale[c] / sqrt((double)a.var[c] + (double)a.eps));
        b = a.offset[c];
    }
}

template <int W>
__device__ __forceinline__ void apply_one(const ApplyArgs& a, const T* x, const T* side, T* y,
                                          const float (&s)[W], const float (&m)[W],
                                          const float (&b)[W], const float (&f)[W]) {
    float o[W];
#pragma unroll
    for (int i = 0; i < W; i++) o[i] = (f[i] - s[i]) * m[i] + b[i];
    if (side) {
        float sv[W];
        load<W>(side, sv, true);
#pragma unroll
        for (int i = 0; i < W; i++) o[i] += sv[i];
    }
    if (a.relu) {
#pragma unroll
        for (int i = 0; i < W; i++) o[i] = 0.0f > o[i] ? 0.0f : o[i];  // the CPU's max(0, v)
    }
    store<W>(y, o);
}

template <int W>
__device__ void apply_cf(Geo g, ApplyArgs a, const T* __restrict__ x, const T* __restrict__ side,
                         T* __restrict__ y) {
    u64 c = g.c0 + blockIdx.y;
    u64 mv = g.outer * (g.inner / W);
    float s1, m1, b1;
    coeffs(a, c, s1, m1, b1);
    float s[W], m[W], b[W];
#pragma unroll
    for (int i = 0; i < W; i++) {
        s[i] = s1;
        m[i] = m1;
        b[i] = b1;
    }
    for (u64 it = 0; it < g.iters; it++) {
        u64 v0 = ((u64)blockIdx.x * g.iters + it) * (THREADS * UNROLL) + threadIdx.x;
        Packed<W> raw[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            u64 v = v0 + (u64)k * THREADS;
            if (v < mv) raw[k] = ldraw<W>(x + cf_offset<W>(g, c, v), a.last);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            u64 v = v0 + (u64)k * THREADS;
            if (v < mv) {
                u64 off = cf_offset<W>(g, c, v);
                float f[W];
                unpack<W>(raw[k], f);
                apply_one<W>(a, x + off, side ? side + off : nullptr, y + off, s, m, b, f);
            }
        }
    }
}

template <int W>
__device__ void apply_cl(Geo g, ApplyArgs a, const T* __restrict__ x, const T* __restrict__ side,
                         T* __restrict__ y) {
    int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    u64 j = g.c0 + (u64)blockIdx.y * TX + tx;
    if (j >= g.c0 + g.width) return;
    float s[W], m[W], b[W];
#pragma unroll
    for (int i = 0; i < W; i++) coeffs(a, j * W + i, s[i], m[i], b[i]);
    for (u64 it = 0; it < g.iters; it++) {
        u64 r0 = ((u64)blockIdx.x * g.iters + it) * TY * RK + ty;
        Packed<W> raw[RK];
#pragma unroll
        for (int k = 0; k < RK; k++) {
            u64 r = r0 + (u64)k * TY;
            if (r < g.outer) raw[k] = ldraw<W>(x + r * g.C + j * W, a.last);
        }
#pragma unroll
        for (int k = 0; k < RK; k++) {
            u64 r = r0 + (u64)k * TY;
            if (r < g.outer) {
                u64 off = r * g.C + j * W;
                float f[W];
                unpack<W>(raw[k], f);
                apply_one<W>(a, x + off, side ? side + off : nullptr, y + off, s, m, b, f);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
    fbn_apply_cf_v(Geo g, ApplyArgs a, const T* x, const T* side, T* y) {
    apply_cf<VEC>(g, a, x, side, y);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    fbn_apply_cf_s(Geo g, ApplyArgs a, const T* x, const T* side, T* y) {
    apply_cf<1>(g, a, x, side, y);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    fbn_apply_cl_v(Geo g, ApplyArgs a, const T* x, const T* side, T* y) {
    apply_cl<VEC>(g, a, x, side, y);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    fbn_apply_cl_s(Geo g, ApplyArgs a, const T* x, const T* side, T* y) {
    apply_cl<1>(g, a, x, side, y);
}

// ---- backward reduce: per-block Σdy and Σdy·(x − mean), dy masked by y > 0 ----
// Optionally writes sg = masked dy (the side input's gradient) and dx = masked dy · k1
// with k1 = scale/√(var + ε) (the inference gradient, in the same pass).

struct GradArgs {
    const T* dy;
    const T* x;
    const T* mask;  // forward output y of a ReLU, or null
    const float* mean;
    const float* var;
    const float* scale;
    const float* coef;  // training apply: [dm, k1, k2] per channel
    T* sg;              // side input gradient, or null
    T* dx;              // inference dx in the reduce pass / training dx in apply
    float eps;
    int last;
};

__device__ __forceinline__ float masked(float dy, float y) { return y > 0.0f ? dy : 0.0f; }

template <int W>
__device__ __forceinline__ void grad_load(const GradArgs& a, u64 off, float (&d)[W],
                                          float (&xv)[W], bool last) {
    load<W>(a.dy + off, d, last);
    load<W>(a.x + off, xv, last);
    if (a.mask) {
        float yv[W];
        load<W>(a.mask + off, yv, last);
#pragma unroll
        for (int i = 0; i < W; i++) d[i] = masked(d[i], yv[i]);
    }
}

template <int W>
__device__ __forceinline__ void grad_write(const GradArgs& a, u64 off, const float (&d)[W],
                                           const float (&k1)[W]) {
    if (a.sg) store<W>(a.sg + off, d);
    if (a.dx) {
        float o[W];
#pragma unroll
        for (int i = 0; i < W; i++) o[i] = d[i] * k1[i];
        store<W>(a.dx + off, o);
    }
}

__device__ __forceinline__ float inf_k1(const GradArgs& a, u64 c) {
    return a.dx ? (float)((double)a.scale[c] / sqrt((double)a.var[c] + (double)a.eps)) : 0.0f;
}

template <int W>
__device__ void reduce_cf(Geo g, GradArgs a, Sum2* __restrict__ part) {
    u64 c = g.c0 + blockIdx.y;
    u64 mv = g.outer * (g.inner / W);
    float mu = a.mean[c];
    float k1[W];
    float kk = inf_k1(a, c);
#pragma unroll
    for (int i = 0; i < W; i++) k1[i] = kk;
    bool last = a.last;
    float sd = 0.0f, sdx = 0.0f;
    u64 base = (u64)blockIdx.x * g.iters * (THREADS * UNROLL) + threadIdx.x;
#pragma unroll 4
    for (u64 k = 0; k < g.iters * UNROLL; k++) {
        u64 v = base + k * THREADS;
        if (v < mv) {
            u64 off = cf_offset<W>(g, c, v);
            float d[W], xv[W];
            grad_load<W>(a, off, d, xv, last);
#pragma unroll
            for (int i = 0; i < W; i++) {
                sd += d[i];
                sdx += d[i] * (xv[i] - mu);
            }
            grad_write<W>(a, off, d, k1);
        }
    }
    Sum2 s = {(double)sd, (double)sdx};
    s = block_sum_all(s);
    if (threadIdx.x == 0) part[(g.part_base + blockIdx.y) * g.chunks + blockIdx.x] = s;
}

template <int W>
__device__ void reduce_cl(Geo g, GradArgs a, Sum2* __restrict__ part) {
    __shared__ Sum2 sh[THREADS];
    int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    u64 j = g.c0 + (u64)blockIdx.y * TX + tx;
    bool active = j < g.c0 + g.width;
    u64 r0 = (u64)blockIdx.x * g.iters * TY * RK + ty;
    float mu[W], k1[W], sd[W], sdx[W];
#pragma unroll
    for (int i = 0; i < W; i++) {
        mu[i] = active ? a.mean[j * W + i] : 0.0f;
        k1[i] = active ? inf_k1(a, j * W + i) : 0.0f;
        sd[i] = 0.0f;
        sdx[i] = 0.0f;
    }
    bool last = a.last;
#pragma unroll 4
    for (u64 k = 0; k < g.iters * RK; k++) {
        u64 r = r0 + k * TY;
        if (active && r < g.outer) {
            u64 off = r * g.C + j * W;
            float d[W], xv[W];
            grad_load<W>(a, off, d, xv, last);
#pragma unroll
            for (int i = 0; i < W; i++) {
                sd[i] += d[i];
                sdx[i] += d[i] * (xv[i] - mu[i]);
            }
            grad_write<W>(a, off, d, k1);
        }
    }
    int t = ty * TX + tx;
#pragma unroll
    for (int i = 0; i < W; i++) {
        sh[t].a = (double)sd[i];
        sh[t].b = (double)sdx[i];
        __syncthreads();
        for (int s = 1; s < TY; s <<= 1) {
            if ((ty & (2 * s - 1)) == 0 && ty + s < TY) {
                sh[t].a += sh[t + s * TX].a;
                sh[t].b += sh[t + s * TX].b;
            }
            __syncthreads();
        }
        if (ty == 0 && active) {
            u64 ch = (j - g.c0) * W + i;
            part[(g.part_base + ch) * g.chunks + blockIdx.x] = sh[tx];
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_reduce_cf_v(Geo g, GradArgs a, Sum2* part) {
    reduce_cf<VEC>(g, a, part);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_reduce_cf_s(Geo g, GradArgs a, Sum2* part) {
    reduce_cf<1>(g, a, part);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_reduce_cl_v(Geo g, GradArgs a, Sum2* part) {
    reduce_cl<VEC>(g, a, part);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_reduce_cl_s(Geo g, GradArgs a, Sum2* part) {
    reduce_cl<1>(g, a, part);
}

// ---- backward finalize: one warp per channel ----
// doffset = Σdy, dscale = r·Σdy(x − mean); in training also [dm, k1, k2] for the apply.
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_bwd_finalize(
    u64 chans, u64 chunks, u64 c_first, double count, const Sum2* __restrict__ part,
    const float* scale, const float* var, float eps, float* dscale, float* doffset,
    float* coef) {
    u64 w = ((u64)blockIdx.x * THREADS + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= chans) return;
    const Sum2* p = part + (c_first + w) * chunks;
    double sa = 0.0, sb = 0.0;
    for (u64 i = lane; i < chunks; i += 32) {
        sa += p[i].a;
        sb += p[i].b;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sa += __shfl_down_sync(0xffffffffu, sa, o);
        sb += __shfl_down_sync(0xffffffffu, sb, o);
    }
    if (lane != 0) return;
    u64 c = c_first + w;
    double r = 1.0 / sqrt((double)var[c] + (double)eps);
    doffset[c] = (float)sa;
    dscale[c] = (float)(r * sb);
    if (coef) {
        double k1 = (double)scale[c] * r;
        coef[3 * c] = (float)(sa / count);
        coef[3 * c + 1] = (float)k1;
        coef[3 * c + 2] = (float)(-k1 * r * r * sb / count);
    }
}

// ---- backward apply (training): dx = (dy − dȳ)·k1 + (x − mean)·k2 ----

template <int W>
__device__ __forceinline__ void bapply_one(const GradArgs& a, u64 off, float dm, float mu,
                                           float k1, float k2) {
    float d[W], xv[W], o[W];
    grad_load<W>(a, off, d, xv, a.last);
#pragma unroll
    for (int i = 0; i < W; i++) o[i] = (d[i] - dm) * k1 + (xv[i] - mu) * k2;
    store<W>(a.dx + off, o);
}

template <int W>
__device__ void bapply_cf(Geo g, GradArgs a) {
    u64 c = g.c0 + blockIdx.y;
    u64 mv = g.outer * (g.inner / W);
    float dm = a.coef[3 * c], k1 = a.coef[3 * c + 1], k2 = a.coef[3 * c + 2], mu = a.mean[c];
    u64 base = (u64)blockIdx.x * g.iters * (THREADS * UNROLL) + threadIdx.x;
#pragma unroll 4
    for (u64 k = 0; k < g.iters * UNROLL; k++) {
        u64 v = base + k * THREADS;
        if (v < mv) bapply_one<W>(a, cf_offset<W>(g, c, v), dm, mu, k1, k2);
    }
}

template <int W>
__device__ void bapply_cl(Geo g, GradArgs a) {
    int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    u64 j = g.c0 + (u64)blockIdx.y * TX + tx;
    if (j >= g.c0 + g.width) return;
    float dm[W], k1[W], k2[W], mu[W];
#pragma unroll
    for (int i = 0; i < W; i++) {
        u64 c = j * W + i;
        dm[i] = a.coef[3 * c];
        k1[i] = a.coef[3 * c + 1];
        k2[i] = a.coef[3 * c + 2];
        mu[i] = a.mean[c];
    }
    u64 r0 = (u64)blockIdx.x * g.iters * TY * RK + ty;
#pragma unroll 4
    for (u64 k = 0; k < g.iters * RK; k++) {
        u64 r = r0 + k * TY;
        if (r < g.outer) {
            u64 off = r * g.C + j * W;
            float d[W], xv[W], o[W];
            grad_load<W>(a, off, d, xv, a.last);
#pragma unroll
            for (int i = 0; i < W; i++) o[i] = (d[i] - dm[i]) * k1[i] + (xv[i] - mu[i]) * k2[i];
            store<W>(a.dx + off, o);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_bapply_cf_v(Geo g, GradArgs a) {
    bapply_cf<VEC>(g, a);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_bapply_cf_s(Geo g, GradArgs a) {
    bapply_cf<1>(g, a);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_bapply_cl_v(Geo g, GradArgs a) {
    bapply_cl<VEC>(g, a);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_bapply_cl_s(Geo g, GradArgs a) {
    bapply_cl<1>(g, a);
}

// ---- a device copy of the same bytes (the benchmark's baseline) ----
extern "C" __global__ void __launch_bounds__(THREADS, 2) fbn_copy(const uint4* src, uint4* dst, u64 n) {
    u64 i = (u64)blockIdx.x * THREADS + threadIdx.x;
    u64 stride = (u64)gridDim.x * THREADS;
    for (; i < n; i += stride) {
        uint4 v;
        asm("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i));
        asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(dst + i), "r"(v.x),
                     "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
    }
}
