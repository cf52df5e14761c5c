// A C++ caller of gpumempool's entry points that need C++, standing in for
// torch's CUDAPluggableAllocator in full-replacement mode:
//
//  - the throwing alloc (gmp_alloc_or_throw_<i>): called by pointer, and
//    what it throws is caught the way torch's Python bindings turn a C++
//    exception into a RuntimeError;
//  - the CUDA-graph hooks (gmp_begin_allocate_to_pool_<i>, ...): called
//    through the function pointer types torch casts their addresses to,
//    with a std::function stream filter like the one torch.cuda.graph
//    passes, whose copies are counted so a test can prove none leaks.
//
// Called from Python through ctypes; no exception leaves it.
#include <atomic>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <utility>

#include <dlfcn.h>

// Built with -DGMP_WITH_C10 against torch's headers (and -lc10), call_alloc
// also tells c10::OutOfMemoryError apart, as torch's Python bindings do
// when they raise torch.OutOfMemoryError.
#ifdef GMP_WITH_C10
#include <c10/util/Exception.h>
#endif

using alloc_fn = void* (*)(std::size_t, int, void*);

// torch: c10::MempoolId_t, cudaStream_t, and the hook types of
// CUDAPluggableAllocator's set_begin_allocate_to_pool /
// set_end_allocate_to_pool_fn / set_release_pool.
struct CUstream_st;
using mempool_id = std::pair<unsigned long long, unsigned long long>;
using begin_fn = void (*)(int, mempool_id, std::function<bool(CUstream_st*)>);
using end_fn = void (*)(int, mempool_id);

namespace {

std::atomic<long> filters_alive{0};
std::atomic<long> filter_calls{0};

// The stream filter: accepts one stream, as torch.cuda.graph's accepts the
// stream being captured. Every copy is counted.
struct StreamFilter {
  void* stream;
  bool throws;
  StreamFilter(void* s, bool t) : stream(s), throws(t) { ++filters_alive; }
  StreamFilter(const StreamFilter& o) : stream(o.stream), throws(o.throws) { ++filters_alive; }
  StreamFilter(StreamFilter&& o) noexcept : stream(o.stream), throws(o.throws) { ++filters_alive; }
  ~StreamFilter() { --filters_alive; }
  bool operator()(CUstream_st* s) const {
    ++filter_calls;
    if (throws) throw std::runtime_error("filter failed");
    return static_cast<void*>(s) == stream;
  }
};

void* lookup(const char* path, const char* sym) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path, RTLD_NOW);
  return lib == nullptr ? nullptr : dlsym(lib, sym);
}

}  // namespace

extern "C" {

// call_alloc calls sym in the library at path. Returns 0 when it returned
// (the pointer in *out), 1 when it threw a std::exception (its what() in
// msg), 2 when it threw something else, 3 (GMP_WITH_C10 only) when it threw
// a c10::OutOfMemoryError (its message in msg), -1 when the symbol was not
// found.
int call_alloc(const char* path, const char* sym, std::size_t size, int device, void* stream, void** out,
               char* msg, std::size_t n) {
  auto fn = reinterpret_cast<alloc_fn>(lookup(path, sym));
  if (fn == nullptr) return -1;
  *out = nullptr;
  try {
    *out = fn(size, device, stream);
    return 0;
#ifdef GMP_WITH_C10
  } catch (const c10::OutOfMemoryError& e) {
    std::strncpy(msg, e.what_without_backtrace(), n - 1);
    msg[n - 1] = 0;
    return 3;
#endif
  } catch (const std::exception& e) {
    std::strncpy(msg, e.what(), n - 1);
    msg[n - 1] = 0;
    return 1;
  } catch (...) {
    return 2;
  }
}

// call_begin calls the begin-allocate-to-pool hook sym like torch does when
// a capture on capture_stream begins, with a filter of kind: 0 the counted
// StreamFilter (too big and not trivially copyable: std::function keeps it
// on the heap), 1 one that throws, 2 a lambda capturing the stream (small
// and trivially copyable: std::function keeps it inside itself, as it keeps
// torch's own filters), 3 an empty std::function. Returns 0, 1 when the
// hook threw, -1 when sym was not found.
int call_begin(const char* path, const char* sym, int device, unsigned long long id0, unsigned long long id1,
               void* capture_stream, int kind) {
  auto fn = reinterpret_cast<begin_fn>(lookup(path, sym));
  if (fn == nullptr) return -1;
  try {
    switch (kind) {
      case 2:
        fn(device, mempool_id{id0, id1}, [capture_stream](CUstream_st* s) {
          ++filter_calls;
          return static_cast<void*>(s) == capture_stream;
        });
        break;
      case 3:
        fn(device, mempool_id{id0, id1}, std::function<bool(CUstream_st*)>());
        break;
      default:
        fn(device, mempool_id{id0, id1}, StreamFilter(capture_stream, kind == 1));
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

// call_begin_layout calls the begin-allocate-to-pool hook sym with 32
// bytes that are no libstdc++ std::function, as a torch built with another
// C++ ABI would pass them (by the caller's temporary's address): a pointer
// to its storage: two functor words, then manager and invoker as given,
// where -1 stands for this library's data (a loaded object, but not code)
// and -2 for a real function of this library. Returns what call_alloc does
// (0 returned, 1 threw a std::exception, its what() in msg, 2 threw
// something else, -1 no such symbol).
namespace {
long some_data[4];
bool some_invoker(const void*, void**) { return true; }
}  // namespace

int call_begin_layout(const char* path, const char* sym, int device, unsigned long long id0,
                      unsigned long long id1, void* functor0, void* functor1, long manager, long invoker, char* msg,
                      std::size_t n) {
  using raw_begin_fn = void (*)(int, mempool_id, void*);
  auto fn = reinterpret_cast<raw_begin_fn>(lookup(path, sym));
  if (fn == nullptr) return -1;
  auto resolve = [](long v) -> void* {
    if (v == -1) return static_cast<void*>(some_data);
    if (v == -2) return reinterpret_cast<void*>(&some_invoker);
    return reinterpret_cast<void*>(v);
  };
  void* layout[4] = {functor0, functor1, resolve(manager), resolve(invoker)};
  msg[0] = 0;
  try {
    fn(device, mempool_id{id0, id1}, layout);
    return 0;
  } catch (const std::exception& e) {
    std::strncpy(msg, e.what(), n - 1);
    msg[n - 1] = 0;
    return 1;
  } catch (...) {
    return 2;
  }
}

// call_end calls an end-allocate-to-pool or release-pool hook.
int call_end(const char* path, const char* sym, int device, unsigned long long id0, unsigned long long id1) {
  auto fn = reinterpret_cast<end_fn>(lookup(path, sym));
  if (fn == nullptr) return -1;
  try {
    fn(device, mempool_id{id0, id1});
    return 0;
  } catch (...) {
    return 1;
  }
}

long live_filters() { return filters_alive.load(); }
long filter_call_count() { return filter_calls.load(); }

}  // extern "C"
