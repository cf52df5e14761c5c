// torch.OutOfMemoryError in full-replacement mode:
// gmp.set_torch_allocator(pool, oom_error="torch").
//
// Torch's CUDAPluggableAllocator does not check the pointer it gets, so the
// extension's alloc entry point for that mode (gmp_alloc_or_throw_<i>)
// throws std::runtime_error, which Python sees as a RuntimeError. Torch
// raises torch.OutOfMemoryError only for c10::OutOfMemoryError, and its own
// C++ fallbacks (cuDNN's smaller workspaces) catch only that type. The type
// belongs to libc10's C++ ABI, which the Go-built extension cannot link
// against, so gpumempool/torch/_oom.py compiles this file at run time
// against the headers of the torch in the process and loads it; torch's
// CUDAPluggableAllocator then calls gmp_torch_oom_alloc, which calls the
// extension's entry point and turns its out-of-memory exception (the one
// whose message starts like torch's own, "CUDA out of memory.") into
// c10::OutOfMemoryError. Other failures pass through unchanged.
#include <c10/util/Exception.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <stdexcept>

namespace {

using alloc_fn = void* (*)(std::size_t, int, void*);
using free_fn = void (*)(void*, std::size_t, int, void*);

// Set once, before torch can call either function (set_torch_allocator
// installs the shim before it hands it to torch).
std::atomic<alloc_fn> inner_alloc{nullptr};
std::atomic<free_fn> inner_free{nullptr};

constexpr char kOutOfMemory[] = "CUDA out of memory.";

}  // namespace

extern "C" {

// gmp_torch_oom_install gives the shim the extension's entry points: the
// throwing alloc of the pool's slot and its free. Returns 0, or -1 for a
// NULL pointer.
int gmp_torch_oom_install(void* alloc, void* free) {
  if (alloc == nullptr || free == nullptr) return -1;
  inner_alloc.store(reinterpret_cast<alloc_fn>(alloc));
  inner_free.store(reinterpret_cast<free_fn>(free));
  return 0;
}

// gmp_torch_oom_alloc has the signature torch's pluggable allocator calls.
void* gmp_torch_oom_alloc(std::size_t size, int device, void* stream) {
  alloc_fn fn = inner_alloc.load();
  TORCH_CHECK(fn != nullptr, "gpumempool: the torch out-of-memory shim was loaded but never installed");
  try {
    return fn(size, device, stream);
  } catch (const std::runtime_error& e) {
    if (std::strncmp(e.what(), kOutOfMemory, sizeof kOutOfMemory - 1) != 0) throw;
    C10_THROW_ERROR(OutOfMemoryError, e.what());
  }
}

// gmp_torch_oom_free forwards to the extension's free (which never throws).
void gmp_torch_oom_free(void* ptr, std::size_t size, int device, void* stream) {
  free_fn fn = inner_free.load();
  if (fn != nullptr) fn(ptr, size, device, stream);
}

}  // extern "C"
