/* A fake libnvidia-ml.so.1 for nvmldev's tests: one device. Built with
 * -DFAKE_NVML_OLD it lacks nvmlDeviceGetNumaNodeId, like a driver older than
 * that function: calling it through go-nvml would kill the process with
 * "symbol lookup error". FAKE_NVML_INIT=<n> makes nvmlInit return n. */
#include <stdlib.h>
#include <string.h>

typedef struct { unsigned long long total, free, used; } fake_memory;

static int init_ret(void) { const char* e = getenv("FAKE_NVML_INIT"); return e ? atoi(e) : 0; }
int nvmlInit_v2(void) { return init_ret(); }
int nvmlInit(void) { return init_ret(); }
int nvmlShutdown(void) { return 0; }
const char* nvmlErrorString(int r) { return r ? "fake error" : "Success"; }
int nvmlDeviceGetCount_v2(unsigned* n) { *n = 1; return 0; }
int nvmlDeviceGetCount(unsigned* n) { *n = 1; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** d) { (void)i; *d = (void*)0x1234; return 0; }
int nvmlDeviceGetHandleByIndex(unsigned i, void** d) { (void)i; *d = (void*)0x1234; return 0; }
int nvmlDeviceGetName(void* d, char* buf, unsigned len) { (void)d; strncpy(buf, "FakeGPU", len); return 0; }
int nvmlDeviceGetUUID(void* d, char* buf, unsigned len) { (void)d; strncpy(buf, "GPU-fake", len); return 0; }
int nvmlDeviceGetMemoryInfo(void* d, fake_memory* m) { (void)d; m->total = 100; m->free = 60; m->used = 40; return 0; }
int nvmlDeviceGetCudaComputeCapability(void* d, int* a, int* b) { (void)d; *a = 9; *b = 0; return 0; }
#ifndef FAKE_NVML_OLD
int nvmlDeviceGetNumaNodeId(void* d, unsigned* n) { (void)d; *n = 3; return 0; }
#endif
