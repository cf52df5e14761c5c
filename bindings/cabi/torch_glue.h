/* The C side of the entry points torch's CUDAPluggableAllocator calls with
 * C++ types (generated per slot in zz_slots.c, which includes this), and the
 * helpers they call. The code is in torch_glue.c; the Go functions it calls
 * are exported by cabi.
 *
 * No C++ compiler or C++ standard library is needed to build it: the C++
 * values torch hands over are used through the Itanium C++ ABI, which x86-64
 * and aarch64 Linux share, and through libstdc++'s ABI, which torch is built
 * with (torch_glue.c says which parts and why they are stable). Whatever
 * C++ runtime the process runs (the one torch loaded) is looked up at run
 * time, so the extension itself needs no libstdc++ and stays within the
 * manylinux policies. */
#ifndef GMP_TORCH_GLUE_H
#define GMP_TORCH_GLUE_H

#include <stddef.h>
#include <stdint.h>

#include "exports.h"
#include "filter.h"

/* torch's c10::MempoolId_t, std::pair<unsigned long long, unsigned long long>.
 * The pair's copy and move constructors are trivial and its destructor too,
 * so by value it is passed exactly like this struct (two integer registers
 * on x86-64 and aarch64). */
typedef struct gmp_mempool_id {
  unsigned long long first;
  unsigned long long second;
} gmp_mempool_id;

/* Allocates through slot; a failure (size > 0) is thrown as a C++
 * std::runtime_error (torch turns it into a Python RuntimeError). Where no
 * C++ runtime is in the process to throw with, it returns NULL. */
void* gmp_alloc_or_throw(int slot, size_t size, int device, void* stream);

/* Moves torch's filter into a heap copy Go owns from then on, and begins
 * the allocation to pool id. A filter without libstdc++'s layout is not
 * touched: the refusal is the pool's last error and is thrown as a
 * std::runtime_error (where a C++ runtime is loaded). */
void gmp_begin_allocate_to_pool(int slot, int device, gmp_mempool_id id, gmp_std_function* filter);

/* The four entry points of slot i, with the types torch casts their
 * addresses to: void*(size_t, int, cudaStream_t), void(int, MempoolId_t,
 * std::function<bool(cudaStream_t)>) and twice void(int, MempoolId_t). */
#define GMP_TORCH_ENTRY_POINTS(i)                                                                   \
  void* gmp_alloc_or_throw_##i(size_t size, int device, void* stream) {                            \
    return gmp_alloc_or_throw(i, size, device, stream);                                            \
  }                                                                                                \
  void gmp_begin_allocate_to_pool_##i(int device, gmp_mempool_id id, gmp_std_function* filter) {   \
    gmp_begin_allocate_to_pool(i, device, id, filter);                                             \
  }                                                                                                \
  void gmp_end_allocate_to_pool_##i(int device, gmp_mempool_id id) {                               \
    gmp_graph_end(i, device, id.first, id.second);                                                 \
  }                                                                                                \
  void gmp_release_pool_##i(int device, gmp_mempool_id id) { gmp_graph_release(i, device, id.first, id.second); }

#endif
