/* struct cudaDeviceProp of the CUDA release whose headers this file is
 * compiled against (the runtime wheel torch was built with: 1032 bytes in
 * CUDA 12, 1008 in 13), filled as an H100-like device with the fake
 * driver's capacity. Kept apart from fake_cudart.c so that only this file
 * needs NVIDIA's headers. */
#include <cuda_runtime_api.h> /* struct cudaDeviceProp and CUDART_VERSION */
#include <stdio.h>
#include <string.h>

void gmp_fake_device_props(struct cudaDeviceProp *p, int dev, size_t total) {
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "gpumempool fake GPU %d", dev);
    for (int i = 0; i < 16; i++) p->uuid.bytes[i] = (char)(0xfa + i * 7 + dev);
    p->totalGlobalMem = total;
    p->sharedMemPerBlock = 49152;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->memPitch = 2147483647;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->totalConstMem = 65536;
    p->major = 9;
    p->minor = 0;
    p->textureAlignment = 512;
    p->multiProcessorCount = 132;
    p->integrated = 0;
    p->canMapHostMemory = 1;
    p->concurrentKernels = 1;
    p->pciBusID = dev + 1;
    p->asyncEngineCount = 2;
    p->unifiedAddressing = 1;
    p->memoryBusWidth = 5120;
    p->l2CacheSize = 50 << 20;
    p->persistingL2CacheMaxSize = 32 << 20;
    p->maxThreadsPerMultiProcessor = 2048;
    p->streamPrioritiesSupported = 1;
    p->globalL1CacheSupported = 1;
    p->localL1CacheSupported = 1;
    p->sharedMemPerMultiprocessor = 233472;
    p->regsPerMultiprocessor = 65536;
    p->managedMemory = 1;
    p->multiGpuBoardGroupID = dev;
    p->concurrentManagedAccess = 1;
    p->sharedMemPerBlockOptin = 232448;
    p->maxBlocksPerMultiProcessor = 32;
    p->reservedSharedMemPerBlock = 1024;
#if CUDART_VERSION < 13000
    p->clockRate = 1980000;
    p->memoryClockRate = 2619000;
#endif
}

size_t gmp_fake_device_props_size(void) { return sizeof(struct cudaDeviceProp); }
