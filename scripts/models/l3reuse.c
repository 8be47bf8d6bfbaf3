// Does a read pass over a tensor far larger than the L3 leave its last part there for a
// second pass that walks back from the end? Two threads read their halves of BYTES
// front to back, then again front to back or back to front; medians of interleaved
// rounds. On the Zen 4 of 2026-12-04 (32 MiB L3): 103 MB 3.78 ms front to back after
// front to back, 3.55 back to front (0.94); 206 MB 0.95. So a second channels-last pass
// in reverse order saves about 6 % of its reads there, not the 30 % an L3 of 32 MiB
// would hold of 103 MB.
//
//   gcc -O2 -mavx2 -pthread -o /tmp/l3reuse scripts/models/l3reuse.c
//   /tmp/l3reuse 102760448
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static size_t N; static char *src; static volatile long sink;
static double now(){struct timespec ts;clock_gettime(CLOCK_MONOTONIC,&ts);return ts.tv_sec+ts.tv_nsec*1e-9;}
typedef struct {int t; int dir;} arg_t;
static void *work(void*p){arg_t*a=p; size_t half=N/2; char*s=src+a->t*half; __m256i acc=_mm256_setzero_si256(),acc2=acc;
 if(a->dir>=0){for(size_t i=0;i<half;i+=64){acc=_mm256_add_epi32(acc,_mm256_load_si256((void*)(s+i)));acc2=_mm256_add_epi32(acc2,_mm256_load_si256((void*)(s+i+32)));}}
 else {for(size_t i=half;i>0;i-=64){acc=_mm256_add_epi32(acc,_mm256_load_si256((void*)(s+i-64)));acc2=_mm256_add_epi32(acc2,_mm256_load_si256((void*)(s+i-32)));}}
 acc=_mm256_add_epi32(acc,acc2); sink+=_mm256_extract_epi32(acc,0); return 0;}
static double run(int dir){pthread_t th[2];arg_t a[2];double t0=now();for(int t=0;t<2;t++){a[t].t=t;a[t].dir=dir;pthread_create(&th[t],0,work,&a[t]);}for(int t=0;t<2;t++)pthread_join(th[t],0);return now()-t0;}
int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){N=(size_t)atol(argv[1]); N&=~(size_t)4095; src=aligned_alloc(4096,N);memset(src,1,N);
 int R=15; double ff[15],fb[15],x1[15],x2[15];
 for(int r=0;r<R;r++){ run(1); ff[r]=run(1); run(1); fb[r]=run(-1); x1[r]=run(1); x2[r]=run(-1);}
 qsort(ff,R,8,cmp);qsort(fb,R,8,cmp);
 printf("forward after forward %.3f ms, backward after forward %.3f ms (%.3f)\n",ff[R/2]*1e3,fb[R/2]*1e3,fb[R/2]/ff[R/2]);}
