// Does the cache keep what a read pass read, for a second pass over the same data?
// Two threads each read their half of BYTES in blocks of BLOCK bytes: every block read
// once; read twice in a row (the second read front to back); or twice with the second
// back to front. Interleaved rounds, medians, each as a multiple of the single read.
// The cost of a channel-major resident pass's second read of a channel share (BLOCK:
// the share a thread keeps, e.g. 3,211,264 for half of an f32 dy and x channel of
// 64x64x112x112). On the Zen 4 of 2026-12-04 (1 MiB L2, 32 MiB L3, 411 MB): 256 KB
// blocks 1.09 / 1.10 of one read, 768 KB 1.16 / 1.15, 1.5 MB 1.19 / 1.17, 3.1 MB
// 1.26 / 1.20, 6.1 MB 1.39 / 1.38.
//
//   gcc -O2 -mavx2 -pthread -o /tmp/reread scripts/models/reread.c
//   /tmp/reread 411041792 3211264
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static size_t N, B; static char *src; static volatile long sink;
static double now(){struct timespec ts;clock_gettime(CLOCK_MONOTONIC,&ts);return ts.tv_sec+ts.tv_nsec*1e-9;}
typedef struct {int t; int mode;} arg_t;
static inline __m256i rd(char*s,size_t a,size_t b,__m256i acc){for(size_t i=a;i<b;i+=64){acc=_mm256_add_epi32(acc,_mm256_add_epi32(_mm256_load_si256((void*)(s+i)),_mm256_load_si256((void*)(s+i+32))));}return acc;}
static inline __m256i rdb(char*s,size_t a,size_t b,__m256i acc){for(size_t i=b;i>a;i-=64){acc=_mm256_add_epi32(acc,_mm256_add_epi32(_mm256_load_si256((void*)(s+i-64)),_mm256_load_si256((void*)(s+i-32))));}return acc;}
static void *work(void*p){arg_t*a=p; size_t half=N/2; char*s=src+a->t*half; __m256i acc=_mm256_setzero_si256();
 for(size_t o=0;o+B<=half;o+=B){acc=rd(s,o,o+B,acc); if(a->mode==1)acc=rd(s,o,o+B,acc); if(a->mode==2)acc=rdb(s,o,o+B,acc);}
 sink+=_mm256_extract_epi32(acc,0); return 0;}
static double run(int mode){pthread_t th[2];arg_t a[2];double t0=now();for(int t=0;t<2;t++){a[t].t=t;a[t].mode=mode;pthread_create(&th[t],0,work,&a[t]);}for(int t=0;t<2;t++)pthread_join(th[t],0);return now()-t0;}
int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){N=(size_t)atol(argv[1]); B=(size_t)atol(argv[2]); src=aligned_alloc(4096,N);memset(src,1,N);
 int R=11; double t[3][11];
 for(int r=0;r<R;r++)for(int m=0;m<3;m++)t[m][r]=run(m);
 for(int m=0;m<3;m++)qsort(t[m],R,8,cmp);
 printf("block %zu KB: once %.2f ms (%.1f GB/s), twice fwd %.3f, twice bwd %.3f of once\n",B>>10,t[0][R/2]*1e3,N/t[0][R/2]/1e9,t[1][R/2]/t[0][R/2],t[2][R/2]/t[0][R/2]);}
