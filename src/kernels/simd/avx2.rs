//! AVX2 + FMA + F16C: 8 f32 lanes; tails through a small stack buffer; bf16 by
//! shifting (round to nearest even on store, NaN kept quiet as `half` does).

use std::arch::x86_64::*;

use super::{Kernel, Simd};
use crate::element::Element;
use crate::tensor::DType;

/// Token of the AVX2 ISA; made only by [`run`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

/// Runs `k` compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<K: Kernel<f32>>(k: K) -> K::Output {
    k.run(Avx2(()))
}

const L: usize = 8;
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;

#[inline(always)]
unsafe fn to_bf16(v: __m256) -> __m128i {
    let bits = _mm256_castps_si256(v);
    let hi = _mm256_srli_epi32::<16>(bits);
    let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    let out = _mm256_blendv_epi8(_mm256_srli_epi32::<16>(rounded), quiet, nan);
    // Pack the eight 32-bit values (each < 2^16) to 16 bits, in order.
    let packed = _mm256_packus_epi32(out, out);
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b11_01_10_00>(packed))
}

#[inline(always)]
unsafe fn from_bf16(h: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

impl Simd<f32> for Avx2 {
    const LANES: usize = L;
    type V = __m256;

    // SAFETY (every method): an `Avx2` token exists only inside `run`, whose caller
    // guarantees the features; slice lengths are checked before each pointer access.
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
    fn sum_f64(self, v: __m256) -> f64 {
        let mut a = [0f32; L];
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        a.iter().map(|&x| x as f64).sum()
    }
    #[inline(always)]
    fn load<T: Element<Stat = f32>>(self, src: &[T]) -> __m256 {
        assert!(src.len() >= L);
        let p = src.as_ptr();
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                DType::BF16 => from_bf16(_mm_loadu_si128(p.cast())),
                _ => _mm256_loadu_ps(p.cast()),
            }
        }
    }
    #[inline(always)]
    fn load_partial<T: Element<Stat = f32>>(self, src: &[T]) -> __m256 {
        let mut buf = [T::default(); L];
        let n = src.len().min(L);
        buf[..n].copy_from_slice(&src[..n]);
        self.load(&buf[..])
    }
    #[inline(always)]
    fn store<T: Element<Stat = f32>>(self, dst: &mut [T], v: __m256) {
        assert!(dst.len() >= L);
        let p = dst.as_mut_ptr();
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm_storeu_si128(p.cast(), to_bf16(v)),
                _ => _mm256_storeu_ps(p.cast(), v),
            }
        }
    }
    #[inline(always)]
    fn store_partial<T: Element<Stat = f32>>(self, dst: &mut [T], v: __m256) {
        let mut buf = [T::default(); L];
        self.store(&mut buf[..], v);
        let n = dst.len().min(L);
        dst[..n].copy_from_slice(&buf[..n]);
    }
    #[inline(always)]
    fn stream<T: Element<Stat = f32>>(self, dst: &mut [T], v: __m256) {
        assert!(dst.len() >= L);
        let p = dst.as_mut_ptr();
        if !(p as usize).is_multiple_of(L * std::mem::size_of::<T>()) {
            return self.store(dst, v);
        }
        unsafe {
            match T::DTYPE {
                DType::F16 => _mm_stream_si128(p.cast(), _mm256_cvtps_ph::<RNE>(v)),
                DType::BF16 => _mm_stream_si128(p.cast(), to_bf16(v)),
                _ => _mm256_stream_ps(p.cast(), v),
            }
        }
    }
    #[inline(always)]
    fn fence(self) {
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    fn prefetch<T>(self, data: &[T]) {
        if !data.is_empty() {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(data.as_ptr().cast()) }
        }
    }
}
