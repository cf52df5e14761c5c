/* See filter.h. The layout is libstdc++'s (torch_glue.c says why it is
 * stable and how it is checked before anything is called through it). */
#include "filter.h"

#include <stdlib.h>

/* filter_call.cpp: the invoker's call, with any exception caught. */
extern int gmp_filter_call(_Bool (*invoker)(const void*, void**), const void* functor, void* stream);

int gmp_filter_accepts(void* filter, uintptr_t stream) {
  gmp_std_function* f = filter;
  if (f == NULL || f->manager == NULL || f->invoker == NULL) return 0;
  return gmp_filter_call(f->invoker, f->functor, (void*)stream);
}

/* libstdc++'s _Manager_operation __destroy_functor. */
#define DESTROY_FUNCTOR 3

void gmp_filter_delete(void* filter) {
  gmp_std_function* f = filter;
  if (f == NULL) return;
  if (f->manager != NULL) f->manager(f->functor, f->functor, DESTROY_FUNCTOR);
  free(f);
}
