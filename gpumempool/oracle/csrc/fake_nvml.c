/* A fake libnvidia-ml.so.1 for torch on the fake CUDA stack: torch 2.15's
 * expandable segments and its out-of-memory messages call NVML through
 * pointers that are NULL without it (and segfault). As many devices as the
 * fake driver (FAKE_CUDA_DEVICES), none with NVLink, peers or fabric, and no
 * processes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3 };

static unsigned count(void) {
    const char *s = getenv("FAKE_CUDA_DEVICES");
    long n = s && *s ? strtol(s, NULL, 10) : 2;
    return n < 0 ? 0 : n > 16 ? 16 : (unsigned)n;
}
/* A device handle is its index plus one. */
static long index_of(void *d) { return (long)(size_t)d - 1; }

EXPORT int nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT int nvmlInit(void) { return NVML_SUCCESS; }
EXPORT int nvmlShutdown(void) { return NVML_SUCCESS; }
EXPORT const char *nvmlErrorString(int r) { return r ? "Not Supported (gpumempool's fake NVML)" : "Success"; }
EXPORT int nvmlSystemGetCudaDriverVersion_v2(int *v) {
    *v = 13000;
    return NVML_SUCCESS;
}
EXPORT int nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }
EXPORT int nvmlDeviceGetCount_v2(unsigned *n) {
    *n = count();
    return NVML_SUCCESS;
}
EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **d) {
    if (i >= count()) return NVML_ERROR_INVALID_ARGUMENT;
    *d = (void *)(size_t)(i + 1);
    return NVML_SUCCESS;
}
/* The fake runtime names device d's bus "0000:<d+1>:00.0". */
EXPORT int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **d) {
    unsigned dom = 0, b = 0;
    if (!bus || sscanf(bus, "%x:%x", &dom, &b) != 2 || b == 0) return NVML_ERROR_INVALID_ARGUMENT;
    return nvmlDeviceGetHandleByIndex_v2(b - 1, d);
}
EXPORT int nvmlDeviceGetUUID(void *d, char *buf, unsigned len) {
    snprintf(buf, len, "GPU-fa4ec0da-0000-4000-8000-%012ld", index_of(d));
    return NVML_SUCCESS;
}
EXPORT int nvmlDeviceGetHandleByUUID(const char *uuid, void **d) {
    const char *tail = uuid ? strrchr(uuid, '-') : NULL;
    if (!tail) return NVML_ERROR_INVALID_ARGUMENT;
    return nvmlDeviceGetHandleByIndex_v2((unsigned)strtoul(tail + 1, NULL, 10), d);
}
/* What gpumempool's own device listing asks (gocore/nvmldev): the name and
 * compute capability the fake runtime reports, FAKE_CUDA_CAPACITY bytes,
 * all free (this library does not see the fake driver's allocations). */
EXPORT int nvmlDeviceGetCount(unsigned *n) { return nvmlDeviceGetCount_v2(n); }
EXPORT int nvmlDeviceGetName(void *d, char *buf, unsigned len) {
    snprintf(buf, len, "gpumempool fake GPU %ld", index_of(d));
    return NVML_SUCCESS;
}
EXPORT int nvmlDeviceGetCudaComputeCapability(void *d, int *major, int *minor) {
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}
typedef struct { unsigned long long total, free, used; } memory_info;
EXPORT int nvmlDeviceGetMemoryInfo(void *d, memory_info *m) {
    const char *s = getenv("FAKE_CUDA_CAPACITY");
    m->total = s && *s ? strtoull(s, NULL, 10) : 1ull << 30;
    m->free = m->total;
    m->used = 0;
    return NVML_SUCCESS;
}
EXPORT int nvmlDeviceGetComputeRunningProcesses(void *d, unsigned *n, void *infos) {
    *n = 0;
    return NVML_SUCCESS;
}
EXPORT int nvmlDeviceGetComputeRunningProcesses_v3(void *d, unsigned *n, void *infos) {
    return nvmlDeviceGetComputeRunningProcesses(d, n, infos);
}
EXPORT int nvmlDeviceGetP2PStatus(void *a, void *b, int index, int *status) {
    *status = 4; /* NVML_P2P_STATUS_NOT_SUPPORTED */
    return NVML_SUCCESS;
}
EXPORT int nvmlDeviceGetNvLinkRemoteDeviceType(void *d, unsigned link, int *type) { return NVML_ERROR_NOT_SUPPORTED; }
EXPORT int nvmlDeviceGetNvLinkRemotePciInfo_v2(void *d, unsigned link, void *pci) { return NVML_ERROR_NOT_SUPPORTED; }
EXPORT int nvmlDeviceGetGpuFabricInfoV(void *d, void *info) { return NVML_ERROR_NOT_SUPPORTED; }
