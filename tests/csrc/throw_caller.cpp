// A C++ caller of gpumempool's throwing alloc entry points
// (gmp_alloc_or_throw_<i>), standing in for torch's CUDAPluggableAllocator in
// full-replacement mode: it calls the function by pointer and catches what
// it throws, the way torch's Python bindings turn a C++ exception into a
// RuntimeError. Called from Python through ctypes; no exception leaves it.
#include <cstddef>
#include <cstring>
#include <exception>

#include <dlfcn.h>

using alloc_fn = void* (*)(std::size_t, int, void*);

extern "C" {

// call_alloc calls sym in the library at path. Returns 0 when it returned
// (the pointer in *out), 1 when it threw a std::exception (its what() in
// msg), 2 when it threw something else, -1 when the symbol was not found.
int call_alloc(const char* path, const char* sym, std::size_t size, int device, void* stream, void** out,
               char* msg, std::size_t n) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path, RTLD_NOW);
  if (lib == nullptr) return -1;
  auto fn = reinterpret_cast<alloc_fn>(dlsym(lib, sym));
  if (fn == nullptr) return -1;
  *out = nullptr;
  try {
    *out = fn(size, device, stream);
    return 0;
  } catch (const std::exception& e) {
    std::strncpy(msg, e.what(), n - 1);
    msg[n - 1] = 0;
    return 1;
  } catch (...) {
    return 2;
  }
}

}  // extern "C"
