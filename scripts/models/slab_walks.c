// A C model of the memory walks of NHWC backward training from DRAM (64x56x56x256 in a
// 16-bit type: a pixel is 512 bytes of each tensor, dy, x and dx 103 MB each), with no
// arithmetic beyond one add a vector, two threads, each taking half the pixels:
//
// - "two passes" (the library's walk): pass 1 reads dy and x in memory order (the
//   sums), both threads wait, pass 2 reads them again and writes dx with non-temporal
//   stores; every input prefetched 8 KiB ahead, one hint a line (`prefetcht1`).
// - "pass 1", "pass 2": each alone.
// - "slab S": the channels cut into slabs of S bytes a pixel (64, 128 or 256: 32, 64 or
//   128 channels of a 16-bit type); per slab pass 1 over every pixel's slab (strided by
//   the pixel, prefetched 16 pixels ahead), both threads wait, then pass 2 over the same
//   slab, hoping to find it in the L3 (a slab of dy and x is 12.8 MB at S = 64). The
//   idea: DRAM traffic of a copy (dy and x read once) instead of reading them twice.
//
// Interleaved rounds, medians of time ÷ the bench's copy (memcpy dy into dx, read x).
//
//   gcc -O2 -mavx2 -mfma -pthread -o /tmp/slab_walks scripts/models/slab_walks.c
//   /tmp/slab_walks 7
//
// On the Zen 4 (AMD EPYC, 2 cores) of 2026-12-02 (fourth session), two runs: two passes
// 1.29 / 1.51 of the copy, pass 1 alone 0.59 / 0.65, pass 2 alone 0.64 / 0.66; slabs of
// 64 bytes 2.86 / 3.84, 128 bytes 3.34 / 3.66, 256 bytes 2.41 / 2.44. The strided walks
// cost far more than the second read they save, so the library keeps its two passes in
// memory order.
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define PX (64L * 56 * 56)
#define PB 512L
#define AHEAD 8192L
static char *dy, *x, *dx;
static pthread_barrier_t bar;
static int mode;
static long slab;
static volatile float sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static __m256 rd(const char *p) { return _mm256_castsi256_ps(_mm256_load_si256((const __m256i *)p)); }

// Pass 1 over bytes [off, off + w) of pixels [p0, p1): a sum of dy·x a vector.
static void pass1(long p0, long p1, long off, long w, __m256 *acc) {
    long ahead = w == PB ? AHEAD : 16 * PB;
    for (long p = p0; p < p1; p++) {
        const char *a = dy + p * PB + off, *b = x + p * PB + off;
        for (long k = 0; k < w; k += 64) {
            _mm_prefetch(a + ahead + k, _MM_HINT_T1);
            _mm_prefetch(b + ahead + k, _MM_HINT_T1);
        }
        for (long k = 0; k < w; k += 32)
            acc[(k / 32) & 7] = _mm256_add_ps(acc[(k / 32) & 7], _mm256_mul_ps(rd(a + k), rd(b + k)));
    }
}

// Pass 2: dx = dy + x, streamed; prefetched only in memory order (a slab is in cache).
static void pass2(long p0, long p1, long off, long w) {
    for (long p = p0; p < p1; p++) {
        const char *a = dy + p * PB + off, *b = x + p * PB + off;
        char *o = dx + p * PB + off;
        if (w == PB)
            for (long k = 0; k < w; k += 64) {
                _mm_prefetch(a + AHEAD + k, _MM_HINT_T1);
                _mm_prefetch(b + AHEAD + k, _MM_HINT_T1);
            }
        for (long k = 0; k < w; k += 32)
            _mm256_stream_ps((float *)(o + k), _mm256_add_ps(rd(a + k), rd(b + k)));
    }
}

static void *run(void *arg) {
    long t = (long)arg, p0 = t * PX / 2, p1 = (t + 1) * PX / 2;
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    switch (mode) {
    case 0: // copy
        memcpy(dx + p0 * PB, dy + p0 * PB, (p1 - p0) * PB);
        for (long i = p0 * PB; i < p1 * PB; i += 32) acc[0] = _mm256_add_ps(acc[0], rd(x + i));
        break;
    case 1: // two passes
        pass1(p0, p1, 0, PB, acc);
        pthread_barrier_wait(&bar);
        pass2(p0, p1, 0, PB);
        break;
    case 2: pass1(p0, p1, 0, PB, acc); break;
    case 3: pass2(p0, p1, 0, PB); break;
    default: // slabs
        for (long off = 0; off < PB; off += slab) {
            pass1(p0, p1, off, slab, acc);
            pthread_barrier_wait(&bar);
            pass2(p0, p1, off, slab);
            pthread_barrier_wait(&bar);
        }
    }
    _mm_sfence();
    float f[8];
    _mm256_storeu_ps(f, acc[0]);
    sink += f[0];
    return 0;
}

static double once(int m, long s) {
    mode = m;
    slab = s;
    pthread_t th[2];
    double t0 = now();
    for (long i = 0; i < 2; i++) pthread_create(&th[i], 0, run, (void *)i);
    for (int i = 0; i < 2; i++) pthread_join(th[i], 0);
    return now() - t0;
}

static int cmp(const void *a, const void *b) {
    double d = *(const double *)a - *(const double *)b;
    return d < 0 ? -1 : d > 0;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    if (rounds < 1 || rounds > 64) rounds = 7;
    dy = aligned_alloc(64, PX * PB);
    x = aligned_alloc(64, PX * PB);
    dx = aligned_alloc(64, PX * PB);
    if (!dy || !x || !dx) return 1;
    memset(dy, 1, PX * PB);
    memset(x, 1, PX * PB);
    memset(dx, 0, PX * PB);
    pthread_barrier_init(&bar, 0, 2);
    const char *name[] = {"copy", "two passes", "pass 1", "pass 2", "slab 64", "slab 128", "slab 256"};
    const int modes[] = {0, 1, 2, 3, 4, 4, 4};
    const long slabs[] = {0, 0, 0, 0, 64, 128, 256};
    double t[7][64];
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < 7; k++) t[k][r] = once(modes[k], slabs[k]);
    for (int k = 0; k < 7; k++) {
        double q[64], ms[64];
        for (int r = 0; r < rounds; r++) {
            q[r] = t[k][r] / t[0][r];
            ms[r] = t[k][r];
        }
        qsort(q, rounds, sizeof q[0], cmp);
        qsort(ms, rounds, sizeof ms[0], cmp);
        printf("%-11s %7.2f ms  %.2f of the copy\n", name[k], ms[rounds / 2] * 1e3, q[rounds / 2]);
    }
    return 0;
}
