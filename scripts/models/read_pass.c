// The fastest a statistics pass can read BYTES from DRAM here: two threads, each reading
// its half as one sequential stream of 256-bit loads (as a pass of fusedbn's reads it),
// summed so the loads are not dropped. Prints the median of ROUNDS timed reads, in ms,
// after one untimed read. Used by scripts/floors.py for the two-pass floor of the
// channels-last training ops.
//
//   gcc -O2 -mavx2 -pthread -o /tmp/read_pass scripts/models/read_pass.c
//   /tmp/read_pass 102760448 9
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t bytes;
static char *buf;
static volatile int sink;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *half(void *arg) {
    size_t t = (size_t)arg, n = bytes / 2;
    const char *s = buf + t * n;
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i + 64 <= n; i += 64) {
        a = _mm256_add_epi32(a, _mm256_load_si256((const void *)(s + i)));
        b = _mm256_add_epi32(b, _mm256_load_si256((const void *)(s + i + 32)));
    }
    sink += _mm256_extract_epi32(_mm256_add_epi32(a, b), 0);
    return 0;
}

static double once(void) {
    pthread_t th[2];
    double t0 = now();
    for (size_t t = 0; t < 2; t++) pthread_create(&th[t], 0, half, (void *)t);
    for (int t = 0; t < 2; t++) pthread_join(th[t], 0);
    return now() - t0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: read_pass BYTES ROUNDS\n");
        return 2;
    }
    bytes = (size_t)atol(argv[1]) & ~(size_t)127;
    int rounds = atoi(argv[2]);
    if (rounds < 1 || rounds > 1000 || bytes < 128) return 2;
    buf = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
    if (!buf) return 1;
    memset(buf, 1, bytes);
    double *t = malloc(sizeof(double) * rounds);
    once();
    for (int r = 0; r < rounds; r++) t[r] = once();
    qsort(t, rounds, sizeof(double), cmp);
    printf("%.4f\n", t[rounds / 2] * 1e3);
    return 0;
}
