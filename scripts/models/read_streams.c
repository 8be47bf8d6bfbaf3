// A C model of how fast two threads read 103 MB from DRAM (64x56x56x256 bf16), against
// a memcpy of it and a copy with ordinary or non-temporal AVX2 stores: each thread's
// half read as one sequential stream, as two or four in lockstep, with a prefetch 1, 4
// or 16 KiB ahead, or one byte a line. Interleaved rounds, medians, time ÷ the first
// row (memcpy). Behind the two-stream output pass (CHANGELOG, 2026-11-29).
//
//   gcc -O2 -mavx2 -pthread -o /tmp/read_streams scripts/models/read_streams.c
//   /tmp/read_streams 102760448
//
// On the Intel Xeon of 2026-11-29: read1 0.653, read2 0.499, read4 0.427 of a memcpy;
// a prefetch 16 KiB ahead 0.406; non-temporal copy 0.688.
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
static size_t N; static char *src,*dst; static volatile long sink;
typedef struct {int mode; int t; int pfd;} arg_t;
static double now(){struct timespec ts;clock_gettime(CLOCK_MONOTONIC,&ts);return ts.tv_sec+ts.tv_nsec*1e-9;}
static void *work(void*p){arg_t*a=p; size_t half=N/2; char*s=src+a->t*half; char*d=dst+a->t*half;
 __m256i acc=_mm256_setzero_si256(), acc2=acc, acc3=acc, acc4=acc;
 if(a->mode==0){ for(size_t i=0;i<half;i+=64){__m256i x=_mm256_load_si256((void*)(s+i)),y=_mm256_load_si256((void*)(s+i+32));_mm256_store_si256((void*)(d+i),x);_mm256_store_si256((void*)(d+i+32),y);} }
 else if(a->mode==1){ for(size_t i=0;i<half;i+=64){acc=_mm256_add_epi32(acc,_mm256_load_si256((void*)(s+i)));acc2=_mm256_add_epi32(acc2,_mm256_load_si256((void*)(s+i+32)));} }
 else if(a->mode==2){ size_t q=half/2; for(size_t i=0;i<q;i+=64){acc=_mm256_add_epi32(acc,_mm256_load_si256((void*)(s+i)));acc2=_mm256_add_epi32(acc2,_mm256_load_si256((void*)(s+i+32)));acc3=_mm256_add_epi32(acc3,_mm256_load_si256((void*)(s+q+i)));acc4=_mm256_add_epi32(acc4,_mm256_load_si256((void*)(s+q+i+32)));} }
 else if(a->mode==4){ size_t q=half/4; for(size_t i=0;i<q;i+=64){for(int k=0;k<4;k++){acc=_mm256_add_epi32(acc,_mm256_load_si256((void*)(s+k*q+i)));acc2=_mm256_add_epi32(acc2,_mm256_load_si256((void*)(s+k*q+i+32)));}} }
 else if(a->mode==5){ int pf=a->pfd; for(size_t i=0;i<half;i+=64){_mm_prefetch(s+i+pf,_MM_HINT_T0);acc=_mm256_add_epi32(acc,_mm256_load_si256((void*)(s+i)));acc2=_mm256_add_epi32(acc2,_mm256_load_si256((void*)(s+i+32)));} }
 else if(a->mode==6){ /* touch one byte per line */ long t=0; for(size_t i=0;i<half;i+=64) t+=s[i]; sink+=t; }
 else if(a->mode==8){ memcpy(d,s,half); }
 else if(a->mode==7){ /* NT-store copy */ for(size_t i=0;i<half;i+=64){__m256i x=_mm256_load_si256((void*)(s+i)),y=_mm256_load_si256((void*)(s+i+32));_mm256_stream_si256((void*)(d+i),x);_mm256_stream_si256((void*)(d+i+32),y);} _mm_sfence(); }
 acc=_mm256_add_epi32(_mm256_add_epi32(acc,acc2),_mm256_add_epi32(acc3,acc4)); sink+=_mm256_extract_epi32(acc,0); return 0;}
static double run(int mode,int pfd){pthread_t th[2];arg_t a[2];double t0=now();for(int t=0;t<2;t++){a[t].mode=mode;a[t].t=t;a[t].pfd=pfd;pthread_create(&th[t],0,work,&a[t]);}for(int t=0;t<2;t++)pthread_join(th[t],0);return now()-t0;}
int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){N=(size_t)atol(argv[1]); N&=~(size_t)4095; src=aligned_alloc(4096,N);dst=aligned_alloc(4096,N);memset(src,1,N);memset(dst,2,N);
 int modes[]={8,0,1,2,4,5,5,5,6,7}; int pfds[]={0,0,0,0,0,1024,4096,16384,0,0}; const char*names[]={"memcpy","copy","read1","read2","read4","read+pf1K","read+pf4K","read+pf16K","touch","copyNT"};
 int M=10,R=15; double t[10][15];
 for(int r=0;r<R;r++)for(int m=0;m<M;m++)t[m][r]=run(modes[m],pfds[m]);
 double base; for(int m=0;m<M;m++){qsort(t[m],R,sizeof(double),cmp);} base=t[0][R/2];
 for(int m=0;m<M;m++)printf("%-12s %8.3f ms  %.3f of copy  %.1f GB/s read\n",names[m],t[m][R/2]*1e3,t[m][R/2]/base,N/t[m][R/2]/1e9);}
