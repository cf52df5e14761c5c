// See torch_glue.h. Besides the helpers of the generated entry points, the
// two functions Go uses on torch's stream filter (graphs.go): Go keeps the
// pointer of a heap copy and never touches a C++ object itself.
#include "torch_glue.h"

#include <cstdio>
#include <new>
#include <stdexcept>
#include <string>

namespace {

// Bytes the way torch's OOM message writes them ("64.00 MiB").
std::string format_size(std::size_t size) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(size);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0) return std::to_string(size) + " bytes";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace

namespace gmp {

// The failure of this very call (also kept as the pool's last_error()) is
// the exception's message. Out of memory starts like torch's own ("CUDA out
// of memory. Tried to allocate ..."), which is what tools that shrink the
// batch on OOM look for in a RuntimeError (torch's OutOfMemoryError type
// lives in libc10).
void* alloc_or_throw(int slot, std::size_t size, int device, void* stream) {
  char buf[1024];
  buf[0] = 0;
  int oom = 0;
  std::uintptr_t p =
      gmp_slot_alloc_ex(slot, size, device, reinterpret_cast<std::uintptr_t>(stream), buf, sizeof buf, &oom);
  if (p != 0 || size == 0) return reinterpret_cast<void*>(p);
  std::string why = buf[0] ? std::string(buf) : std::string("unknown error");
  if (oom) {
    throw std::runtime_error("CUDA out of memory. Tried to allocate " + format_size(size) + " on device " +
                             std::to_string(device) + ". gpumempool: " + why);
  }
  throw std::runtime_error("gpumempool: cannot allocate " + std::to_string(size) + " bytes on device " +
                           std::to_string(device) + ": " + why);
}

void begin_allocate_to_pool(int slot, int device, gmp_mempool_id id, gmp_stream_filter&& filter) {
  auto* copy = new (std::nothrow) gmp_stream_filter(std::move(filter));
  if (copy == nullptr) throw std::bad_alloc();
  gmp_graph_begin(slot, device, id.first, id.second, copy);
}

}  // namespace gmp

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
