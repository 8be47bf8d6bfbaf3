// A C model of the channel-major resident forward training pass (NCHW, 16-bit, whole
// channels a thread: 64x256x56x56 bf16 by default, a channel 64 rows of 3136 elements,
// 401 KB), to see what its walk costs against a copy of the same bytes on this machine,
// with the library's arithmetic reduced to its shape (widen, sum and sum of squares;
// widen, one FMA, narrow with round-to-nearest-even, non-temporal 512-bit stores). Two
// threads, each its half of the channels, a channel's rows one after the other (rows of
// a channel are a whole image of the other channels apart); interleaved rounds, medians,
// time ÷ memcpy:
//
// - memcpy:            each thread's half of x copied into y (the bench's copy).
// - inference:         each row read from DRAM and written, no prefetch.
// - read [pf D rows]:  the reduction alone, every channel once; with a software
//                      prefetch of the row D rows on, a line per vector.
// - serial:            a channel reduced, then written from its cached rows.
// - pipe T:            channel c written while c + 1 is reduced: after each tile of T
//                      rows of c + 1, T rows of c (the library's `fused::RowsBehind`),
//                      each written row prefetching the row of c + 1 T rows on
//                      ("pf 3 tiles": 3T rows on; "ordinary": ordinary stores; "nopf":
//                      no prefetch).
// - write only:        every row written from rows that stay in L1/L2 (no DRAM read).
// - inference pf:      inference with the next row prefetched.
// - zip:               one loop over row r of c + 1 (reduced) and row r of c (written),
//                      a vector of each a step, the row ZIPD rows on prefetched ("same
//                      row": the written row is the reduced one, so nothing is read twice;
//                      "write from L1": the written row's input is a buffer in L1).
//
//   gcc -O2 -mavx512f -mavx512bw -mfma -pthread -o /tmp/resident_pipe scripts/models/resident_pipe.c
//   ZIPD=2 /tmp/resident_pipe 64 256 3136 7      # N C H·W rounds
//
// On the Zen 4 of 2026-12-04 (1 MiB L2, 32 MiB L3; one run, ms): memcpy 7.14; read
// 6.48 without a prefetch, 3.33-3.53 with one (a channel-major walk needs it: each row
// is 6 KB); write only 3.89; inference with the prefetch 5.07; serial 10.26; pipe 2
// 7.77, pipe 2 prefetching 3 tiles on 6.87, pipe 8 6.98; zip 6.34, zip of the same row
// 5.40. So the pipelined pass costs about a read and a write one after the other with
// its prefetch one tile ahead, less with it three tiles ahead (`fused::AHEAD_TILES`),
// and a vector-by-vector zip would take a little less again; its second read of a
// channel costs about 1 ms of the 6.3 (zip against zip of the same row).
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t NB, C, HW, ZIPD = 1;
static uint16_t *x, *y, *l1buf[2];
static volatile float sink;
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static inline uint16_t *row(uint16_t *t, size_t c, size_t o) { return t + (o * C + c) * HW; }

static inline __m512 lo(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
static inline __m512 hi(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}
static inline __m256i narrow(__m512 f) {
    __m512i b = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16));
}

typedef struct { __m512 s, q; } acc_t;
static inline void reduce_row_pf(const uint16_t *r, acc_t *a, const uint16_t *pf) {
    for (size_t i = 0; i + 32 <= HW; i += 32) {
        if (pf) _mm_prefetch((const char *)(pf + i), _MM_HINT_T1);
        __m512i v = _mm512_loadu_si512(r + i);
        __m512 l = lo(v), h = hi(v);
        a->s = _mm512_add_ps(a->s, _mm512_add_ps(l, h));
        a->q = _mm512_fmadd_ps(l, l, _mm512_fmadd_ps(h, h, a->q));
    }
}
static inline void reduce_row(const uint16_t *r, acc_t *a) { reduce_row_pf(r, a, 0); }
// Writes a row; `pf`, if not NULL, is a row whose lines are prefetched along the way.
static inline void write_row(const uint16_t *r, uint16_t *w, const uint16_t *pf, int nt) {
    __m512 k1 = _mm512_set1_ps(1.25f), k2 = _mm512_set1_ps(-0.5f);
    size_t i = 0;
    for (; i + 32 <= HW; i += 32) {
        if (pf) _mm_prefetch((const char *)(pf + i), _MM_HINT_T1);
        __m512i v = _mm512_loadu_si512(r + i);
        __m256i a = narrow(_mm512_fmadd_ps(lo(v), k1, k2)), b = narrow(_mm512_fmadd_ps(hi(v), k1, k2));
        __m512i o = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        if (nt && ((uintptr_t)(w + i) & 63) == 0)
            _mm512_stream_si512((void *)(w + i), o);
        else
            _mm512_storeu_si512(w + i, o);
    }
    for (; i < HW; i++) w[i] = r[i];
}

// One loop over row r of channel c + 1 (reduced) and row r of c (written), a vector
// of each a step; `pf` prefetched along the way.
static inline void zip_row(const uint16_t *red, const uint16_t *r, uint16_t *w, const uint16_t *pf, acc_t *a) {
    __m512 k1 = _mm512_set1_ps(1.25f), k2 = _mm512_set1_ps(-0.5f);
    size_t i = 0;
    for (; i + 32 <= HW; i += 32) {
        if (pf) _mm_prefetch((const char *)(pf + i), _MM_HINT_T1);
        __m512i u = _mm512_loadu_si512(red + i);
        __m512 l = lo(u), h = hi(u);
        a->s = _mm512_add_ps(a->s, _mm512_add_ps(l, h));
        a->q = _mm512_fmadd_ps(l, l, _mm512_fmadd_ps(h, h, a->q));
        __m512i v = _mm512_loadu_si512(r + i);
        __m256i p = narrow(_mm512_fmadd_ps(lo(v), k1, k2)), q = narrow(_mm512_fmadd_ps(hi(v), k1, k2));
        __m512i o = _mm512_inserti64x4(_mm512_castsi256_si512(p), q, 1);
        if (((uintptr_t)(w + i) & 63) == 0)
            _mm512_stream_si512((void *)(w + i), o);
        else
            _mm512_storeu_si512(w + i, o);
    }
    for (; i < HW; i++) w[i] = r[i];
}

enum { MEMCPY, INFER, READ, READ_PF1, READ_PF2, READ_PF4, SERIAL, PIPE, PIPE_ORD, PIPE_NOPF, PIPE8, PIPE_FAR, WRITE, INFER_PF, ZIP, ZIP_NOPF, ZIP_SAME, ZIP_L1, MODES };
static const char *names[MODES] = {
    "memcpy",      "inference",    "read",         "read pf 1 row",     "read pf 2 rows",
    "read pf 4 rows", "serial",    "pipe 2",       "pipe 2 ordinary",   "pipe 2 nopf",
    "pipe 8",      "pipe 2 pf 3 tiles", "write only", "inference pf",   "zip",
    "zip nopf",    "zip same row", "zip write from L1"};
typedef struct { int t, mode; } arg_t;

static void *work(void *p) {
    arg_t *a = p;
    size_t c0 = a->t * C / 2, c1 = (a->t + 1) * C / 2;
    acc_t acc = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    int m = a->mode;
    if (m == MEMCPY) {
        size_t n = NB * C * HW, h = n / 2, s = a->t * h;
        memcpy(y + s, x + s, (a->t ? n - h : h) * 2);
        return 0;
    }
    for (size_t c = c0; c < c1; c++) {
        if (m == INFER) {
            for (size_t o = 0; o < NB; o++) write_row(row(x, c, o), row(y, c, o), 0, 1);
        } else if (m == ZIP_SAME) {
            for (size_t o = 0; o < NB; o++) {
                size_t q = o + ZIPD, cc = c;
                if (q >= NB) q -= NB, cc++;
                zip_row(row(x, c, o), row(x, c, o), row(y, c, o), cc < c1 ? row(x, cc, q) : 0, &acc);
            }
        } else if (m == ZIP_L1) {
            for (size_t o = 0; o < NB; o++) {
                size_t q = o + ZIPD, cc = c;
                if (q >= NB) q -= NB, cc++;
                zip_row(row(x, c, o), l1buf[a->t], row(y, c, o), cc < c1 ? row(x, cc, q) : 0, &acc);
            }
        } else if (m == ZIP || m == ZIP_NOPF) {
            if (c == c0)
                for (size_t o = 0; o < NB; o++) reduce_row(row(x, c, o), &acc);
            for (size_t o = 0; o < NB; o++) {
                size_t q = o + ZIPD, cc = c + 1;
                if (q >= NB) q -= NB, cc++;
                const uint16_t *pf = (m == ZIP && cc < c1) ? row(x, cc, q) : 0;
                if (c + 1 < c1)
                    zip_row(row(x, c + 1, o), row(x, c, o), row(y, c, o), pf, &acc);
                else
                    write_row(row(x, c, o), row(y, c, o), 0, 1);
            }
        } else if (m == WRITE) {
            for (size_t o = 0; o < NB; o++) write_row(row(x, c0, o % 4), row(y, c, o), 0, 1);
        } else if (m == INFER_PF) {
            for (size_t o = 0; o < NB; o++) {
                size_t q = o + 1, cc = c;
                if (q >= NB) q -= NB, cc++;
                write_row(row(x, c, o), row(y, c, o), cc < c1 ? row(x, cc, q) : 0, 1);
            }
        } else if (m == READ) {
            for (size_t o = 0; o < NB; o++) reduce_row(row(x, c, o), &acc);
        } else if (m == READ_PF1 || m == READ_PF2 || m == READ_PF4) {
            size_t d = m == READ_PF1 ? 1 : m == READ_PF2 ? 2 : 4;
            for (size_t o = 0; o < NB; o++) {
                size_t q = o + d, cc = c;
                if (q >= NB) q -= NB, cc++;
                reduce_row_pf(row(x, c, o), &acc, cc < c1 ? row(x, cc, q) : 0);
            }
        } else if (m == SERIAL) {
            for (size_t o = 0; o < NB; o++) reduce_row(row(x, c, o), &acc);
            for (size_t o = 0; o < NB; o++) write_row(row(x, c, o), row(y, c, o), 0, 1);
        } else {
            size_t T = m == PIPE8 ? 8 : 2;
            int nt = m != PIPE_ORD, pf = m != PIPE_NOPF;
            if (c == c0)
                for (size_t o = 0; o < NB; o++) reduce_row(row(x, c, o), &acc);
            // reduce c + 1 tile by tile, writing c's rows behind it
            for (size_t o = 0; o < NB; o += T) {
                size_t e = o + T < NB ? o + T : NB;
                if (c + 1 < c1)
                    for (size_t r = o; r < e; r++) reduce_row(row(x, c + 1, r), &acc);
                for (size_t r = o; r < e; r++) {
                    size_t d = m == PIPE_FAR ? 3 * T : T, q = r + d, cc = c + 1;
                    if (q >= NB) q -= NB, cc++;
                    const uint16_t *ahead = (pf && cc < c1) ? row(x, cc, q) : 0;
                    write_row(row(x, c, r), row(y, c, r), ahead, nt);
                }
            }
        }
    }
    float f[16];
    _mm512_storeu_ps(f, _mm512_add_ps(acc.s, acc.q));
    sink += f[0];
    return 0;
}
static double run(int mode) {
    pthread_t th[2];
    arg_t a[2];
    double t0 = now();
    for (int t = 0; t < 2; t++) {
        a[t].t = t;
        a[t].mode = mode;
        pthread_create(&th[t], 0, work, &a[t]);
    }
    for (int t = 0; t < 2; t++) pthread_join(th[t], 0);
    return now() - t0;
}
static int cmp(const void *a, const void *b) {
    double p = *(const double *)a, q = *(const double *)b;
    return p < q ? -1 : p > q;
}
int main(int argc, char **argv) {
    NB = argc > 1 ? atol(argv[1]) : 64;
    C = argc > 2 ? atol(argv[2]) : 256;
    HW = argc > 3 ? atol(argv[3]) : 3136;
    int R = argc > 4 ? atoi(argv[4]) : 9;
    if (R < 1 || R > 64) {
        fprintf(stderr, "resident_pipe: ROUNDS must be 1 to 64\n");
        return 2;
    }
    if (getenv("ZIPD")) ZIPD = atol(getenv("ZIPD"));
    size_t n = NB * C * HW;
    x = aligned_alloc(4096, n * 2 + 4096);
    y = aligned_alloc(4096, n * 2 + 4096);
    for (size_t i = 0; i < n; i++) x[i] = 0x3f80 + (i & 63);
    memset(y, 0, n * 2);
    for (int t = 0; t < 2; t++) l1buf[t] = aligned_alloc(4096, HW * 2 + 4096), memset(l1buf[t], 0, HW * 2);
    double t[MODES][64];
    for (int m = 0; m < MODES; m++) run(m);
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MODES; m++) t[m][r] = run(m);
    for (int m = 0; m < MODES; m++) qsort(t[m], R, sizeof(double), cmp);
    double base = t[MEMCPY][R / 2];
    printf("%zux%zux%zu 16-bit, %.1f MB a tensor, medians of %d rounds\n", NB, C, HW, n * 2 / 1e6, R);
    for (int m = 0; m < MODES; m++)
        printf("%-16s %8.3f ms  %.2f of memcpy\n", names[m], t[m][R / 2] * 1e3, t[m][R / 2] / base);
    return 0;
}
