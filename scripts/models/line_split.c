// A C model of the second-order output pass on small tensors, to measure what a
// 64-byte AVX-512 access 16 bytes off a cache line costs (CHANGELOG, `fusedbn bench
// --offset`): three 16 KiB f32 inputs, two 16 KiB outputs, all in L2; the pass, a
// memcpy-based copy of the same bytes and a six-sum reduction of the inputs, medians of
// 5001 runs. The arguments: bytes past a 64-byte boundary of the inputs (the i-th input
// is off by i times it) and of the outputs (likewise).
//
//   gcc -O2 -mavx512f -o /tmp/line_split scripts/models/line_split.c
//   for a in "0 0" "16 16" "0 16" "16 0"; do /tmp/line_split $a; done
//
// On the Intel Xeon of 2026-11-29 (README): apply 824-834 ns with everything on a line,
// 2222-2311 ns with the outputs 16 bytes off, 1087-1093 ns with the inputs off alone.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
#define N 4096
__attribute__((noinline)) void apply(const float*g,const float*x,const float*a,float*dg,float*dx,int n){
  __m512 m=_mm512_set1_ps(0.1f),am=_mm512_set1_ps(0.2f),gm=_mm512_set1_ps(0.3f),c1=_mm512_set1_ps(1.1f),c2=_mm512_set1_ps(0.9f),b=_mm512_set1_ps(0.01f),e2=_mm512_set1_ps(0.5f),e3=_mm512_set1_ps(0.7f);
  for(int i=0;i<n;i+=16){
    __m512 G=_mm512_loadu_ps(g+i),X=_mm512_loadu_ps(x+i),A=_mm512_loadu_ps(a+i);
    __m512 xc=_mm512_sub_ps(X,m),ac=_mm512_sub_ps(A,am),gc=_mm512_sub_ps(G,gm);
    __m512 vg=_mm512_add_ps(_mm512_fmadd_ps(ac,c1,_mm512_mul_ps(xc,c2)),b);
    __m512 vx=_mm512_fmadd_ps(gc,c2,_mm512_fmadd_ps(ac,e2,_mm512_mul_ps(xc,e3)));
    _mm512_storeu_ps(dg+i,vg);_mm512_storeu_ps(dx+i,vx);
  }
}
__attribute__((noinline)) float reduce(const float*g,const float*x,const float*a,int n){
  __m512 s[6];for(int k=0;k<6;k++)s[k]=_mm512_setzero_ps();
  for(int i=0;i<n;i+=16){
    __m512 G=_mm512_loadu_ps(g+i),X=_mm512_loadu_ps(x+i),A=_mm512_loadu_ps(a+i);
    s[0]=_mm512_add_ps(s[0],G);s[1]=_mm512_add_ps(s[1],A);s[2]=_mm512_fmadd_ps(G,X,s[2]);s[3]=_mm512_fmadd_ps(A,X,s[3]);s[4]=_mm512_fmadd_ps(A,G,s[4]);s[5]=_mm512_add_ps(s[5],X);}
  __m512 t=s[0];for(int k=1;k<6;k++)t=_mm512_add_ps(t,s[k]);return _mm512_reduce_add_ps(t);
}
static int cmp(const void*a,const void*b){double d=*(double*)a-*(double*)b;return d<0?-1:d>0;}
int main(int argc,char**argv){
  int offin=argc>1?atoi(argv[1]):0; int offout=argc>2?atoi(argv[2]):0;
  char*base=aligned_alloc(4096,8*(N*4+8192)+4096);
  float*buf[8];for(int i=0;i<8;i++){buf[i]=(float*)(base+i*(N*4+4096)+ 64*i + (i<3?offin*i:offout*(i-2)));}
  for(int i=0;i<8;i++)for(int j=0;j<N;j++)buf[i][j]=j*0.001f;
  double ta[5001],tc[5001],tr[5001];volatile float sink=0;
  for(int r=0;r<5001;r++){
    double t0=now();apply(buf[0],buf[1],buf[2],buf[3],buf[4],N);double t1=now();
    memcpy(buf[3],buf[0],N*4);memcpy(buf[4],buf[1],N*4);sink+=reduce(buf[2],buf[2],buf[2],N/3);double t2=now();
    sink+=reduce(buf[0],buf[1],buf[2],N);double t3=now();
    ta[r]=t1-t0;tc[r]=t2-t1;tr[r]=t3-t2;}
  qsort(ta,5001,8,cmp);qsort(tc,5001,8,cmp);qsort(tr,5001,8,cmp);
  printf("in %d out %d apply %.0f ns copy %.0f ns reduce %.0f ns\n",offin,offout,ta[2500],tc[2500],tr[2500]);
}
