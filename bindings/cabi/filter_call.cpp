// The package's only C++: a call of torch's stream filter that lets no
// exception through (torch_glue.c calls it; Go is above on the stack, and an
// exception must never unwind into Go). It includes nothing and uses no C++
// library: the catch needs only the C++ runtime's personality routine and
// __cxa_begin_catch / __cxa_end_catch, which torch_glue.c forwards to the
// runtime the process has loaded (torch's libstdc++).

extern "C" int gmp_filter_call(bool (*invoker)(const void*, void**), const void* functor, void* stream) {
  try {
    return invoker(functor, &stream) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}
