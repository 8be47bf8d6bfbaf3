// A C model of the channels-last statistics pass (NHWC 64x56x56x256 bf16, AVX2: four
// pixels at a time, 32 channel groups, per-group sums in memory, a prefetch a line a
// group ahead) on two threads in tasks of 2^18 elements, as one stream a thread with
// prefetcht1/t0/t2/nta hints 8 to 32 KiB ahead, or as two tasks in lockstep (separate
// accumulators: each task's sums in their own order). Interleaved rounds, medians,
// time ÷ a memcpy of the same bytes. Not built into the library (CHANGELOG,
// 2026-11-29).
//
//   gcc -O2 -mavx2 -mfma -pthread -o /tmp/stats_streams scripts/models/stats_streams.c
//   /tmp/stats_streams
//
// On the Intel Xeon of 2026-11-29, two runs: one stream 0.58-0.65 of a memcpy whatever
// the hint and distance (nta 1.60-1.65), two streams 0.53-0.56.
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#define C 256
#define G (C/8)
static size_t N; static uint16_t *src; static char* dst; static volatile float sink;
typedef struct {int mode; int t; int pfd; int streams;} arg_t;
static double now(){struct timespec ts;clock_gettime(CLOCK_MONOTONIC,&ts);return ts.tv_sec+ts.tv_nsec*1e-9;}
static inline __m256 wid(const uint16_t*p){return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void*)p)),16));}
__attribute__((noinline)) static void quadrun(const uint16_t*x,size_t quads,__m256*a,__m256*b,const __m256*piv,int pfd,int t1){
  for(size_t q=0;q<quads;q++){const uint16_t*p=x+q*4*C; const char*pf=(const char*)p+pfd;
   for(int g=0;g<G;g++){__m256 x0=wid(p+g*8),x1=wid(p+C+g*8),x2=wid(p+2*C+g*8),x3=wid(p+3*C+g*8);
     if(t1==1)_mm_prefetch(pf+g*64,_MM_HINT_T1); else if(t1==0) _mm_prefetch(pf+g*64,_MM_HINT_T0); else if(t1==2) _mm_prefetch(pf+g*64,_MM_HINT_T2); else if(t1==3) _mm_prefetch(pf+g*64,_MM_HINT_NTA);
     __m256 pv=piv[g]; __m256 d0=_mm256_sub_ps(x0,pv),d1=_mm256_sub_ps(x1,pv),d2=_mm256_sub_ps(x2,pv),d3=_mm256_sub_ps(x3,pv);
     __m256 sq=_mm256_fmadd_ps(d1,d1,_mm256_mul_ps(d0,d0)); sq=_mm256_fmadd_ps(d3,d3,_mm256_fmadd_ps(d2,d2,sq));
     a[g]=_mm256_add_ps(a[g],_mm256_add_ps(_mm256_add_ps(d0,d1),_mm256_add_ps(d2,d3))); b[g]=_mm256_add_ps(b[g],sq);}}
}
/* two streams in lockstep: quads of range A and range B alternately, separate accumulators */
__attribute__((noinline)) static void quadrun2(const uint16_t*x,const uint16_t*y,size_t quads,__m256*a,__m256*b,__m256*a2,__m256*b2,const __m256*piv,int pfd){
  for(size_t q=0;q<quads;q++){
   for(int s=0;s<2;s++){const uint16_t*p=(s?y:x)+q*4*C; const char*pf=(const char*)p+pfd; __m256*A=s?a2:a,*B=s?b2:b;
   for(int g=0;g<G;g++){__m256 x0=wid(p+g*8),x1=wid(p+C+g*8),x2=wid(p+2*C+g*8),x3=wid(p+3*C+g*8);
     _mm_prefetch(pf+g*64,_MM_HINT_T1);
     __m256 pv=piv[g]; __m256 d0=_mm256_sub_ps(x0,pv),d1=_mm256_sub_ps(x1,pv),d2=_mm256_sub_ps(x2,pv),d3=_mm256_sub_ps(x3,pv);
     __m256 sq=_mm256_fmadd_ps(d1,d1,_mm256_mul_ps(d0,d0)); sq=_mm256_fmadd_ps(d3,d3,_mm256_fmadd_ps(d2,d2,sq));
     A[g]=_mm256_add_ps(A[g],_mm256_add_ps(_mm256_add_ps(d0,d1),_mm256_add_ps(d2,d3))); B[g]=_mm256_add_ps(B[g],sq);}}}
}

__attribute__((noinline)) static void quadA(const uint16_t*x,size_t quads,__m256*a,__m256*b,const __m256*piv,int pfd){
  __m256 r0=_mm256_setzero_ps(),r1=r0;
  for(size_t q=0;q<quads;q++){const uint16_t*p=x+q*4*C; const char*pf=(const char*)p+pfd;
   for(int g=0;g<G;g++){__m256 x0=wid(p+g*8),x1=wid(p+C+g*8),x2=wid(p+2*C+g*8),x3=wid(p+3*C+g*8);
     _mm_prefetch(pf+g*64,_MM_HINT_T1);
     r0=_mm256_add_ps(r0,_mm256_add_ps(x0,x1)); r1=_mm256_add_ps(r1,_mm256_add_ps(x2,x3));}}
  a[0]=r0;b[0]=r1;
}
__attribute__((noinline)) static void quadB(const uint16_t*x,size_t quads,__m256*a,__m256*b,const __m256*piv,int pfd){
  __m256 r0=_mm256_setzero_ps(),r1=r0,r2=r0,r3=r0;
  for(size_t q=0;q<quads;q++){const uint16_t*p=x+q*4*C; const char*pf=(const char*)p+pfd;
   for(int g=0;g<G;g+=2){
    for(int h=0;h<2;h++){int gg=g+h; __m256 x0=wid(p+gg*8),x1=wid(p+C+gg*8),x2=wid(p+2*C+gg*8),x3=wid(p+3*C+gg*8);
     _mm_prefetch(pf+gg*64,_MM_HINT_T1);
     __m256 pv=piv[gg]; __m256 d0=_mm256_sub_ps(x0,pv),d1=_mm256_sub_ps(x1,pv),d2=_mm256_sub_ps(x2,pv),d3=_mm256_sub_ps(x3,pv);
     __m256 sq=_mm256_fmadd_ps(d1,d1,_mm256_mul_ps(d0,d0)); sq=_mm256_fmadd_ps(d3,d3,_mm256_fmadd_ps(d2,d2,sq));
     if(h){r0=_mm256_add_ps(r0,_mm256_add_ps(_mm256_add_ps(d0,d1),_mm256_add_ps(d2,d3))); r1=_mm256_add_ps(r1,sq);}
     else {r2=_mm256_add_ps(r2,_mm256_add_ps(_mm256_add_ps(d0,d1),_mm256_add_ps(d2,d3))); r3=_mm256_add_ps(r3,sq);}}}}
  a[0]=_mm256_add_ps(r0,r2);b[0]=_mm256_add_ps(r1,r3);
}

__attribute__((noinline)) static void quadL(const uint16_t*x,size_t quads,__m256*a,__m256*b,const __m256*piv,int pfd,int mode){
  __m256 r0=_mm256_setzero_ps(),r1=r0;
  for(size_t q=0;q<quads;q++){const uint16_t*p=x+q*4*C; const char*pf=(const char*)p+pfd;
   for(int g=0;g<G;g++){__m256 x0,x1,x2,x3;
     if(mode&1){x0=wid(p+g*32),x1=wid(p+g*32+8),x2=wid(p+g*32+16),x3=wid(p+g*32+24);} else {x0=wid(p+g*8),x1=wid(p+C+g*8),x2=wid(p+2*C+g*8),x3=wid(p+3*C+g*8);}
     if(mode&2)_mm_prefetch(pf+g*64,_MM_HINT_T0); else if(mode&4) _mm_prefetch(pf+g*64,_MM_HINT_T2); else if(mode&8){} else _mm_prefetch(pf+g*64,_MM_HINT_T1);
     r0=_mm256_add_ps(r0,_mm256_add_ps(x0,x1)); r1=_mm256_add_ps(r1,_mm256_add_ps(x2,x3));}}
  a[0]=r0;b[0]=r1;
}
static void *work(void*p){arg_t*a=p; size_t half=N/2; /* elements */ const uint16_t*s=src+a->t*half;
 if(a->mode==8){memcpy(dst+a->t*half*2,(char*)s,half*2);return 0;}
 __m256 A[4][G] __attribute__((aligned(32))),B[4][G] __attribute__((aligned(32))),piv[G];
 for(int g=0;g<G;g++){piv[g]=_mm256_set1_ps(1.f);for(int k=0;k<4;k++){A[k][g]=B[k][g]=_mm256_setzero_ps();}}
 size_t task=(1<<18)/C*C; /* elements per task ~ 2^18 */ size_t quadsPerTask=task/(4*C);
 if(a->mode>=40){ for(size_t off=0;off+task<=half;off+=task) quadrun(s+off,quadsPerTask,A[0],B[0],piv,a->pfd,a->mode-40); }
 else if(a->mode==1){ for(size_t off=0;off+task<=half;off+=task) quadrun(s+off,quadsPerTask,A[0],B[0],piv,a->pfd,1); }
 else if(a->mode==2){ for(size_t off=0;off+task<=half;off+=task) quadrun(s+off,quadsPerTask,A[0],B[0],piv,a->pfd,0); }
 else if(a->mode==4){ for(size_t off=0;off+task<=half;off+=task) quadA(s+off,quadsPerTask,A[0],B[0],piv,a->pfd); }
 else if(a->mode==5){ for(size_t off=0;off+task<=half;off+=task) quadB(s+off,quadsPerTask,A[0],B[0],piv,a->pfd); }
 else if(a->mode>=16){ for(size_t off=0;off+task<=half;off+=task) quadL(s+off,quadsPerTask,A[0],B[0],piv,a->pfd,a->mode-16); }
 else if(a->mode==3){ for(size_t off=0;off+2*task<=half;off+=2*task) quadrun2(s+off,s+off+task,quadsPerTask,A[0],B[0],A[1],B[1],piv,a->pfd); }
 float t=0; for(int g=0;g<G;g++)for(int k=0;k<2;k++){t+=A[k][g][0]+B[k][g][0];} sink+=t; return 0;}
static double run(int mode,int pfd){pthread_t th[2];arg_t a[2];double t0=now();for(int t=0;t<2;t++){a[t].mode=mode;a[t].t=t;a[t].pfd=pfd;pthread_create(&th[t],0,work,&a[t]);}for(int t=0;t<2;t++)pthread_join(th[t],0);return now()-t0;}
int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){N=64*56*56*256; src=aligned_alloc(4096,N*2);dst=aligned_alloc(4096,N*2);memset(src,1,N*2);memset(dst,2,N*2);
 int modes[]={8,41,41,41,40,40,42,42,43,3,3}; int pfds[]={0,8192,16384,32768,8192,16384,8192,16384,16384,8192,16384}; const char*names[]={"memcpy","F t1 8K","F t1 16K","F t1 32K","F t0 8K","F t0 16K","F t2 8K","F t2 16K","F nta 16K","2str t1 8K","2str t1 16K"};
 enum{M=11,R=9}; double t[M][R];
 for(int r=0;r<R;r++)for(int m=0;m<M;m++)t[m][r]=run(modes[m],pfds[m]);
 double base; for(int m=0;m<M;m++){qsort(t[m],R,sizeof(double),cmp);} base=t[0][R/2];
 for(int m=0;m<M;m++)printf("%-14s %8.3f ms  %.3f of memcpy\n",names[m],t[m][R/2]*1e3,t[m][R/2]/base);}
