/* A stand-in for nvcc's crt/host_defines.h, which the CUDA runtime wheels'
 * headers include but do not ship: the fake runtime only needs the headers'
 * types (struct cudaDeviceProp's layout of each CUDA release), so every
 * qualifier expands to nothing or to its GCC spelling. */
#pragma once
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __cudart_builtin__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __align__(n)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a) __attribute__((a))
#define __location__(a) __annotate__(a)
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __specialization_static
#define __CUDA_ALIGN__(n) __align__(n)
#define __dv(v)
#define __noinline__ __attribute__((noinline))
#define __no_return__ __attribute__((noreturn))
#define __inline_hint__
#define __restrict__ __restrict
