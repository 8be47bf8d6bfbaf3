// What does a masked store cost against a plain one, in L1? A 49-element channel-major
// row (a 7x7 image) ends in a one-element tail, which the kernels had written with a
// masked store (`vmaskmovps` / `vpmaskmovd`, AVX2): the loop below writes one vector a
// row at rows 49 floats apart in a 16 KB buffer, with the store as the only thing that
// differs, medians of 7 rounds. On the AMD EPYC Zen 3 of 2026-12-06 (AVX2 only; three
// runs minutes apart, the machine's speed drifting), ns a store: 256-bit masked 4.5-5.0
// in the first run and 8.1-8.8 in the next two, 128-bit masked 2.6 / 4.6 / 4.7, plain
// 256-bit 1.4 / 1.8 / 2.1 (the loop's own cost included). A masked store takes 3 to 5
// times a plain one there, where a whole 49-element bf16 row of the inference gradient
// took about 27 ns (NCHW 16x512x7x7, one thread: 0.22 ms for its 8,192 rows).
//
//   gcc -O2 -mavx2 -o /tmp/maskstore scripts/models/maskstore.c && /tmp/maskstore
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROWS 80
#define ITERS 4000000
static float buf[ROWS * 49 + 64] __attribute__((aligned(64)));
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
// kind 0: masked 256-bit, lane 0 on; 1: masked 256-bit, lanes 0-6 on; 2: masked
// 128-bit, lane 0 on; 3: plain 256-bit store.
static double run(int kind) {
    __m256 v = _mm256_set1_ps(1.5f);
    __m256i m1 = _mm256_setr_epi32(-1, 0, 0, 0, 0, 0, 0, 0);
    __m256i m7 = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, -1, 0);
    __m128i m1x = _mm_setr_epi32(-1, 0, 0, 0);
    double t = now();
    int r = 0;
    for (int i = 0; i < ITERS; i++) {
        float *p = buf + r * 49 + 48;
        switch (kind) {
        case 0: _mm256_maskstore_ps(p, m1, v); break;
        case 1: _mm256_maskstore_ps(p, m7, v); break;
        case 2: _mm_maskstore_ps(p, m1x, _mm256_castps256_ps128(v)); break;
        default: _mm256_storeu_ps(p - 7, v); break;
        }
        r = r + 1 == ROWS ? 0 : r + 1;
        __asm__ volatile("" ::: "memory");
    }
    return (now() - t) / ITERS * 1e9;
}
int main(void) {
    const char *names[] = {"masked 256-bit, 1 lane", "masked 256-bit, 7 lanes",
                           "masked 128-bit, 1 lane", "plain 256-bit"};
    double t[4][7];
    for (int round = 0; round < 7; round++)
        for (int k = 0; k < 4; k++) t[k][round] = run(k);
    for (int k = 0; k < 4; k++) {
        qsort(t[k], 7, sizeof(double), cmp);
        printf("%-24s %.2f ns a store (median of 7)\n", names[k], t[k][3]);
    }
    return 0;
}
