/* A stand-in for the CUDA runtime (libcudart), preloaded (LD_PRELOAD) into a
 * CPU-only machine's torch process so that torch's CUDA code paths run
 * without a GPU: device queries, streams, events, the caching allocator
 * (cudaMalloc gives host memory, never touched), pinned host memory, graph
 * capture. Kernels, copies and memsets do nothing, so tensors' values are
 * meaningless (copies to the host read zeros): what it can check is what
 * does not depend on them, i.e. which allocator serves what, pools, stats,
 * hooks, routing, graph pools, and that the GPU scripts run end to end.
 *
 * Used by tests/test_torch_oom.py, tests/test_torch_fake_gpu.py and
 * tools/gpu-dryrun.sh, with tests/csrc/fake_cuda.c as libcuda.so.1 (torch
 * and gpumempool's cuda/vmm/async backends use the driver API directly) and
 * tests/csrc/fake_cublas.c. One device, device 0, H100-like: CUDA 13's
 * struct cudaDeviceProp layout (1008 bytes) with compute capability 9.0.
 * Graph capture is shared with the fake libcuda (fake_cuda_set_stream_
 * capturing, fake_cuda_set_global_capture), so the driver calls gpumempool
 * makes during a capture are judged as a real driver would judge them. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;

/* The stream being captured into a graph (one at a time), and the capture's id and mode. */
static void *cap_stream;
static unsigned long long cap_id;
static int cap_mode;

/* Like the real runtime, initialise the driver first (when the fake
 * libcuda is on the library path). */
__attribute__((constructor)) static void init_driver(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    int (*cu_init)(unsigned) = h ? (int (*)(unsigned))dlsym(h, "cuInit") : NULL;
    if (cu_init) cu_init(0);
}

static __thread int cur;
cudaError_t cudaGetDevice(int *d) { *d = cur; return 0; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return 0; }
cudaError_t cudaSetDevice(int d) { if (d != 0) return 101; cur = d; return 0; }
cudaError_t cudaInitDevice(int d, unsigned a, unsigned b) { return 0; }
cudaError_t cudaDeviceGetStreamPriorityRange(int *lo, int *hi) { if (lo) *lo = 0; if (hi) *hi = -5; return 0; }
static uintptr_t next_handle = 0x1000;
cudaError_t cudaStreamCreateWithPriority(void **s, unsigned f, int p) { *s = (void *)(next_handle += 16); return 0; }
cudaError_t cudaStreamCreateWithFlags(void **s, unsigned f) { *s = (void *)(next_handle += 16); return 0; }
cudaError_t cudaStreamCreate(void **s) { *s = (void *)(next_handle += 16); return 0; }
cudaError_t cudaStreamDestroy(void *s) { return 0; }
cudaError_t cudaStreamSynchronize(void *s) { return 0; }
cudaError_t cudaStreamQuery(void *s) { return 0; }
cudaError_t cudaStreamWaitEvent(void *s, void *e, unsigned f) { return 0; }
cudaError_t cudaStreamIsCapturing(void *s, int *st) { *st = s && s == cap_stream; return 0; }
cudaError_t cudaStreamGetPriority(void *s, int *p) { *p = 0; return 0; }
cudaError_t cudaDeviceSynchronize(void) { return 0; }
cudaError_t cudaGetLastError(void) { return 0; }
cudaError_t cudaPeekAtLastError(void) { return 0; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return 0; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
cudaError_t cudaEventCreateWithFlags(void **e, unsigned f) { *e = (void *)(next_handle += 16); return 0; }
cudaError_t cudaEventCreate(void **e) { *e = (void *)(next_handle += 16); return 0; }
cudaError_t cudaEventDestroy(void *e) { return 0; }
cudaError_t cudaEventRecord(void *e, void *s) { return 0; }
cudaError_t cudaEventRecordWithFlags(void *e, void *s, unsigned f) { return 0; }
cudaError_t cudaEventQuery(void *e) { return 0; }
cudaError_t cudaEventSynchronize(void *e) { return 0; }
cudaError_t cudaMalloc(void **p, size_t n) { return posix_memalign(p, 512, n ? n : 1) ? 2 : 0; }
cudaError_t cudaFree(void *p) { free(p); return 0; }
cudaError_t cudaMemGetInfo(size_t *fr, size_t *tot) { *fr = (size_t)70 << 30; *tot = (size_t)80 << 30; return 0; }
cudaError_t cudaDeviceCanAccessPeer(int *c, int a, int b) { *c = 0; return 0; }
cudaError_t cudaDeviceGetAttribute(int *v, int attr, int d) {
  switch (attr) {  /* enum cudaDeviceAttr: an H100-like answer, 1 for the rest */
  case 1: *v = 1024; break;          /* MaxThreadsPerBlock */
  case 2: case 3: case 4: *v = 1024; break;
  case 5: *v = 2147483647; break;    /* MaxGridDimX */
  case 6: case 7: *v = 65535; break;
  case 8: *v = 49152; break;         /* MaxSharedMemoryPerBlock */
  case 10: *v = 32; break;           /* WarpSize */
  case 16: *v = 132; break;          /* MultiProcessorCount */
  case 39: *v = 2048; break;         /* MaxThreadsPerMultiProcessor */
  case 75: *v = 9; break; case 76: *v = 0; break;  /* compute capability */
  case 81: *v = 233472; break;       /* MaxSharedMemoryPerMultiprocessor */
  case 97: *v = 232448; break;       /* MaxSharedMemoryPerBlockOptin */
  default: *v = 1;
  }
  return 0;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(int *m) { return 0; }
/* CUDA 13's struct cudaDeviceProp (1008 bytes): an H100-like device. */
cudaError_t cudaGetDeviceProperties_v2(void *prop, int d) {
  char *p = prop;
  memset(p, 1, 1008); memset(p, 0, 256); strcpy(p, "Fake GPU");
  *(size_t *)(p + 288) = (size_t)80 << 30; *(int *)(p + 308) = 32; *(int *)(p + 320) = 1024;
  *(int *)(p + 360) = 9; *(int *)(p + 364) = 0; *(int *)(p + 384) = 132;
  return 0;
}
cudaError_t cudaGetDeviceProperties(void *prop, int d) { return cudaGetDeviceProperties_v2(prop, d); }
/* Kernels and copies do nothing: memory's values are not what this checks. */
cudaError_t cudaLaunchKernel(const void *f, ...) { return 0; }
cudaError_t cudaLaunchKernelExC(const void *c, const void *f, void **a) { return 0; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int k, void *st) { if (k == 2) memset(d, 0, n); return 0; }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, int k) { if (k == 2) memset(d, 0, n); return 0; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, void *st) { return 0; }
cudaError_t cudaMemset(void *d, int v, size_t n) { return 0; }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned f) { return posix_memalign(p, 4096, n ? n : 1) ? 2 : 0; }
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }
cudaError_t cudaFreeHost(void *p) { free(p); return 0; }
cudaError_t cudaHostRegister(void *p, size_t n, unsigned f) { return 0; }
cudaError_t cudaHostUnregister(void *p) { return 0; }
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned f) { *d = h; return 0; }
/* Graph capture: the capturing stream (one at a time) is also told to the
 * fake libcuda, so that the driver calls gpumempool makes meanwhile are
 * judged as a real driver would judge them. */
static void tell_fake(void *s, int on, int mode) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) return;
  void (*set_stream)(uintptr_t, int) = (void (*)(uintptr_t, int))dlsym(h, "fake_cuda_set_stream_capturing");
  void (*set_global)(int) = (void (*)(int))dlsym(h, "fake_cuda_set_global_capture");
  if (set_stream) set_stream((uintptr_t)s, on);
  if (set_global && mode == 0) set_global(on);
}
cudaError_t cudaStreamBeginCapture(void *s, int mode) { if (cap_stream) return 900; cap_stream = s; cap_id++; cap_mode = mode; tell_fake(s, 1, mode); return 0; }
cudaError_t cudaStreamEndCapture(void *s, void **g) { if (s != cap_stream) return 901; tell_fake(s, 0, cap_mode); cap_stream = 0; *g = (void *)(next_handle += 16); return 0; }
cudaError_t cudaStreamGetCaptureInfo(void *s, int *st, unsigned long long *id, void **g, const void **deps, const void **edges, size_t *n) {
  int on = s && s == cap_stream;
  if (st) *st = on;
  if (id) *id = on ? cap_id : 0;
  if (g) *g = 0;
  if (deps) *deps = 0;
  if (edges) *edges = 0;
  if (n) *n = 0;
  return 0;
}
cudaError_t cudaGraphInstantiateWithFlags(void **e, void *g, unsigned long long f) { *e = (void *)(next_handle += 16); return 0; }
cudaError_t cudaGraphLaunch(void *e, void *s) { return 0; }
cudaError_t cudaGraphDestroy(void *g) { return 0; }
cudaError_t cudaGraphExecDestroy(void *e) { return 0; }
cudaError_t cudaGraphGetNodes(void *g, void **nodes, size_t *n) { *n = 0; return 0; }
cudaError_t cudaGraphNodeGetDependencies(void *node, void **deps, void *edges, size_t *n) { *n = 0; return 0; }
cudaError_t cudaGraphDebugDotPrint(void *g, const char *p, unsigned f) { return 0; }
cudaError_t cudaFuncGetAttributes(void *attr, const void *f) { char *a = attr; memset(a, 0, 64); *(int *)(a + 24) = 1024; *(int *)(a + 28) = 32; *(int *)(a + 32) = 90; *(int *)(a + 36) = 90; return 0; }
cudaError_t cudaFuncSetAttribute(const void *f, int attr, int v) { return 0; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, const void *f, int bs, size_t sm, unsigned fl) { *n = 4; return 0; }
cudaError_t cudaEventElapsedTime(float *ms, void *a, void *b) { *ms = 1.0f; return 0; }
cudaError_t cudaMallocAsync(void **p, size_t n, void *s) { return cudaMalloc(p, n); }
cudaError_t cudaFreeAsync(void *p, void *s) { return cudaFree(p); }
cudaError_t cudaDeviceGetDefaultMemPool(void **pool, int d) { *pool = (void *)0x5000; return 0; }
cudaError_t cudaMemPoolSetAttribute(void *pool, int attr, void *v) { return 0; }
cudaError_t cudaMemPoolGetAttribute(void *pool, int attr, void *v) { memset(v, 0, 8); return 0; }
cudaError_t cudaMemPoolTrimTo(void *pool, size_t keep) { return 0; }
cudaError_t cudaMemPoolSetAccess(void *pool, const void *d, size_t n) { return 0; }
cudaError_t cudaPointerGetAttributes(void *attr, const void *p) { int *a = attr; a[0] = 2; a[1] = 0; ((const void **)attr)[1] = p; ((const void **)attr)[2] = 0; return 0; }
cudaError_t cudaStreamAddCallback(void *s, void (*cb)(void *, cudaError_t, void *), void *u, unsigned f) { cb(s, 0, u); return 0; }
cudaError_t cudaMemcpyPeerAsync(void *d, int dd, const void *s, int sd, size_t n, void *st) { return 0; }
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned f) { return 0; }
cudaError_t cudaDeviceGetPCIBusId(char *id, int len, int d) { strncpy(id, "0000:00:00.0", len); return 0; }
