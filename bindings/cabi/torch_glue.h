// The C++ side of the entry points torch's CUDAPluggableAllocator needs C++
// for (generated per slot in zz_torch.cpp, which includes this): torch's
// types, and the helpers the generated wrappers call. The code is in
// torch_glue.cpp; the Go functions it calls are exported by cabi.
#ifndef GMP_TORCH_GLUE_H
#define GMP_TORCH_GLUE_H

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

struct CUstream_st;  // cudaStream_t is CUstream_st*, opaque here

// torch's c10::MempoolId_t, and the stream filter of beginAllocateToPool.
using gmp_mempool_id = std::pair<unsigned long long, unsigned long long>;
using gmp_stream_filter = std::function<bool(CUstream_st*)>;

// Exported by Go (cabi.go, graphs.go).
extern "C" std::uintptr_t gmp_slot_alloc_ex(int slot, std::size_t size, int device, std::uintptr_t stream, char* buf,
                                            std::size_t n, int* oom);
extern "C" void gmp_graph_begin(int slot, int device, std::uint64_t id0, std::uint64_t id1, void* filter);
extern "C" void gmp_graph_end(int slot, int device, std::uint64_t id0, std::uint64_t id1);
extern "C" void gmp_graph_release(int slot, int device, std::uint64_t id0, std::uint64_t id1);

namespace gmp {

// Allocates through slot; a failure (size > 0) is thrown as a
// std::runtime_error (torch turns it into a Python RuntimeError).
void* alloc_or_throw(int slot, std::size_t size, int device, void* stream);

// Hands torch's filter to Go (a heap copy Go owns from then on) with the
// beginning of an allocation to pool id.
void begin_allocate_to_pool(int slot, int device, gmp_mempool_id id, gmp_stream_filter&& filter);

}  // namespace gmp

#endif
