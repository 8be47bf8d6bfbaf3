// A C model of the channels-last 16-bit backward sums from DRAM (NHWC bf16, C = 256,
// 64x56x56x256: dy and x 103 MB each), against a plain read of the same two tensors:
// per channel Σdy and Σdy·(x − mean) in f32 lanes (AVX2, accumulators in memory),
// two threads, each walking its half in tasks of 1024 pixels, with the pixels taken
// four at a time (the library's `Quads`), two at a time, or one at a time in memory
// order, each with and without a prefetch of both inputs 8 KiB ahead (one hint per
// line, `prefetcht1`). Interleaved rounds, medians, time ÷ the read. Behind README.md's
// Zen 4 section of 2026-12-02 (third session): the library's 16-bit `backward_sums`
// took 1.1-1.6 of a read of dy and x there; how near a plain loop gets is what this
// measures.
//
//   gcc -O2 -mavx2 -mfma -pthread -o /tmp/sums_walks scripts/models/sums_walks.c
//   /tmp/sums_walks 9
//
// On the Zen 4 (AMD EPYC, 2 cores) of 2026-12-02, two runs: four pixels with the
// prefetch 1.15 / 1.08 of the read, without 2.04 / 1.92; two pixels 1.40 / 1.28 and
// 1.90 / 1.68; one pixel 1.44 / 1.32 and 1.26 / 1.15.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define C 256
#define G (C / 8)
#define TASK_PX 1024
#define AHEAD (8192 / 2)
static size_t NPX;
static uint16_t *dy, *xs;
static float mean[C];
static volatile float sink;
typedef struct { int mode, t; } arg_t;
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
static inline __m256 wide(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}
static inline void pf_lines(const uint16_t *p, size_t elems) {
    for (size_t b = 0; b < elems * 2; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}
// Pixels [p0, p1): `step` pixels a group update (1, 2 or 4), `pf` the prefetch.
static void sums(size_t p0, size_t p1, int step, int pf, float *out) {
    __m256 a[G], b[G];
    for (int g = 0; g < G; g++) a[g] = b[g] = _mm256_setzero_ps();
    for (size_t p = p0; p + step <= p1; p += step) {
        const uint16_t *d = dy + p * C, *x = xs + p * C;
        for (int g = 0; g < G; g++) {
            if (pf && (g * 8 * step * 2) % 64 == 0) {
                // The lines of `step` vectors' worth of the block, in memory order.
                // One line (32 elements) of each input per 64 bytes of the block.
                size_t at = AHEAD + (size_t)g * 8 * step;
                pf_lines(d + at, 32); pf_lines(x + at, 32);
            }
            __m256 m = _mm256_loadu_ps(mean + g * 8), sa = _mm256_setzero_ps(), sb = sa;
            for (int k = 0; k < step; k++) {
                __m256 dv = wide(d + k * C + g * 8), xv = wide(x + k * C + g * 8);
                sa = _mm256_add_ps(sa, dv);
                sb = _mm256_fmadd_ps(dv, _mm256_sub_ps(xv, m), sb);
            }
            a[g] = _mm256_add_ps(a[g], sa);
            b[g] = _mm256_add_ps(b[g], sb);
        }
    }
    float t[8];
    for (int g = 0; g < G; g++) {
        _mm256_storeu_ps(t, a[g]); for (int k = 0; k < 8; k++) out[g * 8 + k] += t[k];
        _mm256_storeu_ps(t, b[g]); for (int k = 0; k < 8; k++) out[C + g * 8 + k] += t[k];
    }
}
static void *work(void *v) {
    arg_t *a = v;
    size_t half = NPX / 2, p0 = a->t * half, p1 = p0 + half;
    float out[2 * C] = {0};
    if (a->mode == 0) {
        const uint16_t *d = dy + p0 * C, *x = xs + p0 * C;
        size_t n = half * C;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (size_t i = 0; i < n; i += 32) {
            s0 = _mm256_add_epi32(s0, _mm256_loadu_si256((const void *)(d + i)));
            s1 = _mm256_add_epi32(s1, _mm256_loadu_si256((const void *)(x + i)));
            s2 = _mm256_add_epi32(s2, _mm256_loadu_si256((const void *)(d + i + 16)));
            s3 = _mm256_add_epi32(s3, _mm256_loadu_si256((const void *)(x + i + 16)));
        }
        s0 = _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
        out[0] = (float)_mm256_extract_epi32(s0, 0);
    } else {
        static const int step[] = {0, 4, 4, 2, 2, 1, 1}, pf[] = {0, 1, 0, 1, 0, 1, 0};
        for (size_t q = p0; q < p1; q += TASK_PX) {
            size_t e = q + TASK_PX < p1 ? q + TASK_PX : p1;
            sums(q, e, step[a->mode], pf[a->mode], out);
        }
    }
    sink = out[0] + out[C];
    return NULL;
}
static double run(int mode) {
    pthread_t th[2]; arg_t a[2];
    double t0 = now();
    for (int t = 0; t < 2; t++) { a[t].mode = mode; a[t].t = t; pthread_create(&th[t], NULL, work, &a[t]); }
    for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
    return now() - t0;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 9;
    NPX = 64 * 56 * 56;
    size_t n = NPX * C;
    dy = aligned_alloc(64, n * 2); xs = aligned_alloc(64, n * 2);
    for (size_t i = 0; i < n; i++) { dy[i] = 0x3f80 + i % 97; xs[i] = 0x3f00 + i % 89; }
    for (int c = 0; c < C; c++) mean[c] = 1.0f;
    const char *name[] = {"read dy and x", "four pixels, prefetch", "four pixels", "two pixels, prefetch", "two pixels", "one pixel, prefetch", "one pixel"};
    enum { MODES = 7 };
    double *t = calloc((size_t)MODES * rounds, sizeof *t), med[MODES];
    for (int r = 0; r < rounds; r++)
        for (int m = 0; m < MODES; m++) t[m * rounds + r] = run(m);
    for (int m = 0; m < MODES; m++) { qsort(t + m * rounds, rounds, sizeof *t, cmp); med[m] = t[m * rounds + rounds / 2]; }
    for (int m = 0; m < MODES; m++) printf("%-22s %7.2f ms  %.2f of the read\n", name[m], med[m] * 1e3, med[m] / med[0]);
    return 0;
}
