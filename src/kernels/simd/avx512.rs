//! AVX-512 (F, BW, VL, DQ): 16 f32 lanes, masked loads and stores for tails, f16 via the
//! `vcvtph2ps`/`vcvtps2ph` conversions, bf16 by shifting (round to nearest even on
//! store, NaN kept quiet exactly as `half::bf16::from_f32` does). Pairs of vectors
//! (the elementwise passes' stores) on CPUs with AVX-512 BF16 use `vcvtne2ps2bf16`,
//! which rounds the same way but flushes subnormal inputs to zero: a pair holding one
//! takes the shifting path instead. Single-vector stores keep the shifting path: the
//! same test there slowed NCHW backward inference (a reduction and a store in one
//! loop) from 10.2 to 14.0 ms at 64x256x56x56 on a Zen 4.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{Body, Kernel, Simd};
use crate::element::{DType, Element};

/// Token of the AVX-512 ISA; made only by [`run`]. `bf16`: the CPU has AVX-512 BF16
/// (checked once per process).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    bf16: bool,
}

/// Whether this CPU has the AVX-512 BF16 conversions (cached).
fn has_bf16() -> bool {
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| is_x86_feature_detected!("avx512bf16"))
}

/// Runs `k` compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and DQ (and FMA, F16C, which they imply).
pub(super) unsafe fn run<K: Kernel<f32>>(k: K) -> K::Output {
    // SAFETY: the caller's guarantee; the BF16 instructions run only where `has_bf16`.
    unsafe { run_with(k, has_bf16()) }
}

/// [`run`] with the BF16 conversions left unused, as on an AVX-512 CPU without them
/// (Skylake-X, Ice Lake): on a CPU with them the tests run both narrowing paths.
///
/// # Safety
/// As [`run`].
#[cfg(test)]
pub(super) unsafe fn run_without_bf16<K: Kernel<f32>>(k: K) -> K::Output {
    // SAFETY: the caller's guarantee; with `bf16` false no BF16 instruction runs.
    unsafe { run_with(k, false) }
}

/// Whether this CPU has the AVX-512 BF16 conversions (for the tests).
#[cfg(test)]
pub(super) fn cpu_has_bf16() -> bool {
    has_bf16()
}

/// # Safety
/// As [`run`]. `avx512bf16` is enabled for the whole kernel so that `to_bf16x2` can use
/// it, but its instructions are reached only behind `Avx512::bf16`, true only where the
/// CPU has them.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn run_with<K: Kernel<f32>>(k: K, bf16: bool) -> K::Output {
    k.run(Avx512 { bf16 })
}

/// [`Simd::outline`] for AVX-512.
///
/// # Safety
/// As [`run_with`]: an [`Avx512`] token exists only inside it, and its `bf16` is true
/// only where the CPU has the BF16 instructions.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn outlined<B: Body<Avx512>>(s: Avx512, b: B) -> B::Output {
    b.run(s)
}

const L: usize = 16;

#[inline(always)]
fn mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// f32 → bf16 bits (round to nearest even; NaN → quiet NaN with the high payload).
#[inline(always)]
unsafe fn to_bf16(v: __m512) -> __m256i {
    let bits = _mm512_castps_si512(v);
    let hi = _mm512_srli_epi32::<16>(bits);
    let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    let out = _mm512_mask_mov_epi32(_mm512_srli_epi32::<16>(rounded), nan, quiet);
    _mm512_cvtepi32_epi16(out)
}

/// The lanes of `v` that are subnormal (exponent 0, mantissa not 0): one `vfpclassps`
/// (AVX-512 DQ, which every CPU with AVX-512 BF16 has).
#[inline(always)]
unsafe fn subnormal(v: __m512) -> __mmask16 {
    // 0x20: the denormal class.
    _mm512_fpclass_ps_mask::<0x20>(v)
}

/// Two vectors as 32 bf16 (`a` first), bit for bit as [`to_bf16`] on each: with
/// AVX-512 BF16 one `vcvtne2ps2bf16` (NaN is quieted with its high payload and ties
/// go to even there too) unless a lane is subnormal, which it would flush to zero.
#[inline(always)]
unsafe fn to_bf16x2(s: Avx512, a: __m512, b: __m512) -> __m512i {
    if s.bf16 && (subnormal(a) | subnormal(b)) == 0 {
        // SAFETY: `s.bf16` is true only where the CPU has AVX-512 BF16 (`has_bf16`);
        // `__m512bh` and `__m512i` are both 64 plain bytes.
        unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a)) }
    } else {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(to_bf16(a)), to_bf16(b))
    }
}

/// Two vectors as 32 elements of a 16-bit `T` (`a` first), in one 64-byte vector: the
/// bits of two [`Simd::store_ptr`]s, for one non-temporal store of a whole line.
///
/// Where a streamed 16-bit pair starts a line, one 64-byte store instead of two 32-byte
/// ones (or, channels-last f16, four 16-byte ones), in every pass that streams. On the
/// Intel Xeon (AVX-512, 2 MiB L2 a core, 2 threads), `scripts/ab.sh 7 "--shape
/// 64,56,56,256 --shape 64,112,112,64 --format NCHW,NHWC --op
/// forward_inference,forward_training,backward_training,backward_inference --dtype
/// f16,bf16 --isa avx512 --min-time 0.25"`, time ÷ copy: NHWC f16 forward inference
/// 0.910 -> 0.783 and 0.867 -> 0.786, forward training 1.576 -> 1.501 and 1.457 ->
/// 1.375; NCHW forward training bf16 64x64x112x112 1.262 -> 1.110, f16 1.208 -> 1.141;
/// NCHW inference gradient 64x256x56x56 bf16 1.099 -> 1.032, f16 1.028 -> 0.954; 27
/// of the 32 cells as fast or faster, the other five slower by at most 0.044 (NHWC bf16
/// backward training 64x56x56x256 1.352 -> 1.396).
#[inline(always)]
unsafe fn pack16<T: Element<Stat = f32>>(s: Avx512, a: __m512, b: __m512) -> __m512i {
    match T::DTYPE {
        DType::F16 => _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtps_ph::<RNE>(a)),
            _mm512_cvtps_ph::<RNE>(b),
        ),
        _ => to_bf16x2(s, a, b),
    }
}

/// 32 bytes as two 16-byte non-temporal stores instead of one 32-byte store: the
/// channels-last f16 passes that stream were faster so on a Zen 4 (AVX-512 on 256-bit
/// units), from DRAM, 2 threads (`scripts/ab.sh 5`, NHWC forward inference f16, time ÷
/// copy: 64x112x112x64 0.97 -> 0.87, 64x56x56x256 0.94 -> 0.84). The same stores were
/// slower in the channel-major passes (f16 0.82 -> 0.89) and for bf16 (0.85 -> 0.92 to
/// 0.98) in the same run, so only this path takes them, and since whole-line stores
/// (`pack16`) only for a pair half a line off (every other pair of an odd period).
///
/// # Safety
/// 32 writable bytes at `p`, aligned to 16 bytes.
#[inline(always)]
unsafe fn stream_quarters(p: *mut __m128i, v: __m256i) {
    // SAFETY: the caller's guarantee; both halves are inside the 32 bytes and aligned.
    unsafe {
        _mm_stream_si128(p, _mm256_castsi256_si128(v));
        _mm_stream_si128(p.add(1), _mm256_extracti128_si256::<1>(v));
    }
}

#[inline(always)]
unsafe fn from_bf16(h: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

impl Simd<f32> for Avx512 {
    const LANES: usize = L;
    type V = __m512;

    // SAFETY (every method): an `Avx512` token exists only inside `run`, whose caller
    // guarantees the features; slice lengths are checked before each pointer access.
    #[inline(always)]
    fn splat(self, v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn mask_positive(self, m: __m512, v: __m512) -> __m512 {
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, _mm512_setzero_ps()), v) }
    }
    #[inline(always)]
    fn rotate_lanes(self, v: __m512, r: usize) -> __m512 {
        unsafe {
            let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let at = _mm512_add_epi32(iota, _mm512_set1_epi32(r as i32));
            _mm512_permutexvar_ps(_mm512_and_si512(at, _mm512_set1_epi32(15)), v)
        }
    }
    #[inline(always)]
    fn lanes_between(self, from: usize, to: usize) -> __m512 {
        unsafe { _mm512_maskz_mov_ps(mask(to) & !mask(from), _mm512_set1_ps(1.0)) }
    }
    #[inline(always)]
    fn sum_f64(self, v: __m512) -> f64 {
        // Pairwise in f64 lanes (lane i with i + 8, then i + 4, i + 2, i + 1): four
        // dependent adds instead of a scalar chain of sixteen, which perf showed among
        // the hottest code of small channel-major reductions (six sums per channel).
        unsafe {
            let hi8 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
            let s8 = _mm512_add_pd(lo, _mm512_cvtps_pd(hi8));
            let s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd::<1>(s8));
            let s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd::<1>(s4));
            _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)))
        }
    }
    #[inline(always)]
    unsafe fn load_ptr<T: Element<Stat = f32>>(self, p: *const T) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                DType::BF16 => from_bf16(_mm256_loadu_si256(p.cast())),
                _ => _mm512_loadu_ps(p.cast()),
            }
        }
    }
    #[inline(always)]
    unsafe fn store_ptr<T: Element<Stat = f32>>(self, p: *mut T, v: __m512) {
        // SAFETY: the caller guarantees 16 writable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm256_storeu_si256(p.cast(), _mm512_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm256_storeu_si256(p.cast(), to_bf16(v)),
                _ => _mm512_storeu_ps(p.cast(), v),
            }
        }
    }
    #[inline(always)]
    unsafe fn stream_ptr<T: Element<Stat = f32>>(self, p: *mut T, v: __m512) {
        // SAFETY: the caller guarantees 16 writable elements at `p`, aligned to 16
        // elements (32 or 64 bytes, what the non-temporal stores need).
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm256_stream_si256(p.cast(), _mm512_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm256_stream_si256(p.cast(), to_bf16(v)),
                _ => _mm512_stream_ps(p.cast(), v),
            }
        }
    }
    #[inline(always)]
    unsafe fn store2_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m512, b: __m512) {
        // SAFETY: the caller guarantees 32 writable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::BF16 => _mm512_storeu_si512(p.cast(), to_bf16x2(self, a, b)),
                _ => {
                    self.store_ptr(p, a);
                    self.store_ptr(p.add(L), b);
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn stream2_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m512, b: __m512) {
        // SAFETY: the caller guarantees 32 writable elements at `p`, aligned to 16
        // elements. 16-bit: one 64-byte non-temporal store where `p` is tested to be
        // 64-byte aligned (a whole line), else two 32-byte ones, each aligned.
        unsafe {
            match T::DTYPE {
                DType::BF16 | DType::F16 if (p as usize).is_multiple_of(64) => {
                    _mm512_stream_si512(p.cast(), pack16::<T>(self, a, b))
                }
                DType::BF16 => {
                    let v = to_bf16x2(self, a, b);
                    _mm256_stream_si256(p.cast(), _mm512_castsi512_si256(v));
                    _mm256_stream_si256(p.add(L).cast(), _mm512_extracti64x4_epi64::<1>(v));
                }
                _ => {
                    self.stream_ptr(p, a);
                    self.stream_ptr(p.add(L), b);
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn load_pair_unordered_ptr<T: Element<Stat = f32>>(
        self,
        p: *const T,
    ) -> (__m512, __m512) {
        // SAFETY: the caller guarantees 32 readable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::BF16 => {
                    // Element 2i is the low half of 32-bit lane i, 2i + 1 the high half:
                    // the even elements shifted up, the odd ones masked.
                    let v = _mm512_loadu_si512(p.cast());
                    let even = _mm512_slli_epi32::<16>(v);
                    let odd = _mm512_and_si512(v, _mm512_set1_epi32(-65536));
                    (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
                }
                _ => self.load_pair_ptr(p),
            }
        }
    }
    #[inline(always)]
    fn pair_stream_align<T: Element<Stat = f32>>(self) -> usize {
        // 16-bit: a line, for one 64-byte store a pair (`stream2_ptr`).
        match T::DTYPE {
            DType::BF16 | DType::F16 => 2 * L,
            _ => L,
        }
    }
    #[inline(always)]
    unsafe fn stream_pair_cl_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m512, b: __m512) {
        // SAFETY: the caller guarantees 32 writable elements at `p`, aligned to 16
        // elements (32 or 64 bytes; the 16-byte quarters need less). A pair that starts
        // a line is `stream2_ptr`'s one 64-byte store; only an f16 pair half a line off
        // differs from it.
        unsafe {
            match T::DTYPE {
                DType::F16 if !(p as usize).is_multiple_of(64) => {
                    stream_quarters(p.cast(), _mm512_cvtps_ph::<RNE>(a));
                    stream_quarters(p.add(L).cast(), _mm512_cvtps_ph::<RNE>(b));
                }
                _ => self.stream2_ptr(p, a, b),
            }
        }
    }
    #[inline(always)]
    unsafe fn stream_pair_cl_whole_ptr<T: Element<Stat = f32>>(
        self,
        p: *mut T,
        a: __m512,
        b: __m512,
    ) {
        // SAFETY: the caller guarantees 32 writable elements at `p`, aligned to
        // `cl_stream_align` elements: a 64-byte line for every type, what the 64-byte
        // non-temporal stores need (`stream2_ptr` without its test).
        unsafe {
            match T::DTYPE {
                DType::BF16 | DType::F16 => _mm512_stream_si512(p.cast(), pack16::<T>(self, a, b)),
                _ => {
                    self.stream_ptr(p, a);
                    self.stream_ptr(p.add(L), b);
                }
            }
        }
    }
    #[inline(always)]
    fn cl_stream_align<T: Element<Stat = f32>>(self) -> usize {
        self.pair_stream_align::<T>()
    }
    #[inline(always)]
    fn load_partial<T: Element<Stat = f32>>(self, src: &[T]) -> __m512 {
        let (p, m) = (src.as_ptr(), mask(src.len().min(L)));
        // SAFETY: the mask enables the first `min(len, 16)` lanes, all inside `src`; a
        // masked-off lane is neither read nor faulted on (AVX-512 masked loads).
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast())),
                DType::BF16 => from_bf16(_mm256_maskz_loadu_epi16(m, p.cast())),
                _ => _mm512_maskz_loadu_ps(m, p.cast()),
            }
        }
    }
    #[inline(always)]
    fn store_partial<T: Element<Stat = f32>>(self, dst: &mut [T], v: __m512) {
        let (p, m) = (dst.as_mut_ptr(), mask(dst.len().min(L)));
        // SAFETY: the mask enables the first `min(len, 16)` lanes, all inside `dst`; a
        // masked-off lane is not written (AVX-512 masked stores).
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm256_mask_storeu_epi16(p.cast(), m, _mm512_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm256_mask_storeu_epi16(p.cast(), m, to_bf16(v)),
                _ => _mm512_mask_storeu_ps(p.cast(), m, v),
            }
        }
    }
    #[inline(always)]
    fn fence(self) {
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    fn outline<B: Body<Self>>(self, b: B) -> B::Output {
        // SAFETY: `self` was made by `run_with`, on a CPU with AVX-512 F, BW, VL and DQ.
        unsafe { outlined(self, b) }
    }
    #[inline(always)]
    fn prefetch<T>(self, data: &[T]) {
        if !data.is_empty() {
            self.prefetch_ptr(data.as_ptr());
        }
    }
    #[inline(always)]
    fn prefetch_ptr<T>(self, p: *const T) {
        // SAFETY: a prefetch is a hint: it never faults and reads nothing observable,
        // whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    }
}
