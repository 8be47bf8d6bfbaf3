//! AVX2 + FMA + F16C: 8 f32 lanes; tails by masked loads and stores (`vmaskmovps`
//! for 32-bit elements; 32-bit pairs plus a blend for 16-bit ones); bf16 by
//! shifting (round to nearest even on store, NaN kept quiet as `half` does).

use std::arch::x86_64::*;

use super::{Body, Kernel, Simd};
use crate::element::{DType, Element};

/// Token of the AVX2 ISA; made only by [`run`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2 {
    /// No NaN this pass stores has a payload in its 16 low bits
    /// ([`Simd::plain_nans`]): bf16 narrowing without the NaN test.
    plain_nans: bool,
}

/// Runs `k` compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<K: Kernel<f32>>(k: K) -> K::Output {
    k.run(Avx2 { plain_nans: false })
}

/// [`Simd::outline`] for AVX2.
///
/// # Safety
/// As [`run`]: an [`Avx2`] token exists only inside it.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn outlined<B: Body<Avx2>>(s: Avx2, b: B) -> B::Output {
    b.run(s)
}

const L: usize = 8;
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;

#[inline(always)]
unsafe fn to_bf16(v: __m256, plain_nans: bool) -> __m128i {
    let out = if plain_nans {
        round_bf16_ordered(v)
    } else {
        round_bf16(v)
    };
    // Pack the eight 32-bit values (each < 2^16) to 16 bits, in order.
    let packed = _mm256_packus_epi32(out, out);
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b11_01_10_00>(packed))
}

/// Two vectors to sixteen bf16 (`a` first): [`to_bf16`]'s rounding on each, then one
/// pack and one permute for both (the same sequence in a C loop, in cache: 16 -> 19 GB/s a core).
#[inline(always)]
unsafe fn to_bf16x2(a: __m256, b: __m256, plain_nans: bool) -> __m256i {
    // One NaN test for both vectors (a lane is unordered if either value is NaN), and
    // the NaN blend only when there is one: six instructions fewer per pair on data
    // without NaN, in passes that are bound by this arithmetic; none with `plain_nans`.
    if plain_nans || no_nan(a, b) {
        // Rounded as one interleaved vector (a0 b0 a1 b1 … in each 32-bit lane pair),
        // then put in order: a byte shuffle groups each 128-bit lane's a and b
        // elements, a permute the lanes (eleven instructions, twelve by two roundings
        // and a pack).
        let r = round_bf16_pairs(a, b);
        let grouped = _mm256_shuffle_epi8(
            r,
            _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
            ),
        );
        _mm256_permute4x64_epi64::<0b11_01_10_00>(grouped)
    } else {
        let (ra, rb) = (round_bf16(a), round_bf16(b));
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(ra, rb))
    }
}

/// The bf16 of each lane of `a` in the low half of its 32-bit lane and of `b` in the
/// high half, rounded as `bits + 0x7FFF + lsb` (so for lanes as
/// [`round_bf16_ordered`] allows), in 16-bit lanes: `hi + carry`, where `hi` is the
/// high half of the bits, and the low half `lo` carries (`lo + 0x7FFF + lsb` reaches
/// 2^16) where `lo - 0x8000 > -lsb` in signed 16 bits (no overflow). The same bits as
/// the 32-bit addition, wrap-around included, in nine instructions for two vectors
/// where two 32-bit roundings and a blend took ten. (Not `vpavgw`: LLVM widened it
/// to 32 bits, twice the instructions.)
#[inline(always)]
unsafe fn round_bf16_pairs(a: __m256, b: __m256) -> __m256i {
    let (a, b) = (_mm256_castps_si256(a), _mm256_castps_si256(b));
    let hi = _mm256_blend_epi16::<0b1010_1010>(_mm256_srli_epi32::<16>(a), b);
    let lo = _mm256_blend_epi16::<0b1010_1010>(a, _mm256_slli_epi32::<16>(b));
    let lo = _mm256_xor_si256(lo, _mm256_set1_epi16(i16::MIN));
    let minus_lsb = _mm256_sub_epi16(
        _mm256_setzero_si256(),
        _mm256_and_si256(hi, _mm256_set1_epi16(1)),
    );
    // All ones (-1) where the low half carries.
    let carry = _mm256_cmpgt_epi16(lo, minus_lsb);
    _mm256_sub_epi16(hi, carry)
}

/// Whether no lane of `a` or `b` is NaN.
#[inline(always)]
unsafe fn no_nan(a: __m256, b: __m256) -> bool {
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b);
    _mm256_testz_ps(nan, nan) != 0
}

/// [`round_bf16`] for lanes that are not NaN (±Inf and every finite value round as
/// there; a NaN could come out as Inf), and for NaN lanes with zero in their 16 low
/// bits that are quiet (the addition carries nothing into the kept bits: the same
/// bits as `round_bf16`'s quieting).
#[inline(always)]
unsafe fn round_bf16_ordered(v: __m256) -> __m256i {
    _mm256_srli_epi32::<16>(rounded_high(v))
}

/// The bf16 bits of each lane (not NaN) in the high 16 bits of its 32-bit lane, the low
/// 16 bits garbage: `bits + 0x7FFF + lsb`.
#[inline(always)]
unsafe fn rounded_high(v: __m256) -> __m256i {
    let bits = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb))
}

/// Sixteen bf16 from the even elements `a` and the odd elements `b` (the order of
/// [`Avx2::load_pair_ptr`]), rounded as [`to_bf16`]: the bf16 of `a` shifted to the low
/// half of each 32-bit lane and blended with the high half of `b`'s, no cross-lane
/// shuffle.
#[inline(always)]
unsafe fn to_bf16_even_odd(a: __m256, b: __m256, plain_nans: bool) -> __m256i {
    if plain_nans || no_nan(a, b) {
        round_bf16_pairs(a, b)
    } else {
        _mm256_or_si256(round_bf16(a), _mm256_slli_epi32::<16>(round_bf16(b)))
    }
}

/// The bf16 bits of each lane, in the low 16 bits of its 32-bit lane.
#[inline(always)]
unsafe fn round_bf16(v: __m256) -> __m256i {
    let bits = _mm256_castps_si256(v);
    let hi = _mm256_srli_epi32::<16>(bits);
    let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(_mm256_srli_epi32::<16>(rounded), quiet, nan)
}

#[inline(always)]
unsafe fn from_bf16(h: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// All-ones in the 32-bit lanes below `n`.
#[inline(always)]
unsafe fn lane_mask(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// The first `n < 8` 16-bit elements at `p`, zero above: whole 32-bit pairs by a
/// masked load, an odd last element blended in. Reads nothing past `p + n`.
#[inline(always)]
unsafe fn load_partial_16(p: *const u16, n: usize) -> __m128i {
    let pairs = _mm_cmpgt_epi32(_mm_set1_epi32((n / 2) as i32), _mm_setr_epi32(0, 1, 2, 3));
    let v = _mm_maskload_epi32(p.cast(), pairs);
    if n % 2 == 1 {
        let last = _mm_set1_epi16(p.add(n - 1).read_unaligned() as i16);
        let at = _mm_cmpeq_epi16(
            _mm_set1_epi16((n - 1) as i16),
            _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7),
        );
        _mm_blendv_epi8(v, last, at)
    } else {
        v
    }
}

/// Writes the first `n < 8` 16-bit lanes of `h` at `p` and nothing else: whole pairs
/// by a masked store, an odd last element on its own.
#[inline(always)]
unsafe fn store_partial_16(p: *mut u16, n: usize, h: __m128i) {
    let pairs = _mm_cmpgt_epi32(_mm_set1_epi32((n / 2) as i32), _mm_setr_epi32(0, 1, 2, 3));
    _mm_maskstore_epi32(p.cast(), pairs, h);
    if n % 2 == 1 {
        let b = (2 * (n - 1)) as i16;
        let lane = _mm_shuffle_epi8(h, _mm_set1_epi16(b | ((b + 1) << 8)));
        p.add(n - 1).write_unaligned(_mm_cvtsi128_si32(lane) as u16);
    }
}

impl Simd<f32> for Avx2 {
    const LANES: usize = L;
    type V = __m256;

    // SAFETY (every method): an `Avx2` token exists only inside `run`, whose caller
    // guarantees the features; slice lengths are checked before each pointer access,
    // and the `*_ptr` methods pass their callers' guarantees on.
    #[inline(always)]
    fn splat(self, v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    fn mask_positive(self, m: __m256, v: __m256) -> __m256 {
        unsafe { _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(m, _mm256_setzero_ps()), v) }
    }
    #[inline(always)]
    fn rotate_lanes(self, v: __m256, r: usize) -> __m256 {
        unsafe {
            let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let at = _mm256_add_epi32(iota, _mm256_set1_epi32(r as i32));
            _mm256_permutevar8x32_ps(v, _mm256_and_si256(at, _mm256_set1_epi32(7)))
        }
    }
    #[inline(always)]
    fn lanes_between(self, from: usize, to: usize) -> __m256 {
        unsafe {
            let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            // from ≤ i (i > from − 1) and i < to.
            let lo = _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(from as i32 - 1));
            let hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(to as i32), iota);
            let on = _mm256_castsi256_ps(_mm256_and_si256(lo, hi));
            _mm256_and_ps(on, _mm256_set1_ps(1.0))
        }
    }
    #[inline(always)]
    fn sum_f64(self, v: __m256) -> f64 {
        // Pairwise in f64 lanes: (a0 + a4) + (a2 + a6) and (a1 + a5) + (a3 + a7), then
        // their sum — three dependent adds instead of eight (perf: the scalar chain was
        // an eighth of the statistics time on 64-element channel rows).
        unsafe {
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
            let s4 = _mm256_add_pd(lo, hi);
            let s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd::<1>(s4));
            _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)))
        }
    }
    #[inline(always)]
    unsafe fn load_ptr<T: Element<Stat = f32>>(self, p: *const T) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                DType::BF16 => from_bf16(_mm_loadu_si128(p.cast())),
                _ => _mm256_loadu_ps(p.cast()),
            }
        }
    }
    #[inline(always)]
    unsafe fn store_ptr<T: Element<Stat = f32>>(self, p: *mut T, v: __m256) {
        // SAFETY: the caller guarantees 8 writable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm_storeu_si128(p.cast(), to_bf16(v, self.plain_nans)),
                _ => _mm256_storeu_ps(p.cast(), v),
            }
        }
    }
    #[inline(always)]
    unsafe fn stream_ptr<T: Element<Stat = f32>>(self, p: *mut T, v: __m256) {
        // SAFETY: the caller guarantees 8 writable elements at `p`, aligned to 8 elements
        // (16 or 32 bytes, what the non-temporal stores need).
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm_stream_si128(p.cast(), _mm256_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm_stream_si128(p.cast(), to_bf16(v, self.plain_nans)),
                _ => _mm256_stream_ps(p.cast(), v),
            }
        }
    }
    #[inline(always)]
    unsafe fn store2_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m256, b: __m256) {
        // SAFETY: the caller guarantees 16 writable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::BF16 => _mm256_storeu_si256(p.cast(), to_bf16x2(a, b, self.plain_nans)),
                _ => {
                    self.store_ptr(p, a);
                    self.store_ptr(p.add(L), b);
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn stream2_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m256, b: __m256) {
        // SAFETY: the caller guarantees 16 writable elements at `p`, aligned to 8
        // elements: two 16-byte non-temporal stores, each aligned (p may not be
        // 32-byte aligned, so not one 32-byte store).
        unsafe {
            match T::DTYPE {
                DType::BF16 => {
                    let v = to_bf16x2(a, b, self.plain_nans);
                    _mm_stream_si128(p.cast(), _mm256_castsi256_si128(v));
                    _mm_stream_si128(p.add(L).cast(), _mm256_extracti128_si256::<1>(v));
                }
                _ => {
                    self.stream_ptr(p, a);
                    self.stream_ptr(p.add(L), b);
                }
            }
        }
    }
    #[inline(always)]
    fn plain_nans(self, consts: &[&[f32]]) -> Avx2 {
        // Without an early exit, so the scan vectorizes (the constants are clean but
        // for a rare user NaN).
        let plain = |v: &f32| !v.is_nan() || v.to_bits() & 0xFFFF == 0;
        let each = |k: &&[f32]| k.iter().fold(true, |all, v| all & plain(v));
        Avx2 {
            plain_nans: consts.iter().fold(true, |all, k| all & each(k)),
        }
    }
    #[inline(always)]
    fn pair_even_odd<T: Element<Stat = f32>>(self) -> bool {
        T::DTYPE == DType::BF16
    }
    #[inline(always)]
    fn to_pair_order<T: Element<Stat = f32>>(self, a: __m256, b: __m256) -> (__m256, __m256) {
        if !self.pair_even_odd::<T>() {
            return (a, b);
        }
        unsafe {
            // Per 128-bit half: a0 a2 b0 b2 | a4 a6 b4 b6, then 64-bit pieces 0 2 1 3.
            let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
            let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
            let even = _mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(even));
            let odd = _mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(odd));
            (_mm256_castpd_ps(even), _mm256_castpd_ps(odd))
        }
    }
    #[inline(always)]
    fn to_lane_order<T: Element<Stat = f32>>(self, a: __m256, b: __m256) -> (__m256, __m256) {
        if !self.pair_even_odd::<T>() {
            return (a, b);
        }
        unsafe {
            // Per 128-bit half: e0 o0 e1 o1 | e4 o4 e5 o5 and e2 o2 e3 o3 | e6 o6 e7 o7.
            let lo = _mm256_unpacklo_ps(a, b);
            let hi = _mm256_unpackhi_ps(a, b);
            (
                _mm256_permute2f128_ps::<0x20>(lo, hi),
                _mm256_permute2f128_ps::<0x31>(lo, hi),
            )
        }
    }
    #[inline(always)]
    unsafe fn load_pair_ptr<T: Element<Stat = f32>>(self, p: *const T) -> (__m256, __m256) {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::BF16 => {
                    // Element 2i is the low half of 32-bit lane i, 2i + 1 the high half.
                    let v = _mm256_loadu_si256(p.cast());
                    let even = _mm256_slli_epi32::<16>(v);
                    let odd = _mm256_and_si256(v, _mm256_set1_epi32(-65536));
                    (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
                }
                _ => (self.load_ptr(p), self.load_ptr(p.add(L))),
            }
        }
    }
    #[inline(always)]
    unsafe fn store_pair_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m256, b: __m256) {
        // SAFETY: the caller guarantees 16 writable elements at `p`.
        unsafe {
            match T::DTYPE {
                DType::BF16 => {
                    _mm256_storeu_si256(p.cast(), to_bf16_even_odd(a, b, self.plain_nans))
                }
                _ => self.store2_ptr(p, a, b),
            }
        }
    }
    #[inline(always)]
    unsafe fn stream_pair_ptr<T: Element<Stat = f32>>(self, p: *mut T, a: __m256, b: __m256) {
        // SAFETY: the caller guarantees 16 writable elements at `p`, aligned to 8
        // elements (16 bytes); the 32-byte store is taken only where `p` is tested to
        // be 32-byte aligned (the elementwise runs align their pairs so:
        // `pair_stream_align`, `cl_stream_align`; an odd period of vectors misaligns
        // every other channels-last pair). Otherwise two 16-byte stores.
        unsafe {
            let whole = (p as usize).is_multiple_of(32);
            match T::DTYPE {
                DType::BF16 if whole => {
                    _mm256_stream_si256(p.cast(), to_bf16_even_odd(a, b, self.plain_nans))
                }
                DType::F16 if whole => {
                    let (lo, hi) = (_mm256_cvtps_ph::<RNE>(a), _mm256_cvtps_ph::<RNE>(b));
                    _mm256_stream_si256(p.cast(), _mm256_set_m128i(hi, lo))
                }
                DType::BF16 => {
                    let v = to_bf16_even_odd(a, b, self.plain_nans);
                    _mm_stream_si128(p.cast(), _mm256_castsi256_si128(v));
                    _mm_stream_si128(p.add(L).cast(), _mm256_extracti128_si256::<1>(v));
                }
                _ => self.stream2_ptr(p, a, b),
            }
        }
    }
    #[inline(always)]
    unsafe fn stream_pair_cl_whole_ptr<T: Element<Stat = f32>>(
        self,
        p: *mut T,
        a: __m256,
        b: __m256,
    ) {
        // SAFETY: the caller guarantees 16 writable elements at `p`, aligned to
        // `cl_stream_align` elements: 16 of a 16-bit type (32 bytes, what the one
        // 32-byte store needs), 8 of f32 (32 bytes, two 32-byte stores).
        unsafe {
            match T::DTYPE {
                DType::BF16 => {
                    _mm256_stream_si256(p.cast(), to_bf16_even_odd(a, b, self.plain_nans))
                }
                DType::F16 => {
                    let (lo, hi) = (_mm256_cvtps_ph::<RNE>(a), _mm256_cvtps_ph::<RNE>(b));
                    _mm256_stream_si256(p.cast(), _mm256_set_m128i(hi, lo))
                }
                _ => self.stream2_ptr(p, a, b),
            }
        }
    }
    #[inline(always)]
    fn plain_nans_const<T: Element<Stat = f32>>(self) -> Option<Avx2> {
        (T::DTYPE == DType::BF16 && self.plain_nans).then_some(Avx2 { plain_nans: true })
    }
    #[inline(always)]
    fn pair_stream_align<T: Element<Stat = f32>>(self) -> usize {
        self.cl_stream_align::<T>()
    }
    #[inline(always)]
    fn cl_stream_align<T: Element<Stat = f32>>(self) -> usize {
        // 16-bit elements: a pair, for one 32-byte non-temporal store a pair
        // (`stream_pair_ptr`).
        match T::DTYPE {
            DType::BF16 | DType::F16 => 2 * L,
            _ => L,
        }
    }
    #[inline(always)]
    fn load_partial<T: Element<Stat = f32>>(self, src: &[T]) -> __m256 {
        let (p, n) = (src.as_ptr(), src.len().min(L));
        // SAFETY: masked loads touch only the first `n` elements, all inside `src`.
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm256_cvtph_ps(load_partial_16(p.cast(), n)),
                DType::BF16 => from_bf16(load_partial_16(p.cast(), n)),
                _ => _mm256_maskload_ps(p.cast(), lane_mask(n)),
            }
        }
    }
    #[inline(always)]
    fn store_partial<T: Element<Stat = f32>>(self, dst: &mut [T], v: __m256) {
        let (p, n) = (dst.as_mut_ptr(), dst.len().min(L));
        // SAFETY: masked stores write only the first `n` elements, all inside `dst`.
        unsafe {
            match T::DTYPE {
                DType::F16 => store_partial_16(p.cast(), n, _mm256_cvtps_ph::<RNE>(v)),
                DType::BF16 => store_partial_16(p.cast(), n, to_bf16(v, self.plain_nans)),
                _ => _mm256_maskstore_ps(p.cast(), lane_mask(n), v),
            }
        }
    }
    #[inline(always)]
    fn fence(self) {
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    fn outline<B: Body<Self>>(self, b: B) -> B::Output {
        // SAFETY: `self` was made by `run`, on a CPU with AVX2, FMA and F16C.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The flag of [`Simd::plain_nans`]: set by constants without a NaN payload in the
    /// 16 low bits (ordinary values, infinities, NaNs as arithmetic makes them), cleared
    /// by one such NaN in any slice; each call judges its own constants.
    #[test]
    fn plain_nans_only_without_low_payloads() {
        let s = Avx2 { plain_nans: false };
        let clean: [&[f32]; 2] = [&[1.0, -0.0, f32::NAN, -f32::NAN], &[f32::INFINITY]];
        assert!(s.plain_nans(&clean).plain_nans);
        assert!(s.plain_nans(&[]).plain_nans);
        let low = f32::from_bits(0x7FC0_0001);
        assert!(!s.plain_nans(&[&[1.0], &[2.0, low]]).plain_nans);
        assert!(!s.plain_nans(&[&[f32::from_bits(0xFFFF_FFFF)]]).plain_nans);
        assert!(s.plain_nans(&[&[low]]).plain_nans(&clean).plain_nans);
    }
}
