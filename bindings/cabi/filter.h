/* torch's stream filter, a libstdc++ std::function<bool(cudaStream_t)>, as
 * the C side holds it once torch_glue.c moved it out of torch's hands: its
 * layout, and the two things done with it, calling and deleting. Both the
 * torch glue (which moves it) and the fork checks of exports.c (which delete
 * it in a forked child) use it; Go calls it through graphs.go. */
#ifndef GMP_FILTER_H
#define GMP_FILTER_H

#include <stdint.h>

/* libstdc++'s std::function<bool(cudaStream_t)>: _Any_data (16 bytes), the
 * manager, the invoker. It is not trivially copyable, so a by-value argument
 * is passed as a pointer to the caller's temporary, which the caller
 * destroys after the call (Itanium C++ ABI). */
typedef struct gmp_std_function {
  void* functor[2];
  int (*manager)(void* dest, const void* source, int op);
  /* bool(const _Any_data&, CUstream_st*&&): the argument by reference. */
  _Bool (*invoker)(const void* functor, void** stream);
} gmp_std_function;

/* 1 when filter (a heap gmp_std_function, or NULL) accepts stream; an
 * exception (or an empty filter) is 0: nothing may unwind into Go. */
int gmp_filter_accepts(void* filter, uintptr_t stream);

/* Destroys the functor of filter and frees it (NULL: nothing). */
void gmp_filter_delete(void* filter);

#endif
