// Torch's beginAllocateToPool hook passes a std::function<bool(cudaStream_t)>
// saying which streams allocate into the private pool (graphs.go). The
// generated wrappers (zz_torch.cpp) move it to the heap; Go keeps the
// pointer and asks it about each allocation's stream through these two
// functions, so that Go never touches a C++ object.
#include <cstdint>
#include <functional>

struct CUstream_st;  // cudaStream_t is CUstream_st*, opaque here

using gmp_stream_filter = std::function<bool(CUstream_st*)>;

// 1 when filter accepts stream; an exception (or an empty filter) is 0:
// nothing may unwind into Go.
extern "C" int gmp_filter_accepts(void* filter, std::uintptr_t stream) {
  try {
    auto* f = static_cast<gmp_stream_filter*>(filter);
    return f != nullptr && *f && (*f)(reinterpret_cast<CUstream_st*>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

extern "C" void gmp_filter_delete(void* filter) { delete static_cast<gmp_stream_filter*>(filter); }
