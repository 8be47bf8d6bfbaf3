// A C model of a streamed channels-last output pass (NHWC bf16, C = 256, AVX2: widen,
// one FMA a vector, narrow with round-to-nearest-even and quiet NaNs, non-temporal or
// ordinary stores) on 64x56x56x256 elements split between two threads in tasks of 2^18
// elements, walked as one sequential stream a thread or as a task's two halves in
// lockstep (`kernels::apply::periodic_two`), with and without a prefetch 8 KiB ahead;
// and, for scale, a memcpy of the same bytes. Interleaved rounds, medians, each time ÷
// the memcpy's. The model behind the two-stream output pass (CHANGELOG).
//
//   gcc -O2 -mavx2 -mfma -pthread -o /tmp/two_streams scripts/models/two_streams.c
//   /tmp/two_streams
//
// On the Intel Xeon of 2026-11-29 (two runs, time ÷ memcpy): one stream, non-temporal
// 1.33 / 1.30, with the prefetch 1.16 / 1.13; two streams 1.07 / 1.07, with the
// prefetch 1.05 / 1.03; ordinary stores 1.36 / 1.33 and, two streams, 1.08 / 1.08.
//
// `/tmp/two_streams SKEW` (2026-12-01) adds the library's walk order (each step loads
// both walks, then stores both: "2str loads-first pf8K"), its second walk starting at
// pixel (1024 − SKEW)/2 + SKEW of the task's 1,024: 512 + SKEW/2, of 512 bytes each, so
// a page multiple past the first for SKEW 0 or 16. On an AMD EPYC Zen 3 (AVX2), one run
// each, time ÷ memcpy, SKEW 0 / 2 / 4 / 8 / 16 (512 + 0, 1, 2, 4, 8 pixels): 1.22 /
// 0.63 / 0.62 / 0.63 / 1.19, with one stream ("NT pf8K") 0.62-0.67 and the old order
// ("2str NT pf8K") 1.48-1.64 in the same runs.
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#define C 256
static size_t N; static uint16_t *src,*dst; static volatile float sink;
typedef struct {int mode; int t; int pfd;} arg_t;
static double now(){struct timespec ts;clock_gettime(CLOCK_MONOTONIC,&ts);return ts.tv_sec+ts.tv_nsec*1e-9;}
static inline __m256i nar(__m256 v){__m256i i=_mm256_castps_si256(v); __m256i lsb=_mm256_and_si256(_mm256_srli_epi32(i,16),_mm256_set1_epi32(1));
  i=_mm256_add_epi32(i,_mm256_add_epi32(lsb,_mm256_set1_epi32(0x7fff))); __m256 un=_mm256_cmp_ps(v,v,_CMP_UNORD_Q);
  i=_mm256_blendv_epi8(i,_mm256_or_si256(_mm256_castps_si256(v),_mm256_set1_epi32(0x400000)),_mm256_castps_si256(un)); return _mm256_srli_epi32(i,16);}
static inline void one(const uint16_t*p,uint16_t*o,const __m256*k,const __m256*b,int g,int nt){
  __m256i x=_mm256_load_si256((const void*)(p+g*16)); __m256i z=_mm256_setzero_si256();
  __m256 lo=_mm256_castsi256_ps(_mm256_unpacklo_epi16(z,x)),hi=_mm256_castsi256_ps(_mm256_unpackhi_epi16(z,x));
  lo=_mm256_fmadd_ps(lo,k[2*g],b[2*g]); hi=_mm256_fmadd_ps(hi,k[2*g+1],b[2*g+1]);
  __m256i r=_mm256_packus_epi32(nar(lo),nar(hi));
  if(nt)_mm256_stream_si256((void*)(o+g*16),r); else _mm256_store_si256((void*)(o+g*16),r);}
__attribute__((noinline)) static void app(const uint16_t*x,uint16_t*y,size_t px,const __m256*k,const __m256*b,int pfd,int nt){
  for(size_t q=0;q<px;q++){const uint16_t*p=x+q*C; uint16_t*o=y+q*C;
   for(int g=0;g<C/16;g++){ if(pfd>0&&(g&1)==0)_mm_prefetch((const char*)(p+g*16)+pfd,_MM_HINT_T0); one(p,o,k,b,g,nt);}}}
__attribute__((noinline)) static void app2(const uint16_t*x,uint16_t*y,size_t px,const __m256*k,const __m256*b,int pfd,int nt){
  size_t h=px/2; const uint16_t*x2=x+h*C; uint16_t*y2=y+h*C;
  for(size_t q=0;q<h;q++){const uint16_t*p=x+q*C; uint16_t*o=y+q*C; const uint16_t*p2=x2+q*C; uint16_t*o2=y2+q*C;
   for(int g=0;g<C/16;g++){ if(pfd>0&&(g&1)==0){_mm_prefetch((const char*)(p+g*16)+pfd,_MM_HINT_T0);_mm_prefetch((const char*)(p2+g*16)+pfd,_MM_HINT_T0);} one(p,o,k,b,g,nt); one(p2,o2,k,b,g,nt);}}}
static inline __m256i comp(__m256i x,const __m256*k,const __m256*b,int g){ __m256i z=_mm256_setzero_si256();
  __m256 lo=_mm256_castsi256_ps(_mm256_unpacklo_epi16(z,x)),hi=_mm256_castsi256_ps(_mm256_unpackhi_epi16(z,x));
  lo=_mm256_fmadd_ps(lo,k[2*g],b[2*g]); hi=_mm256_fmadd_ps(hi,k[2*g+1],b[2*g+1]);
  return _mm256_packus_epi32(nar(lo),nar(hi));}

/* Both walks loaded, then both stored (the library's order); the second walk starts
   `skew` pixels past half the task, the pixels between and after them walked alone. */
static int skew;
__attribute__((noinline)) static void app2l(const uint16_t*x,uint16_t*y,size_t px,const __m256*k,const __m256*b,int pfd){
  size_t h=(px-skew)/2; const uint16_t*x2=x+(h+skew)*C; uint16_t*y2=y+(h+skew)*C;
  for(size_t q=0;q<h;q++){const uint16_t*p=x+q*C; uint16_t*o=y+q*C; const uint16_t*p2=x2+q*C; uint16_t*o2=y2+q*C;
   for(int g=0;g<C/16;g++){ if(pfd>0&&(g&1)==0){_mm_prefetch((const char*)(p+g*16)+pfd,_MM_HINT_T0);_mm_prefetch((const char*)(p2+g*16)+pfd,_MM_HINT_T0);}
     __m256i a=_mm256_load_si256((const void*)(p+g*16)), c=_mm256_load_si256((const void*)(p2+g*16));
     __m256i ra=comp(a,k,b,g), rc=comp(c,k,b,g);
     _mm256_stream_si256((void*)(o+g*16),ra); _mm256_stream_si256((void*)(o2+g*16),rc);}}
  app(x+h*C,y+h*C,skew,k,b,pfd,1); app(x+(2*h+skew)*C,y+(2*h+skew)*C,px-2*h-skew,k,b,pfd,1);}
static void *work(void*p){arg_t*a=p; size_t half=N/2; const uint16_t*s=src+a->t*half; uint16_t*d=dst+a->t*half;
 if(a->mode==8){memcpy(d,s,half*2);return 0;}
 __m256 k[C/8],b[C/8]; for(int g=0;g<C/8;g++){k[g]=_mm256_set1_ps(1.5f);b[g]=_mm256_set1_ps(0.25f);}
 size_t task=(1<<18)/C; /* pixels per task */
 for(size_t off=0;off+task*C<=half;off+=task*C){ if(a->mode==20) app2l(s+off,d+off,task,k,b,a->pfd); else if(a->mode<10) app(s+off,d+off,task,k,b,a->pfd,a->mode&1); else app2(s+off,d+off,task,k,b,a->pfd,a->mode&1);}
 return 0;}
static double run(int mode,int pfd){pthread_t th[2];arg_t a[2];double t0=now();for(int t=0;t<2;t++){a[t].mode=mode;a[t].t=t;a[t].pfd=pfd;pthread_create(&th[t],0,work,&a[t]);}for(int t=0;t<2;t++)pthread_join(th[t],0);return now()-t0;}
int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){ if(argc>1) skew=atoi(argv[1]);N=64*56*56*256; src=aligned_alloc(4096,N*2);dst=aligned_alloc(4096,N*2);memset(src,1,N*2);memset(dst,2,N*2);
 int modes[]={8,1,1,1,0,11,11,10,20}; int pfds[]={0,0,8192,16384,0,0,8192,0,8192}; const char*names[]={"memcpy","NT","NT pf8K","NT pf16K","plain","2str NT","2str NT pf8K","2str plain","2str loads-first pf8K"};
 enum{M=9,R=9}; double t[M][R];
 for(int r=0;r<R;r++)for(int m=0;m<M;m++)t[m][r]=run(modes[m],pfds[m]);
 double base; for(int m=0;m<M;m++){qsort(t[m],R,sizeof(double),cmp);} base=t[0][R/2];
 for(int m=0;m<M;m++)printf("%-14s %8.3f ms  %.3f of memcpy\n",names[m],t[m][R/2]*1e3,t[m][R/2]/base);}
