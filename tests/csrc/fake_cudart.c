/* Preloaded (LD_PRELOAD) into a CPU-only torch process so that torch's
 * pluggable-allocator path runs without a GPU: torch asks the CUDA runtime
 * for the current device and the device count before it calls the
 * allocator, and these answers (one device, device 0) are all it needs
 * when the allocator itself is a gpumempool sim pool. */
int cudaGetDevice(int *device) { *device = 0; return 0; }
int cudaGetDeviceCount(int *count) { *count = 1; return 0; }
int cudaSetDevice(int device) { (void)device; return 0; }
