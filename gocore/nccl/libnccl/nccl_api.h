/* The entry points package libnccl resolves with dlsym, as function pointer
 * types. No NCCL or CUDA headers are needed to build: ncclResult_t and
 * CUresult are C enums (int), ncclComm_t and CUcontext opaque pointers.
 * tests/csrc/cuda_abi_check.cpp compiles these against the real nccl.h and
 * cuda.h to prove that the types agree. */
#ifndef GMP_NCCL_API_H
#define GMP_NCCL_API_H

#include <stddef.h>

typedef int (*gmp_nccl_version_fn)(int *);                /* ncclGetVersion */
typedef int (*gmp_nccl_alloc_fn)(void **, size_t);        /* ncclMemAlloc */
typedef int (*gmp_nccl_free_fn)(void *);                  /* ncclMemFree */
typedef const char *(*gmp_nccl_errstr_fn)(int);           /* ncclGetErrorString */
typedef const char *(*gmp_nccl_last_error_fn)(void *);    /* ncclGetLastError (NULL: not per comm) */
typedef int (*gmp_nccl_comm_register_fn)(void *, void *, size_t, void **); /* ncclCommRegister */
typedef int (*gmp_nccl_comm_deregister_fn)(void *, void *);               /* ncclCommDeregister */
typedef int (*gmp_cu_push_fn)(void *);                    /* cuCtxPushCurrent_v2 */
typedef int (*gmp_cu_pop_fn)(void **);                    /* cuCtxPopCurrent_v2 */
typedef int (*gmp_cu_exchange_capture_mode_fn)(int *);    /* cuThreadExchangeStreamCaptureMode */

#endif
