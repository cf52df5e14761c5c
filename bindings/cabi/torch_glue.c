/* See torch_glue.h. The C++ values torch hands over, used without a C++
 * compiler or library:
 *
 *  - throwing: gmp_alloc_or_throw throws std::runtime_error with the C++
 *    runtime's own functions (__cxa_allocate_exception, the constructor from
 *    a C string, __cxa_throw), looked up in the libstdc++ the process has
 *    loaded (torch's). Torch catches it as it catches its own. It is thrown
 *    after the Go call has returned, so it unwinds through C frames only
 *    (built with unwind tables, -fexceptions), never through Go.
 *  - torch's stream filter, a std::function<bool(cudaStream_t)>: moved the
 *    way libstdc++'s move constructor does (the 32 bytes, then the source's
 *    manager and invoker cleared), called through its invoker, destroyed
 *    through its manager, as the libstdc++ of the GCC releases torch 2.x is
 *    built with (9 and later; checked against GCC 12's <bits/std_function.h>
 *    and by tests/csrc/torch_caller.cpp, built with the system g++) lays it
 *    out: the layout is part of libstdc++'s stable ABI. A call that throws
 *    is caught in filter_call.cpp, the package's only C++, which needs no
 *    C++ library: its catch uses the runtime's functions through the
 *    forwarders below.
 *  - before any of that, the filter's layout is checked (filter_layout_error):
 *    a std::function laid out otherwise (another C++ library's, a torch built
 *    with another ABI) would have us jump to whatever its bytes say. Its
 *    manager and invoker must be both NULL (an empty function) or both code
 *    of a loaded object; anything else is refused with one error (the
 *    pool's last error, and a std::runtime_error torch raises as a
 *    RuntimeError) and nothing is called through it. Plausible is all a
 *    check can say, but the likely mismatches fail it: libc++'s
 *    std::function (32 bytes too) keeps a pointer to its own storage where
 *    libstdc++ keeps the invoker, which is data, not code.
 */
#define _GNU_SOURCE
#include "torch_glue.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The C++ runtime's symbols, looked up on first use: in libstdc++ as it is
 * loaded (torch loads it with RTLD_LOCAL, so a global lookup may miss it),
 * else wherever the process exports them. A symbol not found yet is looked
 * up again next time: libstdc++ may be loaded later. */
static void* cxx_symbol(const char* name) {
  void* lib = dlopen("libstdc++.so.6", RTLD_NOW | RTLD_NOLOAD);
  void* sym = lib != NULL ? dlsym(lib, name) : NULL;
  if (lib != NULL) dlclose(lib); /* only drops the reference NOLOAD took */
  return sym != NULL ? sym : dlsym(RTLD_DEFAULT, name);
}

#define CXX_SYMBOL(type, var, name)                                          \
  static type var;                                                           \
  type var##_fn = __atomic_load_n(&var, __ATOMIC_ACQUIRE);                   \
  if (var##_fn == NULL) {                                                    \
    var##_fn = (type)cxx_symbol(name);                                       \
    if (var##_fn != NULL) __atomic_store_n(&var, var##_fn, __ATOMIC_RELEASE); \
  }

typedef void* (*allocate_exception_t)(size_t);
typedef void (*runtime_error_ctor_t)(void* self, const char* what);
typedef void (*destructor_t)(void* self);
typedef void (*throw_t)(void* exception, void* type_info, destructor_t destroy);

/* sizeof(std::runtime_error) is 16 (a vtable pointer and a string); more is
 * harmless. */
#define RUNTIME_ERROR_SPACE 64

/* Throws std::runtime_error(what); returns only when the runtime lacks one
 * of the functions. */
static void throw_runtime_error(const char* what) {
  CXX_SYMBOL(allocate_exception_t, allocate, "__cxa_allocate_exception")
  CXX_SYMBOL(runtime_error_ctor_t, ctor, "_ZNSt13runtime_errorC1EPKc")
  CXX_SYMBOL(destructor_t, dtor, "_ZNSt13runtime_errorD1Ev")
  CXX_SYMBOL(void*, type_info, "_ZTISt13runtime_error")
  CXX_SYMBOL(throw_t, throw_, "__cxa_throw")
  if (!allocate_fn || !ctor_fn || !dtor_fn || !type_info_fn || !throw__fn) return;
  void* exc = allocate_fn(RUNTIME_ERROR_SPACE);
  ctor_fn(exc, what);
  throw__fn(exc, type_info_fn, dtor_fn);
}

/* Bytes the way torch's OOM message writes them ("64.00 MiB"). */
static void format_size(char* out, size_t n, size_t size) {
  static const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)size;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(out, n, "%zu bytes", size);
  else
    snprintf(out, n, "%.2f %s", v, units[u]);
}

/* The failure of this very call (also kept as the pool's last_error()) is
 * the exception's message. Out of memory starts like torch's own ("CUDA out
 * of memory. Tried to allocate ..."), which is what tools that shrink the
 * batch on OOM look for in a RuntimeError (torch's OutOfMemoryError type
 * lives in libc10). */
void* gmp_alloc_or_throw(int slot, size_t size, int device, void* stream) {
  char why[1024];
  why[0] = 0;
  int oom = 0;
  uintptr_t p = gmp_slot_alloc_ex(slot, size, device, (uintptr_t)stream, why, sizeof why, &oom);
  if (p != 0 || size == 0) return (void*)p;
  if (why[0] == 0) snprintf(why, sizeof why, "unknown error");
  char msg[1200];
  if (oom) {
    char bytes[64];
    format_size(bytes, sizeof bytes, size);
    snprintf(msg, sizeof msg, "CUDA out of memory. Tried to allocate %s on device %d. gpumempool: %s", bytes,
             device, why);
  } else {
    snprintf(msg, sizeof msg, "gpumempool: cannot allocate %zu bytes on device %d: %s", size, device, why);
  }
  throw_runtime_error(msg);
  return NULL; /* no C++ runtime in the process: the caller is not torch */
}

/* dl_iterate_phdr's callback: sets *found when the object has an
 * executable PT_LOAD segment holding the address. */
struct code_search {
  uintptr_t addr;
  int found;
};

static int in_executable_segment(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  struct code_search* s = data;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr)* ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X)) continue;
    uintptr_t start = info->dlpi_addr + ph->p_vaddr;
    if (s->addr >= start && s->addr - start < ph->p_memsz) {
      s->found = 1;
      return 1; /* stops the iteration */
    }
  }
  return 0;
}

/* 1 when p is code of a loaded object: dladdr knows the object, and the
 * address lies in one of its executable segments (dladdr alone also
 * accepts an object's data). */
static int is_loaded_code(const void* p) {
  Dl_info info;
  if (p == NULL || dladdr(p, &info) == 0 || info.dli_fname == NULL) return 0;
  struct code_search s = {(uintptr_t)p, 0};
  dl_iterate_phdr(in_executable_segment, &s);
  return s.found;
}

/* 0 when filter has libstdc++'s std::function layout as far as can be
 * told (see the top of this file); else 1, with the reason in why. */
static int filter_layout_error(const gmp_std_function* filter, char* why, size_t n) {
  if (filter == NULL) {
    snprintf(why, n, "no std::function was passed (NULL)");
    return 1;
  }
  void* manager = (void*)filter->manager;
  void* invoker = (void*)filter->invoker;
  if (manager == NULL && invoker == NULL) return 0; /* empty: nothing is called */
  if (manager == NULL || invoker == NULL) {
    snprintf(why, n, "manager %p and invoker %p: one is NULL, the other not (never so in libstdc++)", manager,
             invoker);
    return 1;
  }
  const char* bad = !is_loaded_code(manager) ? "manager" : !is_loaded_code(invoker) ? "invoker" : NULL;
  if (bad == NULL) return 0;
  snprintf(why, n, "its %s (%p) is not code of any loaded library (manager %p, invoker %p)", bad,
           bad[0] == 'm' ? manager : invoker, manager, invoker);
  return 1;
}

void gmp_begin_allocate_to_pool(int slot, int device, gmp_mempool_id id, gmp_std_function* filter) {
  char why[256];
  if (filter_layout_error(filter, why, sizeof why)) {
    char msg[600], thrown[640];
    snprintf(msg, sizeof msg,
             "refused the allocation to pool (%llu, %llu) on device %d: torch's stream filter "
             "(std::function<bool(cudaStream_t)>) does not have the libstdc++ layout the glue was built for: %s. "
             "Nothing was called through it; this torch's C++ ABI is not supported",
             id.first, id.second, device, why);
    gmp_graph_refuse(slot, msg); /* the pool's last error */
    snprintf(thrown, sizeof thrown, "gpumempool: gmp_begin_allocate_to_pool: %s", msg);
    throw_runtime_error(thrown); /* torch: a RuntimeError where the capture (or use_mem_pool) begins */
    return;                      /* no C++ runtime to throw with: the caller is not torch */
  }
  gmp_std_function* copy = malloc(sizeof *copy);
  if (copy != NULL) {
    memcpy(copy, filter, sizeof *copy);
    if (filter->manager != NULL) { /* the source is left empty, as std::move leaves it */
      filter->manager = NULL;
      filter->invoker = NULL;
    }
  }
  /* Without memory for the copy the capture begins with a filter that
   * accepts nothing (gmp_filter_accepts of NULL). */
  gmp_graph_begin(slot, device, id.first, id.second, copy);
}

/* The C++ runtime functions filter_call.cpp's catch needs, forwarded to the
 * process's runtime (hidden: they stand in for it inside this library only,
 * so the library links and loads without a C++ library). */
typedef int (*personality_t)(int version, int actions, uint64_t exception_class, void* exception, void* context);
typedef void* (*begin_catch_t)(void* exception);
typedef void (*end_catch_t)(void);

#define HIDDEN __attribute__((visibility("hidden")))

/* _URC_FATAL_PHASE1_ERROR: the unwinder gives up (std::terminate). No C++
 * runtime means no C++ exception could have been thrown. */
#define URC_FATAL_PHASE1_ERROR 3

HIDDEN int __gxx_personality_v0(int version, int actions, uint64_t exception_class, void* exception,
                                void* context) {
  CXX_SYMBOL(personality_t, personality, "__gxx_personality_v0")
  if (personality_fn == NULL || personality_fn == __gxx_personality_v0) return URC_FATAL_PHASE1_ERROR;
  return personality_fn(version, actions, exception_class, exception, context);
}

HIDDEN void* __cxa_begin_catch(void* exception) {
  CXX_SYMBOL(begin_catch_t, begin_catch, "__cxa_begin_catch")
  if (begin_catch_fn == NULL || begin_catch_fn == __cxa_begin_catch) abort();
  return begin_catch_fn(exception);
}

HIDDEN void __cxa_end_catch(void) {
  CXX_SYMBOL(end_catch_t, end_catch, "__cxa_end_catch")
  if (end_catch_fn == NULL || end_catch_fn == __cxa_end_catch) abort();
  end_catch_fn();
}
